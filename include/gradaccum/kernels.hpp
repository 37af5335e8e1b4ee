#pragma once
/// @file
/// @brief Elementwise kernels over contiguous host memory, shared by every CPU backend.
///
/// A backend whose tensors live in host memory (Eigen, xtensor, a `std::vector`) implements its
/// `add_scaled` and `convert` by calling these (`gradaccum::add_scaled` of a `strided_view` picks
/// the contiguous or strided one), and gets the bit-level 16-bit conversion and the optional
/// OpenMP split for free; the library uses the rest on its own buffer.
///
/// The arithmetic is fixed by the accumulation contract, so it is written so the compiler
/// can neither contract it into an FMA nor reassociate it: each element is converted to the
/// work type, multiplied, then added (two roundings). clang's -ffp-contract=fast overrides
/// that by definition (it disregards FP_CONTRACT pragmas); its fast-honor-pragmas does not.
/// Every kernel is elementwise, so splitting a range across threads gives bit-identical results.
///
/// In `gradaccum::kernels` (W a work type, `float` or `double`; T any element type):
///
///     add_scaled(W* acc, const T* g, size_t count, W scale)          acc[i] += scale · W(g[i])
///     add_scaled_strided(W* acc, const T* g, dims, strides, W scale) the same over a strided g
///     add_scaled_transposed(W* acc, const T* g, rows, cols, W scale) g column-major
///     add_scaled_plane(acc, acc_row, g, row_stride, col_stride, rows, cols, scale)  a 2-D block
///     convert(To* out, const From* in, size_t count)                 out[i] = To(in[i])
///     divide(W* x, size_t count, W first, W second)                  x[i] = (x[i] / first) / second
///     sum_of_squares(const W* x, size_t count) -> double             Σ x[i]², one fixed order
///     all_finite(const T* x, size_t count) -> bool                   no NaN or infinity
///     to_work<W>(T value), f16_bits_to_float, bf16_bits_to_float, bits_of   one element

#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include "gradaccum/dtype.hpp"
#include "gradaccum/shape.hpp"

#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

#if defined(_OPENMP) && !defined(GRADACCUM_DISABLE_OPENMP)
#include <omp.h>
#define GRADACCUM_HAS_OPENMP 1
#endif

#ifndef GRADACCUM_PARALLEL_THRESHOLD
/// Elements below which a kernel never splits across threads: waking the pool costs a few
/// microseconds, which only pays off once a tensor no longer fits in the core's own cache.
#define GRADACCUM_PARALLEL_THRESHOLD (std::size_t{1} << 18)
#endif

#if defined(__clang__)
#define GRADACCUM_NO_FP_CONTRACT _Pragma("STDC FP_CONTRACT OFF")
#else
#define GRADACCUM_NO_FP_CONTRACT
#endif

namespace gradaccum::kernels {

/// @brief Widens IEEE binary16 bits to float exactly (normals, subnormals, ±inf, NaN).
///
/// Branch-free, so loops over it vectorize; Eigen's `half` conversion goes through a scalar
/// path that is several times slower.
constexpr float f16_bits_to_float(std::uint16_t bits) noexcept {
  const std::uint32_t sign = (std::uint32_t{bits} & 0x8000U) << 16;
  const std::uint32_t magnitude = std::uint32_t{bits} & 0x7fffU;
  // Exponent and mantissa moved into float position, then multiplied by 2^112 to rebias the
  // exponent (15 -> 127): exact for normals and subnormals alike (subnormal floats must not be
  // flushed, i.e. no -ffast-math). Inf and NaN get the all-ones exponent and keep their payload.
  const float rebiased = std::bit_cast<float>(magnitude << 13) * 0x1p112F;
  const std::uint32_t special = magnitude >= 0x7c00U ? 0x7f800000U : 0U;
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(rebiased) | special | sign);
}

/// @brief Widens bfloat16 bits to float exactly: they are the float's upper half.
constexpr float bf16_bits_to_float(std::uint16_t bits) noexcept {
  return std::bit_cast<float>(std::uint32_t{bits} << 16);
}

