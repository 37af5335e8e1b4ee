#pragma once
/// @file
/// @brief The global operator new and delete, replaced once for the allocation counters and
/// fault injectors of the tests and benchmarks (tests/alloc_failure.cpp,
/// benchmarks/alloc_counter.cpp).
///
/// Every form of new takes its memory from `replaced_new::allocate` or
/// `replaced_new::allocate_aligned`, which the including file defines (counting, failing or
/// recording there); the nothrow forms turn their `std::bad_alloc` into a null pointer, as the
/// standard's own do. Every delete is `std::free`. A replacement may not be inline, so include
/// this header in exactly one source file of a binary.

#include <cstddef>
#include <cstdlib>
#include <new>

namespace replaced_new {

/// @brief `size` bytes (at least 1), or std::bad_alloc; defined by the including file.
void* allocate(std::size_t size);
/// @brief `size` bytes aligned to `alignment`, or std::bad_alloc; defined by the including file.
void* allocate_aligned(std::size_t size, std::align_val_t alignment);

/// @brief What the default operator new does: malloc of at least 1 byte, or std::bad_alloc.
inline void* malloc_or_throw(std::size_t size) {
  if (void* memory = std::malloc(size == 0 ? 1 : size)) return memory;
  throw std::bad_alloc();
}

/// @brief aligned_alloc of `size` rounded up to a multiple of `alignment` (as aligned_alloc
/// requires), or std::bad_alloc.
inline void* aligned_alloc_or_throw(std::size_t size, std::align_val_t alignment) {
  const auto align = static_cast<std::size_t>(alignment);
  if (void* memory = std::aligned_alloc(align, (size + align - 1) / align * align)) return memory;
  throw std::bad_alloc();
}

}  // namespace replaced_new

void* operator new(std::size_t size) {
  return replaced_new::allocate(size);
}
void* operator new[](std::size_t size) {
  return replaced_new::allocate(size);
}
void* operator new(std::size_t size, const std::nothrow_t& /*tag*/) noexcept {
  try {
    return replaced_new::allocate(size);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, const std::nothrow_t& /*tag*/) noexcept {
  try {
    return replaced_new::allocate(size);
  } catch (...) {
    return nullptr;
  }
}
void* operator new(std::size_t size, std::align_val_t alignment) {
  return replaced_new::allocate_aligned(size, alignment);
}
void* operator new[](std::size_t size, std::align_val_t alignment) {
  return replaced_new::allocate_aligned(size, alignment);
}
void* operator new(std::size_t size, std::align_val_t alignment, const std::nothrow_t& /*tag*/) noexcept {
  try {
    return replaced_new::allocate_aligned(size, alignment);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, std::align_val_t alignment, const std::nothrow_t& /*tag*/) noexcept {
  try {
    return replaced_new::allocate_aligned(size, alignment);
  } catch (...) {
    return nullptr;
  }
}

void operator delete(void* memory) noexcept {
  std::free(memory);
}
void operator delete[](void* memory) noexcept {
  std::free(memory);
}
void operator delete(void* memory, std::size_t /*size*/) noexcept {
  std::free(memory);
}
void operator delete[](void* memory, std::size_t /*size*/) noexcept {
  std::free(memory);
}
void operator delete(void* memory, std::align_val_t /*alignment*/) noexcept {
  std::free(memory);
}
void operator delete[](void* memory, std::align_val_t /*alignment*/) noexcept {
  std::free(memory);
}
void operator delete(void* memory, std::size_t /*size*/, std::align_val_t /*alignment*/) noexcept {
  std::free(memory);
}
void operator delete[](void* memory, std::size_t /*size*/, std::align_val_t /*alignment*/) noexcept {
  std::free(memory);
}
void operator delete(void* memory, const std::nothrow_t& /*tag*/) noexcept {
  std::free(memory);
}
void operator delete[](void* memory, const std::nothrow_t& /*tag*/) noexcept {
  std::free(memory);
}
void operator delete(void* memory, std::align_val_t /*alignment*/, const std::nothrow_t& /*tag*/) noexcept {
  std::free(memory);
}
void operator delete[](void* memory, std::align_val_t /*alignment*/, const std::nothrow_t& /*tag*/) noexcept {
  std::free(memory);
}
