/// @file
/// @brief The conformance suite (conformance.hpp) on accumulating: a window's construction,
/// weighted sums and means, the rejections of accumulate_sum / accumulate_mean, and the plain
/// summing accumulator.

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "conformance.hpp"

namespace {

using namespace gradaccum;
using namespace gradaccum::test;

constexpr std::uint64_t max_microbatches = std::numeric_limits<std::uint64_t>::max();

}  // namespace

TEST_SUITE_BEGIN("conformance");

// ---------------------------------------------------------------------------------------------
// Construction

TEST_CASE_TEMPLATE("a window starts only with a work dtype and a positive representable loss scale", B,
                   GRADACCUM_TEST_BACKENDS) {
  using accumulator = weighted_gradients_accumulator<B>;
  GRADACCUM_CHECK_REJECTED(accumulator(float_dtype::f16, 1.0), errc::invalid_dtype, "");
  GRADACCUM_CHECK_REJECTED(accumulator(float_dtype::bf16, 1.0), errc::invalid_dtype, "");
  for (const float_dtype dtype : {float_dtype::f32, float_dtype::f64}) {
    CAPTURE(dtype);
    for (const double loss_scale : {0.0, -0.0, -1.0, not_a_number, infinity, -infinity}) {
      CAPTURE(loss_scale);
      GRADACCUM_CHECK_REJECTED(accumulator(dtype, loss_scale), errc::invalid_scalar, "");
    }
  }
  // F32 also needs the loss scale to stay finite and non-zero as a float.
  GRADACCUM_CHECK_REJECTED(accumulator(float_dtype::f32, 0x1p128), errc::invalid_scalar, "");
  GRADACCUM_CHECK_REJECTED(accumulator(float_dtype::f32, 0x1p-150), errc::invalid_scalar, "");
  CHECK_NOTHROW((void)accumulator(float_dtype::f32, 0x1.fffffep127));
  CHECK_NOTHROW((void)accumulator(float_dtype::f32, 0x1p-149));
  CHECK_NOTHROW((void)accumulator(float_dtype::f64, 0x1p128));
  CHECK_NOTHROW((void)accumulator(float_dtype::f64, 0x1p-150));

  const accumulator acc(float_dtype::f64, 1024.0);
  CHECK(acc.state().dtype == float_dtype::f64);
  CHECK(acc.state().loss_scale == 1024.0);
  CHECK(acc.state().total_weight == 0.0);
  CHECK(acc.state().microbatches == 0);
  CHECK(acc.pending().empty());
}

// ---------------------------------------------------------------------------------------------
// Weighted means

TEST_CASE_TEMPLATE("microbatches of unequal size are weighted by their token counts (exact)", B,
                   GRADACCUM_TEST_BACKENDS) {
  // Microbatch 1 has 3 tokens whose per-token gradients are k, 2k, 3k (sum 6k, mean 2k);
  // microbatch 2 has 1 token with gradient 10k. The full-batch mean is (6k + 10k) / 4 = 4k;
  // averaging the two microbatch means would give (2k + 10k) / 2 = 6k.
  const auto params = make_parameters<B>({{"a", shape_a}});
  for_each_work_type([&]<class W>() {
    INFO("work dtype " << dtype_of<W>);
    const std::vector<W> full_batch_mean = as<W>(multiples(shape_a, 4));

    SUBCASE("sums weighted by token counts") {
      weighted_gradients_accumulator<B> acc(dtype_of<W>, 1.0);
      acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 6)), 3);
      acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 10)), 1);
      CHECK(values_of<W>(acc.pending(), "a") == as<W>(multiples(shape_a, 16)));
      const auto finished = acc.finish_mean(params);
      CHECK(values_of<W>(finished.gradients, "a") == full_batch_mean);
      CHECK(finished.state == weighted_accumulation_state{dtype_of<W>, 1.0, 4.0, 2});
    }
    SUBCASE("means multiplied by their weights, with a loss scale of 8") {
      weighted_gradients_accumulator<B> acc(dtype_of<W>, 8.0);
      acc.accumulate_mean(params, gradient<B>("a", shape_a, multiples(shape_a, 8 * 2)), 3);
      acc.accumulate_mean(params, gradient<B>("a", shape_a, multiples(shape_a, 8 * 10)), 1);
      CHECK(values_of<W>(acc.pending(), "a") == as<W>(multiples(shape_a, 8 * 16)));
      const auto finished = acc.finish_mean(params);
      CHECK(values_of<W>(finished.gradients, "a") == full_batch_mean);
      CHECK(finished.state == weighted_accumulation_state{dtype_of<W>, 8.0, 4.0, 2});
    }
    SUBCASE("a mean and a sum in the same window") {
      weighted_gradients_accumulator<B> acc(dtype_of<W>, 1.0);
      acc.accumulate_mean(params, gradient<B, double>("a", shape_a, multiples(shape_a, 2)), 3);
      acc.accumulate_sum(params, gradient<B, double>("a", shape_a, multiples(shape_a, 10)), 1);
      CHECK(values_of<W>(acc.finish_mean(params).gradients, "a") == full_batch_mean);
    }
  });
}

