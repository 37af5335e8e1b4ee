#pragma once
/// @file
/// @brief `gradients_params<B>`: the gradients present for a microbatch, keyed by parameter id.

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "gradaccum/backend.hpp"
#include "gradaccum/detail/gradient_checks.hpp"
#include "gradaccum/detail/gradient_input.hpp"
#include "gradaccum/detail/id_index.hpp"
#include "gradaccum/detail/variant.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/strided_view.hpp"

namespace gradaccum {

/// @brief Gradients present for some parameters, each a tensor (or view) of any element type
/// the backend supports. Absent means absent: nothing is invented for a missing parameter.
///
/// Entries keep insertion order; giving them in parameter order makes id resolution a single
/// string comparison each. Reused across microbatches with the same ids (views of buffers
/// rewritten in place, or values replaced by `insert_or_assign`), it is resolved once per accumulator.
template <class B>
class gradients_params {
  static_assert(detail::check_backend<B>());

 public:
  /// A tensor or view of any supported element type.
  using value_type = detail::gradient_variant_t<B>;
  template <class T>
  using tensor = typename B::template tensor<T>;

  struct entry {
    std::string id;
    value_type value;
    std::size_t position = 0;  ///< the parameter's position, in a container bound to a set
    /// The values a `copied_view` went in with, which `value` views; shared by copies of the
    /// container, reused by `insert_or_assign` while only this entry holds it.
    std::shared_ptr<std::byte[]> copy = nullptr;
    std::size_t copy_bytes = 0;
    const detail::gradient_adds<B>* adds = nullptr;  ///< `value`'s adds (`detail::adds_of`)
  };

  /// @brief Gradients for any parameter set, resolved by id on every accumulate call.
  gradients_params() = default;

  /// @brief Gradients bound to `params`: each `insert` resolves its id and checks its shape
  /// and device there, so an accumulate call with this set resolves and checks nothing for
  /// views (owned tensors, which `get<T>` can change, are checked again). `params` must outlive
  /// this container and stay where it is; it may grow.
  /// @code
  /// gradaccum::gradients_params<B> grads(params);          // once
  /// grads.insert("fc.weight", Eigen::Map<const Eigen::MatrixXf>(grad_buffer, 2, 3));
  /// for (auto& mb : window) { backward(mb); acc.accumulate_mean(params, grads, mb.tokens); }
  /// @endcode
  explicit gradients_params(const parameter_set<B>& params) noexcept
      : params_(&params), params_identity_(params.identity()) {}

  /// @brief Whether ids were resolved against `params` at insert (see the bound constructor).
  /// The set's identity is compared too: a set created where a destroyed one was is another set.
  [[nodiscard]] bool bound_to(const parameter_set<B>& params) const noexcept {
    return params_ == &params && params_identity_ == params.identity();
  }

  /// @brief Stores `value` under a new `id`: a tensor (moved or copied), a view of caller memory
  /// (read in place), or anything else the backend takes (see
  /// `<gradaccum/detail/gradient_input.hpp>`; expressions are evaluated here, once). As the
  /// standard library's `insert`, it neither replaces nor adds to a gradient already under `id`:
  /// use `insert_or_assign` to replace one.
  /// @throws error(errc::invalid_record) when `id` is present (nothing changes);
  /// error(errc::parameter_mismatch) for a shape the backend cannot represent.
  template <class X>
  void insert(std::string_view id, X&& value) {
    if (find(id)) [[unlikely]] {
      detail::fail(errc::invalid_record,
                   {"gradient '", id,
                    "' is present already; insert_or_assign replaces it (to sum two gradients, accumulate them "
                    "in separate microbatches)."},
                   id);
    }
    insert_or_assign(id, std::forward<X>(value));
  }

