// A small character-level language model with hand-written backprop:
// previous-k characters -> embedding -> tanh hidden layer -> softmax over
// the characters. Templated on the scalar so the same code computes the F32
// training gradients and the F64 reference gradients.
#pragma once

#include <cmath>
#include <cstddef>
#include <random>
#include <string_view>

#include <Eigen/Core>

#include "text_data.hpp"

namespace demo {

template <typename T>
using matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;

struct model_shape {
  int vocab = vocab_size;
  int context = 3;
  int embed = 16;
  int hidden = 128;
};

// The parameters of the model, or gradients with the same layout.
// Biases are n x 1 matrices so that every tensor has one type.
template <typename T>
struct char_mlp {
  matrix<T> embed_weight;  // vocab x embed
  matrix<T> fc1_weight;    // hidden x (context * embed)
  matrix<T> fc1_bias;      // hidden x 1
  matrix<T> out_weight;    // vocab x hidden
  matrix<T> out_bias;      // vocab x 1

  static char_mlp zeros(const model_shape& s) {
    return {matrix<T>::Zero(s.vocab, s.embed), matrix<T>::Zero(s.hidden, s.context * s.embed),
            matrix<T>::Zero(s.hidden, 1), matrix<T>::Zero(s.vocab, s.hidden), matrix<T>::Zero(s.vocab, 1)};
  }

  template <typename U>
  char_mlp<U> cast() const {
    return {embed_weight.template cast<U>(), fc1_weight.template cast<U>(), fc1_bias.template cast<U>(),
            out_weight.template cast<U>(), out_bias.template cast<U>()};
  }
};

// Calls f(name, tensor) for every tensor, in a fixed order, with the
// parameter names the accumulator knows them by. Works on const models too.
template <typename Model, typename F>
void for_each_tensor(Model& m, F&& f) {
  f(std::string_view("embed.weight"), m.embed_weight);
  f(std::string_view("fc1.weight"), m.fc1_weight);
  f(std::string_view("fc1.bias"), m.fc1_bias);
  f(std::string_view("out.weight"), m.out_weight);
  f(std::string_view("out.bias"), m.out_bias);
}

// Small random weights (scaled by fan-in, so tanh starts unsaturated) and
// zero biases.
inline char_mlp<float> init_model(const model_shape& s, std::mt19937_64& rng) {
  char_mlp<float> m = char_mlp<float>::zeros(s);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto fill = [&](matrix<float>& w, float scale) {
    for (float& x : w.reshaped()) {
      x = normal(rng) * scale;
    }
  };
  fill(m.embed_weight, 1.0f);
  fill(m.fc1_weight, 1.0f / std::sqrt(static_cast<float>(s.context * s.embed)));
  fill(m.out_weight, 0.1f / std::sqrt(static_cast<float>(s.hidden)));
  return m;
}

template <typename T>
struct forward_pass {
  matrix<T> inputs;     // (context * embed) x tokens: concatenated embeddings
  matrix<T> hidden;     // hidden x tokens, after tanh
  matrix<T> probs;      // vocab x tokens, softmax
  double loss_sum = 0;  // summed cross-entropy, accumulated in double
};

template <typename T>
forward_pass<T> forward(const char_mlp<T>& p, const token_batch& batch) {
  const auto n = static_cast<Eigen::Index>(batch.tokens());
  const Eigen::Index k = batch.context;
  const Eigen::Index e = p.embed_weight.cols();
  forward_pass<T> f;
  f.inputs.resize(k * e, n);
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index j = 0; j < k; ++j) {
      f.inputs.col(t).segment(j * e, e) =
          p.embed_weight.row(batch.contexts[static_cast<std::size_t>(t * k + j)]).transpose();
    }
  }
  f.hidden = ((p.fc1_weight * f.inputs).colwise() + p.fc1_bias.col(0)).array().tanh();
  f.probs = (p.out_weight * f.hidden).colwise() + p.out_bias.col(0);
  for (Eigen::Index t = 0; t < n; ++t) {
    auto z = f.probs.col(t);
    z.array() = (z.array() - z.maxCoeff()).exp();
    const T total = z.sum();
    z /= total;
    const T p_target = z(batch.targets[static_cast<std::size_t>(t)]);
    f.loss_sum -= std::log(static_cast<double>(p_target));
  }
  return f;
}

