#pragma once
/// @file
/// @brief Eigen backend: `gradaccum::eigen_backend`.
///
/// Eigen already gives dense matrices and arrays of `Eigen::half`, `Eigen::bfloat16`, `float` and
/// `double` in any size and storage order, maps, blocks and expressions, and (in the Tensor
/// module) tensors of any rank. This header adds the traits that let the core accumulate them:
/// every dense Eigen object goes in as a parameter or gradient, and the fused convert-scale-add
/// runs the core's kernels on the raw storage, because Eigen's half/bfloat16 casts are scalar and
/// run several times below memory speed.
///
/// What goes in, and as what (`eigen_backend::adapt`):
/// - `Eigen::Matrix<T, Dynamic, Dynamic>` (`tensor<T>`): stored, copied or moved.
/// - An object that does not own its storage — `Map` (const or mutable, with strides), `Ref`,
///   blocks, rows, columns, transposes, `Eigen::TensorMap` of rank up to `gradaccum::max_rank`:
///   read in place through its strides (`view<T>`, a `gradaccum::strided_view`); the memory must
///   outlive the accumulation call.
/// - Any other object that owns its storage — vectors, fixed-size or row-major matrices, arrays,
///   `Eigen::Tensor`: copied at insert, as its storage is laid out, into storage the entry keeps
///   (reused by `insert_or_assign`, so no allocation per microbatch), then read like a view. An
///   lvalue is copied too: `Eigen::VectorXf(n).setOnes()` is an lvalue reference to a temporary,
///   which no compiler tells from a named vector. `gradaccum::view(v)` reads `v` in place instead
///   (v must then outlive the accumulation calls). A temporary vector or matrix is copied into a
///   `tensor<T>`.
/// - An expression (`2.0F * g`, `MatrixXf::Constant(2, 3, 1.0F)`): evaluated once, at insert,
///   into a `tensor<T>`.
///
/// Shapes: a column vector type (`ColsAtCompileTime == 1`: `VectorXf`, `Vector3f`, `ArrayXf`,
/// `m.col(j)`) is `[n]`; everything else of the Core module is `[rows, cols]` (so `RowVectorXf`
/// and `m.row(i)` are `[1, n]`); an `Eigen::Tensor<T, N>` is its N dimensions in index order.
/// As in an Eigen assignment, `[n]` is the same shape as `[n, 1]` and `[]` as `[1, 1]`
/// (`canonical_shape`): an `n x 1` matrix gradient is accepted for a `VectorXf` parameter.
/// Results keep the parameter's shape and show as row-major matrices (`[n]` as `n x 1`, a rank
/// above 2 as `d0 x (d1 · d2 · ...)`, its row-major flattening).
///
/// @code
/// params.add("fc.bias", bias);                       // Eigen::VectorXf: shape [n]
/// grads.insert("fc.weight", dW.block(0, 0, 2, 3));   // read in place, strided
/// grads.insert("fc.bias", 2.0F * db);                // evaluated once, here
/// grads.insert("emb", emb_grad);                     // an Eigen::VectorXf: copied
/// grads.insert("head", gradaccum::view(head_grad));  // read in place: must outlive the calls
/// @endcode

#include <array>
#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "gradaccum/backend.hpp"
#include "gradaccum/detail/gradient_input.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/shape.hpp"
#include "gradaccum/strided_view.hpp"
#include "gradaccum/type_list.hpp"

