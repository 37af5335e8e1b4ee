/// @file
/// @brief `<gradaccum/mpi.hpp>` under `mpirun -np N` (N = 1, 2, 3): the reduced mean equals one
/// process accumulating every rank's microbatches bit for bit, and every disagreement is the same
/// error on every rank, with every rank's sums left as they were.
///
/// Run twice: with the default bucket size, and with buckets of a few elements
/// (mpi_N_ranks_small_buckets, $GRADACCUM_TEST_BUCKET_BYTES), where buckets end inside segments
/// and in their padding.

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
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

TEST_CASE_TEMPLATE("buckets ending inside segments and in padding give exact values", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  INFO("buckets of " << bucket_bytes << " bytes");
  // Segments of 3, 17, 4 and 10 elements padded to 16, 32, 16 and 16: "skipped" (present nowhere)
  // lies between the reduced ones, "absent" after them. With small buckets (11 floats, 5 doubles)
  // the reduced range, 74 elements, ends with a bucket of 8 floats or 4 doubles: not a multiple
  // of 3 ranks, and cut inside "c".
  const std::vector<parameter_spec> specs{
      {"a", {3, 1}}, {"b", {17, 1}}, {"skipped", {4, 1}}, {"c", {5, 2}}, {"absent", {2, 1}}};
  const auto params = parameters<B>(specs);
  const std::vector<std::size_t> reduced{0, 1, 3};
  for (const float_dtype dtype : {float_dtype::f32, float_dtype::f64}) {
    INFO("work dtype " << dtype);
    for (const bool blocking : {true, false}) {
      INFO((blocking ? "allreduce_mean" : "start_allreduce_mean"));
      // Rank r sends (r + 1) · v with v = 100 · parameter + element + 1 and weight 1: the sum over
      // N ranks, v · N (N + 1) / 2, is exact, and so is its comparison with the contract's steps.
      gradaccum::gradients_params<B> grads;
      for (const std::size_t k : reduced) {
        std::vector<double> values(*specs[k].shape.checked_element_count());
        for (std::size_t i = 0; i < values.size(); ++i) values[i] = (world_rank + 1.0) * (100.0 * k + i + 1.0);
        if (dtype == float_dtype::f64) {
          grads.insert(specs[k].id,
                       B::template from_row_major<double>(std::span<const double>(values), specs[k].shape, {}));
        } else {
          const std::vector<float> narrow(values.begin(), values.end());
          grads.insert(specs[k].id,
                       B::template from_row_major<float>(std::span<const float>(narrow), specs[k].shape, {}));
        }
      }
      gradaccum::weighted_gradients_accumulator<B> window(dtype, 2.0);
      window.accumulate_sum(params, grads, 1.0);
      auto sums = window.finish_sums();
      const auto mean =
          blocking ? gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bucket_bytes)
                   : gradaccum::start_allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bucket_bytes).wait();
      CHECK(mean.gradients.size() == reduced.size());
      CHECK_FALSE(mean.gradients.contains("skipped"));
      CHECK_FALSE(mean.gradients.contains("absent"));
      const auto check_values = [&]<class W>() {
        const auto n = static_cast<W>(world_size);
        for (const std::size_t k : reduced) {
          const std::vector<W> got = gradaccum::test::values_of<W>(mean.gradients, specs[k].id);
          CHECK(got.size() == *specs[k].shape.checked_element_count());
          for (std::size_t i = 0; i < got.size(); ++i) {
            const W sum = static_cast<W>(100.0 * k + i + 1.0) * (n * (n + 1) / 2);
            CHECK(got[i] == sum / W(2) / n);
          }
        }
        // Padding and the segments present nowhere stay zero.
        const std::vector<W> all = gradaccum::test::flat_values<W>(mean.gradients);
        const auto* layout = mean.gradients.layout();
        std::size_t zeros = 0;
        std::size_t expected_zeros = all.size();
        for (const std::size_t k : reduced) expected_zeros -= (*layout)[k].size;
        for (const W v : all) zeros += v == W(0) ? 1 : 0;
        CHECK(zeros == expected_zeros);
      };
      if (dtype == float_dtype::f64) {
        check_values.template operator()<double>();
      } else {
        check_values.template operator()<float>();
      }
    }
  }
}

