// What only the xtensor backend promises: its tensor and view types, in-place views of caller
// memory, its 16-bit storage types, row-major records of xtensor storage of any rank. The
// accumulation contract, agreement with the other backends and allocation behaviour run against
// xtensor in the conformance suite (conformance.hpp) and test_alloc_failure.cpp.
//
// Built twice: plainly, and with XTENSOR_USE_XSIMD against xtensor's 0.26+ header layout
// (GRADACCUM_TEST_XSIMD_FOLDERED), so both configurations pass the same tests.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>
#if __has_include(<xtensor/containers/xadapt.hpp>)
#include <xtensor/containers/xadapt.hpp>
#else
#include <xtensor/xadapt.hpp>
#endif

#include <gradaccum/backends/xtensor.hpp>
#include <gradaccum/gradaccum.hpp>

#include "test_helpers.hpp"

#ifdef GRADACCUM_TEST_XSIMD_FOLDERED
#ifndef XTENSOR_USE_XSIMD
#error "this build is meant to use xsimd"
#endif
#ifndef GRADACCUM_TEST_FOLDERED_XARRAY_INCLUDED
#error "<gradaccum/backends/xtensor.hpp> did not include xtensor's 0.26+ header layout"
#endif
#elif defined(XTENSOR_USE_XSIMD)
#error "this build is meant to run without xsimd"
#endif

namespace gradaccum::test {
namespace {

using B = xtensor_backend;
using shape_type = B::shape_type;

/// Row-major array of the given shape holding 1, 2, 3, ... (exact in every dtype used here).
template <class T>
xt::xarray<T> counting(const shape_type& dims) {
  xt::xarray<T> array(dims);
  for (std::size_t i = 0; i < array.size(); ++i) array.data()[i] = static_cast<T>(i + 1);
  return array;
}

TEST_CASE("tensors are xt::xarray, views are strided views of caller memory, results are xt::adapt views") {
  static_assert(std::is_same_v<B::tensor<float>, xt::xarray<float>>);
  static_assert(std::is_same_v<B::tensor<double>, xt::xarray<double>>);
  static_assert(std::is_same_v<B::tensor<f16_bits>, xt::xarray<f16_bits>>);
  static_assert(std::is_same_v<B::view<float>, strided_view<const float>>);

  const std::vector<float> buffer{1, 2, 3, 4, 5, 6};
  const auto adapted = xt::adapt(buffer.data(), buffer.size(), xt::no_ownership(), shape_type{2, 3});
  static_assert(std::is_same_v<std::remove_const_t<decltype(adapted)>, B::result_view<float>>);

  const B::view<float> view = B::view_of(buffer.data(), {2, 3});
  CHECK(view.data() == buffer.data());  // the caller's memory, not a copy
  CHECK(B::shape(view) == tensor_shape{2, 3});
  CHECK(B::view_of(adapted).data() == buffer.data());
}

TEST_CASE("gradients given as views are read in place when accumulated, never copied") {
  parameter_set<B> params;
  params.add("w", xt::xarray<float>::from_shape({2, 3}));
  std::vector<float> buffer{1, 2, 3, 4, 5, 6};
  gradients_params<B> grads;
  grads.insert("w", B::view_of(static_cast<const float*>(buffer.data()), {2, 3}));
  CHECK(grads.get<float>("w") == nullptr);  // `get` returns owned tensors only
  CHECK(grads.dtype("w") == float_dtype::f32);

  buffer[4] = 50;  // after insert, before accumulate: the accumulator must see it
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_mean(params, grads, 2.0);

  const xt::xarray<float> expected{{2, 4, 6}, {8, 100, 12}};
  CHECK(*window.pending().get<float>("w") == expected);
  CHECK(buffer == std::vector<float>{1, 2, 3, 4, 50, 6});  // the caller's memory is only read
}

TEST_CASE_TEMPLATE("16-bit gradients widen exactly, from tensors and from views", T, f16_bits, bf16_bits) {
  // ±1, -2, the smallest subnormal and the largest finite value of each format.
  const std::vector<double> values = dtype_of<T> == float_dtype::f16
                                         ? std::vector<double>{1.0, -2.0, 0x1p-24, 65504.0}
                                         : std::vector<double>{1.0, -2.0, 0x1p-133, 0x1.fep127};
  std::vector<T> bits(values.size());
  std::transform(values.begin(), values.end(), bits.begin(), to_element<T>);

  parameter_set<B> params;
  params.add("owned", xt::xarray<float>::from_shape({2, 2}));
  params.add("viewed", xt::xarray<float>::from_shape({2, 2}));
  xt::xarray<T> owned = xt::xarray<T>::from_shape({2, 2});
  std::copy(bits.begin(), bits.end(), owned.data());
  gradients_params<B> grads;
  grads.insert("owned", owned);
  grads.insert("viewed", B::view_of(static_cast<const T*>(bits.data()), {2, 2}));

  weighted_gradients_accumulator<B> window(float_dtype::f64, 1.0);
  window.accumulate_sum(params, grads, 7.0);
  for (const char* id : {"owned", "viewed"}) {
    CAPTURE(id);
    const auto pending = window.pending().get<double>(id);
    REQUIRE(pending.has_value());
    CHECK(std::vector<double>(pending->begin(), pending->end()) == values);
  }
}

TEST_CASE("16-bit gradients round-trip through a record bit for bit, NaN payloads included") {
  parameter_set<B> params;
  params.add("h", xt::xarray<float>::from_shape({3}));
  params.add("b", xt::xarray<float>::from_shape({1, 2}));
  xt::xarray<f16_bits> h{f16_bits{0x3c00}, f16_bits{0x7e01}, f16_bits{0x8001}};
  xt::xarray<bf16_bits> b{{bf16_bits{0xffc1}, bf16_bits{0x0080}}};
  gradients_params<B> grads;
  grads.insert("h", h);
  grads.insert("b", b);

  const gradients_params_record record = grads.to_record();
  REQUIRE(record.tensors.size() == 2);
  CHECK(record.tensors[0].id == "b");  // sorted by id
  CHECK(record.tensors[0].dtype == float_dtype::bf16);
  CHECK(std::get<std::vector<std::uint16_t>>(record.tensors[0].values) == std::vector<std::uint16_t>{0xffc1, 0x0080});
  CHECK(std::get<std::vector<std::uint16_t>>(record.tensors[1].values) ==
        std::vector<std::uint16_t>{0x3c00, 0x7e01, 0x8001});

  const auto restored = gradients_params<B>::from_record(params, record);
  REQUIRE(restored.get<f16_bits>("h") != nullptr);
  CHECK(*restored.get<f16_bits>("h") == h);
  REQUIRE(restored.get<bf16_bits>("b") != nullptr);
  CHECK(*restored.get<bf16_bits>("b") == b);
}

TEST_CASE("records hold xtensor storage in row-major order and restore into the same layout") {
  // Non-square shapes and ranks 0 to 3, so a transposed or reshaped copy shows.
  const std::vector<shape_type> shapes{{}, {5}, {2, 3}, {2, 3, 4}, {0, 3}};
  parameter_set<B> params;
  gradients_params<B> grads;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const std::string id = "p" + std::to_string(i);
    params.add(id, xt::xarray<double>::from_shape(shapes[i]));
    grads.insert(id, counting<double>(shapes[i]));
  }
  weighted_gradients_accumulator<B> window(float_dtype::f64, 1.0);
  window.accumulate_sum(params, grads, 1.0);

