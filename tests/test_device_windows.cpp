// Windows on a backend's devices (`<gradaccum/device_buffers.hpp>`), through the test-only
// `device_backend`: the same bits as the host window of `vector_backend` on the same inputs,
// one buffer per device, results that view the device buffers, copies that own theirs, and
// rejections that change nothing.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>
#if GRADACCUM_TEST_HAVE_CEREAL
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/checkpoint_async.hpp>
#endif

#include "device_backend.hpp"
#include "test_helpers.hpp"

namespace gradaccum::test {
namespace {

using device = device_backend;
using host = vector_backend;

/// Random values of every magnitude the window meets, rounded to T (F32, F16 or BF16 bits).
template <class T>
std::vector<T> random_values(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> value(-4.0F, 4.0F);
  std::vector<T> out(n);
  std::vector<float> f(n);
  for (float& v : f) v = value(rng);
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, &f[i], 4);
      if constexpr (std::is_same_v<T, bf16>) {
        out[i].bits = static_cast<std::uint16_t>(bits >> 16);
      } else {  // a binary16 in the normal range: sign, 5-bit exponent, top 10 mantissa bits
        const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000U);
        const int exponent = static_cast<int>((bits >> 23) & 0xFFU) - 127 + 15;
        const auto clamped = static_cast<std::uint16_t>(std::clamp(exponent, 1, 30));
        out[i].bits = static_cast<std::uint16_t>(sign | (clamped << 10) | ((bits >> 13) & 0x3FFU));
      }
    }
    return out;
  }
}

struct geometry {
  const char* id;
  tensor_shape shape;
  int device;
};
// Two devices, interleaved, with sizes that are not multiples of the alignment; "e" spans
// several of the pieces a device window is staged through (16384 elements).
const std::vector<geometry> model{
    {"a", {2, 3}, 0}, {"b", {17}, 1}, {"c", {5, 7}, 0}, {"d", {1}, 1}, {"e", {200, 201}, 1}};

template <class B>
parameter_set<B> parameters() {
  parameter_set<B> params;
  for (const auto& g : model) params.add(g.id, g.shape, g.device);
  return params;
}

/// The four microbatches' gradients of element type T, the same values for both backends.
template <class T>
std::vector<std::vector<std::vector<T>>> microbatches(std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::vector<T>>> out(4);
  for (auto& mb : out) {
    for (const auto& g : model) mb.push_back(random_values<T>(*g.shape.checked_element_count(), rng));
  }
  return out;
}

template <class B, class T>
gradients_params<B> gradients(const std::vector<std::vector<T>>& values, std::size_t skip = SIZE_MAX) {
  gradients_params<B> grads;
  for (std::size_t k = 0; k < model.size(); ++k) {
    if (k == skip) continue;
    grads.insert(model[k].id, typename B::template tensor<T>{values[k], model[k].shape, model[k].device});
  }
  return grads;
}

std::vector<char> checkpoint_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <class W, class B>
std::vector<W> result_values(const flat_gradients<B>& g, std::string_view id) {
  const auto view = g.template get<W>(id);
  REQUIRE(view.has_value());
  return {view->values.begin(), view->values.end()};
}

/// Every present id's values, bit for bit, and the same ids present.
template <class W>
void check_same_bits(const flat_gradients<device>& on_device, const flat_gradients<host>& on_host) {
  REQUIRE(on_device.size() == on_host.size());
  for (const auto& g : model) {
    REQUIRE(on_device.contains(g.id) == on_host.contains(g.id));
    if (!on_host.contains(g.id)) continue;
    const std::vector<W> a = result_values<W>(on_device, g.id);
    const std::span<const W> b = on_host.template values<W>(g.id);
    REQUIRE(a.size() == b.size());
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(W)) == 0);
  }
}

