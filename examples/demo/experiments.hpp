// The measurements of the demo, each on one accumulation window: gradient
// exactness of the accumulation recipes, mixed-precision microbatch
// gradients, and resuming a window from a checkpoint file; and the whole
// training step after a window (clipping, dynamic loss scaling, Adam).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "model.hpp"
#include "text_data.hpp"
#include "training_step.hpp"

namespace demo {

using backend = gradaccum::eigen_backend;
using parameters = gradaccum::parameter_set<backend>;
using gradients = gradaccum::gradients_params<backend>;
using window_gradients = gradaccum::flat_gradients<backend>;

inline parameters parameter_set_of(const char_mlp<float>& model) {
  parameters params;
  for_each_tensor(model, [&](std::string_view name, const matrix<float>& w) { params.add(name, w); });
  return params;
}

// Views of the model's gradient buffers: the accumulator reads them in
// place, without a copy.
inline gradients views_of(const char_mlp<float>& grads) {
  gradients out;
  for_each_tensor(grads, [&](std::string_view name, const matrix<float>& g) {
    out.insert(name, Eigen::Map<const matrix<float>>(g.data(), g.rows(), g.cols()));
  });
  return out;
}

// Owned copies converted to element type T (Eigen::half, Eigen::bfloat16):
// what a mixed-precision backward pass would hand over.
template <typename T>
gradients converted_to(const char_mlp<float>& grads) {
  gradients out;
  for_each_tensor(grads,
                  [&](std::string_view name, const matrix<float>& g) { out.insert(name, matrix<T>(g.cast<T>())); });
  return out;
}

// Reads accumulated gradients (F32 or F64, per the work dtype) back into
// the model layout.
template <typename T>
char_mlp<T> model_gradients(const window_gradients& grads, const model_shape& shape) {
  char_mlp<T> out = char_mlp<T>::zeros(shape);
  for_each_tensor(out, [&](std::string_view name, matrix<T>& dst) {
    if (const auto g = grads.get<float>(name)) {
      dst = g->cast<T>();
    } else if (const auto g64 = grads.get<double>(name)) {
      dst = g64->cast<T>();
    } else {
      throw std::runtime_error("accumulated gradients lack '" + std::string(name) + "'");
    }
  });
  return out;
}

// All tensors of a model-shaped gradient as one vector, for global norms.
inline Eigen::VectorXd flatten(const char_mlp<double>& m) {
  Eigen::Index total = 0;
  for_each_tensor(m, [&](std::string_view, const matrix<double>& t) { total += t.size(); });
  Eigen::VectorXd flat(total);
  Eigen::Index at = 0;
  for_each_tensor(m, [&](std::string_view, const matrix<double>& t) {
    flat.segment(at, t.size()) = t.reshaped();
    at += t.size();
  });
  return flat;
}

// ||g - ref|| / ||ref|| over all parameters together.
inline double relative_error(const char_mlp<double>& g, const char_mlp<double>& ref) {
  const Eigen::VectorXd r = flatten(ref);
  return (flatten(g) - r).norm() / r.norm();
}

// Gradient of the mean loss over the whole window, computed in double: the
// reference every recipe is measured against.
inline char_mlp<double> reference_gradient(const char_mlp<float>& model, const window& w, const model_shape& shape) {
  const token_batch all = w.merged();
  char_mlp<double> g = char_mlp<double>::zeros(shape);
  loss_and_gradients(model.cast<double>(), all, 1.0 / static_cast<double>(all.tokens()), g);
  return g;
}

struct exactness_result {
  std::string label;
  std::vector<std::size_t> microbatch_tokens;
  double full_batch_f32 = 0;  // the F32 rounding floor
  double accumulate_mean = 0;
  double accumulate_sum = 0;
  double naive = 0;  // mean of per-microbatch mean-loss gradients
};

inline exactness_result measure_exactness(std::string label, const char_mlp<float>& model, const window& w,
                                          const model_shape& shape, gradaccum::float_dtype work_dtype) {
  const parameters params = parameter_set_of(model);
  const char_mlp<double> reference = reference_gradient(model, w, shape);
  exactness_result r;
  r.label = std::move(label);

  char_mlp<float> g = char_mlp<float>::zeros(shape);
  loss_and_gradients(model, w.merged(), 1.0f / static_cast<float>(w.tokens()), g);
  r.full_batch_f32 = relative_error(g.cast<double>(), reference);

  // Naive loops are the weighted window with weight 1 per microbatch.
  gradaccum::weighted_gradients_accumulator<backend> mean_acc(work_dtype, 1.0);
  gradaccum::weighted_gradients_accumulator<backend> sum_acc(work_dtype, 1.0);
  gradaccum::weighted_gradients_accumulator<backend> naive_acc(work_dtype, 1.0);
  for (const token_batch& mb : w.microbatches) {
    const auto tokens = static_cast<double>(mb.tokens());
    r.microbatch_tokens.push_back(mb.tokens());
    loss_and_gradients(model, mb, 1.0f / static_cast<float>(tokens), g);
    mean_acc.accumulate_mean(params, views_of(g), tokens);
    naive_acc.accumulate_mean(params, views_of(g), 1.0);
    loss_and_gradients(model, mb, 1.0f, g);
    sum_acc.accumulate_sum(params, views_of(g), tokens);
  }
  const auto error_of = [&](gradaccum::weighted_gradients_accumulator<backend>& acc) {
    return relative_error(model_gradients<double>(acc.finish_mean(params).gradients, shape), reference);
  };
  r.accumulate_mean = error_of(mean_acc);
  r.accumulate_sum = error_of(sum_acc);
  r.naive = error_of(naive_acc);
  return r;
}

// Accumulates the window from microbatch gradients of element type T (F16,
// BF16 or F32), computed for the loss multiplied by loss_scale, in an F32
// window; returns the relative error against the F64 reference.
template <typename T>
double mixed_precision_error(const char_mlp<float>& model, const window& w, const model_shape& shape, double loss_scale,
                             const char_mlp<double>& reference) {
  const parameters params = parameter_set_of(model);
  gradaccum::weighted_gradients_accumulator<backend> acc(gradaccum::float_dtype::f32, loss_scale);
  char_mlp<float> g = char_mlp<float>::zeros(shape);
  for (const token_batch& mb : w.microbatches) {
    const auto tokens = static_cast<double>(mb.tokens());
    loss_and_gradients(model, mb, static_cast<float>(loss_scale / tokens), g);
    acc.accumulate_mean(params, converted_to<T>(g), tokens);
  }
  return relative_error(model_gradients<double>(acc.finish_mean(params).gradients, shape), reference);
}

struct resume_result {
  std::filesystem::path checkpoint;
  std::uintmax_t checkpoint_bytes = 0;
  std::size_t split_after = 0;  // microbatches accumulated before the checkpoint
  std::size_t microbatches = 0;
  std::string mismatch;  // empty when bit-identical
};

// The first difference between two sets of accumulated gradients, or an
// empty string when they hold the same ids with the same bits.
inline std::string first_mismatch(const window_gradients& uninterrupted, const window_gradients& resumed) {
  if (uninterrupted.size() != resumed.size() || uninterrupted.dtype() != resumed.dtype()) {
    return "different parameter counts or dtypes";
  }
  for (const auto& entry : uninterrupted) {
    const std::string id(entry.id);
    const auto same = [&]<class W>() {
      const std::span<const W> a = uninterrupted.values<W>(id);
      const std::span<const W> b = resumed.values<W>(id);
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
    };
    const bool equal = uninterrupted.dtype() == gradaccum::float_dtype::f64 ? same.template operator()<double>()
                                                                            : same.template operator()<float>();
    if (!equal || !resumed.contains(id)) {
      return "'" + id + "' differs";
    }
  }
  return {};
}

// Accumulates the window twice: once straight through, once checkpointed to
// a file after half of the microbatches, with the accumulator destroyed and
// a fresh one restored from the file to finish.
inline resume_result check_resume(const char_mlp<float>& model, const window& w, const model_shape& shape,
                                  gradaccum::float_dtype work_dtype, const std::filesystem::path& checkpoint) {
  const parameters params = parameter_set_of(model);
  std::vector<char_mlp<float>> microbatch_grads;
  for (const token_batch& mb : w.microbatches) {
    microbatch_grads.push_back(char_mlp<float>::zeros(shape));
    loss_and_gradients(model, mb, 1.0f / static_cast<float>(mb.tokens()), microbatch_grads.back());
  }
  const auto accumulate = [&](gradaccum::weighted_gradients_accumulator<backend>& acc, std::size_t begin,
                              std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
      acc.accumulate_mean(params, views_of(microbatch_grads[i]), static_cast<double>(w.microbatches[i].tokens()));
    }
  };
  const std::size_t n = w.microbatches.size();
  resume_result r;
  r.checkpoint = checkpoint;
  r.split_after = n / 2;
  r.microbatches = n;

