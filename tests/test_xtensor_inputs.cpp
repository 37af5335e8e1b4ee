// What goes into the xtensor backend as a parameter or gradient: containers of any type and
// layout, adaptors of const and mutable memory, strided views (read in place through their
// strides) and expressions (evaluated once, at insert), each giving the same bits as the plain
// row-major xt::xarray holding the same values. Also reading in place, shape refusals and no
// allocation in steady state.
#include <algorithm>
#include <array>
#include <cstddef>
#include <vector>

#include <doctest/doctest.h>
#if __has_include(<xtensor/containers/xtensor.hpp>)
#include <xtensor/containers/xadapt.hpp>
#include <xtensor/containers/xfixed.hpp>
#include <xtensor/containers/xtensor.hpp>
#include <xtensor/generators/xbuilder.hpp>
#include <xtensor/misc/xmanipulation.hpp>
#include <xtensor/views/xstrided_view.hpp>
#include <xtensor/views/xview.hpp>
#else
#include <xtensor/xadapt.hpp>
#include <xtensor/xbuilder.hpp>
#include <xtensor/xfixed.hpp>
#include <xtensor/xmanipulation.hpp>
#include <xtensor/xstrided_view.hpp>
#include <xtensor/xtensor.hpp>
#include <xtensor/xview.hpp>
#endif

#include <gradaccum/backends/xtensor.hpp>
#include <gradaccum/gradaccum.hpp>

#include "alloc_failure.hpp"
#include "input_checks.hpp"

