#pragma once
/// @file
/// @brief `gradients_accumulator<B>`: sums gradients into one contiguous work-dtype buffer.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "gradaccum/backend.hpp"
#include "gradaccum/detail/accumulator_restorer.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/flat_gradients.hpp"
#include "gradaccum/gradient_buffer.hpp"
#include "gradaccum/gradients_params.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/records.hpp"

namespace gradaccum {

/// @brief Plain summing accumulator: `pending[id] += m · W(g[id])` for every present id, in one
/// work dtype W for all of them.
///
/// The pending sums are a `flat_gradients<B>`: one buffer laid out from the parameter set on
/// first use (again only if a different or grown set is passed). `grads()` hands the buffer to
/// the result; the next window reuses it once that result is gone (or a second one, kept from
/// the window before, once that is gone), so a training loop that drops each result before its
/// next window finishes allocates nothing per window. Each call first validates every id, then
/// allocates what it needs, then adds; a rejected call or a failed allocation leaves values
/// exactly as they were (strong guarantee).
template <class B>
class gradients_accumulator {
  static_assert(detail::check_backend<B>());

 public:
  gradients_accumulator() = default;

  /// @brief `pending += g` in F64 if any value so far or now is F64, else F32 (16-bit
  /// gradients are never summed in 16 bits). F32 sums are widened, exactly, when F64 arrives.
  void accumulate(const parameter_set<B>& params, const gradients_params<B>& grads) {
    bool f64 = !pending_.empty() && pending_.dtype() == float_dtype::f64;
    for (const auto& e : grads) f64 = f64 || gradients_params<B>::dtype_of_value(e.value) == float_dtype::f64;
    add(params, grads, 1.0, f64 ? float_dtype::f64 : float_dtype::f32);
  }

  /// @brief `pending += W(g)` in work dtype `dtype` (pending sums of another dtype are
  /// converted first).
  /// @throws error(errc::invalid_dtype) unless `dtype` is F32 or F64.
  void accumulate_with_dtype(const parameter_set<B>& params, const gradients_params<B>& grads, float_dtype dtype) {
    detail::require_work_dtype(dtype);
    add(params, grads, 1.0, dtype);
  }

  /// @brief `pending += W(multiplier) · W(g)` in work dtype `dtype`: one fused pass per tensor.
  /// @throws error(errc::invalid_scalar) when `multiplier` is not representable in `dtype`.
  void accumulate_scaled(const parameter_set<B>& params, const gradients_params<B>& grads, double multiplier,
                         float_dtype dtype) {
    detail::require_work_dtype(dtype);
    detail::require_scalar(multiplier, dtype, false);
    add(params, grads, multiplier, dtype);
  }

  /// @brief Validates like an accumulation would, touching nothing.
  void validate(const parameter_set<B>& params, const gradients_params<B>& grads) const { grads.validate_for(params); }

  /// @brief The same three calls over a `gradient_buffer` laid out for `params`: one pass over
  /// each run of present segments (the whole buffer when every parameter is present), with the
  /// bits of adding each gradient alone. `accumulate` sums in F64 if T is double or the pending
  /// sums are F64, else in F32.
  /// @throws error(errc::parameter_mismatch) when `grads` was laid out for another parameter set
  /// (or one that has grown since); and what the calls above throw for dtypes and multipliers.
  template <class T>
  void accumulate(const parameter_set<B>& params, const gradient_buffer<B, T>& grads) {
    const bool f64 = std::is_same_v<T, double> || (!pending_.empty() && pending_.dtype() == float_dtype::f64);
    add(params, grads, 1.0, f64 ? float_dtype::f64 : float_dtype::f32);
  }
  template <class T>
  void accumulate_with_dtype(const parameter_set<B>& params, const gradient_buffer<B, T>& grads, float_dtype dtype) {
    detail::require_work_dtype(dtype);
    add(params, grads, 1.0, dtype);
  }
  template <class T>
  void accumulate_scaled(const parameter_set<B>& params, const gradient_buffer<B, T>& grads, double multiplier,
                         float_dtype dtype) {
    detail::require_work_dtype(dtype);
    detail::require_scalar(multiplier, dtype, false);
    add(params, grads, multiplier, dtype);
  }
  template <class T>
  void validate(const parameter_set<B>& params, const gradient_buffer<B, T>& grads) const {
    if (!grads.layout().laid_out_for(params)) {
      detail::fail(errc::parameter_mismatch,
                   "this gradient_buffer was laid out for another parameter set, or for one that has grown since.");
    }
  }

