/// @file
/// @brief Loading untrusted binary bytes: truncated inputs, flipped bits, absurd lengths and
/// shapes, directories that do not describe their block. Each gives `gradaccum::error` with the
/// right code and a message naming the problem — never a crash, never another exception, and
/// never an allocation larger than the remaining input can justify (a replaced operator new
/// records the largest one) — and a failed load leaves the accumulator exactly as it was. What a
/// well-formed record may still get wrong (counters, dtype names, ids, versions, text values) is
/// in test_checkpoint_validation.cpp.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <new>
#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include <doctest/doctest.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "replaced_new.hpp"
#include "test_checkpoint_fixture.hpp"
#include "test_checkpoint_forgery.hpp"
#include "test_checkpoint_support.hpp"
#include "test_helpers.hpp"

// ---- The largest single allocation, recorded by a replaced operator new ------------------------

namespace {
std::atomic<bool> tracking{false};
std::atomic<std::size_t> largest_allocation{0};
std::atomic<std::size_t> allocated_bytes{0};
}  // namespace

void* replaced_new::allocate(std::size_t size) {
  if (tracking.load(std::memory_order_relaxed)) {
    allocated_bytes += size;
    std::size_t seen = largest_allocation.load(std::memory_order_relaxed);
    while (size > seen && !largest_allocation.compare_exchange_weak(seen, size)) {
    }
  }
  return malloc_or_throw(size);
}
// Over-aligned allocations are not recorded, as before (only the plain forms were replaced).
void* replaced_new::allocate_aligned(std::size_t size, std::align_val_t alignment) {
  return aligned_alloc_or_throw(size, alignment);
}

using namespace gradaccum;
using namespace gradaccum::test;

namespace {

/// The largest single allocation `call` makes (and, in `allocated_bytes`, the sum of all).
template <class F>
std::size_t largest_allocation_of(F&& call) {
  largest_allocation = 0;
  allocated_bytes = 0;
  tracking = true;
  try {
    call();
  } catch (...) {
    tracking = false;
    throw;
  }
  tracking = false;
  return largest_allocation;
}

}  // namespace

TEST_CASE("the binary layout is the documented one: tags, fields in order, a directory, then one block of values") {
  // Every record starts with its version and tag; a state ends with the checksum of its
  // content; a gradients record holds its tensors as one directory (each entry with its values'
  // offset in the block), the block's size, the directory's checksum, the block and the block's
  // checksum.
  binary_bytes block;
  block.values({0.5F, -1.0F}).values({1, 2, 3, 4, 5, 6});
  binary_bytes directory;
  directory.entry("b", 2, {1, 2}, 0).entry("w", 2, {2, 3}, 8);
  binary_bytes expected;
  expected.u32(5).raw("gradaccW", 8).u32(5).raw("gradaccS", 8).text("F32").f64(1024.0).f64(7.0).u64(2);
  expected.u64(detail::state_checksum(valid_window.state));
  expected.gradients(2, directory.str(), block.str(), block.str().size());
  CHECK(expected.str().substr(0, 28) == std::string("\x05\0\0\0gradaccW\x05\0\0\0gradaccS\x03\0\0\0\0\0\0\0", 28));
  CHECK(expected.str() == serialize_checkpoint(valid_window, checkpoint_format::binary));
  // A portable binary archive starts with its byte-order byte (1: little-endian), then the same.
  CHECK(serialize_checkpoint(valid_window, checkpoint_format::portable_binary).substr(0, 13) ==
        std::string("\x01\x05\0\0\0gradaccW", 13));
}

TEST_CASE("every truncation is refused with a named problem, and a failed load changes nothing") {
  restore_target target;
  const weighted_gradients_record before = target.accumulator.try_to_record();
  for (checkpoint_format format : test::all_formats) {
    CAPTURE(format);
    const std::string whole = serialize_checkpoint(valid_window, format);
    const scratch_file file(extension_of(format));
    const std::size_t content = whole.find_last_not_of(" \t\n") + 1;  // dropping trailing newlines cuts nothing
    for (std::size_t length = 0; length < content; ++length) {
      CAPTURE(length);
      const std::string cut = whole.substr(0, length);
      try {
        (void)parse_checkpoint<weighted_gradients_record>(cut, format);
        FAIL_CHECK("a truncated checkpoint loaded");
      } catch (const error& e) {
        CHECK((e.code() == errc::invalid_record || e.code() == errc::invalid_state));
        if (!detail::is_text_format(format)) CHECK(std::string(e.what()).find("truncated") != std::string::npos);
      }
      CHECK_THROWS_AS(load_checkpoint(file.write(cut), target.params, target.accumulator), error);
    }
    GRADACCUM_CHECK_SAME_BITS(target.accumulator.try_to_record(), before);
    target.accumulator.load_record(target.params, parse_checkpoint<weighted_gradients_record>(whole, format));
    GRADACCUM_CHECK_SAME_BITS(target.accumulator.try_to_record(), valid_window);
    target.accumulator.load_record(target.params, before);
  }
}

