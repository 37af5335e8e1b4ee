// What goes into the Eigen backend as a parameter or gradient: every dense object (any size and
// storage order, arrays, maps, refs, blocks, rows, columns, transposes, expressions) and the
// Tensor module, each giving the same bits as the plain matrix holding the same row-major values.
// Also: the shape of each kind, reading in place, evaluating expressions once, shape rules, a
// checkpoint that moves to xtensor and back, and no allocation in steady state.
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <unsupported/Eigen/CXX11/Tensor>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>

#include "alloc_failure.hpp"
#include "input_checks.hpp"

#if GRADACCUM_TEST_HAVE_XTENSOR
#include <xtensor/xtensor.hpp>

#include <gradaccum/backends/xtensor.hpp>
#endif

namespace gradaccum::test {
namespace {

using B = eigen_backend;
using matrix = Eigen::MatrixXf;
using row_major_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// g(r, c) = 0.1 · (1 + r · cols + c): distinct, inexact values, so bits tell positions apart.
template <class M>
void fill_counting(M& m) {
  for (Eigen::Index r = 0; r < m.rows(); ++r) {
    for (Eigen::Index c = 0; c < m.cols(); ++c) m(r, c) = 0.1F * static_cast<float>(1 + r * m.cols() + c);
  }
}

matrix counting(Eigen::Index rows, Eigen::Index cols) {
  matrix m(rows, cols);
  fill_counting(m);
  return m;
}

/// Row-major values of any dense object.
template <class X>
std::vector<float> row_major_of(const Eigen::DenseBase<X>& x) {
  const row_major_matrix m = x.template cast<float>();
  return {m.data(), m.data() + m.size()};
}

TEST_CASE("vectors are [n], row vectors and matrices [rows, cols], in any size and storage order") {
  Eigen::VectorXf v(3);
  v << 0.1F, 0.2F, 0.3F;
  check_kind<B>(v, v, tensor_shape{3}, row_major_of(v));
  const Eigen::Vector3f fixed_vector = v;
  check_kind<B>(fixed_vector, fixed_vector, tensor_shape{3}, row_major_of(v));
  Eigen::ArrayXf array_vector = v.array();
  check_kind<B>(array_vector, array_vector, tensor_shape{3}, row_major_of(v));

  Eigen::RowVectorXf row = v.transpose();
  check_kind<B>(row, row, tensor_shape{1, 3}, row_major_of(row));

  const matrix m = counting(2, 3);
  Eigen::Matrix<float, 2, 3> fixed = m;
  check_kind<B>(fixed, fixed, tensor_shape{2, 3}, row_major_of(m));
  Eigen::Matrix3f square = counting(3, 3);
  check_kind<B>(square, square, tensor_shape{3, 3}, row_major_of(square));
  row_major_matrix rm = m;
  check_kind<B>(rm, rm, tensor_shape{2, 3}, row_major_of(m));
  Eigen::Matrix<float, 2, 3, Eigen::RowMajor> fixed_rm = m;
  check_kind<B>(fixed_rm, fixed_rm, tensor_shape{2, 3}, row_major_of(m));
  Eigen::ArrayXXf array = m.array();
  check_kind<B>(array, array, tensor_shape{2, 3}, row_major_of(m));
  check_kind<B>(m, m, tensor_shape{2, 3}, row_major_of(m));
}

TEST_CASE("maps, refs, blocks, rows, columns and transposes are read through their strides") {
  const matrix big = counting(4, 5);
  const matrix blk = big.block(1, 1, 2, 3);

  SUBCASE("a 2 x 3 block of a 4 x 5 matrix: element (0, 2) is big(1, 3)") {
    const auto g = row_major_of(blk);
    CHECK(g[2] == big(1, 3));
    check_kind<B>(blk, big.block(1, 1, 2, 3), tensor_shape{2, 3}, g);
    const row_major_matrix big_rm = big;
    check_kind<B>(blk, big_rm.block(1, 1, 2, 3), tensor_shape{2, 3}, g);
  }
  SUBCASE("a transpose: element (0, 2) of the transpose of a 3 x 2 matrix is m(2, 0)") {
    const matrix m = counting(3, 2);
    const auto g = row_major_of(m.transpose());
    CHECK(g[2] == m(2, 0));
    check_kind<B>(m.transpose(), m.transpose(), tensor_shape{2, 3}, g);
    check_kind<B>(big.block(0, 0, 3, 2).transpose(), big.block(0, 0, 3, 2).transpose(), tensor_shape{2, 3},
                  row_major_of(big.block(0, 0, 3, 2).transpose()));
  }
  SUBCASE("rows are [1, n], columns [n]") {
    check_kind<B>(big.row(2), big.row(2), tensor_shape{1, 5}, row_major_of(big.row(2)));
    check_kind<B>(big.col(3), big.col(3), tensor_shape{4}, row_major_of(big.col(3)));
  }
  SUBCASE("maps, const and mutable, contiguous and strided, and refs") {
    std::vector<float> buffer(20);
    for (std::size_t i = 0; i < buffer.size(); ++i) buffer[i] = 0.25F * static_cast<float>(i);
    const Eigen::Map<const matrix> cmap(buffer.data(), 2, 3);
    check_kind<B>(cmap, cmap, tensor_shape{2, 3}, row_major_of(cmap));
    Eigen::Map<matrix> mmap(buffer.data(), 2, 3);
    check_kind<B>(mmap, mmap, tensor_shape{2, 3}, row_major_of(mmap));
    const Eigen::Map<const matrix, 0, Eigen::OuterStride<>> outer(buffer.data(), 2, 3, Eigen::OuterStride<>(5));
    check_kind<B>(outer, outer, tensor_shape{2, 3}, row_major_of(outer));
    const Eigen::Map<const matrix, 0, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>> both(
        buffer.data(), 2, 3, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(7, 2));
    check_kind<B>(both, both, tensor_shape{2, 3}, row_major_of(both));
    const Eigen::Map<const Eigen::VectorXf, 0, Eigen::InnerStride<3>> every_third(buffer.data(), 4);
    check_kind<B>(every_third, every_third, tensor_shape{4}, row_major_of(every_third));
    const Eigen::Ref<const matrix> ref = big.block(0, 1, 2, 3);
    check_kind<B>(ref, ref, tensor_shape{2, 3}, row_major_of(ref));
  }
}

TEST_CASE("expressions are evaluated once, at insert") {
  const matrix m = counting(2, 3);
  check_kind<B>(m, 2.0F * m, tensor_shape{2, 3}, row_major_of(2.0F * m));
  check_kind<B>(m, matrix::Constant(2, 3, 1.0F), tensor_shape{2, 3}, std::vector<float>(6, 1.0F));
  check_kind<B>(Eigen::MatrixXf::Zero(2, 3), m.array() + 1.0F, tensor_shape{2, 3}, row_major_of(m.array() + 1.0F));

  matrix source = m;
  int evaluations = 0;
  const auto counted = source.unaryExpr([&](float x) {
    ++evaluations;
    return 3.0F * x;
  });
  parameter_set<B> params;
  params.add("p", m);
  gradients_params<B> grads;
  grads.insert("p", counted);
  CHECK(evaluations == 6);
  source.setZero();  // the expression's operand changes after insert: the stored values do not
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  CHECK(evaluations == 6);
  const auto pending = window.pending().values<float>("p");
  const auto tripled = row_major_of(3.0F * m);
  for (std::size_t i = 0; i < tripled.size(); ++i) CHECK(pending[i] == tripled[i] + tripled[i]);
}

TEST_CASE("in-place inputs are read when accumulated: later writes to the caller's memory are seen") {
  matrix big = counting(4, 5);
  std::vector<float> buffer(6, 1.0F);
  parameter_set<B> params;
  params.add("block", big.block(1, 1, 2, 3));
  params.add("map", Eigen::Map<const matrix>(buffer.data(), 3, 2));
  Eigen::VectorXf bias = Eigen::VectorXf::Ones(4);
  params.add("bias", bias);
  gradients_params<B> grads;
  grads.insert("block", big.block(1, 1, 2, 3));
  grads.insert("map", Eigen::Map<const matrix>(buffer.data(), 3, 2));
  grads.insert("bias", gradaccum::view(bias));  // owns its storage: read in place only when asked
  CHECK(grads.get<float>("block") == nullptr);  // a view, not an owned copy

  big(1, 3) = 100.0F;  // element (0, 2) of the block
  buffer[1] = 50.0F;   // element (1, 0) of the column-major 3 x 2 map
  bias(3) = 7.0F;
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  CHECK(window.pending().values<float>("block")[2] == 100.0F);
  CHECK(window.pending().values<float>("map")[2] == 50.0F);  // row-major position of (1, 0)
  CHECK(window.pending().values<float>("bias")[3] == 7.0F);
}

TEST_CASE("an lvalue that owns its storage is copied at insert: set*() on a temporary is safe") {
  parameter_set<B> params;
  params.add("b", Eigen::VectorXf(1000));
  params.add("t", Eigen::Tensor<float, 4>(2, 3, 4, 5));
  params.add("r", row_major_matrix(2, 3));
  gradients_params<B> grads;
  // Lvalue references to temporaries (the newcomer's lines): copied while the temporary lives.
  grads.insert("b", Eigen::VectorXf(1000).setOnes());
  grads.insert("t", Eigen::Tensor<float, 4>(2, 3, 4, 5).setConstant(1));
  row_major_matrix r = counting(2, 3);
  grads.insert("r", r);
  r.setZero();  // a copy: later writes are not seen
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  const auto b = window.pending().values<float>("b");
  CHECK(std::vector<float>(b.begin(), b.end()) == std::vector<float>(1000, 1.0F));
  const auto t = window.pending().values<float>("t");
  CHECK(std::vector<float>(t.begin(), t.end()) == std::vector<float>(120, 1.0F));
  CHECK(window.pending().values<float>("r")[5] == 0.1F * 6.0F);

  // A loop that gives the same ids again copies into the entries' storage: no allocation.
  Eigen::VectorXf next = Eigen::VectorXf::Constant(1000, 2.0F);
  CHECK(allocations_of([&] {
          grads.insert_or_assign("b", next);
          grads.insert_or_assign("r", r);
        }) == 0);
  window.accumulate_sum(params, grads, 1.0);
  CHECK(window.pending().values<float>("b")[999] == 3.0F);
  CHECK(window.pending().values<float>("r")[5] == 0.1F * 6.0F);
  // A copy of the container keeps its values when the original is given new ones.
  const gradients_params<B> kept = grads;
  const Eigen::VectorXf five = Eigen::VectorXf::Constant(1000, 5.0F);
  grads.insert_or_assign("b", five);
  gradients_accumulator<B> sum;
  sum.accumulate(params, kept);
  CHECK(sum.pending().values<float>("b")[0] == 2.0F);
}

TEST_CASE("a temporary that owns its storage is copied at insert, not viewed") {
  parameter_set<B> params;
  params.add("b", Eigen::VectorXf::Zero(3).eval());
  params.add("w", matrix(2, 3));
  const matrix m = counting(2, 3);
  gradients_params<B> grads;
  grads.insert("b", Eigen::VectorXf(Eigen::Vector3f(1.0F, 2.0F, 3.0F)));
  grads.insert("w", Eigen::Ref<const matrix>(2.0F * m));  // the Ref holds the evaluated product
  CHECK(grads.get<float>("b") != nullptr);
  CHECK(grads.get<float>("w") != nullptr);
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  const auto b = window.pending().values<float>("b");
  CHECK(std::vector<float>(b.begin(), b.end()) == std::vector<float>{1.0F, 2.0F, 3.0F});
  const auto w = window.pending().values<float>("w");
  CHECK(std::vector<float>(w.begin(), w.end()) == row_major_of(2.0F * m));
}

TEST_CASE("the Tensor module: Eigen::Tensor and TensorMap of any layout, in index order") {
  Eigen::Tensor<float, 4> kernel(2, 3, 4, 5);  // column-major, a rank-4 convolution kernel
  for (Eigen::Index i = 0; i < kernel.size(); ++i) kernel.data()[i] = 0.1F * static_cast<float>(i + 1);
  std::vector<float> g;
  for (Eigen::Index a = 0; a < 2; ++a)
    for (Eigen::Index b = 0; b < 3; ++b)
      for (Eigen::Index c = 0; c < 4; ++c)
        for (Eigen::Index d = 0; d < 5; ++d) g.push_back(kernel(a, b, c, d));
  check_kind<B>(kernel, kernel, tensor_shape{2, 3, 4, 5}, g);
  const Eigen::TensorMap<const Eigen::Tensor<float, 4>> mapped(kernel.data(), 2, 3, 4, 5);
  check_kind<B>(mapped, mapped, tensor_shape{2, 3, 4, 5}, g);
  Eigen::Tensor<float, 4, Eigen::RowMajor> row_major_kernel =
      kernel.swap_layout().shuffle(Eigen::array<int, 4>{3, 2, 1, 0});
  check_kind<B>(row_major_kernel, row_major_kernel, tensor_shape{2, 3, 4, 5}, g);

  Eigen::Tensor<float, 1> vector(3);
  vector.setValues({0.1F, 0.2F, 0.3F});
  check_kind<B>(vector, vector, tensor_shape{3}, {0.1F, 0.2F, 0.3F});
  check_kind<B>(Eigen::VectorXf(Eigen::Vector3f(0.1F, 0.2F, 0.3F)), vector, tensor_shape{3}, {0.1F, 0.2F, 0.3F});
  Eigen::Tensor<float, 0> scalar;
  scalar() = 0.5F;
  check_kind<B>(scalar, scalar, tensor_shape{}, {0.5F});

  Eigen::Tensor<float, 9> too_many(1, 1, 1, 1, 1, 1, 1, 1, 1);
  parameter_set<B> params;
  CHECK_THROWS_AS(params.add("deep", too_many), error);
  try {
    params.add("deep", too_many);
  } catch (const error& e) {
    CHECK(e.code() == errc::parameter_mismatch);
    CHECK(e.param_id() == "deep");
  }
  CHECK(params.empty());
}

TEST_CASE("16-bit and double inputs through views give the bits of their plain matrices") {
  const matrix big = counting(4, 5);
  const Eigen::Matrix<Eigen::half, Eigen::Dynamic, Eigen::Dynamic> halves = big.cast<Eigen::half>();
  const Eigen::MatrixXd doubles = big.cast<double>();
  parameter_set<B> params;
  params.add("h", halves.block(1, 1, 2, 3));
  params.add("d", doubles.transpose());
  gradients_params<B> viewed;
  viewed.insert("h", halves.block(1, 1, 2, 3));
  viewed.insert("d", doubles.transpose());
  gradients_params<B> plain;
  plain.insert("h", Eigen::Matrix<Eigen::half, Eigen::Dynamic, Eigen::Dynamic>(halves.block(1, 1, 2, 3)));
  plain.insert("d", Eigen::MatrixXd(doubles.transpose()));
  weighted_gradients_accumulator<B> a(float_dtype::f64, 1.0);
  weighted_gradients_accumulator<B> b(float_dtype::f64, 1.0);
  a.accumulate_mean(params, viewed, 3.0);
  b.accumulate_mean(params, plain, 3.0);
  const auto ra = a.try_to_record();
  const auto rb = b.try_to_record();
  REQUIRE(ra.gradients.tensors.size() == 2);
  for (std::size_t i = 0; i < 2; ++i) {
    const auto& x = std::get<std::vector<double>>(ra.gradients.tensors[i].values);
    const auto& y = std::get<std::vector<double>>(rb.gradients.tensors[i].values);
    CHECK(std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0);
  }
  CHECK(std::get<std::vector<double>>(ra.gradients.tensors[0].values)[2] == 3.0 * doubles(2, 0));  // "d" (0, 2)
}

TEST_CASE("shapes compare as Eigen assigns: [n] is [n, 1], [] is [1, 1]; other shapes are refused") {
  parameter_set<B> params;
  params.add("bias", Eigen::VectorXf::Zero(3).eval());
  params.add("row", Eigen::RowVectorXf::Zero(3).eval());
  params.add("scalar", tensor_shape{}, {});
  params.add("w", matrix(2, 3));
  CHECK(params[0].shape == tensor_shape{3});
  CHECK(params[1].shape == tensor_shape{1, 3});
  // A tied parameter may be re-added as n x 1; the first shape stays.
  CHECK(params.add("bias", matrix(3, 1)) == 0);
  CHECK(params[0].shape == tensor_shape{3});

  gradients_params<B> grads;
  grads.insert("bias", matrix::Constant(3, 1, 2.0F));
  grads.insert("row", matrix::Constant(1, 3, 3.0F));
  grads.insert("scalar", matrix::Constant(1, 1, 4.0F));
  grads.insert("w", counting(2, 3));
  weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  window.accumulate_sum(params, grads, 1.0);
  CHECK(window.pending().values<float>("bias").size() == 3);
  CHECK(window.pending().get<float>("bias")->rows() == 3);  // results show [n] as n x 1
  CHECK(window.pending().values<float>("scalar")[0] == 4.0F);
  const weighted_gradients_record before = window.try_to_record();

  const auto refused = [&](const char* id, const auto& gradient) {
    check_refused(window, params, grads, before, 0, id, gradient);
  };
  refused("bias", matrix::Zero(1, 3));       // a row for a column vector
  refused("row", Eigen::VectorXf::Zero(3));  // a column for a row vector
  refused("w", counting(3, 2));              // transposed
  refused("w", counting(2, 3).transpose());  // a transpose of the wrong shape
  refused("w", Eigen::VectorXf::Zero(6));    // same count, another shape
  refused("scalar", Eigen::VectorXf::Zero(2));
}

#if GRADACCUM_TEST_HAVE_XTENSOR
TEST_CASE("a checkpoint of such a model restores into xtensor with the natural shapes, and back") {
  using X = xtensor_backend;
  const matrix big = counting(4, 5);
  Eigen::VectorXf bias(3);
  bias << 0.1F, 0.2F, 0.3F;
  Eigen::Tensor<float, 4> kernel(2, 3, 4, 5);
  for (Eigen::Index i = 0; i < kernel.size(); ++i) kernel.data()[i] = 0.01F * static_cast<float>(i);
  parameter_set<B> params;
  params.add("bias", bias);
  params.add("row", big.row(1));
  params.add("block", big.block(1, 1, 2, 3));
  params.add("kernel", kernel);
  gradients_params<B> grads;
  grads.insert("bias", bias);
  grads.insert("row", big.row(1));
  grads.insert("block", big.block(1, 1, 2, 3).transpose().transpose());
  grads.insert("kernel", kernel);
  weighted_gradients_accumulator<B> window(float_dtype::f32, 4.0);
  window.accumulate_mean(params, grads, 3.0);
  const weighted_gradients_record record = window.try_to_record();

  parameter_set<X> xparams;
  xparams.add("bias", xt::xtensor<float, 1>::from_shape({3}));
  xparams.add("row", xt::xtensor<float, 2>::from_shape({1, 5}));
  xparams.add("block", xt::xtensor<float, 2>::from_shape({2, 3}));
  xparams.add("kernel", xt::xtensor<float, 4>::from_shape({2, 3, 4, 5}));
  weighted_gradients_accumulator<X> restored(float_dtype::f64, 1.0);
  restored.load_record(xparams, record);
  const weighted_gradients_record again = restored.try_to_record();
  CHECK(again.gradients.tensors.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(again.gradients.tensors[i].shape == record.gradients.tensors[i].shape);
    CHECK(std::get<std::vector<float>>(again.gradients.tensors[i].values) ==
          std::get<std::vector<float>>(record.gradients.tensors[i].values));
  }

  weighted_gradients_accumulator<B> back(float_dtype::f64, 1.0);
  back.load_record(params, again);
  const auto a = back.finish_mean(params);
  const auto b = window.finish_mean(params);
  for (const char* id : {"bias", "row", "block", "kernel"}) {
    CAPTURE(id);
    const auto x = a.gradients.values<float>(id);
    const auto y = b.gradients.values<float>(id);
    CHECK(std::vector<float>(x.begin(), x.end()) == std::vector<float>(y.begin(), y.end()));
  }
}
#endif

TEST_CASE("accumulating in-place views allocates nothing in steady state") {
  matrix big = counting(64, 48);
  Eigen::VectorXf bias = Eigen::VectorXf::Ones(48);
  Eigen::Tensor<float, 4> kernel(4, 3, 3, 3);
  kernel.setConstant(0.5F);
  std::vector<float> buffer(96, 0.25F);
  parameter_set<B> params;
  params.add("block", big.block(1, 2, 30, 20));
  params.add("transpose", big.transpose());
  params.add("bias", bias);
  params.add("kernel", kernel);
  params.add("map", Eigen::Map<const matrix, 0, Eigen::OuterStride<>>(buffer.data(), 4, 6, Eigen::OuterStride<>(16)));
  gradients_params<B> grads;
  grads.insert("block", big.block(1, 2, 30, 20));
  grads.insert("transpose", big.transpose());
  grads.insert("bias", bias);
  grads.insert("kernel", kernel);
  grads.insert("map", Eigen::Map<const matrix, 0, Eigen::OuterStride<>>(buffer.data(), 4, 6, Eigen::OuterStride<>(16)));
  check_no_allocation_in_steady_state(params, grads);
}

}  // namespace
}  // namespace gradaccum::test
