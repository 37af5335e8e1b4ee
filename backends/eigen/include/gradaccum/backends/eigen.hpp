#pragma once
/// @file
/// @brief Eigen backend: `gradaccum::eigen_backend`.
///
/// Eigen already gives dense matrices of `Eigen::half`, `Eigen::bfloat16`, `float` and `double`,
/// casts between them, and `Eigen::Map` views of caller memory. This header adds the traits
/// that let the core accumulate them: gradients are `Eigen::Matrix<T, Dynamic, Dynamic>` or
/// `Eigen::Map<const Eigen::Matrix<T, Dynamic, Dynamic>>` (read in place, no copy), and the
/// fused convert-scale-add runs the core's kernels on the raw storage, because Eigen's
/// half/bfloat16 casts are scalar and run several times below memory speed.

#include <cstddef>
#include <span>

#include <Eigen/Core>

#include "gradaccum/backend.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/shape.hpp"
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

/// @brief Traits that adapt dense, column-major Eigen matrices to `tensor_backend`.
///
/// A matrix has shape [rows, cols]. Sums and records hold values row-major, so a record written
/// here restores into any other backend with the same shapes; results are handed out as
/// `Eigen::Map`s of row-major matrices over the window's buffer, which any Eigen expression
/// takes (`w -= lr * *g`).
struct eigen_backend {
  using device_type = eigen_cpu_device;
  using element_types = type_list<Eigen::half, Eigen::bfloat16, float, double>;
  template <class T>
  using tensor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
  template <class T>
  using view = Eigen::Map<const tensor<T>>;
  /// A result: row-major values of the window's buffer, read in place.
  template <class W>
  using result_view = Eigen::Map<const Eigen::Matrix<W, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

  template <class X>
  static tensor_shape shape(const X& x) {
    return {static_cast<std::size_t>(x.rows()), static_cast<std::size_t>(x.cols())};
  }

  template <class X>
  static device_type device(const X& /*x*/) noexcept {
    return {};
  }

  /// acc += scale · W(g), acc row-major: one pass for vectors, a tiled transpose otherwise.
  template <class W, class X>
  static void add_scaled(std::span<W> acc, const X& g, W scale) noexcept {
    if (g.rows() <= 1 || g.cols() <= 1) {
      kernels::add_scaled(acc.data(), g.data(), acc.size(), scale);
    } else {
      kernels::add_scaled_transposed(acc.data(), g.data(), static_cast<std::size_t>(g.rows()),
                                     static_cast<std::size_t>(g.cols()), scale);
    }
  }

  template <class W>
  static result_view<W> map(std::span<const W> values, const tensor_shape& s, const device_type& /*device*/) noexcept {
    const auto [rows, cols] = rows_cols(s);
    return result_view<W>(values.data(), rows, cols);
  }

  /// An owned copy in element type W (the identity for W equal to the input's type).
  template <class W, class X>
  static tensor<W> convert(const X& x) {
    tensor<W> out(x.rows(), x.cols());
    using T = typename X::Scalar;
    if constexpr (std::is_same_v<T, W>) {
      out = x;
    } else {
      kernels::convert(out.data(), x.data(), static_cast<std::size_t>(x.size()));
    }
    return out;
  }

  /// Copies to row-major order: out[r * cols + c] = t(r, c).
  template <class T>
  static void to_row_major(const tensor<T>& t, std::span<T> out) {
    Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(out.data(), t.rows(), t.cols()) = t;
  }

  template <class T>
  static tensor<T> from_row_major(std::span<const T> values, const tensor_shape& s, const device_type& /*device*/) {
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
    switch (s.rank()) {
      case 0: return {1, 1};
      case 1: return {dim(0), 1};
      default: return {dim(0), dim(1)};
    }
  }
};

static_assert(serializable_backend<eigen_backend>);

}  // namespace gradaccum
