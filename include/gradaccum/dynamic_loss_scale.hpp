#pragma once
/// @file
/// @brief `dynamic_loss_scale`: the loss scale of each window, backed off after a window whose
/// sums overflowed and grown after a run of good ones, as PyTorch's `GradScaler` and DeepSpeed's
/// `DynamicLossScaler` do. Explicit: nothing advances it but `update`.
///
/// @code
/// gradaccum::dynamic_loss_scale scaler;                        // 2^16, ×2 / 2000 windows, ×0.5
/// gradaccum::weighted_gradients_accumulator<B> window(gradaccum::float_dtype::f32, scaler.scale());
/// for (;;) {
///   // ... accumulate gradients of (loss × scaler.scale()) ...
///   auto mean = window.finish_mean(params);
///   const double norm = gradaccum::clip_by_global_norm(mean, 1.0);
///   if (scaler.update(!std::isfinite(norm))) optimizer_step(mean);  // else: skipped
///   window.set_loss_scale(scaler.scale());                           // the next window's scale
/// }
/// @endcode
///
/// Its state (`dynamic_loss_scale_state`) is a plain value, saved and restored bit for bit with
/// cereal (`<gradaccum/cereal.hpp>`), and given back to the constructor on resume.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>

#include "gradaccum/error.hpp"

namespace gradaccum {

/// @brief The constants of a `dynamic_loss_scale`; the defaults are PyTorch `GradScaler`'s.
struct dynamic_loss_scale_options {
  /// The first window's scale (2^16 in PyTorch and in DeepSpeed's config): a positive F32 value
  /// (exactly), since the scale is an F32 as in `GradScaler`'s float32 tensor.
  double init_scale = 65536.0;
  double growth_factor = 2.0;            ///< > 1: the scale is multiplied by it after `growth_interval` good windows
  double backoff_factor = 0.5;           ///< in (0, 1): the scale is multiplied by it after an overflow
  std::uint64_t growth_interval = 2000;  ///< ≥ 1 (DeepSpeed's `loss_scale_window`, 1000)
  /// ≥ 1: overflows tolerated before the scale backs off, DeepSpeed's `hysteresis` (its config
  /// default is 2; 1 is PyTorch's behaviour). Restored to this value whenever the scale grows.
  std::uint64_t hysteresis = 1;
  /// > 0, an F32 value (exactly): the scale never backs off below this. PyTorch has no floor;
  /// DeepSpeed's `min_loss_scale` defaults to 1. The default here is the smallest normal F32, so
  /// every scale suits an F32 window.
  double min_scale = static_cast<double>(std::numeric_limits<float>::min());

  friend bool operator==(const dynamic_loss_scale_options&, const dynamic_loss_scale_options&) = default;
};

/// @brief Everything `update` changes: what a checkpoint must carry to resume bit for bit.
struct dynamic_loss_scale_state {
  double scale = 65536.0;  ///< the scale of the next window: always an F32 value, held in a double
  /// Good windows since the last growth or overflow (PyTorch's `_growth_tracker`); < growth_interval.
  std::uint64_t growth_tracker = 0;
  /// Overflows still tolerated before the scale backs off (DeepSpeed's `cur_hysteresis`); in
  /// [1, hysteresis].
  std::uint64_t hysteresis_left = 1;

