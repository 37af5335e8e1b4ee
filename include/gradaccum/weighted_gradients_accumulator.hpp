#pragma once
/// @file
/// @brief `weighted_gradients_accumulator<B>`: one token-weighted accumulation window.

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gradaccum/backend.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/flat_gradients.hpp"
#include "gradaccum/gradients_accumulator.hpp"
#include "gradaccum/gradients_params.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/records.hpp"

namespace gradaccum {

/// @brief Gradients of a finished window and the state of the window that produced them.
template <class B>
struct accumulated_gradients {
  /// Present gradients only: a parameter that received none in the window is absent.
  flat_gradients<B> gradients;
  weighted_accumulation_state state;
};

/// @brief Accumulates microbatches of unequal size so that the result is the full-batch gradient.
///
/// For microbatches i with effective weights w_i (token or sample counts) and a loss scale s
/// fixed for the window, in work dtype W:
///
///     accumulate_sum:  pending += W(1)   · W(g_i)     (g_i: gradient of the scaled loss SUM)
///     accumulate_mean: pending += W(w_i) · W(g_i)     (g_i: gradient of the scaled loss MEAN)
///     total_weight  = Σ w_i (in double)
///     finish_mean:  result = (pending / W(s)) / W(total_weight)
///
/// The divisions are sequential because s · total_weight may overflow. Nothing is inferred:
/// no optimizer, scheduler, loss scaler or communication is advanced. Every mutating call
/// either succeeds or throws and leaves values and counters exactly as they were.
template <class B>
class weighted_gradients_accumulator {
  static_assert(detail::check_backend<B>());

 public:
  /// @brief Starts an empty window.
  /// @throws error(errc::invalid_dtype) unless `dtype` is F32 or F64;
  /// error(errc::invalid_scalar) unless `loss_scale` is positive, finite and (for F32) stays
  /// finite and non-zero as a float.
  weighted_gradients_accumulator(float_dtype dtype, double loss_scale) : state_{dtype, loss_scale, 0.0, 0} {
    detail::require_work_dtype(dtype);
    require_loss_scale(loss_scale, dtype);
  }

  /// @brief Sets the loss scale of the next window (e.g. `dynamic_loss_scale::scale()`), keeping
  /// the buffer. A window keeps one scale, so this is only allowed between windows.
  /// @throws error(errc::invalid_state) when the window has accepted a microbatch;
  /// error(errc::invalid_scalar) for a scale the constructor rejects. Nothing changes.
  void set_loss_scale(double loss_scale) {
    if (state_.microbatches != 0) {
      detail::fail(errc::invalid_state, "cannot change the loss scale of a window that has accepted microbatches.");
    }
    require_loss_scale(loss_scale, state_.dtype);
    state_.loss_scale = loss_scale;
  }

  /// @brief Adds gradients of a weighted loss SUM whose effective token/sample count is `weight`.
  /// A zero-weight microbatch is validated and counted but adds nothing.
  /// @throws error(errc::invalid_weight), error(errc::counter_overflow),
  /// error(errc::unknown_parameters), error(errc::parameter_mismatch); nothing changes.
  void accumulate_sum(const parameter_set<B>& params, const gradients_params<B>& grads, double weight);

  /// @brief Adds gradients of a MEAN loss over `weight` tokens/samples: they are multiplied by
  /// `weight` after conversion to the work dtype. Same rules as `accumulate_sum`.
  void accumulate_mean(const parameter_set<B>& params, const gradients_params<B>& grads, double weight);

  /// @brief `accumulate_sum` of a `gradient_buffer` laid out for `params`: the backward pass
  /// wrote into it, and the whole microbatch adds in one pass (see `<gradaccum/gradient_buffer.hpp>`).
  /// Same rules and bits as with the same gradients in a `gradients_params`.
  template <class T>
  void accumulate_sum(const parameter_set<B>& params, const gradient_buffer<B, T>& grads, double weight) {
    accumulate(params, grads, weight, 1.0);
  }
  /// @brief `accumulate_mean` of a `gradient_buffer`; as above.
  template <class T>
  void accumulate_mean(const parameter_set<B>& params, const gradient_buffer<B, T>& grads, double weight) {
    accumulate(params, grads, weight, weight);
  }

  /// @brief Returns the pending sums, still multiplied by the loss scale, with the window's
  /// state, and resets the window. For a data-parallel reduction of sums and weights.
  [[nodiscard]] accumulated_gradients<B> finish_sums() noexcept {
    accumulated_gradients<B> result{accumulator_.grads(), state_};
    reset_counters();
    return result;
  }

  /// @brief Returns `(pending / loss_scale) / total_weight` with the window's state, and resets.
  /// @throws error(errc::empty_weight) when the total weight is zero (nothing is cleared), and
  /// the errors of `validate_for` when the pending ids do not fit `params`.
  [[nodiscard]] accumulated_gradients<B> finish_mean(const parameter_set<B>& params);

