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
/// | `weighted_gradients_record`   | `state`, `gradients`                                          |
/// | `weighted_accumulation_state` | `dtype` (text name), `loss_scale`, `total_weight`, `microbatches` |
/// | `gradients_params_record`     | `tensors` (in record order: sorted by id)                     |
/// | `tensor_record`               | `id`, `dtype` (text name), `shape`, `values` (row-major)      |
///
/// - Every type carries `record_format_version` as its cereal class version.
/// - Dtypes are written as their text names ("F32"); 16-bit values as their bit patterns.
/// - Binary archives write each string and each list as a size followed by one raw block
///   (`cereal::binary_data`), never element by element. Text archives write lists as arrays of
///   numbers: exact for every finite value, ±inf and NaN; a NaN's sign and payload survive
///   binary archives only.
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
/// Some failures happen inside cereal before these functions run, so a plain `archive(record)`
/// of untrusted bytes also needs what `parse_checkpoint` and `load_checkpoint` add: they turn
/// the `cereal::Exception` of a JSON or XML document that does not parse, or of an input too
/// short for the outermost record's version, into `gradaccum::error`; they bound the nesting
/// depth of JSON and XML documents, which cereal's parsers recurse on; and they refuse an XML
/// document without a record, which cereal's XML archive (1.3) dereferences a null node for.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <cereal/cereal.hpp>

#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace cereal {
class XMLInputArchive;  // only compared against: its integer parsing needs a stricter path
}  // namespace cereal

namespace gradaccum {

/// @brief Version of the record format: the cereal class version of every record type. Loading
/// rejects any other version.
inline constexpr std::uint32_t record_format_version = 1;

namespace detail {

// ---- Inputs that know how many bytes they still hold ------------------------------------------

/// @brief A stream buffer that can tell how many bytes remain to be read.
class sized_streambuf : public std::streambuf {
 public:
  [[nodiscard]] virtual std::uint64_t remaining() const noexcept = 0;
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
template <class Archive>
std::optional<std::uint64_t> remaining_input(const Archive& ar) noexcept {
  if (const auto* sized = dynamic_cast<const sized_input_archive<Archive>*>(&ar)) return sized->remaining();
  return std::nullopt;
}

template <class Archive>
inline constexpr bool is_text_archive = cereal::traits::is_text_archive<Archive>::value;

// ---- Messages ------------------------------------------------------------------------------------

/// `text` in quotes for a message: bytes outside printable ASCII escaped, long text cut short.
inline std::string quote(std::string_view text) {
  constexpr std::size_t shown = 64;
  constexpr std::string_view hex = "0123456789abcdef";
  std::string out = "'";
  for (std::size_t i = 0; i < text.size() && i < shown; ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte >= 0x20 && byte < 0x7f && byte != '\\' && byte != '\'') {
      out += static_cast<char>(byte);
    } else {
      out += "\\x";
      out += hex[byte >> 4];
      out += hex[byte & 0xf];
    }
  }
  if (text.size() > shown) out += "...";
  return out + "'";
}

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
/// archives.
template <class Archive, raw_element T>
void save_elements(Archive& ar, std::span<const T> values) {
  ar(cereal::make_size_tag(static_cast<cereal::size_type>(values.size())));
  if constexpr (is_text_archive<Archive>) {
    for (const T& value : values) ar(value);
  } else {
    ar(cereal::binary_data(values.data(), values.size() * sizeof(T)));
  }
}

/// Reads `count` elements of a raw block into `out` (a vector or a string). With a known
/// remaining input the block is checked against it and allocated once; otherwise capacity
/// grows geometrically from 4 KiB with what has actually been read. Either way reads go in
/// chunks of at most 1 MiB, so value-initializing a chunk and filling it share the cache.
template <class Archive, class Container>
void load_raw(Archive& ar, Container& out, std::uint64_t count, const load_site& site, std::string_view field) {
  using T = typename Container::value_type;
  constexpr std::uint64_t addressable =
      static_cast<std::uint64_t>(std::numeric_limits<std::ptrdiff_t>::max()) / sizeof(T);
  const std::optional<std::uint64_t> remaining = remaining_input(ar);
  if (count > addressable || (remaining && count > *remaining / sizeof(T))) {
    site.fail("declares " + std::to_string(count) + " elements of " + std::to_string(sizeof(T)) + " bytes in field '" +
              std::string(field) + "', more than " +
              (remaining ? "the " + std::to_string(*remaining) + " bytes left hold: the input is truncated or corrupt."
                         : std::string("memory can address.")));
  }
  constexpr std::size_t first_capacity = 4096 / sizeof(T);
  constexpr std::size_t max_chunk = (std::size_t{1} << 20) / sizeof(T);
  const auto total = static_cast<std::size_t>(count);
  Container loaded;
  if (remaining) loaded.reserve(total);
  while (loaded.size() < total) {
    const std::size_t done = loaded.size();
    if (done == loaded.capacity()) loaded.reserve(std::min(total, std::max(first_capacity, 2 * done)));
    const std::size_t chunk = std::min({loaded.capacity() - done, max_chunk, total - done});
    loaded.resize(done + chunk);
    ar(cereal::binary_data(loaded.data() + done, chunk * sizeof(T)));
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
      const auto [end, problem] = std::from_chars(text.data(), text.data() + text.size(), value);
      if (problem != std::errc{} || end != text.data() + text.size()) {
        throw std::invalid_argument(quote(text) + " is not a non-negative integer");
      }
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
double load_real(Archive& ar, const load_site& site, const char* field) {
  double value = 0.0;
  read_field<Archive>(site, field != nullptr ? field : "element", "a number", [&] { transfer(ar, field, value); });
  return value;
}

/// Loads one element of a text archive's list.
template <class Archive, raw_element T>
T load_text_element(Archive& ar, const load_site& site) {
  if constexpr (std::is_same_v<T, std::uint16_t>) {
    return static_cast<std::uint16_t>(load_unsigned(ar, site, nullptr, 0xffff));
  } else if constexpr (std::is_same_v<T, std::uint64_t>) {
    return load_unsigned(ar, site, nullptr, std::numeric_limits<std::uint64_t>::max());
  } else if constexpr (std::is_same_v<T, float>) {
    // Text archives hold numbers as doubles; a finite one beyond float's range is not an F32 value.
    const double value = load_real(ar, site, nullptr);
    if (std::fabs(value) > static_cast<double>(std::numeric_limits<float>::max()) && std::isfinite(value)) {
      site.fail("holds the value " + std::to_string(value) + ", which is beyond the range of F32.");
    }
    return static_cast<float>(value);
  } else {
    return load_real(ar, site, nullptr);
  }
}

/// Loads `count` elements (the size already read and checked) into `out`.
template <class Archive, raw_element T>
void load_elements(Archive& ar, std::vector<T>& out, std::uint64_t count, const load_site& site,
                   std::string_view field) {
  if constexpr (is_text_archive<Archive>) {
    // `count` is the length of an array already parsed into memory: allocating it is justified.
    std::vector<T> loaded(static_cast<std::size_t>(count));
    for (T& value : loaded) value = load_text_element<Archive, T>(ar, site);
    out = std::move(loaded);
  } else {
    load_raw(ar, out, count, site, field);
  }
}

// ---- Strings and dtype names -----------------------------------------------------------------

template <class Archive>
void save_string(Archive& ar, const char* field, const std::string& text) {
  if constexpr (is_text_archive<Archive>) {
    ar(cereal::make_nvp(field, text));
  } else {
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(text.size())));
    ar(cereal::binary_data(text.data(), text.size()));
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

/// Fewest bytes a tensor takes in a binary archive: sizes of its id and dtype name, the name
/// ("F32"), its rank and its value count.
inline constexpr std::uint64_t min_binary_tensor_bytes = 8 + 8 + 3 + 8 + 8;

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
                                   "; this build reads version " + std::to_string(record_format_version) + ".");
  }
}

}  // namespace detail

