/// @file
/// @brief Checkpoints lose nothing: checksums catch changed bits (anywhere in a small checkpoint,
/// in large values hashed while they load, in a window's values block and its directory) and
/// changed ids, ids text archives cannot hold are refused, and numbers in cereal's XML archive
/// parse strictly.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <utility>
#include <vector>

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

namespace {

std::string replace_first(std::string text, const std::string& from, const std::string& to) {
  const std::size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.replace(at, from.size(), to);
}

errc code_of_parse(const std::string& bytes, checkpoint_format format) {
  try {
    (void)parse_checkpoint<weighted_gradients_record>(bytes, format);
  } catch (const error& e) {
    return e.code();
  }
  FAIL("the bytes loaded");
  return errc::invalid_record;
}

}  // namespace

TEST_CASE("a changed bit anywhere in a checkpoint is refused, or leaves its content as it was") {
  for (const checkpoint_format format : all_formats) {
    CAPTURE(format);
    const std::string bytes = serialize_checkpoint(fixture_window(), format);
    for (std::size_t byte = 0; byte < bytes.size(); ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        std::string flipped = bytes;
        flipped[byte] = static_cast<char>(flipped[byte] ^ (1 << bit));
        try {
          const auto loaded = parse_checkpoint<weighted_gradients_record>(flipped, format);
          // Only text can change without changing content (a tab for a carriage return).
          CHECK_MESSAGE(detail::is_text_format(format), "byte " << byte << " bit " << bit << " loaded");
          CHECK_MESSAGE(loaded == fixture_window(), "byte " << byte << " bit " << bit << " changed the content");
        } catch (const error& e) {
          // The state's own fields are reported as invalid_state when they no longer parse.
          CHECK((e.code() == errc::invalid_record || e.code() == errc::invalid_state));
        }
      }
    }
  }
  // A value's bit: loaded silently before checksums.
  std::string binary = serialize_checkpoint(fixture_window(), checkpoint_format::binary);
  const float five_and_a_half = 5.5F;
  const std::size_t at = binary.find(std::string(reinterpret_cast<const char*>(&five_and_a_half), sizeof(float)));
  REQUIRE(at != std::string::npos);
  binary[at] = static_cast<char>(binary[at] ^ 1);
  CHECK(code_of_parse(binary, checkpoint_format::binary) == errc::invalid_record);
  const std::string json = replace_first(serialize_checkpoint(fixture_window(), checkpoint_format::json), "5.5", "5.4");
  CHECK(code_of_parse(json, checkpoint_format::json) == errc::invalid_record);
}

TEST_CASE("ids with a NUL byte: binary archives keep them, text archives refuse them") {
  weighted_gradients_record record = fixture_window();
  record.gradients.tensors[0].id = std::string("decoder.bias\0x", 14);
  for (const checkpoint_format format : all_formats) {
    CAPTURE(format);
    if (detail::is_text_format(format)) {
      CHECK_THROWS_AS((void)serialize_checkpoint(record, format), error);
    } else {
      CHECK(parse_checkpoint<weighted_gradients_record>(serialize_checkpoint(record, format), format) == record);
    }
  }
  // A document that holds one: the JSON reader keeps every byte (the checksum, over the id as
  // written, then refuses the changed id).
  const std::string json = read_text(fs::path(GRADACCUM_TEST_FIXTURES) / "window_v5.json");
  try {
    (void)parse_checkpoint<weighted_gradients_record>(
        replace_first(json, "\"decoder.bias\"", "\"decoder.bias\\u0000x\""), checkpoint_format::json);
    FAIL("a changed id loaded");
  } catch (const error& e) {
    CHECK(e.code() == errc::invalid_record);
    CHECK(std::string(e.what()).find("gradients record has checksum") != std::string::npos);
  }
}

TEST_CASE("state fields read through cereal's XML archive parse strictly") {
  // cereal reads XML numbers with std::stod, which takes "2abc" for 2 and "0x10" for 16.
  const std::string xml = test::save_plain<test::xml_archives>(fixture_window());
  for (const char* bad : {"2abc", "0x10", "+2", "2 3"}) {
    CAPTURE(bad);
    try {
      (void)test::load_plain<test::xml_archives, weighted_gradients_record>(
          replace_first(xml, ">320.5<", std::string(">") + bad + "<"));
      FAIL("the document loaded");
    } catch (const error& e) {
      CHECK(e.code() == errc::invalid_state);
    }
  }
}

