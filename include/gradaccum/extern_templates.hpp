#pragma once
/// @file
/// @brief Compiling a backend's accumulation window once per program instead of once per file.
///
/// Header-only code is compiled in every file that uses it. A training loop's window
/// (`weighted_gradients_accumulator<B>`: accumulate, finish, `non_finite`; with its
/// `parameter_set<B>`, `gradients_params<B>` and result `flat_gradients<B>`), the global norm and
/// clipping of its result, the loss scaler's checks and the error messages are most of what
/// gradaccum costs the compiler there, and none of it depends on the caller's code. These macros
/// move it into one file, as C++'s explicit instantiation does (`extern template`):
///
/// @code
/// // In every file that uses the window, after its includes (a project header is a good place):
/// #include <gradaccum/backends/eigen.hpp>
/// #include <gradaccum/gradaccum.hpp>
/// GRADACCUM_EXTERN_TEMPLATES(gradaccum::eigen_backend)
///
/// // In exactly one file of the program, naming every backend declared extern:
/// #include <gradaccum/backends/eigen.hpp>
/// #include <gradaccum/gradaccum.hpp>
/// GRADACCUM_INSTANTIATE_TEMPLATES(gradaccum::eigen_backend)
/// @endcode
///
/// Any backend works, including your own, and a program may do this for up to four. Nothing else
/// changes: same calls, same bits, same errors. Without the macros everything stays header-only.
/// `benchmarks/compile-cost` measures what it saves (docs/performance.md).

#include <cstddef>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/global_norm.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/weighted_gradients_accumulator.hpp"

/// @brief In every file that uses backend `B`'s window: its code is compiled elsewhere (by
/// `GRADACCUM_INSTANTIATE_TEMPLATES`), not here. At namespace scope, after the includes; once
/// per backend.
#define GRADACCUM_EXTERN_TEMPLATES(B) \
  GRADACCUM_DETAIL_SHARED(extern template) GRADACCUM_DETAIL_TEMPLATES(extern template, B)

/// @brief In one file of the program, which does not use `GRADACCUM_EXTERN_TEMPLATES`: compiles
/// the windows of the backends named (one to four, every backend the program declares extern)
/// and the kernels they share. At namespace scope, after the includes.
#define GRADACCUM_INSTANTIATE_TEMPLATES(...)                                                                 \
  GRADACCUM_DETAIL_SHARED(template)                                                                          \
  GRADACCUM_DETAIL_PICK(__VA_ARGS__, GRADACCUM_DETAIL_EACH4, GRADACCUM_DETAIL_EACH3, GRADACCUM_DETAIL_EACH2, \
                        GRADACCUM_DETAIL_EACH1, unused)                                                      \
  (GRADACCUM_DETAIL_INSTANTIATE_ONE, __VA_ARGS__)

// ---- What the two expand to ----------------------------------------------------------------

// The arguments are types and declaration prefixes, which cannot be parenthesized.
// NOLINTBEGIN(bugprone-macro-parentheses)
/// The declarations shared by both macros, `prefix` being `extern template` or `template`: backend
/// `B`'s parameter set, gradients container, window, its result, norm and clipping (their members
/// that a loop calls are defined outside their classes: inline ones would still be compiled in
/// every file), and what depends on no backend and so is compiled once for all: the add kernels
/// of F32 and F64 gradients (which host backends call), the error messages' text and the loss
/// scaler's checks (templates of nothing for this purpose).
#define GRADACCUM_DETAIL_TEMPLATES(prefix, B)                                                                        \
  prefix class ::gradaccum::parameter_set<B>;                                                                        \
  prefix class ::gradaccum::gradients_params<B>;                                                                     \
  prefix class ::gradaccum::gradients_accumulator<B>;                                                                \
  prefix class ::gradaccum::weighted_gradients_accumulator<B>;                                                       \
  prefix class ::gradaccum::flat_gradients<B>;                                                                       \
  prefix std::optional<::gradaccum::detail::result_view<B, float>::type> gradaccum::flat_gradients<B>::get<float>(   \
      std::string_view) const;                                                                                       \
  prefix std::optional<::gradaccum::detail::result_view<B, double>::type> gradaccum::flat_gradients<B>::get<double>( \
      std::string_view) const;                                                                                       \
  prefix void ::gradaccum::detail::check_geometry<B>(const ::gradaccum::parameter_set<B>::parameter&,                \
                                                     std::string_view, const ::gradaccum::detail::geometry<B>&);     \
  prefix double ::gradaccum::global_norm<B>(const ::gradaccum::flat_gradients<B>&) noexcept(                         \
      !::gradaccum::device_buffers_backend<B>);                                                                      \
  prefix double ::gradaccum::global_norm<B>(const ::gradaccum::accumulated_gradients<B>&) noexcept(                  \
      !::gradaccum::device_buffers_backend<B>);                                                                      \
  prefix double ::gradaccum::clip_by_global_norm<B>(::gradaccum::flat_gradients<B>&, double);                        \
  prefix double ::gradaccum::clip_by_global_norm<B>(::gradaccum::accumulated_gradients<B>&, double);
#define GRADACCUM_DETAIL_KERNELS_OF(prefix, W, T)                                                        \
  prefix void ::gradaccum::kernels::add_scaled<W, T>(W*, const T*, std::size_t, W) noexcept;             \
  prefix void ::gradaccum::kernels::add_scaled_strided<W, T>(W*, const T*, std::span<const std::size_t>, \
                                                             std::span<const std::ptrdiff_t>, W) noexcept;
#define GRADACCUM_DETAIL_SHARED(prefix)                                                                                \
  prefix std::string gradaccum::detail::message_text<void>(std::initializer_list<::gradaccum::detail::message_piece>); \
  prefix void ::gradaccum::detail::check_loss_scale<void>(const ::gradaccum::dynamic_loss_scale_options&,              \
                                                          const ::gradaccum::dynamic_loss_scale_state&);               \
  GRADACCUM_DETAIL_KERNELS_OF(prefix, float, float)                                                                    \
  GRADACCUM_DETAIL_KERNELS_OF(prefix, float, double)                                                                   \
  GRADACCUM_DETAIL_KERNELS_OF(prefix, double, float)                                                                   \
  GRADACCUM_DETAIL_KERNELS_OF(prefix, double, double)
#define GRADACCUM_DETAIL_INSTANTIATE_ONE(B) GRADACCUM_DETAIL_TEMPLATES(template, B)
#define GRADACCUM_DETAIL_PICK(b1, b2, b3, b4, each, ...) each
#define GRADACCUM_DETAIL_EACH1(X, b1) X(b1)
#define GRADACCUM_DETAIL_EACH2(X, b1, b2) X(b1) X(b2)
#define GRADACCUM_DETAIL_EACH3(X, b1, b2, b3) X(b1) X(b2) X(b3)
#define GRADACCUM_DETAIL_EACH4(X, b1, b2, b3, b4) X(b1) X(b2) X(b3) X(b4)
// NOLINTEND(bugprone-macro-parentheses)
