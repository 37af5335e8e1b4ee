#pragma once
/// @file
/// @brief Data-parallel reduction of accumulation windows across the ranks of an MPI communicator.
///
/// MPI already gives sums over a communicator (`MPI_Allreduce`, `MPI_Iallreduce`). What a
/// data-parallel gradient needs on top, and what this header adds, is agreement: ranks see
/// different numbers of tokens and different sets of parameters receive gradients on different
/// ranks. So the ranks first agree on which parameters are present (present on any rank: reduced,
/// ranks without it contribute zeros; present on none: absent), check that their parameter sets,
/// work dtypes and loss scales agree (a disagreement is the same error on every rank, never a
/// hang), then sum values, total weights and microbatch counts, and normalize once:
///
///     result[p] = (Σ_r sums_r[p] / W(s)) / W(Σ_r total_weight_r)
///
/// rounded at each step as `finish_mean`'s `divide` is. Whenever the sums across ranks are exact,
/// the result is bit for bit what one process accumulating every rank's microbatches gets; and
/// every rank always gets the same bits, since each value is summed and divided on one rank.
///
/// The values are summed by a ring reduce-scatter and all-gather of point-to-point messages (see
/// `ring_reduction`) on a duplicate of the communicator kept for the library: out of and into
/// the tensors' own memory where the backend exposes it (`host_memory_backend`), through one
/// staging piece only for pieces that span several small tensors, and through one buffer of
/// row-major copies otherwise.
///
/// Optional: include it next to `<gradaccum/gradaccum.hpp>` and link `gradaccum-mpi` (the Meson
/// feature `mpi`); the umbrella header never includes it. Every rank must use the same backend and
/// pass the same parameter set (same ids, shapes and order).

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iterator>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <mpi.h>

#include "gradaccum/backend.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/gradients_params.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/weighted_gradients_accumulator.hpp"

#ifndef GRADACCUM_MPI_PIECE_BYTES
/// Values travel in messages of at most this many bytes, so a received piece is summed into
/// its tensors while it is still in the core's cache, and the two staging buffers stay small
/// however large the window is.
#define GRADACCUM_MPI_PIECE_BYTES (std::size_t{1} << 18)
#endif

namespace gradaccum {

/// @brief A backend whose tensors the MPI reduction can move values in and out of: through their
/// host memory (`host_memory_backend`, backend.hpp), else through row-major copies.
template <class B>
concept mpi_reducible_backend = host_memory_backend<B> || serializable_backend<B>;

template <class B>
class allreduce_mean_request;

template <class B>
  requires mpi_reducible_backend<B>
[[nodiscard]] allreduce_mean_request<B> start_allreduce_mean(const parameter_set<B>& params,
                                                             accumulated_gradients<B>&& sums, MPI_Comm comm);
template <class B>
  requires mpi_reducible_backend<B>
[[nodiscard]] accumulated_gradients<B> allreduce_mean(const parameter_set<B>& params, accumulated_gradients<B>&& sums,
                                                      MPI_Comm comm);

namespace detail::mpi {

/// MPI failures only reach here under `MPI_ERRORS_RETURN`; the default handler aborts the job.
inline void check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  fail(errc::invalid_state,
       std::string(call) + " failed: " + std::string(text, static_cast<std::size_t>(length)) + ".");
}

template <class W>
MPI_Datatype datatype() noexcept {
  if constexpr (std::is_same_v<W, float>) {
    return MPI_FLOAT;
  } else {
    return MPI_DOUBLE;
  }
}

/// Calls `f(pointer, count)` over [data, data + count) in pieces whose count fits MPI's `int`.
template <class W, class F>
void for_each_piece(W* data, std::size_t count, F&& f) {
  constexpr std::size_t max_piece = std::size_t{1} << 30;
  for (std::size_t offset = 0; offset < count; offset += max_piece) {
    f(data + offset, static_cast<int>(std::min(max_piece, count - offset)));
  }
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

inline constexpr std::uint64_t no_failure = std::numeric_limits<std::uint64_t>::max();

/// What every rank contributes to the agreement step; combined field by field by one
/// user-defined reduction so the whole step is one small collective.
struct agreement {
  std::uint64_t first_failure = no_failure;  // min over ranks of (rank << 8 | errc)
  word_range layout;                         // fingerprint of the parameter set
  word_range dtype;
  word_range loss_scale;  // bit pattern of the double
  word_range present;     // how many parameters have a gradient
  double total_weight = 0.0;
  std::uint64_t microbatches = 0;  // saturating sum: saturation means overflow

  void combine(const agreement& other) noexcept {
    first_failure = std::min(first_failure, other.first_failure);
    layout.combine(other.layout);
    dtype.combine(other.dtype);
    loss_scale.combine(other.loss_scale);
    present.combine(other.present);
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

/// The datatype and reduction operation of `agreement`s, and the attribute key of `channel`s.
/// Created once, on first use: Open MPI
/// 4.1 keeps a few hundred bytes of every operation ever created, so one per call would leak in
/// a long run. They are freed when `MPI_Finalize` deletes the attributes of `MPI_COMM_SELF`
/// (the standard hook for a library's cleanup), so no MPI object outlives MPI.
struct library_handles {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  int channel_key = MPI_KEYVAL_INVALID;  // attribute key of a communicator's `channel`

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
      check(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &free_channel, &created.channel_key, nullptr),
            "MPI_Comm_create_keyval");
      int key = MPI_KEYVAL_INVALID;
      check(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &release_at_finalize, &key, nullptr),
            "MPI_Comm_create_keyval");
      check(MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr), "MPI_Comm_set_attr");
    } catch (...) {
      if (created.channel_key != MPI_KEYVAL_INVALID) MPI_Comm_free_keyval(&created.channel_key);
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
    // Channels still attached to communicators keep the key alive until they are deleted
    // (MPI_COMM_WORLD's by MPI_Finalize, right after this).
    MPI_Comm_free_keyval(&handles.channel_key);
    MPI_Comm_free_keyval(&key);
    return MPI_SUCCESS;
  }

