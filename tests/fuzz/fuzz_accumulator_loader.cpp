/// @file
/// @brief libFuzzer harness for the path users take: `load_checkpoint(path, params,
/// accumulator)` into pre-filled Eigen and xtensor accumulators, in one format
/// ($GRADACCUM_FUZZ_FORMAT: binary, portable_binary or json).
///
/// Each input is written to a file and loaded. A rejected load must throw `gradaccum::error`
/// or `std::filesystem::filesystem_error` and leave the accumulator exactly as it was; an
/// accepted one must save and load back to the same record. Anything else aborts: a crash, a
/// sanitizer report, another exception, or an allocation above -malloc_limit_mb.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/backends/xtensor.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "fuzz_format.hpp"

namespace {

using namespace gradaccum;

checkpoint_format format;

/// The parameters of the seed corpus (make_seed_corpus.cpp) that the backend can hold.
template <class B>
parameter_set<B> seed_parameters() {
  parameter_set<B> params;
  const std::pair<const char*, tensor_shape> geometry[] = {
      {"b", {1, 2}}, {"w", {2, 3}}, {"x", {1, 3}}, {"z", {0, 4}}, {"scalar", {}}};
  for (const auto& [id, declared] : geometry) {
    params.add(id, declared, typename B::device_type{});
  }
  return params;
}

/// A window with pending values, so a load that changed it partly would show.
template <class B>
weighted_gradients_accumulator<B> prefilled(const parameter_set<B>& params) {
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 2.0);
  gradients_params<B> grads;
  const typename B::device_type device{};
  const std::vector<float> values = {0.25F, -3.0F};
  grads.insert("b", B::template from_row_major<float>(std::span<const float>(values), tensor_shape{1, 2}, device));
  acc.accumulate_sum(params, grads, 3.0);
  return acc;
}

/// Bit-for-bit equality (a NaN equals itself): the records' binary bytes.
bool same_bits(const weighted_gradients_record& a, const weighted_gradients_record& b) {
  return serialize_checkpoint(a, checkpoint_format::binary) == serialize_checkpoint(b, checkpoint_format::binary);
}

template <class B>
void load_into(const std::filesystem::path& path) {
  static const parameter_set<B> params = seed_parameters<B>();
  weighted_gradients_accumulator<B> acc = prefilled(params);
  const weighted_gradients_record before = acc.try_to_record();
  try {
    load_checkpoint(path, params, acc, format);
  } catch (const error&) {
    if (!same_bits(acc.try_to_record(), before)) std::abort();  // a rejected load changed the window
    return;
  } catch (const std::filesystem::filesystem_error&) {
    if (!same_bits(acc.try_to_record(), before)) std::abort();
    return;
  }
  const weighted_gradients_record loaded = acc.try_to_record();
  const std::filesystem::path again = path.string() + ".again";
  save_checkpoint(again, acc, format);
  weighted_gradients_accumulator<B> restored = prefilled(params);
  load_checkpoint(again, params, restored, format);
  if (!same_bits(restored.try_to_record(), loaded)) std::abort();  // an accepted load does not round-trip
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  format = fuzz::format_from_environment();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("gradaccum-fuzz-" + std::to_string(::getpid()) + ".ckpt");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  load_into<eigen_backend>(path);
  load_into<xtensor_backend>(path);
  return 0;
}
