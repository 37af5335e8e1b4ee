#pragma once
/// @file
/// @brief The implementation of `<gradaccum/mpi.hpp>`: the window buffer the values are reduced
/// in (host memory, or a device window staged a bucket at a time or handed to MPI as it is), the
/// agreement step over it (`mpi/agreement.hpp`), and the bucketed collectives. Include
/// `<gradaccum/mpi.hpp>`.

#include <algorithm>
#include <atomic>
#include <bit>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's MPIX_Query_cuda_support (MPICH declares its query in mpi.h)
#endif

#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/flat_gradients.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/mpi/agreement.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/sharded_gradients.hpp"
#include "gradaccum/weighted_gradients_accumulator.hpp"

namespace gradaccum::detail::mpi {

/// Elements of W in a bucket of `bytes`: at least one, at most what an MPI count (`int`) holds.
inline std::size_t bucket_elements(std::size_t bytes, std::size_t element_size) noexcept {
  return std::clamp<std::size_t>(bytes / element_size, 1, static_cast<std::size_t>(INT_MAX));
}

/// Whether the MPI library reads and writes CUDA device memory, by its own run-time query: Open
/// MPI's `MPIX_Query_cuda_support`, MPICH's `MPIX_GPU_query_support` (4.0 on, and the libraries
/// built on it); false for a library that cannot say.
inline bool mpi_takes_cuda_memory() noexcept {
#if defined(MPIX_CUDA_AWARE_SUPPORT)
  return MPIX_Query_cuda_support() == 1;
#elif defined(MPIX_GPU_SUPPORT_CUDA)
  int supported = 0;
  return MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported) == MPI_SUCCESS && supported != 0;
#else
  return false;
#endif
}

template <class W>
MPI_Datatype datatype() noexcept {
  if constexpr (std::is_same_v<W, float>) {
    return MPI_FLOAT;
  } else {
    return MPI_DOUBLE;
  }
}

/// `1 / d` when `d` is a power of two whose reciprocal is exact, else 0.
template <class W>
W exact_reciprocal(W d) noexcept {
  int exponent = 0;
  if (std::frexp(d, &exponent) != W(0.5)) return 0;
  const W reciprocal = W(1) / d;
  return reciprocal * d == W(1) ? reciprocal : W(0);
}

/// `x[i] = op(x[i])`, in blocks of a fixed count so that GCC's -O2 (whose cost model only
/// vectorizes loops that need no remainder loop) vectorizes it too.
template <class W, class Op>
void for_each_value(W* x, std::size_t count, Op op) noexcept {
  constexpr std::size_t block = 64;
  std::size_t i = 0;
  for (; i + block <= count; i += block) {
    for (std::size_t j = 0; j < block; ++j) x[i + j] = op(x[i + j]);
  }
  for (; i < count; ++i) x[i] = op(x[i]);
}

/// `x[i] = (x[i] / s) / w` with the bits of `kernels::divide` (`finish_mean`'s). Dividing by a
/// power of two is multiplying by its exact reciprocal: both round the same real number, so a
/// loss scale that is one (as dynamic loss scaling keeps it) costs a multiplication instead of
/// a division, which is several times slower and is most of what the reduction adds to MPI's sum.
template <class W>
void normalize(W* x, std::size_t count, W s, W w) noexcept {
  const W s_reciprocal = exact_reciprocal(s);
  const W w_reciprocal = exact_reciprocal(w);
  if (s_reciprocal != 0 && w_reciprocal != 0) {
    for_each_value(x, count, [=](W v) { return v * s_reciprocal * w_reciprocal; });
  } else if (s_reciprocal != 0) {
    for_each_value(x, count, [=](W v) { return v * s_reciprocal / w; });
  } else if (w_reciprocal != 0) {
    for_each_value(x, count, [=](W v) { return v / s * w_reciprocal; });
  } else {
    for_each_value(x, count, [=](W v) { return v / s / w; });
  }
}

/// A window ready for the value collectives: this rank's buffer laid out for the parameter set
/// (moved out of the caller's sums, or zeros), marked present wherever any rank is, and the
/// global state.
template <class B>
struct agreed_window {
  flat_gradients<B> gradients;  // host memory, for MPI; or, staged, zeros on the devices (the result)
  /// Staged (a device window): the sums on their devices, read a bucket at a time, and the result
  /// written into `gradients` a bucket at a time. Null otherwise, and for a rank without sums (it
  /// contributes zeros).
  std::shared_ptr<const flat_storage> source;
  bool staged = false;
  bool direct = false;                // staged, and every rank's buffers go to MPI as they are
  void* result_data = nullptr;        // where this rank's are: the result's values,
  const void* source_data = nullptr;  // and the sums' (null: none)
  weighted_accumulation_state state;
  std::size_t begin = 0;  // elements [begin, end) hold every present segment: the ones reduced
  std::size_t end = 0;
  bool check_non_finite = false;  // whether `found_non_finite` is wanted
  bool found_non_finite = false;  // some rank's sums held a NaN or an infinity (when checked)
  std::uint64_t number = 0;       // the reduction's number (`last_reduction`)
};

