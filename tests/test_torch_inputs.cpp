// What goes into the libtorch backend: torch::Tensors of any dtype go in as they are (the typed
// handle is chosen from scalar_type() at insert), non-contiguous and lazily transformed tensors
// are read as their values, refusals are gradaccum errors that change nothing, and the adds of a
// call give the bits of one add at a time. Agreement with the Eigen and xtensor backends, and
// checkpoints across the three, are in test_torch_backends.cpp (linked into the same test
// executable); the module helpers are in test_torch_modules.cpp; the accumulation contract itself
// runs over torch_backend in the conformance suite (conformance.hpp).
#include "test_torch_support.hpp"

#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <gradaccum/gradaccum.hpp>

#include "test_helpers.hpp"

namespace gradaccum::test {
namespace {

using B = torch_backend;

/// The pending or finished values of `id` as a vector, read from the tensor viewing them.
template <class W>
std::vector<W> values(const flat_gradients<B>& g, std::string_view id) {
  const std::optional<at::Tensor> v = g.template get<W>(id);
  REQUIRE_MESSAGE(v.has_value(), "no values for '" << std::string(id) << "'");
  const at::Tensor host = v->contiguous().cpu();
  return {host.data_ptr<W>(), host.data_ptr<W>() + host.numel()};
}

TEST_CASE("a torch::Tensor goes in as the typed handle of its scalar_type, read in place") {
  parameter_set<B> params;
  const at::ScalarType dtypes[] = {at::kHalf, at::kBFloat16, at::kFloat, at::kDouble};
  gradients_params<B> grads;
  std::vector<at::Tensor> kept;
  for (const at::ScalarType dtype : dtypes) {
    const std::string id = std::string("p.") + c10::toString(dtype);
    params.add(id, torch::zeros({2, 2}, dtype));
    kept.push_back(torch::tensor({1.0, 2.0, -0.5, 4.0}, dtype).reshape({2, 2}));
    grads.insert(id, kept.back());
  }
  CHECK(grads.dtype("p.Half") == float_dtype::f16);
  CHECK(grads.dtype("p.BFloat16") == float_dtype::bf16);
  CHECK(grads.dtype("p.Float") == float_dtype::f32);
  CHECK(grads.dtype("p.Double") == float_dtype::f64);
  REQUIRE(grads.get<c10::BFloat16>("p.BFloat16") != nullptr);
  // The same storage as the caller's tensor, not a copy.
  CHECK(grads.get<c10::BFloat16>("p.BFloat16")->tensor().data_ptr() == kept[1].data_ptr());

  kept[2].mul_(2.0);  // after insert, before accumulate: the accumulator must see it
  weighted_gradients_accumulator<B> window(float_dtype::f64, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  CHECK(values<double>(window.pending(), "p.Half") == std::vector<double>{1, 2, -0.5, 4});
  CHECK(values<double>(window.pending(), "p.BFloat16") == std::vector<double>{1, 2, -0.5, 4});
  CHECK(values<double>(window.pending(), "p.Float") == std::vector<double>{2, 4, -1, 8});
  CHECK(values<double>(window.pending(), "p.Double") == std::vector<double>{1, 2, -0.5, 4});
}

TEST_CASE("non-contiguous tensors (transpose, strided slice, expand, offset) read as their values") {
  const at::Tensor base = torch::arange(1, 13, torch::kFloat).reshape({4, 3});  // 1..12
  const at::Tensor wide = torch::arange(1, 25, torch::kFloat).reshape({3, 8});
  const at::Tensor row = torch::tensor({1.0F, -2.0F, 3.0F, -4.0F});
  const at::Tensor inputs[] = {
      base.t(),                                                             // column-major 3 x 4
      wide.slice(/*dim=*/1, 0, 8, /*step=*/2),                              // every other column
      row.expand({3, 4}),                                                   // stride 0
      wide.narrow(0, 1, 2).narrow(1, 2, 4).repeat({2, 1}).narrow(0, 1, 3),  // storage offset
  };
  parameter_set<B> params;
  params.add("w", torch::zeros({3, 4}));
  for (const at::Tensor& g : inputs) {
    CAPTURE(g.strides());
    gradients_params<B> grads;
    grads.insert("w", g);
    weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
    window.accumulate_mean(params, grads, 2.0);
    std::vector<float> expected = floats_of(g.contiguous());
    for (float& x : expected) x *= 2.0F;
    CHECK(values<float>(window.pending(), "w") == expected);
  }
}

TEST_CASE("gradients that do not fit are refused with a gradaccum::error and change nothing") {
  parameter_set<B> params;
  params.add("w", torch::zeros({2, 3}));
  params.add("b", torch::zeros({3}));
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  gradients_params<B> good;
  good.insert("w", torch::ones({2, 3}));
  window.accumulate_sum(params, good, 2.0);
  const weighted_gradients_record before = window.try_to_record();

  SUBCASE("a dtype that is not F16, BF16, F32 or F64, at insert") {
    gradients_params<B> grads;
    grads.insert("b", torch::ones({3}));
    GRADACCUM_CHECK_REJECTED(grads.insert("w", torch::ones({2, 3}, torch::kInt64)), errc::invalid_dtype, "w");
    GRADACCUM_CHECK_REJECTED(grads.insert_or_assign("b", torch::ones({3}, torch::kComplexFloat)), errc::invalid_dtype,
                             "b");
    CHECK(grads.size() == 1);
    CHECK(grads.dtype("b") == float_dtype::f32);  // the earlier gradient is kept
    GRADACCUM_CHECK_REJECTED(params.add("steps", torch::zeros({1}, torch::kInt32)), errc::invalid_dtype, "steps");
    CHECK(params.size() == 2);
  }
  SUBCASE("undefined, sparse and meta tensors, at insert") {
    gradients_params<B> grads;
    GRADACCUM_CHECK_REJECTED(grads.insert("w", at::Tensor()), errc::parameter_mismatch, "w");
    GRADACCUM_CHECK_REJECTED(grads.insert("w", torch::ones({2, 3}).to_sparse()), errc::parameter_mismatch, "w");
    // The only other device of a CPU build, and it holds no values.
    GRADACCUM_CHECK_REJECTED(grads.insert("w", torch::ones({2, 3}, torch::Device(torch::kMeta))),
                             errc::parameter_mismatch, "w");
    GRADACCUM_CHECK_REJECTED(grads.insert("w", torch::ones({2, 3}).to_mkldnn()), errc::parameter_mismatch, "w");
    CHECK(grads.empty());
  }
  SUBCASE("tensors whose memory does not hold their values, at insert, as gradients and as parameters") {
    at::Tensor freed = torch::ones({2, 3});
    freed.storage().unsafeGetStorageImpl()->reset();  // storage released: no data, 0 bytes
    at::Tensor shrunk = torch::ones({4, 3});
    const at::Tensor tail = shrunk.narrow(0, 2, 2);
    shrunk.storage().set_nbytes(2 * 3 * sizeof(float));  // ends before `tail` starts
    const at::Tensor nested = at::_nested_tensor_from_tensor_list({torch::ones({3}), torch::ones({2})});
    const at::Tensor quantized = at::quantize_per_tensor(torch::ones({2, 3}), 0.5, 0, at::kQInt8);
    const at::Tensor conjugated = torch::ones({3}, torch::kComplexFloat).conj();
    REQUIRE(conjugated.is_conj());
    gradients_params<B> grads;
    for (const at::Tensor& bad : {freed, tail, nested}) {
      GRADACCUM_CHECK_REJECTED(grads.insert("w", bad), errc::parameter_mismatch, "w");
      GRADACCUM_CHECK_REJECTED(params.add("q", bad), errc::parameter_mismatch, "q");
    }
    GRADACCUM_CHECK_REJECTED(torch_tensor<float>(freed), errc::parameter_mismatch, "");
    GRADACCUM_CHECK_REJECTED(grads.insert("w", quantized), errc::invalid_dtype, "w");
    GRADACCUM_CHECK_REJECTED(grads.insert("b", conjugated), errc::invalid_dtype, "b");
    CHECK(grads.empty());
    CHECK(params.size() == 2);
  }
  SUBCASE("a shape that differs from the parameter's, at accumulate") {
    gradients_params<B> grads;
    grads.insert("b", torch::ones({3}));
    grads.insert("w", torch::ones({3, 2}));
    GRADACCUM_CHECK_REJECTED(window.accumulate_sum(params, grads, 1.0), errc::parameter_mismatch, "w");
    gradients_params<B> transposed;  // same elements, other shape
    transposed.insert("w", torch::ones({3, 2}).t().t());
    GRADACCUM_CHECK_REJECTED(window.accumulate_sum(params, transposed, 1.0), errc::parameter_mismatch, "w");
  }
  GRADACCUM_CHECK_SAME_BITS(window.try_to_record(), before);
  CHECK(window.state().microbatches == 1);
}

TEST_CASE("lazily transformed tensors go in as their values: negation bit resolved, a zero tensor as zeros") {
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor base = torch::tensor({1.0F, -2.0F, 3.0F, 0.5F, -0.25F, 6.0F}).reshape({3, 2});
  const at::Tensor negated = at::_neg_view(base.t());  // memory holds +x; read through strides
  const at::Tensor zero = at::_efficientzerotensor({3}, f32);
  REQUIRE(negated.is_neg());
  REQUIRE((zero._is_zerotensor() && zero.data_ptr() == nullptr));
  parameter_set<B> params;  // as parameters only their geometry counts
  params.add("w", at::_neg_view(torch::zeros({2, 3})));
  params.add("z", at::_efficientzerotensor({3}, f32));
  CHECK(params[0].shape == tensor_shape{2, 3});
  CHECK(params[1].shape == tensor_shape{3});

  gradients_params<B> lazy;
  lazy.insert("w", negated);
  lazy.insert("z", zero);
  gradients_params<B> plain;
  plain.insert("w", negated.resolve_neg());
  plain.insert("z", torch::zeros({3}));
  GRADACCUM_CHECK_SAME_BITS(lazy.to_record(), plain.to_record());
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, lazy, 1.0);
  CHECK(values<float>(window.pending(), "w") == std::vector<float>{-1, -3, 0.25F, 2, -0.5F, -6});
  CHECK(values<float>(window.pending(), "z") == std::vector<float>{0, 0, 0});

  // And as a module's .grad(), through torch_gradients.
  torch::OrderedDict<std::string, at::Tensor> named;
  named.insert("w", torch::zeros({2, 3}, torch::requires_grad()));
  named.insert("z", torch::zeros({3}, torch::requires_grad()));
  named["w"].mutable_grad() = negated;
  named["z"].mutable_grad() = zero;
  window.accumulate_sum(params, torch_gradients(named), 1.0);
  CHECK(values<float>(window.pending(), "w") == std::vector<float>{-2, -6, 0.5F, 4, -1, -12});
  CHECK(values<float>(window.pending(), "z") == std::vector<float>{0, 0, 0});
}

TEST_CASE("a result reshaped in place by the caller does not reach the next window's adds") {
  parameter_set<B> params;
  params.add("w", at::zeros({2, 3}));
  const at::Tensor g = at::arange(6, at::kFloat).view({2, 3});
  gradients_params<B> grads;
  grads.insert("w", g);
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  {
    const auto first = window.finish_sums();
    at::Tensor result = *first.gradients.get<float>("w");
    result.t_();  // its sizes and strides, in place
    CHECK(result.sizes() == at::IntArrayRef{3, 2});
  }  // the buffer goes back to the window, which reuses it
  window.accumulate_sum(params, grads, 1.0);
  const auto second = window.finish_sums();
  const at::Tensor result = *second.gradients.get<float>("w");
  CHECK(result.sizes() == at::IntArrayRef{2, 3});
  CHECK(values<float>(second.gradients, "w") == std::vector<float>{0, 1, 2, 3, 4, 5});
}

/// `window`'s pending values of `id` against `expected`, bit for bit.
void check_bits(const flat_gradients<B>& pending, const std::string& id, const std::vector<float>& expected) {
  CAPTURE(id);
  const std::vector<float> got = values<float>(pending, id);
  REQUIRE(got.size() == expected.size());
  std::size_t differing = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    differing += std::bit_cast<std::uint32_t>(got[i]) != std::bit_cast<std::uint32_t>(expected[i]);
  CHECK(differing == 0);
}

/// sums[id] = sums[id] + float(g) · w, element by element, two roundings: the contract's add.
void add_expected(std::vector<float>& sums, const at::Tensor& g, float w) {
  const std::vector<float> x = floats_of(g);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float product = x[i] * w;
    sums[i] = sums[i] + product;
  }
}

TEST_CASE("the adds of a call go out together and give the bits of one add at a time") {
  torch::manual_seed(7);
  SUBCASE("300 small parameters of every input form, summed and weighted") {
    parameter_set<B> params;
    std::vector<std::string> ids;
    std::vector<std::vector<float>> expected;
    for (int k = 0; k < 300; ++k) {
      ids.push_back("p" + std::to_string(k));
      const std::vector<std::int64_t> shape = k % 3 == 0   ? std::vector<std::int64_t>{3, 5}
                                              : k % 3 == 1 ? std::vector<std::int64_t>{7}
                                                           : std::vector<std::int64_t>{2, 3, 4};
      params.add(ids.back(), torch::zeros(shape));
      expected.emplace_back(static_cast<std::size_t>(at::zeros(shape).numel()), 0.0F);
    }
    weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
    std::size_t microbatch = 0;
    for (const float w : {1.0F, 0.3F, 1.0F, 1.7F}) {
      gradients_params<B> grads;
      ++microbatch;
      for (std::size_t k = 0; k < ids.size(); ++k) {
        if ((k + microbatch) % 11 == 5) continue;  // absent from this microbatch
        const at::Tensor plain = torch::randn(params[k].shape.rank() == 1   ? std::vector<std::int64_t>{7}
                                              : params[k].shape.rank() == 2 ? std::vector<std::int64_t>{3, 5}
                                                                            : std::vector<std::int64_t>{2, 3, 4});
        at::Tensor g;
        switch (k % 5) {
          case 0: g = plain; break;                                                  // F32, contiguous
          case 1: g = plain.to(at::kBFloat16); break;                                // converted
          case 2: g = plain.dim() == 2 ? plain.t().contiguous().t() : plain; break;  // transposed
          case 3: g = at::_neg_view(plain.neg()); break;                             // negation bit
          default: g = plain.to(at::kHalf); break;
        }
        grads.insert(ids[k], g);
        add_expected(expected[k], g, w);
      }
      if (w == 1.0F) {
        window.accumulate_sum(params, grads, 1.0);
      } else {
        window.accumulate_mean(params, grads, w);
      }
    }
    for (std::size_t k = 0; k < ids.size(); ++k) check_bits(window.pending(), ids[k], expected[k]);
  }
  SUBCASE("gradients larger than the scratch, and staged ones that fill it") {
    // The scratch holds 4 Mi elements: "huge" is added in pieces of rows, and of one row's
    // elements; "big" in pieces of 2,048 rows; "m1" and "m2" (3 Mi and 2 Mi) do not fit together.
    const std::vector<std::pair<std::string, std::vector<std::int64_t>>> shapes = {
        {"huge", {2, 4194305}}, {"big", {2049, 2048}}, {"m1", {3, 1048576}}, {"m2", {2, 1048576}}};
    parameter_set<B> params;
    std::vector<std::vector<float>> expected;
    for (const auto& [id, shape] : shapes) {
      params.add(id, torch::zeros(shape));
      expected.emplace_back(static_cast<std::size_t>(shape[0] * shape[1]), 0.0F);
    }
    weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
    for (const float w : {0.3F, 1.7F}) {
      gradients_params<B> grads;
      for (std::size_t k = 0; k < shapes.size(); ++k) {
        const at::Tensor g = torch::randn(shapes[k].second).to(at::kBFloat16);
        grads.insert(shapes[k].first, g);
        add_expected(expected[k], g, w);
      }
      window.accumulate_mean(params, grads, w);
    }
    for (std::size_t k = 0; k < shapes.size(); ++k) check_bits(window.pending(), shapes[k].first, expected[k]);
  }
}

}  // namespace
}  // namespace gradaccum::test
