#pragma once
/// @file
/// @brief Heap allocation counting and fault injection for tests.
///
/// alloc_failure.cpp replaces the global operator new/delete and, through the linker's
/// `--wrap=malloc` and `--wrap=realloc`, the `malloc` and `realloc` of every object in the executable (Eigen allocates
/// with malloc directly). While an `allocation_probe` is alive, allocations on its thread are counted and the Nth one
/// fails: malloc or realloc returns null, so operator new and Eigen throw `std::bad_alloc`. A run that fails with
/// `gradaccum::error` after the injected failure counts as failed too (a loader may report the failure as what it could
/// not read). Link alloc_failure.cpp into its own executable, so no other test runs under it.

#include <cstddef>
#include <new>

#include <doctest/doctest.h>

#include <gradaccum/error.hpp>

namespace gradaccum::test {

/// @brief Counts this thread's heap allocations while alive; fails the `fail_at`-th (1-based;
/// 0 never fails). Probes do not nest.
class allocation_probe {
 public:
  explicit allocation_probe(std::size_t fail_at = 0) noexcept;
  allocation_probe(const allocation_probe&) = delete;
  allocation_probe& operator=(const allocation_probe&) = delete;
  ~allocation_probe();

  /// Allocations attempted so far, the failed one included.
  [[nodiscard]] std::size_t count() const noexcept;
  /// Whether the `fail_at`-th allocation was reached (and failed).
  [[nodiscard]] bool failed() const noexcept;
};

/// @brief Heap allocations made by `call()` on this thread.
template <class Call>
std::size_t allocations_of(Call&& call) {
  const allocation_probe probe;
  call();
  return probe.count();
}

/// @brief Runs `call()` with its 1st, 2nd, ... allocation failing until a run completes, and
/// checks `unchanged()` (run with allocation allowed) after every failed run.
/// @returns the number of allocations of the run that completed.
template <class Call, class Check>
std::size_t fail_each_allocation(Call&& call, Check&& unchanged) {
  constexpr std::size_t give_up = 100000;
  for (std::size_t fail_at = 1; fail_at < give_up; ++fail_at) {
    bool injected = false;
    std::size_t count = 0;
    {
      const allocation_probe probe(fail_at);
      try {
        call();
      } catch (const std::bad_alloc&) {
        if (!probe.failed()) throw;  // a real allocation failure, not ours
        injected = true;
      } catch (const gradaccum::error&) {
        if (!probe.failed()) throw;  // a library error the failure did not cause
        injected = true;
      }
      count = probe.count();
    }
    if (!injected) {
      // The failure point lies beyond the last allocation: the call ran through.
      CHECK(count < fail_at);
      return count;
    }
    INFO("allocation " << fail_at << " failed");
    unchanged();
  }
  FAIL("the call kept failing after " << give_up << " allocations");
  return give_up;
}

}  // namespace gradaccum::test