/// The largest number of a reduction this process took part in. A reduction's number is one more
/// than the largest of its ranks', so it is the same on all of its ranks and larger than that of
/// every reduction any of them took part in before: two shards of different reductions over one
/// communicator never carry the same number.
inline std::atomic<std::uint64_t> last_reduction{0};

inline void note_reduction(std::uint64_t number) noexcept {
  std::uint64_t last = last_reduction.load();
  while (last < number && !last_reduction.compare_exchange_weak(last, number)) {
  }
}

/// This rank's buffer for the reduction, found or made before the agreement so that nothing
/// after it can fail: the sums' own when laid out for `params`, else their values copied into a
/// buffer laid out for it (checked by id and shape), or zeros when there are none. A window on
/// devices is `staged`: its sums stay where they are, read a bucket at a time through host memory,
/// and a full result goes into new device buffers (zeros until then), so that a failed device
/// copy midway leaves the sums as they were and no second copy of the window is made in host
/// memory. A staged window is `direct` when MPI can take its buffers as they are
/// (`device_values::data`: one device, and memory the MPI library reaches): if every rank's is, no
/// value crosses to the host.
template <class B>
struct local_window {
  std::shared_ptr<const flat_layout<B>> layout;
  std::shared_ptr<flat_storage> storage;       // host memory; staged, zeros on the devices
  std::shared_ptr<const flat_storage> source;  // staged: the sums on their devices (or null: zeros)
  bool staged = false;
  bool direct = false;
  void* result_data = nullptr;  // direct: the buffers as MPI takes them
  const void* source_data = nullptr;
  std::vector<std::uint64_t> present;  // one bit per parameter position, for the presence exchange

  local_window(const parameter_set<B>& params, const accumulated_gradients<B>& sums) {
    validate(sums.state);
    const flat_gradients<B>& g = sums.gradients;
    if (sums.state.total_weight == 0.0 && !g.empty()) {
      fail(errc::invalid_state, "accumulated sums have zero total weight but pending gradients.");
    }
    if (!g.empty() && g.dtype() != sums.state.dtype) {
      fail(errc::invalid_state, "the pending sums are of dtype " + std::string(to_string(g.dtype())) +
                                    " but the state's work dtype is " + std::string(to_string(sums.state.dtype)) + ".");
    }
    const auto& own_layout = flat_access::layout(g);
    const auto& own_storage = flat_access::storage(g);
    layout =
        own_layout && own_layout->laid_out_for(params) ? own_layout : std::make_shared<const flat_layout<B>>(params);
    const bool fits = own_storage && layout == own_layout && own_storage->dtype == sums.state.dtype;
    staged = device_buffers_backend<B>;
    if (staged) {
      if (fits) {
        source = own_storage;
      } else if (!g.empty()) {
        std::shared_ptr<flat_storage> copy = allocate_storage(*layout, sums.state.dtype);
        for (const auto& e : g) copy_into_layout(e, g, *copy);
        source = std::move(copy);
      }
      storage = allocate_storage(*layout, sums.state.dtype);  // zeros, on the devices
      if (source) {
        storage->present = source->present;  // same length: the same layout
        storage->present_count = source->present_count;
      }
      const bool cuda_aware = mpi_takes_cuda_memory();
      result_data = storage->device->data(cuda_aware);
      source_data = source ? source->device->data(cuda_aware) : nullptr;
      direct = result_data != nullptr && (!source || source_data != nullptr);
    } else if (fits) {
      storage = own_storage;
    } else {
      storage = flat_storage::allocate(sums.state.dtype, layout->elements(), layout->size());
      for (const auto& e : g) copy_into_layout(e, g, *storage);
    }
    present.resize((layout->size() + 63) / 64);
  }

  /// Takes the buffers into `window`. The caller's sums are moved from here, once nothing can
  /// fail; staged, once every bucket was read (`reduce_staged`).
  void take(accumulated_gradients<B>& sums, agreed_window<B>& window) noexcept {
    if (!staged) sums.gradients = {};
    window.gradients = flat_access::make(std::move(layout), std::move(storage));
    window.source = std::move(source);
    window.staged = staged;
    window.direct = direct;
    window.result_data = result_data;
    window.source_data = source_data;
  }

