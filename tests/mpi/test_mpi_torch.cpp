/// @file
/// @brief `<gradaccum/mpi.hpp>` over `torch_backend`, under `mpirun -np 2`: a module's gradients
/// (F32 and BF16 tensors, one of them transposed, one parameter without a gradient on one rank)
/// reduced across ranks equal one process accumulating every rank's microbatches, bit for bit,
/// and the mean goes back into the module's `.grad()`.
///
/// Tests only CHECK (never REQUIRE), so no rank leaves a test case early and skips a collective
/// its peers are in.

// Before doctest: c10 defines a CHECK macro, which doctest's must replace.
#include <gradaccum/backends/torch.hpp>

#include <algorithm>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>
#include <gradaccum/mpi.hpp>

#include "../test_helpers.hpp"

namespace {

using gradaccum::float_dtype;
using B = gradaccum::torch_backend;

int world_rank = 0;
int world_size = 1;

/// The gradients rank `rank` computes for its microbatch: random values of a fixed seed, F32
/// for "w" (given transposed, so it is read through its strides) and BF16 for "b"; "b" has
/// no gradient on odd ranks.
gradaccum::gradients_params<B> microbatch_of(int rank) {
  at::manual_seed(static_cast<std::uint64_t>(100 + rank));
  gradaccum::gradients_params<B> grads;
  grads.insert("w", at::randn({3, 4}).t());
  if (rank % 2 == 0) grads.insert("b", at::randn({4}).to(at::kBFloat16));
  return grads;
}

double tokens_of(int rank) {
  return 2.0 + 3.0 * rank;
}

gradaccum::parameter_set<B> parameters() {
  gradaccum::parameter_set<B> params;
  params.add("w", at::zeros({4, 3}));
  params.add("b", at::zeros({4}, at::kBFloat16));
  return params;
}

TEST_CASE_TEMPLATE("allreduce_mean of torch gradients equals one process accumulating every rank's", W, float, double) {
  INFO("rank " << world_rank << " of " << world_size);
  const auto params = parameters();
  gradaccum::weighted_gradients_accumulator<B> mine(gradaccum::dtype_of<W>, 8.0);
  mine.accumulate_mean(params, microbatch_of(world_rank), tokens_of(world_rank));
  const auto mean = gradaccum::allreduce_mean(params, mine.finish_sums(), MPI_COMM_WORLD);

  gradaccum::weighted_gradients_accumulator<B> all(gradaccum::dtype_of<W>, 8.0);
  for (int rank = 0; rank < world_size; ++rank) all.accumulate_mean(params, microbatch_of(rank), tokens_of(rank));
  const auto expected = all.finish_mean(params);
  GRADACCUM_CHECK_SAME_BITS(mean.gradients.to_record(), expected.gradients.to_record());
  CHECK(mean.state.total_weight == expected.state.total_weight);
  CHECK(mean.gradients.contains("b"));  // present on rank 0 only, reduced everywhere

  // And into a module's parameters, as an optimizer step would read them.
  torch::OrderedDict<std::string, at::Tensor> named;
  named.insert("w", at::zeros({4, 3}).requires_grad_());
  named.insert("b", at::zeros({4}, at::kBFloat16).requires_grad_());
  gradaccum::write_gradients(named, mean.gradients);
  const at::Tensor w_grad = named["w"].grad().contiguous();
  const at::Tensor w_values = mean.gradients.template get<W>("w")->contiguous();  // on the window's device
  bool same = true;
  for (std::int64_t i = 0; i < w_values.numel(); ++i)
    same &= w_grad.data_ptr<float>()[i] == static_cast<float>(w_values.data_ptr<W>()[i]);
  CHECK(same);
  CHECK(w_values.numel() == 12);
  CHECK((named["b"].grad().scalar_type() == at::kBFloat16));

  // Started: the buckets in flight from the sums' tensor into the result's, divided at the end.
  gradaccum::weighted_gradients_accumulator<B> again(gradaccum::dtype_of<W>, 8.0);
  again.accumulate_mean(params, microbatch_of(world_rank), tokens_of(world_rank));
  auto request = gradaccum::start_allreduce_mean(params, again.finish_sums(), MPI_COMM_WORLD, 16);
  while (!request.test()) {
  }
  GRADACCUM_CHECK_SAME_BITS(request.wait().gradients.to_record(), expected.gradients.to_record());

  // Sharded: one reduce-scatter from the sums' tensor (which ends before the layout's padding).
  again.accumulate_mean(params, microbatch_of(world_rank), tokens_of(world_rank));
  const auto shard = gradaccum::reduce_scatter_mean(params, again.finish_sums(), MPI_COMM_WORLD);
  std::vector<W> flat(mean.gradients.layout()->elements(), W(0));  // the window's buffer
  for (const auto& e : mean.gradients) {
    const at::Tensor values = mean.gradients.template get<W>(e.id)->contiguous();
    std::copy_n(values.data_ptr<W>(), values.numel(), flat.begin() + static_cast<std::ptrdiff_t>(e.offset));
  }
  const std::span<const W> ours = shard.template values<W>();
  bool shard_same = ours.size() == shard.range().size;
  for (std::size_t i = 0; shard_same && i < ours.size(); ++i) {
    const W want = i < shard.range().stored ? flat[shard.range().begin + i] : W(0);
    shard_same = std::memcmp(&ours[i], &want, sizeof(W)) == 0;
  }
  CHECK(shard_same);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  doctest::Context context(argc, argv);
  if (world_rank != 0) context.setOption("minimal", true);
  int failed = context.run() != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return failed;
}
