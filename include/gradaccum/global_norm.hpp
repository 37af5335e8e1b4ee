#pragma once
/// @file
/// @brief `global_norm` and `clip_by_global_norm`: the L2 norm of a window's result over every
/// present parameter, and clipping to it with the semantics of PyTorch's `clip_grad_norm_`.
///
/// @code
/// auto mean = window.finish_mean(params);                         // or allreduce_mean(...)
/// const double norm = gradaccum::clip_by_global_norm(mean, 1.0);  // the norm before clipping
/// if (scaler.update(!std::isfinite(norm))) optimizer_step(mean);  // non-finite: left as it was
/// @endcode
///
/// The norm is summed in F64 whatever the work dtype, in one fixed order over the result's
/// buffer (which is in parameter order): blocks of `norm_block_elements` elements at fixed
/// offsets, each summed by `kernels::sum_of_squares`, and the block sums added one after another
/// from the first. Absent parameters and padding hold zeros, so they add nothing. The bits
/// therefore depend only on the values and the parameter set: the same on every rank holding the
/// same result, on every backend (the buffer is row-major whatever the backend), and for a result
/// sharded by `reduce_scatter_mean` (`<gradaccum/mpi.hpp>`), whose shards are whole blocks.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "gradaccum/error.hpp"
#include "gradaccum/flat_gradients.hpp"
#include "gradaccum/gradients_params.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/weighted_gradients_accumulator.hpp"

