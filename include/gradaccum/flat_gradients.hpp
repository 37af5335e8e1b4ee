#pragma once
/// @file
/// @brief `flat_gradients<B>`: a window's gradients in one contiguous work-dtype buffer.
///
/// Pending sums and finished results are one buffer of the work dtype laid out once from a
/// `parameter_set`: each parameter (a tied one once) owns a segment of its element count, in
/// row-major order, starting on a 64-byte boundary (`segment_alignment` elements), in parameter
/// order. Which parameters received a gradient is tracked beside it: an absent parameter is
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
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradaccum/backend.hpp"
#include "gradaccum/detail/id_index.hpp"
#include "gradaccum/device_buffers.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/kernels.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum {

/// @brief Segments start at multiples of this many elements: 64 bytes of F32 (a cache line and
/// an AVX-512 vector), 128 of F64.
inline constexpr std::size_t segment_alignment = 16;

/// @brief Where one parameter's values live in a flat buffer.
template <class B>
struct flat_segment {
  std::string id;
  tensor_shape shape;
  typename B::device_type device;
  std::size_t offset = 0;  ///< first element, a multiple of `segment_alignment`
  std::size_t size = 0;    ///< element count
};

/// @brief The segments of every parameter of a `parameter_set`, in its order (see the file
/// comment). Immutable once built; shared by the buffers laid out with it.
template <class B>
class flat_layout {
 public:
  /// @throws error(errc::parameter_mismatch) when the elements do not fit in memory.
  explicit flat_layout(const parameter_set<B>& params) : params_identity_(params.identity()) {
    segments_.reserve(params.size());
    for (const auto& p : params) {
      const auto count = p.shape.checked_element_count();
      const std::size_t room = SIZE_MAX / 8 - segment_alignment;  // bytes of F64 must not overflow
      if (!count || *count > room || total_ > room - *count) {
        detail::fail(errc::parameter_mismatch, {"parameter '", p.id, "' has more elements than fit in memory."}, p.id);
      }
      segments_.push_back({p.id, p.shape, p.device, total_, *count});
      total_ += (*count + segment_alignment - 1) / segment_alignment * segment_alignment;
    }
    index_.reserve(segments_.size(), key_of());
    for (std::size_t i = 0; i < segments_.size(); ++i) index_.insert(i, segments_[i].id);
    by_id_.resize(segments_.size());
    for (std::size_t i = 0; i < by_id_.size(); ++i) by_id_[i] = i;
    std::sort(by_id_.begin(), by_id_.end(),
              [&](std::size_t a, std::size_t b) { return segments_[a].id < segments_[b].id; });
    sorted_id_ends_.reserve(segments_.size());
    for (const std::size_t position : by_id_) {
      sorted_ids_ += segments_[position].id;
      sorted_id_ends_.push_back(sorted_ids_.size());
    }
  }

  [[nodiscard]] std::size_t size() const noexcept { return segments_.size(); }
  [[nodiscard]] const flat_segment<B>& operator[](std::size_t position) const noexcept { return segments_[position]; }
  [[nodiscard]] auto begin() const noexcept { return segments_.cbegin(); }
  [[nodiscard]] auto end() const noexcept { return segments_.cend(); }
  /// @brief Elements of the whole buffer, padding included.
  [[nodiscard]] std::size_t elements() const noexcept { return total_; }
  /// @brief Position of `id`, if it is a parameter.
  [[nodiscard]] std::optional<std::size_t> find(std::string_view id) const noexcept {
    return index_.find(id, key_of());
  }
  /// @brief Positions sorted by id: the order of records.
  [[nodiscard]] std::span<const std::size_t> by_id() const noexcept { return {by_id_.data(), by_id_.size()}; }
  /// @brief The id of `by_id()[k]`, from one contiguous copy of the ids in that order: a load
  /// matches a record's ids against them front to back, reading memory in order.
  [[nodiscard]] std::string_view sorted_id(std::size_t k) const noexcept {
    const std::size_t begin = k == 0 ? 0 : sorted_id_ends_[k - 1];
    return std::string_view(sorted_ids_).substr(begin, sorted_id_ends_[k] - begin);
  }
  /// @brief Whether this layout was built from `params` as it is now (a set only appends).
  [[nodiscard]] bool laid_out_for(const parameter_set<B>& params) const noexcept {
    return params.identity() == params_identity_ && params.size() == segments_.size();
  }

 private:
  auto key_of() const noexcept {
    return [this](std::size_t position) -> std::string_view { return segments_[position].id; };
  }

  std::vector<flat_segment<B>> segments_;
  detail::id_index index_;
  std::vector<std::size_t> by_id_;
  std::string sorted_ids_;                   // every id in by_id_ order, back to back
  std::vector<std::size_t> sorted_id_ends_;  // where each of them ends in sorted_ids_
  std::size_t total_ = 0;
  std::uint64_t params_identity_;
};

