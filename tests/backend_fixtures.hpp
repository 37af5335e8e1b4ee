#pragma once
/// @file
/// @brief What the conformance suite needs to know about each backend, and the list of backends
/// it runs against.
///
/// Adding a backend takes a `backend_fixture<B>` specialization (its devices and, if it has
/// views, how to view a tensor) and one entry in `GRADACCUM_TEST_BACKENDS`. Everything else is
/// generic: tensors are made and read back through the backend's own row-major conversions.

#include <cstddef>
#include <initializer_list>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>

#include "device_backend.hpp"
#include "test_backend.hpp"
#include "test_helpers.hpp"

#if GRADACCUM_TEST_HAVE_EIGEN
#include <gradaccum/backends/eigen.hpp>
#endif
#if GRADACCUM_TEST_HAVE_TORCH
#include <gradaccum/backends/torch.hpp>
#endif
#if GRADACCUM_TEST_HAVE_XTENSOR && __has_include(<gradaccum/backends/xtensor.hpp>)
#include <gradaccum/backends/xtensor.hpp>
#define GRADACCUM_TEST_XTENSOR 1
#endif

namespace gradaccum::test {

/// @brief Per-backend facts the generic tests cannot derive from the backend itself:
/// `device()`, `other_device()` (a second device, if there is one) and `view_of(tensor)`
/// (for backends with views).
template <class B>
struct backend_fixture;

template <>
struct backend_fixture<vector_backend> {
  static int device() noexcept { return 0; }
  static std::optional<int> other_device() noexcept { return 1; }
  template <class T>
  static vector_backend::view<T> view_of(const vector_backend::tensor<T>& t) noexcept {
    return {t.values, t.shape, t.device};
  }
};

/// Its tensors and views are `vector_backend`'s.
template <>
struct backend_fixture<device_backend> : backend_fixture<vector_backend> {
  /// A result's values, read from the view `get<W>` gives.
  template <class W>
  static std::vector<W> values_of(const device_backend::view<W>& result) {
    return {result.values.begin(), result.values.end()};
  }
};

#if GRADACCUM_TEST_HAVE_EIGEN
template <>
struct backend_fixture<eigen_backend> {
  static eigen_cpu_device device() noexcept { return {}; }
  static std::optional<eigen_cpu_device> other_device() noexcept { return std::nullopt; }
  template <class T>
  static eigen_backend::view<T> view_of(const eigen_backend::tensor<T>& t) noexcept {
    return eigen_backend::view_of(t);
  }
};
#define GRADACCUM_TEST_EIGEN_BACKEND , gradaccum::eigen_backend
#else
#define GRADACCUM_TEST_EIGEN_BACKEND
#endif

#if GRADACCUM_TEST_XTENSOR
template <>
struct backend_fixture<xtensor_backend> {
  static xtensor_cpu_device device() noexcept { return {}; }
  static std::optional<xtensor_cpu_device> other_device() noexcept { return std::nullopt; }
  template <class T>
  static xtensor_backend::view<T> view_of(const xtensor_backend::tensor<T>& t) {
    return xtensor_backend::view_of(t.data(), t.shape());
  }
};
#define GRADACCUM_TEST_XTENSOR_BACKEND , gradaccum::xtensor_backend
#else
#define GRADACCUM_TEST_XTENSOR_BACKEND
#endif

#if GRADACCUM_TEST_HAVE_TORCH
/// libtorch's CPU build has no second device with values (the meta device has none, and
/// `adapt` refuses it), so the tests of a gradient on another device do not run here;
/// test_torch_inputs.cpp checks that a meta gradient is refused.
template <>
struct backend_fixture<torch_backend> {
  static c10::Device device() noexcept { return c10::Device(c10::kCPU); }
  static std::optional<c10::Device> other_device() noexcept { return std::nullopt; }
  /// A result's values, read from the tensor `get<W>` gives (a view of the window's buffer).
  template <class W>
  static std::vector<W> values_of(const at::Tensor& result) {
    const at::Tensor host = result.contiguous().cpu();
    const W* const data = host.data_ptr<W>();
    return {data, data + host.numel()};
  }
};
#define GRADACCUM_TEST_TORCH_BACKEND , gradaccum::torch_backend
#else
#define GRADACCUM_TEST_TORCH_BACKEND
#endif

}  // namespace gradaccum::test

/// @brief Every backend the conformance suite runs against (for `TEST_CASE_TEMPLATE`); each
/// optional backend's entry is empty when its dependency was not found.
#define GRADACCUM_TEST_BACKENDS                                                                 \
  gradaccum::test::vector_backend, gradaccum::test::device_backend GRADACCUM_TEST_EIGEN_BACKEND \
                                       GRADACCUM_TEST_XTENSOR_BACKEND GRADACCUM_TEST_TORCH_BACKEND

TYPE_TO_STRING(gradaccum::test::vector_backend);
TYPE_TO_STRING(gradaccum::test::device_backend);
#if GRADACCUM_TEST_HAVE_EIGEN
TYPE_TO_STRING(gradaccum::eigen_backend);
#endif
#if GRADACCUM_TEST_XTENSOR
TYPE_TO_STRING(gradaccum::xtensor_backend);
#endif
#if GRADACCUM_TEST_HAVE_TORCH
TYPE_TO_STRING(gradaccum::torch_backend);
#endif

