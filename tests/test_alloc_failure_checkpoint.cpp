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
      const std::string expected = serialize_checkpoint(source.try_to_record(), format);
      fail_each_allocation([&] { save_checkpoint(path, source, format); },
                           [&] { CHECK(file_bytes(path) == previous); });
      CHECK(file_bytes(path) == expected);
      fail_each_allocation([&] { (void)serialize_checkpoint(source.try_to_record(), format); }, [] {});
      CHECK(serialize_checkpoint(source.try_to_record(), format) == expected);

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

TEST_SUITE_END();
