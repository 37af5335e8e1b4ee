/// @file
/// @brief Replaced operator new/delete (replaced_new.hpp) and wrapped malloc behind
/// `allocation_probe` (see alloc_failure.hpp). Link with `-Wl,--wrap=malloc,--wrap=realloc`.

#include "alloc_failure.hpp"

#include <cstddef>
#include <new>

#include "replaced_new.hpp"

namespace {

struct probe_state {
  bool armed = false;
  bool failed = false;
  std::size_t count = 0;
  std::size_t fail_at = 0;
};

// Constant-initialized, so reading it never allocates (it is read inside malloc).
constinit thread_local probe_state probe{};

/// Counts one allocation; false when this one must fail.
bool allocation_allowed() noexcept {
  if (!probe.armed) return true;
  ++probe.count;
  if (probe.count == probe.fail_at) {
    probe.failed = true;
    return false;
  }
  return true;
}

}  // namespace

// The names the linker's --wrap=malloc gives the wrapper and the original.
// NOLINTBEGIN(bugprone-reserved-identifier)
extern "C" {
void* __real_malloc(std::size_t size);
void* __wrap_malloc(std::size_t size);
void* __wrap_malloc(std::size_t size) {
  return allocation_allowed() ? __real_malloc(size) : nullptr;
}
void* __real_realloc(void* memory, std::size_t size);
void* __wrap_realloc(void* memory, std::size_t size);
void* __wrap_realloc(void* memory, std::size_t size) {
  return allocation_allowed() ? __real_realloc(memory, size) : nullptr;
}
}
// NOLINTEND(bugprone-reserved-identifier)

void* replaced_new::allocate(std::size_t size) {
  // Goes through the wrapped malloc, so it is counted (once) there.
  return malloc_or_throw(size);
}

void* replaced_new::allocate_aligned(std::size_t size, std::align_val_t alignment) {
  if (!allocation_allowed()) throw std::bad_alloc();
  return aligned_alloc_or_throw(size, alignment);
}

namespace gradaccum::test {

allocation_probe::allocation_probe(std::size_t fail_at) noexcept {
  probe = {true, false, 0, fail_at};
}
allocation_probe::~allocation_probe() {
  probe.armed = false;
}
std::size_t allocation_probe::count() const noexcept {
  return probe.count;
}
bool allocation_probe::failed() const noexcept {
  return probe.failed;
}

}  // namespace gradaccum::test
