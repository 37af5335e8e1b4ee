/// @file
/// @brief The conformance suite (conformance.hpp) on a window's results and state: what a
/// result's buffer and accessors give, finishing, inspecting and snapshotting a window.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "conformance.hpp"

namespace {

using namespace gradaccum;
using namespace gradaccum::test;

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
// A result's buffer and accessors; pending gradients a smaller parameter set lacks

TEST_CASE_TEMPLATE("a result's buffer comes back zero outside its present segments, whatever flat<W>() wrote", B,
                   GRADACCUM_TEST_BACKENDS) {
  // Weight decay over the whole flat vector writes absent segments and padding too.
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  for_each_work_type([&]<class W>() {
    INFO("work dtype " << dtype_of<W>);
    weighted_gradients_accumulator<B> acc(dtype_of<W>, 1.0);
    acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 1);
    const weighted_gradients_record saved = acc.try_to_record();
    // A device window hands out no flat<W>() (its results are the backend's views): its
    // recycled buffers are checked through the values only.
    constexpr bool host_window = !device_buffers_backend<B>;
    const auto decayed = [&] {
      auto result = acc.finish_mean(params);
      if constexpr (host_window) {
        for (W& v : result.gradients.template flat<W>()) v = v + W{0.25};
      }
    };  // the result is dropped: its buffer serves the next window
    decayed();
    acc.accumulate_sum(params, gradient<B>("a", shape_a, multiples(shape_a, 1)), 1);
    if constexpr (host_window) CHECK(zero_outside_present<W>(acc.pending()));
    acc.accumulate_sum(params, gradient<B>("b", shape_b, multiples(shape_b, 1)), 1);
    CHECK(values_of<W>(acc.pending(), "b") == as<W>(multiples(shape_b, 1)));  // not 1.25, 2.25, ...
    decayed();
    // A load takes the recycled buffer too: what it does not overwrite is zero.
    acc.load_record(params, saved);
    CHECK(values_of<W>(acc.pending(), "a") == as<W>(multiples(shape_a, 1)));
    CHECK_FALSE(acc.pending().contains("b"));
    if constexpr (host_window) CHECK(zero_outside_present<W>(acc.pending()));
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
  const std::string message = message_of([&] { (void)read_only.template get<float>("a"); });
  CHECK(message.find("F64") != std::string::npos);
  CHECK(message.find("F32") != std::string::npos);
  CHECK_FALSE(read_only.template get<double>("b").has_value());  // absent
  if constexpr (!device_buffers_backend<B>) {                    // host memory: spans of the buffer too
    GRADACCUM_CHECK_REJECTED(read_only.template values<float>("a"), errc::invalid_dtype, "");
    GRADACCUM_CHECK_REJECTED(read_only.template values<float>("b"), errc::invalid_dtype, "");
    GRADACCUM_CHECK_REJECTED(read_only.template values<float>(*read_only.begin()), errc::invalid_dtype, "");
    GRADACCUM_CHECK_REJECTED(read_only.template flat<float>(), errc::invalid_dtype, "");
    GRADACCUM_CHECK_REJECTED(g.template flat<float>(), errc::invalid_dtype, "");
    CHECK(read_only.template values<double>("b").empty());
    CHECK(flat_gradients<B>().template flat<double>().empty());  // nothing laid out: no values of any type
  }
  CHECK(values_of<double>(g, "a") == multiples(shape_a, 1));  // nothing changed
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

TEST_SUITE_END();
