/// @file
/// @brief The accumulation contract, written once and run against every
/// backend in `GRADACCUM_TEST_BACKENDS`.
///
/// Values are chosen so that the arithmetic is exact (small integers, powers of two) wherever
/// the contract fixes a result, and compared with `==` or bit for bit. Every rejection is
/// checked for its `errc`, the offending id, and that values and counters did not change.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

// Before doctest: c10 defines a CHECK macro, which doctest's must replace.
#if GRADACCUM_TEST_HAVE_TORCH
#include <gradaccum/backends/torch.hpp>
#endif

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>

#include "backend_fixtures.hpp"
#include "test_helpers.hpp"

namespace {

using namespace gradaccum;
using namespace gradaccum::test;

constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();
constexpr double infinity = std::numeric_limits<double>::infinity();
constexpr std::uint64_t max_microbatches = std::numeric_limits<std::uint64_t>::max();

// Non-square, so a transposed layout cannot pass for a correct one.
const tensor_shape shape_a{2, 3};
const tensor_shape shape_b{3, 2};

/// A microbatch's gradients with one entry: `id` → T tensor of `shape` holding `values`.
template <class B, class T = float>
gradients_params<B> gradient(std::string_view id, const tensor_shape& shape, const std::vector<double>& values,
                             const device_t<B>& device = backend_fixture<B>::device()) {
  gradients_params<B> grads;
  grads.insert(id, make_tensor<B, T>(shape, std::span<const double>(values), device));
  return grads;
}

/// What `call` throws, as text; empty when it throws nothing.
template <class Call>
std::string message_of(const Call& call) {
  try {
    call();
  } catch (const error& e) {
    return e.what();
  }
  return {};
}

/// Whether `g`'s buffer is zero outside its present segments, as its invariant says.
template <class W, class B>
bool zero_outside_present(const flat_gradients<B>& g) {
  const std::span<const W> all = g.template flat<W>();
  std::vector<bool> inside(all.size(), false);
  for (const auto& e : g) std::fill_n(inside.begin() + static_cast<std::ptrdiff_t>(e.offset), e.size, true);
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (!inside[i] && all[i] != W{0}) return false;
  }
  return true;
}

}  // namespace

TEST_SUITE_BEGIN("conformance");

// ---------------------------------------------------------------------------------------------
// parameter_set and gradients_params

TEST_CASE_TEMPLATE("parameter_set keeps parameters in order and counts a tied parameter once", B,
                   GRADACCUM_TEST_BACKENDS) {
  parameter_set<B> params;
  CHECK(params.empty());
  CHECK(params.add("embedding", filled<B, float>(shape_a, 0.0)) == 0);
  CHECK(params.add("head.bias", filled<B, double>(shape_b, 1.0)) == 1);
  // A decoder that reuses the embedding matrix adds it again: a tie, not a second parameter.
  CHECK(params.add("embedding", filled<B, float>(shape_a, 5.0)) == 0);
  REQUIRE(params.size() == 2);
  CHECK(params[0].id == "embedding");
  CHECK(params[0].shape == shape_a);
  CHECK(params[0].device == backend_fixture<B>::device());
  CHECK(params[1].id == "head.bias");
  CHECK(params[1].shape == shape_b);
  CHECK(params.find("head.bias") == std::optional<std::size_t>(1));
  CHECK(params.contains("embedding"));
  CHECK_FALSE(params.contains("head.weight"));

  SUBCASE("a tie with another shape is refused and changes nothing") {
    GRADACCUM_CHECK_REJECTED(params.add("embedding", filled<B, float>(shape_b, 0.0)), errc::parameter_mismatch,
                             "embedding");
    CHECK(params.size() == 2);
    CHECK(params[0].shape == shape_a);
  }
  if (const auto other = backend_fixture<B>::other_device()) {
    SUBCASE("a tie on another device is refused and changes nothing") {
      GRADACCUM_CHECK_REJECTED(params.add("embedding", filled<B, float>(shape_a, 0.0, *other)),
                               errc::parameter_mismatch, "embedding");
      CHECK(params.size() == 2);
      CHECK(params[0].device == backend_fixture<B>::device());
    }
  }
  if constexpr (gradaccum::detail::has_views<B>) {
    SUBCASE("a parameter can be added from a view of caller memory") {
      const auto storage = filled<B, float>(shape_b, 2.0);
      CHECK(params.add("viewed", backend_fixture<B>::view_of(storage)) == 2);
      CHECK(params[2].shape == shape_b);
    }
  }
}