template <class W, class T>
void check_window(bool mean) {
  const float_dtype work = dtype_of<W>;
  const auto batches = microbatches<T>(mean ? 7U : 11U);
  weighted_gradients_accumulator<device> on_device(work, 1000.0);
  weighted_gradients_accumulator<host> on_host(work, 1000.0);
  const auto device_params = parameters<device>();
  const auto host_params = parameters<host>();
  const double weights[] = {3.0, 1.0, 7.0, 4.0};  // total 15, loss scale 1000: divisions round
  for (int window = 0; window < 2; ++window) {    // the second reuses the first's buffers
    for (std::size_t k = 0; k < batches.size(); ++k) {
      const std::size_t skip = k == 1 ? 2 : SIZE_MAX;  // "c" absent from one microbatch
      if (mean) {
        on_device.accumulate_mean(device_params, gradients<device, T>(batches[k], skip), weights[k]);
        on_host.accumulate_mean(host_params, gradients<host, T>(batches[k], skip), weights[k]);
      } else {
        on_device.accumulate_sum(device_params, gradients<device, T>(batches[k], skip), weights[k]);
        on_host.accumulate_sum(host_params, gradients<host, T>(batches[k], skip), weights[k]);
      }
    }
    check_same_bits<W>(on_device.pending(), on_host.pending());
    const auto device_result = window == 0 ? on_device.finish_mean(device_params) : on_device.finish_sums();
    const auto host_result = window == 0 ? on_host.finish_mean(host_params) : on_host.finish_sums();
    check_same_bits<W>(device_result.gradients, host_result.gradients);
  }
}

TEST_CASE_TEMPLATE("a device window gives the host window's bits", W, float, double) {
  SUBCASE("F32 gradients, accumulate_mean then finish_mean, accumulate_sum then finish_sums") {
    check_window<W, float>(true);
    check_window<W, float>(false);
  }
  SUBCASE("BF16 gradients") {
    check_window<W, bf16>(true);
  }
  SUBCASE("F16 gradients") {
    check_window<W, f16>(false);
  }
}

TEST_CASE("a device window keeps one buffer per device; results view it on the parameter's device") {
  weighted_gradients_accumulator<device> window(float_dtype::f32, 1.0);
  const auto params = parameters<device>();
  window.accumulate_sum(params, gradients<device, float>(microbatches<float>(3)[0]), 1.0);
  const auto result = window.finish_sums();
  for (const auto& g : model) {
    const auto view = result.gradients.get<float>(g.id);
    REQUIRE(view.has_value());
    CHECK(view->device == g.device);
    CHECK(view->shape == g.shape);
  }
  CHECK_FALSE(result.gradients.get<float>("missing").has_value());
  GRADACCUM_CHECK_REJECTED(result.gradients.get<double>("a"), errc::invalid_dtype, "");
}

TEST_CASE("a copy of a device result owns its buffers; the window's next sums do not reach it") {
  weighted_gradients_accumulator<device> window(float_dtype::f32, 1.0);
  const auto params = parameters<device>();
  const auto batches = microbatches<float>(5);
  window.accumulate_sum(params, gradients<device, float>(batches[0], 1), 1.0);  // "b" absent
  flat_gradients<device> copy;
  std::vector<float> expected;
  {
    const auto result = window.finish_sums();
    copy = result.gradients;
    expected = result_values<float>(result.gradients, "a");
  }
  window.accumulate_sum(params, gradients<device, float>(batches[1]), 1.0);  // reuses the result's buffer
  CHECK(result_values<float>(copy, "a") == expected);
  CHECK_FALSE(copy.contains("b"));
  const auto second = window.finish_sums();
  CHECK(result_values<float>(second.gradients, "a") == batches[1][0]);  // zeroed before reuse
  CHECK(result_values<float>(second.gradients, "b") == batches[1][1]);
}

