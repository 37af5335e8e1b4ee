#pragma once
/// @file
/// @brief cereal serialization of records, through every cereal archive.
///
/// cereal already gives the archives (binary, portable binary, JSON, XML), name-value pairs,
/// class versions and a raw-bytes path (`cereal::binary_data`). This header adds free `save` /
/// `load` functions next to the record types, so a plain `archive(record)` works, and fixes the
/// format (field names are those of the text archives; binary archives write the same fields in
/// the same order, unnamed):
///
/// | type                          | fields, in order                                              |
/// |-------------------------------|---------------------------------------------------------------|
/// | `weighted_gradients_record`   | `record`, `state`, `gradients`                                |
/// | `weighted_accumulation_state` | `record`, `dtype` (text name), `loss_scale`, `total_weight`, `microbatches`,
/// `checksum` | | `gradients_params_record`     | `record`, `tensors` (in record order: sorted by id), `checksum` | |
/// `tensor_record`               | `id`, `dtype` (text name), `shape`, `values` (row-major)      | |
/// `dynamic_loss_scale_state`    | `record`, `scale`, `growth_tracker`, `hysteresis_left`, `checksum` |
///
/// - Every type carries `record_format_version` as its cereal class version; only that version
///   loads.
/// - `record` is the tag that names the record's type: in text archives its name
///   ("weighted_gradients_record", "gradients_params_record", "weighted_accumulation_state",
///   "dynamic_loss_scale_state"), in binary archives 8 bytes ("gradaccW", "gradaccG",
///   "gradaccS", "gradaccL"). A loader given another record type refuses it naming both, and a
///   binary checkpoint's first bytes (cereal's class version, then the tag; in a portable binary
///   archive after its byte-order byte) tell which archive wrote it.
/// - `checksum` is the XXH3-64 of the content before it, over a canonical byte stream that does
///   not depend on the archive: for a state its dtype name, the bits of `loss_scale` and
///   `total_weight` and `microbatches`; for gradients each tensor's id, dtype name, rank,
///   dimensions, value count and values (16-bit values as their bit patterns), integers and
///   values little-endian and text as its length and bytes. Binary archives hash a gradients
///   record as two blocks instead (see below). Loading recomputes it and refuses a mismatch
///   with `errc::invalid_record`, so a changed bit that still parses (a value, an id, a weight)
///   is caught.
/// - Ids are at most `max_id_length` bytes. Text archives cannot hold an id with a NUL byte
///   (cereal's JSON and XML archives cut strings there): saving one to them throws.
/// - Dtypes are written as their text names ("F32"); 16-bit values as their bit patterns.
/// - Binary archives write a gradients record as its tensor count, one directory block (per
///   tensor its id, dtype code, shape and where its values are), the directory's checksum and
///   then every value as one block (see "The values block of a binary gradients record"
///   below), whose checksum is the record's `checksum`: an accumulator's buffer is written as
///   it is and read back with one read. Strings and lists elsewhere are a size followed by one
///   raw block, never element by element.
/// - Text archives write a gradients record as a list of `tensor_record` nodes (one node per
///   tensor, which a text reader parses anyway). They write shapes as arrays of numbers and values as one
///   string of numbers separated by spaces, each the shortest text that reads back to the same
///   value (`std::to_chars`, about 10 bytes per F32): exact for every finite value, ±inf and
///   NaN; a NaN keeps its sign, and its payload survives binary archives only.
///
/// Loading treats the bytes as untrusted. Every problem found by these functions throws
/// `gradaccum::error` naming it: `errc::invalid_state` for the accumulation state's fields and
/// their agreement with the tensors, `errc::invalid_record` for everything else (format versions,
/// tensors, structure, truncation outside the state). The object being loaded is replaced only on
/// success, and loaded records are `validate`d (so a weighted record's tensors are in its state's
/// work dtype). Memory grows only as bytes arrive: counts are checked against shapes before
/// anything is allocated, and raw blocks are read in chunks that grow geometrically with what
/// has been read — or at once when the archive knows how many bytes remain and they suffice
/// (the archives of `<gradaccum/checkpoint.hpp>` do).
///
/// cereal's XML output archive formats every value through a stream that swallows
/// `std::bad_alloc`, and its JSON archive terminates when a save throws midway; the checkpoint
/// functions of `<gradaccum/checkpoint.hpp>` write with the library's own archives instead
/// (`detail/text_archives.hpp`). A plain `archive(record)` into cereal's text archives keeps
/// those faults; the checksum then refuses at load what a swallowed failure wrote wrong.
///
/// Some failures happen inside cereal before these functions run, so a plain `archive(record)`
/// of untrusted bytes also needs what `parse_checkpoint` and `load_checkpoint` add: they turn
/// the `cereal::Exception` of a JSON or XML document that does not parse, or of an input too
/// short for the outermost record's version, into `gradaccum::error`; they bound the nesting
/// depth of JSON and XML documents, which cereal's parsers recurse on; and they refuse an XML
/// document without a record, which cereal's XML archive (1.3) dereferences a null node for.

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

#include "gradaccum/detail/checksum.hpp"
#include "gradaccum/detail/tensor_sink.hpp"
#include "gradaccum/detail/text_guards.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace cereal {
class XMLInputArchive;  // only compared against: its integer parsing needs a stricter path
}  // namespace cereal

