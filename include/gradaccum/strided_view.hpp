#pragma once
/// @file
/// @brief `strided_view<T>`: caller memory of any rank read in place through element strides.
///
/// @code
/// // A 2 x 3 block of a column-major 4 x 5 matrix m: element (r, c) is at m + r + 4 * c.
/// gradaccum::strided_view<const float> block(m, {2, 3}, {1, 4});
/// gradaccum::add_scaled(acc, block, 2.0F);   // acc (row-major, 6 elements) += 2 · block
/// gradaccum::copy_row_major(block, out);      // out = block, row-major
/// @endcode
///
/// Host backends use `strided_view<const T>` as their `view<T>`: one type per element type,
/// whatever the layout of the caller's object (row- or column-major, a block, a transpose, a
/// strided slice), keeps the variant of stored gradients small, and its `add_scaled` takes the
/// contiguous kernel whenever the strides allow it, so every layout gives the same bits.
///
/// Also here, for what goes into a `gradients_params`: `copied_view<T>` (what a backend's `adapt`
/// returns for an object that owns its storage: copied at insert) and `gradaccum::view(x)` (read
/// `x` in place instead).

#include <array>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <type_traits>

#include "gradaccum/dtype.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum {

/// @brief A view of `shape` elements at `data`: element (i0, ..., ik) is
/// `data[i0 · strides[0] + ... + ik · strides[k]]` (strides in elements, possibly negative or 0).
///
/// It never owns: the memory must outlive every use of the view.
template <class T>
class strided_view {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;

  constexpr strided_view() noexcept = default;

  /// Row-major contiguous values.
  constexpr strided_view(T* data, const tensor_shape& shape) noexcept : data_(data), shape_(shape) {
    std::ptrdiff_t stride = 1;
    for (std::size_t axis = shape.rank(); axis-- > 0;) {
      strides_[axis] = stride;
      stride *= static_cast<std::ptrdiff_t>(shape[axis]);
    }
  }

  /// Precondition: `strides.size() == shape.rank()`.
  constexpr strided_view(T* data, const tensor_shape& shape, std::span<const std::ptrdiff_t> strides) noexcept
      : data_(data), shape_(shape) {
    for (std::size_t axis = 0; axis < shape.rank(); ++axis) strides_[axis] = strides[axis];
    row_major_contiguous_ = contiguous_in_row_major();
  }
  constexpr strided_view(T* data, const tensor_shape& shape, std::initializer_list<std::ptrdiff_t> strides) noexcept
      : strided_view(data, shape, std::span(strides.begin(), strides.size())) {}

  /// A view of mutable memory is also a read-only view.
  template <class U>
    requires std::is_same_v<const U, T> && (!std::is_same_v<U, T>)
  constexpr strided_view(const strided_view<U>& other) noexcept  // NOLINT(google-explicit-constructor)
      : strided_view(other.data(), other.shape(), other.strides()) {}

  [[nodiscard]] constexpr T* data() const noexcept { return data_; }
  [[nodiscard]] constexpr const tensor_shape& shape() const noexcept { return shape_; }
  [[nodiscard]] constexpr std::span<const std::ptrdiff_t> strides() const noexcept {
    return {strides_.data(), shape_.rank()};
  }
  [[nodiscard]] constexpr std::size_t size() const noexcept { return *shape_.checked_element_count(); }

  /// True when the elements are `data()[0 .. size())` in row-major order (unit axes' strides
  /// do not matter): the layout every contiguous tensor of either storage order reaches as a
  /// view of its row-major positions once its order is that of the shape. Known from the
  /// strides, so it is found once, when the view is made.
  [[nodiscard]] constexpr bool row_major_contiguous() const noexcept { return row_major_contiguous_; }

 private:
  constexpr bool contiguous_in_row_major() const noexcept {
    std::ptrdiff_t expected = 1;
    for (std::size_t axis = shape_.rank(); axis-- > 0;) {
      if (shape_[axis] == 1) continue;
      if (strides_[axis] != expected) return false;
      expected *= static_cast<std::ptrdiff_t>(shape_[axis]);
    }
    return true;
  }

  T* data_ = nullptr;
  tensor_shape shape_;
  std::array<std::ptrdiff_t, max_rank> strides_{};
  bool row_major_contiguous_ = true;
};

/// @brief `acc[i] = acc[i] + scale · W(g[i])` over g's elements in row-major order, with the
/// arithmetic of `kernels::add_scaled` (see `kernels::add_scaled_strided`).
template <class W, class T>
void add_scaled(std::span<W> acc, const strided_view<T>& g, W scale) noexcept {
  // The contiguous case is the common one: taken here, its loop runs with the few registers
  // it needs (inlined into the strided walk, a 4 KiB add ran 1.5x slower on spilled pointers).
  if (g.row_major_contiguous()) {
    kernels::add_scaled(acc.data(), g.data(), acc.size(), scale);
  } else {
    kernels::add_scaled_strided(acc.data(), g.data(), g.shape().dims(), g.strides(), scale);
  }
}

/// @brief `out[i] = U(g[i])` over g's elements in row-major order; `out.size()` is `g.size()`.
/// `U` is g's element type (a copy) or a work type (an exact conversion, F64 → F32 rounding).
template <class U, class T>
void copy_row_major(const strided_view<T>& g, std::span<U> out) noexcept {
  const std::size_t rank = g.shape().rank();
  if (out.empty()) return;
  std::array<std::size_t, max_rank> index{};
  std::ptrdiff_t offset = 0;
  for (U& value : out) {
    if constexpr (std::is_same_v<U, std::remove_cv_t<T>>) {
      value = g.data()[offset];
    } else {
      value = kernels::to_work<U>(g.data()[offset]);
    }
    for (std::size_t axis = rank; axis-- > 0;) {
      if (++index[axis] < g.shape()[axis]) {
        offset += g.strides()[axis];
        break;
      }
      offset -= g.strides()[axis] * static_cast<std::ptrdiff_t>(g.shape()[axis] - 1);
      index[axis] = 0;
    }
  }
}

/// @brief What a backend's `adapt` returns for values the library must not keep a view of: an
/// object that owns its storage, given as an lvalue. No compiler tells `Eigen::VectorXf v; v`
/// from `Eigen::VectorXf(n).setOnes()` (an lvalue reference to a temporary), so both are copied
/// at insert: `gradients_params` copies the storage `view` spans into storage its entry keeps
/// (reused by `insert_or_assign`) and reads the copy through the same strides. For a host
/// backend whose `view<T>` is `strided_view<const T>`.
template <class T>
struct copied_view {
  strided_view<const T> view;
};

/// @brief The object `insert` is given through `gradaccum::view(x)`: read in place.
template <class X>
struct in_place {
  const X& object;
};

/// @brief Asks `gradients_params::insert` to read `x` in place rather than copy it, as it does
/// an object that owns its storage: `x` must then outlive every accumulation call that reads it
/// (a buffer the backward pass rewrites, inserted once). Maps, blocks, `Ref`s, xtensor views
/// and adaptors are read in place without it. A temporary is refused (it would dangle).
template <class X>
[[nodiscard]] constexpr in_place<X> view(const X& x) noexcept {
  return {x};
}
template <class X>
void view(const X&&) = delete;

}  // namespace gradaccum
