#pragma once
/// @file
/// @brief `gradients_accumulator<B>`: sums gradients per parameter in a work dtype.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "gradaccum/backend.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/gradients_params.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/records.hpp"

namespace gradaccum {

/// @brief Plain summing accumulator: `pending[id] += m · W(g[id])` for every present id.
///
/// Pending tensors are created (zero-filled) the first time an id receives a gradient and
/// reused afterwards, so once every parameter has one, accumulating allocates nothing. Each
/// call first validates every id, then allocates what is new, then adds; a rejected call or a
/// failed allocation leaves values exactly as they were (strong guarantee).
template <class B>
class gradients_accumulator {
  static_assert(detail::check_backend<B>());

 public:
  template <class T>
  using tensor = typename B::template tensor<T>;

  gradients_accumulator() = default;

  /// @brief `pending += g`. A new pending tensor is F64 for F64 gradients and F32 otherwise
  /// (16-bit gradients are never summed in 16 bits); later gradients are converted to it.
  void accumulate(const parameter_set<B>& params, const gradients_params<B>& grads) {
    add(params, grads, 1.0, std::nullopt);
  }

  /// @brief `pending += W(g)` with every pending and incoming value in work dtype `dtype`
  /// (pending tensors of another dtype are converted first).
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

  /// @brief The pending sums (owned tensors of a work dtype).
  [[nodiscard]] const gradients_params<B>& pending() const noexcept { return pending_; }

  /// @brief Takes the pending sums and resets the accumulator.
  [[nodiscard]] gradients_params<B> grads() noexcept {
    gradients_params<B> taken = std::move(pending_);
    pending_.clear();
    slots_.clear();
    slots_for_ = 0;
    pending_dtype_.reset();
    return taken;
  }

  /// @brief `pending = (pending / first) / second` in each tensor's own work dtype: two
  /// sequential divisions, never one by the product.
  void divide_pending(double first, double second) noexcept {
    for (auto& e : pending_.entries_) {
      if (auto* f32 = std::get_if<tensor<float>>(&e.value)) {
        B::divide(*f32, static_cast<float>(first), static_cast<float>(second));
      } else if (auto* f64 = std::get_if<tensor<double>>(&e.value)) {
        B::divide(*f64, first, second);
      }
    }
  }

  /// @brief Ids whose pending values hold a NaN or an infinity, sorted; changes nothing.
  [[nodiscard]] std::vector<std::string> non_finite() const {
    std::vector<std::string> ids;
    for (const auto& e : pending_) {
      const bool finite = detail::visit_gradient(
          [](const auto& value) {
            if constexpr (requires { B::all_finite(value); }) {
              return B::all_finite(value);
            } else {
              return true;  // pending values are always owned work-dtype tensors
            }
          },
          e.value);
      if (!finite) ids.push_back(e.id);
    }
    std::sort(ids.begin(), ids.end());
    return ids;
  }

  /// @brief Row-major record of the pending sums, sorted by id.
  [[nodiscard]] gradients_params_record try_to_record() const
    requires serializable_backend<B>
  {
    return pending_.to_record();
  }

  /// @brief `f(view)` of `try_to_record()` without its copy (see `gradients_params::visit_record`).
  template <class F>
  decltype(auto) visit_record(F&& f) const
    requires serializable_backend<B>
  {
    return pending_.visit_record(std::forward<F>(f));
  }

  /// @brief Replaces the pending sums with a record's (validated against `params` first;
  /// nothing changes on error). Values of 16-bit dtypes are rejected with invalid_dtype.
  void load_record(const parameter_set<B>& params, const gradients_params_record& record)
    requires serializable_backend<B>
  {
    for (const tensor_record& t : record.tensors) require_pending_dtype(t.id, t.dtype);
    adopt(gradients_params<B>::from_record(params, record));
  }

  /// @brief Restores the pending sums tensor by tensor as a loader reads them, with the checks
  /// of `load_record`; the accumulator changes only on `commit()`. A sink of
  /// `<gradaccum/cereal.hpp>`'s loaders, which `load_checkpoint` uses to read values straight
  /// into the backend's tensors.
  class restorer {
   public:
    restorer(gradients_accumulator& target, const parameter_set<B>& params) noexcept
        : target_(&target), built_(params) {}

