#pragma once
/// @file
/// @brief libtorch backend: `gradaccum::torch_backend`, and helpers that take a module's
/// `named_parameters()` and their `.grad()` directly.
///
/// libtorch already gives tensors of every dtype on every device, with any strides (transposes,
/// slices, `expand`), a module's parameters by name, and optimizers that step on each
/// parameter's `.grad()`. It carries the element type at run time, where gradaccum's contract
/// is typed (`B::tensor<T>`). This header adds:
/// - `torch_backend`: a `torch::Tensor` goes in as it is (`params.add(name, p)`,
///   `grads.insert(name, p.grad())`); `adapt` reads its `scalar_type()` once, at insert, and
///   stores it as the typed handle `torch_tensor<T>` for T in `c10::Half`, `c10::BFloat16`,
///   `float`, `double`. Nothing is copied: the handle shares the caller's storage.
/// - `torch_parameters`, `torch_gradients`, `write_gradients`: a module's `named_parameters()`
///   in, a finished mean back into the parameters' `.grad()`, for a `torch::optim` step.
///
/// Windows live where the parameters do: `torch_backend` provides device buffers
/// (`<gradaccum/device_buffers.hpp>`), one flat tensor of the work dtype per device
/// (`torch_buffer`), and adds with libtorch's own operations on that device, a CUDA window
/// without a host round trip. The contract's roundings hold: a gradient is converted to the work
/// dtype (exact), multiplied by its scale (one rounding) and added (one rounding), never
/// `add_(g, alpha)`, which may fuse the two; divisions are true divisions by a value on the
/// device (a CPU scalar would let CUDA multiply by its reciprocal). Each operation rounds per
/// element, so a window gives the same bits on the CPU, on CUDA and on the Eigen and xtensor
/// backends. The adds of one accumulate call go out together (one `_foreach_add_` on a device, a
/// loop of `add_` on the CPU); a product
/// is staged in a scratch tensor of at most 4 Mi elements per device: a gradient of the work
/// dtype with a scale other than 1 costs two passes (multiply, add), one of another dtype three
/// (convert, multiply, add), where `accumulate_sum` of a gradient of the work dtype costs one.
/// Results (`get<W>`) are tensors viewing the window's buffer, on its device.
///
/// @code
/// auto named = model->named_parameters();
/// auto params = gradaccum::torch_parameters(named);                 // once
/// gradaccum::weighted_gradients_accumulator<gradaccum::torch_backend> window(gradaccum::float_dtype::f32, 1.0);
/// for (const auto& batch : microbatches) {
///   optimizer.zero_grad();
///   loss_sum(*model, batch).backward();
///   window.accumulate_sum(params, gradaccum::torch_gradients(named), batch.tokens);
/// }
/// gradaccum::write_gradients(named, window.finish_mean(params).gradients);
/// optimizer.step();
/// @endcode
///
/// Needs libtorch (tested with 1.13) and a compiler that builds its headers as C++20: g++ does,
/// clang 14 with libstdc++ 12 does not.

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/ordered_dict.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include "gradaccum/backend.hpp"
#include "gradaccum/backends/torch_buffer.hpp"
#include "gradaccum/dtype.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/flat_gradients.hpp"
#include "gradaccum/gradients_params.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/shape.hpp"
#include "gradaccum/strided_view.hpp"
#include "gradaccum/type_list.hpp"

namespace gradaccum {

template <>
struct element_dtype<c10::Half> {
  static constexpr float_dtype value = float_dtype::f16;
};
template <>
struct element_dtype<c10::BFloat16> {
  static constexpr float_dtype value = float_dtype::bf16;
};

/// @brief A `torch::Tensor` whose dtype is T's (`c10::Half`, `c10::BFloat16`, `float`,
/// `double`): the typed form the library stores. A handle, like the tensor itself: copying it
/// shares the storage; any device, any strides. It is read where it is, when it is added.
template <class T>
class torch_tensor {
 public:
  /// @throws error(errc::invalid_dtype) unless `value` is a defined, strided tensor of T's dtype;
  /// error(errc::parameter_mismatch) when it has no values to read (the meta device, a nested
  /// tensor, a storage that does not hold its elements).
  explicit torch_tensor(at::Tensor value);

  /// @brief The tensor, as the caller gave it.
  [[nodiscard]] const at::Tensor& tensor() const noexcept { return value_; }

