#pragma once
/// @file
/// @brief Reading records from untrusted bytes into a sink: a record (`record_sink`) or an
/// accumulator's restorer (`tensor_sink`), with every length checked before it is used.

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
#include "gradaccum/checkpoint/tensor_sink.hpp"
#include "gradaccum/checkpoint/values_block.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum::detail {

// ---- Loading into a sink -----------------------------------------------------------------------
//
// The loaders below read a record's fields in order and hand what they read to a sink, so the
// same code fills a record (`record_sink`) or restores an accumulator's tensors straight from
// the input (the accumulators' `restorer`). A sink has
//   state(const weighted_accumulation_state&)    the window's state, before any tensor;
//   reserve(std::size_t)                         a count of tensors the input can hold;
//   add(std::string&& id, float_dtype, const tensor_shape&, const values_reader<A>&)
//                                                one tensor, whose values it reads with the
//                                                reader; it may move from `id` once they are in;
// and, for binary gradients records, in place of `add`:
//   place(std::string_view id, float_dtype, const tensor_shape&)
//                                                one tensor of the directory, in its order;
//   values(const values_block<A>&)               all their values, once the directory is read.

/// @brief The values of one tensor, not read yet: `count` of them, the shape's element count.
template <class Archive>
class values_reader final : public values_source {
 public:
  values_reader(Archive& ar, std::uint64_t count, const load_site& site, std::string_view text,
                content_hash* hash) noexcept
      : ar_(ar), count_(count), site_(site), text_(text), hash_(hash) {}

  void into(std::span<float> out) const override { read(out); }
  void into(std::span<double> out) const override { read(out); }

  /// Reads the values into `out` (exactly `count` elements, e.g. a tensor's storage).
  template <raw_element S>
  void read(std::span<S> out) const {
    if constexpr (is_text_archive<Archive>) {
      parse_values_text(text_, out, site_);
      if (hash_ != nullptr) hash_->add_text_values(std::span<const S>(out));
    } else {
      // Each piece is hashed while it is still in cache; a worker thread hashing behind the
      // reads was measured no faster on a 64 MiB load.
      constexpr std::size_t block = loaded_block_bytes / sizeof(S);
      for (std::size_t done = 0; done < out.size(); done += block) {
        const std::span<S> piece = out.subspan(done, std::min(block, out.size() - done));
        ar_(cereal::binary_data(piece.data(), piece.size_bytes()));
        if (hash_ != nullptr) hash_->add_values(std::span<const S>(piece));
      }
    }
  }

  /// Reads the values into a new vector, grown only as bytes arrive (see `load_raw`).
  template <raw_element S>
  void into(std::vector<S>& out) const {
    if constexpr (is_text_archive<Archive>) {
      std::vector<S> loaded(static_cast<std::size_t>(count_));
      read(std::span<S>(loaded));
      out = std::move(loaded);
    } else {
      load_raw(ar_, out, count_, site_, "values", hash_);
    }
  }

 private:
  Archive& ar_;
  std::uint64_t count_;
  const load_site& site_;
  std::string_view text_;  // text archives: the values' text, already read
  content_hash* hash_;     // the gradients record's checksum being computed, if any
};

/// Reads one tensor's id, dtype and shape, then has `sink.add` take it and read its values.
template <class Archive, class Sink>
void load_tensor(Archive& ar, Sink& sink) {
  content_hash* const hash = active_hash;
  std::string id = load_string(ar, {errc::invalid_record, "a record tensor"}, "id", max_id_length);
  const load_site site{errc::invalid_record, "record tensor", &id};
  const float_dtype dtype = load_dtype(ar, site);

  std::array<std::uint64_t, max_rank> dims{};
  std::size_t rank = 0;
  read_field<Archive>(site, "shape", "a list of dimensions", [&] {
    ar(cereal::make_nvp("shape", archive_node{[&](auto& node) {
                          cereal::size_type declared = 0;
                          node(cereal::make_size_tag(declared));
                          if (declared > max_rank) {
                            site.fail({"has rank ", declared, ", more than the supported ", max_rank, "."});
                          }
                          rank = static_cast<std::size_t>(declared);
                          if constexpr (is_text_archive<Archive>) {
                            for (std::size_t axis = 0; axis < rank; ++axis) {
                              dims[axis] =
                                  load_unsigned(node, site, nullptr, std::numeric_limits<std::uint64_t>::max());
                            }
                          } else if (rank != 0) {
                            node(cereal::binary_data(dims.data(), rank * sizeof(std::uint64_t)));
                          }
                        }}));
  });
  const tensor_shape shape(std::span<const std::uint64_t>(dims.data(), rank));
  const std::optional<std::size_t> elements = shape.checked_element_count();
  if (!elements) site.fail({"has shape ", shape.dims(), ", whose element count overflows."});
  if (hash != nullptr) hash_tensor_header(*hash, id, dtype, std::span(dims.data(), rank), *elements);

  read_field<Archive>(site, "values", is_text_archive<Archive> ? "a string of numbers" : "", [&] {
    if constexpr (is_text_archive<Archive>) {
      std::string text;
      ar(cereal::make_nvp("values", text));
      // Every value takes a character and all but the last a separator: a bound on the count
      // before anything is allocated for it.
      if (*elements > (text.size() + 1) / 2) {
        site.fail({"has ", text.size(), " characters of values, too few for the ", *elements, " elements of shape ",
                   shape.dims(), "."});
      }
      sink.add(std::move(id), dtype, shape, values_reader<Archive>(ar, *elements, site, text, hash));
    } else {
      cereal::size_type count = 0;
      ar(cereal::make_size_tag(count));
      if (count != *elements) {
        site.fail({"declares ", count, " values for shape ", shape.dims(), " of ", *elements, " elements."});
      }
      visit_stored_type(dtype, [&]<class S>() { check_block_fits<S>(ar, count, site, "values"); });
      sink.add(std::move(id), dtype, shape, values_reader<Archive>(ar, count, site, {}, hash));
    }
  });
}

