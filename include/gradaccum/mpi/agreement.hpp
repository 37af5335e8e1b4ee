#pragma once
/// @file
/// @brief The agreement step of `<gradaccum/mpi.hpp>`: what every rank contributes before any
/// value collective (failures, calls, parameter sets, dtypes, scales, weights, counts), combined
/// by one small user-defined reduction, and the error every rank then throws alike. Include
/// `<gradaccum/mpi.hpp>`.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <string_view>

#include <mpi.h>

#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/parameter_set.hpp"

namespace gradaccum::detail::mpi {

/// MPI failures only reach here under `MPI_ERRORS_RETURN`; the default handler aborts the job.
inline void check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  fail(errc::invalid_state,
       std::string(call) + " failed: " + std::string(text, static_cast<std::size_t>(length)) + ".");
}

/// The smallest and largest value of a word over the ranks, kept as `max(x)` and `max(~x)` so
/// that one reduction operation computes both.
struct word_range {
  std::uint64_t max = 0;
  std::uint64_t not_min = 0;

  static word_range of(std::uint64_t x) noexcept { return {x, ~x}; }
  [[nodiscard]] std::uint64_t min() const noexcept { return ~not_min; }
  [[nodiscard]] bool agreed() const noexcept { return max == min(); }
  void combine(const word_range& other) noexcept {
    max = std::max(max, other.max);
    not_min = std::max(not_min, other.not_min);
  }
};

/// Above every failure word (`rank << 8 | errc`) and below 2^63, so that an `MPI_MIN` of words
/// as `MPI_UINT64_T` picks the first failure also where the library compares them as signed
/// (MPICH 4.0.2 does).
inline constexpr std::uint64_t no_failure = std::numeric_limits<std::int64_t>::max();

/// What this rank's own step threw before a collective. An exception cannot cross ranks, but its
/// code can: the collective carries `word`, MPI_MIN picks the lowest failed rank, and `rethrow`
/// then makes every rank throw.
class local_failure {
 public:
  /// Runs `step` unless an earlier one failed, keeping what it throws; whether it succeeded.
  template <class Step>
  bool run(Step&& step) noexcept {
    if (exception_) return false;
    try {
      step();
      return true;
    } catch (const error& e) {
      code_ = e.code();
      exception_ = std::current_exception();
    } catch (...) {
      exception_ = std::current_exception();  // not the library's: counted as invalid_state
    }
    return false;
  }

  /// This rank's contribution to the agreed first failure: `rank << 8 | code`, or `no_failure`.
  [[nodiscard]] std::uint64_t word(int rank) const noexcept {
    return exception_ ? static_cast<std::uint64_t>(rank) << 8 | static_cast<unsigned>(code_) : no_failure;
  }

  /// Throws for the agreed `first_failure`, unless it is `no_failure`: the rank that failed first
  /// its own exception, every other rank `error(code)` naming that rank, "rank R " + `what` + ...
  void rethrow(std::uint64_t first_failure, int rank, std::string_view what, std::string_view outcome) const {
    if (first_failure == no_failure) return;
    if (exception_ && first_failure >> 8 == static_cast<std::uint64_t>(rank)) std::rethrow_exception(exception_);
    const auto code = static_cast<errc>(first_failure & 0xffU);
    fail(code, {"rank ", first_failure >> 8, " ", what, " (", make_error_code(code).message(), "); ", outcome});
  }

 private:
  std::exception_ptr exception_;
  errc code_ = errc::invalid_state;
};

/// Which call the collectives after an agreement belong to: every collective the library makes
/// follows an agreement, and ranks in different calls (`allreduce_mean` on one, `global_norm` of
/// a shard on another) then throw the same error instead of entering different collectives.
enum class value_collectives : std::uint64_t {
  allreduce = 1,         // allreduce_mean
  started_allreduce,     // start_allreduce_mean
  reduce_scatter,        // reduce_scatter_mean, shard_reduction::reduce_scatter
  allreduce_then_shard,  // reduce_scatter_mean, shard_reduction::same_as_allreduce
  shard_global_norm,     // global_norm(shard, comm)
  shard_clip,            // clip_by_global_norm(shard, max_norm, comm)
  shard_allgather,       // allgather_shards
};

inline const char* call_name(std::uint64_t collectives) noexcept {
  switch (static_cast<value_collectives>(collectives)) {
    case value_collectives::allreduce: return "allreduce_mean";
    case value_collectives::started_allreduce: return "start_allreduce_mean";
    case value_collectives::reduce_scatter: return "reduce_scatter_mean with shard_reduction::reduce_scatter";
    case value_collectives::allreduce_then_shard: return "reduce_scatter_mean with shard_reduction::same_as_allreduce";
    case value_collectives::shard_global_norm: return "global_norm of a shard";
    case value_collectives::shard_clip: return "clip_by_global_norm of a shard";
    case value_collectives::shard_allgather: return "allgather_shards";
  }
  return "an unknown call";
}

