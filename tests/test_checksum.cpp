/// @file
/// @brief checkpoint/checksum.hpp: `content_hash` is XXH3-64 of the bytes it was given, however they
/// were split, on whichever vector path the machine runs (the AVX2 one where the CPU has it).

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/checkpoint/checksum.hpp>

using gradaccum::detail::content_hash;

namespace {

/// Bytes that differ along the input, so a misplaced or skipped stripe changes the hash.
std::vector<unsigned char> pattern(std::size_t size) {
  std::vector<unsigned char> bytes(size);
  for (std::size_t i = 0; i < size; ++i) bytes[i] = static_cast<unsigned char>(i * 131 + (i >> 9));
  return bytes;
}

}  // namespace

TEST_CASE("content_hash is XXH3-64 of its bytes, whatever pieces they came in") {
  // Around XXH3's thresholds: short inputs, 240 bytes (the midsize limit), a 1,024-byte block, a
  // 256 KiB piece as checkpoints hash, and more.
  for (const std::size_t size :
       {std::size_t{0}, std::size_t{1}, std::size_t{16}, std::size_t{17}, std::size_t{240}, std::size_t{241},
        std::size_t{1024}, std::size_t{1025}, std::size_t{262144}, std::size_t{1000003}}) {
    CAPTURE(size);
    const std::vector<unsigned char> bytes = pattern(size);
    const std::uint64_t expected = XXH3_64bits(bytes.data(), bytes.size());
    for (const std::size_t piece : {std::size_t{1}, std::size_t{63}, std::size_t{4096}, std::size_t{262144}}) {
      CAPTURE(piece);
      content_hash hash;
      for (std::size_t at = 0; at < size; at += piece) hash.add_bytes(bytes.data() + at, std::min(piece, size - at));
      CHECK(hash.digest() == expected);
    }
  }
}

TEST_CASE("content_hash of a known input has XXH3-64's published value") {
  // The empty input's XXH3-64 (seed 0), as xxHash's own sanity checks list it.
  CHECK(content_hash().digest() == 0x2D06800538D394C2ULL);
  const std::vector<float> values = {1.0F, -2.5F, 0.125F};
  content_hash hash;
  hash.add_values(std::span<const float>(values));
  CHECK(hash.digest() == XXH3_64bits(values.data(), sizeof(float) * values.size()));
}