/// @brief The bit pattern of a 16-bit element. `std::memcpy`, not `std::bit_cast`: GCC 12 stops
/// vectorizing loops that bit-cast a class type such as `Eigen::bfloat16` (5x slower).
template <element_type T>
  requires(sizeof(T) == 2)
constexpr std::uint16_t bits_of(const T& value) noexcept {
  if (std::is_constant_evaluated()) return std::bit_cast<std::uint16_t>(value);
  std::uint16_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

/// @brief Converts one element to the work type `W` exactly (16-bit inputs through float).
template <class W, element_type T>
constexpr W to_work(const T& value) noexcept {
  if constexpr (dtype_of<T> == float_dtype::f16) {
    return static_cast<W>(f16_bits_to_float(bits_of(value)));
  } else if constexpr (dtype_of<T> == float_dtype::bf16) {
    return static_cast<W>(bf16_bits_to_float(bits_of(value)));
  } else {
    return static_cast<W>(value);
  }
}

}  // namespace gradaccum::kernels

namespace gradaccum::detail {

/// Runs `body(begin, end)` over [0, count), split across the OpenMP pool for large counts.
template <class F>
void for_ranges(std::size_t count, F&& body) noexcept {
#ifdef GRADACCUM_HAS_OPENMP
  if (count >= GRADACCUM_PARALLEL_THRESHOLD && omp_get_max_threads() > 1 && !omp_in_parallel()) {
#pragma omp parallel
    {
      const auto threads = static_cast<std::size_t>(omp_get_num_threads());
      const auto thread = static_cast<std::size_t>(omp_get_thread_num());
      // Contiguous blocks aligned to 64 elements so no two threads share a cache line.
      const std::size_t block = ((count + threads - 1) / threads + 63) / 64 * 64;
      const std::size_t begin = thread * block < count ? thread * block : count;
      const std::size_t end = begin + block < count ? begin + block : count;
      body(begin, end);
    }
    return;
  }
#endif
  body(std::size_t{0}, count);
}

}  // namespace gradaccum::detail

// GCC contracts `acc + scale * g` into an FMA under -march=native even in ISO mode, which
// rounds once instead of twice and breaks the contract (and cross-backend bit identity). And at
// -O2 its "very cheap" vectorizer cost model leaves every loop below scalar (their trip count
// is known only at run time): 8-12x slower than -O3 in cache. The kernels are vectorized
// whatever the optimization level; vectorizing an elementwise loop changes no bits.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off", "tree-vectorize", "vect-cost-model=dynamic")
#endif

namespace gradaccum::detail {

/// One thread's range of `kernels::add_scaled`, through restrict-qualified parameters: a lambda's
/// captured pointers are not, so its loop reloaded them after every store (F16 through F16C ran
/// at a third of the hand loop's speed in cache). Out of line, as `add_scaled_plane` is: the
/// strided walk reaches each from several places, and every inlined copy was vectorized and
/// compiled again (a third of a training loop's object code).
template <class W, element_type T>
[[gnu::noinline]] void add_scaled_range(W* __restrict acc, const T* __restrict g, std::size_t count, W scale) noexcept {
  GRADACCUM_NO_FP_CONTRACT
  std::size_t i = 0;
#ifdef __F16C__
  if constexpr (dtype_of<T> == float_dtype::f16) {
    for (; i + 8 <= count; i += 8) {
      const __m256 widened = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i)));
      if constexpr (std::is_same_v<W, float>) {
        const __m256 product = _mm256_mul_ps(_mm256_set1_ps(scale), widened);
        _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), product));
      } else {
        const __m256d factor = _mm256_set1_pd(scale);
        const __m256d low = _mm256_mul_pd(factor, _mm256_cvtps_pd(_mm256_castps256_ps128(widened)));
        const __m256d high = _mm256_mul_pd(factor, _mm256_cvtps_pd(_mm256_extractf128_ps(widened, 1)));
        _mm256_storeu_pd(acc + i, _mm256_add_pd(_mm256_loadu_pd(acc + i), low));
        _mm256_storeu_pd(acc + i + 4, _mm256_add_pd(_mm256_loadu_pd(acc + i + 4), high));
      }
    }
  }