  static int free_channel(MPI_Comm /*comm*/, int /*key*/, void* value, void* /*extra*/);
};

/// The library's own communicator next to a user's: a duplicate made on first use and cached on
/// the user's communicator as an attribute (MPI's way for a library to keep its point-to-point
/// messages apart from the caller's), freed with it. Reductions are collective, so every rank
/// starts them in the same order and numbers them alike: the number is the tag of their
/// messages, so reductions in flight together never take each other's.
struct channel {
  MPI_Comm comm = MPI_COMM_NULL;
  int next_tag = 0;

  /// Collective over `comm` the first time, local afterwards.
  static channel& of(MPI_Comm comm) {
    const int key = library_handles::get().channel_key;
    void* value = nullptr;
    int found = 0;
    check(MPI_Comm_get_attr(comm, key, &value, &found), "MPI_Comm_get_attr");
    if (found != 0) return *static_cast<channel*>(value);
    auto created = std::make_unique<channel>();
    check(MPI_Comm_dup(comm, &created->comm), "MPI_Comm_dup");
    const int code = MPI_Comm_set_attr(comm, key, created.get());
    if (code != MPI_SUCCESS) MPI_Comm_free(&created->comm);
    check(code, "MPI_Comm_set_attr");
    return *created.release();
  }

  /// A tag for the next reduction; MPI guarantees tags up to 32767.
  int take_tag() noexcept {
    const int tag = next_tag;
    next_tag = (next_tag + 1) % 32768;
    return tag;
  }
};

inline int library_handles::free_channel(MPI_Comm /*comm*/, int /*key*/, void* value, void* /*extra*/) {
  std::unique_ptr<channel> owned(static_cast<channel*>(value));
  return MPI_Comm_free(&owned->comm);
}

/// Combines `agreement`s over `comm` in place: one small collective.
inline void allreduce_agreement(agreement& mine, MPI_Comm comm) {
  const library_handles& handles = library_handles::get();
  check(MPI_Allreduce(MPI_IN_PLACE, &mine, 1, handles.type, handles.op, comm), "MPI_Allreduce");
}

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

/// A present parameter: its entry in the result and where its values lie in the window's
/// logical array (every present tensor's values, one after another in parameter order).
struct tensor_slot {
  std::size_t entry = 0;
  std::size_t offset = 0;
  std::size_t count = 0;
};

/// A run of the logical array in host memory: a tensor's elements, or the packed buffer.
template <class W>
struct segment {
  W* data = nullptr;
  std::size_t offset = 0;  // in the logical array
  std::size_t count = 0;
};

/// The owned work-dtype tensor of entry `entry` (checked to be one before the reduction starts).
template <class B, class W>
typename B::template tensor<W>& tensor_at(gradients_params<B>& gradients, std::size_t entry) noexcept {
  return *gradients.template get_at<W>(entry);
}

// The arithmetic of the normalization, `((a + b) / s) / w`, is rounded at every step as
// `finish_mean`'s `divide` is; a division is never contracted, so no pragma is needed.
template <class W>
void add_into(W* __restrict acc, const W* __restrict x, std::size_t count) noexcept {
  for (std::size_t i = 0; i < count; ++i) acc[i] = acc[i] + x[i];
}
template <class W>
void add_then_divide(W* __restrict acc, const W* __restrict x, std::size_t count, W first, W second) noexcept {
  for (std::size_t i = 0; i < count; ++i) acc[i] = (acc[i] + x[i]) / first / second;
}

