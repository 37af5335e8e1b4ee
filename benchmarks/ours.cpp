/// @file
/// @brief gradaccum's own cases ("ours_<backend>"), through the public API only.
///
/// Accumulation cases reuse one accumulator for every iteration, so after the first call the
/// window holds a pending tensor and a call costs what a training step pays per microbatch.
/// Incoming gradients are views of the shared buffers (no copy), in a gradients container bound
/// to the parameter set (ids resolved once, at insert), as a training loop keeps them; the
/// "_buffer" cases hold them in a `gradient_buffer` the backward pass writes into; the
/// many-small cases also show the unbound container, which resolves every id on every call.

#include "bench_ours.hpp"
#include "bench_peers.hpp"

// GRADACCUM_BENCH_OURS_EIGEN / _XTENSOR come from meson.build: the backend's dependency was found.
#ifdef GRADACCUM_BENCH_OURS_EIGEN
#include <Eigen/Core>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>
#endif

#ifdef GRADACCUM_BENCH_OURS_XTENSOR
#include <gradaccum/backends/xtensor.hpp>
#include <gradaccum/gradaccum.hpp>
#endif

#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace ga_bench {
namespace {

std::string param_name(std::size_t i) {
  return "blocks." + std::to_string(i) + ".mlp.weight";
}

/// What the generic cases need from a backend: the element type of a benchmark dtype (for the
/// 16-bit ones, the backend's 2-byte type F16 or BF16 of the same bits) and the shape of a vector
/// of n elements ([n, 1] where vectors are columns, as in Eigen; else [n]).
template <class F16, class BF16, bool column_vectors>
struct backend_facts {
  template <class In>
  using element = element_t<In, F16, BF16>;
  static gradaccum::tensor_shape vector(std::size_t n) {
    return column_vectors ? gradaccum::tensor_shape{n, 1} : gradaccum::tensor_shape{n};
  }
};

/// Each backend's row name, with its `backend_facts`.
template <class B>
struct backend_of;

#ifdef GRADACCUM_BENCH_OURS_EIGEN
template <>
struct backend_of<gradaccum::eigen_backend> : backend_facts<Eigen::half, Eigen::bfloat16, true> {
  static constexpr const char* name = "ours_eigen";
};
#endif

#ifdef GRADACCUM_BENCH_OURS_XTENSOR
/// xtensor has no 16-bit float type; the backend stores them as bit patterns.
template <>
struct backend_of<gradaccum::xtensor_backend> : backend_facts<gradaccum::f16_bits, gradaccum::bf16_bits, false> {
  static constexpr const char* name = "ours_xtensor";
};
#endif

/// A read-only view of n contiguous elements, in place (both backends' views are
/// `gradaccum::strided_view`s).
template <class B, class T>
auto view_of(const T* p, std::size_t n) {
  return typename B::template view<T>(p, backend_of<B>::vector(n));
}

/// The shared buffers as elements of B (16-bit: the same bits, another 2-byte type).
template <class B, class In>
auto elements_of(const storage_t<In>* p) {
  using E = typename backend_of<B>::template element<In>;
  static_assert(sizeof(E) == sizeof(storage_t<In>) && std::is_trivially_copyable_v<E>);
  return reinterpret_cast<const E*>(p);
}

template <class B, class W, class In>
void accumulate_case_body(benchmark::State& state, accumulate_case c) {
  const std::size_t n = c.elements();
  const auto* g = elements_of<B, In>(pool().gradient<In>(n));
  gradaccum::parameter_set<B> params;
  params.add("w", view_of<B>(g, n));
  gradaccum::gradients_params<B> grads(params);
  grads.insert("w", view_of<B>(g, n));
  accumulate_loop(state, c, params, grads, gradaccum::dtype_of<W>);
  state.counters["bytes"] = accumulate_bytes<W, In>(n);
  state.counters["threads"] = openmp_threads();  // the pool gradaccum may split large tensors over
}

/// The same gradient in a `gradient_buffer` laid out for the parameter set, as a backward pass
/// that writes into it leaves it: the call adds the buffer in one pass, resolving nothing.
template <class B, class W, class In>
void accumulate_buffer_body(benchmark::State& state, accumulate_case c) {
  using E = typename backend_of<B>::template element<In>;
  const std::size_t n = c.elements();
  const auto* g = elements_of<B, In>(pool().gradient<In>(n));
  gradaccum::parameter_set<B> params;
  params.add("w", view_of<B>(g, n));
  gradaccum::gradient_buffer<B, E> buffer(params);
  const std::span<E> segment = buffer.values("w");
  std::memcpy(segment.data(), g, segment.size_bytes());
  accumulate_loop(state, c, params, buffer, gradaccum::dtype_of<W>);
  state.counters["bytes"] = accumulate_bytes<W, In>(n);
  state.counters["threads"] = openmp_threads();
}

/// `count` parameters of `elements` floats, each gradient its own allocation, viewed in place;
/// the gradients container bound to the parameter set (ids resolved at insert) or not.
template <class B>
struct small_model {
  gradaccum::parameter_set<B> params;
  std::vector<raw_buffer> storage;
  gradaccum::gradients_params<B> grads;
  std::size_t elements;

