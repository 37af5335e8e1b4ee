#pragma once
/// @file
/// @brief Shared pieces of the benchmark binaries: sizes, buffers, counters, the hand-written
/// loops that define the machine's limit, and the command line every binary understands.
///
/// Naming: every case is registered as `<case>/<peer>/<bytes>`, where `<case>` may itself
/// contain slashes (`acc_sum/f32_bf16`), `<peer>` never does (`hand`, `ours_eigen`, `torch_1t`)
/// and `<bytes>` is the size of the pending work-dtype tensor (`acc` below). `benchmarks/report`
/// parses these names, so keep to the scheme.
///
/// Counters every case sets:
///  - `bytes`       bytes one iteration moves (read g, read and write acc for accumulation);
///                  the report turns it into GB/s with the real time;
///  - `allocs/iter` heap allocations per iteration (malloc family, see alloc_counter.cpp);
///  - `threads`     threads the peer may use (libtorch peers).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#define GA_BENCH_OMP_FOR _Pragma("omp parallel for schedule(static)")
#else
#define GA_BENCH_OMP_FOR
#endif

namespace ga_bench {

// ---------------------------------------------------------------------------------------------
// Heap allocation counter (defined in alloc_counter.cpp, one per binary).

/// @brief Number of malloc-family allocations (malloc, calloc, realloc, aligned) so far.
/// Counts at the malloc level because Eigen allocates through malloc, not operator new.
std::uint64_t allocations() noexcept;

/// @brief Measures allocations over the timed loop and reports `allocs/iter`.
class alloc_probe {
 public:
  explicit alloc_probe(benchmark::State& state) : state_(state), start_(allocations()) {}
  alloc_probe(const alloc_probe&) = delete;
  alloc_probe& operator=(const alloc_probe&) = delete;
  ~alloc_probe() {
    const auto delta = static_cast<double>(allocations() - start_);
    const auto iterations = static_cast<double>(std::max<benchmark::IterationCount>(state_.iterations(), 1));
    state_.counters["allocs/iter"] = benchmark::Counter(delta / iterations);
  }

