/// @file
/// @brief `gradaccum::allreduce_mean` against a raw `MPI_Allreduce` of one contiguous buffer of
/// the same bytes, for one large tensor and for 10,000 small ones. Run it under MPI (the targets
/// are for 2 local ranks):
///
///     mpirun -np 2 build/benchmarks/bench_mpi [--benchmark_* flags]
///
/// Every rank runs every case in lockstep (fixed iteration and repetition counts, so the ranks
/// never disagree on how often to call a collective), and only rank 0 prints. One run of a case
/// takes as long as its slowest rank; an iteration's time is the fastest of `samples` runs. On a
/// shared machine a rank that other load deschedules stalls its peer for one or more scheduler
/// ticks (4 ms, ten times the small case), so a median over runs would measure the machine's
/// load, not the reduction. The fastest run is the undisturbed time, and every peer is measured
/// alike. Cases are
/// named `<case>/<peer>/<bytes>` like the rest of the suite: `allreduce/<tensors>x<elements>/
/// {mpi_raw, mpi_raw_start, mpi_rsb_ag, mpi_raw_rs, mpi_per_tensor, ours_eigen, ours_eigen_start,
/// ours_eigen_sharded, ours_eigen_sharded_same}/<bytes>`; `ours_eigen_sharded` is
/// `reduce_scatter_mean`, which leaves each rank its shard (counter `result_bytes`: what the
/// result holds per rank), and `mpi_raw_rs` its floor, one raw `MPI_Reduce_scatter`;
/// `ours_eigen_sharded_same` is `reduce_scatter_mean` with `shard_reduction::same_as_allreduce`
/// (the shard cut from `allreduce_mean`'s collectives).
/// After the table, rank 0 prints the ratio of our median time to the raw MPI_Allreduce's
/// (targets: 1.05 for the large tensor, 1.15 for the small ones) and of the non-blocking variant
/// to a raw MPI_Iallreduce's; `benchmarks/report --only mpi` prints the same with ranges.
///
/// What "ours" does on top of the raw sum: the agreement (one small collective here) and the
/// normalization `(x / s) / w` of every value (s = 1024, a power of two, costs a multiplication;
/// w = 2000 tokens, a division). `mpi_rsb_ag` is the other way to get the same result from MPI:
/// `MPI_Reduce_scatter_block`, normalize this rank's 1/N, `MPI_Allgather`.

#include <benchmark/benchmark.h>

#include <mpi.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>
#include <gradaccum/mpi.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

/// `tensors` tensors of `rows` × `cols` floats; each iteration is timed as the fastest of
/// `samples` runs.
struct layout {
  std::size_t tensors;
  Eigen::Index rows;
  Eigen::Index cols;
  int iterations;
  std::size_t samples;

  [[nodiscard]] std::size_t elements() const noexcept { return tensors * static_cast<std::size_t>(rows * cols); }
  [[nodiscard]] std::size_t bytes() const noexcept { return elements() * sizeof(float); }
  [[nodiscard]] std::string name() const {
    return "allreduce/" + std::to_string(tensors) + "x" + std::to_string(rows * cols);
  }
};

const std::vector<layout>& layouts() {
  static const std::vector<layout> all{
      {1, 4096, 4096, 2, 5},  // 64 MiB in one tensor
      {10000, 8, 8, 4, 15},   // 10,000 tensors of 64 floats (2.4 MiB)
  };
  return all;
}

constexpr int repetitions = 5;
constexpr float loss_scale = 1024.0F;
constexpr double tokens_per_rank = 1000.0;
constexpr float total_weight = 2 * tokens_per_rank;  // over 2 ranks, as the targets assume

/// `body()` on every rank at once, in seconds: as long as its slowest rank.
template <class Body>
double time_on_all_ranks(Body&& body) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double start = MPI_Wtime();
  body();
  double elapsed = MPI_Wtime() - start;
  MPI_Allreduce(MPI_IN_PLACE, &elapsed, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return elapsed;
}