namespace gradaccum::test {

template <class B, class T>
using tensor_t = typename B::template tensor<T>;

/// @brief The element type of backend B with dtype D, or void when B has none.
template <class B, float_dtype D>
using element_t = typename detail::element_with_dtype<typename B::element_types, D>::type;

template <class B>
using device_t = typename B::device_type;

/// @brief Runs `body.template operator()<W>()` for W = float and double (work dtypes F32 and F64).
template <class F>
void for_each_work_type(F&& body) {
  body.template operator()<float>();
  body.template operator()<double>();
}

/// @brief Runs `body.template operator()<T>()` for B's F16 and BF16 element types, if it has them.
template <class B, class F>
void for_each_16bit_type(F&& body) {
  using f16_type = element_t<B, float_dtype::f16>;
  using bf16_type = element_t<B, float_dtype::bf16>;
  if constexpr (!std::is_void_v<f16_type>) body.template operator()<f16_type>();
  if constexpr (!std::is_void_v<bf16_type>) body.template operator()<bf16_type>();
}

/// @brief {factor · 1, factor · 2, ...}: row-major values, one per element of `shape`.
inline std::vector<double> multiples(const tensor_shape& shape, double factor) {
  std::vector<double> values(*shape.checked_element_count());
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = factor * static_cast<double>(i + 1);
  return values;
}

/// @brief `values` converted to element type W (exactly, for the small values tests use).
template <class W>
std::vector<W> as(const std::vector<double>& values) {
  return {values.begin(), values.end()};
}

/// @brief A tensor of B with `shape` and the given row-major values (converted by `to_element`).
template <class B, class T>
tensor_t<B, T> make_tensor(const tensor_shape& shape, std::span<const double> row_major,
                           const device_t<B>& device = backend_fixture<B>::device()) {
  REQUIRE(row_major.size() == *shape.checked_element_count());
  std::vector<T> elements;
  elements.reserve(row_major.size());
  for (double value : row_major) elements.push_back(to_element<T>(value));
  return B::template from_row_major<T>(std::span<const T>(elements), shape, device);
}

template <class B, class T>
tensor_t<B, T> make_tensor(const tensor_shape& shape, std::initializer_list<double> row_major,
                           const device_t<B>& device = backend_fixture<B>::device()) {
  return make_tensor<B, T>(shape, std::span<const double>(row_major.begin(), row_major.size()), device);
}

/// @brief Whether B's owned tensors can have `shape` (an Eigen matrix has rank 2, so it cannot
/// hold a rank-3 gradient; such a gradient goes in as an `Eigen::Tensor` view instead).
template <class B>
bool tensors_can_have(const tensor_shape& shape) {
  try {
    const std::vector<double> values(*shape.checked_element_count(), 1.0);
    (void)make_tensor<B, float>(shape, std::span<const double>(values));
    return true;
  } catch (const error& e) {
    REQUIRE(e.code() == errc::parameter_mismatch);
    return false;
  }
}

/// @brief A tensor of B with every element equal to `value`.
template <class B, class T>
tensor_t<B, T> filled(const tensor_shape& shape, double value,
                      const device_t<B>& device = backend_fixture<B>::device()) {
  const std::vector<double> values(*shape.checked_element_count(), value);
  return make_tensor<B, T>(shape, std::span<const double>(values), device);
}

/// @brief Row-major values of a tensor, read back through the backend.
template <class B, class T>
std::vector<T> row_major(const tensor_t<B, T>& t) {
  std::vector<T> values(*B::shape(t).checked_element_count());
  B::to_row_major(t, std::span<T>(values));
  return values;
}

/// @brief Row-major values of the owned W tensor under `id`; fails the test when there is none.
template <class W, class B>
std::vector<W> values_of(const gradients_params<B>& grads, std::string_view id) {
  const tensor_t<B, W>* t = grads.template get<W>(id);
  REQUIRE_MESSAGE(t != nullptr, "no " << to_string(dtype_of<W>) << " tensor under '" << std::string(id) << "'");
  return row_major<B, W>(*t);
}

/// @brief The W values of `id` in a window's buffer; fails the test when there are none.
template <class W, class B>
std::vector<W> values_of(const flat_gradients<B>& grads, std::string_view id) {
  REQUIRE_MESSAGE(grads.contains(id), "no values under '" << std::string(id) << "'");
  REQUIRE_MESSAGE(grads.dtype() == dtype_of<W>,
                  "values under '" << std::string(id) << "' are not " << to_string(dtype_of<W>));
  if constexpr (device_buffers_backend<B>) {
    return backend_fixture<B>::template values_of<W>(*grads.template get<W>(id));
  } else {
    const std::span<const W> values = grads.template values<W>(id);
    return {values.begin(), values.end()};
  }
}

/// @brief The whole buffer of a window's values as `flat<W>()` gives it: for a device window,
/// assembled from each present segment's view, zeros elsewhere.
template <class W, class B>
std::vector<W> flat_values(const flat_gradients<B>& grads) {
  if constexpr (device_buffers_backend<B>) {
    std::vector<W> all(grads.layout() ? grads.layout()->elements() : 0, W{0});
    for (const auto& e : grads) {
      const std::vector<W> values = values_of<W>(grads, e.id);
      std::copy(values.begin(), values.end(), all.begin() + static_cast<std::ptrdiff_t>(e.offset));
    }
    return all;
  } else {
    const std::span<const W> all = grads.template flat<W>();
    return {all.begin(), all.end()};
  }
}

/// @brief One parameter: id and shape (on the fixture's device).
struct parameter_geometry {
  std::string_view id;
  tensor_shape shape;
};

/// @brief A parameter set built from parameter tensors, as a model would build it.
template <class B>
parameter_set<B> make_parameters(std::initializer_list<parameter_geometry> geometry) {
  parameter_set<B> params;
  for (const auto& [id, shape] : geometry) params.add(id, filled<B, float>(shape, 0.0));
  return params;
}

}  // namespace gradaccum::test
