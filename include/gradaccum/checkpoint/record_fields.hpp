#pragma once
/// @file
/// @brief The fields records are made of, as `<gradaccum/cereal.hpp>` reads and writes them in
/// any cereal archive: sized inputs, error sites, nodes, numbers, value text, strings, record
/// tags and checksums.

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <limits>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <variant>
#include <vector>

#include <cereal/cereal.hpp>

#include "gradaccum/checkpoint/checksum.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace cereal {
class XMLInputArchive;  // only compared against: its integer parsing needs a stricter path
}  // namespace cereal

namespace gradaccum::detail {

/// `text` as a T when it is exactly a decimal number of T (`std::from_chars`: no sign for
/// unsigned types, no leading '+', whitespace, hex prefix or trailing bytes).
template <class T>
std::optional<T> parse_number(std::string_view text) noexcept {
  T value{};
  const auto [end, problem] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (problem != std::errc{} || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// ---- Inputs that know how many bytes they still hold ------------------------------------------

/// @brief A stream buffer that can tell how many bytes remain to be read.
class sized_streambuf : public std::streambuf {
 public:
  [[nodiscard]] virtual std::uint64_t remaining() const noexcept = 0;
  /// Up to `count` of the next bytes (fewer only at the end of the input), not consumed.
  virtual std::string_view peek(std::size_t count) = 0;
};

struct istream_holder {
  explicit istream_holder(std::streambuf& buffer) : stream(&buffer) {}
  std::istream stream;
};

/// @brief A cereal input archive over a `sized_streambuf`. Loaders that find one reject a length
/// the remaining input cannot hold before allocating, and allocate a block that fits at once.
template <class Archive>
class sized_input_archive final : private istream_holder, public Archive {
 public:
  template <class... Options>
  explicit sized_input_archive(sized_streambuf& source, Options&&... options)
      : istream_holder(source), Archive(istream_holder::stream, std::forward<Options>(options)...), source_(source) {}

  [[nodiscard]] std::uint64_t remaining() const noexcept { return source_.remaining(); }

 private:
  const sized_streambuf& source_;
};

/// Bytes left in `ar`'s input, when it knows (cereal hands loaders the base archive type).
/// Comparing type_info objects is a pointer comparison for the same type, where dynamic_cast
/// compares type names (it ran several times per tensor of a checkpoint).
template <class Archive>
std::optional<std::uint64_t> remaining_input(const Archive& ar) noexcept {
  if (typeid(ar) != typeid(sized_input_archive<Archive>)) return std::nullopt;
  return static_cast<const sized_input_archive<Archive>&>(ar).remaining();
}

template <class Archive>
inline constexpr bool is_text_archive = cereal::traits::is_text_archive<Archive>::value;

// ---- Messages ------------------------------------------------------------------------------------

/// What is being loaded, for messages: the error code its problems get, what it is ("record
/// tensor") and, once read, its id. Messages are composed only on failure.
struct load_site {
  errc code;
  std::string_view owner;
  const std::string* id = nullptr;

  /// Throws `error(code)`: the owner, its quoted id when known, then `problem`. Out of line and
  /// cold, so each check in a loader (instantiated per archive) compiles to a call.
  [[noreturn, gnu::cold, gnu::noinline]] void fail(std::initializer_list<message_piece> problem) const {
    std::string text(owner);
    if (id != nullptr) text += " " + quote(*id);
    text += ' ';
    for (const message_piece& piece : problem) piece.append_to(text);
    detail::fail(code, text, id != nullptr ? *id : std::string());
  }
};

/// Throws `site`'s error for a field that could not be read: in a text archive missing or not
/// what it must be (`expected`), in a binary one cut off.
[[noreturn, gnu::cold, gnu::noinline]] inline void fail_field(const load_site& site, std::string_view field, bool text,
                                                              std::string_view expected, const char* cause) {
  if (!text) site.fail({"has a field '", field, "' that is cut off: the input is truncated (", cause, ")."});
  site.fail({"has a field '", field, "' that is missing or not ", expected, " (", cause, ")."});
}

/// Runs `read`, turning what cereal (or, for XML numbers, `std::sto*`) throws for malformed
/// input into `error(site.code)` naming the field. Errors of this library pass through.
template <class Archive, class F>
void read_field(const load_site& site, std::string_view field, std::string_view expected, F&& read) {
  try {
    std::forward<F>(read)();
  } catch (const cereal::Exception& e) {
    fail_field(site, field, is_text_archive<Archive>, expected, e.what());
  } catch (const std::logic_error& e) {
    fail_field(site, field, is_text_archive<Archive>, expected, e.what());
  }
}

/// Loads or saves `value` under `name`, or unnamed (an array element) when `name` is null.
template <class Archive, class T>
void transfer(Archive& ar, const char* name, T&& value) {
  if (name != nullptr) {
    ar(cereal::make_nvp(name, std::forward<T>(value)));
  } else {
    ar(std::forward<T>(value));
  }
}

// ---- Nodes and sequences ---------------------------------------------------------------------

/// @brief A node whose contents `body(archive)` writes or reads: in text archives a named
/// object or array (cereal opens and closes it around `body`), in binary archives nothing.
template <class Body>
struct archive_node {
  Body body;
};
template <class Body>
archive_node(Body) -> archive_node<Body>;

template <class Archive, class Body>
void save(Archive& ar, const archive_node<Body>& node) {
  node.body(ar);
}
template <class Archive, class Body>
void load(Archive& ar, archive_node<Body>& node) {
  node.body(ar);
}

/// Element types of a raw block: 16-bit values as bit patterns, then F32, F64, dimensions, text.
template <class T>
concept raw_element = std::is_same_v<T, std::uint16_t> || std::is_same_v<T, float> || std::is_same_v<T, double> ||
                      std::is_same_v<T, std::uint64_t> || std::is_same_v<T, char>;

/// Saves a size and the elements: one raw block in binary archives, one number each in text
/// archives (for shapes; values are saved by `save_values`).
template <class Archive, raw_element T>
void save_elements(Archive& ar, std::span<const T> values) {
  ar(cereal::make_size_tag(static_cast<cereal::size_type>(values.size())));
  if constexpr (is_text_archive<Archive>) {
    for (const T& value : values) ar(value);
  } else {
    if (!values.empty()) ar(cereal::binary_data(values.data(), values.size() * sizeof(T)));
  }
}

/// Checks that `count` elements of T can be read: addressable, and (when the archive knows)
/// held by the bytes that remain, which it returns. Runs before anything is allocated for them.
template <class T, class Archive>
std::optional<std::uint64_t> check_block_fits(const Archive& ar, std::uint64_t count, const load_site& site,
                                              std::string_view field) {
  constexpr std::uint64_t addressable =
      static_cast<std::uint64_t>(std::numeric_limits<std::ptrdiff_t>::max()) / sizeof(T);
  const std::optional<std::uint64_t> remaining = remaining_input(ar);
  if (count > addressable || (remaining && count > *remaining / sizeof(T))) {
    if (remaining) {
      site.fail({"declares ", count, " elements of ", sizeof(T), " bytes in field '", field, "', more than the ",
                 *remaining, " bytes left hold: the input is truncated or corrupt."});
    }
    site.fail({"declares ", count, " elements of ", sizeof(T), " bytes in field '", field,
               "', more than memory can address."});
  }
  return remaining;
}

/// Reads `count` elements of a raw block into `out` (a vector or a string). With a known
/// remaining input the block is checked against it and allocated once; otherwise capacity
/// grows geometrically from 4 KiB with what has actually been read. Either way reads go in
/// chunks of at most 1 MiB, so value-initializing a chunk and filling it share the cache.
template <class Archive, class Container>
void load_raw(Archive& ar, Container& out, std::uint64_t count, const load_site& site, std::string_view field,
              content_hash* hash = nullptr) {
  using T = typename Container::value_type;
  const bool sized = check_block_fits<T>(ar, count, site, field).has_value();
  constexpr std::size_t first_capacity = 4096 / sizeof(T);
  constexpr std::size_t max_chunk = (std::size_t{1} << 20) / sizeof(T);
  const auto total = static_cast<std::size_t>(count);
  Container loaded;
  if (sized) loaded.reserve(total);
  while (loaded.size() < total) {
    const std::size_t done = loaded.size();
    if (done == loaded.capacity()) loaded.reserve(std::min(total, std::max(first_capacity, 2 * done)));
    const std::size_t chunk = std::min({loaded.capacity() - done, max_chunk, total - done});
    loaded.resize(done + chunk);
    ar(cereal::binary_data(loaded.data() + done, chunk * sizeof(T)));
    if (hash != nullptr) hash->add_values(std::span<const T>(loaded.data() + done, chunk));
  }
  out = std::move(loaded);
}

// ---- Scalars ---------------------------------------------------------------------------------

/// Loads an unsigned integer no larger than `max`.
template <class Archive>
std::uint64_t load_unsigned(Archive& ar, const load_site& site, const char* field, std::uint64_t max) {
  std::uint64_t value = 0;
  read_field<Archive>(site, field != nullptr ? field : "element", "a non-negative integer", [&] {
    if constexpr (std::is_same_v<Archive, cereal::XMLInputArchive>) {
      // cereal parses XML integers with std::stoull, which reads "-1" as 2^64 - 1.
      std::string text;
      transfer(ar, field, text);
      const std::optional<std::uint64_t> parsed = parse_number<std::uint64_t>(text);
      if (!parsed) throw std::invalid_argument(quote(text) + " is not a non-negative integer");
      value = *parsed;
    } else {
      transfer(ar, field, value);
    }
  });
  if (value > max) {
    site.fail({field != nullptr ? "has a field '" : "has an element", field != nullptr ? field : "",
               field != nullptr ? "' of " : " of ", value, ", more than the largest allowed ", max, "."});
  }
  return value;
}

template <class Archive>
void check_checksum(Archive& ar, const load_site& site, std::uint64_t computed) {
  const std::uint64_t stored = load_unsigned(ar, site, "checksum", std::numeric_limits<std::uint64_t>::max());
  if (stored != computed) {
    site.fail({"has checksum ", stored, " but its content hashes to ", computed, ": the checkpoint is corrupt."});
  }
}

template <class Archive>
double load_real(Archive& ar, const load_site& site, const char* field) {
  double value = 0.0;
  read_field<Archive>(site, field != nullptr ? field : "element", "a number", [&] {
    if constexpr (std::is_same_v<Archive, cereal::XMLInputArchive>) {
      // cereal parses XML reals with std::stod, which reads "2abc" as 2 and "0x10" as 16.
      std::string text;
      transfer(ar, field, text);
      const std::optional<double> parsed = parse_number<double>(text);
      if (!parsed) throw std::invalid_argument(quote(text) + " is not a decimal number");
      value = *parsed;
    } else {
      transfer(ar, field, value);
    }
  });
  return value;
}

// ---- Values in text archives -------------------------------------------------------------------

/// Longest text `std::to_chars` writes for a T ("-2.2250738585072014e-308" for a double).
template <raw_element T>
inline constexpr std::size_t max_value_text = std::is_same_v<T, double>  ? 24
                                              : std::is_same_v<T, float> ? 15
                                                                         : 5;

/// The values as one string of numbers separated by spaces: each the shortest text that reads
/// back to the same value (`std::to_chars`), 16-bit values as their bit patterns. A float
/// written as a double would take 17 digits, and an array one line per number.
template <raw_element T>
std::string values_text(std::span<const T> values) {
  std::string text;
  text.reserve(values.size() * (max_value_text<T> + 1));
  std::array<char, max_value_text<T>> buffer{};
  for (const T value : values) {
    if (!text.empty()) text += ' ';
    text.append(buffer.data(), std::to_chars(buffer.data(), buffer.data() + buffer.size(), value).ptr);
  }
  return text;
}

constexpr bool is_value_separator(char c) noexcept {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

/// What a value of T must be, for messages.
template <raw_element T>
constexpr std::string_view value_kind() noexcept {
  if constexpr (std::is_same_v<T, std::uint16_t>) return "a 16-bit pattern (an integer from 0 to 65535)";
  if constexpr (std::is_same_v<T, float>) return "an F32 value";
  return "an F64 value";
}

/// Reads the numbers of `text` (`values_text`; any whitespace separates) into `out`, which has
/// room for exactly as many as the tensor's shape holds. `std::from_chars` rounds once, so
/// every value comes back bit for bit (a NaN as a NaN of its sign).
template <raw_element T>
void parse_values_text(std::string_view text, std::span<T> out, const load_site& site) {
  const char* at = text.data();
  const char* const end = at + text.size();
  const auto skip_separators = [&] {
    while (at != end && is_value_separator(*at)) ++at;
  };
  std::size_t count = 0;
  for (skip_separators(); at != end; skip_separators()) {
    if (count == out.size()) site.fail({"holds more values than the ", out.size(), " of its shape."});
    const auto [next, problem] = std::from_chars(at, end, out[count]);
    if (problem != std::errc{} || (next != end && !is_value_separator(*next))) {
      const std::string_view token(at, static_cast<std::size_t>(std::find_if(at, end, is_value_separator) - at));
      site.fail({"holds the value ", quote(token), ", which is not ", value_kind<T>(), "."});
    }
    at = next;
    ++count;
  }
  if (count != out.size()) {
    site.fail({"holds ", count, " values for the ", out.size(), " elements of its shape."});
  }
}

// ---- Strings and dtype names -----------------------------------------------------------------

template <class Archive>
void save_string(Archive& ar, const char* field, std::string_view text) {
  if constexpr (is_text_archive<Archive>) {
    ar(cereal::make_nvp(field, std::string(text)));
  } else {
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(text.size())));
    if (!text.empty()) ar(cereal::binary_data(text.data(), text.size()));
  }
}

/// Loads a string of at most `max_length` bytes (cereal's own string loader would allocate
/// whatever length the input claims).
template <class Archive>
std::string load_string(Archive& ar, const load_site& site, const char* field, std::uint64_t max_length) {
  std::string text;
  read_field<Archive>(site, field, "a string", [&] {
    if constexpr (is_text_archive<Archive>) {
      ar(cereal::make_nvp(field, text));
    } else {
      cereal::size_type length = 0;
      ar(cereal::make_size_tag(length));
      if (length > max_length) {
        site.fail({"declares a field '", field, "' of ", length, " bytes, more than the ", max_length, " allowed."});
      }
      load_raw(ar, text, length, site, field);
    }
  });
  if (text.size() > max_length) {
    site.fail({"has a field '", field, "' of ", text.size(), " bytes, more than the ", max_length, " allowed."});
  }
  return text;
}

/// Longest dtype name read ("BF16" has 4 bytes); longer input is not a dtype name.
inline constexpr std::uint64_t max_dtype_name_length = 8;

template <class Archive>
float_dtype load_dtype(Archive& ar, const load_site& site) {
  const std::string name = load_string(ar, site, "dtype", max_dtype_name_length);
  const std::optional<float_dtype> dtype = parse_float_dtype(name);
  if (!dtype) site.fail({"has unknown dtype name ", quote(name), "; dtypes are F16, BF16, F32 and F64."});
  return *dtype;
}

/// Calls `f.template operator()<S>()` with S the type `record_values` stores for `dtype`.
template <class F>
decltype(auto) visit_stored_type(float_dtype dtype, F&& f) {
  switch (dtype) {
    case float_dtype::f64: return std::forward<F>(f).template operator()<double>();
    case float_dtype::f32: return std::forward<F>(f).template operator()<float>();
    case float_dtype::f16:
    case float_dtype::bf16: break;
  }
  return std::forward<F>(f).template operator()<std::uint16_t>();
}

inline void check_format_version(std::uint32_t version, std::string_view type) {
  if (version != record_format_version) {
    fail(errc::invalid_record,
         {type, " has format version ", version, "; this build reads version ", record_format_version, " only."});
  }
}

// ---- Record tags -------------------------------------------------------------------------------

/// @brief What a record starts with, after cereal's class version: in text archives a field
/// `record` holding its type's name, in binary archives 8 bytes. A reader expecting one type
/// and given another names both; a checkpoint's first bytes tell which archive wrote it.
struct record_tag {
  std::string_view name;
  std::string_view magic;
};

inline constexpr record_tag window_tag{"weighted_gradients_record", "gradaccW"};
inline constexpr record_tag gradients_tag{"gradients_params_record", "gradaccG"};
inline constexpr record_tag state_tag{"weighted_accumulation_state", "gradaccS"};
inline constexpr record_tag loss_scale_tag{"dynamic_loss_scale_state", "gradaccL"};
inline constexpr std::array<const record_tag*, 4> record_tags{&window_tag, &gradients_tag, &state_tag, &loss_scale_tag};
inline constexpr std::size_t record_magic_bytes = 8;

/// The tag whose name (text) or magic (binary) is `text`, if any.
inline const record_tag* find_tag(std::string_view text, bool magic) noexcept {
  for (const record_tag* tag : record_tags) {
    if ((magic ? tag->magic : tag->name) == text) return tag;
  }
  return nullptr;
}

template <class Archive>
void save_tag(Archive& ar, const record_tag& tag) {
  if constexpr (is_text_archive<Archive>) {
    ar(cereal::make_nvp("record", std::string(tag.name)));
  } else {
    ar(cereal::binary_data(tag.magic.data(), tag.magic.size()));
  }
}

/// Reads a record's tag and refuses any other than `expected`, naming what the input holds.
template <class Archive>
void check_tag(Archive& ar, const record_tag& expected) {
  constexpr bool text = is_text_archive<Archive>;
  std::string found;
  read_field<Archive>({errc::invalid_record, expected.name}, "record", "a string", [&] {
    if constexpr (text) {
      ar(cereal::make_nvp("record", found));
    } else {
      found.resize(record_magic_bytes);
      ar(cereal::binary_data(found.data(), found.size()));
    }
  });
  if (found == (text ? expected.name : expected.magic)) return;
  if (const record_tag* other = find_tag(found, !text)) {
    fail(errc::invalid_record, {"expected a ", expected.name, ", but the input holds a ", other->name, "."});
  }
  fail(errc::invalid_record, {"expected a ", expected.name, ", but the input holds ", quote(found),
                              " where the record's tag ", quote(text ? expected.name : expected.magic), " belongs."});
}

// ---- Checksums ---------------------------------------------------------------------------------

/// The hash of the gradients record being saved or loaded on this thread, if any. A text
/// archive's tensors reach it through cereal (which keeps its version bookkeeping), whose calls
/// carry no context of ours.
inline thread_local content_hash* active_hash = nullptr;

/// @brief Makes `hash` the `active_hash` while alive.
class hash_scope {
 public:
  explicit hash_scope(content_hash* hash) noexcept : previous_(std::exchange(active_hash, hash)) {}
  hash_scope(const hash_scope&) = delete;
  hash_scope& operator=(const hash_scope&) = delete;
  ~hash_scope() { active_hash = previous_; }

 private:
  content_hash* previous_;
};

/// What a tensor contributes to its record's checksum before its values: its id, dtype name,
/// rank, dimensions and value count (see `content_hash::add`), given to the hash as one piece
/// (the same stream, so the same digest, as adding them one by one; a tenth of the cost for the
/// many small tensors of a window).
inline void hash_tensor_header(content_hash& hash, std::string_view id, float_dtype dtype,
                               std::span<const std::uint64_t> shape, std::uint64_t count) noexcept {
  constexpr std::size_t inline_id = 256;
  if (id.size() > inline_id) {
    hash.add(id);
    hash.add(to_string(dtype));
    hash.add(static_cast<std::uint64_t>(shape.size()));
    for (const std::uint64_t dim : shape) hash.add(dim);
    hash.add(count);
    return;
  }
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): written before it is read
  std::array<unsigned char, 8 + inline_id + 8 + max_dtype_name_length + 8 + 8 * max_rank + 8> bytes;
  little_endian_writer out(bytes.data());
  out.text(id);
  out.text(to_string(dtype));
  out.u64(shape.size());
  for (const std::uint64_t dim : shape) out.u64(dim);
  out.u64(count);
  hash.add_bytes(bytes.data(), out.written(bytes.data()));
}

inline std::uint64_t state_checksum(const weighted_accumulation_state& state) noexcept {
  content_hash hash;
  hash.add(to_string(state.dtype));
  hash.add(state.loss_scale);
  hash.add(state.total_weight);
  hash.add(state.microbatches);
  return hash.digest();
}

inline std::uint64_t loss_scale_checksum(const dynamic_loss_scale_state& state) noexcept {
  content_hash hash;
  hash.add(state.scale);
  hash.add(state.growth_tracker);
  hash.add(state.hysteresis_left);
  return hash.digest();
}

/// Reads a record's checksum and compares it with what its content hashed to.
template <class Archive>
void check_checksum(Archive& ar, const load_site& site, std::uint64_t computed);

/// Values go through the hash and the archive in blocks of these many bytes, so a block is still
/// in the core's own cache when the second pass reads it. A load reads 32 KiB pieces: measured on
/// a 64 MiB load from the page cache, `read` + hash in 32 KiB pieces costs what `read` alone
/// does, while in 256 KiB pieces the hash adds about 10 % (the kernel's copy has left the piece's
/// start behind). A save hashes 256 KiB pieces and hands each straight to the file (no copy into
/// its buffer): in 32 KiB pieces, which the file buffers, a 64 MiB save took 15 % longer.
inline constexpr std::size_t loaded_block_bytes = std::size_t{1} << 15;
inline constexpr std::size_t saved_block_bytes = std::size_t{1} << 18;

}  // namespace gradaccum::detail
