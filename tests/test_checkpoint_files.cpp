/// @file
/// @brief checkpoint.hpp: checkpoint files. Saved and loaded by path in every format, chosen
/// explicitly or by extension; saving is atomic (a writer killed mid-save never leaves a torn
/// file: the previous checkpoint always loads); a failed save or load changes nothing; an
/// asynchronous save snapshots the window as of the call; and a window written by one process
/// and continued by another finishes bit-identically to the uninterrupted window.

#include <bit>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <random>
#include <string>
#include <system_error>
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

#include "test_checkpoint_fixture.hpp"
#include "test_checkpoint_support.hpp"
#include "test_helpers.hpp"

extern char** environ;

using namespace gradaccum;
using backend = eigen_backend;
using test::extension_of;
namespace fs = std::filesystem;

namespace {

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

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

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

/// The fixture window after `k` microbatches.
weighted_gradients_accumulator<backend> window_after(const parameter_set<backend>& params, std::size_t k) {
  weighted_gradients_accumulator<backend> accumulator(test::window::work_dtype, test::window::loss_scale);
  test::window::run(accumulator, params, 0, k);
  return accumulator;
}

}  // namespace

TEST_CASE("checkpoints round-trip by path in every format, chosen by extension or explicitly") {
  const scratch_directory directory;
  const parameter_set<backend> params = test::window::make_parameters<backend>();
  const auto accumulator = window_after(params, 4);
  const weighted_gradients_record record = accumulator.try_to_record();
  for (checkpoint_format format : test::all_formats) {
    CAPTURE(format);
    const fs::path by_extension = directory / ("window" + extension_of(format));
    save_checkpoint(by_extension, record);
    GRADACCUM_CHECK_SAME_BITS(load_checkpoint<weighted_gradients_record>(by_extension), record);
    CHECK(read_bytes(by_extension) == serialize_checkpoint(record, format));

    const fs::path explicit_format = directory / "window.ckpt";
    save_checkpoint(explicit_format, accumulator, format);
    // Binary archives write an accumulator's buffer as it is, a record's values in record order.
    if (detail::is_text_format(format)) CHECK(read_bytes(explicit_format) == serialize_checkpoint(record, format));
    GRADACCUM_CHECK_SAME_BITS(parse_checkpoint<weighted_gradients_record>(read_bytes(explicit_format), format), record);
    weighted_gradients_accumulator<backend> restored(float_dtype::f64, 2.0);
    load_checkpoint(explicit_format, params, restored, format);
    GRADACCUM_CHECK_SAME_BITS(restored.try_to_record(), record);
  }
  CHECK(directory.files() == std::vector<std::string>{"window.bin", "window.ckpt", "window.json",
                                                      "window.pbin"});  // no temporary left behind
}

TEST_CASE("the extension names the format in any case; another extension is refused before anything is written") {
  CHECK(checkpoint_format_for("a/b.bin") == checkpoint_format::binary);
  CHECK(checkpoint_format_for("b.PBIN") == checkpoint_format::portable_binary);
  CHECK(checkpoint_format_for("b.Json") == checkpoint_format::json);
  for (checkpoint_format format : test::all_formats) CHECK(parse_checkpoint_format(to_string(format)) == format);
  CHECK_FALSE(parse_checkpoint_format("JSON").has_value());

  const scratch_directory directory;
  for (const char* name : {"window.ckpt", "window.xml"}) {
    CAPTURE(name);
    const fs::path unknown = directory / name;
    try {
      save_checkpoint(unknown, weighted_gradients_record{});
      FAIL("saved to a path without a known extension");
    } catch (const fs::filesystem_error& e) {
      CHECK(e.code() == std::errc::invalid_argument);
      CHECK(e.path1() == unknown);
      CHECK(std::string(e.what()).find(unknown.extension().string()) != std::string::npos);
      CHECK(std::string(e.what()).find("use .bin, .pbin or .json") != std::string::npos);
    }
    CHECK_THROWS_AS((void)load_checkpoint<weighted_gradients_record>(unknown), fs::filesystem_error);
  }
  CHECK(directory.files().empty());
}

