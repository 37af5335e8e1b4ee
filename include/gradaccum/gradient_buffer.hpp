#pragma once
/// @file
/// @brief `gradient_buffer<B, T>`: a model's gradients in one buffer laid out like the window's,
/// so the backward pass writes into it and accumulating a microbatch is one pass over it, as
/// PyTorch DDP's `gradient_as_bucket_view` and Megatron's gradient buffers do.
///
/// @code
/// gradaccum::gradient_buffer<B> grads(params);                  // once: F32, zeros, nothing present
/// for (const auto& batch : microbatches) {
///   grads.clear();                                             // zero_grad(): nothing present
///   std::span<float> w = grads.values("fc.weight");            // row-major, marks it present
///   backward(model, batch, w, grads.values("fc.bias"));
///   window.accumulate_sum(params, grads, batch.tokens);        // one kernel pass
/// }
/// @endcode
///
/// The buffer has the window's layout (`flat_layout`: each parameter's segment in parameter
/// order, 64-byte aligned, a tied parameter once), so a microbatch whose gradients are all
/// present adds as one fused loop over the whole buffer, the padding (zeros) included, with the
/// arithmetic and bits of adding each tensor alone. Absent parameters stay absent: only runs of
/// present segments are added. Wrap a segment in your library's own view to write into it, e.g.
/// `Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>`.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradaccum/backend.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/flat_gradients.hpp"
#include "gradaccum/gradients_params.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/type_list.hpp"

namespace gradaccum {

/// @brief Gradients of element type T (one of B's `element_types`) in one buffer laid out for a
/// `parameter_set` (see the file comment). Move-only: it owns its buffer, and the spans handed
/// out stay valid as long as it lives.
template <class B, class T = float>
class gradient_buffer {
  static_assert(detail::check_backend<B>());
  static_assert(detail::list_contains<T, typename B::element_types>::value,
                "gradient_buffer<B, T>: T must be one of the backend's element_types");

 public:
  /// @brief Zero-filled, every parameter absent.
  /// @throws error(errc::parameter_mismatch) when the elements do not fit in memory;
  /// std::bad_alloc.
  explicit gradient_buffer(const parameter_set<B>& params);

  gradient_buffer(gradient_buffer&&) noexcept = default;
  gradient_buffer& operator=(gradient_buffer&&) noexcept = default;
  gradient_buffer(const gradient_buffer&) = delete;
  gradient_buffer& operator=(const gradient_buffer&) = delete;
  ~gradient_buffer() = default;

  /// @brief `id`'s segment (row-major, its parameter's element count) to write its gradient
  /// into; marks it present. What was there stays (zeros after `clear()`), so a gradient may be
  /// added in place over several calls.
  /// @throws error(errc::unknown_parameters) for an id that names no parameter.
  [[nodiscard]] std::span<T> values(std::string_view id);
  /// @brief The same by position in the parameter set (no lookup), for a backward pass that
  /// knows its parameters' positions. Precondition: `position < layout().size()`.
  [[nodiscard]] std::span<T> values(std::size_t position) noexcept;

  /// @brief Zeroes the whole buffer, every segment whatever wrote it, and marks every parameter
  /// absent (`zero_grad()`).
  void clear() noexcept;

  /// @brief Whether `id` is present (its segment was handed out since the last `clear()`).
  [[nodiscard]] bool contains(std::string_view id) const noexcept;
  /// @brief Number of present parameters.
  [[nodiscard]] std::size_t size() const noexcept { return present_count_; }
  [[nodiscard]] bool empty() const noexcept { return present_count_ == 0; }
  /// @brief Whether the parameter at `position` of `layout()` is present.
  [[nodiscard]] bool is_present(std::size_t position) const noexcept { return present_[position] != 0; }
  /// @brief The segments, shared with accumulators that use this parameter set.
  [[nodiscard]] const flat_layout<B>& layout() const noexcept { return *layout_; }
  /// @brief The whole buffer, padding and absent segments included (zeros, unless written
  /// through a span handed out before the last `clear()`).
  [[nodiscard]] std::span<const T> flat() const noexcept { return {data_.get(), layout_->elements()}; }

 private:
  template <class>
  friend class gradients_accumulator;

  std::shared_ptr<const flat_layout<B>> layout_;
  std::unique_ptr<T, detail::free_deleter> data_;
  std::vector<std::uint8_t> present_;  // per segment
  std::size_t present_count_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Implementation.

template <class B, class T>
gradient_buffer<B, T>::gradient_buffer(const parameter_set<B>& params)
    : layout_(std::make_shared<const flat_layout<B>>(params)), present_(layout_->size(), 0) {
  const std::size_t bytes = (std::max<std::size_t>(layout_->elements() * sizeof(T), 1) + 63) / 64 * 64;
  data_.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
  if (!data_) throw std::bad_alloc();
  std::memset(static_cast<void*>(data_.get()), 0, bytes);  // all-zero bytes are +0 in every float format
}

template <class B, class T>
std::span<T> gradient_buffer<B, T>::values(std::string_view id) {
  const auto position = layout_->find(id);
  if (!position) detail::fail_unknown<B>(id);
  return values(*position);
}

template <class B, class T>
std::span<T> gradient_buffer<B, T>::values(std::size_t position) noexcept {
  present_count_ += present_[position] == 0 ? 1 : 0;
  present_[position] = 1;
  const flat_segment<B>& s = (*layout_)[position];
  return {data_.get() + s.offset, s.size};
}

template <class B, class T>
void gradient_buffer<B, T>::clear() noexcept {
  // The whole buffer, as zero_grad() does: a span handed out earlier may have written a segment
  // that is absent now, and a backward that adds into a segment needs it zero.
  std::memset(static_cast<void*>(data_.get()), 0, layout_->elements() * sizeof(T));
  std::fill(present_.begin(), present_.end(), std::uint8_t{0});
  present_count_ = 0;
}

template <class B, class T>
bool gradient_buffer<B, T>::contains(std::string_view id) const noexcept {
  const auto position = layout_->find(id);
  return position && present_[*position] != 0;
}

}  // namespace gradaccum