TEST_CASE_TEMPLATE("gradients_params holds present gradients of any element type, keyed by id", B,
                   GRADACCUM_TEST_BACKENDS) {
  gradients_params<B> grads;
  CHECK(grads.empty());
  CHECK(grads.size() == 0);
  grads.insert("a", make_tensor<B, float>(shape_a, {1, 2, 3, 4, 5, 6}));
  grads.insert("b", make_tensor<B, double>(shape_b, {6, 5, 4, 3, 2, 1}));
  CHECK(grads.size() == 2);
  CHECK(grads.contains("a"));
  CHECK_FALSE(grads.contains("c"));  // absent means absent
  CHECK(grads.dtype("a") == std::optional(float_dtype::f32));
  CHECK(grads.dtype("b") == std::optional(float_dtype::f64));
  CHECK(values_of<float>(grads, "a") == std::vector<float>{1, 2, 3, 4, 5, 6});
  CHECK(values_of<double>(grads, "b") == std::vector<double>{6, 5, 4, 3, 2, 1});
  CHECK(grads.template get<double>("a") == nullptr);                         // another element type
  CHECK(grads.template get<float>("c") == nullptr);                          // absent
  CHECK(grads.template get_at<float>(0) == grads.template get<float>("a"));  // by position, in order
  CHECK(grads.template get_at<double>(1) == grads.template get<double>("b"));
  CHECK(grads.template get_at<double>(0) == nullptr);

  SUBCASE("insert refuses an id that is present, changing nothing; insert_or_assign replaces") {
    GRADACCUM_CHECK_REJECTED(grads.insert("a", make_tensor<B, double>(shape_a, {7, 7, 7, 7, 7, 7})),
                             errc::invalid_record, "a");
    CHECK(message_of([&] {
            grads.insert("a", make_tensor<B, float>(shape_a, {7, 7, 7, 7, 7, 7}));
          }).find("insert_or_assign") != std::string::npos);
    CHECK(grads.size() == 2);
    CHECK(values_of<float>(grads, "a") == std::vector<float>{1, 2, 3, 4, 5, 6});
    grads.insert_or_assign("a", make_tensor<B, double>(shape_a, {7, 7, 7, 7, 7, 7}));
    CHECK(grads.size() == 2);
    CHECK(grads.template get<float>("a") == nullptr);
    CHECK(values_of<double>(grads, "a") == std::vector<double>(6, 7.0));
    grads.insert_or_assign("c", make_tensor<B, float>(shape_a, {1, 1, 1, 1, 1, 1}));  // absent: inserted
    CHECK(grads.size() == 3);
  }
  SUBCASE("16-bit gradients keep their dtype") {
    for_each_16bit_type<B>([&]<class T>() {
      grads.insert_or_assign("h", make_tensor<B, T>(shape_a, {1, 2, 3, 4, 5, 6}));
      CHECK(grads.dtype("h") == std::optional(dtype_of<T>));
      CHECK(grads.template get<T>("h") != nullptr);
    });
  }
  if constexpr (gradaccum::detail::has_views<B>) {
    SUBCASE("a view is held as a view: visible to find_value, not to get<T>") {
      const auto storage = make_tensor<B, float>(shape_a, {1, 2, 3, 4, 5, 6});
      grads.insert("v", backend_fixture<B>::view_of(storage));
      CHECK(grads.contains("v"));
      CHECK(grads.find_value("v") != nullptr);
      CHECK(grads.template get<float>("v") == nullptr);
      CHECK(grads.template get_at<float>(2) == nullptr);  // views are never handed out mutably
      CHECK(grads.dtype("v") == std::optional(float_dtype::f32));
    }
  }
  SUBCASE("erase removes one id and keeps the others") {
    CHECK(grads.erase("a"));
    CHECK_FALSE(grads.erase("a"));
    CHECK(grads.size() == 1);
    CHECK(values_of<double>(grads, "b") == std::vector<double>{6, 5, 4, 3, 2, 1});
  }
}

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

TEST_CASE_TEMPLATE("a result's buffer comes back zero outside its present segments, whatever flat<W>() wrote", B,
                   GRADACCUM_TEST_BACKENDS) {
  // Weight decay over the whole flat vector writes absent segments and padding too.
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  for_each_work_type([&]<class W>() {
    INFO("work dtype " << dtype_of<W>);
    weighted_gradients_accumulator<B> acc(dtype_of<W>, 1.0);
    acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 1);
    const weighted_gradients_record saved = acc.try_to_record();
    const auto decayed = [&] {
      auto result = acc.finish_mean(params);
      for (W& v : result.gradients.template flat<W>()) v = v + W{0.25};
    };  // the result is dropped: its buffer serves the next window
    decayed();
    acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 1);
    CHECK(zero_outside_present<W>(acc.pending()));
    acc.accumulate_sum(params, gradient<B>("b", shape_b, multiples(shape_b, 1)), 1);
    CHECK(values_of<W>(acc.pending(), "b") == as<W>(multiples(shape_b, 1)));  // not 1.25, 2.25, ...
    decayed();
    // A load takes the recycled buffer too: what it does not overwrite is zero.
    acc.load_record(params, saved);
    CHECK(values_of<W>(acc.pending(), "a") == as<W>(multiples(shape_a, 1)));
    CHECK_FALSE(acc.pending().contains("b"));
    CHECK(zero_outside_present<W>(acc.pending()));
  });
}

TEST_CASE_TEMPLATE("a result asked for the other work type refuses with invalid_dtype; an absent id is absent", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  weighted_gradients_accumulator<B> acc(float_dtype::f64, 1.0);
  acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 1);
  auto result = acc.finish_mean(params);
  auto& g = result.gradients;
  const auto& read_only = g;
  GRADACCUM_CHECK_REJECTED(read_only.template get<float>("a"), errc::invalid_dtype, "");
  GRADACCUM_CHECK_REJECTED(read_only.template values<float>("a"), errc::invalid_dtype, "");
  GRADACCUM_CHECK_REJECTED(read_only.template values<float>("b"), errc::invalid_dtype, "");
  GRADACCUM_CHECK_REJECTED(read_only.template values<float>(*read_only.begin()), errc::invalid_dtype, "");
  GRADACCUM_CHECK_REJECTED(read_only.template flat<float>(), errc::invalid_dtype, "");
  GRADACCUM_CHECK_REJECTED(g.template flat<float>(), errc::invalid_dtype, "");
  const std::string message = message_of([&] { (void)g.template flat<float>(); });
  CHECK(message.find("F64") != std::string::npos);
  CHECK(message.find("F32") != std::string::npos);
  CHECK_FALSE(read_only.template get<double>("b").has_value());  // absent
  CHECK(read_only.template values<double>("b").empty());
  CHECK(values_of<double>(g, "a") == multiples(shape_a, 1));   // nothing changed
  CHECK(flat_gradients<B>().template flat<double>().empty());  // nothing laid out: no values of any type
}

