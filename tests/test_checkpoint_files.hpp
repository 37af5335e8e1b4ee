#pragma once
/// @file
/// @brief Shared by the files of test_checkpoint_files: a scratch directory, a file's bytes, and
/// the fixture window after some microbatches.

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/gradaccum.hpp>

#include "test_checkpoint_fixture.hpp"

namespace gradaccum::test::files {

using backend = eigen_backend;
namespace fs = std::filesystem;

/// A fresh directory, removed with everything in it at the end of the test.
class scratch_directory {
 public:
  scratch_directory() {
    std::string pattern = (fs::temp_directory_path() / "gradaccum-checkpoint-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path_ = pattern;
  }
  scratch_directory(const scratch_directory&) = delete;
  scratch_directory& operator=(const scratch_directory&) = delete;
  ~scratch_directory() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  [[nodiscard]] fs::path operator/(const std::string& name) const { return path_ / name; }
  /// Names of the files in the directory, sorted.
  [[nodiscard]] std::vector<std::string> files() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(path_)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  fs::path path_;
};

inline std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// The fixture window after `k` microbatches.
inline weighted_gradients_accumulator<backend> window_after(const parameter_set<backend>& params, std::size_t k) {
  weighted_gradients_accumulator<backend> accumulator(test::window::work_dtype, test::window::loss_scale);
  test::window::run(accumulator, params, 0, k);
  return accumulator;
}

}  // namespace gradaccum::test::files
