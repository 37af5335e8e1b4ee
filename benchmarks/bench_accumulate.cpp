/// @file
/// @brief Accumulation of one parameter, every (work, incoming) dtype pair and size, side by
/// side: the hand-written fused loop (the limit), the native Eigen and xtensor expressions,
/// libtorch `add_` (when built with it) and gradaccum's accumulate_sum / accumulate_mean.

#include "bench_common.hpp"
#include "bench_peers.hpp"

namespace ga_bench {
namespace {

template <class W, class In>
void hand(benchmark::State& state, accumulate_case c) {
  const std::size_t n = c.elements();
  W* acc = pool().work<W>(n);
  const storage_t<In>* g = pool().gradient<In>(n);
  const auto w = opaque(static_cast<W>(mean_weight));  // a runtime weight, as in gradaccum
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      if (c.mean) {
        hand_accumulate<W, In>(acc, g, n, w);
      } else {
        hand_accumulate_sum<W, In>(acc, g, n);
      }
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = accumulate_bytes<W, In>(n);
}

/// The hand loop on every OpenMP thread; registered only for sizes where gradaccum splits.
template <class W, class In>
void hand_mt(benchmark::State& state, accumulate_case c) {
  const std::size_t n = c.elements();
  W* acc = pool().work<W>(n);
  const storage_t<In>* g = pool().gradient<In>(n);
  const auto w = opaque(static_cast<W>(mean_weight));  // a runtime weight, as in gradaccum
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      if (c.mean) {
        hand_accumulate_mt<W, In>(acc, g, n, w);
      } else {
        hand_accumulate_sum_mt<W, In>(acc, g, n);
      }
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = accumulate_bytes<W, In>(n);
  state.counters["threads"] = openmp_threads();
}

void register_case(const accumulate_case& c) {
  const std::string base = c.name() + "/";
  c.visit([&]<class W, class In>() {
    add(base + "hand", c.bytes, [c](benchmark::State& s) { hand<W, In>(s, c); });
#ifdef _OPENMP
    if (c.bytes >= 1 * MiB) add(base + "hand_mt", c.bytes, [c](benchmark::State& s) { hand_mt<W, In>(s, c); });
#endif
  });
  register_eigen_native(c);
  register_xtensor_native(c);
  register_torch_accumulate(c);
  register_ours_accumulate(c);
}

}  // namespace
}  // namespace ga_bench

int main(int argc, char** argv) {
  using ga_bench::accumulate_case;
  using dt = accumulate_case::dtype;
  return ga_bench::run(argc, argv, [] {
    ga_bench::init_peers();
    const std::pair<dt, dt> pairs[] = {
        {dt::f32, dt::f32}, {dt::f64, dt::f32}, {dt::f64, dt::f64}, {dt::f32, dt::f16}, {dt::f32, dt::bf16}};
    for (const bool mean : {false, true}) {
      for (const auto& [work, incoming] : pairs) {
        for (const std::size_t bytes : ga_bench::accumulate_sizes()) {
          if (!ga_bench::size_enabled(bytes)) continue;
          ga_bench::register_case(accumulate_case{mean, work, incoming, bytes});
        }
      }
    }
  });
}
