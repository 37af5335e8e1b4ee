/// @file
/// @brief Checkpoint save and load (binary, portable binary, JSON) of an accumulator's pending
/// window, against the floor: fwrite / fread of the same values, on a tmpfs (/dev/shm), so the
/// disk is out of the picture and what remains is serialization and copying.
///
/// Cases are `ckpt_<save|load>/<format>/<layout>`: `1_tensor` (one parameter of <bytes>) and
/// `<N>_tensors` (N parameters of 64 floats: 10,000 in binary, 1,000 in JSON). Peers:
///  - `hand`          fopen + fwrite of the raw values (one call per tensor) + fclose; load:
///                    fopen + fread into freshly allocated buffers + fclose. No fsync, no rename:
///                    the floor, not a crash-safe writer;
///  - `ours_eigen`    save_checkpoint(path, accumulator, format) — snapshot (try_to_record) plus
///                    an atomic write (temporary, fsync, rename, directory fsync); load:
///                    load_checkpoint(path, params, accumulator, format), i.e. read, validate and
///                    restore into the accumulator;
///  - `ours_record`   the same without the accumulator: save_checkpoint(path, record) of a record
///                    taken beforehand, load_checkpoint<weighted_gradients_record>(path);
///  - `checksum`      (binary, one tensor) only the XXH3-64 a save adds: it hashes each 256 KiB
///                    piece right before the piece is written, so the piece is in cache and the
///                    read from memory is the copy's, paid without a checksum too. The peer
///                    hashes one cache-resident piece as many times as the window has pieces; its
///                    time over `ours_eigen`'s save is the checksum's share, bound ≤ 5 %.
///  - `pieces`, `pieces_hashed` (binary, one tensor) the hand peer's fwrite / fread in those
///                    pieces (256 KiB saved, 32 KiB loaded) (loads into one reused buffer, as an accumulator's),
///                    without and with XXH3-64 on the calling thread after each piece: `ours_eigen`'s load, checksum
///                    included, against `pieces` bounds what the checksum costs (≥ 0.95×).
///
/// `ckpt_snapshot/binary/1_tensor` measures what save_checkpoint_async costs the calling thread
/// (`ours_eigen`: until it returns; the write is awaited untimed) against one copy of the pending
/// bytes into a fresh buffer (`hand`: new + memcpy), the bound it must stay within.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <unistd.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/checkpoint_async.hpp>
#include <gradaccum/gradaccum.hpp>

#include "bench_common.hpp"

namespace ga_bench {
namespace {

using backend = gradaccum::eigen_backend;
using gradaccum::checkpoint_format;

std::filesystem::path& scratch_directory() {
  static std::filesystem::path directory;
  return directory;
}

/// A model with one pending window: `count` parameters of `elements` floats, pending = g.
struct window {
  std::size_t count;
  std::size_t elements;
  gradaccum::parameter_set<backend> params;
  gradaccum::weighted_gradients_accumulator<backend> acc{gradaccum::float_dtype::f32, 1.0};
  const float* values;  // the gradients (and so the pending values), contiguous

  window(std::size_t count_, std::size_t elements_)
      : count(count_), elements(elements_), values(pool().gradient<float>(count_ * elements_)) {
    gradaccum::gradients_params<backend> grads;
    const gradaccum::tensor_shape shape{elements, 1};
    for (std::size_t i = 0; i < count; ++i) {
      const std::string id = "blocks." + std::to_string(i) + ".mlp.weight";
      params.add(id, backend::view<float>(values + i * elements, shape));
      grads.insert(id, backend::view<float>(values + i * elements, shape));
    }
    acc.accumulate_sum(params, grads, 1.0);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return count * elements * sizeof(float); }
};

std::string layout_name(std::size_t count) {
  return count == 1 ? "1_tensor" : std::to_string(count) + "_tensors";
}

std::filesystem::path file_for(const std::string& stem, checkpoint_format format) {
  const char* extension = format == checkpoint_format::binary            ? ".bin"
                          : format == checkpoint_format::portable_binary ? ".pbin"
                                                                         : ".json";
  return scratch_directory() / (stem + extension);
}

void hand_save(benchmark::State& state, const window& w, const std::filesystem::path& path) {
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      std::FILE* file = std::fopen(path.c_str(), "wb");
      if (file == nullptr) {
        state.SkipWithError("cannot open the scratch file");
        break;
      }
      for (std::size_t i = 0; i < w.count; ++i) std::fwrite(w.values + i * w.elements, sizeof(float), w.elements, file);
      std::fclose(file);
    }
  }
  state.counters["bytes"] = static_cast<double>(w.bytes());
}

