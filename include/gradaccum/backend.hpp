#pragma once
/// @file
/// @brief The backend contract: `tensor_backend`, `serializable_backend` and `host_memory_backend`.
///
/// A backend is a traits type; the library never names a tensor library. It must provide
/// (T ranges over `element_types`, which must contain `float` and `double`; W is float or double;
/// X is `tensor<T>` or, if the backend has views, `view<T>`):
///
/// @code
/// struct my_backend {
///   using device_type = ...;                               // equality-comparable
///   using element_types = gradaccum::type_list<float, double /*, 16-bit types */>;
///   template <class T> using tensor = ...;                 // owning, evaluated tensor
///   template <class T> using view = ...;                   // optional: read-only view of caller memory
///   static gradaccum::tensor_shape shape(const X&);
///   static device_type device(const X&);
///   template <class W> static tensor<W> zeros(const gradaccum::tensor_shape&, const device_type&);
///   static void add_scaled(tensor<W>& acc, const X& g, W scale) noexcept;   // acc += scale · W(g)
///   static void divide(tensor<W>& acc, W first, W second) noexcept;        // acc = acc / first / second
///   static bool all_finite(const tensor<W>&) noexcept;
///   template <class W> static tensor<W> convert(const X&);
///   // optional, checked on every accumulate call: whether shape(x) == s, without building it
///   static bool has_shape(const X&, const gradaccum::tensor_shape& s) noexcept;
///   // optional: whether the backend's tensors can have shape s, so that shape(zeros(s)) == s.
///   // Where it is false the library throws error(errc::parameter_mismatch) naming the parameter
///   // (parameter_set::add with explicit geometry), and zeros, from_row_major and uninitialized
///   // must throw error(errc::parameter_mismatch) rather than build a tensor of another shape.
///   static bool represents(const gradaccum::tensor_shape& s) noexcept;
///   // optional: whether moving t cannot allocate. Where it is false the library copies t
///   // into its entry instead (a move declared noexcept that allocates would terminate).
///   static bool moves_without_allocating(const tensor<T>& t) noexcept;
///   // optional: a view stores its shape and device, so they never change after it is made
///   // (lets an accumulator skip checking a gradients_params of views that did not change)
///   static constexpr bool views_keep_geometry = true;
///   // serializable_backend adds:
///   static void to_row_major(const tensor<T>&, std::span<T> out);
///   template <class T> static tensor<T> from_row_major(std::span<const T>, const gradaccum::tensor_shape&,
///                                                      const device_type&);
///   // host_memory_backend adds:
///   template <class T> static T* data(tensor<T>&) noexcept;  // the elements, contiguous, in host memory
///   // optional, for checkpoints without intermediate copies (F32 and F64):
///   template <class T> static tensor<T> uninitialized(const gradaccum::tensor_shape&, const device_type&);
///   static T* row_major_data(tensor<T>&) noexcept;             // storage if it is row-major, else null
///   static const T* row_major_data(const tensor<T>&) noexcept;
/// };
/// @endcode

#include <concepts>
#include <span>
#include <string>
#include <string_view>

#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/shape.hpp"
#include "gradaccum/type_list.hpp"