  /// @brief `insert`, replacing the gradient under `id` if there is one (a view re-seated, or a
  /// value copied into storage the entry keeps: a loop that gives the same ids again allocates
  /// nothing). Strong guarantee: on a throw the previous gradient stays.
  template <class X>
  void insert_or_assign(std::string_view id, X&& value) {
    if constexpr (detail::gradient_input<B, X>) {
      detail::visit_input<B>([&]<class A>(A&& alternative) { insert_alternative(id, std::forward<A>(alternative)); },
                             detail::as_alternative<B>(id, std::forward<X>(value)));
    } else {
      detail::reject_input<B, X>();
    }
  }

  /// @brief The owned tensor of element type T under `id`; null when absent, of another
  /// element type, or a view.
  template <class T>
  [[nodiscard]] const tensor<T>* get(std::string_view id) const noexcept {
    const auto position = find(id);
    return position ? std::get_if<tensor<T>>(&entries_[*position].value) : nullptr;
  }
  template <class T>
  [[nodiscard]] tensor<T>* get(std::string_view id) noexcept {
    const auto position = find(id);
    return position ? std::get_if<tensor<T>>(&entries_[*position].value) : nullptr;
  }

  /// @brief The gradient under `id` whatever its type; null when absent.
  /// Whether `value` is a view, whose shape and device stay as inserted.
  static bool is_view(const value_type& value) noexcept { return value.index() >= B::element_types::size; }

  [[nodiscard]] const value_type* find_value(std::string_view id) const noexcept {
    const auto position = find(id);
    return position ? &entries_[*position].value : nullptr;
  }

  /// @brief The owned tensor of element type T of the `index`-th entry (in `begin()` order),
  /// reached without hashing its id; null when of another element type or a view.
  /// Precondition: `index < size()`.
  template <class T>
  [[nodiscard]] tensor<T>* get_at(std::size_t index) noexcept {
    return std::get_if<tensor<T>>(&entries_[index].value);
  }

  /// @brief The dtype of the gradient under `id`, if present.
  [[nodiscard]] std::optional<float_dtype> dtype(std::string_view id) const noexcept {
    const value_type* value = find_value(id);
    if (!value) return std::nullopt;
    return dtype_of_value(*value);
  }

  /// @brief Removes the gradient under `id`; returns whether there was one.
  bool erase(std::string_view id) noexcept {
    const auto position = find(id);
    if (!position) return false;
    owned_ -= is_view(entries_[*position].value) ? 0 : 1;
    entries_.erase(*position);
    index_.rebuild(entries_.size(), key_of());
    return true;
  }

  void clear() noexcept {
    entries_.clear();
    index_.clear();
    owned_ = 0;
  }

  [[nodiscard]] bool contains(std::string_view id) const noexcept { return find(id).has_value(); }
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  [[nodiscard]] bool empty() const noexcept { return entries_.empty(); }
  /// @brief How many gradients are owned tensors (the rest are views).
  [[nodiscard]] std::size_t owned_count() const noexcept { return owned_; }
  [[nodiscard]] auto begin() const noexcept { return entries_.cbegin(); }
  [[nodiscard]] auto end() const noexcept { return entries_.cend(); }

  /// @brief Checks that every id is a parameter of `params` with the same shape and device.
  /// @throws error(errc::unknown_parameters) or error(errc::parameter_mismatch), naming the id.
  void validate_for(const parameter_set<B>& params) const {
    std::size_t hint = 0;
    for (const entry& e : entries_) {
      hint = detail::resolve(params, e.id, e.value, hint) + 1;
    }
  }

  /// @brief Row-major record of every gradient, sorted by id.
  [[nodiscard]] gradients_params_record to_record() const
    requires serializable_backend<B>
  {
    const std::vector<const entry*> sorted = sorted_entries();
    gradients_params_record record;
    record.tensors.reserve(sorted.size());
    for (const entry* e : sorted) {
      detail::visit_gradient([&](const auto& value) { record.tensors.push_back(record_of(e->id, value)); }, e->value);
    }
    return record;
  }

