#pragma once
/// @file
/// @brief The checks that test_eigen_inputs.cpp and test_xtensor_inputs.cpp run on every kind of
/// input of their backend: one window over the input compared bit for bit with the same window
/// over the plain tensor of the same row-major values, a refused shape that changes nothing, and
/// no allocation in steady state.

#include <cstddef>
#include <cstring>
#include <span>
#include <utility>
#include <variant>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>

#include "alloc_failure.hpp"

namespace gradaccum::test {

/// @brief What the window of `window_result` makes of one gradient g given twice (sum, weight 3;
/// mean, weight 2) under loss scale 2: ((0 + 1 · g) + 2 · g) / 2 / 5, in float, element by element.
inline std::vector<float> expected_mean(const std::vector<float>& g) {
  std::vector<float> out;
  for (const float x : g) {
    float p = 0.0F + 1.0F * x;
    p = p + 2.0F * x;
    out.push_back(p / 2.0F / 5.0F);
  }
  return out;
}

/// @brief Runs the window of `expected_mean` over "p" and returns the result's values (bits
/// compared by the caller), checking that the pending sums after the first microbatch are g.
template <class B>
std::vector<float> window_result(const parameter_set<B>& params, const gradients_params<B>& grads,
                                 const std::vector<float>& g) {
  weighted_gradients_accumulator<B> window(float_dtype::f32, 2.0);
  window.accumulate_sum(params, grads, 3.0);
  const std::span<const float> pending = window.pending().template values<float>("p");
  CHECK(std::vector<float>(pending.begin(), pending.end()) == g);
  window.accumulate_mean(params, grads, 2.0);
  const auto result = window.finish_mean(params);
  const std::span<const float> values = result.gradients.template values<float>("p");
  return {values.begin(), values.end()};
}

/// @brief The gradient "p" holding the row-major values `g` as B's plain tensor; for a shape B's
/// tensors cannot hold (an Eigen matrix refuses a rank above 2), row-major contiguous memory.
template <class B>
gradients_params<B> plain_gradient(const std::vector<float>& g, const tensor_shape& shape) {
  gradients_params<B> plain;
  try {
    plain.insert("p", B::template from_row_major<float>(g, shape, {}));
  } catch (const error& e) {
    if (e.code() != errc::parameter_mismatch) throw;
    plain.insert("p", typename B::template view<float>(g.data(), shape));
  }
  return plain;
}

/// @brief The parameter `param` gets shape `shape`; the gradient `grad` (row-major values `g`)
/// gives exactly the values of `expected_mean`, the same bits as the plain tensor with those values.
template <class B, class P, class G>
void check_kind(const P& param, G&& grad, const tensor_shape& shape, const std::vector<float>& g) {
  parameter_set<B> params;
  params.add("p", param);
  CHECK(params[0].shape == shape);
  gradients_params<B> grads;
  grads.insert("p", std::forward<G>(grad));
  const std::vector<float> ours = window_result(params, grads, g);
  CHECK(ours == expected_mean(g));
  const std::vector<float> reference = window_result(params, plain_gradient<B>(g, shape), g);
  CHECK((ours.size() == reference.size() &&
         std::memcmp(ours.data(), reference.data(), ours.size() * sizeof(float)) == 0));
}

/// @brief Checks that `window` refuses `grads` with `gradient` under `id` (parameter_mismatch,
/// naming `id`) and changes nothing: its microbatch count and the F32 values of its record's
/// tensor `kept` stay those of `before`.
template <class B, class G>
void check_refused(weighted_gradients_accumulator<B>& window, const parameter_set<B>& params,
                   const gradients_params<B>& grads, const weighted_gradients_record& before, std::size_t kept,
                   const char* id, const G& gradient) {
  CAPTURE(id);
  gradients_params<B> wrong = grads;
  wrong.insert_or_assign(id, gradient);
  try {
    window.accumulate_sum(params, wrong, 1.0);
    FAIL("accepted");
  } catch (const error& e) {
    CHECK(e.code() == errc::parameter_mismatch);
    CHECK(e.param_id() == id);
  }
  const weighted_gradients_record after = window.try_to_record();
  CHECK(after.state.microbatches == before.state.microbatches);
  CHECK(std::get<std::vector<float>>(after.gradients.tensors[kept].values) ==
        std::get<std::vector<float>>(before.gradients.tensors[kept].values));
}

/// @brief After a first microbatch lays out the window's buffer, three more rounds of
/// accumulate_mean and accumulate_sum over the same inputs allocate nothing.
template <class B>
void check_no_allocation_in_steady_state(const parameter_set<B>& params, const gradients_params<B>& grads) {
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_mean(params, grads, 2.0);  // lays out the buffer
  CHECK(allocations_of([&] {
          for (int i = 0; i < 3; ++i) {
            window.accumulate_mean(params, grads, 2.0);
            window.accumulate_sum(params, grads, 1.0);
          }
        }) == 0);
}

}  // namespace gradaccum::test
