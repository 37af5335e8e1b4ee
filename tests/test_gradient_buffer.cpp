/// @file
/// @brief gradient_buffer.hpp: gradients written into one buffer laid out like the window's add
/// with the same bits as the same gradients in a `gradients_params`, keep absent parameters
/// absent, and every refusal names its code and changes nothing. Over Eigen and xtensor.

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#if __has_include(<xtensor/containers/xtensor.hpp>)
#include <xtensor/containers/xadapt.hpp>
#include <xtensor/containers/xtensor.hpp>
#else
#include <xtensor/xadapt.hpp>
#include <xtensor/xtensor.hpp>
#endif

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/backends/xtensor.hpp>
#include <gradaccum/gradaccum.hpp>

#include "test_helpers.hpp"

using namespace gradaccum;

namespace {

/// Shapes that leave padding between segments (3, 17 and 6 elements, segments of 16 or 32), a
/// scalar and a tied parameter.
template <class B>
parameter_set<B> model() {
  parameter_set<B> params;
  params.add("embed", tensor_shape{3, 1}, typename B::device_type{});
  params.add("fc.weight", tensor_shape{17, 1}, typename B::device_type{});
  params.add("scale", tensor_shape{1, 1}, typename B::device_type{});
  params.add("fc.bias", tensor_shape{2, 3}, typename B::device_type{});
  params.add("embed", tensor_shape{3, 1}, typename B::device_type{});  // tied: once
  return params;
}

/// Microbatch k's gradient of parameter `id`: values with full mantissas, so that any change of
/// rounding would show.
template <class T>
std::vector<T> gradient_of(std::size_t k, std::size_t parameter, std::size_t size) {
  std::vector<T> values(size);
  for (std::size_t i = 0; i < size; ++i) {
    values[i] = static_cast<T>(0.1 * static_cast<double>(k + 1) + 0.37 * static_cast<double>(parameter) -
                               0.013 * static_cast<double>(i * i));
  }
  return values;
}

/// Writes microbatch k's gradients of the ids in `present` into both containers.
template <class B, class T>
void fill(std::size_t k, const std::vector<std::string>& present, const parameter_set<B>& params,
          gradient_buffer<B, T>& buffer, gradients_params<B>& grads) {
  buffer.clear();
  grads.clear();
  for (const std::string& id : present) {
    const std::size_t position = *params.find(id);
    const tensor_shape& shape = params[position].shape;
    const std::vector<T> values = gradient_of<T>(k, position, *shape.checked_element_count());
    const std::span<T> segment = buffer.values(id);
    REQUIRE(segment.size() == values.size());
    std::copy(values.begin(), values.end(), segment.begin());
    grads.insert(id, B::template from_row_major<T>(std::span<const T>(values), shape, {}));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("a gradient buffer adds with the bits of the same gradients in a gradients_params", B, eigen_backend,
                   xtensor_backend) {
  const parameter_set<B> params = model<B>();
  gradient_buffer<B> buffer(params);
  gradients_params<B> grads;
  const std::vector<std::vector<std::string>> microbatches = {
      {"embed", "fc.weight", "scale", "fc.bias"},  // every parameter: one pass over the buffer
      {"embed", "fc.bias"},                        // two runs around an absent pair
      {"fc.weight"},
      {"embed", "fc.weight", "scale", "fc.bias"},
  };
  const std::vector<double> weights = {3.0, 0.0, 7.0, 1.5};  // a zero-weight microbatch adds nothing
  for (const float_dtype work : {float_dtype::f32, float_dtype::f64}) {
    CAPTURE(work);
    for (const bool mean : {false, true}) {
      CAPTURE(mean);
      weighted_gradients_accumulator<B> from_buffer(work, 4.0);
      weighted_gradients_accumulator<B> from_params(work, 4.0);
      for (std::size_t k = 0; k < microbatches.size(); ++k) {
        fill(k, microbatches[k], params, buffer, grads);
        CHECK(buffer.size() == microbatches[k].size());
        if (mean) {
          from_buffer.accumulate_mean(params, buffer, weights[k]);
          from_params.accumulate_mean(params, grads, weights[k]);
        } else {
          from_buffer.accumulate_sum(params, buffer, weights[k]);
          from_params.accumulate_sum(params, grads, weights[k]);
        }
        GRADACCUM_CHECK_SAME_BITS(from_buffer.try_to_record(), from_params.try_to_record());
      }
      // "scale" had a gradient only in microbatches 0 and 3, and "fc.weight" in 0, 2 and 3.
      CHECK(from_buffer.pending().contains("scale"));
      const auto a = from_buffer.finish_mean(params);
      const auto b = from_params.finish_mean(params);
      CHECK(a.gradients.size() == 4);
      GRADACCUM_CHECK_SAME_BITS(a.gradients.to_record(), b.gradients.to_record());
      CHECK(a.state == b.state);
    }
  }
}

TEST_CASE_TEMPLATE("absent parameters stay absent; clear() zeroes what was present", B, eigen_backend,
                   xtensor_backend) {
  const parameter_set<B> params = model<B>();
  gradient_buffer<B> buffer(params);
  CHECK(buffer.empty());
  CHECK(buffer.flat().size() == buffer.layout().elements());
  const std::span<float> bias = buffer.values("fc.bias");
  CHECK(bias.size() == 6);
  for (float& v : bias) CHECK(v == 0.0F);
  for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = static_cast<float>(i + 1);
  CHECK(buffer.contains("fc.bias"));
  CHECK_FALSE(buffer.contains("embed"));
  CHECK(buffer.is_present(*params.find("fc.bias")));

  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, buffer, 2.0);
  const auto mean = window.finish_mean(params);
  CHECK(mean.gradients.size() == 1);
  CHECK_FALSE(mean.gradients.contains("embed"));
  const std::vector<float> expected = {0.5F, 1.0F, 1.5F, 2.0F, 2.5F, 3.0F};
  const std::span<const float> got = mean.gradients.template values<float>("fc.bias");
  CHECK(std::vector<float>(got.begin(), got.end()) == expected);

  buffer.clear();
  CHECK(buffer.empty());
  CHECK_FALSE(buffer.contains("fc.bias"));
  for (const float v : buffer.flat()) CHECK(v == 0.0F);
  // An empty buffer is a microbatch without gradients: counted, nothing pending.
  weighted_gradients_accumulator<B> nothing(float_dtype::f32, 1.0);
  nothing.accumulate_sum(params, buffer, 5.0);
  CHECK(nothing.pending().empty());
  CHECK(nothing.state().microbatches == 1);
  CHECK(nothing.state().total_weight == 5.0);
}

TEST_CASE_TEMPLATE("clear() zeroes every segment, also one written through a span while it was absent", B,
                   eigen_backend, xtensor_backend) {
  const parameter_set<B> params = model<B>();
  gradient_buffer<B> buffer(params);
  const std::span<float> bias = buffer.values("fc.bias");  // held across microbatches
  buffer.clear();
  bias[0] = 5.0F;  // "fc.bias" is absent: no clear() since has zeroed it
  buffer.clear();
  for (const float v : buffer.flat()) CHECK(v == 0.0F);
  // A backward that adds into its segment: 2, not 5 + 2.
  buffer.values("fc.bias")[0] += 2.0F;
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, buffer, 1.0);
  CHECK(window.pending().template values<float>("fc.bias")[0] == 2.0F);
}

TEST_CASE_TEMPLATE("a buffer of another parameter set, or of an unknown id, is refused and changes nothing", B,
                   eigen_backend, xtensor_backend) {
  parameter_set<B> params = model<B>();
  gradient_buffer<B> buffer(params);
  GRADACCUM_CHECK_REJECTED(buffer.values("nope"), errc::unknown_parameters, "nope");
  CHECK(buffer.empty());

  weighted_gradients_accumulator<B> window(float_dtype::f64, 2.0);
  buffer.values("scale")[0] = 1.25F;
  window.accumulate_sum(params, buffer, 1.0);
  const weighted_gradients_record before = window.try_to_record();

  const parameter_set<B> other = model<B>();  // same ids, another set
  GRADACCUM_CHECK_REJECTED(window.accumulate_sum(other, buffer, 1.0), errc::parameter_mismatch, "");
  GRADACCUM_CHECK_SAME_BITS(window.try_to_record(), before);
  params.add("grown", tensor_shape{2, 1}, typename B::device_type{});  // the buffer's layout is stale
  GRADACCUM_CHECK_REJECTED(window.accumulate_sum(params, buffer, 1.0), errc::parameter_mismatch, "");
  GRADACCUM_CHECK_REJECTED(window.accumulate_sum(params, buffer, 0.0), errc::parameter_mismatch, "");
  GRADACCUM_CHECK_REJECTED(window.accumulate_sum(params, buffer, -1.0), errc::invalid_weight, "");
  GRADACCUM_CHECK_SAME_BITS(window.try_to_record(), before);
}

TEST_CASE("a double buffer goes into an F64 window, and a plain accumulator takes a buffer too") {
  using B = eigen_backend;
  const parameter_set<B> params = model<B>();
  gradient_buffer<B, double> buffer(params);
  gradients_params<B> grads;
  fill(0, {"embed", "fc.bias"}, params, buffer, grads);
  gradients_accumulator<B> from_buffer;
  gradients_accumulator<B> from_params;
  from_buffer.accumulate(params, buffer);
  from_params.accumulate(params, grads);
  CHECK(from_buffer.pending().dtype() == float_dtype::f64);
  GRADACCUM_CHECK_SAME_BITS(from_buffer.try_to_record(), from_params.try_to_record());
  from_buffer.accumulate_scaled(params, buffer, 0.5, float_dtype::f64);
  from_params.accumulate_scaled(params, grads, 0.5, float_dtype::f64);
  GRADACCUM_CHECK_SAME_BITS(from_buffer.try_to_record(), from_params.try_to_record());
  GRADACCUM_CHECK_REJECTED(from_buffer.accumulate_with_dtype(params, buffer, float_dtype::bf16), errc::invalid_dtype,
                           "");
}

TEST_CASE("a backward pass writes through its own library's views: an Eigen::Map and xt::adapt") {
  // Eigen: a model's MatrixXf parameter (column-major) and VectorXf bias; the gradient is an
  // expression assigned into a row-major Map over the segment, as Eigen assigns between orders.
  {
    using B = eigen_backend;
    const Eigen::MatrixXf weight = Eigen::MatrixXf::Zero(2, 3);
    const Eigen::VectorXf bias = Eigen::VectorXf::Zero(2);
    parameter_set<B> params;
    params.add("fc.weight", weight);
    params.add("fc.bias", bias);
    gradient_buffer<B> grads(params);
    using row_major = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    Eigen::MatrixXf g(2, 3);
    g << 1, 2, 3, 4, 5, 6;
    Eigen::Map<row_major>(grads.values("fc.weight").data(), 2, 3) = 2.0F * g;
    Eigen::VectorXf b(2);
    b << 0.5F, -1.0F;
    Eigen::Map<Eigen::VectorXf>(grads.values("fc.bias").data(), 2) = b;

    weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
    window.accumulate_sum(params, grads, 4.0);
    const auto mean = window.finish_mean(params);
    const Eigen::MatrixXf expected_weight = 0.5F * g;  // 2 · g over 4 tokens
    CHECK(Eigen::MatrixXf(*mean.gradients.get<float>("fc.weight")) == expected_weight);
    CHECK(Eigen::VectorXf(mean.gradients.get<float>("fc.bias")->reshaped()) == 0.25F * b);
  }
  // xtensor: an xt::xtensor<float, 2> parameter; the gradient written through xt::adapt.
  {
    using B = xtensor_backend;
    const xt::xtensor<float, 2> weight = xt::zeros<float>({2, 3});
    parameter_set<B> params;
    params.add("fc.weight", weight);
    gradient_buffer<B> grads(params);
    const std::span<float> segment = grads.values("fc.weight");
    auto view = xt::adapt(segment.data(), segment.size(), xt::no_ownership(), std::vector<std::size_t>{2, 3});
    const xt::xtensor<float, 2> g = {{1, 2, 3}, {4, 5, 6}};
    view = 3.0F * g;

    weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
    window.accumulate_sum(params, grads, 3.0);
    const auto mean = window.finish_mean(params);
    const std::span<const float> values = mean.gradients.values<float>("fc.weight");
    CHECK(std::vector<float>(values.begin(), values.end()) == std::vector<float>{1, 2, 3, 4, 5, 6});
  }
}
