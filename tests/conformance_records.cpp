/// @file
/// @brief The conformance suite (conformance.hpp) on records: restoring a window from a record
/// or from saved sums, and every backend against the reference bits of a window that rounds.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "conformance.hpp"

namespace {

using namespace gradaccum;
using namespace gradaccum::test;

}  // namespace

TEST_SUITE_BEGIN("conformance");

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
