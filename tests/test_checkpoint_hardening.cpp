/// @file
/// @brief Loading untrusted bytes: truncated inputs, flipped bits, absurd lengths and shapes,
/// negative or NaN counters, unknown dtype names, duplicate ids, wrong versions, deep nesting.
/// Each gives `gradaccum::error` with the right code and a message naming the problem — never a
/// crash, never another exception, and never an allocation larger than the remaining input can
/// justify (a replaced operator new records the largest one) — and a failed load leaves the
/// accumulator exactly as it was.

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
using backend = eigen_backend;
using test::extension_of;

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

/// Builds binary archive bytes field by field (little-endian, as cereal's binary archive writes
/// on this machine), to forge what a writer never would.
class binary_bytes {
 public:
  binary_bytes& u8(std::uint8_t value) { return raw(&value, sizeof value); }
  binary_bytes& u32(std::uint32_t value) { return raw(&value, sizeof value); }
  /// One tensor's directory entry: id length, id, dtype code, rank, dimensions, values' offset.
  binary_bytes& entry(std::string_view id, std::uint8_t dtype_code, std::initializer_list<std::uint64_t> shape,
                      std::uint64_t offset) {
    u32(static_cast<std::uint32_t>(id.size())).raw(id.data(), id.size()).u8(dtype_code);
    u8(static_cast<std::uint8_t>(shape.size()));
    for (std::uint64_t dim : shape) u64(dim);
    return u64(offset);
  }
  binary_bytes& values(std::initializer_list<float> values) {
    for (float value : values) raw(&value, sizeof value);
    return *this;
  }
  /// A record's start: the format version (cereal writes it before the first object of each
  /// record type) and the tag that names its type.
  binary_bytes& start(std::string_view magic) { return u32(record_format_version).raw(magic.data(), magic.size()); }
  binary_bytes& u64(std::uint64_t value) { return raw(&value, sizeof value); }
  binary_bytes& f64(double value) { return raw(&value, sizeof value); }
  binary_bytes& text(std::string_view value) { return u64(value.size()).raw(value.data(), value.size()); }
  /// A state's fields and its checksum, computed over what is written (so forged values reach
  /// the checks behind it); a `dtype` that is no dtype's name is hashed as F32.
  binary_bytes& state(std::string_view dtype, double loss_scale, double total_weight, std::uint64_t microbatches) {
    const float_dtype hashed = parse_float_dtype(dtype).value_or(float_dtype::f32);
    start("gradaccS").text(dtype).f64(loss_scale).f64(total_weight).u64(microbatches);
    return u64(detail::state_checksum({hashed, loss_scale, total_weight, microbatches}));
  }
  /// A gradients record of `count` tensors: `directory`, a values block of `block_bytes` whose
  /// bytes are `block`, and checksums that match them.
  binary_bytes& gradients(std::uint64_t count, const std::string& directory, const std::string& block,
                          std::uint64_t block_bytes) {
    detail::content_hash values;
    values.add_bytes(block.data(), block.size());
    start("gradaccG").u64(count).u64(directory.size()).raw(directory.data(), directory.size());
    u64(block_bytes).u64(detail::directory_checksum(count, directory, block_bytes));
    return raw(block.data(), block.size()).u64(values.digest());
  }
  binary_bytes& raw(const void* data, std::size_t size) {
    bytes_.append(static_cast<const char*>(data), size);
    return *this;
  }
  [[nodiscard]] const std::string& str() const noexcept { return bytes_; }

 private:
  std::string bytes_;
};

/// A binary window record of a valid F32 state and the given gradients record, under checksums
/// that match, so each check behind them is reached.
std::string forged_window(std::uint64_t count, const std::string& directory, const std::string& block,
                          std::uint64_t block_bytes) {
  binary_bytes bytes;
  bytes.start("gradaccW").state("F32", 1.0, 1.0, 1).gradients(count, directory, block, block_bytes);
  return bytes.str();
}

