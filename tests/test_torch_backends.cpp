// The libtorch backend against the others: sums and means agree bit for bit with the Eigen and
// xtensor backends, and a checkpoint saved with torch restores into Eigen and xtensor, and back,
// and resumes bit for bit. Linked into test_torch_inputs (tests/meson.build) with
// test_torch_inputs.cpp, which tests what goes in.
#include "test_torch_support.hpp"

#include <sstream>
#include <utility>
#include <vector>

#include <cereal/archives/binary.hpp>
#if __has_include(<xtensor/containers/xadapt.hpp>)
#include <xtensor/containers/xadapt.hpp>
#else
#include <xtensor/xadapt.hpp>
#endif

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/backends/xtensor.hpp>
#include <gradaccum/cereal.hpp>
#include <gradaccum/gradaccum.hpp>

#include "test_helpers.hpp"

namespace gradaccum::test {
namespace {

using B = torch_backend;
using eigen_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// One window of mixed inputs with inexact arithmetic (random values, weights 0.3 and 1.7, loss
/// scale 3): the F32 and F64 sums and means of the three backends, as records.
struct mixed_inputs {
  at::Tensor w32 = torch::randn({5, 7});
  at::Tensor w16 = torch::randn({5, 7}).to(at::kBFloat16);
  at::Tensor b32 = torch::randn({1, 7});  // [1, 7]: an Eigen matrix has no rank-1 shape
};

template <class W>
std::pair<weighted_gradients_record, gradients_params_record> torch_window(const mixed_inputs& in) {
  parameter_set<B> params;
  params.add("w", torch::zeros({5, 7}));
  params.add("b", torch::zeros({1, 7}));
  weighted_gradients_accumulator<B> window(dtype_of<W>, 3.0);
  gradients_params<B> first;
  first.insert("w", in.w32);
  first.insert("b", in.b32);
  window.accumulate_mean(params, first, 0.3);
  gradients_params<B> second;
  second.insert("w", in.w16);
  window.accumulate_mean(params, second, 1.7);
  auto sums = window.try_to_record();
  return {std::move(sums), window.finish_mean(params).gradients.to_record()};
}

template <class W>
std::pair<weighted_gradients_record, gradients_params_record> eigen_window(const mixed_inputs& in) {
  using E = eigen_backend;
  const at::Tensor w16 = in.w16.contiguous();
  parameter_set<E> params;
  params.add("w", Eigen::MatrixXf::Zero(5, 7));
  params.add("b", Eigen::MatrixXf::Zero(1, 7));
  weighted_gradients_accumulator<E> window(dtype_of<W>, 3.0);
  gradients_params<E> first;
  first.insert("w", Eigen::Map<const eigen_matrix>(in.w32.data_ptr<float>(), 5, 7));
  first.insert("b", Eigen::Map<const eigen_matrix>(in.b32.data_ptr<float>(), 1, 7));
  window.accumulate_mean(params, first, 0.3);
  gradients_params<E> second;
  using bf16_matrix = Eigen::Matrix<Eigen::bfloat16, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  second.insert("w", Eigen::Map<const bf16_matrix>(static_cast<const Eigen::bfloat16*>(w16.data_ptr()), 5, 7));
  window.accumulate_mean(params, second, 1.7);
  auto sums = window.try_to_record();
  return {std::move(sums), window.finish_mean(params).gradients.to_record()};
}

template <class W>
std::pair<weighted_gradients_record, gradients_params_record> xtensor_window(const mixed_inputs& in) {
  using X = xtensor_backend;
  const at::Tensor w16 = in.w16.contiguous();
  parameter_set<X> params;
  params.add("w", xt::xarray<float>::from_shape({5, 7}));
  params.add("b", xt::xarray<float>::from_shape({1, 7}));
  weighted_gradients_accumulator<X> window(dtype_of<W>, 3.0);
  gradients_params<X> first;
  first.insert("w", X::view_of(in.w32.data_ptr<float>(), {5, 7}));
  first.insert("b", X::view_of(in.b32.data_ptr<float>(), {1, 7}));
  window.accumulate_mean(params, first, 0.3);
  gradients_params<X> second;
  second.insert("w", X::view_of(static_cast<const bf16_bits*>(w16.data_ptr()), {5, 7}));
  window.accumulate_mean(params, second, 1.7);
  auto sums = window.try_to_record();
  return {std::move(sums), window.finish_mean(params).gradients.to_record()};
}

TEST_CASE_TEMPLATE("sums and means are bit-identical to the Eigen and xtensor backends", W, float, double) {
  torch::manual_seed(2);
  const mixed_inputs in;
  const auto torch_result = torch_window<W>(in);
  const auto eigen_result = eigen_window<W>(in);
  const auto xtensor_result = xtensor_window<W>(in);
  GRADACCUM_CHECK_SAME_BITS(torch_result.first, eigen_result.first);
  GRADACCUM_CHECK_SAME_BITS(torch_result.first, xtensor_result.first);
  GRADACCUM_CHECK_SAME_BITS(torch_result.second, eigen_result.second);
  GRADACCUM_CHECK_SAME_BITS(torch_result.second, xtensor_result.second);
}

/// A record through a cereal binary archive, as a checkpoint file holds it.
weighted_gradients_record through_archive(const weighted_gradients_record& record) {
  std::stringstream bytes;
  {
    cereal::BinaryOutputArchive out(bytes);
    out(record);
  }
  weighted_gradients_record loaded;
  cereal::BinaryInputArchive in(bytes);
  in(loaded);
  return loaded;
}

TEST_CASE("a checkpoint saved with torch restores into Eigen and xtensor, and back, and resumes bit for bit") {
  torch::manual_seed(3);
  const at::Tensor g[] = {torch::randn({4, 3}), torch::randn({4, 3}).to(at::kBFloat16), torch::randn({4, 3})};
  const double weights[] = {3.0, 0.7, 5.0};
  parameter_set<B> params;
  params.add("w", torch::zeros({4, 3}));
  const auto feed = [&](weighted_gradients_accumulator<B>& window, int microbatch) {
    gradients_params<B> grads;
    grads.insert("w", g[microbatch]);
    window.accumulate_mean(params, grads, weights[microbatch]);
  };
  weighted_gradients_accumulator<B> uninterrupted(float_dtype::f32, 2.0);
  for (int k = 0; k < 3; ++k) feed(uninterrupted, k);

  weighted_gradients_accumulator<B> saved(float_dtype::f32, 2.0);
  feed(saved, 0);
  feed(saved, 1);
  const weighted_gradients_record mid_window = through_archive(saved.try_to_record());

  parameter_set<eigen_backend> eigen_params;
  eigen_params.add("w", Eigen::MatrixXf::Zero(4, 3));
  weighted_gradients_accumulator<eigen_backend> on_eigen(float_dtype::f64, 1.0);
  on_eigen.load_record(eigen_params, mid_window);
  GRADACCUM_CHECK_SAME_BITS(on_eigen.try_to_record(), mid_window);

  parameter_set<xtensor_backend> xtensor_params;
  xtensor_params.add("w", xt::xarray<float>::from_shape({4, 3}));
  weighted_gradients_accumulator<xtensor_backend> on_xtensor(float_dtype::f64, 1.0);
  on_xtensor.load_record(xtensor_params, mid_window);
  GRADACCUM_CHECK_SAME_BITS(on_xtensor.try_to_record(), mid_window);

  // Back to torch from each, then the last microbatch: the uninterrupted window's bits.
  for (const weighted_gradients_record& other :
       {through_archive(on_eigen.try_to_record()), through_archive(on_xtensor.try_to_record())}) {
    weighted_gradients_accumulator<B> resumed(float_dtype::f64, 1.0);
    resumed.load_record(params, other);
    feed(resumed, 2);
    GRADACCUM_CHECK_SAME_BITS(resumed.try_to_record(), uninterrupted.try_to_record());
    GRADACCUM_CHECK_SAME_BITS(
        resumed.finish_mean(params).gradients.to_record(),
        weighted_gradients_accumulator<B>(uninterrupted).finish_mean(params).gradients.to_record());
  }
}

}  // namespace
}  // namespace gradaccum::test