TEST_CASE("F32 sums of a device window widen to F64 exactly when an F64 gradient arrives") {
  gradients_accumulator<device> on_device;
  gradients_accumulator<host> on_host;
  const auto device_params = parameters<device>();
  const auto host_params = parameters<host>();
  const auto f32 = microbatches<float>(9);
  const auto f64 = microbatches<float>(10);
  on_device.accumulate(device_params, gradients<device, float>(f32[0]));
  on_host.accumulate(host_params, gradients<host, float>(f32[0]));
  std::vector<std::vector<double>> wide;
  for (const auto& v : f64[0]) wide.emplace_back(v.begin(), v.end());
  on_device.accumulate(device_params, gradients<device, double>(wide));
  on_host.accumulate(host_params, gradients<host, double>(wide));
  REQUIRE(on_device.pending().dtype() == float_dtype::f64);
  check_same_bits<double>(on_device.pending(), on_host.pending());
}

TEST_CASE("a gradient on the other device is refused and the device window keeps its sums") {
  weighted_gradients_accumulator<device> window(float_dtype::f32, 1.0);
  const auto params = parameters<device>();
  const auto batches = microbatches<float>(13);
  window.accumulate_sum(params, gradients<device, float>(batches[0]), 1.0);
  const std::vector<float> before = result_values<float>(window.pending(), "b");
  gradients_params<device> wrong;
  wrong.insert("a", device::tensor<float>{batches[1][0], model[0].shape, 0});
  wrong.insert("b", device::tensor<float>{batches[1][1], model[1].shape, 0});  // "b" lives on device 1
  GRADACCUM_CHECK_REJECTED(window.accumulate_sum(params, wrong, 1.0), errc::parameter_mismatch, "b");
  CHECK(result_values<float>(window.pending(), "b") == before);
  CHECK(result_values<float>(window.pending(), "a") == batches[0][0]);
  CHECK(window.state().microbatches == 1);
}

/// The same window on both backends: three microbatches, "c" absent from all.
template <class W>
std::pair<accumulated_gradients<device>, accumulated_gradients<host>> finished_windows() {
  const auto batches = microbatches<float>(17);
  weighted_gradients_accumulator<device> on_device(dtype_of<W>, 1.0);
  weighted_gradients_accumulator<host> on_host(dtype_of<W>, 1.0);
  for (std::size_t k = 0; k < 3; ++k) {
    on_device.accumulate_mean(parameters<device>(), gradients<device, float>(batches[k], 2), 3.0 + double(k));
    on_host.accumulate_mean(parameters<host>(), gradients<host, float>(batches[k], 2), 3.0 + double(k));
  }
  return {on_device.finish_mean(parameters<device>()), on_host.finish_mean(parameters<host>())};
}

TEST_CASE_TEMPLATE("the norm, clipping and non-finite ids of a device window are the host window's, bit for bit", W,
                   float, double) {
  auto [on_device, on_host] = finished_windows<W>();
  CHECK(std::bit_cast<std::uint64_t>(global_norm(on_device)) == std::bit_cast<std::uint64_t>(global_norm(on_host)));
  const double norm = clip_by_global_norm(on_device, 1.0);
  CHECK(std::bit_cast<std::uint64_t>(norm) == std::bit_cast<std::uint64_t>(clip_by_global_norm(on_host, 1.0)));
  REQUIRE(norm > 1.0);  // so the values were scaled
  check_same_bits<W>(on_device.gradients, on_host.gradients);
  CHECK(on_device.gradients.non_finite().empty());

  weighted_gradients_accumulator<device> window(dtype_of<W>, 1.0);
  auto values = microbatches<float>(19)[0];
  values[4][30000] = std::numeric_limits<float>::infinity();  // in the second piece of "e"
  values[1][3] = std::numeric_limits<float>::quiet_NaN();
  window.accumulate_sum(parameters<device>(), gradients<device, float>(values), 1.0);
  device::largest_read = 0;
  device::finite_checks = 0;
  CHECK(window.non_finite() == std::vector<std::string>{"b", "e"});
  CHECK(device::largest_read == 0);  // checked on the device, one segment at a time
  CHECK(device::finite_checks == parameters<device>().size());
  auto result = window.finish_sums();
  const std::vector<W> before = result_values<W>(result.gradients, "a");
  CHECK(std::isnan(clip_by_global_norm(result, 1.0)));
  CHECK(result_values<W>(result.gradients, "a") == before);  // a non-finite norm clips nothing
}