/// What every rank contributes to the agreement step; combined field by field by one
/// user-defined reduction so the whole step is one small collective. The calls on a shard use
/// `collectives`, `dtype`, `window`, `elements`, `values_dtype` and `max_norm`; the reductions
/// the others (and `window`, to number the reduction).
struct agreement {
  std::uint64_t first_failure = no_failure;  // min over ranks of (rank << 8 | errc)
  word_range layout;                         // fingerprint of the parameter set
  word_range dtype;
  word_range loss_scale;    // bit pattern of the double
  word_range present;       // how many parameters have a gradient
  word_range bucket;        // bytes per bucket of the value collectives (0 where there are none)
  word_range collectives;   // value_collectives
  word_range window;        // a shard's reduction; in a reduction, the last reduction's number
  word_range elements;      // the elements of a shard's window
  word_range values_dtype;  // of allgather_shards' buffer
  word_range max_norm;      // bit pattern of clip_by_global_norm's max_norm
  word_range direct;        // 1 where a staged window's buffers go to MPI as they are (`local_window`)
  double total_weight = 0.0;
  std::uint64_t microbatches = 0;  // saturating sum: saturation means overflow
  std::uint64_t non_finite = 0;    // 1 when some rank's sums hold a NaN or an infinity (if checked)

  void combine(const agreement& other) noexcept {
    first_failure = std::min(first_failure, other.first_failure);
    non_finite = std::max(non_finite, other.non_finite);
    layout.combine(other.layout);
    dtype.combine(other.dtype);
    loss_scale.combine(other.loss_scale);
    present.combine(other.present);
    bucket.combine(other.bucket);
    collectives.combine(other.collectives);
    window.combine(other.window);
    elements.combine(other.elements);
    values_dtype.combine(other.values_dtype);
    max_norm.combine(other.max_norm);
    direct.combine(other.direct);
    total_weight += other.total_weight;
    microbatches = other.microbatches > std::numeric_limits<std::uint64_t>::max() - microbatches
                       ? std::numeric_limits<std::uint64_t>::max()
                       : microbatches + other.microbatches;
  }
};

/// `MPI_User_function` over `agreement`s; MPI's buffers carry no alignment promise, so fields are
/// copied out and back.
inline void combine_agreements(void* in, void* inout, int* count, MPI_Datatype* /*type*/) {
  auto* const in_bytes = static_cast<const unsigned char*>(in);
  auto* const out_bytes = static_cast<unsigned char*>(inout);
  for (int i = 0; i < *count; ++i) {
    const auto offset = static_cast<std::size_t>(i) * sizeof(agreement);
    agreement a;
    agreement b;
    std::memcpy(&a, in_bytes + offset, sizeof a);
    std::memcpy(&b, out_bytes + offset, sizeof b);
    b.combine(a);
    std::memcpy(out_bytes + offset, &b, sizeof b);
  }
}

/// The datatype and reduction operation of `agreement`s, created once, on first use: Open MPI 4.1
/// keeps a few hundred bytes of every operation ever created, so one per call would leak in a
/// long run. They are freed when `MPI_Finalize` deletes the attributes of `MPI_COMM_SELF` (the
/// standard hook for a library's cleanup), so no MPI object outlives MPI.
struct library_handles {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;

  static const library_handles& get() { return instance(); }

 private:
  static library_handles& instance() {
    static library_handles handles = create();
    return handles;
  }

  static library_handles create() {
    library_handles created;
    try {
      check(MPI_Type_contiguous(static_cast<int>(sizeof(agreement)), MPI_BYTE, &created.type), "MPI_Type_contiguous");
      check(MPI_Type_commit(&created.type), "MPI_Type_commit");
      check(MPI_Op_create(&combine_agreements, 1, &created.op), "MPI_Op_create");
      int key = MPI_KEYVAL_INVALID;
      check(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &release_at_finalize, &key, nullptr),
            "MPI_Comm_create_keyval");
      check(MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr), "MPI_Comm_set_attr");
    } catch (...) {
      if (created.op != MPI_OP_NULL) MPI_Op_free(&created.op);
      if (created.type != MPI_DATATYPE_NULL) MPI_Type_free(&created.type);
      throw;
    }
    return created;
  }

  static int release_at_finalize(MPI_Comm /*comm*/, int key, void* /*value*/, void* /*extra*/) {
    library_handles& handles = instance();
    MPI_Op_free(&handles.op);
    MPI_Type_free(&handles.type);
    MPI_Comm_free_keyval(&key);
    return MPI_SUCCESS;
  }
};