 private:
  benchmark::State& state_;
  std::uint64_t start_;
};

// ---------------------------------------------------------------------------------------------
// Sizes and options.

inline constexpr std::size_t KiB = 1024;
inline constexpr std::size_t MiB = 1024 * KiB;

/// Options shared by every binary; set from the `--ga_*` flags before registration.
struct options {
  std::size_t max_bytes = 256 * MiB;  ///< skip cases whose pending tensor is larger
  double min_time = 0.1;              ///< seconds per repetition (per benchmark, Google Benchmark's MinTime)
  double min_time_large = 0.1;        ///< same, for sizes >= 64 MiB (few iterations suffice there)
  int torch_threads = 0;              ///< threads of the `torch` peers (0: built without libtorch)
};
options& opts() noexcept;

/// Accumulation sizes (bytes of the pending work tensor).
inline const std::vector<std::size_t>& accumulate_sizes() {
  static const std::vector<std::size_t> sizes{4 * KiB, 256 * KiB, 4 * MiB, 64 * MiB, 256 * MiB};
  return sizes;
}

/// "in cache" sizes: the only ones where the plain xtensor `+=` (a temporary per call) runs.
inline bool small_size(std::size_t bytes) noexcept {
  return bytes <= 4 * MiB;
}

inline bool size_enabled(std::size_t bytes) noexcept {
  return bytes <= opts().max_bytes;
}

/// @brief Registers `fn` as `<name>/<bytes>` with the suite-wide settings (real time,
/// nanoseconds, min time by size).
template <class F>
benchmark::internal::Benchmark* add(const std::string& name, std::size_t bytes, F&& fn) {
  auto* b = benchmark::RegisterBenchmark((name + "/" + std::to_string(bytes)).c_str(), std::forward<F>(fn));
  b->UseRealTime()->Unit(benchmark::kNanosecond);
  b->MinTime(bytes >= 64 * MiB ? opts().min_time_large : opts().min_time);
  return b;
}

/// @brief Like `add`, but the case times itself (`state.SetIterationTime`): for passes that
/// need an untimed refill before each timed call (finish_mean consumes its window).
template <class F>
benchmark::internal::Benchmark* add_manual(const std::string& name, std::size_t bytes, F&& fn) {
  auto* b = benchmark::RegisterBenchmark((name + "/" + std::to_string(bytes)).c_str(), std::forward<F>(fn));
  b->UseManualTime()->Unit(benchmark::kNanosecond);
  b->MinTime(bytes >= 64 * MiB ? opts().min_time_large : opts().min_time);
  return b;
}

/// @brief Runs `prepare()` untimed, then times `body()` alone, once per iteration.
/// The two steady_clock reads (~20 ns) are paid by every peer alike.
/// Sets `allocs/iter` from the allocations made inside `body` only.
template <class Prepare, class Body>
void manual_loop(benchmark::State& state, Prepare&& prepare, Body&& body) {
  std::uint64_t allocs = 0;
  for (auto _ : state) {
    prepare();
    const std::uint64_t before = allocations();
    const auto start = std::chrono::steady_clock::now();
    body();
    benchmark::ClobberMemory();
    const auto stop = std::chrono::steady_clock::now();
    allocs += allocations() - before;
    state.SetIterationTime(std::chrono::duration<double>(stop - start).count());
  }
  state.counters["allocs/iter"] =
      static_cast<double>(allocs) / static_cast<double>(std::max<benchmark::IterationCount>(state.iterations(), 1));
}

/// Names of the element-type pairs, `<work>_<incoming>`.
template <class T>
constexpr std::string_view dtype_name();
template <>
constexpr std::string_view dtype_name<float>() {
  return "f32";
}
template <>
constexpr std::string_view dtype_name<double>() {
  return "f64";
}

/// Tags for the 16-bit inputs; the buffers hold their raw bit patterns (std::uint16_t).
struct f16_bits {};
struct bf16_bits {};
template <>
constexpr std::string_view dtype_name<f16_bits>() {
  return "f16";
}
template <>
constexpr std::string_view dtype_name<bf16_bits>() {
  return "bf16";
}

/// Storage type of an incoming element: the type itself, or the bits for 16-bit tags.
template <class In>
using storage_t = std::conditional_t<std::is_same_v<In, f16_bits> || std::is_same_v<In, bf16_bits>, std::uint16_t, In>;

/// An incoming element as a library whose 16-bit float types are F16 and BF16 sees it: the type
/// itself, or that library's 2-byte type of the same bits.
template <class In, class F16, class BF16>
using element_t =
    std::conditional_t<std::is_same_v<In, f16_bits>, F16, std::conditional_t<std::is_same_v<In, bf16_bits>, BF16, In>>;

template <class W, class In>
std::string pair_name() {
  return std::string(dtype_name<W>()) + "_" + std::string(dtype_name<In>());
}

/// Bytes one fused accumulation pass moves: read g, read and write acc.
template <class W, class In>
constexpr double accumulate_bytes(std::size_t n) noexcept {
  return static_cast<double>(n) * static_cast<double>(2 * sizeof(W) + sizeof(storage_t<In>));
}

/// @brief One accumulation case: `acc_<mode>/<work>_<incoming>` at `bytes` (pending tensor size).
struct accumulate_case {
  enum class dtype { f32, f64, f16, bf16 };
  bool mean = false;  ///< accumulate_mean (multiply by the weight) instead of accumulate_sum
  dtype work = dtype::f32;
  dtype incoming = dtype::f32;
  std::size_t bytes = 0;

  [[nodiscard]] std::size_t elements() const noexcept { return bytes / (work == dtype::f64 ? 8 : 4); }
  [[nodiscard]] static std::string_view name_of(dtype d) noexcept {
    switch (d) {
      case dtype::f32: return "f32";
      case dtype::f64: return "f64";
      case dtype::f16: return "f16";
      case dtype::bf16: return "bf16";
    }
    return "?";
  }
  /// `acc_sum/f32_bf16`
  [[nodiscard]] std::string name() const {
    return std::string(mean ? "acc_mean/" : "acc_sum/") + std::string(name_of(work)) + "_" +
           std::string(name_of(incoming));
  }

  /// Calls `f.template operator()<W, In>()` for the case's (work, incoming) pair; In is one of
  /// float, double, f16_bits, bf16_bits.
  template <class F>
  void visit(F&& f) const {
    if (work == dtype::f32) {
      visit_incoming<float>(std::forward<F>(f));
    } else {
      visit_incoming<double>(std::forward<F>(f));
    }
  }

