#pragma once
/// @file
/// @brief `detail::accumulator_restorer<B>`, the `restorer` of `gradients_accumulator<B>`: pending
/// sums restored tensor by tensor as a loader reads them (`load_record`, `load_checkpoint`),
/// committed only once all are in.

#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gradaccum/detail/flat_storage.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/flat_gradients.hpp"
#include "gradaccum/flat_layout.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum {

template <class B>
class gradients_accumulator;

namespace detail {

// A friend of the accumulator, defined apart from it (it only declares it): the accumulator's
// members it reaches are resolved where the restorer is used, when the accumulator is complete.
template <class B>
class accumulator_restorer {
 public:
  accumulator_restorer(gradients_accumulator<B>& target, const parameter_set<B>& params) noexcept
      : target_(&target), params_(&params) {}

  /// @brief Requires every tensor to be of work dtype `dtype` (`errc::invalid_state`
  /// otherwise): a window's state names its dtype before its tensors.
  void expect_dtype(float_dtype dtype) noexcept { expected_ = dtype; }

  void reserve(std::size_t /*count*/) noexcept {}

  /// @brief Checks the tensor against the parameter set and the tensors added so far and has
  /// `values.into(std::span<W>)` write its row-major values straight into its segment.
  /// @throws error(errc::unknown_parameters), error(errc::parameter_mismatch),
  /// error(errc::invalid_dtype), error(errc::invalid_state) (see `expect_dtype`),
  /// error(errc::invalid_record) for an id given twice.
  template <class Values>
  void add(std::string&& id, float_dtype dtype, const tensor_shape& shape, const Values& values) {
    const std::size_t position = admit(id, dtype, shape);
    const flat_segment<B>& s = (*layout_)[position];
    // On a throw the segment may hold part of the values: it stays absent, so it is zeroed.
    try {
      if (dtype == float_dtype::f64) {
        restore_into<double>(position, values);
      } else {
        restore_into<float>(position, values);
      }
    } catch (...) {
      storage_->zero_segment(position, s.offset, s.size);
      throw;
    }
    storage_->mark_present(position);
  }

  /// @brief The checks of `add` for a tensor whose values come later, with all the others',
  /// through `values`.
  void place(std::string_view id, float_dtype dtype, const tensor_shape& shape) {
    const std::size_t position = admit(id, dtype, shape);
    storage_->mark_present(position);  // a failed load drops the buffer: nothing is restored
    placed_.push_back(position);
  }

  /// @brief Reads the values of the tensors placed so far from `block` (see `values_block` in
  /// `<gradaccum/cereal.hpp>`): in one read straight into the buffer when every tensor is
  /// where its segment is, else tensor by tensor into their segments.
  template <class Block>
  void values(const Block& block) {
    if (!storage_ || storage_->dtype == float_dtype::f32) {
      read_block<float>(block);
    } else {
      read_block<double>(block);
    }
  }

  void commit() && noexcept {
    // A recycled buffer's present segments were not zeroed when taken (the rest was): those
    // this load did not overwrite are zeroed now.
    for (std::size_t position = 0; position < stale_.size(); ++position) {
      if (stale_[position] == 0 || storage_->present[position] != 0) continue;
      const flat_segment<B>& s = (*layout_)[position];
      storage_->zero_segment(position, s.offset, s.size);
    }
    // The layout is chosen before the storage is moved: argument evaluation order is unspecified.
    std::shared_ptr<const flat_layout<B>> layout = storage_ ? layout_ : nullptr;
    target_->adopt_pending(layout_, std::move(layout), std::move(storage_));
  }

 private:
  /// Checks a tensor against the parameter set and the tensors admitted so far, takes a
  /// buffer for the first, and returns its position.
  std::size_t admit(std::string_view id, float_dtype dtype, const tensor_shape& shape) {
    if (expected_ && dtype != *expected_) {
      detail::fail(errc::invalid_state,
                   {"pending tensor '", id, "' has dtype ", to_string(dtype),
                    " but the accumulation state's work dtype is ", to_string(*expected_), "."},
                   id);
    }
    gradients_accumulator<B>::require_pending_dtype(id, dtype);
    if (!layout_) layout_ = target_->layout_for(*params_);
    const auto position = position_of(id);
    if (!position) {
      detail::fail(errc::unknown_parameters, {"record tensor '", id, "' names no parameter of the parameter set."}, id);
    }
    if (!detail::same_shape<B>(shape, (*params_)[*position].shape)) {
      detail::fail(errc::parameter_mismatch,
                   {"record tensor '", id, "' has shape ", shape.dims(), " but its parameter has shape ",
                    (*params_)[*position].shape.dims(), "."},
                   id);
    }
    if (storage_ && dtype != storage_->dtype) {
      detail::fail(errc::invalid_dtype,
                   {"record tensor '", id, "' has dtype ", to_string(dtype), " but tensor of ",
                    to_string(storage_->dtype), " came before it; a window has one work dtype."},
                   id);
    }
    if (!storage_) take_storage(dtype);
    if (storage_->present[*position] != 0) {
      detail::fail(errc::invalid_record, {"record lists tensor '", id, "' twice."}, id);
    }
    return *position;
  }

