#pragma once
/// @file
/// @brief Data-parallel reduction of accumulation windows across the ranks of an MPI communicator.
///
/// Ranks see different numbers of tokens, and different parameters receive gradients on
/// different ranks. These calls agree on that first, then sum every rank's window buffer (the
/// pending sums from `finish_sums()`, one contiguous block) with MPI's own collectives and
/// normalize once:
///
///     result[p] = (Σ_r sums_r[p] / W(s)) / W(Σ_r total_weight_r)
///
/// `allreduce_mean` leaves the whole result on every rank; `reduce_scatter_mean` leaves each rank
/// only its shard of it (`sharded_gradients`), for an optimizer sharded across the ranks, with
/// `global_norm` / `clip_by_global_norm` of the whole window from the shards and
/// `allgather_shards` to share the updated parameters afterwards.
///
/// Every call is collective, and each begins with one small agreement collective in which every
/// rank tells what it called with what (and whether its own checks failed), before any other
/// collective: ranks that disagree, or a rank whose arguments are rejected, make every rank throw
/// an error of the same code, and no rank is left waiting in a collective its peers never enter.
/// When several ranks reject their arguments, every rank throws the code of the lowest such rank.
///
/// Optional: include it next to `<gradaccum/gradaccum.hpp>` and link `gradaccum-mpi` (the Meson
/// feature `mpi`); the umbrella header never includes it. Every rank must use the same backend
/// and pass the same parameter set (same ids, shapes and order).
///
/// About 600 lines, kept together: the public calls and their contracts come first, then their
/// definitions, which are the order of each call's collectives (agreement, buckets, normalization)
/// and belong beside one another; the machinery under them is in `mpi/`.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpi.h>

#include "gradaccum/global_norm.hpp"
#include "gradaccum/mpi/reduction.hpp"
#include "gradaccum/mpi/shards.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/sharded_gradients.hpp"
#include "gradaccum/weighted_gradients_accumulator.hpp"

