#pragma once
/// @file
/// @brief Element dtypes of gradients, their text names, and the `representable` check.

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

namespace gradaccum {

/// @brief Element type of a gradient. Arithmetic (work) dtypes are `f32` and `f64` only.
enum class float_dtype : std::uint8_t { f16, bf16, f32, f64 };

/// @brief Text name used in records and messages: "F16", "BF16", "F32", "F64".
constexpr std::string_view to_string(float_dtype dtype) noexcept {
  switch (dtype) {
    case float_dtype::f16: return "F16";
    case float_dtype::bf16: return "BF16";
    case float_dtype::f32: return "F32";
    case float_dtype::f64: return "F64";
  }
  return "?";
}

/// @brief Inverse of `to_string`; empty for any other text (names are case-sensitive).
constexpr std::optional<float_dtype> parse_float_dtype(std::string_view name) noexcept {
  for (auto dtype : {float_dtype::f16, float_dtype::bf16, float_dtype::f32, float_dtype::f64}) {
    if (to_string(dtype) == name) return dtype;
  }
  return std::nullopt;
}

/// @brief Bytes per element.
constexpr std::size_t size_of(float_dtype dtype) noexcept {
  return dtype == float_dtype::f64 ? 8 : dtype == float_dtype::f32 ? 4 : 2;
}

/// @brief Whether arithmetic may be done in `dtype` (F32 or F64).
constexpr bool is_work_dtype(float_dtype dtype) noexcept {
  return dtype == float_dtype::f32 || dtype == float_dtype::f64;
}

/// @brief `x` is finite and stays finite when narrowed to `dtype` (round to nearest even).
///
/// Narrowing to F16 overflows from 65520 up and to BF16 from 0x1.ffp127 up, the halfway points
/// past their largest finite values.
inline bool representable(double x, float_dtype dtype) noexcept {
  if (!std::isfinite(x)) return false;
  // Compared before narrowing: converting a double beyond float's range is undefined behaviour.
  // 0x1.ffffffp127 is the halfway point past the largest float, which rounds to infinity.
  const bool fits_f32 = std::fabs(x) < 0x1.ffffffp127;
  switch (dtype) {
    case float_dtype::f64: return true;
    case float_dtype::f32: return fits_f32;
    case float_dtype::bf16: return fits_f32 && std::fabs(static_cast<float>(x)) < 0x1.ffp127F;
    case float_dtype::f16: return std::fabs(x) < 65520.0;
  }
  return false;
}

/// @brief Maps an element type to its dtype. Specialized here for `float` and `double`;
/// a backend specializes it for its 16-bit types (which must be 2-byte, trivially copyable
/// IEEE binary16 or bfloat16 bit patterns).
template <class T>
struct element_dtype;
template <>
struct element_dtype<float> {
  static constexpr float_dtype value = float_dtype::f32;
};
template <>
struct element_dtype<double> {
  static constexpr float_dtype value = float_dtype::f64;
};

/// @brief The dtype of element type `T`.
template <class T>
inline constexpr float_dtype dtype_of = element_dtype<T>::value;

/// @brief A type with a known dtype; 16-bit ones must be plain 2-byte bit patterns.
template <class T>
concept element_type = requires {
  { element_dtype<T>::value } -> std::convertible_to<float_dtype>;
} && (size_of(element_dtype<T>::value) == sizeof(T)) && std::is_trivially_copyable_v<T>;

/// @brief The C++ type of a work dtype: `float` for F32, `double` for F64.
template <float_dtype D>
  requires(is_work_dtype(D))
using work_type = std::conditional_t<D == float_dtype::f32, float, double>;

}  // namespace gradaccum
