/// @file
/// @brief The sharded step after `reduce_scatter_mean` under `mpirun -np N` (N = 1 to 4): the
/// sharded global norm has the full norm's bits, clipping shards equals clipping the full result,
/// a non-finite value is agreed by every rank, and `allgather_shards` gives every rank every
/// rank's part; and its refusals: `reduce_scatter_mean` rejects as `allreduce_mean` does, and
/// ranks passing other shards, buffers or calls to the sharded norm, clipping and
/// `allgather_shards` all fail alike; nothing is taken or changed, and the ranks stay in step.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>
#include <gradaccum/mpi.hpp>

#include "mpi_fixture.hpp"
#include "sharded_fixture.hpp"

using namespace mpi_test;
using gradaccum::errc;
using gradaccum::float_dtype;

namespace {

/// Values whose sums over up to 4 ranks are exact (rank r sends (r + 1) · m · 2^-e, m < 2^19),
/// while their squares, spread over many exponents, round when summed: the norm's order matters.
template <class B, class W>
gradaccum::accumulated_gradients<B> exact_sums_rounding_squares(const gradaccum::parameter_set<B>& params) {
  gradaccum::gradients_params<B> grads;
  std::size_t salt = 0;
  for (const auto& spec : model()) {
    std::vector<W> values(*spec.shape.checked_element_count());
    for (std::size_t i = 0; i < values.size(); ++i, ++salt) {
      const double mantissa = 1.0 + static_cast<double>((salt * 7919) % (std::size_t{1} << 19));
      values[i] = static_cast<W>((world_rank + 1.0) * std::ldexp(mantissa, -static_cast<int>(salt % 23)));
    }
    grads.insert(spec.id, B::template from_row_major<W>(std::span<const W>(values), spec.shape, {}));
  }
  gradaccum::weighted_gradients_accumulator<B> window(gradaccum::dtype_of<W>, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  return window.finish_sums();
}

}  // namespace

TEST_CASE_TEMPLATE("the sharded global norm has the full norm's bits on any number of ranks", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  for_both_dtypes([&]<class W>(float_dtype dtype) {
    INFO("work dtype " << dtype);
    const auto full = gradaccum::allreduce_mean(params, exact_sums_rounding_squares<B, W>(params), MPI_COMM_WORLD);
    const auto shard =
        gradaccum::reduce_scatter_mean(params, exact_sums_rounding_squares<B, W>(params), MPI_COMM_WORLD);
    REQUIRE(shard_matches<W>(shard, full));
    const double sharded = gradaccum::global_norm(shard, MPI_COMM_WORLD);
    CHECK(std::bit_cast<std::uint64_t>(sharded) == std::bit_cast<std::uint64_t>(gradaccum::global_norm(full)));
    // Not a property of any order: adding the squares one after another rounds differently.
    double sequential = 0.0;
    const std::vector<W> all = gradaccum::test::flat_values<W>(full.gradients);
    for (const W v : all) sequential += static_cast<double>(v) * static_cast<double>(v);
    CHECK(sequential != gradaccum::detail::add_block_sums(std::span<const W>(all), 0.0));
  });
}

TEST_CASE_TEMPLATE("clipping the shards gives the clipped full result's bits and the same norm", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  for_both_dtypes([&]<class W>(float_dtype dtype) {
    INFO("work dtype " << dtype);
    auto full = gradaccum::allreduce_mean(params, exact_sums_rounding_squares<B, W>(params), MPI_COMM_WORLD);
    auto shard = gradaccum::reduce_scatter_mean(params, exact_sums_rounding_squares<B, W>(params), MPI_COMM_WORLD);
    const double norm = gradaccum::global_norm(full);
    const double max_norm = norm / 3;
    CHECK(gradaccum::clip_by_global_norm(shard, max_norm, MPI_COMM_WORLD) == norm);
    CHECK(gradaccum::clip_by_global_norm(full, max_norm) == norm);
    CHECK(shard_matches<W>(shard, full));

    // A bad max_norm, on every rank: the same error, after the collective, and nothing changed.
    const std::vector<W> before(shard.template values<W>().begin(), shard.template values<W>().end());
    GRADACCUM_CHECK_REJECTED(gradaccum::clip_by_global_norm(shard, -1.0, MPI_COMM_WORLD), errc::invalid_scalar, "");
    CHECK(std::equal(before.begin(), before.end(), shard.template values<W>().begin()));
  });
}

TEST_CASE_TEMPLATE("a non-finite value on one rank is found on every rank, and clipping leaves the shards", B,
                   BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  const int culprit = world_size - 1;
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    INFO("value " << bad);
    gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, loss_scale);
    gradaccum::gradients_params<B> grads;
    std::vector<float> values(4, 1.0F);
    if (world_rank == culprit) values[2] = bad;
    grads.insert("solo", B::template from_row_major<float>(std::span<const float>(values), model()[4].shape, {}));
    window.accumulate_sum(params, grads, 1.0);
    auto shard = gradaccum::reduce_scatter_mean(params, window.finish_sums(), MPI_COMM_WORLD);
    CHECK(shard.found_non_finite());
    const std::vector<float> before(shard.template values<float>().begin(), shard.template values<float>().end());
    const double norm = gradaccum::clip_by_global_norm(shard, 1.0, MPI_COMM_WORLD);
    CHECK_FALSE(std::isfinite(norm));
    const std::span<const float> after = shard.template values<float>();
    for (std::size_t i = 0; i < before.size(); ++i) {
      CHECK(std::bit_cast<std::uint32_t>(after[i]) == std::bit_cast<std::uint32_t>(before[i]));
    }
  }
}

