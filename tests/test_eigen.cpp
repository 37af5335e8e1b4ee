/// @file
/// @brief What only the Eigen backend promises: column-major matrices recorded row-major,
/// `Eigen::Map` views read in place, Eigen's 16-bit types, and records that move to another
/// backend and back exactly. The accumulation contract itself runs in the conformance suite
/// (conformance.hpp).

#include <bit>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>

#include "backend_fixtures.hpp"
#include "test_helpers.hpp"

using namespace gradaccum;
using namespace gradaccum::test;
using matrix = Eigen::MatrixXf;

static_assert(dtype_of<Eigen::half> == float_dtype::f16);
static_assert(dtype_of<Eigen::bfloat16> == float_dtype::bf16);
// Expressions and maps are not stored as they are: an expression is evaluated into a matrix, a
// map read through a strided view (tests/test_eigen_inputs.cpp).
static_assert(!detail::is_gradient_alternative<eigen_backend, decltype(matrix() + matrix())>);
static_assert(detail::gradient_input<eigen_backend, decltype(matrix() + matrix())>);
static_assert(
    std::is_same_v<detail::alternative_t<eigen_backend, Eigen::Map<const matrix>>, eigen_backend::view<float>>);

TEST_CASE("matrices are recorded row-major and restored column-major") {
  matrix m(2, 3);
  m << 0, 1, 2, 10, 11, 12;  // m(r, c) = 10 r + c
  CHECK(eigen_backend::shape(m) == tensor_shape{2, 3});
  std::vector<float> row_major(6);
  eigen_backend::to_row_major(m, std::span<float>(row_major));
  CHECK(row_major == std::vector<float>{0, 1, 2, 10, 11, 12});
  const matrix back = eigen_backend::from_row_major<float>(std::span<const float>(row_major), {2, 3}, {});
  CHECK(back == m);

  const parameter_set<eigen_backend> params = make_parameters<eigen_backend>({{"m", {2, 3}}});
  gradients_params<eigen_backend> grads;
  grads.insert("m", m);
  weighted_gradients_accumulator<eigen_backend> acc(float_dtype::f32, 1.0);
  acc.accumulate_sum(params, grads, 1);
  const auto record = acc.try_to_record();
  REQUIRE(record.gradients.tensors.size() == 1);
  CHECK(record.gradients.tensors[0].shape == std::vector<std::uint64_t>{2, 3});
  CHECK(record.gradients.tensors[0].values == record_values(std::vector<float>{0, 1, 2, 10, 11, 12}));
}

TEST_CASE("shapes of rank 0 and 1 become 1×1 matrices and column vectors") {
  const std::vector<double> values{1, 2, 3, 4};
  const auto scalar = eigen_backend::map<double>(std::span(values).first(1), {}, {});
  CHECK((scalar.rows() == 1 && scalar.cols() == 1));
  const auto column = eigen_backend::map<double>(std::span(values), {4}, {});
  CHECK((column.rows() == 4 && column.cols() == 1));
  CHECK(eigen_backend::shape(eigen_backend::from_row_major<double>(std::span(values), {4}, {})) == tensor_shape{4, 1});
}

TEST_CASE("Eigen::Map gradients are read in place, when accumulated") {
  std::vector<float> caller_buffer{1, 2, 3, 4, 5, 6};  // column-major 3×2
  const parameter_set<eigen_backend> params = make_parameters<eigen_backend>({{"w", {3, 2}}});
  gradients_params<eigen_backend> grads;
  grads.insert("w", Eigen::Map<const matrix>(caller_buffer.data(), 3, 2));
  weighted_gradients_accumulator<eigen_backend> acc(float_dtype::f32, 1.0);
  acc.accumulate_sum(params, grads, 1);
  caller_buffer.assign({10, 20, 30, 40, 50, 60});  // the map sees the new values: nothing was copied
  acc.accumulate_sum(params, grads, 1);
  const auto pending = acc.pending().get<float>("w");
  REQUIRE(pending.has_value());
  matrix expected(3, 2);
  expected << 11, 44, 22, 55, 33, 66;
  CHECK(*pending == expected);
}

TEST_CASE("the kernels widen Eigen::half and Eigen::bfloat16 exactly as Eigen does") {
  for (std::uint32_t bits = 0; bits <= 0xffffU; ++bits) {
    const auto pattern = static_cast<std::uint16_t>(bits);
    const auto eigen_half = static_cast<float>(std::bit_cast<Eigen::half>(pattern));
    const auto eigen_bf16 = static_cast<float>(std::bit_cast<Eigen::bfloat16>(pattern));
    const auto kernel_half = kernels::to_work<float>(std::bit_cast<Eigen::half>(pattern));
    const auto kernel_bf16 = kernels::to_work<float>(std::bit_cast<Eigen::bfloat16>(pattern));
    // NaN payloads are not part of the contract; everything else must agree bit for bit.
    const bool half_agrees = std::isnan(eigen_half) ? std::isnan(kernel_half) : same_bits(eigen_half, kernel_half);
    const bool bf16_agrees = std::isnan(eigen_bf16) ? std::isnan(kernel_bf16) : same_bits(eigen_bf16, kernel_bf16);
    if (!half_agrees) FAIL_CHECK("Eigen::half pattern " << bits);
    if (!bf16_agrees) FAIL_CHECK("Eigen::bfloat16 pattern " << bits);
  }
}

TEST_CASE("a record written from Eigen restores into another backend and back, exactly") {
  const auto eigen_params = make_parameters<eigen_backend>({{"a", {2, 3}}, {"b", {3, 2}}});
  const auto vector_params = make_parameters<vector_backend>({{"a", {2, 3}}, {"b", {3, 2}}});
  weighted_gradients_accumulator<eigen_backend> eigen_acc(float_dtype::f32, 3.0);
  gradients_params<eigen_backend> grads;
  grads.insert("a", make_tensor<eigen_backend, Eigen::half>({2, 3}, {0.5, -1, 2, 4.25, 8, -16}));
  grads.insert("b", make_tensor<eigen_backend, double>({3, 2}, {0.1, 0.2, 0.3, 0.4, 0.5, 0.6}));
  eigen_acc.accumulate_mean(eigen_params, grads, 7);
  const auto record = eigen_acc.try_to_record();

  weighted_gradients_accumulator<vector_backend> vector_acc(float_dtype::f64, 1.0);
  vector_acc.load_record(vector_params, record);
  GRADACCUM_CHECK_SAME_BITS(vector_acc.try_to_record(), record);
  CHECK(values_of<float>(vector_acc.pending(), "a") == std::vector<float>{3.5F, -7, 14, 29.75F, 56, -112});

  weighted_gradients_accumulator<eigen_backend> round_trip(float_dtype::f64, 1.0);
  round_trip.load_record(eigen_params, vector_acc.try_to_record());
  GRADACCUM_CHECK_SAME_BITS(round_trip.try_to_record(), record);
}