/// A buffer values are staged in (the ring's two pieces; every value, for a backend without
/// host memory). A fresh one costs a page fault per 4 KiB on first touch, which on 2 local ranks
/// took far longer than the reduction itself (2.4 MiB: about 6 ms against 0.5 ms), so each
/// thread keeps the largest buffer it released for its next reduction: the memory held between
/// calls is one such buffer per thread and work dtype.
template <class W>
class packed_buffer {
 public:
  packed_buffer() noexcept = default;
  explicit packed_buffer(std::size_t count) {
    if (count == 0) return;  // leaves the kept buffer to a reduction that packs something
    packed_buffer& kept = spare();
    if (kept.capacity_ >= count) {
      data_ = std::move(kept.data_);
      capacity_ = std::exchange(kept.capacity_, 0);
    } else {
      data_ = std::make_unique_for_overwrite<W[]>(count);
      capacity_ = count;
    }
  }
  packed_buffer(packed_buffer&& other) noexcept
      : data_(std::move(other.data_)), capacity_(std::exchange(other.capacity_, 0)) {}
  packed_buffer& operator=(packed_buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::move(other.data_);
      capacity_ = std::exchange(other.capacity_, 0);
    }
    return *this;
  }
  packed_buffer(const packed_buffer&) = delete;
  packed_buffer& operator=(const packed_buffer&) = delete;
  ~packed_buffer() { release(); }

  [[nodiscard]] W* data() const noexcept { return data_.get(); }

 private:
  static packed_buffer& spare() noexcept {
    thread_local packed_buffer kept;
    return kept;
  }

  void release() noexcept {
    packed_buffer& kept = spare();
    if (this != &kept && capacity_ > kept.capacity_) {
      kept.data_ = std::move(data_);
      kept.capacity_ = capacity_;
    }
    data_.reset();
    capacity_ = 0;
  }

  std::unique_ptr<W[]> data_;
  std::size_t capacity_ = 0;
};

/// Where a reduction's messages travel: the library's communicator, the reduction's tag, and
/// this rank's place among the ranks.
struct ring_position {
  MPI_Comm comm = MPI_COMM_NULL;
  int tag = 0;
  int rank = 0;
  int ranks = 1;
};

/// Sums a window's logical array over the ranks of a communicator and normalizes it, in two
/// rings of point-to-point messages, as a large `MPI_Allreduce` does inside:
///
/// - reduce-scatter: in N - 1 steps each rank sends one chunk (1/N of the array) to its right
///   neighbour and adds the chunk it receives from its left into its own values; after the last
///   step rank r holds the whole sum of chunk r + 1, which it divides right there,
///   `((a + b) / s) / w`, fused with that last addition;
/// - all-gather: in N - 1 more steps the finished chunks travel round the ring, copied into place.
///
/// Done here rather than by MPI so that the values never leave their tensors: a piece inside one
/// tensor is sent from and received into that tensor's memory, and only pieces spanning several
/// small tensors go through a staging buffer; the normalization costs 1/N of a pass instead of a
/// pass; and each chunk is summed and rounded on one rank only, so every rank gets the same bits.
/// Pieces hold at most `GRADACCUM_MPI_PIECE_BYTES`; the ranks agree on the layout (the parameter
/// set), so every rank computes the same pieces and messages match one for one.
///
/// One piece is in flight at a time; `advance` moves on as far as the messages allow.
template <class W>
class ring_reduction {
 public:
  static constexpr std::size_t piece_elements = std::max<std::size_t>(GRADACCUM_MPI_PIECE_BYTES / sizeof(W), 1);

  ring_reduction() = default;
  /// `staging` holds two pieces (or two whole arrays, if smaller); nothing is sent yet.
  ring_reduction(std::vector<segment<W>> segments, std::size_t total, const ring_position& where, W scale, W weight,
                 packed_buffer<W> staging) noexcept
      : segments_(std::move(segments)),
        total_(total),
        comm_(where.comm),
        tag_(where.tag),
        rank_(static_cast<std::size_t>(where.rank)),
        ranks_(static_cast<std::size_t>(where.ranks)),
        scale_(scale),
        weight_(weight),
        piece_(std::min(total, piece_elements)),
        pieces_(piece_ == 0 ? 0 : (total + piece_ - 1) / piece_),
        staging_(std::move(staging)) {
    if (ranks_ == 1) {
      for (const segment<W>& s : segments_) kernels::divide(s.data, s.count, scale_, weight_);
    }
  }