  /// Whether the sums hold only finite values: on a device checked there, whole, when the
  /// backend can (`all_finite`), else read through host pieces.
  [[nodiscard]] bool finite() const {
    const flat_storage* const sums = staged ? source.get() : storage.get();
    if (sums == nullptr) return true;
    if (sums->device) {
      if (const std::optional<bool> on_device = sums->device->all_finite()) return *on_device;
    }
    for (std::size_t position = 0; position < layout->size(); ++position) {
      if (sums->present[position] != 0 &&
          !segment_finite(*sums, position, (*layout)[position].offset, (*layout)[position].size)) {
        return false;
      }
    }
    return true;
  }

 private:
  void copy_into_layout(const typename flat_gradients<B>::entry& e, const flat_gradients<B>& from,
                        flat_storage& target) {
    const auto position = layout->find(e.id);
    if (!position) {
      fail(errc::unknown_parameters,
           "pending gradient '" + std::string(e.id) + "' names no parameter of the parameter set.", std::string(e.id));
    }
    const flat_segment<B>& s = (*layout)[*position];
    if (s.shape != e.shape) {
      fail(errc::parameter_mismatch,
           "pending gradient '" + std::string(e.id) + "' has shape " + e.shape.to_string() +
               " but its parameter has shape " + s.shape.to_string() + ".",
           std::string(e.id));
    }
    copy_segment(*flat_access::storage(from), e.position, e.offset, target, *position, s.offset, e.size);
    target.mark_present(*position);
  }
};

/// The agreement step of every entry point: checks this rank's sums, agrees with the other ranks
/// in one small collective (two when some parameter is present on some ranks only), and on
/// success takes the sums. `reserve(elements)` allocates what the value collectives will need,
/// before the agreement: a failure on one rank is then an error on every rank, never a rank
/// missing from a collective. With `check_non_finite`, each rank's sums are read for a NaN or an
/// infinity and the agreement ORs the answers (a reduction whose result no rank holds whole).
/// Ranks must pass the same `collectives` and `bucket_bytes`, since they decide the value
/// collectives.
template <class B, class Reserve>
agreed_window<B> agree(const parameter_set<B>& params, accumulated_gradients<B>& sums, MPI_Comm comm, Reserve&& reserve,
                       value_collectives collectives, bool check_non_finite, std::uint64_t bucket_bytes) {
  int rank = 0;
  check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");

  // 1. Check this rank's sums; a failure is not thrown yet, since the peers would then wait
  //    forever in the agreement: it travels with the agreement so every rank throws.
  std::unique_ptr<local_window<B>> local;
  local_failure failure;
  bool finite = true;
  failure.run([&] {
    local = std::make_unique<local_window<B>>(params, sums);
    reserve(local->layout->elements());
    // A staged window's sums are checked as its buckets are read (see `staged_copies`).
    if (check_non_finite && (!local->staged || local->direct)) finite = local->finite();
  });

  // 2. One small collective: failures, calls, parameter sets, dtypes, loss scales, weights, counts.
  agreement agreed;
  agreed.layout = word_range::of(layout_fingerprint(params));
  agreed.dtype = word_range::of(static_cast<std::uint64_t>(sums.state.dtype));
  agreed.loss_scale = word_range::of(std::bit_cast<std::uint64_t>(sums.state.loss_scale));
  agreed.present = word_range::of(sums.gradients.size());
  agreed.bucket = word_range::of(bucket_bytes);
  agreed.collectives = word_range::of(static_cast<std::uint64_t>(collectives));
  agreed.window = word_range::of(last_reduction.load());
  agreed.total_weight = sums.state.total_weight;
  agreed.microbatches = sums.state.microbatches;
  agreed.direct = word_range::of(local && local->direct ? 1 : 0);
  agreed.non_finite = finite ? 0 : 1;
  agree_on(agreed, rank, failure, comm);

  // 3. Presence: one bit per parameter position, OR-ed over the ranks. When every rank has a
  //    gradient for every parameter (the usual case), or none for any, the OR is known, and
  //    every rank skips this collective alike. It stays apart from the agreement: its length is
  //    the parameter count, which the ranks have only just agreed on.
  flat_storage& storage = *local->storage;
  if (agreed.present.min() != params.size() && agreed.present.max != 0) {
    std::vector<std::uint64_t>& present = local->present;
    for (std::size_t position = 0; position < params.size(); ++position) {
      if (storage.present[position] != 0) present[position / 64] |= std::uint64_t{1} << (position % 64);
    }
    check(MPI_Allreduce(MPI_IN_PLACE, present.data(), static_cast<int>(present.size()), MPI_UINT64_T, MPI_BOR, comm),
          "MPI_Allreduce");
    // A segment present elsewhere only holds zeros here already: marking it is all it takes.
    for (std::size_t position = 0; position < params.size(); ++position) {
      if (((present[position / 64] >> (position % 64)) & 1U) != 0) storage.mark_present(position);
    }
  }

  // 4. Take the sums; the elements to reduce run from the first present segment to the end of
  //    the last (the zeros between cost less than splitting the collectives).
  agreed_window<B> window;
  window.state = {sums.state.dtype, sums.state.loss_scale, agreed.total_weight, agreed.microbatches};
  window.check_non_finite = check_non_finite;
  window.found_non_finite = agreed.non_finite != 0;
  window.number = agreed.window.max + 1;
  note_reduction(window.number);
  const flat_layout<B>& layout = *local->layout;
  if (storage.present_count != 0) {
    std::size_t first = 0;
    while (storage.present[first] == 0) ++first;
    std::size_t last = layout.size() - 1;
    while (storage.present[last] == 0) --last;
    window.begin = layout[first].offset;
    window.end = layout[last].offset + layout[last].size;
  }
  local->take(sums, window);
  window.direct = agreed.direct.min() == 1;
  return window;
}

