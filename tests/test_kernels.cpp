/// @file
/// @brief kernels.hpp: exact 16-bit widening, the two-rounding fused add, sequential division,
/// finiteness and conversion, including ranges large enough to be split across threads.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/kernels.hpp>

#include "test_backend.hpp"
#include "test_helpers.hpp"

namespace kernels = gradaccum::kernels;
using gradaccum::test::bf16;
using gradaccum::test::f16;
using gradaccum::test::same_bits;

namespace {

/// Reference decoding of a 16-bit float with a sign bit, `mantissa_bits` of mantissa and the
/// other bits exponent (biased by half its range), built from the definition with ldexp:
/// normals are (2^m + mantissa) · 2^(exponent - bias - m), subnormals mantissa · 2^(1 - bias - m).
/// Returns the float bits; NaN keeps its payload in the top bits.
template <int mantissa_bits>
std::uint32_t reference_to_float_bits(std::uint16_t bits) {
  constexpr int exponent_mask = (1 << (15 - mantissa_bits)) - 1;
  constexpr int bias = exponent_mask / 2;
  constexpr std::uint32_t implicit_one = 1U << mantissa_bits;
  const std::uint32_t sign = (bits & 0x8000U) != 0 ? 0x80000000U : 0U;
  const int exponent = (bits >> mantissa_bits) & exponent_mask;
  const std::uint32_t mantissa = bits & (implicit_one - 1);
  if (exponent == exponent_mask) return sign | 0x7f800000U | (mantissa << (23 - mantissa_bits));
  const float magnitude =
      exponent == 0 ? std::ldexp(static_cast<float>(mantissa), 1 - bias - mantissa_bits)
                    : std::ldexp(static_cast<float>(implicit_one + mantissa), exponent - bias - mantissa_bits);
  return sign | std::bit_cast<std::uint32_t>(magnitude);
}

/// binary16 (5-bit exponent biased by 15) and bfloat16 (8-bit exponent biased by 127).
constexpr auto reference_f16_to_float_bits = reference_to_float_bits<10>;
constexpr auto reference_bf16_to_float_bits = reference_to_float_bits<7>;

/// Above the threshold at which kernels may split a range across threads, and not a multiple of 64.
constexpr std::size_t large_count = (std::size_t{1} << 18) + 37;

}  // namespace

TEST_CASE("16-bit values widen to float exactly, for every bit pattern") {
  for (std::uint32_t bits = 0; bits <= 0xffffU; ++bits) {
    const auto pattern = static_cast<std::uint16_t>(bits);
    const auto f16_bits = std::bit_cast<std::uint32_t>(kernels::f16_bits_to_float(pattern));
    const auto bf16_bits = std::bit_cast<std::uint32_t>(kernels::bf16_bits_to_float(pattern));
    if (f16_bits != reference_f16_to_float_bits(pattern)) FAIL_CHECK("F16 pattern " << bits);
    if (bf16_bits != reference_bf16_to_float_bits(pattern)) FAIL_CHECK("BF16 pattern " << bits);
  }
  static_assert(kernels::f16_bits_to_float(0x3c00) == 1.0F);
  static_assert(kernels::f16_bits_to_float(0x7bff) == 65504.0F);
  static_assert(kernels::f16_bits_to_float(0x0001) == 0x1p-24F);
  static_assert(kernels::bf16_bits_to_float(0x3f80) == 1.0F);
  static_assert(kernels::bf16_bits_to_float(0x7f7f) == 0x1.fep127F);
  static_assert(kernels::to_work<double>(f16{0xc000}) == -2.0);
}

TEST_CASE("add_scaled rounds the product, then the sum: never a fused multiply-add") {
  // (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 rounds to 1 + 2^-11 as a float, so the sum is exactly 0;
  // a fused multiply-add would keep the 2^-24.
  float acc32[] = {-(1 + 0x1p-11F)};
  const float g32[] = {1 + 0x1p-12F};
  kernels::add_scaled(acc32, g32, 1, 1 + 0x1p-12F);
  CHECK(acc32[0] == 0.0F);
  // Same in double: (1 + 2^-27)^2 = 1 + 2^-26 + 2^-54 rounds to 1 + 2^-26.
  double acc64[] = {-(1 + 0x1p-26)};
  const double g64[] = {1 + 0x1p-27};
  kernels::add_scaled(acc64, g64, 1, 1 + 0x1p-27);
  CHECK(acc64[0] == 0.0);
}