/// A binary window record of the given state and no tensors.
std::string window_with_state(std::string_view dtype, double loss_scale, double total_weight,
                              std::uint64_t microbatches) {
  binary_bytes bytes;
  bytes.start("gradaccW").state(dtype, loss_scale, total_weight, microbatches).gradients(0, "", "", 0);
  return bytes.str();
}

/// Where `check_refused` reads a document: a checkpoint format, or (none) cereal's XML input
/// archive, which records load through as through any cereal archive.
using read_as = std::optional<checkpoint_format>;
constexpr read_as cereal_xml = std::nullopt;

/// `document` (JSON, or XML of cereal's archive) with its state's `field` set to `text` and the
/// state's checksum recomputed for `state`, the state that `text` reads as, so the edit reaches
/// the checks behind the checksum.
std::string with_state(std::string document, read_as format, std::string_view field, std::string_view text,
                       const weighted_accumulation_state& state) {
  const bool json = format == checkpoint_format::json;
  // The text of the first `name`'s value: after `"name": ` up to a comma or line end in JSON,
  // after `<name>` up to the next tag in XML.
  const auto replace_value = [&](std::string_view name, std::string_view value) {
    const std::string key = json ? "\"" + std::string(name) + "\": " : "<" + std::string(name) + ">";
    const std::size_t at = document.find(key);
    REQUIRE_MESSAGE(at != std::string::npos, "no " << key << " in\n" << document);
    const std::size_t from = at + key.size();
    document.replace(from, document.find_first_of(json ? ",\n" : "<", from) - from, value);
  };
  replace_value(field, text);
  replace_value("checksum", std::to_string(detail::state_checksum(state)));  // the state's is the first
  return document;
}

const weighted_gradients_record valid_window{{{{"b", float_dtype::f32, {1, 2}, std::vector<float>{0.5F, -1.0F}},
                                               {"w", float_dtype::f32, {2, 3}, std::vector<float>{1, 2, 3, 4, 5, 6}}}},
                                             {float_dtype::f32, 1024.0, 7.0, 2}};

/// Checks that parsing `bytes` as a window record in `format` throws `error` with `code`,
/// naming `param_id`, with every one of `phrases` in the message.
void check_refused(const std::string& bytes, read_as format, errc code, std::string_view param_id,
                   std::initializer_list<std::string_view> phrases) {
  try {
    if (format) {
      (void)parse_checkpoint<weighted_gradients_record>(bytes, *format);
    } else {
      (void)test::load_plain<test::xml_archives, weighted_gradients_record>(bytes);
    }
    FAIL_CHECK("accepted, but expected rejection with " << code);
  } catch (const error& e) {
    CHECK(e.code() == code);
    CHECK(e.param_id() == param_id);
    const std::string message = e.what();
    for (std::string_view phrase : phrases) {
      CHECK_MESSAGE(message.find(phrase) != std::string::npos,
                    "message \"" << message << "\" lacks \"" << std::string(phrase) << "\"");
    }
  }
}

/// `text` with its first `occurrence` (0-based) of `from` replaced by `to`; the test fails if
/// there is no such occurrence.
std::string replaced(std::string text, std::string_view from, std::string_view to, int occurrence = 0) {
  std::size_t at = text.find(from);
  for (int i = 0; i < occurrence && at != std::string::npos; ++i) at = text.find(from, at + 1);
  REQUIRE_MESSAGE(at != std::string::npos, "no \"" << std::string(from) << "\" #" << occurrence << " in\n" << text);
  return text.replace(at, from.size(), to);
}

/// The parameters of `valid_window`, and an accumulator holding another window over them.
struct restore_target {
  parameter_set<backend> params;
  weighted_gradients_accumulator<backend> accumulator{float_dtype::f32, 4.0};

  restore_target() {
    params.add("b", tensor_shape{1, 2}, eigen_cpu_device{});
    params.add("w", tensor_shape{2, 3}, eigen_cpu_device{});
    gradients_params<backend> grads;
    grads.insert("w", backend::tensor<float>(backend::tensor<float>::Constant(2, 3, 0.25F)));
    accumulator.accumulate_sum(params, grads, 3.0);
  }
};

