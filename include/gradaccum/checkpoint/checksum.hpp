#pragma once
/// @file
/// @brief The checksum of a record's content: XXH3-64 (xxHash, header-only) over a canonical
/// byte stream, the same whatever archive the record is written with; and the little-endian
/// writer that builds such bytes.

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string_view>
#include <type_traits>

// XXH3 is the same function in every vector width; a build for baseline x86-64 gets SSE2 only,
// so AVX2 stripe functions are compiled too (as xxHash's own x86 dispatcher does) and chosen at
// run time: they hash values in cache 2-3x faster, which is most of what a checkpoint's checksum
// costs. They are written with the compiler's vector types, not <immintrin.h>, whose
// declarations of every x86 extension take longer to parse than all the rest of a checkpoint's
// headers but cereal and the standard library.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX2__)
#define GRADACCUM_XXH3_AVX2 1
#endif
#define XXH_INLINE_ALL
// GCC 12 reports its own AVX-512 intrinsics (`_mm512_undefined_epi32`) as maybe uninitialized
// when xxHash inlines them under -mavx512f (e.g. -march=native on a recent x86): a false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <xxhash.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace gradaccum::detail {

#ifdef GRADACCUM_XXH3_AVX2
/// xxHash's `XXH3_accumulate_512_avx2` and `XXH3_scrambleAcc_avx2`, lane for lane.
namespace xxh3_avx2 {

using u64x4 = std::uint64_t __attribute__((vector_size(32)));
using i32x8 = int __attribute__((vector_size(32)));

/// The low halves of `a` and `b`'s lanes multiplied to 64 bits (`vpmuludq`, which GCC does
/// not find in the masked product).
[[gnu::target("avx2"), gnu::always_inline]] inline u64x4 mul_low32(u64x4 a, u64x4 b) noexcept {
  return reinterpret_cast<u64x4>(__builtin_ia32_pmuludq256(reinterpret_cast<i32x8>(a), reinterpret_cast<i32x8>(b)));
}

[[gnu::target("avx2"), gnu::always_inline]] inline u64x4 load(const void* at, std::size_t lane) noexcept {
  u64x4 value;
  std::memcpy(&value, static_cast<const unsigned char*>(at) + lane * sizeof value, sizeof value);
  return value;
}

/// acc[i ^ 1] += data[i]; acc[i] += low32(data[i] ^ key[i]) * high32(data[i] ^ key[i]).
[[gnu::target("avx2")]] inline void accumulate_512(void* __restrict acc, const void* __restrict input,
                                                   const void* __restrict secret) noexcept {
  auto* const lanes = static_cast<u64x4*>(acc);  // XXH3 keeps its accumulators 64-byte aligned
  for (std::size_t i = 0; i < 2; ++i) {
    const u64x4 data = load(input, i);
    const u64x4 data_key = data ^ load(secret, i);
    lanes[i] += __builtin_shufflevector(data, data, 1, 0, 3, 2) + mul_low32(data_key, data_key >> 32);
  }
}

/// acc = (acc ^ (acc >> 47) ^ key) * PRIME32_1.
[[gnu::target("avx2")]] inline void scramble_acc(void* __restrict acc, const void* __restrict secret) noexcept {
  auto* const lanes = static_cast<u64x4*>(acc);
  const u64x4 prime = {XXH_PRIME32_1, XXH_PRIME32_1, XXH_PRIME32_1, XXH_PRIME32_1};
  for (std::size_t i = 0; i < 2; ++i) {
    const u64x4 value = lanes[i] ^ (lanes[i] >> 47) ^ load(secret, i);
    lanes[i] = mul_low32(value, prime) + (mul_low32(value >> 32, prime) << 32);
  }
}

}  // namespace xxh3_avx2
#endif

/// @brief Writes integers little-endian and bytes into a buffer the caller sized.
class little_endian_writer {
 public:
  explicit little_endian_writer(unsigned char* at) noexcept : at_(at) {}