namespace gradaccum {

/// @brief How many bytes `allreduce_mean` and `start_allreduce_mean` sum per collective unless
/// told otherwise (as DDP's `bucket_cap_mb`): a bucket is normalized as soon as its sum arrives,
/// while it is still in cache where MPI's transport leaves it there (docs/multi-process.md:
/// Open MPI's single copy through the kernel does not, on one node).
inline constexpr std::size_t default_bucket_bytes = std::size_t{4} << 20;

/// @brief How `reduce_scatter_mean` sums a window.
enum class shard_reduction {
  /// One `MPI_Reduce_scatter` of the buffer: each rank receives only its shard's sums (on a
  /// network, half the bytes of an allreduce). Bit for bit `allreduce_mean`'s range whenever MPI's
  /// reduce-scatter adds in its allreduce's order: on 1 or 2 ranks always (a + b rounds as
  /// b + a), and for sums that are exact in any order; on more ranks MPI may group the additions
  /// otherwise (Open MPI does), and then the values differ in rounding.
  reduce_scatter,
  /// The very collectives of `allreduce_mean` with the same `bucket_bytes`, then the shard cut out
  /// of the result: bit for bit its range on any number of ranks, for the bytes of an allreduce.
  /// For checking a sharded optimizer against a replicated one, or when a step must not depend
  /// on how the data was sharded.
  same_as_allreduce,
};

/// @brief Reduces every rank's window sums over `comm`; returns, on every rank, the mean over all
/// ranks' microbatches with the global state (summed total weight and microbatch count).
///
/// Collective: every rank of `comm` calls it with its own `sums` (from `finish_sums()`) and the
/// same parameter set. A parameter is present when some rank's sums hold values for it (a
/// parameter named only in zero-weight microbatches is not); present on any rank, it is reduced
/// (ranks without it contribute zeros), present on none, it stays absent. The result is rounded
/// at each step as `finish_mean` rounds: when the sums across ranks are exact, it is bit for bit
/// what one process accumulating every rank's microbatches gets; every rank normalizes the same
/// sums, so every rank gets the same bits (see the implementation notes below).
///
/// @throws error(errc::invalid_state) when ranks disagree on the work dtype or the loss scale, or
/// call different collectives of this header, or when a rank's sums are malformed; error(errc::parameter_mismatch) when
/// ranks pass different parameter sets; error(errc::empty_weight) when the total weight over all ranks is zero;
/// error(errc::invalid_weight) or error(errc::counter_overflow) when the summed weights or counts
/// do not fit. A rank whose own sums are rejected throws its own error (also
/// error(errc::unknown_parameters) or error(errc::parameter_mismatch) for a pending gradient that
/// is no parameter of `params`); its peers throw the same code naming that rank. When several
/// ranks' sums are rejected, the lowest of them throws its own error and every other rank that
/// rank's code. Every rank throws alike, and `sums` is moved from only on success.
///
/// Values are summed in buckets of `bucket_bytes` (at least one element, at most `INT_MAX`);
/// every rank must pass the same, else error(errc::invalid_state) on every rank. The buckets are
/// summed one after another, each by one blocking `MPI_Allreduce`.
///
/// Sums on a device (`device_buffers_backend`) are reduced into new device buffers that become
/// the result: straight from buffer to buffer when every rank's window is on one device whose
/// memory its MPI library reaches (the backend's `data`: host memory, or CUDA memory with a
/// CUDA-aware MPI), else through one bucket of host memory at a time. A device copy that fails
/// (the backend's `read` or `write` throws) is thrown after the last bucket by every rank: by
/// that rank as thrown, by the others as error(errc::invalid_state) naming it; `sums` is then as
/// it was.
template <class B>
[[nodiscard]] accumulated_gradients<B> allreduce_mean(const parameter_set<B>& params, accumulated_gradients<B>&& sums,
                                                      MPI_Comm comm, std::size_t bucket_bytes = default_bucket_bytes);

template <class B>
class allreduce_mean_request;

/// @brief Starts the reduction of `allreduce_mean` and returns a request to wait on, so the value
/// sums overlap other work.
///
/// The agreement happens before this returns, so every error of `allreduce_mean` is thrown here,
/// by every rank alike; every value collective is started here too (so the caller's own
/// collectives on `comm`, before or after, keep the same order on every rank). They move on
/// inside MPI calls: call `test()` now and then while overlapping other work. Sums on a device
/// that go to MPI as they are (see `allreduce_mean`) are summed into the result's device buffer
/// and divided there once the last bucket has arrived; staged through host memory, they are
/// reduced before this returns (one bucket of host memory, no overlap).
template <class B>
[[nodiscard]] allreduce_mean_request<B> start_allreduce_mean(const parameter_set<B>& params,
                                                             accumulated_gradients<B>&& sums, MPI_Comm comm,
                                                             std::size_t bucket_bytes = default_bucket_bytes);

/// @brief A reduction started by `start_allreduce_mean`.
///
/// - `test()`: whether every value has been summed and normalized (so `wait()` will not block);
///   true from then on, also after `wait()` and on a moved-from request.
/// - `wait()`: blocks until then and returns the result; a second call (or one on a moved-from
///   request) throws error(errc::invalid_state).
/// - Destroying a request before `wait()` first completes its collectives (the peers are in them
///   too) and discards the result; it must therefore happen before `MPI_Finalize`.
/// - Moving it leaves the buffers MPI reads and writes where they are.
template <class B>
class allreduce_mean_request {
 public:
  allreduce_mean_request(allreduce_mean_request&& other) noexcept;
  allreduce_mean_request& operator=(allreduce_mean_request&& other) noexcept;
  allreduce_mean_request(const allreduce_mean_request&) = delete;
  allreduce_mean_request& operator=(const allreduce_mean_request&) = delete;
  ~allreduce_mean_request();

  /// @brief Whether the reduction has finished; normalizes the buckets that have arrived.
  [[nodiscard]] bool test();

  /// @brief Waits for the reduction and returns `(Σ_r sums_r / W(s)) / W(Σ_r total_weight_r)`
  /// for every parameter present on any rank, with the global state.
  /// @throws error(errc::invalid_state) when the result was already taken.
  [[nodiscard]] accumulated_gradients<B> wait();