/// A file that is removed when the test ends.
class scratch_file {
 public:
  explicit scratch_file(std::string_view extension)
      : path_(std::filesystem::temp_directory_path() /
              ("gradaccum-hardening-" + std::to_string(::getpid()) + std::string(extension))) {}
  scratch_file(const scratch_file&) = delete;
  scratch_file& operator=(const scratch_file&) = delete;
  ~scratch_file() { std::filesystem::remove(path_); }
  const std::filesystem::path& write(const std::string& bytes) const {
    std::ofstream(path_, std::ios::binary | std::ios::trunc) << bytes;
    return path_;
  }

 private:
  std::filesystem::path path_;
};

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

TEST_CASE("negative, fractional or NaN counters and scales are refused as invalid states") {
  const std::string json = serialize_checkpoint(valid_window, checkpoint_format::json);
  const std::string xml = test::save_plain<test::xml_archives>(valid_window);
  const checkpoint_format as_json = checkpoint_format::json;
  const read_as as_xml = cereal_xml;
  const weighted_accumulation_state valid = valid_window.state;
  // Text that does not read as the field's type: refused before the state's checksum is.
  const auto json_state = [&](std::string_view field, std::string_view text) {
    return with_state(json, as_json, field, text, valid);
  };
  check_refused(json_state("microbatches", "-1"), as_json, errc::invalid_state, "",
                {"'microbatches'", "non-negative integer"});
  check_refused(json_state("microbatches", "2.5"), as_json, errc::invalid_state, "",
                {"'microbatches'", "non-negative integer"});
  check_refused(json_state("microbatches", "18446744073709551616"), as_json, errc::invalid_state, "",
                {"'microbatches'"});
  check_refused(json_state("loss_scale", "\"big\""), as_json, errc::invalid_state, "",
                {"'loss_scale'", "not a number"});
  // cereal reads XML integers with std::stoull, which takes "-1" for 2^64 - 1; these loaders do not.
  check_refused(with_state(xml, as_xml, "microbatches", "-1", valid), as_xml, errc::invalid_state, "",
                {"'microbatches'", "'-1' is not a non-negative integer"});
  // Values that read but make no valid state, under a checksum that matches them.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const auto forged = [&](double loss_scale, double total_weight, std::uint64_t microbatches) {
    return weighted_accumulation_state{float_dtype::f32, loss_scale, total_weight, microbatches};
  };
  check_refused(with_state(json, as_json, "total_weight", "NaN", forged(1024.0, nan, 2)), as_json, errc::invalid_state,
                "", {"total weight"});
  check_refused(with_state(xml, as_xml, "total_weight", "nan", forged(1024.0, nan, 2)), as_xml, errc::invalid_state, "",
                {"total weight"});
  check_refused(with_state(json, as_json, "total_weight", "-7.0", forged(1024.0, -7.0, 2)), as_json,
                errc::invalid_state, "", {"total weight -7"});
  check_refused(with_state(json, as_json, "loss_scale", "-Infinity", forged(-inf, 7.0, 2)), as_json,
                errc::invalid_state, "", {"loss scale"});
  check_refused(with_state(json, as_json, "microbatches", "0", forged(1024.0, 7.0, 0)), as_json, errc::invalid_state,
                "", {"no microbatches"});
  check_refused(with_state(json, as_json, "total_weight", "0.0", forged(1024.0, 0.0, 2)), as_json, errc::invalid_state,
                "", {"zero total weight but pending"});
  // Unchanged text under the forged checksum: the checksum refuses it.
  check_refused(with_state(json, as_json, "total_weight", "7.0", forged(1024.0, 8.0, 2)), as_json, errc::invalid_record,
                "", {"accumulation state has checksum"});
  for (double weight : {nan, -inf, -1.0}) {
    CAPTURE(weight);
    check_refused(window_with_state("F32", 1.0, weight, 1), checkpoint_format::binary, errc::invalid_state, "",
                  {"total weight"});
  }
  check_refused(window_with_state("F64", 0.0, 1.0, 1), checkpoint_format::binary, errc::invalid_state, "",
                {"loss scale 0"});
}