/// FNV-1a over ids, ranks and dimensions: equal on every rank exactly when the parameter sets
/// list the same ids with the same shapes in the same order (up to hash collisions). Cached for
/// the last set seen, since a set only appends and hashing thousands of ids costs more than
/// reducing their values.
template <class B>
std::uint64_t layout_fingerprint(const parameter_set<B>& params) noexcept {
  struct cached {
    std::uint64_t identity = 0;
    std::size_t size = 0;
    std::uint64_t fingerprint = 0;
  };
  thread_local cached last;
  if (last.identity == params.identity() && last.size == params.size()) return last.fingerprint;
  std::uint64_t hash = 14695981039346656037ULL;
  const auto mix = [&](const void* data, std::size_t size) {
    for (std::size_t i = 0; i < size; ++i) {
      hash = (hash ^ static_cast<const unsigned char*>(data)[i]) * 1099511628211ULL;
    }
  };
  for (const auto& param : params) {
    const std::uint64_t length = param.id.size();
    const std::uint64_t rank = param.shape.rank();
    mix(&length, sizeof length);
    mix(param.id.data(), param.id.size());
    mix(&rank, sizeof rank);
    for (const std::size_t dim : param.shape) {
      const std::uint64_t extent = dim;
      mix(&extent, sizeof extent);
    }
  }
  last = {params.identity(), params.size(), hash};
  return hash;
}

/// Throws what the agreement found, the same code on every rank: every rank evaluates the same
/// agreed words in the same order. A failed local check is thrown by the rank that failed first
/// with its own message; every other rank, failed or not, throws its code.
inline void check_agreement(const agreement& agreed, int rank, const local_failure& failure) {
  failure.rethrow(agreed.first_failure, rank, "rejected its arguments", "nothing was done.");
  if (!agreed.collectives.agreed()) {
    fail(errc::invalid_state, std::string("ranks called different collectives (") +
                                  call_name(agreed.collectives.min()) + " and " + call_name(agreed.collectives.max) +
                                  "); nothing was done.");
  }
  if (agreed.collectives.max >= static_cast<std::uint64_t>(value_collectives::shard_global_norm)) {
    if (!agreed.dtype.agreed()) {
      fail(errc::invalid_state, "ranks passed shards of different work dtypes (" +
                                    std::string(to_string(static_cast<float_dtype>(agreed.dtype.min()))) + " and " +
                                    std::string(to_string(static_cast<float_dtype>(agreed.dtype.max))) +
                                    "); nothing was done.");
    }
    if (!agreed.window.agreed() || !agreed.elements.agreed()) {
      fail(errc::invalid_state, "ranks passed shards of different reductions; nothing was done.");
    }
    if (!agreed.values_dtype.agreed()) {
      fail(errc::invalid_state,
           "ranks passed flat parameter buffers of different element types (" +
               std::string(to_string(static_cast<float_dtype>(agreed.values_dtype.min()))) + " and " +
               std::string(to_string(static_cast<float_dtype>(agreed.values_dtype.max))) + "); nothing was done.");
    }
    if (!agreed.max_norm.agreed()) {
      fail(errc::invalid_state, "ranks passed different max_norm values (" +
                                    number_text(std::bit_cast<double>(agreed.max_norm.min())) + " and " +
                                    number_text(std::bit_cast<double>(agreed.max_norm.max)) + "); nothing was done.");
    }
    return;
  }
  if (!agreed.layout.agreed()) {
    fail(errc::parameter_mismatch,
         "ranks passed different parameter sets (ids, shapes or order differ); nothing was reduced.");
  }
  if (!agreed.dtype.agreed()) {
    fail(errc::invalid_state, "ranks accumulated in different work dtypes (" +
                                  std::string(to_string(static_cast<float_dtype>(agreed.dtype.min()))) + " and " +
                                  std::string(to_string(static_cast<float_dtype>(agreed.dtype.max))) +
                                  "); nothing was reduced.");
  }
  if (!agreed.bucket.agreed()) {
    fail(errc::invalid_state, "ranks asked for different bucket sizes (" + std::to_string(agreed.bucket.min()) +
                                  " and " + std::to_string(agreed.bucket.max) + " bytes); nothing was reduced.");
  }
  if (!agreed.loss_scale.agreed()) {
    fail(errc::invalid_state,
         "ranks used different loss scales (" + number_text(std::bit_cast<double>(agreed.loss_scale.min())) + " and " +
             number_text(std::bit_cast<double>(agreed.loss_scale.max)) + "); nothing was reduced.");
  }
  const auto dtype = static_cast<float_dtype>(agreed.dtype.max);
  if (agreed.microbatches == std::numeric_limits<std::uint64_t>::max()) {
    fail(errc::counter_overflow, "the ranks' microbatch counts overflow when summed.");
  }
  if (!representable(agreed.total_weight, dtype)) {
    fail(errc::invalid_weight, "the ranks' total weights sum to " + number_text(agreed.total_weight) +
                                   ", which is not representable in " + std::string(to_string(dtype)) + ".");
  }
  if (!(agreed.total_weight > 0.0)) {
    fail(errc::empty_weight,
         "cannot normalize accumulation windows whose total weight over all ranks is zero; nothing was reduced.");
  }
}

/// One agreement collective over `comm`, then its checks (`check_agreement`).
inline void agree_on(agreement& agreed, int rank, const local_failure& failure, MPI_Comm comm) {
  agreed.first_failure = failure.word(rank);
  const library_handles& handles = library_handles::get();
  check(MPI_Allreduce(MPI_IN_PLACE, &agreed, 1, handles.type, handles.op, comm), "MPI_Allreduce");
  check_agreement(agreed, rank, failure);
}

}  // namespace gradaccum::detail::mpi