/// Runs `prepare()` untimed, then `body()` on every rank at once; an iteration takes as long
/// as the fastest run (the same on every rank). Returns the fastest run of all.
template <class Prepare, class Body>
double timed_loop(benchmark::State& state, const layout& shape, Prepare&& prepare, Body&& body) {
  std::vector<double> runs(shape.samples);
  double fastest = 1e300;
  for (auto _ : state) {
    for (double& elapsed : runs) {
      prepare();
      elapsed = time_on_all_ranks(body);
    }
    const double iteration = *std::min_element(runs.begin(), runs.end());
    state.SetIterationTime(iteration);
    fastest = std::min(fastest, iteration);
  }
  state.counters["bytes"] = static_cast<double>(shape.bytes());
  return fastest;
}

/// A raw in-place `MPI_Allreduce` of the very buffer `allreduce_mean` is about to reduce, in the
/// state it is about to reduce it in: before each of our runs the window is accumulated, this
/// times MPI alone on its buffer, and the window is accumulated again into the same (recycled)
/// buffer for our run. Counter `vs_mpi_raw` is the fastest of ours over the fastest of these. A
/// buffer of its own, however warm, is not the same peer: the time of a collective depends on
/// what the process did to its memory just before (the accumulation's 10,000 gradients pass
/// through the caches first), and that difference would show up as our cost.
class paired_raw {
 public:
  template <class B>
  void run(gradaccum::accumulated_gradients<B>& sums) {
    const std::span<float> values = sums.gradients.template flat<float>();
    fastest_ = std::min(fastest_, time_on_all_ranks([&] {
                          MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_FLOAT,
                                        MPI_SUM, MPI_COMM_WORLD);
                        }));
  }
  [[nodiscard]] double fastest() const noexcept { return fastest_; }

 private:
  double fastest_ = 1e300;
};

/// The floor: one in-place `MPI_Allreduce` of every value, already contiguous.
void mpi_raw(benchmark::State& state, const layout& shape) {
  std::vector<float> values(shape.elements());
  timed_loop(
      state, shape, [&] { std::fill(values.begin(), values.end(), 1.0F); },
      [&] {
        MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      });
}

/// The floor of any mean: one in-place `MPI_Allreduce` of every value, then the hand
/// normalization `(x / s) / w` of every value with the library's bits at the least cost: the
/// loss scale is a power of two, so `x / s` is `x` times its exact reciprocal; `w` (2,000) is a
/// division. What MPI leaves in cache decides this pass's cost (see `paired_raw`).
void mpi_raw_mean(benchmark::State& state, const layout& shape) {
  std::vector<float> values(shape.elements());
  const volatile float hidden_w = total_weight;  // a divisor known at run time only, as the library's
  const float w = hidden_w;
  constexpr float s_reciprocal = 1.0F / loss_scale;
  static_assert(s_reciprocal * loss_scale == 1.0F, "the loss scale is a power of two");
  timed_loop(
      state, shape, [&] { std::fill(values.begin(), values.end(), 1.0F); },
      [&] {
        MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (float& x : values) x = x * s_reciprocal / w;
      });
}

/// The non-blocking floor, for `ours_eigen_start`: `MPI_Iallreduce`, then `MPI_Wait`.
void mpi_raw_start(benchmark::State& state, const layout& shape) {
  std::vector<float> values(shape.elements());
  timed_loop(
      state, shape, [&] { std::fill(values.begin(), values.end(), 1.0F); },
      [&] {
        MPI_Request request = MPI_REQUEST_NULL;
        MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD,
                       &request);
        MPI_Wait(&request, MPI_STATUS_IGNORE);
      });
}

