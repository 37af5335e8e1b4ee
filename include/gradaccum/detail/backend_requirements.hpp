#pragma once
/// @file
/// @brief The requirements `tensor_backend` and `serializable_backend` (`<gradaccum/backend.hpp>`)
/// are made of, one concept per member a backend declares.

#include <concepts>
#include <span>
#include <type_traits>

#include "gradaccum/dtype.hpp"
#include "gradaccum/shape.hpp"
#include "gradaccum/type_list.hpp"

namespace gradaccum::detail {

template <class B>
concept has_views = requires { typename B::template view<float>; };

/// Whether B keeps windows on its devices (`<gradaccum/device_buffers.hpp>`).
template <class B>
concept has_buffers = requires { typename B::template buffer<float>; };

template <class B>
concept has_backend_types = requires {
  typename B::device_type;
  typename B::element_types;
  typename B::template tensor<float>;
  typename B::template tensor<double>;
};

/// How a gradient X is added: into a span of the host buffer, or for a backend with device
/// buffers into one of those (`<gradaccum/device_buffers.hpp>`).
template <class B, class X>
concept host_add = requires(const X& g, std::span<float> acc32, std::span<double> acc64) {
  { B::add_scaled(acc32, g, 1.0F) } noexcept;
  { B::add_scaled(acc64, g, 1.0) } noexcept;
};
template <class B, class X>
concept device_add =
    requires(const X& g, typename B::template buffer<float>& b32, typename B::template buffer<double>& b64) {
      { B::add_scaled(b32, std::size_t{}, g, 1.0F) } noexcept;
      { B::add_scaled(b64, std::size_t{}, g, 1.0) } noexcept;
    };

/// What the library does with an incoming gradient of type X (a tensor or a view).
template <class B, class X>
concept backend_input = requires(const X& g) {
  { B::shape(g) } -> std::same_as<tensor_shape>;
  { B::device(g) } -> std::convertible_to<typename B::device_type>;
  { B::template convert<float>(g) } -> std::same_as<typename B::template tensor<float>>;
  { B::template convert<double>(g) } -> std::same_as<typename B::template tensor<double>>;
} && ((!has_buffers<B> && host_add<B, X>) || (has_buffers<B> && device_add<B, X>));

/// How the library shows a segment of work type W.
template <class B, class W>
concept backend_work =
    has_buffers<B> || requires(std::span<const W> values, const tensor_shape& shape,
                               const typename B::device_type& device) { B::template map<W>(values, shape, device); };

template <class B, class T>
struct element_supported : std::bool_constant<element_type<T> && backend_input<B, typename B::template tensor<T>> &&
                                              std::copyable<typename B::template tensor<T>>> {};

template <class B, class List>
struct all_elements_supported;
template <class B, class... Ts>
struct all_elements_supported<B, type_list<Ts...>>
    : std::bool_constant<(element_supported<B, Ts>::value && ...) && list_contains<float, type_list<Ts...>>::value &&
                         list_contains<double, type_list<Ts...>>::value> {};

template <class B, class List>
struct all_views_supported;
template <class B, class... Ts>
struct all_views_supported<B, type_list<Ts...>>
    : std::bool_constant<(backend_input<B, typename B::template view<Ts>> && ...)> {};

template <class B, class T>
concept row_major_io = requires(const typename B::template tensor<T>& t, std::span<T> out, std::span<const T> in,
                                const tensor_shape& shape, const typename B::device_type& device) {
  B::to_row_major(t, out);
  { B::template from_row_major<T>(in, shape, device) } -> std::same_as<typename B::template tensor<T>>;
};

template <class B, class List>
struct all_row_major_io;
template <class B, class... Ts>
struct all_row_major_io<B, type_list<Ts...>> : std::bool_constant<(row_major_io<B, Ts> && ...)> {};

}  // namespace gradaccum::detail