TEST_CASE_TEMPLATE("accumulate_mean converts to the work dtype before it multiplies", B, GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", {1, 2}}});
  if constexpr (!std::is_void_v<element_t<B, float_dtype::f16>>) {
    // 1024 · 128 = 131072 exceeds F16's largest finite value 65504: multiplied in F16 it is infinity.
    weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
    acc.accumulate_mean(params, gradient<B, element_t<B, float_dtype::f16>>("a", {1, 2}, {1024, -1024}), 128);
    CHECK(values_of<float>(acc.pending(), "a") == std::vector<float>{131072, -131072});
    CHECK(acc.non_finite().empty());
  }
  if constexpr (!std::is_void_v<element_t<B, float_dtype::bf16>>) {
    // (1 + 2^-7) · 3 = 3.0234375 needs 9 significant bits; BF16 has 8, so it would round to 3.03125.
    weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
    acc.accumulate_mean(params, gradient<B, element_t<B, float_dtype::bf16>>("a", {1, 2}, {1 + 0x1p-7, 0.5}), 3);
    CHECK(values_of<float>(acc.pending(), "a") == std::vector<float>{3.0234375F, 1.5F});
  }
  // (1 + 2^-23) · 3 = 3 + 3 · 2^-23 needs 25 significant bits: exact in F64, rounded in F32.
  weighted_gradients_accumulator<B> acc(float_dtype::f64, 1.0);
  acc.accumulate_mean(params, gradient<B, float>("a", {1, 2}, {1 + 0x1p-23, 1}), 3);
  CHECK(values_of<double>(acc.pending(), "a") == std::vector<double>{3 + 3 * 0x1p-23, 3});
}

