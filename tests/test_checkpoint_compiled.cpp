// Checkpoints through the compiled checkpoint library (GRADACCUM_SEPARATE_COMPILATION, the
// `gradaccum-checkpoint` dependency): this file sees declarations only, and what the library
// reads and writes is what the header-only build does, byte for byte (the fixtures were written
// header-only).
#include <doctest/doctest.h>

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "fixtures/fixture_window.hpp"

#if !defined(GRADACCUM_SEPARATE_COMPILATION) || defined(CEREAL_CEREAL_HPP_)
#error "this test compiles against the checkpoint library's declarations, without cereal"
#endif

using namespace gradaccum;
using gradaccum::test::fixture_window;
namespace fs = std::filesystem;

namespace {

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

parameter_set<eigen_backend> fixture_parameters() {
  parameter_set<eigen_backend> p;
  p.add("encoder.weight", tensor_shape{2, 3}, {});
  p.add("decoder.bias", tensor_shape{1, 3}, {});
  return p;
}

fs::path fixture(const std::string& extension) {
  return fs::path(GRADACCUM_TEST_FIXTURES) / ("window_v5" + extension);
}

struct scratch_dir {
  fs::path path = fs::temp_directory_path() / ("gradaccum_compiled_" + std::to_string(::getpid()));
  scratch_dir() { fs::create_directories(path); }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  ~scratch_dir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

}  // namespace

TEST_CASE("the compiled library reads and writes the fixtures' bytes in every format") {
  const auto params = fixture_parameters();
  for (const auto& format_and_extension :
       {std::pair{checkpoint_format::binary, ".bin"}, std::pair{checkpoint_format::portable_binary, ".pbin"},
        std::pair{checkpoint_format::json, ".json"}}) {
    const checkpoint_format format = format_and_extension.first;
    const std::string extension = format_and_extension.second;  // a variable doctest's CAPTURE can take
    CAPTURE(extension);
    const fs::path path = fixture(extension);
    CHECK(checkpoint_version(path) == record_format_version);
    CHECK(load_checkpoint<weighted_gradients_record>(path) == fixture_window());
    CHECK(parse_checkpoint<weighted_gradients_record>(read_bytes(path), format) == fixture_window());
    CHECK(serialize_checkpoint(fixture_window(), format) == read_bytes(path));
    weighted_gradients_accumulator<eigen_backend> window(float_dtype::f64, 1.0);
    load_checkpoint(path, params, window);
    CHECK(window.try_to_record() == fixture_window());
  }
}

TEST_CASE("a window and its loss scaler go through the compiled library and come back bit for bit") {
  const scratch_dir dir;
  const auto params = fixture_parameters();
  weighted_gradients_accumulator<eigen_backend> window(float_dtype::f64, 1.0);
  load_checkpoint(fixture(".bin"), params, window);
  dynamic_loss_scale scaler;
  scaler.update(true);  // backed off once: 32768
  for (const char* name : {"w.bin", "w.pbin", "w.json"}) {
    CAPTURE(name);
    const fs::path path = dir.path / name;
    save_checkpoint(path, window, scaler);
    weighted_gradients_accumulator<eigen_backend> restored(float_dtype::f64, 1.0);
    dynamic_loss_scale restored_scaler;
    load_checkpoint(path, params, restored, restored_scaler);
    CHECK(restored.try_to_record() == window.try_to_record());
    CHECK(restored_scaler.state() == scaler.state());
    CHECK(restored_scaler.scale() == 32768.0);
    // Without the scaler the file is refused, and the window keeps what it had.
    CHECK_THROWS_WITH_AS(load_checkpoint(path, params, restored), doctest::Contains("dynamic_loss_scale"), error);
    CHECK(restored.try_to_record() == window.try_to_record());
  }
}

TEST_CASE("a corrupt checkpoint is refused by the compiled library and changes nothing") {
  const scratch_dir dir;
  const auto params = fixture_parameters();
  std::string bytes = read_bytes(fixture(".bin"));
  const std::size_t value = bytes.rfind(std::string("\x00\x00\x80\x3f", 4));  // 1.0F of encoder.weight
  REQUIRE(value != std::string::npos);
  bytes[value + 3] = '\x40';  // 1.0F becomes 4.0F: the checksum no longer matches
  const fs::path path = dir.path / "corrupt.bin";
  write_bytes(path, bytes);

  weighted_gradients_accumulator<eigen_backend> window(float_dtype::f64, 1.0);
  load_checkpoint(fixture(".json"), params, window);
  const weighted_gradients_record before = window.try_to_record();
  try {
    load_checkpoint(path, params, window);
    FAIL("a corrupt checkpoint loaded");
  } catch (const error& e) {
    CHECK(e.code() == errc::invalid_record);
    CHECK(std::string(e.what()).find("corrupt.bin") != std::string::npos);
  }
  CHECK(window.try_to_record() == before);
  CHECK_THROWS_AS((void)load_checkpoint<weighted_gradients_record>(path), error);
}
