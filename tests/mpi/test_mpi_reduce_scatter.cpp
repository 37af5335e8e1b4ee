/// @file
/// @brief `reduce_scatter_mean` under `mpirun -np N` (N = 1 to 4): each shard is bit for bit its
/// range of `allreduce_mean`'s result (sparse participation included), its pieces map it to
/// parameters, its storage is reused once its result is gone, and a shard cut from the
/// allreduce's own collectives has its range's bits on any number of ranks. A window on a
/// backend's devices (the test-only device_backend) is reduce-scattered through one bucket of
/// host memory at a time, or straight from its buffers, with the non-finite check on the devices;
/// a device read failing on rank 0 is an error on every rank that takes nothing.

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
using gradaccum::float_dtype;

TEST_CASE_TEMPLATE("each shard is its range of allreduce_mean's result, bit for bit", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  for_both_dtypes([&]<class W>(float_dtype dtype) {
    INFO("work dtype " << dtype);
    const auto full = gradaccum::allreduce_mean(params, local_sums(params, dtype), MPI_COMM_WORLD);
    const auto shard = gradaccum::reduce_scatter_mean(params, local_sums(params, dtype), MPI_COMM_WORLD);
    CHECK(shard_matches<W>(shard, full));
    CHECK(shard.state() == full.state);
    CHECK(shard.dtype() == dtype);
    CHECK_FALSE(shard.found_non_finite());
    // The whole layout: 20560 elements in 21 blocks of 1024, cut into equal shards.
    const std::size_t elements = shard.layout()->elements();
    CHECK(elements == 20560);
    const auto ranks = static_cast<std::size_t>(world_size);
    const std::size_t blocks = (21 + ranks - 1) / ranks;
    CHECK(shard.range() == gradaccum::shard_of(elements, static_cast<std::size_t>(world_rank), ranks));
    CHECK(shard.range().size == blocks * 1024);
    CHECK(shard.template values<W>().size() == blocks * 1024);  // about 1/N of the window
    for (std::size_t position = 0; position < params.size(); ++position) {
      CHECK(shard.is_present(position) == full.gradients.is_present(position));
    }
    CHECK_FALSE(shard.is_present(*params.find("unused")));  // present on no rank
    CHECK(shard.is_present(*params.find("solo")));          // present on one rank
    // The ranks' pieces cover every present parameter exactly once, and nothing else.
    const std::vector<std::uint64_t> covered = piece_elements<W>(shard, full);
    for (std::size_t position = 0; position < params.size(); ++position) {
      CHECK(covered[position] ==
            (full.gradients.is_present(position) ? *params[position].shape.checked_element_count() : 0));
    }
  });
}

TEST_CASE_TEMPLATE("a shard's storage is reused once its result is gone, and only then", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  const auto full = gradaccum::allreduce_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD);
  {
    const auto first = gradaccum::reduce_scatter_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD);
    // Made while the first is kept: it must not write into the first's values.
    const auto second = gradaccum::reduce_scatter_mean(params, rounding_sums<B, float>(params), MPI_COMM_WORLD);
    CHECK(second.template values<float>().data() != first.template values<float>().data());
    CHECK(shard_matches<float>(first, full));
  }
  const float* reused = nullptr;
  {
    auto last = gradaccum::reduce_scatter_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD);
    // Garbage everywhere, where the shard reaches past the buffer's end too.
    for (float& v : last.template values<float>()) v = 7.0F;
    reused = last.template values<float>().data();
  }
  const auto again = gradaccum::reduce_scatter_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD);
  CHECK(again.template values<float>().data() == reused);
  CHECK(shard_matches<float>(again, full));  // the reduced values, and zeros past the buffer's end
}