TEST_CASE_TEMPLATE("finish_mean divides by the loss scale, then by the total weight, never by their product", B,
                   GRADACCUM_TEST_BACKENDS) {
  // In F32 the product 2^100 · 2^40 = 2^140 overflows to infinity (the result would be 0);
  // two divisions give 2^120 / 2^100 / 2^40 = 2^-20 exactly.
  const auto params = make_parameters<B>({{"a", {1, 2}}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 0x1p100);
  acc.accumulate_sum(params, gradient<B>("a", {1, 2}, {0x1p119, -3 * 0x1p119}), 0x1p39);
  acc.accumulate_sum(params, gradient<B>("a", {1, 2}, {0x1p119, -3 * 0x1p119}), 0x1p39);
  CHECK(values_of<float>(acc.pending(), "a") == std::vector<float>{0x1p120F, -3 * 0x1p120F});
  const auto finished = acc.finish_mean(params);
  CHECK(values_of<float>(finished.gradients, "a") == std::vector<float>{0x1p-20F, -3 * 0x1p-20F});
  CHECK(finished.state.total_weight == 0x1p40);
}

TEST_CASE_TEMPLATE("16-bit gradients are summed in F32, so small additions are kept", B, GRADACCUM_TEST_BACKENDS) {
  // Above 2048 (F16) and 256 (BF16) the spacing of 16-bit values is 2: adding 1 in 16 bits rounds
  // back to the same value every time. In F32 every addition counts.
  const auto params = make_parameters<B>({{"a", {1, 1}}});
  for_each_16bit_type<B>([&]<class T>() {
    INFO("gradient dtype " << dtype_of<T>);
    const double large = dtype_of<T> == float_dtype::f16 ? 2048 : 256;
    const int additions = dtype_of<T> == float_dtype::f16 ? 1024 : 256;
    weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
    acc.accumulate_sum(params, gradient<B, T>("a", {1, 1}, {large}), 1);
    const auto one = gradient<B, T>("a", {1, 1}, {1});
    for (int i = 0; i < additions; ++i) acc.accumulate_sum(params, one, 1);
    CHECK(acc.pending().dtype("a") == std::optional(float_dtype::f32));
    CHECK(values_of<float>(acc.pending(), "a") == std::vector<float>{static_cast<float>(large + additions)});
    CHECK(acc.state().microbatches == static_cast<std::uint64_t>(additions + 1));
  });
}

TEST_CASE_TEMPLATE("a zero-weight microbatch is validated and counted but adds nothing", B, GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 2.0);
  acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 0);
  acc.accumulate_mean(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 0);
  CHECK(acc.state() == weighted_accumulation_state{float_dtype::f32, 2.0, 0.0, 2});
  CHECK(acc.pending().empty());  // no pending entry is created
  CHECK(acc.try_to_record().gradients.tensors.empty());

  SUBCASE("it is validated like any other") {
    GRADACCUM_CHECK_REJECTED(acc.accumulate_sum(params, gradient<B>("c", shape_a, multiples(shape_a, 1)), 0),
                             errc::unknown_parameters, "c");
    GRADACCUM_CHECK_REJECTED(acc.accumulate_sum(params, gradient<B>("b", shape_a, multiples(shape_a, 1)), 0),
                             errc::parameter_mismatch, "b");
    CHECK(acc.state().microbatches == 2);
  }
  SUBCASE("a window of zero-weight microbatches has no mean") {
    GRADACCUM_CHECK_REJECTED(acc.finish_mean(params), errc::empty_weight, "");
    CHECK(acc.state() == weighted_accumulation_state{float_dtype::f32, 2.0, 0.0, 2});
  }
  SUBCASE("it still counts towards the window that later receives weight") {
    acc.accumulate_sum(params, gradient<B>("b", shape_b, multiples(shape_b, 4)), 2);
    CHECK_FALSE(acc.pending().contains("a"));
    const auto finished = acc.finish_mean(params);
    CHECK(values_of<float>(finished.gradients, "b") == as<float>(multiples(shape_b, 1)));
    CHECK(finished.state == weighted_accumulation_state{float_dtype::f32, 2.0, 2.0, 3});
  }
}

TEST_CASE_TEMPLATE("parameters that receive no gradient stay absent", B, GRADACCUM_TEST_BACKENDS) {
  // Sparse participation: "a" appears in microbatch 1 only, "b" in microbatch 2 only, "c" never.
  // Each is divided by the weight of the whole window, as if it had received zeros elsewhere.
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}, {"c", {4, 1}}});
  for_each_work_type([&]<class W>() {
    INFO("work dtype " << dtype_of<W>);
    weighted_gradients_accumulator<B> acc(dtype_of<W>, 1.0);
    acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 8)), 1);
    acc.accumulate_sum(params, gradient<B>("b", shape_b, multiples(shape_b, 4)), 3);
    CHECK(acc.pending().size() == 2);
    const auto finished = acc.finish_mean(params);
    CHECK(finished.gradients.size() == 2);
    CHECK_FALSE(finished.gradients.contains("c"));
    CHECK(values_of<W>(finished.gradients, "a") == as<W>(multiples(shape_a, 2)));
    CHECK(values_of<W>(finished.gradients, "b") == as<W>(multiples(shape_b, 1)));
  });
}

TEST_CASE_TEMPLATE("a tied parameter accumulates under its one id", B, GRADACCUM_TEST_BACKENDS) {
  parameter_set<B> params;
  params.add("embedding", filled<B, float>(shape_a, 0));
  params.add("decoder.bias", filled<B, float>(shape_b, 0));
  params.add("embedding", filled<B, float>(shape_a, 0));  // the decoder's tied weight
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
  acc.accumulate_sum(params, gradient<B>("embedding", shape_a, multiples(shape_a, 3)), 2);
  acc.accumulate_sum(params, gradient<B>("embedding", shape_a, multiples(shape_a, 1)), 2);
  const auto finished = acc.finish_mean(params);
  CHECK(finished.gradients.size() == 1);
  CHECK(values_of<float>(finished.gradients, "embedding") == as<float>(multiples(shape_a, 1)));
}

