#pragma once
/// @file
/// @brief Shared by the tests of untrusted checkpoint input (test_checkpoint_hardening.cpp,
/// test_checkpoint_validation.cpp): records forged field by field, documents edited in place,
/// and the check that a load refuses them with the right error.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include <unistd.h>

#include <doctest/doctest.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "test_checkpoint_support.hpp"

namespace gradaccum::test {

using backend = eigen_backend;

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
inline std::string forged_window(std::uint64_t count, const std::string& directory, const std::string& block,
                                 std::uint64_t block_bytes) {
  binary_bytes bytes;
  bytes.start("gradaccW").state("F32", 1.0, 1.0, 1).gradients(count, directory, block, block_bytes);
  return bytes.str();
}

/// A binary window record of the given state and no tensors.
inline std::string window_with_state(std::string_view dtype, double loss_scale, double total_weight,
                                     std::uint64_t microbatches) {
  binary_bytes bytes;
  bytes.start("gradaccW").state(dtype, loss_scale, total_weight, microbatches).gradients(0, "", "", 0);
  return bytes.str();
}

/// Where `check_refused` reads a document: a checkpoint format, or (none) cereal's XML input
/// archive, which records load through as through any cereal archive.
using read_as = std::optional<checkpoint_format>;
inline constexpr read_as cereal_xml = std::nullopt;

/// `document` (JSON, or XML of cereal's archive) with its state's `field` set to `text` and the
/// state's checksum recomputed for `state`, the state that `text` reads as, so the edit reaches
/// the checks behind the checksum.
inline std::string with_state(std::string document, read_as format, std::string_view field, std::string_view text,
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

inline const weighted_gradients_record valid_window{
    {{{"b", float_dtype::f32, {1, 2}, std::vector<float>{0.5F, -1.0F}},
      {"w", float_dtype::f32, {2, 3}, std::vector<float>{1, 2, 3, 4, 5, 6}}}},
    {float_dtype::f32, 1024.0, 7.0, 2}};

/// Checks that parsing `bytes` as a window record in `format` throws `error` with `code`,
/// naming `param_id`, with every one of `phrases` in the message.
inline void check_refused(const std::string& bytes, read_as format, errc code, std::string_view param_id,
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
inline std::string replaced(std::string text, std::string_view from, std::string_view to, int occurrence = 0) {
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

}  // namespace gradaccum::test