TEST_CASE_TEMPLATE("a pending gradient that a smaller parameter set lacks is refused as pending, changing nothing", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  const auto smaller = make_parameters<B>({{"a", shape_a}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
  acc.accumulate_sum(params, gradient<B>("b", shape_b, multiples(shape_b, 1)), 1);
  const auto before = acc.try_to_record();
  GRADACCUM_CHECK_REJECTED(acc.accumulate_sum(smaller, gradient<B>("a", shape_a, multiples(shape_a, 1)), 1),
                           errc::unknown_parameters, "b");
  GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
  CHECK(message_of([&] {
          acc.accumulate_sum(smaller, gradient<B>("a", shape_a, multiples(shape_a, 1)), 1);
        }).find("pending in this window") != std::string::npos);
  GRADACCUM_CHECK_REJECTED((void)acc.finish_mean(smaller), errc::unknown_parameters, "b");
  GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
  CHECK(message_of([&] { (void)acc.finish_mean(smaller); }).find("pending in this window") != std::string::npos);
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
// Finishing, inspecting and snapshotting a window

TEST_CASE_TEMPLATE("finish_sums returns the loss-scaled sums and the window's state, then resets", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  for_each_work_type([&]<class W>() {
    INFO("work dtype " << dtype_of<W>);
    weighted_gradients_accumulator<B> acc(dtype_of<W>, 1024.0);
    acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1024)), 3);
    acc.accumulate_mean(params, gradient<B>("b", shape_b, multiples(shape_b, 1024)), 2);
    const auto sums = acc.finish_sums();
    CHECK(values_of<W>(sums.gradients, "a") == as<W>(multiples(shape_a, 1024)));
    CHECK(values_of<W>(sums.gradients, "b") == as<W>(multiples(shape_b, 2048)));
    CHECK(sums.state == weighted_accumulation_state{dtype_of<W>, 1024.0, 5.0, 2});
    // Reset: counters zero, nothing pending, dtype and loss scale kept for the next window.
    CHECK(acc.state() == weighted_accumulation_state{dtype_of<W>, 1024.0, 0.0, 0});
    CHECK(acc.pending().empty());
    acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1024)), 1);
    CHECK(values_of<W>(acc.pending(), "a") == as<W>(multiples(shape_a, 1024)));
  });
}

TEST_CASE_TEMPLATE("finish_mean returns the normalized gradients and the window's state, then resets", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 4.0);
  acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 32)), 8);
  const auto finished = acc.finish_mean(params);
  CHECK(values_of<float>(finished.gradients, "a") == as<float>(multiples(shape_a, 1)));
  CHECK(finished.state == weighted_accumulation_state{float_dtype::f32, 4.0, 8.0, 1});
  CHECK(acc.state() == weighted_accumulation_state{float_dtype::f32, 4.0, 0.0, 0});
  CHECK(acc.pending().empty());
  GRADACCUM_CHECK_REJECTED(acc.finish_mean(params), errc::empty_weight, "");
  // The next window starts from zero.
  acc.accumulate_sum(params, gradient<B>("b", shape_b, multiples(shape_b, 8)), 2);
  const auto next = acc.finish_mean(params);
  CHECK_FALSE(next.gradients.contains("a"));
  CHECK(values_of<float>(next.gradients, "b") == as<float>(multiples(shape_b, 1)));
}

TEST_CASE_TEMPLATE("a refused finish_mean clears nothing", B, GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 2.0);
  GRADACCUM_CHECK_REJECTED(acc.finish_mean(params), errc::empty_weight, "");
  acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 3)), 3);
  const auto before = acc.try_to_record();
  // The pending ids must fit the parameters it is given.
  GRADACCUM_CHECK_REJECTED(acc.finish_mean(make_parameters<B>({{"b", shape_b}})), errc::unknown_parameters, "a");
  GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
  GRADACCUM_CHECK_REJECTED(acc.finish_mean(make_parameters<B>({{"a", shape_b}})), errc::parameter_mismatch, "a");
  GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
}

TEST_CASE_TEMPLATE("state() and try_to_record() inspect without resetting", B, GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"b", shape_b}, {"a", shape_a}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 2.0);
  gradients_params<B> grads = gradient<B>("b", shape_b, {1, 2, 3, 4, 5, 6});
  grads.insert("a", make_tensor<B, float>(shape_a, {-1, -2, -3, -4, -5, -6}));
  acc.accumulate_sum(params, grads, 3);

  const weighted_gradients_record record = acc.try_to_record();
  CHECK(acc.state() == weighted_accumulation_state{float_dtype::f32, 2.0, 3.0, 1});
  CHECK(record.state == acc.state());
  // Sorted by id whatever the order of parameters and gradients; row-major values.
  REQUIRE(record.gradients.tensors.size() == 2);
  const tensor_record& a = record.gradients.tensors[0];
  const tensor_record& b = record.gradients.tensors[1];
  CHECK(a.id == "a");
  CHECK(a.dtype == float_dtype::f32);
  CHECK(a.shape == std::vector<std::uint64_t>{2, 3});
  CHECK(a.values == record_values(std::vector<float>{-1, -2, -3, -4, -5, -6}));
  CHECK(b.id == "b");
  CHECK(b.shape == std::vector<std::uint64_t>{3, 2});
  CHECK(b.values == record_values(std::vector<float>{1, 2, 3, 4, 5, 6}));

  GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), record);  // a second snapshot sees the same window
  acc.accumulate_sum(params, grads, 1);
  CHECK(acc.state() == weighted_accumulation_state{float_dtype::f32, 2.0, 4.0, 2});
  CHECK(values_of<float>(acc.pending(), "b") == std::vector<float>{2, 4, 6, 8, 10, 12});
}