  gradaccum::weighted_gradients_accumulator<backend> straight(work_dtype, 1.0);
  accumulate(straight, 0, n);
  const window_gradients expected = straight.finish_mean(params).gradients;

  // The interrupted window: checkpointed, then destroyed with its scope; only the file remains.
  {
    gradaccum::weighted_gradients_accumulator<backend> first_half(work_dtype, 1.0);
    accumulate(first_half, 0, r.split_after);
    gradaccum::save_checkpoint(checkpoint, first_half);  // atomic; the format follows the extension
  }
  r.checkpoint_bytes = std::filesystem::file_size(checkpoint);

  // The restored window adopts the record's dtype and loss scale, whatever
  // it was constructed with.
  gradaccum::weighted_gradients_accumulator<backend> resumed(gradaccum::float_dtype::f64, 1.0);
  gradaccum::load_checkpoint(checkpoint, params, resumed);
  accumulate(resumed, r.split_after, n);
  r.mismatch = first_mismatch(expected, resumed.finish_mean(params).gradients);
  return r;
}

struct full_step_result {
  std::vector<double> scales;        // each window's loss scale
  std::vector<double> norms;         // each window's gradient norm, before clipping
  std::vector<std::size_t> skipped;  // windows whose step was skipped
  double first_loss = 0;             // mean training loss of the first and last window
  double last_loss = 0;
};

