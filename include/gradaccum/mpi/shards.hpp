#pragma once
/// @file
/// @brief The sharded reduction's internals (`reduce_scatter_mean`, the sharded `global_norm`,
/// `allgather_shards` of `<gradaccum/mpi.hpp>`): agreement on a shard, its norm, its storage.

#include <bit>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpi.h>

#include "gradaccum/global_norm.hpp"
#include "gradaccum/mpi/reduction.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/sharded_gradients.hpp"
#include "gradaccum/weighted_gradients_accumulator.hpp"

// ---------------------------------------------------------------------------------------------
// The sharded reduction.
//
// One `MPI_Reduce_scatter` of the whole buffer with counts (the last shards reach past the
// buffer's end, so their counts are smaller, or 0), then this rank normalizes its shard with the
// same `normalize` as `allreduce_mean`. The shard, its counts and its pieces are allocated
// before the agreement, as the full reduction's buffers are; the window's full buffer is
// released on return, so the accumulator that produced it reuses it for the next window, and the
// shard's storage is reused by the next call once its result is gone (`shard_storage`).
// A reduce-scatter moves half the bytes of an allreduce over a network (docs/multi-process.md);
// on top of it come the non-finite check (one read of this rank's sums) and the normalization
// of the shard.
// ---------------------------------------------------------------------------------------------

namespace gradaccum::detail::mpi {

struct comm_place {
  int rank = 0;
  int ranks = 1;
};

inline comm_place place_in(MPI_Comm comm) {
  comm_place place;
  check(MPI_Comm_rank(comm, &place.rank), "MPI_Comm_rank");
  check(MPI_Comm_size(comm, &place.ranks), "MPI_Comm_size");
  return place;
}

/// What a call on a shard must agree on besides the shard.
struct shard_call {
  value_collectives call;
  std::uint64_t values_dtype = 0;  // allgather_shards: its buffer's float_dtype
  double max_norm = 0.0;           // clip_by_global_norm
};

/// The agreement step of the collectives on a shard, as `agree` is the reductions': this rank
/// checks that its shard was cut for its place in `comm`, then `prepare(place)` checks the other
/// arguments and allocates what the collectives need; a failure there is not thrown yet but
/// travels with the agreement, so every rank throws its code. So do ranks in different calls,
/// with shards of different reductions or work dtypes, or with different arguments.
template <class B, class Prepare>
comm_place agree_on_shard(const sharded_gradients<B>& shard, MPI_Comm comm, const shard_call& call, Prepare&& prepare) {
  const comm_place place = place_in(comm);
  const std::size_t elements = shard.layout() != nullptr ? shard.layout()->elements() : 0;
  local_failure failure;
  failure.run([&] {
    if (shard.range() !=
        shard_of(elements, static_cast<std::size_t>(place.rank), static_cast<std::size_t>(place.ranks))) {
      fail(errc::invalid_state, "this shard was not cut for rank " + std::to_string(place.rank) + " of " +
                                    std::to_string(place.ranks) + ".");
    }
    prepare(place);
  });
  agreement agreed;
  agreed.collectives = word_range::of(static_cast<std::uint64_t>(call.call));
  agreed.dtype = word_range::of(static_cast<std::uint64_t>(shard.dtype()));
  agreed.window = word_range::of(shard_access::reduction(shard));
  agreed.elements = word_range::of(elements);
  agreed.values_dtype = word_range::of(call.values_dtype);
  agreed.max_norm = word_range::of(std::bit_cast<std::uint64_t>(call.max_norm));
  agree_on(agreed, place.rank, failure, comm);
  return place;
}

/// `global_norm(shard, comm)`, or the norm of `clip_by_global_norm` (which also checks max_norm).
template <class B>
double sharded_norm(const sharded_gradients<B>& shard, MPI_Comm comm, const shard_call& call) {
  std::size_t blocks = 0;
  std::vector<double> block_sums;
  const comm_place place = agree_on_shard(shard, comm, call, [&](const comm_place& at) {
    if (call.call == value_collectives::shard_clip) check_max_norm(call.max_norm);
    blocks = shard.range().size / norm_block_elements;
    block_sums.resize(blocks * static_cast<std::size_t>(at.ranks));
  });
  visit_work_dtype(shard.dtype(), [&]<class W>() {
    const std::span<const W> values = shard.template values<W>();
    double* const mine = block_sums.data() + static_cast<std::size_t>(place.rank) * blocks;
    for (std::size_t b = 0; b < blocks; ++b) {
      mine[b] = kernels::sum_of_squares(values.data() + b * norm_block_elements, norm_block_elements);
    }
  });
  check(
      MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, block_sums.data(), static_cast<int>(blocks), MPI_DOUBLE, comm),
      "MPI_Allgather");
  double total = 0.0;
  for (const double block_sum : block_sums) total += block_sum;
  return std::sqrt(total);
}

/// Storage for a shard: the last one this thread handed out when its result is gone (as an
/// accumulator reuses the buffers of its results, so a training loop does not allocate and fault
/// in 1/N of a window every step), else a new one. Elements from `stored` on are zeroed; the
/// reduce-scatter writes the others.
inline std::shared_ptr<flat_storage> shard_storage(float_dtype dtype, std::size_t elements, std::size_t segments,
                                                   std::size_t stored) {
  thread_local std::shared_ptr<flat_storage> last;
  if (last && last.use_count() == 1 && last->dtype == dtype && last->elements == elements &&
      last->present.size() == segments) {
    std::memset(last->bytes.get() + stored * last->element_size(), 0, (elements - stored) * last->element_size());
  } else {
    last = flat_storage::allocate(dtype, elements, segments);
  }
  return last;
}

inline int int_count(std::size_t count, const char* what) {
  if (count > static_cast<std::size_t>(INT_MAX)) {
    fail(errc::parameter_mismatch,
         std::string(what) + " of " + std::to_string(count) + " elements exceeds what MPI's int counts can address.");
  }
  return static_cast<int>(count);
}

}  // namespace gradaccum::detail::mpi