namespace gradaccum {

template <>
struct element_dtype<Eigen::half> {
  static constexpr float_dtype value = float_dtype::f16;
};
template <>
struct element_dtype<Eigen::bfloat16> {
  static constexpr float_dtype value = float_dtype::bf16;
};

/// @brief Eigen matrices live in host memory: one device, equal to itself.
struct eigen_cpu_device {
  friend constexpr bool operator==(eigen_cpu_device, eigen_cpu_device) noexcept { return true; }
};

namespace detail {

using eigen_elements = type_list<Eigen::half, Eigen::bfloat16, float, double>;

template <class X>
concept eigen_dense =
    std::is_base_of_v<Eigen::DenseBase<X>, X> && list_contains<typename X::Scalar, eigen_elements>::value;

template <class X>
concept eigen_direct = eigen_dense<X> && (int{X::Flags} & int{Eigen::DirectAccessBit}) != 0;

/// An object of the Tensor module with storage (`Eigen::Tensor`, `TensorFixedSize`, `TensorMap`),
/// recognized by its members so that this header needs the Tensor module only if the caller uses it.
template <class X>
concept eigen_tensor_storage = requires(const X& x) {
  typename X::Scalar;
  typename X::Dimensions;
  X::NumIndices;
  X::Layout;
  { x.data() } -> std::convertible_to<const typename X::Scalar*>;
  x.dimensions();
} && list_contains<typename X::Scalar, eigen_elements>::value;

/// Matrices, arrays and tensors own their storage; maps and blocks do not. A `Ref` may (a
/// `Ref<const M>` bound to an expression holds its evaluation), so a temporary one counts as owning.
template <class X>
concept eigen_owning = std::is_base_of_v<Eigen::PlainObjectBase<X>, X> || std::is_base_of_v<Eigen::RefBase<X>, X> ||
                       (eigen_tensor_storage<X> && !requires { typename X::StorageRefType; });

}  // namespace detail

/// @brief Traits that adapt dense Eigen objects to `serializable_backend` (see the file comment).
///
/// Sums and records hold values row-major, so a record written here restores into any other
/// backend with the same shapes; results are handed out as `Eigen::Map`s of row-major matrices
/// over the window's buffer, which any Eigen expression takes (`w -= lr * *g`).
struct eigen_backend {
  using device_type = eigen_cpu_device;
  using element_types = detail::eigen_elements;
  template <class T>
  using tensor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
  /// Caller memory of any layout, read in place.
  template <class T>
  using view = strided_view<const T>;
  /// A result: row-major values of the window's buffer, read in place.
  template <class W>
  using result_view = Eigen::Map<const Eigen::Matrix<W, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

  /// @brief The view of a dense object with direct access: `[n]` for a column vector type, else
  /// `[rows, cols]`, with its row and column strides.
  /// (tensor_shape's constructor throws only above max_rank, which a matrix's rank 1 or 2 is not.)
  template <detail::eigen_direct X>
  static view<typename X::Scalar> view_of(const X& x) noexcept {  // NOLINT(bugprone-exception-escape)
    const auto rows = static_cast<std::size_t>(x.rows());
    if constexpr (X::ColsAtCompileTime == 1) {
      return {x.data(), tensor_shape{rows}, {static_cast<std::ptrdiff_t>(x.innerStride())}};
    } else {
      return {x.data(),
              tensor_shape{rows, static_cast<std::size_t>(x.cols())},
              {static_cast<std::ptrdiff_t>(x.rowStride()), static_cast<std::ptrdiff_t>(x.colStride())}};
    }
  }

  /// @brief The view of an `Eigen::Tensor` or `Eigen::TensorMap`: its dimensions in index order.
  /// @throws error(errc::invalid_record) for a rank above `gradaccum::max_rank`.
  template <detail::eigen_tensor_storage X>
  static view<typename X::Scalar> view_of(const X& x) {
    constexpr std::size_t rank = X::NumIndices;
    std::array<std::size_t, rank> dims{};
    std::array<std::ptrdiff_t, rank> strides{};
    std::ptrdiff_t stride = 1;
    for (std::size_t k = 0; k < rank; ++k) {
      // Column-major storage runs over the first index fastest, row-major over the last.
      const std::size_t axis = int{X::Layout} == int{Eigen::RowMajor} ? rank - 1 - k : k;
      dims[axis] = static_cast<std::size_t>(x.dimension(static_cast<Eigen::Index>(axis)));
      strides[axis] = stride;
      stride *= static_cast<std::ptrdiff_t>(dims[axis]);
    }
    return {x.data(), tensor_shape(std::span<const std::size_t>(dims)), std::span<const std::ptrdiff_t>(strides)};
  }

