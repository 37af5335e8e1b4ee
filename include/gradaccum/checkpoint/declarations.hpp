#pragma once
/// @file
/// @brief The checkpoint format type and the functions that do not depend on a backend: declared
/// here for `<gradaccum/checkpoint.hpp>`'s templates, defined by `checkpoint/files.hpp` (inline by
/// default, or compiled once in `src/checkpoint.cpp` with `GRADACCUM_SEPARATE_COMPILATION`).
/// Include `<gradaccum/checkpoint.hpp>`, not this file.

#include <concepts>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

#include "gradaccum/checkpoint/tensor_sink.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/records.hpp"

/// Compiled once: with `GRADACCUM_SEPARATE_COMPILATION` defined (in every translation unit of
/// the program, as the `gradaccum-checkpoint` library's dependency does), the functions below are
/// declared only and `src/checkpoint.cpp` defines them, so a file that saves or loads a
/// checkpoint compiles none of cereal. By default `<gradaccum/checkpoint.hpp>` includes their
/// definitions and they are templates of nothing, so a file compiles only those it calls.
#ifdef GRADACCUM_SEPARATE_COMPILATION
#define GRADACCUM_CHECKPOINT_INLINE
#define GRADACCUM_CHECKPOINT_DECLARE
#define GRADACCUM_CHECKPOINT_DEFINE
#else
#define GRADACCUM_CHECKPOINT_INLINE inline
#define GRADACCUM_CHECKPOINT_DECLARE template <class = void>
#define GRADACCUM_CHECKPOINT_DEFINE template <class>
#endif

