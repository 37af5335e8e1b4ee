#pragma once
/// @file
/// @brief What goes in as a parameter or gradient: `gradients_params::insert` and
/// `parameter_set::add` take any `X` for which `gradient_input<B, X>` holds, as
/// `as_alternative<B>(id, x)`: a `tensor<T>` or `view<T>` of B. In this order:
///
/// 1. a `tensor<T>` or `view<T>` of B, as it is;
/// 2. what the backend's optional `static auto adapt(X&&)` returns (its own library's objects:
///    blocks, other layouts, expressions). A library whose tensors carry their element type at
///    run time (libtorch) returns a `std::variant` of B's tensors or views instead: the element
///    type is chosen once, here, and stored as that alternative;
/// 3. for an lvalue, a `view<T>` it converts to (read in place); then a `tensor<T>` it converts
///    to (a derived type, an expression the tensor type is built from; evaluated here). An
///    rvalue tries the tensor first: a view of a temporary would dangle.
///
/// `adapt` may also return a `copied_view<T>` (the built-in backends do for an object that owns
/// its storage given as an lvalue): the values are copied at insert into storage the entry
/// keeps, since nothing tells such an lvalue from a temporary that `setOnes()` returned by
/// reference. `gradaccum::view(x)` asks for x to be read in place instead.
///
/// T is X's own element type when X names one (`Scalar`, `value_type` or `elem_type`), so a
/// conversion never changes element types. Anything else gets one static_assert that names
/// the way out (`reject_input`).

#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

#include "gradaccum/backend.hpp"
#include "gradaccum/detail/variant.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/strided_view.hpp"
#include "gradaccum/type_list.hpp"

