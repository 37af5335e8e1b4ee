#pragma once
/// @file
/// @brief `tensor_shape`: dimensions of a tensor, held inline so comparing shapes never allocates.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>

#include "gradaccum/error.hpp"

namespace gradaccum {

/// @brief Highest tensor rank the library handles.
inline constexpr std::size_t max_rank = 8;

/// @brief Dimensions of a tensor, outermost first (row-major order of the record format).
class tensor_shape {
 public:
  constexpr tensor_shape() noexcept = default;
  constexpr tensor_shape(std::initializer_list<std::size_t> dims)
      : tensor_shape(std::span(dims.begin(), dims.size())) {}

  /// @throws error(errc::invalid_record) when `dims` has more than `max_rank` entries.
  template <class Int>
  constexpr explicit tensor_shape(std::span<const Int> dims) {
    if (dims.size() > max_rank) {
      detail::fail(errc::invalid_record,
                   {"a tensor of rank ", dims.size(), " exceeds the supported rank ", max_rank, "."});
    }
    std::copy(dims.begin(), dims.end(), dims_.begin());
    rank_ = static_cast<std::uint8_t>(dims.size());
  }

  [[nodiscard]] constexpr std::size_t rank() const noexcept { return rank_; }
  [[nodiscard]] constexpr std::size_t operator[](std::size_t axis) const noexcept { return dims_[axis]; }
  [[nodiscard]] constexpr std::span<const std::size_t> dims() const noexcept { return {dims_.data(), rank_}; }
  [[nodiscard]] constexpr const std::size_t* begin() const noexcept { return dims_.data(); }
  [[nodiscard]] constexpr const std::size_t* end() const noexcept { return dims_.data() + rank_; }

  /// @brief Product of the dimensions, or empty if it overflows `std::size_t`.
  [[nodiscard]] constexpr std::optional<std::size_t> checked_element_count() const noexcept {
    std::size_t count = 1;
    for (std::size_t axis = 0; axis < rank_; ++axis) {
      if (dims_[axis] != 0 && count > SIZE_MAX / dims_[axis]) return std::nullopt;
      count *= dims_[axis];
    }
    return count;
  }

  /// @brief "[3, 4]".
  [[nodiscard]] std::string to_string() const {
    std::string text;
    detail::append_dims(text, dims());
    return text;
  }

  // Unused trailing dimensions are always zero, so member-wise equality is shape equality.
  friend constexpr bool operator==(const tensor_shape&, const tensor_shape&) noexcept = default;

 private:
  std::array<std::size_t, max_rank> dims_{};
  std::uint8_t rank_ = 0;
};

}  // namespace gradaccum