  small_model(const many_small_case& c, bool bound)
      : grads(bound ? gradaccum::gradients_params<B>(params) : gradaccum::gradients_params<B>()), elements(c.elements) {
    const float* source = pool().gradient<float>(c.count * c.elements);
    storage.reserve(c.count);
    for (std::size_t i = 0; i < c.count; ++i) {
      storage.push_back(allocate_pages_small(c.elements * sizeof(float)));
      std::memcpy(storage.back().get(), source + i * c.elements, c.elements * sizeof(float));
      params.add(param_name(i), view_of<B>(data(i), elements));
    }
    insert_all();
  }
  [[nodiscard]] const float* data(std::size_t i) const { return static_cast<const float*>(storage[i].get()); }
  void insert_all() {
    for (std::size_t i = 0; i < storage.size(); ++i)
      grads.insert_or_assign(params[i].id, view_of<B>(data(i), elements));
  }
};

/// What happens to the gradients_params before each call: nothing (its views read buffers the
/// backward pass rewrites in place), every gradient inserted again under its id (values
/// replaced, ids kept), or cleared and refilled (a training loop that builds one per microbatch).
enum class refill { none, reinsert, rebuild };

template <class B>
void many_small_body(benchmark::State& state, many_small_case c, refill before_call, bool bound = false) {
  small_model<B> model(c, bound);
  gradaccum::weighted_gradients_accumulator<B> acc(gradaccum::float_dtype::f32, 1.0);
  acc.accumulate_sum(model.params, model.grads, 1.0);
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      if (before_call == refill::rebuild) model.grads.clear();
      if (before_call != refill::none) model.insert_all();
      acc.accumulate_sum(model.params, model.grads, 1.0);
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = static_cast<double>(c.count * c.elements * 3 * sizeof(float));
  // Pending memory: one F32 copy of the parameters' elements plus the segments' padding.
  state.counters["pending_bytes"] = static_cast<double>(acc.pending().layout()->elements() * sizeof(float));
  state.counters["parameter_bytes"] = static_cast<double>(c.count * c.elements * sizeof(float));
}

/// The same model with its gradients in a `gradient_buffer`, as a backward pass writing into it
/// (DDP's gradient-as-bucket-view) leaves them: every parameter present, one pass per call.
template <class B>
void many_small_buffer_body(benchmark::State& state, many_small_case c) {
  small_model<B> model(c, false);
  gradaccum::gradient_buffer<B> buffer(model.params);
  for (std::size_t i = 0; i < c.count; ++i) {
    const std::span<float> segment = buffer.values(i);
    std::memcpy(segment.data(), model.data(i), segment.size_bytes());
  }
  gradaccum::weighted_gradients_accumulator<B> acc(gradaccum::float_dtype::f32, 1.0);
  acc.accumulate_sum(model.params, buffer, 1.0);
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      acc.accumulate_sum(model.params, buffer, 1.0);
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = static_cast<double>(c.count * c.elements * 3 * sizeof(float));
}

template <class B, class W>
void finish_body(benchmark::State& state, std::size_t bytes) {
  const std::size_t n = bytes / sizeof(W);
  const W* g = pool().gradient<W>(n);
  gradaccum::parameter_set<B> params;
  params.add("w", view_of<B>(g, n));
  gradaccum::gradients_params<B> grads;
  grads.insert("w", view_of<B>(g, n));
  gradaccum::weighted_gradients_accumulator<B> acc(gradaccum::dtype_of<W>, finish_loss_scale);
  std::optional<gradaccum::accumulated_gradients<B>> result;
  // pending = g with total weight 3; the result is freed outside the timed part.
  manual_loop(
      state,
      [&] {
        result.reset();
        acc.accumulate_sum(params, grads, finish_total_weight);
      },
      [&] { result.emplace(acc.finish_mean(params)); });
  state.counters["bytes"] = 2.0 * static_cast<double>(bytes);
  state.counters["threads"] = openmp_threads();
}

/// Calls `f.template operator()<B>()` for every backend built in.
template <class F>
void for_each_backend(F&& f) {
#ifdef GRADACCUM_BENCH_OURS_EIGEN
  f.template operator()<gradaccum::eigen_backend>();
#endif
#ifdef GRADACCUM_BENCH_OURS_XTENSOR
  f.template operator()<gradaccum::xtensor_backend>();
#endif
  (void)f;
}

}  // namespace

