#pragma once
/// @file
/// @brief `torch_buffer`: a window's values on one device for `torch_backend`, and the libtorch
/// operations on it that the backend's device-buffer members are made of.
///
/// One flat tensor of the work dtype holds the device's segments back to back; each segment has a
/// view of its parameter's shape, made once. Adds are queued and issued together by
/// `torch_flush_adds`, one `_foreach_add_` on a device (on CUDA a few multi-tensor kernels for
/// hundreds of parameters, where a loop of `add_` launches one kernel each); an addend that is not a gradient
/// of the work dtype with scale 1 is first staged, converted and multiplied, in `scratch`. The
/// contract's roundings hold: conversion to the work dtype is exact, the product and the sum are
/// each rounded once per element, in that order (never `add_(g, alpha)`, which may fuse them).

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <vector>

#include "gradaccum/device_buffers.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum {

/// @brief A window's values on one device (`torch_backend::buffer<W>`): a flat tensor of the
/// work dtype, and what its adds and divisions need there, allocated with it.
struct torch_buffer {
  at::Tensor values;                               ///< 1-D, the device's segments back to back
  at::Tensor scratch;                              ///< 1-D, addends staged in the work dtype, scaled
  std::array<at::Tensor, 2> divisors;              ///< 0-dim, on the device: `divide`'s divisors
  std::array<double, 2> divisor_values{1.0, 1.0};  ///< what `divisors` hold
  /// Each segment's start, ascending, and a tensor of its parameter's shape viewing it, made
  /// once: an add or a result is then one libtorch call, not three.
  std::vector<std::size_t> offsets;
  std::vector<at::Tensor> segments;
  /// Adds not yet done, `queued_sums[i] += queued_addends[i]`: room for one per segment,
  /// reserved with the buffer, so queueing one allocates no memory.
  std::vector<at::Tensor> queued_sums;
  std::vector<at::Tensor> queued_addends;
  std::int64_t staged = 0;  ///< elements of `scratch` holding queued addends
};