TEST_CASE_TEMPLATE("add_scaled gives the two-rounding bits at every length, unrolled body and tails alike", W, float,
                   double) {
  // Lengths 0..300 cover the four-vector body, the single vectors after it and the scalar
  // tail, at every offset. acc = -(1 + 2^-k), g = scale = 1 + 2^-(k+1): the rounded product is
  // 1 + 2^-k, so each sum is exactly 0, where a fused multiply-add would leave 2^-(2k+2).
  // Elements past the length must stay as they were.
  constexpr int k = std::is_same_v<W, float> ? 11 : 26;
  const W tiny = std::ldexp(W(1), -k);
  const W scale = 1 + tiny / 2;
  const W sentinel = 7;
  for (std::size_t count = 0; count <= 300; ++count) {
    std::vector<W> acc(count + 3, sentinel);
    std::fill_n(acc.begin(), count, -(1 + tiny));
    const std::vector<W> g(count, scale);
    kernels::add_scaled(acc.data(), g.data(), count, scale);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < count; ++i) wrong += same_bits(acc[i], W(0)) ? 0 : 1;
    for (std::size_t i = count; i < acc.size(); ++i) wrong += acc[i] == sentinel ? 0 : 1;
    // accumulate_sum's loop (scale 1): i + 1/2 is exact.
    std::vector<W> sums(count + 3, sentinel);
    for (std::size_t i = 0; i < count; ++i) sums[i] = static_cast<W>(i);
    const std::vector<W> halves(count, W(0.5));
    kernels::add_scaled(sums.data(), halves.data(), count, W(1));
    for (std::size_t i = 0; i < count; ++i) wrong += sums[i] == static_cast<W>(i) + W(0.5) ? 0 : 1;
    for (std::size_t i = count; i < sums.size(); ++i) wrong += sums[i] == sentinel ? 0 : 1;
    INFO("length " << count);
    CHECK(wrong == 0);
  }
}

TEST_CASE("add_scaled converts each element to the work type before multiplying") {
  float acc[] = {1, 1, 1};
  const f16 half[] = {{0x3c01}, {0x7bff}, {0xfc00}};  // 1 + 2^-10, 65504, -inf
  kernels::add_scaled(acc, half, 3, 4.0F);
  CHECK(acc[0] == 1 + 4 * (1 + 0x1p-10F));
  CHECK(acc[1] == 1 + 4 * 65504.0F);  // 262016 is far outside F16, exact in F32
  CHECK(acc[2] == -std::numeric_limits<float>::infinity());

  float narrowed[] = {0};
  const double tenth[] = {0.1};
  kernels::add_scaled(narrowed, tenth, 1, 1.0F);
  CHECK(narrowed[0] == 0.1F);

  double widened[] = {0};
  const bf16 brain[] = {{0x3f81}};  // 1 + 2^-7
  kernels::add_scaled(widened, brain, 1, 3.0);
  CHECK(widened[0] == 3 * (1 + 0x1p-7));
}

TEST_CASE("divide divides twice in sequence, never by the product or by a reciprocal") {
  // 2^100 · 2^40 overflows float; dividing in sequence stays exact.
  float huge[] = {0x1p120F, -0x1p121F};
  kernels::divide(huge, 2, 0x1p100F, 0x1p40F);
  CHECK(huge[0] == 0x1p-20F);
  CHECK(huge[1] == -0x1p-19F);
  // 38.5 / 3 = 0x1.9aaaaap+3, but 38.5 · (1/3) = 0x1.9aaaacp+3.
  float x[] = {38.5F};
  kernels::divide(x, 1, 3.0F, 1.0F);
  CHECK(x[0] == 0x1.9aaaaap+3F);
}

