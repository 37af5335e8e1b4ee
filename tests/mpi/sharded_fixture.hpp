#pragma once
/// @file
/// @brief Shared by the files of test_mpi_sharded (each run under `mpirun -np N`): whether a shard
/// holds its range of a full result bit for bit, the ranks' pieces checked against it, sums of
/// full-mantissa values that round, and a body run for both work dtypes.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>
#include <gradaccum/mpi.hpp>

#include "mpi_fixture.hpp"

namespace mpi_test {

template <class W>
using bits_t = std::conditional_t<sizeof(W) == 4, std::uint32_t, std::uint64_t>;

/// Whether `shard` holds exactly elements [begin, begin + stored) of `full`'s buffer, bit for bit,
/// and zeros after them.
template <class W, class B>
bool shard_matches(const gradaccum::sharded_gradients<B>& shard, const gradaccum::accumulated_gradients<B>& full) {
  const std::span<const W> mine = shard.template values<W>();
  const std::vector<W> all = gradaccum::test::flat_values<W>(full.gradients);
  const gradaccum::shard_range& range = shard.range();
  if (mine.size() != range.size) return false;
  for (std::size_t i = 0; i < range.size; ++i) {
    const W expected = i < range.stored ? all[range.begin + i] : W(0);
    if (std::bit_cast<bits_t<W>>(mine[i]) != std::bit_cast<bits_t<W>>(expected)) return false;
  }
  return true;
}

/// Every rank's sums of full-mantissa values (different per rank) over every parameter.
template <class B, class W>
gradaccum::accumulated_gradients<B> rounding_sums(const gradaccum::parameter_set<B>& params, double scale = 3.0) {
  gradaccum::gradients_params<B> grads;
  for (const auto& spec : model()) {
    std::vector<W> values(*spec.shape.checked_element_count());
    for (std::size_t i = 0; i < values.size(); ++i) {
      values[i] = W(1) / static_cast<W>(3 + i % 11 + static_cast<std::size_t>(world_rank) * 5) + W(0.1);
    }
    grads.insert(spec.id, B::template from_row_major<W>(std::span<const W>(values), spec.shape, {}));
  }
  gradaccum::weighted_gradients_accumulator<B> window(gradaccum::dtype_of<W>, scale);
  window.accumulate_sum(params, grads, 7.0);
  return window.finish_sums();
}

/// The present parameters' elements over every rank's pieces, per layout position: each piece is
/// checked against `full` here, and the counts are summed over the ranks.
template <class W, class B>
std::vector<std::uint64_t> piece_elements(const gradaccum::sharded_gradients<B>& shard,
                                          const gradaccum::accumulated_gradients<B>& full) {
  std::vector<std::uint64_t> elements(shard.layout()->size());
  const std::span<const W> mine = shard.template values<W>();
  for (const gradaccum::shard_piece& piece : shard.pieces()) {
    CHECK(shard.is_present(piece.position));
    CHECK(piece.id == (*shard.layout())[piece.position].id);
    const std::vector<W> values = gradaccum::test::values_of<W>(full.gradients, piece.id);
    REQUIRE(piece.parameter_offset + piece.size <= values.size());
    for (std::size_t i = 0; i < piece.size; ++i) {
      CHECK(std::bit_cast<bits_t<W>>(mine[piece.offset + i]) ==
            std::bit_cast<bits_t<W>>(values[piece.parameter_offset + i]));
    }
    elements[piece.position] += piece.size;
  }
  MPI_Allreduce(MPI_IN_PLACE, elements.data(), static_cast<int>(elements.size()), MPI_UINT64_T, MPI_SUM,
                MPI_COMM_WORLD);
  return elements;
}

/// Runs `body.template operator()<W>(dtype)` for both work dtypes.
template <class F>
void for_both_dtypes(F&& body) {
  body.template operator()<float>(float_dtype::f32);
  body.template operator()<double>(float_dtype::f64);
}

}  // namespace mpi_test
