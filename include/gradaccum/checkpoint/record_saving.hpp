#pragma once
/// @file
/// @brief Writing records' tensors: one node per tensor in text archives, the directory and one
/// values block in binary ones, each with its checksum.

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
#include <memory>
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
#include "gradaccum/checkpoint/values_block.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum::detail {

// ---- Saving ------------------------------------------------------------------------------------

/// Refuses an id that would not load back: too long, or with a NUL byte in a text archive.
template <class Archive>
void check_saved_id(std::string_view id) {
  if (id.size() > max_id_length) {
    fail(errc::invalid_record,
         {"tensor id ", quote(id), " has ", id.size(), " bytes, more than the ", max_id_length, " allowed."},
         id.substr(0, 64));
  }
  if (is_text_archive<Archive> && id.find('\0') != std::string_view::npos) {
    fail(errc::invalid_record,
         {"tensor id ", quote(id),
          " holds a NUL byte, which JSON and XML archives cannot hold; save it in a binary format."},
         id);
  }
}

/// Host memory for the pieces of values read from a `values_on_device` (a device window's):
/// `saved_block_bytes`, allocated at the first piece, so a save stages at most that much. A
/// piece is placed after the previous one while it fits, so consecutive small tensors stay
/// adjacent and are written together; `release` is called before memory is reused.
class values_staging {
 public:
  template <class S, class Release>
  std::span<const S> read(const tensor_view& tensor, std::size_t first, std::size_t count, Release&& release) {
    if (!bytes_) bytes_ = std::make_unique_for_overwrite<std::byte[]>(saved_block_bytes);
    std::size_t at = (used_ + sizeof(S) - 1) / sizeof(S) * sizeof(S);
    if (at + count * sizeof(S) > saved_block_bytes) {
      release();
      at = 0;
    }
    const std::span<std::byte> out(bytes_.get() + at, count * sizeof(S));
    tensor.source->read(tensor.key, first, out);
    used_ = at + out.size();
    return {reinterpret_cast<const S*>(out.data()), count};
  }

 private:
  std::unique_ptr<std::byte[]> bytes_;
  std::size_t used_ = 0;
};

/// `f(piece)` for `tensor`'s values (`values`, its `values` alternative) in order, in pieces of
/// at most `saved_block_bytes`: where they are, or staged from its source (`release` as above).
template <class S, class F, class Release>
void for_each_saved_piece(const tensor_view& tensor, std::span<const S> values, values_staging& staging, F&& f,
                          Release&& release) {
  constexpr std::size_t piece_size = saved_block_bytes / sizeof(S);
  const std::size_t count = tensor.size();
  for (std::size_t done = 0; done < count; done += piece_size) {
    const std::size_t n = std::min(piece_size, count - done);
    f(tensor.source == nullptr ? values.subspan(done, n) : staging.template read<S>(tensor, done, n, release));
  }
}

/// Writes values as one raw block (in pieces, each hashed first when a checksum is being
/// taken). Hashing on a worker thread instead bought nothing measurable on a 64 MiB save.
template <class Archive, class T>
void save_raw_values(Archive& ar, std::span<const T> values, content_hash* hash) {
  constexpr std::size_t block = saved_block_bytes / sizeof(T);
  for (std::size_t done = 0; done < values.size(); done += block) {
    const std::span<const T> piece = values.subspan(done, std::min(block, values.size() - done));
    if (hash != nullptr) hash->add_values(piece);
    ar(cereal::binary_data(piece.data(), piece.size_bytes()));
  }
}

