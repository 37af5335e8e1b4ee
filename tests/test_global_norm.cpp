/// @file
/// @brief global_norm.hpp and the step around it, on every backend: exact norms on values whose
/// squares sum to a perfect square, the documented summation order bit for bit on values whose
/// sums round (so every backend gets the same bits), `clip_by_global_norm`'s PyTorch semantics
/// and its rejections, and `set_loss_scale` between windows.

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>

#include "backend_fixtures.hpp"
#include "test_helpers.hpp"

namespace {

using namespace gradaccum;
using namespace gradaccum::test;

constexpr double infinity = std::numeric_limits<double>::infinity();
constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();

/// "big" spans three norm blocks; "bias" never receives a gradient (absent, zeros).
template <class B>
parameter_set<B> model() {
  return make_parameters<B>({{"head", {2, 3}}, {"bias", {3, 1}}, {"big", {48, 48}}});
}

/// head = (12, 24, 8, 0, 0, 0): 784 = 28²; big: 2304 twos, 9216 = 96²; together 10000 = 100².
template <class B, class W>
accumulated_gradients<B> exact_window(double loss_scale = 1.0) {
  const auto params = model<B>();
  weighted_gradients_accumulator<B> window(dtype_of<W>, loss_scale);
  gradients_params<B> grads;
  grads.insert("head", make_tensor<B, W>({2, 3}, {12 * loss_scale, 24 * loss_scale, 8 * loss_scale, 0, 0, 0}));
  grads.insert("big", filled<B, W>({48, 48}, 2 * loss_scale));
  window.accumulate_sum(params, grads, 1.0);
  return window.finish_mean(params);
}

template <class W, class B>
std::vector<W> all_values(const accumulated_gradients<B>& result) {
  return flat_values<W>(result.gradients);
}

/// `id` → a W tensor of `shape` holding `values`: one microbatch's gradients.
template <class B, class W>
gradients_params<B> one_gradient(std::string_view id, const tensor_shape& shape, std::initializer_list<double> values) {
  gradients_params<B> grads;
  grads.insert(id, make_tensor<B, W>(shape, values));
  return grads;
}

template <class W>
bool identical_bits(const std::vector<W>& a, const std::vector<W>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<std::conditional_t<sizeof(W) == 4, std::uint32_t, std::uint64_t>>(a[i]) !=
        std::bit_cast<std::conditional_t<sizeof(W) == 4, std::uint32_t, std::uint64_t>>(b[i])) {
      return false;
    }
  }
  return true;
}

}  // namespace

TEST_CASE_TEMPLATE("global_norm is exact where the squares sum exactly", B, GRADACCUM_TEST_BACKENDS) {
  for_each_work_type([]<class W>() {
    INFO("work dtype " << to_string(dtype_of<W>));
    const auto result = exact_window<B, W>(4.0);  // divided back by the loss scale exactly
    CHECK_FALSE(result.gradients.contains("bias"));
    CHECK(global_norm(result) == 100.0);
    CHECK(global_norm(result.gradients) == 100.0);
  });
  CHECK(global_norm(accumulated_gradients<B>{}) == 0.0);
}

/// A window of full-mantissa values: a different order or a single F32 accumulator would round
/// their squares' sum differently.
template <class B, class W>
accumulated_gradients<B> rounding_window() {
  const auto params = model<B>();
  std::vector<double> head(6);
  std::vector<double> big(48 * 48);
  for (std::size_t i = 0; i < head.size(); ++i) head[i] = static_cast<double>(static_cast<W>(1.0 / (3.0 + i)));
  for (std::size_t i = 0; i < big.size(); ++i) {
    big[i] = static_cast<double>(static_cast<W>(1.0 / (3.0 + static_cast<double>(i % 97)) + 0.1));
  }
  weighted_gradients_accumulator<B> window(dtype_of<W>, 1.0);
  gradients_params<B> grads;
  grads.insert("head", make_tensor<B, W>({2, 3}, std::span<const double>(head)));
  grads.insert("big", make_tensor<B, W>({48, 48}, std::span<const double>(big)));
  window.accumulate_sum(params, grads, 1.0);
  return window.finish_mean(params);
}

/// The norm's bits of `rounding_window` on every backend listed.
template <class W, class... Bs>
std::vector<std::uint64_t> norm_bits_on() {
  return {std::bit_cast<std::uint64_t>(global_norm(rounding_window<Bs, W>()))...};
}

TEST_CASE_TEMPLATE("global_norm sums in the documented order, so every backend gets the same bits", B,
                   GRADACCUM_TEST_BACKENDS) {
  for_each_work_type([&]<class W>() {
    INFO("work dtype " << to_string(dtype_of<W>));
    const auto result = rounding_window<B, W>();

    // The contract spelled out: the buffer in blocks of 1024 elements; per block, lane i mod 8
    // adds its squares in order, lanes combined pairwise; block sums added from the first.
    const std::vector<W> flat = flat_values<W>(result.gradients);
    REQUIRE(flat.size() == 16 + 16 + 2304);  // head, bias and big, each padded to 16 elements
    double total = 0.0;
    for (std::size_t at = 0; at < flat.size(); at += norm_block_elements) {
      std::array<double, 8> lane{};
      for (std::size_t i = at; i < std::min(at + norm_block_elements, flat.size()); ++i) {
        lane[(i - at) % 8] += static_cast<double>(flat[i]) * static_cast<double>(flat[i]);
      }
      total += ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    }
    CHECK(std::bit_cast<std::uint64_t>(global_norm(result)) == std::bit_cast<std::uint64_t>(std::sqrt(total)));
    // ... which a plain sequential sum does not reproduce here, so the check above can fail.
    double sequential = 0.0;
    for (const W v : flat) sequential += static_cast<double>(v) * static_cast<double>(v);
    CHECK(sequential != total);
  });
}