TEST_CASE_TEMPLATE("equal windows give bit-identical records", B, GRADACCUM_TEST_BACKENDS) {
  const auto forward = make_parameters<B>({{"a", shape_a}, {"b", shape_b}, {"c", {1, 1}}});
  const auto backward = make_parameters<B>({{"c", {1, 1}}, {"b", shape_b}, {"a", shape_a}});
  gradients_params<B> ab = gradient<B>("a", shape_a, multiples(shape_a, 0.25));
  ab.insert("b", make_tensor<B, double>(shape_b, multiples(shape_b, 3)));
  gradients_params<B> ba = gradient<B, double>("b", shape_b, multiples(shape_b, 3));
  ba.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 0.25)));

  weighted_gradients_accumulator<B> first(float_dtype::f64, 8.0);
  weighted_gradients_accumulator<B> second(float_dtype::f64, 8.0);
  first.accumulate_mean(forward, ab, 3);
  second.accumulate_mean(backward, ba, 3);
  GRADACCUM_CHECK_SAME_BITS(first.try_to_record(), second.try_to_record());
  CHECK(first.try_to_record() == second.try_to_record());
}

TEST_CASE_TEMPLATE("non_finite names the pending ids that overflowed, and changes nothing", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", {1, 2}}, {"b", {1, 2}}, {"c", {1, 2}}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
  CHECK(acc.non_finite().empty());
  gradients_params<B> grads = gradient<B>("b", {1, 2}, {0x1p127, 1});  // 2^127 + 2^127 overflows F32
  grads.insert("a", make_tensor<B, float>({1, 2}, {1, 0x1p127}));
  grads.insert("c", make_tensor<B, float>({1, 2}, {1, 1}));
  acc.accumulate_sum(params, grads, 1);
  CHECK(acc.non_finite().empty());
  acc.accumulate_sum(params, grads, 1);
  const auto before = acc.try_to_record();
  CHECK(acc.non_finite() == std::vector<std::string>{"a", "b"});  // sorted
  CHECK(acc.non_finite() == std::vector<std::string>{"a", "b"});
  GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);

  gradients_accumulator<B> plain;
  plain.accumulate(params, gradient<B, double>("c", {1, 2}, {not_a_number, 1}));
  const auto plain_before = plain.try_to_record();
  CHECK(plain.non_finite() == std::vector<std::string>{"c"});
  GRADACCUM_CHECK_SAME_BITS(plain.try_to_record(), plain_before);
}

TEST_CASE_TEMPLATE("accumulators are movable and keep their window", B, GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 2.0);
  acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 2)), 1);
  const auto before = acc.try_to_record();
  weighted_gradients_accumulator<B> moved(std::move(acc));
  GRADACCUM_CHECK_SAME_BITS(moved.try_to_record(), before);
  weighted_gradients_accumulator<B> assigned(float_dtype::f64, 1.0);
  assigned = std::move(moved);
  GRADACCUM_CHECK_SAME_BITS(assigned.try_to_record(), before);
  assigned.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 2)), 1);
  CHECK(values_of<float>(assigned.finish_mean(params).gradients, "a") == as<float>(multiples(shape_a, 1)));
}

// ---------------------------------------------------------------------------------------------
// Restoring a window

TEST_CASE_TEMPLATE("load_record restores values and counters; a resumed window equals an uninterrupted one", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  for_each_work_type([&]<class W>() {
    INFO("work dtype " << dtype_of<W>);
    weighted_gradients_accumulator<B> uninterrupted(dtype_of<W>, 16.0);
    uninterrupted.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 0.75)), 3);
    uninterrupted.accumulate_mean(params, gradient<B, double>("b", shape_b, multiples(shape_b, 0.5)), 5);
    const weighted_gradients_record checkpoint = uninterrupted.try_to_record();

    // A different dtype and loss scale: the record's win.
    weighted_gradients_accumulator<B> resumed(dtype_of<W> == float_dtype::f32 ? float_dtype::f64 : float_dtype::f32,
                                              3.0);
    resumed.accumulate_sum(params, gradient<B>("b", shape_b, multiples(shape_b, 1)), 1);  // discarded by the load
    resumed.load_record(params, checkpoint);
    CHECK(resumed.state() == checkpoint.state);
    GRADACCUM_CHECK_SAME_BITS(resumed.try_to_record(), checkpoint);

    for (auto* acc : {&uninterrupted, &resumed}) {
      acc->accumulate_mean(params, gradient<B>("a", shape_a, multiples(shape_a, 0.125)), 7);
    }
    GRADACCUM_CHECK_SAME_BITS(resumed.try_to_record(), uninterrupted.try_to_record());
    const auto expected = uninterrupted.finish_mean(params);
    const auto actual = resumed.finish_mean(params);
    GRADACCUM_CHECK_SAME_BITS(actual.gradients.to_record(), expected.gradients.to_record());
    CHECK(actual.state == expected.state);
  });
}

