#pragma once
/// @file
/// @brief Shared by the MPI tests (each run under `mpirun -np N`): the model, the microbatches of
/// one step and which rank accumulates each, this rank's sums and the single-process result they
/// must reduce to, and checks that a rejected call left everything as it was.
///
/// Values are small integers and the loss scale a power of two, so every sum is exact in any
/// order and comparisons with the single-process run can be bitwise. Tests only CHECK (never
/// REQUIRE), so no rank leaves a test case early and skips a collective its peers are in.

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>
#include <gradaccum/mpi.hpp>

#include "../backend_fixtures.hpp"
#include "../test_helpers.hpp"

#ifdef GRADACCUM_TEST_HAVE_EIGEN
#include <gradaccum/backends/eigen.hpp>
#endif
#ifdef GRADACCUM_TEST_HAVE_XTENSOR
#include <gradaccum/backends/xtensor.hpp>
#endif

namespace mpi_test {

using gradaccum::errc;
using gradaccum::float_dtype;

/// Set by main() (mpi_main.cpp); the bucket size from $GRADACCUM_TEST_BUCKET_BYTES, which the
/// small-bucket runs set to 44 bytes (11 floats, 5 doubles): buckets then end inside segments and
/// in their padding, and most segments span several.
inline int world_rank = 0;
inline int world_size = 1;
inline std::size_t bucket_bytes = gradaccum::default_bucket_bytes;

#ifdef GRADACCUM_TEST_HAVE_EIGEN
#define EIGEN_BACKENDS gradaccum::eigen_backend,
#else
#define EIGEN_BACKENDS
#endif
#ifdef GRADACCUM_TEST_HAVE_XTENSOR
#define XTENSOR_BACKENDS gradaccum::xtensor_backend,
#else
#define XTENSOR_BACKENDS
#endif
struct parameter_spec {
  std::string id;
  gradaccum::tensor_shape shape;
};

/// Every shape has rank 2, as Eigen matrices do. "big" holds 20480 elements, many buckets when buckets are small
/// (the small-bucket runs); "solo" receives a gradient on one rank only; "unused" on none.
inline const std::vector<parameter_spec>& model() {
  static const std::vector<parameter_spec> specs{
      {"embed", {4, 3}},   {"fc.weight", {3, 5}}, {"fc.bias", {5, 1}},
      {"big", {160, 128}}, {"solo", {2, 2}},      {"unused", {3, 1}},
  };
  return specs;
}

struct microbatch {
  double weight;
  bool mean;  // gradients of a MEAN loss (accumulate_mean), else of a SUM loss
  std::vector<std::string> ids;
};

/// The whole step's microbatches, unequal in size and in which parameters they touch. The
/// zero-weight one carries gradients (they add nothing, but are validated and counted).
inline const std::vector<microbatch>& step() {
  static const std::vector<microbatch> microbatches{
      {7, false, {"embed", "fc.weight", "fc.bias", "big"}},
      {3, true, {"embed", "solo", "big"}},
      {12, false, {"fc.weight", "big"}},
      {0, false, {"embed", "fc.bias"}},
      {5, true, {"embed", "fc.weight", "big"}},
      {1, false, {"fc.bias"}},
  };
  return microbatches;
}

/// Rank that accumulates microbatch `index` of a `ranks`-rank run: the zero-weight one goes to
/// the last rank, which then has no tokens at all; the others round-robin over the rest, so
/// "solo" (microbatch 1) lands on one rank only.
inline int owner(std::size_t index, int ranks) {
  if (step()[index].weight == 0.0) return ranks - 1;
  return static_cast<int>(index % static_cast<std::size_t>(ranks > 1 ? ranks - 1 : 1));
}

template <class B>
gradaccum::parameter_set<B> parameters(const std::vector<parameter_spec>& specs = model()) {
  gradaccum::parameter_set<B> params;
  for (const auto& spec : specs) params.add(spec.id, spec.shape, {});
  return params;
}

/// Integer gradient values in [-4, 4], different per microbatch, parameter and element.
template <class B, class T>
typename B::template tensor<T> gradient(std::size_t index, const parameter_spec& spec) {
  std::vector<T> values(*spec.shape.checked_element_count());
  for (std::size_t i = 0; i < values.size(); ++i) {
    values[i] = static_cast<T>(static_cast<int>((index * 7 + spec.id.size() * 3 + i) % 9) - 4);
  }
  return B::template from_row_major<T>(std::span<const T>(values), spec.shape, {});
}

template <class B>
gradaccum::gradients_params<B> gradients_of(std::size_t index, float_dtype dtype) {
  gradaccum::gradients_params<B> grads;
  for (const auto& spec : model()) {
    for (const auto& id : step()[index].ids) {
      if (id != spec.id) continue;
      if (dtype == float_dtype::f64) {
        grads.insert(id, gradient<B, double>(index, spec));
      } else {
        grads.insert(id, gradient<B, float>(index, spec));
      }
    }
  }
  return grads;
}

template <class B>
void accumulate(gradaccum::weighted_gradients_accumulator<B>& window, const gradaccum::parameter_set<B>& params,
                std::size_t index, float_dtype dtype) {
  const microbatch& mb = step()[index];
  if (mb.mean) {
    window.accumulate_mean(params, gradients_of<B>(index, dtype), mb.weight);
  } else {
    window.accumulate_sum(params, gradients_of<B>(index, dtype), mb.weight);
  }
}

inline constexpr double loss_scale = 4.0;

/// This rank's share of the step, as `finish_sums()` hands it over.
template <class B>
gradaccum::accumulated_gradients<B> local_sums(const gradaccum::parameter_set<B>& params, float_dtype dtype,
                                               double scale = loss_scale) {
  gradaccum::weighted_gradients_accumulator<B> window(dtype, scale);
  for (std::size_t index = 0; index < step().size(); ++index) {
    if (owner(index, world_size) == world_rank) accumulate(window, params, index, dtype);
  }
  return window.finish_sums();
}

/// What one process accumulating every microbatch of the step gets from `finish_mean`.
template <class B>
gradaccum::accumulated_gradients<B> single_process_mean(const gradaccum::parameter_set<B>& params, float_dtype dtype) {
  gradaccum::weighted_gradients_accumulator<B> window(dtype, loss_scale);
  for (std::size_t index = 0; index < step().size(); ++index) accumulate(window, params, index, dtype);
  return window.finish_mean(params);
}

template <class B>
gradaccum::weighted_gradients_record record_of(const gradaccum::accumulated_gradients<B>& result) {
  return {result.gradients.to_record(), result.state};
}

/// Checks that `call` throws `code` on this rank and leaves `sums` exactly as they were.
template <class B, class Call>
void check_rejected_unchanged(gradaccum::accumulated_gradients<B>& sums, const Call& call, errc code,
                              std::string_view param_id = {}) {
  const auto before = record_of(sums);
  GRADACCUM_CHECK_REJECTED(call(), code, param_id);
  // The analyzer loses doctest's result builder on the exception path of the check above.
  // NOLINTNEXTLINE(clang-analyzer-cplusplus.NewDeleteLeaks)
  GRADACCUM_CHECK_SAME_BITS(record_of(sums), before);
}

/// A reduction that must work after a rejected one: the ranks are still in step.
template <class B>
void check_ranks_still_agree(const gradaccum::parameter_set<B>& params) {
  auto mean = gradaccum::allreduce_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD);
  GRADACCUM_CHECK_SAME_BITS(record_of(mean), record_of(single_process_mean(params, float_dtype::f32)));
}

/// `reduce()`, a reduction in which rank 0's device copy fails midway: every rank throws, rank 0
/// the backend's own error, every other `invalid_state` naming rank 0.
template <class Reduce>
void check_rank_0_copy_failed(Reduce&& reduce) {
  try {
    reduce();
    FAIL_CHECK("the reduction succeeded");
  } catch (const std::runtime_error& e) {
    const auto* library_error = dynamic_cast<const gradaccum::error*>(&e);
    if (world_rank == 0) {
      CHECK(library_error == nullptr);  // its own error: the backend's
      CHECK(std::string(e.what()) == "device_backend: the device copy failed");
    } else {
      REQUIRE(library_error != nullptr);
      CHECK(library_error->code() == gradaccum::errc::invalid_state);
      CHECK(std::string(e.what()).find("rank 0 failed to copy its window") != std::string::npos);
    }
  }
}

#define BACKENDS EIGEN_BACKENDS XTENSOR_BACKENDS gradaccum::test::vector_backend, gradaccum::test::device_backend

}  // namespace mpi_test