  /// @brief The global state of the reduced windows: agreed dtype and loss scale, summed weight
  /// and microbatch count.
  [[nodiscard]] const weighted_accumulation_state& state() const noexcept { return window_.state; }

 private:
  template <class B2>
  friend allreduce_mean_request<B2> start_allreduce_mean(const parameter_set<B2>&, accumulated_gradients<B2>&&,
                                                         MPI_Comm, std::size_t);
  template <class B2>
  friend accumulated_gradients<B2> allreduce_mean(const parameter_set<B2>&, accumulated_gradients<B2>&&, MPI_Comm,
                                                  std::size_t);

  template <class B2>
  friend sharded_gradients<B2> reduce_scatter_mean(const parameter_set<B2>&, accumulated_gradients<B2>&&, MPI_Comm,
                                                   shard_reduction, std::size_t);

  /// Agrees and starts the collectives. For every caller but `start_allreduce_mean`, the buckets
  /// are reduced right here, one blocking `MPI_Allreduce` after another, instead. For
  /// `reduce_scatter_mean`, the agreement also ORs whether any rank's sums hold a non-finite
  /// value; `also_reserve(elements)` allocates what the caller needs, inside the agreement.
  template <class Reserve>
  allreduce_mean_request(const parameter_set<B>& params, accumulated_gradients<B>& sums, MPI_Comm comm,
                         std::size_t bucket_bytes, detail::mpi::value_collectives collectives, Reserve&& also_reserve);

  /// Bucket `k`'s sum has arrived: normalizes it, or (a direct window on devices) divides the
  /// whole result once the last one has.
  void bucket_arrived(std::size_t k) noexcept;
  void complete_quietly() noexcept;