  /// Sends and receives until every piece has travelled (true) or, unless `block`, until a
  /// message is not there yet (false).
  bool advance(bool block) {
    while (true) {
      if (!in_flight_ && !post_next()) return true;
      int done = 0;
      // The analyzer's MPI checker cannot see that `in_flight_` means post_next() started them
      // (unposted slots are MPI_REQUEST_NULL, which MPI waits on at once).
      if (block) {
        check(MPI_Waitall(2, requests_, MPI_STATUSES_IGNORE),  // NOLINT(clang-analyzer-optin.mpi.MPI-Checker)
              "MPI_Waitall");
      } else {
        check(MPI_Testall(2, requests_, &done, MPI_STATUSES_IGNORE),  // NOLINT(clang-analyzer-optin.mpi.MPI-Checker)
              "MPI_Testall");
        if (done == 0) return false;
      }
      in_flight_ = false;
      complete();
    }
  }

  /// Finishes whatever is in flight or left to send, so no peer waits forever; errors are
  /// dropped, since there is no one left to report them to.
  void finish_quietly() noexcept {
    try {
      advance(true);
    } catch (...) {
      // an MPI error under MPI_ERRORS_RETURN: the communicator is broken, stop here
    }
  }

 private:
  /// Pieces [first, last) of chunk `chunk`.
  [[nodiscard]] std::pair<std::size_t, std::size_t> chunk_pieces(std::size_t chunk) const noexcept {
    return {chunk * pieces_ / ranks_, (chunk + 1) * pieces_ / ranks_};
  }
  [[nodiscard]] std::pair<std::size_t, std::size_t> piece_range(std::size_t piece) const noexcept {
    return {piece * piece_, std::min(total_, (piece + 1) * piece_)};
  }
  [[nodiscard]] bool reducing() const noexcept { return step_ + 1 < ranks_; }
  /// The chunks this step sends and receives (see the class comment).
  [[nodiscard]] std::pair<std::size_t, std::size_t> step_chunks() const noexcept {
    const std::size_t k = reducing() ? step_ : step_ - (ranks_ - 1);
    const std::size_t send = reducing() ? rank_ + ranks_ - k % ranks_ : rank_ + 1 + ranks_ - k % ranks_;
    return {send % ranks_, (send + ranks_ - 1) % ranks_};
  }

  /// The segment holding logical position `at` (segments are sorted, none empty).
  [[nodiscard]] auto segment_at(std::size_t at) const {
    return std::prev(std::upper_bound(segments_.begin(), segments_.end(), at,
                                      [](std::size_t offset, const segment<W>& x) { return offset < x.offset; }));
  }
  /// Calls `f(data, offset in the range, count)` for each segment's part of [begin, end).
  template <class F>
  void for_each_part(std::size_t begin, std::size_t end, F&& f) const {
    auto part = segment_at(begin);
    for (std::size_t at = begin; at < end; ++part) {
      const std::size_t count = std::min(end, part->offset + part->count) - at;
      f(part->data + (at - part->offset), at - begin, count);
      at += count;
    }
  }
  /// The memory of [begin, end) if it lies in one segment, else null.
  [[nodiscard]] W* contiguous(std::size_t begin, std::size_t end) const {
    const auto part = segment_at(begin);
    return end <= part->offset + part->count ? part->data + (begin - part->offset) : nullptr;
  }

  /// Posts the next piece's receive and send, moving on to the next step when this one is
  /// done; false when there is nothing left.
  bool post_next() {
    while (step_ < 2 * (ranks_ - 1)) {
      const auto [send_chunk, receive_chunk] = step_chunks();
      const auto [send_first, send_last] = chunk_pieces(send_chunk);
      const auto [receive_first, receive_last] = chunk_pieces(receive_chunk);
      if (index_ < std::max(send_last - send_first, receive_last - receive_first)) {
        const std::size_t left = (rank_ + ranks_ - 1) % ranks_;
        const std::size_t right = (rank_ + 1) % ranks_;
        requests_[0] = requests_[1] = MPI_REQUEST_NULL;
        received_ = {};
        if (index_ < receive_last - receive_first) {
          const auto [begin, end] = piece_range(receive_first + index_);
          W* target = reducing() ? nullptr : contiguous(begin, end);
          received_ = {begin, end, target == nullptr};
          check(MPI_Irecv(target != nullptr ? target : staging_.data() + piece_, static_cast<int>(end - begin),
                          datatype<W>(), static_cast<int>(left), tag_, comm_, &requests_[0]),
                "MPI_Irecv");
        }
        if (index_ < send_last - send_first) {
          const auto [begin, end] = piece_range(send_first + index_);
          const W* source = contiguous(begin, end);
          if (source == nullptr) {
            W* const packed = staging_.data();
            for_each_part(begin, end, [&](const W* data, std::size_t at, std::size_t count) {
              std::copy_n(data, count, packed + at);
            });
            source = packed;
          }
          check(MPI_Isend(source, static_cast<int>(end - begin), datatype<W>(), static_cast<int>(right), tag_, comm_,
                          &requests_[1]),
                "MPI_Isend");
        }
        in_flight_ = true;
        ++index_;
        return true;
      }
      ++step_;
      index_ = 0;
    }
    return false;
  }

