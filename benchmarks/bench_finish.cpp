/// @file
/// @brief finish_mean against a hand-written in-place `x = (x / s) / t` loop (two divisions,
/// as the contract requires; a reciprocal multiply would round differently). Every case
/// refills its pending values untimed before each timed pass, so all of them divide data that
/// was just written (in cache for the small sizes).

#include <cstring>

#include "bench_common.hpp"
#include "bench_peers.hpp"

namespace ga_bench {
namespace {

const std::size_t finish_sizes[] = {4 * KiB, 256 * KiB, 4 * MiB, 64 * MiB};

template <class W>
void hand(benchmark::State& state, std::size_t bytes) {
  const std::size_t n = bytes / sizeof(W);
  const W* source = pool().gradient<W>(n);
  W* x = pool().scratch<W>(n);
  const auto scale = opaque(static_cast<W>(finish_loss_scale));
  const auto total = opaque(static_cast<W>(finish_total_weight));
  manual_loop(
      state, [&] { std::memcpy(x, source, n * sizeof(W)); }, [&] { hand_divide<W>(x, n, scale, total); });
  state.counters["bytes"] = 2.0 * static_cast<double>(bytes);
}

}  // namespace
}  // namespace ga_bench

int main(int argc, char** argv) {
  return ga_bench::run(argc, argv, [] {
    for (const bool f64 : {false, true}) {
      for (const std::size_t bytes : ga_bench::finish_sizes) {
        if (!ga_bench::size_enabled(bytes)) continue;
        const std::string name = std::string(f64 ? "finish_mean/f64" : "finish_mean/f32") + "/hand";
        if (f64) {
          ga_bench::add_manual(name, bytes, [bytes](benchmark::State& s) { ga_bench::hand<double>(s, bytes); });
        } else {
          ga_bench::add_manual(name, bytes, [bytes](benchmark::State& s) { ga_bench::hand<float>(s, bytes); });
        }
        ga_bench::register_eigen_native_finish(f64, bytes);
        ga_bench::register_ours_finish(f64, bytes);
      }
    }
  });
}