namespace gradaccum {

// ---- The records' cereal functions (found by cereal through argument-dependent lookup) ------

template <class Archive>
void save(Archive& ar, const tensor_record& tensor, std::uint32_t version);
template <class Archive>
void load(Archive& ar, tensor_record& tensor, std::uint32_t version);

/// @throws error(errc::invalid_record) for a record that would not load back (see `validate`).
template <class Archive>
void save(Archive& ar, const gradients_params_record& record, std::uint32_t version);
template <class Archive>
void load(Archive& ar, gradients_params_record& record, std::uint32_t version);

/// @throws error(errc::invalid_state) for a state that would not load back (see `validate`).
template <class Archive>
void save(Archive& ar, const weighted_accumulation_state& state, std::uint32_t version);
template <class Archive>
void load(Archive& ar, weighted_accumulation_state& state, std::uint32_t version);

/// @throws error(errc::invalid_state) or error(errc::invalid_record) for a record that would not
/// load back (see `validate`).
template <class Archive>
void save(Archive& ar, const weighted_gradients_record& record, std::uint32_t version);
template <class Archive>
void load(Archive& ar, weighted_gradients_record& record, std::uint32_t version);

/// The loss scaler's state, exactly (a double's bits survive every archive), and its checksum.
/// @throws error(errc::invalid_state) for a scale that is not a positive F32 value or a zero
/// hysteresis_left; `state` is unchanged on error. The constructor of `dynamic_loss_scale`
/// checks the rest against its options.
template <class Archive>
void save(Archive& ar, const dynamic_loss_scale_state& state, std::uint32_t version);
template <class Archive>
void load(Archive& ar, dynamic_loss_scale_state& state, std::uint32_t version);

// ---- Implementation ------------------------------------------------------------------------------

namespace detail {

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

  [[noreturn]] void fail(const std::string& problem) const {
    detail::fail(code, std::string(owner) + (id != nullptr ? " " + quote(*id) : "") + " " + problem,
                 id != nullptr ? *id : std::string());
  }
};

/// Runs `read`, turning what cereal (or, for XML numbers, `std::sto*`) throws for malformed
/// input into `error(site.code)` naming the field. Errors of this library pass through.
template <class Archive, class F>
void read_field(const load_site& site, std::string_view field, std::string_view expected, F&& read) {
  const auto fail_field = [&](const char* cause) {
    site.fail("has a field '" + std::string(field) + "' that " +
              (is_text_archive<Archive> ? "is missing or not " + std::string(expected)
                                        : std::string("is cut off: the input is truncated")) +
              " (" + cause + ").");
  };
  try {
    std::forward<F>(read)();
  } catch (const cereal::Exception& e) {
    fail_field(e.what());
  } catch (const std::logic_error& e) {
    fail_field(e.what());
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
    site.fail("declares " + std::to_string(count) + " elements of " + std::to_string(sizeof(T)) + " bytes in field '" +
              std::string(field) + "', more than " +
              (remaining ? "the " + std::to_string(*remaining) + " bytes left hold: the input is truncated or corrupt."
                         : std::string("memory can address.")));
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
    site.fail("has " + std::string(field != nullptr ? "a field '" + std::string(field) + "'" : "an element") + " of " +
              std::to_string(value) + ", more than the largest allowed " + std::to_string(max) + ".");
  }
  return value;
}

template <class Archive>
void check_checksum(Archive& ar, const load_site& site, std::uint64_t computed) {
  const std::uint64_t stored = load_unsigned(ar, site, "checksum", std::numeric_limits<std::uint64_t>::max());
  if (stored != computed) {
    site.fail("has checksum " + std::to_string(stored) + " but its content hashes to " + std::to_string(computed) +
              ": the checkpoint is corrupt.");
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
    if (count == out.size()) site.fail("holds more values than the " + std::to_string(out.size()) + " of its shape.");
    const auto [next, problem] = std::from_chars(at, end, out[count]);
    if (problem != std::errc{} || (next != end && !is_value_separator(*next))) {
      const std::string_view token(at, static_cast<std::size_t>(std::find_if(at, end, is_value_separator) - at));
      site.fail("holds the value " + quote(token) + ", which is not " + std::string(value_kind<T>()) + ".");
    }
    at = next;
    ++count;
  }
  if (count != out.size()) {
    site.fail("holds " + std::to_string(count) + " values for the " + std::to_string(out.size()) +
              " elements of its shape.");
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
        site.fail("declares a field '" + std::string(field) + "' of " + std::to_string(length) +
                  " bytes, more than the " + std::to_string(max_length) + " allowed.");
      }
      load_raw(ar, text, length, site, field);
    }
  });
  if (text.size() > max_length) {
    site.fail("has a field '" + std::string(field) + "' of " + std::to_string(text.size()) + " bytes, more than the " +
              std::to_string(max_length) + " allowed.");
  }
  return text;
}

/// Longest dtype name read ("BF16" has 4 bytes); longer input is not a dtype name.
inline constexpr std::uint64_t max_dtype_name_length = 8;

template <class Archive>
float_dtype load_dtype(Archive& ar, const load_site& site) {
  const std::string name = load_string(ar, site, "dtype", max_dtype_name_length);
  const std::optional<float_dtype> dtype = parse_float_dtype(name);
  if (!dtype) site.fail("has unknown dtype name " + quote(name) + "; dtypes are F16, BF16, F32 and F64.");
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
    fail(errc::invalid_record, std::string(type) + " has format version " + std::to_string(version) +
                                   "; this build reads version " + std::to_string(record_format_version) + " only.");
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
  const std::string where_expected = "expected a " + std::string(expected.name) + ", but the input holds ";
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
    fail(errc::invalid_record, where_expected + "a " + std::string(other->name) + ".");
  }
  fail(errc::invalid_record, where_expected + quote(found) + " where the record's tag " +
                                 quote(text ? expected.name : expected.magic) + " belongs.");
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

// ---- The values block of a binary gradients record ---------------------------------------------
//
// Binary archives write a gradients record as: its tag; its tensor count; the size and
// bytes of its directory; the size in bytes of its values block; the directory checksum; the
// values block; and, as the record's `checksum`, the block's. Per tensor the directory holds,
// little-endian: id length (4 bytes), id, dtype (1 byte: 0 F16, 1 BF16, 2 F32, 3 F64), rank
// (1 byte), dimensions (8 bytes each) and the offset in bytes of its values in the block (8
// bytes, a multiple of its element size). Tensors' values do not overlap, and every byte of
// the block outside them is zero. The directory checksum is the XXH3-64 of the count, the
// directory and the block's size (integers as 8 bytes little-endian), the block's that of its
// bytes with values little-endian. A writer lays the block out as it likes: an accumulator
// writes its buffer as it is, so a load into the same layout is one read straight into the
// buffer, and a record its tensors in record order. The directory is checked whole before
// anything is placed by it.

