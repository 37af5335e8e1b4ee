// Compile-cost target (a): a newcomer's MLP training loop with gradaccum, as the README shows it:
// a parameter_set, each microbatch's gradients in a gradients_params, a token-weighted window
// (accumulate_mean, or accumulate_sum for gradients of a loss sum), finish_mean,
// clip_by_global_norm and a dynamic_loss_scale. mlp_by_hand.cpp is the same loop without it.
// With -DEXTERN_TEMPLATES it declares the window compiled elsewhere (<gradaccum/extern_templates.hpp>).
// mlp_checkpoint.cpp is this file with WITH_CHECKPOINT defined (target (b)).
#include <gradaccum/backends/eigen.hpp>
#ifdef WITH_CHECKPOINT
#include <gradaccum/checkpoint.hpp>
#endif
#include <gradaccum/gradaccum.hpp>

#include <cmath>
#include <iostream>

#include "mlp_model.hpp"

#ifdef EXTERN_TEMPLATES  // target (a-ext): the window compiled once, in another file of the program
GRADACCUM_EXTERN_TEMPLATES(gradaccum::eigen_backend)
#endif

int main() {
  using B = gradaccum::eigen_backend;
  mlp model = initial_mlp();
  const std::vector<microbatch> microbatches = make_microbatches();
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
#ifdef WITH_CHECKPOINT
    if (step == 50) {  // resume from a checkpoint of the full window
      gradaccum::save_checkpoint("mlp_window.bin", window, scaler);
      gradaccum::load_checkpoint("mlp_window.bin", params, window, scaler);
    }
#endif
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
