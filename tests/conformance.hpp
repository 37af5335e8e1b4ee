#pragma once
/// @file
/// @brief The conformance suite's shared pieces. The suite is the accumulation contract, written
/// once and run against every backend in `GRADACCUM_TEST_BACKENDS`, one file per feature:
/// conformance_inputs.cpp (parameter sets, gradients containers, views),
/// conformance_accumulate.cpp (weighted sums and means, their rejections, the plain summing
/// accumulator), conformance_results.cpp (finishing, results and inspecting a window) and
/// conformance_records.cpp (restoring a window; every backend against the reference bits).
///
/// Values are chosen so that the arithmetic is exact (small integers, powers of two) wherever
/// the contract fixes a result, and compared with `==` or bit for bit. Every rejection is
/// checked for its `errc`, the offending id, and that values and counters did not change.

#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// Before doctest: c10 defines a CHECK macro, which doctest's must replace.
#if GRADACCUM_TEST_HAVE_TORCH
#include <gradaccum/backends/torch.hpp>
#endif

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>

#include "backend_fixtures.hpp"
#include "test_helpers.hpp"

namespace gradaccum::test {

inline constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();
inline constexpr double infinity = std::numeric_limits<double>::infinity();

// Non-square, so a transposed layout cannot pass for a correct one.
inline const tensor_shape shape_a{2, 3};
inline const tensor_shape shape_b{3, 2};

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

}  // namespace gradaccum::test
