/// @file
/// @brief What checkpoints hold, and their limits: files of this format load from fixtures and
/// this build writes their bytes, files of older formats are refused naming their version,
/// zero-element tensors and Eigen parameters of any rank round-trip, a binary checkpoint holds a
/// window's values as one block, straight from its buffer; length fields cannot make a load
/// allocate (ids longer than max_id_length are refused before any allocation), files that are not
/// regular are refused without blocking, and names up to NAME_MAX save.

#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <sys/stat.h>

#include <doctest/doctest.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "fixtures/fixture_window.hpp"
#include "test_checkpoint_reliability.hpp"
#include "test_checkpoint_support.hpp"

using namespace gradaccum;
using namespace gradaccum::test;
using reliability::read_text;
using reliability::scratch_dir;
namespace fs = std::filesystem;

TEST_CASE("checkpoints of this format load from files; older formats are refused naming their version") {
  const auto params = [] {
    parameter_set<eigen_backend> p;
    p.add("encoder.weight", tensor_shape{2, 3}, {});
    p.add("decoder.bias", tensor_shape{1, 3}, {});
    return p;
  }();
  for (const checkpoint_format format : all_formats) {
    CAPTURE(format);
    const fs::path path = fs::path(GRADACCUM_TEST_FIXTURES) / ("window_v5" + extension_of(format));
    CHECK(checkpoint_version(path) == 5);
    CHECK(load_checkpoint<weighted_gradients_record>(path) == fixture_window());
    weighted_gradients_accumulator<eigen_backend> acc(float_dtype::f64, 1.0);
    load_checkpoint(path, params, acc);
    CHECK(acc.try_to_record() == fixture_window());
    // This build writes the fixture's bytes.
    CHECK(serialize_checkpoint(fixture_window(), format) == read_text(path));
  }
  // A file of format 3: its version is told, and loading it is refused, changing nothing.
  const fs::path old = fs::path(GRADACCUM_TEST_FIXTURES) / "window_v3.bin";
  CHECK(checkpoint_version(old) == 3);
  const std::string expected = "checkpoint " + detail::quote(old.string()) +
                               ": a weighted gradients record has format version 3; this build reads version 5 only.";
  for (const bool into_accumulator : {false, true}) {
    weighted_gradients_accumulator<eigen_backend> acc(float_dtype::f64, 2.0);
    try {
      if (into_accumulator) {
        load_checkpoint(old, params, acc);
      } else {
        (void)load_checkpoint<weighted_gradients_record>(old);
      }
      FAIL("a checkpoint of format 3 loaded");
    } catch (const error& e) {
      CHECK(e.code() == errc::invalid_record);
      CHECK(std::string(e.what()) == expected);
    }
    CHECK(acc.try_to_record() == weighted_gradients_record{{}, {float_dtype::f64, 2.0, 0.0, 0}});
  }
}

TEST_CASE("zero-element tensors save and load in every format") {
  const gradients_params_record record{{{"empty", float_dtype::f32, {0, 3}, std::vector<float>{}},
                                        {"half", float_dtype::f16, {2, 0}, std::vector<std::uint16_t>{}}}};
  for (const checkpoint_format format : all_formats) {
    CAPTURE(format);
    CHECK(parse_checkpoint<gradients_params_record>(serialize_checkpoint(record, format), format) == record);
  }
}

TEST_CASE("Eigen parameters of any rank restore into their own segment, finish and save again") {
  // A declared rank-3 shape once had 6 values written into a 1 x 2 matrix, and ranks 0 and 1
  // loaded, then failed at finish_mean: the window's segment has the declared shape's elements.
  for (const tensor_shape& shape : {tensor_shape{1, 2, 3}, tensor_shape{2, 2, 3}, tensor_shape{}, tensor_shape{4}}) {
    CAPTURE(shape.to_string());
    const std::size_t n = *shape.checked_element_count();
    std::vector<float> values(n);
    for (std::size_t i = 0; i < n; ++i) values[i] = static_cast<float>(i + 1);
    weighted_gradients_record saved;
    saved.state = {float_dtype::f32, 1.0, 2.0, 1};
    saved.gradients.tensors.push_back(
        {"w", float_dtype::f32, std::vector<std::uint64_t>(shape.begin(), shape.end()), values});
    parameter_set<eigen_backend> params;
    params.add("w", shape, {});
    weighted_gradients_accumulator<eigen_backend> acc(float_dtype::f32, 1.0);
    acc.load_record(params, parse_checkpoint<weighted_gradients_record>(
                                serialize_checkpoint(saved, checkpoint_format::binary), checkpoint_format::binary));
    CHECK(acc.try_to_record() == saved);
    weighted_gradients_accumulator<eigen_backend> again(float_dtype::f32, 1.0);
    again.load_record(params, acc.try_to_record());
    const auto finished = again.finish_mean(params);
    const std::span<const float> mean = finished.gradients.values<float>("w");
    REQUIRE(mean.size() == n);
    for (std::size_t i = 0; i < n; ++i) CHECK(mean[i] == values[i] / 2.0F);
  }
}