TEST_CASE("a plain archive(record) refuses truncated binary input too: cereal itself reads only the version") {
  const std::string whole = serialize_checkpoint(valid_window, checkpoint_format::binary);
  for (std::size_t length = 0; length < whole.size(); ++length) {
    CAPTURE(length);
    try {
      (void)test::load_plain<test::binary_archives, weighted_gradients_record>(whole.substr(0, length));
      FAIL_CHECK("a truncated checkpoint loaded");
    } catch (const error& e) {
      CHECK(std::string(e.what()).find("truncated") != std::string::npos);
    } catch (const cereal::Exception&) {
      CHECK(length < sizeof(std::uint32_t));  // the outermost version, read before our loader runs
    }
  }
}

TEST_CASE("flipped bits either load as another valid record or are refused; nothing else happens") {
  for (checkpoint_format format : test::all_formats) {
    CAPTURE(format);
    const std::string whole = serialize_checkpoint(valid_window, format);
    std::size_t loaded = 0;
    std::size_t refused = 0;
    for (std::size_t position = 0; position < whole.size(); ++position) {
      for (int bit = 0; bit < 8; ++bit) {
        std::string flipped = whole;
        flipped[position] = static_cast<char>(flipped[position] ^ (1 << bit));
        try {
          const auto record = parse_checkpoint<weighted_gradients_record>(flipped, format);
          CHECK_NOTHROW(validate(record));
          // What loads is a record like any other: it saves and loads back to itself.
          GRADACCUM_CHECK_SAME_BITS(
              parse_checkpoint<weighted_gradients_record>(serialize_checkpoint(record, format), format), record);
          ++loaded;
        } catch (const error& e) {
          CHECK((e.code() == errc::invalid_record || e.code() == errc::invalid_state));
          CHECK(std::string(e.what()).size() > 20);
          ++refused;
        }
      }
    }
    MESSAGE(to_string(format) << ": " << loaded << " bit flips loaded, " << refused << " refused");
    CHECK(refused > 0);
  }
}

TEST_CASE("absurd counts, lengths and shapes are refused before anything of their size is allocated") {
  constexpr std::uint64_t huge = std::uint64_t{1} << 60;
  const auto head = [](std::uint64_t count, std::uint64_t directory_bytes) {
    binary_bytes bytes;
    bytes.start("gradaccW").state("F32", 1.0, 1.0, 1).start("gradaccG").u64(count).u64(directory_bytes);
    return bytes.str();
  };
  binary_bytes huge_id;
  huge_id.u32(0xFFFFFFFFU).raw("wwwwwwwwwwwwwwwwwwww", 20);  // long enough for one entry
  binary_bytes overflowing;
  overflowing.entry("w", 2, {1u << 31, 1u << 31, 1u << 31}, 0);
  binary_bytes huge_shape;
  huge_shape.entry("w", 2, {1000000, 1000000}, 0);
  struct forged {
    const char* what;
    std::string bytes;
    const char* param_id;
    std::vector<std::string_view> phrases;
  };
  const std::vector<forged> cases = {
      {"tensor count", head(huge, 0) + std::string(16, '\0'), "", {"declares 1152921504606846976 tensors"}},
      {"directory size", head(1, huge), "", {"more than the entries of its 1 tensors take"}},
      {"directory size past the input", head(1000, 1'000'000), "", {"'directory'", "bytes left hold"}},
      {"id length", forged_window(1, huge_id.str(), "", 0), "", {"4294967295 bytes, more than the 4096 allowed"}},
      {"overflowing shape",
       forged_window(1, overflowing.str(), "", 0),
       "w",
       {"[2147483648, 2147483648, 2147483648]", "overflows"}},
      {"values for a huge shape",
       forged_window(1, huge_shape.str(), "", 0),
       "w",
       {"1000000000000 elements of 4 bytes"}},
      {"block size past the input", forged_window(0, "", "", huge), "", {"'values'", "bytes left hold"}},
  };
  for (const forged& f : cases) {
    CAPTURE(f.what);
    const std::size_t largest = largest_allocation_of(
        [&] { check_refused(f.bytes, checkpoint_format::binary, errc::invalid_record, f.param_id, {}); });
    for (std::string_view phrase : f.phrases) {
      try {
        (void)parse_checkpoint<weighted_gradients_record>(f.bytes, checkpoint_format::binary);
      } catch (const error& e) {
        CHECK_MESSAGE(std::string(e.what()).find(phrase) != std::string::npos,
                      "message \"" << e.what() << "\" lacks \"" << std::string(phrase) << "\"");
      }
    }
    // Knowing the remaining input, nothing larger than it (plus the message) is allocated.
    CHECK(largest <= f.bytes.size() + 1024);
    // A plain archive does not know it: memory still grows only with what actually arrived.
    const std::size_t plain = largest_allocation_of(
        [&] { CHECK_THROWS((void)test::load_plain<test::binary_archives, weighted_gradients_record>(f.bytes)); });
    CHECK(plain <= 2 * f.bytes.size() + 8192);
  }
}