/// Fewest and most bytes a tensor's directory entry takes before its offset: an empty id and
/// rank 0; the longest id and rank `max_rank`.
inline constexpr std::uint64_t min_directory_entry_bytes = 4 + 1 + 1;
inline constexpr std::uint64_t max_directory_entry_bytes = 4 + max_id_length + 1 + 1 + 8 * max_rank;
inline constexpr std::uint64_t block_offset_bytes = 8;

/// The checksum that guards a binary directory and what it is read with.
inline std::uint64_t directory_checksum(std::uint64_t count, std::string_view directory,
                                        std::uint64_t block_bytes) noexcept {
  content_hash hash;
  hash.add(count);
  hash.add_bytes(directory.data(), directory.size());
  hash.add(block_bytes);
  return hash.digest();
}

constexpr std::uint8_t dtype_code(float_dtype dtype) noexcept {
  switch (dtype) {
    case float_dtype::f16: return 0;
    case float_dtype::bf16: return 1;
    case float_dtype::f32: return 2;
    case float_dtype::f64: break;
  }
  return 3;
}

constexpr std::optional<float_dtype> dtype_of_code(std::uint8_t code) noexcept {
  constexpr std::array<float_dtype, 4> dtypes{float_dtype::f16, float_dtype::bf16, float_dtype::f32, float_dtype::f64};
  if (code >= dtypes.size()) return std::nullopt;
  return dtypes[code];
}

/// The directory of `tensors` (records or views; their ids already checked), whose values are
/// at `offsets` in the values block.
template <class Tensors>
std::string binary_directory(const Tensors& tensors, std::span<const std::uint64_t> offsets) {
  std::size_t bytes = 0;
  for (const auto& tensor : tensors) {
    bytes += min_directory_entry_bytes + block_offset_bytes + tensor.id.size() + 8 * tensor.shape.size();
  }
  std::string directory(bytes, '\0');
  auto* const start = reinterpret_cast<unsigned char*>(directory.data());
  little_endian_writer out(start);
  std::size_t i = 0;
  for (const auto& tensor : tensors) {
    out.u32(static_cast<std::uint32_t>(tensor.id.size()));
    out.bytes(tensor.id);
    out.u8(dtype_code(tensor.dtype));
    out.u8(static_cast<std::uint8_t>(tensor.shape.size()));
    for (const std::uint64_t dim : tensor.shape) out.u64(dim);
    out.u64(offsets[i++]);
  }
  return directory;
}

/// Reads a directory entry by entry; every read is checked against the bytes left.
class directory_reader {
 public:
  directory_reader(std::string_view directory, const load_site& site) noexcept : rest_(directory), site_(site) {}

  [[nodiscard]] bool at_end() const noexcept { return rest_.empty(); }

  std::string_view id() {
    const auto length = little_endian<std::uint32_t>();
    if (length > max_id_length) {
      site_.fail("has a tensor id of " + std::to_string(length) + " bytes, more than the " +
                 std::to_string(max_id_length) + " allowed.");
    }
    return take(length);
  }
  float_dtype dtype() {
    const auto code = little_endian<std::uint8_t>();
    const std::optional<float_dtype> dtype = dtype_of_code(code);
    if (!dtype) site_.fail("has unknown dtype code " + std::to_string(code) + "; codes are 0 to 3.");
    return *dtype;
  }
  template <class U>
  U little_endian() {
    const std::string_view bytes = take(sizeof(U));
    if constexpr (std::endian::native == std::endian::little) {
      U value = 0;
      std::memcpy(&value, bytes.data(), sizeof(U));
      return value;
    } else {
      std::uint64_t value = 0;
      for (std::size_t i = 0; i < sizeof(U); ++i) {
        value |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
      }
      return static_cast<U>(value);
    }
  }

 private:
  std::string_view take(std::size_t count) {
    if (count > rest_.size())
      site_.fail("has a directory that ends inside a tensor's entry: it is truncated or corrupt.");
    const std::string_view taken = rest_.substr(0, count);
    rest_.remove_prefix(count);
    return taken;
  }

  std::string_view rest_;
  const load_site& site_;
};

/// Writes pieces of values as raw blocks, joining pieces that follow each other in memory (as
/// the segments of a window's buffer do) into one block of at most `saved_block_bytes`.
template <class Archive>
class values_writer {
 public:
  explicit values_writer(Archive& ar) noexcept : ar_(ar) {}
  values_writer(const values_writer&) = delete;
  values_writer& operator=(const values_writer&) = delete;
  ~values_writer() = default;

  template <class S>
  void add(std::span<const S> piece) {
    auto* open = std::get_if<std::span<const S>>(&pending_);
    if (open != nullptr && open->data() + open->size() == piece.data()) {
      *open = std::span<const S>(open->data(), open->size() + piece.size());
    } else {
      flush();
      pending_ = piece;
    }
    if (std::visit([](auto values) { return values.size_bytes(); }, pending_) >= saved_block_bytes) flush();
  }

  void flush() {
    std::visit(
        [&](auto values) {
          if (!values.empty()) ar_(cereal::binary_data(values.data(), values.size_bytes()));
        },
        pending_);
    pending_ = std::span<const float>();
  }

 private:
  Archive& ar_;
  values_view pending_;
};

// ---- Saving ------------------------------------------------------------------------------------

/// Refuses an id that would not load back: too long, or with a NUL byte in a text archive.
template <class Archive>
void check_saved_id(std::string_view id) {
  if (id.size() > max_id_length) {
    fail(errc::invalid_record,
         "tensor id " + quote(id) + " has " + std::to_string(id.size()) + " bytes, more than the " +
             std::to_string(max_id_length) + " allowed.",
         std::string(id.substr(0, 64)));
  }
  if (is_text_archive<Archive> && id.find('\0') != std::string_view::npos) {
    fail(errc::invalid_record,
         "tensor id " + quote(id) +
             " holds a NUL byte, which JSON and XML archives cannot hold; save it in a "
             "binary format.",
         std::string(id));
  }
}