// The whole step, window after window: a token-weighted window of scaled loss-SUM gradients, the
// reduction (finish_mean: one process), clipping to `max_norm`, the loss scale's update, Adam over
// the flat buffer. Window `overflow_at` gets an infinity in one gradient, as an F16 overflow
// would: its step is skipped and the scale backs off.
inline full_step_result train_full_steps(char_mlp<float> model, const std::vector<window>& windows,
                                         std::size_t overflow_at, float lr, double max_norm) {
  const parameters params = parameter_set_of(model);
  const flat_layout layout(params);
  std::vector<float> flat = flat_parameters(model, layout);
  flat_adam adam(layout.elements(), lr);
  char_mlp<float> g = char_mlp<float>::zeros(model_shape{});
  full_step_result r;

  gradaccum::dynamic_loss_scale scaler;  // GradScaler's defaults: 2^16, x2 / 2000 windows, x0.5
  gradaccum::weighted_gradients_accumulator<backend> window(gradaccum::float_dtype::f32, scaler.scale());
  for (std::size_t step = 0; step < windows.size(); ++step) {
    double loss = 0;
    for (const token_batch& mb : windows[step].microbatches) {
      loss += loss_and_gradients(model, mb, static_cast<float>(scaler.scale()), g);  // of the scaled SUM
      if (step == overflow_at) g.out_bias(0) = std::numeric_limits<float>::infinity();
      window.accumulate_sum(params, views_of(g), static_cast<double>(mb.tokens()));
    }
    r.scales.push_back(scaler.scale());
    auto mean = window.finish_mean(params);                              // (sums / scale) / tokens
    const double norm = gradaccum::clip_by_global_norm(mean, max_norm);  // as clip_grad_norm_
    if (scaler.update(!std::isfinite(norm))) {                           // false after an overflow: skip, back off
      adam.step(flat, mean.gradients);
    } else {
      r.skipped.push_back(step);
    }
    window.set_loss_scale(scaler.scale());  // the next window's fixed scale
    write_back(flat, layout, model);

    r.norms.push_back(norm);
    (step == 0 ? r.first_loss : r.last_loss) = loss / static_cast<double>(windows[step].tokens());
  }
  return r;
}

}  // namespace demo