  /// Adds (or, in the last reducing step, adds and divides) a received piece into place, or
  /// copies a gathered one there if it did not arrive in place.
  void complete() {
    if (!received_.staged) return;
    const W* in = staging_.data() + piece_;
    const bool last = step_ + 2 == ranks_;
    for_each_part(received_.begin, received_.end, [&](W* data, std::size_t at, std::size_t count) {
      if (!reducing()) {
        std::copy_n(in + at, count, data);
      } else if (last) {
        add_then_divide(data, in + at, count, scale_, weight_);
      } else {
        add_into(data, in + at, count);
      }
    });
  }

  struct receipt {
    std::size_t begin = 0;
    std::size_t end = 0;
    bool staged = false;  // arrived in the staging buffer, not in place
  };

  std::vector<segment<W>> segments_;  // in logical order
  std::size_t total_ = 0;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int tag_ = 0;
  std::size_t rank_ = 0;
  std::size_t ranks_ = 1;
  W scale_ = 1;
  W weight_ = 1;
  std::size_t piece_ = 0;     // elements per piece
  std::size_t pieces_ = 0;    // pieces in the array
  packed_buffer<W> staging_;  // [0, piece): what is sent, [piece, 2 piece): what is received
  std::size_t step_ = 0;      // 0 .. N - 2: reduce-scatter; N - 1 .. 2N - 3: all-gather
  std::size_t index_ = 0;     // next piece of the step
  bool in_flight_ = false;
  receipt received_;
  MPI_Request requests_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
};

}  // namespace detail::mpi

/// @brief A reduction started by `start_allreduce_mean`: the values are in flight, and `wait()`
/// returns the globally normalized mean.
///
/// Owns every buffer MPI reads and writes: moving it leaves those buffers where they are, and
/// destroying it before `wait()` finishes the reduction (its peers need this rank's messages)
/// and discards the result (so it must be destroyed before `MPI_Finalize`).
template <class B>
class allreduce_mean_request {
 public:
  allreduce_mean_request(allreduce_mean_request&& other) noexcept
      : gradients_(std::move(other.gradients_)),
        state_(other.state_),
        packed_(std::move(other.packed_)),
        slots_(std::move(other.slots_)),
        ring_(std::exchange(other.ring_, {})),
        taken_(std::exchange(other.taken_, true)) {}
  allreduce_mean_request& operator=(allreduce_mean_request&& other) noexcept {
    if (this != &other) {
      complete_quietly();
      gradients_ = std::move(other.gradients_);
      state_ = other.state_;
      packed_ = std::move(other.packed_);
      slots_ = std::move(other.slots_);
      ring_ = std::exchange(other.ring_, {});
      taken_ = std::exchange(other.taken_, true);
    }
    return *this;
  }
  allreduce_mean_request(const allreduce_mean_request&) = delete;
  allreduce_mean_request& operator=(const allreduce_mean_request&) = delete;
  ~allreduce_mean_request() { complete_quietly(); }

  /// @brief Whether the reduction has finished (so `wait()` will not block). Drives MPI's
  /// progress, so call it now and then while overlapping other work.
  [[nodiscard]] bool test() { return advance(false); }

  /// @brief Waits for the reduction and returns `(Σ_r sums_r / W(s)) / W(Σ_r total_weight_r)`
  /// for every parameter present on any rank, with the global state.
  /// @throws error(errc::invalid_state) when the result was already taken.
  [[nodiscard]] accumulated_gradients<B> wait() {
    if (taken_) detail::fail(errc::invalid_state, "this reduction's result was already taken.");
    advance(true);
    taken_ = true;
    ring_ = {};  // its staging buffer is kept for the next reduction, even if this request lives on
    if constexpr (!host_memory_backend<B>) detail::visit_work_dtype(state_.dtype, [&]<class W>() { unpack<W>(); });
    return {std::move(gradients_), state_};
  }

  /// @brief The global state of the reduced windows: agreed dtype and loss scale, summed weight
  /// and microbatch count.
  [[nodiscard]] const weighted_accumulation_state& state() const noexcept { return state_; }

 private:
  template <class B2>
    requires mpi_reducible_backend<B2>
  friend allreduce_mean_request<B2> start_allreduce_mean(const parameter_set<B2>&, accumulated_gradients<B2>&&,
                                                         MPI_Comm);
  template <class B2>
    requires mpi_reducible_backend<B2>
  friend accumulated_gradients<B2> allreduce_mean(const parameter_set<B2>&, accumulated_gradients<B2>&&, MPI_Comm);

  template <class T>
  using tensor = typename B::template tensor<T>;
  using packed_buffer = std::variant<detail::mpi::packed_buffer<float>, detail::mpi::packed_buffer<double>>;
  using ring = std::variant<std::monostate, detail::mpi::ring_reduction<float>, detail::mpi::ring_reduction<double>>;