TEST_CASE_TEMPLATE("allgather_shards gives every rank every rank's updated part", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  const auto shard = gradaccum::reduce_scatter_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD);
  const std::size_t elements = shard.layout()->elements();
  for_both_dtypes([&]<class W>(float_dtype) {
    std::vector<W> parameters(elements, std::numeric_limits<W>::quiet_NaN());
    const gradaccum::shard_range& mine = shard.range();
    for (std::size_t i = mine.begin; i < mine.begin + mine.stored; ++i) parameters[i] = static_cast<W>(i);
    gradaccum::allgather_shards(shard, std::span<W>(parameters), MPI_COMM_WORLD);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < elements; ++i) wrong += parameters[i] == static_cast<W>(i) ? 0 : 1;
    CHECK(wrong == 0);

    std::vector<W> short_buffer(elements - 1, W(7));
    GRADACCUM_CHECK_REJECTED(gradaccum::allgather_shards(shard, std::span<W>(short_buffer), MPI_COMM_WORLD),
                             errc::parameter_mismatch, "");
    CHECK(std::all_of(short_buffer.begin(), short_buffer.end(), [](W v) { return v == W(7); }));
  });
}

TEST_CASE_TEMPLATE("a shard used with another communicator's size is invalid_state, and no peer waits for it", B,
                   BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  if (world_size == 1) return;  // MPI_COMM_SELF has the world's size
  const auto params = parameters<B>();
  auto shard = gradaccum::reduce_scatter_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD);
  GRADACCUM_CHECK_REJECTED(static_cast<void>(gradaccum::global_norm(shard, MPI_COMM_SELF)), errc::invalid_state, "");
  std::vector<float> parameters(shard.layout()->elements());
  GRADACCUM_CHECK_REJECTED(gradaccum::allgather_shards(shard, std::span<float>(parameters), MPI_COMM_SELF),
                           errc::invalid_state, "");
  check_ranks_still_agree(params);
}

