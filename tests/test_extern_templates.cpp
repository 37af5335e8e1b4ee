/// @file
/// @brief `GRADACCUM_EXTERN_TEMPLATES`: a window declared compiled elsewhere (here, in
/// extern_templates_instantiation.cpp) links, and gives the bits of the header-only window.
/// The declarations must match the definitions exactly (a `noexcept` that differs, a member
/// missing from the class's explicit instantiation): otherwise this does not link.

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include <doctest/doctest.h>

#include "extern_templates_backends.hpp"

GRADACCUM_EXTERN_TEMPLATES(gradaccum::test::vector_backend)
GRADACCUM_EXTERN_TEMPLATES(gradaccum::test::device_backend)
#if GRADACCUM_TEST_HAVE_EIGEN
GRADACCUM_EXTERN_TEMPLATES(gradaccum::eigen_backend)
#endif

namespace {

using gradaccum::float_dtype;

template <class B>
typename B::template tensor<float> tensor_of(std::vector<float> values) {
  return B::template from_row_major<float>(std::span<const float>(values), gradaccum::tensor_shape{2, 2}, {});
}

TEST_CASE_TEMPLATE("a window compiled in another file: accumulate, finish, norm and clipping", B,
                   EXTERN_TEMPLATES_BACKENDS) {
  gradaccum::parameter_set<B> params;
  params.add("w", gradaccum::tensor_shape{2, 2}, {});
  gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, 2.0);
  for (const auto& [values, tokens] :
       {std::pair{std::vector<float>{1, 2, 3, 4}, 3.0}, std::pair{std::vector<float>{5, 6, 7, 8}, 1.0}}) {
    gradaccum::gradients_params<B> grads;
    grads.insert("w", tensor_of<B>(values));
    window.accumulate_mean(params, grads, tokens);
  }
  CHECK(window.non_finite().empty());
  auto mean = window.finish_mean(params);  // ((3 g1 + g2) / 2) / 4, exact
  CHECK(gradaccum::test::values_of<float>(mean.gradients, "w") == std::vector<float>{1.0F, 1.5F, 2.0F, 2.5F});

  const double norm = gradaccum::global_norm(mean);
  CHECK(norm == std::sqrt(13.5));
  CHECK(gradaccum::clip_by_global_norm(mean, 1.0) == norm);
  const auto c = static_cast<float>(1.0 / (norm + 1e-6));
  CHECK(gradaccum::test::values_of<float>(mean.gradients, "w") ==
        std::vector<float>{1.0F * c, 1.5F * c, 2.0F * c, 2.5F * c});

  gradaccum::gradients_params<B> sum;
  sum.insert("w", tensor_of<B>({1, 2, 3, 4}));
  window.accumulate_sum(params, sum, 5.0);  // the next window: a loss sum over 5 tokens
  const auto sum_mean = window.finish_mean(params);
  CHECK(gradaccum::test::values_of<float>(sum_mean.gradients, "w") == std::vector<float>{0.1F, 0.2F, 0.3F, 0.4F});
}

}  // namespace
