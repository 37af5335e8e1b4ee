/// @file
/// @brief `allreduce_mean` and `start_allreduce_mean` under `mpirun -np N` (N = 1, 2, 3): the
/// reduced mean equals one process accumulating every rank's microbatches bit for bit, whether
/// blocking or started, several in flight together beside the caller's own messages, with
/// parameters present on some ranks only or on none; and their refusals: every disagreement
/// between the ranks, and every rank's malformed sums, are the same error on every rank, with
/// every rank's sums left as they were and the ranks still in step.
///
/// One of test_mpi's files (tests/mpi/meson.build), run twice: with the default bucket size, and
/// with buckets of a few elements (mpi_N_ranks_small_buckets, $GRADACCUM_TEST_BUCKET_BYTES).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>
#include <gradaccum/mpi.hpp>

#include "mpi_fixture.hpp"

using namespace mpi_test;
using gradaccum::errc;
using gradaccum::float_dtype;

TEST_CASE_TEMPLATE("allreduce_mean equals one process accumulating every rank's microbatches", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  for (const float_dtype dtype : {float_dtype::f32, float_dtype::f64}) {
    INFO("work dtype " << dtype);
    auto sums = local_sums(params, dtype);
    const auto mean = gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bucket_bytes);
    const auto expected = single_process_mean(params, dtype);
    GRADACCUM_CHECK_SAME_BITS(record_of(mean), record_of(expected));
    // Spelled out, since the comparison above would also pass if both were wrong the same way:
    CHECK(mean.state.total_weight == 28.0);
    CHECK(mean.state.microbatches == step().size());
    CHECK(mean.gradients.contains("solo"));          // present on one rank: reduced everywhere
    CHECK_FALSE(mean.gradients.contains("unused"));  // present on none: absent
    CHECK(mean.gradients.size() == 5);
  }
}

TEST_CASE_TEMPLATE("every parameter present on every rank: the same result without the presence exchange", B,
                   BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  const auto every_parameter = [](int rank) {
    gradaccum::gradients_params<B> grads;
    for (const auto& spec : model()) grads.insert(spec.id, gradient<B, float>(static_cast<std::size_t>(rank), spec));
    return grads;
  };
  gradaccum::weighted_gradients_accumulator<B> mine(float_dtype::f32, loss_scale);
  mine.accumulate_sum(params, every_parameter(world_rank), world_rank + 1.0);
  gradaccum::weighted_gradients_accumulator<B> all(float_dtype::f32, loss_scale);
  for (int rank = 0; rank < world_size; ++rank) all.accumulate_sum(params, every_parameter(rank), rank + 1.0);
  const auto mean = gradaccum::allreduce_mean(params, mine.finish_sums(), MPI_COMM_WORLD, bucket_bytes);
  GRADACCUM_CHECK_SAME_BITS(record_of(mean), record_of(all.finish_mean(params)));
  CHECK(mean.gradients.size() == model().size());
}

TEST_CASE_TEMPLATE("a rank with zero tokens receives the full result and counts its microbatches", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  auto sums = local_sums(params, float_dtype::f32);
  if (world_size > 1 && world_rank == world_size - 1) {
    CHECK(sums.gradients.empty());
    CHECK(sums.state.total_weight == 0.0);
    CHECK(sums.state.microbatches == 1);
  }
  const auto mean = gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bucket_bytes);
  // fc.bias: sums g0 and g5 of microbatches 0 and 5, over 28 tokens and a loss scale of 4.
  const auto record = mean.gradients.to_record();  // sorted by id: big, embed, fc.bias, ...
  CHECK(record.tensors[2].id == "fc.bias");
  const auto bias = std::get<std::vector<float>>(record.tensors[2].values);
  const std::vector<float> g0{-1, 0, 1, 2, 3};  // ((index · 7 + 7 · 3 + i) mod 9) - 4
  const std::vector<float> g5{-2, -1, 0, 1, 2};
  for (std::size_t i = 0; i < 5; ++i) CHECK(bias[i] == (g0[i] + g5[i]) / 4.0F / 28.0F);
}

TEST_CASE_TEMPLATE("start_allreduce_mean overlaps other work and gives the same result", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  auto request =
      gradaccum::start_allreduce_mean(params, local_sums(params, float_dtype::f64), MPI_COMM_WORLD, bucket_bytes);
  CHECK(request.state().total_weight == 28.0);
  CHECK(request.state().microbatches == step().size());
  const auto expected = single_process_mean(params, float_dtype::f64);  // the overlapped work
  while (!request.test()) {
  }
  CHECK(request.test());  // finished stays finished
  auto moved = std::move(request);
  CHECK(moved.test());
  const auto mean = moved.wait();
  GRADACCUM_CHECK_SAME_BITS(record_of(mean), record_of(expected));
  CHECK(moved.test());  // nothing left in flight
  GRADACCUM_CHECK_REJECTED(moved.wait(), errc::invalid_state, "");
  // A moved-from request has no result to give: wait() must say so, not crash.
  CHECK(request.test());                                              // NOLINT(bugprone-use-after-move)
  GRADACCUM_CHECK_REJECTED(request.wait(), errc::invalid_state, "");  // NOLINT(bugprone-use-after-move)

  {  // waited without a test() first
    auto direct =
        gradaccum::start_allreduce_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD, bucket_bytes);
    GRADACCUM_CHECK_SAME_BITS(record_of(direct.wait()), record_of(single_process_mean(params, float_dtype::f32)));
  }

  {  // dropped without waiting: the destructor waits, and the ranks stay in step
    auto dropped =
        gradaccum::start_allreduce_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD, bucket_bytes);
  }
  check_ranks_still_agree(params);
}

