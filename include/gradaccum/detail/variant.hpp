#pragma once
/// @file
/// @brief The variant that holds one gradient of any supported element type, owned or viewed.

#include <array>
#include <memory>
#include <type_traits>
#include <utility>
#include <variant>

#include "gradaccum/backend.hpp"
#include "gradaccum/type_list.hpp"

namespace gradaccum::detail {

/// Holds a view. Views of caller memory (such as `Eigen::Map`) are often not assignable;
/// this re-seats instead, so the variant that holds them stays a regular type.
template <class V>
struct view_slot {
  V view;

  explicit view_slot(V v) noexcept(std::is_nothrow_move_constructible_v<V>) : view(std::move(v)) {}
  view_slot(const view_slot&) = default;
  view_slot(view_slot&&) noexcept = default;
  view_slot& operator=(const view_slot& other) noexcept(std::is_nothrow_copy_constructible_v<V>) {
    if (this != &other) {
      std::destroy_at(&view);
      std::construct_at(&view, other.view);
    }
    return *this;
  }
  view_slot& operator=(view_slot&& other) noexcept { return *this = static_cast<const view_slot&>(other); }
  ~view_slot() = default;
};

template <class X>
constexpr const X& unwrap(const X& x) noexcept {
  return x;
}
template <class V>
constexpr const V& unwrap(const view_slot<V>& slot) noexcept {
  return slot.view;
}

/// Calls `f` with the tensor or view held by `value` (never with the slot wrapping a view).
template <class F, class Variant>
decltype(auto) visit_gradient(F&& f, const Variant& value) {
  return std::visit([&](const auto& alternative) -> decltype(auto) { return f(unwrap(alternative)); }, value);
}

template <class B, class List, bool Views = has_views<B>>
struct gradient_variant;
template <class B, class... Ts>
struct gradient_variant<B, type_list<Ts...>, false> {
  using type = std::variant<typename B::template tensor<Ts>...>;
};
template <class B, class... Ts>
struct gradient_variant<B, type_list<Ts...>, true> {
  using type = std::variant<typename B::template tensor<Ts>..., view_slot<typename B::template view<Ts>>...>;
};

/// Owned tensors of every element type, then (if the backend has them) views of every type.
template <class B>
using gradient_variant_t = typename gradient_variant<B, typename B::element_types>::type;

template <class B, class X, class List>
struct element_of_impl {
  using type = void;
};
template <class B, class X, class T, class... Ts>
struct element_of_impl<B, X, type_list<T, Ts...>> {
  static constexpr bool matches = [] {
    if constexpr (has_views<B>) {
      return std::is_same_v<X, typename B::template tensor<T>> || std::is_same_v<X, typename B::template view<T>>;
    } else {
      return std::is_same_v<X, typename B::template tensor<T>>;
    }
  }();
  using type = std::conditional_t<matches, T, typename element_of_impl<B, X, type_list<Ts...>>::type>;
};

/// The element type of a gradient alternative X (a tensor<T> or view<T> of B), else void.
template <class B, class X>
using element_of = typename element_of_impl<B, std::remove_cvref_t<X>, typename B::element_types>::type;

template <class B, class X>
concept is_gradient_alternative = !std::is_void_v<element_of<B, X>>;

/// The dtypes of a list of element types, in order.
template <class... Ts>
constexpr std::array<float_dtype, sizeof...(Ts)> dtypes_of(type_list<Ts...> /*types*/) noexcept {
  return {dtype_of<Ts>...};
}

/// The backend element type whose dtype is `D`, else void.
template <class List, float_dtype D>
struct element_with_dtype {
  using type = void;
};
template <class T, class... Ts, float_dtype D>
struct element_with_dtype<type_list<T, Ts...>, D> {
  using type = std::conditional_t<dtype_of<T> == D, T, typename element_with_dtype<type_list<Ts...>, D>::type>;
};

}  // namespace gradaccum::detail
