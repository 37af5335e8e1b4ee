/// @file
/// @brief Strided inputs — a block of a larger matrix and a transpose — through gradaccum's
/// accumulate_mean (read in place through their strides into row-major sums), against the
/// native expression of each library on the same input: Eigen's
/// `acc.noalias() += s * g.cast<float>()` and xtensor's `noalias(acc) += s * xt::cast<float>(g)`,
/// with `acc` row-major, the layout of gradaccum's sums. The gradients are bound to the
/// parameter set, as a training loop keeps them, so a call pays no id lookup.

#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>

#include "bench_common.hpp"

#ifdef GRADACCUM_BENCH_OURS_XTENSOR
#if __has_include(<xtensor/containers/xarray.hpp>)
#include <xtensor/containers/xarray.hpp>
#include <xtensor/core/xmath.hpp>
#include <xtensor/core/xnoalias.hpp>
#include <xtensor/misc/xmanipulation.hpp>
#include <xtensor/views/xview.hpp>
#else
#include <xtensor/xarray.hpp>
#include <xtensor/xmanipulation.hpp>
#include <xtensor/xmath.hpp>
#include <xtensor/xnoalias.hpp>
#include <xtensor/xview.hpp>
#endif
#include <gradaccum/backends/xtensor.hpp>
#endif

namespace ga_bench {
namespace {

using row_major = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// An n x n gradient: a block of an (n + 8) x (n + 8) column-major matrix, or the transpose of
/// an n x n one.
enum class input { block, transpose };

/// n of the n x n gradient whose sums are the case's argument, in bytes.
std::size_t side_of(const benchmark::State& state) {
  return static_cast<std::size_t>(std::lround(std::sqrt(static_cast<double>(state.range(0)) / 4.0)));
}

Eigen::MatrixXf source(input kind, Eigen::Index n) {
  const Eigen::Index m = kind == input::block ? n + 8 : n;
  return Eigen::MatrixXf::Constant(m, m, 0.5F);
}

template <class F>
void with_eigen_input(input kind, const Eigen::MatrixXf& big, Eigen::Index n, F&& f) {
  if (kind == input::block) {
    f(big.block(3, 5, n, n));
  } else {
    f(big.transpose());
  }
}

/// gradaccum's row on backend B: the gradient that `with_input` hands its callback is added as
/// parameter "w" and inserted as its gradient, then accumulated as a mean once per iteration,
/// after a first call that lays out the window's buffer.
template <class B, class WithInput>
void ours(benchmark::State& state, WithInput&& with_input) {
  const std::size_t n = side_of(state);
  gradaccum::parameter_set<B> params;
  gradaccum::gradients_params<B> grads(params);  // bound: ids resolved once, at insert
  with_input([&](const auto& g) {
    params.add("w", g);
    grads.insert("w", g);
  });
  gradaccum::weighted_gradients_accumulator<B> window(gradaccum::float_dtype::f32, 1.0);
  const double weight = opaque(mean_weight);
  window.accumulate_mean(params, grads, weight);
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      window.accumulate_mean(params, grads, weight);
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = static_cast<double>(3 * n * n * 4);
}

void eigen_ours(benchmark::State& state, input kind) {
  const auto n = static_cast<Eigen::Index>(side_of(state));
  const Eigen::MatrixXf big = source(kind, n);
  ours<gradaccum::eigen_backend>(state, [&](const auto& bind) { with_eigen_input(kind, big, n, bind); });
}

void eigen_native(benchmark::State& state, input kind) {
  const auto n = static_cast<Eigen::Index>(side_of(state));
  const Eigen::MatrixXf big = source(kind, n);
  row_major acc = row_major::Zero(n, n);
  const auto s = opaque(static_cast<float>(mean_weight));
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      with_eigen_input(kind, big, n, [&](const auto& g) { acc.noalias() += s * g.template cast<float>(); });
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = static_cast<double>(3 * n * n * 4);
}

#ifdef GRADACCUM_BENCH_OURS_XTENSOR
/// The same inputs in xtensor: a block (xt::view) of a row-major (n + 8) x (n + 8) array, whose
/// rows are strided, or xt::transpose of an n x n one.
xt::xarray<float> xsource(input kind, std::size_t n) {
  const std::size_t m = kind == input::block ? n + 8 : n;
  return xt::xarray<float>(std::vector<std::size_t>{m, m}, 0.5F);
}

template <class F>
void with_xtensor_input(input kind, const xt::xarray<float>& big, std::size_t n, F&& f) {
  if (kind == input::block) {
    f(xt::view(big, xt::range(3, 3 + n), xt::range(5, 5 + n)));
  } else {
    f(xt::transpose(big));
  }
}

void xtensor_ours(benchmark::State& state, input kind) {
  const auto n = side_of(state);
  const xt::xarray<float> big = xsource(kind, n);
  ours<gradaccum::xtensor_backend>(state, [&](const auto& bind) { with_xtensor_input(kind, big, n, bind); });
}

void xtensor_noalias(benchmark::State& state, input kind) {
  const auto n = side_of(state);
  const xt::xarray<float> big = xsource(kind, n);
  xt::xarray<float> acc(std::vector<std::size_t>{n, n}, 0.0F);
  const auto s = opaque(static_cast<float>(mean_weight));
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      with_xtensor_input(kind, big, n, [&](auto&& g) { xt::noalias(acc) += s * xt::cast<float>(g); });
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = static_cast<double>(3 * n * n * 4);
}
#endif

/// n x n floats, n = 128, 512, 2048: 64 KiB, 1 MiB, 16 MiB of sums, the case's argument (the
/// suite names cases by bytes; `--ga_max_bytes` skips the larger ones).
void sizes(benchmark::internal::Benchmark* b) {
  for (const long n : {128L, 512L, 2048L}) {
    if (size_enabled(static_cast<std::size_t>(n * n * 4))) b->Arg(n * n * 4);
  }
  b->Unit(benchmark::kMicrosecond);
}

void register_cases() {
  for (const auto& [name, kind] : {std::pair{"block", input::block}, std::pair{"transpose", input::transpose}}) {
    const std::string prefix = std::string("input_") + name + "/";
    benchmark::RegisterBenchmark((prefix + "ours_eigen").c_str(), eigen_ours, kind)->Apply(sizes);
    benchmark::RegisterBenchmark((prefix + "eigen_native").c_str(), eigen_native, kind)->Apply(sizes);
#ifdef GRADACCUM_BENCH_OURS_XTENSOR
    benchmark::RegisterBenchmark((prefix + "ours_xtensor").c_str(), xtensor_ours, kind)->Apply(sizes);
    benchmark::RegisterBenchmark((prefix + "xtensor_noalias").c_str(), xtensor_noalias, kind)->Apply(sizes);
#endif
  }
}

}  // namespace
}  // namespace ga_bench

int main(int argc, char** argv) {
  return ga_bench::run(argc, argv, ga_bench::register_cases);
}
