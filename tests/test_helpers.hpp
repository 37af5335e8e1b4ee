#pragma once
/// @file
/// @brief Backend-independent test helpers: exact 16-bit encodings, bitwise record comparison
/// and checks that a call is rejected with a given `errc` and parameter id.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ostream>  // doctest prints std::error_code through operator<<
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>

#include <doctest/doctest.h>

#include <gradaccum/dtype.hpp>
#include <gradaccum/error.hpp>
#include <gradaccum/kernels.hpp>
#include <gradaccum/records.hpp>

template <>
struct doctest::StringMaker<gradaccum::errc> {
  static doctest::String convert(gradaccum::errc code) { return make_error_code(code).message().c_str(); }
};
template <>
struct doctest::StringMaker<gradaccum::float_dtype> {
  static doctest::String convert(gradaccum::float_dtype dtype) { return std::string(to_string(dtype)).c_str(); }
};

namespace gradaccum::test {

/// @brief IEEE binary16 bits of `value`, which must be exactly representable (the test fails
/// otherwise): normals are 1.m · 2^e with a 10-bit m and e in [-14, 15], subnormals n · 2^-24.
inline std::uint16_t f16_bits_of(double value) {
  const auto sign = static_cast<std::uint16_t>(std::signbit(value) ? 0x8000U : 0U);
  const double magnitude = std::fabs(value);
  std::uint32_t bits = 0;
  if (magnitude < 0x1p-14) {
    bits = static_cast<std::uint32_t>(magnitude * 0x1p24);
  } else {
    int exponent = 0;
    const double fraction = std::frexp(magnitude, &exponent);  // magnitude = fraction · 2^exponent
    REQUIRE_MESSAGE(exponent <= 16, value << " overflows F16");
    const auto mantissa = static_cast<std::uint32_t>((fraction * 2.0 - 1.0) * 1024.0);
    bits = (static_cast<std::uint32_t>(exponent + 14) << 10) | mantissa;
  }
  const auto result = static_cast<std::uint16_t>(sign | bits);
  REQUIRE_MESSAGE(kernels::f16_bits_to_float(result) == value, value << " is not exactly representable in F16");
  return result;
}

/// @brief bfloat16 bits of `value`, which must be exactly representable: the upper half of the float.
inline std::uint16_t bf16_bits_of(double value) {
  const auto bits = std::bit_cast<std::uint32_t>(static_cast<float>(value));
  const auto result = static_cast<std::uint16_t>(bits >> 16);
  REQUIRE_MESSAGE(kernels::bf16_bits_to_float(result) == value, value << " is not exactly representable in BF16");
  return result;
}

/// @brief `value` as element type T: a 16-bit T must hold it exactly, float rounds to nearest.
template <element_type T>
T to_element(double value) {
  if constexpr (dtype_of<T> == float_dtype::f16) {
    return std::bit_cast<T>(f16_bits_of(value));
  } else if constexpr (dtype_of<T> == float_dtype::bf16) {
    return std::bit_cast<T>(bf16_bits_of(value));
  } else {
    return static_cast<T>(value);
  }
}

/// @brief Floats compare as bit patterns (so NaN equals itself and -0 differs from +0).
template <class T>
  requires std::is_arithmetic_v<T>
bool same_bits(T a, T b) noexcept {
  if constexpr (std::is_floating_point_v<T>) {
    using bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    return std::bit_cast<bits>(a) == std::bit_cast<bits>(b);
  } else {
    return a == b;
  }
}

inline bool same_bits(const record_values& a, const record_values& b) {
  return a.index() == b.index() && std::visit(
                                       [&](const auto& values) {
                                         const auto& other = std::get<std::decay_t<decltype(values)>>(b);
                                         return std::equal(values.begin(), values.end(), other.begin(), other.end(),
                                                           [](auto x, auto y) { return same_bits(x, y); });
                                       },
                                       a);
}

inline bool same_bits(const gradients_params_record& a, const gradients_params_record& b) {
  if (a.tensors.size() != b.tensors.size()) return false;
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const tensor_record& x = a.tensors[i];
    const tensor_record& y = b.tensors[i];
    if (x.id != y.id || x.dtype != y.dtype || x.shape != y.shape || !same_bits(x.values, y.values)) return false;
  }
  return true;
}

