/// @file
/// @brief dtype.hpp: text names, sizes, work dtypes and the `representable` check at every boundary.

#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include <doctest/doctest.h>

#include <gradaccum/dtype.hpp>

#include "test_backend.hpp"
#include "test_helpers.hpp"

using gradaccum::float_dtype;
using gradaccum::representable;

namespace {
constexpr double infinity = std::numeric_limits<double>::infinity();
constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();
constexpr float_dtype all_dtypes[] = {float_dtype::f16, float_dtype::bf16, float_dtype::f32, float_dtype::f64};
}  // namespace

TEST_CASE("dtypes have the text names of the record format, and parse back case-sensitively") {
  CHECK(gradaccum::to_string(float_dtype::f16) == "F16");
  CHECK(gradaccum::to_string(float_dtype::bf16) == "BF16");
  CHECK(gradaccum::to_string(float_dtype::f32) == "F32");
  CHECK(gradaccum::to_string(float_dtype::f64) == "F64");
  for (const float_dtype dtype : all_dtypes) {
    CHECK(gradaccum::parse_float_dtype(gradaccum::to_string(dtype)) == std::optional(dtype));
  }
  for (const char* other : {"f32", "FP32", "F8", "", "F32 ", "float"}) {
    CAPTURE(other);
    CHECK_FALSE(gradaccum::parse_float_dtype(other).has_value());
  }
}

TEST_CASE("sizes and work dtypes") {
  CHECK(gradaccum::size_of(float_dtype::f16) == 2);
  CHECK(gradaccum::size_of(float_dtype::bf16) == 2);
  CHECK(gradaccum::size_of(float_dtype::f32) == 4);
  CHECK(gradaccum::size_of(float_dtype::f64) == 8);
  CHECK_FALSE(gradaccum::is_work_dtype(float_dtype::f16));
  CHECK_FALSE(gradaccum::is_work_dtype(float_dtype::bf16));
  CHECK(gradaccum::is_work_dtype(float_dtype::f32));
  CHECK(gradaccum::is_work_dtype(float_dtype::f64));
  static_assert(std::is_same_v<gradaccum::work_type<float_dtype::f32>, float>);
  static_assert(std::is_same_v<gradaccum::work_type<float_dtype::f64>, double>);
  static_assert(gradaccum::dtype_of<float> == float_dtype::f32);
  static_assert(gradaccum::dtype_of<double> == float_dtype::f64);
  static_assert(gradaccum::dtype_of<gradaccum::test::f16> == float_dtype::f16);
  static_assert(gradaccum::element_type<gradaccum::test::bf16>);
  static_assert(!gradaccum::element_type<int>);
}

TEST_CASE("nothing non-finite is representable in any dtype") {
  for (const float_dtype dtype : all_dtypes) {
    CAPTURE(dtype);
    CHECK_FALSE(representable(infinity, dtype));
    CHECK_FALSE(representable(-infinity, dtype));
    CHECK_FALSE(representable(not_a_number, dtype));
    CHECK(representable(0.0, dtype));
    CHECK(representable(-1.5, dtype));
  }
  CHECK(representable(std::numeric_limits<double>::max(), float_dtype::f64));
  CHECK(representable(std::numeric_limits<double>::denorm_min(), float_dtype::f64));
}

TEST_CASE("F32: representable while the value narrows to a finite float (round to nearest even)") {
  CHECK(representable(0x1.fffffep127, float_dtype::f32));        // FLT_MAX
  CHECK(representable(0x1.fffffefp127, float_dtype::f32));       // rounds down to FLT_MAX
  CHECK_FALSE(representable(0x1.ffffffp127, float_dtype::f32));  // the halfway point rounds to 2^128
  CHECK_FALSE(representable(-0x1p128, float_dtype::f32));
  // Values that narrow to 0 are still finite: "narrows to 0" is a separate check of its callers.
  CHECK(representable(0x1p-150, float_dtype::f32));
}

TEST_CASE("F16: representable below 65520, the halfway point past the largest finite value 65504") {
  CHECK(representable(65504.0, float_dtype::f16));
  CHECK(representable(65519.99, float_dtype::f16));
  CHECK(representable(-65519.99, float_dtype::f16));
  CHECK_FALSE(representable(65520.0, float_dtype::f16));
  CHECK_FALSE(representable(-65520.0, float_dtype::f16));
}

TEST_CASE("BF16: representable below 0x1.ffp127, the halfway point past the largest finite value 0x1.fep127") {
  // Round to nearest even from float: 0x1.ffp127 lies halfway between the largest finite BF16
  // (odd significand 0x7f) and 2^128, so it rounds up to infinity; anything below rounds down.
  CHECK(representable(0x1.fep127, float_dtype::bf16));
  CHECK(representable(0x1.fefffep127, float_dtype::bf16));
  CHECK_FALSE(representable(0x1.ffp127, float_dtype::bf16));
  CHECK_FALSE(representable(0x1.ff8p127, float_dtype::bf16));
  CHECK_FALSE(representable(-0x1.ffp127, float_dtype::bf16));
}