TEST_CASE("normalize has kernels::divide's bits, with and without power-of-two divisors") {
  // Bit patterns across the range: subnormals (where x / s rounds), normals, both zeros,
  // infinities, NaN.
  std::vector<std::uint32_t> patterns{0x00000000U, 0x80000000U, 0x7f800000U, 0xff800000U, 0x7fc00001U};
  for (std::uint32_t bits = 1; bits < 0x7f800000U; bits += 0x000fedcbU) {
    patterns.push_back(bits);
    patterns.push_back(bits | 0x80000000U);
  }
  for (std::uint32_t bits = 1; bits < 0x00001000U; bits += 7) patterns.push_back(bits);
  for (const double s : {1.0, 4.0, 1024.0, 65536.0, 0.125, std::ldexp(1.0, 100), 3.0}) {
    for (const double w : {1.0, 28.0, 64.0, 0.25, 7.0, std::ldexp(1.0, -120)}) {
      INFO("s = " << s << ", w = " << w);
      std::vector<float> fast(patterns.size());
      std::vector<float> reference(patterns.size());
      for (std::size_t i = 0; i < patterns.size(); ++i) fast[i] = reference[i] = std::bit_cast<float>(patterns[i]);
      gradaccum::detail::mpi::normalize(fast.data(), fast.size(), static_cast<float>(s), static_cast<float>(w));
      gradaccum::kernels::divide(reference.data(), reference.size(), static_cast<float>(s), static_cast<float>(w));
      std::size_t differing = 0;
      for (std::size_t i = 0; i < patterns.size(); ++i) {
        const bool both_nan = std::isnan(fast[i]) && std::isnan(reference[i]);
        differing +=
            both_nan || std::bit_cast<std::uint32_t>(fast[i]) == std::bit_cast<std::uint32_t>(reference[i]) ? 0 : 1;
      }
      CHECK(differing == 0);
      std::vector<double> fast64(patterns.size());
      std::vector<double> reference64(patterns.size());
      for (std::size_t i = 0; i < patterns.size(); ++i) {
        fast64[i] = reference64[i] = std::ldexp(static_cast<double>(std::bit_cast<float>(patterns[i])), -900);
      }
      gradaccum::detail::mpi::normalize(fast64.data(), fast64.size(), s, w);
      gradaccum::kernels::divide(reference64.data(), reference64.size(), s, w);
      differing = 0;
      for (std::size_t i = 0; i < patterns.size(); ++i) {
        const bool both_nan = std::isnan(fast64[i]) && std::isnan(reference64[i]);
        differing +=
            both_nan || std::bit_cast<std::uint64_t>(fast64[i]) == std::bit_cast<std::uint64_t>(reference64[i]) ? 0 : 1;
      }
      CHECK(differing == 0);
    }
  }
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

TEST_CASE_TEMPLATE("a bucket holds at least one element and at most an MPI count", B, BACKENDS) {
  INFO("rank " << world_rank << " of " << world_size);
  const std::vector<parameter_spec> specs{{"a", {3, 1}}, {"b", {5, 2}}};
  const auto params = parameters<B>(specs);
  const auto sums = [&] {
    gradaccum::gradients_params<B> grads;
    for (const auto& spec : specs) {
      std::vector<float> values(*spec.shape.checked_element_count());
      for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>((world_rank + 1) * (i + 1));
      grads.insert(spec.id, B::template from_row_major<float>(std::span<const float>(values), spec.shape, {}));
    }
    gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
    window.accumulate_sum(params, grads, 1.0);
    return window.finish_sums();
  };
  const auto reference = gradaccum::allreduce_mean(params, sums(), MPI_COMM_WORLD);
  // 0 and 3 bytes: one float per bucket; SIZE_MAX: INT_MAX elements, one bucket.
  for (const std::size_t bytes : {std::size_t{0}, std::size_t{3}, SIZE_MAX}) {
    CAPTURE(bytes);
    GRADACCUM_CHECK_SAME_BITS(record_of(gradaccum::allreduce_mean(params, sums(), MPI_COMM_WORLD, bytes)),
                              record_of(reference));
    GRADACCUM_CHECK_SAME_BITS(record_of(gradaccum::start_allreduce_mean(params, sums(), MPI_COMM_WORLD, bytes).wait()),
                              record_of(reference));
  }
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

TEST_CASE("a device window is reduced a bucket at a time, and a device copy failing midway takes nothing") {
  INFO("rank " << world_rank << " of " << world_size);
  using B = gradaccum::test::device_backend;
  const auto params = parameters<B>();
  constexpr std::size_t bucket = 4096;  // 1,024 F32 values: "big" (20,480) spans several buckets

  B::largest_read = 0;
  const auto mean = gradaccum::allreduce_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD, bucket);
  CHECK(B::largest_read <= bucket / sizeof(float));  // no host copy of the window, nor of a segment
  GRADACCUM_CHECK_SAME_BITS(record_of(mean), record_of(single_process_mean(params, float_dtype::f32)));

  // Started, without MPI reaching the buffers: reduced at once, through the same one bucket.
  B::largest_read = 0;
  auto request = gradaccum::start_allreduce_mean(params, local_sums(params, float_dtype::f32), MPI_COMM_WORLD, bucket);
  CHECK(B::largest_read <= bucket / sizeof(float));
  CHECK(request.test());  // nothing left in flight
  GRADACCUM_CHECK_SAME_BITS(record_of(request.wait()), record_of(mean));

  // Rank 0 (which has sums) fails its fifth device read, after some buckets were reduced.
  auto sums = local_sums(params, float_dtype::f32);
  const auto before = record_of(sums);
  if (world_rank == 0) B::reads_until_failure = 5;
  check_rank_0_copy_failed([&] { (void)gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bucket); });
  B::reads_until_failure = 0;
  GRADACCUM_CHECK_SAME_BITS(record_of(sums), before);  // not taken, not changed
  const auto retried = gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD, bucket);
  GRADACCUM_CHECK_SAME_BITS(record_of(retried), record_of(mean));
}