/// Writes values as one raw block (in pieces, each hashed first when a checksum is being
/// taken). Hashing on a worker thread instead bought nothing measurable on a 64 MiB save.
template <class Archive, class T>
void save_raw_values(Archive& ar, std::span<const T> values, content_hash* hash) {
  constexpr std::size_t block = saved_block_bytes / sizeof(T);
  for (std::size_t done = 0; done < values.size(); done += block) {
    const std::span<const T> piece = values.subspan(done, std::min(block, values.size() - done));
    if (hash != nullptr) hash->add_values(piece);
    ar(cereal::binary_data(piece.data(), piece.size_bytes()));
  }
}

template <class Archive>
void save_tensor(Archive& ar, const tensor_view& tensor) {
  check_saved_id<Archive>(tensor.id);
  content_hash* const hash = active_hash;
  save_string(ar, "id", tensor.id);
  save_string(ar, "dtype", to_string(tensor.dtype));
  ar(cereal::make_nvp("shape", archive_node{[&](auto& node) { save_elements(node, tensor.shape); }}));
  std::visit(
      [&](const auto values) {
        if (hash != nullptr) hash_tensor_header(*hash, tensor.id, tensor.dtype, tensor.shape, values.size());
        if constexpr (is_text_archive<Archive>) {
          if (hash != nullptr) hash->add_text_values(values);
          ar(cereal::make_nvp("values", values_text(values)));
        } else {
          ar(cereal::make_size_tag(static_cast<cereal::size_type>(values.size())));
          save_raw_values(ar, values, hash);
        }
      },
      tensor.values);
}

inline const tensor_view& view_of(const tensor_view& tensor) noexcept {
  return tensor;
}

/// Where each of `tensors` (records or views) goes in the values block, in bytes, and the
/// block's size: where they are in `block` when they are its segments, else one after the
/// other in record order, each aligned to its element size.
template <class Tensors>
std::uint64_t block_layout(const Tensors& tensors, const values_view& block, std::vector<std::uint64_t>& offsets) {
  const auto* const base =
      std::visit([](auto values) { return reinterpret_cast<const unsigned char*>(values.data()); }, block);
  const std::uint64_t block_bytes = std::visit([](auto values) { return values.size_bytes(); }, block);
  offsets.reserve(tensors.size());
  std::uint64_t end = 0;
  for (const auto& record_or_view : tensors) {
    std::visit(
        [&](const auto values) {
          using S = typename decltype(values)::element_type;
          if (block_bytes != 0) {
            offsets.push_back(static_cast<std::uint64_t>(reinterpret_cast<const unsigned char*>(values.data()) - base));
          } else {
            end = (end + sizeof(S) - 1) / sizeof(S) * sizeof(S);
            offsets.push_back(end);
            end += values.size_bytes();
          }
        },
        view_of(record_or_view).values);
  }
  return block_bytes != 0 ? block_bytes : end;
}

/// The count, directory, block size, directory checksum and values block of a binary
/// gradients record (see above); `hash` takes the block.
template <class Archive, class Tensors>
void save_binary_tensors(Archive& ar, const Tensors& tensors, const values_view& block, content_hash& hash) {
  for (const auto& tensor : tensors) check_saved_id<Archive>(tensor.id);
  std::vector<std::uint64_t> offsets;
  const std::uint64_t block_bytes = block_layout(tensors, block, offsets);
  const std::string directory = binary_directory(tensors, offsets);
  ar(cereal::make_size_tag(static_cast<cereal::size_type>(tensors.size())));
  ar(cereal::make_size_tag(static_cast<cereal::size_type>(directory.size())));
  if (!directory.empty()) ar(cereal::binary_data(directory.data(), directory.size()));
  ar(block_bytes, directory_checksum(tensors.size(), directory, block_bytes));
  if (std::visit([](auto values) { return !values.empty(); }, block)) {
    std::visit([&](auto values) { save_raw_values(ar, values, &hash); }, block);
    return;
  }
  values_writer<Archive> values_out(ar);
  std::uint64_t end = 0;
  std::size_t i = 0;
  for (const auto& record_or_view : tensors) {
    std::visit(
        [&](const auto values) {
          using S = typename decltype(values)::element_type;
          if (offsets[i] != end) {  // alignment to the element size: fewer than 8 zero bytes
            constexpr std::array<unsigned char, 8> zeros{};
            values_out.flush();
            hash.add_bytes(zeros.data(), offsets[i] - end);
            ar(cereal::binary_data(zeros.data(), offsets[i] - end));
          }
          constexpr std::size_t piece_size = saved_block_bytes / sizeof(S);
          for (std::size_t done = 0; done < values.size(); done += piece_size) {
            const std::span<const S> piece = values.subspan(done, std::min(piece_size, values.size() - done));
            hash.add_values(piece);
            values_out.add(piece);
          }
          end = offsets[i++] + values.size_bytes();
        },
        view_of(record_or_view).values);
  }
  values_out.flush();
}

/// `tensors` (records or views) as the list of a gradients record, then the checksum of what
/// they hold: in a text archive each tensor through cereal, in a binary archive the directory
/// and values block (see above), `block` the buffer views lie in, if any.
template <class Archive, class Tensors>
void save_checksummed_tensors(Archive& ar, const Tensors& tensors, const values_view& block = {}) {
  save_tag(ar, gradients_tag);
  content_hash hash;
  ar(cereal::make_nvp("tensors", archive_node{[&](auto& node) {
                        if constexpr (is_text_archive<Archive>) {
                          const hash_scope scope(&hash);
                          node(cereal::make_size_tag(static_cast<cereal::size_type>(tensors.size())));
                          for (const auto& tensor : tensors) node(tensor);
                        } else {
                          save_binary_tensors(node, tensors, block, hash);
                        }
                      }}));
  ar(cereal::make_nvp("checksum", hash.digest()));
}

