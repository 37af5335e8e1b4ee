#pragma once
/// @file
/// @brief A deterministic accumulation window that any serializable backend can run, in pieces:
/// the checkpoint tests run it whole, or stop after k microbatches, checkpoint, restore (in this
/// process or in `checkpoint_helper`) and continue, and compare the results bit for bit.
///
/// Standard library and gradaccum only (no doctest), so the helper program can use it too.

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include <gradaccum/gradaccum.hpp>

namespace gradaccum::test::window {

/// The window's work dtype and loss scale.
inline constexpr float_dtype work_dtype = float_dtype::f32;
inline constexpr double loss_scale = 1024.0;

struct parameter_geometry {
  std::string_view id;
  tensor_shape shape;
};

/// Non-square matrices (and a row vector), added in an order other than sorted by id.
inline const std::array<parameter_geometry, 4> parameters = {{
    {"encoder.weight", {3, 5}},
    {"embedding", {5, 3}},
    {"decoder.weight", {7, 2}},
    {"decoder.bias", {1, 7}},
}};

struct microbatch {
  double weight;  ///< effective token count
  bool mean;      ///< gradients of a mean loss (accumulate_mean) rather than a sum
};

/// Unequal weights, a zero-weight microbatch, sums and means.
inline constexpr std::array<microbatch, 7> microbatches = {
    {{3.0, false}, {300.0, true}, {0.0, false}, {17.0, true}, {1.0, false}, {42.0, true}, {5.0, false}}};

template <class B>
parameter_set<B> make_parameters() {
  parameter_set<B> params;
  for (const parameter_geometry& p : parameters) params.add(p.id, p.shape, typename B::device_type{});
  return params;
}

/// A multiple of 1/16 in [-127/16, 127/16]: exact in every dtype, F16 and BF16 included.
constexpr float value_at(std::size_t microbatch_index, std::size_t parameter_index, std::size_t element) noexcept {
  std::uint32_t x = static_cast<std::uint32_t>(microbatch_index * 7919 + parameter_index * 104729 + element * 31 + 1);
  x ^= x >> 13;
  x *= 0x5bd1e995U;
  x ^= x >> 15;
  return static_cast<float>(static_cast<int>(x % 255) - 127) / 16.0F;
}

/// IEEE binary16 bits of a float that F16 holds exactly (as `value_at`'s do).
constexpr std::uint16_t f16_bits_of(float value) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000U);
  if ((bits & 0x7fffffffU) == 0) return sign;
  const std::uint32_t exponent = ((bits >> 23) & 0xffU) - 127 + 15;
  return static_cast<std::uint16_t>(sign | (exponent << 10) | ((bits & 0x7fffffU) >> 13));
}

/// `value` as element type T (16-bit types through their bit patterns).
template <element_type T>
T element_of(float value) noexcept {
  if constexpr (dtype_of<T> == float_dtype::f16) {
    return std::bit_cast<T>(f16_bits_of(value));
  } else if constexpr (dtype_of<T> == float_dtype::bf16) {
    return std::bit_cast<T>(static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(value) >> 16));
  } else {
    return static_cast<T>(value);
  }
}

/// The gradients of microbatch `index`: some parameters absent, element types cycling through
/// F32, F16, BF16 and F64 (those the backend has).
template <class B>
gradients_params<B> gradients_of(std::size_t index) {
  gradients_params<B> grads;
  for (std::size_t p = 0; p < parameters.size(); ++p) {
    if ((index + p) % 3 == 2) continue;  // absent means absent
    const tensor_shape& shape = parameters[p].shape;
    const auto add = [&]<class T>() {
      std::vector<T> values(*shape.checked_element_count());
      for (std::size_t i = 0; i < values.size(); ++i) values[i] = element_of<T>(value_at(index, p, i));
      grads.insert(parameters[p].id,
                   B::template from_row_major<T>(std::span<const T>(values), shape, typename B::device_type{}));
    };
    constexpr std::array<float_dtype, 4> cycle = {float_dtype::f32, float_dtype::f16, float_dtype::bf16,
                                                  float_dtype::f64};
    const float_dtype wanted = cycle[(index + p) % cycle.size()];
    bool added = false;
    detail::for_each_type<typename B::element_types>([&]<class T>() {
      if (dtype_of<T> == wanted) {
        add.template operator()<T>();
        added = true;
      }
    });
    if (!added) add.template operator()<float>();
  }
  return grads;
}

/// Accumulates microbatches [begin, end) of the window.
template <class B>
void run(weighted_gradients_accumulator<B>& accumulator, const parameter_set<B>& params, std::size_t begin,
         std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) {
    const gradients_params<B> grads = gradients_of<B>(i);
    if (microbatches[i].mean) {
      accumulator.accumulate_mean(params, grads, microbatches[i].weight);
    } else {
      accumulator.accumulate_sum(params, grads, microbatches[i].weight);
    }
  }
}

/// The finished mean of the whole window, run without interruption.
template <class B>
gradients_params_record uninterrupted_mean() {
  const parameter_set<B> params = make_parameters<B>();
  weighted_gradients_accumulator<B> accumulator(work_dtype, loss_scale);
  run(accumulator, params, 0, microbatches.size());
  return accumulator.finish_mean(params).gradients.to_record();
}

/// A large window record whose every value derives from `generation`, for the kill test:
/// 4 MiB of F32 pending values, and the generation as the microbatch count.
inline weighted_gradients_record generation_record(std::uint64_t generation) {
  constexpr std::size_t side = 1024;
  std::vector<float> values(side * side);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>((generation * 31 + i) % 4093);
  return {{{{"w", float_dtype::f32, {side, side}, std::move(values)}}},
          {float_dtype::f32, 1.0, static_cast<double>(generation + 1), generation + 1}};
}

/// Whether `record` is exactly `generation_record` of the generation it names.
inline bool is_intact_generation(const weighted_gradients_record& record) {
  if (record.state.microbatches == 0) return false;
  return record == generation_record(record.state.microbatches - 1);
}

}  // namespace gradaccum::test::window
