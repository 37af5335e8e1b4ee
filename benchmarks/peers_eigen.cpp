/// @file
/// @brief Native Eigen peers: what an Eigen user writes without gradaccum.

#include "bench_eigen.hpp"
#include "bench_peers.hpp"

namespace ga_bench {
namespace {

/// `acc.noalias() += w * g.cast<W>()` on Maps of the shared buffers (16-bit through Eigen's
/// own half / bfloat16 conversion).
template <class W, class In>
void native(benchmark::State& state, accumulate_case c) {
  using E = eigen_element_t<In>;
  const std::size_t n = c.elements();
  const auto size = static_cast<Eigen::Index>(n);
  Eigen::Map<Eigen::Matrix<W, Eigen::Dynamic, 1>> acc(pool().work<W>(n), size);
  Eigen::Map<const Eigen::Matrix<E, Eigen::Dynamic, 1>> g(as_eigen<In>(pool().gradient<In>(n)), size);
  const auto w = opaque(static_cast<W>(mean_weight));  // a runtime weight, as in gradaccum
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      if (c.mean) {
        acc.noalias() += w * g.template cast<W>();
      } else {
        acc.noalias() += g.template cast<W>();
      }
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = accumulate_bytes<W, In>(n);
}

/// `x = (x / s) / t` as an Eigen array expression, on a pending tensor refilled (untimed)
/// before each pass.
template <class W>
void native_finish(benchmark::State& state, std::size_t bytes) {
  const std::size_t n = bytes / sizeof(W);
  const auto size = static_cast<Eigen::Index>(n);
  const W* source = pool().gradient<W>(n);
  W* scratch = pool().scratch<W>(n);
  Eigen::Map<Eigen::Array<W, Eigen::Dynamic, 1>> x(scratch, size);
  // Runtime values, as in gradaccum: a known power-of-two divisor would let the compiler
  // multiply by its (exact) reciprocal instead.
  const auto scale = opaque(static_cast<W>(finish_loss_scale));
  const auto total = opaque(static_cast<W>(finish_total_weight));
  manual_loop(
      state, [&] { std::memcpy(scratch, source, n * sizeof(W)); }, [&] { x = x / scale / total; });
  state.counters["bytes"] = 2.0 * static_cast<double>(bytes);
}

}  // namespace

void register_eigen_native_finish(bool f64, std::size_t bytes) {
  const std::string name = std::string(f64 ? "finish_mean/f64" : "finish_mean/f32") + "/eigen_native";
  if (f64) {
    add_manual(name, bytes, [bytes](benchmark::State& s) { native_finish<double>(s, bytes); });
  } else {
    add_manual(name, bytes, [bytes](benchmark::State& s) { native_finish<float>(s, bytes); });
  }
}

void register_eigen_native(const accumulate_case& c) {
  c.visit([&]<class W, class In>() {
    if constexpr (std::is_same_v<W, double> && (std::is_same_v<In, f16_bits> || std::is_same_v<In, bf16_bits>)) {
      return;  // not a suite pair, and Eigen has no direct half -> double cast
    } else {
      add(c.name() + "/eigen_native", c.bytes, [c](benchmark::State& s) { native<W, In>(s, c); });
    }
  });
}

}  // namespace ga_bench
