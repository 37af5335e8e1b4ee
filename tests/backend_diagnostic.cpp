// Must NOT compile: the backend_diagnostic tests build it once per broken backend of
// backend_pieces.hpp (-DGRADACCUM_TEST_BROKEN_BACKEND=missing_shape, ...) and expect the first
// error to be the library's static_assert naming the missing piece, not template noise.
#include <gradaccum/gradaccum.hpp>

#include "backend_pieces.hpp"

#ifndef GRADACCUM_TEST_BROKEN_BACKEND
#error "define GRADACCUM_TEST_BROKEN_BACKEND to one of the broken backends of backend_pieces.hpp"
#endif

int main() {
  // What a user writes first with a new backend.
  gradaccum::weighted_gradients_accumulator<gradaccum::test::GRADACCUM_TEST_BROKEN_BACKEND> window(
      gradaccum::float_dtype::f32, 1.0);
  return static_cast<int>(window.state().microbatches);
}