TEST_CASE_TEMPLATE("reduce_scatter_mean rejects as allreduce_mean does, on every rank, and takes nothing", B,
                   BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  const auto reduce = [&](gradaccum::accumulated_gradients<B>& sums) {
    return gradaccum::reduce_scatter_mean(params, std::move(sums), MPI_COMM_WORLD);
  };
  SUBCASE("zero total weight over all ranks") {
    gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, loss_scale);
    window.accumulate_sum(params, gradients_of<B>(3, float_dtype::f32), 0.0);
    auto sums = window.finish_sums();
    check_rejected_unchanged(
        sums, [&] { return reduce(sums); }, errc::empty_weight);
  }
  SUBCASE("different loss scales") {
    if (world_size > 1) {
      auto sums = local_sums(params, float_dtype::f32, world_rank == 0 ? 2.0 : loss_scale);
      check_rejected_unchanged(
          sums, [&] { return reduce(sums); }, errc::invalid_state);
    }
  }
  SUBCASE("one rank's malformed sums") {
    auto sums = local_sums(params, float_dtype::f32);
    if (world_rank == 0) sums.state.loss_scale = -1.0;
    check_rejected_unchanged(
        sums, [&] { return reduce(sums); }, errc::invalid_state);
  }
  SUBCASE("ranks asking for different reductions") {
    if (world_size > 1) {
      using gradaccum::shard_reduction;
      auto sums = local_sums(params, float_dtype::f32);
      SUBCASE("another shard_reduction") {
        const shard_reduction how =
            world_rank == 0 ? shard_reduction::same_as_allreduce : shard_reduction::reduce_scatter;
        // A bucket of 0 bytes, as the reduce-scatter's agreement carries: only the reduction differs.
        check_rejected_unchanged(
            sums, [&] { return gradaccum::reduce_scatter_mean(params, std::move(sums), MPI_COMM_WORLD, how, 0); },
            errc::invalid_state);
      }
      // Rank 0 calls allreduce_mean, the others `other` (which returns a size, as the first does).
      const auto against_allreduce_mean = [&](const auto& other) {
        check_rejected_unchanged(
            sums,
            [&] {
              if (world_rank == 0) {
                return gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD).gradients.size();
              }
              return other();
            },
            errc::invalid_state);
      };
      SUBCASE("allreduce_mean against start_allreduce_mean") {
        against_allreduce_mean([&] {
          return gradaccum::start_allreduce_mean(params, std::move(sums), MPI_COMM_WORLD).wait().gradients.size();
        });
      }
      SUBCASE("allreduce_mean against reduce_scatter_mean cut from the allreduce") {
        against_allreduce_mean([&] {
          return gradaccum::reduce_scatter_mean(params, std::move(sums), MPI_COMM_WORLD,
                                                shard_reduction::same_as_allreduce)
              .pieces()
              .size();
        });
      }
    }
  }
  check_ranks_still_agree(params);
}

namespace {

/// The shard's values, whatever its dtype (F32 values are exact as doubles).
template <class B>
std::vector<double> values_of(const gradaccum::sharded_gradients<B>& shard) {
  if (shard.dtype() == gradaccum::float_dtype::f64) {
    return {shard.template values<double>().begin(), shard.template values<double>().end()};
  }
  return {shard.template values<float>().begin(), shard.template values<float>().end()};
}

/// Checks that the sharded norm and clipping of `mine` (clipped to `max_norm`) both throw `code` on
/// this rank and leave the shard's values as they were.
template <class B>
void check_norms_rejected(gradaccum::sharded_gradients<B>& mine, errc code, double max_norm = 1.0) {
  const std::vector<double> before = values_of(mine);
  GRADACCUM_CHECK_REJECTED(gradaccum::global_norm(mine, MPI_COMM_WORLD), code, "");
  GRADACCUM_CHECK_REJECTED(gradaccum::clip_by_global_norm(mine, max_norm, MPI_COMM_WORLD), code, "");
  CHECK(values_of(mine) == before);
}

}  // namespace

TEST_CASE_TEMPLATE("allgather_shards: one rank's wrong buffer is an error on every rank, and no buffer changes", B,
                   BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  const auto shard = gradaccum::reduce_scatter_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD);
  const std::size_t elements = shard.layout()->elements();
  const bool culprit = world_rank == world_size - 1;
  std::vector<float> floats(culprit ? elements + 1 : elements, 7.0F);
  std::vector<double> doubles(elements, 7.0);
  SUBCASE("a buffer of another size") {
    GRADACCUM_CHECK_REJECTED(gradaccum::allgather_shards(shard, std::span<float>(floats), MPI_COMM_WORLD),
                             errc::parameter_mismatch, "");
  }
  SUBCASE("a buffer of another element type") {
    if (world_size > 1) {
      floats.resize(elements);
      const auto gather = [&] {
        if (culprit) return gradaccum::allgather_shards(shard, std::span<double>(doubles), MPI_COMM_WORLD);
        return gradaccum::allgather_shards(shard, std::span<float>(floats), MPI_COMM_WORLD);
      };
      GRADACCUM_CHECK_REJECTED(gather(), errc::invalid_state, "");
    }
  }
  CHECK(std::all_of(floats.begin(), floats.end(), [](float v) { return v == 7.0F; }));
  CHECK(std::all_of(doubles.begin(), doubles.end(), [](double v) { return v == 7.0; }));
  check_ranks_still_agree(params);
}