#endif
  // Four vectors per turn: with one, a 4 KiB F32 add in cache took 27-29 ns (20-37 ns depending
  // on where the loop landed in the binary), with four 19-24 ns wherever it lands (AVX-512, g++ 12).
  // Unrolling an elementwise loop changes no bits.
  if (scale == W(1)) {  // accumulate_sum: 1 · x is x, bit for bit (a NaN quieted either way)
#pragma GCC unroll 4
    for (; i < count; ++i) acc[i] = acc[i] + kernels::to_work<W>(g[i]);
    return;
  }
#pragma GCC unroll 4
  for (; i < count; ++i) {
    const W product = scale * kernels::to_work<W>(g[i]);
    acc[i] = acc[i] + product;
  }
}

}  // namespace gradaccum::detail

namespace gradaccum::kernels {

/// @brief `acc[i] = acc[i] + scale · W(g[i])` for i in [0, count).
///
/// Where the compiler targets F16C (e.g. -march=native on x86-64 since 2012), F16 gradients are
/// widened by the hardware, eight at a time. That conversion is exact too, except that it quiets
/// a signalling NaN, which the multiplication right after it does anyway: the sums have the same
/// bits either way (tests/no_contraction checks every F16 value).
template <class W, element_type T>
void add_scaled(W* __restrict acc, const T* __restrict g, std::size_t count, W scale) noexcept {
  gradaccum::detail::for_ranges(count, [=](std::size_t begin, std::size_t end) noexcept {
    gradaccum::detail::add_scaled_range(acc + begin, g + begin, end - begin, scale);
  });
}

#ifdef __AVX__
/// @brief The F32 plane of `add_scaled_plane` whose rows are g's contiguous axis (a block of
/// a column-major matrix, a transpose), over its whole 8 × 8 blocks: eight 8-element column
/// loads, a transpose in registers, eight row updates. The same multiply and add per element
/// as the scalar loops, so the same bits; a copy through memory instead (the generic tiles)
/// ran at half the speed of Eigen's own strided loop on a 128 × 128 block.
inline void add_scaled_plane_8x8(float* __restrict acc, std::ptrdiff_t acc_row, const float* __restrict g,
                                 std::ptrdiff_t col_stride, std::size_t rows, std::size_t cols, float scale) noexcept {
  const __m256 factor = _mm256_set1_ps(scale);
  for (std::size_t r0 = 0; r0 + 8 <= rows; r0 += 8) {
    for (std::size_t c0 = 0; c0 + 8 <= cols; c0 += 8) {
      const float* in = g + static_cast<std::ptrdiff_t>(r0) + static_cast<std::ptrdiff_t>(c0) * col_stride;
      __m256 v[8];
      for (std::ptrdiff_t k = 0; k < 8; ++k) v[k] = _mm256_loadu_ps(in + k * col_stride);  // column c0 + k
      const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]);
      const __m256 t1 = _mm256_unpackhi_ps(v[0], v[1]);
      const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]);
      const __m256 t3 = _mm256_unpackhi_ps(v[2], v[3]);
      const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]);
      const __m256 t5 = _mm256_unpackhi_ps(v[4], v[5]);
      const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]);
      const __m256 t7 = _mm256_unpackhi_ps(v[6], v[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44);
      const __m256 u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44);
      const __m256 u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44);
      const __m256 u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44);
      const __m256 u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      const __m256 row[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                             _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                             _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                             _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
      for (std::size_t r = 0; r < 8; ++r) {
        float* out = acc + static_cast<std::ptrdiff_t>(r0 + r) * acc_row + static_cast<std::ptrdiff_t>(c0);
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), _mm256_mul_ps(factor, row[r])));
      }
    }
  }
}
#endif