  const weighted_gradients_record record = window.try_to_record();
  REQUIRE(record.gradients.tensors.size() == shapes.size());
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const tensor_record& t = record.gradients.tensors[i];
    CAPTURE(t.id);
    CHECK(t.shape == std::vector<std::uint64_t>(shapes[i].begin(), shapes[i].end()));
    const auto& values = std::get<std::vector<double>>(t.values);
    std::vector<double> expected(values.size());
    std::iota(expected.begin(), expected.end(), 1.0);
    CHECK(values == expected);
  }

  weighted_gradients_accumulator<B> resumed(float_dtype::f32, 2.0);
  resumed.load_record(params, record);
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const auto pending = resumed.pending().get<double>("p" + std::to_string(i));
    REQUIRE(pending.has_value());
    CHECK(pending->shape() == shapes[i]);
    CHECK(*pending == counting<double>(shapes[i]));
  }
}

TEST_CASE("a tensor of rank above max_rank is refused and changes nothing") {
  const shape_type too_many_axes(max_rank + 1, 1);
  parameter_set<B> params;
  params.add("w", xt::xarray<float>::from_shape({1}));
  GRADACCUM_CHECK_REJECTED(params.add("deep", xt::xarray<float>::from_shape(too_many_axes)), errc::parameter_mismatch,
                           "deep");
  CHECK(params.size() == 1);
  CHECK_FALSE(params.contains("deep"));

  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  gradients_params<B> first;
  first.insert("w", xt::xarray<float>{3.0F});
  window.accumulate_sum(params, first, 1.0);
  const weighted_gradients_record before = window.try_to_record();

  gradients_params<B> deep;
  deep.insert("w", xt::xarray<float>::from_shape(too_many_axes));
  GRADACCUM_CHECK_REJECTED(window.accumulate_sum(params, deep, 1.0), errc::parameter_mismatch, "w");
  GRADACCUM_CHECK_SAME_BITS(window.try_to_record(), before);
}

}  // namespace
}  // namespace gradaccum::test