namespace detail {

/// The scratch holds at most this many elements (16 MiB of F32).
inline constexpr std::int64_t torch_scratch_elements = std::int64_t{1} << 22;

template <class W>
inline constexpr at::ScalarType torch_scalar_type = c10::CppTypeToScalarType<W>::value;

template <class W>
at::TensorOptions torch_options(const c10::Device& device) {
  return at::TensorOptions().dtype(torch_scalar_type<W>).device(device);
}

inline std::vector<std::int64_t> torch_sizes(const tensor_shape& s) {
  return {s.begin(), s.end()};
}

/// `count` zeros of W on `device` with a view of each of `segments`, and a scratch of up to
/// `torch_scratch_elements` (no more than `count`).
/// @throws std::bad_alloc when libtorch cannot allocate them.
template <class W>
torch_buffer torch_allocate(std::size_t count, std::span<const buffer_segment> segments, const c10::Device& device) {
  try {
    const auto options = torch_options<W>(device);
    torch_buffer b;
    b.values = at::zeros({static_cast<std::int64_t>(count)}, options);
    b.scratch = at::empty({std::min(static_cast<std::int64_t>(count), torch_scratch_elements)}, options);
    b.divisors = {at::ones({}, options), at::ones({}, options)};
    b.offsets.reserve(segments.size());
    b.segments.reserve(segments.size());
    for (const buffer_segment& s : segments) {
      b.offsets.push_back(s.offset);
      b.segments.push_back(b.values.narrow(0, static_cast<std::int64_t>(s.offset), static_cast<std::int64_t>(s.size))
                               .view(torch_sizes(s.shape)));
    }
    b.queued_sums.reserve(segments.size());
    b.queued_addends.reserve(segments.size());
    return b;
  } catch (const c10::Error&) {
    throw std::bad_alloc();
  }
}

/// The buffer's view of the segment starting at `offset` with `count` elements, or a new view
/// of those elements (1-D) when no segment is exactly that.
inline at::Tensor torch_segment(const torch_buffer& b, std::size_t offset, std::size_t count) {
  const auto at = std::lower_bound(b.offsets.begin(), b.offsets.end(), offset);
  if (at != b.offsets.end() && *at == offset) {
    const at::Tensor& segment = b.segments[static_cast<std::size_t>(at - b.offsets.begin())];
    if (static_cast<std::size_t>(segment.numel()) == count) return segment;
  }
  if (offset == 0 && static_cast<std::int64_t>(count) == b.values.numel()) return b.values;
  return b.values.narrow(0, static_cast<std::int64_t>(offset), static_cast<std::int64_t>(count));
}

/// Does every queued add, rounding once per element as `add_` does: one `_foreach_add_` on a
/// device (multi-tensor kernels on CUDA), a loop of `add_` on the CPU, where libtorch's
/// `_foreach_add_` is that loop behind a second dispatch per tensor (about 20% slower for 10,000
/// small tensors).
inline void torch_flush_adds(torch_buffer& b) noexcept {
  if (b.queued_sums.empty()) return;
  if (b.values.is_cpu()) {
    for (std::size_t i = 0; i < b.queued_sums.size(); ++i) b.queued_sums[i].add_(b.queued_addends[i]);
  } else {
    at::_foreach_add_(b.queued_sums, b.queued_addends);
  }
  b.queued_sums.clear();
  b.queued_addends.clear();
  b.staged = 0;
}

/// `staged` = scale · W(g), each product rounded once: one pass (`mul_out`) for a gradient of the
/// work dtype, else a conversion (exact) and a multiply. The scale is a 0-dim CPU tensor of W,
/// so nothing promotes; a CPU one is a kernel argument on any device.
inline void torch_stage(at::Tensor& staged, const at::Tensor& g, const at::Scalar& scale, bool scaled) {
  if (scaled && g.scalar_type() == staged.scalar_type()) {
    at::mul_out(staged, g, at::scalar_tensor(scale, staged.options().device(at::kCPU)));
  } else {
    staged.copy_(g);
    if (scaled) staged.mul_(scale);
  }
}

/// acc += scale · W(g) now, through the whole scratch, in pieces along g's leading axes: for a
/// gradient larger than the scratch.
inline void torch_add_scaled_pieces(const at::Tensor& acc, const at::Tensor& g, const at::Scalar& scale, bool scaled,
                                    at::Tensor& scratch) {
  const std::int64_t n = g.numel();
  if (n <= scratch.numel()) {
    at::Tensor staged = scratch.narrow(0, 0, n).view(g.sizes());
    torch_stage(staged, g, scale, scaled);
    acc.add_(staged);
    return;
  }
  const std::int64_t rows = g.size(0);
  const std::int64_t per_row = n / rows;
  if (per_row > scratch.numel()) {
    for (std::int64_t i = 0; i < rows; ++i)
      torch_add_scaled_pieces(acc.select(0, i), g.select(0, i), scale, scaled, scratch);
    return;
  }
  const std::int64_t step = scratch.numel() / per_row;
  for (std::int64_t i = 0; i < rows; i += step) {
    const std::int64_t k = std::min(step, rows - i);
    torch_add_scaled_pieces(acc.narrow(0, i, k), g.narrow(0, i, k), scale, scaled, scratch);
  }
}

/// Queues segment += scale · W(g) (`same_dtype`: g is of the work dtype). A gradient of the work
/// dtype with scale 1 is queued as it is; another is staged in the scratch first, after the
/// queued addends there (the queue is flushed when the scratch is full). One larger than the
/// whole scratch is added at once, in pieces.
inline void torch_queue_add(torch_buffer& b, at::Tensor segment, const at::Tensor& g, const at::Scalar& scale,
                            bool same_dtype, bool scaled) {
  if (b.queued_sums.size() == b.queued_sums.capacity()) torch_flush_adds(b);
  // The negation bit is a flag, not values: staging resolves it; a zero tensor has no memory. On
  // a device a strided gradient is staged too: `_foreach_add_` takes its multi-tensor kernels on
  // CUDA only when every tensor is dense with its partner's strides, else adds each on its own.
  if (same_dtype && !scaled && (g.is_contiguous() || b.values.is_cpu()) && !g.is_neg() && !g._is_zerotensor()) {
    b.queued_sums.push_back(std::move(segment));
    b.queued_addends.push_back(g);
    return;
  }
  const std::int64_t n = g.numel();
  if (n > b.scratch.numel() - b.staged) {
    torch_flush_adds(b);
    if (n > b.scratch.numel()) {
      torch_add_scaled_pieces(segment, g, scale, scaled, b.scratch);
      return;
    }
  }
  at::Tensor staged = b.scratch.narrow(0, b.staged, n).view(g.sizes());
  torch_stage(staged, g, scale, scaled);
  b.staged += n;
  b.queued_sums.push_back(std::move(segment));
  b.queued_addends.push_back(std::move(staged));
}

/// (x / first) / second over `count` elements from `offset`: true divisions by a 0-dim tensor on
/// the device (CUDA multiplies by a scalar's reciprocal), whose value is set only when it
/// changes (a window's segments share their divisors).
template <class W>
void torch_divide(torch_buffer& b, std::size_t offset, std::size_t count, W first, W second) {
  at::Tensor segment = torch_segment(b, offset, count);
  const std::array<W, 2> by{first, second};
  for (std::size_t i = 0; i < 2; ++i) {
    if (by[i] == W{1}) continue;
    if (b.divisor_values[i] != static_cast<double>(by[i])) {
      b.divisors[i].fill_(by[i]);
      b.divisor_values[i] = static_cast<double>(by[i]);
    }
    segment.div_(b.divisors[i]);
  }
}

}  // namespace detail
}  // namespace gradaccum
