// Compiled, never run: which types are backends. The built-in and test backends satisfy both
// concepts (the built-in ones also `host_memory_backend`); a type that lacks or breaks any one
// required piece satisfies neither (or, lacking a row-major function, only `tensor_backend`).
// The build fails if any of this stops being true (the backends' headers do not check
// themselves: every file that includes one would pay for it).
// What a user sees for each broken type is checked by the backend_diagnostic tests.
#include <gradaccum/backend.hpp>

#include "backend_pieces.hpp"
#include "test_backend.hpp"

#if GRADACCUM_TEST_HAVE_EIGEN
#include <gradaccum/backends/eigen.hpp>
static_assert(gradaccum::serializable_backend<gradaccum::eigen_backend>);
static_assert(gradaccum::detail::check_backend<gradaccum::eigen_backend>());
#endif
#if GRADACCUM_TEST_HAVE_XTENSOR
#include <gradaccum/backends/xtensor.hpp>
static_assert(gradaccum::serializable_backend<gradaccum::xtensor_backend>);
static_assert(gradaccum::detail::check_backend<gradaccum::xtensor_backend>());
#endif
#if GRADACCUM_TEST_HAVE_TORCH
#include <gradaccum/backends/torch.hpp>
static_assert(gradaccum::serializable_backend<gradaccum::torch_backend>);
static_assert(gradaccum::detail::check_backend<gradaccum::torch_backend>());
#endif

namespace gradaccum::test {
namespace {

template <class B>
constexpr bool is_backend_only = tensor_backend<B> && !serializable_backend<B>;
template <class B>
constexpr bool is_no_backend = !tensor_backend<B> && !serializable_backend<B>;

static_assert(serializable_backend<vector_backend>);
static_assert(serializable_backend<minimal_backend>);
static_assert(detail::check_backend<minimal_backend>());

// Each piece of `tensor_backend` is required.
static_assert(is_no_backend<missing_device_type>);
static_assert(is_no_backend<missing_element_types>);
static_assert(is_no_backend<missing_tensor>);
static_assert(is_no_backend<missing_shape>);
static_assert(is_no_backend<missing_device>);
static_assert(is_no_backend<missing_add_scaled>);
static_assert(is_no_backend<missing_map>);
static_assert(is_no_backend<missing_convert>);

// ... and must have its documented form.
static_assert(is_no_backend<incomparable_device_type_instead>);
static_assert(is_no_backend<float_only_element_types_instead>);
static_assert(is_no_backend<unknown_element_types_instead>);
static_assert(is_no_backend<throwing_add_scaled_instead>);
static_assert(is_no_backend<unsupported_view_instead>);

// Row-major copies are what records need; without them a backend still accumulates.
static_assert(is_backend_only<missing_to_row_major>);
static_assert(is_backend_only<missing_from_row_major>);

// Not backends at all.
static_assert(is_no_backend<int>);
static_assert(is_no_backend<vector_backend::tensor<float>>);

}  // namespace
}  // namespace gradaccum::test