TEST_CASE("a checkpoint read as another archive or record type is refused naming what it holds") {
  const scratch_directory directory;
  const parameter_set<backend> params = test::window::make_parameters<backend>();
  const auto window = window_after(params, 3);
  const weighted_gradients_record record = window.try_to_record();
  const dynamic_loss_scale scaler;
  const auto description = [](checkpoint_format format) {
    switch (format) {
      case checkpoint_format::binary: return std::string("a binary archive");
      case checkpoint_format::portable_binary: return std::string("a portable binary archive");
      case checkpoint_format::json: break;
    }
    return std::string("a JSON document");
  };
  // What is written: each record type, and a window with its loss scale.
  const std::vector<std::string> written_kinds = {"weighted_gradients_record", "gradients_params_record",
                                                  "weighted_accumulation_state", "window_and_scale"};
  // What is read: each record type, and an accumulator without and with its scaler.
  const std::vector<std::string> read_kinds = {"weighted_gradients_record", "gradients_params_record",
                                               "weighted_accumulation_state", "accumulator", "accumulator_and_scaler"};
  for (checkpoint_format written : test::all_formats) {
    for (const std::string& written_kind : written_kinds) {
      const fs::path path = directory / "checkpoint.data";
      if (written_kind == "weighted_gradients_record") save_checkpoint(path, record, written);
      if (written_kind == "gradients_params_record") save_checkpoint(path, record.gradients, written);
      if (written_kind == "weighted_accumulation_state") save_checkpoint(path, record.state, written);
      if (written_kind == "window_and_scale") save_checkpoint(path, window, scaler, written);
      const std::string written_record =
          written_kind == "window_and_scale" ? "weighted_gradients_record" : written_kind;
      for (checkpoint_format read : test::all_formats) {
        const std::string prefix = "checkpoint " + detail::quote(path.string()) + ": ";
        if (read != written) {
          const std::string other_archive = prefix + "checkpoint is " + description(written) + ", not " +
                                            description(read) + "; load it as " + std::string(to_string(written)) + ".";
          try {
            (void)checkpoint_version(path, read);
            FAIL("checkpoint_version read a " << to_string(written) << " checkpoint as " << to_string(read));
          } catch (const error& e) {
            CHECK(e.code() == errc::invalid_record);
            CHECK(std::string(e.what()) == other_archive);
          }
        } else {
          CHECK(checkpoint_version(path, read) == record_format_version);
        }
        for (const std::string& read_kind : read_kinds) {
          CAPTURE(written);
          CAPTURE(written_kind);
          CAPTURE(read);
          CAPTURE(read_kind);
          const bool into_accumulator = read_kind.starts_with("accumulator");
          const std::string read_record = into_accumulator ? "weighted_gradients_record" : read_kind;
          const bool with_scaler = read_kind == "accumulator_and_scaler";
          const bool saved_scale = written_kind == "window_and_scale";
          if (read == written && read_record == written_record && (!into_accumulator || with_scaler == saved_scale)) {
            continue;  // a matching read: loads (tested elsewhere)
          }
          std::string expected;  // the whole message, or, where it holds a size, a part of it
          if (read != written) {
            expected = prefix + "checkpoint is " + description(written) + ", not " + description(read) +
                       "; load it as " + std::string(to_string(written)) + ".";
          } else if (read_record != written_record) {
            expected = prefix + "expected a " + read_record + ", but the input holds a " + written_record + ".";
          } else if (with_scaler) {
            expected = prefix +
                       "checkpoint holds no dynamic loss scale after its weighted_gradients_record; load it "
                       "without a scaler.";
          } else {
            expected = detail::is_text_format(read)
                           ? prefix + "checkpoint holds more than its weighted_gradients_record"
                           : "bytes after its record; it is not one " + std::string(to_string(read)) + " record";
            expected +=
                " (a window saved with its dynamic_loss_scale loads with load_checkpoint(path, params, "
                "accumulator, scaler)).";
          }
          weighted_gradients_accumulator<backend> target(float_dtype::f64, 2.0);
          dynamic_loss_scale target_scaler(dynamic_loss_scale_options{1024.0});
          try {
            if (read_kind == "weighted_gradients_record") (void)load_checkpoint<weighted_gradients_record>(path, read);
            if (read_kind == "gradients_params_record") (void)load_checkpoint<gradients_params_record>(path, read);
            if (read_kind == "weighted_accumulation_state") {
              (void)load_checkpoint<weighted_accumulation_state>(path, read);
            }
            if (read_kind == "accumulator") load_checkpoint(path, params, target, read);
            if (read_kind == "accumulator_and_scaler") load_checkpoint(path, params, target, target_scaler, read);
            FAIL("loaded");
          } catch (const error& e) {
            CHECK(e.code() == errc::invalid_record);
            CHECK(e.param_id().empty());
            const std::string message = e.what();
            if (expected.starts_with(prefix)) {
              CHECK(message == expected);
            } else {
              CHECK_MESSAGE(message.ends_with(expected), message);
            }
          }
          CHECK(target.try_to_record() == weighted_gradients_record{{}, {float_dtype::f64, 2.0, 0.0, 0}});
          CHECK(target_scaler.state() == dynamic_loss_scale_state{1024.0, 0, 1});
        }
      }
    }
  }
}

