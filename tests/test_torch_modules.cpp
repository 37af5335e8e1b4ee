// The libtorch backend's helpers for a module: torch_parameters and torch_gradients take
// named_parameters() as it is (ties once, frozen parameters skipped), write_gradients writes a
// finished mean back into .grad() (in place where it can, checking every parameter first), and
// a torch::optim optimizer steps on it. What goes in is in test_torch_inputs.cpp, agreement with
// the other backends in test_torch_backends.cpp.
#include "test_torch_support.hpp"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <gradaccum/gradaccum.hpp>

#include "test_helpers.hpp"

namespace gradaccum::test {
namespace {

using B = torch_backend;

/// A module with a tied weight: one tensor registered under two names, and a frozen tensor.
struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    weight = register_parameter("weight", torch::ones({2, 3}));
    register_parameter("tied_weight", weight);
    bias = register_parameter("bias", torch::zeros({3}));
    frozen = register_parameter("frozen", torch::zeros({4}), /*requires_grad=*/false);
  }
  torch::Tensor weight, bias, frozen;
};
TORCH_MODULE(Tied);

TEST_CASE("README: a module's gradients, accumulated over microbatches, step a torch::optim optimizer") {
  torch::manual_seed(0);
  // --- snippet (keep in sync with docs/backends.md "libtorch") ---
  torch::nn::Linear model(3, 2);
  torch::optim::SGD optimizer(model->parameters(), /*lr=*/0.1);
  auto named = model->named_parameters();
  auto params = gradaccum::torch_parameters(named);
  gradaccum::weighted_gradients_accumulator<gradaccum::torch_backend> window(gradaccum::float_dtype::f32, 1.0);
  for (const auto& x : {torch::randn({1, 3}), torch::randn({3, 3})}) {  // 1 token, then 3
    optimizer.zero_grad();
    model(x).pow(2).sum().backward();  // a loss SUM over the microbatch's tokens
    window.accumulate_sum(params, gradaccum::torch_gradients(named), static_cast<double>(x.size(0)));
  }
  gradaccum::write_gradients(named, window.finish_mean(params).gradients);
  optimizer.step();
  // --- end of snippet ---
  CHECK(params.size() == 2);
  CHECK(model->weight.grad().sizes() == at::IntArrayRef{2, 3});
  CHECK(window.state().microbatches == 0);  // finish_mean reset the window
}

TEST_CASE("docs: the training loop on the model's device keeps the window and .grad() there") {
  torch::manual_seed(0);
  // --- snippet (keep in sync with docs/backends.md "On a GPU") ---
  const torch::Device device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
  torch::nn::Linear model(3, 2);
  model->to(device);
  torch::optim::SGD optimizer(model->parameters(), /*lr=*/0.1);
  auto named = model->named_parameters();
  auto params = gradaccum::torch_parameters(named);
  gradaccum::weighted_gradients_accumulator<gradaccum::torch_backend> window(gradaccum::float_dtype::f32, 1.0);
  for (const std::int64_t tokens : {1, 3}) {
    optimizer.zero_grad();
    model(torch::randn({tokens, 3}, device)).pow(2).sum().backward();
    window.accumulate_sum(params, gradaccum::torch_gradients(named), static_cast<double>(tokens));
  }
  gradaccum::write_gradients(named, window.finish_mean(params).gradients);  // stays on the device
  optimizer.step();
  // --- end of snippet ---
  CHECK(model->weight.grad().device() == device);
  CHECK(model->weight.grad().sizes() == at::IntArrayRef{2, 3});
  CHECK(window.state().microbatches == 0);
}

TEST_CASE("the full-batch mean is written into .grad() bit for bit, and the optimizer steps on it") {
  torch::manual_seed(1);
  torch::nn::Linear model(3, 2);
  const at::Tensor first = torch::randn({2, 3});
  const at::Tensor second = torch::randn({5, 3});
  auto named = model->named_parameters();
  const auto params = torch_parameters(named);
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  std::vector<at::Tensor> sums;
  for (const at::Tensor& x : {first, second}) {
    model->zero_grad();
    model(x).pow(2).sum().backward();
    sums.push_back(model->weight.grad().clone());
    window.accumulate_sum(params, torch_gradients(named), static_cast<double>(x.size(0)));
  }
  write_gradients(named, window.finish_mean(params).gradients);
  // pending = (0 + 1 · g1) + 1 · g2; mean = (pending / 1) / 7, each step rounded in F32.
  const at::Tensor expected = ((sums[0] + sums[1]) / 1.0F) / 7.0F;
  CHECK(floats_of(model->weight.grad()) == floats_of(expected));

  const at::Tensor before = model->weight.detach().clone();
  torch::optim::SGD(model->parameters(), /*lr=*/1.0).step();
  CHECK(floats_of(model->weight) == floats_of(before - expected));
}

