// Must NOT compile: the input_diagnostic tests build it once per refused input
// (-DGRADACCUM_TEST_REFUSED_INPUT=...) and expect the first error to be the library's one
// static_assert saying what to do, not template noise.
#include <gradaccum/gradaccum.hpp>

#include "matrix_backend.hpp"

#ifndef GRADACCUM_TEST_REFUSED_INPUT
#error "define GRADACCUM_TEST_REFUSED_INPUT to gradient_cube, parameter_cube or int_matrix"
#endif

#define GRADACCUM_TEST_gradient_cube 1
#define GRADACCUM_TEST_parameter_cube 2
#define GRADACCUM_TEST_int_matrix 3
#define GRADACCUM_TEST_CASE_OF(name) GRADACCUM_TEST_##name
#define GRADACCUM_TEST_CASE(name) GRADACCUM_TEST_CASE_OF(name)

int main() {
  using B = gradaccum::test::matrix_backend;
  gradaccum::parameter_set<B> params;
  gradaccum::gradients_params<B> grads;
#if GRADACCUM_TEST_CASE(GRADACCUM_TEST_REFUSED_INPUT) == 1
  grads.insert("w", lab::cube{});
#elif GRADACCUM_TEST_CASE(GRADACCUM_TEST_REFUSED_INPUT) == 2
  params.add("w", lab::cube{});
#else
  grads.insert("w", lab::mat<int>(2, 2));
#endif
  return static_cast<int>(params.size() + grads.size());
}
