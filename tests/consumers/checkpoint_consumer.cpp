// A program written against an installed gradaccum's compiled checkpoint library: it must see
// declarations only (GRADACCUM_SEPARATE_COMPILATION, no cereal) and link with nothing else.
#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#if !defined(GRADACCUM_SEPARATE_COMPILATION) || defined(CEREAL_CEREAL_HPP_)
#error "a consumer of the checkpoint library compiles its declarations, without cereal"
#endif

#include <iostream>

/// One microbatch of 1 token with mean-loss gradient 2 saved, loaded into a fresh window, then
/// one of 3 tokens with gradient 6: the full-batch gradient is (1·2 + 3·6) / 4 = 5.
int main() {
  using B = gradaccum::eigen_backend;
  gradaccum::parameter_set<B> params;
  params.add("w", Eigen::MatrixXf::Constant(2, 3, 0.0F).eval());
  auto accumulate = [&params](gradaccum::weighted_gradients_accumulator<B>& window, float mean_gradient,
                              double tokens) {
    gradaccum::gradients_params<B> grads;
    grads.insert("w", Eigen::MatrixXf::Constant(2, 3, mean_gradient).eval());
    window.accumulate_mean(params, grads, tokens);
  };
  gradaccum::weighted_gradients_accumulator<B> saved(gradaccum::float_dtype::f32, /*loss_scale=*/1.0);
  accumulate(saved, 2.0F, 1.0);
  gradaccum::save_checkpoint("checkpoint_consumer.bin", saved);
  gradaccum::weighted_gradients_accumulator<B> resumed(gradaccum::float_dtype::f32, /*loss_scale=*/1.0);
  gradaccum::load_checkpoint("checkpoint_consumer.bin", params, resumed);
  accumulate(resumed, 6.0F, 3.0);
  std::cout << "checkpoint resumed " << resumed.finish_mean(params).gradients.values<float>("w")[0] << '\n';
}