 private:
  at::Tensor value_;
};

/// @brief Traits that adapt `torch::Tensor`s to `serializable_backend` (see the file comment).
///
/// Devices are `c10::Device`s: a gradient must be on its parameter's device. A tensor is read
/// where it is when it is added (its storage must outlive the accumulation call, as a module's
/// parameters and gradients do). Results (`map`) are tensors viewing the window's buffer on its
/// device; `write_gradients` copies them into each parameter's `.grad()` there. Records hold
/// row-major values, so they restore into any other backend.
struct torch_backend {
  using device_type = c10::Device;
  using element_types = type_list<c10::Half, c10::BFloat16, float, double>;
  template <class T>
  using tensor = torch_tensor<T>;

  /// @brief What a `torch::Tensor` goes in as: the typed handle of its `scalar_type()`.
  using input = std::variant<tensor<c10::Half>, tensor<c10::BFloat16>, tensor<float>, tensor<double>>;

  /// @brief `x` as the handle of its dtype.
  /// @throws error(errc::invalid_dtype) for a dtype other than F16, BF16, F32, F64 (integers,
  /// complex, quantized); error(errc::parameter_mismatch) for an undefined tensor (a parameter
  /// without a gradient is absent: do not insert it), a sparse, MKL-DNN or other non-strided
  /// layout, a nested tensor, or a tensor without values (the meta device, a storage that does
  /// not hold its elements). The same for a parameter as for a gradient.
  static input adapt(const at::Tensor& x);

  template <class T>
  static tensor_shape shape(const tensor<T>& x);
  template <class T>
  static device_type device(const tensor<T>& x) noexcept {
    return x.tensor().device();
  }

  /// @brief The window's values on one device (see `torch_buffer`).
  template <class W>
  using buffer = torch_buffer;

  /// `count` zeros of W on `device`, a view of each of `segments`, and a scratch of up to 4 Mi
  /// elements (no more than `count`).
  /// @throws std::bad_alloc when libtorch cannot allocate them.
  template <class W>
  static buffer<W> allocate(std::size_t count, std::span<const buffer_segment> segments, const device_type& device);

  /// Queues acc[offset, offset + numel(g)) += scale · W(g), on acc's device, rounding twice.
  template <class W, class T>
  static void add_scaled(buffer<W>& acc, std::size_t offset, const tensor<T>& g, W scale) noexcept;
  /// Does the queued adds together (`_foreach_add_` on a device).
  template <class W>
  static void flush_adds(buffer<W>& acc) noexcept;
  /// The values for MPI to read and write in place: CPU memory, or CUDA memory when the MPI
  /// library is CUDA-aware (after the work queued on the device's stream is done); else nullptr.
  /// @throws error(errc::parameter_mismatch) when libtorch fails to wait for the device.
  template <class W>
  static W* data(buffer<W>& b, bool cuda_aware);

  /// A tensor of dtype W and shape `s` viewing the buffer from `offset`, on its device.
  template <class W>
  static at::Tensor map(const buffer<W>& b, std::size_t offset, const tensor_shape& s, const device_type& device);

  template <class W>
  static void divide(buffer<W>& b, std::size_t offset, std::size_t count, W first, W second) noexcept;
  template <class W>
  static void zero(buffer<W>& b, std::size_t offset, std::size_t count) noexcept;
  /// Whether the values are all finite: `isfinite(...).all()` on the buffer's device, one value
  /// copied back. @throws error(errc::parameter_mismatch) when libtorch fails.
  template <class W>
  static bool all_finite(const buffer<W>& b, std::size_t offset, std::size_t count);
  /// Host staging. @throws error(errc::parameter_mismatch) when libtorch fails to copy.
  template <class W>
  static void read(const buffer<W>& b, std::size_t offset, std::span<W> out);
  template <class W>
  static void write(buffer<W>& b, std::size_t offset, std::span<const W> in);

  /// An owned, contiguous copy in element type W, on the tensor's device.
  template <class W, class T>
  static tensor<W> convert(const tensor<T>& x);

  template <class T>
  static void to_row_major(const tensor<T>& t, std::span<T> out);