namespace gradaccum {

namespace detail {

/// Refuses a shape the backend cannot represent (see `represents` in the contract above).
/// @throws error(errc::parameter_mismatch) naming `id`.
template <class B>
void check_representable(std::string_view id, const tensor_shape& shape) {
  if constexpr (requires { B::represents(shape); }) {
    if (!B::represents(shape)) {
      fail(errc::parameter_mismatch,
           "parameter '" + std::string(id) + "' has shape " + shape.to_string() +
               ", which this backend's tensors cannot have.",
           std::string(id));
    }
  }
}

}  // namespace detail
namespace detail {

template <class B>
concept has_views = requires { typename B::template view<float>; };

template <class B>
concept has_backend_types = requires {
  typename B::device_type;
  typename B::element_types;
  typename B::template tensor<float>;
  typename B::template tensor<double>;
};

/// What the library does with an incoming gradient of type X (a tensor or a view).
template <class B, class X>
concept backend_input =
    requires(const X& g, typename B::template tensor<float>& acc32, typename B::template tensor<double>& acc64) {
      { B::shape(g) } -> std::same_as<tensor_shape>;
      { B::device(g) } -> std::convertible_to<typename B::device_type>;
      { B::add_scaled(acc32, g, 1.0F) } noexcept;
      { B::add_scaled(acc64, g, 1.0) } noexcept;
      { B::template convert<float>(g) } -> std::same_as<typename B::template tensor<float>>;
      { B::template convert<double>(g) } -> std::same_as<typename B::template tensor<double>>;
    };

/// What the library does with a pending tensor of work type W.
template <class B, class W>
concept backend_work = requires(typename B::template tensor<W>& acc, const typename B::template tensor<W>& pending,
                                const tensor_shape& shape, const typename B::device_type& device, W scalar) {
  { B::template zeros<W>(shape, device) } -> std::same_as<typename B::template tensor<W>>;
  { B::divide(acc, scalar, scalar) } noexcept;
  { B::all_finite(pending) } noexcept -> std::same_as<bool>;
};

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

/// Whether checkpoints can read and write tensor<T>'s storage in place (see the optional
/// functions above).
template <class B, class T>
concept lends_row_major = requires(typename B::template tensor<T>& t, const typename B::template tensor<T>& c,
                                   const tensor_shape& shape, const typename B::device_type& device) {
  { B::template uninitialized<T>(shape, device) } -> std::same_as<typename B::template tensor<T>>;
  { B::row_major_data(t) } noexcept -> std::same_as<T*>;
  { B::row_major_data(c) } noexcept -> std::same_as<const T*>;
};

template <class B, class List>
struct all_row_major_io;
template <class B, class... Ts>
struct all_row_major_io<B, type_list<Ts...>> : std::bool_constant<(row_major_io<B, Ts> && ...)> {};

}  // namespace detail

/// @brief A traits type `B` that lets the library create, accumulate into and divide tensors.
template <class B>
concept tensor_backend =
    detail::has_backend_types<B> && std::equality_comparable<typename B::device_type> &&
    std::copyable<typename B::device_type> && detail::backend_work<B, float> && detail::backend_work<B, double> &&
    detail::all_elements_supported<B, typename B::element_types>::value &&
    (!detail::has_views<B> || detail::all_views_supported<B, typename B::element_types>::value);

/// @brief A backend whose tensors can be copied to and from row-major buffers (records).
template <class B>
concept serializable_backend = tensor_backend<B> && detail::all_row_major_io<B, typename B::element_types>::value;

/// @brief A backend whose owned work-dtype tensors keep their elements in one contiguous run of
/// host memory, in any fixed order: `B::data(t)` points to the `shape(t)`-many elements of `t`.
///
/// Optional. The MPI reduction uses it to reduce large tensors in place and pack small ones with
/// plain copies, instead of going through `to_row_major` / `from_row_major`.
template <class B>
concept host_memory_backend =
    tensor_backend<B> && requires(typename B::template tensor<float>& f32, typename B::template tensor<double>& f64) {
      { B::data(f32) } noexcept -> std::same_as<float*>;
      { B::data(f64) } noexcept -> std::same_as<double*>;
    };

namespace detail {

/// `B::shape(value)` for the tensor named `id`; a rank above `max_rank` is that tensor's
/// `parameter_mismatch`, not a malformed record.
template <class B, class X>
tensor_shape shape_of(const X& value, std::string_view id) {
  try {
    return B::shape(value);
  } catch (const error& problem) {
    if (problem.code() != errc::invalid_record) throw;
    fail(errc::parameter_mismatch, "tensor '" + std::string(id) + "' cannot be used: " + problem.what(),
         std::string(id));
  }
}

/// Whether B declares that its views store their shape and device (see the list above).
template <class B>
constexpr bool views_keep_geometry() noexcept {
  if constexpr (requires { B::views_keep_geometry; }) {
    return has_views<B> && B::views_keep_geometry;
  } else {
    return false;
  }
}

/// Whether the tensor named `id` has dimensions `shape`, through the backend's `has_shape` if it
/// has one: gradients are checked on every call, and a tensor_shape built each time costs more
/// than comparing a few dimensions in place.
template <class B, class X>
bool has_shape(const X& value, const tensor_shape& shape, std::string_view id) {
  if constexpr (requires {
                  { B::has_shape(value, shape) } noexcept -> std::same_as<bool>;
                }) {
    return B::has_shape(value, shape);
  } else {
    return shape_of<B>(value, id) == shape;
  }
}

/// Explains, one requirement at a time, why `B` is not a `tensor_backend`: concept failures
/// alone print pages of template context, these name the missing piece and its signature.
template <class B>
consteval bool check_backend() {
  static_assert(
      requires { typename B::device_type; },
      "gradaccum backend: missing `using device_type = ...;` (an equality-comparable device tag)");
  static_assert(
      requires { typename B::element_types; },
      "gradaccum backend: missing `using element_types = gradaccum::type_list<float, double, ...>;`");
  static_assert(
      requires { typename B::template tensor<float>; },
      "gradaccum backend: missing `template <class T> using tensor = ...;`");
  if constexpr (has_backend_types<B>) {
    using f32 = typename B::template tensor<float>;
    static_assert(std::equality_comparable<typename B::device_type>,
                  "gradaccum backend: `device_type` must be equality-comparable (operator==)");
    static_assert(list_contains<float, typename B::element_types>::value &&
                      list_contains<double, typename B::element_types>::value,
                  "gradaccum backend: `element_types` must contain float and double (the work types)");
    static_assert(
        requires(const f32& t) {
          { B::shape(t) } -> std::same_as<tensor_shape>;
        }, "gradaccum backend: missing or mis-declared `static gradaccum::tensor_shape shape(const tensor<T>&)`");
    static_assert(
        requires(const f32& t) {
          { B::device(t) } -> std::convertible_to<typename B::device_type>;
        }, "gradaccum backend: missing or mis-declared `static device_type device(const tensor<T>&)`");
    static_assert(
        requires(const tensor_shape& s, const typename B::device_type& d) {
          { B::template zeros<float>(s, d) } -> std::same_as<f32>;
        },
        "gradaccum backend: missing or mis-declared `template <class W> static tensor<W> zeros(const "
        "gradaccum::tensor_shape&, const device_type&)`");
    static_assert(
        requires(f32& acc, const f32& g) {
          { B::add_scaled(acc, g, 1.0F) } noexcept;
        },
        "gradaccum backend: missing, mis-declared or not noexcept `static void add_scaled(tensor<W>& acc, "
        "const tensor<T>& g, W scale) noexcept` (acc += scale * W(g))");
    static_assert(
        requires(f32& acc) {
          { B::divide(acc, 1.0F, 1.0F) } noexcept;
        },
        "gradaccum backend: missing, mis-declared or not noexcept `static void divide(tensor<W>& acc, W first, "
        "W second) noexcept` (acc = acc / first / second)");
    static_assert(
        requires(const f32& t) {
          { B::all_finite(t) } noexcept -> std::same_as<bool>;
        },
        "gradaccum backend: missing, mis-declared or not noexcept `static bool all_finite(const tensor<W>&) "
        "noexcept`");
    static_assert(
        requires(const f32& t) {
          { B::template convert<double>(t) } -> std::same_as<typename B::template tensor<double>>;
        },
        "gradaccum backend: missing or mis-declared `template <class W> static tensor<W> convert(const "
        "tensor<T>&)`");
    static_assert(tensor_backend<B>,
                  "gradaccum backend: tensor<float> conforms but not everything else: every T of element_types "
                  "needs a gradaccum::element_dtype<T> specialization and a copyable tensor<T> that shape, device, "
                  "add_scaled (into tensor<float> and tensor<double>) and convert accept, as they must accept "
                  "view<T> if `view` is declared; zeros, divide and all_finite must work for double too, and "
                  "device_type must be copyable");
  }
  return true;
}

}  // namespace detail
}  // namespace gradaccum