template <class Archive>
void save(Archive& ar, const tensor_view& tensor, const std::uint32_t /*version*/) {
  save_tensor(ar, tensor);
}

template <class Archive>
void save(Archive& ar, const gradients_view& gradients, const std::uint32_t /*version*/) {
  save_checksummed_tensors(ar, gradients.tensors, gradients.block);
}

template <class Archive>
void save(Archive& ar, const weighted_gradients_view& record, const std::uint32_t /*version*/) {
  save_tag(ar, window_tag);
  ar(cereal::make_nvp("state", record.state), cereal::make_nvp("gradients", record.gradients));
}

// ---- Loading into a sink -----------------------------------------------------------------------
//
// The loaders below read a record's fields in order and hand what they read to a sink, so the
// same code fills a record (`record_sink`) or restores an accumulator's tensors straight from
// the input (the accumulators' `restorer`). A sink has
//   state(const weighted_accumulation_state&)    the window's state, before any tensor;
//   reserve(std::size_t)                         a count of tensors the input can hold;
//   add(std::string&& id, float_dtype, const tensor_shape&, const values_reader<A>&)
//                                                one tensor, whose values it reads with the
//                                                reader; it may move from `id` once they are in;
// and, for binary gradients records, in place of `add`:
//   place(std::string_view id, float_dtype, const tensor_shape&)
//                                                one tensor of the directory, in its order;
//   values(const values_block<A>&)               all their values, once the directory is read.

/// @brief The values of one tensor, not read yet: `count` of them, the shape's element count.
template <class Archive>
class values_reader final : public values_source {
 public:
  values_reader(Archive& ar, std::uint64_t count, const load_site& site, std::string_view text,
                content_hash* hash) noexcept
      : ar_(ar), count_(count), site_(site), text_(text), hash_(hash) {}

  void into(std::span<float> out) const override { read(out); }
  void into(std::span<double> out) const override { read(out); }

  /// Reads the values into `out` (exactly `count` elements, e.g. a tensor's storage).
  template <raw_element S>
  void read(std::span<S> out) const {
    if constexpr (is_text_archive<Archive>) {
      parse_values_text(text_, out, site_);
      if (hash_ != nullptr) hash_->add_text_values(std::span<const S>(out));
    } else {
      // Each piece is hashed while it is still in cache; a worker thread hashing behind the
      // reads was measured no faster on a 64 MiB load.
      constexpr std::size_t block = loaded_block_bytes / sizeof(S);
      for (std::size_t done = 0; done < out.size(); done += block) {
        const std::span<S> piece = out.subspan(done, std::min(block, out.size() - done));
        ar_(cereal::binary_data(piece.data(), piece.size_bytes()));
        if (hash_ != nullptr) hash_->add_values(std::span<const S>(piece));
      }
    }
  }

  /// Reads the values into a new vector, grown only as bytes arrive (see `load_raw`).
  template <raw_element S>
  void into(std::vector<S>& out) const {
    if constexpr (is_text_archive<Archive>) {
      std::vector<S> loaded(static_cast<std::size_t>(count_));
      read(std::span<S>(loaded));
      out = std::move(loaded);
    } else {
      load_raw(ar_, out, count_, site_, "values", hash_);
    }
  }

 private:
  Archive& ar_;
  std::uint64_t count_;
  const load_site& site_;
  std::string_view text_;  // text archives: the values' text, already read
  content_hash* hash_;     // the gradients record's checksum being computed, if any
};

/// Reads one tensor's id, dtype and shape, then has `sink.add` take it and read its values.
template <class Archive, class Sink>
void load_tensor(Archive& ar, Sink& sink) {
  content_hash* const hash = active_hash;
  std::string id = load_string(ar, {errc::invalid_record, "a record tensor"}, "id", max_id_length);
  const load_site site{errc::invalid_record, "record tensor", &id};
  const float_dtype dtype = load_dtype(ar, site);

  std::array<std::uint64_t, max_rank> dims{};
  std::size_t rank = 0;
  read_field<Archive>(site, "shape", "a list of dimensions", [&] {
    ar(cereal::make_nvp("shape", archive_node{[&](auto& node) {
                          cereal::size_type declared = 0;
                          node(cereal::make_size_tag(declared));
                          if (declared > max_rank) {
                            site.fail("has rank " + std::to_string(declared) + ", more than the supported " +
                                      std::to_string(max_rank) + ".");
                          }
                          rank = static_cast<std::size_t>(declared);
                          if constexpr (is_text_archive<Archive>) {
                            for (std::size_t axis = 0; axis < rank; ++axis) {
                              dims[axis] =
                                  load_unsigned(node, site, nullptr, std::numeric_limits<std::uint64_t>::max());
                            }
                          } else if (rank != 0) {
                            node(cereal::binary_data(dims.data(), rank * sizeof(std::uint64_t)));
                          }
                        }}));
  });
  const tensor_shape shape(std::span<const std::uint64_t>(dims.data(), rank));
  const std::optional<std::size_t> elements = shape.checked_element_count();
  if (!elements) site.fail("has shape " + shape.to_string() + ", whose element count overflows.");
  if (hash != nullptr) hash_tensor_header(*hash, id, dtype, std::span(dims.data(), rank), *elements);

  read_field<Archive>(site, "values", is_text_archive<Archive> ? "a string of numbers" : "", [&] {
    if constexpr (is_text_archive<Archive>) {
      std::string text;
      ar(cereal::make_nvp("values", text));
      // Every value takes a character and all but the last a separator: a bound on the count
      // before anything is allocated for it.
      if (*elements > (text.size() + 1) / 2) {
        site.fail("has " + std::to_string(text.size()) + " characters of values, too few for the " +
                  std::to_string(*elements) + " elements of shape " + shape.to_string() + ".");
      }
      sink.add(std::move(id), dtype, shape, values_reader<Archive>(ar, *elements, site, text, hash));
    } else {
      cereal::size_type count = 0;
      ar(cereal::make_size_tag(count));
      if (count != *elements) {
        site.fail("declares " + std::to_string(count) + " values for shape " + shape.to_string() + " of " +
                  std::to_string(*elements) + " elements.");
      }
      visit_stored_type(dtype, [&]<class S>() { check_block_fits<S>(ar, count, site, "values"); });
      sink.add(std::move(id), dtype, shape, values_reader<Archive>(ar, count, site, {}, hash));
    }
  });
}

