// The training step after a window, written over the window's flat buffer: the model's
// parameters laid out like the gradients (one row-major segment per parameter), and Adam over
// that buffer, either whole (one process, or every rank after allreduce_mean) or one rank's shard
// of it (after reduce_scatter_mean). Adam is elementwise, so a shard's update is bit for bit the
// same elements of the whole update.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>
#include <gradaccum/sharded_gradients.hpp>

#include "model.hpp"

namespace demo {

using flat_layout = gradaccum::flat_layout<gradaccum::eigen_backend>;
using row_major_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// The model's parameters in `layout`: each tensor row-major at its segment's offset.
inline std::vector<float> flat_parameters(const char_mlp<float>& model, const flat_layout& layout) {
  std::vector<float> flat(layout.elements());
  for_each_tensor(model, [&](std::string_view name, const matrix<float>& w) {
    Eigen::Map<row_major_matrix>(flat.data() + layout[*layout.find(name)].offset, w.rows(), w.cols()) = w;
  });
  return flat;
}

// The inverse: the model's tensors read back from `flat`.
inline void write_back(std::span<const float> flat, const flat_layout& layout, char_mlp<float>& model) {
  for_each_tensor(model, [&](std::string_view name, matrix<float>& w) {
    w = Eigen::Map<const row_major_matrix>(flat.data() + layout[*layout.find(name)].offset, w.rows(), w.cols());
  });
}

// Adam (Kingma & Ba) with bias correction over a flat buffer of F32 parameters, as PyTorch's
// torch.optim.Adam with its defaults (betas 0.9, 0.999, eps 1e-8, no weight decay):
//
//   m = β1 · m + (1 − β1) · g,   v = β2 · v + (1 − β2) · g²,
//   p = p − lr · (m / (1 − β1^t)) / (√(v / (1 − β2^t)) + ε)
//
// Only present parameters are updated (PyTorch skips a parameter whose grad is None). `m` and
// `v` cover `elements` values: the whole buffer, or one rank's shard of it.
class flat_adam {
 public:
  flat_adam(std::size_t elements, float lr) : lr_(lr), m_(elements), v_(elements) {}

  // One step over the whole buffer: `params` is laid out like `g`.
  void step(std::span<float> params, const gradaccum::flat_gradients<gradaccum::eigen_backend>& g) {
    begin_step();
    const std::span<const float> grads = g.flat<float>();
    for (const auto& e : g) update(params.data() + e.offset, grads.data() + e.offset, e.offset, e.size);
  }

  // One step over this rank's shard: `params` holds the shard's part of the parameter buffer
  // (elements [range().begin, range().begin + range().stored)).
  void step(std::span<float> params, const gradaccum::sharded_gradients<gradaccum::eigen_backend>& shard) {
    begin_step();
    const std::span<const float> grads = shard.values<float>();
    for (const gradaccum::shard_piece& p : shard.pieces()) {
      update(params.data() + p.offset, grads.data() + p.offset, p.offset, p.size);
    }
  }

 private:
  static constexpr float beta1 = 0.9F;
  static constexpr float beta2 = 0.999F;
  static constexpr float epsilon = 1e-8F;

  void begin_step() {
    ++t_;
    c1_ = 1.0F - std::pow(beta1, static_cast<float>(t_));
    c2_ = 1.0F - std::pow(beta2, static_cast<float>(t_));
  }

  void update(float* p, const float* g, std::size_t at, std::size_t count) {
    float* const m = m_.data() + at;
    float* const v = v_.data() + at;
    for (std::size_t i = 0; i < count; ++i) {
      m[i] = beta1 * m[i] + (1 - beta1) * g[i];
      v[i] = beta2 * v[i] + (1 - beta2) * g[i] * g[i];
      p[i] -= lr_ * (m[i] / c1_) / (std::sqrt(v[i] / c2_) + epsilon);
    }
  }

  float lr_;
  std::vector<float> m_;
  std::vector<float> v_;
  long t_ = 0;
  float c1_ = 1;
  float c2_ = 1;
};

}  // namespace demo