/// The directory of `count` tensors whose entries take `min_entry` to `max_entry` bytes each,
/// its size checked against both before anything is allocated or read.
template <class Archive>
std::string load_directory(Archive& ar, std::uint64_t count, std::uint64_t min_entry, std::uint64_t max_entry,
                           const load_site& site) {
  cereal::size_type directory_bytes = 0;
  ar(cereal::make_size_tag(directory_bytes));
  // Bounded by what `count` entries can take, before the bytes left are even asked (a sparse
  // file "holds" whatever it claims).
  if (directory_bytes != 0 && (directory_bytes - 1) / max_entry >= count) {
    site.fail(
        {"has a directory of ", directory_bytes, " bytes, more than the entries of its ", count, " tensors take."});
  }
  std::string directory;
  load_raw(ar, directory, directory_bytes, site, "directory");
  if (count > directory.size() / min_entry) {
    site.fail({"declares ", count, " tensors, more than its directory of ", directory.size(), " bytes holds."});
  }
  return directory;
}

/// Whether `size` bytes from `bytes` are all zero.
inline bool all_zero(const unsigned char* bytes, std::size_t size) noexcept {
  return size == 0 || (bytes[0] == 0 && std::memcmp(bytes, bytes + 1, size - 1) == 0);
}

/// @brief The values block of a binary gradients record, not read yet; its entries
/// (in directory order) lie inside it. The block is read once, either whole or entry by entry.
template <class Archive>
class values_block final : public values_block_source {
 public:
  values_block(Archive& ar, std::uint64_t bytes, std::span<const block_entry> entries, const load_site& site,
               content_hash& hash) noexcept
      : ar_(ar), bytes_(bytes), entries_(entries), site_(site), hash_(hash) {}

  [[nodiscard]] std::uint64_t bytes() const noexcept override { return bytes_; }
  [[nodiscard]] std::span<const block_entry> entries() const noexcept override { return entries_; }

  /// Reads the whole block into `out`, exactly `bytes()` of its type. The caller checks that
  /// what lies outside the entries is zero.
  void into(std::span<float> out) const override {
    values_reader<Archive>(ar_, out.size(), site_, {}, &hash_).read(out);
  }
  void into(std::span<double> out) const override {
    values_reader<Archive>(ar_, out.size(), site_, {}, &hash_).read(out);
  }