/// The directory of `count` tensors whose entries take `min_entry` to `max_entry` bytes each,
/// its size checked against both before anything is allocated or read.
template <class Archive>
std::string load_directory(Archive& ar, std::uint64_t count, std::uint64_t min_entry, std::uint64_t max_entry,
                           const load_site& site) {
  cereal::size_type directory_bytes = 0;
  ar(cereal::make_size_tag(directory_bytes));
  // Bounded by what `count` entries can take, before the bytes left are even asked (a sparse
  // file "holds" whatever it claims).
  if (directory_bytes != 0 && (directory_bytes - 1) / max_entry >= count) {
    site.fail("has a directory of " + std::to_string(directory_bytes) + " bytes, more than the entries of its " +
              std::to_string(count) + " tensors take.");
  }
  std::string directory;
  load_raw(ar, directory, directory_bytes, site, "directory");
  if (count > directory.size() / min_entry) {
    site.fail("declares " + std::to_string(count) + " tensors, more than its directory of " +
              std::to_string(directory.size()) + " bytes holds.");
  }
  return directory;
}

/// Whether `size` bytes from `bytes` are all zero.
inline bool all_zero(const unsigned char* bytes, std::size_t size) noexcept {
  return size == 0 || (bytes[0] == 0 && std::memcmp(bytes, bytes + 1, size - 1) == 0);
}

/// @brief The values block of a binary gradients record, not read yet; its entries
/// (in directory order) lie inside it. The block is read once, either whole or entry by entry.
template <class Archive>
class values_block final : public values_block_source {
 public:
  values_block(Archive& ar, std::uint64_t bytes, std::span<const block_entry> entries, const load_site& site,
               content_hash& hash) noexcept
      : ar_(ar), bytes_(bytes), entries_(entries), site_(site), hash_(hash) {}

  [[nodiscard]] std::uint64_t bytes() const noexcept override { return bytes_; }
  [[nodiscard]] std::span<const block_entry> entries() const noexcept override { return entries_; }

  /// Reads the whole block into `out`, exactly `bytes()` of its type. The caller checks that
  /// what lies outside the entries is zero.
  void into(std::span<float> out) const override {
    values_reader<Archive>(ar_, out.size(), site_, {}, &hash_).read(out);
  }
  void into(std::span<double> out) const override {
    values_reader<Archive>(ar_, out.size(), site_, {}, &hash_).read(out);
  }

  /// Reads the block front to back: `read(i, reader)` reads the values of entry `i` with a
  /// `values_reader`; bytes outside every entry must be zero.
  template <class F>
  void each_entry(F&& read) const {
    // Zero-element entries first where an offset is shared, so they never overlap a neighbour.
    const auto before = [&](std::size_t a, std::size_t b) {
      const block_entry& x = entries_[a];
      const block_entry& y = entries_[b];
      return x.offset != y.offset ? x.offset < y.offset : x.count < y.count;
    };
    std::vector<std::size_t> order(entries_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    if (!std::is_sorted(order.begin(), order.end(), before)) std::sort(order.begin(), order.end(), before);
    std::uint64_t at = 0;
    for (const std::size_t i : order) {
      const block_entry& entry = entries_[i];
      if (entry.offset < at) site_.fail("has tensors whose values overlap in its values block: it is corrupt.");
      zeros(entry.offset - at);
      read(i, values_reader<Archive>(ar_, entry.count, site_, {}, &hash_));
      at = entry.offset + entry.count * size_of(entry.dtype);
    }
    zeros(bytes_ - at);
  }

  /// Fails unless `size` bytes read from the block at `bytes` are zero.
  void check_zero(const unsigned char* bytes, std::size_t size) const override {
    if (!all_zero(bytes, size)) site_.fail("has bytes outside its tensors' values that are not zero: it is corrupt.");
  }

 private:
  void each_tensor(const tensor_visitor& read) const override {
    each_entry([&](std::size_t i, const values_source& values) { read(i, values); });
  }

  void zeros(std::uint64_t count) const {
    std::array<unsigned char, 4096> piece{};
    while (count != 0) {
      const auto size = static_cast<std::size_t>(std::min<std::uint64_t>(count, piece.size()));
      read_field<Archive>(site_, "values", "", [&] { ar_(cereal::binary_data(piece.data(), size)); });
      hash_.add_bytes(piece.data(), size);
      check_zero(piece.data(), size);
      count -= size;
    }
  }

  Archive& ar_;
  std::uint64_t bytes_;
  std::span<const block_entry> entries_;
  const load_site& site_;
  content_hash& hash_;
};

/// Reads the directory of a binary gradients record (see "The values block"
/// above), has `sink` place each tensor, then hands it the values block. Every length is
/// checked against what can hold it, and the directory against its checksum, before it is
/// used; `hash` takes the block.
template <class Archive, class Sink>
void load_block_tensors(Archive& ar, Sink& sink, std::uint64_t count, const load_site& site, content_hash& hash) {
  constexpr std::uint64_t min_entry = min_directory_entry_bytes + block_offset_bytes;
  constexpr std::uint64_t max_entry = max_directory_entry_bytes + block_offset_bytes;
  std::string directory = load_directory(ar, count, min_entry, max_entry, site);
  const std::uint64_t block_bytes =
      load_unsigned(ar, site, "values block size", std::numeric_limits<std::uint64_t>::max());
  check_block_fits<char>(ar, block_bytes, site, "values");
  const std::uint64_t stored = load_unsigned(ar, site, "directory checksum", std::numeric_limits<std::uint64_t>::max());
  if (stored != directory_checksum(count, directory, block_bytes)) {
    site.fail("has a directory with checksum " + std::to_string(stored) + " but its content hashes to " +
              std::to_string(directory_checksum(count, directory, block_bytes)) + ": the checkpoint is corrupt.");
  }
  sink.reserve(static_cast<std::size_t>(count));
  std::vector<block_entry> entries;
  entries.reserve(static_cast<std::size_t>(count));
  directory_reader reader(directory, site);
  std::string id;  // for messages
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::string_view entry_id = reader.id();
    const float_dtype dtype = reader.dtype();
    const auto rank = reader.little_endian<std::uint8_t>();
    const auto tensor_site = [&] {
      id.assign(entry_id);
      return load_site{errc::invalid_record, "record tensor", &id};
    };
    if (rank > max_rank) {
      tensor_site().fail("has rank " + std::to_string(rank) + ", more than the supported " + std::to_string(max_rank) +
                         ".");
    }
    std::array<std::uint64_t, max_rank> dims{};
    for (std::size_t axis = 0; axis < rank; ++axis) dims[axis] = reader.little_endian<std::uint64_t>();
    const tensor_shape shape(std::span<const std::uint64_t>(dims.data(), rank));
    const std::optional<std::size_t> elements = shape.checked_element_count();
    if (!elements) tensor_site().fail("has shape " + shape.to_string() + ", whose element count overflows.");
    const auto offset = reader.little_endian<std::uint64_t>();
    const std::size_t size = size_of(dtype);
    if (offset % size != 0 || offset > block_bytes || *elements > (block_bytes - offset) / size) {
      tensor_site().fail("declares " + std::to_string(*elements) + " elements of " + std::to_string(size) +
                         " bytes at offset " + std::to_string(offset) + ", which do not fit aligned in the " +
                         std::to_string(block_bytes) + " bytes of its values block.");
    }
    sink.place(entry_id, dtype, shape);
    entries.push_back({offset, *elements, dtype});
  }
  if (!reader.at_end()) site.fail("has a directory with bytes after its last tensor: it is corrupt.");
  sink.values(values_block<Archive>(ar, block_bytes, entries, site, hash));
}