TEST_CASE("dtype names are checked: unknown names, other cases, non-work dtypes in the state") {
  const std::string json = serialize_checkpoint(valid_window, checkpoint_format::json);
  check_refused(replaced(json, "\"dtype\": \"F32\"", "\"dtype\": \"F128\""), checkpoint_format::json,
                errc::invalid_state, "", {"accumulation state", "unknown dtype name 'F128'"});
  check_refused(replaced(json, "\"dtype\": \"F32\"", "\"dtype\": \"f32\""), checkpoint_format::json,
                errc::invalid_state, "", {"unknown dtype name 'f32'"});
  weighted_accumulation_state f16 = valid_window.state;
  f16.dtype = float_dtype::f16;
  check_refused(with_state(json, checkpoint_format::json, "dtype", "\"F16\"", f16), checkpoint_format::json,
                errc::invalid_state, "", {"work dtype F16", "only F32 and F64"});
  check_refused(replaced(json, "\"dtype\": \"F32\"", "\"dtype\": \"Q8\"", 1), checkpoint_format::json,
                errc::invalid_record, "b", {"record tensor 'b'", "unknown dtype name 'Q8'"});
  check_refused(replaced(json, "\"dtype\": \"F32\"", "\"dtype\": 32", 2), checkpoint_format::json, errc::invalid_record,
                "w", {"record tensor 'w'", "'dtype'", "not a string"});
  // A tensor of another dtype than the state's (both F32 and F64 are known names).
  binary_bytes f64_entry;
  f64_entry.entry("w", 3, {1, 1}, 0);
  binary_bytes f64_value;
  f64_value.f64(2.0);
  check_refused(forged_window(1, f64_entry.str(), f64_value.str(), 8), checkpoint_format::binary, errc::invalid_state,
                "w", {"'w' has dtype F64", "work dtype is F32"});
  check_refused(window_with_state(std::string_view("F\x01\xff", 3), 1.0, 1.0, 1), checkpoint_format::binary,
                errc::invalid_state, "", {"unknown dtype name 'F\\x01\\xff'"});
}

TEST_CASE("a record listing an id twice is refused, naming it") {
  binary_bytes block;
  block.values({1, 2, 3});
  binary_bytes twice;
  twice.entry("w", 2, {1, 1}, 0).entry("w", 2, {1, 1}, 4);
  check_refused(forged_window(2, twice.str(), block.str().substr(0, 8), 8), checkpoint_format::binary,
                errc::invalid_record, "w", {"lists tensor 'w' twice"});
  // Out of order, the duplicates are not neighbours.
  binary_bytes unsorted;
  unsorted.entry("w", 2, {1, 1}, 0).entry("a", 2, {1, 1}, 4).entry("w", 2, {1, 1}, 8);
  check_refused(forged_window(3, unsorted.str(), block.str(), 12), checkpoint_format::binary, errc::invalid_record, "w",
                {"lists tensor 'w' twice"});
  // Out of order without duplicates is a valid record, and keeps its order.
  binary_bytes reversed;
  reversed.entry("w", 2, {1, 1}, 0).entry("a", 2, {1, 1}, 4);
  const auto loaded = parse_checkpoint<weighted_gradients_record>(
      forged_window(2, reversed.str(), block.str().substr(0, 8), 8), checkpoint_format::binary);
  CHECK(loaded.gradients.tensors[0].id == "w");
  CHECK(loaded.gradients.tensors[1].id == "a");
  // In a text archive, under a checksum that matches (the ids are hashed).
  weighted_gradients_record renamed = valid_window;
  renamed.gradients.tensors[1].id = "c";
  const std::string json = serialize_checkpoint(renamed, checkpoint_format::json);
  detail::content_hash hash;
  for (const tensor_record& tensor : valid_window.gradients.tensors) {
    const auto& values = std::get<std::vector<float>>(tensor.values);
    detail::hash_tensor_header(hash, "b", tensor.dtype, tensor.shape, values.size());
    hash.add_text_values(std::span<const float>(values));
  }
  std::string twice_json = replaced(json, "\"id\": \"c\"", "\"id\": \"b\"");
  const std::size_t checksum_at = twice_json.rfind("\"checksum\": ") + 12;  // the gradients' is the last
  twice_json.replace(checksum_at, twice_json.find('\n', checksum_at) - checksum_at, std::to_string(hash.digest()));
  check_refused(twice_json, checkpoint_format::json, errc::invalid_record, "b", {"lists tensor 'b' twice"});
}