namespace gradaccum::test {
namespace {

using B = xtensor_backend;

/// A row-major array of `shape` holding 0.1 · (1 + i) at row-major position i.
xt::xarray<float> counting(const std::vector<std::size_t>& shape) {
  xt::xarray<float> a = xt::xarray<float>::from_shape(shape);
  for (std::size_t i = 0; i < a.size(); ++i) a.data()[i] = 0.1F * static_cast<float>(i + 1);
  return a;
}

template <class E>
std::vector<float> row_major_of(const E& e) {
  const xt::xarray<float> a = e;
  return {a.data(), a.data() + a.size()};
}

TEST_CASE("containers of any type, rank and layout are read in place") {
  const xt::xarray<float> a = counting({2, 3});
  const auto g = row_major_of(a);
  check_kind<B>(a, a, tensor_shape{2, 3}, g);
  const xt::xtensor<float, 2> t = a;
  check_kind<B>(t, t, tensor_shape{2, 3}, g);
  const xt::xtensor_fixed<float, xt::xshape<2, 3>> f = a;
  check_kind<B>(f, f, tensor_shape{2, 3}, g);
  const xt::xarray<float, xt::layout_type::column_major> cm = a;
  check_kind<B>(cm, cm, tensor_shape{2, 3}, g);
  const xt::xtensor<float, 2, xt::layout_type::column_major> tcm = a;
  check_kind<B>(tcm, tcm, tensor_shape{2, 3}, g);
  const xt::xtensor<float, 1> bias = {0.1F, 0.2F, 0.3F};
  check_kind<B>(bias, bias, tensor_shape{3}, {0.1F, 0.2F, 0.3F});
  const xt::xarray<float> kernel = counting({2, 3, 4, 5});
  const xt::xtensor<float, 4, xt::layout_type::column_major> kernel_cm = kernel;
  check_kind<B>(kernel, kernel_cm, tensor_shape{2, 3, 4, 5}, row_major_of(kernel));
  const xt::xarray<float> scalar = 0.5F;
  check_kind<B>(scalar, scalar, tensor_shape{}, {0.5F});
}

TEST_CASE("adaptors of const and mutable memory, views, transposes and strided views") {
  const xt::xarray<float> big = counting({4, 5});
  SUBCASE("adaptors") {
    std::vector<float> buffer{0.5F, 1.5F, 2.5F, 3.5F, 4.5F, 5.5F};
    const std::vector<std::size_t> shape{2, 3};
    auto mutable_memory = xt::adapt(buffer.data(), buffer.size(), xt::no_ownership(), shape);
    check_kind<B>(mutable_memory, mutable_memory, tensor_shape{2, 3}, buffer);
    const auto const_memory =
        xt::adapt(static_cast<const float*>(buffer.data()), buffer.size(), xt::no_ownership(), shape);
    check_kind<B>(const_memory, const_memory, tensor_shape{2, 3}, buffer);
    auto of_vector = xt::adapt(buffer, shape);
    check_kind<B>(of_vector, of_vector, tensor_shape{2, 3}, buffer);
  }
  SUBCASE("a 2 x 3 view of a 4 x 5 array: element (0, 2) is big(1, 3)") {
    const auto view = xt::view(big, xt::range(1, 3), xt::range(1, 4));
    const auto g = row_major_of(view);
    CHECK(g[2] == big(1, 3));
    check_kind<B>(view, view, tensor_shape{2, 3}, g);
    const xt::xarray<float, xt::layout_type::column_major> big_cm = big;
    check_kind<B>(view, xt::view(big_cm, xt::range(1, 3), xt::range(1, 4)), tensor_shape{2, 3}, g);
    check_kind<B>(xt::view(big, 2), xt::view(big, 2), tensor_shape{5}, row_major_of(xt::view(big, 2)));
    check_kind<B>(xt::view(big, xt::all(), 1), xt::view(big, xt::all(), 1), tensor_shape{4},
                  row_major_of(xt::view(big, xt::all(), 1)));
  }
  SUBCASE("a transpose: element (0, 2) of the transpose of a 3 x 2 array is m(2, 0)") {
    const xt::xarray<float> m = counting({3, 2});
    const auto g = row_major_of(xt::transpose(m));
    CHECK(g[2] == m(2, 0));
    check_kind<B>(xt::transpose(m), xt::transpose(m), tensor_shape{2, 3}, g);
    const xt::xarray<float> kernel = counting({2, 3, 4, 5});
    check_kind<B>(xt::transpose(kernel), xt::transpose(kernel), tensor_shape{5, 4, 3, 2},
                  row_major_of(xt::transpose(kernel)));
  }
  SUBCASE("strided views, with steps and negative steps") {
    const auto stepped = xt::strided_view(big, {xt::range(0, 4, 2), xt::range(4, xt::placeholders::_, -2)});
    check_kind<B>(stepped, stepped, tensor_shape{2, 3}, row_major_of(stepped));
    const auto reversed = xt::view(big, xt::range(3, xt::placeholders::_, -1), xt::all());
    check_kind<B>(reversed, reversed, tensor_shape{4, 5}, row_major_of(reversed));
  }
}

TEST_CASE("expressions are evaluated once, at insert") {
  xt::xarray<float> h = counting({2, 3});
  check_kind<B>(h, 2.0F * h, tensor_shape{2, 3}, row_major_of(2.0F * h));
  check_kind<B>(h, xt::ones<float>({2, 3}), tensor_shape{2, 3}, std::vector<float>(6, 1.0F));

  parameter_set<B> params;
  params.add("p", h + 1.0F);
  gradients_params<B> grads;
  grads.insert("p", 3.0F * h);
  const auto tripled = row_major_of(3.0F * h);
  h.fill(0.0F);  // the operand changes after insert: the stored values do not
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  const auto pending = window.pending().values<float>("p");
  CHECK(std::vector<float>(pending.begin(), pending.end()) == tripled);
  CHECK(grads.get<float>("p") != nullptr);  // an owned tensor
}

TEST_CASE("a temporary container is copied at insert, not viewed") {
  parameter_set<B> params;
  params.add("t", xt::xtensor<float, 2>::from_shape({2, 3}));
  params.add("f", xt::xtensor_fixed<float, xt::xshape<3>>{});
  CHECK(params[1].shape == tensor_shape{3});
  gradients_params<B> grads;
  grads.insert("t", xt::xtensor<float, 2, xt::layout_type::column_major>(counting({2, 3})));
  grads.insert("f", xt::xtensor_fixed<float, xt::xshape<3>>{1.0F, 2.0F, 3.0F});
  CHECK(grads.get<float>("t") != nullptr);
  CHECK(grads.get<float>("f") != nullptr);
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  const auto t = window.pending().values<float>("t");
  CHECK(std::vector<float>(t.begin(), t.end()) == row_major_of(counting({2, 3})));
  const auto f = window.pending().values<float>("f");
  CHECK(std::vector<float>(f.begin(), f.end()) == std::vector<float>{1.0F, 2.0F, 3.0F});
}

TEST_CASE("a container given as an lvalue is copied at insert: `c += 1` on a temporary is safe") {
  parameter_set<B> params;
  params.add("t", xt::xtensor<float, 2>::from_shape({30, 40}));
  params.add("c", xt::xtensor<float, 2>::from_shape({2, 3}));
  gradients_params<B> grads;
  // An lvalue reference to a temporary: copied while the temporary lives.
  grads.insert("t", xt::xtensor<float, 2>(std::array<std::size_t, 2>{30, 40}, 0.0F) += 1.0F);
  xt::xtensor<float, 2, xt::layout_type::column_major> c = counting({2, 3});
  grads.insert("c", c);
  c.fill(0.0F);  // a copy: later writes are not seen
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  CHECK(window.pending().values<float>("c")[5] == 0.1F * 6.0F);
  CHECK(allocations_of([&] { grads.insert_or_assign("c", c); }) == 0);  // the entry's storage, reused
  window.accumulate_sum(params, grads, 1.0);
  CHECK(window.pending().values<float>("c")[5] == 0.1F * 6.0F);
  const auto t = window.pending().values<float>("t");
  CHECK(t.size() == 1200);
  CHECK(std::all_of(t.begin(), t.end(), [](float x) { return x == 2.0F; }));
}

TEST_CASE("in-place inputs are read when accumulated: later writes to the caller's memory are seen") {
  xt::xarray<float> big = counting({4, 5});
  xt::xtensor<float, 1> bias = {1.0F, 1.0F, 1.0F};
  parameter_set<B> params;
  params.add("view", xt::view(big, xt::range(1, 3), xt::range(1, 4)));
  params.add("transpose", xt::transpose(big));
  params.add("bias", bias);
  gradients_params<B> grads;
  grads.insert("view", xt::view(big, xt::range(1, 3), xt::range(1, 4)));
  grads.insert("transpose", xt::transpose(big));
  grads.insert("bias", gradaccum::view(bias));  // a container: read in place only when asked
  CHECK(grads.get<float>("view") == nullptr);

  big(1, 3) = 100.0F;  // element (0, 2) of the view, element (3, 1) of the transpose
  bias(2) = 7.0F;
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  CHECK(window.pending().values<float>("view")[2] == 100.0F);
  CHECK(window.pending().values<float>("transpose")[3 * 4 + 1] == 100.0F);
  CHECK(window.pending().values<float>("bias")[2] == 7.0F);
}

TEST_CASE("16-bit gradients of any layout widen exactly, like their plain arrays") {
  xt::xarray<f16_bits, xt::layout_type::column_major> bits = xt::xarray<f16_bits>::from_shape({2, 3});
  const std::uint16_t patterns[] = {0x3c00, 0xc000, 0x0001, 0x7bff, 0x3555, 0x0400};  // row-major
  for (std::size_t i = 0; i < 6; ++i) bits(i / 3, i % 3) = f16_bits{patterns[i]};
  parameter_set<B> params;
  params.add("p", xt::xarray<float>::from_shape({2, 3}));
  gradients_params<B> grads;
  grads.insert("p", bits);
  weighted_gradients_accumulator<B> window(float_dtype::f64, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  const auto pending = window.pending().values<double>("p");
  CHECK(pending[0] == 1.0);
  CHECK(pending[1] == -2.0);
  CHECK(pending[2] == 0x1p-24);
  CHECK(pending[3] == 65504.0);
}

TEST_CASE("a gradient of another shape is refused, and nothing changes") {
  const xt::xarray<float> big = counting({4, 5});
  parameter_set<B> params;
  params.add("w", xt::xtensor<float, 2>::from_shape({2, 3}));
  params.add("b", xt::xtensor<float, 1>::from_shape({3}));
  gradients_params<B> grads;
  grads.insert("w", xt::view(big, xt::range(0, 2), xt::range(0, 3)));
  grads.insert("b", xt::view(big, 0, xt::range(0, 3)));
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  const weighted_gradients_record before = window.try_to_record();
  const auto refused = [&](const char* id, const auto& gradient) {
    check_refused(window, params, grads, before, 1, id, gradient);
  };
  refused("w", xt::transpose(xt::view(big, xt::range(0, 2), xt::range(0, 3))));
  refused("w", xt::view(big, 0, xt::range(0, 6)));
  refused("b", xt::view(big, xt::range(0, 1), xt::range(0, 3)));  // [1, 3] is not [3] here
  refused("b", 2.0F * xt::view(big, 0, xt::range(0, 4)));
}

TEST_CASE("accumulating in-place views allocates nothing in steady state") {
  const xt::xarray<float> big = counting({64, 48});
  const xt::xtensor<float, 4, xt::layout_type::column_major> kernel = counting({4, 3, 3, 3});
  parameter_set<B> params;
  gradients_params<B> grads;
  const auto view = xt::view(big, xt::range(1, 31), xt::range(2, 22));
  const auto transposed = xt::transpose(big);
  params.add("view", view);
  params.add("transpose", transposed);
  params.add("kernel", kernel);
  grads.insert("view", view);
  grads.insert("transpose", transposed);
  grads.insert("kernel", kernel);
  check_no_allocation_in_steady_state(params, grads);
}

}  // namespace
}  // namespace gradaccum::test