TEST_CASE("a large valid checkpoint is read into one allocation of exactly its values") {
  const weighted_gradients_record record = test::window::generation_record(5);
  const std::string bytes = serialize_checkpoint(record, checkpoint_format::binary);
  weighted_gradients_record loaded;
  const std::size_t largest = largest_allocation_of(
      [&] { loaded = parse_checkpoint<weighted_gradients_record>(bytes, checkpoint_format::binary); });
  CHECK(largest == 1024 * 1024 * sizeof(float));
  CHECK(test::window::is_intact_generation(loaded));
}

TEST_CASE("an accumulator restores a vector straight into its new tensor, with no buffer in between") {
  constexpr std::size_t elements = std::size_t{1} << 20;
  parameter_set<backend> params;
  params.add("v", tensor_shape{elements, 1}, eigen_cpu_device{});
  const weighted_gradients_record record{{{{"v", float_dtype::f32, {elements, 1}, std::vector<float>(elements, 0.5F)}}},
                                         {float_dtype::f32, 1.0, 1.0, 1}};
  const scratch_file file(".bin");
  const std::filesystem::path& path = file.write(serialize_checkpoint(record, checkpoint_format::binary));
  weighted_gradients_accumulator<backend> restored(float_dtype::f64, 2.0);
  (void)largest_allocation_of([&] { load_checkpoint(path, params, restored); });
  // Eigen allocates the tensor itself with malloc, which operator new does not see; what is
  // counted is the file's read buffer and small change, never a copy of the 4 MiB of values.
  CHECK(allocated_bytes < 256 * 1024);
  GRADACCUM_CHECK_SAME_BITS(restored.try_to_record(), record);
}

