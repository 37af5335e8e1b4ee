/// @file
/// @brief `<gradaccum/mpi.hpp>`'s refusals under `mpirun -np N` (N = 1, 2, 3): every disagreement
/// between the ranks, and every rank's malformed sums, are the same error on every rank, with
/// every rank's sums left as they were and the ranks still in step.
///
/// One of test_mpi's files (tests/mpi/meson.build), run with the default bucket size and with
/// buckets of a few elements (mpi_N_ranks_small_buckets, $GRADACCUM_TEST_BUCKET_BYTES).

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>
#include <gradaccum/mpi.hpp>

#include "mpi_fixture.hpp"

using namespace mpi_test;
using gradaccum::errc;
using gradaccum::float_dtype;

/// Checks that `allreduce_mean` and `start_allreduce_mean` (buckets of `bytes`) both throw `code`
/// on this rank and leave `sums` as they were.
template <class B>
void check_both_rejected(const gradaccum::parameter_set<B>& params, gradaccum::accumulated_gradients<B>& sums,
                         errc code, std::size_t bytes = bucket_bytes) {
  check_rejected_unchanged(
      sums, [&] { return gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bytes); }, code);
  check_rejected_unchanged(
      sums, [&] { return gradaccum::start_allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bytes); }, code);
}

TEST_CASE_TEMPLATE("mismatched loss scales are an error on every rank, and nothing is taken", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  if (world_size == 1) return;  // one rank always agrees with itself
  const auto params = parameters<B>();
  auto sums = local_sums(params, float_dtype::f32, world_rank == 0 ? 2.0 : loss_scale);
  check_both_rejected(params, sums, errc::invalid_state);
  check_ranks_still_agree(params);
}

TEST_CASE_TEMPLATE("mismatched bucket sizes are an error on every rank, and nothing is taken", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  if (world_size == 1) return;
  const auto params = parameters<B>();
  const std::size_t mine = world_rank == 0 ? bucket_bytes + 4 : bucket_bytes;
  auto sums = local_sums(params, float_dtype::f32);
  check_both_rejected(params, sums, errc::invalid_state, mine);
  check_ranks_still_agree(params);
}

TEST_CASE_TEMPLATE("mismatched work dtypes are an error on every rank, and nothing is taken", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  if (world_size == 1) return;
  const auto params = parameters<B>();
  auto sums = local_sums(params, world_rank == world_size - 1 ? float_dtype::f64 : float_dtype::f32);
  check_rejected_unchanged(
      sums, [&] { return gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bucket_bytes); },
      errc::invalid_state);
  check_ranks_still_agree(params);
}

TEST_CASE_TEMPLATE("a zero total weight over all ranks is empty_weight everywhere, and nothing is cleared", B,
                   BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, loss_scale);
  window.accumulate_sum(params, gradients_of<B>(3, float_dtype::f32), 0.0);
  auto sums = window.finish_sums();
  CHECK(sums.state.microbatches == 1);
  check_both_rejected(params, sums, errc::empty_weight);
  check_ranks_still_agree(params);
}

TEST_CASE_TEMPLATE("one rank's malformed sums are its own error there and the same code everywhere else", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  const bool culprit = world_rank == 0;  // a rank with tokens, so its sums are otherwise valid
  const auto reduce = [&](gradaccum::accumulated_gradients<B>& sums) {
    return gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bucket_bytes);
  };

  SUBCASE("a gradient of no parameter") {
    // Accumulated against a parameter set with one more parameter than the one reduced over.
    auto specs = model();
    specs.push_back({"ghost", {2, 1}});
    const auto haunted = parameters<B>(specs);
    gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, loss_scale);
    gradaccum::gradients_params<B> grads = gradients_of<B>(0, float_dtype::f32);
    if (culprit) grads.insert("ghost", gradient<B, float>(0, specs.back()));
    window.accumulate_sum(haunted, grads, 7.0);
    auto sums = window.finish_sums();
    check_rejected_unchanged(
        sums, [&] { return reduce(sums); }, errc::unknown_parameters, culprit ? "ghost" : "");
  }
  SUBCASE("pending sums of another dtype than the state's") {
    auto sums = local_sums(params, culprit ? float_dtype::f64 : float_dtype::f32);
    if (culprit) sums.state.dtype = float_dtype::f32;
    check_rejected_unchanged(
        sums, [&] { return reduce(sums); }, errc::invalid_state);
  }
  SUBCASE("an invalid state") {
    auto sums = local_sums(params, float_dtype::f32);
    if (culprit) sums.state.loss_scale = -1.0;
    check_rejected_unchanged(
        sums, [&] { return reduce(sums); }, errc::invalid_state);
  }
  SUBCASE("pending gradients with zero total weight") {
    auto sums = local_sums(params, float_dtype::f32);
    if (culprit) sums.state.total_weight = 0.0;
    check_rejected_unchanged(
        sums, [&] { return reduce(sums); }, errc::invalid_state);
  }
  SUBCASE("two ranks failing for different reasons: the first one's code everywhere") {
    if (world_size > 1) {
      // Rank 0's state is invalid; the last rank's sums hold a gradient of no parameter.
      auto specs = model();
      specs.push_back({"ghost", {2, 1}});
      const auto haunted = parameters<B>(specs);
      gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, loss_scale);
      gradaccum::gradients_params<B> grads = gradients_of<B>(0, float_dtype::f32);
      if (world_rank == world_size - 1) grads.insert("ghost", gradient<B, float>(0, specs.back()));
      window.accumulate_sum(haunted, grads, 7.0);
      auto sums = window.finish_sums();
      if (culprit) sums.state.loss_scale = -1.0;
      check_rejected_unchanged(
          sums, [&] { return reduce(sums); }, errc::invalid_state);
    }
  }
  check_ranks_still_agree(params);
}

TEST_CASE_TEMPLATE("ranks with different parameter sets are parameter_mismatch everywhere", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  if (world_size == 1) return;
  auto specs = model();
  if (world_rank == 0) specs[2].shape = {6, 1};
  const auto params = parameters<B>(specs);
  // Rank 0's sums hold no fc.bias, so they are valid for its own set.
  gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, loss_scale);
  window.accumulate_sum(params, gradients_of<B>(2, float_dtype::f32), 12.0);
  auto sums = world_rank == 0 ? window.finish_sums() : local_sums(params, float_dtype::f32);
  check_rejected_unchanged(
      sums, [&] { return gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bucket_bytes); },
      errc::parameter_mismatch);
  check_ranks_still_agree(parameters<B>());
}

TEST_CASE_TEMPLATE("summed weights and counts that do not fit are an error on every rank", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  if (world_size == 1) return;
  const auto params = parameters<B>();

  SUBCASE("total weight beyond the largest float") {
    gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, loss_scale);
    window.accumulate_sum(params, gradients_of<B>(5, float_dtype::f32), 3e38);
    auto sums = window.finish_sums();
    check_rejected_unchanged(
        sums, [&] { return gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bucket_bytes); },
        errc::invalid_weight);
  }
  SUBCASE("microbatch count beyond 2^64 - 1") {
    gradaccum::accumulated_gradients<B> sums{{}, {float_dtype::f32, loss_scale, 1.0, std::uint64_t{1} << 63}};
    check_rejected_unchanged(
        sums, [&] { return gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bucket_bytes); },
        errc::counter_overflow);
  }
  check_ranks_still_agree(params);
}
