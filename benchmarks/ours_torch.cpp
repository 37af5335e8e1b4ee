/// @file
/// @brief gradaccum's own cases over `torch_backend` ("ours_torch"), through the public API and
/// the helpers a libtorch user calls; compared in the report with the `torch` peer (`add_` per
/// tensor, torch_shim.cpp). Built with g++ only: libtorch's headers do not compile as C++20
/// with clang 14 (see backends/torch/meson.build).

#include <gradaccum/backends/torch.hpp>
#include <gradaccum/gradaccum.hpp>

#include <cstdint>
#include <string>
#include <type_traits>

#include "bench_ours.hpp"
#include "bench_peers.hpp"

namespace ga_bench {
namespace {

template <class In>
at::ScalarType scalar_type_of() {
  if constexpr (std::is_same_v<In, f16_bits>) {
    return at::kHalf;
  } else if constexpr (std::is_same_v<In, bf16_bits>) {
    return at::kBFloat16;
  } else {
    return c10::CppTypeToScalarType<In>::value;
  }
}

/// The shared gradient buffer as a torch tensor (from_blob: no copy), as the peer reads it.
template <class In>
at::Tensor gradient_tensor(std::size_t n) {
  return at::from_blob(const_cast<storage_t<In>*>(pool().gradient<In>(n)), {static_cast<std::int64_t>(n)},
                       at::TensorOptions().dtype(scalar_type_of<In>()));
}

template <class W, class In>
void accumulate(benchmark::State& state, accumulate_case c) {
  const std::size_t n = c.elements();
  const at::Tensor g = gradient_tensor<In>(n);
  gradaccum::parameter_set<gradaccum::torch_backend> params;
  params.add("w", g);
  gradaccum::gradients_params<gradaccum::torch_backend> grads;
  grads.insert("w", g);
  accumulate_loop(state, c, params, grads, gradaccum::dtype_of<W>);
  state.counters["bytes"] = accumulate_bytes<W, In>(n);
}

/// `count` parameters of `elements` floats, each with its own .grad(), as a module holds them;
/// `rebuild`: torch_gradients(named) before every call, as a training loop does after backward.
void many_small(benchmark::State& state, many_small_case c, bool rebuild) {
  torch::OrderedDict<std::string, at::Tensor> named;
  const at::Tensor source = gradient_tensor<float>(c.count * c.elements);
  const auto elements = static_cast<std::int64_t>(c.elements);
  for (std::size_t i = 0; i < c.count; ++i) {
    at::Tensor p = at::zeros({elements}).requires_grad_();
    p.mutable_grad() = source.narrow(0, static_cast<std::int64_t>(i) * elements, elements).clone();
    named.insert("blocks." + std::to_string(i) + ".mlp.weight", p);
  }
  const auto params = gradaccum::torch_parameters(named);
  auto grads = gradaccum::torch_gradients(named);
  gradaccum::weighted_gradients_accumulator<gradaccum::torch_backend> acc(gradaccum::float_dtype::f32, 1.0);
  acc.accumulate_sum(params, grads, 1.0);
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      if (rebuild) grads = gradaccum::torch_gradients(named);
      acc.accumulate_sum(params, grads, 1.0);
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = static_cast<double>(c.count * c.elements * 3 * sizeof(float));
}

}  // namespace

void register_ours_torch_accumulate(const accumulate_case& c) {
  c.visit([&]<class W, class In>() {
    add(c.name() + "/ours_torch", c.bytes, [c](benchmark::State& s) { accumulate<W, In>(s, c); });
  });
}

void register_ours_torch_many_small(const many_small_case& c) {
  add(c.name() + "/ours_torch", c.bytes(), [c](benchmark::State& s) { many_small(s, c, false); });
  add(c.name() + "/ours_torch_rebuild", c.bytes(), [c](benchmark::State& s) { many_small(s, c, true); });
}

}  // namespace ga_bench