TEST_CASE("a binary directory that does not describe its block is refused, and changes nothing") {
  // Forged under checksums that match, so each check behind them is reached; each is refused by
  // a record load and by an accumulator load, which leaves the accumulator as it was.
  const auto window_with = forged_window;
  restore_target target;
  const weighted_gradients_record before = target.accumulator.try_to_record();
  const scratch_file file(".bin");
  const auto refused = [&](const std::string& bytes, std::string_view why) {
    CAPTURE(why);
    for (const bool into_accumulator : {false, true}) {
      try {
        if (into_accumulator) {
          load_checkpoint(file.write(bytes), target.params, target.accumulator);
        } else {
          (void)parse_checkpoint<weighted_gradients_record>(bytes, checkpoint_format::binary);
        }
        FAIL("loaded");
      } catch (const error& e) {
        CHECK(e.code() == errc::invalid_record);
        CHECK_MESSAGE(std::string(e.what()).find(why) != std::string::npos, e.what());
      }
      GRADACCUM_CHECK_SAME_BITS(target.accumulator.try_to_record(), before);
    }
  };
  binary_bytes values;
  values.values({0.5F, -1.0F, 1, 2, 3, 4, 5, 6});
  const std::string& block = values.str();
  binary_bytes good;
  good.entry("b", 2, {1, 2}, 0).entry("w", 2, {2, 3}, 8);
  CHECK(parse_checkpoint<weighted_gradients_record>(window_with(2, good.str(), block, block.size()),
                                                    checkpoint_format::binary)
            .gradients == valid_window.gradients);
  refused(window_with(5, good.str(), block, block.size()), "tensors, more than its directory");
  refused(window_with(3, good.str(), block, block.size()), "ends inside a tensor's entry");
  binary_bytes dtype;
  dtype.entry("b", 2, {1, 2}, 0).entry("w", 7, {2, 3}, 8);
  refused(window_with(2, dtype.str(), block, block.size()), "unknown dtype code 7");
  binary_bytes rank;
  rank.entry("b", 2, {1, 1, 1, 1, 1, 1, 1, 1, 2}, 0);
  refused(window_with(1, rank.str(), block, block.size()), "has rank 9");
  refused(window_with(2, good.str() + "x", block, block.size()), "bytes after its last tensor");
  binary_bytes misaligned;
  misaligned.entry("b", 2, {1, 2}, 2).entry("w", 2, {2, 3}, 10);
  refused(window_with(2, misaligned.str(), block + std::string(4, '\0'), block.size() + 4), "do not fit aligned");
  binary_bytes outside;
  outside.entry("b", 2, {1, 2}, 0).entry("w", 2, {2, 3}, 12);
  refused(window_with(2, outside.str(), block, block.size()), "do not fit aligned");
  binary_bytes huge_offset;
  huge_offset.entry("b", 2, {1, 2}, 0).entry("w", 2, {2, 3}, std::uint64_t{1} << 62);
  refused(window_with(2, huge_offset.str(), block, block.size()), "do not fit aligned");
  binary_bytes big;
  big.entry("b", 2, {1, 2}, 0).entry("w", 2, {1u << 20, 1u << 20}, 8);
  refused(window_with(2, big.str(), block, block.size()), "do not fit aligned");
  binary_bytes overlapping;
  overlapping.entry("b", 2, {1, 2}, 0).entry("w", 2, {2, 3}, 4);
  refused(window_with(2, overlapping.str(), block, block.size()), "overlap");
  // Bytes between or after the tensors' values must be zero, in a block read whole (the
  // accumulator's layout matches: 'b' is padded to 16 elements) or tensor by tensor.
  binary_bytes padded;
  padded.entry("b", 2, {1, 2}, 0).entry("w", 2, {2, 3}, 64);
  std::string spaced = block.substr(0, 8) + std::string(56, '\0') + block.substr(8);
  CHECK(parse_checkpoint<weighted_gradients_record>(window_with(2, padded.str(), spaced, spaced.size()),
                                                    checkpoint_format::binary)
            .gradients == valid_window.gradients);
  weighted_gradients_accumulator<backend> restored(float_dtype::f64, 1.0);
  load_checkpoint(file.write(window_with(2, padded.str(), spaced, spaced.size())), target.params, restored);
  CHECK(restored.try_to_record().gradients == valid_window.gradients);
  spaced[20] = 1;
  refused(window_with(2, padded.str(), spaced, spaced.size()), "not zero");
  refused(window_with(2, good.str(), block + std::string(3, '\0') + "\x01", block.size() + 4), "not zero");
  // The block's size is checked against the input before anything is read by it, and the
  // directory's size against its count and the input before it is allocated.
  refused(window_with(2, good.str(), block, std::uint64_t{1} << 50), "bytes left hold");
  const auto header = [](std::uint64_t count, std::uint64_t directory_bytes) {
    binary_bytes bytes;
    bytes.start("gradaccW").state("F32", 1.0, 1.0, 1).start("gradaccG").u64(count).u64(directory_bytes);
    return bytes.str();
  };
  refused(header(1, std::uint64_t{1} << 40), "more than the entries of its 1 tensors take");
  refused(header(1000, 1'000'000), "bytes left hold");
  // A directory or a block whose checksum does not match.
  std::string flipped = window_with(2, good.str(), block, block.size());
  flipped[flipped.find(std::string_view("\x01\x00\x00\x00w", 5)) + 4] ^= 0x20;  // 'w' -> 'W'
  refused(flipped, "has a directory with checksum");
  flipped = window_with(2, good.str(), block, block.size());
  flipped[flipped.size() - 9] ^= 0x01;
  refused(flipped, "has checksum");
}
