// The README's usage example: two microbatches of unequal size give the full-batch gradient.
#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>
#include <iostream>

int main() try {
  using B = gradaccum::eigen_backend;
  Eigen::MatrixXf weight = Eigen::MatrixXf::Zero(2, 3);
  gradaccum::parameter_set<B> params;
  params.add("fc.weight", weight);

  gradaccum::weighted_gradients_accumulator<B> window(gradaccum::float_dtype::f32, /*loss_scale=*/1.0);
  // Gradients of each microbatch's MEAN loss, and how many tokens that mean was over.
  for (auto [mean_gradient, tokens] : {std::pair{2.0F, 1.0}, std::pair{6.0F, 3.0}}) {
    gradaccum::gradients_params<B> grads;
    grads.insert("fc.weight", Eigen::MatrixXf::Constant(2, 3, mean_gradient).eval());
    window.accumulate_mean(params, grads, tokens);
  }
  const auto result = window.finish_mean(params);
  // (1·2 + 3·6) / 4 = 5 everywhere; averaging the two means would give 4.
  std::cout << *result.gradients.get<float>("fc.weight") << '\n';
} catch (const std::exception& e) {  // a gradaccum::error names the call, the problem and the id
  std::cerr << e.what() << '\n';
  return 1;
}
