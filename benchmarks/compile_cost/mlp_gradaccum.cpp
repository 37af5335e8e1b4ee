// Compile-cost target (a): a newcomer's MLP training loop with gradaccum, as the README shows it:
// a parameter_set, each microbatch's gradients in a gradients_params, a token-weighted window
// (accumulate_mean, or accumulate_sum for gradients of a loss sum), finish_mean,
// clip_by_global_norm and a dynamic_loss_scale. mlp_by_hand.cpp is the same loop without it.
#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>

#include <Eigen/Dense>
#include <cmath>
#include <cstddef>
#include <iostream>
#include <vector>

namespace {

struct mlp {
  Eigen::MatrixXf w1, w2;
  Eigen::VectorXf b1, b2;
};

struct mlp_gradients {
  Eigen::MatrixXf w1, w2;
  Eigen::VectorXf b1, b2;
};

struct microbatch {
  Eigen::MatrixXf x, y;  // one column per token
  double tokens() const { return static_cast<double>(x.cols()); }
};

// The gradients of loss_scale times the mean (or the sum) squared error over the microbatch.
float loss_and_gradients(const mlp& m, const microbatch& mb, float loss_scale, bool sum_loss, mlp_gradients& g) {
  const Eigen::MatrixXf h = ((m.w1 * mb.x).colwise() + m.b1).array().tanh().matrix();
  const Eigen::MatrixXf out = (m.w2 * h).colwise() + m.b2;
  const Eigen::MatrixXf diff = out - mb.y;
  const float n = static_cast<float>(mb.x.cols());
  const Eigen::MatrixXf d_out = (sum_loss ? 2.0F * loss_scale : 2.0F * loss_scale / n) * diff;
  g.w2 = d_out * h.transpose();
  g.b2 = d_out.rowwise().sum();
  const Eigen::MatrixXf d_h = ((m.w2.transpose() * d_out).array() * (1.0F - h.array().square())).matrix();
  g.w1 = d_h * mb.x.transpose();
  g.b1 = d_h.rowwise().sum();
  return diff.squaredNorm() / n;
}

}  // namespace

int main() {
  using B = gradaccum::eigen_backend;
  const Eigen::Index inputs = 16, hidden = 64, outputs = 4;
  mlp model{Eigen::MatrixXf::Random(hidden, inputs) * 0.1F, Eigen::MatrixXf::Random(outputs, hidden) * 0.1F,
            Eigen::VectorXf::Zero(hidden), Eigen::VectorXf::Zero(outputs)};
  std::vector<microbatch> microbatches;
  for (const Eigen::Index tokens : {3, 17, 9, 31}) {
    microbatches.push_back({Eigen::MatrixXf::Random(inputs, tokens), Eigen::MatrixXf::Random(outputs, tokens)});
  }
  const float lr = 0.05F;
  const double max_norm = 1.0;
  const bool sum_loss = false;  // true: gradients of the loss SUM

  gradaccum::parameter_set<B> params;
  params.add("fc1.weight", model.w1);
  params.add("fc1.bias", model.b1);
  params.add("fc2.weight", model.w2);
  params.add("fc2.bias", model.b2);

  gradaccum::dynamic_loss_scale scaler;  // PyTorch GradScaler's defaults
  gradaccum::weighted_gradients_accumulator<B> window(gradaccum::float_dtype::f32, scaler.scale());
  mlp_gradients g;
  for (int step = 0; step < 100; ++step) {
    for (const microbatch& mb : microbatches) {
      loss_and_gradients(model, mb, static_cast<float>(scaler.scale()), sum_loss, g);
      gradaccum::gradients_params<B> grads;
      grads.insert("fc1.weight", g.w1);
      grads.insert("fc1.bias", g.b1);
      grads.insert("fc2.weight", g.w2);
      grads.insert("fc2.bias", g.b2);
      if (sum_loss) {
        window.accumulate_sum(params, grads, mb.tokens());
      } else {
        window.accumulate_mean(params, grads, mb.tokens());
      }
    }
    auto mean = window.finish_mean(params);
    const double norm = gradaccum::clip_by_global_norm(mean, max_norm);
    if (scaler.update(!std::isfinite(norm))) {  // false after an overflow: skip the step, back off
      model.w1 -= lr * *mean.gradients.get<float>("fc1.weight");
      model.w2 -= lr * *mean.gradients.get<float>("fc2.weight");
      model.b1 -= lr * *mean.gradients.get<float>("fc1.bias");
      model.b2 -= lr * *mean.gradients.get<float>("fc2.bias");
    }
    window.set_loss_scale(scaler.scale());
  }
  std::cout << model.w2.norm() << ' ' << scaler.scale() << '\n';
}