/// Sums [begin, end) of `values`, at most one bucket, over `comm` in place and normalizes it.
template <class W>
void reduce(W* values, std::size_t begin, std::size_t end, W scale, W weight, MPI_Comm comm) {
  check(MPI_Allreduce(MPI_IN_PLACE, values + begin, static_cast<int>(end - begin), datatype<W>(), MPI_SUM, comm),
        "MPI_Allreduce");
  normalize(values + begin, end - begin, scale, weight);
}

/// The buckets of a `direct` staged window: each summed by MPI from the sums' device buffer into
/// the result's (in place where a rank has no sums: its result holds zeros), then the result
/// normalized on its device (`divide`: (x / s) / w, the bits of `normalize`).
template <class B, class W>
void reduce_direct(agreed_window<B>& window, std::size_t bucket, MPI_Comm comm) {
  W* const out = static_cast<W*>(window.result_data);
  const auto* const in = static_cast<const W*>(window.source_data);
  for (std::size_t at = window.begin; at < window.end; at += bucket) {
    const auto count = static_cast<int>(std::min(bucket, window.end - at));
    const void* const send = in != nullptr ? static_cast<const void*>(in + at) : MPI_IN_PLACE;
    check(MPI_Allreduce(send, out + at, count, datatype<W>(), MPI_SUM, comm), "MPI_Allreduce");
  }
  flat_access::storage(window.gradients)->device->divide_all(window.state.loss_scale, window.state.total_weight);
}

/// The device copies of a staged reduction: the first one that fails ends this rank's copies
/// (it then contributes zeros, so no peer waits in a collective), and `agree` after the last
/// collective makes every rank throw: the rank that failed first its own error, every other its
/// code. The sums were only read, so they are as they were on every rank. The sums read can be
/// checked for a NaN or an infinity on the way (`check`), and `agree` ORs the answers too.
class staged_copies {
 public:
  template <class W>
  void check(std::span<const W> values) noexcept {
    finite_ = finite_ && kernels::all_finite(values.data(), values.size());
  }

  /// `copy()`, unless an earlier one failed; returns whether every copy so far succeeded.
  template <class Copy>
  bool run(Copy&& copy) noexcept {
    return failure_.run(copy);
  }

  /// One small collective: whether every rank's copies succeeded (throws on every rank if not)
  /// and every value `check`ed on every rank was finite (returned).
  [[nodiscard]] bool agree(MPI_Comm comm) const {
    int rank = 0;
    mpi::check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
    std::uint64_t agreed[2] = {failure_.word(rank), finite_ ? 1U : 0U};
    mpi::check(MPI_Allreduce(MPI_IN_PLACE, agreed, 2, MPI_UINT64_T, MPI_MIN, comm), "MPI_Allreduce");
    failure_.rethrow(agreed[0], rank, "failed to copy its window between host and device", "the sums were not taken.");
    return agreed[1] == 1;
  }

 private:
  local_failure failure_;
  bool finite_ = true;
};