  /// @brief The window's state; inspecting it never clears anything.
  [[nodiscard]] const weighted_accumulation_state& state() const noexcept { return state_; }

  /// @brief The pending (loss-scaled) sums.
  [[nodiscard]] const flat_gradients<B>& pending() const noexcept { return accumulator_.pending(); }

  /// @brief Ids whose pending values hold a NaN or an infinity, sorted; changes nothing.
  /// Pair it with a loss scaler: a non-empty result means the window overflowed.
  [[nodiscard]] std::vector<std::string> non_finite() const;

  /// @brief Snapshot of pending values and state; nothing is reset.
  [[nodiscard]] weighted_gradients_record try_to_record() const { return {accumulator_.try_to_record(), state_}; }

  /// @brief `f(view)` of `try_to_record()` without its copy (see `gradients_params::visit_record`).
  template <class F>
  decltype(auto) visit_record(F&& f) const {
    return accumulator_.visit_record([&](const detail::gradients_view& gradients) {
      return f(detail::weighted_gradients_view{state_, gradients});
    });
  }

  /// @brief Restores pending values and counters together; adopts the record's work dtype and
  /// loss scale. No batch replay.
  /// @throws error(errc::invalid_state) for an inconsistent state or a pending tensor of another
  /// dtype than the state's; error(errc::invalid_record), error(errc::unknown_parameters),
  /// error(errc::parameter_mismatch) from the tensors. The accumulator is unchanged on error.
  void load_record(const parameter_set<B>& params, const weighted_gradients_record& record) {
    check_restorable(record.state, record.gradients.tensors.size(), [&](auto&& on_tensor) {
      for (const tensor_record& t : record.gradients.tensors) on_tensor(t.id, t.dtype);
    });
    validate(record.gradients);
    restorer restored(*this, params);
    restored.state(record.state);
    for (const tensor_record& t : record.gradients.tensors) {
      restored.add(std::string(t.id), t.dtype, detail::record_shape(t),
                   typename gradients_accumulator<B>::record_values_source{t.values});
    }
    std::move(restored).commit();
  }

  /// @brief Restores the window state and pending values piece by piece as a loader reads them
  /// (the state first), with the checks of `load_record`; the accumulator changes only on
  /// `commit()`. See `gradients_accumulator::restorer`.
  class restorer {
   public:
    restorer(weighted_gradients_accumulator& target, const parameter_set<B>& params) noexcept
        : target_(&target), built_(target.accumulator_, params) {}

    void state(const weighted_accumulation_state& state) {
      check_restorable(state, 0, [](auto&&) {});
      state_ = state;
      built_.expect_dtype(state.dtype);
    }
    void reserve(std::size_t count) { built_.reserve(count); }
    template <class Values>
    void add(std::string&& id, float_dtype dtype, const tensor_shape& shape, const Values& values) {
      detail::check_pending_against(state_, 1, [&](auto&& check) { check(id, dtype); });
      built_.add(std::move(id), dtype, shape, values);
    }
    void place(std::string_view id, float_dtype dtype, const tensor_shape& shape) {
      // The dtype is checked against the state's by `expect_dtype`.
      detail::check_pending_against(state_, 1, [](auto&& /*check*/) {});
      built_.place(id, dtype, shape);
    }
    template <class Block>
    void values(const Block& block) {
      built_.values(block);
    }
    void commit() && noexcept {
      std::move(built_).commit();
      target_->state_ = state_;
    }

   private:
    weighted_gradients_accumulator* target_;
    typename gradients_accumulator<B>::restorer built_;
    weighted_accumulation_state state_;
  };

  /// @brief Reattaches a saved state to already-restored pending sums, with the checks of
  /// `load_record`. `pending` is moved from only on success.
  [[nodiscard]] static weighted_gradients_accumulator from_accumulator(const parameter_set<B>& params,
                                                                       gradients_accumulator<B>&& pending,
                                                                       const weighted_accumulation_state& state) {
    check_restorable(state, pending.pending().size(), [&](auto&& on_tensor) {
      for (const auto& e : pending.pending()) on_tensor(std::string(e.id), pending.pending().dtype());
    });
    pending.check_pending_for(params);
    weighted_gradients_accumulator restored(state.dtype, state.loss_scale);
    restored.accumulator_ = std::move(pending);
    restored.state_ = state;
    return restored;
  }