/// The unbucketed loop over parameters: one in-place `MPI_Allreduce` per tensor (no packing, a
/// collective's latency per tensor).
void mpi_per_tensor(benchmark::State& state, const layout& shape) {
  std::vector<Eigen::MatrixXf> tensors(shape.tensors, Eigen::MatrixXf::Constant(shape.rows, shape.cols, 1.0F));
  timed_loop(
      state, shape,
      [&] {
        for (auto& t : tensors) t.setConstant(1.0F);
      },
      [&] {
        for (auto& t : tensors) {
          MPI_Allreduce(MPI_IN_PLACE, t.data(), static_cast<int>(t.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        }
      });
}

/// The alternative collective: `MPI_Reduce_scatter_block` into a kept buffer of 1/N of the
/// values, their normalization there, `MPI_Allgather` back (each rank divides only its share).
void mpi_rsb_ag(benchmark::State& state, const layout& shape) {
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const std::size_t share = (shape.elements() + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
  std::vector<float> values(share * static_cast<std::size_t>(ranks));
  std::vector<float> mine(share);
  timed_loop(
      state, shape, [&] { std::fill(values.begin(), values.end(), 1.0F); },
      [&] {
        const int count = static_cast<int>(share);
        MPI_Reduce_scatter_block(values.data(), mine.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (float& x : mine) x = x / loss_scale / total_weight;
        MPI_Allgather(mine.data(), count, MPI_FLOAT, values.data(), count, MPI_FLOAT, MPI_COMM_WORLD);
      });
}

/// The sharded floor, for `ours_eigen_sharded`: one `MPI_Reduce_scatter` of every value with the
/// counts `reduce_scatter_mean` uses (shards of whole 1,024-element blocks).
void mpi_raw_rs(benchmark::State& state, const layout& shape) {
  int ranks = 1;
  int rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const auto n = static_cast<std::size_t>(ranks);
  std::vector<float> values(shape.elements());
  std::vector<float> mine(gradaccum::shard_of(values.size(), static_cast<std::size_t>(rank), n).size);
  std::vector<int> counts(n);
  for (std::size_t r = 0; r < n; ++r) counts[r] = static_cast<int>(gradaccum::shard_of(values.size(), r, n).stored);
  timed_loop(
      state, shape, [&] { std::fill(values.begin(), values.end(), 1.0F); },
      [&] { MPI_Reduce_scatter(values.data(), mine.data(), counts.data(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); });
}

enum class call { blocking, start_then_wait, sharded, sharded_same_as_allreduce };

/// `allreduce_mean` (or `start_allreduce_mean` + `wait`, or `reduce_scatter_mean`) of every rank's sums:
/// `shape.tensors` present parameters, one microbatch of `tokens_per_rank` tokens per rank. The sums are accumulated
/// untimed, into the buffer of the result before (dropped untimed too), so the timed region touches no fresh memory.
template <class B>
void ours(benchmark::State& state, const layout& shape, call how) {
  gradaccum::parameter_set<B> params;
  gradaccum::gradients_params<B> gradients;
  for (std::size_t i = 0; i < shape.tensors; ++i) {
    const std::string id = "layer" + std::to_string(i) + ".weight";
    typename B::template tensor<float> values = B::template tensor<float>::Constant(shape.rows, shape.cols, 1.0F);
    params.add(id, values);
    gradients.insert(id, std::move(values));
  }
  gradaccum::weighted_gradients_accumulator<B> window(gradaccum::float_dtype::f32, loss_scale);
  gradaccum::accumulated_gradients<B> sums;
  gradaccum::accumulated_gradients<B> mean;
  gradaccum::sharded_gradients<B> shard;
  paired_raw raw;
  const double fastest = timed_loop(
      state, shape,
      [&] {
        mean = {};
        shard = {};
        window.accumulate_sum(params, gradients, tokens_per_rank);
        sums = window.finish_sums();
        if (how == call::blocking) {
          raw.run(sums);
          sums = {};  // back to the accumulator, which reuses it for the window ours reduces
          window.accumulate_sum(params, gradients, tokens_per_rank);
          sums = window.finish_sums();
        }
      },
      [&] {
        if (how == call::blocking) {
          mean = gradaccum::allreduce_mean(params, std::move(sums), MPI_COMM_WORLD);
        } else if (how == call::start_then_wait) {
          auto request = gradaccum::start_allreduce_mean(params, std::move(sums), MPI_COMM_WORLD);
          mean = request.wait();
        } else if (how == call::sharded) {
          shard = gradaccum::reduce_scatter_mean(params, std::move(sums), MPI_COMM_WORLD);
        } else {
          shard = gradaccum::reduce_scatter_mean(params, std::move(sums), MPI_COMM_WORLD,
                                                 gradaccum::shard_reduction::same_as_allreduce);
        }
      });
  if (how == call::blocking) state.counters["vs_mpi_raw"] = fastest / raw.fastest();
  state.counters["result_bytes"] = static_cast<double>(how == call::sharded || how == call::sharded_same_as_allreduce
                                                           ? shard.range().size * sizeof(float)
                                                           : mean.gradients.template flat<float>().size_bytes());
}

/// Google Benchmark's console table, plus each peer's median time over the raw MPI_Allreduce's.
class ratio_reporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type == Run::RT_Aggregate && run.aggregate_name == "median") {
        medians_[run.run_name.function_name] = run.GetAdjustedRealTime();
        const auto paired = run.counters.find("vs_mpi_raw");
        if (paired != run.counters.end()) paired_[run.run_name.function_name] = paired->second.value;
      }
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf(
        "\nmedian time / peer's median time (targets: ours_eigen <= 1.05 x mpi_raw for 1x16777216, <= 1.15 x "
        "for 10000x64)\n");
    for (const layout& shape : layouts()) {
      std::string bytes = "/";  // appended: GCC 12 at -O3 reports a false -Wrestrict in `"/" + string&&`
      bytes += std::to_string(shape.bytes());
      for (const auto& [ours, peer] :
           {std::pair{"ours_eigen", "mpi_raw"}, std::pair{"ours_eigen", "mpi_raw_mean"},
            std::pair{"ours_eigen_start", "mpi_raw_start"}, std::pair{"ours_eigen_start", "mpi_raw"},
            std::pair{"mpi_rsb_ag", "mpi_raw"}, std::pair{"ours_eigen_sharded", "mpi_raw_rs"},
            std::pair{"ours_eigen_sharded", "ours_eigen"}, std::pair{"ours_eigen_sharded_same", "ours_eigen"},
            std::pair{"mpi_raw_rs", "mpi_raw"}}) {
        const auto mine = medians_.find(shape.name() + "/" + ours + bytes);
        const auto theirs = medians_.find(shape.name() + "/" + peer + bytes);
        if (mine == medians_.end() || theirs == medians_.end()) continue;
        std::printf("  %-22s %-16s / %-14s %6.2fx  (%.3f ms vs %.3f ms)\n", shape.name().c_str(), ours, peer,
                    mine->second / theirs->second, mine->second, theirs->second);
      }
    }
    std::printf(
        "\nours_eigen / a raw MPI_Allreduce of the same window buffer, timed right before each of its runs "
        "(counter vs_mpi_raw, median)\n");
    for (const auto& [name, ratio] : paired_) std::printf("  %-48s %6.2fx\n", name.c_str(), ratio);
  }

 private:
  std::map<std::string, double> medians_;  // function name → median real time (ms)
  std::map<std::string, double> paired_;   // function name → median of its vs_mpi_raw counter
};

/// Prints nothing: ranks other than 0 run every case but report none.
class silent_reporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context& /*context*/) override { return true; }
  void ReportRuns(const std::vector<Run>& /*runs*/) override {}
};

