// Compile-cost baseline of target (a): the training loop of mlp_gradaccum.cpp without gradaccum.
// The same model, forward and backward; the window's arithmetic written by hand: gradients
// summed weighted by their token counts, divided by the loss scale and the total, clipped by
// the global norm, and a dynamic loss scale (halve on overflow, double after 2000 good windows).
#include <cmath>
#include <iostream>

#include "mlp_model.hpp"

namespace {

mlp_gradients zeros_like(const mlp& m) {
  return {Eigen::MatrixXf::Zero(m.w1.rows(), m.w1.cols()), Eigen::MatrixXf::Zero(m.w2.rows(), m.w2.cols()),
          Eigen::VectorXf::Zero(m.b1.size()), Eigen::VectorXf::Zero(m.b2.size())};
}

}  // namespace

int main() {
  mlp model = initial_mlp();
  const std::vector<microbatch> microbatches = make_microbatches();
  const float lr = 0.05F;
  const double max_norm = 1.0;
  const bool sum_loss = false;  // true: gradients of the loss SUM

  double loss_scale = 65536.0;  // halved on overflow, doubled after 2000 good windows in a row
  int good_windows = 0;
  mlp_gradients g;
  for (int step = 0; step < 100; ++step) {
    mlp_gradients sum = zeros_like(model);
    double total_tokens = 0;
    for (const microbatch& mb : microbatches) {
      loss_and_gradients(model, mb, static_cast<float>(loss_scale), sum_loss, g);
      const float w = sum_loss ? 1.0F : static_cast<float>(mb.tokens());
      sum.w1 += w * g.w1;
      sum.w2 += w * g.w2;
      sum.b1 += w * g.b1;
      sum.b2 += w * g.b2;
      total_tokens += mb.tokens();
    }
    const float scale = static_cast<float>(loss_scale), total = static_cast<float>(total_tokens);
    sum.w1 = (sum.w1 / scale) / total;
    sum.w2 = (sum.w2 / scale) / total;
    sum.b1 = (sum.b1 / scale) / total;
    sum.b2 = (sum.b2 / scale) / total;

    const double norm = std::sqrt(sum.w1.cast<double>().squaredNorm() + sum.w2.cast<double>().squaredNorm() +
                                  sum.b1.cast<double>().squaredNorm() + sum.b2.cast<double>().squaredNorm());
    if (std::isfinite(norm) && max_norm / (norm + 1e-6) < 1.0) {
      const float c = static_cast<float>(max_norm / (norm + 1e-6));
      sum.w1 *= c;
      sum.w2 *= c;
      sum.b1 *= c;
      sum.b2 *= c;
    }
    if (!std::isfinite(norm)) {  // overflow: skip the step, back off
      loss_scale *= 0.5;
      good_windows = 0;
      continue;
    }
    if (++good_windows == 2000) {
      loss_scale *= 2.0;
      good_windows = 0;
    }
    model.w1 -= lr * sum.w1;
    model.w2 -= lr * sum.w2;
    model.b1 -= lr * sum.b1;
    model.b2 -= lr * sum.b2;
  }
  std::cout << model.w2.norm() << ' ' << loss_scale << '\n';
}