template <class Archive>
void save_tensor(Archive& ar, const tensor_view& tensor) {
  check_saved_id<Archive>(tensor.id);
  content_hash* const hash = active_hash;
  save_string(ar, "id", tensor.id);
  save_string(ar, "dtype", to_string(tensor.dtype));
  ar(cereal::make_nvp("shape", archive_node{[&](auto& node) { save_elements(node, tensor.shape); }}));
  std::visit(
      [&](const auto values) {
        using S = typename decltype(values)::value_type;
        if (hash != nullptr) hash_tensor_header(*hash, tensor.id, tensor.dtype, tensor.shape, tensor.size());
        if constexpr (is_text_archive<Archive>) {
          // Text is written a tensor at a time: a device tensor is read whole, as its text is.
          std::vector<S> staged(tensor.source != nullptr ? tensor.count : 0);
          if (tensor.source != nullptr) tensor.source->read(tensor.key, 0, std::as_writable_bytes(std::span(staged)));
          const std::span<const S> all = tensor.source != nullptr ? std::span<const S>(staged) : values;
          if (hash != nullptr) hash->add_text_values(all);
          ar(cereal::make_nvp("values", values_text(all)));
        } else {
          ar(cereal::make_size_tag(static_cast<cereal::size_type>(tensor.size())));
          values_staging staging;
          for_each_saved_piece(
              tensor, values, staging,
              [&](std::span<const S> piece) {
                if (hash != nullptr) hash->add_values(piece);
                ar(cereal::binary_data(piece.data(), piece.size_bytes()));
              },
              [] {});
        }
      },
      tensor.values);
}

/// The fields of `tensor`, borrowed: a record and a view save the same way.
inline tensor_view view_of(const tensor_record& tensor) noexcept {
  // get_if, not std::visit, and spans from pointer and size, not from the vectors (which checks
  // the ranges concepts): this inline function is compiled wherever a checkpoint is.
  values_view values;
  if (const auto* bits = std::get_if<std::vector<std::uint16_t>>(&tensor.values)) {
    values = std::span<const std::uint16_t>(bits->data(), bits->size());
  } else if (const auto* f32 = std::get_if<std::vector<float>>(&tensor.values)) {
    values = std::span<const float>(f32->data(), f32->size());
  } else if (const auto* f64 = std::get_if<std::vector<double>>(&tensor.values)) {
    values = std::span<const double>(f64->data(), f64->size());
  }
  return {tensor.id, tensor.dtype, std::span<const std::uint64_t>(tensor.shape.data(), tensor.shape.size()), values};
}

inline const tensor_view& view_of(const tensor_view& tensor) noexcept {
  return tensor;
}

/// Where each of `tensors` (records or views) goes in the values block, in bytes, and the
/// block's size: where they are in `block` when they are its segments (or, for views of a
/// device window, at their `offset` in a block of `staged_block` elements), else one after the
/// other in record order, each aligned to its element size.
template <class Tensors>
std::uint64_t block_layout(const Tensors& tensors, const values_view& block, std::size_t staged_block,
                           std::vector<std::uint64_t>& offsets) {
  const auto* const base =
      std::visit([](auto values) { return reinterpret_cast<const unsigned char*>(values.data()); }, block);
  std::uint64_t block_bytes = std::visit([](auto values) { return values.size_bytes(); }, block);
  offsets.reserve(tensors.size());
  std::uint64_t end = 0;
  for (const auto& record_or_view : tensors) {
    const tensor_view& tensor = view_of(record_or_view);
    std::visit(
        [&](const auto values) {
          using S = typename decltype(values)::value_type;
          if (staged_block != 0) {
            offsets.push_back(tensor.offset * sizeof(S));
            block_bytes = staged_block * sizeof(S);
          } else if (block_bytes != 0) {
            offsets.push_back(static_cast<std::uint64_t>(reinterpret_cast<const unsigned char*>(values.data()) - base));
          } else {
            end = (end + sizeof(S) - 1) / sizeof(S) * sizeof(S);
            offsets.push_back(end);
            end += tensor.size() * sizeof(S);
          }
        },
        tensor.values);
  }
  return block_bytes != 0 ? block_bytes : end;
}

/// `bytes` zero bytes into the values block (between segments, or for alignment).
template <class Archive>
void save_zeros(Archive& ar, std::uint64_t bytes, content_hash& hash) {
  static constexpr std::array<unsigned char, 4096> zeros{};
  while (bytes != 0) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(bytes, zeros.size()));
    hash.add_bytes(zeros.data(), n);
    ar(cereal::binary_data(zeros.data(), n));
    bytes -= n;
  }
}