  /// @brief The pending sums.
  [[nodiscard]] const flat_gradients<B>& pending() const noexcept { return pending_; }

  /// @brief Takes the pending sums and resets the accumulator.
  [[nodiscard]] flat_gradients<B> grads() noexcept {
    remember(pending_);  // once the caller drops the result, a later window writes into it again
    return std::exchange(pending_, flat_gradients<B>{});
  }

  /// @brief `pending = (pending / first) / second`: two sequential divisions, never one by the
  /// product; one pass over the buffer (padding and absent segments are zero and stay zero).
  void divide_pending(double first, double second) noexcept {
    detail::flat_storage* storage = pending_.storage_.get();
    if (!storage || storage->present_count == 0) return;
    const flat_layout<B>& layout = *pending_.layout_;
    // From the first present segment to the end of the last: the zeros in between cost less
    // than splitting the pass.
    std::size_t first_position = 0;
    while (storage->present[first_position] == 0) ++first_position;
    std::size_t last_position = layout.size() - 1;
    while (storage->present[last_position] == 0) --last_position;
    if (storage->device) {
      // A device operation per call: one per buffer when every segment is present.
      if (storage->present_count == layout.size()) {
        storage->device->divide_all(first, second);
        return;
      }
      for (std::size_t position = first_position; position <= last_position; ++position) {
        if (storage->present[position] != 0) storage->device->divide(position, first, second);
      }
      return;
    }
    const std::size_t begin = layout[first_position].offset;
    const std::size_t end = layout[last_position].offset + layout[last_position].size;
    if (storage->dtype == float_dtype::f64) {
      kernels::divide(storage->data<double>() + begin, end - begin, first, second);
    } else {
      kernels::divide(storage->data<float>() + begin, end - begin, static_cast<float>(first),
                      static_cast<float>(second));
    }
  }

  /// @brief Ids whose pending values hold a NaN or an infinity, sorted; changes nothing.
  [[nodiscard]] std::vector<std::string> non_finite() const { return pending_.non_finite(); }

  /// @brief Row-major record of the pending sums, sorted by id.
  [[nodiscard]] gradients_params_record try_to_record() const { return pending_.to_record(); }

  /// @brief `f(view)` of `try_to_record()` without its copy (see `flat_gradients::visit_record`).
  template <class F>
  decltype(auto) visit_record(F&& f) const {
    return pending_.visit_record(std::forward<F>(f));
  }

  /// @brief Replaces the pending sums with a record's (validated against `params` first;
  /// nothing changes on error). Values of 16-bit dtypes are rejected with invalid_dtype, and
  /// so are tensors of two different work dtypes (a window has one).
  void load_record(const parameter_set<B>& params, const gradients_params_record& record) {
    gradaccum::validate(record);
    restorer restored(*this, params);
    for (const tensor_record& t : record.tensors) {
      restored.add(std::string(t.id), t.dtype, detail::record_shape(t), record_values_source{t.values});
    }
    std::move(restored).commit();
  }

  /// @brief Restores the pending sums tensor by tensor as a loader reads them, with the checks
  /// of `load_record`; the accumulator changes only on `commit()`. A sink of
  /// `<gradaccum/cereal.hpp>`'s loaders, which `load_checkpoint` uses to read values straight
  /// into the buffer.
  using restorer = detail::accumulator_restorer<B>;

