#pragma once
/// @file
/// @brief Windows whose values live on the gradients' device: what a backend with device buffers
/// provides, and how the library holds them.
///
/// A backend whose tensors live on an accelerator keeps a window's sums there, one flat buffer
/// per device, and provides (W is float or double; X is any tensor or view it takes):
///
/// @code
/// template <class W> using buffer = ...;  // W values on one device; movable (may be one type for both W)
/// // `count` zeros holding `segments` (one per parameter on this device, by offset): a backend may
/// // prepare what each segment's adds and results need, once per window layout
/// template <class W> static buffer<W> allocate(std::size_t count, std::span<const buffer_segment> segments,
///                                              const device_type&);
/// // acc[offset, offset + numel(g)) += scale · W(g), rounding twice (no FMA)
/// template <class W, class X> static void add_scaled(buffer<W>& acc, std::size_t offset, const X& g,
///                                                    W scale) noexcept;
/// // a read-only view of a result: `shape`'s elements from `offset`, row-major
/// template <class W> static auto map(const buffer<W>&, std::size_t offset, const tensor_shape& shape,
///                                    const device_type&);
/// template <class W> static void divide(buffer<W>&, std::size_t offset, std::size_t count, W first,
///                                       W second) noexcept;                  // (x / first) / second
/// template <class W> static void zero(buffer<W>&, std::size_t offset, std::size_t count) noexcept;
/// // host staging, in pieces the library bounds
/// template <class W> static void read(const buffer<W>&, std::size_t offset, std::span<W> out);
/// template <class W> static void write(buffer<W>&, std::size_t offset, std::span<const W> in);
/// @endcode
///
/// Everything else a window does (records and checkpoints, the global norm and clipping, MPI
/// reductions, a change of work dtype) goes through `read` and `write`, so its bits are the
/// host's. The library lays out each device's segments back to back (64-byte aligned) in that
/// device's buffer.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradaccum/dtype.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum {

/// @brief One parameter's segment of a device buffer: where it starts, and its shape (its
/// element count is the shape's).
struct buffer_segment {
  std::size_t offset = 0;
  std::size_t size = 0;
  tensor_shape shape;
};

/// @brief Whether backend `B` keeps windows on its tensors' devices (see the file comment).
template <class B>
concept device_buffers_backend =
    requires { typename B::template buffer<float>; } &&
    requires(typename B::template buffer<float>& b32, typename B::template buffer<double>& b64,
             const typename B::device_type& device, std::span<float> out32, std::span<const float> in32,
             std::span<double> out64, std::span<const double> in64, const tensor_shape& shape,
             std::span<const buffer_segment> segments) {
      {
        B::template allocate<float>(std::size_t{}, segments, device)
      } -> std::same_as<typename B::template buffer<float>>;
      {
        B::template allocate<double>(std::size_t{}, segments, device)
      } -> std::same_as<typename B::template buffer<double>>;
      B::template map<float>(std::as_const(b32), std::size_t{}, shape, device);
      B::template map<double>(std::as_const(b64), std::size_t{}, shape, device);
      { B::divide(b32, std::size_t{}, std::size_t{}, 1.0F, 1.0F) } noexcept;
      { B::divide(b64, std::size_t{}, std::size_t{}, 1.0, 1.0) } noexcept;
      { B::template zero<float>(b32, std::size_t{}, std::size_t{}) } noexcept;
      { B::template zero<double>(b64, std::size_t{}, std::size_t{}) } noexcept;
      B::read(std::as_const(b32), std::size_t{}, out32);
      B::read(std::as_const(b64), std::size_t{}, out64);
      B::write(b32, std::size_t{}, in32);
      B::write(b64, std::size_t{}, in64);
    };

namespace detail {

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

  void divide_all(double first, double second) noexcept override {
    for (std::size_t d = 0; d < buffers_.size(); ++d)
      B::template divide<W>(buffers_[d], 0, sizes_[d], static_cast<W>(first), static_cast<W>(second));
  }

  /// The buffer and offset of segment `position`, for the backend's add and map.
  [[nodiscard]] buffer& buffer_of(std::size_t position) noexcept { return buffers_[place(position).buffer]; }
  [[nodiscard]] const buffer& buffer_of(std::size_t position) const noexcept {
    return buffers_[place(position).buffer];
  }

 private:
  std::vector<buffer> buffers_;
  std::vector<std::size_t> sizes_;  // elements of each buffer
};

}  // namespace detail
}  // namespace gradaccum