/// A finished mean of {0.25, 0.5, 0.75, 1} for each of `ids`, each a [2, 2] F32 parameter.
flat_gradients<B> quarter_mean(const std::vector<std::string>& ids) {
  parameter_set<B> params;
  gradients_params<B> grads;
  const at::Tensor g = torch::tensor({0.5F, 1.0F, 1.5F, 2.0F}).reshape({2, 2});
  for (const std::string& id : ids) {
    params.add(id, torch::zeros({2, 2}));
    grads.insert(id, g);
  }
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 2.0);
  return window.finish_mean(params).gradients;
}

TEST_CASE("write_gradients writes a .grad() that can take the values in place, and replaces any other") {
  at::Tensor freed = torch::ones({2, 2});
  freed.storage().unsafeGetStorageImpl()->reset();
  at::Tensor inference;
  {
    const c10::InferenceMode guard;
    inference = torch::ones({2, 2});
  }
  const std::vector<std::pair<std::string, at::Tensor>> grads = {
      {"dense", torch::full({2, 2}, 9.0F)},
      {"transposed", torch::full({2, 2}, 9.0F).t()},
      {"negated", at::_neg_view(torch::full({2, 2}, 9.0F))},
      {"undefined", at::Tensor()},
      {"expanded", torch::ones({1}).expand({2, 2})},
      {"slice", torch::ones({2, 4}).slice(1, 0, 4, 2)},
      {"double", torch::ones({2, 2}, torch::kDouble)},
      {"reshaped", torch::ones({4})},
      {"zero", at::_efficientzerotensor({2, 2}, at::TensorOptions().dtype(at::kFloat))},
      {"inference", inference},
      {"freed", freed},
  };
  torch::OrderedDict<std::string, at::Tensor> named;
  std::vector<std::string> ids;
  for (const auto& [id, grad] : grads) {
    named.insert(id, torch::zeros({2, 2}, torch::requires_grad()));
    named[id].mutable_grad() = grad;
    ids.push_back(id);
  }
  write_gradients(named, quarter_mean(ids));
  for (const auto& [id, before] : grads) {
    CAPTURE(id);
    const at::Tensor& grad = named[id].grad();
    REQUIRE(grad.defined());
    CHECK((grad.scalar_type() == at::kFloat));
    CHECK(grad.sizes() == at::IntArrayRef{2, 2});
    CHECK(floats_of(grad) == std::vector<float>{0.25F, 0.5F, 0.75F, 1});
    const bool in_place = id == "dense" || id == "transposed" || id == "negated";
    CHECK(grad.is_same(before) == in_place);
  }
}

TEST_CASE("write_gradients gives .grad()s that share memory new tensors, and writes disjoint views in place") {
  parameter_set<B> params;
  gradients_params<B> grads;
  const at::Tensor g = torch::tensor({0.5F, 1.0F, 1.5F, 2.0F}).reshape({2, 2});
  const std::string ids[] = {"a", "b", "c", "d"};
  for (int k = 0; k < 4; ++k) {
    params.add(ids[k], torch::zeros({2, 2}));
    grads.insert(ids[k], g * static_cast<float>(k + 1));
  }
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  torch::OrderedDict<std::string, at::Tensor> named;
  for (const std::string& id : ids) named.insert(id, torch::zeros({2, 2}, torch::requires_grad()));
  const at::Tensor shared = torch::full({2, 2}, 9.0F);
  const at::Tensor bucket = torch::full({8}, 9.0F);  // as DDP's gradient_as_bucket_view
  named["a"].mutable_grad() = shared;
  named["b"].mutable_grad() = shared;
  named["c"].mutable_grad() = bucket.narrow(0, 0, 4).view({2, 2});
  named["d"].mutable_grad() = bucket.narrow(0, 4, 4).view({2, 2});
  write_gradients(named, window.finish_mean(params).gradients);
  for (int k = 0; k < 4; ++k) {
    CAPTURE(ids[k]);
    CHECK(floats_of(named[ids[k]].grad()) == floats_of(g * static_cast<float>(k + 1)));
  }
  CHECK(floats_of(shared) == std::vector<float>(4, 9.0F));
  CHECK(floats_of(bucket) == floats_of(torch::cat({g.flatten() * 3.0F, g.flatten() * 4.0F})));
}