 private:
  template <class>
  friend class weighted_gradients_accumulator;
  friend class detail::accumulator_restorer<B>;

  /// The values of a record tensor, for `restorer::add`.
  struct record_values_source {
    const record_values& values;
    template <class S>
    void into(std::span<S> out) const {
      std::copy_n(std::get<std::vector<S>>(values).data(), out.size(), out.data());
    }
  };

  /// `pending += W(multiplier) · W(g)`: `prepare`, then `add_prepared`.
  template <class G>
  void add(const parameter_set<B>& params, const G& grads, double multiplier, float_dtype dtype) {
    prepare(params, grads, dtype);
    add_prepared(params, grads, multiplier, dtype);
  }

  /// Everything of an add that may throw, touching no value: every gradient validated and its
  /// id resolved to a parameter position, then a buffer laid out for `params` in `dtype`. The
  /// adds that follow (`add_prepared`) cannot fail, so a caller may commit its own state in
  /// between, before the kernels' stores, rather than after them.
  void prepare(const parameter_set<B>& params, const gradients_params<B>& grads, float_dtype dtype) {
    // Gradients bound to `params` were resolved and checked at insert; only owned tensors,
    // which `get<T>` hands out mutably, are checked again.
    if (grads.bound_to(params)) {
      if (grads.owned_count() != 0) check_owned(params, grads);
    } else {
      resolve_positions(params, grads);
    }
    if (!grads.empty() && !ready_for(params, dtype)) [[unlikely]] {
      lay_out(params, dtype, nullptr);
    }
  }

  /// Whether `prepare` would find nothing to do: gradients bound to `params`, all views, and a
  /// buffer laid out for `params` in `dtype` (the steady state of a training loop).
  [[nodiscard, gnu::always_inline]] bool ready_to_add(const parameter_set<B>& params, const gradients_params<B>& grads,
                                                      float_dtype dtype) const noexcept {
    return grads.bound_to(params) && grads.owned_count() == 0 && ready_for(params, dtype);
  }

  /// The adds of a prepared call (positions from the binding or `positions_`).
  void add_prepared(const parameter_set<B>& params, const gradients_params<B>& grads, double multiplier,
                    float_dtype dtype) noexcept {
    if (grads.empty()) return;
    const bool bound = grads.bound_to(params);
    if (dtype == float_dtype::f64) {
      bound ? add_each<double, true>(grads, multiplier) : add_each<double, false>(grads, multiplier);
    } else {
      const auto scale = static_cast<float>(multiplier);
      bound ? add_each<float, true>(grads, scale) : add_each<float, false>(grads, scale);
    }
  }

  /// The adds of `add`, into the prepared buffer (positions from the binding or `positions_`).
  /// One gradient (a model whose parameters live in one flat tensor, as FSDP's flat parameter)
  /// ends the call in its kernel, with no register saved on the way; more go round a loop.
  template <class W, bool Bound>
  void add_each(const gradients_params<B>& grads, W scale) noexcept {
    if (grads.size() == 1) {
      add_entry<W, Bound>(grads, 0, scale);
    } else {
      add_entries<W, Bound>(grads, scale);
    }
    if constexpr (device_buffers_backend<B>) {
      // A device backend may queue adds to issue them together; none may outlive the call.
      static_cast<detail::device_values_of<B, W>&>(*pending_.storage_->device).flush_adds();
    }
  }
  template <class W, bool Bound>
  [[gnu::noinline]] void add_entries(const gradients_params<B>& grads, W scale) noexcept {
    for (std::size_t k = 0; k < grads.size(); ++k) add_entry<W, Bound>(grads, k, scale);
  }
  /// The k-th gradient goes to its entry's add (`detail::gradient_adds`), with the segment and
  /// scale as arguments: they stay in registers (a visiting lambda's captures were written to the
  /// stack for every gradient).
  template <class W, bool Bound>
  void add_entry(const gradients_params<B>& grads, std::size_t k, W scale) noexcept {
    const auto& e = grads.begin()[static_cast<std::ptrdiff_t>(k)];
    const std::size_t position = Bound ? e.position : positions_[k];
    const flat_segment<B>& s = (*pending_.layout_)[position];
    detail::flat_storage& buffer = *pending_.storage_;
    buffer.mark_present(position);
    detail::add_target<B, W> acc;
    if constexpr (device_buffers_backend<B>) {
      auto& values = static_cast<detail::device_values_of<B, W>&>(*buffer.device);
      acc = {&values.buffer_of(position), values.place(position).offset};
    } else {
      acc = std::span<W>(buffer.data<W>() + s.offset, s.size);
    }
    if constexpr (std::is_same_v<W, float>) {
      e.adds->f32(acc, e.value, scale);
    } else {
      e.adds->f64(acc, e.value, scale);
    }
  }

