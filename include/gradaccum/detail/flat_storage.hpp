#pragma once
/// @file
/// @brief The storage behind `flat_gradients`: host bytes or a backend's device buffers, which
/// segments are present, and the staged reads and copies that reach both alike.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradaccum/detail/device_values.hpp"
#include "gradaccum/device_buffers.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/flat_layout.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum::detail {

struct free_deleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

/// Zero-filled, 64-byte aligned storage for `elements` values of `dtype`, and which segments of
/// a layout hold values. Invariant: absent segments and padding are zero.
struct flat_storage {
  std::unique_ptr<std::byte, free_deleter> bytes;
  float_dtype dtype = float_dtype::f32;
  std::size_t elements = 0;
  std::vector<std::uint8_t> present;  // per segment: 1 when it received values
  std::size_t present_count = 0;
  std::unique_ptr<device_values> device;  // instead of `bytes`, for a device_buffers_backend

  /// @throws std::bad_alloc
  /// (A template of nothing: a file that includes the core compiles it only when it makes a window.)
  template <class = void>
  static std::shared_ptr<flat_storage> allocate(float_dtype dtype, std::size_t elements, std::size_t segments) {
    auto storage = std::make_shared<flat_storage>();
    const std::size_t size = elements * (dtype == float_dtype::f64 ? 8 : 4);
    const std::size_t rounded = (std::max<std::size_t>(size, 1) + 63) / 64 * 64;
    storage->bytes.reset(static_cast<std::byte*>(std::aligned_alloc(64, rounded)));
    if (!storage->bytes) throw std::bad_alloc();
    std::memset(storage->bytes.get(), 0, rounded);
    storage->dtype = dtype;
    storage->elements = elements;
    storage->present.assign(segments, 0);
    return storage;
  }

  template <class W>
  [[nodiscard]] W* data() const noexcept {
    return reinterpret_cast<W*>(bytes.get());
  }
  [[nodiscard]] std::size_t element_size() const noexcept { return dtype == float_dtype::f64 ? 8 : 4; }

  /// Every value of `storage` as W, empty without storage: what a result's `flat<W>()` and a
  /// shard's `values<W>()` give. `holder` names them in the error ("values of these gradients
  /// are F64, ...").
  /// @throws error(errc::invalid_dtype) when W is not the storage's type.
  template <class W>
  static std::span<W> all_values(const flat_storage* storage, std::string_view holder) {
    require_type<W>(storage, holder);
    if (storage == nullptr) return {};
    return {storage->data<W>(), storage->elements};
  }
  template <class W>
  static void require_type(const flat_storage* storage, std::string_view holder) {
    static_assert(std::is_same_v<W, float> || std::is_same_v<W, double>, "results hold float or double values");
    if (storage != nullptr && dtype_of<W> != storage->dtype) [[unlikely]] {
      fail(errc::invalid_dtype, {"values of ", holder, " are ", to_string(storage->dtype), ", asked for as ",
                                 to_string(dtype_of<W>), " (use the element type of dtype())."});
    }
  }
  /// Whether segment `position` of `storage` is present (false without storage).
  static bool is_present(const flat_storage* storage, std::size_t position) noexcept {
    return storage != nullptr && position < storage->present.size() && storage->present[position] != 0;
  }

  /// Zeroes the whole buffer and marks every segment absent: a result's mutable views (`flat<W>()`
  /// over absent segments and padding too) may have written anywhere in it, so a buffer taken back
  /// from one is zeroed whole (one pass, about what zeroing its present segments costs).
  void clear() noexcept {
    if (device) {  // only present segments were ever shown (as backend views), so only they were written
      for (std::size_t position = 0; position < present.size(); ++position) {
        if (present[position] != 0) device->zero(position);
      }
    } else {
      std::memset(bytes.get(), 0, elements * element_size());
    }
    std::fill(present.begin(), present.end(), std::uint8_t{0});
    present_count = 0;
  }