/// Reads elements [at, at + out.size()) of a window on devices (`storage`, laid out by `layout`)
/// into `out`: zeros where no segment is present, or for no storage (a rank without sums);
/// `hint` as `for_each_overlap`'s.
template <class B, class W>
void read_range(const flat_layout<B>& layout, const flat_storage* storage, std::size_t& hint, std::size_t at,
                std::span<W> out) {
  std::fill(out.begin(), out.end(), W{0});
  if (storage == nullptr) return;
  for_each_overlap(layout, hint, at, out.size(), [&](std::size_t p, std::size_t first, std::size_t to, std::size_t n) {
    if (storage->present[p] != 0) storage->device->read(p, first, std::as_writable_bytes(out.subspan(to, n)));
  });
}

/// `read_range` of a staged window's sums.
template <class B, class W>
void read_staged(const agreed_window<B>& window, std::size_t& hint, std::size_t at, std::span<W> out) {
  read_range(*flat_access::layout(window.gradients), window.source.get(), hint, at, out);
}

/// The buckets of a staged window (see `local_window`), through `staging` (one bucket of host
/// memory): each is read from the sums' devices, summed over `comm` and normalized as `reduce`
/// does, and written into the result's devices; then `staged_copies::agree`.
template <class B, class W>
void reduce_staged(agreed_window<B>& window, std::span<W> staging, MPI_Comm comm) {
  const flat_layout<B>& layout = *flat_access::layout(window.gradients);
  flat_storage& result = *flat_access::storage(window.gradients);
  staged_copies copies;
  std::size_t read_from = 0;
  std::size_t write_from = 0;
  for (std::size_t at = window.begin; at < window.end; at += staging.size()) {
    const std::span<W> bucket = staging.first(std::min(staging.size(), window.end - at));
    if (!copies.run([&] { read_staged(window, read_from, at, bucket); })) std::fill(bucket.begin(), bucket.end(), W{0});
    if (window.check_non_finite) copies.check(std::span<const W>(bucket));
    reduce(bucket.data(), 0, bucket.size(), static_cast<W>(window.state.loss_scale),
           static_cast<W>(window.state.total_weight), comm);
    copies.run([&] {
      for_each_overlap(layout, write_from, at, bucket.size(),
                       [&](std::size_t p, std::size_t first, std::size_t to, std::size_t n) {
                         if (result.present[p] != 0)
                           result.device->write(p, first, std::as_bytes(bucket.subspan(to, n)));
                       });
    });
  }
  window.found_non_finite = !copies.agree(comm) || window.found_non_finite;
}

/// `MPI_Reduce_scatter` of a staged window into `shard` (this rank's `ranges[rank]`, unnormalized)
/// through `staging`, in pieces: piece k holds the k-th run of `staging.size() / ranks` elements of
/// every rank's shard, one after another, and one `MPI_Reduce_scatter` with `counts` (room for one
/// per rank) gives each rank the sums of its run. `staging` holds at least one element per rank;
/// `hints` has one `for_each_overlap` hint per rank. Then `staged_copies::agree`, which also
/// says whether some rank's sums held a NaN or an infinity (every value is read by its rank).
template <class B, class W>
void reduce_scatter_staged(agreed_window<B>& window, std::span<const shard_range> ranges, std::size_t rank, W* shard,
                           std::span<W> staging, std::span<int> counts, std::span<std::size_t> hints, MPI_Comm comm) {
  const std::size_t run = std::max<std::size_t>(staging.size() / ranges.size(), 1);
  std::size_t longest = 0;
  for (const shard_range& r : ranges) longest = std::max(longest, r.stored);
  staged_copies copies;
  for (std::size_t k = 0; k * run < longest; ++k) {
    std::size_t to = 0;
    for (std::size_t r = 0; r < ranges.size(); ++r) {
      const std::size_t first = std::min(k * run, ranges[r].stored);
      const std::size_t count = std::min(run, ranges[r].stored - first);
      const std::span<W> part = staging.subspan(to, count);
      if (!copies.run([&] { read_staged(window, hints[r], ranges[r].begin + first, part); })) {
        std::fill(part.begin(), part.end(), W{0});
      }
      copies.check(std::span<const W>(part));
      counts[r] = static_cast<int>(count);
      to += count;
    }
    check(MPI_Reduce_scatter(staging.data(), shard + std::min(k * run, ranges[rank].stored), counts.data(),
                             datatype<W>(), MPI_SUM, comm),
          "MPI_Reduce_scatter");
  }
  window.found_non_finite = !copies.agree(comm) || window.found_non_finite;
}

}  // namespace gradaccum::detail::mpi