  /// @brief Rebuilds gradients from a record, on the devices of `params`.
  /// @throws error(errc::invalid_record) for a malformed record, error(errc::unknown_parameters)
  /// for an id outside `params`, error(errc::parameter_mismatch) for a shape that differs, and
  /// error(errc::invalid_dtype) for a dtype the backend has no element type for.
  [[nodiscard]] static gradients_params from_record(const parameter_set<B>& params,
                                                    const gradients_params_record& record)
    requires serializable_backend<B>
  {
    validate(record);
    gradients_params restored;
    restored.reserve(record.tensors.size());
    for (const tensor_record& t : record.tensors) {
      const auto& param = params[check_against(params, t.id, t.dtype, detail::record_shape(t))];
      restored.emplace_from(t.id, t.dtype, param.shape, param.device, t.values);
    }
    return restored;
  }

  /// @brief The dtype of a stored gradient.
  static float_dtype dtype_of_value(const value_type& value) noexcept {
    // Alternatives are the tensors of every element type, then (if any) their views.
    constexpr auto dtypes = detail::dtypes_of(typename B::element_types{});
    return dtypes[value.index() % dtypes.size()];
  }

 private:
  /// Tensors are stored as they are; views inside a re-seatable slot.
  template <class X>
  using stored_type = std::conditional_t<std::is_same_v<X, tensor<detail::element_of<B, X>>>, X, detail::view_slot<X>>;

  std::optional<std::size_t> find(std::string_view id) const noexcept { return index_.find(id, key_of()); }

  auto key_of() const noexcept {
    return [this](std::size_t position) -> std::string_view { return entries_[position].id; };
  }

  /// Stores a copy of the storage `value.view` spans under `id`, read through the same strides,
  /// in the entry's own storage when it has room and no copy of the container shares it;
  /// strong guarantee (everything that may throw comes before the first write).
  template <class T>
  void insert_copy(std::string_view id, const copied_view<T>& value) {
    using view = strided_view<const T>;
    using stored = detail::view_slot<view>;
    const view& from = value.view;
    // The elements the strides reach: [low, high] around data(); every element when they are
    // a plain object's own.
    std::ptrdiff_t low = 0;
    std::ptrdiff_t high = 0;
    for (std::size_t axis = 0; axis < from.shape().rank(); ++axis) {
      const std::ptrdiff_t reach = from.strides()[axis] * static_cast<std::ptrdiff_t>(from.shape()[axis] - 1);
      (reach < 0 ? low : high) += reach;
    }
    const std::size_t bytes = from.size() == 0 ? 0 : static_cast<std::size_t>(high - low + 1) * sizeof(T);
    const std::size_t parameter = params_ ? detail::resolve(*params_, id, from, 0) : 0;
    const auto position = find(id);
    entry* const present = position ? &entries_[*position] : nullptr;
    std::shared_ptr<std::byte[]> copy;
    std::size_t capacity = std::max<std::size_t>(bytes, 1);
    if (present && present->copy.use_count() == 1 && present->copy_bytes >= bytes) {
      copy = present->copy;  // written below, once nothing can throw
      capacity = present->copy_bytes;
    } else {
      copy = std::shared_ptr<std::byte[]>(new std::byte[capacity]);
    }
    const auto copied = [&] {
      if (bytes != 0) std::memcpy(copy.get(), from.data() + low, bytes);
      return view(reinterpret_cast<const T*>(copy.get()) - low, from.shape(), from.strides());
    };
    if (present) {
      owned_ -= is_view(present->value) ? 0 : 1;
      present->value.template emplace<stored>(copied());
      present->adds = &detail::adds_of<B, stored>;
      present->position = parameter;
    } else {
      reserve(entries_.size() + 1);
      entries_.emplace_back_with([&](void* node) {
        ::new (node) entry{std::string(id),
                           value_type(std::in_place_type<stored>, copied()),
                           parameter,
                           nullptr,
                           0,
                           &detail::adds_of<B, stored>};
      });
      index_.insert(entries_.size() - 1, entries_.back().id);
    }
    entry& e = present ? *present : entries_.back();
    e.copy = std::move(copy);
    e.copy_bytes = capacity;
  }