namespace gradaccum {

/// @brief The cereal archive a checkpoint is written with.
enum class checkpoint_format : std::uint8_t { binary, portable_binary, json };

/// @brief "binary", "portable_binary", "json".
constexpr std::string_view to_string(checkpoint_format format) noexcept {
  switch (format) {
    case checkpoint_format::binary: return "binary";
    case checkpoint_format::portable_binary: return "portable_binary";
    case checkpoint_format::json: return "json";
  }
  return "?";
}

/// @brief Inverse of `to_string`; empty for any other text.
constexpr std::optional<checkpoint_format> parse_checkpoint_format(std::string_view name) noexcept {
  for (auto format : {checkpoint_format::binary, checkpoint_format::portable_binary, checkpoint_format::json}) {
    if (to_string(format) == name) return format;
  }
  return std::nullopt;
}

/// @brief The format a path's extension names: `.bin`, `.pbin`, `.json` (any case).
/// @throws std::filesystem::filesystem_error (std::errc::invalid_argument) for any other extension.
inline checkpoint_format checkpoint_format_for(const std::filesystem::path& path) {
  std::string extension = path.extension().string();
  for (char& c : extension) c = (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
  if (extension == ".bin") return checkpoint_format::binary;
  if (extension == ".pbin") return checkpoint_format::portable_binary;
  if (extension == ".json") return checkpoint_format::json;
  throw std::filesystem::filesystem_error("gradaccum: cannot tell a checkpoint format from the extension '" +
                                              extension + "'; use .bin, .pbin or .json, or pass a checkpoint_format",
                                          path, std::make_error_code(std::errc::invalid_argument));
}

/// @brief The records a checkpoint holds.
template <class R>
concept checkpoint_record =
    std::is_same_v<R, weighted_gradients_record> || std::is_same_v<R, gradients_params_record> ||
    std::is_same_v<R, weighted_accumulation_state>;

/// @brief The format version of the outermost record of the checkpoint at `path`, read from its
/// first bytes without loading it (also of a version this build does not load).
/// @throws error(errc::invalid_record) for a file that does not start like a checkpoint of
/// `format` (one of another archive is named);
/// std::filesystem::filesystem_error when the file cannot be read.
GRADACCUM_CHECKPOINT_INLINE std::uint32_t checkpoint_version(const std::filesystem::path& path,
                                                             std::optional<checkpoint_format> format = std::nullopt);

namespace detail {

/// Whether a checkpoint holds a loss scale state after its record: it must not, it must, or it
/// may.
enum class loss_scale_part : std::uint8_t { refused, required, optional };

// The format and file code the templates below call: one overload per record type (and per
// view an accumulator saves from), so nothing in it depends on a backend or a template argument
// (see GRADACCUM_SEPARATE_COMPILATION).
GRADACCUM_CHECKPOINT_DECLARE std::string serialize_record(const weighted_gradients_record& record,
                                                          checkpoint_format format);
GRADACCUM_CHECKPOINT_DECLARE std::string serialize_record(const gradients_params_record& record,
                                                          checkpoint_format format);
GRADACCUM_CHECKPOINT_DECLARE std::string serialize_record(const weighted_accumulation_state& record,
                                                          checkpoint_format format);
GRADACCUM_CHECKPOINT_DECLARE void parse_record(std::string_view bytes, checkpoint_format format,
                                               weighted_gradients_record& record);
GRADACCUM_CHECKPOINT_DECLARE void parse_record(std::string_view bytes, checkpoint_format format,
                                               gradients_params_record& record);
GRADACCUM_CHECKPOINT_DECLARE void parse_record(std::string_view bytes, checkpoint_format format,
                                               weighted_accumulation_state& record);
GRADACCUM_CHECKPOINT_DECLARE void save_record_file(const std::filesystem::path& path,
                                                   const weighted_gradients_record& record, checkpoint_format format,
                                                   const dynamic_loss_scale_state* scale);
GRADACCUM_CHECKPOINT_DECLARE void save_record_file(const std::filesystem::path& path,
                                                   const gradients_params_record& record, checkpoint_format format,
                                                   const dynamic_loss_scale_state* scale);
GRADACCUM_CHECKPOINT_DECLARE void save_record_file(const std::filesystem::path& path,
                                                   const weighted_accumulation_state& record, checkpoint_format format,
                                                   const dynamic_loss_scale_state* scale);
GRADACCUM_CHECKPOINT_DECLARE void save_record_file(const std::filesystem::path& path,
                                                   const weighted_gradients_view& record, checkpoint_format format,
                                                   const dynamic_loss_scale_state* scale);
GRADACCUM_CHECKPOINT_DECLARE void save_record_file(const std::filesystem::path& path, const gradients_view& record,
                                                   checkpoint_format format, const dynamic_loss_scale_state* scale);
GRADACCUM_CHECKPOINT_DECLARE void load_record_file(const std::filesystem::path& path, checkpoint_format format,
                                                   weighted_gradients_record& record, loss_scale_part part,
                                                   std::optional<dynamic_loss_scale_state>* scale);
GRADACCUM_CHECKPOINT_DECLARE void load_record_file(const std::filesystem::path& path, checkpoint_format format,
                                                   gradients_params_record& record, loss_scale_part part,
                                                   std::optional<dynamic_loss_scale_state>* scale);
GRADACCUM_CHECKPOINT_DECLARE void load_record_file(const std::filesystem::path& path, checkpoint_format format,
                                                   weighted_accumulation_state& record, loss_scale_part part,
                                                   std::optional<dynamic_loss_scale_state>* scale);
/// Read a file of a window's (or a gradients) record into `sink` (an accumulator's restorer),
/// which checks every tensor.
GRADACCUM_CHECKPOINT_DECLARE void load_window_file(const std::filesystem::path& path, checkpoint_format format,
                                                   tensor_sink& sink, loss_scale_part part,
                                                   std::optional<dynamic_loss_scale_state>* scale);
GRADACCUM_CHECKPOINT_DECLARE void load_gradients_file(const std::filesystem::path& path, checkpoint_format format,
                                                      tensor_sink& sink, loss_scale_part part,
                                                      std::optional<dynamic_loss_scale_state>* scale);

inline checkpoint_format resolve_format(const std::filesystem::path& path, std::optional<checkpoint_format> format) {
  return format ? *format : checkpoint_format_for(path);
}

}  // namespace detail
}  // namespace gradaccum
