// mpi_data_parallel: trains the demo's character-level model data-parallel over the ranks of
// MPI_COMM_WORLD with the whole training step, twice, and checks it against one process.
//
//   mpirun -np 2 ./mpi_data_parallel [steps] [word-file]
//
// Every rank reads the same words and builds the same windows of unequal microbatches; rank r
// computes microbatches r, r + size, ..., so ranks see different numbers of tokens. Each rank
// accumulates the gradients of its loss SUM, scaled by a dynamic loss scale, weighted by their
// token counts. Then, per window:
//   full:    allreduce_mean -> clip_by_global_norm -> loss scale update -> Adam on every parameter
//   sharded: reduce_scatter_mean -> clip_by_global_norm(shard, comm) -> loss scale update ->
//            Adam on this rank's shard only -> allgather_shards
// Window 3 gets an infinity on the last rank (as an F16 overflow would): every rank skips it.
// Checks: the sharded run's parameters equal the full run's bit for bit (on 2 ranks, where
// reduce-scatter and allreduce form the same sums); every rank holds the same parameters; the
// reduced gradient matches what one process gets from the whole window (float rounding: sums in
// another order); and rank 0 also trains the single-process run, whose parameters it compares.

#include "demo/model.hpp"
#include "demo/text_data.hpp"
#include "demo/training_step.hpp"

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>
#include <gradaccum/mpi.hpp>

#include <mpi.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <limits>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

// Set by meson to the bundled word list's absolute path.
#ifndef GRADACCUM_DEMO_FALLBACK_DATA
#define GRADACCUM_DEMO_FALLBACK_DATA "examples/demo/fallback_words.txt"
#endif

namespace {

using gradaccum::float_dtype;
using backend = gradaccum::eigen_backend;
using accumulator = gradaccum::weighted_gradients_accumulator<backend>;
using parameters = gradaccum::parameter_set<backend>;

constexpr float learning_rate = 1e-2F;
constexpr double max_norm = 0.4;
constexpr std::size_t overflow_step = 3;
constexpr std::uint64_t seed = 42;
constexpr int context = 3;
// Float sums in another order round differently, by a few units in the last place: far below this.
constexpr double match_below = 1e-5;

struct rank_info {
  int rank = 0;
  int size = 1;
};

parameters parameter_set_of(const demo::char_mlp<float>& model) {
  parameters params;
  demo::for_each_tensor(model, [&](std::string_view name, const demo::matrix<float>& w) { params.add(name, w); });
  return params;
}

/// Views of the model's gradient buffers: the accumulator reads them in place.
gradaccum::gradients_params<backend> views_of(const demo::char_mlp<float>& grads) {
  gradaccum::gradients_params<backend> out;
  demo::for_each_tensor(grads, [&](std::string_view name, const demo::matrix<float>& g) {
    out.insert(name, Eigen::Map<const demo::matrix<float>>(g.data(), g.rows(), g.cols()));
  });
  return out;
}

/// A window's result (F32 or F64, per its work dtype) in the model's layout.
template <typename T>
demo::char_mlp<T> model_gradients(const gradaccum::flat_gradients<backend>& grads, const demo::model_shape& shape) {
  demo::char_mlp<T> out = demo::char_mlp<T>::zeros(shape);
  demo::for_each_tensor(out, [&](std::string_view name, demo::matrix<T>& dst) {
    if (const auto g = grads.get<float>(name)) {
      dst = g->template cast<T>();
    } else if (const auto g64 = grads.get<double>(name)) {
      dst = g64->template cast<T>();
    } else {
      throw std::runtime_error("reduced gradients lack '" + std::string(name) + "'");
    }
  });
  return out;
}

/// All tensors of a model-shaped gradient as one vector.
Eigen::VectorXd flatten(const demo::char_mlp<double>& m) {
  Eigen::Index total = 0;
  demo::for_each_tensor(m, [&](std::string_view, const demo::matrix<double>& t) { total += t.size(); });
  Eigen::VectorXd flat(total);
  Eigen::Index at = 0;
  demo::for_each_tensor(m, [&](std::string_view, const demo::matrix<double>& t) {
    flat.segment(at, t.size()) = t.reshaped();
    at += t.size();
  });
  return flat;
}

/// ||g - ref|| / ||ref|| over all parameters together.
double relative_error(const demo::char_mlp<double>& g, const demo::char_mlp<double>& ref) {
  const Eigen::VectorXd r = flatten(ref);
  return (flatten(g) - r).norm() / r.norm();
}

std::filesystem::path word_file(int argc, char** argv) {
  if (argc > 2) return argv[2];
  const std::filesystem::path system_words = "/usr/share/dict/american-english";
  return std::filesystem::exists(system_words) ? system_words : std::filesystem::path(GRADACCUM_DEMO_FALLBACK_DATA);
}

/// Accumulates `microbatches[i]` for every i with i % every == first: this rank's share of the
/// window, or all of it (first 0, every 1) for the single-process run. With `overflow`, microbatch
/// `poisoned` (the last rank's first) gets an infinity in one gradient.
accumulator accumulate_window(const demo::char_mlp<float>& model, const parameters& params, const demo::window& w,
                              std::size_t first, std::size_t every, double loss_scale, bool overflow,
                              std::size_t poisoned) {
  accumulator window(float_dtype::f32, loss_scale);
  demo::char_mlp<float> g = demo::char_mlp<float>::zeros(demo::model_shape{});
  for (std::size_t i = first; i < w.microbatches.size(); i += every) {
    const demo::token_batch& mb = w.microbatches[i];
    demo::loss_and_gradients(model, mb, static_cast<float>(loss_scale), g);  // of the scaled loss SUM
    if (overflow && i == poisoned) g.out_bias(0) = std::numeric_limits<float>::infinity();
    window.accumulate_sum(params, views_of(g), static_cast<double>(mb.tokens()));
  }
  return window;
}

/// One training run: the model, its parameters in the window's layout, Adam (over the whole
/// buffer, or one shard of it) and the loss scale.
struct training_run {
  demo::char_mlp<float> model;
  std::vector<float> flat;
  demo::flat_adam adam;
  gradaccum::dynamic_loss_scale scaler;
  std::vector<std::size_t> skipped;