void hand_load(benchmark::State& state, const window& w, const std::filesystem::path& path) {
  {
    std::FILE* file = std::fopen(path.c_str(), "wb");  // the file to read
    for (std::size_t i = 0; i < w.count; ++i) std::fwrite(w.values + i * w.elements, sizeof(float), w.elements, file);
    std::fclose(file);
  }
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      std::FILE* file = std::fopen(path.c_str(), "rb");
      if (file == nullptr) {
        state.SkipWithError("cannot open the scratch file");
        break;
      }
      std::vector<std::unique_ptr<float[]>> tensors;
      tensors.reserve(w.count);
      for (std::size_t i = 0; i < w.count; ++i) {
        tensors.emplace_back(new float[w.elements]);
        if (std::fread(tensors.back().get(), sizeof(float), w.elements, file) != w.elements) {
          state.SkipWithError("short read");
          break;
        }
      }
      std::fclose(file);
      benchmark::DoNotOptimize(tensors.data());
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = static_cast<double>(w.bytes());
}

void ours_save(benchmark::State& state, const window& w, const std::filesystem::path& path, checkpoint_format format,
               bool whole_accumulator) {
  const auto record = w.acc.try_to_record();
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      if (whole_accumulator) {
        gradaccum::save_checkpoint(path, w.acc, format);
      } else {
        gradaccum::save_checkpoint(path, record, format);
      }
    }
  }
  state.counters["bytes"] = static_cast<double>(w.bytes());
  state.counters["file_bytes"] = static_cast<double>(std::filesystem::file_size(path));
}

void ours_load(benchmark::State& state, const window& w, const std::filesystem::path& path, checkpoint_format format,
               bool whole_accumulator) {
  gradaccum::save_checkpoint(path, w.acc, format);
  gradaccum::weighted_gradients_accumulator<backend> restored(gradaccum::float_dtype::f32, 1.0);
  // Untimed, like the hand peer's file: the first load into an accumulator also lays its window
  // out (ids sorted once per parameter set), which a resumed run pays once, not per checkpoint,
  // and the first two allocate the two buffers every later load alternates between.
  for (int warm_up = 0; warm_up < 2 && whole_accumulator; ++warm_up)
    gradaccum::load_checkpoint(path, w.params, restored, format);
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      if (whole_accumulator) {
        gradaccum::load_checkpoint(path, w.params, restored, format);
      } else {
        const auto record = gradaccum::load_checkpoint<gradaccum::weighted_gradients_record>(path, format);
        benchmark::DoNotOptimize(record.gradients.tensors.data());
      }
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = static_cast<double>(w.bytes());
}

void hand_snapshot(benchmark::State& state, const window& w) {
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      std::unique_ptr<float[]> copy(new float[w.count * w.elements]);
      std::memcpy(copy.get(), w.values, w.bytes());
      benchmark::DoNotOptimize(copy.get());
      benchmark::ClobberMemory();
      state.PauseTiming();  // the snapshot, too, is freed off the calling thread's clock
      copy.reset();
      state.ResumeTiming();
    }
  }
  state.counters["bytes"] = static_cast<double>(w.bytes());
}

/// The checksum alone: XXH3-64 over as many bytes as the window's values, in the pieces a save
/// or load hashes them, each in cache (see the file comment; the rest of the record
/// adds a few dozen bytes), so its share of a save or load shows.
void checksum_only(benchmark::State& state, const window& w) {
  const std::size_t total = w.count * w.elements;
  const std::size_t piece = std::min(total, gradaccum::detail::saved_block_bytes / sizeof(float));
  const std::span<const float> in_cache(w.values, piece);
  for (auto _ : state) {
    gradaccum::detail::content_hash hash;
    for (std::size_t done = 0; done < total; done += piece) {
      hash.add_values(in_cache.first(std::min(piece, total - done)));
    }
    benchmark::DoNotOptimize(hash.digest());
  }
  state.counters["bytes"] = static_cast<double>(w.bytes());
}

/// The hand peer in the pieces a checkpoint copies, each hashed right after (load) or before
/// (save) its copy when `hashed`.
void pieces_peer(benchmark::State& state, const window& w, const std::filesystem::path& path, bool save, bool hashed) {
  const std::size_t total = w.count * w.elements;
  const std::size_t piece =
      (save ? gradaccum::detail::saved_block_bytes : gradaccum::detail::loaded_block_bytes) / sizeof(float);
  std::vector<float> loaded(save ? 0 : total);
  if (!save) {
    std::FILE* file = std::fopen(path.c_str(), "wb");
    if (file == nullptr || std::fwrite(w.values, sizeof(float), total, file) != total) {
      state.SkipWithError("cannot write the scratch file");
    }
    if (file != nullptr) std::fclose(file);
  }
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      std::FILE* file = std::fopen(path.c_str(), save ? "wb" : "rb");
      if (file == nullptr) {
        state.SkipWithError("cannot open the scratch file");
        break;
      }
      gradaccum::detail::content_hash hash;
      for (std::size_t done = 0; done < total; done += piece) {
        const std::size_t count = std::min(piece, total - done);
        std::size_t moved = 0;
        if (save) {
          const std::span<const float> values(w.values + done, count);
          if (hashed) hash.add_values(values);
          moved = std::fwrite(values.data(), sizeof(float), count, file);
        } else {
          moved = std::fread(loaded.data() + done, sizeof(float), count, file);
          if (hashed) hash.add_values(std::span<const float>(loaded.data() + done, count));
        }
        if (moved != count) {
          state.SkipWithError("short read or write");
          break;
        }
      }
      benchmark::DoNotOptimize(hash.digest());
      std::fclose(file);
      benchmark::ClobberMemory();
    }
  }
  state.counters["bytes"] = static_cast<double>(w.bytes());
}

