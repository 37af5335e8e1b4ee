#pragma once
/// @file
/// @brief `sharded_gradients<B>`: one rank's contiguous shard of a reduced window, as
/// `reduce_scatter_mean` (`<gradaccum/mpi.hpp>`) hands it out, with the map from the shard's
/// elements to parameters, for an optimizer that updates only its shard (ZeRO / FSDP style).
///
/// @code
/// auto shard = gradaccum::reduce_scatter_mean(params, window.finish_sums(), comm);
/// std::span<float> g = shard.values<float>();          // elements [begin(), begin() + size())
/// for (const gradaccum::shard_piece& p : shard.pieces())  // present parameters in the shard
///   step(p.id, p.parameter_offset, g.subspan(p.offset, p.size));
/// @endcode
///
/// The full window's buffer (`flat_gradients`, laid out by `flat_layout`) is cut into `ranks`
/// shards of equal size, a whole number of `norm_block_elements` blocks each (so a sharded
/// `global_norm` has the full one's bits), rank r holding elements [r · size, (r + 1) · size).
/// A parameter may span two or more shards; the last shards may reach past the buffer's end,
/// where they hold zeros (as absent parameters and padding do).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/flat_gradients.hpp"
#include "gradaccum/global_norm.hpp"
#include "gradaccum/records.hpp"

namespace gradaccum {

/// @brief Where shard `rank` of `ranks` lies in a buffer of `elements` (see the file comment).
struct shard_range {
  std::size_t begin = 0;   ///< first element of the buffer in the shard
  std::size_t size = 0;    ///< elements of every shard: ⌈⌈elements / block⌉ / ranks⌉ · block
  std::size_t stored = 0;  ///< of them inside the buffer: min(size, elements − begin), or 0

  friend bool operator==(const shard_range&, const shard_range&) = default;
};

/// @brief Shard `rank` of `ranks` (rank < ranks) of a buffer of `elements` elements.
[[nodiscard]] constexpr shard_range shard_of(std::size_t elements, std::size_t rank, std::size_t ranks) noexcept {
  const std::size_t blocks = (elements + norm_block_elements - 1) / norm_block_elements;
  const std::size_t size = (blocks + ranks - 1) / ranks * norm_block_elements;
  const std::size_t begin = rank * size;
  return {begin, size, begin < elements ? std::min(size, elements - begin) : 0};
}

/// @brief The part of one present parameter that lies in a shard.
struct shard_piece {
  std::string_view id;
  std::size_t position = 0;          ///< in the layout
  std::size_t offset = 0;            ///< first element in the shard's values
  std::size_t parameter_offset = 0;  ///< the same element's row-major index in the parameter
  std::size_t size = 0;              ///< elements
};

namespace detail {
/// Builds a `sharded_gradients` (the MPI reduction, `<gradaccum/mpi.hpp>`).
struct shard_access;
}  // namespace detail

/// @brief One rank's shard of a reduced window (see the file comment). Move-only: it owns
/// 1/ranks of the window's buffer.
template <class B>
class sharded_gradients {
 public:
  sharded_gradients() = default;
  sharded_gradients(sharded_gradients&&) noexcept = default;
  sharded_gradients& operator=(sharded_gradients&&) noexcept = default;
  sharded_gradients(const sharded_gradients&) = delete;
  sharded_gradients& operator=(const sharded_gradients&) = delete;
  ~sharded_gradients() = default;

  /// @brief The global state of the reduced windows (as `allreduce_mean`'s result has it).
  [[nodiscard]] const weighted_accumulation_state& state() const noexcept { return state_; }
  [[nodiscard]] float_dtype dtype() const noexcept { return state_.dtype; }
  /// @brief Whether some rank's sums held a NaN or an infinity before the reduction; the same on
  /// every rank. A sum that overflows only across ranks shows in `global_norm(shard, comm)`.
  [[nodiscard]] bool found_non_finite() const noexcept { return found_non_finite_; }

  /// @brief This shard's place in the window's buffer.
  [[nodiscard]] const shard_range& range() const noexcept { return range_; }
  /// @brief The shard's `range().size` values (empty for a default-constructed shard).
  /// @throws error(errc::invalid_dtype) when W is not `dtype()`'s type.
  template <class W>
  [[nodiscard]] std::span<const W> values() const {
    return detail::flat_storage::all_values<W>(storage_.get(), "this shard");
  }
  /// @brief Mutable values, for in-place steps (clipping).
  /// @throws error(errc::invalid_dtype) when W is not `dtype()`'s type.
  template <class W>
  [[nodiscard]] std::span<W> values() {
    return detail::flat_storage::all_values<W>(storage_.get(), "this shard");
  }

  /// @brief The layout of the whole window (every parameter, present or not); null when empty.
  [[nodiscard]] const flat_layout<B>* layout() const noexcept { return layout_.get(); }
  /// @brief Whether the parameter at `position` of `layout()` is present (on any rank).
  [[nodiscard]] bool is_present(std::size_t position) const noexcept {
    return detail::flat_storage::is_present(storage_.get(), position);
  }
  /// @brief The present parameters' parts in this shard, in parameter order.
  [[nodiscard]] std::span<const shard_piece> pieces() const noexcept { return {pieces_.data(), pieces_.size()}; }

 private:
  friend struct detail::shard_access;

  std::shared_ptr<const flat_layout<B>> layout_;
  std::shared_ptr<detail::flat_storage> storage_;  // range_.size values; presence per layout position
  std::vector<shard_piece> pieces_;
  weighted_accumulation_state state_;
  shard_range range_;
  bool found_non_finite_ = false;
  // Which reduction cut it: the same on every rank, so the collectives on shards can tell that
  // ranks passed shards of different reductions (0: none).
  std::uint64_t reduction_ = 0;
};

namespace detail {

struct shard_access {
  /// `storage` holds the shard's values (`range.size` of them) and the agreed presence.
  template <class B>
  [[nodiscard]] static sharded_gradients<B> make(std::shared_ptr<const flat_layout<B>> layout,
                                                 const std::shared_ptr<flat_storage>& storage,
                                                 const std::vector<shard_piece>& pieces,
                                                 const weighted_accumulation_state& state, const shard_range& range,
                                                 bool found_non_finite, std::uint64_t reduction) noexcept {
    sharded_gradients<B> shard;
    shard.layout_ = std::move(layout);
    shard.storage_ = storage;
    shard.pieces_ = pieces;
    shard.state_ = state;
    shard.range_ = range;
    shard.found_non_finite_ = found_non_finite;
    shard.reduction_ = reduction;
    return shard;
  }

  template <class B>
  [[nodiscard]] static std::uint64_t reduction(const sharded_gradients<B>& shard) noexcept {
    return shard.reduction_;
  }

  /// The present parameters' parts in `range`, in parameter order.
  template <class B>
  static void pieces_in(const flat_layout<B>& layout, const std::vector<std::uint8_t>& present,
                        const shard_range& range, std::vector<shard_piece>& out) {
    std::size_t from = 0;
    for_each_overlap(layout, from, range.begin, range.stored,
                     [&](std::size_t position, std::size_t first, std::size_t at, std::size_t count) {
                       if (present[position] != 0) out.push_back({layout[position].id, position, at, first, count});
                     });
  }
};

}  // namespace detail
}  // namespace gradaccum