TEST_CASE("all_finite reads every element of every dtype") {
  constexpr float finf = std::numeric_limits<float>::infinity();
  constexpr double dnan = std::numeric_limits<double>::quiet_NaN();
  const float finite32[] = {0.0F, -0.0F, std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min()};
  CHECK(kernels::all_finite(finite32, 4));
  CHECK(kernels::all_finite(finite32, 0));
  const float inf32[] = {1, -finf, 1};
  CHECK_FALSE(kernels::all_finite(inf32, 3));
  const double nan64[] = {1, 2, dnan};
  CHECK_FALSE(kernels::all_finite(nan64, 3));
  CHECK(kernels::all_finite(nan64, 2));

  const f16 finite16[] = {{0x7bff}, {0xfbff}, {0x8001}, {0x0000}};
  CHECK(kernels::all_finite(finite16, 4));
  for (const std::uint16_t special : {0x7c00, 0xfc00, 0x7e00, 0x7c01}) {
    const f16 values[] = {{0x3c00}, {special}};
    CHECK_FALSE(kernels::all_finite(values, 2));
  }
  const bf16 finite_bf16[] = {{0x7f7f}, {0xff7f}, {0x0001}};
  CHECK(kernels::all_finite(finite_bf16, 3));
  for (const std::uint16_t special : {0x7f80, 0xff80, 0x7fc0}) {
    const bf16 values[] = {{special}, {0x3f80}};
    CHECK_FALSE(kernels::all_finite(values, 2));
  }
}

TEST_CASE("convert widens exactly and narrows F64 to F32 to nearest even") {
  const double wide[] = {0.1, 1 + 0x1p-24, 1 + 3 * 0x1p-24, -0x1p-149};
  float narrow[4];
  kernels::convert(narrow, wide, 4);
  CHECK(narrow[0] == 0.1F);
  CHECK(narrow[1] == 1.0F);          // a tie, to the even neighbour below
  CHECK(narrow[2] == 1 + 0x1p-22F);  // a tie, to the even neighbour above
  CHECK(narrow[3] == -0x1p-149F);
  const f16 half[] = {{0x0001}, {0xbc00}};
  double exact[2];
  kernels::convert(exact, half, 2);
  CHECK(exact[0] == 0x1p-24);
  CHECK(exact[1] == -1.0);
}

// Built a second time with OpenMP (test kernels_openmp, 3 threads): ranges this large are split
// across the pool, and must give exactly these bits.
TEST_CASE("large ranges give the bits of the element-by-element loop") {
#ifdef GRADACCUM_HAS_OPENMP
  REQUIRE(omp_get_max_threads() > 1);  // otherwise nothing here would run split
#endif
  std::vector<float> g(large_count);
  std::vector<float> acc(large_count);
  for (std::size_t i = 0; i < large_count; ++i) {
    g[i] = static_cast<float>(i) * 0.1F;
    acc[i] = 1.0F / static_cast<float>(i + 3);
  }
  std::vector<float> expected = acc;
  const float scale = 0.3F;
  for (std::size_t i = 0; i < large_count; ++i) {
    const float product = scale * g[i];
    expected[i] = expected[i] + product;
  }
  kernels::add_scaled(acc.data(), g.data(), large_count, scale);
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < large_count; ++i) mismatches += same_bits(acc[i], expected[i]) ? 0 : 1;
  CHECK(mismatches == 0);

  for (float& x : expected) x = x / 3.0F / 7.0F;
  kernels::divide(acc.data(), large_count, 3.0F, 7.0F);
  mismatches = 0;
  for (std::size_t i = 0; i < large_count; ++i) mismatches += same_bits(acc[i], expected[i]) ? 0 : 1;
  CHECK(mismatches == 0);

  acc[large_count - 1] = std::numeric_limits<float>::infinity();
  CHECK_FALSE(kernels::all_finite(acc.data(), large_count));

  // A mixed pair: 16-bit gradients widened into an F64 window, split the same way.
  std::vector<bf16> brain(large_count);
  std::vector<double> wide(large_count);
  for (std::size_t i = 0; i < large_count; ++i) {
    brain[i].bits = static_cast<std::uint16_t>(0x3c00U + i % 0x3000U);
    wide[i] = 1.0 / static_cast<double>(i + 1);
  }
  std::vector<double> wide_expected = wide;
  for (std::size_t i = 0; i < large_count; ++i) {
    const double product = 0.7 * static_cast<double>(std::bit_cast<float>(std::uint32_t{brain[i].bits} << 16));
    wide_expected[i] = wide_expected[i] + product;
  }
  kernels::add_scaled(wide.data(), brain.data(), large_count, 0.7);
  mismatches = 0;
  for (std::size_t i = 0; i < large_count; ++i) mismatches += same_bits(wide[i], wide_expected[i]) ? 0 : 1;
  CHECK(mismatches == 0);
}