TEST_CASE_TEMPLATE("a window smaller than one block lives on rank 0; the others hold zeros", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const std::vector<parameter_spec> specs{{"a", {3, 1}}, {"b", {4, 5}}};
  const auto params = parameters<B>(specs);
  gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, 2.0);
  gradaccum::gradients_params<B> grads;
  grads.insert("b", gradient<B, float>(static_cast<std::size_t>(world_rank), specs[1]));
  window.accumulate_sum(params, grads, 1.0);
  gradaccum::weighted_gradients_accumulator<B> twin(float_dtype::f32, 2.0);
  twin.accumulate_sum(params, grads, 1.0);
  const auto full = gradaccum::allreduce_mean(params, window.finish_sums(), MPI_COMM_WORLD);
  const auto shard = gradaccum::reduce_scatter_mean(params, twin.finish_sums(), MPI_COMM_WORLD);
  CHECK(shard_matches<float>(shard, full));
  CHECK(shard.range().size == 1024);
  CHECK(shard.range().stored == (world_rank == 0 ? 48 : 0));
  CHECK(shard.pieces().size() == (world_rank == 0 ? 1 : 0));
  CHECK(gradaccum::global_norm(shard, MPI_COMM_WORLD) == gradaccum::global_norm(full));
}

TEST_CASE_TEMPLATE("shards of sums that round: bit for bit on 1 and 2 ranks, on any number cut from the allreduce", B,
                   BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  for_both_dtypes([&]<class W>(float_dtype dtype) {
    INFO("work dtype " << dtype);
    const auto full = gradaccum::allreduce_mean(params, rounding_sums<B, W>(params), MPI_COMM_WORLD);
    const auto shard = gradaccum::reduce_scatter_mean(params, rounding_sums<B, W>(params), MPI_COMM_WORLD);
    if (world_size <= 2) {
      CHECK(shard_matches<W>(shard, full));
    } else {  // MPI may add three or more ranks' values in another order: rounding only
      const std::span<const W> mine = shard.template values<W>();
      const std::vector<W> all = gradaccum::test::flat_values<W>(full.gradients);
      for (std::size_t i = 0; i < shard.range().stored; ++i) {
        const W expected = all[shard.range().begin + i];
        CHECK(std::abs(mine[i] - expected) <= 4 * std::numeric_limits<W>::epsilon() * std::abs(expected));
      }
    }
    // Cut from allreduce_mean's own collectives, a shard has its range's bits on any number of
    // ranks, with the same state and non-finite answer as the reduce-scatter's.
    for (const std::size_t bucket_bytes : {gradaccum::default_bucket_bytes, std::size_t{44}}) {
      INFO("bucket bytes " << bucket_bytes);
      const auto bucketed =
          gradaccum::allreduce_mean(params, rounding_sums<B, W>(params), MPI_COMM_WORLD, bucket_bytes);
      const auto same = gradaccum::reduce_scatter_mean(params, rounding_sums<B, W>(params), MPI_COMM_WORLD,
                                                       gradaccum::shard_reduction::same_as_allreduce, bucket_bytes);
      CHECK(shard_matches<W>(same, bucketed));
      CHECK(same.range() == shard.range());
      CHECK(same.state() == shard.state());
      CHECK(same.found_non_finite() == shard.found_non_finite());
      CHECK(same.pieces().size() == shard.pieces().size());
    }
    // The norm of the shards is the same on every rank.
    const double norm = gradaccum::global_norm(shard, MPI_COMM_WORLD);
    double range[2] = {norm, -norm};
    MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    CHECK(std::bit_cast<std::uint64_t>(range[0]) == std::bit_cast<std::uint64_t>(-range[1]));
  });
}

