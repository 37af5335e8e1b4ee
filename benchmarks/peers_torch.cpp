/// @file
/// @brief libtorch peers: `torch` with every hardware thread in libtorch's intra-op pool,
/// `torch_1t` with one. The work happens in torch_shim.cpp (C++17).
///
/// libtorch's own default pool size is its count of *physical* cores, which on a VM can be 1
/// (then `torch` and `torch_1t` would be one case), so `torch` sets the hardware thread count
/// explicitly; the default is recorded in the context as `ga_torch_default_threads`. libtorch
/// and gradaccum share one OpenMP runtime, and libtorch's lazy start-up lowers the runtime's
/// thread count to its default: every case restores the hardware count afterwards, so
/// gradaccum's cases run with the pool they would have without libtorch in the process.

#include "bench_peers.hpp"

#ifdef GRADACCUM_BENCH_HAVE_TORCH

#include <string>
#include <thread>

#include "torch_shim.hpp"

namespace ga_bench {
namespace {

template <class T>
constexpr torch_shim::dtype shim_dtype() {
  if constexpr (std::is_same_v<T, float>) {
    return torch_shim::dtype::f32;
  } else if constexpr (std::is_same_v<T, double>) {
    return torch_shim::dtype::f64;
  } else if constexpr (std::is_same_v<T, f16_bits>) {
    return torch_shim::dtype::f16;
  } else {
    static_assert(std::is_same_v<T, bf16_bits>);
    return torch_shim::dtype::bf16;
  }
}

template <class W, class In>
void accumulate(benchmark::State& state, accumulate_case c, int threads) {
  const std::size_t n = c.elements();
  torch_shim::accumulate(state, pool().work<W>(n), shim_dtype<W>(), pool().gradient<In>(n), shim_dtype<In>(), n, c.mean,
                         mean_weight, threads, opts().torch_threads);
  state.counters["bytes"] = accumulate_bytes<W, In>(n);
  state.counters["threads"] = threads;
}

void many_small(benchmark::State& state, many_small_case c, int threads) {
  torch_shim::many_small(state, pool().gradient<float>(c.count * c.elements), c.count, c.elements, threads,
                         opts().torch_threads);
  state.counters["bytes"] = static_cast<double>(c.count * c.elements * 3 * sizeof(float));
  state.counters["threads"] = threads;
}

}  // namespace

void init_peers() {
  const int libtorch_default = torch_shim::default_threads();
  opts().torch_threads = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
  torch_shim::set_threads(opts().torch_threads);
  benchmark::AddCustomContext("ga_torch_default_threads", std::to_string(libtorch_default));
}

void register_torch_accumulate(const accumulate_case& c) {
  c.visit([&]<class W, class In>() {
    add(c.name() + "/torch", c.bytes, [c](benchmark::State& s) { accumulate<W, In>(s, c, opts().torch_threads); });
    add(c.name() + "/torch_1t", c.bytes, [c](benchmark::State& s) { accumulate<W, In>(s, c, 1); });
  });
}

void register_torch_many_small(const many_small_case& c) {
  add(c.name() + "/torch", c.bytes(), [c](benchmark::State& s) { many_small(s, c, opts().torch_threads); });
  add(c.name() + "/torch_1t", c.bytes(), [c](benchmark::State& s) { many_small(s, c, 1); });
}

}  // namespace ga_bench

#else

namespace ga_bench {
void init_peers() {}
void register_torch_accumulate(const accumulate_case&) {}
void register_torch_many_small(const many_small_case&) {}
}  // namespace ga_bench

#endif