  /// Stores one tensor or view of B under `id` (see `insert`), with the strong guarantee.
  template <class A>
  void insert_alternative(std::string_view id, A&& value) {
    if constexpr (detail::is_copied_view_of<B, std::remove_cvref_t<A>>::value) {
      insert_copy(id, value);
    } else {
      insert_tensor_or_view(id, std::forward<A>(value));
    }
  }
  template <class A>
  void insert_tensor_or_view(std::string_view id, A&& value) {
    using stored = stored_type<std::remove_cvref_t<A>>;
    const auto position = find(id);
    if constexpr (!std::is_same_v<stored, std::remove_cvref_t<A>>) {
      if (position) {  // a view re-seats its slot: nothing allocates
        value_type replacement(std::in_place_type<stored>, std::forward<A>(value));
        // The alternative as its type: resolving the variant would compile a check per alternative.
        const std::size_t parameter =
            params_ ? detail::resolve(*params_, id, detail::unwrap(*std::get_if<stored>(&replacement)), 0) : 0;
        owned_ -= is_view(entries_[*position].value) ? 0 : 1;
        entries_[*position].value = std::move(replacement);
        entries_[*position].adds = &detail::adds_of<B, stored>;
        entries_[*position].position = parameter;
        return;
      }
    }
    reserve(entries_.size() + 1);  // a spare node: for a new entry, or beside the one replaced
    const auto construct = [&](void* node) {
      entry* made = construct_entry<stored>(node, std::string(id), std::forward<A>(value));
      if (params_) {
        try {
          made->position = detail::resolve(*params_, id, detail::unwrap(*std::get_if<stored>(&made->value)), 0);
        } catch (...) {
          std::destroy_at(made);
          throw;
        }
      }
    };
    constexpr std::size_t owned = std::is_same_v<stored, std::remove_cvref_t<A>> ? 1 : 0;
    if (position) {
      const std::size_t replaced = is_view(entries_[*position].value) ? 0 : 1;
      entries_.replace_with(*position, construct);  // the old entry stays whole if this throws
      owned_ = owned_ - replaced + owned;
      return;
    }
    entries_.emplace_back_with(construct);
    index_.insert(entries_.size() - 1, entries_.back().id);
    owned_ += owned;
  }

  void reserve(std::size_t count);

  /// Constructs the entry (`id`, `value`) at `node` and returns it. A tensor is moved in only
  /// where that cannot allocate, else copied (see `detail::moves_without_allocating`): its move
  /// is declared noexcept, so an allocation failing inside it would terminate.
  template <class Stored, class X>
  static entry* construct_entry(void* node, std::string&& id, X&& value) {
    if constexpr (std::is_same_v<Stored, std::remove_cvref_t<X>> && !std::is_lvalue_reference_v<X>) {
      if (!detail::moves_without_allocating<B>(value)) {
        return ::new (node) entry{std::move(id),
                                  value_type(std::in_place_type<Stored>, std::as_const(value)),
                                  0,
                                  nullptr,
                                  0,
                                  &detail::adds_of<B, Stored>};
      }
    }
    return ::new (node) entry{std::move(id),
                              value_type(std::in_place_type<Stored>, std::forward<X>(value)),
                              0,
                              nullptr,
                              0,
                              &detail::adds_of<B, Stored>};
  }

  /// Appends (`id`, a tensor of `shape` holding a record's row-major `values`), within reserved
  /// capacity (see `reserve`).
  void emplace_from(const std::string& id, float_dtype dtype, const tensor_shape& shape,
                    const typename B::device_type& device, const record_values& values) {
    detail::for_each_type<typename B::element_types>([&]<class T>() {
      if (dtype_of<T> != dtype) return;
      const auto emplace = [&](tensor<T>&& made) {
        entries_.emplace_back_with(
            [&](void* node) { construct_entry<tensor<T>>(node, std::string(id), std::move(made)); });
      };
      if constexpr (sizeof(T) == 2) {
        const auto& bits = std::get<std::vector<std::uint16_t>>(values);
        std::vector<T> elements(bits.size());
        std::transform(bits.begin(), bits.end(), elements.begin(), [](std::uint16_t b) { return std::bit_cast<T>(b); });
        emplace(B::template from_row_major<T>(std::span<const T>(elements), shape, device));
      } else {
        emplace(B::template from_row_major<T>(std::span<const T>(std::get<std::vector<T>>(values)), shape, device));
      }
    });
    index_.insert(entries_.size() - 1, entries_.back().id);
    ++owned_;
  }

