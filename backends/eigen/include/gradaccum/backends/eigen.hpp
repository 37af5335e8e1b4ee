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
#include <string>

#include <Eigen/Core>

#include "gradaccum/backend.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
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
/// A matrix has shape [rows, cols]. Records store values row-major, so a record written here
/// restores into any other backend with the same shapes. Matrices own contiguous host memory,
/// which `data` exposes (`host_memory_backend`).
struct eigen_backend {
  using device_type = eigen_cpu_device;
  using element_types = type_list<Eigen::half, Eigen::bfloat16, float, double>;
  template <class T>
  using tensor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
  template <class T>
  using view = Eigen::Map<const tensor<T>>;

  /// Views store their dimensions: a view's shape never changes once it is made.
  static constexpr bool views_keep_geometry = true;

  template <class X>
  static tensor_shape shape(const X& x) {
    return {static_cast<std::size_t>(x.rows()), static_cast<std::size_t>(x.cols())};
  }

  /// shape(x) == s, comparing the dimensions in place.
  template <class X>
  static bool has_shape(const X& x, const tensor_shape& s) noexcept {
    return s.rank() == 2 && s[0] == static_cast<std::size_t>(x.rows()) && s[1] == static_cast<std::size_t>(x.cols());
  }

  template <class X>
  static device_type device(const X& /*x*/) noexcept {
    return {};
  }

  /// The storage, column-major.
  template <class T>
  static T* data(tensor<T>& t) noexcept {
    return t.data();
  }

  /// A matrix's shape is [rows, cols], so only rank-2 shapes are represented: a [n] or []
  /// tensor would come back as [n, 1] or [1, 1], and a [1, 2, 3] one lose an axis.
  static bool represents(const tensor_shape& s) noexcept { return s.rank() == 2; }

  template <class W>
  static tensor<W> zeros(const tensor_shape& s, const device_type& /*device*/) {
    const auto [rows, cols] = rows_cols(s);
    return tensor<W>::Zero(rows, cols);
  }

  /// acc += scale · W(g), one pass over contiguous storage.
  template <class W, class X>
  static void add_scaled(tensor<W>& acc, const X& g, W scale) noexcept {
    kernels::add_scaled(acc.data(), g.data(), static_cast<std::size_t>(acc.size()), scale);
  }

  /// acc = (acc / first) / second.
  template <class W>
  static void divide(tensor<W>& acc, W first, W second) noexcept {
    kernels::divide(acc.data(), static_cast<std::size_t>(acc.size()), first, second);
  }

  template <class W>
  static bool all_finite(const tensor<W>& t) noexcept {
    return kernels::all_finite(t.data(), static_cast<std::size_t>(t.size()));
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

  template <class T>
  static tensor<T> uninitialized(const tensor_shape& s, const device_type& /*device*/) {
    const auto [rows, cols] = rows_cols(s);
    return tensor<T>(rows, cols);
  }

  /// Column-major storage is row-major order too when there is one row or one column.
  template <class T>
  static T* row_major_data(tensor<T>& t) noexcept {
    return t.rows() <= 1 || t.cols() <= 1 ? t.data() : nullptr;
  }
  template <class T>
  static const T* row_major_data(const tensor<T>& t) noexcept {
    return t.rows() <= 1 || t.cols() <= 1 ? t.data() : nullptr;
  }

 private:
  struct extent {
    Eigen::Index rows;
    Eigen::Index cols;
  };
  /// @throws error(errc::parameter_mismatch) for a shape a matrix cannot have (`represents`).
  static extent rows_cols(const tensor_shape& s) {
    if (!represents(s)) {
      detail::fail(errc::parameter_mismatch, "an Eigen matrix cannot have shape " + s.to_string() + ".");
    }
    return {static_cast<Eigen::Index>(s[0]), static_cast<Eigen::Index>(s[1])};
  }
};

static_assert(serializable_backend<eigen_backend> && host_memory_backend<eigen_backend>);

}  // namespace gradaccum