  detail::mpi::agreed_window<B> window_;
  std::vector<MPI_Request> requests_;  // one per bucket; MPI_REQUEST_NULL once it completed
  std::vector<int> completed_;         // indices from MPI_Testsome / MPI_Waitsome
  std::size_t bucket_ = 0;             // elements per bucket
  std::size_t in_flight_ = 0;
  bool taken_ = true;
};

/// @brief Reduces every rank's window sums over `comm` as `allreduce_mean` does, and leaves each
/// rank only its shard of the result: rank r holds elements `shard_of(elements, r, ranks)` of the
/// normalized buffer, and `pieces()` says which parameters (and which of their elements) they are.
///
/// Collective, with the agreement, presence rules, errors and strong guarantee of
/// `allreduce_mean` (every rank must pass the same `how` and `bucket_bytes`; `bucket_bytes` is
/// used by `shard_reduction::same_as_allreduce`, and for sums on a device staged through host
/// memory: pieces of one bucket, each holding every rank's next run of its shard, and the
/// non-finite check done on the way). The same agreement also ORs whether each
/// rank's sums hold a NaN or an infinity (`found_non_finite()`, the same on every rank; this
/// reads every rank's sums once). See `shard_reduction` for when the shard has the bits of
/// `allreduce_mean`'s range.
/// @throws the errors of `allreduce_mean`; error(errc::parameter_mismatch) on every rank when a
/// shard's element count exceeds MPI's `int`.
template <class B>
[[nodiscard]] sharded_gradients<B> reduce_scatter_mean(const parameter_set<B>& params, accumulated_gradients<B>&& sums,
                                                       MPI_Comm comm,
                                                       shard_reduction how = shard_reduction::reduce_scatter,
                                                       std::size_t bucket_bytes = default_bucket_bytes);

/// @brief `global_norm` of the whole window from its shards, with its bits: each rank sums the
/// squares of its own `norm_block_elements` blocks, one `MPI_Allgather` (one double per block,
/// 1/512 of an F32 window's bytes) gives every rank every block's sum, and every rank adds them in
/// block order, as `global_norm` of the full result does.
///
/// Collective over the communicator the shard was reduced on; every rank passes its shard of the
/// same reduction. An agreement step comes first (see the file comment), so every error is
/// thrown by every rank alike, with the same code, and nothing changes.
/// @throws error(errc::invalid_state) when some rank's `shard` was not cut for its place in
/// `comm` (its size and rank), when ranks pass shards of different work dtypes or of different
/// reductions (every reduction is numbered alike on its ranks, and differently from every other
/// reduction any of them took part in), or when ranks make different calls (one `global_norm`,
/// another `clip_by_global_norm`, `allgather_shards` or a reduction).
template <class B>
[[nodiscard]] double global_norm(const sharded_gradients<B>& shard, MPI_Comm comm);

/// @brief `clip_by_global_norm` of the whole window, applied to this rank's shard: the norm of
/// `global_norm(shard, comm)` and the coefficient of `clip_by_global_norm`, so a shard equal to its
/// range of the full result stays equal to it clipped. Returns the norm before clipping; a
/// non-finite norm leaves the values as they were.
/// @throws error(errc::invalid_scalar) on every rank when some rank's `max_norm` is negative or
/// NaN; error(errc::invalid_state) when ranks pass different `max_norm`s (bit for bit), or as
/// `global_norm`. Nothing changes on any rank on error.
template <class B>
double clip_by_global_norm(sharded_gradients<B>& shard, double max_norm, MPI_Comm comm);

/// @brief After an optimizer step that updated only this rank's shard: `flat_parameters` is laid
/// out like the window's buffer (`layout()->elements()` values, each parameter at its segment's
/// offset), this rank has written elements [range().begin, range().begin + range().stored) of it,
/// and on return every rank holds every rank's part (one in-place `MPI_Allgatherv`).
///
/// Collective over the communicator the shard was reduced on, with the agreement step of
/// `global_norm`: every error is thrown by every rank alike.
/// @throws error(errc::parameter_mismatch) on every rank when some rank's `flat_parameters` has
/// another size than the layout or more elements than MPI's `int` counts;
/// error(errc::invalid_state) when ranks pass buffers of different element types, or as
/// `global_norm`. Nothing changes on any rank on error.
template <class W, class B>
  requires(std::is_same_v<W, float> || std::is_same_v<W, double>)
void allgather_shards(const sharded_gradients<B>& shard, std::span<W> flat_parameters, MPI_Comm comm);

// ---------------------------------------------------------------------------------------------
// Implementation.
//
// The values are summed in place over the window buffer in buckets of at most `bucket_bytes`,
// each normalized once its sum has arrived: in the blocking calls one `MPI_Allreduce` per bucket,
// one after another; in `start_allreduce_mean` one `MPI_Iallreduce` per bucket, all in flight
// together. A bucket is normalized while its sum is still in cache, which keeps the blocking
// reduction within the cost of one raw `MPI_Allreduce` of the buffer (the target;
// docs/multi-process.md has the α–β model and `benchmarks/bench_mpi.cpp` the measurement).
// Every rank normalizes the same sums with the same arithmetic,
// so it gets the same bits as long as MPI hands every rank the same sums, which the reduction
// algorithms of Open MPI and MPICH do for a commutative operation (each sum is formed once and
// sent, or formed by both partners of an exchange as a + b and b + a, which round alike).
//
// Only collectives on the caller's communicator are used, no point-to-point messages, so no
// duplicate communicator is needed: MPI keeps collective traffic apart from point-to-point
// traffic on a communicator, and the caller's collectives cannot cross ours since the request
// starts all of its collectives in `start_allreduce_mean`, where every rank is in the same call.
// (Starting buckets later, as earlier ones complete, would order them differently on different
// ranks relative to the caller's collectives, or another request's, whenever ranks call `test()`
// at different moments.)
// ---------------------------------------------------------------------------------------------

template <class B>
template <class Reserve>
allreduce_mean_request<B>::allreduce_mean_request(const parameter_set<B>& params, accumulated_gradients<B>& sums,
                                                  MPI_Comm comm, std::size_t bucket_bytes,
                                                  detail::mpi::value_collectives collectives, Reserve&& also_reserve) {
  using detail::mpi::value_collectives;
  const bool blocking = collectives != value_collectives::started_allreduce;
  const auto bucket_of = [&](float_dtype dtype) {
    return detail::mpi::bucket_elements(bucket_bytes, dtype == float_dtype::f64 ? sizeof(double) : sizeof(float));
  };
  std::vector<double> staging;  // a staged window's host memory: one bucket of W (double-aligned)
  window_ = detail::mpi::agree(
      params, sums, comm,
      [&](std::size_t elements) {
        if (!blocking) {
          requests_.reserve(elements / bucket_of(sums.state.dtype) + 1);
          completed_.resize(requests_.capacity());
        }
        if (device_buffers_backend<B>) {
          const std::size_t bytes = std::min(bucket_of(sums.state.dtype), elements) * size_of(sums.state.dtype);
          staging.resize((bytes + sizeof(double) - 1) / sizeof(double));
        }
        also_reserve(elements);
      },
      collectives, collectives == value_collectives::allreduce_then_shard, bucket_bytes);
  bucket_ = bucket_of(window_.state.dtype);
  taken_ = false;
  try {
    detail::visit_work_dtype(window_.state.dtype, [&]<class W>() {
      if (window_.staged && !(window_.direct && !blocking)) {
        // Started without MPI reaching the buffers, this reduces at once: overlapping it would
        // take either every bucket in host memory (a second copy of the window) or a thread.
        const std::size_t count = std::min(bucket_, staging.size() * sizeof(double) / sizeof(W));
        if (window_.direct) {
          detail::mpi::reduce_direct<B, W>(window_, bucket_, comm);
        } else {
          detail::mpi::reduce_staged(window_, std::span<W>(reinterpret_cast<W*>(staging.data()), count), comm);
        }
        // Every bucket was read: the sums are taken only now (by `reduce_scatter_mean` once it
        // has read its shard from the result).
        if (collectives != value_collectives::allreduce_then_shard) sums.gradients = {};
        return;
      }
      W* const values = window_.staged ? nullptr : detail::flat_access::storage(window_.gradients)->template data<W>();
      if (blocking) {
        for (std::size_t at = window_.begin; at < window_.end; at += bucket_) {
          detail::mpi::reduce(values, at, std::min(at + bucket_, window_.end), static_cast<W>(window_.state.loss_scale),
                              static_cast<W>(window_.state.total_weight), comm);
        }
        return;
      }
      // Staged and direct: from the sums' device buffer into the result's (in place for a rank
      // without sums), divided on the device once the last bucket has arrived.
      W* const out = window_.staged ? static_cast<W*>(window_.result_data) : values;
      const auto* const in = static_cast<const W*>(window_.source_data);
      for (std::size_t at = window_.begin; at < window_.end; at += bucket_) {
        const std::size_t count = std::min(bucket_, window_.end - at);
        const void* const send = in != nullptr ? static_cast<const void*>(in + at) : MPI_IN_PLACE;
        MPI_Request& request = requests_.emplace_back(MPI_REQUEST_NULL);  // reserved: cannot throw
        detail::mpi::check(MPI_Iallreduce(send, out + at, static_cast<int>(count), detail::mpi::datatype<W>(), MPI_SUM,
                                          comm, &request),
                           "MPI_Iallreduce");
        ++in_flight_;
      }
      if (window_.staged) sums.gradients = {};  // MPI reads them from the buffer `window_.source` holds
    });
  } catch (...) {
    complete_quietly();  // the buckets already started (only an MPI error gets here)
    throw;
  }
}

template <class B>
allreduce_mean_request<B>::allreduce_mean_request(allreduce_mean_request&& other) noexcept
    : window_(std::move(other.window_)),
      requests_(std::move(other.requests_)),
      completed_(std::move(other.completed_)),
      bucket_(other.bucket_),
      in_flight_(std::exchange(other.in_flight_, 0)),
      taken_(std::exchange(other.taken_, true)) {}

template <class B>
allreduce_mean_request<B>& allreduce_mean_request<B>::operator=(allreduce_mean_request&& other) noexcept {
  if (this != &other) {
    complete_quietly();
    window_ = std::move(other.window_);
    requests_ = std::move(other.requests_);
    completed_ = std::move(other.completed_);
    bucket_ = other.bucket_;
    in_flight_ = std::exchange(other.in_flight_, 0);
    taken_ = std::exchange(other.taken_, true);
  }
  return *this;
}

template <class B>
allreduce_mean_request<B>::~allreduce_mean_request() {
  complete_quietly();
}

template <class B>
bool allreduce_mean_request<B>::test() {
  if (in_flight_ == 0) return true;
  int count = 0;
  const int size = static_cast<int>(requests_.size());
  // The analyzer's MPI checker cannot follow the requests into the vector they were started in.
  // NOLINTNEXTLINE(clang-analyzer-optin.mpi.MPI-Checker)
  detail::mpi::check(MPI_Testsome(size, requests_.data(), &count, completed_.data(), MPI_STATUSES_IGNORE),
                     "MPI_Testsome");
  if (count == MPI_UNDEFINED) count = 0;
  for (int k = 0; k < count; ++k) bucket_arrived(static_cast<std::size_t>(completed_[static_cast<std::size_t>(k)]));
  return in_flight_ == 0;
}

template <class B>
accumulated_gradients<B> allreduce_mean_request<B>::wait() {
  if (taken_) detail::fail(errc::invalid_state, "this reduction's result was already taken.");
  // In order: buckets complete about in the order they started, and MPI_Wait progresses the
  // later ones too.
  for (std::size_t k = 0; k < requests_.size() && in_flight_ != 0; ++k) {
    if (requests_[k] == MPI_REQUEST_NULL) continue;  // completed in test()
    // NOLINTNEXTLINE(clang-analyzer-optin.mpi.MPI-Checker): see test()
    detail::mpi::check(MPI_Wait(&requests_[k], MPI_STATUS_IGNORE), "MPI_Wait");
    bucket_arrived(k);
  }
  taken_ = true;
  return {std::move(window_.gradients), window_.state};
}

template <class B>
void allreduce_mean_request<B>::bucket_arrived(std::size_t k) noexcept {
  if (window_.staged) {  // direct: the whole result is divided on its device at the end
    if (--in_flight_ == 0) {
      detail::flat_access::storage(window_.gradients)
          ->device->divide_all(window_.state.loss_scale, window_.state.total_weight);
    }
    return;
  }
  detail::visit_work_dtype(window_.state.dtype, [&]<class W>() {
    const std::size_t at = window_.begin + k * bucket_;
    detail::mpi::normalize(detail::flat_access::storage(window_.gradients)->template data<W>() + at,
                           std::min(bucket_, window_.end - at), static_cast<W>(window_.state.loss_scale),
                           static_cast<W>(window_.state.total_weight));
  });
  --in_flight_;
}

template <class B>
void allreduce_mean_request<B>::complete_quietly() noexcept {
  if (in_flight_ == 0) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  // After MPI_Finalize the requests are gone with MPI; the class comment rules this out.
  if (finalized == 0) MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
  in_flight_ = 0;
}

template <class B>
allreduce_mean_request<B> start_allreduce_mean(const parameter_set<B>& params, accumulated_gradients<B>&& sums,
                                               MPI_Comm comm, std::size_t bucket_bytes) {
  return allreduce_mean_request<B>(params, sums, comm, bucket_bytes, detail::mpi::value_collectives::started_allreduce,
                                   [](std::size_t) {});
}

template <class B>
accumulated_gradients<B> allreduce_mean(const parameter_set<B>& params, accumulated_gradients<B>&& sums, MPI_Comm comm,
                                        std::size_t bucket_bytes) {
  return allreduce_mean_request<B>(params, sums, comm, bucket_bytes, detail::mpi::value_collectives::allreduce,
                                   [](std::size_t) {})
      .wait();
}

template <class B>
sharded_gradients<B> reduce_scatter_mean(const parameter_set<B>& params, accumulated_gradients<B>&& sums, MPI_Comm comm,
                                         shard_reduction how, std::size_t bucket_bytes) {
  const detail::mpi::comm_place place = detail::mpi::place_in(comm);
  const auto ranks = static_cast<std::size_t>(place.ranks);
  shard_range range;
  std::vector<int> counts;
  std::shared_ptr<detail::flat_storage> shard;
  std::vector<shard_piece> pieces;
  // A window on devices, staged (see `detail::mpi::local_window`): every rank's range, and per
  // piece its count and where its reads reached; the pieces go through `staging`, one bucket (at
  // least one element per rank) of W in doubles.
  std::vector<shard_range> ranges;
  std::vector<int> piece_counts;
  std::vector<std::size_t> hints;
  std::vector<double> staging;
  const auto reserve = [&](std::size_t elements) {
    range = shard_of(elements, static_cast<std::size_t>(place.rank), ranks);
    detail::mpi::int_count(range.size, "a shard");
    if (how == shard_reduction::reduce_scatter) {
      counts.resize(ranks);
      for (std::size_t r = 0; r < ranks; ++r) counts[r] = static_cast<int>(shard_of(elements, r, ranks).stored);
      if constexpr (device_buffers_backend<B>) {
        for (std::size_t r = 0; r < ranks; ++r) ranges.push_back(shard_of(elements, r, ranks));
        piece_counts.resize(ranks);
        hints.resize(ranks);
        const std::size_t element_size = size_of(sums.state.dtype);
        const std::size_t values =
            std::max(std::min(detail::mpi::bucket_elements(bucket_bytes, element_size), elements), ranks);
        staging.resize((values * element_size + sizeof(double) - 1) / sizeof(double));
      }
    }
    shard = detail::mpi::shard_storage(sums.state.dtype, range.size, params.size(), range.stored);
    pieces.reserve(params.size());  // a segment meets a shard in one run at most
  };
  // The shard's values, its state and the flags of the window they were cut from.
  const auto cut = [&](const flat_gradients<B>& window, const weighted_accumulation_state& state, bool found_non_finite,
                       std::uint64_t reduction) {
    const detail::flat_storage& full = *detail::flat_access::storage(window);
    std::copy(full.present.begin(), full.present.end(), shard->present.begin());
    shard->present_count = full.present_count;
    const auto& layout = detail::flat_access::layout(window);
    detail::shard_access::pieces_in(*layout, shard->present, range, pieces);
    return detail::shard_access::make(layout, std::move(shard), std::move(pieces), state, range, found_non_finite,
                                      reduction);
  };

  if (how == shard_reduction::same_as_allreduce) {
    // Every rank computes the whole of allreduce_mean's result, by its very calls, and keeps its range.
    allreduce_mean_request<B> request(params, sums, comm, bucket_bytes,
                                      detail::mpi::value_collectives::allreduce_then_shard, reserve);
    const bool found_non_finite = request.window_.found_non_finite;
    const std::uint64_t reduction = request.window_.number;
    const accumulated_gradients<B> reduced = request.wait();
    const detail::flat_storage& all = *detail::flat_access::storage(reduced.gradients);
    detail::visit_work_dtype(reduced.state.dtype, [&]<class W>() {
      W* const values = shard->template data<W>();
      if (!all.device) {
        std::copy_n(all.data<W>() + range.begin, range.stored, values);
        return;
      }
      // The range read from the result's devices; whether every rank's reads succeeded is agreed
      // before the sums are taken.
      detail::mpi::staged_copies copies;
      std::size_t hint = 0;
      copies.run([&] {
        detail::mpi::read_range(*detail::flat_access::layout(reduced.gradients), &all, hint, range.begin,
                                std::span<W>(values, range.stored));
      });
      (void)copies.agree(comm);
      sums.gradients = {};
    });
    return cut(reduced.gradients, reduced.state, found_non_finite, reduction);
  }

  detail::mpi::agreed_window<B> window =
      detail::mpi::agree(params, sums, comm, reserve, detail::mpi::value_collectives::reduce_scatter, true, 0);
  const detail::flat_storage& full = *detail::flat_access::storage(window.gradients);
  detail::visit_work_dtype(window.state.dtype, [&]<class W>() {
    if (window.staged && !window.direct) {
      detail::mpi::reduce_scatter_staged(
          window, std::span<const shard_range>(ranges), static_cast<std::size_t>(place.rank), shard->template data<W>(),
          std::span<W>(reinterpret_cast<W*>(staging.data()), staging.size() * sizeof(double) / sizeof(W)),
          std::span<int>(piece_counts), std::span<std::size_t>(hints), comm);
    } else {
      const void* send = full.data<W>();
      if (window.staged) {
        // Direct: from the sums' device buffer (or the zeros of a rank without sums). It ends
        // with the last segment, so the layout's padding after it is not sent: it sums to zero.
        send = window.source_data != nullptr ? window.source_data : window.result_data;
        const auto& layout = *detail::flat_access::layout(window.gradients);
        const std::size_t sent =
            layout.size() == 0 ? 0 : layout[layout.size() - 1].offset + layout[layout.size() - 1].size;
        for (std::size_t r = 0; r < ranks; ++r) {
          const shard_range theirs = ranges[r];
          counts[r] = static_cast<int>(std::min(theirs.stored, sent - std::min(sent, theirs.begin)));
        }
        const auto received = static_cast<std::size_t>(counts[static_cast<std::size_t>(place.rank)]);
        std::fill(shard->template data<W>() + received, shard->template data<W>() + range.stored, W{0});
      }
      detail::mpi::check(
          MPI_Reduce_scatter(send, shard->template data<W>(), counts.data(), detail::mpi::datatype<W>(), MPI_SUM, comm),
          "MPI_Reduce_scatter");
    }
    if (window.staged) sums.gradients = {};  // every value was read: the sums are taken only now
    detail::mpi::normalize(shard->template data<W>(), range.stored, static_cast<W>(window.state.loss_scale),
                           static_cast<W>(window.state.total_weight));
  });
  return cut(window.gradients, window.state, window.found_non_finite, window.number);
}

template <class B>
double global_norm(const sharded_gradients<B>& shard, MPI_Comm comm) {
  return detail::mpi::sharded_norm(shard, comm, {detail::mpi::value_collectives::shard_global_norm});
}

template <class B>
double clip_by_global_norm(sharded_gradients<B>& shard, double max_norm, MPI_Comm comm) {
  const double norm = detail::mpi::sharded_norm(shard, comm, {detail::mpi::value_collectives::shard_clip, 0, max_norm});
  if (std::isfinite(norm)) {
    detail::visit_work_dtype(shard.dtype(),
                             [&]<class W>() { detail::clip_values(shard.template values<W>(), norm, max_norm); });
  }
  return norm;
}

template <class W, class B>
  requires(std::is_same_v<W, float> || std::is_same_v<W, double>)
void allgather_shards(const sharded_gradients<B>& shard, std::span<W> flat_parameters, MPI_Comm comm) {
  const std::size_t elements = shard.layout() != nullptr ? shard.layout()->elements() : 0;
  std::vector<int> counts;
  std::vector<int> offsets;
  const detail::mpi::shard_call call{detail::mpi::value_collectives::shard_allgather,
                                     static_cast<std::uint64_t>(dtype_of<W>)};
  detail::mpi::agree_on_shard(shard, comm, call, [&](const detail::mpi::comm_place& place) {
    if (flat_parameters.size() != elements) {
      detail::fail(errc::parameter_mismatch, "a flat parameter buffer of " + std::to_string(flat_parameters.size()) +
                                                 " elements does not fit the window's layout of " +
                                                 std::to_string(elements) + ".");
    }
    detail::mpi::int_count(elements, "a flat parameter buffer");
    const auto ranks = static_cast<std::size_t>(place.ranks);
    counts.resize(ranks);
    offsets.resize(ranks);
    for (std::size_t r = 0; r < ranks; ++r) {
      const shard_range range = shard_of(elements, r, ranks);
      counts[r] = static_cast<int>(range.stored);
      offsets[r] = static_cast<int>(range.stored != 0 ? range.begin : 0);
    }
  });
  detail::mpi::check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, flat_parameters.data(), counts.data(),
                                    offsets.data(), detail::mpi::datatype<W>(), comm),
                     "MPI_Allgatherv");
}

}  // namespace gradaccum
