/// @file
/// @brief The sharded step after `reduce_scatter_mean` under `mpirun -np N` (N = 1 to 4): the
/// sharded global norm has the full norm's bits, clipping shards equals clipping the full result,
/// a non-finite value is agreed by every rank, and `allgather_shards` gives every rank every
/// rank's part.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
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