TEST_CASE_TEMPLATE("reductions in flight together and the caller's own messages keep apart", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  // A receive for any message on the caller's communicator, posted before the reductions: it
  // must get only the message sent for it afterwards, none of the reductions' own.
  int received = 0;
  MPI_Request caller = MPI_REQUEST_NULL;
  MPI_Irecv(&received, 1, MPI_INT, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &caller);
  auto first =
      gradaccum::start_allreduce_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD, bucket_bytes);
  // The caller's own collective on the same communicator while both are in flight, with test()
  // called on some ranks only: every collective of a request starts in start_allreduce_mean.
  if (world_rank == 0) static_cast<void>(first.test());
  int ranks = 1;
  MPI_Allreduce(MPI_IN_PLACE, &ranks, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  CHECK(ranks == world_size);
  auto second =
      gradaccum::start_allreduce_mean(params, local_sums(params, float_dtype::f64), MPI_COMM_WORLD, bucket_bytes);
  if (world_rank == world_size - 1) static_cast<void>(second.test());
  const auto second_mean = second.wait();  // taken in the other order than started
  const auto first_mean = first.wait();
  GRADACCUM_CHECK_SAME_BITS(record_of(first_mean), record_of(single_process_mean(params, float_dtype::f32)));
  GRADACCUM_CHECK_SAME_BITS(record_of(second_mean), record_of(single_process_mean(params, float_dtype::f64)));
  const int sent = 1000 + world_rank;
  MPI_Send(&sent, 1, MPI_INT, (world_rank + 1) % world_size, 7, MPI_COMM_WORLD);
  MPI_Wait(&caller, MPI_STATUS_IGNORE);
  CHECK(received == 1000 + (world_rank + world_size - 1) % world_size);
}

TEST_CASE_TEMPLATE("every rank gets the same bits when the sums round", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  // Values with full mantissas, different on every rank, so the order of the sums matters.
  gradaccum::gradients_params<B> grads;
  for (const auto& spec : model()) {
    std::vector<float> values(*spec.shape.checked_element_count());
    for (std::size_t i = 0; i < values.size(); ++i) {
      values[i] = 1.0F / static_cast<float>(3 + i % 11 + static_cast<std::size_t>(world_rank) * 5) + 0.1F;
    }
    grads.insert(spec.id, B::template from_row_major<float>(std::span<const float>(values), spec.shape, {}));
  }
  gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, 3.0);
  window.accumulate_sum(params, grads, 7.0);
  const auto mean = gradaccum::allreduce_mean(params, window.finish_sums(), MPI_COMM_WORLD, bucket_bytes);
  // FNV-1a over every value's bits, then the smallest and largest over the ranks.
  std::uint64_t hash = 14695981039346656037ULL;
  for (const auto& t : mean.gradients.to_record().tensors) {
    for (const float v : std::get<std::vector<float>>(t.values)) {
      hash = (hash ^ std::bit_cast<std::uint32_t>(v)) * 1099511628211ULL;
    }
  }
  std::uint64_t lowest = hash;
  std::uint64_t highest = hash;
  MPI_Allreduce(MPI_IN_PLACE, &lowest, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &highest, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  CHECK(lowest == highest);
  CHECK(mean.gradients.size() == model().size());
}

TEST_CASE_TEMPLATE("a parameter named only in zero-weight microbatches is absent", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters<B>();
  gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, loss_scale);
  window.accumulate_sum(params, gradients_of<B>(2, float_dtype::f32), 12.0);  // fc.weight, big
  window.accumulate_sum(params, gradients_of<B>(3, float_dtype::f32), 0.0);   // embed, fc.bias
  const auto mean = gradaccum::allreduce_mean(params, window.finish_sums(), MPI_COMM_WORLD, bucket_bytes);
  CHECK(mean.gradients.size() == 2);
  CHECK(mean.gradients.contains("fc.weight"));
  CHECK(mean.gradients.contains("big"));
  CHECK_FALSE(mean.gradients.contains("embed"));
  CHECK_FALSE(mean.gradients.contains("fc.bias"));
  CHECK(mean.state.microbatches == 2 * static_cast<std::uint64_t>(world_size));
}

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