  training_run(const demo::char_mlp<float>& initial, const demo::flat_layout& layout, std::size_t adam_elements)
      : model(initial), flat(demo::flat_parameters(initial, layout)), adam(adam_elements, learning_rate) {}
};

/// What mainstream data parallelism computes: each rank's own mean gradient, averaged over the
/// ranks with equal weight whatever their token counts.
demo::char_mlp<double> mean_of_rank_means(accumulator local, const parameters& params) {
  accumulator rank_means(float_dtype::f32, 1.0);
  if (local.state().total_weight > 0 && local.non_finite().empty()) {
    const demo::char_mlp<float> own_mean =
        model_gradients<float>(local.finish_mean(params).gradients, demo::model_shape{});
    rank_means.accumulate_mean(params, views_of(own_mean), 1.0);
  }
  const auto averaged = gradaccum::allreduce_mean(params, rank_means.finish_sums(), MPI_COMM_WORLD);
  return model_gradients<double>(averaged.gradients, demo::model_shape{});
}

/// Whether every rank holds bit-identical parameters: the same FNV-1a hash of their bytes.
bool ranks_hold_same_model(const demo::char_mlp<float>& model) {
  std::uint64_t hash = 14695981039346656037ULL;
  demo::for_each_tensor(model, [&](std::string_view, const demo::matrix<float>& t) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(t.data());
    for (std::size_t i = 0; i < sizeof(float) * static_cast<std::size_t>(t.size()); ++i) {
      hash = (hash ^ bytes[i]) * 1099511628211ULL;
    }
  });
  std::uint64_t range[2] = {hash, ~hash};  // max of the hash and of its complement: max and min
  MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  return range[0] == ~range[1];
}