TEST_CASE_TEMPLATE("load_record refuses an inconsistent record and leaves the accumulator unchanged", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  weighted_gradients_accumulator<B> source(float_dtype::f32, 4.0);
  source.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 2);
  source.accumulate_sum(params, gradient<B>("b", shape_b, multiples(shape_b, 1)), 2);
  const weighted_gradients_record valid = source.try_to_record();
  REQUIRE(valid.gradients.tensors.size() == 2);

  weighted_gradients_accumulator<B> acc(float_dtype::f64, 2.0);
  acc.accumulate_sum(params, gradient<B>("b", shape_b, multiples(shape_b, 3)), 1);
  const auto before = acc.try_to_record();
  const auto rejects = [&](const weighted_gradients_record& record, errc code, std::string_view id) {
    GRADACCUM_CHECK_REJECTED(acc.load_record(params, record), code, id);
    GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
  };
  // Applies `change` to a copy of the valid record.
  const auto changed = [&](auto&& change) {
    weighted_gradients_record record = valid;
    change(record);
    return record;
  };
  using R = weighted_gradients_record;

  SUBCASE("invalid state") {
    for (const float_dtype dtype : {float_dtype::f16, float_dtype::bf16, static_cast<float_dtype>(7)}) {
      rejects(changed([&](R& r) { r.state.dtype = dtype; }), errc::invalid_state, "");
    }
    for (const double loss_scale : {0.0, -1.0, not_a_number, infinity, 0x1p128, 0x1p-150}) {
      CAPTURE(loss_scale);
      rejects(changed([&](R& r) { r.state.loss_scale = loss_scale; }), errc::invalid_state, "");
    }
    for (const double total_weight : {-1.0, not_a_number, infinity, 0x1p128, 0x1p-150}) {
      CAPTURE(total_weight);
      rejects(changed([&](R& r) { r.state.total_weight = total_weight; }), errc::invalid_state, "");
    }
    rejects(changed([](R& r) { r.state.microbatches = 0; }), errc::invalid_state, "");  // weight without microbatches
    rejects(changed([](R& r) { r.state.total_weight = 0; }), errc::invalid_state, "");  // pending values, no weight
  }
  SUBCASE("a pending tensor of another dtype than the state's") {
    rejects(changed([](R& r) {
              r.gradients.tensors[1].dtype = float_dtype::f64;
              r.gradients.tensors[1].values = std::vector<double>(6, 1.0);
            }),
            errc::invalid_state, "b");
    rejects(changed([](R& r) {
              r.gradients.tensors[0].dtype = float_dtype::f16;
              r.gradients.tensors[0].values = std::vector<std::uint16_t>(6, 0x3c00);
            }),
            errc::invalid_state, "a");
  }
  SUBCASE("tensors that do not fit the parameter set") {
    rejects(changed([](R& r) {
              r.gradients.tensors.push_back(r.gradients.tensors[1]);
              r.gradients.tensors.back().id = "c";
            }),
            errc::unknown_parameters, "c");
    rejects(changed([](R& r) { r.gradients.tensors[0].shape = {3, 2}; }), errc::parameter_mismatch, "a");
    rejects(changed([](R& r) { r.gradients.tensors[1].shape = {6}; }), errc::parameter_mismatch, "b");
  }
  SUBCASE("malformed tensors") {
    rejects(changed([](R& r) { r.gradients.tensors[0].values = std::vector<float>(5, 1.0F); }), errc::invalid_record,
            "a");
    rejects(changed([](R& r) { r.gradients.tensors[0].values = std::vector<double>(6, 1.0); }), errc::invalid_record,
            "a");
    rejects(changed([](R& r) { r.gradients.tensors[1].shape = std::vector<std::uint64_t>(max_rank + 1, 1); }),
            errc::invalid_record, "b");
    rejects(changed([](R& r) {
              r.gradients.tensors[1].shape = {std::uint64_t{1} << 32, std::uint64_t{1} << 32};
            }),
            errc::invalid_record, "b");
    rejects(changed([](R& r) { r.gradients.tensors.push_back(r.gradients.tensors[0]); }), errc::invalid_record, "a");
  }
}

TEST_CASE_TEMPLATE("from_accumulator reattaches a saved state to restored sums, with the checks of load_record", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  weighted_gradients_accumulator<B> source(float_dtype::f64, 4.0);
  source.accumulate_mean(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 2);
  source.accumulate_sum(params, gradient<B>("b", shape_b, multiples(shape_b, 1)), 2);
  const weighted_gradients_record checkpoint = source.try_to_record();

  gradients_accumulator<B> sums;
  sums.load_record(params, checkpoint.gradients);
  const auto sums_before = sums.try_to_record();
  const auto rejects = [&](const parameter_set<B>& against, const weighted_accumulation_state& state, errc code,
                           std::string_view id) {
    GRADACCUM_CHECK_REJECTED(weighted_gradients_accumulator<B>::from_accumulator(against, std::move(sums), state), code,
                             id);
    GRADACCUM_CHECK_SAME_BITS(sums.try_to_record(), sums_before);  // moved from only on success
  };
  const auto with = [&](auto&& change) {
    weighted_accumulation_state state = checkpoint.state;
    change(state);
    return state;
  };
  using S = weighted_accumulation_state;

  rejects(params, with([](S& s) { s.dtype = float_dtype::f16; }), errc::invalid_state, "");
  rejects(params, with([](S& s) { s.loss_scale = -4; }), errc::invalid_state, "");
  rejects(params, with([](S& s) { s.total_weight = not_a_number; }), errc::invalid_state, "");
  rejects(params, with([](S& s) { s.microbatches = 0; }), errc::invalid_state, "");
  rejects(params, with([](S& s) { s.total_weight = 0; }), errc::invalid_state, "");
  rejects(params, with([](S& s) { s.dtype = float_dtype::f32; }), errc::invalid_state, "a");  // pending are F64
  rejects(make_parameters<B>({{"a", shape_a}}), checkpoint.state, errc::unknown_parameters, "b");
  rejects(make_parameters<B>({{"a", shape_a}, {"b", shape_a}}), checkpoint.state, errc::parameter_mismatch, "b");

  auto restored = weighted_gradients_accumulator<B>::from_accumulator(params, std::move(sums), checkpoint.state);
  GRADACCUM_CHECK_SAME_BITS(restored.try_to_record(), checkpoint);
  for (auto* acc : {&source, &restored})
    acc->accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 3)), 1);
  GRADACCUM_CHECK_SAME_BITS(restored.finish_mean(params).gradients.to_record(),
                            source.finish_mean(params).gradients.to_record());
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