void register_ours_accumulate(const accumulate_case& c) {
  for_each_backend([&]<class B>() {
    c.visit([&]<class W, class In>() {
      add(c.name() + "/" + backend_of<B>::name, c.bytes,
          [c](benchmark::State& s) { accumulate_case_body<B, W, In>(s, c); });
      add(c.name() + "/" + backend_of<B>::name + "_buffer", c.bytes,
          [c](benchmark::State& s) { accumulate_buffer_body<B, W, In>(s, c); });
    });
  });
}

void register_ours_many_small(const many_small_case& c) {
  for_each_backend([&]<class B>() {
    const std::string name = c.name() + "/" + backend_of<B>::name;
    add(name, c.bytes(), [c](benchmark::State& s) { many_small_body<B>(s, c, refill::none); });
    add(name + "_bound", c.bytes(), [c](benchmark::State& s) { many_small_body<B>(s, c, refill::none, true); });
    add(name + "_reinsert", c.bytes(), [c](benchmark::State& s) { many_small_body<B>(s, c, refill::reinsert); });
    add(name + "_rebuild", c.bytes(), [c](benchmark::State& s) { many_small_body<B>(s, c, refill::rebuild); });
    add(name + "_buffer", c.bytes(), [c](benchmark::State& s) { many_small_buffer_body<B>(s, c); });
  });
}

#ifndef GRADACCUM_BENCH_OURS_TORCH
void register_ours_torch_accumulate(const accumulate_case& /*c*/) {}
void register_ours_torch_many_small(const many_small_case& /*c*/) {}
#endif

void register_ours_finish(bool f64, std::size_t bytes) {
  for_each_backend([&]<class B>() {
    const std::string name = std::string(f64 ? "finish_mean/f64/" : "finish_mean/f32/") + backend_of<B>::name;
    if (f64) {
      add_manual(name, bytes, [bytes](benchmark::State& s) { finish_body<B, double>(s, bytes); });
    } else {
      add_manual(name, bytes, [bytes](benchmark::State& s) { finish_body<B, float>(s, bytes); });
    }
  });
}

}  // namespace ga_bench