/// NaN-proof: scalars compare as bit patterns.
inline bool same_bits(const weighted_accumulation_state& a, const weighted_accumulation_state& b) noexcept {
  return a.dtype == b.dtype && same_bits(a.loss_scale, b.loss_scale) && same_bits(a.total_weight, b.total_weight) &&
         a.microbatches == b.microbatches;
}

inline bool same_bits(const weighted_gradients_record& a, const weighted_gradients_record& b) {
  return same_bits(a.gradients, b.gradients) && same_bits(a.state, b.state);
}

/// @brief Exact text of a value: hexadecimal floating point, so two printouts differ where the bits do.
inline std::string exact(double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%a", value);
  return text;
}

inline std::string describe(const record_values& values) {
  return std::visit(
      [](const auto& v) {
        std::string text = "{";
        for (std::size_t i = 0; i < v.size(); ++i) text += (i == 0 ? "" : ", ") + exact(static_cast<double>(v[i]));
        return text + "}";
      },
      values);
}

inline std::string describe(const gradients_params_record& record) {
  std::string text;
  for (const tensor_record& t : record.tensors) {
    text += "  '" + t.id + "' " + std::string(to_string(t.dtype)) + " [";
    for (std::size_t axis = 0; axis < t.shape.size(); ++axis)
      text += (axis == 0 ? "" : ", ") + std::to_string(t.shape[axis]);
    text += "] " + describe(t.values) + "\n";
  }
  return text;
}

inline std::string describe(const weighted_accumulation_state& state) {
  return "  state " + std::string(to_string(state.dtype)) + " loss_scale " + exact(state.loss_scale) +
         " total_weight " + exact(state.total_weight) + " microbatches " + std::to_string(state.microbatches) + "\n";
}

inline std::string describe(const weighted_gradients_record& record) {
  return describe(record.gradients) + describe(record.state);
}

/// @brief Checks that `call` throws `gradaccum::error` with `code`, naming `param_id` (empty: no
/// parameter) in both `param_id()` and the message; `text` is the call, shown on failure.
template <class Call>
void check_rejected(const Call& call, errc code, std::string_view param_id, const char* text) {
  INFO("call: " << text);
  try {
    call();
    FAIL_CHECK("accepted, but expected rejection with " << code);
  } catch (const error& e) {
    CHECK(e.code() == code);
    CHECK(e.error_code() == code);
    CHECK(e.param_id() == param_id);
    const std::string message = e.what();
    CHECK_MESSAGE(!message.empty(), "the message is empty");
    if (!param_id.empty()) {
      CHECK_MESSAGE(message.find("'" + std::string(param_id) + "'") != std::string::npos,
                    "message \"" << message << "\" does not name '" << std::string(param_id) << "'");
    }
  }
}

}  // namespace gradaccum::test

/// @brief CHECKs that `expression` throws gradaccum::error with `code` and parameter id `id`.
#define GRADACCUM_CHECK_REJECTED(expression, code, id) \
  ::gradaccum::test::check_rejected([&] { (void)(expression); }, code, id, #expression)

/// @brief CHECKs that two records (or states, or values) are equal bit for bit.
#define GRADACCUM_CHECK_SAME_BITS(actual, expected)                                                        \
  CHECK_MESSAGE(::gradaccum::test::same_bits(actual, expected), "actual:\n"                                \
                                                                    << ::gradaccum::test::describe(actual) \
                                                                    << "expected:\n"                       \
                                                                    << ::gradaccum::test::describe(expected))