void register_cases() {
  for (const layout& shape : layouts()) {
    const auto add = [&](std::string_view peer, auto&& fn) {
      benchmark::RegisterBenchmark(
          (shape.name() + "/" + std::string(peer) + "/" + std::to_string(shape.bytes())).c_str(),
          [&shape, fn](benchmark::State& state) { fn(state, shape); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(shape.iterations)
          ->Repetitions(repetitions)
          ->DisplayAggregatesOnly(true);
    };
    add("mpi_raw", mpi_raw);
    add("mpi_raw_mean", mpi_raw_mean);
    add("mpi_raw_start", mpi_raw_start);
    add("mpi_rsb_ag", mpi_rsb_ag);
    add("mpi_raw_rs", mpi_raw_rs);
    if (shape.tensors > 1) add("mpi_per_tensor", mpi_per_tensor);
    add("ours_eigen",
        [](benchmark::State& state, const layout& s) { ours<gradaccum::eigen_backend>(state, s, call::blocking); });
    add("ours_eigen_start", [](benchmark::State& state, const layout& s) {
      ours<gradaccum::eigen_backend>(state, s, call::start_then_wait);
    });
    add("ours_eigen_sharded",
        [](benchmark::State& state, const layout& s) { ours<gradaccum::eigen_backend>(state, s, call::sharded); });
    add("ours_eigen_sharded_same", [](benchmark::State& state, const layout& s) {
      ours<gradaccum::eigen_backend>(state, s, call::sharded_same_as_allreduce);
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // Only rank 0 writes --benchmark_out files; the others drop the flag.
  if (rank != 0) {
    argc = static_cast<int>(
        std::remove_if(argv + 1, argv + argc,
                       [](const char* arg) { return std::string_view(arg).starts_with("--benchmark_out"); }) -
        argv);
  }
  benchmark::Initialize(&argc, argv);
  register_cases();
  if (rank == 0) {
    ratio_reporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
  } else {
    silent_reporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
  }
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
