#pragma once
/// @file
/// @brief How the library holds a window whose values live on devices (`flat_storage::device`):
/// one `B::buffer<W>` per device, seen without the backend through `device_values`.

#include <concepts>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "gradaccum/device_buffers.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum::detail {

/// Where one segment of a window lives on its device: which buffer, and where in it.
struct device_place {
  std::size_t buffer = 0;
  std::size_t offset = 0;
  std::size_t size = 0;
};

/// A window's values on devices, seen without the backend: what `flat_storage` holds instead of
/// host bytes for a `device_buffers_backend`. Segments are addressed by layout position.
class device_values : public values_on_device {
 public:
  device_values(const device_values&) = delete;
  device_values& operator=(const device_values&) = delete;
  device_values(device_values&&) = delete;
  device_values& operator=(device_values&&) = delete;
  virtual ~device_values() = default;

  /// Elements [first, first + out.size()) of segment `position` into host memory, as the work
  /// dtype's bytes (`out` holds float or double); a segment is a record view's `key`.
  void read(std::size_t position, std::size_t first, std::span<std::byte> out) const override = 0;
  virtual void write(std::size_t position, std::size_t first, std::span<const std::byte> in) = 0;
  virtual void zero(std::size_t position) noexcept = 0;
  virtual void divide(std::size_t position, double first, double second) noexcept = 0;
  /// Every buffer, whole (padding and absent segments are zeros and stay zeros).
  virtual void divide_all(double first, double second) noexcept = 0;
  /// The values for an MPI library to read and write in place (`B::data`): laid out as the host
  /// window is, so only when they are one buffer, and when the backend says MPI can reach its
  /// memory; else null.
  /// @throws what `B::data` throws (waiting for the device's queued work)
  [[nodiscard]] virtual void* data(bool cuda_aware) = 0;
  /// Whether segment `position` holds only finite values, checked on its device
  /// (`B::all_finite`); empty when the backend has no such check (read host pieces instead).
  /// @throws what `B::all_finite` throws
  [[nodiscard]] virtual std::optional<bool> finite(std::size_t position) const = 0;
  /// The same for every buffer, whole (padding and absent segments hold zeros).
  [[nodiscard]] virtual std::optional<bool> all_finite() const = 0;

  [[nodiscard]] const device_place& place(std::size_t position) const noexcept { return places_[position]; }

 protected:
  explicit device_values(std::vector<device_place> places) noexcept : places_(std::move(places)) {}
  std::vector<device_place> places_;
};

/// `device_values` of backend B in work type W: one `B::buffer<W>` per device.
template <class B, class W>
class device_values_of final : public device_values {
 public:
  using buffer = typename B::template buffer<W>;

  /// Zero-filled buffers for segments at `places`, of `shapes`, on `devices` (one buffer per
  /// device). @throws what the backend's `allocate` throws
  device_values_of(std::vector<device_place> places, std::span<const tensor_shape> shapes,
                   std::span<const typename B::device_type> devices)
      : device_values(std::move(places)) {
    std::vector<std::vector<buffer_segment>> segments(devices.size());
    for (std::size_t position = 0; position < places_.size(); ++position) {
      const device_place& p = places_[position];
      segments[p.buffer].push_back({p.offset, p.size, shapes[position]});
    }
    buffers_.reserve(devices.size());
    sizes_.reserve(devices.size());
    for (std::size_t d = 0; d < devices.size(); ++d) {
      const std::size_t count = segments[d].empty() ? 0 : segments[d].back().offset + segments[d].back().size;
      buffers_.push_back(B::template allocate<W>(count, segments[d], devices[d]));
      sizes_.push_back(count);
    }
  }

  void read(std::size_t position, std::size_t first, std::span<std::byte> out) const override {
    const device_place& p = place(position);
    B::template read<W>(std::as_const(buffers_[p.buffer]), p.offset + first,
                        std::span<W>(reinterpret_cast<W*>(out.data()), out.size() / sizeof(W)));
  }
  void write(std::size_t position, std::size_t first, std::span<const std::byte> in) override {
    const device_place& p = place(position);
    B::template write<W>(buffers_[p.buffer], p.offset + first,
                         std::span<const W>(reinterpret_cast<const W*>(in.data()), in.size() / sizeof(W)));
  }
  void zero(std::size_t position) noexcept override {
    const device_place& p = place(position);
    B::template zero<W>(buffers_[p.buffer], p.offset, p.size);
  }
  void divide(std::size_t position, double first, double second) noexcept override {
    const device_place& p = place(position);
    B::template divide<W>(buffers_[p.buffer], p.offset, p.size, static_cast<W>(first), static_cast<W>(second));
  }

  /// Completes the adds the backend queued (`flush_adds`, `<gradaccum/device_buffers.hpp>`).
  void flush_adds() noexcept {
    if constexpr (requires(buffer& b) { B::template flush_adds<W>(b); }) {
      static_assert(noexcept(B::template flush_adds<W>(buffers_.front())), "flush_adds must be noexcept");
      for (buffer& b : buffers_) B::template flush_adds<W>(b);
    }
  }

  void divide_all(double first, double second) noexcept override {
    for (std::size_t d = 0; d < buffers_.size(); ++d)
      B::template divide<W>(buffers_[d], 0, sizes_[d], static_cast<W>(first), static_cast<W>(second));
  }

  [[nodiscard]] void* data(bool cuda_aware) override {
    if constexpr (requires(buffer& b) { B::template data<W>(b, cuda_aware); }) {
      if (buffers_.size() == 1) return B::template data<W>(buffers_.front(), cuda_aware);
    }
    return nullptr;
  }

  [[nodiscard]] std::optional<bool> finite(std::size_t position) const override {
    if constexpr (checks_finite) {
      const device_place& p = place(position);
      return B::template all_finite<W>(buffers_[p.buffer], p.offset, p.size);
    }
    return std::nullopt;
  }
  [[nodiscard]] std::optional<bool> all_finite() const override {
    if constexpr (checks_finite) {
      for (std::size_t d = 0; d < buffers_.size(); ++d) {
        if (!B::template all_finite<W>(buffers_[d], 0, sizes_[d])) return false;
      }
      return true;
    }
    return std::nullopt;
  }

  /// The buffer and offset of segment `position`, for the backend's add and map.
  [[nodiscard]] buffer& buffer_of(std::size_t position) noexcept { return buffers_[place(position).buffer]; }
  [[nodiscard]] const buffer& buffer_of(std::size_t position) const noexcept {
    return buffers_[place(position).buffer];
  }

 private:
  static constexpr bool checks_finite = requires(const buffer& b) {
    { B::template all_finite<W>(b, std::size_t{}, std::size_t{}) } -> std::convertible_to<bool>;
  };

  std::vector<buffer> buffers_;
  std::vector<std::size_t> sizes_;  // elements of each buffer
};

}  // namespace gradaccum::detail
