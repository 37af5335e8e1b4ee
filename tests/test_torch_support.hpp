#pragma once
/// @file
/// @brief What the libtorch tests (test_torch_inputs.cpp, test_torch_backends.cpp and
/// test_torch_modules.cpp) share: libtorch included before doctest, and tensors read back as floats.

// Before doctest: c10 defines a CHECK macro, which doctest's must replace.
#include <torch/torch.h>

#include <gradaccum/backends/torch.hpp>

#include <vector>

#include <doctest/doctest.h>

namespace gradaccum::test {

/// Row-major float values of a tensor of any dtype, layout or device, with the negation bit.
inline std::vector<float> floats_of(const at::Tensor& t) {
  const at::Tensor flat = t.to(at::kCPU).to(at::kFloat).resolve_neg().contiguous();
  return {flat.data_ptr<float>(), flat.data_ptr<float>() + flat.numel()};
}

}  // namespace gradaccum::test
