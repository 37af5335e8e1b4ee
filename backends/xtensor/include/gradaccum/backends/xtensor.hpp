#pragma once
/// @file
/// @brief xtensor backend: `gradaccum::xtensor_backend`.
///
/// xtensor already gives containers of any element type, rank and layout, `xt::adapt` views of
/// caller memory, strided views and lazy expressions. This header adds the traits that let the
/// core accumulate them: adaptors and strided views are read in place through their strides,
/// containers are copied (`gradaccum::view(c)` reads one in place), other expressions are
/// evaluated once at insert (see `xtensor_backend`), for element types
/// `float`, `double` and the two 16-bit storage types below. The fused convert-scale-add runs the
/// core's kernels on the raw storage, so the arithmetic is the same instruction for instruction
/// as every other CPU backend's (bit-identical results), with or without xsimd.
///
/// @code
/// params.add("conv.weight", kernel);                                  // xt::xtensor<float, 4>
/// grads.insert("fc.weight", xt::transpose(dW));                       // read in place, strided
/// grads.insert("fc.bias", 2.0F * db);                                 // evaluated once, here
/// grads.insert("emb", gradaccum::xtensor_backend::view_of(ptr, {n, d}));  // row-major memory
/// @endcode
///
/// Works with xtensor 0.24/0.25 (flat `<xtensor/xarray.hpp>`) and 0.26+ (headers moved into
/// `<xtensor/containers/...>`).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>

#if __has_include(<xtensor/containers/xarray.hpp>)
#include <xtensor/containers/xarray.hpp>
#else
#include <xtensor/xarray.hpp>
#endif

#include "gradaccum/backend.hpp"
#include "gradaccum/detail/gradient_input.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/shape.hpp"
#include "gradaccum/strided_view.hpp"
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

namespace detail {

template <class S>
struct borrowed_storage : std::is_reference<S> {};
template <class CP, class A>
struct borrowed_storage<xt::xbuffer_adaptor<CP, xt::no_ownership, A>> : std::true_type {};

/// A container that owns its values (`xt::xarray`, `xt::xtensor`, `xt::xtensor_fixed`, an
/// adaptor that took ownership); views and adaptors of borrowed memory do not.
template <class X>
concept xtensor_owning = std::is_base_of_v<xt::xcontainer<X>, X> && !borrowed_storage<typename X::storage_type>::value;

template <class X, class List>
concept xtensor_input = xt::is_xexpression<X>::value && list_contains<typename X::value_type, List>::value;

/// Containers, adaptors and strided views: values reachable through `data() + data_offset()` and
/// element strides.
template <class X>
concept xtensor_strided = requires(const X& x) {
  x.data() + x.data_offset();
  x.strides().size();
  x.shape().size();
};

}  // namespace detail

/// @brief Traits that adapt xtensor containers, views and expressions to `serializable_backend`.
///
/// Any rank up to `gradaccum::max_rank`; a rank-0 array holds one value. Owned tensors are
/// row-major `xt::xarray`s (the layout is fixed here rather than taken from
/// `XTENSOR_DEFAULT_LAYOUT`), so record values are a plain copy of the storage. Everything else
/// goes in through `adapt`:
/// - an `xt::adapt` of const or mutable memory and a strided view (`xt::view` of ranges,
///   `xt::transpose`, `xt::strided_view`) are read in place through their strides (`view<T>`, a
///   `gradaccum::strided_view`); the memory must outlive the accumulation call;
/// - a container of another type or layout (`xt::xtensor<T, N>`, `xt::xtensor_fixed`, a
///   column-major `xt::xarray`), lvalue or not, is copied at insert: an lvalue into storage the
///   entry keeps (reused by `insert_or_assign`), read like a view (`c += 1` is an lvalue
///   reference to whatever `c` is, a temporary too), a temporary into a `tensor<T>`.
///   `gradaccum::view(c)` reads a container in place instead (c must outlive the calls);
/// - any other expression (`2.0F * h`, `xt::ones<float>({2, 3})`) is evaluated once, at insert,
///   into a `tensor<T>`.
///
/// Shapes are xtensor's own. Results are handed out as `result_view<W>`s (`xt::adapt`s) of the
/// window's buffer, so they take part in xtensor expressions.
struct xtensor_backend {
  using device_type = xtensor_cpu_device;
  using element_types = type_list<f16_bits, bf16_bits, float, double>;

  /// `xt::xarray<T>` under xtensor's default (row-major) configuration.
  template <class T>
  using tensor = xt::xarray<T, xt::layout_type::row_major>;