namespace gradaccum::detail {

template <class B, class A>
struct is_copied_view_of : std::false_type {};
template <class B, class T>
struct is_copied_view_of<B, copied_view<T>>
    : std::bool_constant<has_views<B> && std::is_same_v<typename B::template view<T>, strided_view<const T>>> {};

template <class X>
struct in_place_object : std::false_type {};
template <class X>
struct in_place_object<in_place<X>> : std::true_type {
  using type = X;
};

template <class X>
struct declared_element {
  using type = void;
};
template <class X>
  requires requires { typename X::Scalar; }
struct declared_element<X> {
  using type = typename X::Scalar;
};
template <class X>
  requires(
      !requires { typename X::Scalar; } && requires { typename X::value_type; })
struct declared_element<X> {
  using type = typename X::value_type;
};
template <class X>
  requires(
      !requires { typename X::Scalar; } && !requires { typename X::value_type; } && requires { typename X::elem_type; })
struct declared_element<X> {
  using type = typename X::elem_type;
};

/// The element types X may convert to: its own if it names one, else all of B's.
template <class B, class X, class E = typename declared_element<std::remove_cvref_t<X>>::type>
using candidate_elements = std::conditional_t<
    std::is_void_v<E>, typename B::element_types,
    std::conditional_t<list_contains<E, typename B::element_types>::value, type_list<E>, type_list<>>>;

template <class A, class B>
concept alternative_of = is_gradient_alternative<B, A> || is_copied_view_of<B, std::remove_cvref_t<A>>::value;

template <class B, class X>
concept has_adapt = requires(X&& x) {
  { B::adapt(std::forward<X>(x)) } -> alternative_of<B>;
};

template <class V, class B>
struct runtime_choice : std::false_type {};
template <class B, class... As>
struct runtime_choice<std::variant<As...>, B> : std::bool_constant<(is_gradient_alternative<B, As> && ...)> {};

/// A `std::variant` of B's tensors or views: the alternative chosen at run time (rule 2).
template <class A, class B>
concept runtime_alternative_of = runtime_choice<A, B>::value;

template <class B, class X>
concept has_runtime_adapt = requires(X&& x) {
  { B::adapt(std::forward<X>(x)) } -> runtime_alternative_of<B>;
};

template <class B, class T, bool View>
struct target_type {
  using type = typename B::template tensor<T>;
};
template <class B, class T>
struct target_type<B, T, true> {
  using type = typename B::template view<T>;
};

template <class B, class X, bool View, class List>
struct conversion_target {
  using type = void;
};
template <class B, class X, bool View, class T, class... Ts>
struct conversion_target<B, X, View, type_list<T, Ts...>> {
  static constexpr bool converts = [] {
    if constexpr (View && has_views<B>) {
      return std::is_convertible_v<X, typename B::template view<T>>;
    } else if constexpr (!View) {
      return std::is_convertible_v<X, typename B::template tensor<T>>;
    } else {
      return false;
    }
  }();
  using type = typename std::conditional_t<converts, target_type<B, T, View>,
                                           conversion_target<B, X, View, type_list<Ts...>>>::type;
};

/// The view or tensor type X converts to (rule 3), else void.
template <class B, class X, class Elements = candidate_elements<B, X>,
          class View = typename conversion_target<B, X, true, Elements>::type,
          class Tensor = typename conversion_target<B, X, false, Elements>::type>
using converted_type =
    std::conditional_t<std::is_lvalue_reference_v<X>, std::conditional_t<std::is_void_v<View>, Tensor, View>,
                       std::conditional_t<std::is_void_v<Tensor>, View, Tensor>>;

/// @brief Whether `X` (a forwarding reference type) can be a parameter or gradient of B.
template <class B, class X>
concept plain_gradient_input = is_gradient_alternative<B, X> || has_adapt<B, X> || has_runtime_adapt<B, X> ||
                               !std::is_void_v<converted_type<B, X>>;

/// The tensor or view that `x` goes in as (see the file comment).
template <class B, class X>
  requires plain_gradient_input<B, X>
decltype(auto) plain_alternative(X&& x) {
  if constexpr (is_gradient_alternative<B, X>) {
    return std::forward<X>(x);
  } else if constexpr (has_adapt<B, X> || has_runtime_adapt<B, X>) {
    return B::adapt(std::forward<X>(x));
  } else {
    return converted_type<B, X>(std::forward<X>(x));
  }
}

/// The view of `gradaccum::view(x)`'s object: what `adapt` makes of it, uncopied, or the
/// `view<T>` it converts to; void when it has none (an expression, or a backend without views).
template <class B, class X>
auto in_place_view(const X& x) {
  if constexpr (has_views<B> && requires { B::adapt(x); }) {
    using A = std::remove_cvref_t<decltype(B::adapt(x))>;
    if constexpr (is_copied_view_of<B, A>::value) {
      return B::adapt(x).view;
    } else if constexpr (!std::is_void_v<element_of<B, A>> &&
                         std::is_same_v<A, typename B::template view<element_of<B, A>>>) {
      return B::adapt(x);
    }
  } else if constexpr (has_views<B>) {
    using V = typename conversion_target<B, const X&, true, candidate_elements<B, X>>::type;
    if constexpr (!std::is_void_v<V>) return V(x);
  }
}

template <class B, class X>
concept in_place_input = in_place_object<std::remove_cvref_t<X>>::value &&
                         !std::is_void_v<decltype(in_place_view<B>(
                             std::declval<const typename in_place_object<std::remove_cvref_t<X>>::type&>()))>;

/// @brief Whether `X` (a forwarding reference type) can be a parameter or gradient of B.
template <class B, class X>
concept gradient_input = plain_gradient_input<B, X> || in_place_input<B, X>;

/// The tensor or view that `x` goes in as (see the file comment).
template <class B, class X>
  requires gradient_input<B, X>
decltype(auto) to_alternative(X&& x) {
  if constexpr (in_place_input<B, X>) {
    return in_place_view<B>(x.object);
  } else {
    return plain_alternative<B>(std::forward<X>(x));
  }
}

/// The view inside a `copied_view`, else `x`: what a parameter's shape and device are read from.
template <class X>
constexpr const X& uncopied(const X& x) noexcept {
  return x;
}
template <class T>
constexpr const strided_view<const T>& uncopied(const copied_view<T>& x) noexcept {
  return x.view;
}

/// `to_alternative`, with the backend's refusals named after `id`: a shape it cannot represent (a
/// rank above `max_rank`) as `parameter_mismatch`, any other error that names no parameter
/// (an element type `adapt` refuses, say) with its own code.
template <class B, class X>
  requires gradient_input<B, X>
decltype(auto) as_alternative(std::string_view id, X&& x) {
  try {
    return to_alternative<B>(std::forward<X>(x));
  } catch (const error& problem) {
    if (problem.code() != errc::invalid_record && !problem.param_id().empty()) throw;
    fail(problem.code() == errc::invalid_record ? errc::parameter_mismatch : problem.code(),
         {"tensor '", id, "' cannot be used: ", problem.what()}, id);
  }
}

/// Calls `f` with the tensor or view `input` is: itself, or the alternative a run-time `adapt`
/// chose (rule 2).
template <class B, class F, class A>
decltype(auto) visit_input(F&& f, A&& input) {
  if constexpr (runtime_alternative_of<std::remove_cvref_t<A>, B>) {
    return std::visit(std::forward<F>(f), std::forward<A>(input));
  } else {
    return std::forward<F>(f)(std::forward<A>(input));
  }
}

/// The type `x` is stored as.
template <class B, class X>
using alternative_t = std::remove_cvref_t<decltype(to_alternative<B>(std::declval<X>()))>;

template <class X>
inline constexpr bool refused_input = false;

/// The one diagnostic for a type that cannot go in; the instantiation note names X.
template <class B, class X>
void reject_input() {
  static_assert(!in_place_object<std::remove_cvref_t<X>>::value,
                "gradaccum::view(x): x has no storage that the backend can read in place (an expression, or a "
                "backend without views); insert x itself to have it evaluated or copied");
  static_assert(in_place_object<std::remove_cvref_t<X>>::value || refused_input<X>,
                "gradaccum: this type cannot be a parameter or gradient of the backend (see X in the note "
                "below): evaluate it into the backend's tensor<T> (T one of its element_types), or make it "
                "convertible to the backend's view<T> or tensor<T>, or give the backend a "
                "`static auto adapt(X&&)` that returns one");
}

}  // namespace gradaccum::detail
