#pragma once
/// @file
/// @brief `gradients_params<B>`: the gradients present for a microbatch, keyed by parameter id.

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "gradaccum/backend.hpp"
#include "gradaccum/detail/id_index.hpp"
#include "gradaccum/detail/variant.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/records.hpp"

namespace gradaccum {

template <class B>
class gradients_params;

namespace detail {

template <class B>
[[noreturn]] void fail_unknown(std::string_view id) {
  fail(errc::unknown_parameters, "gradient '" + std::string(id) + "' names no parameter of the parameter set.",
       std::string(id));
}

/// Checks that the gradient `id` has the shape and device of `param`; throws parameter_mismatch.
template <class B, class X>
void check_geometry(const typename parameter_set<B>::parameter& param, std::string_view id, const X& value) {
  if (!has_shape<B>(value, param.shape, id)) {
    fail(errc::parameter_mismatch,
         "gradient '" + std::string(id) + "' has shape " + shape_of<B>(value, id).to_string() +
             " but its parameter has shape " + param.shape.to_string() + ".",
         std::string(id));
  }
  if (!(B::device(value) == param.device)) {
    fail(errc::parameter_mismatch, "gradient '" + std::string(id) + "' is on another device than its parameter.",
         std::string(id));
  }
}

/// Position of `id` in `params`, checking geometry; throws unknown_parameters or parameter_mismatch.
template <class B, class X>
std::size_t resolve(const parameter_set<B>& params, std::string_view id, const X& value, std::size_t hint) {
  const auto position = params.find(id, hint);
  if (!position) fail_unknown<B>(id);
  check_geometry<B>(params[*position], id, value);
  return *position;
}

// The two helpers below name B's optional checkpoint functions only inside templates of their
// own: in a generic lambda of a class template, clang checks `B::member` once B is known.

/// `B::row_major_data(t)` where the backend lends its storage (`lends_row_major`), else null.
template <class B, class T>
const T* lent_row_major(const typename B::template tensor<T>& t) noexcept {
  if constexpr (lends_row_major<B, T>) {
    return B::row_major_data(t);
  } else {
    return nullptr;
  }
}

/// Creates a tensor of `shape`, has `values.into(std::span<T>)` write its row-major values
/// straight into its storage and hands it to `store`, where the backend lends its storage;
/// returns whether it did. Where the layout is not row-major the tensor is dropped untouched:
/// cheap, and backends need not expose their layout rules.
template <class B, class T, class Values, class Store>
bool fill_in_place(const tensor_shape& shape, const typename B::device_type& device, const Values& values,
                   Store&& store) {
  if constexpr (lends_row_major<B, T>) {
    auto created = B::template uninitialized<T>(shape, device);
    if (T* data = B::row_major_data(created)) {
      values.into(std::span<T>(data, *shape.checked_element_count()));
      std::forward<Store>(store)(std::move(created));
      return true;
    }
  }
  return false;
}

template <float_dtype D, class F>
decltype(auto) with_work_type(F&& f) {
  return std::forward<F>(f).template operator()<work_type<D>>();
}

/// Calls `f.template operator()<W>()` with W the C++ type of work dtype `dtype`.
template <class F>
decltype(auto) visit_work_dtype(float_dtype dtype, F&& f) {
  if (dtype == float_dtype::f64) return with_work_type<float_dtype::f64>(std::forward<F>(f));
  return with_work_type<float_dtype::f32>(std::forward<F>(f));
}

inline void require_work_dtype(float_dtype dtype) {
  if (!is_work_dtype(dtype)) {
    fail(errc::invalid_dtype,
         "dtype " + std::string(to_string(dtype)) + " cannot be used for arithmetic; use F32 or F64.");
  }
}

inline void require_scalar(double value, float_dtype dtype, bool divisor) {
  const bool narrows_to_zero = dtype == float_dtype::f32 && static_cast<float>(value) == 0.0F && value != 0.0;
  if (!representable(value, dtype) || narrows_to_zero || (divisor && value == 0.0)) {
    fail(errc::invalid_scalar, std::string(divisor ? "divisor " : "multiplier ") + detail::number_text(value) +
                                   " is not representable as a " + (divisor ? "non-zero " : "") +
                                   std::string(to_string(dtype)) + " value.");
  }
}

}  // namespace detail

/// @brief Gradients present for some parameters, each a tensor (or view) of any element type
/// the backend supports. Absent means absent: nothing is invented for a missing parameter.
///
/// Entries keep insertion order; giving them in parameter order makes id resolution a single
/// string comparison each. Reused across microbatches with the same ids (views of buffers
/// rewritten in place, or values replaced by `insert`), it is resolved once per accumulator.
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
  };

  /// @brief Stores `value` (a tensor, moved or copied, or a view of caller memory) under `id`,
  /// replacing any previous gradient for `id`. Expressions must be evaluated first.
  template <class X>
    requires detail::is_gradient_alternative<B, X>
  void insert(std::string_view id, X&& value) {
    using stored = stored_type<std::remove_cvref_t<X>>;
    const auto position = find(id);
    if (position && !std::is_same_v<stored, std::remove_cvref_t<X>>) {
      // A view re-seats its slot: nothing allocates, nothing throws once it is built.
      value_type replacement(std::in_place_type<stored>, std::forward<X>(value));
      entries_[*position].value = std::move(replacement);
      values_.renew();
      return;
    }
    reserve(entries_.size() + 1);  // a spare node, for a new entry or a replacement tensor
    const auto construct = [&](void* node) { construct_entry<stored>(node, std::string(id), std::forward<X>(value)); };
    if (position) {
      // Built in a spare node first: the old entry stays whole if that throws.
      entries_.replace_with(*position, construct);
      values_.renew();
      return;
    }
    entries_.emplace_back_with(construct);
    indexed_last();
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
  [[nodiscard]] const value_type* find_value(std::string_view id) const noexcept {
    const auto position = find(id);
    return position ? &entries_[*position].value : nullptr;
  }

  /// @brief The owned tensor of element type T of the `index`-th entry (in `begin()` order),
  /// reached without hashing its id; null when of another element type or a view. Views are not
  /// handed out mutably: accumulators rely on a view changing only through `insert`.
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
    entries_.erase(*position);
    index_.rebuild(entries_.size(), key_of());
    ids_.renew();
    values_.renew();
    return true;
  }

  void clear() noexcept {
    entries_.clear();
    index_.clear();
    ids_.renew();
    values_.renew();
  }

  [[nodiscard]] bool contains(std::string_view id) const noexcept { return find(id).has_value(); }
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  [[nodiscard]] bool empty() const noexcept { return entries_.empty(); }
  [[nodiscard]] auto begin() const noexcept { return entries_.cbegin(); }
  [[nodiscard]] auto end() const noexcept { return entries_.cend(); }

  /// @brief Changes whenever an id is added or removed, never when `insert` replaces the value
  /// of an id already present: accumulators resolve ids again only when it changed, so reusing
  /// one `gradients_params` across microbatches (re-inserting the same ids) skips that work.
  [[nodiscard]] std::uint64_t ids_version() const noexcept { return ids_.value(); }

  /// @brief Checks that every id is a parameter of `params` with the same shape and device.
  /// @throws error(errc::unknown_parameters) or error(errc::parameter_mismatch), naming the id.
  void validate_for(const parameter_set<B>& params) const {
    std::size_t hint = 0;
    for (const entry& e : entries_) {
      hint = detail::visit_gradient([&](const auto& value) { return detail::resolve(params, e.id, value, hint); },
                                    e.value) +
             1;
    }
  }

  /// @brief Validated copy with every gradient converted to work dtype `dtype`.
  [[nodiscard]] gradients_params cast_for(const parameter_set<B>& params, float_dtype dtype) const {
    return transformed_for(params, dtype, [](auto&) noexcept {});
  }

  /// @brief Validated copy: `g ← W(multiplier) · W(g)` in work dtype `dtype`.
  /// @throws error(errc::invalid_scalar) when `multiplier` is not representable in `dtype`.
  [[nodiscard]] gradients_params scaled_for(const parameter_set<B>& params, double multiplier,
                                            float_dtype dtype) const {
    detail::require_work_dtype(dtype);
    detail::require_scalar(multiplier, dtype, false);
    // Not noexcept: the product needs a fresh tensor (0 + m·g, the kernel's own rounding).
    return transformed_for(params, dtype, [&]<class W>(tensor<W>& t) {
      auto zero = B::template zeros<W>(B::shape(t), B::device(t));
      B::add_scaled(zero, t, static_cast<W>(multiplier));
      t = std::move(zero);
    });
  }

  /// @brief Validated copy: `g ← W(g) / W(divisor)` in work dtype `dtype`.
  /// @throws error(errc::invalid_scalar) when `divisor` is zero or not representable in `dtype`.
  [[nodiscard]] gradients_params unscaled_for(const parameter_set<B>& params, double divisor, float_dtype dtype) const {
    detail::require_work_dtype(dtype);
    detail::require_scalar(divisor, dtype, true);
    return transformed_for(params, dtype,
                           [&]<class W>(tensor<W>& t) noexcept { B::divide(t, static_cast<W>(divisor), W{1}); });
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

  /// @brief Calls `f(view)` with `to_record()` as a `detail::gradients_view` and returns what `f`
  /// returns. Values are borrowed from the tensors where the backend stores them row-major
  /// (`B::row_major_data`) and copied only otherwise, so serializing the view writes the bytes
  /// of `to_record()` without its copy. The view lives until `f` returns.
  template <class F>
  decltype(auto) visit_record(F&& f) const
    requires serializable_backend<B>
  {
    const std::vector<const entry*> sorted = sorted_entries();
    std::vector<std::array<std::uint64_t, max_rank>> shapes(sorted.size());
    std::vector<tensor_record> copies;  // the tensors whose storage cannot be lent
    copies.reserve(sorted.size());      // views point into it: never reallocated
    std::vector<detail::tensor_view> views;
    views.reserve(sorted.size());
    for (std::size_t i = 0; i < sorted.size(); ++i) {
      detail::visit_gradient(
          [&](const auto& value) {
            using X = std::remove_cvref_t<decltype(value)>;
            using T = detail::element_of<B, X>;
            if constexpr (std::is_same_v<X, tensor<T>> && sizeof(T) != 2) {
              if (const T* data = detail::lent_row_major<B, T>(value)) {
                const tensor_shape shape = B::shape(value);
                std::copy(shape.begin(), shape.end(), shapes[i].begin());
                views.push_back({sorted[i]->id, dtype_of<T>, std::span(shapes[i].data(), shape.rank()),
                                 std::span<const T>(data, *shape.checked_element_count())});
                return;
              }
            }
            copies.push_back(record_of(sorted[i]->id, value));
            views.push_back(detail::view_of(copies.back()));
          },
          sorted[i]->value);
    }
    return std::forward<F>(f)(detail::gradients_view{views});
  }

  /// @brief Builds gradients one tensor at a time with the checks of `from_record`, so a loader
  /// can read values straight into the backend's tensors.
  class builder {
   public:
    explicit builder(const parameter_set<B>& params) noexcept : params_(&params) {}

    void reserve(std::size_t count) { built_.reserve(count); }

    /// @brief Checks the tensor against the parameter set (see `from_record`) and the ids added
    /// so far, creates it on its parameter's device and has `values` write its row-major values:
    /// `values.into(std::span<T>)` straight into its storage where the backend lends it, else
    /// `values.into(std::vector<S>&)` with S the type `record_values` holds for `dtype`.
    /// `id` is moved from once the values are in.
    /// @throws error(errc::invalid_record) for an id added twice, and what `from_record` throws.
    template <class Values>
    void add(std::string&& id, float_dtype dtype, const tensor_shape& shape, const Values& values) {
      const auto& param = (*params_)[check_against(*params_, id, dtype, shape)];
      if (built_.contains(id)) detail::fail(errc::invalid_record, "record lists tensor '" + id + "' twice.", id);
      built_.reserve(built_.size() + 1);
      add_tensor_from(built_, std::move(id), dtype, param.shape, param.device, values);
    }

    [[nodiscard]] gradients_params finish() && noexcept { return std::move(built_); }

   private:
    const parameter_set<B>* params_;
    gradients_params built_;
  };

  /// @brief Rebuilds gradients from a record, on the devices of `params`.
  /// @throws error(errc::invalid_record) for a malformed record, error(errc::unknown_parameters)
  /// for an id outside `params`, error(errc::parameter_mismatch) for a shape that differs, and
  /// error(errc::invalid_dtype) for a dtype the backend has no element type for.
  [[nodiscard]] static gradients_params from_record(const parameter_set<B>& params,
                                                    const gradients_params_record& record)
    requires serializable_backend<B>
  {
    validate(record);
    builder restored(params);
    restored.reserve(record.tensors.size());
    for (const tensor_record& t : record.tensors) {
      restored.add(std::string(t.id), t.dtype, detail::record_shape(t), record_values_source{t.values});
    }
    return std::move(restored).finish();
  }

  /// @brief The dtype of a stored gradient.
  static float_dtype dtype_of_value(const value_type& value) noexcept {
    // Alternatives are the tensors of every element type, then (if any) their views.
    constexpr auto dtypes = detail::dtypes_of(typename B::element_types{});
    return dtypes[value.index() % dtypes.size()];
  }

 private:
  template <class>
  friend class gradients_accumulator;

  /// Tensors are stored as they are; views inside a re-seatable slot.
  template <class X>
  using stored_type = std::conditional_t<std::is_same_v<X, tensor<detail::element_of<B, X>>>, X, detail::view_slot<X>>;

  std::optional<std::size_t> find(std::string_view id) const noexcept { return index_.find(id, key_of()); }

  /// Changes whenever an entry does (only `get<T>` gives mutable access, to owned tensors).
  [[nodiscard]] std::uint64_t values_version() const noexcept { return values_.value(); }

  /// Whether `value` is a view: its shape and device stay as inserted.
  static bool is_view(const value_type& value) noexcept { return value.index() >= B::element_types::size; }

  auto key_of() const noexcept {
    return [this](std::size_t position) -> std::string_view { return entries_[position].id; };
  }

  void reserve(std::size_t count) {
    detail::reserve_geometric(entries_, count);
    index_.reserve(count, key_of());
  }

  /// Appends within reserved capacity (see `reserve`).
  void push_back_reserved(entry&& added) noexcept {
    entries_.push_back(std::move(added));
    indexed_last();
  }

  /// Indexes the entry just appended.
  void indexed_last() noexcept {
    index_.insert(entries_.size() - 1, entries_.back().id);
    ids_.renew();
    values_.renew();
  }

  /// Constructs the entry (`id`, `value`) at `node`, the tensor in place: moved where that
  /// cannot allocate, else copied (see `detail::moves_without_allocating`).
  template <class Stored, class X>
  static void construct_entry(void* node, std::string&& id, X&& value) {
    if constexpr (std::is_same_v<Stored, std::remove_cvref_t<X>> && !std::is_lvalue_reference_v<X>) {
      if (!detail::moves_without_allocating<B>(value)) {
        ::new (node) entry{std::move(id), value_type(std::in_place_type<Stored>, std::as_const(value))};
        return;
      }
    }
    ::new (node) entry{std::move(id), value_type(std::in_place_type<Stored>, std::forward<X>(value))};
  }

  /// Appends (`id`, `t`) within reserved capacity (see `construct_entry`).
  template <class T>
  void emplace_reserved(std::string&& id, tensor<T>&& t) {
    entries_.emplace_back_with([&](void* node) { construct_entry<tensor<T>>(node, std::move(id), std::move(t)); });
    indexed_last();
  }

  template <class F>
  gradients_params transformed_for(const parameter_set<B>& params, float_dtype dtype, F&& transform) const {
    detail::require_work_dtype(dtype);
    validate_for(params);
    gradients_params result;
    result.reserve(entries_.size());
    for (const entry& e : entries_) {
      detail::visit_work_dtype(dtype, [&]<class W>() {
        auto converted =
            detail::visit_gradient([](const auto& value) { return B::template convert<W>(value); }, e.value);
        transform(converted);
        result.emplace_reserved(std::string(e.id), std::move(converted));
      });
    }
    return result;
  }

  /// Position of a record tensor's parameter, checking shape and dtype.
  static std::size_t check_against(const parameter_set<B>& params, const std::string& id, float_dtype dtype,
                                   const tensor_shape& shape) {
    const auto position = params.find(id);
    if (!position) {
      detail::fail(errc::unknown_parameters, "record tensor '" + id + "' names no parameter of the parameter set.", id);
    }
    if (shape != params[*position].shape) {
      detail::fail(errc::parameter_mismatch,
                   "record tensor '" + id + "' has shape " + shape.to_string() + " but its parameter has shape " +
                       params[*position].shape.to_string() + ".",
                   id);
    }
    if (!supports(dtype)) {
      detail::fail(errc::invalid_dtype,
                   "record tensor '" + id + "' has dtype " + std::string(to_string(dtype)) +
                       ", which this backend has no element type for.",
                   id);
    }
    return *position;
  }

  static bool supports(float_dtype dtype) noexcept {
    bool found = false;
    detail::for_each_type<typename B::element_types>([&]<class T>() { found |= dtype_of<T> == dtype; });
    return found;
  }

  template <class X>
  static tensor_record record_of(const std::string& id, const X& value) {
    using T = detail::element_of<B, X>;
    if constexpr (!std::is_same_v<std::remove_cvref_t<X>, tensor<T>>) {
      const tensor<T> copy = B::template convert<T>(value);  // a view: copy it into an owned tensor first
      return record_of(id, copy);
    } else {
      return record_of_owned(id, value);
    }
  }

  template <class T>
  static tensor_record record_of_owned(const std::string& id, const tensor<T>& value) {
    const tensor<T>* owned = &value;
    tensor_record record{id, dtype_of<T>, {}, {}};
    const tensor_shape shape = B::shape(*owned);
    record.shape.assign(shape.begin(), shape.end());
    using stored = std::conditional_t<sizeof(T) == 2, std::uint16_t, T>;
    std::vector<stored> values(*shape.checked_element_count());
    if constexpr (sizeof(T) == 2) {
      std::vector<T> elements(values.size());
      B::to_row_major(*owned, std::span<T>(elements));
      std::transform(elements.begin(), elements.end(), values.begin(),
                     [](T x) { return std::bit_cast<std::uint16_t>(x); });
    } else {
      B::to_row_major(*owned, std::span<T>(values));
    }
    record.values = std::move(values);
    return record;
  }

  /// The values of a record tensor, for `builder::add`.
  struct record_values_source {
    const record_values& values;

    template <class S>
    void into(std::span<S> out) const {
      std::copy_n(std::get<std::vector<S>>(values).data(), out.size(), out.data());
    }
    template <class S>
    void into(std::vector<S>& out) const {
      out = std::get<std::vector<S>>(values);
    }
  };

  /// Appends (`id`, a tensor of `shape` holding `values`) to `built`, which has room for it
  /// (see `builder::add`). The tensor is made where it is kept, never moved after.
  template <class Values>
  static void add_tensor_from(gradients_params& built, std::string&& id, float_dtype dtype, const tensor_shape& shape,
                              const typename B::device_type& device, const Values& values) {
    bool added = false;
    detail::for_each_type<typename B::element_types>([&]<class T>() {
      if (dtype_of<T> != dtype || added) return;
      added = true;
      if constexpr (sizeof(T) == 2) {
        std::vector<std::uint16_t> bits;
        values.into(bits);
        std::vector<T> elements(bits.size());
        std::transform(bits.begin(), bits.end(), elements.begin(), [](std::uint16_t b) { return std::bit_cast<T>(b); });
        built.emplace_reserved(std::move(id),
                               B::template from_row_major<T>(std::span<const T>(elements), shape, device));
      } else {
        const auto store = [&](tensor<T>&& created) { built.emplace_reserved(std::move(id), std::move(created)); };
        if (detail::fill_in_place<B, T>(shape, device, values, store)) return;
        std::vector<T> row_major;
        values.into(row_major);
        built.emplace_reserved(std::move(id),
                               B::template from_row_major<T>(std::span<const T>(row_major), shape, device));
      }
    });
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
  detail::version_stamp ids_;
  detail::version_stamp values_;
};

}  // namespace gradaccum
