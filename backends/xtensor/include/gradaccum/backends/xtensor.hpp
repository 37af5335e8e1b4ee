#pragma once
/// @file
/// @brief xtensor backend: `gradaccum::xtensor_backend`.
///
/// xtensor already gives dense, row-major `xt::xarray<T>` containers of any element type and
/// `xt::adapt` views of caller memory. This header adds the traits that let the core accumulate
/// them: gradients are `xt::xarray<T>` or read-only `xt::adapt` views (`xtensor_backend::view<T>`,
/// read in place, no copy), for T in `float`, `double` and the two 16-bit storage types below.
/// The fused convert-scale-add runs the core's kernels on the raw storage, so the arithmetic is
/// the same instruction for instruction as every other CPU backend's (bit-identical results),
/// with or without xsimd.
///
/// Works with xtensor 0.24/0.25 (flat `<xtensor/xarray.hpp>`) and 0.26+ (headers moved into
/// `<xtensor/containers/...>`).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <type_traits>

#if __has_include(<xtensor/containers/xarray.hpp>)
#include <xtensor/containers/xarray.hpp>
#else
#include <xtensor/xarray.hpp>
#endif

#include "gradaccum/backend.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/shape.hpp"
#include "gradaccum/type_list.hpp"

namespace gradaccum {

/// @brief An IEEE binary16 (F16) value held as its bit pattern.
///
/// xtensor has no 16-bit float type, so 16-bit gradients produced elsewhere (a mixed-precision
/// forward pass, another library, a file) are adapted as these: `xt::xarray<f16_bits>` or a view
/// of the caller's `std::uint16_t` buffer. They are storage only; the library widens them to the
/// work dtype exactly before any arithmetic. Example: `f16_bits{0x3c00}` is 1.0.
struct f16_bits {
  std::uint16_t bits;
  friend constexpr bool operator==(f16_bits, f16_bits) noexcept = default;
};

/// @brief A bfloat16 (BF16) value held as its bit pattern (the upper half of a float);
/// `bf16_bits{0x3f80}` is 1.0. Storage only, like `f16_bits`.
struct bf16_bits {
  std::uint16_t bits;
  friend constexpr bool operator==(bf16_bits, bf16_bits) noexcept = default;
};

template <>
struct element_dtype<f16_bits> {
  static constexpr float_dtype value = float_dtype::f16;
};
template <>
struct element_dtype<bf16_bits> {
  static constexpr float_dtype value = float_dtype::bf16;
};

/// @brief xtensor containers live in host memory: one device, equal to itself.
struct xtensor_cpu_device {
  friend constexpr bool operator==(xtensor_cpu_device, xtensor_cpu_device) noexcept = default;
};

/// @brief Traits that adapt dense row-major xtensor arrays to `serializable_backend`.
///
/// Any rank up to `gradaccum::max_rank`; a rank-0 array holds one value. Storage is row-major
/// (the layout is fixed here rather than taken from `XTENSOR_DEFAULT_LAYOUT`), so record values
/// are a plain copy of the storage, and tensors and views always agree element for element.
/// Arrays own contiguous host memory, which `data` exposes (`host_memory_backend`).
struct xtensor_backend {
  using device_type = xtensor_cpu_device;
  using element_types = type_list<f16_bits, bf16_bits, float, double>;

  /// `xt::xarray<T>` under xtensor's default (row-major) configuration.
  template <class T>
  using tensor = xt::xarray<T, xt::layout_type::row_major>;

  /// The shape container of `tensor<T>` (inline storage up to rank 4, so no allocation).
  using shape_type = typename tensor<float>::shape_type;

  /// @brief A read-only view of caller memory, read in place by every operation.
  ///
  /// Exactly the type of `xt::adapt(pointer, size, xt::no_ownership(), shape)` for a `const T*`
  /// prvalue pointer and a `shape_type` shape; `view_of` builds one without those details.
  template <class T>
  using view = xt::xarray_adaptor<xt::xbuffer_adaptor<const T*, xt::no_ownership, std::allocator<T>>,
                                  xt::layout_type::row_major, shape_type>;