  /// Position of a record tensor's parameter, checking shape and dtype.
  static std::size_t check_against(const parameter_set<B>& params, const std::string& id, float_dtype dtype,
                                   const tensor_shape& shape) {
    const auto position = params.find(id);
    if (!position) {
      detail::fail(errc::unknown_parameters, {"record tensor '", id, "' names no parameter of the parameter set."}, id);
    }
    if (!detail::same_shape<B>(shape, params[*position].shape)) {
      detail::fail(errc::parameter_mismatch,
                   {"record tensor '", id, "' has shape ", shape.dims(), " but its parameter has shape ",
                    params[*position].shape.dims(), "."},
                   id);
    }
    if (!supports(dtype)) {
      detail::fail(
          errc::invalid_dtype,
          {"record tensor '", id, "' has dtype ", to_string(dtype), ", which this backend has no element type for."},
          id);
    }
    return *position;
  }

  static bool supports(float_dtype dtype) noexcept {
    bool found = false;
    detail::for_each_type<typename B::element_types>([&]<class T>() { found |= dtype_of<T> == dtype; });
    return found;
  }

  /// The record of one gradient, with the gradient's own shape (a view is not copied into a tensor
  /// first when it is a `strided_view`, which writes row-major values itself).
  template <class X>
  static tensor_record record_of(const std::string& id, const X& value) {
    using T = detail::element_of<B, X>;
    tensor_record record{id, dtype_of<T>, {}, {}};
    const tensor_shape shape = B::shape(value);
    record.shape.assign(shape.begin(), shape.end());
    std::vector<T> elements(*shape.checked_element_count());
    if constexpr (std::is_same_v<X, strided_view<const T>>) {
      copy_row_major(value, std::span<T>(elements));
    } else if constexpr (std::is_same_v<X, tensor<T>>) {
      B::to_row_major(value, std::span<T>(elements));
    } else {
      B::to_row_major(B::template convert<T>(value), std::span<T>(elements));
    }
    if constexpr (sizeof(T) == 2) {
      std::vector<std::uint16_t> bits(elements.size());
      std::transform(elements.begin(), elements.end(), bits.begin(),
                     [](T x) { return std::bit_cast<std::uint16_t>(x); });
      record.values = std::move(bits);
    } else {
      record.values = std::move(elements);
    }
    return record;
  }

  /// Entries sorted by id: the order of records.
  std::vector<const entry*> sorted_entries() const {
    std::vector<const entry*> sorted;
    sorted.reserve(entries_.size());
    for (const entry& e : entries_) sorted.push_back(&e);
    std::sort(sorted.begin(), sorted.end(), [](const entry* a, const entry* b) { return a->id < b->id; });
    return sorted;
  }

  detail::stable_vector<entry> entries_;  // never moves a tensor when it grows
  detail::id_index index_;
  const parameter_set<B>* params_ = nullptr;  // the set ids are resolved against at insert, if any
  std::uint64_t params_identity_ = 0;
  std::size_t owned_ = 0;  // entries holding a tensor, not a view: checked again on every call
};

// Defined outside the class, so that `GRADACCUM_EXTERN_TEMPLATES` keeps it out of the caller's file.
template <class B>
void gradients_params<B>::reserve(std::size_t count) {
  detail::reserve_geometric(entries_, count);
  index_.reserve(count, key_of());
}

}  // namespace gradaccum
