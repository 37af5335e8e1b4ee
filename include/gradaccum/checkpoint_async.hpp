#pragma once
/// @file
/// @brief `save_checkpoint_async`: a checkpoint written on another thread, from a snapshot taken
/// on the calling thread.
///
/// The snapshot is a copy of the accumulator (one copy of the pending values, on the calling
/// thread); the file is written by `std::async` on its own thread, with every guarantee of
/// `save_checkpoint` (`<gradaccum/checkpoint.hpp>`), and `get()` on the returned future rethrows
/// what the save threw. What it buys the calling thread: `ckpt_snapshot` in
/// `benchmarks/bench_checkpoint.cpp` (a copy of the pending bytes, against a whole save). Saves to
/// one path land in the order they finish: wait for one before starting the next if order
/// matters. This is the only place a checkpoint starts a thread, and the only header of
/// gradaccum that includes `<future>`: files that save and load on the calling thread do not
/// compile it.
///
/// @code
/// auto saving = gradaccum::save_checkpoint_async("run/window.bin", window);  // snapshot now
/// // ... go on accumulating into `window` ...
/// saving.get();  // rethrows what the save threw
/// @endcode

#include <concepts>
#include <filesystem>
#include <future>
#include <optional>
#include <utility>

#include "gradaccum/checkpoint.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"

namespace gradaccum {

/// @brief Writes `record` on another thread; `get()` on the result rethrows what
/// `save_checkpoint` threw.
template <checkpoint_record R>
[[nodiscard]] std::future<void> save_checkpoint_async(std::filesystem::path path, R record,
                                                      std::optional<checkpoint_format> format = std::nullopt);

/// @brief Snapshots `accumulator` as of this call (a copy of it: one copy of the pending
/// values on the calling thread) and writes the copy on another thread, straight from its
/// tensors; the accumulator may be used again as soon as this returns.
template <checkpointable Accumulator>
  requires std::copy_constructible<Accumulator>
[[nodiscard]] std::future<void> save_checkpoint_async(std::filesystem::path path, const Accumulator& accumulator,
                                                      std::optional<checkpoint_format> format = std::nullopt);

/// @brief `save_checkpoint(path, accumulator, scaler)` on another thread, from a snapshot of both
/// as of this call.
template <checkpointable Accumulator>
  requires std::copy_constructible<Accumulator>
[[nodiscard]] std::future<void> save_checkpoint_async(std::filesystem::path path, const Accumulator& accumulator,
                                                      const dynamic_loss_scale& scaler,
                                                      std::optional<checkpoint_format> format = std::nullopt);

// ---- Implementation ------------------------------------------------------------------------------

template <checkpoint_record R>
std::future<void> save_checkpoint_async(std::filesystem::path path, R record, std::optional<checkpoint_format> format) {
  const checkpoint_format resolved = detail::resolve_format(path, format);
  return std::async(std::launch::async, [path = std::move(path), record = std::move(record), resolved] {
    save_checkpoint(path, record, resolved);
  });
}

template <checkpointable Accumulator>
  requires std::copy_constructible<Accumulator>
std::future<void> save_checkpoint_async(std::filesystem::path path, const Accumulator& accumulator,
                                        std::optional<checkpoint_format> format) {
  const checkpoint_format resolved = detail::resolve_format(path, format);
  return std::async(std::launch::async, [path = std::move(path), snapshot = accumulator, resolved] {
    save_checkpoint(path, snapshot, resolved);
  });
}

template <checkpointable Accumulator>
  requires std::copy_constructible<Accumulator>
std::future<void> save_checkpoint_async(std::filesystem::path path, const Accumulator& accumulator,
                                        const dynamic_loss_scale& scaler, std::optional<checkpoint_format> format) {
  const checkpoint_format resolved = detail::resolve_format(path, format);
  return std::async(std::launch::async, [path = std::move(path), snapshot = accumulator, scaler, resolved] {
    save_checkpoint(path, snapshot, scaler, resolved);
  });
}

}  // namespace gradaccum