TEST_CASE("large values are hashed while they load: a changed bit anywhere is refused, nothing changes") {
  // 3,000,001 floats (an odd count, so the last 32 KiB piece is partial) beside a small tensor.
  constexpr std::size_t large = 3'000'001;
  parameter_set<eigen_backend> params;
  params.add("a.small", tensor_shape{3}, {});
  params.add("b.large", tensor_shape{large}, {});
  Eigen::VectorXf small(3);
  small << 1.5F, -2.0F, 0.25F;
  Eigen::VectorXf big(static_cast<Eigen::Index>(large));
  for (Eigen::Index i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i % 1000) * 0.125F - 7.0F;
  gradients_params<eigen_backend> both;
  both.insert("a.small", small);
  both.insert("b.large", big);
  gradients_params<eigen_backend> only_small;
  only_small.insert("a.small", small);

  weighted_gradients_accumulator<eigen_backend> full(float_dtype::f32, 1.0);
  full.accumulate_sum(params, both, 4);
  weighted_gradients_accumulator<eigen_backend> sparse(float_dtype::f32, 1.0);
  sparse.accumulate_sum(params, only_small, 2);
  const scratch_dir dir;
  const fs::path full_path = dir.path / "full.bin";
  const fs::path sparse_path = dir.path / "sparse.bin";
  save_checkpoint(full_path, full);
  save_checkpoint(sparse_path, sparse);

  weighted_gradients_accumulator<eigen_backend> restored(float_dtype::f32, 1.0);
  for (int round = 0; round < 3; ++round) {  // the third load reuses the first's buffer
    load_checkpoint(full_path, params, restored);
    CHECK(restored.try_to_record() == full.try_to_record());
  }
  // A reused buffer is not zeroed before a load writes it: what the sparse file does not hold
  // must still read as absent and zero afterwards.
  load_checkpoint(sparse_path, params, restored);
  load_checkpoint(sparse_path, params, restored);
  CHECK(restored.try_to_record() == sparse.try_to_record());
  const std::span<const float> flat = restored.pending().flat<float>();
  const std::size_t large_offset = (*restored.pending().layout())[1].offset;
  CHECK(std::all_of(flat.begin() + static_cast<std::ptrdiff_t>(large_offset), flat.end(),
                    [](float x) { return std::bit_cast<std::uint32_t>(x) == 0; }));

  const std::string bytes = read_text(full_path);
  const float first = big[0] * 1.0F;
  const std::size_t values_at = bytes.find(std::string(reinterpret_cast<const char*>(&first), sizeof first));
  REQUIRE(values_at != std::string::npos);
  const weighted_gradients_record before = restored.try_to_record();
  for (const std::size_t element : {std::size_t{0}, large / 2, large - 1}) {
    CAPTURE(element);
    std::string flipped = bytes;
    flipped[values_at + element * sizeof(float) + 1] ^= 0x10;
    const fs::path path = dir.path / "flipped.bin";
    std::ofstream(path, std::ios::binary) << flipped;
    try {
      load_checkpoint(path, params, restored);
      FAIL("the changed file loaded");
    } catch (const error& e) {
      CHECK(e.code() == errc::invalid_record);
    }
    CHECK(restored.try_to_record() == before);
  }
}

TEST_CASE(
    "a window's values block: a changed bit or a cut anywhere in it or its directory is refused, nothing changes") {
  // Segments padded to 16 elements and an absent parameter: the block the window writes holds
  // zeros between its tensors. Loaded into the same layout it is read whole; into a parameter
  // set in another order, tensor by tensor.
  const auto parameters = [](bool reversed) {
    std::vector<std::pair<std::string, tensor_shape>> list{
        {"c", tensor_shape{12}}, {"a", tensor_shape{2, 7}}, {"d", tensor_shape{2}}, {"b", tensor_shape{4, 4}}};
    if (reversed) std::reverse(list.begin(), list.end());
    parameter_set<eigen_backend> params;
    for (const auto& [id, shape] : list) params.add(id, shape, {});
    return params;
  };
  const parameter_set<eigen_backend> params = parameters(false);
  gradients_params<eigen_backend> grads;
  grads.insert("c", Eigen::VectorXf::LinSpaced(12, -3.0F, 8.0F).eval());
  grads.insert("a", Eigen::MatrixXf::Constant(2, 7, 0.75F));
  grads.insert("b", Eigen::MatrixXf::Identity(4, 4));
  weighted_gradients_accumulator<eigen_backend> window(float_dtype::f32, 8.0);
  window.accumulate_sum(params, grads, 3);
  const weighted_gradients_record saved = window.try_to_record();
  const scratch_dir dir;
  const fs::path path = dir.path / "window.ckpt";
  for (const checkpoint_format format : {checkpoint_format::binary, checkpoint_format::portable_binary}) {
    CAPTURE(format);
    save_checkpoint(path, window, format);
    const std::string bytes = read_text(path);
    for (const bool reversed : {false, true}) {
      CAPTURE(reversed);
      const parameter_set<eigen_backend> target_params = parameters(reversed);
      weighted_gradients_accumulator<eigen_backend> target(float_dtype::f32, 2.0);
      gradients_params<eigen_backend> other;
      other.insert("d", Eigen::VectorXf::Constant(2, -1.5F).eval());
      target.accumulate_sum(target_params, other, 1);
      const weighted_gradients_record before = target.try_to_record();
      const auto refused = [&](const std::string& changed) {
        std::ofstream(path, std::ios::binary | std::ios::trunc) << changed;
        try {
          load_checkpoint(path, target_params, target, format);
          return false;
        } catch (const error& e) {
          return e.code() == errc::invalid_record || e.code() == errc::invalid_state;
        }
      };
      std::size_t loaded = 0;
      for (std::size_t byte = 0; byte < bytes.size(); ++byte) {
        for (int bit = 0; bit < 8; ++bit) {
          std::string flipped = bytes;
          flipped[byte] = static_cast<char>(flipped[byte] ^ (1 << bit));
          if (!refused(flipped)) ++loaded;
        }
      }
      for (std::size_t length = 0; length < bytes.size(); ++length) {
        if (!refused(bytes.substr(0, length))) ++loaded;
      }
      CHECK(loaded == 0);
      CHECK(target.try_to_record() == before);
      std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
      load_checkpoint(path, target_params, target, format);
      CHECK(target.try_to_record() == saved);
      const std::span<const float> flat = target.pending().flat<float>();
      CHECK(std::count_if(flat.begin(), flat.end(), [](float x) { return x != 0.0F; }) == 12 + 14 + 4 - 1);
    }
  }
}