// ---------------------------------------------------------------------------------------------
// Rejections of accumulate_sum / accumulate_mean

TEST_CASE_TEMPLATE("a rejected microbatch changes neither values nor counters", B, GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  for_each_work_type([&]<class W>() {
    constexpr float_dtype dtype = dtype_of<W>;
    INFO("work dtype " << dtype);
    for (const bool mean : {false, true}) {
      INFO((mean ? "accumulate_mean" : "accumulate_sum"));
      weighted_gradients_accumulator<B> acc(dtype, 4.0);
      acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 3);
      const auto before = acc.try_to_record();
      const auto add = [&](const gradients_params<B>& grads, double weight) {
        mean ? acc.accumulate_mean(params, grads, weight) : acc.accumulate_sum(params, grads, weight);
      };
      const auto rejects = [&](const gradients_params<B>& grads, double weight, errc code, std::string_view id) {
        CAPTURE(weight);
        GRADACCUM_CHECK_REJECTED(add(grads, weight), code, id);
        GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
      };
      const auto good = gradient<B>("a", shape_a, multiples(shape_a, 1));

      for (const double weight : {-1.0, -0x1p-1074, not_a_number, infinity, -infinity})
        rejects(good, weight, errc::invalid_weight, "");
      if constexpr (dtype == float_dtype::f32) {
        rejects(good, 0x1p128, errc::invalid_weight, "");   // infinite as a float
        rejects(good, 0x1p-150, errc::invalid_weight, "");  // narrows to 0 as a float
        try {
          add(good, 0x1p-150);
          FAIL_CHECK("a weight that narrows to zero was accepted");
        } catch (const gradaccum::error& e) {  // the weight as given, not std::to_string's 0.000000
          CHECK(std::string_view(e.what()).find("weight 7.006492321624085e-46 ") != std::string_view::npos);
        }
      }

      // Every id is validated before any value is touched: "a" is fine and is not added either.
      gradients_params<B> unknown = gradient<B>("a", shape_a, multiples(shape_a, 1));
      unknown.insert("z", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
      rejects(unknown, 1, errc::unknown_parameters, "z");
      gradients_params<B> misshapen = gradient<B>("a", shape_a, multiples(shape_a, 1));
      misshapen.insert("b", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));  // b is [3, 2]
      rejects(misshapen, 1, errc::parameter_mismatch, "b");
      if (const auto other = backend_fixture<B>::other_device()) {
        gradients_params<B> elsewhere = gradient<B>("a", shape_a, multiples(shape_a, 1));
        elsewhere.insert("b", make_tensor<B, float>(shape_b, multiples(shape_b, 1), *other));
        rejects(elsewhere, 1, errc::parameter_mismatch, "b");
      }
    }

    // The running total must stay representable too.
    const double largest_half = dtype == float_dtype::f32 ? 0x1p127 : 0x1p1023;
    weighted_gradients_accumulator<B> acc(dtype, 1.0);
    acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), largest_half);
    const auto before = acc.try_to_record();
    GRADACCUM_CHECK_REJECTED(acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), largest_half),
                             errc::invalid_weight, "");
    GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
  });
  // What F32 rejects as a weight, F64 accepts.
  weighted_gradients_accumulator<B> acc(float_dtype::f64, 1.0);
  acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 0x1p-150);
  acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 0x1p128);
  CHECK(acc.state().total_weight == 0x1p128 + 0x1p-150);
}

TEST_CASE_TEMPLATE("a full microbatch counter is refused with counter_overflow", B, GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}});
  weighted_gradients_accumulator<B> source(float_dtype::f32, 1.0);
  source.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 2);
  auto record = source.try_to_record();
  record.state.microbatches = max_microbatches;

  weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
  acc.load_record(params, record);
  const auto before = acc.try_to_record();
  for (const double weight : {1.0, 0.0}) {
    CAPTURE(weight);
    GRADACCUM_CHECK_REJECTED(acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), weight),
                             errc::counter_overflow, "");
    GRADACCUM_CHECK_REJECTED(acc.accumulate_mean(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), weight),
                             errc::counter_overflow, "");
    GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
  }
  // The window can still be finished.
  const auto finished = acc.finish_mean(params);
  CHECK(finished.state.microbatches == max_microbatches);
  CHECK(values_of<float>(finished.gradients, "a") == as<float>(multiples(shape_a, 0.5)));
}

