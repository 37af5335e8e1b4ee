#pragma once
/// @file
/// @brief `flat_gradients<B>`: a window's gradients in one contiguous work-dtype buffer.
///
/// Pending sums and finished results are one buffer of the work dtype laid out once from a
/// `parameter_set` (`flat_layout`: each parameter's segment, 64-byte aligned, in parameter
/// order). Which parameters received a gradient is tracked beside it: an absent parameter is
/// absent (`get` gives nothing, records list only present ones), and its segment holds zeros,
/// as does the padding, so the whole buffer can go to a collective or a file as one block.
///
/// @code
/// auto result = window.finish_mean(params);
/// if (auto g = result.gradients.get<float>("fc.weight")) use(*g);     // a backend view
/// for (const auto& p : result.gradients) use(p.id, p.shape, result.gradients.values<float>(p));
/// std::span<const float> all = result.gradients.flat<float>();        // every segment
/// @endcode
///
/// The layout is shared, never copied, between an accumulator and the results it hands out, so
/// a window costs no allocation once the buffer exists (see `gradients_accumulator`).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradaccum/backend.hpp"
#include "gradaccum/detail/flat_storage.hpp"
#include "gradaccum/device_buffers.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/flat_layout.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum {

namespace detail {

/// Library code that fills or reduces a buffer in place, outside the accumulator (the MPI
/// reduction, `<gradaccum/mpi.hpp>`), reaches a `flat_gradients`' layout and storage here, and
/// makes one of both; defined after `flat_gradients`.
struct flat_access;

}  // namespace detail

/// @brief Gradients of one window in a contiguous buffer (see the file comment). Pending sums
/// of an accumulator and the results of `finish_sums` / `finish_mean` are this type.
///
/// Copying copies the buffer; moving hands it over.
template <class B>
class flat_gradients {
 public:
  /// @brief One present parameter, as iteration gives it (parameter order).
  struct entry {
    std::string_view id;
    const tensor_shape& shape;
    std::size_t offset;
    std::size_t size;
    std::size_t position;  ///< in the layout
  };

  flat_gradients() = default;
  flat_gradients(const flat_gradients& other)
      : layout_(other.layout_), storage_(other.storage_ ? other.copy_of(*other.storage_) : nullptr) {}
  flat_gradients(flat_gradients&&) noexcept = default;
  flat_gradients& operator=(const flat_gradients& other) {
    if (this != &other) *this = flat_gradients(other);
    return *this;
  }
  flat_gradients& operator=(flat_gradients&&) noexcept = default;
  ~flat_gradients() = default;

  /// @brief The work dtype of the values (F32 unless something was accumulated in F64).
  [[nodiscard]] float_dtype dtype() const noexcept { return storage_ ? storage_->dtype : float_dtype::f32; }
  /// @brief Number of present parameters.
  [[nodiscard]] std::size_t size() const noexcept { return storage_ ? storage_->present_count : 0; }
  [[nodiscard]] bool empty() const noexcept { return size() == 0; }
  [[nodiscard]] bool contains(std::string_view id) const noexcept { return position_of(id).has_value(); }
  /// @brief The dtype of `id`'s values, if present.
  [[nodiscard]] std::optional<float_dtype> dtype(std::string_view id) const noexcept {
    if (!contains(id)) return std::nullopt;
    return storage_->dtype;
  }

  /// @brief `id`'s values as the backend's read-only view (`B::map`), if present; valid while
  /// this object lives and is not modified.
  /// @throws error(errc::invalid_dtype) when W is not the element type of the values held
  /// (`dtype()`): asked for the other work type, a result does not answer as if `id` were absent.
  template <class W>
  [[nodiscard]] std::optional<typename detail::result_view<B, W>::type> get(std::string_view id) const {
    require_type<W>();
    const auto position = position_of(id);
    if (!position) return std::nullopt;
    const flat_segment<B>& s = (*layout_)[*position];
    if constexpr (device_buffers_backend<B>) {
      const auto& values = static_cast<const detail::device_values_of<B, W>&>(*storage_->device);
      return B::template map<W>(values.buffer_of(*position), values.place(*position).offset, s.shape, s.device);
    } else {
      return B::template map<W>(values_at<W>(s), s.shape, s.device);
    }
  }

