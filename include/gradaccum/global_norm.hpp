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
#include <span>

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
template <class B>
[[nodiscard]] double global_norm(const flat_gradients<B>& gradients) noexcept;

/// @brief `global_norm(result.gradients)`.
template <class B>
[[nodiscard]] double global_norm(const accumulated_gradients<B>& result) noexcept {
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

}  // namespace detail

template <class B>
double global_norm(const flat_gradients<B>& gradients) noexcept {
  return detail::visit_work_dtype(gradients.dtype(), [&]<class W>() {
    return std::sqrt(detail::add_block_sums(gradients.template flat<W>(), 0.0));
  });
}

template <class B>
double clip_by_global_norm(flat_gradients<B>& gradients, double max_norm) {
  detail::check_max_norm(max_norm);
  const double norm = global_norm(gradients);
  if (std::isfinite(norm)) {
    detail::visit_work_dtype(gradients.dtype(),
                             [&]<class W>() { detail::clip_values(gradients.template flat<W>(), norm, max_norm); });
  }
  return norm;
}

}  // namespace gradaccum