  friend bool operator==(const dynamic_loss_scale_state&, const dynamic_loss_scale_state&) = default;
};

/// @brief Dynamic loss scaling with PyTorch's `GradScaler` and DeepSpeed's `DynamicLossScaler`
/// rules. After each window, `update(found_non_finite)`:
///
///     overflow:  growth_tracker = 0
///                hysteresis_left > 1 ? --hysteresis_left
///                                    : scale = max(F32(scale · backoff_factor), min_scale)
///     finite:    if ++growth_tracker == growth_interval:
///                  growth_tracker = 0, hysteresis_left = hysteresis,
///                  F32(scale · growth_factor) if it is finite (else scale stays)
///
/// and returns whether to take the optimizer step (no overflow). The scale is an F32 and is
/// rounded as `GradScaler` rounds it (`torch._amp_update_scale_`, CPU and CUDA alike): the
/// product of the F32 scale and the factor is formed in F64 and rounded to F32, so the scales
/// are `GradScaler`'s bit for bit for any factors (with hysteresis 1 and the floor never
/// reached). Every window keeps one fixed scale: ask `scale()` for the next window's only after
/// `update`.
class dynamic_loss_scale {
 public:
  /// @brief PyTorch's defaults: 2^16, ×2 after 2000 good windows, ×0.5 after an overflow.
  dynamic_loss_scale() : dynamic_loss_scale(dynamic_loss_scale_options{}) {}

  /// @throws error(errc::invalid_scalar) for options outside the ranges documented on
  /// `dynamic_loss_scale_options`, or an `init_scale` that is not a positive F32 value (exactly)
  /// ≥ min_scale.
  explicit dynamic_loss_scale(const dynamic_loss_scale_options& options)
      : dynamic_loss_scale(options, {options.init_scale, 0, options.hysteresis}) {}

  /// @brief Resumes from a saved state.
  ///
  /// The state must be one these options can reach; what is checked: the scale is a finite,
  /// positive F32 value (exactly) ≥ min_scale; growth_tracker < growth_interval; hysteresis_left
  /// is in [1, hysteresis]; and when growth_factor = 2^g and backoff_factor = 2^-b are powers of
  /// two and min_scale is a normal F32 (the defaults), every reachable scale is init_scale · 2^k
  /// or min_scale · 2^k for an integer k that gcd(g, b) divides, and the scale must be one of
  /// them. With other factors the reachable scales have no such test (each step rounds), and any
  /// F32 value ≥ min_scale passes. The state does not record the options it was made with, so a
  /// state saved under other options passes when these options could reach it too.
  /// @throws error(errc::invalid_scalar) for invalid options; error(errc::invalid_state) for a
  /// state that fails these checks.
  dynamic_loss_scale(const dynamic_loss_scale_options& options, const dynamic_loss_scale_state& state);

  /// @brief The loss scale of the next window.
  [[nodiscard]] double scale() const noexcept { return state_.scale; }

  /// @brief Advances the state after a window (the rules of the class comment); returns whether
  /// to step (`!found_non_finite`).
  bool update(bool found_non_finite) noexcept;

  [[nodiscard]] const dynamic_loss_scale_state& state() const noexcept { return state_; }
  [[nodiscard]] const dynamic_loss_scale_options& options() const noexcept { return options_; }

