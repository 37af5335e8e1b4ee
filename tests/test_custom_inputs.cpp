// The generic input rules, on a backend that declares neither views nor `adapt`: a type derived
// from its tensor type and an expression the tensor type is built from go in as that tensor
// (the expression evaluated once, at insert).
#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>

#include "matrix_backend.hpp"

namespace gradaccum::test {
namespace {

using B = matrix_backend;

static_assert(detail::gradient_input<B, lab::col<float>>);
static_assert(detail::gradient_input<B, lab::col<float>&>);
static_assert(detail::gradient_input<B, lab::scaled<double>>);
static_assert(std::is_same_v<detail::alternative_t<B, lab::col<double>&>, lab::mat<double>>);
static_assert(!detail::gradient_input<B, lab::cube>);
static_assert(!detail::gradient_input<B, lab::mat<int>>);

TEST_CASE("a derived type and an expression go in as the tensor type they convert to") {
  const lab::mat<float> weight(2, 3, 0.5F);
  const lab::col<float> bias(3, 0.25F);
  parameter_set<B> params;
  params.add("w", weight);
  params.add("b", bias);
  CHECK(params[1].shape == tensor_shape{3, 1});

  const int before = lab::mat<float>::evaluations;
  gradients_params<B> grads;
  grads.insert("w", 2.0F * weight);
  grads.insert("b", lab::col<float>(3, 1.5F));
  CHECK(lab::mat<float>::evaluations == before + 1);
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_mean(params, grads, 2.0);
  window.accumulate_sum(params, grads, 1.0);
  CHECK(lab::mat<float>::evaluations == before + 1);  // evaluated at insert, not per use
  const auto result = window.finish_mean(params);
  for (const float x : result.gradients.values<float>("w")) CHECK(x == 1.0F);  // (2 · 1 + 1) / 3
  for (const float x : result.gradients.values<float>("b")) CHECK(x == 1.5F);
}

}  // namespace
}  // namespace gradaccum::test