  /// Reads the block front to back: `read(i, reader)` reads the values of entry `i` with a
  /// `values_reader`; bytes outside every entry must be zero.
  template <class F>
  void each_entry(F&& read) const {
    // Zero-element entries first where an offset is shared, so they never overlap a neighbour.
    const auto before = [&](std::size_t a, std::size_t b) {
      const block_entry& x = entries_[a];
      const block_entry& y = entries_[b];
      return x.offset != y.offset ? x.offset < y.offset : x.count < y.count;
    };
    std::vector<std::size_t> order(entries_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    if (!std::is_sorted(order.begin(), order.end(), before)) std::sort(order.begin(), order.end(), before);
    std::uint64_t at = 0;
    for (const std::size_t i : order) {
      const block_entry& entry = entries_[i];
      if (entry.offset < at) site_.fail({"has tensors whose values overlap in its values block: it is corrupt."});
      zeros(entry.offset - at);
      read(i, values_reader<Archive>(ar_, entry.count, site_, {}, &hash_));
      at = entry.offset + entry.count * size_of(entry.dtype);
    }
    zeros(bytes_ - at);
  }

  /// Fails unless `size` bytes read from the block at `bytes` are zero.
  void check_zero(const unsigned char* bytes, std::size_t size) const override {
    if (!all_zero(bytes, size)) site_.fail({"has bytes outside its tensors' values that are not zero: it is corrupt."});
  }

 private:
  void each_tensor(const tensor_visitor& read) const override {
    each_entry([&](std::size_t i, const values_source& values) { read(i, values); });
  }

  void zeros(std::uint64_t count) const {
    std::array<unsigned char, 4096> piece{};
    while (count != 0) {
      const auto size = static_cast<std::size_t>(std::min<std::uint64_t>(count, piece.size()));
      read_field<Archive>(site_, "values", "", [&] { ar_(cereal::binary_data(piece.data(), size)); });
      hash_.add_bytes(piece.data(), size);
      check_zero(piece.data(), size);
      count -= size;
    }
  }

  Archive& ar_;
  std::uint64_t bytes_;
  std::span<const block_entry> entries_;
  const load_site& site_;
  content_hash& hash_;
};

/// Reads the directory of a binary gradients record (see "The values block"
/// above), has `sink` place each tensor, then hands it the values block. Every length is
/// checked against what can hold it, and the directory against its checksum, before it is
/// used; `hash` takes the block.
template <class Archive, class Sink>
void load_block_tensors(Archive& ar, Sink& sink, std::uint64_t count, const load_site& site, content_hash& hash) {
  constexpr std::uint64_t min_entry = min_directory_entry_bytes + block_offset_bytes;
  constexpr std::uint64_t max_entry = max_directory_entry_bytes + block_offset_bytes;
  std::string directory = load_directory(ar, count, min_entry, max_entry, site);
  const std::uint64_t block_bytes =
      load_unsigned(ar, site, "values block size", std::numeric_limits<std::uint64_t>::max());
  check_block_fits<char>(ar, block_bytes, site, "values");
  const std::uint64_t stored = load_unsigned(ar, site, "directory checksum", std::numeric_limits<std::uint64_t>::max());
  if (stored != directory_checksum(count, directory, block_bytes)) {
    site.fail({"has a directory with checksum ", stored, " but its content hashes to ",
               directory_checksum(count, directory, block_bytes), ": the checkpoint is corrupt."});
  }
  sink.reserve(static_cast<std::size_t>(count));
  std::vector<block_entry> entries;
  entries.reserve(static_cast<std::size_t>(count));
  directory_reader reader(directory, site);
  std::string id;  // for messages
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::string_view entry_id = reader.id();
    const float_dtype dtype = reader.dtype();
    const auto rank = reader.little_endian<std::uint8_t>();
    const auto tensor_site = [&] {
      id.assign(entry_id);
      return load_site{errc::invalid_record, "record tensor", &id};
    };
    if (rank > max_rank) {
      tensor_site().fail({"has rank ", static_cast<unsigned>(rank), ", more than the supported ", max_rank, "."});
    }
    std::array<std::uint64_t, max_rank> dims{};
    for (std::size_t axis = 0; axis < rank; ++axis) dims[axis] = reader.little_endian<std::uint64_t>();
    const tensor_shape shape(std::span<const std::uint64_t>(dims.data(), rank));
    const std::optional<std::size_t> elements = shape.checked_element_count();
    if (!elements) tensor_site().fail({"has shape ", shape.dims(), ", whose element count overflows."});
    const auto offset = reader.little_endian<std::uint64_t>();
    const std::size_t size = size_of(dtype);
    if (offset % size != 0 || offset > block_bytes || *elements > (block_bytes - offset) / size) {
      tensor_site().fail({"declares ", *elements, " elements of ", size, " bytes at offset ", offset,
                          ", which do not fit aligned in the ", block_bytes, " bytes of its values block."});
    }
    sink.place(entry_id, dtype, shape);
    entries.push_back({offset, *elements, dtype});
  }
  if (!reader.at_end()) site.fail({"has a directory with bytes after its last tensor: it is corrupt."});
  sink.values(values_block<Archive>(ar, block_bytes, entries, site, hash));
}

/// @brief A sink that fills a record.
struct record_sink {
  weighted_gradients_record record;