/// @brief A sink that fills a record.
struct record_sink {
  weighted_gradients_record record;

  void state(const weighted_accumulation_state& state) noexcept { record.state = state; }
  void reserve(std::size_t count) { record.gradients.tensors.reserve(count); }
  template <class Values>
  void add(std::string&& id, float_dtype dtype, const tensor_shape& shape, const Values& values) {
    tensor_record tensor{{}, dtype, std::vector<std::uint64_t>(shape.begin(), shape.end()), {}};
    visit_stored_type(dtype, [&]<class S>() { values.into(tensor.values.template emplace<std::vector<S>>()); });
    tensor.id = std::move(id);
    record.gradients.tensors.push_back(std::move(tensor));
  }
  void place(std::string_view id, float_dtype dtype, const tensor_shape& shape) {
    record.gradients.tensors.push_back(
        {std::string(id), dtype, std::vector<std::uint64_t>(shape.begin(), shape.end()), std::vector<float>()});
  }
  template <class Archive>
  void values(const values_block<Archive>& block) {
    block.each_entry([&](std::size_t i, const values_reader<Archive>& values) {
      tensor_record& tensor = record.gradients.tensors[i];
      visit_stored_type(tensor.dtype,
                        [&]<class S>() { values.into(tensor.values.template emplace<std::vector<S>>()); });
    });
  }
};

/// Loads one tensor of a list into `sink` through cereal, which reads the tensor type's version
/// the first time in an archive. A record's tensors load as `tensor_record`, the type they were
/// saved as, so cereal's bookkeeping of which versions it has read matches the saving side's
/// even in an archive holding several records.
template <class Archive, class Sink>
void load_listed_tensor(Archive& ar, Sink& sink);
template <class Archive>
void load_listed_tensor(Archive& ar, record_sink& sink);

/// Loads the "gradients" of a weighted record into `sink` (as `gradients_params_record` for
/// records, for the reason above).
template <class Archive, class Sink>
void load_gradients_field(Archive& ar, Sink& sink);
template <class Archive>
void load_gradients_field(Archive& ar, record_sink& sink);

template <class Sink>
struct tensor_into {
  Sink* sink;
};
template <class Sink>
struct gradients_into {
  Sink* sink;
};
template <class Sink>
struct weighted_into {
  Sink* sink;
};

template <class Archive, class Sink>
void load(Archive& ar, tensor_into<Sink>& into, const std::uint32_t version) {
  check_format_version(version, "a tensor record");
  load_tensor(ar, *into.sink);
}

template <class Archive, class Sink>
void load(Archive& ar, gradients_into<Sink>& into, const std::uint32_t version) {
  check_format_version(version, "a gradients record");
  check_tag(ar, gradients_tag);
  const load_site site{errc::invalid_record, "gradients record"};
  content_hash hash;
  const hash_scope scope(&hash);
  read_field<Archive>(site, "tensors", "a list of tensors", [&] {
    ar(cereal::make_nvp("tensors", archive_node{[&](auto& node) {
                          cereal::size_type count = 0;
                          node(cereal::make_size_tag(count));
                          if constexpr (is_text_archive<Archive>) {
                            // The count is the length of an array the archive has parsed.
                            into.sink->reserve(static_cast<std::size_t>(count));
                            for (cereal::size_type i = 0; i < count; ++i) load_listed_tensor(node, *into.sink);
                          } else {
                            load_block_tensors(node, *into.sink, count, site, hash);
                          }
                        }}));
  });
  check_checksum(ar, site, hash.digest());
}

template <class Archive, class Sink>
void load(Archive& ar, weighted_into<Sink>& into, const std::uint32_t version) {
  check_format_version(version, "a weighted gradients record");
  check_tag(ar, window_tag);
  weighted_accumulation_state state;
  // The state comes first, so a reader learns the work dtype before any tensor.
  read_field<Archive>({errc::invalid_state, "weighted gradients record"}, "state", "an accumulation state",
                      [&] { ar(cereal::make_nvp("state", state)); });
  into.sink->state(state);
  read_field<Archive>({errc::invalid_record, "weighted gradients record"}, "gradients", "a gradients record",
                      [&] { load_gradients_field(ar, *into.sink); });
}

