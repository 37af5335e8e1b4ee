// A program written against an installed gradaccum, built by every consumer project here
// (CMake find_package, pkg-config, Meson subproject). Each optional component the build system
// found is switched on with GRADACCUM_CONSUMER_<COMPONENT>=1 and must then compile, link and run.
#if GRADACCUM_CONSUMER_TORCH
#include <gradaccum/backends/torch.hpp>
#endif
#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>
#if GRADACCUM_CONSUMER_XTENSOR
#include <gradaccum/backends/xtensor.hpp>
#endif
#if GRADACCUM_CONSUMER_MPI
#include <gradaccum/mpi.hpp>
#endif
#if GRADACCUM_CONSUMER_CEREAL
#include <cereal/archives/binary.hpp>
#include <gradaccum/cereal.hpp>

#include <sstream>
#endif

#include <iostream>
#include <utility>
#include <variant>
#include <vector>

#if GRADACCUM_CONSUMER_CEREAL
/// Whether a record survives a cereal binary archive unchanged.
bool round_trips(const gradaccum::weighted_gradients_record& record) {
  std::stringstream bytes;
  {
    cereal::BinaryOutputArchive output(bytes);
    output(record);
  }
  gradaccum::weighted_gradients_record loaded;
  cereal::BinaryInputArchive input(bytes);
  input(loaded);
  return loaded == record;
}
#endif

/// Two microbatches of 1 and 3 tokens with mean-loss gradients 2 and 6: the full-batch gradient
/// is (1·2 + 3·6) / 4 = 5 in every element, whatever the backend.
template <class B, class Filled>
float full_batch_gradient(Filled filled) {
  gradaccum::parameter_set<B> params;
  params.add("w", filled(0.0F));
  gradaccum::weighted_gradients_accumulator<B> window(gradaccum::float_dtype::f32, /*loss_scale=*/1.0);
  for (auto [mean_gradient, tokens] : {std::pair{2.0F, 1.0}, std::pair{6.0F, 3.0}}) {
    gradaccum::gradients_params<B> grads;
    grads.insert("w", filled(mean_gradient));
    window.accumulate_mean(params, grads, tokens);
  }
#if GRADACCUM_CONSUMER_CEREAL
  std::cout << "cereal round trip " << round_trips(window.try_to_record()) << '\n';
#endif
  // Through the result's record: a device backend's (torch) values are not host spans.
  const gradaccum::gradients_params_record mean = window.finish_mean(params).gradients.to_record();
  return std::get<std::vector<float>>(mean.tensors.at(0).values).at(0);
}

int main() {
  std::cout << "gradaccum " << GRADACCUM_VERSION_STRING << '\n';
  const float eigen_gradient = full_batch_gradient<gradaccum::eigen_backend>(
      [](float value) { return Eigen::MatrixXf::Constant(2, 3, value).eval(); });
  std::cout << "eigen " << eigen_gradient << '\n';
#if GRADACCUM_CONSUMER_XTENSOR
  const float xtensor_gradient = full_batch_gradient<gradaccum::xtensor_backend>([](float value) {
    xt::xarray<float> filled = xt::xarray<float>::from_shape({2, 3});
    filled.fill(value);
    return filled;
  });
  std::cout << "xtensor " << xtensor_gradient << '\n';
#endif
#if GRADACCUM_CONSUMER_TORCH
  const float torch_gradient = full_batch_gradient<gradaccum::torch_backend>([](float value) {
    return at::full({2, 3}, value);
  });
  std::cout << "torch " << torch_gradient << '\n';
#endif
#if GRADACCUM_CONSUMER_MPI
  // Linking is what is checked; MPI_Initialized may be called before MPI_Init, without mpirun.
  int initialized = 1;
  MPI_Initialized(&initialized);
  std::cout << "mpi linked " << (initialized == 0) << '\n';
#endif
}
