/// @file
/// @brief gradaccum-inspect: prints what a checkpoint file holds.
///
///     gradaccum-inspect FILE [--format binary|portable_binary|json]
///                            [--record auto|weighted|gradients|state]
///
/// Prints the format, the record type and its format version, the accumulation state, the
/// loss scale state of a window saved with its `dynamic_loss_scale`, and for every tensor its
/// id (quoted, bytes outside printable ASCII escaped as the library's messages do), dtype,
/// shape, smallest and largest finite value and number of non-finite values (NaN, ±inf: a
/// window that overflowed). The record type is the one the file's tag names unless given. The
/// file is loaded by the same hardened loader as `load_checkpoint`, so a damaged file gets the
/// same named error. Exit status: 0, 1 when the file cannot be read or is refused, CLI11's
/// codes for a bad command line.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <CLI/CLI.hpp>

#include <gradaccum/checkpoint.hpp>
#include <gradaccum/kernels.hpp>

using namespace gradaccum;

namespace {

/// Shortest text that reads back as `value`.
template <class T>
std::string number(T value) {
  char text[64];
  const auto end = std::to_chars(text, text + sizeof text, value).ptr;
  return {text, end};
}

/// A value of a record as a double (16-bit values widened from their bit patterns).
double widened(float_dtype dtype, std::uint16_t bits) {
  return dtype == float_dtype::f16 ? kernels::f16_bits_to_float(bits) : kernels::bf16_bits_to_float(bits);
}

struct tensor_summary {
  std::string id;
  std::string dtype;
  std::string shape;
  std::string min = "-";
  std::string max = "-";
  std::size_t elements = 0;
  std::size_t non_finite = 0;
};

tensor_summary summarize(const tensor_record& tensor) {
  // Whole and escaped: ids may hold NUL bytes (binary archives keep them) or terminal escapes.
  tensor_summary summary{detail::quote(tensor.id, std::numeric_limits<std::size_t>::max()),
                         std::string(to_string(tensor.dtype)), detail::record_shape(tensor).to_string()};
  std::visit(
      [&](const auto& values) {
        std::optional<double> low;
        std::optional<double> high;
        for (const auto& stored : values) {
          double value = 0.0;
          if constexpr (std::is_same_v<std::decay_t<decltype(stored)>, std::uint16_t>) {
            value = widened(tensor.dtype, stored);
          } else {
            value = static_cast<double>(stored);
          }
          if (!std::isfinite(value)) {
            ++summary.non_finite;
            continue;
          }
          low = low ? std::min(*low, value) : value;
          high = high ? std::max(*high, value) : value;
        }
        summary.elements = values.size();
        if (low) summary.min = number(*low);
        if (high) summary.max = number(*high);
      },
      tensor.values);
  return summary;
}

void print_tensors(const gradients_params_record& record) {
  std::vector<tensor_summary> rows = {{"id", "dtype", "shape", "min", "max", 0, 0}};
  std::size_t elements = 0;
  std::size_t non_finite = 0;
  for (const tensor_record& tensor : record.tensors) {
    rows.push_back(summarize(tensor));
    elements += rows.back().elements;
    non_finite += rows.back().non_finite;
  }
  std::size_t widths[5] = {};
  for (const tensor_summary& row : rows) {
    const std::string* cells[5] = {&row.id, &row.dtype, &row.shape, &row.min, &row.max};
    for (std::size_t c = 0; c < 5; ++c) widths[c] = std::max(widths[c], cells[c]->size());
  }
  std::printf("tensors: %zu, %zu values, %zu non-finite\n", record.tensors.size(), elements, non_finite);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const tensor_summary& row = rows[r];
    const std::string last = r == 0 ? "non-finite" : std::to_string(row.non_finite);
    std::printf("  %-*s  %-*s  %-*s  %*s  %*s  %s\n", static_cast<int>(widths[0]), row.id.c_str(),
                static_cast<int>(widths[1]), row.dtype.c_str(), static_cast<int>(widths[2]), row.shape.c_str(),
                static_cast<int>(widths[3]), row.min.c_str(), static_cast<int>(widths[4]), row.max.c_str(),
                last.c_str());
  }
}

void print_state(const weighted_accumulation_state& state) {
  std::printf("state: dtype %s, loss_scale %s, total_weight %s, microbatches %llu\n",
              std::string(to_string(state.dtype)).c_str(), number(state.loss_scale).c_str(),
              number(state.total_weight).c_str(), static_cast<unsigned long long>(state.microbatches));
}

void print(const weighted_gradients_record& record) {
  print_state(record.state);
  print_tensors(record.gradients);
}
void print(const gradients_params_record& record) {
  print_tensors(record);
}
void print(const weighted_accumulation_state& state) {
  print_state(state);
}

/// Loads and prints a record of type R and the loss scale state saved after it, if any.
template <class R>
void inspect(const std::filesystem::path& path, checkpoint_format format, std::uint32_t version) {
  const checkpoint_contents<R> contents = load_checkpoint_contents<R>(path, format);
  std::printf("record: %s, format version %u (XXH3-64 checksums verified)\n",
              std::string(detail::record_name<R>()).c_str(), static_cast<unsigned>(version));
  if (contents.loss_scale) {
    const dynamic_loss_scale_state& scale = *contents.loss_scale;
    std::printf("loss scale: scale %s, growth_tracker %llu, hysteresis_left %llu\n", number(scale.scale).c_str(),
                static_cast<unsigned long long>(scale.growth_tracker),
                static_cast<unsigned long long>(scale.hysteresis_left));
  }
  print(contents.record);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Prints what a gradaccum checkpoint file holds: format, record, state and per-tensor statistics."};
  std::filesystem::path path;
  std::string format_name;
  std::string record_kind = "auto";
  app.add_option("file", path, "checkpoint file")->required();
  app.add_option("-f,--format", format_name, "format, if the extension (.bin .pbin .json) does not tell")
      ->check(CLI::IsMember({"binary", "portable_binary", "json"}));
  app.add_option("-r,--record", record_kind,
                 "record the file holds: a weighted window, a plain accumulator's gradients, a window's state, or "
                 "auto (the one the file names)")
      ->check(CLI::IsMember({"auto", "weighted", "gradients", "state"}));
  CLI11_PARSE(app, argc, argv);

  try {
    const std::optional<checkpoint_format> given = parse_checkpoint_format(format_name);
    const checkpoint_format format = given ? *given : checkpoint_format_for(path);
    std::printf("file: %s\nformat: %s (%s)\n",
                detail::quote(path.string(), std::numeric_limits<std::size_t>::max()).c_str(),
                std::string(to_string(format)).c_str(), given ? "given" : "from the extension");
    // The file's start names its archive (a misread one is refused here), version and record.
    const detail::checkpoint_start start = detail::read_start(path, format);
    if (record_kind == "auto" && start.record != nullptr) {
      if (start.record == &detail::gradients_tag) record_kind = "gradients";
      if (start.record == &detail::state_tag) record_kind = "state";
    }
    if (record_kind == "gradients") {
      inspect<gradients_params_record>(path, format, start.version);
    } else if (record_kind == "state") {
      inspect<weighted_accumulation_state>(path, format, start.version);
    } else {  // a window, or a file whose start names no record: its loader says what is wrong
      inspect<weighted_gradients_record>(path, format, start.version);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gradaccum-inspect: %s\n", e.what());
    return 1;
  }
}