TEST_CASE("a format version other than this build's is refused for every record type") {
  std::string binary = serialize_checkpoint(valid_window, checkpoint_format::binary);
  binary[0] = 4;  // the weighted record's version comes first
  check_refused(binary, checkpoint_format::binary, errc::invalid_record, "",
                {"weighted gradients record has format version 4; this build reads version 5 only."});
  const std::string json = serialize_checkpoint(valid_window, checkpoint_format::json);
  const char* types[] = {"weighted gradients record", "accumulation state", "gradients record", "tensor record"};
  for (int occurrence = 0; occurrence < 4; ++occurrence) {
    CAPTURE(types[occurrence]);
    check_refused(replaced(json, "\"cereal_class_version\": 5", "\"cereal_class_version\": 4", occurrence),
                  checkpoint_format::json, errc::invalid_record, "",
                  {types[occurrence], "format version 4; this build reads version 5 only."});
  }
  const std::string xml = test::save_plain<test::xml_archives>(valid_window);
  check_refused(replaced(xml, "<cereal_class_version>5<", "<cereal_class_version>7<", 3), cereal_xml,
                errc::invalid_record, "", {"tensor record has format version 7"});
  std::string portable = serialize_checkpoint(valid_window, checkpoint_format::portable_binary);
  portable[1] = 3;  // after the byte-order byte
  check_refused(portable, checkpoint_format::portable_binary, errc::invalid_record, "",
                {"weighted gradients record has format version 3; this build reads version 5 only."});
}

TEST_CASE("values a text archive cannot hold for their dtype are refused") {
  const std::string json = serialize_checkpoint(valid_window, checkpoint_format::json);
  check_refused(replaced(json, "\"0.5 -1\"", "\"0.5 1e300\""), checkpoint_format::json, errc::invalid_record, "b",
                {"record tensor 'b'", "the value '1e300', which is not an F32 value"});
  check_refused(replaced(json, "\"0.5 -1\"", "\"0.5 -1x\""), checkpoint_format::json, errc::invalid_record, "b",
                {"record tensor 'b'", "the value '-1x', which is not an F32 value"});
  check_refused(replaced(json, "\"0.5 -1\"", "[0.5, -1]"), checkpoint_format::json, errc::invalid_record, "b",
                {"record tensor 'b'", "'values'", "not a string of numbers"});
  check_refused(replaced(json, "\"0.5 -1\"", "\"0.5\""), checkpoint_format::json, errc::invalid_record, "b",
                {"holds 1 values for the 2 elements"});
  check_refused(replaced(json, "\"0.5 -1\"", "\"0.5 -1 2\""), checkpoint_format::json, errc::invalid_record, "b",
                {"holds more values than the 2 of its shape"});
  // Too short for the shape's element count before anything is allocated for it.
  check_refused(replaced(json, "\"0.5 -1\"", "\"1\""), checkpoint_format::json, errc::invalid_record, "b",
                {"1 characters of values, too few for the 2 elements"});
  // Any whitespace separates; what to_chars writes for infinities reads back.
  weighted_gradients_record infinite = valid_window;
  std::get<std::vector<float>>(infinite.gradients.tensors[0].values)[1] = -std::numeric_limits<float>::infinity();
  const std::string spaced =
      replaced(serialize_checkpoint(infinite, checkpoint_format::json), "\"0.5 -inf\"", "\" 0.5\\n\\t-inf \"");
  GRADACCUM_CHECK_SAME_BITS(parse_checkpoint<weighted_gradients_record>(spaced, checkpoint_format::json), infinite);
  const gradients_params_record half{{{"h", float_dtype::f16, {1, 1}, std::vector<std::uint16_t>{0x3c00}}}};
  const std::string half_json = serialize_checkpoint(half, checkpoint_format::json);
  try {
    (void)parse_checkpoint<gradients_params_record>(replaced(half_json, "15360", "70000"), checkpoint_format::json);
    FAIL("a 16-bit value of 70000 loaded");
  } catch (const error& e) {
    CHECK(e.code() == errc::invalid_record);
    CHECK(std::string(e.what()).find("'70000', which is not a 16-bit pattern") != std::string::npos);
  }
  const std::string half_xml = test::save_plain<test::xml_archives>(half);
  const auto load_xml = [](const std::string& bytes) {
    return test::load_plain<test::xml_archives, gradients_params_record>(bytes);
  };
  CHECK_THROWS_AS((void)load_xml(replaced(half_xml, ">15360<", ">-4294901761<")), error);
}