 private:
  /// G: `gradients_params<B>` or a `gradient_buffer<B, T>`.
  template <class G>
  void accumulate(const parameter_set<B>& params, const G& grads, double weight, double multiplier) {
    const float_dtype dtype = state_.dtype;
    const double total = state_.total_weight + weight;
    // `representable` for a non-negative value of a work dtype, in a few instructions: below
    // the point where F32 rounds to infinity, or finite. NaN fails every comparison. The
    // messages are built out of line.
    const double limit = dtype == float_dtype::f32 ? 0x1.ffffffp127 : std::numeric_limits<double>::infinity();
    if (!(weight >= 0.0 && weight < limit) ||
        (dtype == float_dtype::f32 && weight > 0.0 && static_cast<float>(weight) == 0.0F)) [[unlikely]] {
      fail_weight(weight, dtype);
    }
    if (!(total < limit)) [[unlikely]] {
      fail_total(weight, dtype);
    }
    if (state_.microbatches == std::numeric_limits<std::uint64_t>::max()) [[unlikely]] {
      fail_counter();
    }
    // The dtype is a work dtype (checked at construction) and the multiplier is 1 or the
    // weight checked above, so the accumulator's own scalar checks would repeat these.
    if (weight > 0.0 && accumulator_.ready_to_add(params, grads, dtype)) [[likely]] {
      // The steady state: nothing to check or allocate, so the call ends in the kernels with no
      // register saved or spilled on the way (each such store queues behind the previous
      // call's kernel stores, and they cost a 4 KiB add a fifth of its time).
      commit(total);
      accumulator_.add_prepared(params, grads, multiplier, dtype);
      return;
    }
    accumulate_otherwise(params, grads, weight, multiplier, total);
  }

  /// `accumulate` of a call that must resolve, check or allocate first (see
  /// `gradients_accumulator::prepare`), or adds nothing (zero weight). Out of line.
  template <class G>
  [[gnu::noinline]] void accumulate_otherwise(const parameter_set<B>& params, const G& grads, double weight,
                                              double multiplier, double total) {
    if (weight > 0.0) {
      accumulator_.prepare(params, grads, state_.dtype);
    } else {
      accumulator_.validate(params, grads);
    }
    commit(total);  // nothing below throws
    if (weight > 0.0) accumulator_.add_prepared(params, grads, multiplier, state_.dtype);
  }

  void commit(double total) noexcept {
    state_.total_weight = total;
    ++state_.microbatches;
  }

  [[noreturn, gnu::cold, gnu::noinline]] static void fail_weight(double weight, float_dtype dtype) {
    detail::fail(errc::invalid_weight, {"microbatch weight ", weight, " is not a non-negative value representable in ",
                                        to_string(dtype), "."});
  }
  [[noreturn, gnu::cold, gnu::noinline]] static void fail_total(double weight, float_dtype dtype) {
    detail::fail(errc::invalid_weight,
                 {"adding weight ", weight, " makes the total weight unrepresentable in ", to_string(dtype), "."});
  }
  [[noreturn, gnu::cold, gnu::noinline]] static void fail_counter() {
    detail::fail(errc::counter_overflow, "the microbatch counter of this window cannot be incremented.");
  }

  static void require_loss_scale(double loss_scale, float_dtype dtype) {
    if (loss_scale <= 0.0) {
      detail::fail(errc::invalid_scalar, {"loss scale ", loss_scale, " is not positive."});
    }
    detail::require_scalar(loss_scale, dtype, true);
  }

  void reset_counters() noexcept {
    state_.total_weight = 0.0;
    state_.microbatches = 0;
  }

  /// Checks shared by `load_record` and `from_accumulator`; `for_each_tensor(f)` calls
  /// `f(id, dtype)` for every pending tensor.
  template <class ForEach>
  static void check_restorable(const weighted_accumulation_state& state, std::size_t pending_count,
                               ForEach&& for_each_tensor) {
    validate(state);
    detail::check_pending_against(state, pending_count, std::forward<ForEach>(for_each_tensor));
  }

  gradients_accumulator<B> accumulator_;
  weighted_accumulation_state state_;
};

// The calls of a training loop are defined out of the class, so that a program can compile them
// once (`GRADACCUM_EXTERN_TEMPLATES`, <gradaccum/extern_templates.hpp>).

template <class B>
void weighted_gradients_accumulator<B>::accumulate_sum(const parameter_set<B>& params, const gradients_params<B>& grads,
                                                       double weight) {
  accumulate(params, grads, weight, 1.0);
}

template <class B>
void weighted_gradients_accumulator<B>::accumulate_mean(const parameter_set<B>& params,
                                                        const gradients_params<B>& grads, double weight) {
  accumulate(params, grads, weight, weight);
}

template <class B>
accumulated_gradients<B> weighted_gradients_accumulator<B>::finish_mean(const parameter_set<B>& params) {
  if (!(state_.total_weight > 0.0)) {
    detail::fail(errc::empty_weight, "cannot normalize an accumulation window whose total weight is zero.");
  }
  accumulator_.check_pending_for(params);
  accumulator_.divide_pending(state_.loss_scale, state_.total_weight);
  accumulated_gradients<B> result{accumulator_.grads(), state_};
  reset_counters();
  return result;
}

template <class B>
std::vector<std::string> weighted_gradients_accumulator<B>::non_finite() const {
  return accumulator_.non_finite();
}

}  // namespace gradaccum