namespace {

/// One strided layout of a gradient: dimensions, element strides, and the offset of element
/// (0, ..., 0) in the backing buffer.
struct layout {
  std::vector<std::size_t> dims;
  std::vector<std::ptrdiff_t> strides;
  std::ptrdiff_t origin;
};

/// The gradient's elements in row-major order, gathered index by index.
template <class T>
std::vector<T> gathered(const std::vector<T>& buffer, const layout& l) {
  std::size_t count = 1;
  for (const std::size_t d : l.dims) count *= d;
  std::vector<T> out;
  for (std::size_t flat = 0; flat < count; ++flat) {
    std::ptrdiff_t offset = l.origin;
    std::size_t rest = flat;
    for (std::size_t axis = l.dims.size(); axis-- > 0;) {
      offset += static_cast<std::ptrdiff_t>(rest % l.dims[axis]) * l.strides[axis];
      rest /= l.dims[axis];
    }
    out.push_back(buffer[static_cast<std::size_t>(offset)]);
  }
  return out;
}

}  // namespace

TEST_CASE_TEMPLATE("add_scaled_strided gives the bits of add_scaled on the same values, for any strides", W, float,
                   double) {
  std::vector<float> buffer(4096);
  for (std::size_t i = 0; i < buffer.size(); ++i) buffer[i] = 0.1F * static_cast<float>(i % 977) - 31.7F;
  const std::vector<layout> layouts{
      {{}, {}, 5},                        // rank 0
      {{7}, {1}, 0},                      // contiguous vector
      {{7}, {-3}, 40},                    // reversed, every third
      {{5, 7}, {7, 1}, 0},                // row-major
      {{5, 7}, {1, 5}, 0},                // column-major
      {{5, 7}, {1, 9}, 3},                // column-major block, leading dimension 9
      {{37, 45}, {1, 40}, 2},             // larger than a tile, ragged edges
      {{37, 45}, {50, 1}, 1},             // row-major block
      {{16, 24}, {1, 19}, 7},             // whole 8 x 8 blocks only
      {{64, 64}, {1, 64}, 0},             // a transpose's layout
      {{9, 17}, {1, -12}, 200},           // columns reversed, one row and one column past the blocks
      {{6, 1, 4}, {4, 999, 1}, 0},        // a unit dimension with any stride
      {{1, 9}, {0, 2}, 0},                // a row vector of a column-major matrix
      {{2, 3, 4, 5}, {1, 2, 6, 24}, 0},   // column-major rank 4 (Eigen::Tensor)
      {{5, 4, 3, 2}, {1, 5, 20, 60}, 0},  // its transpose's layout
      {{3, 4, 5}, {-20, 5, 1}, 60},       // first axis reversed
      {{2, 3, 4}, {3, 1, 6}, 0},          // the fast axis in the middle
      {{0, 4}, {4, 1}, 0},                // empty
  };
  for (const layout& l : layouts) {
    CAPTURE(l.dims.size());
    CAPTURE(l.strides.size() > 1 ? l.strides[1] : 0);
    const std::vector<float> g = gathered(buffer, l);
    std::vector<W> expected(g.size(), W(0.5));
    std::vector<W> ours = expected;
    kernels::add_scaled(expected.data(), g.data(), g.size(), W(1.7));
    kernels::add_scaled_strided(ours.data(), buffer.data() + l.origin, std::span<const std::size_t>(l.dims),
                                std::span<const std::ptrdiff_t>(l.strides), W(1.7));
    CHECK(same_bits(gradaccum::record_values(ours), gradaccum::record_values(expected)));
  }
}

TEST_CASE("add_scaled_strided widens 16-bit gradients exactly through any strides") {
  std::vector<f16> buffer(64);
  for (std::size_t i = 0; i < buffer.size(); ++i) buffer[i] = f16{static_cast<std::uint16_t>(0x3c00U + 37U * i)};
  const layout transposed{{4, 8}, {1, 8}, 0};
  const std::vector<f16> g = gathered(buffer, transposed);
  std::vector<float> expected(g.size(), 0.0F);
  std::vector<float> ours = expected;
  kernels::add_scaled(expected.data(), g.data(), g.size(), 3.0F);
  kernels::add_scaled_strided(ours.data(), buffer.data(), std::span<const std::size_t>(transposed.dims),
                              std::span<const std::ptrdiff_t>(transposed.strides), 3.0F);
  CHECK(same_bits(ours, expected));
}
