#pragma once
/// @file
/// @brief Checkpoint files: records and accumulators saved and loaded by path, atomically.
///
/// `<gradaccum/cereal.hpp>` makes records cereal-serializable; this header adds files (POSIX):
///
/// - `save_checkpoint(path, record_or_accumulator[, format])` writes a temporary file next to
///   `path`, flushes and fsyncs it, renames it over `path` and fsyncs the directory. A crash at
///   any moment leaves either the previous checkpoint or the new one at `path`, never a torn
///   file. A writer killed before its rename leaves `.gradaccum-<16 hex digits>.tmp` beside
///   it, which no loader reads (safely ignored; it may be deleted). Any name up to NAME_MAX
///   saves. A save that returns wrote exactly the record's bytes; one that throws, whatever
///   allocation failed, left the previous file.
/// - `save_checkpoint_async` (`<gradaccum/checkpoint_async.hpp>`) saves on another thread.
/// - `load_checkpoint<Record>(path[, format])` and `load_checkpoint(path, params, accumulator
///   [, format])` read untrusted bytes: every problem with the content throws `gradaccum::error`
///   (`errc::invalid_record` or `errc::invalid_state`) naming the problem and the path; nothing
///   larger than the file is ever allocated; checksums refuse any changed content; JSON
///   documents nesting deeper than `max_document_depth` are rejected; an accumulator is changed
///   only when everything loaded and validated. Files that are not regular (FIFO, device,
///   socket) are refused without blocking. Only `record_format_version` loads: a file of
///   another version is refused naming it. A file read as another archive than the one that
///   wrote it (binary, portable binary, JSON: told by its first bytes), or holding another
///   record type than the one asked for (told by the tag every record starts with), is refused
///   naming what it is.
/// - `save_checkpoint(path, accumulator, scaler[, format])` and `load_checkpoint(path, params,
///   accumulator, scaler[, format])` keep a window and the `dynamic_loss_scale` that drives it in
///   one file, written and restored together: a resumed run continues with the same pending
///   values, scale and counters, bit for bit. Loading such a file without the scaler (or a file
///   without one with it) is refused, so neither is lost silently. `load_checkpoint_contents<R>(path)`
///   reads such a file with or without the scaler's state, for tools that show a file.
/// - `checkpoint_version(path)` tells a file's record format version, also of a version this
///   build does not load.
/// - `serialize_checkpoint` / `parse_checkpoint` do the same in memory.
///
/// The format is explicit or follows the extension (any case): `.bin` binary (native byte order,
/// fastest: resuming on the same kind of machine), `.pbin` portable binary (little-endian tagged:
/// moving a file between machines of other byte orders), `.json` (for people and tools: reading,
/// diffing). Problems with the file itself (missing, unreadable, not regular, disk full, unknown
/// extension) throw `std::filesystem::filesystem_error` naming the path; running out of memory
/// throws `std::bad_alloc`. The files hold the bytes cereal's archives write, written and read
/// by the library's own: one archive pair for both binary formats
/// (`checkpoint/binary_archives.hpp`) and JSON ones (`checkpoint/text_archives.hpp`).

#include <concepts>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>

#include "gradaccum/checkpoint/declarations.hpp"
#include "gradaccum/checkpoint/tensor_sink.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/records.hpp"

