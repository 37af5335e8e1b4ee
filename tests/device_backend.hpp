#pragma once
/// @file
/// @brief `device_backend`: the test-only `vector_backend` with windows on its devices.
///
/// Its tensors are `vector_backend`'s (devices 0 and 1); a window's values live in
/// `buffer<W>`s whose storage is private, so the library reaches them only through the
/// operations of `<gradaccum/device_buffers.hpp>`, as it must reach an accelerator's memory.
/// The arithmetic is `gradaccum::kernels`', so its bits are the host window's. Adds are queued
/// and done by `flush_adds`, as a GPU backend batches its launches, so a read the library makes
/// before flushing would miss them and fail the tests. `device_backend` checks for NaN and
/// infinity on its devices (`all_finite`), as a GPU backend does;
/// `basic_device_backend<false>` has no such check, so the library reads its buffers instead.

#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <vector>

#include <gradaccum/device_buffers.hpp>
#include <gradaccum/kernels.hpp>

#include "test_backend.hpp"

namespace gradaccum::test {

template <bool FiniteOnDevice = true>
struct basic_device_backend {
  using device_type = int;
  using element_types = vector_backend::element_types;
  template <class T>
  using tensor = vector_backend::tensor<T>;
  template <class T>
  using view = vector_backend::view<T>;

  /// W values on one device; nothing outside this backend can reach them.
  template <class W>
  class buffer {
    friend struct basic_device_backend;
    struct queued_add {
      std::size_t offset;
      const void* g;
      void (*add)(W* acc, const void* g, W scale) noexcept;
      W scale;
    };
    std::vector<W> values_;
    std::vector<queued_add> queued_;  // room for one add per segment, reserved at allocate
    device_type device_ = 0;
  };

  template <class X>
  static tensor_shape shape(const X& x) noexcept {
    return vector_backend::shape(x);
  }
  template <class X>
  static device_type device(const X& x) noexcept {
    return vector_backend::device(x);
  }
  template <class W, class X>
  static tensor<W> convert(const X& x) {
    return vector_backend::convert<W>(x);
  }

  template <class T>
  static void to_row_major(const tensor<T>& t, std::span<T> out) {
    vector_backend::to_row_major(t, out);
  }
  template <class T>
  static tensor<T> from_row_major(std::span<const T> values, const tensor_shape& shape, const device_type& device) {
    return vector_backend::from_row_major(values, shape, device);
  }

  template <class W>
  static buffer<W> allocate(std::size_t count, std::span<const buffer_segment> segments, const device_type& device) {
    buffer<W> b;
    b.values_.assign(count, W{0});
    b.queued_.reserve(segments.size());
    b.device_ = device;
    return b;
  }
  template <class W, class X>
  static void add_scaled(buffer<W>& acc, std::size_t offset, const X& g, W scale) noexcept {
    if (acc.queued_.size() == acc.queued_.capacity()) flush_adds(acc);
    acc.queued_.push_back({offset, &g,
                           [](W* sums, const void* x, W s) noexcept {
                             const X& values = *static_cast<const X*>(x);
                             kernels::add_scaled(sums, values.values.data(), values.values.size(), s);
                           },
                           scale});
  }
  /// Whether MPI may take the buffers as they are: the tests choose (its memory is the host's).
  static inline bool mpi_reaches_buffers = false;
  template <class W>
  static W* data(buffer<W>& b, bool /*cuda_aware*/) noexcept {
    return mpi_reaches_buffers ? b.values_.data() : nullptr;
  }

  template <class W>
  static void flush_adds(buffer<W>& b) noexcept {
    for (const auto& q : b.queued_) q.add(b.values_.data() + q.offset, q.g, q.scale);
    b.queued_.clear();
  }
  /// A result: a view of the device buffer, on its device.
  template <class W>
  static view<W> map(const buffer<W>& b, std::size_t offset, const tensor_shape& shape, const device_type& device) {
    return {std::span<const W>(b.values_).subspan(offset, *shape.checked_element_count()), shape, device};
  }
  template <class W>
  static void divide(buffer<W>& b, std::size_t offset, std::size_t count, W first, W second) noexcept {
    kernels::divide(b.values_.data() + offset, count, first, second);
  }
  template <class W>
  static void zero(buffer<W>& b, std::size_t offset, std::size_t count) noexcept {
    std::fill_n(b.values_.begin() + static_cast<std::ptrdiff_t>(offset), count, W{0});
  }
  /// The most elements one `read` copied to the host, and whether reads fail (a device copy
  /// that fails): all of them, or, counting down, the `reads_until_failure`-th from now.
  static inline std::size_t largest_read = 0;
  static inline bool fail_reads = false;
  static inline std::size_t reads_until_failure = 0;  // 0: none

  template <class W>
  static void read(const buffer<W>& b, std::size_t offset, std::span<W> out) {
    if (fail_reads || (reads_until_failure != 0 && --reads_until_failure == 0)) {
      throw std::runtime_error("device_backend: the device copy failed");
    }
    largest_read = std::max(largest_read, out.size());
    std::copy_n(b.values_.begin() + static_cast<std::ptrdiff_t>(offset), out.size(), out.begin());
  }
  template <class W>
  static void write(buffer<W>& b, std::size_t offset, std::span<const W> in) {
    std::copy(in.begin(), in.end(), b.values_.begin() + static_cast<std::ptrdiff_t>(offset));
  }

  static inline std::size_t finite_checks = 0;  // calls of `all_finite`
  template <class W>
    requires FiniteOnDevice
  static bool all_finite(const buffer<W>& b, std::size_t offset, std::size_t count) {
    ++finite_checks;
    return kernels::all_finite(b.values_.data() + offset, count);
  }
};

using device_backend = basic_device_backend<>;

static_assert(detail::check_backend<device_backend>() && detail::check_backend<basic_device_backend<false>>());
static_assert(serializable_backend<device_backend> && device_buffers_backend<device_backend>);

}  // namespace gradaccum::test
