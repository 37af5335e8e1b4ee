// Every member function of the public class templates, compiled for every built-in backend that
// was found. A member is otherwise compiled only when some test calls it, so a member that does
// not compile for one backend (or that warns) could ship unnoticed; this translation unit is also
// what clang-tidy reads to check the library's templates as instantiated.
#include <gradaccum/gradaccum.hpp>
#if GRADACCUM_HAVE_EIGEN
#include <gradaccum/backends/eigen.hpp>
#endif
#if GRADACCUM_HAVE_XTENSOR
#include <gradaccum/backends/xtensor.hpp>
#endif

#define GRADACCUM_INSTANTIATE_FOR(backend)                           \
  template class gradaccum::parameter_set<backend>;                  \
  template class gradaccum::gradients_params<backend>;               \
  template class gradaccum::gradients_accumulator<backend>;          \
  template class gradaccum::weighted_gradients_accumulator<backend>; \
  template struct gradaccum::accumulated_gradients<backend>;         \
  template class gradaccum::sharded_gradients<backend>;

#if GRADACCUM_HAVE_EIGEN
GRADACCUM_INSTANTIATE_FOR(gradaccum::eigen_backend)
#endif
#if GRADACCUM_HAVE_XTENSOR
GRADACCUM_INSTANTIATE_FOR(gradaccum::xtensor_backend)
#endif
