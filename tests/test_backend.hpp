#pragma once
/// @file
/// @brief `vector_backend`: a minimal, test-only backend built on `std::vector`.
///
/// It is the smallest complete `serializable_backend`: row-major tensors in host memory, views
/// of caller memory, two 16-bit element types of its own and a real device type (an `int`), so
/// the conformance suite can check that a gradient on another device is refused. The arithmetic
/// comes from `gradaccum::kernels`, like every CPU backend's.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include <gradaccum/backend.hpp>
#include <gradaccum/dtype.hpp>
#include <gradaccum/kernels.hpp>
#include <gradaccum/shape.hpp>
#include <gradaccum/type_list.hpp>

namespace gradaccum::test {

/// @brief IEEE binary16 bits (no arithmetic: the library only converts them).
struct f16 {
  std::uint16_t bits;
};
/// @brief bfloat16 bits.
struct bf16 {
  std::uint16_t bits;
};

}  // namespace gradaccum::test

template <>
struct gradaccum::element_dtype<gradaccum::test::f16> {
  static constexpr float_dtype value = float_dtype::f16;
};
template <>
struct gradaccum::element_dtype<gradaccum::test::bf16> {
  static constexpr float_dtype value = float_dtype::bf16;
};

namespace gradaccum::test {

struct vector_backend {
  using device_type = int;
  using element_types = type_list<f16, bf16, float, double>;

  /// Owns its row-major values.
  template <class T>
  struct tensor {
    std::vector<T> values;
    tensor_shape shape;
    device_type device = 0;
  };
  /// Reads caller memory in place.
  template <class T>
  struct view {
    std::span<const T> values;
    tensor_shape shape;
    device_type device = 0;
  };

  template <class X>
  static tensor_shape shape(const X& x) noexcept {
    return x.shape;
  }
  template <class X>
  static device_type device(const X& x) noexcept {
    return x.device;
  }
  template <class W, class X>
  static void add_scaled(std::span<W> acc, const X& g, W scale) noexcept {
    kernels::add_scaled(acc.data(), g.values.data(), acc.size(), scale);
  }
  /// A result: a view of the window's buffer.
  template <class W>
  static view<W> map(std::span<const W> values, const tensor_shape& shape, const device_type& device) noexcept {
    return {values, shape, device};
  }
  /// An owned copy in element type W; a plain copy when W is the input's own type.
  template <class W, class X>
  static tensor<W> convert(const X& x) {
    tensor<W> out{std::vector<W>(x.values.size()), x.shape, x.device};
    if constexpr (std::is_same_v<W, std::remove_cvref_t<decltype(x.values[0])>>) {
      std::copy(x.values.begin(), x.values.end(), out.values.begin());
    } else {
      kernels::convert(out.values.data(), x.values.data(), x.values.size());
    }
    return out;
  }
  template <class T>
  static void to_row_major(const tensor<T>& t, std::span<T> out) {
    std::copy(t.values.begin(), t.values.end(), out.begin());
  }
  template <class T>
  static tensor<T> from_row_major(std::span<const T> values, const tensor_shape& shape, const device_type& device) {
    return {std::vector<T>(values.begin(), values.end()), shape, device};
  }
};

static_assert(detail::check_backend<vector_backend>());
static_assert(serializable_backend<vector_backend>);

}  // namespace gradaccum::test