void ours_snapshot(benchmark::State& state, const window& w, const std::filesystem::path& path) {
  {
    alloc_probe probe(state);
    for (auto _ : state) {
      std::future<void> saved = gradaccum::save_checkpoint_async(path, w.acc, checkpoint_format::binary);
      state.PauseTiming();
      saved.get();
      state.ResumeTiming();
    }
  }
  state.counters["bytes"] = static_cast<double>(w.bytes());
}

/// Windows are built on first use and kept (they hold hundreds of MiB at most).
const window& window_of(std::size_t count, std::size_t elements) {
  static std::vector<std::unique_ptr<window>> windows;
  for (const auto& w : windows) {
    if (w->count == count && w->elements == elements) return *w;
  }
  windows.push_back(std::make_unique<window>(count, elements));
  return *windows.back();
}

void register_cases(checkpoint_format format, std::size_t count, std::size_t elements) {
  const std::size_t bytes = count * elements * sizeof(float);
  if (!size_enabled(bytes)) return;
  const std::string format_name(gradaccum::to_string(format));
  const std::string layout = layout_name(count);
  const std::string stem = format_name + "_" + layout + "_" + std::to_string(bytes);
  for (const bool save : {true, false}) {
    const std::string base = std::string(save ? "ckpt_save/" : "ckpt_load/") + format_name + "/" + layout + "/";
    const auto hand_path = scratch_directory() / (stem + ".raw");
    const auto path = file_for(stem, format);
    add(base + "hand", bytes, [=](benchmark::State& s) {
      const window& w = window_of(count, elements);
      save ? hand_save(s, w, hand_path) : hand_load(s, w, hand_path);
    });
    if (count == 1 && format == checkpoint_format::binary) {
      add(base + "checksum", bytes, [=](benchmark::State& s) { checksum_only(s, window_of(count, elements)); });
      for (const bool hashed : {false, true}) {
        add(base + (hashed ? "pieces_hashed" : "pieces"), bytes,
            [=](benchmark::State& s) { pieces_peer(s, window_of(count, elements), hand_path, save, hashed); });
      }
    }
    for (const bool whole : {true, false}) {
      add(base + (whole ? "ours_eigen" : "ours_record"), bytes, [=](benchmark::State& s) {
        const window& w = window_of(count, elements);
        save ? ours_save(s, w, path, format, whole) : ours_load(s, w, path, format, whole);
      });
    }
  }
}

}  // namespace
}  // namespace ga_bench

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  using gradaccum::checkpoint_format;
  // Memory (/dev/shm) by default, so the numbers are the library's and not a disk's;
  // GRADACCUM_BENCH_DIR names another directory (a disk, to see what the asynchronous save buys).
  const char* chosen = std::getenv("GRADACCUM_BENCH_DIR");
  const fs::path base = chosen != nullptr && *chosen != '\0' ? fs::path(chosen)
                        : fs::exists("/dev/shm")             ? fs::path("/dev/shm")
                                                             : fs::temp_directory_path();
  ga_bench::scratch_directory() = base / ("gradaccum-bench-" + std::to_string(::getpid()));
  fs::create_directories(ga_bench::scratch_directory());
  const int status = ga_bench::run(argc, argv, [] {
    benchmark::AddCustomContext("ga_checkpoint_dir", ga_bench::scratch_directory().string());
    using ga_bench::MiB;
    using ga_bench::KiB;
    for (const auto format : {checkpoint_format::binary, checkpoint_format::portable_binary}) {
      ga_bench::register_cases(format, 1, 256 * KiB / sizeof(float));
      ga_bench::register_cases(format, 1, 4 * MiB / sizeof(float));
      ga_bench::register_cases(format, 1, 64 * MiB / sizeof(float));
      ga_bench::register_cases(format, 10'000, 64);
    }
    if (ga_bench::size_enabled(64 * MiB)) {
      const auto path = ga_bench::scratch_directory() / "snapshot.bin";
      ga_bench::add("ckpt_snapshot/binary/1_tensor/hand", 64 * MiB, [](benchmark::State& s) {
        ga_bench::hand_snapshot(s, ga_bench::window_of(1, 64 * MiB / sizeof(float)));
      });
      ga_bench::add("ckpt_snapshot/binary/1_tensor/ours_eigen", 64 * MiB, [path](benchmark::State& s) {
        ga_bench::ours_snapshot(s, ga_bench::window_of(1, 64 * MiB / sizeof(float)), path);
      });
    }
    // Text is ~2.7x larger than binary and every value is formatted and parsed.
    ga_bench::register_cases(checkpoint_format::json, 1, 256 * KiB / sizeof(float));
    ga_bench::register_cases(checkpoint_format::json, 1, 64 * MiB / sizeof(float));
    ga_bench::register_cases(checkpoint_format::json, 1'000, 64);
  });
  std::error_code ignored;
  fs::remove_all(ga_bench::scratch_directory(), ignored);
  return status;
}
