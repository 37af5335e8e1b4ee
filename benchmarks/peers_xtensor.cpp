/// @file
/// @brief Native xtensor peers: `noalias(acc) += w * cast<W>(g)` (the fast form) and the
/// plain `acc += ...` (which evaluates into a temporary first; small sizes only).

#include "bench_peers.hpp"

#ifdef GRADACCUM_BENCH_HAVE_XTENSOR

#include <Eigen/Core>  // Eigen::half / bfloat16 conversions for the 16-bit inputs

#include <array>
#include <bit>

#if __has_include(<xtensor/xadapt.hpp>)
#include <xtensor/xadapt.hpp>
#include <xtensor/xnoalias.hpp>
#include <xtensor/xtensor.hpp>
#include <xtensor/xvectorize.hpp>
#else  // xtensor >= 0.26 moved its headers into subfolders
#include <xtensor/containers/xadapt.hpp>
#include <xtensor/containers/xtensor.hpp>
#include <xtensor/core/xnoalias.hpp>
#include <xtensor/core/xvectorize.hpp>
#endif

namespace ga_bench {
namespace {

/// Widens one stored element with the conversion a user has at hand: a plain cast for float
/// and double; for 16-bit values (which xtensor has no type for: gradaccum's xtensor backend
/// stores them as bit patterns) Eigen's half / bfloat16 conversion of the bits.
template <class W, class In>
W widen(storage_t<In> x) noexcept {
  if constexpr (std::is_same_v<In, f16_bits>) {
    return static_cast<W>(static_cast<float>(std::bit_cast<Eigen::half>(x)));
  } else if constexpr (std::is_same_v<In, bf16_bits>) {
    return static_cast<W>(static_cast<float>(std::bit_cast<Eigen::bfloat16>(x)));
  } else {
    return static_cast<W>(x);
  }
}

template <class W, class In, bool NoAlias>
void native(benchmark::State& state, accumulate_case c) {
  using S = storage_t<In>;
  const std::size_t n = c.elements();
  const std::array<std::size_t, 1> shape{n};
  auto acc = xt::adapt(pool().work<W>(n), n, xt::no_ownership(), shape);
  const auto g = xt::adapt(pool().gradient<In>(n), n, xt::no_ownership(), shape);
  const auto w = opaque(static_cast<W>(mean_weight));  // a runtime weight, as in gradaccum
  // 16-bit: xt::cast cannot convert bit patterns, so the conversion goes in a vectorized
  // lambda. (xt::cast over Eigen::bfloat16 elements would not even compile under -Wpedantic:
  // xtensor 0.24 promotes `float + bfloat16`, which ISO C++ finds ambiguous.)
  const auto widened = xt::vectorize([](S x) { return widen<W, In>(x); });
  constexpr bool sixteen = sizeof(S) == 2;
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      if constexpr (sixteen && NoAlias) {
        if (c.mean) {
          xt::noalias(acc) += w * widened(g);
        } else {
          xt::noalias(acc) += widened(g);
        }
      } else if constexpr (sixteen) {
        if (c.mean) {
          acc += w * widened(g);
        } else {
          acc += widened(g);
        }
      } else if constexpr (NoAlias) {
        if (c.mean) {
          xt::noalias(acc) += w * xt::cast<W>(g);
        } else {
          xt::noalias(acc) += xt::cast<W>(g);
        }
      } else {
        if (c.mean) {
          acc += w * xt::cast<W>(g);
        } else {
          acc += xt::cast<W>(g);
        }
      }
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = accumulate_bytes<W, In>(n);
}

}  // namespace

void register_xtensor_native(const accumulate_case& c) {
  c.visit([&]<class W, class In>() {
    add(c.name() + "/xtensor_noalias", c.bytes, [c](benchmark::State& s) { native<W, In, true>(s, c); });
    if (small_size(c.bytes)) {
      add(c.name() + "/xtensor_plain", c.bytes, [c](benchmark::State& s) { native<W, In, false>(s, c); });
    }
  });
}

}  // namespace ga_bench

#else

namespace ga_bench {
void register_xtensor_native(const accumulate_case&) {}
}  // namespace ga_bench

#endif