TEST_CASE("documents cereal's parsers mishandle are refused, or read exactly") {
  // Nesting deeper than any record: RapidJSON recurses once per level.
  constexpr std::size_t depth = 200000;
  check_refused(std::string(depth, '[') + std::string(depth, ']'), checkpoint_format::json, errc::invalid_record, "",
                {"nests deeper than 32"});
  check_refused("{\"a\": [1, 2,]}", checkpoint_format::json, errc::invalid_record, "", {"not valid JSON", "byte 12"});
  // Numbers RapidJSON 1.1 misread (its full-precision conversion calls clz(0) and indexes its
  // table of powers of ten out of bounds) are read exactly now; a changed weight fails the checksum.
  const std::string json = serialize_checkpoint(valid_window, checkpoint_format::json);
  for (const char* number : {"0e-300", "184467440737095516156"}) {
    CAPTURE(number);
    check_refused(replaced(json, "7.0", number), checkpoint_format::json, errc::invalid_record, "", {"checksum"});
  }
  for (const char* number : {"1844044.1841844674401e-337", "184.184e-9223372036854775807"}) {  // below any double
    CAPTURE(number);
    check_refused(replaced(json, "7.0", number), checkpoint_format::json, errc::invalid_state, "", {"'total_weight'"});
  }
  const std::string scaled_twenty_digits = replaced(json, "7.0", "70000000000000000000e-19");
  GRADACCUM_CHECK_SAME_BITS(parse_checkpoint<weighted_gradients_record>(scaled_twenty_digits, checkpoint_format::json),
                            valid_window);
  const std::string twenty_digits = replaced(json, "7.0", "7.0000000000000000000");
  GRADACCUM_CHECK_SAME_BITS(parse_checkpoint<weighted_gradients_record>(twenty_digits, checkpoint_format::json),
                            valid_window);
}

TEST_CASE("bytes after a binary record, or a document without the record, are refused") {
  check_refused(serialize_checkpoint(valid_window, checkpoint_format::binary) + std::string(4, '\0'),
                checkpoint_format::binary, errc::invalid_record, "", {"4 bytes after its record"});
  check_refused(
      "{\"weighted_gradients_record\": {\"cereal_class_version\": 5, \"record\": \"weighted_gradients_record\"}}",
      checkpoint_format::json, errc::invalid_state, "", {"'state'", "missing"});
  check_refused("[1, 2]", checkpoint_format::json, errc::invalid_record, "", {"holds no record"});
  check_refused("{\"value0\": 5}", checkpoint_format::json, errc::invalid_record, "", {"not a valid json"});
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