  /// Checks the owned tensors of bound gradients against their parameters, views having been
  /// checked at insert. Out of line: gradients that are all views never come here.
  [[gnu::noinline]] static void check_owned(const parameter_set<B>& params, const gradients_params<B>& grads) {
    for (const auto& e : grads) {
      if (gradients_params<B>::is_view(e.value)) continue;
      detail::check_geometry<B>(params[e.position], e.id, detail::geometry_of<B>(e.value, e.id));
    }
  }

  /// `positions_[k]`: the parameter position of the k-th gradient (ids looked up, every
  /// gradient checked against its parameter). Out of line: bound gradients never come here.
  [[gnu::noinline]] void resolve_positions(const parameter_set<B>& params, const gradients_params<B>& grads) {
    positions_.clear();
    positions_.reserve(grads.size());
    std::size_t hint = 0;
    for (const auto& e : grads) {
      const std::size_t position = detail::resolve(params, e.id, e.value, hint);
      positions_.push_back(position);
      hint = position + 1;
    }
  }

  /// `prepare` and `add_prepared` of a `gradient_buffer`.
  template <class T>
  void prepare(const parameter_set<B>& params, const gradient_buffer<B, T>& grads, float_dtype dtype) {
    static_assert(!device_buffers_backend<B>, "a gradient_buffer is host memory; a device window takes tensors");
    validate(params, grads);
    if (!grads.empty() && !ready_for(params, dtype)) [[unlikely]] {
      lay_out(params, dtype, &grads.layout_);  // the buffer's layout is this set's; then nothing throws
    }
  }
  template <class T>
  [[nodiscard, gnu::always_inline]] bool ready_to_add(const parameter_set<B>& params,
                                                      const gradient_buffer<B, T>& grads,
                                                      float_dtype dtype) const noexcept {
    return grads.layout().laid_out_for(params) && ready_for(params, dtype);
  }
  template <class T>
  void add_prepared(const parameter_set<B>& /*params*/, const gradient_buffer<B, T>& grads, double multiplier,
                    float_dtype dtype) noexcept {
    if (grads.empty()) return;  // then `prepare` may have laid out nothing
    const flat_layout<B>& segments = *pending_.layout_;
    const detail::flat_storage& buffer = *pending_.storage_;
    detail::visit_work_dtype(dtype, [&]<class W>() {
      const auto scale = static_cast<W>(multiplier);
      // The steady state, every parameter present in both: one pass over the whole buffer, and
      // nothing else, so this call ends in the kernel.
      if (grads.size() == segments.size() && buffer.present_count == segments.size()) [[likely]] {
        kernels::add_scaled(buffer.data<W>(), grads.data_.get(), segments.elements(), scale);
      } else {
        add_present_runs(grads, scale);
      }
    });
  }
  /// The adds of a `gradient_buffer` otherwise: both buffers have the same segments, so a run
  /// of present segments is one stretch of both, the zero padding between them included.
  template <class T, class W>
  [[gnu::noinline]] void add_present_runs(const gradient_buffer<B, T>& grads, W scale) noexcept {
    const flat_layout<B>& segments = *pending_.layout_;
    detail::flat_storage& buffer = *pending_.storage_;
    W* const acc = buffer.data<W>();
    const T* const g = grads.data_.get();
    for (std::size_t first = 0; first < segments.size();) {
      if (!grads.is_present(first)) {
        ++first;
        continue;
      }
      std::size_t last = first;
      while (last + 1 < segments.size() && grads.is_present(last + 1)) ++last;
      for (std::size_t position = first; position <= last; ++position) buffer.mark_present(position);
      const std::size_t begin = segments[first].offset;
      kernels::add_scaled(acc + begin, g + begin, segments[last].offset + segments[last].size - begin, scale);
      first = last + 1;
    }
  }

