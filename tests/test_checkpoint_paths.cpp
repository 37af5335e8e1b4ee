/// @file
/// @brief checkpoint.hpp: checkpoint files by path. Saved and loaded in every format, chosen
/// explicitly or by extension; a checkpoint read as another archive or record type is refused
/// naming what it holds; a failed save or load changes nothing and leaves no temporary.

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "test_checkpoint_files.hpp"
#include "test_checkpoint_fixture.hpp"
#include "test_checkpoint_support.hpp"
#include "test_helpers.hpp"

using namespace gradaccum;
using backend = eigen_backend;
using test::extension_of;
using namespace gradaccum::test::files;
namespace fs = std::filesystem;

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