  /// @brief Any other dense object, as the file comment says: a view of storage that the object
  /// does not own, a copy of one that does (`copied_view`: an lvalue such as
  /// `Eigen::VectorXf(n).setOnes()` may be a temporary), or an evaluated expression.
  template <class Y, class X = std::remove_cvref_t<Y>>
    requires detail::eigen_dense<X> || detail::eigen_tensor_storage<X>
  static auto adapt(Y&& y) {
    if constexpr (detail::eigen_tensor_storage<X>) {
      if constexpr (detail::eigen_owning<X>) {
        return copied_view<typename X::Scalar>{view_of(y)};
      } else {
        return view_of(y);
      }
    } else if constexpr (detail::eigen_direct<X> &&
                         (!detail::eigen_owning<X> ||
                          (std::is_lvalue_reference_v<Y> && std::is_base_of_v<Eigen::RefBase<X>, X>))) {
      // A map, block, row, column or transpose is the caller's memory; a named Ref is a view by
      // type (what it evaluated lives as long as it does).
      return view_of(y);
    } else if constexpr (detail::eigen_direct<X> && std::is_lvalue_reference_v<Y>) {
      return copied_view<typename X::Scalar>{view_of(y)};
    } else {
      return tensor<typename X::Scalar>(std::forward<Y>(y));
    }
  }

  /// Vectors are columns, as in Eigen: `[n]` is `[n, 1]` and `[]` is `[1, 1]`.
  static tensor_shape canonical_shape(const tensor_shape& s) {
    switch (s.rank()) {
      case 0: return {1, 1};
      case 1: return {s[0], 1};
      default: return s;
    }
  }

  template <class T>
  static tensor_shape shape(const tensor<T>& x) {
    return {static_cast<std::size_t>(x.rows()), static_cast<std::size_t>(x.cols())};
  }
  template <class T>
  static tensor_shape shape(const view<T>& x) noexcept {
    return x.shape();
  }

  template <class X>
  static device_type device(const X& /*x*/) noexcept {
    return {};
  }

  /// acc (row-major) += scale · W(g): one pass for vectors, a tiled transpose otherwise.
  template <class W, class T>
  static void add_scaled(std::span<W> acc, const tensor<T>& g, W scale) noexcept {
    gradaccum::add_scaled(acc, view_of(g), scale);
  }
  template <class W, class T>
  static void add_scaled(std::span<W> acc, const view<T>& g, W scale) noexcept {
    gradaccum::add_scaled(acc, g, scale);
  }

  template <class W>
  static result_view<W> map(std::span<const W> values, const tensor_shape& s, const device_type& /*device*/) noexcept {
    const auto [rows, cols] = rows_cols(s);
    return result_view<W>(values.data(), rows, cols);
  }

  /// An owned copy in element type W (the identity for W equal to the input's type).
  template <class W, class T>
  static tensor<W> convert(const tensor<T>& x) {
    tensor<W> out(x.rows(), x.cols());
    if constexpr (std::is_same_v<T, W>) {
      out = x;
    } else {
      kernels::convert(out.data(), x.data(), static_cast<std::size_t>(x.size()));
    }
    return out;
  }
  /// A view's values as a row-major matrix (see `map` for shapes of rank other than 2).
  template <class W, class T>
  static tensor<W> convert(const view<T>& x) {
    std::vector<W> values(x.size());
    copy_row_major(x, std::span<W>(values));
    const auto [rows, cols] = rows_cols(x.shape());
    return Eigen::Map<const Eigen::Matrix<W, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(values.data(), rows,
                                                                                               cols);
  }

  /// Copies to row-major order: out[r * cols + c] = t(r, c).
  template <class T>
  static void to_row_major(const tensor<T>& t, std::span<T> out) {
    Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(out.data(), t.rows(), t.cols()) = t;
  }

  /// @throws error(errc::parameter_mismatch) for a rank above 2, which a matrix cannot hold.
  template <class T>
  static tensor<T> from_row_major(std::span<const T> values, const tensor_shape& s, const device_type& /*device*/) {
    if (s.rank() > 2) {
      detail::fail(errc::parameter_mismatch,
                   {"an Eigen matrix cannot hold a tensor of shape ", s.dims(), "; accumulate it instead."});
    }
    const auto [rows, cols] = rows_cols(s);
    return Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(values.data(), rows,
                                                                                               cols);
  }

 private:
  struct extent {
    Eigen::Index rows;
    Eigen::Index cols;
  };
  static extent rows_cols(const tensor_shape& s) noexcept {
    const auto dim = [&](std::size_t axis) { return static_cast<Eigen::Index>(s[axis]); };
    Eigen::Index rest = 1;
    for (std::size_t axis = 1; axis < s.rank(); ++axis) rest *= dim(axis);
    return s.rank() == 0 ? extent{1, 1} : extent{dim(0), rest};
  }
};

}  // namespace gradaccum
