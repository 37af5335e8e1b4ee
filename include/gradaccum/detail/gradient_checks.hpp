#pragma once
/// @file
/// @brief The checks a gradient goes through before anything is added: its id against the
/// parameter set, its shape and device against its parameter's, and the scalars of a call.

#include <string>
#include <string_view>

#include "gradaccum/backend.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/parameter_set.hpp"

namespace gradaccum::detail {

template <class B>
[[noreturn]] void fail_unknown(std::string_view id) {
  fail(errc::unknown_parameters, {"gradient '", id, "' names no parameter of the parameter set."}, id);
}

/// Checks that the gradient `id` has the shape and device of `param`; throws parameter_mismatch.
template <class B, class X>
void check_geometry(const typename parameter_set<B>::parameter& param, std::string_view id, const X& value) {
  const tensor_shape shape = shape_of<B>(value, id);
  if (!same_shape<B>(shape, param.shape)) {
    fail(errc::parameter_mismatch,
         {"gradient '", id, "' has shape ", shape.dims(), " but its parameter has shape ", param.shape.dims(), "."},
         id);
  }
  if (!(B::device(value) == param.device)) {
    fail(errc::parameter_mismatch, {"gradient '", id, "' is on another device than its parameter."}, id);
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
