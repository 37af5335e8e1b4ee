#pragma once
/// @file
/// @brief A compile-time list of element types, used by backends to declare what they support.

#include <cstddef>
#include <type_traits>

namespace gradaccum {

/// @brief The element types a backend supports, e.g. `type_list<float, double>`.
template <class... Ts>
struct type_list {
  static constexpr std::size_t size = sizeof...(Ts);
};

namespace detail {

template <class T, class List>
struct list_contains;
template <class T, class... Ts>
struct list_contains<T, type_list<Ts...>> : std::bool_constant<(std::is_same_v<T, Ts> || ...)> {};

template <class List, class F>
struct for_each_type_impl;
template <class... Ts, class F>
struct for_each_type_impl<type_list<Ts...>, F> {
  static constexpr void run(F& f) { (f.template operator()<Ts>(), ...); }
};

/// Calls `f.template operator()<T>()` for every T of the list, in order.
template <class List, class F>
constexpr void for_each_type(F&& f) {
  for_each_type_impl<List, std::remove_reference_t<F>>::run(f);
}

template <class List>
struct list_all;
template <class... Ts>
struct list_all<type_list<Ts...>> {
  template <template <class> class Pred>
  static constexpr bool value = (Pred<Ts>::value && ...);
};

}  // namespace detail
}  // namespace gradaccum
