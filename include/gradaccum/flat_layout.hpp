#pragma once
/// @file
/// @brief `flat_layout<B>`: where each parameter of a `parameter_set` lives in a window's flat
/// buffer.
///
/// Each parameter (a tied one once) owns a segment of its element count, in row-major order,
/// starting on a 64-byte boundary (`segment_alignment` elements), in parameter order. A layout is
/// built once per parameter set and shared, never copied, by the buffers laid out with it.
///
/// @code
/// const flat_layout<B>& layout = *result.gradients.layout();
/// for (const flat_segment<B>& s : layout) use(s.id, s.offset, s.size);   // present or not
/// @endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradaccum/detail/id_index.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum {

/// @brief Segments start at multiples of this many elements: 64 bytes of F32 (a cache line and
/// an AVX-512 vector), 128 of F64.
inline constexpr std::size_t segment_alignment = 16;

/// @brief Where one parameter's values live in a flat buffer.
template <class B>
struct flat_segment {
  std::string id;
  tensor_shape shape;
  typename B::device_type device;
  std::size_t offset = 0;  ///< first element, a multiple of `segment_alignment`
  std::size_t size = 0;    ///< element count
};

/// @brief The segments of every parameter of a `parameter_set`, in its order (see the file
/// comment). Immutable once built; shared by the buffers laid out with it.
template <class B>
class flat_layout {
 public:
  /// @throws error(errc::parameter_mismatch) when the elements do not fit in memory.
  explicit flat_layout(const parameter_set<B>& params) : params_identity_(params.identity()) {
    segments_.reserve(params.size());
    for (const auto& p : params) {
      const auto count = p.shape.checked_element_count();
      const std::size_t room = SIZE_MAX / 8 - segment_alignment;  // bytes of F64 must not overflow
      if (!count || *count > room || total_ > room - *count) {
        detail::fail(errc::parameter_mismatch, {"parameter '", p.id, "' has more elements than fit in memory."}, p.id);
      }
      segments_.push_back({p.id, p.shape, p.device, total_, *count});
      total_ += (*count + segment_alignment - 1) / segment_alignment * segment_alignment;
    }
    index_.reserve(segments_.size(), key_of());
    for (std::size_t i = 0; i < segments_.size(); ++i) index_.insert(i, segments_[i].id);
    by_id_.resize(segments_.size());
    for (std::size_t i = 0; i < by_id_.size(); ++i) by_id_[i] = i;
    std::sort(by_id_.begin(), by_id_.end(),
              [&](std::size_t a, std::size_t b) { return segments_[a].id < segments_[b].id; });
    sorted_id_ends_.reserve(segments_.size());
    for (const std::size_t position : by_id_) {
      sorted_ids_ += segments_[position].id;
      sorted_id_ends_.push_back(sorted_ids_.size());
    }
  }

  [[nodiscard]] std::size_t size() const noexcept { return segments_.size(); }
  [[nodiscard]] const flat_segment<B>& operator[](std::size_t position) const noexcept { return segments_[position]; }
  [[nodiscard]] auto begin() const noexcept { return segments_.cbegin(); }
  [[nodiscard]] auto end() const noexcept { return segments_.cend(); }
  /// @brief Elements of the whole buffer, padding included.
  [[nodiscard]] std::size_t elements() const noexcept { return total_; }
  /// @brief Position of `id`, if it is a parameter.
  [[nodiscard]] std::optional<std::size_t> find(std::string_view id) const noexcept {
    return index_.find(id, key_of());
  }
  /// @brief Positions sorted by id: the order of records.
  [[nodiscard]] std::span<const std::size_t> by_id() const noexcept { return {by_id_.data(), by_id_.size()}; }
  /// @brief The id of `by_id()[k]`, from one contiguous copy of the ids in that order: a load
  /// matches a record's ids against them front to back, reading memory in order.
  [[nodiscard]] std::string_view sorted_id(std::size_t k) const noexcept {
    const std::size_t begin = k == 0 ? 0 : sorted_id_ends_[k - 1];
    return std::string_view(sorted_ids_).substr(begin, sorted_id_ends_[k] - begin);
  }
  /// @brief Whether this layout was built from `params` as it is now (a set only appends).
  [[nodiscard]] bool laid_out_for(const parameter_set<B>& params) const noexcept {
    return params.identity() == params_identity_ && params.size() == segments_.size();
  }

 private:
  auto key_of() const noexcept {
    return [this](std::size_t position) -> std::string_view { return segments_[position].id; };
  }

  std::vector<flat_segment<B>> segments_;
  detail::id_index index_;
  std::vector<std::size_t> by_id_;
  std::string sorted_ids_;                   // every id in by_id_ order, back to back
  std::vector<std::size_t> sorted_id_ends_;  // where each of them ends in sorted_ids_
  std::size_t total_ = 0;
  std::uint64_t params_identity_;
};

namespace detail {

/// `f(position, first, to, count)` for each segment of `layout` meeting elements [at, at + size)
/// of the buffer: its elements [first, first + count) are the range's [to, to + count).
/// `position` is where to start looking, kept from one call to the next over ascending ranges
/// (a reduction's buckets).
template <class B, class F>
void for_each_overlap(const flat_layout<B>& layout, std::size_t& position, std::size_t at, std::size_t size, F&& f) {
  while (position < layout.size() && layout[position].offset + layout[position].size <= at) ++position;
  for (std::size_t p = position; p < layout.size() && layout[p].offset < at + size; ++p) {
    const flat_segment<B>& s = layout[p];
    const std::size_t begin = std::max(s.offset, at);
    const std::size_t end = std::min(s.offset + s.size, at + size);
    if (begin < end) f(p, begin - s.offset, begin - at, end - begin);
  }
}

}  // namespace detail
}  // namespace gradaccum