/// The count, directory, block size, directory checksum and values block of a binary
/// gradients record (see above); `hash` takes the block.
template <class Archive, class Tensors>
void save_binary_tensors(Archive& ar, const Tensors& tensors, const values_view& block, std::size_t staged_block,
                         content_hash& hash) {
  for (const auto& tensor : tensors) check_saved_id<Archive>(tensor.id);
  std::vector<std::uint64_t> offsets;
  const std::uint64_t block_bytes = block_layout(tensors, block, staged_block, offsets);
  const std::string directory = binary_directory(tensors, offsets);
  ar(cereal::make_size_tag(static_cast<cereal::size_type>(tensors.size())));
  ar(cereal::make_size_tag(static_cast<cereal::size_type>(directory.size())));
  if (!directory.empty()) ar(cereal::binary_data(directory.data(), directory.size()));
  ar(block_bytes, directory_checksum(tensors.size(), directory, block_bytes));
  if (std::visit([](auto values) { return !values.empty(); }, block)) {
    std::visit([&](auto values) { save_raw_values(ar, values, &hash); }, block);
    return;
  }
  // Tensor by tensor in block order (a device window's views are sorted by id, not by offset),
  // with zeros wherever the block has no tensor.
  std::vector<std::size_t> order(tensors.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (staged_block != 0) std::ranges::sort(order, {}, [&](std::size_t i) { return offsets[i]; });
  values_writer<Archive> values_out(ar);
  values_staging staging;
  std::uint64_t end = 0;
  for (const std::size_t i : order) {
    const tensor_view& tensor = view_of(tensors[i]);
    std::visit(
        [&](const auto values) {
          using S = typename decltype(values)::value_type;
          if (offsets[i] != end) {
            values_out.flush();
            save_zeros(ar, offsets[i] - end, hash);
          }
          for_each_saved_piece(
              tensor, values, staging,
              [&](std::span<const S> piece) {
                hash.add_values(piece);
                values_out.add(piece);
              },
              [&] { values_out.flush(); });
          end = offsets[i] + tensor.size() * sizeof(S);
        },
        tensor.values);
  }
  values_out.flush();
  save_zeros(ar, block_bytes - end, hash);
}

/// `tensors` (records or views) as the list of a gradients record, then the checksum of what
/// they hold: in a text archive each tensor through cereal, in a binary archive the directory
/// and values block (see above), `block` the buffer views lie in, if any, or `staged_block`
/// the element count of a device window's block.
template <class Archive, class Tensors>
void save_checksummed_tensors(Archive& ar, const Tensors& tensors, const values_view& block = {},
                              std::size_t staged_block = 0) {
  save_tag(ar, gradients_tag);
  content_hash hash;
  ar(cereal::make_nvp("tensors", archive_node{[&](auto& node) {
                        if constexpr (is_text_archive<Archive>) {
                          const hash_scope scope(&hash);
                          node(cereal::make_size_tag(static_cast<cereal::size_type>(tensors.size())));
                          for (const auto& tensor : tensors) node(tensor);
                        } else {
                          save_binary_tensors(node, tensors, block, staged_block, hash);
                        }
                      }}));
  ar(cereal::make_nvp("checksum", hash.digest()));
}

template <class Archive>
void save(Archive& ar, const tensor_view& tensor, const std::uint32_t /*version*/) {
  save_tensor(ar, tensor);
}

template <class Archive>
void save(Archive& ar, const gradients_view& gradients, const std::uint32_t /*version*/) {
  save_checksummed_tensors(ar, gradients.tensors, gradients.block, gradients.staged_block);
}

template <class Archive>
void save(Archive& ar, const weighted_gradients_view& record, const std::uint32_t /*version*/) {
  save_tag(ar, window_tag);
  ar(cereal::make_nvp("state", record.state), cereal::make_nvp("gradients", record.gradients));
}

}  // namespace gradaccum::detail