template <class Archive, class Sink>
void load_listed_tensor(Archive& ar, Sink& sink) {
  tensor_into<Sink> tensor{&sink};
  ar(tensor);
}

template <class Archive, class Sink>
void load_gradients_field(Archive& ar, Sink& sink) {
  gradients_into<Sink> gradients{&sink};
  ar(cereal::make_nvp("gradients", gradients));
}

template <class Archive>
void load_listed_tensor(Archive& ar, record_sink& sink) {
  tensor_record tensor;
  ar(tensor);
  sink.record.gradients.tensors.push_back(std::move(tensor));
}

template <class Archive>
void load_gradients_field(Archive& ar, record_sink& sink) {
  ar(cereal::make_nvp("gradients", sink.record.gradients));
}

}  // namespace detail

template <class Archive>
void save(Archive& ar, const tensor_record& tensor, const std::uint32_t /*version*/) {
  detail::save_tensor(ar, detail::view_of(tensor));
}

template <class Archive>
void load(Archive& ar, tensor_record& tensor, const std::uint32_t version) {
  detail::record_sink sink;
  detail::tensor_into<detail::record_sink> into{&sink};
  detail::load(ar, into, version);
  tensor = std::move(sink.record.gradients.tensors.front());
}

template <class Archive>
void save(Archive& ar, const gradients_params_record& record, const std::uint32_t /*version*/) {
  validate(record);
  detail::save_checksummed_tensors(ar, record.tensors);
}

template <class Archive>
void load(Archive& ar, gradients_params_record& record, const std::uint32_t version) {
  detail::record_sink sink;
  detail::gradients_into<detail::record_sink> into{&sink};
  detail::load(ar, into, version);
  validate(sink.record.gradients);
  record = std::move(sink.record.gradients);
}

template <class Archive>
void save(Archive& ar, const weighted_accumulation_state& state, const std::uint32_t /*version*/) {
  validate(state);
  detail::save_tag(ar, detail::state_tag);
  detail::save_string(ar, "dtype", to_string(state.dtype));
  ar(cereal::make_nvp("loss_scale", state.loss_scale), cereal::make_nvp("total_weight", state.total_weight),
     cereal::make_nvp("microbatches", state.microbatches), cereal::make_nvp("checksum", detail::state_checksum(state)));
}

template <class Archive>
void load(Archive& ar, weighted_accumulation_state& state, const std::uint32_t version) {
  detail::check_format_version(version, "an accumulation state");
  detail::check_tag(ar, detail::state_tag);
  const detail::load_site site{errc::invalid_state, "accumulation state"};
  weighted_accumulation_state loaded;
  loaded.dtype = detail::load_dtype(ar, site);
  loaded.loss_scale = detail::load_real(ar, site, "loss_scale");
  loaded.total_weight = detail::load_real(ar, site, "total_weight");
  loaded.microbatches = detail::load_unsigned(ar, site, "microbatches", std::numeric_limits<std::uint64_t>::max());
  // The checksum first: a corrupt state is reported as corrupt, not as an implausible value.
  detail::check_checksum(ar, {errc::invalid_record, "accumulation state"}, detail::state_checksum(loaded));
  validate(loaded);
  state = loaded;
}

template <class Archive>
void save(Archive& ar, const dynamic_loss_scale_state& state, const std::uint32_t /*version*/) {
  detail::save_tag(ar, detail::loss_scale_tag);
  ar(cereal::make_nvp("scale", state.scale), cereal::make_nvp("growth_tracker", state.growth_tracker),
     cereal::make_nvp("hysteresis_left", state.hysteresis_left),
     cereal::make_nvp("checksum", detail::loss_scale_checksum(state)));
}

template <class Archive>
void load(Archive& ar, dynamic_loss_scale_state& state, const std::uint32_t version) {
  detail::check_format_version(version, "a loss scale state");
  detail::check_tag(ar, detail::loss_scale_tag);
  const detail::load_site site{errc::invalid_state, "loss scale state"};
  dynamic_loss_scale_state loaded;
  loaded.scale = detail::load_real(ar, site, "scale");
  loaded.growth_tracker = detail::load_unsigned(ar, site, "growth_tracker", std::numeric_limits<std::uint64_t>::max());
  loaded.hysteresis_left =
      detail::load_unsigned(ar, site, "hysteresis_left", std::numeric_limits<std::uint64_t>::max());
  detail::check_checksum(ar, {errc::invalid_record, "loss scale state"}, detail::loss_scale_checksum(loaded));
  if (!detail::valid_f32_scale(loaded.scale))
    site.fail("has scale " + detail::number_text(loaded.scale) + ", not a positive F32 value.");
  if (loaded.hysteresis_left == 0) site.fail("has hysteresis_left 0; at least 1 is needed.");
  state = loaded;
}

template <class Archive>
void save(Archive& ar, const weighted_gradients_record& record, const std::uint32_t /*version*/) {
  validate(record);
  detail::save_tag(ar, detail::window_tag);
  ar(cereal::make_nvp("state", record.state), cereal::make_nvp("gradients", record.gradients));
}

template <class Archive>
void load(Archive& ar, weighted_gradients_record& record, const std::uint32_t version) {
  detail::record_sink sink;
  detail::weighted_into<detail::record_sink> into{&sink};
  detail::load(ar, into, version);
  validate(sink.record);
  record = std::move(sink.record);
}

}  // namespace gradaccum

CEREAL_CLASS_VERSION(gradaccum::tensor_record, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::gradients_params_record, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::weighted_accumulation_state, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::weighted_gradients_record, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::dynamic_loss_scale_state, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::detail::tensor_view, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::detail::gradients_view, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::detail::weighted_gradients_view, gradaccum::record_format_version)