  /// The shape container of `tensor<T>` (inline storage up to rank 4, so no allocation).
  using shape_type = typename tensor<float>::shape_type;

  /// Caller memory of any layout, read in place.
  template <class T>
  using view = strided_view<const T>;

  /// @brief A result: exactly the type of `xt::adapt(pointer, size, xt::no_ownership(), shape)`
  /// for a `const W*` prvalue pointer and a `shape_type` shape.
  template <class W>
  using result_view = xt::xarray_adaptor<xt::xbuffer_adaptor<const W*, xt::no_ownership, std::allocator<W>>,
                                         xt::layout_type::row_major, shape_type>;

  /// @brief A view of the row-major values at `data` with dimensions `dims`; `data` must hold
  /// the product of `dims` elements and outlive every use of the view.
  /// @throws error(errc::invalid_record) for a rank above `gradaccum::max_rank`.
  template <class T>
  static view<T> view_of(const T* data, const shape_type& dims) {
    return {data, tensor_shape(std::span<const std::size_t>(dims.data(), dims.size()))};
  }

  /// @brief The view of a container, adaptor or strided view, through its strides.
  /// @throws error(errc::invalid_record) for a rank above `gradaccum::max_rank`.
  template <detail::xtensor_strided X>
  static view<typename X::value_type> view_of(const X& x) {
    std::array<std::size_t, max_rank + 1> dims{};
    std::array<std::ptrdiff_t, max_rank + 1> strides{};
    const std::size_t rank = std::min<std::size_t>(x.shape().size(), max_rank + 1);
    std::copy_n(x.shape().begin(), rank, dims.begin());
    std::copy_n(x.strides().begin(), rank, strides.begin());
    return {x.data() + x.data_offset(), tensor_shape(std::span<const std::size_t>(dims.data(), rank)),
            std::span<const std::ptrdiff_t>(strides.data(), rank)};
  }

  /// @brief Any other xtensor expression, as the class comment says.
  template <class Y, class X = std::remove_cvref_t<Y>>
    requires detail::xtensor_input<X, element_types>
  static auto adapt(Y&& y) {
    if constexpr (detail::xtensor_strided<X> && !detail::xtensor_owning<X>) {
      return view_of(y);
    } else if constexpr (detail::xtensor_strided<X> && std::is_lvalue_reference_v<Y>) {
      // May be a temporary: `c += 1` returns an lvalue reference whatever c is.
      return copied_view<typename X::value_type>{view_of(y)};
    } else {
      return tensor<typename X::value_type>(std::forward<Y>(y));
    }
  }

  template <class T>
  static tensor_shape shape(const tensor<T>& x) {
    const auto& dims = x.shape();
    return tensor_shape(std::span<const std::size_t>(dims.data(), dims.size()));
  }
  template <class T>
  static tensor_shape shape(const view<T>& x) noexcept {
    return x.shape();
  }

  template <class X>
  static device_type device(const X& /*x*/) noexcept {
    return {};
  }

  /// acc += scale · W(g), one pass over contiguous storage (both row-major).
  template <class W, class T>
  static void add_scaled(std::span<W> acc, const tensor<T>& g, W scale) noexcept {
    kernels::add_scaled(acc.data(), g.data(), acc.size(), scale);
  }
  /// acc += scale · W(g) through g's strides (one pass when they are row-major).
  template <class W, class T>
  static void add_scaled(std::span<W> acc, const view<T>& g, W scale) noexcept {
    gradaccum::add_scaled(acc, g, scale);
  }

  template <class W>
  static result_view<W> map(std::span<const W> values, const tensor_shape& s, const device_type& /*device*/) {
    return result_view<W>(typename result_view<W>::storage_type(values.data(), values.size()), to_shape_type(s));
  }

  /// An owned copy in element type W (a plain copy when W is the input's element type).
  template <class W, class T>
  static tensor<W> convert(const tensor<T>& x) {
    tensor<W> out(x.shape());
    if constexpr (std::is_same_v<T, W>) {
      std::copy_n(x.data(), x.size(), out.data());
    } else {
      kernels::convert(out.data(), x.data(), x.size());
    }
    return out;
  }
  template <class W, class T>
  static tensor<W> convert(const view<T>& x) {
    tensor<W> out(to_shape_type(x.shape()));
    copy_row_major(x, std::span<W>(out.data(), out.size()));
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

 private:
  static shape_type to_shape_type(const tensor_shape& s) { return {s.begin(), s.end()}; }
};

}  // namespace gradaccum
