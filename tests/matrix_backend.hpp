#pragma once
/// @file
/// @brief `matrix_backend`: a test-only backend over a small Armadillo-like matrix library that
/// declares no views and no `adapt`, for the generic input rules of
/// `<gradaccum/detail/gradient_input.hpp>`: a derived type (`lab::col` of `lab::mat`) and an
/// expression the matrix is built from (`lab::scaled`) go in as the matrix; anything else is
/// refused with one diagnostic.

#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include <gradaccum/backend.hpp>
#include <gradaccum/kernels.hpp>
#include <gradaccum/shape.hpp>
#include <gradaccum/type_list.hpp>

namespace lab {

template <class T>
struct scaled;

/// Row-major rows x cols values.
template <class T>
struct mat {
  using elem_type = T;
  std::vector<T> values;
  std::size_t rows = 0;
  std::size_t cols = 0;

  mat(std::size_t r, std::size_t c, T fill = T{}) : values(r * c, fill), rows(r), cols(c) {}
  mat(const scaled<T>& e) : mat(e.m.rows, e.m.cols) {  // NOLINT(google-explicit-constructor): as Armadillo's
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = e.factor * e.m.values[i];
    ++evaluations;
  }
  static inline int evaluations = 0;
};

/// A column vector is a one-column matrix.
template <class T>
struct col : mat<T> {
  explicit col(std::size_t n, T fill = T{}) : mat<T>(n, 1, fill) {}
};

/// A lazy `factor * m`.
template <class T>
struct scaled {
  using elem_type = T;
  const mat<T>& m;
  T factor;
};
template <class T>
scaled<T> operator*(T factor, const mat<T>& m) {
  return {m, factor};
}

/// Neither a matrix nor convertible to one.
struct cube {
  using elem_type = float;
};

}  // namespace lab

namespace gradaccum::test {

struct matrix_backend {
  using device_type = int;
  using element_types = type_list<float, double>;
  template <class T>
  using tensor = lab::mat<T>;

  template <class T>
  static tensor_shape shape(const tensor<T>& x) {
    return {x.rows, x.cols};
  }
  template <class T>
  static device_type device(const tensor<T>& /*x*/) noexcept {
    return 0;
  }
  template <class W, class T>
  static void add_scaled(std::span<W> acc, const tensor<T>& g, W scale) noexcept {
    kernels::add_scaled(acc.data(), g.values.data(), acc.size(), scale);
  }
  template <class W>
  static std::span<const W> map(std::span<const W> values, const tensor_shape& /*shape*/,
                                const device_type& /*device*/) noexcept {
    return values;
  }
  template <class W, class T>
  static tensor<W> convert(const tensor<T>& x) {
    tensor<W> out(x.rows, x.cols);
    for (std::size_t i = 0; i < x.values.size(); ++i) out.values[i] = static_cast<W>(x.values[i]);
    return out;
  }
};

static_assert(tensor_backend<matrix_backend>);

}  // namespace gradaccum::test