int run(int argc, char** argv, const rank_info& me) {
  const std::size_t steps = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 20;
  std::vector<std::string> words = demo::read_words(word_file(argc, argv));
  const demo::model_shape shape{};
  std::mt19937_64 rng(seed);
  const demo::char_mlp<float> initial = demo::init_model(shape, rng);  // the same on every rank
  demo::window_stream stream(std::move(words), {3, 17, 40, 9}, context, seed);
  const parameters params = parameter_set_of(initial);
  const demo::flat_layout layout(params);
  const auto rank = static_cast<std::size_t>(me.rank);
  const auto ranks = static_cast<std::size_t>(me.size);
  const std::size_t poisoned = ranks - 1;  // the last rank's first microbatch

  training_run full(initial, layout, layout.elements());
  training_run sharded(initial, layout, gradaccum::shard_of(layout.elements(), rank, ranks).size);
  training_run single(initial, layout, layout.elements());  // rank 0 only
  double worst_match = 0;
  double worst_naive = 0;
  bool sharded_equal = true;
  for (std::size_t step = 1; step <= steps; ++step) {
    const demo::window w = stream.next();
    const bool overflow = step == overflow_step;

    // Full: every rank gets the whole mean and updates every parameter.
    accumulator local = accumulate_window(full.model, params, w, rank, ranks, full.scaler.scale(), overflow, poisoned);
    const auto naive = mean_of_rank_means(local, params);
    auto my_tokens = static_cast<unsigned long>(local.state().total_weight);
    auto mean = gradaccum::allreduce_mean(params, local.finish_sums(), MPI_COMM_WORLD);
    const demo::char_mlp<float> reduced = model_gradients<float>(mean.gradients, shape);  // before clipping
    const double norm = gradaccum::clip_by_global_norm(mean, max_norm);
    if (full.scaler.update(!std::isfinite(norm))) {
      full.adam.step(full.flat, mean.gradients);
    } else {
      full.skipped.push_back(step);
    }

    // Sharded: each rank gets its shard, updates its parameters, then shares them.
    accumulator mine =
        accumulate_window(sharded.model, params, w, rank, ranks, sharded.scaler.scale(), overflow, poisoned);
    auto shard = gradaccum::reduce_scatter_mean(params, mine.finish_sums(), MPI_COMM_WORLD);
    const double shard_norm = gradaccum::clip_by_global_norm(shard, max_norm, MPI_COMM_WORLD);
    if (sharded.scaler.update(shard.found_non_finite() || !std::isfinite(shard_norm))) {
      const gradaccum::shard_range& range = shard.range();
      sharded.adam.step(std::span(sharded.flat).subspan(range.begin, range.stored), shard);
      gradaccum::allgather_shards(shard, std::span(sharded.flat), MPI_COMM_WORLD);
    } else {
      sharded.skipped.push_back(step);
    }
    sharded_equal = sharded_equal && sharded.flat == full.flat &&
                    (std::bit_cast<std::uint64_t>(shard_norm) == std::bit_cast<std::uint64_t>(norm));

    std::vector<unsigned long> tokens_per_rank(ranks);
    MPI_Gather(&my_tokens, 1, MPI_UNSIGNED_LONG, tokens_per_rank.data(), 1, MPI_UNSIGNED_LONG, 0, MPI_COMM_WORLD);
    if (me.rank == 0) {
      std::string split;
      for (const unsigned long t : tokens_per_rank) split += (split.empty() ? "" : " + ") + std::to_string(t);
      if (overflow) {
        std::printf("step %3zu  tokens %s = %.0f  overflow (an infinity on rank %zu): skipped, loss scale now %g\n",
                    step, split.c_str(), mean.state.total_weight, poisoned, full.scaler.scale());
      } else {
        const auto reference =
            model_gradients<double>(accumulate_window(full.model, params, w, 0, 1, mean.state.loss_scale, false, 0)
                                        .finish_mean(params)
                                        .gradients,
                                    shape);
        const double match = relative_error(reduced.cast<double>(), reference);
        const double off = relative_error(naive, reference);
        worst_match = std::max(worst_match, match);
        worst_naive = std::max(worst_naive, off);
        std::printf(
            "step %3zu  tokens %s = %.0f  |data-parallel - single| / |single| = %.1e   mean of rank means: %.1e  "
            "norm %.3f\n",
            step, split.c_str(), mean.state.total_weight, match, off, norm);
      }
      // The single-process run: the whole window, the same step.
      auto alone = accumulate_window(single.model, params, w, 0, 1, single.scaler.scale(), overflow, poisoned)
                       .finish_mean(params);
      if (single.scaler.update(!std::isfinite(gradaccum::clip_by_global_norm(alone, max_norm)))) {
        single.adam.step(single.flat, alone.gradients);
      } else {
        single.skipped.push_back(step);
      }
      demo::write_back(single.flat, layout, single.model);
    }
    demo::write_back(full.flat, layout, full.model);
    demo::write_back(sharded.flat, layout, sharded.model);
  }

  const bool same_model = ranks_hold_same_model(full.model) && ranks_hold_same_model(sharded.model);
  int all_equal = sharded_equal ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &all_equal, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (me.rank != 0) return 0;
  const std::vector<std::size_t> expected_skips{overflow_step};
  const bool skipped_together =
      steps < overflow_step ||
      (full.skipped == expected_skips && sharded.skipped == expected_skips && single.skipped == expected_skips);
  const bool match = worst_match < match_below;
  // Promised bit for bit where reduce-scatter and allreduce form the same sums: on 1 and 2 ranks.
  const bool sharded_ok = all_equal == 1 || me.size > 2;
  double parameter_difference = 0;
  double parameter_norm = 0;
  for (std::size_t i = 0; i < full.flat.size(); ++i) {
    parameter_difference += std::pow(static_cast<double>(full.flat[i]) - single.flat[i], 2);
    parameter_norm += std::pow(static_cast<double>(single.flat[i]), 2);
  }
  std::printf(
      "\n%d ranks, %zu steps: data-parallel gradients %s the single-process run (worst relative difference "
      "%.1e, float rounding; averaging per-rank means is off by up to %.1e)\n",
      me.size, steps, match ? "match" : "DO NOT match", worst_match, worst_naive);
  std::printf("every rank holds the same parameters: %s\n", same_model ? "yes, bit for bit" : "NO");
  std::printf(
      "sharded run (reduce_scatter_mean, Adam on %zu of %zu elements per rank, allgather_shards) equals the "
      "full run: %s\n",
      gradaccum::shard_of(layout.elements(), 0, ranks).size, layout.elements(),
      all_equal == 1
          ? "yes, bit for bit"
          : (me.size > 2 ? "no (not promised on more than 2 ranks; shard_reduction::same_as_allreduce promises it)"
                         : "NO"));
  std::printf("parameters vs the single-process run: relative difference %.1e (float sums in another order)\n",
              std::sqrt(parameter_difference / parameter_norm));
  std::printf("overflow at step %zu skipped by every rank in every run: %s\n", overflow_step,
              skipped_together ? "yes" : "NO");
  return match && same_model && sharded_ok && skipped_together ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  rank_info me;
  MPI_Comm_rank(MPI_COMM_WORLD, &me.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &me.size);
  int status = 1;
  try {
    status = run(argc, argv, me);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", me.rank, e.what());
  }
  MPI_Allreduce(MPI_IN_PLACE, &status, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return status;
}
