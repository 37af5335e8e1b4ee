/// @file
/// @brief Accumulation of one parameter, every (work, incoming) dtype pair and size, side by
/// side: the hand-written fused loop (the limit), the native Eigen and xtensor expressions,
/// libtorch `add_` (when built with it) and gradaccum's accumulate_sum / accumulate_mean, with
/// gradaccum's kernel alone on the hand loop's buffers ("kernel": a call's fixed cost is the
/// difference).

#include <gradaccum/kernels.hpp>

#include "bench_common.hpp"
#include "bench_peers.hpp"

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define GA_BENCH_HAVE_F16C 1
#endif

namespace ga_bench {
namespace {

/// The hand loop, single-threaded or (Threaded, registered only for sizes where gradaccum
/// splits) on every OpenMP thread; or (Kernel) gradaccum's `kernels::add_scaled` in its place.
template <class W, class In, bool Threaded = false, bool Kernel = false>
void hand(benchmark::State& state, accumulate_case c) {
  const std::size_t n = c.elements();
  W* acc = pool().work<W>(n);
  const storage_t<In>* g = pool().gradient<In>(n);
  const auto w = opaque(static_cast<W>(mean_weight));  // a runtime weight, as in gradaccum
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      if constexpr (Kernel) {
        gradaccum::kernels::add_scaled(acc, g, n, c.mean ? w : W(1));
      } else if constexpr (Threaded) {
        if (c.mean) {
          hand_accumulate_mt<W, In>(acc, g, n, w);
        } else {
          hand_accumulate_sum_mt<W, In>(acc, g, n);
        }
      } else if (c.mean) {
        hand_accumulate<W, In>(acc, g, n, w);
      } else {
        hand_accumulate_sum<W, In>(acc, g, n);
      }
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = accumulate_bytes<W, In>(n);
  if constexpr (Threaded) state.counters["threads"] = openmp_threads();
}

#ifdef GA_BENCH_HAVE_F16C
/// F16 through the F16C conversion instruction (8 per vcvtph2ps): the hardware's limit for
/// F16 inputs, shown for information next to the bit-level `hand` loop (the target's reference).
[[gnu::noinline]] void hand_f16c_accumulate(float* __restrict acc, const std::uint16_t* __restrict g, std::size_t n,
                                            float scale) noexcept {
  const __m256 s = _mm256_set1_ps(scale);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 widened = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i)));
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_mul_ps(s, widened)));
  }
  for (; i < n; ++i) acc[i] += scale * _cvtsh_ss(g[i]);
}

void hand_f16c(benchmark::State& state, accumulate_case c) {
  const std::size_t n = c.elements();
  float* acc = pool().work<float>(n);
  const std::uint16_t* g = pool().gradient<f16_bits>(n);
  const float w = opaque(c.mean ? static_cast<float>(mean_weight) : 1.0F);
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      hand_f16c_accumulate(acc, g, n, w);
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = accumulate_bytes<float, f16_bits>(n);
}
#endif

void register_case(const accumulate_case& c) {
  const std::string base = c.name() + "/";
  c.visit([&]<class W, class In>() {
    add(base + "hand", c.bytes, [c](benchmark::State& s) { hand<W, In>(s, c); });
    if constexpr (std::is_same_v<W, In>) {
      if (c.bytes <= 256 * KiB)
        add(base + "kernel", c.bytes, [c](benchmark::State& s) { hand<W, In, false, true>(s, c); });
    }
#ifdef _OPENMP
    if (c.bytes >= 1 * MiB) add(base + "hand_mt", c.bytes, [c](benchmark::State& s) { hand<W, In, true>(s, c); });
#endif
#ifdef GA_BENCH_HAVE_F16C
    if constexpr (std::is_same_v<W, float> && std::is_same_v<In, f16_bits>) {
      add(base + "hand_f16c", c.bytes, [c](benchmark::State& s) { hand_f16c(s, c); });
    }
#endif
  });
  register_eigen_native(c);
  register_xtensor_native(c);
  register_torch_accumulate(c);
  register_ours_accumulate(c);
  register_ours_torch_accumulate(c);
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