  template <class T>
  static tensor<T> from_row_major(std::span<const T> values, const tensor_shape& s, const device_type& device);
};

/// @brief The trainable parameters of `named` (`model->named_parameters()`), in its order: those
/// with `requires_grad()`. A tied parameter (one tensor under two names) is added once, under
/// its first name.
/// @throws the errors of `parameter_set::add`, and those of `torch_backend::adapt`.
parameter_set<torch_backend> torch_parameters(const torch::OrderedDict<std::string, at::Tensor>& named);

/// @brief The present gradients of `named`: each trainable parameter's `.grad()` under the name
/// `torch_parameters` gave it, read in place. An undefined `.grad()` is absent (not zero).
gradients_params<torch_backend> torch_gradients(const torch::OrderedDict<std::string, at::Tensor>& named);

/// @brief Writes `mean` into the `.grad()` of each trainable parameter of `named`, in the
/// parameter's dtype and on its device (narrowing rounds to nearest even), so a `torch::optim`
/// optimizer can step. A `.grad()` is written in place when it is a dense tensor of the
/// parameter's dtype, shape and device that can be written (not a zero tensor, not an inference
/// tensor outside inference mode, its storage holding its elements); any other (undefined,
/// `expand()`ed, strided slice, other dtype, ...) is replaced by a new contiguous tensor. A
/// parameter absent from `mean` gets an undefined `.grad()`, which optimizers skip: a gradient
/// left from the last backward pass must not be stepped on. Every `.grad()` is written, or none.
/// @throws error(errc::parameter_mismatch) when a present id's element count differs from its
/// parameter's, for a sparse, nested or meta parameter, or when libtorch fails to stage the values
/// (nothing is written);
/// error(errc::invalid_dtype) when such a parameter's dtype is not F16, BF16, F32 or F64.
void write_gradients(const torch::OrderedDict<std::string, at::Tensor>& named,
                     const flat_gradients<torch_backend>& mean);

// ---------------------------------------------------------------------------------------------
// Implementation.

namespace detail {

/// `x`'s values on the host, as a strided view in elements (libtorch's strides are in elements).
template <class T>
strided_view<const T> torch_host_view(const at::Tensor& host, const tensor_shape& shape) {
  std::array<std::ptrdiff_t, max_rank> strides{};
  for (std::size_t axis = 0; axis < shape.rank(); ++axis) {
    strides[axis] = static_cast<std::ptrdiff_t>(host.stride(static_cast<std::int64_t>(axis)));
  }
  return {static_cast<const T*>(host.data_ptr()), shape, std::span<const std::ptrdiff_t>(strides.data(), shape.rank())};
}

/// Why `x` (defined, strided) has no values in memory to read through its sizes and strides, or
/// empty when it has. A zero tensor has none, and passes: it is read as zeros.
inline std::string torch_unreadable(const at::Tensor& x) {
  if (x.is_meta()) return "a tensor on the meta device has no values.";
  if (x.is_nested()) return "a nested tensor has no single shape.";
  if (!x.has_storage()) return "the tensor has no storage.";
  if (x._is_zerotensor() || x.numel() == 0) return {};
  // Strides are never negative in libtorch: the last element is the furthest from the first.
  std::int64_t last = x.storage_offset();
  for (std::int64_t axis = 0; axis < x.dim(); ++axis) last += (x.size(axis) - 1) * x.stride(axis);
  const auto needed = static_cast<std::size_t>(last + 1) * x.element_size();
  if (x.storage().data() == nullptr || x.storage().nbytes() < needed) {
    return "the tensor's storage (" + std::to_string(x.storage().nbytes()) + " bytes) does not hold its elements (" +
           std::to_string(needed) + " bytes): freed or shrunk.";
  }
  return {};
}

inline void torch_check_readable(const at::Tensor& x) {
  if (std::string why = torch_unreadable(x); !why.empty()) fail(errc::parameter_mismatch, why);
}

/// `f()`, with a `c10::Error` it throws as error(errc::parameter_mismatch), naming `id`.
template <class F>
decltype(auto) torch_guarded(const std::string& id, F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const c10::Error& problem) {
    fail(errc::parameter_mismatch,
         (id.empty() ? "" : "tensor '" + id + "': ") + "libtorch failed: " + problem.what_without_backtrace(), id);
  }
}

/// `x`'s values as a CPU tensor: `x` itself when it is a plain CPU tensor, else a copy. The
/// negation bit is a flag on the tensor, not in its memory; a zero tensor has no memory.
inline at::Tensor torch_host_values(const at::Tensor& x) {
  return torch_guarded({}, [&] {
    if (x._is_zerotensor()) return at::zeros(x.sizes(), at::TensorOptions().dtype(x.scalar_type()));
    // The conjugate bit needs no resolving: it is only set on complex tensors, refused by dtype.
    return (x.is_cpu() ? x : x.to(at::kCPU)).resolve_neg();
  });
}

/// The first name of each distinct trainable tensor of `named` (ties once), with the tensor.
template <class F>
void for_each_trainable(const torch::OrderedDict<std::string, at::Tensor>& named, F&& f) {
  std::unordered_set<const void*> seen;
  for (const auto& item : named) {
    const at::Tensor& p = item.value();
    if (!p.defined() || !p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    f(item.key(), p);
  }
}

}  // namespace detail

template <class T>
torch_tensor<T>::torch_tensor(at::Tensor value) : value_(std::move(value)) {
  if (!value_.defined() || value_.layout() != at::kStrided || value_.scalar_type() != detail::torch_scalar_type<T>) {
    detail::fail(errc::invalid_dtype, "a torch_tensor<" + std::string(to_string(dtype_of<T>)) +
                                          "> must hold a defined, strided tensor of that dtype.");
  }
  detail::torch_check_readable(value_);
}

inline torch_backend::input torch_backend::adapt(const at::Tensor& x) {
  if (!x.defined()) {
    detail::fail(errc::parameter_mismatch, "the tensor is undefined (a parameter without a gradient is absent).");
  }
  if (x.layout() != at::kStrided) {
    detail::fail(errc::parameter_mismatch, "only strided (dense) tensors can be accumulated, not sparse ones.");
  }
  detail::torch_check_readable(x);
  switch (x.scalar_type()) {
    case at::kHalf: return tensor<c10::Half>(x);
    case at::kBFloat16: return tensor<c10::BFloat16>(x);
    case at::kFloat: return tensor<float>(x);
    case at::kDouble: return tensor<double>(x);
    default:
      detail::fail(errc::invalid_dtype, "dtype " + std::string(c10::toString(x.scalar_type())) +
                                            " is not a gradient dtype (F16, BF16, F32 or F64).");
  }
}

template <class T>
tensor_shape torch_backend::shape(const tensor<T>& x) {
  const at::IntArrayRef sizes = x.tensor().sizes();
  return tensor_shape(std::span<const std::int64_t>(sizes.data(), sizes.size()));
}

template <class W>
torch_buffer torch_backend::allocate(std::size_t count, std::span<const buffer_segment> segments,
                                     const device_type& device) {
  return detail::torch_allocate<W>(count, segments, device);
}

template <class W, class T>
void torch_backend::add_scaled(buffer<W>& acc, std::size_t offset, const tensor<T>& g, W scale) noexcept {
  const at::Tensor& x = g.tensor();
  at::Tensor segment = detail::torch_segment(acc, offset, static_cast<std::size_t>(x.numel()));
  if (segment.sizes() != x.sizes()) segment = segment.view(x.sizes());
  detail::torch_queue_add(acc, std::move(segment), x, at::Scalar(scale), std::is_same_v<T, W>, scale != W{1});
}

template <class W>
void torch_backend::flush_adds(buffer<W>& acc) noexcept {
  detail::torch_flush_adds(acc);
}

template <class W>
W* torch_backend::data(buffer<W>& b, bool cuda_aware) {
  if (b.values.is_cpu()) return static_cast<W*>(b.values.data_ptr());
  if (!cuda_aware || !b.values.is_cuda()) return nullptr;
  // MPI reads and writes the memory outside libtorch's stream: what is queued there goes first.
  detail::torch_guarded({}, [&] {
    const c10::Device device = b.values.device();
    c10::impl::getDeviceGuardImpl(device.type())->getStream(device).synchronize();
  });
  return static_cast<W*>(b.values.data_ptr());
}

template <class W>
at::Tensor torch_backend::map(const buffer<W>& b, std::size_t offset, const tensor_shape& s,
                              const device_type& /*device*/) {
  // A new view, not the buffer's own: what a caller does to its result's sizes or strides
  // (`squeeze_()`, `t_()`) must not reach the view the next window's adds go through.
  return detail::torch_segment(b, offset, *s.checked_element_count()).view(detail::torch_sizes(s));
}

template <class W>
void torch_backend::divide(buffer<W>& b, std::size_t offset, std::size_t count, W first, W second) noexcept {
  detail::torch_divide(b, offset, count, first, second);
}

template <class W>
void torch_backend::zero(buffer<W>& b, std::size_t offset, std::size_t count) noexcept {
  detail::torch_segment(b, offset, count).zero_();
}

template <class W>
bool torch_backend::all_finite(const buffer<W>& b, std::size_t offset, std::size_t count) {
  return detail::torch_guarded(
      {}, [&] { return at::isfinite(detail::torch_segment(b, offset, count)).all().template item<bool>(); });
}

template <class W>
void torch_backend::read(const buffer<W>& b, std::size_t offset, std::span<W> out) {
  detail::torch_guarded({}, [&] {
    const auto n = static_cast<std::int64_t>(out.size());
    at::from_blob(out.data(), {n}, at::TensorOptions().dtype(detail::torch_scalar_type<W>))
        .copy_(b.values.narrow(0, static_cast<std::int64_t>(offset), n));
  });
}

template <class W>
void torch_backend::write(buffer<W>& b, std::size_t offset, std::span<const W> in) {
  detail::torch_guarded({}, [&] {
    const auto n = static_cast<std::int64_t>(in.size());
    b.values.narrow(0, static_cast<std::int64_t>(offset), n)
        .copy_(at::from_blob(const_cast<W*>(in.data()), {n}, at::TensorOptions().dtype(detail::torch_scalar_type<W>)));
  });
}

template <class W, class T>
torch_tensor<W> torch_backend::convert(const tensor<T>& x) {
  const tensor_shape s = shape(x);
  at::Tensor out = at::empty(detail::torch_sizes(s), at::TensorOptions().dtype(detail::torch_scalar_type<W>));
  copy_row_major(detail::torch_host_view<T>(detail::torch_host_values(x.tensor()), s),
                 std::span<W>(static_cast<W*>(out.data_ptr()), out.numel()));
  return tensor<W>(x.tensor().is_cpu() ? out : detail::torch_guarded({}, [&] { return out.to(x.tensor().device()); }));
}

template <class T>
void torch_backend::to_row_major(const tensor<T>& t, std::span<T> out) {
  copy_row_major(detail::torch_host_view<T>(detail::torch_host_values(t.tensor()), shape(t)), out);
}

template <class T>
torch_tensor<T> torch_backend::from_row_major(std::span<const T> values, const tensor_shape& s,
                                              const device_type& device) {
  at::Tensor out = at::empty(detail::torch_sizes(s), at::TensorOptions().dtype(detail::torch_scalar_type<T>));
  if (!values.empty()) std::memcpy(out.data_ptr(), values.data(), values.size_bytes());
  return tensor<T>(device.is_cpu() ? out : detail::torch_guarded({}, [&] { return out.to(device); }));
}

inline parameter_set<torch_backend> torch_parameters(const torch::OrderedDict<std::string, at::Tensor>& named) {
  parameter_set<torch_backend> params;
  // A parameter off the CPU (or with the negation bit) is copied to the host here, one at a
  // time and once per parameter set (its values are not kept; only its shape and device are).
  detail::for_each_trainable(named, [&](const std::string& id, const at::Tensor& p) { params.add(id, p); });
  return params;
}

inline gradients_params<torch_backend> torch_gradients(const torch::OrderedDict<std::string, at::Tensor>& named) {
  gradients_params<torch_backend> grads;
  detail::for_each_trainable(named, [&](const std::string& id, const at::Tensor& p) {
    if (p.grad().defined()) grads.insert(id, p.grad());
  });
  return grads;
}

namespace detail {

/// Whether `grad`, the `.grad()` of `param`, can take `param`'s new gradient `values` in place
/// without libtorch refusing the copy or the values changing on the way: dense (no element
/// shares memory with another), of `param`'s dtype, shape and device, writable, and not
/// overlapping the values only in part.
inline bool torch_writable_grad(const at::Tensor& grad, const at::Tensor& param, const at::Tensor& values) {
  if (grad.layout() != at::kStrided || grad.is_nested() || grad._is_zerotensor() ||
      grad.scalar_type() != param.scalar_type() || grad.device() != param.device() || grad.sizes() != param.sizes() ||
      !grad.is_non_overlapping_and_dense() || (grad.is_inference() && !c10::InferenceMode::is_enabled()) ||
      !torch_unreadable(grad).empty()) {
    return false;
  }
  return at::get_overlap_status(grad, values) != at::MemOverlapStatus::Partial;
}

/// A new `.grad()` for `param` holding `values`: a copy in its dtype, on its device.
inline at::Tensor torch_new_grad(const std::string& id, const at::Tensor& values, const at::Tensor& param) {
  return torch_guarded(id, [&] {
    return values.to(at::TensorOptions().dtype(param.scalar_type()).device(param.device()), /*non_blocking=*/false,
                     /*copy=*/true);
  });
}

}  // namespace detail

inline void write_gradients(const torch::OrderedDict<std::string, at::Tensor>& named,
                            const flat_gradients<torch_backend>& mean) {
  // Everything that can fail happens first, with nothing written: each parameter is checked and
  // its values staged (in its dtype, on its device, where they cannot go in as they are); then
  // only copies that libtorch has no reason to refuse, and assignments.
  struct write {
    std::string id;
    at::Tensor param;
    at::Tensor values;  // undefined: clear .grad()
    bool in_place = false;
  };
  std::vector<write> writes;
  const c10::NoGradGuard no_grad;
  detail::visit_work_dtype(mean.dtype(), [&]<class W>() {
    detail::for_each_trainable(named, [&](const std::string& id, const at::Tensor& p) {
      if (!mean.contains(id)) {
        writes.push_back({id, p, {}, false});
        return;
      }
      if (p.layout() != at::kStrided || p.is_nested() || p.is_meta()) {
        detail::fail(
            errc::parameter_mismatch,
            "parameter '" + id + "' is sparse, nested or on the meta device: its .grad() cannot hold dense values.",
            id);
      }
      const at::ScalarType dtype = p.scalar_type();
      if (dtype != at::kHalf && dtype != at::kBFloat16 && dtype != at::kFloat && dtype != at::kDouble) {
        detail::fail(errc::invalid_dtype,
                     "parameter '" + id + "' has dtype " + c10::toString(dtype) + ", not F16, BF16, F32 or F64.", id);
      }
      const at::Tensor result = *mean.template get<W>(id);  // a view of the window's buffer
      if (result.numel() != p.numel()) {
        detail::fail(errc::parameter_mismatch,
                     "gradient '" + id + "' has " + std::to_string(result.numel()) + " elements but its parameter " +
                         std::to_string(p.numel()) + ".",
                     id);
      }
      const at::Tensor values = result.view(p.sizes());
      const bool in_place =
          p.grad().defined() && values.device() == p.device() && detail::torch_writable_grad(p.grad(), p, values);
      // Copied into .grad() where it is written in place; a new .grad() must not share the
      // window's buffer (the next window reuses it), so it is a copy, made on the device.
      writes.push_back({id, p, in_place ? values : detail::torch_new_grad(id, values, p), in_place});
    });
  });
  // Two .grad()s sharing memory cannot each hold their own values: both get new tensors. An
  // in-place target is dense, so its memory is one range of bytes.
  struct range {
    c10::Device device;
    std::uintptr_t begin, end;
    std::size_t write;
  };
  std::vector<range> ranges;
  for (std::size_t k = 0; k < writes.size(); ++k) {
    if (!writes[k].in_place || writes[k].param.numel() == 0) continue;
    const at::Tensor& grad = writes[k].param.grad();
    const auto begin = reinterpret_cast<std::uintptr_t>(grad.data_ptr());
    ranges.push_back({grad.device(), begin, begin + static_cast<std::uintptr_t>(grad.nbytes()), k});
  }
  std::sort(ranges.begin(), ranges.end(), [](const range& a, const range& b) {
    return std::tuple(a.device.type(), a.device.index(), a.begin) <
           std::tuple(b.device.type(), b.device.index(), b.begin);
  });
  for (std::size_t k = 1, reach = 0; k < ranges.size(); ++k) {
    if (ranges[k].device != ranges[reach].device || ranges[k].begin >= ranges[reach].end) {
      reach = k;
      continue;
    }
    for (const std::size_t shared : {ranges[reach].write, ranges[k].write}) {
      write& w = writes[shared];
      if (!w.in_place) continue;
      w.in_place = false;
      w.values = detail::torch_new_grad(w.id, w.values, w.param);  // it was the window's buffer
    }
    if (ranges[k].end > ranges[reach].end) reach = k;
  }
  for (write& w : writes) {
    if (!w.values.defined()) {
      w.param.mutable_grad().reset();
    } else if (w.in_place) {
      w.param.mutable_grad().copy_(w.values);
    } else {
      w.param.mutable_grad() = std::move(w.values);
    }
  }
}

}  // namespace gradaccum
