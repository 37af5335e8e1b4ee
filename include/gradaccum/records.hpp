#pragma once
/// @file
/// @brief Backend-neutral records of pending gradients and of an accumulation window.
///
/// Records are plain values. Tensors are listed sorted by id and hold row-major values, so equal
/// windows give equal (and, once serialized, byte-identical) records whatever the backend.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum {

/// @brief Version of the record format: the cereal class version of every record type (see
/// `<gradaccum/cereal.hpp>`). Only this version loads; a record of another one is refused with
/// `errc::invalid_record` naming both. Version 5 starts every record with a tag naming its type.
inline constexpr std::uint32_t record_format_version = 5;

/// @brief Longest parameter id a record holds, in bytes. Saving a longer one, or loading a
/// checkpoint that declares one, throws error(errc::invalid_record): a length field read from
/// untrusted bytes is refused before anything is allocated for it.
inline constexpr std::size_t max_id_length = 4096;

/// @brief Row-major values of one tensor: 16-bit dtypes as their bit patterns.
using record_values = std::variant<std::vector<std::uint16_t>, std::vector<float>, std::vector<double>>;

/// @brief One pending tensor: id, dtype, shape (outermost first) and row-major values.
struct tensor_record {
  std::string id;
  float_dtype dtype = float_dtype::f32;
  std::vector<std::uint64_t> shape;
  record_values values;

  friend bool operator==(const tensor_record&, const tensor_record&) = default;
};

/// @brief The pending gradients of an accumulator, sorted by id.
struct gradients_params_record {
  std::vector<tensor_record> tensors;

  friend bool operator==(const gradients_params_record&, const gradients_params_record&) = default;
};

/// @brief Explicit normalization and continuation state of an accumulation window.
struct weighted_accumulation_state {
  /// F32 or F64: the arithmetic every microbatch was added in.
  float_dtype dtype = float_dtype::f32;
  /// The multiplier the caller applied to every loss of the window.
  double loss_scale = 1.0;
  /// Sum of the effective (token or sample) weights, not a batch count.
  double total_weight = 0.0;
  /// Accepted microbatches, zero-weight ones included.
  std::uint64_t microbatches = 0;

  friend bool operator==(const weighted_accumulation_state&, const weighted_accumulation_state&) = default;
};

/// @brief Pending gradients and the state that normalizes them, saved and restored together.
struct weighted_gradients_record {
  gradients_params_record gradients;
  weighted_accumulation_state state;

  friend bool operator==(const weighted_gradients_record&, const weighted_gradients_record&) = default;
};