// ---------------------------------------------------------------------------------------------
// Views

TEST_CASE_TEMPLATE("gradients viewed in caller memory accumulate exactly like owned ones", B, GRADACCUM_TEST_BACKENDS) {
  if constexpr (gradaccum::detail::has_views<B>) {
    const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
    const auto a = make_tensor<B, float>(shape_a, {0.1, 0.2, 0.3, 0.4, 0.5, 0.6});
    const auto b = make_tensor<B, double>(shape_b, {-0.1, -0.2, -0.3, -0.4, -0.5, -0.6});
    gradients_params<B> owned;
    owned.insert("a", a);
    owned.insert("b", b);
    gradients_params<B> viewed;
    viewed.insert("a", backend_fixture<B>::view_of(a));
    viewed.insert("b", backend_fixture<B>::view_of(b));

    weighted_gradients_accumulator<B> from_owned(float_dtype::f32, 3.0);
    weighted_gradients_accumulator<B> from_views(float_dtype::f32, 3.0);
    for (const double weight : {3.0, 5.0}) {
      from_owned.accumulate_mean(params, owned, weight);
      from_views.accumulate_mean(params, viewed, weight);
    }
    GRADACCUM_CHECK_SAME_BITS(from_views.try_to_record(), from_owned.try_to_record());
  }
}

TEST_CASE_TEMPLATE("a gradients_params reused across microbatches is checked in full on every call", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
  gradients_params<B> grads = gradient<B>("b", shape_b, multiples(shape_b, 1));
  grads.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  acc.accumulate_sum(params, grads, 1);

  // insert_or_assign under the same ids replaces the values.
  grads.insert_or_assign("a", make_tensor<B, float>(shape_a, multiples(shape_a, 10)));
  acc.accumulate_sum(params, grads, 1);
  CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 11)));
  CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 2)));

  const auto before = acc.try_to_record();
  const auto rejects = [&](errc code, std::string_view id) {
    GRADACCUM_CHECK_REJECTED(acc.accumulate_sum(params, grads, 1), code, id);
    GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
  };
  // Same ids, but a value of another shape: replaced, or changed in place through get<T>.
  grads.insert_or_assign("a", make_tensor<B, float>(shape_b, multiples(shape_b, 1)));
  rejects(errc::parameter_mismatch, "a");
  grads.insert_or_assign("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  *grads.template get<float>("a") = make_tensor<B, float>(shape_b, multiples(shape_b, 1));
  rejects(errc::parameter_mismatch, "a");
  grads.insert_or_assign("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  // Changed ids are resolved again.
  CHECK(grads.erase("b"));
  grads.insert("z", make_tensor<B, float>(shape_b, multiples(shape_b, 1)));
  rejects(errc::unknown_parameters, "z");
  grads.clear();
  grads.insert("b", make_tensor<B, float>(shape_b, multiples(shape_b, 100)));
  acc.accumulate_sum(params, grads, 1);
  CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 11)));
  CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 102)));

  // The same gradients against another set (other positions), and against a set that grew.
  auto reordered = make_parameters<B>({{"c", shape_a}, {"b", shape_b}, {"a", shape_a}});
  grads.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  acc.accumulate_sum(reordered, grads, 1);
  reordered.add("d", make_tensor<B, float>(shape_b, multiples(shape_b, 0)));
  const gradients_params<B> copy = grads;
  acc.accumulate_sum(reordered, copy, 1);
  CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 13)));
  CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 302)));

  if constexpr (gradaccum::detail::has_views<B>) {
    // A re-seated view, another parameter set or a repeated refused call is checked again.
    const auto good = make_tensor<B, float>(shape_a, multiples(shape_a, 1));
    const auto misshapen = make_tensor<B, float>(shape_b, multiples(shape_b, 1));
    gradients_params<B> viewed;
    viewed.insert_or_assign("a", backend_fixture<B>::view_of(good));
    weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
    window.accumulate_sum(params, viewed, 1);
    window.accumulate_sum(params, viewed, 1);
    const auto kept = window.try_to_record();
    viewed.insert_or_assign("a", backend_fixture<B>::view_of(misshapen));
    for (int attempt = 0; attempt < 2; ++attempt) {
      GRADACCUM_CHECK_REJECTED(window.accumulate_sum(params, viewed, 1), errc::parameter_mismatch, "a");
    }
    viewed.insert_or_assign("a", backend_fixture<B>::view_of(good));
    const auto transposed = make_parameters<B>({{"a", shape_b}});
    GRADACCUM_CHECK_REJECTED(window.accumulate_sum(transposed, viewed, 1), errc::parameter_mismatch, "a");
    GRADACCUM_CHECK_SAME_BITS(window.try_to_record(), kept);
    window.accumulate_sum(params, viewed, 1);
    CHECK(values_of<float>(window.pending(), "a") == as<float>(multiples(shape_a, 3)));
  }
}

