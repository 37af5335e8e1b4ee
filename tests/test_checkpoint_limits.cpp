/// @file
/// @brief Checkpoint files at the limits: length fields cannot make a load allocate (ids longer
/// than max_id_length are refused before any allocation), files that are not regular are refused
/// without blocking, and names up to NAME_MAX save.

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <string_view>
#include <vector>

#include <sys/stat.h>

#include <doctest/doctest.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "fixtures/fixture_window.hpp"
#include "test_checkpoint_reliability.hpp"
#include "test_checkpoint_support.hpp"

using namespace gradaccum;
using namespace gradaccum::test;
using reliability::scratch_dir;
namespace fs = std::filesystem;

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