namespace detail {

/// `text` in quotes for a message or a listing: bytes outside printable ASCII, backslashes and
/// quotes escaped as `\xHH`, so an id's bytes (NUL and terminal escapes included) never reach a
/// terminal raw and distinct ids print distinctly; cut after `shown` bytes with "..." (a
/// message keeps a long id short, a listing shows it whole).
inline std::string quote(std::string_view text, std::size_t shown = 64) {
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

/// Index of the `record_values` alternative that holds `dtype`.
constexpr std::size_t values_index(float_dtype dtype) noexcept {
  return dtype == float_dtype::f64 ? 2 : dtype == float_dtype::f32 ? 1 : 0;
}

inline std::size_t values_size(const record_values& values) noexcept {
  if (const auto* bits = std::get_if<std::vector<std::uint16_t>>(&values)) return bits->size();
  if (const auto* f32 = std::get_if<std::vector<float>>(&values)) return f32->size();
  const auto* f64 = std::get_if<std::vector<double>>(&values);
  return f64 ? f64->size() : 0;
}

/// Shape of a record entry as a `tensor_shape`.
inline tensor_shape record_shape(const tensor_record& tensor) {
  return tensor_shape(std::span<const std::uint64_t>(tensor.shape));
}

/// Row-major values borrowed from wherever they live, in the alternatives of `record_values`.
using values_view = std::variant<std::span<const std::uint16_t>, std::span<const float>, std::span<const double>>;

/// Values that are not in host memory (a device window's), read into it piece by piece.
class values_on_device {
 public:
  /// Elements [first, first + out.size() / element size) of the tensor at `key`, as bytes of
  /// the view's dtype. @throws what the device's copy throws (nothing is then saved)
  virtual void read(std::size_t key, std::size_t first, std::span<std::byte> out) const = 0;

 protected:
  values_on_device() = default;
  values_on_device(const values_on_device&) = default;
  values_on_device& operator=(const values_on_device&) = default;
  ~values_on_device() = default;
};

/// @brief A `tensor_record` whose fields are borrowed: saving one writes what saving the record
/// would, so accumulators save their tensors without a snapshot. Built only from valid data.
struct tensor_view {
  std::string_view id;
  float_dtype dtype = float_dtype::f32;
  std::span<const std::uint64_t> shape;
  /// The values in host memory; empty, of the dtype's type, when `source` is set.
  values_view values;
  /// Where the values are when they are not in host memory: `count` of them, under `key`, at
  /// element `offset` of their gradients view's `staged_block` when it has one.
  const values_on_device* source = nullptr;
  std::size_t key = 0;
  std::size_t count = 0;
  std::size_t offset = 0;

  // get_if, not std::visit: this inline function is compiled wherever the core is included.
  [[nodiscard]] std::size_t size() const noexcept {
    if (source != nullptr) return count;
    if (const auto* f32 = std::get_if<std::span<const float>>(&values)) return f32->size();
    if (const auto* f64 = std::get_if<std::span<const double>>(&values)) return f64->size();
    const auto* bits = std::get_if<std::span<const std::uint16_t>>(&values);
    return bits != nullptr ? bits->size() : 0;
  }
};

/// @brief A `gradients_params_record` of borrowed tensors, in record order.
struct gradients_view {
  std::span<const tensor_view> tensors;
  /// When the tensors are segments of one buffer: that buffer from the first segment's start to
  /// the last one's end (zeros between segments), which binary archives write as it is. Empty
  /// otherwise.
  values_view block;
  /// The same for tensors on a device (`tensor_view::source`): the element count of the block
  /// their `offset`s lie in, or 0.
  std::size_t staged_block = 0;
};

/// @brief A `weighted_gradients_record` whose tensors are borrowed.
struct weighted_gradients_view {
  weighted_accumulation_state state;
  gradients_view gradients;
};

}  // namespace detail

// The checks below are templates of nothing, called as `validate(record)`: a file that
// includes the core compiles them only if it calls one (they instantiate the id sort).

/// @brief Checks a record on its own: ids of at most `max_id_length` bytes, no duplicate ids, values of the declared
/// dtype, element counts that match shapes.
/// @throws error(errc::invalid_record) naming the first problem and the offending id.
template <class = void>
void validate(const gradients_params_record& record) {
  for (const tensor_record& tensor : record.tensors) {
    if (tensor.id.size() > max_id_length) {
      detail::fail(errc::invalid_record,
                   {"record tensor id of ", tensor.id.size(), " bytes is longer than the ", max_id_length, " allowed."},
                   std::string_view(tensor.id).substr(0, 64));
    }
    const tensor_shape shape = [&] {
      if (tensor.shape.size() > max_rank) {
        detail::fail(errc::invalid_record,
                     {"record tensor ", detail::quote(tensor.id), " has rank ", tensor.shape.size(),
                      ", more than the supported ", max_rank, "."},
                     tensor.id);
      }
      return detail::record_shape(tensor);
    }();
    if (tensor.values.index() != detail::values_index(tensor.dtype)) {
      detail::fail(errc::invalid_record,
                   {"record tensor ", detail::quote(tensor.id), " holds values of another dtype than its ",
                    to_string(tensor.dtype), "."},
                   tensor.id);
    }
    const auto count = shape.checked_element_count();
    if (!count || *count != detail::values_size(tensor.values)) {
      detail::fail(errc::invalid_record,
                   {"record tensor ", detail::quote(tensor.id), " has ", detail::values_size(tensor.values),
                    " values for shape ", shape.dims(), "."},
                   tensor.id);
    }
  }
  // Records list tensors sorted by id, so a duplicate is a neighbour: one pass. Only a record
  // in another order needs sorting (thousands of ids sharing long prefixes sort slowly).
  const auto fail_duplicate = [](const std::string& id) {
    detail::fail(errc::invalid_record, {"record lists tensor ", detail::quote(id), " twice."}, id);
  };
  const auto by_id = [](const tensor_record& a, const tensor_record& b) { return a.id < b.id; };
  if (std::is_sorted(record.tensors.begin(), record.tensors.end(), by_id)) {
    const auto same_id = [](const tensor_record& a, const tensor_record& b) { return a.id == b.id; };
    const auto duplicate = std::adjacent_find(record.tensors.begin(), record.tensors.end(), same_id);
    if (duplicate != record.tensors.end()) fail_duplicate(duplicate->id);
    return;
  }
  std::vector<const std::string*> ids;
  ids.reserve(record.tensors.size());
  for (const tensor_record& tensor : record.tensors) ids.push_back(&tensor.id);
  std::sort(ids.begin(), ids.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
  const auto duplicate =
      std::adjacent_find(ids.begin(), ids.end(), [](const std::string* a, const std::string* b) { return *a == *b; });
  if (duplicate != ids.end()) fail_duplicate(**duplicate);
}

/// @brief Checks a window state: work dtype, a representable positive loss scale, a
/// representable non-negative total weight, and no weight without microbatches.
/// @throws error(errc::invalid_state) naming the problem.
template <class = void>
void validate(const weighted_accumulation_state& state) {
  if (!is_work_dtype(state.dtype)) {
    detail::fail(errc::invalid_state,
                 {"accumulation state has work dtype ", to_string(state.dtype), "; only F32 and F64 are work dtypes."});
  }
  const bool f32 = state.dtype == float_dtype::f32;
  if (!representable(state.loss_scale, state.dtype) || state.loss_scale <= 0.0 ||
      (f32 && static_cast<float>(state.loss_scale) == 0.0F)) {
    detail::fail(errc::invalid_state, {"accumulation state has loss scale ", state.loss_scale,
                                       ", which is not a positive representable value."});
  }
  if (!representable(state.total_weight, state.dtype) || state.total_weight < 0.0 ||
      (f32 && state.total_weight > 0.0 && static_cast<float>(state.total_weight) == 0.0F)) {
    detail::fail(errc::invalid_state, {"accumulation state has total weight ", state.total_weight,
                                       ", which is not a non-negative representable value."});
  }
  if (state.microbatches == 0 && state.total_weight != 0.0) {
    detail::fail(errc::invalid_state, {"accumulation state has a non-zero total weight but no microbatches."});
  }
}

namespace detail {

/// @brief Checks that pending tensors agree with the state that normalizes them: pending values
/// need a non-zero total weight, and every pending tensor is in the state's work dtype.
/// `for_each_tensor(check)` calls `check(id, dtype)` for every pending tensor.
/// @throws error(errc::invalid_state) naming the first problem.
template <class ForEach>
void check_pending_against(const weighted_accumulation_state& state, std::size_t pending_count,
                           ForEach&& for_each_tensor) {
  if (state.total_weight == 0.0 && pending_count != 0) {
    fail(errc::invalid_state, {"accumulation state has zero total weight but pending gradients."});
  }
  for_each_tensor([&](const std::string& id, float_dtype dtype) {
    if (dtype != state.dtype) {
      fail(errc::invalid_state,
           {"pending tensor ", quote(id), " has dtype ", to_string(dtype),
            " but the accumulation state's work dtype is ", to_string(state.dtype), "."},
           id);
    }
  });
}

}  // namespace detail

/// @brief Checks a window record on its own: a valid state, pending tensors that agree with it
/// (`detail::check_pending_against`) and a well-formed gradients record.
/// @throws error(errc::invalid_state) for the state and its agreement with the tensors,
/// error(errc::invalid_record) for the tensors themselves.
template <class = void>
void validate(const weighted_gradients_record& record) {
  validate(record.state);
  detail::check_pending_against(record.state, record.gradients.tensors.size(), [&](auto&& check) {
    for (const tensor_record& tensor : record.gradients.tensors) check(tensor.id, tensor.dtype);
  });
  validate(record.gradients);
}

}  // namespace gradaccum