  /// `values` in work dtype W.
  template <class W, class Block>
  void read_block(const Block& block) {
    const std::optional<std::size_t> base = storage_ && storage_->device ? std::nullopt : block_base<W>(block);
    if (!base) {
      block.each([&](std::size_t i, const auto& values) { restore_into<W>(placed_[i], values); });
      return;
    }
    const std::size_t end = *base + block.bytes() / sizeof(W);
    block.into(std::span<W>(storage_->data<W>() + *base, end - *base));
    // What the block held besides the tensors, segments of other parameters and padding alike,
    // must be zero, as the buffer's invariant is.
    const auto* const bytes = reinterpret_cast<const unsigned char*>(storage_->data<W>());
    std::size_t at = *base;
    for (std::size_t position = 0; position < layout_->size(); ++position) {
      if (storage_->present[position] == 0) continue;
      const flat_segment<B>& s = (*layout_)[position];
      block.check_zero(bytes + at * sizeof(W), (s.offset - at) * sizeof(W));
      at = s.offset + s.size;
    }
    block.check_zero(bytes + at * sizeof(W), (end - at) * sizeof(W));
  }

  /// `values.into` segment `position`: straight into host memory, or through a host copy of
  /// the tensor onto its device.
  template <class W, class Values>
  void restore_into(std::size_t position, const Values& values) {
    if (!storage_->device) {
      const flat_segment<B>& s = (*layout_)[position];
      values.into(std::span<W>(storage_->data<W>() + s.offset, s.size));
      return;
    }
    std::vector<W> staged((*layout_)[position].size);
    values.into(std::span<W>(staged));
    storage_->device->write(position, 0, std::as_bytes(std::span<const W>(staged)));
  }

  /// Where the block's first value goes in the buffer, if every tensor placed is at the
  /// offset its segment has from there and the block fits from there on.
  template <class W, class Block>
  std::optional<std::size_t> block_base(const Block& block) const noexcept {
    const auto entries = block.entries();
    if (placed_.empty() || block.bytes() % sizeof(W) != 0) return std::nullopt;
    const std::size_t first = (*layout_)[placed_[0]].offset;
    if (entries[0].offset / sizeof(W) > first) return std::nullopt;
    const std::size_t base = first - entries[0].offset / sizeof(W);
    for (std::size_t i = 0; i < placed_.size(); ++i) {
      if ((*layout_)[placed_[i]].offset - base != entries[i].offset / sizeof(W)) return std::nullopt;
    }
    if (block.bytes() / sizeof(W) > layout_->elements() - base) return std::nullopt;
    return base;
  }

  /// A buffer for the values: a recycled one, its present segments taken as they are (every
  /// value the load writes overwrites them, so zeroing them first would write the window twice;
  /// `commit` zeroes those it does not), the rest zeroed by `recycle`; else a new one.
  void take_storage(float_dtype dtype) {
    std::vector<std::uint8_t> absent(layout_->size(), 0);  // may throw: nothing is taken yet
    storage_ = target_->recycle(layout_, dtype, false);
    if (!storage_) {
      storage_ = detail::allocate_storage(*layout_, dtype);
      return;
    }
    storage_->present.swap(absent);
    stale_ = std::move(absent);
    storage_->present_count = 0;
  }

  /// The parameter `id` names. Records list tensors sorted by id, the layout's `by_id()`
  /// order, so the walk along its sorted ids finds each with a comparison or two; ids out of
  /// that order are looked up.
  std::optional<std::size_t> position_of(std::string_view id) noexcept {
    const std::span<const std::size_t> order = layout_->by_id();
    for (; next_ < order.size(); ++next_) {  // one comparison per id in the usual case
      const int order_of = layout_->sorted_id(next_).compare(id);
      if (order_of == 0) return order[next_++];
      if (order_of > 0) break;
    }
    return params_->find(id);
  }

  gradients_accumulator<B>* target_;
  const parameter_set<B>* params_;
  std::size_t next_ = 0;  // where `position_of` walks `by_id()` from
  std::optional<float_dtype> expected_;
  std::shared_ptr<const flat_layout<B>> layout_;
  std::shared_ptr<detail::flat_storage> storage_;
  std::vector<std::uint8_t> stale_;  // segments a recycled storage_ held values in when taken
  std::vector<std::size_t> placed_;  // positions of the tensors `place`d, in their order
};

}  // namespace detail
}  // namespace gradaccum
