// mpi_data_parallel: trains the demo's character-level model data-parallel over the ranks of
// MPI_COMM_WORLD and checks, every step, that the reduced gradient is the one a single process
// gets from the whole window.
//
//   mpirun -np 2 ./mpi_data_parallel [steps] [word-file]
//
// Every rank reads the same words and builds the same windows of unequal microbatches; rank r
// computes microbatches r, r + size, ..., so ranks see different numbers of tokens. Each rank
// accumulates the gradients of its loss SUM (scaled by a fixed loss scale) weighted by their token
// counts; gradaccum::allreduce_mean sums values and weights over the ranks and normalizes once.
// Rank 0 also accumulates the whole window alone (the single-process run) and prints how far
// apart the two are, next to what averaging the ranks' own mean gradients would give.

#include "demo/model.hpp"
#include "demo/text_data.hpp"

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>
#include <gradaccum/mpi.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <random>
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
constexpr double loss_scale = 1024;
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
/// window, or all of it (first 0, every 1) for the single-process run.
accumulator accumulate_window(const demo::char_mlp<float>& model, const parameters& params, const demo::window& w,
                              std::size_t first, std::size_t every) {
  accumulator window(float_dtype::f32, loss_scale);
  demo::char_mlp<float> g = demo::char_mlp<float>::zeros(demo::model_shape{});
  for (std::size_t i = first; i < w.microbatches.size(); i += every) {
    const demo::token_batch& mb = w.microbatches[i];
    demo::loss_and_gradients(model, mb, static_cast<float>(loss_scale), g);  // of the scaled loss SUM
    window.accumulate_sum(params, views_of(g), static_cast<double>(mb.tokens()));
  }
  return window;
}

/// What mainstream data parallelism computes: each rank's own mean gradient, averaged over the
/// ranks with equal weight whatever their token counts.
demo::char_mlp<double> mean_of_rank_means(accumulator local, const parameters& params) {
  accumulator rank_means(float_dtype::f32, 1.0);
  if (local.state().total_weight > 0) {
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
  demo::char_mlp<float> model = demo::init_model(shape, rng);  // the same on every rank
  demo::window_stream stream(std::move(words), {3, 17, 40, 9}, context, seed);
  demo::adam optimizer(shape, learning_rate);
  const parameters params = parameter_set_of(model);

  double worst_match = 0;
  double worst_naive = 0;
  for (std::size_t step = 1; step <= steps; ++step) {
    const demo::window w = stream.next();
    accumulator local =
        accumulate_window(model, params, w, static_cast<std::size_t>(me.rank), static_cast<std::size_t>(me.size));
    const auto naive = mean_of_rank_means(local, params);
    auto my_tokens = static_cast<unsigned long>(local.state().total_weight);
    const auto mean = gradaccum::allreduce_mean(params, local.finish_sums(), MPI_COMM_WORLD);
    const auto data_parallel = model_gradients<float>(mean.gradients, shape);

    std::vector<unsigned long> tokens_per_rank(static_cast<std::size_t>(me.size));
    MPI_Gather(&my_tokens, 1, MPI_UNSIGNED_LONG, tokens_per_rank.data(), 1, MPI_UNSIGNED_LONG, 0, MPI_COMM_WORLD);
    if (me.rank == 0) {
      const auto reference =
          model_gradients<double>(accumulate_window(model, params, w, 0, 1).finish_mean(params).gradients, shape);
      const double match = relative_error(data_parallel.cast<double>(), reference);
      const double off = relative_error(naive, reference);
      worst_match = std::max(worst_match, match);
      worst_naive = std::max(worst_naive, off);
      std::string split;
      for (const unsigned long t : tokens_per_rank) split += (split.empty() ? "" : " + ") + std::to_string(t);
      std::printf(
          "step %3zu  tokens %s = %.0f  |data-parallel - single| / |single| = %.1e   mean of rank means: %.1e\n", step,
          split.c_str(), mean.state.total_weight, match, off);
    }
    optimizer.step(model, data_parallel);
  }

  const bool same_model = ranks_hold_same_model(model);
  if (me.rank != 0) return 0;
  const bool match = worst_match < match_below;
  std::printf(
      "\n%d ranks, %zu steps: data-parallel gradients %s the single-process run (worst relative difference "
      "%.1e, float rounding; averaging per-rank means is off by up to %.1e)\n",
      me.size, steps, match ? "match" : "DO NOT match", worst_match, worst_naive);
  std::printf("every rank holds the same parameters: %s\n", same_model ? "yes, bit for bit" : "NO");
  return match && same_model ? 0 : 1;
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