TEST_CASE("a binary checkpoint holds a window's values as one block, straight from its buffer") {
  // Parameters in id order with sizes that need no padding: the window's buffer is exactly the
  // values in record order, so the file must contain it as one run of bytes.
  parameter_set<eigen_backend> params;
  gradients_params<eigen_backend> grads(params);
  std::vector<Eigen::MatrixXf> values;
  for (int i = 0; i < 40; ++i) {
    const std::string id = "layer" + std::to_string(100 + i);
    params.add(id, tensor_shape{4, 4}, {});
    values.emplace_back(Eigen::MatrixXf::Constant(4, 4, 0.5F + static_cast<float>(i)));
  }
  for (int i = 0; i < 40; ++i) grads.insert("layer" + std::to_string(100 + i), values[static_cast<std::size_t>(i)]);
  weighted_gradients_accumulator<eigen_backend> acc(float_dtype::f32, 1.0);
  acc.accumulate_sum(params, grads, 2);
  const scratch_dir dir;
  for (const checkpoint_format format : {checkpoint_format::binary, checkpoint_format::portable_binary}) {
    CAPTURE(format);
    const fs::path path = dir.path / "window.ckpt";
    save_checkpoint(path, acc, format);
    const weighted_gradients_record saved = acc.try_to_record();
    std::ifstream in(path, std::ios::binary);
    const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    const auto sums = acc.finish_sums();
    const std::span<const float> flat = sums.gradients.template flat<float>();
    REQUIRE(flat.size() == 40 * 16);
    const std::string_view block(reinterpret_cast<const char*>(flat.data()), flat.size_bytes());
    if constexpr (std::endian::native == std::endian::little) CHECK(bytes.find(block) != std::string::npos);
    // The directory: per tensor 4 + 8 id bytes + dtype + rank + 2 dimensions and an offset of
    // 8 bytes.
    const std::size_t directory = 40 * (4 + 8 + 1 + 1 + 16 + 8);
    CHECK(bytes.find(std::string_view("\x08\x00\x00\x00layer100\x02\x02", 14)) != std::string::npos);
    weighted_gradients_accumulator<eigen_backend> restored(float_dtype::f64, 4.0);
    load_checkpoint(path, params, restored, format);
    CHECK(restored.try_to_record() == saved);
    CHECK(bytes.size() > directory + block.size());
    CHECK(bytes.size() < directory + block.size() + 128);  // the state, counts and checksums
    acc.load_record(params, saved);                        // finish_sums took the window
  }
}

TEST_CASE("ids longer than max_id_length are refused on save and on load, before any allocation") {
  gradients_params_record record{{{std::string(max_id_length + 1, 'a'), float_dtype::f32, {1, 1}, std::vector{1.0F}}}};
  CHECK_THROWS_AS((void)serialize_checkpoint(record, checkpoint_format::binary), error);
  record.tensors[0].id = "a";
  std::string bytes = serialize_checkpoint(record, checkpoint_format::binary);
  // The id length (4 bytes) follows the gradients version and tag, the tensor count and the
  // directory's size: declare 4 GiB, in a sparse file of 64 GiB, under a directory checksum that
  // matches.
  const std::uint64_t huge = std::uint64_t{64} << 30;
  const std::uint32_t id_length = 0xFFFFFFFFU;
  constexpr std::size_t directory_at = 4 + 8 + 8 + 8;
  std::memcpy(bytes.data() + directory_at, &id_length, sizeof id_length);
  std::uint64_t directory_size = 0;
  std::uint64_t block_size = 0;
  std::memcpy(&directory_size, bytes.data() + directory_at - 8, sizeof directory_size);
  std::memcpy(&block_size, bytes.data() + directory_at + directory_size, sizeof block_size);
  const std::uint64_t checksum =
      detail::directory_checksum(1, std::string_view(bytes).substr(directory_at, directory_size), block_size);
  std::memcpy(bytes.data() + directory_at + directory_size + 8, &checksum, sizeof checksum);
  const scratch_dir dir;
  const fs::path path = dir.path / "sparse.bin";
  {
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  fs::resize_file(path, huge + 4096);
  const auto start = std::chrono::steady_clock::now();
  try {
    (void)load_checkpoint<gradients_params_record>(path);
    FAIL("a 64 GiB id loaded");
  } catch (const error& e) {
    CHECK(e.code() == errc::invalid_record);
    CHECK(std::string(e.what()).find("allowed") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(1));
}

TEST_CASE("files that are not regular are refused without blocking") {
  const scratch_dir dir;
  const fs::path fifo = dir.path / "pipe.bin";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto loading = std::async(std::launch::async, [&] {
    try {
      (void)load_checkpoint<weighted_gradients_record>(fifo);
    } catch (const fs::filesystem_error&) {
      return true;
    }
    return false;
  });
  REQUIRE(loading.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(loading.get());
  CHECK_THROWS_AS((void)load_checkpoint<weighted_gradients_record>("/dev/null", checkpoint_format::binary),
                  fs::filesystem_error);
}

TEST_CASE("names up to NAME_MAX save, and temporary files are gone after a save") {
  const scratch_dir dir;
  for (const std::size_t length : {250, 255}) {
    const fs::path path = dir.path / (std::string(length - 4, 'n') + ".bin");
    save_checkpoint(path, fixture_window());
    CHECK(load_checkpoint<weighted_gradients_record>(path) == fixture_window());
  }
  std::size_t files = 0;
  for (const auto& entry : fs::directory_iterator(dir.path)) files += entry.is_regular_file() ? 1 : 0;
  CHECK(files == 2);
}