TEST_CASE_TEMPLATE("without a check on the device, a device window's non-finite ids are read through host pieces", W,
                   float, double) {
  using reading = basic_device_backend<false>;
  weighted_gradients_accumulator<reading> window(dtype_of<W>, 1.0);
  auto values = microbatches<float>(19)[0];
  CHECK(window.non_finite().empty());
  window.accumulate_sum(parameters<reading>(), gradients<reading, float>(values), 1.0);
  CHECK(window.non_finite().empty());
  values[4][30000] = std::numeric_limits<float>::infinity();  // in the second piece of "e"
  values[1][3] = -std::numeric_limits<float>::quiet_NaN();
  window.accumulate_sum(parameters<reading>(), gradients<reading, float>(values), 1.0);
  reading::largest_read = 0;
  CHECK(window.non_finite() == std::vector<std::string>{"b", "e"});
  CHECK(reading::largest_read == detail::staged_elements);  // "e" holds more than one piece
}

TEST_CASE("a device window's record is the host window's; it loads back into either") {
  const auto batches = microbatches<float>(23);
  weighted_gradients_accumulator<device> window(float_dtype::f32, 1.0);
  weighted_gradients_accumulator<host> reference(float_dtype::f32, 1.0);
  window.accumulate_mean(parameters<device>(), gradients<device, float>(batches[0], 2), 5.0);
  reference.accumulate_mean(parameters<host>(), gradients<host, float>(batches[0], 2), 5.0);
  const weighted_gradients_record record = window.try_to_record();
  GRADACCUM_CHECK_SAME_BITS(record, reference.try_to_record());

  weighted_gradients_accumulator<device> restored(float_dtype::f32, 1.0);
  restored.load_record(parameters<device>(), reference.try_to_record());
  check_same_bits<float>(restored.pending(), reference.pending());
  CHECK(restored.state().total_weight == 5.0);
  weighted_gradients_accumulator<host> on_the_host(float_dtype::f32, 1.0);
  on_the_host.load_record(parameters<host>(), record);
  check_same_bits<float>(window.pending(), on_the_host.pending());

  // A record that does not fit is refused and the device window keeps its sums.
  weighted_gradients_record wrong = record;
  wrong.gradients.tensors.back().shape = {201, 200};
  GRADACCUM_CHECK_REJECTED(restored.load_record(parameters<device>(), wrong), errc::parameter_mismatch, "e");
  check_same_bits<float>(restored.pending(), reference.pending());
}

