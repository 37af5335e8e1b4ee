/// @file
/// @brief The other process of the checkpoint tests (not a test itself):
///
///     checkpoint_helper write-window PATH FORMAT K    run the fixture window's first K
///                                                     microbatches, save_checkpoint to PATH
///     checkpoint_helper continue-window PATH FORMAT OUT
///                                                     load PATH into a new accumulator, run the
///                                                     rest of the window, save the finished
///                                                     mean to OUT (binary gradients record)
///     checkpoint_helper save-loop PATH GENERATION     save generation_record(GENERATION),
///                                                     GENERATION + 1, ... to PATH until killed
///
/// Exit status 0 on success, 1 with a message on stderr on error, 2 for a bad command line.

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "test_checkpoint_fixture.hpp"

using namespace gradaccum;
using backend = eigen_backend;

namespace {

checkpoint_format format_named(const char* name) {
  const auto format = parse_checkpoint_format(name);
  if (!format) throw std::invalid_argument(std::string("unknown format ") + name);
  return *format;
}

void write_window(const char* path, checkpoint_format format, std::size_t k) {
  const parameter_set<backend> params = test::window::make_parameters<backend>();
  weighted_gradients_accumulator<backend> accumulator(test::window::work_dtype, test::window::loss_scale);
  test::window::run(accumulator, params, 0, k);
  save_checkpoint(path, accumulator, format);
}

void continue_window(const char* path, checkpoint_format format, const char* out) {
  const parameter_set<backend> params = test::window::make_parameters<backend>();
  weighted_gradients_accumulator<backend> accumulator(float_dtype::f64, 1.0);  // adopts the checkpoint's
  load_checkpoint(path, params, accumulator, format);
  const auto done = static_cast<std::size_t>(accumulator.state().microbatches);
  test::window::run(accumulator, params, done, test::window::microbatches.size());
  save_checkpoint(out, accumulator.finish_mean(params).gradients.to_record(), checkpoint_format::binary);
}

[[noreturn]] void save_loop(const char* path, std::uint64_t generation) {
  for (;; ++generation) save_checkpoint(path, test::window::generation_record(generation), checkpoint_format::binary);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string_view mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "write-window" && argc == 5) {
      write_window(argv[2], format_named(argv[3]), std::stoul(argv[4]));
    } else if (mode == "continue-window" && argc == 5) {
      continue_window(argv[2], format_named(argv[3]), argv[4]);
    } else if (mode == "save-loop" && argc == 4) {
      save_loop(argv[2], std::stoull(argv[3]));
    } else {
      std::fputs(
          "usage: checkpoint_helper write-window PATH FORMAT K | continue-window PATH FORMAT OUT | "
          "save-loop PATH GENERATION\n",
          stderr);
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_helper: %s\n", e.what());
    return 1;
  }
  return 0;
}