 private:
  template <class W, class F>
  void visit_incoming(F&& f) const {
    switch (incoming) {
      case dtype::f32: f.template operator()<W, float>(); break;
      case dtype::f64: f.template operator()<W, double>(); break;
      case dtype::f16: f.template operator()<W, f16_bits>(); break;
      case dtype::bf16: f.template operator()<W, bf16_bits>(); break;
    }
  }
};

/// @brief `value`, but unknown to the optimizer (a volatile read), so peers see runtime scalars
/// as gradaccum does: a known power-of-two divisor, say, would become an exact reciprocal multiply.
///
/// Not `benchmark::DoNotOptimize(x)` on a scalar: with GCC 12 its `"+m,r"` constraint can hand
/// back garbage for a `double` (a subnormal instead of the value), which makes the peers'
/// arithmetic subnormal and many times slower.
template <class T>
T opaque(T value) noexcept {
  volatile T hidden = value;
  return hidden;
}

/// The weight given to accumulate_mean cases (any value that is not 1 keeps the multiply).
inline constexpr double mean_weight = 3.0;

/// finish_mean cases divide by this loss scale, then by this total weight.
inline constexpr double finish_loss_scale = 1024.0;
inline constexpr double finish_total_weight = 3.0;

// ---------------------------------------------------------------------------------------------
// 16-bit conversions.

/// @brief float -> binary16 bits, round to nearest even (setup only, need not be fast).
inline std::uint16_t float_to_f16_bits(float value) noexcept {
  const auto x = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (x >> 16) & 0x8000U;
  const std::uint32_t abs = x & 0x7fffffffU;
  if (abs >= 0x7f800000U) return static_cast<std::uint16_t>(sign | 0x7c00U | (abs > 0x7f800000U ? 0x200U : 0U));
  if (abs >= 0x477ff000U) return static_cast<std::uint16_t>(sign | 0x7c00U);  // rounds past 65504
  if (abs < 0x38800000U) {                                                    // subnormal or zero half
    const float scaled = std::bit_cast<float>(abs) * 0x1p24F;                 // exact multiple of 2^-24 units
    return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(std::nearbyint(scaled)));
  }
  const std::uint32_t rounded = abs + 0xfffU + ((abs >> 13) & 1U);
  return static_cast<std::uint16_t>(sign | ((rounded - (112U << 23)) >> 13));
}

/// @brief float -> bfloat16 bits, round to nearest even (finite inputs).
inline std::uint16_t float_to_bf16_bits(float value) noexcept {
  const auto x = std::bit_cast<std::uint32_t>(value);
  return static_cast<std::uint16_t>((x + 0x7fffU + ((x >> 16) & 1U)) >> 16);
}

/// @brief binary16 bits -> float, branch-free so a loop over it vectorizes: the reference
/// for what a 16-bit conversion should cost (written independently of the library's kernel).
inline float f16_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = (std::uint32_t{h} & 0x8000U) << 16;
  const std::uint32_t em = std::uint32_t{h} & 0x7fffU;
  // Shift exponent and mantissa into float position; multiplying by 2^112 rebiases the
  // exponent (15 -> 127) and is exact for normals and subnormals alike.
  const float magnitude = std::bit_cast<float>(em << 13) * 0x1p112F;
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(magnitude) | (em >= 0x7c00U ? 0x7f800000U : 0U);
  return std::bit_cast<float>(bits | sign);
}

/// @brief bfloat16 bits -> float: a 16-bit shift.
inline float bf16_bits_to_float(std::uint16_t h) noexcept {
  return std::bit_cast<float>(std::uint32_t{h} << 16);
}

template <class W, class In>
inline W to_work(storage_t<In> g) noexcept {
  if constexpr (std::is_same_v<In, f16_bits>) {
    return static_cast<W>(f16_bits_to_float(g));
  } else if constexpr (std::is_same_v<In, bf16_bits>) {
    return static_cast<W>(bf16_bits_to_float(g));
  } else {
    return static_cast<W>(g);
  }
}

// ---------------------------------------------------------------------------------------------
// Buffers.

/// Page-aligned, touched (so page faults are not timed), never counted as a case's allocation.
struct buffer_deleter {
  void operator()(void* p) const noexcept { std::free(p); }
};
using raw_buffer = std::unique_ptr<void, buffer_deleter>;

inline raw_buffer allocate_pages(std::size_t bytes) {
  const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + 4095) / 4096 * 4096;
  raw_buffer p(std::aligned_alloc(4096, rounded));
  if (!p) throw std::bad_alloc();
  std::memset(p.get(), 0, rounded);
  return p;
}

/// A small buffer (one tensor of a model): malloc'd, 64-byte aligned, zeroed.
inline raw_buffer allocate_pages_small(std::size_t bytes) {
  raw_buffer p(std::aligned_alloc(64, (std::max<std::size_t>(bytes, 1) + 63) / 64 * 64));
  if (!p) throw std::bad_alloc();
  std::memset(p.get(), 0, bytes);
  return p;
}

