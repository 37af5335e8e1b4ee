#pragma once
/// @file
/// @brief The backends whose windows `test_extern_templates` declares compiled elsewhere and
/// `extern_templates_instantiation.cpp` compiles: the test-only host and device backends, and
/// the Eigen backend when it was found.

#include "backend_fixtures.hpp"

#if GRADACCUM_TEST_HAVE_EIGEN
#define EXTERN_TEMPLATES_BACKENDS \
  gradaccum::test::vector_backend, gradaccum::test::device_backend, gradaccum::eigen_backend
#else
#define EXTERN_TEMPLATES_BACKENDS gradaccum::test::vector_backend, gradaccum::test::device_backend
#endif