 private:
  dynamic_loss_scale_options options_;
  dynamic_loss_scale_state state_;
};

// ---------------------------------------------------------------------------------------------
// Implementation.
// ---------------------------------------------------------------------------------------------

namespace detail {

/// Positive, finite, finite and non-zero as an F32: a scale every F32 window accepts.
inline bool valid_f32_scale(double scale) noexcept {
  return scale > 0.0 && std::isfinite(static_cast<float>(scale)) && static_cast<float>(scale) != 0.0F;
}

/// A positive F32 value, exactly.
inline bool exact_f32_scale(double scale) noexcept {
  return valid_f32_scale(scale) && static_cast<double>(static_cast<float>(scale)) == scale;
}

/// `GradScaler`'s step: the F32 scale times the F64 factor, formed in F64 and rounded to F32.
inline float f32_scaled(double scale, double factor) noexcept {
  return static_cast<float>(scale * factor);
}

/// k when x = 2^k, else 0 (x = 1 is excluded by the factors' ranges).
inline int power_of_two_exponent(double x) noexcept {
  int exponent = 0;
  return std::frexp(x, &exponent) == 0.5 ? exponent - 1 : 0;
}

/// Whether scale = base · 2^k for an integer k that `step` divides.
inline bool power_of_two_multiple(double scale, double base, int step) noexcept {
  int scale_exponent = 0;
  int base_exponent = 0;
  return std::frexp(scale, &scale_exponent) == std::frexp(base, &base_exponent) &&
         (scale_exponent - base_exponent) % step == 0;
}

/// The scale test of `dynamic_loss_scale(options, state)` (see there). With factors 2^g and 2^-b
/// every step is exact while the scale stays ≥ a normal floor (below it, the floor replaces the
/// rounded product), so a scale is init_scale or the floor times a power of two whose exponent
/// is a sum of multiples of g and -b.
inline bool reachable_scale(const dynamic_loss_scale_options& options, double scale) noexcept {
  if (!(exact_f32_scale(scale) && scale >= options.min_scale)) return false;
  const int g = power_of_two_exponent(options.growth_factor);
  const int b = -power_of_two_exponent(options.backoff_factor);
  if (g == 0 || b == 0 || options.min_scale < static_cast<double>(std::numeric_limits<float>::min())) return true;
  const int step = std::gcd(g, b);
  return power_of_two_multiple(scale, options.init_scale, step) ||
         power_of_two_multiple(scale, options.min_scale, step);
}

/// The checks of `dynamic_loss_scale(options, state)`. A template of nothing, so that
/// `GRADACCUM_EXTERN_TEMPLATES` can compile it in one file of a program instead of in each.
template <class = void>
void check_loss_scale(const dynamic_loss_scale_options& options, const dynamic_loss_scale_state& state) {
  const auto reject = [](const char* what, double value) {
    fail(errc::invalid_scalar, {"dynamic loss scale: ", what, " ", value, " is out of range."});
  };
  if (!exact_f32_scale(options.min_scale)) reject("min_scale", options.min_scale);
  if (!(exact_f32_scale(options.init_scale) && options.init_scale >= options.min_scale)) {
    reject("init_scale", options.init_scale);
  }
  if (!(options.growth_factor > 1.0 && std::isfinite(options.growth_factor))) {
    reject("growth_factor", options.growth_factor);
  }
  if (!(options.backoff_factor > 0.0 && options.backoff_factor < 1.0)) reject("backoff_factor", options.backoff_factor);
  if (options.growth_interval == 0) reject("growth_interval", 0.0);
  if (options.hysteresis == 0) reject("hysteresis", 0.0);
  if (!reachable_scale(options, state.scale) || state.growth_tracker >= options.growth_interval ||
      state.hysteresis_left == 0 || state.hysteresis_left > options.hysteresis) {
    fail(errc::invalid_state,
         {"dynamic loss scale state (scale ", state.scale, ", growth_tracker ", state.growth_tracker,
          ", hysteresis_left ", state.hysteresis_left, ") cannot be reached with these options."});
  }
}

}  // namespace detail

inline dynamic_loss_scale::dynamic_loss_scale(const dynamic_loss_scale_options& options,
                                              const dynamic_loss_scale_state& state)
    : options_(options), state_(state) {
  detail::check_loss_scale(options, state);
}

inline bool dynamic_loss_scale::update(bool found_non_finite) noexcept {
  if (found_non_finite) {
    state_.growth_tracker = 0;
    if (state_.hysteresis_left > 1) {
      --state_.hysteresis_left;
    } else {
      state_.scale =
          std::max(static_cast<double>(detail::f32_scaled(state_.scale, options_.backoff_factor)), options_.min_scale);
    }
    return false;
  }
  if (++state_.growth_tracker == options_.growth_interval) {
    state_.growth_tracker = 0;
    state_.hysteresis_left = options_.hysteresis;
    const float grown = detail::f32_scaled(state_.scale, options_.growth_factor);
    if (std::isfinite(grown)) state_.scale = grown;
  }
  return true;
}

}  // namespace gradaccum