  void u8(std::uint8_t value) noexcept { *at_++ = value; }
  void u32(std::uint32_t value) noexcept { put(value, 4); }
  void u64(std::uint64_t value) noexcept { put(value, 8); }
  void bytes(std::string_view text) noexcept {
    if (!text.empty()) std::memcpy(at_, text.data(), text.size());
    at_ += text.size();
  }
  /// Its length (8 bytes), then its bytes: text as `content_hash::add` hashes it.
  void text(std::string_view text) noexcept {
    u64(text.size());
    bytes(text);
  }
  /// Bytes written since `start`, where this writer began.
  [[nodiscard]] std::size_t written(const unsigned char* start) const noexcept {
    return static_cast<std::size_t>(at_ - start);
  }

 private:
  void put(std::uint64_t value, std::size_t size) noexcept {
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(at_, &value, size);
      at_ += size;
    } else {
      for (std::size_t i = 0; i < size; ++i) *at_++ = static_cast<unsigned char>(value >> (8 * i));
    }
  }

  unsigned char* at_;
};

/// @brief A running XXH3-64 over what `add` is given: integers and values as their
/// little-endian bytes, text as its length and bytes.
class content_hash {
 public:
  content_hash() noexcept { XXH3_64bits_reset(&state_); }

  void add_bytes(const void* data, std::size_t size) noexcept {
    if (size == 0) return;
#ifdef GRADACCUM_XXH3_AVX2
    static const bool avx2 = __builtin_cpu_supports("avx2") != 0;
    if (avx2) {
      update_avx2(&state_, data, size);
      return;
    }
#endif
    XXH3_64bits_update(&state_, data, size);
  }
  void add(std::uint64_t value) noexcept {
    const std::uint64_t little = std::endian::native == std::endian::little ? value : byteswap(value);
    add_bytes(&little, sizeof little);
  }
  void add(double value) noexcept { add(std::bit_cast<std::uint64_t>(value)); }
  void add(std::string_view text) noexcept {
    add(static_cast<std::uint64_t>(text.size()));
    add_bytes(text.data(), text.size());
  }
  /// Values of 2, 4 or 8 bytes. Big-endian machines hash them element by element.
  template <class T>
  void add_values(std::span<const T> values) noexcept {
    if constexpr (std::endian::native == std::endian::little) {
      add_bytes(values.data(), values.size_bytes());
    } else {
      using bits = std::conditional_t<sizeof(T) == 2, std::uint16_t,
                                      std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>>;
      for (const T value : values) {
        const bits little = byteswap(std::bit_cast<bits>(value));
        add_bytes(&little, sizeof little);
      }
    }
  }

  /// Values as text archives keep them: a NaN as the default NaN of its sign (its payload is
  /// not written), so a text checkpoint's checksum matches what it reads back.
  template <class T>
  void add_text_values(std::span<const T> values) noexcept {
    if constexpr (std::is_floating_point_v<T>) {
      std::array<T, 256> block{};
      for (std::size_t done = 0; done < values.size(); done += block.size()) {
        const std::size_t count = std::min(block.size(), values.size() - done);
        for (std::size_t i = 0; i < count; ++i) {
          const T value = values[done + i];
          block[i] = std::isnan(value) ? std::copysign(std::numeric_limits<T>::quiet_NaN(), value) : value;
        }
        add_values(std::span<const T>(block.data(), count));
      }
    } else {
      add_values(values);
    }
  }

  [[nodiscard]] std::uint64_t digest() const noexcept { return XXH3_64bits_digest(&state_); }

 private:
  template <class U>
  static constexpr U byteswap(U value) noexcept {
    U swapped = 0;
    for (std::size_t i = 0; i < sizeof(U); ++i) swapped = static_cast<U>((swapped << 8) | ((value >> (8 * i)) & 0xff));
    return swapped;
  }

#ifdef GRADACCUM_XXH3_AVX2
  __attribute__((__target__("avx2"))) static void update_avx2(XXH3_state_t* state, const void* data,
                                                              std::size_t size) noexcept {
    XXH3_update(state, static_cast<const xxh_u8*>(data), size, xxh3_avx2::accumulate_512, xxh3_avx2::scramble_acc);
  }
#endif

  XXH3_state_t state_{};
};

}  // namespace gradaccum::detail