TEST_CASE_TEMPLATE("bound gradients check their owned tensors on every call, whatever replaced what", B,
                   GRADACCUM_TEST_BACKENDS) {
  // Views are checked once, at insert; owned tensors, which get<T> hands out mutably, on every
  // call. Each way an entry changes kind (tensor over view, view over tensor, erase, clear)
  // must keep the owned ones checked.
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
  gradients_params<B> grads(params);
  const auto ones_a = make_tensor<B, float>(shape_a, multiples(shape_a, 1));
  const auto misshapen = [] { return make_tensor<B, float>(shape_b, multiples(shape_b, 1)); };
  const auto owned_a_is_checked = [&] {
    const auto before = acc.try_to_record();
    const auto kept = *grads.template get<float>("a");
    *grads.template get<float>("a") = misshapen();
    GRADACCUM_CHECK_REJECTED(acc.accumulate_sum(params, grads, 1), errc::parameter_mismatch, "a");
    GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
    *grads.template get<float>("a") = kept;
  };
  grads.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  grads.insert("b", make_tensor<B, float>(shape_b, multiples(shape_b, 2)));
  grads.insert_or_assign("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));  // a tensor over a tensor
  CHECK(grads.owned_count() == 2);
  owned_a_is_checked();
  acc.accumulate_sum(params, grads, 1);
  if constexpr (gradaccum::detail::has_views<B>) {
    const auto fives_b = make_tensor<B, float>(shape_b, multiples(shape_b, 5));
    grads.insert_or_assign("b", backend_fixture<B>::view_of(fives_b));  // a view over a tensor
    CHECK(grads.owned_count() == 1);
    owned_a_is_checked();
    acc.accumulate_sum(params, grads, 1);
    grads.insert_or_assign("a", backend_fixture<B>::view_of(ones_a));  // a view over a tensor
    CHECK(grads.owned_count() == 0);
    acc.accumulate_sum(params, grads, 1);
    grads.insert_or_assign("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));  // a tensor over a view
    CHECK(grads.owned_count() == 1);
    owned_a_is_checked();
    acc.accumulate_sum(params, grads, 1);
    CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 4)));
    CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 17)));
    CHECK(grads.erase("b"));  // erasing a view keeps the count
    CHECK(grads.owned_count() == 1);
    owned_a_is_checked();
  } else {
    CHECK(grads.erase("b"));
    CHECK(grads.owned_count() == 1);
  }
  CHECK(grads.erase("a"));
  CHECK(grads.owned_count() == 0);
  grads.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  CHECK(grads.owned_count() == 1);
  owned_a_is_checked();
  grads.clear();
  CHECK(grads.owned_count() == 0);
  grads.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  CHECK(grads.owned_count() == 1);
  owned_a_is_checked();
}

TEST_CASE_TEMPLATE("calls repeated with unchanged views add into the right tensors after every change", B,
                   GRADACCUM_TEST_BACKENDS) {
  if constexpr (gradaccum::detail::has_views<B>) {
    // An accumulator skips checking views (of a backend whose views keep their geometry) that
    // did not change since the last call: re-seated views, a copy of the gradients, a copy of
    // the accumulator, new pending tensors and a work dtype change must each be followed.
    const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
    const auto ones_a = make_tensor<B, float>(shape_a, multiples(shape_a, 1));
    const auto tens_a = make_tensor<B, float>(shape_a, multiples(shape_a, 10));
    const auto ones_b = make_tensor<B, double>(shape_b, multiples(shape_b, 1));
    gradients_params<B> viewed;
    viewed.insert("a", backend_fixture<B>::view_of(ones_a));
    viewed.insert("b", backend_fixture<B>::view_of(ones_b));
    gradients_accumulator<B> acc;
    const auto call = [&](const gradients_params<B>& grads, int times) {
      for (int k = 0; k < times; ++k) acc.accumulate_with_dtype(params, grads, float_dtype::f32);
    };
    call(viewed, 4);
    CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 4)));
    CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 4)));

    viewed.insert_or_assign("a", backend_fixture<B>::view_of(tens_a));  // re-seated
    call(viewed, 3);
    CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 34)));
    {
      auto copy = std::make_unique<gradients_params<B>>(viewed);  // same versions, other entries
      viewed.insert_or_assign("a", backend_fixture<B>::view_of(ones_a));
      call(*copy, 2);
      copy.reset();
      call(viewed, 2);
    }
    CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 56)));
    CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 11)));

    {  // a copy of the accumulator adds into its own tensors, not the original's
      gradients_accumulator<B> copied = acc;
      copied.accumulate_with_dtype(params, viewed, float_dtype::f32);
      CHECK(values_of<float>(copied.pending(), "a") == as<float>(multiples(shape_a, 57)));
      CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 56)));
      gradients_accumulator<B> moved = std::move(copied);
      moved.accumulate_with_dtype(params, viewed, float_dtype::f32);
      CHECK(values_of<float>(moved.pending(), "a") == as<float>(multiples(shape_a, 58)));
    }
    const flat_gradients<B> taken = acc.grads();  // a new buffer from here on
    call(viewed, 3);
    CHECK(values_of<float>(taken, "a") == as<float>(multiples(shape_a, 56)));
    CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 3)));

    for (int k = 0; k < 3; ++k) acc.accumulate_with_dtype(params, viewed, float_dtype::f64);  // converted
    CHECK(values_of<double>(acc.pending(), "a") == as<double>(multiples(shape_a, 6)));
    CHECK(values_of<double>(acc.pending(), "b") == as<double>(multiples(shape_b, 6)));
    acc.accumulate_scaled(params, viewed, 0.5, float_dtype::f64);
    CHECK(values_of<double>(acc.pending(), "a") == as<double>(multiples(shape_a, 6.5)));
  }
}

