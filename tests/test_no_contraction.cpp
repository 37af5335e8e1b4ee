/// @file
/// @brief The two-rounding contract (`acc + round(scale · g)`, never one fused multiply-add)
/// holds when the code that includes the library asks for contraction.
///
/// meson.build compiles this file with -march=native (so FMA instructions exist on machines that
/// have them) and the most permissive contraction mode whose pragmas the compiler still honors
/// (GCC: -ffp-contract=fast; clang: fast-honor-pragmas, or `on` before clang 15, because its
/// plain `fast` ignores FP_CONTRACT pragmas by definition). test_kernels cannot catch a
/// regression: it is built without -march=native, where there is no FMA to contract into.
/// References are computed through volatile temporaries, which round every operation
/// separately whatever the flags.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>
#include <gradaccum/kernels.hpp>

#include "backend_fixtures.hpp"
#include "test_helpers.hpp"

using gradaccum::test::same_bits;

namespace {

/// Not a multiple of any vector width: the vector loop and its scalar tail both run.
constexpr std::size_t rows = 7;
constexpr std::size_t cols = 149;
constexpr std::size_t count = rows * cols;

/// Values in [1, 2) with full mantissas (a fixed LCG), so products are rarely exact.
template <class W>
std::vector<W> mantissas(std::uint64_t seed) {
  std::vector<W> values(count);
  std::uint64_t state = seed;
  for (W& value : values) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    value = static_cast<W>(1.0 + std::ldexp(static_cast<double>(state >> 12), -52));
  }
  return values;
}

/// round(acc + round(scale · g)), each operation rounded on its own.
template <class W>
W two_roundings(W acc, W scale, W g) {
  volatile W product = scale * g;
  volatile W sum = acc + product;
  return sum;
}

/// How many elements a fused multiply-add would get wrong: the data must tell the two apart.
template <class W>
std::size_t fused_differs(std::span<const W> acc, W scale, std::span<const W> g) {
  std::size_t differs = 0;
  for (std::size_t i = 0; i < acc.size(); ++i) {
    differs += same_bits(std::fma(scale, g[i], acc[i]), two_roundings(acc[i], scale, g[i])) ? 0 : 1;
  }
  return differs;
}

template <class W>
std::size_t mismatches(std::span<const W> actual, std::span<const W> expected) {
  std::size_t count_differing = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) count_differing += same_bits(actual[i], expected[i]) ? 0 : 1;
  return count_differing;
}

}  // namespace

TEST_CASE("add_scaled rounds twice under -march=native and contraction flags, F32 and F64") {
#ifndef __FMA__
  MESSAGE("built without FMA instructions (none on this machine): no contraction to catch here");
#endif
  gradaccum::test::for_each_work_type([]<class W>() {
    CAPTURE(gradaccum::dtype_of<W>);
    std::vector<W> acc = mantissas<W>(1);
    const std::vector<W> g = mantissas<W>(2);
    const W scale = static_cast<W>(0.7);
    REQUIRE(fused_differs<W>(acc, scale, g) > count / 10);
    std::vector<W> expected(count);
    for (std::size_t i = 0; i < count; ++i) expected[i] = two_roundings(acc[i], scale, g[i]);
    gradaccum::kernels::add_scaled(acc.data(), g.data(), count, scale);
    CHECK(mismatches<W>(acc, expected) == 0);
  });
}

TEST_CASE_TEMPLATE("accumulate_mean rounds twice under -march=native and contraction flags, F32 and F64", B,
                   GRADACCUM_TEST_BACKENDS) {
  using namespace gradaccum;
  test::for_each_work_type([]<class W>() {
    CAPTURE(dtype_of<W>);
    const tensor_shape shape{rows, cols};
    const std::vector<W> g1 = mantissas<W>(3);
    const std::vector<W> g2 = mantissas<W>(4);
    const double w1 = 3.0;
    const double w2 = 0.7;  // not exact in binary: W(w2) · g2 rounds
    const auto tensor_of = [&](const std::vector<W>& values) {
      const std::vector<double> wide(values.begin(), values.end());
      return test::make_tensor<B, W>(shape, std::span<const double>(wide));
    };

    parameter_set<B> params;
    params.add("w", tensor_of(g1));
    gradients_params<B> first;
    first.insert("w", tensor_of(g1));
    gradients_params<B> second;
    second.insert("w", tensor_of(g2));
    weighted_gradients_accumulator<B> acc(dtype_of<W>, 1.0);
    acc.accumulate_mean(params, first, w1);
    acc.accumulate_mean(params, second, w2);

    std::vector<W> pending(count);
    std::vector<W> expected(count);
    for (std::size_t i = 0; i < count; ++i) {
      volatile W product = static_cast<W>(w1) * g1[i];
      pending[i] = product;
      expected[i] = two_roundings(pending[i], static_cast<W>(w2), g2[i]);
    }
    REQUIRE(fused_differs<W>(pending, static_cast<W>(w2), g2) > count / 20);
    CHECK(mismatches<W>(test::values_of<W>(acc.pending(), "w"), expected) == 0);
  });
}

TEST_CASE("F16 gradients widened by the hardware (F16C) sum to the portable conversion's bits, every value") {
#ifndef __F16C__
  MESSAGE("built without F16C (none on this machine): the portable conversion is the only one");
#endif
  // Every F16 bit pattern (signalling and quiet NaNs, infinities, subnormals), against pending
  // values that are finite, infinite and NaN, with a scale whose products round (so a fused
  // multiply-add would show too). Where both the pending value and the gradient are NaN, which
  // payload survives depends on the order the compiler gives the addition's operands (it may
  // swap them: IEEE 754 does not fix the choice), so there the sum need only be a NaN.
  std::vector<gradaccum::test::f16> bits(65536 + 5);  // not a multiple of 8: the scalar tail runs too
  for (std::size_t i = 0; i < bits.size(); ++i) bits[i].bits = static_cast<std::uint16_t>(i * 40503U);
  gradaccum::test::for_each_work_type([&]<class W>() {
    CAPTURE(gradaccum::dtype_of<W>);
    const W pending_values[] = {W(1.5), -W(0), std::numeric_limits<W>::infinity(), std::numeric_limits<W>::quiet_NaN()};
    std::vector<W> acc(bits.size());
    std::vector<W> expected(bits.size());
    for (std::size_t i = 0; i < bits.size(); ++i) {
      acc[i] = pending_values[i % 4];
      expected[i] = two_roundings(acc[i], W(0.1), static_cast<W>(gradaccum::kernels::f16_bits_to_float(bits[i].bits)));
    }
    const std::vector<W> before = acc;
    gradaccum::kernels::add_scaled(acc.data(), bits.data(), bits.size(), W(0.1));
    std::size_t differing = 0;
    for (std::size_t i = 0; i < bits.size(); ++i) {
      const bool both_nan = std::isnan(before[i]) && std::isnan(gradaccum::kernels::f16_bits_to_float(bits[i].bits));
      differing += (both_nan ? std::isnan(acc[i]) : same_bits(acc[i], expected[i])) ? 0 : 1;
    }
    CHECK(differing == 0);
  });
}