  /// Views store their dimensions: a view's shape never changes once it is made.
  static constexpr bool views_keep_geometry = true;

  /// @brief A view of the row-major values at `data` with dimensions `dims`; `data` must hold
  /// the product of `dims` elements and outlive every use of the view.
  template <class T>
  static view<T> view_of(const T* data, const shape_type& dims) {
    const std::size_t count = std::accumulate(dims.begin(), dims.end(), std::size_t{1}, std::multiplies<>());
    return view<T>(typename view<T>::storage_type(data, count), dims);
  }

  /// @throws error(errc::invalid_record) for a rank above `gradaccum::max_rank`.
  template <class X>
  static tensor_shape shape(const X& x) {
    const auto& dims = x.shape();
    return tensor_shape(std::span<const std::size_t>(dims.data(), dims.size()));
  }

  /// shape(x) == s, comparing the dimensions in place (a loop: std::equal calls memcmp).
  template <class X>
  static bool has_shape(const X& x, const tensor_shape& s) noexcept {
    const auto& dims = x.shape();
    if (dims.size() != s.rank()) return false;
    for (std::size_t axis = 0; axis < dims.size(); ++axis) {
      if (dims[axis] != s[axis]) return false;
    }
    return true;
  }

  template <class X>
  static device_type device(const X& /*x*/) noexcept {
    return {};
  }

  /// The storage, row-major.
  template <class T>
  static T* data(tensor<T>& t) noexcept {
    return t.data();
  }

  template <class W>
  static tensor<W> zeros(const tensor_shape& s, const device_type& /*device*/) {
    return tensor<W>(to_shape_type(s), W{0});
  }

  /// acc += scale · W(g), one pass over contiguous storage.
  template <class W, class X>
  static void add_scaled(tensor<W>& acc, const X& g, W scale) noexcept {
    kernels::add_scaled(acc.data(), g.data(), acc.size(), scale);
  }

  /// acc = (acc / first) / second.
  template <class W>
  static void divide(tensor<W>& acc, W first, W second) noexcept {
    kernels::divide(acc.data(), acc.size(), first, second);
  }

  template <class W>
  static bool all_finite(const tensor<W>& t) noexcept {
    return kernels::all_finite(t.data(), t.size());
  }

  /// An owned copy in element type W (a plain copy when W is the input's element type).
  template <class W, class X>
  static tensor<W> convert(const X& x) {
    tensor<W> out(x.shape());
    if constexpr (std::is_same_v<typename X::value_type, W>) {
      std::copy_n(x.data(), x.size(), out.data());
    } else {
      kernels::convert(out.data(), x.data(), x.size());
    }
    return out;
  }

  /// Storage is row-major already: out[i] = t.data()[i].
  template <class T>
  static void to_row_major(const tensor<T>& t, std::span<T> out) noexcept {
    std::copy_n(t.data(), t.size(), out.data());
  }

  template <class T>
  static tensor<T> from_row_major(std::span<const T> values, const tensor_shape& s, const device_type& /*device*/) {
    tensor<T> out(to_shape_type(s));
    std::copy_n(values.data(), out.size(), out.data());
    return out;
  }

  /// xtensor 0.24 declares its moves noexcept, but its shapes hold 4 dimensions inline: moving
  /// a tensor of higher rank allocates, and would terminate if that failed. The library copies
  /// those tensors instead of moving them.
  template <class T>
  static bool moves_without_allocating(const tensor<T>& t) noexcept {
    return t.dimension() <= 4;
  }

  template <class T>
  static tensor<T> uninitialized(const tensor_shape& s, const device_type& /*device*/) {
    return tensor<T>(to_shape_type(s));
  }

  template <class T>
  static T* row_major_data(tensor<T>& t) noexcept {
    return t.data();
  }
  template <class T>
  static const T* row_major_data(const tensor<T>& t) noexcept {
    return t.data();
  }

 private:
  static shape_type to_shape_type(const tensor_shape& s) { return {s.begin(), s.end()}; }
};

static_assert(serializable_backend<xtensor_backend> && host_memory_backend<xtensor_backend>);

}  // namespace gradaccum
