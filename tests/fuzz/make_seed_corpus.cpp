/// @file
/// @brief Writes the seed corpus of the fuzz harnesses: a few valid weighted records in every
/// format, as corpus/<format>/<name>, and one followed by its loss scale state (as
/// `save_checkpoint(path, accumulator, scaler)` writes it), which the harnesses' loaders refuse
/// and `gradaccum-inspect` shows. Run from tests/fuzz after changing the record format:
/// `meson compile -C build make_seed_corpus && (cd tests/fuzz && ../../build/tests/fuzz/make_seed_corpus)`.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gradaccum/checkpoint.hpp>

using namespace gradaccum;

int main() {
  const std::vector<std::pair<std::string, weighted_gradients_record>> seeds = {
      {"empty_window", {{}, {float_dtype::f32, 1.0, 0.0, 0}}},
      {"zero_weight_microbatches", {{}, {float_dtype::f64, 65536.0, 0.0, 3}}},
      {"two_tensors",
       {{{{"b", float_dtype::f32, {1, 2}, std::vector<float>{0.5F, -1.0F}},
          {"w", float_dtype::f32, {2, 3}, std::vector<float>{1, 2, 3, 4, 5, 6}}}},
        {float_dtype::f32, 1024.0, 7.0, 2}}},
      {"f64_edge_values",
       {{{{"scalar", float_dtype::f64, {}, std::vector<double>{-0.0}},
          {"x",
           float_dtype::f64,
           {1, 3},
           std::vector<double>{std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN(),
                               std::numeric_limits<double>::denorm_min()}},
          {"z", float_dtype::f64, {0, 4}, std::vector<double>{}}}},
        {float_dtype::f64, 0.5, 1e-300, std::numeric_limits<std::uint64_t>::max()}}},
  };
  // "two_tensors" as an accumulator over the harness's parameters writes it: binary archives
  // hold its buffer as it is ('b' padded to 16 elements), which loads into one read.
  const std::vector<float> buffer = {0.5F, -1.0F, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6};
  const std::uint64_t b_shape[] = {1, 2};
  const std::uint64_t w_shape[] = {2, 3};
  const std::span<const float> values(buffer);
  const detail::tensor_view views[] = {{"b", float_dtype::f32, b_shape, values.subspan(0, 2)},
                                       {"w", float_dtype::f32, w_shape, values.subspan(16, 6)}};
  const detail::weighted_gradients_view window{{float_dtype::f32, 1024.0, 7.0, 2}, {views, values}};
  for (const checkpoint_format format :
       {checkpoint_format::binary, checkpoint_format::portable_binary, checkpoint_format::json}) {
    const std::filesystem::path directory = std::filesystem::path("corpus") / std::string(to_string(format));
    std::filesystem::create_directories(directory);
    for (const auto& [name, record] : seeds) {
      std::ofstream(directory / name, std::ios::binary | std::ios::trunc) << serialize_checkpoint(record, format);
    }
    {
      const dynamic_loss_scale_state scale{32768.0, 5, 1};
      std::ofstream out(directory / "two_tensors_with_loss_scale", std::ios::binary | std::ios::trunc);
      detail::write_record(out, seeds[2].second, format, &scale);
    }
    if (detail::is_text_format(format)) continue;  // text archives write it as the record
    std::ofstream out(directory / "two_tensors_buffer", std::ios::binary | std::ios::trunc);
    detail::write_record(out, window, format);
  }
  return 0;
}