TEST_CASE("write_gradients checks every parameter before it writes any .grad()") {
  flat_gradients<B> mean = quarter_mean({"a", "b"});
  torch::OrderedDict<std::string, at::Tensor> named;
  named.insert("a", torch::zeros({2, 2}, torch::requires_grad()));
  const at::Tensor a_grad = torch::full({2, 2}, 9.0F);
  named["a"].mutable_grad() = a_grad;
  errc expected = errc::parameter_mismatch;
  SUBCASE("complex") {
    named.insert("b", torch::zeros({2, 2}, torch::dtype(torch::kComplexFloat).requires_grad(true)));
    expected = errc::invalid_dtype;
  }
  SUBCASE("sparse") {
    named.insert("b", torch::zeros({2, 2}).to_sparse().requires_grad_());
  }
  SUBCASE("meta") {
    named.insert("b", torch::zeros({2, 2}, torch::Device(torch::kMeta)).requires_grad_());
  }
  SUBCASE("more elements than the mean's") {
    named.insert("b", torch::zeros({5}, torch::requires_grad()));
  }
  SUBCASE("an empty mean for a parameter with elements") {
    named.insert("b", torch::zeros({2, 2}, torch::requires_grad()));
    parameter_set<B> params;
    params.add("a", torch::zeros({2, 2}));
    params.add("b", torch::zeros({0}));
    gradients_params<B> grads;
    grads.insert("a", torch::ones({2, 2}));
    grads.insert("b", torch::ones({0}));
    weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
    window.accumulate_sum(params, grads, 1.0);
    mean = window.finish_mean(params).gradients;
  }
  GRADACCUM_CHECK_REJECTED(write_gradients(named, mean), expected, "b");
  CHECK(named["a"].grad().is_same(a_grad));
  CHECK(floats_of(a_grad) == std::vector<float>(4, 9.0F));
  CHECK_FALSE(named["b"].grad().defined());
}

TEST_CASE("the helpers take named_parameters() as it is: ties once, frozen skipped, undefined .grad() absent") {
  Tied model;
  auto named = model->named_parameters();
  REQUIRE(named.size() == 4);
  const auto params = torch_parameters(named);
  REQUIRE(params.size() == 2);  // "tied_weight" is "weight"; "frozen" does not require grad
  CHECK(params[0].id == "weight");
  CHECK(params[1].id == "bias");
  CHECK(params[1].device == c10::Device(c10::kCPU));

  CHECK(torch_gradients(named).empty());  // nothing has a .grad() yet
  model->weight.mutable_grad() = torch::full({2, 3}, 2.0F);
  const auto grads = torch_gradients(named);
  CHECK(grads.size() == 1);
  CHECK(grads.contains("weight"));
  CHECK_FALSE(grads.contains("bias"));

  SUBCASE("write_gradients allocates .grad() in the parameter's dtype and clears absent ones") {
    model->to(torch::kBFloat16);
    named = model->named_parameters();
    const auto bf16_params = torch_parameters(named);
    model->bias.mutable_grad() = torch::ones({3}, torch::kBFloat16);  // stale, from a backward pass
    weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
    gradients_params<B> only_weight;
    only_weight.insert("weight", torch::full({2, 3}, 1.0F + 0x3p-9F));  // not a BF16 value
    window.accumulate_sum(bf16_params, only_weight, 1.0);
    model->weight.mutable_grad().reset();
    write_gradients(named, window.finish_mean(bf16_params).gradients);
    REQUIRE(model->weight.grad().defined());
    CHECK(std::string(c10::toString(model->weight.grad().scalar_type())) == "BFloat16");
    CHECK(model->weight.grad().device() == model->weight.device());
    // BF16's neighbours of 1 + 3 · 2^-9 are 1 and 1 + 2^-7: the nearer one, not the truncation.
    CHECK(floats_of(model->weight.grad()) == std::vector<float>(6, 1.0F + 0x1p-7F));
    CHECK_FALSE(model->bias.grad().defined());  // absent from the mean: no stale step
  }
  SUBCASE("write_gradients refuses values that do not fit a parameter and writes nothing") {
    torch::OrderedDict<std::string, at::Tensor> other;
    const at::Tensor small = torch::zeros({2}, torch::requires_grad());
    other.insert("bias", torch::zeros({3}, torch::requires_grad()));
    other.insert("weight", small);
    weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
    window.accumulate_sum(params, grads, 1.0);
    const auto mean = window.finish_mean(params);
    GRADACCUM_CHECK_REJECTED(write_gradients(other, mean.gradients), errc::parameter_mismatch, "weight");
    CHECK_FALSE(other["bias"].grad().defined());
    CHECK_FALSE(small.grad().defined());
  }
}

}  // namespace
}  // namespace gradaccum::test