#if GRADACCUM_TEST_HAVE_CEREAL
TEST_CASE("a device window's checkpoint holds the host window's bytes and restores its bits") {
  const auto batches = microbatches<float>(29);
  weighted_gradients_accumulator<device> window(float_dtype::f64, 2.0);
  weighted_gradients_accumulator<host> reference(float_dtype::f64, 2.0);
  for (std::size_t k = 0; k < 2; ++k) {
    window.accumulate_sum(parameters<device>(), gradients<device, float>(batches[k], 2), 7.0);
    reference.accumulate_sum(parameters<host>(), gradients<host, float>(batches[k], 2), 7.0);
  }
  const auto directory = std::filesystem::temp_directory_path() / "gradaccum_test_device_windows";
  std::filesystem::create_directories(directory);
  for (const char* name : {"window.bin", "window.json"}) {
    INFO(name);
    const auto on_device_file = directory / (std::string("device_") + name);
    const auto on_host_file = directory / (std::string("host_") + name);
    save_checkpoint(on_device_file, window);
    save_checkpoint(on_host_file, reference);
    CHECK(checkpoint_bytes(on_device_file) == checkpoint_bytes(on_host_file));
    weighted_gradients_accumulator<device> restored(float_dtype::f64, 2.0);
    load_checkpoint(on_host_file, parameters<device>(), restored);
    check_same_bits<double>(restored.pending(), reference.pending());
    CHECK(restored.state().microbatches == 2);
  }
  // Saved through one host piece at a time: the largest read is a piece of the 256 KiB the
  // archive writes at once, not "e" (40,200 F64 values) and not the window.
  device_backend::largest_read = 0;
  save_checkpoint(directory / "staged.bin", window);
  CHECK(device_backend::largest_read == (std::size_t{1} << 18) / sizeof(double));
  CHECK(checkpoint_bytes(directory / "staged.bin") == checkpoint_bytes(directory / "host_window.bin"));

  // A device copy that fails midway throws and leaves the file as it was; the window keeps its sums.
  device_backend::fail_reads = true;
  CHECK_THROWS_WITH_AS(save_checkpoint(directory / "staged.bin", window), "device_backend: the device copy failed",
                       std::runtime_error);
  device_backend::fail_reads = false;
  CHECK(checkpoint_bytes(directory / "staged.bin") == checkpoint_bytes(directory / "host_window.bin"));
  check_same_bits<double>(window.pending(), reference.pending());

  const auto async_file = directory / "async.bin";
  save_checkpoint_async(async_file, window).get();
  CHECK(checkpoint_bytes(async_file) == checkpoint_bytes(directory / "host_window.bin"));
  std::filesystem::remove_all(directory);
}

TEST_CASE("a sparse device window saves only its present tensors, the host window's bytes") {
  // "big" is absent: the block would hold more zeros than values, so each tensor is written on
  // its own, read from its device in pieces.
  const auto sparse_parameters = []<class B>(B) {
    parameter_set<B> params;
    params.add("a", tensor_shape{2, 3}, 0);
    params.add("big", tensor_shape{300, 300}, 1);
    params.add("z", tensor_shape{4}, 1);
    return params;
  };
  const auto sparse_gradients = []<class B>(B) {
    gradients_params<B> grads;
    grads.insert("a", typename B::template tensor<float>{{1, 2, 3, 4, 5, 6}, {2, 3}, 0});
    grads.insert("z", typename B::template tensor<float>{{0.5F, 0.25F, 0.125F, 3}, {4}, 1});
    return grads;
  };
  weighted_gradients_accumulator<device> window(float_dtype::f32, 1.0);
  weighted_gradients_accumulator<host> reference(float_dtype::f32, 1.0);
  window.accumulate_mean(sparse_parameters(device{}), sparse_gradients(device{}), 3.0);
  reference.accumulate_mean(sparse_parameters(host{}), sparse_gradients(host{}), 3.0);
  const auto directory = std::filesystem::temp_directory_path() / "gradaccum_test_device_sparse";
  std::filesystem::create_directories(directory);
  save_checkpoint(directory / "device.bin", window);
  save_checkpoint(directory / "host.bin", reference);
  CHECK(checkpoint_bytes(directory / "device.bin") == checkpoint_bytes(directory / "host.bin"));
  CHECK(std::filesystem::file_size(directory / "device.bin") < 1000);  // not the 360 KB of "big"
  weighted_gradients_accumulator<device> restored(float_dtype::f32, 1.0);
  load_checkpoint(directory / "device.bin", sparse_parameters(device{}), restored);
  CHECK_FALSE(restored.pending().contains("big"));
  CHECK(result_values<float>(restored.pending(), "z") == std::vector<float>{1.5F, 0.75F, 0.375F, 9});
  std::filesystem::remove_all(directory);
}
#endif

}  // namespace
}  // namespace gradaccum::test
