#pragma once
/// @file
/// @brief What a checkpoint loader hands tensors to: an accumulator's `restorer` behind one
/// interface, so the loaders are compiled once for every backend (and, with
/// `GRADACCUM_SEPARATE_COMPILATION`, once for the whole program).
///
/// A sink receives, in this order: a window's `state` (weighted records only), then either each
/// tensor through `add` (id, dtype, shape and a `values_source` to read its values from), or,
/// for binary gradients records, each tensor of the directory through `place` and then all
/// their values through `values`. Calls are per tensor, never per element.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "gradaccum/dtype.hpp"
#include "gradaccum/records.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum::detail {

/// @brief The values of one tensor, not read yet: `into` reads all of them once, into a span of
/// the tensor's own dtype.
class values_source {
 public:
  virtual void into(std::span<float> out) const = 0;
  virtual void into(std::span<double> out) const = 0;

 protected:
  values_source() = default;
  values_source(const values_source&) = default;
  values_source& operator=(const values_source&) = default;
  ~values_source() = default;
};

/// @brief Where a tensor's values are in a values block: at `offset` bytes, `count` elements.
struct block_entry {
  std::uint64_t offset;
  std::uint64_t count;
  float_dtype dtype;
};

/// @brief The values block of a binary gradients record, read once: whole (`into`, then
/// `check_zero` on what lies outside the tensors) or tensor by tensor (`each`).
class values_block_source {
 public:
  /// Reads the values of the tensors placed, in directory order: `read(i, values)`.
  template <class F>
  void each(F&& read) const {
    struct visitor final : tensor_visitor {
      explicit visitor(F& f) noexcept : f_(f) {}
      void operator()(std::size_t i, const values_source& values) const override { f_(i, values); }
      F& f_;
    };
    each_tensor(visitor(read));
  }

  [[nodiscard]] virtual std::uint64_t bytes() const noexcept = 0;
  /// Where each tensor placed lies in the block, in directory order.
  [[nodiscard]] virtual std::span<const block_entry> entries() const noexcept = 0;
  virtual void into(std::span<float> out) const = 0;
  virtual void into(std::span<double> out) const = 0;
  /// Fails (`errc::invalid_record`) unless the `size` bytes at `bytes` are zero.
  virtual void check_zero(const unsigned char* bytes, std::size_t size) const = 0;

 protected:
  class tensor_visitor {
   public:
    virtual void operator()(std::size_t i, const values_source& values) const = 0;

   protected:
    ~tensor_visitor() = default;
  };
  virtual void each_tensor(const tensor_visitor& read) const = 0;

  values_block_source() = default;
  values_block_source(const values_block_source&) = default;
  values_block_source& operator=(const values_block_source&) = default;
  ~values_block_source() = default;
};

/// @brief Where a loader puts what it reads (see the file comment).
class tensor_sink {
 public:
  virtual void state(const weighted_accumulation_state& state) = 0;
  virtual void reserve(std::size_t count) = 0;
  virtual void add(std::string&& id, float_dtype dtype, const tensor_shape& shape, const values_source& values) = 0;
  virtual void place(std::string_view id, float_dtype dtype, const tensor_shape& shape) = 0;
  virtual void values(const values_block_source& block) = 0;

 protected:
  tensor_sink() = default;
  tensor_sink(const tensor_sink&) = default;
  tensor_sink& operator=(const tensor_sink&) = default;
  ~tensor_sink() = default;
};

/// @brief `sink` (an accumulator's `restorer`) as a `tensor_sink`. A sink without `state`
/// restores gradients records only, which hold none.
template <class Sink>
class tensor_sink_of final : public tensor_sink {
 public:
  explicit tensor_sink_of(Sink& sink) noexcept : sink_(sink) {}

  void state(const weighted_accumulation_state& state) override {
    if constexpr (requires { sink_.state(state); }) sink_.state(state);
  }
  void reserve(std::size_t count) override { sink_.reserve(count); }
  void add(std::string&& id, float_dtype dtype, const tensor_shape& shape, const values_source& values) override {
    sink_.add(std::move(id), dtype, shape, values);
  }
  void place(std::string_view id, float_dtype dtype, const tensor_shape& shape) override {
    sink_.place(id, dtype, shape);
  }
  void values(const values_block_source& block) override { sink_.values(block); }

 private:
  Sink& sink_;
};

}  // namespace gradaccum::detail
