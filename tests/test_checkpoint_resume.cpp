/// @file
/// @brief checkpoint.hpp: checkpoint files to resume from. A window saves with its dynamic loss
/// scale and resumes together with it; saving is atomic (a writer killed mid-save never leaves a
/// torn file: the previous checkpoint always loads); an asynchronous save snapshots the window as
/// of the call; and a window written by one process and continued by another finishes
/// bit-identically to the uninterrupted window.

#include <bit>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/checkpoint_async.hpp>
#include <gradaccum/gradaccum.hpp>

#include "test_checkpoint_files.hpp"
#include "test_checkpoint_fixture.hpp"
#include "test_checkpoint_support.hpp"
#include "test_helpers.hpp"

extern char** environ;

using namespace gradaccum;
using backend = eigen_backend;
using test::extension_of;
using namespace gradaccum::test::files;
namespace fs = std::filesystem;

namespace {

/// Starts `checkpoint_helper` with `arguments`.
pid_t spawn_helper(const std::vector<std::string>& arguments) {
  std::vector<std::string> words = {GRADACCUM_CHECKPOINT_HELPER};
  words.insert(words.end(), arguments.begin(), arguments.end());
  std::vector<char*> argv;
  for (std::string& word : words) argv.push_back(word.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  REQUIRE(::posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) == 0);
  return pid;
}

/// Runs `checkpoint_helper` to completion; its exit status.
int run_helper(const std::vector<std::string>& arguments) {
  const pid_t pid = spawn_helper(arguments);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  return WEXITSTATUS(status);
}

}  // namespace

TEST_CASE("a window and its dynamic loss scale save in one file and resume together, bit for bit") {
  const scratch_directory directory;
  const parameter_set<backend> params = test::window::make_parameters<backend>();
  const auto accumulator = window_after(params, 4);
  const weighted_gradients_record record = accumulator.try_to_record();
  const dynamic_loss_scale_options options{
      .init_scale = 0x1.8p-3, .backoff_factor = 0.3, .growth_interval = 7, .hysteresis = 3};
  dynamic_loss_scale scaler(options);
  for (const bool overflow : {true, true, true, false, false}) scaler.update(overflow);  // 0.1875 · 0.3, counters set
  REQUIRE(scaler.state().growth_tracker == 2);

  for (checkpoint_format format : test::all_formats) {
    CAPTURE(format);
    const fs::path path = directory / ("step" + extension_of(format));
    save_checkpoint(path, accumulator, scaler);
    weighted_gradients_accumulator<backend> restored(float_dtype::f64, 2.0);
    dynamic_loss_scale resumed(options);
    load_checkpoint(path, params, restored, resumed);
    GRADACCUM_CHECK_SAME_BITS(restored.try_to_record(), record);
    CHECK(resumed.state() == scaler.state());
    CHECK(std::bit_cast<std::uint64_t>(resumed.scale()) == std::bit_cast<std::uint64_t>(scaler.scale()));

    // Without the scaler, or with one for a file that has none: refused, nothing changes.
    weighted_gradients_accumulator<backend> fresh(float_dtype::f32, 1.0);
    const weighted_gradients_record fresh_record = fresh.try_to_record();
    GRADACCUM_CHECK_REJECTED(load_checkpoint(path, params, fresh), errc::invalid_record, "");
    GRADACCUM_CHECK_SAME_BITS(fresh.try_to_record(), fresh_record);
    const fs::path plain = directory / ("plain" + extension_of(format));
    save_checkpoint(plain, accumulator);
    dynamic_loss_scale untouched(options);
    GRADACCUM_CHECK_REJECTED(load_checkpoint(plain, params, fresh, untouched), errc::invalid_record, "");
    GRADACCUM_CHECK_SAME_BITS(fresh.try_to_record(), fresh_record);
    CHECK(untouched.state() == dynamic_loss_scale(options).state());

    // A state the loading scaler's options cannot reach (growth_tracker 2 ≥ an interval of 2).
    dynamic_loss_scale_options shorter = options;
    shorter.growth_interval = 2;
    dynamic_loss_scale other(shorter);
    GRADACCUM_CHECK_REJECTED(load_checkpoint(path, params, fresh, other), errc::invalid_state, "");
    GRADACCUM_CHECK_SAME_BITS(fresh.try_to_record(), fresh_record);
    CHECK(other.state() == dynamic_loss_scale(shorter).state());
  }

  // The scale's bits are under the checksum: one flipped bit of the last byte (the scaler's
  // checksum) or of its scale is refused.
  const fs::path path = directory / "step.bin";
  std::string bytes = read_bytes(path);
  for (const std::size_t from_end : {1, 9 + 8 + 8 + 1}) {
    CAPTURE(from_end);
    std::string changed = bytes;
    changed[changed.size() - from_end] = static_cast<char>(changed[changed.size() - from_end] ^ 0x10);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << changed;
    weighted_gradients_accumulator<backend> fresh(float_dtype::f32, 1.0);
    dynamic_loss_scale untouched(options);
    GRADACCUM_CHECK_REJECTED(load_checkpoint(path, params, fresh, untouched), errc::invalid_record, "");
    CHECK(untouched.state() == dynamic_loss_scale(options).state());
  }
}