namespace detail {

struct free_deleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

/// Zero-filled, 64-byte aligned storage for `elements` values of `dtype`, and which segments of
/// a layout hold values. Invariant: absent segments and padding are zero.
struct flat_storage {
  std::unique_ptr<std::byte, free_deleter> bytes;
  float_dtype dtype = float_dtype::f32;
  std::size_t elements = 0;
  std::vector<std::uint8_t> present;  // per segment: 1 when it received values
  std::size_t present_count = 0;
  std::unique_ptr<device_values> device;  // instead of `bytes`, for a device_buffers_backend

  /// @throws std::bad_alloc
  static std::shared_ptr<flat_storage> allocate(float_dtype dtype, std::size_t elements, std::size_t segments) {
    auto storage = std::make_shared<flat_storage>();
    const std::size_t size = elements * (dtype == float_dtype::f64 ? 8 : 4);
    const std::size_t rounded = (std::max<std::size_t>(size, 1) + 63) / 64 * 64;
    storage->bytes.reset(static_cast<std::byte*>(std::aligned_alloc(64, rounded)));
    if (!storage->bytes) throw std::bad_alloc();
    std::memset(storage->bytes.get(), 0, rounded);
    storage->dtype = dtype;
    storage->elements = elements;
    storage->present.assign(segments, 0);
    return storage;
  }

  template <class W>
  [[nodiscard]] W* data() const noexcept {
    return reinterpret_cast<W*>(bytes.get());
  }
  [[nodiscard]] std::size_t element_size() const noexcept { return dtype == float_dtype::f64 ? 8 : 4; }

  /// Every value of `storage` as W, empty without storage: what a result's `flat<W>()` and a
  /// shard's `values<W>()` give. `holder` names them in the error ("values of these gradients
  /// are F64, ...").
  /// @throws error(errc::invalid_dtype) when W is not the storage's type.
  template <class W>
  static std::span<W> all_values(const flat_storage* storage, std::string_view holder) {
    require_type<W>(storage, holder);
    if (storage == nullptr) return {};
    return {storage->data<W>(), storage->elements};
  }
  template <class W>
  static void require_type(const flat_storage* storage, std::string_view holder) {
    static_assert(std::is_same_v<W, float> || std::is_same_v<W, double>, "results hold float or double values");
    if (storage != nullptr && dtype_of<W> != storage->dtype) [[unlikely]] {
      fail(errc::invalid_dtype, {"values of ", holder, " are ", to_string(storage->dtype), ", asked for as ",
                                 to_string(dtype_of<W>), " (use the element type of dtype())."});
    }
  }
  /// Whether segment `position` of `storage` is present (false without storage).
  static bool is_present(const flat_storage* storage, std::size_t position) noexcept {
    return storage != nullptr && position < storage->present.size() && storage->present[position] != 0;
  }

  /// Zeroes the whole buffer and marks every segment absent: a result's mutable views (`flat<W>()`
  /// over absent segments and padding too) may have written anywhere in it, so a buffer taken back
  /// from one is zeroed whole (one pass, about what zeroing its present segments costs).
  void clear() noexcept {
    if (device) {  // only present segments were ever shown (as backend views), so only they were written
      for (std::size_t position = 0; position < present.size(); ++position) {
        if (present[position] != 0) device->zero(position);
      }
    } else {
      std::memset(bytes.get(), 0, elements * element_size());
    }
    std::fill(present.begin(), present.end(), std::uint8_t{0});
    present_count = 0;
  }

  /// Zeroes what lies outside the present segments of `layout` (absent segments and padding),
  /// which a result's `flat<W>()` may have written: the invariant back, values kept.
  template <class B>
  void zero_outside_present(const flat_layout<B>& layout) noexcept {
    if (device) return;  // a device window shows nothing outside its present segments
    std::size_t at = 0;
    for (std::size_t i = 0; i < present.size(); ++i) {
      if (present[i] == 0) continue;
      std::memset(bytes.get() + at * element_size(), 0, (layout[i].offset - at) * element_size());
      at = layout[i].offset + layout[i].size;
    }
    std::memset(bytes.get() + at * element_size(), 0, (elements - at) * element_size());
  }

  /// Zeroes segment `position` (`size` elements at `offset` in host memory).
  void zero_segment(std::size_t position, std::size_t offset, std::size_t size) noexcept {
    if (device) {
      device->zero(position);
    } else {
      std::memset(bytes.get() + offset * element_size(), 0, size * element_size());
    }
  }