  /// Agrees, allocates and packs; `sums` is moved from only once nothing can fail any more.
  allreduce_mean_request(const parameter_set<B>& params, accumulated_gradients<B>& sums, MPI_Comm comm) {
    int rank = 0;
    detail::mpi::check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");

    // 1. Check this rank's sums; a failure is not thrown yet, since the peers would then wait
    //    forever in the agreement: it travels with the agreement so every rank throws.
    std::vector<std::size_t> entry_of(params.size(), no_entry);
    std::exception_ptr local_failure;
    errc local_code = errc::invalid_state;
    try {
      check_sums(params, sums, entry_of);
    } catch (const error& e) {
      local_failure = std::current_exception();
      local_code = e.code();
    } catch (...) {
      local_failure = std::current_exception();
    }

    // 2. One small collective: failures, parameter sets, dtypes, loss scales, weights, counts.
    detail::mpi::agreement agreed;
    if (local_failure) agreed.first_failure = static_cast<std::uint64_t>(rank) << 8 | static_cast<unsigned>(local_code);
    agreed.layout = detail::mpi::word_range::of(detail::mpi::layout_fingerprint(params));
    agreed.dtype = detail::mpi::word_range::of(static_cast<std::uint64_t>(sums.state.dtype));
    agreed.loss_scale = detail::mpi::word_range::of(std::bit_cast<std::uint64_t>(sums.state.loss_scale));
    agreed.present = detail::mpi::word_range::of(sums.gradients.size());
    agreed.total_weight = sums.state.total_weight;
    agreed.microbatches = sums.state.microbatches;
    detail::mpi::allreduce_agreement(agreed, comm);
    if (local_failure) std::rethrow_exception(local_failure);
    check_agreement(agreed);
    state_ = {sums.state.dtype, sums.state.loss_scale, agreed.total_weight, agreed.microbatches};

    // 3. Presence: one bit per parameter position, OR-ed over the ranks. When every rank has a
    //    gradient for every parameter (the usual case) the OR is known, and every rank skips this
    //    collective alike. It stays apart from the agreement: its length is the parameter count,
    //    which the ranks have only just agreed on.
    const bool everywhere = agreed.present.min() == params.size();
    std::vector<std::uint64_t> present;
    if (!everywhere) {
      present.resize((params.size() + 63) / 64);
      for (std::size_t position = 0; position < params.size(); ++position) {
        if (entry_of[position] != no_entry) present[position / 64] |= std::uint64_t{1} << (position % 64);
      }
      detail::mpi::check(
          MPI_Allreduce(MPI_IN_PLACE, present.data(), static_cast<int>(present.size()), MPI_UINT64_T, MPI_BOR, comm),
          "MPI_Allreduce");
    }
    const auto is_present = [&](std::size_t position) {
      return everywhere || ((present[position / 64] >> (position % 64)) & 1U) != 0;
    };

    // 4. The library's own communicator (a collective the first time), then the values' layout.
    detail::mpi::channel& channel = detail::mpi::channel::of(comm);
    int ranks = 1;
    detail::mpi::check(MPI_Comm_size(comm, &ranks), "MPI_Comm_size");
    const detail::mpi::ring_position where{channel.comm, channel.take_tag(), rank, ranks};
    detail::visit_work_dtype(state_.dtype, [&]<class W>() { prepare<W>(params, sums, entry_of, is_present, where); });
  }

  static constexpr std::size_t no_entry = std::numeric_limits<std::size_t>::max();

  /// Local checks, touching nothing; fills `entry_of[position]` with the entry index of each
  /// pending tensor.
  static void check_sums(const parameter_set<B>& params, const accumulated_gradients<B>& sums,
                         std::vector<std::size_t>& entry_of) {
    validate(sums.state);
    if (sums.state.total_weight == 0.0 && !sums.gradients.empty()) {
      detail::fail(errc::invalid_state, "accumulated sums have zero total weight but pending gradients.");
    }
    std::size_t hint = 0;
    std::size_t entry = 0;
    for (const auto& e : sums.gradients) {
      const std::size_t position = detail::visit_gradient(
          [&](const auto& value) { return detail::resolve(params, e.id, value, hint); }, e.value);
      const bool owned_work_tensor = detail::visit_work_dtype(
          sums.state.dtype, [&]<class W>() { return std::holds_alternative<tensor<W>>(e.value); });
      if (!owned_work_tensor) {
        detail::fail(errc::invalid_state,
                     "pending tensor '" + e.id + "' is not an owned tensor of the state's work dtype " +
                         std::string(to_string(sums.state.dtype)) + ".",
                     e.id);
      }
      entry_of[position] = entry++;
      hint = position + 1;
    }
  }