  /// Whether the pending buffer is one laid out for `params` in `dtype`, as it is in the steady
  /// state; else `lay_out` makes it one.
  [[nodiscard, gnu::always_inline]] bool ready_for(const parameter_set<B>& params, float_dtype dtype) const noexcept {
    return pending_.storage_ && pending_.storage_->dtype == dtype && pending_.layout_ == layout_ &&
           layout_->laid_out_for(params);
  }
  /// Makes the pending buffer one laid out for `params` in `dtype`: a layout (the current one,
  /// or `*laid_out` when given and the current one is not this set's, or a new one) and a
  /// writable buffer are made first and committed after, so a failure changes nothing. Out of
  /// line, off the steady path.
  [[gnu::noinline]] void lay_out(const parameter_set<B>& params, float_dtype dtype,
                                 const std::shared_ptr<const flat_layout<B>>* laid_out) {
    std::shared_ptr<const flat_layout<B>> layout =
        laid_out && !(layout_ && layout_->laid_out_for(params)) ? *laid_out : layout_for(params);
    std::shared_ptr<detail::flat_storage> storage = writable(layout, dtype);
    layout_ = layout;
    pending_.layout_ = std::move(layout);
    pending_.storage_ = std::move(storage);
  }

  /// Checks that every pending id is a parameter of `params` with the same shape.
  void check_pending_for(const parameter_set<B>& params) const {
    if (!pending_.layout_ || pending_.layout_->laid_out_for(params)) return;
    for (const auto& e : pending_) {
      const auto position = params.find(e.id);
      if (!position) fail_pending_unknown(e.id);
      if (!detail::same_shape<B>(params[*position].shape, e.shape)) fail_pending_shape(e, params[*position].shape);
    }
  }

  /// A pending gradient the parameter set passed now lacks: it came from an earlier call of
  /// this window, not from this call's gradients, and the message says so.
  [[noreturn, gnu::cold]] static void fail_pending_unknown(std::string_view id) {
    detail::fail(errc::unknown_parameters,
                 {"gradient '", id,
                  "', pending in this window from an earlier call, names no parameter of the parameter set "
                  "passed now; finish the window with the set it was accumulated with before switching to a "
                  "set without it."},
                 id);
  }
  [[noreturn, gnu::cold]] static void fail_pending_shape(const typename flat_gradients<B>::entry& e,
                                                         const tensor_shape& shape) {
    detail::fail(errc::parameter_mismatch,
                 {"gradient '", e.id, "', pending in this window from an earlier call, has shape ", e.shape.dims(),
                  " but its parameter in the parameter set passed now has shape ", shape.dims(), "."},
                 e.id);
  }

  /// The layout for `params`: the current one while it was laid out for this set, else new.
  std::shared_ptr<const flat_layout<B>> layout_for(const parameter_set<B>& params) const {
    if (layout_ && layout_->laid_out_for(params)) return layout_;
    return std::make_shared<const flat_layout<B>>(params);
  }