// ---- tensor_record ---------------------------------------------------------------------------

template <class Archive>
void save(Archive& ar, const tensor_record& tensor, const std::uint32_t /*version*/) {
  detail::save_string(ar, "id", tensor.id);
  detail::save_string(ar, "dtype", std::string(to_string(tensor.dtype)));
  ar(cereal::make_nvp("shape", detail::archive_node{[&](auto& node) {
                        detail::save_elements(node, std::span<const std::uint64_t>(tensor.shape));
                      }}));
  ar(cereal::make_nvp("values", detail::archive_node{[&](auto& node) {
                        std::visit([&](const auto& values) { detail::save_elements(node, std::span(values)); },
                                   tensor.values);
                      }}));
}

template <class Archive>
void load(Archive& ar, tensor_record& tensor, const std::uint32_t version) {
  detail::check_format_version(version, "a tensor record");
  tensor_record loaded;
  loaded.id = detail::load_string(ar, {errc::invalid_record, "a record tensor"}, "id",
                                  std::numeric_limits<std::uint64_t>::max());
  const detail::load_site site{errc::invalid_record, "record tensor", &loaded.id};
  loaded.dtype = detail::load_dtype(ar, site);

  detail::read_field<Archive>(site, "shape", "a list of dimensions", [&] {
    ar(cereal::make_nvp("shape", detail::archive_node{[&](auto& node) {
                          cereal::size_type rank = 0;
                          node(cereal::make_size_tag(rank));
                          if (rank > max_rank) {
                            site.fail("has rank " + std::to_string(rank) + ", more than the supported " +
                                      std::to_string(max_rank) + ".");
                          }
                          detail::load_elements(node, loaded.shape, rank, site, "shape");
                        }}));
  });
  const tensor_shape shape = detail::record_shape(loaded);
  const std::optional<std::size_t> elements = shape.checked_element_count();
  if (!elements) site.fail("has shape " + shape.to_string() + ", whose element count overflows.");

  detail::read_field<Archive>(site, "values", "a list of numbers", [&] {
    ar(cereal::make_nvp("values", detail::archive_node{[&](auto& node) {
                          cereal::size_type count = 0;
                          node(cereal::make_size_tag(count));
                          if (count != *elements) {
                            site.fail("declares " + std::to_string(count) + " values for shape " + shape.to_string() +
                                      " of " + std::to_string(*elements) + " elements.");
                          }
                          detail::visit_stored_type(loaded.dtype, [&]<class S>() {
                            detail::load_elements(node, loaded.values.template emplace<std::vector<S>>(), count, site,
                                                  "values");
                          });
                        }}));
  });
  tensor = std::move(loaded);
}

