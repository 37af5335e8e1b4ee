/// @file
/// @brief 10,000 parameters of 64 floats through one whole accumulate_sum call, against the
/// floor (one fused loop over a single flat buffer of the same values), a per-tensor hand loop
/// (the floor plus one call per tensor, no lookups) and libtorch's per-tensor add_.

#include <vector>

#include "bench_common.hpp"
#include "bench_peers.hpp"

namespace ga_bench {
namespace {

void hand_flat(benchmark::State& state, many_small_case c) {
  const std::size_t n = c.count * c.elements;
  float* acc = pool().work<float>(n);
  const float* g = pool().gradient<float>(n);
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      hand_accumulate_sum<float, float>(acc, g, n);
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = static_cast<double>(n * 3 * sizeof(float));
}

/// Separate allocations per tensor, as in a model; same arithmetic as hand_flat.
void hand_per_tensor(benchmark::State& state, many_small_case c) {
  std::vector<raw_buffer> storage;
  std::vector<std::pair<float*, const float*>> tensors;
  const float* source = pool().gradient<float>(c.count * c.elements);
  for (std::size_t i = 0; i < c.count; ++i) {
    storage.push_back(allocate_pages_small(c.elements * sizeof(float)));
    auto* acc = static_cast<float*>(storage.back().get());
    storage.push_back(allocate_pages_small(c.elements * sizeof(float)));
    auto* g = static_cast<float*>(storage.back().get());
    std::memcpy(g, source + i * c.elements, c.elements * sizeof(float));
    tensors.emplace_back(acc, g);
  }
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      for (const auto& [acc, g] : tensors) hand_accumulate_sum<float, float>(acc, g, c.elements);
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = static_cast<double>(c.count * c.elements * 3 * sizeof(float));
}

}  // namespace
}  // namespace ga_bench

int main(int argc, char** argv) {
  return ga_bench::run(argc, argv, [] {
    ga_bench::init_peers();
    const ga_bench::many_small_case c;
    ga_bench::add(c.name() + "/hand", c.bytes(), [c](benchmark::State& s) { ga_bench::hand_flat(s, c); });
    ga_bench::add(c.name() + "/hand_per_tensor", c.bytes(),
                  [c](benchmark::State& s) { ga_bench::hand_per_tensor(s, c); });
    ga_bench::register_torch_many_small(c);
    ga_bench::register_ours_many_small(c);
    ga_bench::register_ours_torch_many_small(c);
  });
}
