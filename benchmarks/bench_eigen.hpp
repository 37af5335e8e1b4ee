#pragma once
/// @file
/// @brief Eigen element types of the benchmark dtypes: the 16-bit buffers hold the bit
/// patterns of `Eigen::half` / `Eigen::bfloat16` (both plain 2-byte structs).

#include <Eigen/Core>

#include <type_traits>

#include "bench_common.hpp"

namespace ga_bench {

template <class In>
using eigen_element_t = element_t<In, Eigen::half, Eigen::bfloat16>;

static_assert(sizeof(Eigen::half) == 2 && std::is_trivially_copyable_v<Eigen::half>);
static_assert(sizeof(Eigen::bfloat16) == 2 && std::is_trivially_copyable_v<Eigen::bfloat16>);

/// The shared 16-bit buffers, seen as Eigen elements.
template <class In>
const eigen_element_t<In>* as_eigen(const storage_t<In>* p) noexcept {
  return reinterpret_cast<const eigen_element_t<In>*>(p);
}

}  // namespace ga_bench
