/// @file
/// @brief How `<gradaccum/mpi.hpp>` moves the sums, under `mpirun -np N` (N = 1, 2, 3): buckets
/// ending inside segments and in their padding give exact values, a bucket of any size gives the
/// same bits, the division after the reduction has `kernels::divide`'s bits, and a window on a
/// backend's devices (the test-only device_backend) is reduced a bucket at a time, or straight
/// from its buffers when MPI reaches every rank's; a device copy failing midway takes nothing.
///
/// One of test_mpi's files (tests/mpi/meson.build), run twice: with the default bucket size, and
/// with buckets of a few elements (mpi_N_ranks_small_buckets, $GRADACCUM_TEST_BUCKET_BYTES),
/// where buckets end inside segments and in their padding.

#include <bit>
#include <cmath>
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
using gradaccum::float_dtype;

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