  void mark_present(std::size_t position) noexcept {
    // A load and a branch once a parameter is present: the steady state stores nothing here
    // (a store would queue behind the add's own stores).
    if (present[position] == 0) {
      present[position] = 1;
      ++present_count;
    }
  }
};

/// What `flat_gradients<B>::get<W>` gives: the backend's view of a result's segment.
template <class B, class W>
struct result_view {
  using type = decltype(B::template map<W>(std::span<const W>{}, std::declval<const tensor_shape&>(),
                                           std::declval<const typename B::device_type&>()));
};
template <class B, class W>
  requires device_buffers_backend<B>
struct result_view<B, W> {
  using type =
      decltype(B::template map<W>(std::declval<const typename B::template buffer<W>&>(), std::size_t{},
                                  std::declval<const tensor_shape&>(), std::declval<const typename B::device_type&>()));
};

/// A zero-filled buffer for `layout` in `dtype`: host memory, or for a `device_buffers_backend`
/// one buffer per device, each device's segments back to back.
/// @throws std::bad_alloc, or what the backend's `allocate` throws
template <class B>
std::shared_ptr<flat_storage> allocate_storage(const flat_layout<B>& layout, float_dtype dtype) {
  if constexpr (!device_buffers_backend<B>) {
    return flat_storage::allocate(dtype, layout.elements(), layout.size());
  } else {
    std::vector<device_place> places(layout.size());
    std::vector<tensor_shape> shapes(layout.size());
    std::vector<typename B::device_type> devices;
    std::vector<std::size_t> ends;  // per device: where its next segment starts
    for (std::size_t position = 0; position < layout.size(); ++position) {
      const flat_segment<B>& s = layout[position];
      const auto known = std::find(devices.begin(), devices.end(), s.device);
      const auto d = static_cast<std::size_t>(known - devices.begin());
      if (known == devices.end()) {
        devices.push_back(s.device);
        ends.push_back(0);
      }
      places[position] = {d, ends[d], s.size};
      shapes[position] = s.shape;
      ends[d] += (s.size + segment_alignment - 1) / segment_alignment * segment_alignment;
    }
    auto storage = std::make_shared<flat_storage>();
    storage->dtype = dtype;
    storage->elements = layout.elements();
    storage->present.assign(layout.size(), 0);
    if (dtype == float_dtype::f64) {
      storage->device = std::make_unique<device_values_of<B, double>>(std::move(places), shapes, devices);
    } else {
      storage->device = std::make_unique<device_values_of<B, float>>(std::move(places), shapes, devices);
    }
    return storage;
  }
}

/// Values of a device window are staged through host memory this many at a time: a multiple
/// of the global norm's blocks, 64 KiB of F32.
inline constexpr std::size_t staged_elements = 16384;

/// `f(std::span<const W>)` over the `size` values of segment `position` (at `offset` in a host
/// buffer) of `storage`, W its work type: the segment itself in host memory, else pieces of at
/// most `staged_elements` read from the device.
/// @throws std::bad_alloc, or what the backend's `read` throws (never for host memory)
template <class F>
void for_each_piece(const flat_storage& storage, std::size_t position, std::size_t offset, std::size_t size, F&& f) {
  const auto each = [&]<class W>(W) {
    if (!storage.device) {
      f(std::span<const W>(storage.data<W>() + offset, size));
      return;
    }
    std::vector<W> staged(std::min(size, staged_elements));
    for (std::size_t first = 0; first < size; first += staged_elements) {
      const std::span<W> piece(staged.data(), std::min(staged_elements, size - first));
      storage.device->read(position, first, std::as_writable_bytes(piece));
      f(std::span<const W>(piece));
    }
  };
  storage.dtype == float_dtype::f64 ? each(double{}) : each(float{});
}

/// Copies `size` values from segment `from_position` (at `from_offset` in a host buffer) of
/// `from` to segment `to_position` (at `to_offset`) of `to`, converting to `to`'s dtype; through
/// bounded host pieces where either side is on a device.
/// @throws std::bad_alloc, or what a backend's `read` or `write` throws
inline void copy_segment(const flat_storage& from, std::size_t from_position, std::size_t from_offset, flat_storage& to,
                         std::size_t to_position, std::size_t to_offset, std::size_t size) {
  const auto as_work_type = [](float_dtype dtype, auto&& f) { dtype == float_dtype::f64 ? f(double{}) : f(float{}); };
  if (!from.device && !to.device) {
    as_work_type(to.dtype, [&]<class W>(W) {
      as_work_type(from.dtype,
                   [&]<class V>(V) { kernels::convert(to.data<W>() + to_offset, from.data<V>() + from_offset, size); });
    });
    return;
  }
  constexpr std::size_t piece = staged_elements;
  std::vector<double> staged_from(std::min(size, piece));
  std::vector<double> staged_to(to.device ? staged_from.size() : 0);
  for (std::size_t first = 0; first < size; first += piece) {
    const std::size_t count = std::min(piece, size - first);
    as_work_type(from.dtype, [&]<class V>(V) {
      V* const in = reinterpret_cast<V*>(staged_from.data());
      if (from.device) {
        from.device->read(from_position, first, std::as_writable_bytes(std::span<V>(in, count)));
      } else {
        std::copy_n(from.data<V>() + from_offset + first, count, in);
      }
      as_work_type(to.dtype, [&]<class W>(W) {
        if (!to.device) {
          kernels::convert(to.data<W>() + to_offset + first, in, count);
          return;
        }
        W* const out = reinterpret_cast<W*>(staged_to.data());
        kernels::convert(out, in, count);
        to.device->write(to_position, first, std::as_bytes(std::span<const W>(out, count)));
      });
    });
  }
}

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
      bool finite = true;
      detail::for_each_piece(*storage_, position, s.offset, s.size, [&](auto values) {
        finite = finite && kernels::all_finite(values.data(), values.size());
      });
      if (!finite) ids.push_back(s.id);
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