TEST_CASE("a device window is reduce-scattered through one bucket of host memory at a time, or none") {
  INFO("rank " << world_rank << " of " << world_size);
  using B = gradaccum::test::device_backend;
  const auto params = parameters<B>();
  constexpr std::size_t bucket = 4096;  // 1,024 F32 values: the 20,560-element window in many pieces
  const auto reduce = [&](gradaccum::accumulated_gradients<B>&& sums) {
    return gradaccum::reduce_scatter_mean(params, std::move(sums), MPI_COMM_WORLD,
                                          gradaccum::shard_reduction::reduce_scatter, bucket);
  };
  const auto full = gradaccum::allreduce_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD);

  // Staged: each piece holds every rank's next run of its shard (1,024 / ranks values each).
  B::largest_read = 0;
  const auto staged = reduce(local_sums(params, float_dtype::f32));
  CHECK(B::largest_read <= bucket / sizeof(float) / static_cast<std::size_t>(world_size));
  CHECK(shard_matches<float>(staged, full));  // sums exact in any order: the allreduce's bits
  CHECK(staged.state() == full.state);
  for (std::size_t position = 0; position < params.size(); ++position) {
    CHECK(staged.is_present(position) == full.gradients.is_present(position));
  }

  // Sums that round: on 1 and 2 ranks, the pieces give the whole buffer's bits.
  const auto whole = gradaccum::reduce_scatter_mean(params, rounding_sums<B, float>(params), MPI_COMM_WORLD);
  const auto in_pieces = reduce(rounding_sums<B, float>(params));
  if (world_size <= 2) CHECK(std::ranges::equal(in_pieces.values<float>(), whole.values<float>()));

  // MPI reaching every rank's buffers: one reduce-scatter from them, and the non-finite check
  // done on the devices (`all_finite`): nothing is read through the host.
  B::mpi_reaches_buffers = true;
  B::largest_read = 0;
  const auto direct = reduce(local_sums(params, float_dtype::f32));
  CHECK(B::largest_read == 0);
  CHECK(shard_matches<float>(direct, full));
  CHECK_FALSE(direct.found_non_finite());
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    INFO("value " << bad);
    gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, loss_scale);
    gradaccum::gradients_params<B> grads;
    std::vector<float> values(4, 1.0F);
    if (world_rank == world_size - 1) values[2] = bad;
    grads.insert("solo", B::template from_row_major<float>(std::span<const float>(values), model()[4].shape, {}));
    window.accumulate_sum(params, grads, 1.0);
    B::finite_checks = 0;
    CHECK(reduce(window.finish_sums()).found_non_finite());  // on every rank
    CHECK(B::largest_read == 0);
    CHECK(B::finite_checks == 1);  // this rank's one buffer, whole
  }
  B::mpi_reaches_buffers = false;

  // Cut from allreduce_mean's own collectives (staged or direct), the shard is read from the
  // result on the devices; rank 0 failing that read is an error on every rank, nothing taken.
  const auto cut = [&](gradaccum::accumulated_gradients<B>&& sums) {
    return gradaccum::reduce_scatter_mean(params, std::move(sums), MPI_COMM_WORLD,
                                          gradaccum::shard_reduction::same_as_allreduce, bucket);
  };
  for (const bool reaches : {false, true}) {
    CAPTURE(reaches);
    B::mpi_reaches_buffers = reaches;
    constexpr std::size_t uncounted = std::size_t{1} << 40;
    B::reads_until_failure = uncounted;  // counts this rank's reads without failing any
    CHECK(shard_matches<float>(cut(local_sums(params, float_dtype::f32)), full));
    const std::size_t reads = uncounted - B::reads_until_failure;
    REQUIRE(reads >= 1);
    auto kept = local_sums(params, float_dtype::f32);
    const auto kept_before = record_of(kept);
    B::reads_until_failure = world_rank == 0 ? reads : 0;  // the last read, the shard's, fails
    check_rank_0_copy_failed([&] { (void)cut(std::move(kept)); });
    B::reads_until_failure = 0;
    GRADACCUM_CHECK_SAME_BITS(record_of(kept), kept_before);
    CHECK(shard_matches<float>(cut(std::move(kept)), full));  // the ranks are still in step
  }
  B::mpi_reaches_buffers = false;

  // Rank 0 (which has sums) fails its third device read: every rank throws, nothing is taken.
  auto sums = local_sums(params, float_dtype::f32);
  const auto before = record_of(sums);
  if (world_rank == 0) B::reads_until_failure = 3;
  check_rank_0_copy_failed([&] { (void)reduce(std::move(sums)); });
  B::reads_until_failure = 0;
  GRADACCUM_CHECK_SAME_BITS(record_of(sums), before);  // not taken, not changed
  CHECK(shard_matches<float>(reduce(std::move(sums)), full));
}