  /// @brief `id`'s row-major values, if present; else empty.
  /// @throws error(errc::invalid_dtype) when W is not `dtype()`'s type (see `get`).
  template <class W>
  [[nodiscard]] std::span<const W> values(std::string_view id) const {
    require_type<W>();
    static_assert(!device_buffers_backend<B>, "values on a device are read through get<W>(id), the backend's view");
    const auto position = position_of(id);
    if (!position) return {};
    return values_at<W>((*layout_)[*position]);
  }
  /// @brief The row-major values of an entry of this object.
  /// @throws error(errc::invalid_dtype) when W is not `dtype()`'s type.
  template <class W>
  [[nodiscard]] std::span<const W> values(const entry& e) const {
    require_type<W>();
    static_assert(!device_buffers_backend<B>, "values on a device are read through get<W>(id), the backend's view");
    return {storage_->data<W>() + e.offset, e.size};
  }

  /// @brief The whole buffer, padding and absent segments (zeros) included; empty when nothing
  /// was laid out. `layout()` says where each parameter is.
  /// @throws error(errc::invalid_dtype) when W is not `dtype()`'s type.
  template <class W>
  [[nodiscard]] std::span<const W> flat() const {
    static_assert(!device_buffers_backend<B>, "values on a device are read through get<W>(id), the backend's view");
    return detail::flat_storage::all_values<W>(storage_.get(), "these gradients");
  }
  /// @brief Mutable access for in-place steps on the result (clipping, weight decay, a
  /// reduction), absent segments and padding included: whatever is written there is zeroed again
  /// when the buffer goes back to its accumulator, and never reaches a later window.
  /// @throws error(errc::invalid_dtype) when W is not `dtype()`'s type.
  template <class W>
  [[nodiscard]] std::span<W> flat() {
    static_assert(!device_buffers_backend<B>, "values on a device are read through get<W>(id), the backend's view");
    return detail::flat_storage::all_values<W>(storage_.get(), "these gradients");
  }

  /// @brief The segments of every parameter (present or not); null before anything was laid out.
  [[nodiscard]] const flat_layout<B>* layout() const noexcept { return layout_.get(); }
  /// @brief Whether the parameter at `position` of `layout()` is present.
  [[nodiscard]] bool is_present(std::size_t position) const noexcept {
    return detail::flat_storage::is_present(storage_.get(), position);
  }

  /// @brief Iterates the present parameters in parameter order (the same on every rank of a
  /// reduction, which shares the parameter set).
  class iterator {
   public:
    using value_type = entry;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    entry operator*() const noexcept {
      const flat_segment<B>& s = (*owner_->layout_)[position_];
      return {s.id, s.shape, s.offset, s.size, position_};
    }
    iterator& operator++() noexcept {
      ++position_;
      skip();
      return *this;
    }
    iterator operator++(int) noexcept {
      iterator before = *this;
      ++*this;
      return before;
    }
    friend bool operator==(const iterator& a, const iterator& b) noexcept { return a.position_ == b.position_; }

   private:
    friend class flat_gradients;
    iterator(const flat_gradients* owner, std::size_t position) noexcept : owner_(owner), position_(position) {
      skip();
    }
    void skip() noexcept {
      const std::size_t end = owner_->layout_ ? owner_->layout_->size() : 0;
      while (position_ < end && !owner_->is_present(position_)) ++position_;
    }
    const flat_gradients* owner_ = nullptr;
    std::size_t position_ = 0;
  };
  [[nodiscard]] iterator begin() const noexcept { return {this, 0}; }
  [[nodiscard]] iterator end() const noexcept { return {this, layout_ ? layout_->size() : 0}; }

