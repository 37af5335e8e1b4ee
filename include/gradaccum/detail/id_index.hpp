#pragma once
/// @file
/// @brief Open-addressing index from string ids to positions in a caller-owned vector.
///
/// Unlike `std::unordered_map`, capacity is reserved up front and insertion never allocates,
/// which is what lets the containers commit new entries with the strong guarantee.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

namespace gradaccum::detail {

/// Reserves room for `count` elements, growing geometrically: appending one element at a time
/// with an exact `reserve(size() + 1)` would reallocate, and move every element, on each append.
template <class T>
void reserve_geometric(std::vector<T>& v, std::size_t count) {
  if (count > v.capacity()) v.reserve(std::max(count, 2 * v.capacity()));
}

/// A process-wide unique, non-zero number (never reused, so a stale cache key never matches).
inline std::uint64_t next_stamp() noexcept {
  static std::atomic<std::uint64_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed) + 1;
}

/// Version of some part of a container (its list of ids, say): two containers with the same
/// stamp hold equal parts, so what was derived from one (positions resolved for its ids) holds
/// for the other. A copy keeps the stamp; a move hands it over and renews the source's.
class version_stamp {
 public:
  version_stamp() noexcept = default;
  version_stamp(const version_stamp&) noexcept = default;
  version_stamp(version_stamp&& other) noexcept : value_(std::exchange(other.value_, next_stamp())) {}
  version_stamp& operator=(const version_stamp&) noexcept = default;
  version_stamp& operator=(version_stamp&& other) noexcept {
    value_ = std::exchange(other.value_, next_stamp());
    return *this;
  }
  ~version_stamp() = default;

  /// Called whenever the part changes.
  void renew() noexcept { value_ = next_stamp(); }
  [[nodiscard]] std::uint64_t value() const noexcept { return value_; }

 private:
  std::uint64_t value_ = next_stamp();
};

class id_index {
 public:
  /// Position of `id`, where `key_of(position)` gives the id stored at a position.
  template <class KeyOf>
  [[nodiscard]] std::optional<std::size_t> find(std::string_view id, const KeyOf& key_of) const noexcept {
    if (slots_.empty()) return std::nullopt;
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t slot = hash(id) & mask;; slot = (slot + 1) & mask) {
      const std::uint32_t stored = slots_[slot];
      if (stored == 0) return std::nullopt;
      if (key_of(stored - 1) == id) return stored - 1;
    }
  }

  /// Makes room for `count` entries; the only operation that allocates (strong guarantee).
  template <class KeyOf>
  void reserve(std::size_t count, const KeyOf& key_of) {
    std::size_t capacity = 8;
    while (capacity < 2 * count) capacity *= 2;
    if (capacity <= slots_.size()) return;
    std::vector<std::uint32_t> grown(capacity, 0);
    grown.swap(slots_);
    rebuild(size_, key_of);
  }

  /// Adds `position` under `id`; `reserve(size() + 1)` must have been called.
  void insert(std::size_t position, std::string_view id) noexcept {
    const std::size_t mask = slots_.size() - 1;
    std::size_t slot = hash(id) & mask;
    while (slots_[slot] != 0) slot = (slot + 1) & mask;
    slots_[slot] = static_cast<std::uint32_t>(position + 1);
    ++size_;
  }

  /// Re-inserts positions [0, count) after entries moved (no allocation).
  template <class KeyOf>
  void rebuild(std::size_t count, const KeyOf& key_of) noexcept {
    std::fill(slots_.begin(), slots_.end(), 0U);
    size_ = 0;
    for (std::size_t position = 0; position < count; ++position) insert(position, key_of(position));
  }

  void clear() noexcept {
    slots_.clear();
    size_ = 0;
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }

 private:
  static std::size_t hash(std::string_view id) noexcept { return std::hash<std::string_view>{}(id); }

  std::vector<std::uint32_t> slots_;  // 0 = empty, otherwise position + 1
  std::size_t size_ = 0;
};

}  // namespace gradaccum::detail
