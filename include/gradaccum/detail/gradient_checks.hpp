#pragma once
/// @file
/// @brief The checks a gradient goes through before anything is added: its id against the
/// parameter set, its shape and device against its parameter's, and the scalars of a call.

#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "gradaccum/backend.hpp"
#include "gradaccum/detail/variant.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/parameter_set.hpp"

namespace gradaccum::detail {

template <class B>
[[noreturn]] void fail_unknown(std::string_view id) {
  fail(errc::unknown_parameters, {"gradient '", id, "' names no parameter of the parameter set."}, id);
}

/// A gradient's shape and device: what its parameter's are compared with. Read by one small
/// function per tensor or view type, so that the comparison and its messages compile once per
/// backend, not once per alternative of a stored gradient.
template <class B>
struct geometry {
  tensor_shape shape;
  typename B::device_type device;
};

/// The geometry of `value`: a tensor or view of B, or a stored gradient holding one.
template <class B, class X>
geometry<B> geometry_of(const X& value, std::string_view id) {
  if constexpr (std::is_same_v<X, gradient_variant_t<B>>) {
    return visit_gradient([&](const auto& held) { return geometry_of<B>(held, id); }, value);
  } else {
    return {shape_of<B>(value, id), B::device(value)};
  }
}

/// Checks that the gradient `id` has the shape and device of `param`; throws parameter_mismatch.
template <class B>
void check_geometry(const typename parameter_set<B>::parameter& param, std::string_view id, const geometry<B>& got) {
  if (!same_shape<B>(got.shape, param.shape)) {
    fail(errc::parameter_mismatch,
         {"gradient '", id, "' has shape ", got.shape.dims(), " but its parameter has shape ", param.shape.dims(), "."},
         id);
  }
  if (!(got.device == param.device)) {
    fail(errc::parameter_mismatch, {"gradient '", id, "' is on another device than its parameter."}, id);
  }
}

/// Position of `id` in `params`, checking the geometry of `value` (a tensor, view or stored
/// gradient) there; throws unknown_parameters or parameter_mismatch.
template <class B, class X>
std::size_t resolve(const parameter_set<B>& params, std::string_view id, const X& value, std::size_t hint) {
  const auto position = params.find(id, hint);
  if (!position) fail_unknown<B>(id);
  check_geometry<B>(params[*position], id, geometry_of<B>(value, id));
  return *position;
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
    fail(errc::invalid_dtype, {"dtype ", to_string(dtype), " cannot be used for arithmetic; use F32 or F64."});
  }
}

inline void require_scalar(double value, float_dtype dtype, bool divisor) {
  const bool narrows_to_zero = dtype == float_dtype::f32 && static_cast<float>(value) == 0.0F && value != 0.0;
  if (!representable(value, dtype) || narrows_to_zero || (divisor && value == 0.0)) {
    fail(errc::invalid_scalar, {divisor ? "divisor " : "multiplier ", value, " is not representable as a ",
                                divisor ? "non-zero " : "", to_string(dtype), " value."});
  }
}

}  // namespace gradaccum::detail