TEST_CASE_TEMPLATE("the sharded norm and clipping: ranks passing other shards or calls fail alike, and nothing changes",
                   B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  if (world_size == 1) return;  // one rank always agrees with itself
  const auto params = parameters<B>();
  const bool culprit = world_rank == world_size - 1;
  auto mine = gradaccum::reduce_scatter_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD);
  auto other = gradaccum::reduce_scatter_mean(params, rounding_sums<B, float>(params), MPI_COMM_WORLD);
  auto wide = gradaccum::reduce_scatter_mean(params, local_sums(params, float_dtype::f64), MPI_COMM_WORLD);
  const std::vector<parameter_spec> small_specs{{"a", {3, 1}}, {"b", {4, 5}}};
  const auto small_params = parameters<B>(small_specs);
  gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  gradaccum::gradients_params<B> grads;
  grads.insert("b", gradient<B, float>(1, small_specs[1]));
  window.accumulate_sum(small_params, grads, 1.0);
  auto small = gradaccum::reduce_scatter_mean(small_params, window.finish_sums(), MPI_COMM_WORLD);
  const double norm = gradaccum::global_norm(mine, MPI_COMM_WORLD);

  SUBCASE("a shard of another reduction of the same parameter set") {
    check_norms_rejected(culprit ? other : mine, errc::invalid_state);
  }
  SUBCASE("a shard of a window of another size") {
    check_norms_rejected(culprit ? small : mine, errc::invalid_state);
  }
  SUBCASE("a shard of another work dtype") {
    check_norms_rejected(culprit ? wide : mine, errc::invalid_state);
  }
  SUBCASE("another max_norm") {
    const std::vector<double> before = values_of(mine);
    GRADACCUM_CHECK_REJECTED(gradaccum::clip_by_global_norm(mine, culprit ? norm / 2 : norm / 3, MPI_COMM_WORLD),
                             errc::invalid_state, "");
    CHECK(values_of(mine) == before);
  }
  SUBCASE("an invalid max_norm on one rank") {
    const std::vector<double> before = values_of(mine);
    GRADACCUM_CHECK_REJECTED(gradaccum::clip_by_global_norm(mine, culprit ? -1.0 : 1.0, MPI_COMM_WORLD),
                             errc::invalid_scalar, "");
    CHECK(values_of(mine) == before);
  }
  SUBCASE("two ranks failing for different reasons: the first one's error everywhere") {
    // Rank 0's max_norm is invalid; the last rank's shard was cut for one rank only.
    auto self = gradaccum::reduce_scatter_mean(params, rounding_sums<B, float>(params), MPI_COMM_SELF);
    const std::vector<double> before = values_of(mine);
    GRADACCUM_CHECK_REJECTED(
        gradaccum::clip_by_global_norm(culprit ? self : mine, world_rank == 0 ? -1.0 : 1.0, MPI_COMM_WORLD),
        errc::invalid_scalar, "");
    CHECK(values_of(mine) == before);
  }
  SUBCASE("different calls") {
    const std::vector<double> before = values_of(mine);
    std::vector<float> parameters(mine.layout()->elements(), 7.0F);
    SUBCASE("global_norm against clip_by_global_norm") {
      const auto call = [&] {
        if (culprit) return gradaccum::global_norm(mine, MPI_COMM_WORLD);
        return gradaccum::clip_by_global_norm(mine, norm / 3, MPI_COMM_WORLD);
      };
      GRADACCUM_CHECK_REJECTED(call(), errc::invalid_state, "");
    }
    SUBCASE("global_norm against allgather_shards") {
      const auto call = [&] {
        if (culprit) return gradaccum::global_norm(mine, MPI_COMM_WORLD);
        gradaccum::allgather_shards(mine, std::span<float>(parameters), MPI_COMM_WORLD);
        return 0.0;
      };
      GRADACCUM_CHECK_REJECTED(call(), errc::invalid_state, "");
    }
    SUBCASE("global_norm against allreduce_mean") {
      auto sums = local_sums(params, float_dtype::f32);
      const auto call = [&] {
        if (culprit) return gradaccum::global_norm(mine, MPI_COMM_WORLD);
        return static_cast<double>(gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD).gradients.size());
      };
      check_rejected_unchanged(sums, call, errc::invalid_state);
    }
    CHECK(values_of(mine) == before);
    CHECK(std::all_of(parameters.begin(), parameters.end(), [](float v) { return v == 7.0F; }));
  }
  // The ranks are still in step: the same shards give the same norm as before.
  CHECK(gradaccum::global_norm(mine, MPI_COMM_WORLD) == norm);
  check_ranks_still_agree(params);
}
