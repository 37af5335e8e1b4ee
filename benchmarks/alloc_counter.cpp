/// @file
/// @brief Counts heap allocations of the whole process for the `allocs/iter` counter.
///
/// Eigen allocates with malloc directly, so replacing operator new alone would miss the
/// allocations that matter most here (pending tensors). On glibc this file replaces the malloc
/// family itself, forwarding to glibc's own implementation (`__libc_*`), which glibc supports;
/// operator new goes through malloc and is counted once. Elsewhere it falls back to replacing
/// the global operator new (tests/replaced_new.hpp, shared with the tests). One definition per
/// binary.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "bench_common.hpp"

namespace {
std::atomic<std::uint64_t> allocation_count{0};
inline void count_one() noexcept {
  allocation_count.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

std::uint64_t ga_bench::allocations() noexcept {
  return allocation_count.load(std::memory_order_relaxed);
}

#if defined(__GLIBC__) && !defined(GRADACCUM_BENCH_COUNT_OPERATOR_NEW)

extern "C" {
// glibc's own allocator under its exported internal names.
void* __libc_malloc(std::size_t) noexcept;
void* __libc_calloc(std::size_t, std::size_t) noexcept;
void* __libc_realloc(void*, std::size_t) noexcept;
void* __libc_memalign(std::size_t, std::size_t) noexcept;
void __libc_free(void*) noexcept;

void* malloc(std::size_t size) noexcept {
  count_one();
  return __libc_malloc(size);
}
void* calloc(std::size_t count, std::size_t size) noexcept {
  count_one();
  return __libc_calloc(count, size);
}
void* realloc(void* p, std::size_t size) noexcept {
  count_one();
  return __libc_realloc(p, size);
}
void free(void* p) noexcept {
  __libc_free(p);
}
void* memalign(std::size_t alignment, std::size_t size) noexcept {
  count_one();
  return __libc_memalign(alignment, size);
}
void* aligned_alloc(std::size_t alignment, std::size_t size) noexcept {
  count_one();
  return __libc_memalign(alignment, size);
}
int posix_memalign(void** out, std::size_t alignment, std::size_t size) noexcept {
  if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) return 22;  // EINVAL
  count_one();
  void* p = __libc_memalign(alignment, size);
  if (p == nullptr && size != 0) return 12;  // ENOMEM
  *out = p;
  return 0;
}
}  // extern "C"

#else  // count operator new only

#include "replaced_new.hpp"

void* replaced_new::allocate(std::size_t size) {
  count_one();
  return malloc_or_throw(size);
}
void* replaced_new::allocate_aligned(std::size_t size, std::align_val_t alignment) {
  count_one();
  return aligned_alloc_or_throw(size, alignment);
}

#endif