/// @brief `acc[r · acc_row + c] = acc[r · acc_row + c] + scale · W(g[r · row_stride + c · col_stride])`
/// for a `rows × cols` plane, with the arithmetic of `add_scaled`.
///
/// In tiles of 16 × 16: each tile of g is first copied as it is (no arithmetic) into a row-major
/// scratch tile, walking g along its smaller stride, then added row by row with contiguous,
/// vectorizable loops. Reading g across its strides in the adding loop instead makes compilers
/// emit gathers, two to three times slower. The scratch rows are 17 elements long, so the copy's
/// stores down a column do not all fall into one cache set; with rows of 32 and tiles of 32 a
/// block of a column-major matrix added 1.8-2.2x slower (bench_inputs, input_block).
template <class W, element_type T>
[[gnu::noinline]] void add_scaled_plane(W* __restrict acc, std::ptrdiff_t acc_row, const T* __restrict g,
                                        std::ptrdiff_t row_stride, std::ptrdiff_t col_stride, std::size_t rows,
                                        std::size_t cols, W scale) noexcept {
  GRADACCUM_NO_FP_CONTRACT
#ifdef __AVX__
  if constexpr (std::is_same_v<W, float> && std::is_same_v<T, float>) {
    if (row_stride == 1 && rows >= 8 && cols >= 8) {
      // The whole 8 × 8 blocks in registers; the right and bottom strips below.
      const std::size_t block_rows = rows / 8 * 8;
      const std::size_t block_cols = cols / 8 * 8;
      add_scaled_plane_8x8(acc, acc_row, g, col_stride, block_rows, block_cols, scale);
      if (block_cols < cols) {
        add_scaled_plane(acc + block_cols, acc_row, g + static_cast<std::ptrdiff_t>(block_cols) * col_stride, 1,
                         col_stride, block_rows, cols - block_cols, scale);
      }
      if (block_rows < rows) {
        add_scaled_plane(acc + static_cast<std::ptrdiff_t>(block_rows) * acc_row, acc_row,
                         g + static_cast<std::ptrdiff_t>(block_rows), 1, col_stride, rows - block_rows, cols, scale);
      }
      return;
    }
  }
#endif
  constexpr std::size_t tile = 16;
  const bool rows_fast = (row_stride < 0 ? -row_stride : row_stride) < (col_stride < 0 ? -col_stride : col_stride);
  T scratch[tile][tile + 1];
  for (std::size_t r0 = 0; r0 < rows; r0 += tile) {
    const std::size_t tile_rows = r0 + tile < rows ? tile : rows - r0;
    for (std::size_t c0 = 0; c0 < cols; c0 += tile) {
      const std::size_t tile_cols = c0 + tile < cols ? tile : cols - c0;
      const T* in = g + static_cast<std::ptrdiff_t>(r0) * row_stride + static_cast<std::ptrdiff_t>(c0) * col_stride;
      if (rows_fast) {
        for (std::size_t c = 0; c < tile_cols; ++c) {
          for (std::size_t r = 0; r < tile_rows; ++r) {
            scratch[r][c] =
                in[static_cast<std::ptrdiff_t>(r) * row_stride + static_cast<std::ptrdiff_t>(c) * col_stride];
          }
        }
      } else {
        for (std::size_t r = 0; r < tile_rows; ++r) {
          for (std::size_t c = 0; c < tile_cols; ++c) {
            scratch[r][c] =
                in[static_cast<std::ptrdiff_t>(r) * row_stride + static_cast<std::ptrdiff_t>(c) * col_stride];
          }
        }
      }
      for (std::size_t r = 0; r < tile_rows; ++r) {
        W* out = acc + static_cast<std::ptrdiff_t>(r0 + r) * acc_row + static_cast<std::ptrdiff_t>(c0);
        for (std::size_t c = 0; c < tile_cols; ++c) {
          const W product = scale * to_work<W>(scratch[r][c]);
          out[c] = out[c] + product;
        }
      }
    }
  }
}

