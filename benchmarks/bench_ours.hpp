#pragma once
/// @file
/// @brief What gradaccum's own cases share over every backend: ours.cpp, and ours_torch.cpp
/// (its own translation unit, for libtorch's headers).

#include <gradaccum/gradaccum.hpp>

#include "bench_common.hpp"

namespace ga_bench {

/// Drives one accumulator through `accumulate_sum` (weight 1) or `accumulate_mean`
/// (weight `mean_weight`): the total weight grows by at most 3 per call, far from the F32 limit.
template <class B, class G>
void accumulate_loop(benchmark::State& state, const accumulate_case& c, const gradaccum::parameter_set<B>& params,
                     const G& grads, gradaccum::float_dtype work) {
  gradaccum::weighted_gradients_accumulator<B> acc(work, 1.0);
  const auto step = [&] {
    if (c.mean) {
      acc.accumulate_mean(params, grads, mean_weight);
    } else {
      acc.accumulate_sum(params, grads, 1.0);
    }
  };
  step();  // creates the pending buffer
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      step();
      benchmark::ClobberMemory();
    }
  }
}

}  // namespace ga_bench