// Summed cross-entropy of the batch, no gradients (held-out evaluation).
template <typename T>
double loss_sum(const char_mlp<T>& p, const token_batch& batch) {
  return forward(p, batch).loss_sum;
}

// Forward and backward pass. Writes into `grads` the gradient of
// scale * (summed cross-entropy over the batch): scale 1 gives the gradient
// of the SUM loss, 1 / tokens that of the MEAN loss, and a loss-scaling
// factor can be folded in. Returns the unscaled summed loss.
template <typename T>
double loss_and_gradients(const char_mlp<T>& p, const token_batch& batch, T scale, char_mlp<T>& grads) {
  forward_pass<T> f = forward(p, batch);
  const auto n = static_cast<Eigen::Index>(batch.tokens());
  const Eigen::Index k = batch.context;
  const Eigen::Index e = p.embed_weight.cols();

  // d(loss)/d(logits) = softmax - one_hot(target), reusing probs in place.
  matrix<T>& d_logits = f.probs;
  for (Eigen::Index t = 0; t < n; ++t) {
    d_logits(batch.targets[static_cast<std::size_t>(t)], t) -= T(1);
  }
  d_logits *= scale;

  grads.out_weight.noalias() = d_logits * f.hidden.transpose();
  grads.out_bias = d_logits.rowwise().sum();
  const matrix<T> d_pre =
      (p.out_weight.transpose() * d_logits).cwiseProduct((T(1) - f.hidden.array().square()).matrix());
  grads.fc1_weight.noalias() = d_pre * f.inputs.transpose();
  grads.fc1_bias = d_pre.rowwise().sum();
  const matrix<T> d_inputs = p.fc1_weight.transpose() * d_pre;
  grads.embed_weight.setZero(p.embed_weight.rows(), e);
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index j = 0; j < k; ++j) {
      grads.embed_weight.row(batch.contexts[static_cast<std::size_t>(t * k + j)]) +=
          d_inputs.col(t).segment(j * e, e).transpose();
    }
  }
  return f.loss_sum;
}

// Adam (Kingma & Ba) with bias correction, on F32 parameters.
class adam {
 public:
  adam(const model_shape& s, float lr) : lr_(lr), m_(char_mlp<float>::zeros(s)), v_(char_mlp<float>::zeros(s)) {}

  void step(char_mlp<float>& params, const char_mlp<float>& grads) {
    ++t_;
    const float c1 = 1.0f - std::pow(beta1, static_cast<float>(t_));
    const float c2 = 1.0f - std::pow(beta2, static_cast<float>(t_));
    update(params.embed_weight, grads.embed_weight, m_.embed_weight, v_.embed_weight, c1, c2);
    update(params.fc1_weight, grads.fc1_weight, m_.fc1_weight, v_.fc1_weight, c1, c2);
    update(params.fc1_bias, grads.fc1_bias, m_.fc1_bias, v_.fc1_bias, c1, c2);
    update(params.out_weight, grads.out_weight, m_.out_weight, v_.out_weight, c1, c2);
    update(params.out_bias, grads.out_bias, m_.out_bias, v_.out_bias, c1, c2);
  }

 private:
  static constexpr float beta1 = 0.9f;
  static constexpr float beta2 = 0.999f;
  static constexpr float epsilon = 1e-8f;

  void update(matrix<float>& w, const matrix<float>& g, matrix<float>& m, matrix<float>& v, float c1, float c2) const {
    m = beta1 * m + (1 - beta1) * g;
    v = beta2 * v + (1 - beta2) * g.cwiseAbs2();
    w.array() -= lr_ * (m.array() / c1) / ((v.array() / c2).sqrt() + epsilon);
  }

  float lr_;
  char_mlp<float> m_;
  char_mlp<float> v_;
  long t_ = 0;
};

}  // namespace demo