TEST_CASE("device buffers that MPI reaches go to it as they are, when every rank's do") {
  INFO("rank " << world_rank << " of " << world_size);
  using B = gradaccum::test::device_backend;
  const auto params = parameters<B>();
  const auto expected = record_of(single_process_mean(params, float_dtype::f64));
  const auto reduce = [&] {
    return gradaccum::allreduce_mean(params, local_sums(params, float_dtype::f64), MPI_COMM_WORLD, bucket_bytes);
  };
  const bool has_sums = local_sums(params, float_dtype::f64).gradients.size() != 0;

  B::mpi_reaches_buffers = true;
  B::largest_read = 0;
  const auto direct = reduce();
  CHECK(B::largest_read == 0);  // nothing went through the host
  GRADACCUM_CHECK_SAME_BITS(record_of(direct), expected);

  // Started: every bucket in flight from the sums' buffer into the result's, divided at the end.
  B::largest_read = 0;
  auto request =
      gradaccum::start_allreduce_mean(params, local_sums(params, float_dtype::f64), MPI_COMM_WORLD, bucket_bytes);
  while (!request.test()) {
  }
  const auto started = request.wait();
  CHECK(B::largest_read == 0);
  GRADACCUM_CHECK_SAME_BITS(record_of(started), expected);

  // One rank whose MPI cannot take its buffers: every rank stages its buckets, with the same bits.
  B::mpi_reaches_buffers = world_rank != 0;
  B::largest_read = 0;
  const auto staged = reduce();
  CHECK((B::largest_read != 0) == has_sums);
  GRADACCUM_CHECK_SAME_BITS(record_of(staged), expected);
  B::mpi_reaches_buffers = false;
}
