// Plugging your own tensor type into gradaccum: a complete backend in about a page.
//
// `lab::ndarray<T>` stands for the tensor type of your code base; it knows nothing about
// gradaccum. `lab_backend` is the adapter: a struct of types and static functions through which
// gradaccum reads ndarrays into its own buffer of sums, shows results, and copies ndarrays for
// records. Nothing else is needed: the accumulators, their buffer, validation, error handling
// and checkpoint records all come from the library.
#include <algorithm>
#include <cstddef>
#include <exception>
#include <functional>
#include <iostream>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include <gradaccum/gradaccum.hpp>

namespace lab {

/// Your tensor: row-major values in host memory, their dimensions and the device they are on.
template <class T>
class ndarray {
 public:
  ndarray(std::vector<std::size_t> dims, int device, T fill = T{0})
      : dims_(std::move(dims)),
        values_(std::accumulate(dims_.begin(), dims_.end(), std::size_t{1}, std::multiplies<>()), fill),
        device_(device) {}
  [[nodiscard]] const std::vector<std::size_t>& dims() const { return dims_; }
  [[nodiscard]] int device() const { return device_; }
  [[nodiscard]] std::size_t size() const { return values_.size(); }
  [[nodiscard]] T* data() { return values_.data(); }
  [[nodiscard]] const T* data() const { return values_.data(); }

 private:
  std::vector<std::size_t> dims_;
  std::vector<T> values_;
  int device_;
};

}  // namespace lab

/// The adapter. gradaccum checks it against its `tensor_backend` concept and names any piece
/// that is missing. W below is always float or double: the work type sums are kept in.
struct lab_backend {
  using device_type = int;                                    // copyable, compared with ==
  using element_types = gradaccum::type_list<float, double>;  // gradient element types accepted
  template <class T>
  using tensor = lab::ndarray<T>;

  template <class T>
  static gradaccum::tensor_shape shape(const tensor<T>& t) {
    return gradaccum::tensor_shape(std::span<const std::size_t>(t.dims()));
  }
  template <class T>
  static device_type device(const tensor<T>& t) {
    return t.device();
  }
  // The arithmetic: acc is this parameter's slice of gradaccum's buffer of sums, row-major;
  // gradaccum::kernels has the exact loop (two roundings, no FMA).
  template <class W, class T>
  static void add_scaled(std::span<W> acc, const tensor<T>& g, W scale) noexcept {  // acc += scale · W(g)
    gradaccum::kernels::add_scaled(acc.data(), g.data(), acc.size(), scale);
  }
  // How results are handed out: here as plain spans of the row-major values.
  template <class W>
  static std::span<const W> map(std::span<const W> values, const gradaccum::tensor_shape& /*shape*/,
                                const device_type& /*device*/) noexcept {
    return values;
  }
  template <class W, class T>
  static tensor<W> convert(const tensor<T>& t) {
    tensor<W> out(t.dims(), t.device());
    gradaccum::kernels::convert(out.data(), t.data(), t.size());
    return out;
  }
  // For checkpoints: copies to and from row-major buffers (ndarray is row-major already).
  template <class T>
  static void to_row_major(const tensor<T>& t, std::span<T> out) {
    std::copy_n(t.data(), t.size(), out.data());
  }
  template <class T>
  static tensor<T> from_row_major(std::span<const T> values, const gradaccum::tensor_shape& shape,
                                  const device_type& device) {
    tensor<T> out(std::vector<std::size_t>(shape.begin(), shape.end()), device);
    std::copy(values.begin(), values.end(), out.data());
    return out;
  }
};
static_assert(gradaccum::serializable_backend<lab_backend>);

int main() try {
  using B = lab_backend;
  constexpr int gpu0 = 0;
  gradaccum::parameter_set<B> params;
  params.add("fc.weight", lab::ndarray<float>({2, 3}, gpu0));

  // Two microbatches of MEAN-loss gradients, over 1 and 3 tokens.
  gradaccum::weighted_gradients_accumulator<B> window(gradaccum::float_dtype::f32, /*loss_scale=*/1.0);
  for (auto [mean_gradient, tokens] : {std::pair{2.0F, 1.0}, std::pair{6.0F, 3.0}}) {
    gradaccum::gradients_params<B> grads;
    grads.insert("fc.weight", lab::ndarray<float>({2, 3}, gpu0, mean_gradient));
    window.accumulate_mean(params, grads, tokens);
  }

  // A gradient on another device is refused, and the window is left as it was.
  try {
    gradaccum::gradients_params<B> misplaced;
    misplaced.insert("fc.weight", lab::ndarray<float>({2, 3}, /*device=*/1));
    window.accumulate_sum(params, misplaced, 1.0);
  } catch (const gradaccum::error& e) {
    std::cout << "refused: " << e.error_code().message() << " for '" << e.param_id() << "'\n";
  }

  // Checkpoint mid-window and resume in a fresh accumulator: values and counters together.
  const gradaccum::weighted_gradients_record checkpoint = window.try_to_record();
  gradaccum::weighted_gradients_accumulator<B> resumed(gradaccum::float_dtype::f32, 1.0);
  resumed.load_record(params, checkpoint);

  const auto result = resumed.finish_mean(params);
  std::cout << result.state.microbatches << " microbatches, " << result.state.total_weight << " tokens\n";
  const std::span<const float> mean = *result.gradients.get<float>("fc.weight");
  std::cout << "fc.weight:";
  for (const float x : mean) std::cout << ' ' << x;  // (1·2 + 3·6) / 4 = 5
  std::cout << '\n';
} catch (const std::exception& e) {  // nothing above should throw, but say so if it does
  std::cerr << e.what() << '\n';
  return 1;
}