    void reserve(std::size_t count) { built_.reserve(count); }
    template <class Values>
    void add(std::string&& id, float_dtype dtype, const tensor_shape& shape, const Values& values) {
      require_pending_dtype(id, dtype);
      built_.add(std::move(id), dtype, shape, values);
    }
    void commit() && noexcept { target_->adopt(std::move(built_).finish()); }

   private:
    gradients_accumulator* target_;
    typename gradients_params<B>::builder built_;
  };

  /// @brief Replaces the pending sums with `pending` (owned F32/F64 tensors, already validated
  /// against the parameters by the caller). Used when restoring.
  void adopt(gradients_params<B>&& pending) noexcept {
    pending_ = std::move(pending);
    slots_.clear();
    slots_for_ = 0;
    pending_dtype_ = common_dtype(pending_);
  }

 private:
  using value_type = typename gradients_params<B>::value_type;

  /// The work dtype of `position`'s pending tensor after this call.
  static float_dtype target_dtype(const value_type* pending, const value_type& incoming,
                                  std::optional<float_dtype> work) noexcept {
    if (work) return *work;
    if (pending) return gradients_params<B>::dtype_of_value(*pending);
    return gradients_params<B>::dtype_of_value(incoming) == float_dtype::f64 ? float_dtype::f64 : float_dtype::f32;
  }

  void add(const parameter_set<B>& params, const gradients_params<B>& grads, double multiplier,
           std::optional<float_dtype> work) {
    // 1. Validate every gradient and resolve its id to a parameter position; nothing is touched
    // yet. Positions of an earlier call stand while neither the set nor the ids of `grads`
    // changed, so a steady-state call only checks shapes and devices; and not even those when
    // every gradient is a view of a backend whose views keep their geometry, and no entry
    // changed since they were checked.
    const resolution_key key{params.identity(), params.size(), grads.ids_version()};
    std::size_t k = 0;
    bool all_views = true;
    if (key != resolved_for_) {
      resolved_for_ = {};  // positions_ is rewritten below, possibly only in part
      views_checked_for_ = 0;
      positions_.resize(grads.size());
      std::size_t hint = 0;
      for (const auto& e : grads) {
        const std::size_t position = detail::visit_gradient(
            [&](const auto& value) { return detail::resolve(params, e.id, value, hint); }, e.value);
        positions_[k++] = position;
        hint = position + 1;
        all_views = all_views && gradients_params<B>::is_view(e.value);
      }
      resolved_for_ = key;
    } else if (grads.values_version() != views_checked_for_) {
      for (const auto& e : grads) {
        const auto& param = params[positions_[k++]];
        detail::visit_gradient([&](const auto& value) { detail::check_geometry<B>(param, e.id, value); }, e.value);
        all_views = all_views && gradients_params<B>::is_view(e.value);
      }
    }
    if (detail::views_keep_geometry<B>() && all_views) views_checked_for_ = grads.values_version();
    const bool rebind = slots_for_ != params.identity() || slots_.size() != params.size();
    const bool all_pending =
        !rebind && std::all_of(positions_.begin(), positions_.end(), [&](std::size_t p) { return slots_[p] != 0; });

    // 2. Steady state skips this: every id has a pending tensor of the right dtype already.
    const bool convert = work && !pending_.empty() && pending_dtype_ != work;
    if (!all_pending || convert) prepare(params, grads, work, rebind);

    // 3. Add: nothing below can throw.
    k = 0;
    for (const auto& e : grads) {
      auto& target = pending_.entries_[slots_[positions_[k++]] - 1].value;
      std::visit(
          [&](auto& acc) {
            using W = detail::element_of<B, decltype(acc)>;
            if constexpr (std::is_same_v<W, float> || std::is_same_v<W, double>) {
              if constexpr (std::is_same_v<std::remove_cvref_t<decltype(acc)>, tensor<W>>) {
                detail::visit_gradient([&](const auto& g) { B::add_scaled(acc, g, static_cast<W>(multiplier)); },
                                       e.value);
              }
            }
          },
          target);
    }
  }

