/// @file
/// @brief Checkpoints when memory runs out: one failing allocation (operator new, malloc or
/// realloc) swept over every save and load, in every format, for every backend and rank. Each
/// run either succeeds or throws `gradaccum::error` or `std::bad_alloc`; a failed load leaves
/// the accumulator as it was; a failed save leaves the previous file; a save that returns has
/// written exactly the accumulator's bytes.

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#include <doctest/doctest.h>

#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "alloc_failure.hpp"
#include "backend_fixtures.hpp"
#include "test_checkpoint_support.hpp"
#include "test_helpers.hpp"

namespace {

using namespace gradaccum;
using namespace gradaccum::test;
namespace fs = std::filesystem;

std::string file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Shapes of every rank up to max_rank: 2 × 1 × 3 × 1 × ...
std::vector<tensor_shape> shapes_of_every_rank() {
  std::vector<tensor_shape> shapes;
  for (std::size_t rank = 0; rank <= max_rank; ++rank) {
    std::vector<std::uint64_t> dims(rank, 1);
    if (rank > 0) dims[0] = 2;
    if (rank > 2) dims[2] = 3;
    const tensor_shape shape{std::span<const std::uint64_t>(dims)};
    shapes.push_back(shape);
  }
  return shapes;
}

}  // namespace

TEST_SUITE_BEGIN("alloc_failure");

TEST_CASE_TEMPLATE("one failing allocation in any checkpoint save or load changes nothing it must not", B,
                   GRADACCUM_TEST_BACKENDS) {
  const fs::path dir = fs::temp_directory_path() / ("gradaccum_alloc_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const tensor_shape& shape : shapes_of_every_rank()) {
    CAPTURE(shape.to_string());
    parameter_set<B> params;
    params.add("a.weight", shape, backend_fixture<B>::device());
    params.add("b", tensor_shape{1, 2}, backend_fixture<B>::device());
    // Windows of every rank come from records: an Eigen matrix gradient cannot have rank 3.
    const auto window = [&](float_dtype dtype, double scale, double weight, double factor) {
      weighted_gradients_record r;
      r.state = {dtype, scale, weight, 1};
      const std::vector<double> a = multiples(shape, factor);
      const std::vector<double> b{-1.2345678901234568e-05 * factor, 3 * factor};
      const auto values = [&](const std::vector<double>& v) -> record_values {
        if (dtype == float_dtype::f64) return v;
        return std::vector<float>(v.begin(), v.end());
      };
      r.gradients.tensors.push_back({"a.weight", dtype, {shape.begin(), shape.end()}, values(a)});
      r.gradients.tensors.push_back({"b", dtype, {1, 2}, values(b)});
      weighted_gradients_accumulator<B> acc(dtype, scale);
      acc.load_record(params, r);
      return acc;
    };
    const weighted_gradients_accumulator<B> source = window(float_dtype::f64, 8.0, 3.0, 0.25);
    const weighted_gradients_accumulator<B> other = window(float_dtype::f32, 2.0, 5.0, 1.0);

    for (const checkpoint_format format : all_formats) {
      CAPTURE(format);
      const fs::path path = dir / "window.ckpt";
      save_checkpoint(path, other, format);
      const std::string previous = file_bytes(path);
      // Binary archives write the accumulator's buffer as it is, a record in record order.
      const std::string expected = file_bytes([&] {
        const fs::path reference = dir / "reference.ckpt";
        save_checkpoint(reference, source, format);
        return reference;
      }());
      const std::string record_bytes = serialize_checkpoint(source.try_to_record(), format);
      fail_each_allocation([&] { save_checkpoint(path, source, format); },
                           [&] { CHECK(file_bytes(path) == previous); });
      CHECK(file_bytes(path) == expected);
      fail_each_allocation([&] { (void)serialize_checkpoint(source.try_to_record(), format); }, [] {});
      CHECK(serialize_checkpoint(source.try_to_record(), format) == record_bytes);

      weighted_gradients_accumulator<B> target = other;
      const auto before = target.try_to_record();
      fail_each_allocation([&] { load_checkpoint(path, params, target, format); },
                           [&] { CHECK(target.try_to_record() == before); });
      CHECK(target.try_to_record() == source.try_to_record());
      fail_each_allocation([&] { (void)load_checkpoint<weighted_gradients_record>(path, format); }, [] {});
    }
  }
  fs::remove_all(dir);
}

TEST_CASE_TEMPLATE("one failing allocation in a save or load of a window's values block changes nothing", B,
                   GRADACCUM_TEST_BACKENDS) {
  // Segments that fill the buffer, so binary archives write it as one block; loaded into the
  // same layout it is read whole, into the parameters in another order tensor by tensor.
  const fs::path dir = fs::temp_directory_path() / ("gradaccum_alloc_block_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto parameters = [](bool reversed) {
    parameter_set<B> params;
    if (reversed) params.add("b", tensor_shape{1, 2}, backend_fixture<B>::device());
    params.add("a", tensor_shape{4, 4}, backend_fixture<B>::device());
    if (!reversed) params.add("b", tensor_shape{1, 2}, backend_fixture<B>::device());
    return params;
  };
  const auto window = [](const parameter_set<B>& params, double factor) {
    weighted_gradients_record r;
    r.state = {float_dtype::f32, 4.0, 2.0, 1};
    std::vector<float> a(16);
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(factor * static_cast<double>(i + 1));
    r.gradients.tensors.push_back({"a", float_dtype::f32, {4, 4}, a});
    r.gradients.tensors.push_back({"b", float_dtype::f32, {1, 2}, std::vector<float>{-0.5F, 0.25F}});
    weighted_gradients_accumulator<B> acc(float_dtype::f32, 4.0);
    acc.load_record(params, r);
    return acc;
  };
  const parameter_set<B> params = parameters(false);
  const weighted_gradients_accumulator<B> source = window(params, 0.5);
  for (const checkpoint_format format : {checkpoint_format::binary, checkpoint_format::portable_binary}) {
    CAPTURE(format);
    const fs::path path = dir / "window.ckpt";
    save_checkpoint(path, source, format);
    const std::string expected = file_bytes(path);
    save_checkpoint(path, window(params, 3.0), format);
    const std::string previous = file_bytes(path);
    fail_each_allocation([&] { save_checkpoint(path, source, format); }, [&] { CHECK(file_bytes(path) == previous); });
    CHECK(file_bytes(path) == expected);
    for (const bool reversed : {false, true}) {
      CAPTURE(reversed);
      const parameter_set<B> target_params = parameters(reversed);
      weighted_gradients_accumulator<B> target = window(target_params, 2.0);
      const auto before = target.try_to_record();
      fail_each_allocation([&] { load_checkpoint(path, target_params, target, format); },
                           [&] { CHECK(target.try_to_record() == before); });
      CHECK(target.try_to_record() == source.try_to_record());
    }
    fail_each_allocation([&] { (void)load_checkpoint<weighted_gradients_record>(path, format); }, [] {});
  }
  fs::remove_all(dir);
}

TEST_SUITE_END();