TEST_CASE("a save that fails leaves the previous checkpoint as it was, and no temporary") {
  const scratch_directory directory;
  const fs::path path = directory / "window.bin";
  const weighted_gradients_record good = window_after(test::window::make_parameters<backend>(), 2).try_to_record();
  save_checkpoint(path, good);
  const std::string before = read_bytes(path);

  SUBCASE("a record that would not load back") {
    weighted_gradients_record duplicate = good;
    duplicate.gradients.tensors.push_back(duplicate.gradients.tensors.front());
    const std::string id = duplicate.gradients.tensors.front().id;
    GRADACCUM_CHECK_REJECTED(save_checkpoint(path, duplicate), errc::invalid_record, id);
    weighted_gradients_record negative = good;
    negative.state.total_weight = -1.0;
    GRADACCUM_CHECK_REJECTED(save_checkpoint(path, negative), errc::invalid_state, "");
  }
  SUBCASE("a directory that does not exist") {
    const fs::path missing = directory / "missing" / "window.bin";
    try {
      save_checkpoint(missing, good);
      FAIL("saved into a missing directory");
    } catch (const fs::filesystem_error& e) {
      CHECK(e.code() == std::errc::no_such_file_or_directory);
      CHECK(e.path1().parent_path() == missing.parent_path());
    }
  }
  CHECK(read_bytes(path) == before);
  CHECK(directory.files() == std::vector<std::string>{"window.bin"});
}

TEST_CASE("loading a missing file or a directory throws filesystem_error naming the path") {
  const scratch_directory directory;
  const fs::path missing = directory / "missing.bin";
  try {
    (void)load_checkpoint<weighted_gradients_record>(missing);
    FAIL("loaded a missing file");
  } catch (const fs::filesystem_error& e) {
    CHECK(e.code() == std::errc::no_such_file_or_directory);
    CHECK(e.path1() == missing);
  }
  fs::create_directory(directory / "folder.bin");
  CHECK_THROWS_AS((void)load_checkpoint<weighted_gradients_record>(directory / "folder.bin"), fs::filesystem_error);
}

TEST_CASE("a checkpoint that does not fit the parameters leaves the accumulator unchanged") {
  const scratch_directory directory;
  const parameter_set<backend> params = test::window::make_parameters<backend>();
  auto accumulator = window_after(params, 3);
  const weighted_gradients_record before = accumulator.try_to_record();

  parameter_set<backend> other;
  other.add("unrelated", tensor_shape{2, 2}, eigen_cpu_device{});
  const fs::path path = directory / "other.json";
  {
    weighted_gradients_accumulator<backend> foreign(float_dtype::f32, 8.0);
    gradients_params<backend> grads;
    grads.insert("unrelated", backend::tensor<float>(backend::tensor<float>::Ones(2, 2)));
    foreign.accumulate_sum(other, grads, 1.0);
    save_checkpoint(path, foreign);
  }
  try {
    load_checkpoint(path, params, accumulator);
    FAIL("loaded a checkpoint of other parameters");
  } catch (const error& e) {
    CHECK(e.code() == errc::unknown_parameters);
    CHECK(e.param_id() == "unrelated");
    CHECK(std::string(e.what()).find(path.string()) != std::string::npos);
  }
  GRADACCUM_CHECK_SAME_BITS(accumulator.try_to_record(), before);

  std::ofstream(path, std::ios::trunc) << "{\"weighted_gradients_record\": ";  // torn JSON
  GRADACCUM_CHECK_REJECTED(load_checkpoint(path, params, accumulator), errc::invalid_record, "");
  GRADACCUM_CHECK_SAME_BITS(accumulator.try_to_record(), before);
}

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
