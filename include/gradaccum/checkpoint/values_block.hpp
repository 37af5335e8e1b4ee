#pragma once
/// @file
/// @brief The values block of a binary gradients record: its directory and the writer of the
/// block (the reader is in `record_loading.hpp`).

#include <algorithm>
#include <array>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <limits>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <variant>
#include <vector>

#include <cereal/cereal.hpp>

#include "gradaccum/checkpoint/checksum.hpp"
#include "gradaccum/checkpoint/record_fields.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum::detail {

// ---- The values block of a binary gradients record ---------------------------------------------
//
// Binary archives write a gradients record as: its tag; its tensor count; the size and
// bytes of its directory; the size in bytes of its values block; the directory checksum; the
// values block; and, as the record's `checksum`, the block's. Per tensor the directory holds,
// little-endian: id length (4 bytes), id, dtype (1 byte: 0 F16, 1 BF16, 2 F32, 3 F64), rank
// (1 byte), dimensions (8 bytes each) and the offset in bytes of its values in the block (8
// bytes, a multiple of its element size). Tensors' values do not overlap, and every byte of
// the block outside them is zero. The directory checksum is the XXH3-64 of the count, the
// directory and the block's size (integers as 8 bytes little-endian), the block's that of its
// bytes with values little-endian. A writer lays the block out as it likes: an accumulator
// writes its buffer as it is, so a load into the same layout is one read straight into the
// buffer, and a record its tensors in record order. The directory is checked whole before
// anything is placed by it.

/// Fewest and most bytes a tensor's directory entry takes before its offset: an empty id and
/// rank 0; the longest id and rank `max_rank`.
inline constexpr std::uint64_t min_directory_entry_bytes = 4 + 1 + 1;
inline constexpr std::uint64_t max_directory_entry_bytes = 4 + max_id_length + 1 + 1 + 8 * max_rank;
inline constexpr std::uint64_t block_offset_bytes = 8;

/// The checksum that guards a binary directory and what it is read with.
inline std::uint64_t directory_checksum(std::uint64_t count, std::string_view directory,
                                        std::uint64_t block_bytes) noexcept {
  content_hash hash;
  hash.add(count);
  hash.add_bytes(directory.data(), directory.size());
  hash.add(block_bytes);
  return hash.digest();
}

constexpr std::uint8_t dtype_code(float_dtype dtype) noexcept {
  switch (dtype) {
    case float_dtype::f16: return 0;
    case float_dtype::bf16: return 1;
    case float_dtype::f32: return 2;
    case float_dtype::f64: break;
  }
  return 3;
}

constexpr std::optional<float_dtype> dtype_of_code(std::uint8_t code) noexcept {
  constexpr std::array<float_dtype, 4> dtypes{float_dtype::f16, float_dtype::bf16, float_dtype::f32, float_dtype::f64};
  if (code >= dtypes.size()) return std::nullopt;
  return dtypes[code];
}

/// The directory of `tensors` (records or views; their ids already checked), whose values are
/// at `offsets` in the values block.
template <class Tensors>
std::string binary_directory(const Tensors& tensors, std::span<const std::uint64_t> offsets) {
  std::size_t bytes = 0;
  for (const auto& tensor : tensors) {
    bytes += min_directory_entry_bytes + block_offset_bytes + tensor.id.size() + 8 * tensor.shape.size();
  }
  std::string directory(bytes, '\0');
  auto* const start = reinterpret_cast<unsigned char*>(directory.data());
  little_endian_writer out(start);
  std::size_t i = 0;
  for (const auto& tensor : tensors) {
    out.u32(static_cast<std::uint32_t>(tensor.id.size()));
    out.bytes(tensor.id);
    out.u8(dtype_code(tensor.dtype));
    out.u8(static_cast<std::uint8_t>(tensor.shape.size()));
    for (const std::uint64_t dim : tensor.shape) out.u64(dim);
    out.u64(offsets[i++]);
  }
  return directory;
}

/// Reads a directory entry by entry; every read is checked against the bytes left.
class directory_reader {
 public:
  directory_reader(std::string_view directory, const load_site& site) noexcept : rest_(directory), site_(site) {}

  [[nodiscard]] bool at_end() const noexcept { return rest_.empty(); }

  std::string_view id() {
    const auto length = little_endian<std::uint32_t>();
    if (length > max_id_length) {
      site_.fail({"has a tensor id of ", length, " bytes, more than the ", max_id_length, " allowed."});
    }
    return take(length);
  }
  float_dtype dtype() {
    const auto code = little_endian<std::uint8_t>();
    const std::optional<float_dtype> dtype = dtype_of_code(code);
    if (!dtype) site_.fail({"has unknown dtype code ", static_cast<unsigned>(code), "; codes are 0 to 3."});
    return *dtype;
  }
  template <class U>
  U little_endian() {
    const std::string_view bytes = take(sizeof(U));
    if constexpr (std::endian::native == std::endian::little) {
      U value = 0;
      std::memcpy(&value, bytes.data(), sizeof(U));
      return value;
    } else {
      std::uint64_t value = 0;
      for (std::size_t i = 0; i < sizeof(U); ++i) {
        value |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
      }
      return static_cast<U>(value);
    }
  }

 private:
  std::string_view take(std::size_t count) {
    if (count > rest_.size())
      site_.fail({"has a directory that ends inside a tensor's entry: it is truncated or corrupt."});
    const std::string_view taken = rest_.substr(0, count);
    rest_.remove_prefix(count);
    return taken;
  }

  std::string_view rest_;
  const load_site& site_;
};

/// Writes pieces of values as raw blocks, joining pieces that follow each other in memory (as
/// the segments of a window's buffer do) into one block of at most `saved_block_bytes`.
template <class Archive>
class values_writer {
 public:
  explicit values_writer(Archive& ar) noexcept : ar_(ar) {}
  values_writer(const values_writer&) = delete;
  values_writer& operator=(const values_writer&) = delete;
  ~values_writer() = default;

  template <class S>
  void add(std::span<const S> piece) {
    auto* open = std::get_if<std::span<const S>>(&pending_);
    if (open != nullptr && open->data() + open->size() == piece.data()) {
      *open = std::span<const S>(open->data(), open->size() + piece.size());
    } else {
      flush();
      pending_ = piece;
    }
    if (std::visit([](auto values) { return values.size_bytes(); }, pending_) >= saved_block_bytes) flush();
  }

  void flush() {
    std::visit(
        [&](auto values) {
          if (!values.empty()) ar_(cereal::binary_data(values.data(), values.size_bytes()));
        },
        pending_);
    pending_ = std::span<const float>();
  }

 private:
  Archive& ar_;
  values_view pending_;
};

}  // namespace gradaccum::detail
