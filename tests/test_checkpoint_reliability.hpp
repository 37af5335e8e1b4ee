#pragma once
/// @file
/// @brief Shared by the files of test_checkpoint_reliability: a file's bytes, and a scratch
/// directory removed at the end of the test.

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <unistd.h>

namespace gradaccum::test::reliability {

namespace fs = std::filesystem;

inline std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct scratch_dir {
  fs::path path = fs::temp_directory_path() / ("gradaccum_reliability_" + std::to_string(::getpid()));
  scratch_dir() { fs::create_directories(path); }
  ~scratch_dir() { fs::remove_all(path); }
};

}  // namespace gradaccum::test::reliability
