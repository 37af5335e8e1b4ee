/// @file
/// @brief `reduce_scatter_mean` and the sharded step under `mpirun -np N` (N = 1 to 4): each
/// shard is bit for bit its range of `allreduce_mean`'s result (sparse participation included),
/// its pieces map it to parameters, the sharded global norm has the full norm's bits, clipping
/// shards equals clipping the full result, a non-finite value is agreed by every rank, and
/// `allgather_shards` gives every rank every rank's part.

#include <algorithm>
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

#include "mpi_fixture.hpp"

using namespace mpi_test;
using gradaccum::errc;
using gradaccum::float_dtype;

namespace {

template <class W>
using bits_t = std::conditional_t<sizeof(W) == 4, std::uint32_t, std::uint64_t>;

/// Whether `shard` holds exactly elements [begin, begin + stored) of `full`'s buffer, bit for bit,
/// and zeros after them.
template <class W, class B>
bool shard_matches(const gradaccum::sharded_gradients<B>& shard, const gradaccum::accumulated_gradients<B>& full) {
  const std::span<const W> mine = shard.template values<W>();
  const std::vector<W> all = gradaccum::test::flat_values<W>(full.gradients);
  const gradaccum::shard_range& range = shard.range();
  if (mine.size() != range.size) return false;
  for (std::size_t i = 0; i < range.size; ++i) {
    const W expected = i < range.stored ? all[range.begin + i] : W(0);
    if (std::bit_cast<bits_t<W>>(mine[i]) != std::bit_cast<bits_t<W>>(expected)) return false;
  }
  return true;
}

/// Every rank's sums of full-mantissa values (different per rank) over every parameter.
template <class B, class W>
gradaccum::accumulated_gradients<B> rounding_sums(const gradaccum::parameter_set<B>& params, double scale = 3.0) {
  gradaccum::gradients_params<B> grads;
  for (const auto& spec : model()) {
    std::vector<W> values(*spec.shape.checked_element_count());
    for (std::size_t i = 0; i < values.size(); ++i) {
      values[i] = W(1) / static_cast<W>(3 + i % 11 + static_cast<std::size_t>(world_rank) * 5) + W(0.1);
    }
    grads.insert(spec.id, B::template from_row_major<W>(std::span<const W>(values), spec.shape, {}));
  }
  gradaccum::weighted_gradients_accumulator<B> window(gradaccum::dtype_of<W>, scale);
  window.accumulate_sum(params, grads, 7.0);
  return window.finish_sums();
}

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

/// The present parameters' elements over every rank's pieces, per layout position: each piece is
/// checked against `full` here, and the counts are summed over the ranks.
template <class W, class B>
std::vector<std::uint64_t> piece_elements(const gradaccum::sharded_gradients<B>& shard,
                                          const gradaccum::accumulated_gradients<B>& full) {
  std::vector<std::uint64_t> elements(shard.layout()->size());
  const std::span<const W> mine = shard.template values<W>();
  for (const gradaccum::shard_piece& piece : shard.pieces()) {
    CHECK(shard.is_present(piece.position));
    CHECK(piece.id == (*shard.layout())[piece.position].id);
    const std::vector<W> values = gradaccum::test::values_of<W>(full.gradients, piece.id);
    REQUIRE(piece.parameter_offset + piece.size <= values.size());
    for (std::size_t i = 0; i < piece.size; ++i) {
      CHECK(std::bit_cast<bits_t<W>>(mine[piece.offset + i]) ==
            std::bit_cast<bits_t<W>>(values[piece.parameter_offset + i]));
    }
    elements[piece.position] += piece.size;
  }
  MPI_Allreduce(MPI_IN_PLACE, elements.data(), static_cast<int>(elements.size()), MPI_UINT64_T, MPI_SUM,
                MPI_COMM_WORLD);
  return elements;
}

/// Runs `body.template operator()<W>(dtype)` for both work dtypes.
template <class F>
void for_both_dtypes(F&& body) {
  body.template operator()<float>(float_dtype::f32);
  body.template operator()<double>(float_dtype::f64);
}

}  // namespace

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