/// @brief `acc[r · cols + c] = acc[r · cols + c] + scale · W(g[r + c · rows])`: a column-major
/// `rows × cols` gradient added into row-major sums, with the arithmetic of `add_scaled`.
template <class W, element_type T>
void add_scaled_transposed(W* __restrict acc, const T* __restrict g, std::size_t rows, std::size_t cols,
                           W scale) noexcept {
  constexpr std::size_t tile = 32;
  gradaccum::detail::for_ranges((rows + tile - 1) / tile, [=](std::size_t begin, std::size_t end) noexcept {
    const std::size_t r0 = begin * tile;
    const std::size_t r1 = end * tile < rows ? end * tile : rows;
    add_scaled_plane(acc + r0 * cols, static_cast<std::ptrdiff_t>(cols), g + r0, 1, static_cast<std::ptrdiff_t>(rows),
                     r1 - r0, cols, scale);
  });
}

/// @brief `acc[i] = acc[i] + scale · W(g[offset(i)])` over a rank-N strided gradient in row-major
/// order: `acc` is row-major over `dims`, element (i0, ..., ik) of g is at
/// `g[i0 · strides[0] + ... + ik · strides[k]]`. Same arithmetic, so the same bits, as `add_scaled`.
///
/// Unit dimensions are dropped and dimensions contiguous in both acc and g merged first, so a
/// row-major input (of any rank, or a vector of any orientation) takes `add_scaled` itself. What
/// remains is walked as planes: rows of contiguous runs when g's innermost stride is 1, else
/// 32 × 32 tiles of the innermost dimension against g's fastest one (a column-major matrix, a
/// transpose, a column-major Eigen::Tensor).
template <class W, element_type T>
void add_scaled_strided(W* __restrict acc, const T* g, std::span<const std::size_t> dims,
                        std::span<const std::ptrdiff_t> strides, W scale) noexcept {
  std::array<std::size_t, max_rank> d{};
  std::array<std::ptrdiff_t, max_rank> s{};
  std::size_t rank = 0;
  for (std::size_t axis = 0; axis < dims.size(); ++axis) {
    if (dims[axis] == 0) return;
    if (dims[axis] == 1) continue;
    if (rank > 0 && s[rank - 1] == strides[axis] * static_cast<std::ptrdiff_t>(dims[axis])) {
      d[rank - 1] *= dims[axis];
      s[rank - 1] = strides[axis];
    } else {
      d[rank] = dims[axis];
      s[rank] = strides[axis];
      ++rank;
    }
  }
  if (rank == 0) return add_scaled(acc, g, 1, scale);
  if (rank == 1 && s[0] == 1) return add_scaled(acc, g, d[0], scale);
  if (rank == 2 && s[0] == 1 && s[1] == static_cast<std::ptrdiff_t>(d[0])) {
    return add_scaled_transposed(acc, g, d[0], d[1], scale);
  }
  // Row-major strides of acc, and g's fastest axis (the tile's row axis when it is not the last).
  std::array<std::ptrdiff_t, max_rank> a{};
  a[rank - 1] = 1;
  for (std::size_t axis = rank - 1; axis-- > 0;) a[axis] = a[axis + 1] * static_cast<std::ptrdiff_t>(d[axis + 1]);
  const std::size_t last = rank - 1;
  std::size_t fast = last;
  for (std::size_t axis = 0; axis < last; ++axis) {
    const std::ptrdiff_t magnitude = s[axis] < 0 ? -s[axis] : s[axis];
    const std::ptrdiff_t best = s[fast] < 0 ? -s[fast] : s[fast];
    if (magnitude < best) fast = axis;
  }
  const std::size_t plane_rows = fast == last ? 1 : d[fast];
  // Every other axis is walked by an odometer, one plane per step.
  std::array<std::size_t, max_rank> index{};
  std::ptrdiff_t acc_offset = 0;
  std::ptrdiff_t g_offset = 0;
  for (;;) {
    if (fast == last && s[last] == 1) {
      add_scaled(acc + acc_offset, g + g_offset, d[last], scale);
    } else {
      add_scaled_plane(acc + acc_offset, a[fast], g + g_offset, s[fast], s[last], plane_rows, d[last], scale);
    }
    bool advanced = false;
    for (std::size_t axis = last; axis-- > 0 && !advanced;) {
      if (axis == fast) continue;
      if (++index[axis] < d[axis]) {
        acc_offset += a[axis];
        g_offset += s[axis];
        advanced = true;
      } else {
        acc_offset -= a[axis] * static_cast<std::ptrdiff_t>(d[axis] - 1);
        g_offset -= s[axis] * static_cast<std::ptrdiff_t>(d[axis] - 1);
        index[axis] = 0;
      }
    }
    if (!advanced) return;
  }
}

