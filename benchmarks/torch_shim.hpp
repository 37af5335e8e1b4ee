#pragma once
/// @file
/// @brief The libtorch peers behind a small C++17 interface.
///
/// libtorch 1.13's headers do not compile as C++20 with clang 14 and libstdc++ 12 (vectors of
/// the incomplete `c10::IValue`), so torch_shim.cpp is built as C++17 and sees nothing of the
/// C++20 benchmark code; peers_torch.cpp registers the cases through this header.

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>

namespace ga_bench::torch_shim {

enum class dtype { f32, f64, f16, bf16 };

/// libtorch's own default intra-op thread count. Starting libtorch this way lowers the shared
/// OpenMP runtime's thread count to it: call `set_threads` afterwards.
int default_threads();
void set_threads(int threads);

/// `acc.add_(g)` (or `acc.add_(g, alpha)` when `scaled`) on tensors wrapping `acc` and `g`, every
/// iteration of `state`, with `threads` intra-op threads (restored to `restore_threads` after).
/// Sets the `allocs/iter` counter.
void accumulate(benchmark::State& state, void* acc, dtype acc_type, const void* g, dtype g_type, std::size_t n,
                bool scaled, double alpha, int threads, int restore_threads);

/// `count` accumulators of `elements` floats, each `acc[i].add_(g[i])` per iteration, the
/// gradients copied from `source` into separate tensors first.
void many_small(benchmark::State& state, const float* source, std::size_t count, std::size_t elements, int threads,
                int restore_threads);

}  // namespace ga_bench::torch_shim

namespace ga_bench {
std::uint64_t allocations() noexcept;  // alloc_counter.cpp
}  // namespace ga_bench