  /// Every rank evaluates the same agreed words in the same order, so every rank throws the same.
  void check_agreement(const detail::mpi::agreement& agreed) const {
    if (agreed.first_failure != detail::mpi::no_failure) {
      const auto code = static_cast<errc>(agreed.first_failure & 0xffU);
      detail::fail(code, "rank " + std::to_string(agreed.first_failure >> 8) + " rejected its accumulated sums (" +
                             make_error_code(code).message() + "); nothing was reduced.");
    }
    if (!agreed.layout.agreed()) {
      detail::fail(errc::parameter_mismatch,
                   "ranks passed different parameter sets (ids, shapes or order differ); nothing was reduced.");
    }
    if (!agreed.dtype.agreed()) {
      detail::fail(errc::invalid_state,
                   "ranks accumulated in different work dtypes (" +
                       std::string(to_string(static_cast<float_dtype>(agreed.dtype.min()))) + " and " +
                       std::string(to_string(static_cast<float_dtype>(agreed.dtype.max))) + "); nothing was reduced.");
    }
    if (!agreed.loss_scale.agreed()) {
      detail::fail(errc::invalid_state,
                   "ranks used different loss scales (" +
                       detail::number_text(std::bit_cast<double>(agreed.loss_scale.min())) + " and " +
                       detail::number_text(std::bit_cast<double>(agreed.loss_scale.max)) + "); nothing was reduced.");
    }
    const auto dtype = static_cast<float_dtype>(agreed.dtype.max);
    if (agreed.microbatches == std::numeric_limits<std::uint64_t>::max()) {
      detail::fail(errc::counter_overflow, "the ranks' microbatch counts overflow when summed.");
    }
    if (!representable(agreed.total_weight, dtype)) {
      detail::fail(errc::invalid_weight, "the ranks' total weights sum to " + detail::number_text(agreed.total_weight) +
                                             ", which is not representable in " + std::string(to_string(dtype)) + ".");
    }
    if (!(agreed.total_weight > 0.0)) {
      detail::fail(errc::empty_weight,
                   "cannot normalize accumulation windows whose total weight over all ranks is "
                   "zero; nothing was reduced.");
    }
  }

  /// Allocates zeros for parameters present elsewhere only and the buffers, then (nothing can
  /// throw after the zeros are in) takes the sums and lays out the ring over their values: each
  /// tensor's own memory for a `host_memory_backend`, else one buffer they are copied into.
  template <class W, class IsPresent>
  void prepare(const parameter_set<B>& params, accumulated_gradients<B>& sums, const std::vector<std::size_t>& entry_of,
               const IsPresent& is_present, const detail::mpi::ring_position& where) {
    // One pass over the parameters lays out the slots; parameters present elsewhere only get
    // zeros, appended as entries after this rank's own.
    std::vector<std::size_t> missing;
    std::vector<detail::mpi::tensor_slot> slots;
    slots.reserve(params.size());
    std::size_t total = 0;
    for (std::size_t position = 0; position < params.size(); ++position) {
      if (!is_present(position)) continue;
      detail::mpi::tensor_slot slot{entry_of[position], total, *params[position].shape.checked_element_count()};
      if (slot.entry == no_entry) {
        slot.entry = sums.gradients.size() + missing.size();
        missing.push_back(position);
      }
      total += slot.count;
      if (slot.count != 0) slots.push_back(slot);
    }
    std::vector<tensor<W>> zeros;
    zeros.reserve(missing.size());
    for (const std::size_t position : missing) {
      zeros.push_back(B::template zeros<W>(params[position].shape, params[position].device));
    }
    std::vector<detail::mpi::segment<W>> segments;
    segments.reserve(host_memory_backend<B> ? slots.size() : 1);
    detail::mpi::packed_buffer<W> packed(host_memory_backend<B> ? 0 : total);
    detail::mpi::packed_buffer<W> staging(2 * std::min(total, detail::mpi::ring_reduction<W>::piece_elements));

    // Insert the zeros; should an insertion run out of memory, take the earlier ones out again.
    std::size_t inserted = 0;
    try {
      for (; inserted < missing.size(); ++inserted) {
        sums.gradients.insert(params[missing[inserted]].id, std::move(zeros[inserted]));
      }
    } catch (...) {
      for (std::size_t k = 0; k < inserted; ++k) sums.gradients.erase(params[missing[k]].id);
      throw;
    }

    gradients_ = std::move(sums.gradients);
    taken_ = false;
    if constexpr (host_memory_backend<B>) {
      for (const auto& slot : slots) {
        segments.push_back({B::data(detail::mpi::tensor_at<B, W>(gradients_, slot.entry)), slot.offset, slot.count});
      }
    } else {
      for (const auto& slot : slots) {
        B::to_row_major(detail::mpi::tensor_at<B, W>(gradients_, slot.entry),
                        std::span<W>(packed.data() + slot.offset, slot.count));
      }
      if (total != 0) segments.push_back({packed.data(), 0, total});
      slots_ = std::move(slots);
      packed_ = std::move(packed);
    }
    ring_.template emplace<detail::mpi::ring_reduction<W>>(std::move(segments), total, where,
                                                           static_cast<W>(state_.loss_scale),
                                                           static_cast<W>(state_.total_weight), std::move(staging));
  }