TEST_CASE("a plain accumulator's pending sums checkpoint and restore") {
  const scratch_directory directory;
  const parameter_set<backend> params = test::window::make_parameters<backend>();
  gradients_accumulator<backend> accumulator;
  accumulator.accumulate_with_dtype(params, test::window::gradients_of<backend>(0), float_dtype::f64);
  accumulator.accumulate_with_dtype(params, test::window::gradients_of<backend>(1), float_dtype::f64);
  for (checkpoint_format format : test::all_formats) {
    CAPTURE(format);
    const fs::path path = directory / ("sums" + extension_of(format));
    save_checkpoint(path, accumulator);
    gradients_accumulator<backend> restored;
    load_checkpoint(path, params, restored);
    GRADACCUM_CHECK_SAME_BITS(restored.try_to_record(), accumulator.try_to_record());
  }
}

TEST_CASE("an asynchronous save writes the window as of the call while training goes on") {
  const scratch_directory directory;
  const parameter_set<backend> params = test::window::make_parameters<backend>();
  auto accumulator = window_after(params, 3);
  const weighted_gradients_record at_call = accumulator.try_to_record();

  const fs::path path = directory / "window.bin";
  std::future<void> saved = save_checkpoint_async(path, accumulator);
  test::window::run(accumulator, params, 3, 5);  // training continues at once
  const auto finished = accumulator.finish_mean(params);
  saved.get();
  GRADACCUM_CHECK_SAME_BITS(load_checkpoint<weighted_gradients_record>(path), at_call);
  CHECK(finished.state.microbatches == 5);

  std::future<void> record_saved = save_checkpoint_async(directory / "record.json", at_call);
  record_saved.get();
  GRADACCUM_CHECK_SAME_BITS(load_checkpoint<weighted_gradients_record>(directory / "record.json"), at_call);

  // I/O errors arrive through the future; an unknown extension is refused on the calling thread.
  std::future<void> failed = save_checkpoint_async(directory / "missing" / "window.bin", accumulator);
  CHECK_THROWS_AS(failed.get(), fs::filesystem_error);
  CHECK_THROWS_AS((void)save_checkpoint_async(directory / "window.ckpt", accumulator), fs::filesystem_error);
}

TEST_CASE("a window written by one process and continued by another finishes bit-identically") {
  const scratch_directory directory;
  const gradients_params_record uninterrupted = test::window::uninterrupted_mean<backend>();
  for (checkpoint_format format : test::all_formats) {
    for (std::size_t k : {0, 3, 6}) {
      CAPTURE(format);
      CAPTURE(k);
      const std::string path = (directory / ("window" + extension_of(format))).string();
      const std::string finished = (directory / "finished.bin").string();
      REQUIRE(run_helper({"write-window", path, std::string(to_string(format)), std::to_string(k)}) == 0);
      REQUIRE(run_helper({"continue-window", path, std::string(to_string(format)), finished}) == 0);
      GRADACCUM_CHECK_SAME_BITS(load_checkpoint<gradients_params_record>(finished), uninterrupted);
    }
  }
}

TEST_CASE("a writer killed mid-save never leaves a torn checkpoint: the previous one always loads") {
  const scratch_directory directory;
  const fs::path path = directory / "window.bin";
  save_checkpoint(path, test::window::generation_record(0));
  // The generation of the checkpoint at `path`, which must be intact whenever it is read.
  const auto generation_at = [&] {
    const weighted_gradients_record loaded = load_checkpoint<weighted_gradients_record>(path);
    REQUIRE(test::window::is_intact_generation(loaded));
    return loaded.state.microbatches - 1;
  };
  std::mt19937 random(20240611);
  std::uniform_real_distribution<double> moment(0.0, 1.0);
  constexpr int kills = 30;
  int killed_mid_save = 0;  // kills that left a temporary behind
  std::uint64_t last_generation = 0;
  for (int round = 0; round < kills; ++round) {
    CAPTURE(round);
    const pid_t writer = spawn_helper({"save-loop", path.string(), std::to_string(last_generation + 1)});
    // Let the writer replace the checkpoint twice (reading it meanwhile), which times one turn of
    // its loop (build a generation's record, save it), then kill it at a random moment of a turn.
    // The turn is timed rather than assumed: a sanitized build takes tens of times longer to
    // build the record, and a fixed delay would then never reach the save.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    const auto next_generation = [&](std::uint64_t after) {
      std::uint64_t generation = after;
      while ((generation = generation_at()) == after) {
        REQUIRE(std::chrono::steady_clock::now() < deadline);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return std::pair{generation, std::chrono::steady_clock::now()};
    };
    const auto [first, first_seen] = next_generation(last_generation);
    const auto [second, second_seen] = next_generation(first);
    std::this_thread::sleep_for((second_seen - first_seen) * moment(random));
    REQUIRE(::kill(writer, SIGKILL) == 0);
    int status = 0;
    REQUIRE(::waitpid(writer, &status, 0) == writer);
    REQUIRE_MESSAGE(WIFSIGNALED(status), "the writer exited by itself, status " << status);

    const std::uint64_t generation = generation_at();
    CHECK(generation > last_generation);  // never an older checkpoint
    last_generation = generation;
    for (const std::string& name : directory.files()) {
      if (name == "window.bin") continue;
      CHECK((name.starts_with(".gradaccum-") && name.ends_with(".tmp")));
      fs::remove(directory / name);
      ++killed_mid_save;
    }
  }
  MESSAGE(killed_mid_save << " of " << kills << " kills landed mid-save; the last checkpoint is generation "
                          << last_generation);
  CHECK(killed_mid_save > 0);
}
