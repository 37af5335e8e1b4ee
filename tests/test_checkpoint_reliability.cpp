/// @file
/// @brief Checkpoints lose nothing: checksums catch changed bits, files of this format load
/// from fixtures and files of older ones are refused naming their version, ids text archives
/// cannot hold are refused, files that are not regular are refused
/// without blocking, long names save, length fields cannot make a load allocate, and numbers
/// in cereal's XML archive parse strictly.

#include <algorithm>
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
#include <system_error>
#include <utility>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "fixtures/fixture_window.hpp"
#include "test_checkpoint_support.hpp"

using namespace gradaccum;
using namespace gradaccum::test;
namespace fs = std::filesystem;

namespace {

std::string replace_first(std::string text, const std::string& from, const std::string& to) {
  const std::size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.replace(at, from.size(), to);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct scratch_dir {
  fs::path path = fs::temp_directory_path() / ("gradaccum_reliability_" + std::to_string(::getpid()));
  scratch_dir() { fs::create_directories(path); }
  ~scratch_dir() { fs::remove_all(path); }
};

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

TEST_CASE("zero-element tensors save and load in every format") {
  const gradients_params_record record{{{"empty", float_dtype::f32, {0, 3}, std::vector<float>{}},
                                        {"half", float_dtype::f16, {2, 0}, std::vector<std::uint16_t>{}}}};
  for (const checkpoint_format format : all_formats) {
    CAPTURE(format);
    CHECK(parse_checkpoint<gradients_params_record>(serialize_checkpoint(record, format), format) == record);
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