  /// Allocates what a call needs (the position → pending map, zero tensors for new ids,
  /// pending tensors converted to `work`), then commits it without throwing. A throw while
  /// allocating leaves the accumulator as it was.
  void prepare(const parameter_set<B>& params, const gradients_params<B>& grads, std::optional<float_dtype> work,
               bool rebind) {
    std::vector<std::uint32_t> rebuilt_slots;
    if (rebind) {
      rebuilt_slots.assign(params.size(), 0);
      std::size_t index = 0;
      for (const auto& e : pending_) {
        ++index;
        if (const auto position = params.find(e.id)) rebuilt_slots[*position] = static_cast<std::uint32_t>(index);
      }
    }
    const std::vector<std::uint32_t>& slots = rebind ? rebuilt_slots : slots_;

    // Ids are unique within `grads`, so each new position appears once.
    std::vector<std::pair<std::size_t, typename gradients_params<B>::entry>> fresh;  // position, zeros
    std::vector<std::pair<std::size_t, value_type>> converted;  // pending index, value in the new dtype
    std::size_t k = 0;
    for (const auto& e : grads) {
      const std::size_t position = positions_[k++];
      const std::uint32_t slot = slots[position];
      if (slot == 0) {
        const auto& param = params[position];
        detail::visit_work_dtype(target_dtype(nullptr, e.value, work), [&]<class W>() {
          fresh.emplace_back(position, typename gradients_params<B>::entry{
                                           param.id, value_type(std::in_place_type<tensor<W>>,
                                                                B::template zeros<W>(param.shape, param.device))});
        });
      }
    }
    if (work) {
      std::size_t index = 0;
      for (const auto& e : pending_) {
        if (gradients_params<B>::dtype_of_value(e.value) != *work) {
          detail::visit_work_dtype(*work, [&]<class W>() {
            converted.emplace_back(
                index,
                value_type(std::in_place_type<tensor<W>>,
                           detail::visit_gradient([](const auto& v) { return B::template convert<W>(v); }, e.value)));
          });
        }
        ++index;
      }
    }
    pending_.reserve(pending_.size() + fresh.size());

    // Commit.
    if (rebind) {
      slots_.swap(rebuilt_slots);
      slots_for_ = params.identity();
    }
    for (auto& [index, value] : converted) pending_.entries_[index].value = std::move(value);
    for (auto& [position, added] : fresh) {
      pending_.push_back_reserved(std::move(added));
      slots_[position] = static_cast<std::uint32_t>(pending_.size());
    }
    pending_dtype_ = common_dtype(pending_);
  }

  static void require_pending_dtype(const std::string& id, float_dtype dtype) {
    if (!is_work_dtype(dtype)) {
      detail::fail(
          errc::invalid_dtype,
          "pending tensor '" + id + "' has dtype " + std::string(to_string(dtype)) + "; pending sums are F32 or F64.",
          id);
    }
  }

  /// The dtype every pending tensor shares, if there is one.
  static std::optional<float_dtype> common_dtype(const gradients_params<B>& pending) noexcept {
    std::optional<float_dtype> common;
    for (const auto& e : pending) {
      const float_dtype dtype = gradients_params<B>::dtype_of_value(e.value);
      if (common && *common != dtype) return std::nullopt;
      common = dtype;
    }
    return common;
  }

  /// What `positions_` was resolved for: parameter set identity and size, ids version of the gradients.
  struct resolution_key {
    std::uint64_t params = 0;
    std::size_t size = 0;
    std::uint64_t ids = 0;
    friend bool operator==(const resolution_key&, const resolution_key&) = default;
  };

  gradients_params<B> pending_;
  std::vector<std::uint32_t> slots_;          // parameter position → pending index + 1 (0: none yet)
  std::uint64_t slots_for_ = 0;               // identity of the parameter set `slots_` was built for
  std::vector<std::size_t> positions_;        // parameter positions of the last gradients, in order
  resolution_key resolved_for_;               // what `positions_` holds positions for
  std::uint64_t views_checked_for_ = 0;       // values version of all-view gradients checked under it
  std::optional<float_dtype> pending_dtype_;  // dtype shared by every pending tensor, if any
};

}  // namespace gradaccum
