/// @file
/// @brief libtorch peers (C++17, see torch_shim.hpp): `acc.add_(g, alpha)` on tensors that wrap
/// the shared buffers (from_blob, no copy). With a dtype change (F32 into F64, 16-bit into F32)
/// add_ goes through libtorch's type promotion.

#include "torch_shim.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

namespace ga_bench::torch_shim {
namespace {

at::ScalarType scalar_type(dtype d) {
  switch (d) {
    case dtype::f32: return at::kFloat;
    case dtype::f64: return at::kDouble;
    case dtype::f16: return at::kHalf;
    case dtype::bf16: return at::kBFloat16;
  }
  return at::kFloat;
}

at::Tensor wrap(const void* data, std::size_t n, dtype d) {
  // from_blob never writes through the tensors we only read from.
  return at::from_blob(const_cast<void*>(data), {static_cast<std::int64_t>(n)},
                       at::TensorOptions().dtype(scalar_type(d)));
}

/// Sets libtorch's thread count for one case and restores it afterwards: libtorch and gradaccum
/// share one OpenMP runtime, so a leaked setting would change later cases.
class thread_scope {
 public:
  thread_scope(int threads, int restore) : restore_(restore) { at::set_num_threads(threads); }
  thread_scope(const thread_scope&) = delete;
  thread_scope& operator=(const thread_scope&) = delete;
  ~thread_scope() { at::set_num_threads(restore_); }

 private:
  int restore_;
};

template <class Body>
void timed(benchmark::State& state, Body&& body) {
  const std::uint64_t before = allocations();
  for (auto _ : state) {
    body();
    benchmark::ClobberMemory();
  }
  const auto iterations = static_cast<double>(state.iterations() > 0 ? state.iterations() : 1);
  state.counters["allocs/iter"] = benchmark::Counter(static_cast<double>(allocations() - before) / iterations);
}

}  // namespace

int default_threads() {
  return at::get_num_threads();
}
void set_threads(int threads) {
  at::set_num_threads(threads);
}

void accumulate(benchmark::State& state, void* acc, dtype acc_type, const void* g, dtype g_type, std::size_t n,
                bool scaled, double alpha, int threads, int restore_threads) {
  const thread_scope scope(threads, restore_threads);
  at::Tensor acc_tensor = wrap(acc, n, acc_type);
  const at::Tensor g_tensor = wrap(g, n, g_type);
  if (scaled) {
    timed(state, [&] { acc_tensor.add_(g_tensor, alpha); });
  } else {
    timed(state, [&] { acc_tensor.add_(g_tensor); });
  }
}

void many_small(benchmark::State& state, const float* source, std::size_t count, std::size_t elements, int threads,
                int restore_threads) {
  const thread_scope scope(threads, restore_threads);
  const auto n = static_cast<std::int64_t>(elements);
  std::vector<at::Tensor> acc;
  std::vector<at::Tensor> grads;
  acc.reserve(count);
  grads.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    acc.push_back(at::zeros({n}, at::kFloat));
    grads.push_back(wrap(source + i * elements, elements, dtype::f32).clone());  // separate storage each
  }
  timed(state, [&] {
    for (std::size_t i = 0; i < count; ++i) acc[i].add_(grads[i]);
  });
}

}  // namespace ga_bench::torch_shim