// ---------------------------------------------------------------------------------------------
// The plain summing accumulator

TEST_CASE_TEMPLATE("gradients_accumulator sums in a work dtype", B, GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}, {"h", {1, 2}}});
  gradients_accumulator<B> acc;

  SUBCASE("a window is F32 until an F64 gradient arrives, then F64 for every parameter") {
    acc.accumulate(params, gradient<B, float>("b", shape_b, multiples(shape_b, 1)));
    for_each_16bit_type<B>([&]<class T>() { acc.accumulate(params, gradient<B, T>("h", {1, 2}, {1, 2})); });
    CHECK(acc.pending().dtype() == float_dtype::f32);  // 16-bit gradients are summed in F32
    CHECK(acc.pending().dtype("b") == std::optional(float_dtype::f32));
    if (acc.pending().contains("h")) {
      CHECK(values_of<float>(acc.pending(), "h") == std::vector<float>{2, 4});  // F16 + BF16
    }
    const auto before = acc.try_to_record();
    acc.accumulate(params, gradient<B, double>("a", shape_a, multiples(shape_a, 1)));
    // The F32 sums are widened exactly: the same values, now F64.
    CHECK(acc.pending().dtype() == float_dtype::f64);
    CHECK(acc.pending().dtype("b") == std::optional(float_dtype::f64));
    CHECK(values_of<double>(acc.pending(), "b") == multiples(shape_b, 1));
    if (acc.pending().contains("h")) CHECK(values_of<double>(acc.pending(), "h") == std::vector<double>{2, 4});
    CHECK(acc.pending().size() == before.tensors.size() + 1);
    const auto taken = acc.grads();
    CHECK(acc.pending().empty());
    CHECK(values_of<double>(taken, "a") == multiples(shape_a, 1));
  }
  SUBCASE("accumulate_with_dtype converts pending tensors to the work dtype") {
    acc.accumulate(params, gradient<B, float>("a", shape_a, {1 + 0x1p-23, 1, 1, 1, 1, 1}));
    acc.accumulate_with_dtype(params, gradient<B, float>("b", shape_b, multiples(shape_b, 1)), float_dtype::f64);
    CHECK(acc.pending().dtype("a") == std::optional(float_dtype::f64));
    CHECK(values_of<double>(acc.pending(), "a") == std::vector<double>{1 + 0x1p-23, 1, 1, 1, 1, 1});
    const auto before = acc.try_to_record();
    GRADACCUM_CHECK_REJECTED(
        acc.accumulate_with_dtype(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), float_dtype::f16),
        errc::invalid_dtype, "");
    GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
  }
  SUBCASE("accumulate_scaled multiplies after conversion and refuses unusable multipliers") {
    acc.accumulate_scaled(params, gradient<B, float>("a", shape_a, multiples(shape_a, 1)), 0.5, float_dtype::f32);
    CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 0.5)));
    const auto before = acc.try_to_record();
    for (const double multiplier : {not_a_number, infinity, 0x1p128, 0x1p-150}) {
      CAPTURE(multiplier);
      GRADACCUM_CHECK_REJECTED(
          acc.accumulate_scaled(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), multiplier, float_dtype::f32),
          errc::invalid_scalar, "");
      GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
    }
  }
  SUBCASE("load_record refuses 16-bit pending sums") {
    acc.accumulate(params, gradient<B, float>("a", shape_a, multiples(shape_a, 1)));
    const auto before = acc.try_to_record();
    gradients_params_record record = before;
    record.tensors[0].dtype = float_dtype::bf16;
    record.tensors[0].values = std::vector<std::uint16_t>(6, 0x3f80);
    GRADACCUM_CHECK_REJECTED(acc.load_record(params, record), errc::invalid_dtype, "a");
    GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
  }
}

TEST_SUITE_END();