/// @brief `Σ x[i]²` for i in [0, count), in F64 whatever W, in one fixed order: element i goes to
/// lane i mod 8, each lane adds its squares in index order, and the lanes are combined as
/// `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
///
/// Fixed lanes let the loop vectorize without reassociating anything, so the bits depend only on
/// the values and `count`, never on the compiler, the target or a thread split; zeros appended
/// after the last element leave them unchanged. An F32 square is exact in F64.
template <class W>
double sum_of_squares(const W* x, std::size_t count) noexcept {
  GRADACCUM_NO_FP_CONTRACT
  constexpr std::size_t lanes = 8;
  std::array<double, lanes> lane{};
  std::size_t i = 0;
  for (; i + lanes <= count; i += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) {
      const auto v = static_cast<double>(x[i + j]);
      const double square = v * v;
      lane[j] = lane[j] + square;
    }
  }
  for (std::size_t j = 0; i + j < count; ++j) {
    const auto v = static_cast<double>(x[i + j]);
    const double square = v * v;
    lane[j] = lane[j] + square;
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/// @brief `x[i] = (x[i] / first) / second`: two divisions in sequence, never one by their
/// product (which may overflow) and never a reciprocal multiply (which rounds differently).
template <class W>
void divide(W* x, std::size_t count, W first, W second) noexcept {
  gradaccum::detail::for_ranges(count, [=](std::size_t begin, std::size_t end) noexcept {
    for (std::size_t i = begin; i < end; ++i) x[i] = x[i] / first / second;
  });
}

/// @brief Whether every element is finite: whether no exponent field is all ones. Reads
/// everything (no early exit) and ORs integer comparisons, which vectorize with any SIMD set (a
/// floating-point test folded into a bool stayed one element per iteration, 9x slower).
template <element_type T>
bool all_finite(const T* x, std::size_t count) noexcept {
  constexpr float_dtype dtype = dtype_of<T>;
  using bits_type = std::conditional_t<dtype == float_dtype::f64, std::uint64_t,
                                       std::conditional_t<dtype == float_dtype::f32, std::uint32_t, std::uint16_t>>;
  constexpr auto exponent = static_cast<bits_type>(dtype == float_dtype::f64   ? 0x7ff0000000000000U
                                                   : dtype == float_dtype::f32 ? 0x7f800000U
                                                   : dtype == float_dtype::f16 ? 0x7c00U
                                                                               : 0x7f80U);
  bits_type seen = 0;  // all ones once an exponent field was
  for (std::size_t i = 0; i < count; ++i) {
    bits_type bits;
    if constexpr (dtype == float_dtype::f32 || dtype == float_dtype::f64) {
      bits = std::bit_cast<bits_type>(x[i]);
    } else {
      bits = bits_of(x[i]);
    }
    seen |= static_cast<bits_type>((bits & exponent) == exponent ? ~bits_type{0} : bits_type{0});
  }
  return seen == 0;
}

/// @brief `out[i] = To(in[i])` for a work type `To`, exactly for widening conversions and
/// rounding to nearest for F64 → F32.
template <class To, element_type From>
void convert(To* __restrict out, const From* __restrict in, std::size_t count) noexcept {
  for (std::size_t i = 0; i < count; ++i) out[i] = to_work<To>(in[i]);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

}  // namespace gradaccum::kernels