// ---------------------------------------------------------------------------------------------
// Backends agree

namespace {

/// A window whose every step rounds: inputs of all element types, weights and a loss scale that
/// are not powers of two. Run on two backends it must give the same bits, and those must be the
/// bits of the scalar `reference_window`.
struct mixed_window {
  struct microbatch {
    bool mean;
    double weight;
    std::vector<double> a;  // row-major, shape_a; empty: absent
    std::vector<double> b;  // row-major, shape_b; empty: absent
  };
  static constexpr double loss_scale = 3.0;
  std::vector<microbatch> microbatches = {
      {false, 5, {0.1, -1.7, 2.3, 1e-3, 3.14159, -0.5772}, {1.0 / 3, 2.0 / 3, -1e-7, 7.25, 1e5, -0.3}},
      {true, 7, {1.00390625, -2.75390625, 0.33203125, 5.12890625, -7.99609375, 0.01171875}, {}},
      {false, 0, {}, {9, 9, 9, 9, 9, 9}},
      {true, 3, {0.7, 0.11, -0.13, 17.5, 2e-5, 1.5}, {0.9, -0.8, 0.7, -0.6, 0.5, -0.4}},
  };
};

/// Element type of each input of `mixed_window`: a F32, F16 (F32 without one), F64 for b and then F32.
template <class B, class F>
void feed(const mixed_window& window, F&& add) {
  using f16_or_f32 =
      std::conditional_t<std::is_void_v<element_t<B, float_dtype::f16>>, float, element_t<B, float_dtype::f16>>;
  for (std::size_t i = 0; i < window.microbatches.size(); ++i) {
    const auto& mb = window.microbatches[i];
    gradients_params<B> grads;
    if (!mb.a.empty()) {
      if (i == 1) {
        grads.insert("a", make_tensor<B, f16_or_f32>(shape_a, std::span<const double>(mb.a)));
      } else {
        grads.insert("a", make_tensor<B, float>(shape_a, std::span<const double>(mb.a)));
      }
    }
    if (!mb.b.empty()) {
      if (i == 0) {
        grads.insert("b", make_tensor<B, double>(shape_b, std::span<const double>(mb.b)));
      } else {
        grads.insert("b", make_tensor<B, float>(shape_b, std::span<const double>(mb.b)));
      }
    }
    add(grads, mb);
  }
}

/// Records of the pending sums before finish_mean and of its result.
struct window_result {
  gradients_params_record sums;
  gradients_params_record mean;
};

/// The window computed one element at a time: `pending = pending + W(m) · W(g)`, with m the weight
/// (mean) or 1 (sum), then `(pending / W(s)) / W(Σ w)`.
template <class W>
window_result reference_window(const mixed_window& window) {
  std::vector<W> a(6, W{0});
  std::vector<W> b(6, W{0});
  double total = 0;
  for (std::size_t i = 0; i < window.microbatches.size(); ++i) {
    const auto& mb = window.microbatches[i];
    total += mb.weight;
    if (mb.weight == 0) continue;
    const W multiplier = mb.mean ? static_cast<W>(mb.weight) : W{1};
    for (std::size_t k = 0; k < mb.a.size(); ++k) {
      // Microbatch 1's 16-bit values are exact, so F16 and F32 inputs convert to the same value.
      const auto g = static_cast<W>(static_cast<float>(mb.a[k]));
      a[k] = a[k] + multiplier * g;
    }
    for (std::size_t k = 0; k < mb.b.size(); ++k) {
      const W g = i == 0 ? static_cast<W>(mb.b[k]) : static_cast<W>(static_cast<float>(mb.b[k]));
      b[k] = b[k] + multiplier * g;
    }
  }
  const auto record = [](const std::vector<W>& pa, const std::vector<W>& pb) {
    return gradients_params_record{{{"a", dtype_of<W>, {2, 3}, pa}, {"b", dtype_of<W>, {3, 2}, pb}}};
  };
  const auto sums = record(a, b);
  for (auto* values : {&a, &b}) {
    for (W& x : *values) x = x / static_cast<W>(mixed_window::loss_scale) / static_cast<W>(total);
  }
  return {sums, record(a, b)};
}

/// `mixed_window` on backend B.
template <class B, class W>
window_result run_window(const mixed_window& window) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  weighted_gradients_accumulator<B> acc(dtype_of<W>, mixed_window::loss_scale);
  feed<B>(window, [&](const gradients_params<B>& grads, const mixed_window::microbatch& mb) {
    mb.mean ? acc.accumulate_mean(params, grads, mb.weight) : acc.accumulate_sum(params, grads, mb.weight);
  });
  auto sums = acc.try_to_record().gradients;
  return {std::move(sums), acc.finish_mean(params).gradients.to_record()};
}

}  // namespace

TEST_CASE_TEMPLATE("every backend gives the reference bits, so backends agree with each other", B,
                   GRADACCUM_TEST_BACKENDS) {
  const mixed_window window;
  for_each_work_type([&]<class W>() {
    INFO("work dtype " << dtype_of<W>);
    const window_result actual = run_window<B, W>(window);
    const window_result reference = reference_window<W>(window);
    GRADACCUM_CHECK_SAME_BITS(actual.sums, reference.sums);
    GRADACCUM_CHECK_SAME_BITS(actual.mean, reference.mean);
    const window_result on_vector_backend = run_window<vector_backend, W>(window);
    GRADACCUM_CHECK_SAME_BITS(actual.sums, on_vector_backend.sums);
    GRADACCUM_CHECK_SAME_BITS(actual.mean, on_vector_backend.mean);
  });
}

TEST_SUITE_END();