  /// A buffer laid out with `layout`, in `dtype`, holding the pending sums, that this call may
  /// write: the pending one if it fits; else the pending values moved into a recycled or new
  /// buffer (converted to `dtype`, moved to the new layout). Changes nothing visible.
  std::shared_ptr<detail::flat_storage> writable(const std::shared_ptr<const flat_layout<B>>& layout,
                                                 float_dtype dtype) {
    const bool same_layout = pending_.layout_ == layout;
    if (pending_.storage_ && same_layout && pending_.storage_->dtype == dtype) return pending_.storage_;
    std::shared_ptr<detail::flat_storage> fresh = recycle(layout, dtype);
    if (!fresh) fresh = detail::allocate_storage(*layout, dtype);
    if (pending_.empty()) return fresh;
    // Move the pending values over (new dtype or new layout): by id, checked like a gradient.
    try {
      for (const auto& e : pending_) {
        const auto position = layout->find(e.id);
        if (!position) fail_pending_unknown(e.id);
        if (!detail::same_shape<B>((*layout)[*position].shape, e.shape))
          fail_pending_shape(e, (*layout)[*position].shape);
        detail::copy_segment(*pending_.storage_, e.position, e.offset, *fresh, *position, (*layout)[*position].offset,
                             e.size);
        fresh->mark_present(*position);
      }
    } catch (...) {
      fresh->clear();
      throw;
    }
    return fresh;
  }

  /// Keeps `buffer`'s storage among the two `recycle` may hand out again.
  /// The restorer's commit: `storage` laid out by `layout` becomes the pending sums (`kept`, when
  /// set, the layout kept across windows); the buffer replaced serves a later load or window.
  void adopt_pending(const std::shared_ptr<const flat_layout<B>>& kept, std::shared_ptr<const flat_layout<B>> layout,
                     std::shared_ptr<detail::flat_storage> storage) noexcept {
    if (kept) layout_ = kept;
    remember(pending_);
    pending_ = flat_gradients<B>(std::move(layout), std::move(storage));
  }

  void remember(const flat_gradients<B>& buffer) noexcept {
    if (!buffer.storage_) return;
    recycled_[1] = std::move(recycled_[0]);
    recycled_[0] = {buffer.layout_, buffer.storage_};
  }

  /// A buffer handed out by `grads()` or replaced by a load that nobody else holds any more,
  /// zeroed (unless `cleared` is false: then only its absent segments and padding are, and its
  /// present segments keep their values); else null. A result's mutable views may have written
  /// anywhere in the buffer, so the invariant is re-established here, whatever was written.
  std::shared_ptr<detail::flat_storage> recycle(const std::shared_ptr<const flat_layout<B>>& layout, float_dtype dtype,
                                                bool cleared = true) noexcept {
    for (auto& [laid_out_with, storage] : recycled_) {
      if (storage && storage.use_count() == 1 && laid_out_with == layout && storage->dtype == dtype) {
        if (cleared) {
          storage->clear();
        } else {
          storage->zero_outside_present(*layout);
        }
        return std::exchange(storage, nullptr);
      }
    }
    return nullptr;
  }

  static void require_pending_dtype(std::string_view id, float_dtype dtype) {
    if (!is_work_dtype(dtype)) {
      detail::fail(errc::invalid_dtype,
                   {"pending tensor '", id, "' has dtype ", to_string(dtype), "; pending sums are F32 or F64."}, id);
    }
  }

  struct recycled_storage {
    std::shared_ptr<const flat_layout<B>> layout;
    std::shared_ptr<detail::flat_storage> storage;
  };

  flat_gradients<B> pending_;
  std::shared_ptr<const flat_layout<B>> layout_;  // the last parameter set's, kept across windows
  std::array<recycled_storage, 2> recycled_;      // buffers of the last two results, for reuse
  std::vector<std::size_t> positions_;            // scratch: parameter positions of a call's gradients
};

}  // namespace gradaccum