namespace gradaccum {

/// @brief Elements per block of the norm's fixed summation order (see the file comment); shards
/// of `reduce_scatter_mean` are multiples of it.
inline constexpr std::size_t norm_block_elements = 1024;

/// @brief `‖g‖₂ = √(Σ_p Σ_i g[p][i]²)` over every present parameter, summed in F64 in the fixed
/// order of the file comment. Zero for an empty result; NaN or +inf when a value is non-finite
/// (or, in F64, when the squares overflow).
/// A window on a device is read in pieces through host memory (same blocks, same bits); that
/// may throw what the backend's `read` throws, or `std::bad_alloc`.
template <class B>
[[nodiscard]] double global_norm(const flat_gradients<B>& gradients) noexcept(!device_buffers_backend<B>);

/// @brief `global_norm(result.gradients)`.
template <class B>
[[nodiscard]] double global_norm(const accumulated_gradients<B>& result) noexcept(!device_buffers_backend<B>) {
  return global_norm(result.gradients);
}

/// @brief Scales every value by `c = max_norm / (‖g‖₂ + 1e-6)` when c < 1, as PyTorch's
/// `clip_grad_norm_` does, and returns ‖g‖₂ before clipping.
///
/// c is computed in F64 and rounded to the work dtype once; every value is multiplied by it in
/// the work dtype. A non-finite norm is returned and the values are left as they were (PyTorch's
/// default would multiply them by NaN or zero them; `error_if_nonfinite=True` would throw):
/// pass `!std::isfinite(norm)` to `dynamic_loss_scale::update`, which skips the step.
/// @throws error(errc::invalid_scalar) when `max_norm` is negative or NaN (+inf never clips);
/// nothing changes.
template <class B>
double clip_by_global_norm(flat_gradients<B>& gradients, double max_norm);

/// @brief `clip_by_global_norm(result.gradients, max_norm)`.
template <class B>
double clip_by_global_norm(accumulated_gradients<B>& result, double max_norm) {
  return clip_by_global_norm(result.gradients, max_norm);
}

// ---------------------------------------------------------------------------------------------
// Implementation.
// ---------------------------------------------------------------------------------------------

namespace detail {

/// `Σ_b sum_of_squares(block b of x)`, added to `total` block by block from the first.
template <class W>
double add_block_sums(std::span<const W> x, double total) noexcept {
  for (std::size_t at = 0; at < x.size(); at += norm_block_elements) {
    total += kernels::sum_of_squares(x.data() + at, std::min(norm_block_elements, x.size() - at));
  }
  return total;
}

inline void check_max_norm(double max_norm) {
  if (!(max_norm >= 0.0)) {
    fail(errc::invalid_scalar, {"max_norm ", max_norm, " is not a non-negative number."});
  }
}

/// PyTorch's `clip_coef = max_norm / (total_norm + 1e-6)`, applied only below 1.
template <class W>
void clip_values(std::span<W> x, double norm, double max_norm) noexcept {
  const double coefficient = max_norm / (norm + 1e-6);
  if (!(coefficient < 1.0)) return;
  const auto c = static_cast<W>(coefficient);
  for (W& v : x) v = v * c;
}

/// The block sums of a window on a device: its buffer's blocks as the host buffer has them
/// (padding and absent segments zero), assembled from the device `staged_elements` at a time.
template <class W, class B>
double staged_block_sums(const flat_gradients<B>& gradients) {
  const flat_layout<B>* layout = gradients.layout();
  const std::shared_ptr<flat_storage>& storage = flat_access::storage(gradients);
  if (layout == nullptr || !storage || !storage->device) return 0.0;
  std::vector<W> piece(std::min(staged_elements, layout->elements()));
  double total = 0.0;
  std::size_t next = 0;  // the first segment that may reach into this piece
  for (std::size_t begin = 0; begin < layout->elements(); begin += staged_elements) {
    const std::size_t end = std::min(begin + staged_elements, layout->elements());
    std::fill_n(piece.begin(), end - begin, W{0});
    while (next < layout->size() && (*layout)[next].offset + (*layout)[next].size <= begin) ++next;
    for (std::size_t position = next; position < layout->size() && (*layout)[position].offset < end; ++position) {
      if (!gradients.is_present(position)) continue;
      const flat_segment<B>& s = (*layout)[position];
      const std::size_t from = std::max(begin, s.offset);
      const std::size_t to = std::min(end, s.offset + s.size);
      storage->device->read(position, from - s.offset,
                            std::as_writable_bytes(std::span<W>(piece.data() + (from - begin), to - from)));
    }
    total = add_block_sums(std::span<const W>(piece.data(), end - begin), total);
  }
  return total;
}

/// `clip_values` of a window on a device, segment by segment through host pieces.
template <class W, class B>
void clip_staged(flat_gradients<B>& gradients, double norm, double max_norm) {
  const flat_layout<B>* layout = gradients.layout();
  const std::shared_ptr<flat_storage>& storage = flat_access::storage(gradients);
  if (layout == nullptr || !storage || !storage->device || !(max_norm / (norm + 1e-6) < 1.0)) return;
  std::vector<W> piece;
  for (std::size_t position = 0; position < layout->size(); ++position) {
    if (!gradients.is_present(position)) continue;
    const std::size_t size = (*layout)[position].size;
    piece.resize(std::min(staged_elements, size));
    for (std::size_t first = 0; first < size; first += staged_elements) {
      const std::span<W> values(piece.data(), std::min(staged_elements, size - first));
      storage->device->read(position, first, std::as_writable_bytes(values));
      clip_values(values, norm, max_norm);
      storage->device->write(position, first, std::as_bytes(std::span<const W>(values)));
    }
  }
}

}  // namespace detail

template <class B>
double global_norm(const flat_gradients<B>& gradients) noexcept(!device_buffers_backend<B>) {
  return detail::visit_work_dtype(gradients.dtype(), [&]<class W>() {
    if constexpr (device_buffers_backend<B>) {
      return std::sqrt(detail::staged_block_sums<W>(gradients));
    } else {
      return std::sqrt(detail::add_block_sums(gradients.template flat<W>(), 0.0));
    }
  });
}

template <class B>
double clip_by_global_norm(flat_gradients<B>& gradients, double max_norm) {
  detail::check_max_norm(max_norm);
  const double norm = global_norm(gradients);
  if (std::isfinite(norm)) {
    detail::visit_work_dtype(gradients.dtype(), [&]<class W>() {
      if constexpr (device_buffers_backend<B>) {
        detail::clip_staged<W>(gradients, norm, max_norm);
      } else {
        detail::clip_values(gradients.template flat<W>(), norm, max_norm);
      }
    });
  }
  return norm;
}

}  // namespace gradaccum