  /// Zeroes what lies outside the present segments of `layout` (absent segments and padding),
  /// which a result's `flat<W>()` may have written: the invariant back, values kept.
  template <class B>
  void zero_outside_present(const flat_layout<B>& layout) noexcept {
    if (device) return;  // a device window shows nothing outside its present segments
    std::size_t at = 0;
    for (std::size_t i = 0; i < present.size(); ++i) {
      if (present[i] == 0) continue;
      std::memset(bytes.get() + at * element_size(), 0, (layout[i].offset - at) * element_size());
      at = layout[i].offset + layout[i].size;
    }
    std::memset(bytes.get() + at * element_size(), 0, (elements - at) * element_size());
  }

  /// Zeroes segment `position` (`size` elements at `offset` in host memory).
  void zero_segment(std::size_t position, std::size_t offset, std::size_t size) noexcept {
    if (device) {
      device->zero(position);
    } else {
      std::memset(bytes.get() + offset * element_size(), 0, size * element_size());
    }
  }

  void mark_present(std::size_t position) noexcept {
    // A load and a branch once a parameter is present: the steady state stores nothing here
    // (a store would queue behind the add's own stores).
    if (present[position] == 0) {
      present[position] = 1;
      ++present_count;
    }
  }
};

/// What `flat_gradients<B>::get<W>` gives: the backend's view of a result's segment.
template <class B, class W>
struct result_view {
  using type = decltype(B::template map<W>(std::span<const W>{}, std::declval<const tensor_shape&>(),
                                           std::declval<const typename B::device_type&>()));
};
template <class B, class W>
  requires device_buffers_backend<B>
struct result_view<B, W> {
  using type =
      decltype(B::template map<W>(std::declval<const typename B::template buffer<W>&>(), std::size_t{},
                                  std::declval<const tensor_shape&>(), std::declval<const typename B::device_type&>()));
};

/// A zero-filled buffer for `layout` in `dtype`: host memory, or for a `device_buffers_backend`
/// one buffer per device, each device's segments back to back.
/// @throws std::bad_alloc, or what the backend's `allocate` throws
template <class B>
std::shared_ptr<flat_storage> allocate_storage(const flat_layout<B>& layout, float_dtype dtype) {
  if constexpr (!device_buffers_backend<B>) {
    return flat_storage::allocate(dtype, layout.elements(), layout.size());
  } else {
    std::vector<device_place> places(layout.size());
    std::vector<tensor_shape> shapes(layout.size());
    std::vector<typename B::device_type> devices;
    std::vector<std::size_t> ends;  // per device: where its next segment starts
    for (std::size_t position = 0; position < layout.size(); ++position) {
      const flat_segment<B>& s = layout[position];
      const auto known = std::find(devices.begin(), devices.end(), s.device);
      const auto d = static_cast<std::size_t>(known - devices.begin());
      if (known == devices.end()) {
        devices.push_back(s.device);
        ends.push_back(0);
      }
      places[position] = {d, ends[d], s.size};
      shapes[position] = s.shape;
      ends[d] += (s.size + segment_alignment - 1) / segment_alignment * segment_alignment;
    }
    auto storage = std::make_shared<flat_storage>();
    storage->dtype = dtype;
    storage->elements = layout.elements();
    storage->present.assign(layout.size(), 0);
    if (dtype == float_dtype::f64) {
      storage->device = std::make_unique<device_values_of<B, double>>(std::move(places), shapes, devices);
    } else {
      storage->device = std::make_unique<device_values_of<B, float>>(std::move(places), shapes, devices);
    }
    return storage;
  }
}

/// Values of a device window are staged through host memory this many at a time: a multiple
/// of the global norm's blocks, 64 KiB of F32.
inline constexpr std::size_t staged_elements = 16384;

