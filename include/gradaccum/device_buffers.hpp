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
/// and optionally
///
/// @code
/// // completes every add that `add_scaled` queued on this buffer
/// template <class W> static void flush_adds(buffer<W>&) noexcept;
/// // the buffer's first element, for an MPI library to read and write in place once the device's
/// // queued work is done, or nullptr when it cannot reach this memory (`cuda_aware`: it reports
/// // support for CUDA device memory); may throw
/// template <class W> static W* data(buffer<W>&, bool cuda_aware);
/// // whether the `count` values from `offset` are all finite (no NaN, no infinity), checked on
/// // the device; may throw
/// template <class W> static bool all_finite(const buffer<W>&, std::size_t offset, std::size_t count);
/// @endcode
///
/// With `flush_adds`, `add_scaled` may queue its add instead of doing it (holding `g` no longer
/// than the accumulate call): the library calls `flush_adds` on every buffer at the end of each
/// accumulate call, so nothing else ever sees a queued add. A backend whose adds are bound by
/// kernel launches (many small parameters on a GPU) issues them together there. With `data`,
/// `allreduce_mean` hands a window on one device straight to MPI when every rank's can. With
/// `all_finite`, the checks for NaN and infinity (`non_finite()`, and `reduce_scatter_mean`'s
/// `found_non_finite()` when MPI takes the buffers) run on the device instead of reading the
/// window into host memory.
///
/// Everything else a window does (records and checkpoints, the global norm and clipping, MPI
/// reductions, a change of work dtype) goes through `read` and `write`, so its bits are the
/// host's. The library lays out each device's segments back to back (64-byte aligned) in that
/// device's buffer, and holds the buffers in `detail::device_values`
/// (`<gradaccum/detail/device_values.hpp>`).

#include <concepts>
#include <cstddef>
#include <span>
#include <utility>

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

}  // namespace gradaccum