namespace gradaccum {

/// @brief An accumulator a checkpoint can hold: it has `try_to_record()` (and a `restorer`).
template <class A>
concept checkpointable = requires(const A& accumulator) {
  { accumulator.try_to_record() } -> checkpoint_record;
};

// ---- Memory ------------------------------------------------------------------------------------

/// @brief The bytes of `record` in `format`, as `save_checkpoint` writes them.
/// @throws error when `record` is invalid (see `validate`): it would not load back.
template <checkpoint_record R>
[[nodiscard]] std::string serialize_checkpoint(const R& record, checkpoint_format format);

/// @brief Reads a record from untrusted bytes.
/// @throws error(errc::invalid_record) or error(errc::invalid_state) naming the problem.
template <checkpoint_record R>
[[nodiscard]] R parse_checkpoint(std::string_view bytes, checkpoint_format format);

/// @brief Writes `record` to `path` atomically, in `format` or the one its extension names.
/// @throws error when `record` is invalid (the file at `path` is untouched);
/// std::filesystem::filesystem_error when the file cannot be written.
template <checkpoint_record R>
void save_checkpoint(const std::filesystem::path& path, const R& record,
                     std::optional<checkpoint_format> format = std::nullopt);

/// @brief Reads a record of type `R` from `path`.
/// @throws error(errc::invalid_record) or error(errc::invalid_state) naming the problem and the
/// path; std::filesystem::filesystem_error when the file cannot be read.
template <checkpoint_record R>
[[nodiscard]] R load_checkpoint(const std::filesystem::path& path,
                                std::optional<checkpoint_format> format = std::nullopt);

/// @brief A record and, when the file holds one after it, the loss scale state saved with it.
template <checkpoint_record R>
struct checkpoint_contents {
  R record;
  std::optional<dynamic_loss_scale_state> loss_scale;
};

/// @brief Reads what a checkpoint file holds, as `load_checkpoint<R>` does, whether or not a
/// window was saved with its `dynamic_loss_scale` (`save_checkpoint(path, accumulator, scaler)`):
/// for tools that show a file. The loss scale state is checked on its own (a positive F32
/// scale, hysteresis_left ≥ 1), not against any scaler's options.
/// @throws what `load_checkpoint<R>` throws.
template <checkpoint_record R>
[[nodiscard]] checkpoint_contents<R> load_checkpoint_contents(const std::filesystem::path& path,
                                                              std::optional<checkpoint_format> format = std::nullopt);

/// @brief Saves an accumulator's record (`try_to_record()`): pending values, and for a weighted
/// accumulator the window's state. Values are written straight from the pending tensors where
/// the backend's layout allows (`visit_record`), so nothing is copied first.
template <checkpointable Accumulator>
void save_checkpoint(const std::filesystem::path& path, const Accumulator& accumulator,
                     std::optional<checkpoint_format> format = std::nullopt);

/// @brief Restores an accumulator from `path` (with the checks of `load_record` against
/// `params`), reading values straight into new backend tensors where the backend's layout
/// allows. The accumulator is unchanged unless everything loaded and validated.
/// @throws what `load_checkpoint<R>` and the accumulator's `load_record` throw.
template <checkpointable Accumulator, class B>
void load_checkpoint(const std::filesystem::path& path, const parameter_set<B>& params, Accumulator& accumulator,
                     std::optional<checkpoint_format> format = std::nullopt);

/// @brief Saves an accumulator's record followed by `scaler`'s state, in one file: the window and
/// the loss scale that drives it are committed together (a crash leaves both old or both new).
template <checkpointable Accumulator>
void save_checkpoint(const std::filesystem::path& path, const Accumulator& accumulator,
                     const dynamic_loss_scale& scaler, std::optional<checkpoint_format> format = std::nullopt);

/// @brief Restores an accumulator and `scaler` from a file `save_checkpoint(path, accumulator,
/// scaler)` wrote. The saved state must be one `scaler`'s options can reach (the checks of
/// `dynamic_loss_scale(options, state)`); neither changes unless both loaded and validated.
/// @throws what `load_checkpoint(path, params, accumulator)` throws; error(errc::invalid_record)
/// for a file without a loss scale state (and, from that overload, for a file with one).
template <checkpointable Accumulator, class B>
void load_checkpoint(const std::filesystem::path& path, const parameter_set<B>& params, Accumulator& accumulator,
                     dynamic_loss_scale& scaler, std::optional<checkpoint_format> format = std::nullopt);

// ---- Implementation ------------------------------------------------------------------------------

namespace detail {

/// `save_checkpoint` of an accumulator, followed by `scaler`'s state when given.
template <class Accumulator>
void save_accumulator(const std::filesystem::path& path, const Accumulator& accumulator,
                      const dynamic_loss_scale* scaler, std::optional<checkpoint_format> format) {
  const checkpoint_format resolved = resolve_format(path, format);
  const dynamic_loss_scale_state* scale = scaler != nullptr ? &scaler->state() : nullptr;
  accumulator.visit_record([&](const auto& view) { save_record_file(path, view, resolved, scale); });
}

/// `load_checkpoint` into an accumulator, and into `scaler` when given (the file must then hold
/// its state, else must not); both change only once everything loaded and validated.
template <class Accumulator, class B>
void load_accumulator(const std::filesystem::path& path, const parameter_set<B>& params, Accumulator& accumulator,
                      dynamic_loss_scale* scaler, std::optional<checkpoint_format> format) {
  using restorer = typename Accumulator::restorer;
  restorer restoring(accumulator, params);
  tensor_sink_of<restorer> sink(restoring);
  std::optional<dynamic_loss_scale_state> state;
  const loss_scale_part part = scaler != nullptr ? loss_scale_part::required : loss_scale_part::refused;
  if constexpr (std::is_same_v<decltype(accumulator.try_to_record()), weighted_gradients_record>) {
    load_window_file(path, resolve_format(path, format), sink, part, &state);
  } else {
    load_gradients_file(path, resolve_format(path, format), sink, part, &state);
  }
  std::optional<dynamic_loss_scale> restored;
  if (scaler != nullptr) restored.emplace(scaler->options(), *state);  // an unreachable state throws here
  std::move(restoring).commit();                                       // neither of these two can throw
  if (scaler != nullptr) *scaler = *restored;
}

}  // namespace detail

template <checkpoint_record R>
std::string serialize_checkpoint(const R& record, checkpoint_format format) {
  return detail::serialize_record(record, format);
}

template <checkpoint_record R>
R parse_checkpoint(std::string_view bytes, checkpoint_format format) {
  R record;
  detail::parse_record(bytes, format, record);
  return record;
}

template <checkpoint_record R>
void save_checkpoint(const std::filesystem::path& path, const R& record, std::optional<checkpoint_format> format) {
  detail::save_record_file(path, record, detail::resolve_format(path, format), nullptr);
}

template <checkpoint_record R>
R load_checkpoint(const std::filesystem::path& path, std::optional<checkpoint_format> format) {
  R record;
  detail::load_record_file(path, detail::resolve_format(path, format), record, detail::loss_scale_part::refused,
                           nullptr);
  return record;
}

template <checkpoint_record R>
checkpoint_contents<R> load_checkpoint_contents(const std::filesystem::path& path,
                                                std::optional<checkpoint_format> format) {
  checkpoint_contents<R> contents;
  detail::load_record_file(path, detail::resolve_format(path, format), contents.record,
                           detail::loss_scale_part::optional, &contents.loss_scale);
  return contents;
}

template <checkpointable Accumulator>
void save_checkpoint(const std::filesystem::path& path, const Accumulator& accumulator,
                     std::optional<checkpoint_format> format) {
  detail::save_accumulator(path, accumulator, nullptr, format);
}

template <checkpointable Accumulator, class B>
void load_checkpoint(const std::filesystem::path& path, const parameter_set<B>& params, Accumulator& accumulator,
                     std::optional<checkpoint_format> format) {
  detail::load_accumulator(path, params, accumulator, nullptr, format);
}

template <checkpointable Accumulator>
void save_checkpoint(const std::filesystem::path& path, const Accumulator& accumulator,
                     const dynamic_loss_scale& scaler, std::optional<checkpoint_format> format) {
  detail::save_accumulator(path, accumulator, &scaler, format);
}

template <checkpointable Accumulator, class B>
void load_checkpoint(const std::filesystem::path& path, const parameter_set<B>& params, Accumulator& accumulator,
                     dynamic_loss_scale& scaler, std::optional<checkpoint_format> format) {
  detail::load_accumulator(path, params, accumulator, &scaler, format);
}

}  // namespace gradaccum

#ifndef GRADACCUM_SEPARATE_COMPILATION
#include "gradaccum/checkpoint/files.hpp"
#endif