/// `f(std::span<const W>)` over the `size` values of segment `position` (at `offset` in a host
/// buffer) of `storage`, W its work type: the segment itself in host memory, else pieces of at
/// most `staged_elements` read from the device.
/// @throws std::bad_alloc, or what the backend's `read` throws (never for host memory)
template <class F>
void for_each_piece(const flat_storage& storage, std::size_t position, std::size_t offset, std::size_t size, F&& f) {
  const auto each = [&]<class W>(W) {
    if (!storage.device) {
      f(std::span<const W>(storage.data<W>() + offset, size));
      return;
    }
    std::vector<W> staged(std::min(size, staged_elements));
    for (std::size_t first = 0; first < size; first += staged_elements) {
      const std::span<W> piece(staged.data(), std::min(staged_elements, size - first));
      storage.device->read(position, first, std::as_writable_bytes(piece));
      f(std::span<const W>(piece));
    }
  };
  storage.dtype == float_dtype::f64 ? each(double{}) : each(float{});
}

/// Whether the `size` values of segment `position` (at `offset` in a host buffer) are all
/// finite: checked on the device where the backend can (`all_finite`), else read as
/// `for_each_piece` reads them.
/// @throws std::bad_alloc, or what the backend's `all_finite` or `read` throws
/// A template, as `copy_segment` below, so that a translation unit that checks nothing does not
/// compile the check.
template <class = void>
bool segment_finite(const flat_storage& storage, std::size_t position, std::size_t offset, std::size_t size) {
  if (storage.device) {
    if (const std::optional<bool> on_device = storage.device->finite(position)) return *on_device;
  }
  bool finite = true;
  for_each_piece(storage, position, offset, size,
                 [&](auto values) { finite = finite && kernels::all_finite(values.data(), values.size()); });
  return finite;
}

/// Copies `size` values from segment `from_position` (at `from_offset` in a host buffer) of
/// `from` to segment `to_position` (at `to_offset`) of `to`, converting to `to`'s dtype; through
/// bounded host pieces where either side is on a device.
/// @throws std::bad_alloc, or what a backend's `read` or `write` throws
/// A template only so that a translation unit that copies no segment does not compile its eight
/// conversion loops (an inline function's body is compiled wherever its header is included).
template <class = void>
void copy_segment(const flat_storage& from, std::size_t from_position, std::size_t from_offset, flat_storage& to,
                  std::size_t to_position, std::size_t to_offset, std::size_t size) {
  const auto as_work_type = [](float_dtype dtype, auto&& f) { dtype == float_dtype::f64 ? f(double{}) : f(float{}); };
  if (!from.device && !to.device) {
    as_work_type(to.dtype, [&]<class W>(W) {
      as_work_type(from.dtype,
                   [&]<class V>(V) { kernels::convert(to.data<W>() + to_offset, from.data<V>() + from_offset, size); });
    });
    return;
  }
  constexpr std::size_t piece = staged_elements;
  std::vector<double> staged_from(std::min(size, piece));
  std::vector<double> staged_to(to.device ? staged_from.size() : 0);
  for (std::size_t first = 0; first < size; first += piece) {
    const std::size_t count = std::min(piece, size - first);
    as_work_type(from.dtype, [&]<class V>(V) {
      V* const in = reinterpret_cast<V*>(staged_from.data());
      if (from.device) {
        from.device->read(from_position, first, std::as_writable_bytes(std::span<V>(in, count)));
      } else {
        std::copy_n(from.data<V>() + from_offset + first, count, in);
      }
      as_work_type(to.dtype, [&]<class W>(W) {
        if (!to.device) {
          kernels::convert(to.data<W>() + to_offset + first, in, count);
          return;
        }
        W* const out = reinterpret_cast<W*>(staged_to.data());
        kernels::convert(out, in, count);
        to.device->write(to_position, first, std::as_bytes(std::span<const W>(out, count)));
      });
    });
  }
}

}  // namespace gradaccum::detail
