// The model of the compile-cost MLP files (mlp_by_hand.cpp, mlp_gradaccum.cpp,
// mlp_checkpoint.cpp): a two-layer tanh MLP, its microbatches and its backward pass, shared so
// that each file shows only its own training loop. Eigen only: what the files add to it is
// what is measured.
#pragma once

#include <Eigen/Dense>
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

const Eigen::Index inputs = 16, hidden = 64, outputs = 4;

// Small random weights, zero biases.
mlp initial_mlp() {
  return {Eigen::MatrixXf::Random(hidden, inputs) * 0.1F, Eigen::MatrixXf::Random(outputs, hidden) * 0.1F,
          Eigen::VectorXf::Zero(hidden), Eigen::VectorXf::Zero(outputs)};
}

// Four microbatches of unequal size: 3, 17, 9 and 31 tokens.
std::vector<microbatch> make_microbatches() {
  std::vector<microbatch> microbatches;
  for (const Eigen::Index tokens : {3, 17, 9, 31}) {
    microbatches.push_back({Eigen::MatrixXf::Random(inputs, tokens), Eigen::MatrixXf::Random(outputs, tokens)});
  }
  return microbatches;
}

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
