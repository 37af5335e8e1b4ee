/// @file
/// @brief gradaccum-inspect as users run it: every record a checkpoint file holds is shown (a
/// window saved with its dynamic_loss_scale included, in every format), ids are escaped as the
/// library's messages escape them, and a misread file is refused naming what it is.

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <gradaccum/checkpoint.hpp>

#include "test_checkpoint_support.hpp"

using namespace gradaccum;
namespace fs = std::filesystem;

namespace {

struct run_result {
  int status;
  std::string output;  // stdout, then stderr
};

/// Runs the inspector on `arguments` (each single-quoted for the shell).
run_result inspect(const std::vector<std::string>& arguments) {
  std::string command = GRADACCUM_INSPECT;
  for (const std::string& argument : arguments) command += " '" + argument + "'";
  command += " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string output;
  std::array<char, 4096> buffer{};
  for (std::size_t got; (got = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0;)
    output.append(buffer.data(), got);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

struct scratch_dir {
  fs::path path = fs::temp_directory_path() / ("gradaccum_inspect_" + std::to_string(::getpid()));
  scratch_dir() { fs::create_directories(path); }
  ~scratch_dir() { fs::remove_all(path); }
};

/// A window whose ids hold a NUL byte and a terminal escape (binary archives only), and 'w'.
weighted_gradients_record window(bool text) {
  weighted_gradients_record record;
  record.state = {float_dtype::f32, 1024.0, 7.0, 2};
  if (!text) {
    record.gradients.tensors.push_back({"\x1b[2J", float_dtype::f32, {1, 1}, std::vector<float>{3.5F}});
    record.gradients.tensors.push_back({std::string("a\0b", 3), float_dtype::f32, {1, 2}, std::vector{0.5F, -1.0F}});
    record.gradients.tensors.push_back({std::string("a\0c", 3), float_dtype::f32, {1, 2}, std::vector{0.5F, -1.0F}});
  }
  record.gradients.tensors.push_back({"w", float_dtype::f32, {2, 3}, std::vector<float>{1, 2, 3, 4, 5, 6}});
  return record;
}

}  // namespace

TEST_CASE("a window saved with its dynamic_loss_scale is shown whole in every format, ids escaped") {
  const scratch_dir dir;
  const dynamic_loss_scale_state scale{32768.0, 5, 1};
  for (const checkpoint_format format : test::all_formats) {
    CAPTURE(format);
    const bool text = detail::is_text_format(format);
    const fs::path path = dir.path / ("window" + test::extension_of(format));
    detail::save_file(path, window(text), format, &scale);  // what save_checkpoint(path, window, scaler) writes
    const run_result result = inspect({path.string()});
    CHECK(result.status == 0);
    const std::string rows = text ? "  id   dtype  shape   min  max  non-finite\n"
                                    "  'w'  F32    [2, 3]    1    6  0\n"
                                  : "  id         dtype  shape   min  max  non-finite\n"
                                    "  '\\x1b[2J'  F32    [1, 1]  3.5  3.5  0\n"
                                    "  'a\\x00b'   F32    [1, 2]   -1  0.5  0\n"
                                    "  'a\\x00c'   F32    [1, 2]   -1  0.5  0\n"
                                    "  'w'        F32    [2, 3]    1    6  0\n";
    CHECK(result.output == "file: " + detail::quote(path.string(), path.string().size()) +
                               "\nformat: " + std::string(to_string(format)) +
                               " (from the extension)\n"
                               "record: weighted_gradients_record, format version 5 (XXH3-64 checksums verified)\n"
                               "loss scale: scale 32768, growth_tracker 5, hysteresis_left 1\n"
                               "state: dtype F32, loss_scale 1024, total_weight 7, microbatches 2\n"
                               "tensors: " +
                               std::string(text ? "1, 6" : "4, 11") + " values, 0 non-finite\n" + rows);
  }
}

TEST_CASE("the inspector shows a gradients record or a state by the record its file names") {
  const scratch_dir dir;
  const fs::path gradients = dir.path / "gradients.json";
  save_checkpoint(gradients, gradients_params_record{});
  const run_result shown = inspect({gradients.string()});
  CHECK(shown.status == 0);
  CHECK(shown.output.find("record: gradients_params_record, format version 5") != std::string::npos);
  const fs::path state = dir.path / "state.pbin";
  save_checkpoint(state, weighted_accumulation_state{float_dtype::f64, 2.0, 3.0, 1});
  const run_result state_shown = inspect({state.string()});
  CHECK(state_shown.status == 0);
  CHECK(state_shown.output.find("state: dtype F64, loss_scale 2, total_weight 3, microbatches 1") != std::string::npos);
}

TEST_CASE("the inspector refuses a file read as another archive, naming it") {
  const scratch_dir dir;
  const fs::path path = dir.path / "window.pbin";
  save_checkpoint(path, window(false));
  const run_result result = inspect({path.string(), "--format", "binary"});
  CHECK(result.status == 1);
  CHECK(result.output.find("checkpoint is a portable binary archive, not a binary archive; load it as "
                           "portable_binary.") != std::string::npos);
}
