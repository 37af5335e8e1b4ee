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
         "tensor id " + quote(id) + " has " + std::to_string(id.size()) + " bytes, more than the " +
             std::to_string(max_id_length) + " allowed.",
         std::string(id.substr(0, 64)));
  }
  if (is_text_archive<Archive> && id.find('\0') != std::string_view::npos) {
    fail(errc::invalid_record,
         "tensor id " + quote(id) +
             " holds a NUL byte, which JSON and XML archives cannot hold; save it in a "
             "binary format.",
         std::string(id));
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
        if (hash != nullptr) hash_tensor_header(*hash, tensor.id, tensor.dtype, tensor.shape, values.size());
        if constexpr (is_text_archive<Archive>) {
          if (hash != nullptr) hash->add_text_values(values);
          ar(cereal::make_nvp("values", values_text(values)));
        } else {
          ar(cereal::make_size_tag(static_cast<cereal::size_type>(values.size())));
          save_raw_values(ar, values, hash);
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
/// block's size: where they are in `block` when they are its segments, else one after the
/// other in record order, each aligned to its element size.
template <class Tensors>
std::uint64_t block_layout(const Tensors& tensors, const values_view& block, std::vector<std::uint64_t>& offsets) {
  const auto* const base =
      std::visit([](auto values) { return reinterpret_cast<const unsigned char*>(values.data()); }, block);
  const std::uint64_t block_bytes = std::visit([](auto values) { return values.size_bytes(); }, block);
  offsets.reserve(tensors.size());
  std::uint64_t end = 0;
  for (const auto& record_or_view : tensors) {
    std::visit(
        [&](const auto values) {
          using S = typename decltype(values)::element_type;
          if (block_bytes != 0) {
            offsets.push_back(static_cast<std::uint64_t>(reinterpret_cast<const unsigned char*>(values.data()) - base));
          } else {
            end = (end + sizeof(S) - 1) / sizeof(S) * sizeof(S);
            offsets.push_back(end);
            end += values.size_bytes();
          }
        },
        view_of(record_or_view).values);
  }
  return block_bytes != 0 ? block_bytes : end;
}

/// The count, directory, block size, directory checksum and values block of a binary
/// gradients record (see above); `hash` takes the block.
template <class Archive, class Tensors>
void save_binary_tensors(Archive& ar, const Tensors& tensors, const values_view& block, content_hash& hash) {
  for (const auto& tensor : tensors) check_saved_id<Archive>(tensor.id);
  std::vector<std::uint64_t> offsets;
  const std::uint64_t block_bytes = block_layout(tensors, block, offsets);
  const std::string directory = binary_directory(tensors, offsets);
  ar(cereal::make_size_tag(static_cast<cereal::size_type>(tensors.size())));
  ar(cereal::make_size_tag(static_cast<cereal::size_type>(directory.size())));
  if (!directory.empty()) ar(cereal::binary_data(directory.data(), directory.size()));
  ar(block_bytes, directory_checksum(tensors.size(), directory, block_bytes));
  if (std::visit([](auto values) { return !values.empty(); }, block)) {
    std::visit([&](auto values) { save_raw_values(ar, values, &hash); }, block);
    return;
  }
  values_writer<Archive> values_out(ar);
  std::uint64_t end = 0;
  std::size_t i = 0;
  for (const auto& record_or_view : tensors) {
    std::visit(
        [&](const auto values) {
          using S = typename decltype(values)::element_type;
          if (offsets[i] != end) {  // alignment to the element size: fewer than 8 zero bytes
            constexpr std::array<unsigned char, 8> zeros{};
            values_out.flush();
            hash.add_bytes(zeros.data(), offsets[i] - end);
            ar(cereal::binary_data(zeros.data(), offsets[i] - end));
          }
          constexpr std::size_t piece_size = saved_block_bytes / sizeof(S);
          for (std::size_t done = 0; done < values.size(); done += piece_size) {
            const std::span<const S> piece = values.subspan(done, std::min(piece_size, values.size() - done));
            hash.add_values(piece);
            values_out.add(piece);
          }
          end = offsets[i++] + values.size_bytes();
        },
        view_of(record_or_view).values);
  }
  values_out.flush();
}

/// `tensors` (records or views) as the list of a gradients record, then the checksum of what
/// they hold: in a text archive each tensor through cereal, in a binary archive the directory
/// and values block (see above), `block` the buffer views lie in, if any.
template <class Archive, class Tensors>
void save_checksummed_tensors(Archive& ar, const Tensors& tensors, const values_view& block = {}) {
  save_tag(ar, gradients_tag);
  content_hash hash;
  ar(cereal::make_nvp("tensors", archive_node{[&](auto& node) {
                        if constexpr (is_text_archive<Archive>) {
                          const hash_scope scope(&hash);
                          node(cereal::make_size_tag(static_cast<cereal::size_type>(tensors.size())));
                          for (const auto& tensor : tensors) node(tensor);
                        } else {
                          save_binary_tensors(node, tensors, block, hash);
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
  save_checksummed_tensors(ar, gradients.tensors, gradients.block);
}

template <class Archive>
void save(Archive& ar, const weighted_gradients_view& record, const std::uint32_t /*version*/) {
  save_tag(ar, window_tag);
  ar(cereal::make_nvp("state", record.state), cereal::make_nvp("gradients", record.gradients));
}

}  // namespace gradaccum::detail