  /// @brief Ids whose values hold a NaN or an infinity, sorted; changes nothing.
  [[nodiscard]] std::vector<std::string> non_finite() const {
    std::vector<std::string> ids;
    if (!layout_) return ids;
    for (const std::size_t position : layout_->by_id()) {
      if (!is_present(position)) continue;
      const flat_segment<B>& s = (*layout_)[position];
      if (!detail::segment_finite(*storage_, position, s.offset, s.size)) ids.push_back(s.id);
    }
    return ids;
  }

  /// @brief `f(view)` with the present parameters as a `detail::gradients_view` (sorted by id)
  /// borrowing this buffer's values; returns what `f` returns. The view's block is the buffer
  /// from the first present segment to the end of the last unless it holds more zeros than
  /// values and more than 4 KiB of them, so a sparse window is not written with the zeros of its
  /// absent segments.
  template <class F>
  decltype(auto) visit_record(F&& f) const {
    if constexpr (device_buffers_backend<B>) {
      if (storage_ && storage_->device) return visit_device_record(std::forward<F>(f));
    }
    return visit_host_record(std::forward<F>(f));
  }

  /// @brief A record of the present parameters, sorted by id.
  [[nodiscard]] gradients_params_record to_record() const {
    return visit_record([](const detail::gradients_view& view) {
      gradients_params_record record;
      record.tensors.reserve(view.tensors.size());
      for (const detail::tensor_view& t : view.tensors) {
        tensor_record& r = record.tensors.emplace_back();
        r.id = std::string(t.id);
        r.dtype = t.dtype;
        r.shape.assign(t.shape.begin(), t.shape.end());
        std::visit(
            [&](auto values) {
              using S = typename decltype(values)::value_type;
              if (t.source == nullptr) {
                r.values = std::vector(values.begin(), values.end());
                return;
              }
              std::vector<S> read(t.count);
              t.source->read(t.key, 0, std::as_writable_bytes(std::span(read)));
              r.values = std::move(read);
            },
            t.values);
      }
      return record;
    });
  }

 private:
  template <class>
  friend class gradients_accumulator;
  friend struct detail::flat_access;

  /// The block a record of these values is written as: the buffer from the first present
  /// segment to the end of the last, unless it holds more zeros than values and more than 4 KiB
  /// of them, so a sparse window is not written with the zeros of its absent segments.
  [[nodiscard]] std::optional<std::pair<std::size_t, std::size_t>> record_block() const noexcept {
    if (!layout_ || !storage_ || storage_->present_count == 0) return std::nullopt;
    std::size_t first = layout_->size();
    std::size_t last = 0;
    std::size_t present_elements = 0;
    for (std::size_t position = 0; position < layout_->size(); ++position) {
      if (!is_present(position)) continue;
      first = std::min(first, position);
      last = position;
      present_elements += (*layout_)[position].size;
    }
    const std::size_t begin = (*layout_)[first].offset;
    const std::size_t end = (*layout_)[last].offset + (*layout_)[last].size;
    const std::size_t zeros = end - begin - present_elements;
    if (zeros > present_elements && zeros * storage_->element_size() > 4096) return std::nullopt;
    return std::pair(begin, end);
  }

  /// `visit_record` of values in host memory.
  template <class F>
  decltype(auto) visit_host_record(F&& f) const {
    std::vector<std::array<std::uint64_t, max_rank>> shapes(size());
    std::vector<detail::tensor_view> views;
    views.reserve(size());
    detail::values_view block;
    if (const auto range = record_block()) {
      const auto [begin, end] = *range;
      block = storage_->dtype == float_dtype::f64
                  ? detail::values_view(std::span<const double>(storage_->data<double>() + begin, end - begin))
                  : detail::values_view(std::span<const float>(storage_->data<float>() + begin, end - begin));
    }
    if (layout_) {
      for (const std::size_t position : layout_->by_id()) {
        if (!is_present(position)) continue;
        const flat_segment<B>& s = (*layout_)[position];
        auto& shape = shapes[views.size()];
        std::copy(s.shape.begin(), s.shape.end(), shape.begin());
        const auto values = storage_->dtype == float_dtype::f64 ? detail::values_view(values_at<double>(s))
                                                                : detail::values_view(values_at<float>(s));
        views.push_back({s.id, storage_->dtype, std::span(shape.data(), s.shape.rank()), values});
      }
    }
    return std::forward<F>(f)(detail::gradients_view{{views.data(), views.size()}, block});
  }