  void state(const weighted_accumulation_state& state) noexcept { record.state = state; }
  void reserve(std::size_t count) { record.gradients.tensors.reserve(count); }
  template <class Values>
  void add(std::string&& id, float_dtype dtype, const tensor_shape& shape, const Values& values) {
    tensor_record tensor{{}, dtype, std::vector<std::uint64_t>(shape.begin(), shape.end()), {}};
    visit_stored_type(dtype, [&]<class S>() { values.into(tensor.values.template emplace<std::vector<S>>()); });
    tensor.id = std::move(id);
    record.gradients.tensors.push_back(std::move(tensor));
  }
  void place(std::string_view id, float_dtype dtype, const tensor_shape& shape) {
    record.gradients.tensors.push_back(
        {std::string(id), dtype, std::vector<std::uint64_t>(shape.begin(), shape.end()), std::vector<float>()});
  }
  template <class Archive>
  void values(const values_block<Archive>& block) {
    block.each_entry([&](std::size_t i, const values_reader<Archive>& values) {
      tensor_record& tensor = record.gradients.tensors[i];
      visit_stored_type(tensor.dtype,
                        [&]<class S>() { values.into(tensor.values.template emplace<std::vector<S>>()); });
    });
  }
};

/// Loads one tensor of a list into `sink` through cereal, which reads the tensor type's version
/// the first time in an archive. A record's tensors load as `tensor_record`, the type they were
/// saved as, so cereal's bookkeeping of which versions it has read matches the saving side's
/// even in an archive holding several records.
template <class Archive, class Sink>
void load_listed_tensor(Archive& ar, Sink& sink);
template <class Archive>
void load_listed_tensor(Archive& ar, record_sink& sink);

/// Loads the "gradients" of a weighted record into `sink` (as `gradients_params_record` for
/// records, for the reason above).
template <class Archive, class Sink>
void load_gradients_field(Archive& ar, Sink& sink);
template <class Archive>
void load_gradients_field(Archive& ar, record_sink& sink);

template <class Sink>
struct tensor_into {
  Sink* sink;
};
template <class Sink>
struct gradients_into {
  Sink* sink;
};
template <class Sink>
struct weighted_into {
  Sink* sink;
};

template <class Archive, class Sink>
void load(Archive& ar, tensor_into<Sink>& into, const std::uint32_t version) {
  check_format_version(version, "a tensor record");
  load_tensor(ar, *into.sink);
}

template <class Archive, class Sink>
void load(Archive& ar, gradients_into<Sink>& into, const std::uint32_t version) {
  check_format_version(version, "a gradients record");
  check_tag(ar, gradients_tag);
  const load_site site{errc::invalid_record, "gradients record"};
  content_hash hash;
  const hash_scope scope(&hash);
  read_field<Archive>(site, "tensors", "a list of tensors", [&] {
    ar(cereal::make_nvp("tensors", archive_node{[&](auto& node) {
                          cereal::size_type count = 0;
                          node(cereal::make_size_tag(count));
                          if constexpr (is_text_archive<Archive>) {
                            // The count is the length of an array the archive has parsed.
                            into.sink->reserve(static_cast<std::size_t>(count));
                            for (cereal::size_type i = 0; i < count; ++i) load_listed_tensor(node, *into.sink);
                          } else {
                            load_block_tensors(node, *into.sink, count, site, hash);
                          }
                        }}));
  });
  check_checksum(ar, site, hash.digest());
}

template <class Archive, class Sink>
void load(Archive& ar, weighted_into<Sink>& into, const std::uint32_t version) {
  check_format_version(version, "a weighted gradients record");
  check_tag(ar, window_tag);
  weighted_accumulation_state state;
  // The state comes first, so a reader learns the work dtype before any tensor.
  read_field<Archive>({errc::invalid_state, "weighted gradients record"}, "state", "an accumulation state",
                      [&] { ar(cereal::make_nvp("state", state)); });
  into.sink->state(state);
  read_field<Archive>({errc::invalid_record, "weighted gradients record"}, "gradients", "a gradients record",
                      [&] { load_gradients_field(ar, *into.sink); });
}

template <class Archive, class Sink>
void load_listed_tensor(Archive& ar, Sink& sink) {
  tensor_into<Sink> tensor{&sink};
  ar(tensor);
}

template <class Archive, class Sink>
void load_gradients_field(Archive& ar, Sink& sink) {
  gradients_into<Sink> gradients{&sink};
  ar(cereal::make_nvp("gradients", gradients));
}

template <class Archive>
void load_listed_tensor(Archive& ar, record_sink& sink) {
  tensor_record tensor;
  ar(tensor);
  sink.record.gradients.tensors.push_back(std::move(tensor));
}

template <class Archive>
void load_gradients_field(Archive& ar, record_sink& sink) {
  ar(cereal::make_nvp("gradients", sink.record.gradients));
}

}  // namespace gradaccum::detail