  /// Moves the values along the ring as far as MPI lets them go without waiting (or, with
  /// `block`, to the end); true when every value has arrived.
  bool advance(bool block) {
    return std::visit(
        [&](auto& reduction) {
          if constexpr (std::is_same_v<std::remove_cvref_t<decltype(reduction)>, std::monostate>) {
            return true;
          } else {
            return reduction.advance(block);
          }
        },
        ring_);
  }

  /// For a backend without host memory: the reduced values, back from the buffer into tensors.
  template <class W>
  void unpack() {
    const W* const packed = std::get<detail::mpi::packed_buffer<W>>(packed_).data();
    for (const auto& slot : slots_) {
      tensor<W>& t = detail::mpi::tensor_at<B, W>(gradients_, slot.entry);
      t = B::template from_row_major<W>(std::span<const W>(packed + slot.offset, slot.count), B::shape(t),
                                        B::device(t));
    }
    packed_ = {};
  }

  /// Finishes a reduction still in flight (the peers need this rank's messages).
  void complete_quietly() noexcept {
    std::visit(
        [](auto& reduction) {
          if constexpr (!std::is_same_v<std::remove_cvref_t<decltype(reduction)>, std::monostate>) {
            reduction.finish_quietly();
          }
        },
        ring_);
    ring_ = {};
  }

  gradients_params<B> gradients_;
  weighted_accumulation_state state_;
  packed_buffer packed_;                         // without host memory: every value, in the logical array
  std::vector<detail::mpi::tensor_slot> slots_;  // without host memory: present parameters, in order
  ring ring_;
  bool taken_ = true;
};

/// @brief Starts reducing every rank's window sums over `comm` and returns a request to wait on.
///
/// Collective: every rank of `comm` calls it with its own `sums` (from `finish_sums()`) and the
/// same parameter set. The agreement (presence, dtype, loss scale, weights; one small collective,
/// two when some parameter has gradients on some ranks only) happens before this returns, so
/// every error below is thrown here, by every rank alike; only the value sums are left in
/// flight. They move on whenever `test()` or `wait()` is called (MPI point-to-point messages
/// progress inside MPI calls), so call `test()` now and then while overlapping other work.
/// The first time a communicator is used, it is duplicated for the library (`MPI_Comm_dup`,
/// collective); the duplicate is freed with it.
///
/// @throws error(errc::invalid_state) when ranks disagree on the work dtype or the loss scale, or
/// when a rank's sums are malformed; error(errc::parameter_mismatch) when ranks pass different
/// parameter sets; error(errc::empty_weight) when the total weight over all ranks is zero;
/// error(errc::invalid_weight) or error(errc::counter_overflow) when the summed weights or counts
/// do not fit. A rank whose own sums are rejected throws its own error; its peers throw the same
/// code naming that rank. `sums` is moved from only on success. Should memory run out on one
/// rank after the agreement, that rank throws `std::bad_alloc` with its sums unchanged, but its
/// peers then block in the value reduction, as they would after any failed collective.
template <class B>
  requires mpi_reducible_backend<B>
[[nodiscard]] allreduce_mean_request<B> start_allreduce_mean(const parameter_set<B>& params,
                                                             accumulated_gradients<B>&& sums, MPI_Comm comm) {
  allreduce_mean_request<B> request(params, sums, comm);
  static_cast<void>(request.advance(false));  // the first messages leave now
  return request;
}

/// @brief Reduces every rank's window sums over `comm` and returns, on every rank, the mean over
/// all ranks' microbatches:
///
///     result[p] = (Σ_r sums_r[p] / W(s)) / W(Σ_r total_weight_r)
///
/// for every parameter present on any rank (absent on all ranks: absent), with the global state
/// (summed total weight and microbatch count). Collective, with the errors and guarantees of
/// `start_allreduce_mean`. With a `host_memory_backend`, values are sent from and received into
/// the tensors themselves; only pieces spanning several small tensors are staged.
template <class B>
  requires mpi_reducible_backend<B>
[[nodiscard]] accumulated_gradients<B> allreduce_mean(const parameter_set<B>& params, accumulated_gradients<B>&& sums,
                                                      MPI_Comm comm) {
  allreduce_mean_request<B> request(params, sums, comm);
  return request.wait();
}

}  // namespace gradaccum
