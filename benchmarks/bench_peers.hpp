#pragma once
/// @file
/// @brief Registration entry points of the peer families, one translation unit each, so the
/// heavy headers (libtorch, xtensor) are compiled once and only where needed. A family that is
/// not built registers nothing: its cases are simply absent from the run and the report.

#include <cstddef>

#include "bench_common.hpp"

namespace ga_bench {

/// Records libtorch's default thread count (when built with it). Call before registering.
void init_peers();

// accumulate (bench_accumulate)
void register_eigen_native(const accumulate_case& c);           // peers_eigen.cpp
void register_xtensor_native(const accumulate_case& c);         // peers_xtensor.cpp
void register_torch_accumulate(const accumulate_case& c);       // peers_torch.cpp
void register_ours_accumulate(const accumulate_case& c);        // ours.cpp
void register_ours_torch_accumulate(const accumulate_case& c);  // ours_torch.cpp (g++ only)

/// Many small parameters (bench_many_small): `count` tensors of `elements` floats each.
struct many_small_case {
  std::size_t count = 10'000;
  std::size_t elements = 64;
  /// `many_small/<count>x<elements>`
  [[nodiscard]] std::string name() const {
    return "many_small/" + std::to_string(count) + "x" + std::to_string(elements);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return count * elements * sizeof(float); }
};
void register_torch_many_small(const many_small_case& c);       // peers_torch.cpp
void register_ours_many_small(const many_small_case& c);        // ours.cpp
void register_ours_torch_many_small(const many_small_case& c);  // ours_torch.cpp (g++ only)

/// finish_mean of one pending tensor of `bytes` bytes in work dtype F64 or F32 (bench_finish).
void register_eigen_native_finish(bool f64, std::size_t bytes);  // peers_eigen.cpp
void register_ours_finish(bool f64, std::size_t bytes);          // ours.cpp

}  // namespace ga_bench
