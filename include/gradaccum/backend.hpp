#pragma once
/// @file
/// @brief The backend contract: `tensor_backend` and `serializable_backend`.
///
/// A backend is a traits type; the library never names a tensor library. Pending sums and
/// results live in one contiguous host buffer of the work dtype that the library owns (see
/// `<gradaccum/flat_gradients.hpp>`); each parameter's segment holds its elements in row-major
/// order. A backend says how to read its tensors into such a segment and how to show a segment
/// as one of its own views. It must provide (T ranges over `element_types`, which must contain
/// `float` and `double`; W is float or double; X is `tensor<T>` or, if the backend has views,
/// `view<T>`):
///
/// @code
/// struct my_backend {
///   using device_type = ...;                               // equality-comparable
///   using element_types = gradaccum::type_list<float, double /*, 16-bit types */>;
///   template <class T> using tensor = ...;                 // owning, evaluated tensor
///   template <class T> using view = ...;                   // optional: read-only view of caller memory
///                                                          // (gradaccum::strided_view<const T> fits any host layout)
///   static auto adapt(Y&&);                                // optional: a tensor<T> or view<T> for another type Y
///   static gradaccum::tensor_shape canonical_shape(const gradaccum::tensor_shape&);  // optional: shapes that
///                                                          // compare equal (parameter vs gradient) when these agree
///   static gradaccum::tensor_shape shape(const X&);        // a shape it cannot represent: errc::parameter_mismatch
///   static device_type device(const X&);
///   // acc (row-major, shape(g)'s element count) += scale · W(g), rounding twice (no FMA)
///   static void add_scaled(std::span<W> acc, const X& g, W scale) noexcept;
///   // a read-only view of row-major values, as results hand them out
///   template <class W> static auto map(std::span<const W> row_major, const gradaccum::tensor_shape&,
///                                      const device_type&);
///   template <class W> static tensor<W> convert(const X&);   // an owned copy in element type W
///   // optional: whether moving t cannot allocate. Where it is false the library copies t
///   // into its storage instead (a move declared noexcept that allocates would terminate).
///   static bool moves_without_allocating(const tensor<T>& t) noexcept;
///   // serializable_backend adds (records of gradients, not of pending sums, which are row-major already):
///   static void to_row_major(const tensor<T>&, std::span<T> out);
///   template <class T> static tensor<T> from_row_major(std::span<const T>, const gradaccum::tensor_shape&,
///                                                      const device_type&);
/// };
/// @endcode
///
/// A parameter or gradient of any other type goes in through `adapt`, or as a `view<T>` or
/// `tensor<T>` it converts to (see `<gradaccum/detail/gradient_input.hpp>`).
///
/// The buffer is host memory, so a backend whose tensors live on an accelerator reads them into
/// it in `add_scaled`. That is `noexcept`, so a copy off the device belongs where the tensor goes in
/// (`adapt`, or its `tensor<T>`'s constructor), which may throw; see docs/architecture.md.

#include <concepts>
#include <span>
#include <string>
#include <string_view>

#include "gradaccum/detail/backend_requirements.hpp"
#include "gradaccum/device_buffers.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/shape.hpp"
#include "gradaccum/type_list.hpp"

namespace gradaccum {

/// @brief A traits type `B` that lets the library create, accumulate into and divide tensors.
template <class B>
concept tensor_backend =
    detail::has_backend_types<B> && std::equality_comparable<typename B::device_type> &&
    std::copyable<typename B::device_type> && detail::backend_work<B, float> && detail::backend_work<B, double> &&
    detail::all_elements_supported<B, typename B::element_types>::value &&
    (!detail::has_views<B> || detail::all_views_supported<B, typename B::element_types>::value) &&
    (!detail::has_buffers<B> || device_buffers_backend<B>);

/// @brief A backend whose tensors can be copied to and from row-major buffers (records).
template <class B>
concept serializable_backend = tensor_backend<B> && detail::all_row_major_io<B, typename B::element_types>::value;

// ---- Implementation ------------------------------------------------------------------------------

namespace detail {

/// `B::shape(value)` for the tensor named `id`; a rank above `max_rank` is that tensor's
/// `parameter_mismatch`, not a malformed record.
template <class B, class X>
tensor_shape shape_of(const X& value, std::string_view id) {
  try {
    return B::shape(value);
  } catch (const error& problem) {
    if (problem.code() != errc::invalid_record) throw;
    fail(errc::parameter_mismatch, {"tensor '", id, "' cannot be used: ", problem.what()}, id);
  }
}

template <class B>
concept has_canonical_shape = requires(const tensor_shape& s) {
  { B::canonical_shape(s) } -> std::same_as<tensor_shape>;
};

/// Whether shapes `a` and `b` are the same to B: equal, or equal after `B::canonical_shape`
/// (Eigen: a vector [n] is an n x 1 matrix).
template <class B>
bool same_shape(const tensor_shape& a, const tensor_shape& b) {
  if (a == b) return true;
  if constexpr (has_canonical_shape<B>) {
    return B::canonical_shape(a) == B::canonical_shape(b);
  } else {
    return false;
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
        has_buffers<B> ||
            requires(std::span<float> acc, const f32& g) {
              { B::add_scaled(acc, g, 1.0F) } noexcept;
            },
        "gradaccum backend: missing, mis-declared or not noexcept `static void add_scaled(std::span<W> acc, "
        "const tensor<T>& g, W scale) noexcept` (acc, row-major, += scale * W(g))");
    static_assert(
        has_buffers<B> || requires(std::span<const float> values, const tensor_shape& s,
                                   const typename B::device_type& d) { B::template map<float>(values, s, d); },
        "gradaccum backend: missing or mis-declared `template <class W> static auto map(std::span<const W> "
        "row_major, const gradaccum::tensor_shape&, const device_type&)` (a read-only view of a result)");
    static_assert(
        requires(const f32& t) {
          { B::template convert<double>(t) } -> std::same_as<typename B::template tensor<double>>;
        },
        "gradaccum backend: missing or mis-declared `template <class W> static tensor<W> convert(const "
        "tensor<T>&)`");
    static_assert(!has_buffers<B> || device_buffers_backend<B>,
                  "gradaccum backend: `buffer<W>` is declared but not every member of a backend with device "
                  "buffers is (allocate, add_scaled, map, divide, zero, read, write; see "
                  "<gradaccum/device_buffers.hpp>)");
    static_assert(tensor_backend<B>,
                  "gradaccum backend: tensor<float> conforms but not everything else: every T of element_types "
                  "needs a gradaccum::element_dtype<T> specialization and a copyable tensor<T> that shape, device, "
                  "add_scaled (into tensor<float> and tensor<double>) and convert accept, as they must accept "
                  "view<T> if `view` is declared; map must work for double too, and device_type must be "
                  "copyable");
  }
  return true;
}

}  // namespace detail
}  // namespace gradaccum