/// @brief Incoming gradient values: uniform in [-1, 1), fixed seed, no subnormals in 16-bit.
template <class In>
void fill_gradient(storage_t<In>* out, std::size_t n, std::uint32_t seed = 42) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0F, 1.0F);
  for (std::size_t i = 0; i < n; ++i) {
    float v = dist(rng);
    if (std::abs(v) < 1e-3F) v = 1e-3F;  // keep 16-bit values normal
    if constexpr (std::is_same_v<In, f16_bits>) {
      out[i] = float_to_f16_bits(v);
    } else if constexpr (std::is_same_v<In, bf16_bits>) {
      out[i] = float_to_bf16_bits(v);
    } else {
      out[i] = static_cast<In>(v);
    }
  }
}

/// @brief Shared buffers so the many peers of a case read the same bytes and setup (filling
/// hundreds of MiB) happens once per binary, not once per case.
class buffer_pool {
 public:
  /// Incoming gradient of `n` elements (same content for every caller).
  template <class In>
  const storage_t<In>* gradient(std::size_t n) {
    auto& slot = buffers_[{std::string(dtype_name<In>()), n}];
    if (!slot) {
      slot = allocate_pages(n * sizeof(storage_t<In>));
      fill_gradient<In>(static_cast<storage_t<In>*>(slot.get()), n);
    }
    return static_cast<const storage_t<In>*>(slot.get());
  }

  /// A zero-filled work buffer of `n` elements, shared by the peers that accumulate in place.
  template <class W>
  W* work(std::size_t n) {
    auto& slot = buffers_[{"work_" + std::string(dtype_name<W>()), n}];
    if (!slot) slot = allocate_pages(n * sizeof(W));
    return static_cast<W*>(slot.get());
  }

  /// A scratch work buffer distinct from `work` (finish_mean refills it from `work`).
  template <class W>
  W* scratch(std::size_t n) {
    auto& slot = buffers_[{"scratch_" + std::string(dtype_name<W>()), n}];
    if (!slot) slot = allocate_pages(n * sizeof(W));
    return static_cast<W*>(slot.get());
  }

 private:
  std::map<std::pair<std::string, std::size_t>, raw_buffer> buffers_;
};

buffer_pool& pool();

// ---------------------------------------------------------------------------------------------
// The limit: hand-written fused loops.

/// @brief `acc[i] += scale · W(g[i])`, one pass. Not inlined so every peer pays one call.
template <class W, class In>
[[gnu::noinline]] void hand_accumulate(W* __restrict acc, const storage_t<In>* __restrict g, std::size_t n,
                                       W scale) noexcept {
  for (std::size_t i = 0; i < n; ++i) acc[i] += scale * to_work<W, In>(g[i]);
}

/// @brief `hand_accumulate` split across OpenMP threads (static schedule): the limit for code
/// that, like gradaccum with OpenMP, uses every core on large tensors. Same as `hand_accumulate`
/// without OpenMP.
template <class W, class In>
[[gnu::noinline]] void hand_accumulate_mt(W* __restrict acc, const storage_t<In>* __restrict g, std::size_t n,
                                          W scale) noexcept {
  GA_BENCH_OMP_FOR
  for (std::size_t i = 0; i < n; ++i) acc[i] += scale * to_work<W, In>(g[i]);
}

template <class W, class In>
[[gnu::noinline]] void hand_accumulate_sum_mt(W* __restrict acc, const storage_t<In>* __restrict g,
                                              std::size_t n) noexcept {
  GA_BENCH_OMP_FOR
  for (std::size_t i = 0; i < n; ++i) acc[i] += to_work<W, In>(g[i]);
}

/// Threads an OpenMP region would use now (1 without OpenMP).
int openmp_threads() noexcept;

/// @brief `acc[i] += W(g[i])` (a weighted-sum microbatch: no multiply).
template <class W, class In>
[[gnu::noinline]] void hand_accumulate_sum(W* __restrict acc, const storage_t<In>* __restrict g,
                                           std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) acc[i] += to_work<W, In>(g[i]);
}

/// @brief `x[i] = (x[i] / first) / second`: the finish_mean contract (two divisions).
template <class W>
[[gnu::noinline]] void hand_divide(W* __restrict x, std::size_t n, W first, W second) noexcept {
  for (std::size_t i = 0; i < n; ++i) x[i] = x[i] / first / second;
}

// ---------------------------------------------------------------------------------------------
// Command line.

/// @brief Strips and applies the `--ga_*` flags, registers the binary's cases with
/// `register_cases`, then runs Google Benchmark on what is left of the command line.
///
///   --ga_max_bytes=N        skip cases larger than N bytes (suffixes K, M accepted)
///   --ga_min_time=S         seconds per repetition (default 0.1)
///   --ga_min_time_large=S   same for cases >= 64 MiB (default 0.1)
int run(int argc, char** argv, const std::function<void()>& register_cases);

}  // namespace ga_bench