  /// `visit_record` of a device window: each view reads its segment from the device in pieces
  /// (`tensor_view::source`), so saving one stages a piece at a time, never the whole window;
  /// a binary save writes the same bytes as the host window's.
  template <class F>
  decltype(auto) visit_device_record(F&& f) const {
    std::vector<std::array<std::uint64_t, max_rank>> shapes(size());
    std::vector<detail::tensor_view> views;
    views.reserve(size());
    const auto range = record_block();
    const std::size_t begin = range ? range->first : 0;
    for (const std::size_t position : layout_->by_id()) {
      if (!is_present(position)) continue;
      const flat_segment<B>& s = (*layout_)[position];
      auto& shape = shapes[views.size()];
      std::copy(s.shape.begin(), s.shape.end(), shape.begin());
      const auto none = storage_->dtype == float_dtype::f64 ? detail::values_view(std::span<const double>())
                                                            : detail::values_view(std::span<const float>());
      views.push_back({s.id, storage_->dtype, std::span(shape.data(), s.shape.rank()), none, storage_->device.get(),
                       position, s.size, range ? s.offset - begin : 0});
    }
    const std::size_t staged_block = range ? range->second - begin : 0;
    return std::forward<F>(f)(detail::gradients_view{{views.data(), views.size()}, {}, staged_block});
  }

  flat_gradients(std::shared_ptr<const flat_layout<B>> layout, std::shared_ptr<detail::flat_storage> storage) noexcept
      : layout_(std::move(layout)), storage_(std::move(storage)) {}

  [[nodiscard]] std::optional<std::size_t> position_of(std::string_view id) const noexcept {
    if (!layout_ || !storage_) return std::nullopt;
    const auto position = layout_->find(id);
    if (!position || !is_present(*position)) return std::nullopt;
    return position;
  }

  /// Values of one work dtype are asked for as that type: W that is not the held values' type is
  /// a mistake (a loop over them would silently do nothing), not an absence. Nothing laid out
  /// holds values of no type, so any W finds nothing there.
  template <class W>
  void require_type() const {
    detail::flat_storage::require_type<W>(storage_.get(), "these gradients");
  }

  template <class W>
  [[nodiscard]] std::span<const W> values_at(const flat_segment<B>& s) const noexcept {
    return {storage_->data<W>() + s.offset, s.size};
  }

  std::shared_ptr<detail::flat_storage> copy_of(const detail::flat_storage& from) const {
    auto copy = detail::allocate_storage(*layout_, from.dtype);
    if (from.device) {
      for (std::size_t position = 0; position < layout_->size(); ++position) {
        if (from.present[position] == 0) continue;
        detail::copy_segment(from, position, 0, *copy, position, 0, (*layout_)[position].size);
      }
    } else {
      std::memcpy(copy->bytes.get(), from.bytes.get(), from.elements * from.element_size());
    }
    copy->present = from.present;
    copy->present_count = from.present_count;
    return copy;
  }

  std::shared_ptr<const flat_layout<B>> layout_;
  std::shared_ptr<detail::flat_storage> storage_;
};

namespace detail {

struct flat_access {
  template <class B>
  [[nodiscard]] static const std::shared_ptr<const flat_layout<B>>& layout(const flat_gradients<B>& g) noexcept {
    return g.layout_;
  }
  template <class B>
  [[nodiscard]] static const std::shared_ptr<flat_storage>& storage(const flat_gradients<B>& g) noexcept {
    return g.storage_;
  }
  /// `storage` must have been allocated for `layout` (its element and segment counts).
  template <class B>
  [[nodiscard]] static flat_gradients<B> make(std::shared_ptr<const flat_layout<B>> layout,
                                              std::shared_ptr<flat_storage> storage) noexcept {
    return {std::move(layout), std::move(storage)};
  }
};

}  // namespace detail
}  // namespace gradaccum