TEST_CASE_TEMPLATE("clip_by_global_norm scales by max_norm / (norm + 1e-6) below 1 and returns the norm", B,
                   GRADACCUM_TEST_BACKENDS) {
  for_each_work_type([]<class W>() {
    INFO("work dtype " << to_string(dtype_of<W>));
    auto result = exact_window<B, W>();
    const std::vector<W> before = all_values<W>(result);

    SUBCASE("clipped") {
      CHECK(clip_by_global_norm(result, 10.0) == 100.0);
      const auto c = static_cast<W>(10.0 / (100.0 + 1e-6));
      const std::vector<W> after = all_values<W>(result);
      for (std::size_t i = 0; i < before.size(); ++i) CHECK(after[i] == before[i] * c);
      CHECK(values_of<W>(result.gradients, "head")[1] == W(24) * c);
      CHECK(std::abs(global_norm(result) - 10.0) < 1e-5);
    }
    SUBCASE("a norm within max_norm, or an infinite max_norm, leaves the values as they were") {
      auto unclipped = exact_window<B, W>();
      CHECK(clip_by_global_norm(unclipped, 100.001) == 100.0);
      CHECK(identical_bits(all_values<W>(unclipped), before));
      CHECK(clip_by_global_norm(unclipped, infinity) == 100.0);
      CHECK(identical_bits(all_values<W>(unclipped), before));
    }
    SUBCASE("max_norm 0 zeroes every value") {
      CHECK(clip_by_global_norm(result, 0.0) == 100.0);
      for (const W v : all_values<W>(result)) CHECK(v == W(0));
    }
    SUBCASE("a negative or NaN max_norm is rejected and nothing changes") {
      for (const double bad : {-1.0, not_a_number, -infinity}) {
        GRADACCUM_CHECK_REJECTED(clip_by_global_norm(result, bad), errc::invalid_scalar, "");
        CHECK(identical_bits(all_values<W>(result), before));
      }
    }
  });
}

TEST_CASE_TEMPLATE("a non-finite norm is returned and the values are left as they were", B, GRADACCUM_TEST_BACKENDS) {
  const auto params = model<B>();
  for_each_work_type([&]<class W>() {
    for (const double bad : {infinity, not_a_number}) {
      INFO("work dtype " << to_string(dtype_of<W>) << ", value " << bad);
      weighted_gradients_accumulator<B> window(dtype_of<W>, 1.0);
      window.accumulate_sum(params, one_gradient<B, W>("head", {2, 3}, {1, 2, bad, 4, 5, 6}), 1.0);
      auto result = window.finish_mean(params);
      const std::vector<W> before = all_values<W>(result);
      const double norm = clip_by_global_norm(result, 1.0);
      CHECK_FALSE(std::isfinite(norm));
      CHECK(std::isnan(norm) == std::isnan(bad));
      const std::vector<W> after = all_values<W>(result);
      CHECK(after.size() == before.size());
      for (std::size_t i = 0; i < after.size(); ++i) CHECK((after[i] == before[i] || std::isnan(after[i])));
      CHECK(result.gradients.non_finite() == std::vector<std::string>{"head"});
    }
  });
}

TEST_CASE_TEMPLATE("set_loss_scale changes the next window's scale, only between windows", B, GRADACCUM_TEST_BACKENDS) {
  const auto params = model<B>();
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1024.0);
  window.set_loss_scale(512.0);
  CHECK(window.state().loss_scale == 512.0);
  window.accumulate_sum(params, one_gradient<B, float>("head", {2, 3}, {512, 1024, 0, 0, 0, 512}), 1.0);

  const auto state_before = window.state();
  const auto record_before = window.try_to_record();
  GRADACCUM_CHECK_REJECTED(window.set_loss_scale(256.0), errc::invalid_state, "");
  CHECK(window.state() == state_before);
  GRADACCUM_CHECK_SAME_BITS(window.try_to_record(), record_before);

  const auto mean = window.finish_mean(params);
  CHECK(values_of<float>(mean.gradients, "head") == std::vector<float>{1, 2, 0, 0, 0, 1});
  CHECK(mean.state.loss_scale == 512.0);

  for (const double bad : {0.0, -2.0, infinity, not_a_number, 1e39, 1e-50}) {
    INFO("scale " << bad);
    GRADACCUM_CHECK_REJECTED(window.set_loss_scale(bad), errc::invalid_scalar, "");
    CHECK(window.state().loss_scale == 512.0);
  }
  window.set_loss_scale(2.0);  // a zero-weight microbatch counts too, so set it first
  window.accumulate_sum(params, gradients_params<B>{}, 0.0);
  GRADACCUM_CHECK_REJECTED(window.set_loss_scale(4.0), errc::invalid_state, "");
  CHECK(window.state().loss_scale == 2.0);
}

TEST_CASE("every backend's norm of the same window has the same bits") {
  for_each_work_type([]<class W>() {
    INFO("work dtype " << to_string(dtype_of<W>));
    const std::vector<std::uint64_t> bits = norm_bits_on<W, GRADACCUM_TEST_BACKENDS>();
    REQUIRE(!bits.empty());
    for (const std::uint64_t b : bits) CHECK(b == bits.front());
  });
}