// ---- gradients_params_record ------------------------------------------------------------------

/// @throws error(errc::invalid_record) for a record that would not load back (see `validate`).
template <class Archive>
void save(Archive& ar, const gradients_params_record& record, const std::uint32_t /*version*/) {
  validate(record);
  ar(cereal::make_nvp("tensors", detail::archive_node{[&](auto& node) {
                        node(cereal::make_size_tag(static_cast<cereal::size_type>(record.tensors.size())));
                        for (const tensor_record& tensor : record.tensors) node(tensor);
                      }}));
}

template <class Archive>
void load(Archive& ar, gradients_params_record& record, const std::uint32_t version) {
  detail::check_format_version(version, "a gradients record");
  const detail::load_site site{errc::invalid_record, "gradients record"};
  gradients_params_record loaded;
  detail::read_field<Archive>(site, "tensors", "a list of tensors", [&] {
    ar(cereal::make_nvp("tensors", detail::archive_node{[&](auto& node) {
                          cereal::size_type count = 0;
                          node(cereal::make_size_tag(count));
                          // A text archive's count is the length of an array it has parsed; a binary archive's
                          // may be forged, so there the list reserves only what the remaining input can hold.
                          if constexpr (detail::is_text_archive<Archive>) {
                            loaded.tensors.reserve(static_cast<std::size_t>(count));
                          } else if (const auto remaining = detail::remaining_input(node)) {
                            const std::uint64_t room = *remaining / detail::min_binary_tensor_bytes;
                            loaded.tensors.reserve(static_cast<std::size_t>(std::min<std::uint64_t>(count, room)));
                          }
                          for (cereal::size_type i = 0; i < count; ++i) {
                            tensor_record tensor;
                            node(tensor);
                            loaded.tensors.push_back(std::move(tensor));
                          }
                        }}));
  });
  validate(loaded);
  record = std::move(loaded);
}

// ---- weighted_accumulation_state ---------------------------------------------------------------

/// @throws error(errc::invalid_state) for a state that would not load back (see `validate`).
template <class Archive>
void save(Archive& ar, const weighted_accumulation_state& state, const std::uint32_t /*version*/) {
  validate(state);
  detail::save_string(ar, "dtype", std::string(to_string(state.dtype)));
  ar(cereal::make_nvp("loss_scale", state.loss_scale), cereal::make_nvp("total_weight", state.total_weight),
     cereal::make_nvp("microbatches", state.microbatches));
}

template <class Archive>
void load(Archive& ar, weighted_accumulation_state& state, const std::uint32_t version) {
  detail::check_format_version(version, "an accumulation state");
  const detail::load_site site{errc::invalid_state, "accumulation state"};
  weighted_accumulation_state loaded;
  loaded.dtype = detail::load_dtype(ar, site);
  loaded.loss_scale = detail::load_real(ar, site, "loss_scale");
  loaded.total_weight = detail::load_real(ar, site, "total_weight");
  loaded.microbatches = detail::load_unsigned(ar, site, "microbatches", std::numeric_limits<std::uint64_t>::max());
  validate(loaded);
  state = loaded;
}

// ---- weighted_gradients_record ----------------------------------------------------------------

/// @throws error(errc::invalid_state) or error(errc::invalid_record) for a record that would not
/// load back (see `validate`).
template <class Archive>
void save(Archive& ar, const weighted_gradients_record& record, const std::uint32_t /*version*/) {
  validate(record);
  ar(cereal::make_nvp("state", record.state), cereal::make_nvp("gradients", record.gradients));
}

template <class Archive>
void load(Archive& ar, weighted_gradients_record& record, const std::uint32_t version) {
  detail::check_format_version(version, "a weighted gradients record");
  weighted_gradients_record loaded;
  // The state comes first, so a reader learns the work dtype before any tensor.
  detail::read_field<Archive>({errc::invalid_state, "weighted gradients record"}, "state", "an accumulation state",
                              [&] { ar(cereal::make_nvp("state", loaded.state)); });
  detail::read_field<Archive>({errc::invalid_record, "weighted gradients record"}, "gradients", "a gradients record",
                              [&] { ar(cereal::make_nvp("gradients", loaded.gradients)); });
  validate(loaded);
  record = std::move(loaded);
}

}  // namespace gradaccum

CEREAL_CLASS_VERSION(gradaccum::tensor_record, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::gradients_params_record, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::weighted_accumulation_state, gradaccum::record_format_version)
CEREAL_CLASS_VERSION(gradaccum::weighted_gradients_record, gradaccum::record_format_version)
