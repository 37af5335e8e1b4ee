// The libtorch backend on a device, checked in one process (run by tools/gpu-check on a machine
// with CUDA; CI runs it on the CPU with --device cpu --quick so that it keeps building and running):
//
//   1. bits: a window of device tensors gives the bits of the same window of CPU tensors (F32 and
//      F64 work dtypes; F32, BF16 and F16 gradients, contiguous and strided; accumulate_sum and
//      accumulate_mean; finish_mean; the global norm and clip_by_global_norm);
//   2. a torch::nn module trained on the device: the accumulated mean of token-weighted
//      microbatches against the gradient of the full batch's mean loss;
//   3. speed, side by side with the loop a libtorch user writes on the same tensors (medians of
//      --repetitions windows, the device synchronized before each clock read). gradaccum's
//      window is a training loop's: torch_gradients of the parameters' .grad() per microbatch,
//      accumulate, then write_gradients of the mean back into .grad():
//        8 microbatches of one 64 MiB F32 parameter, accumulate_sum  <= 1.2x  acc.add_(g) then div
//        the same with accumulate_mean                               <= 2.0x  acc.add_(g, w) then div
//        8 microbatches of 1,000 parameters of 4 KiB                  >= 2x faster than add_ per parameter
//
// One line per check, with its ratio; exit status 1 when a bit differs or a target is missed.
// Speed targets are gated on CUDA only (on the CPU the lines are printed for information).
#include <gradaccum/backends/torch.hpp>
#include <gradaccum/gradaccum.hpp>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace {

using B = gradaccum::torch_backend;
using gradaccum::float_dtype;

struct options {
  torch::Device device = torch::kCUDA;
  bool quick = false;
  int repetitions = 9;
};

int failures = 0;

void report(bool ok, const std::string& line) {
  std::printf("%s %s\n", ok ? "PASS" : "MISS", line.c_str());
  std::fflush(stdout);
  if (!ok) ++failures;
}

at::ScalarType scalar_type(float_dtype d) {
  switch (d) {
    case float_dtype::f64: return at::kDouble;
    case float_dtype::bf16: return at::kBFloat16;
    case float_dtype::f16: return at::kHalf;
    default: return at::kFloat;
  }
}

/// Same bits: both tensors' bytes compared as integers (NaN payloads and signed zeros included).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::ScalarType as_int = a.element_size() == 8 ? at::kLong : a.element_size() == 4 ? at::kInt : at::kShort;
  return torch::equal(a.contiguous().cpu().view(as_int), b.contiguous().cpu().view(as_int));
}

// --- 1. bits ---

struct bits_case {
  float_dtype work;
  float_dtype gradient;
  bool strided;
  bool mean;
};

/// The finished mean of a window over `microbatches` gradients given on `device`: each
/// parameter's values, copied to the CPU.
std::vector<at::Tensor> window_on(const torch::Device& device, const bits_case& c,
                                  const std::vector<std::vector<at::Tensor>>& microbatches,
                                  const std::vector<double>& weights, const std::vector<std::string>& ids,
                                  const std::vector<at::Tensor>& parameters) {
  gradaccum::parameter_set<B> params;
  for (std::size_t i = 0; i < ids.size(); ++i) params.add(ids[i], parameters[i].to(device));
  gradaccum::weighted_gradients_accumulator<B> window(c.work, 1.0);
  for (std::size_t k = 0; k < microbatches.size(); ++k) {
    gradaccum::gradients_params<B> grads;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const at::Tensor g = microbatches[k][i].to(device);
      // Strided: the parameter's shape read through a transpose of a buffer laid out the other way.
      grads.insert(ids[i], c.strided ? g.t().contiguous().t() : g);
    }
    if (c.mean) {
      window.accumulate_mean(params, grads, weights[k]);
    } else {
      window.accumulate_sum(params, grads, weights[k]);
    }
  }
  auto result = window.finish_mean(params);
  std::vector<at::Tensor> values;
  const auto copy_results = [&] {
    for (const std::string& id : ids) {
      values.push_back(c.work == float_dtype::f64 ? result.gradients.get<double>(id)->clone().cpu()
                                                  : result.gradients.get<float>(id)->clone().cpu());
    }
  };
  copy_results();
  // The norm and clipping read the window through host staging: the CPU's bits too.
  values.push_back(torch::tensor(gradaccum::clip_by_global_norm(result, 1.0), torch::kDouble));
  copy_results();
  return values;
}

void check_bits(const options& o) {
  torch::manual_seed(7);
  const std::vector<std::string> ids = {"fc.weight", "fc.bias"};
  const std::vector<double> weights = {3.0, 1.0, 5.0, 2.0};
  for (const float_dtype work : {float_dtype::f32, float_dtype::f64}) {
    for (const float_dtype gradient : {float_dtype::f32, float_dtype::bf16, float_dtype::f16}) {
      for (const bool strided : {false, true}) {
        for (const bool mean : {false, true}) {
          const bits_case c{work, gradient, strided, mean};
          const std::vector<at::Tensor> parameters = {torch::zeros({48, 64}), torch::zeros({64})};
          std::vector<std::vector<at::Tensor>> microbatches;
          for (std::size_t k = 0; k < weights.size(); ++k) {
            microbatches.push_back({(torch::randn({48, 64}) * 3).to(scalar_type(gradient)),
                                    (torch::randn({64}) * 3).to(scalar_type(gradient))});
          }
          const auto on_cpu = window_on(torch::kCPU, c, microbatches, weights, ids, parameters);
          const auto on_device = window_on(o.device, c, microbatches, weights, ids, parameters);
          bool same = true;
          for (std::size_t i = 0; i < on_cpu.size(); ++i) same = same && same_bits(on_cpu[i], on_device[i]);
          report(same, std::string("bits ") + std::string(gradaccum::to_string(work)) + " window, " +
                           std::string(gradaccum::to_string(gradient)) + (strided ? " strided" : " contiguous") +
                           " gradients, " + (mean ? "accumulate_mean" : "accumulate_sum") +
                           " + finish_mean, global norm, clip: device == CPU");
        }
      }
    }
  }
}

// --- 2. a module trained on the device ---

void check_module(const options& o) {
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::Tanh(), torch::nn::Linear(32, 4));
  model->to(o.device, torch::kDouble);
  const std::vector<std::int64_t> tokens = {3, 9, 1, 6};
  std::vector<at::Tensor> xs;
  std::vector<at::Tensor> ys;
  for (const std::int64_t n : tokens) {
    xs.push_back(torch::randn({n, 16}, torch::kDouble).to(o.device));
    ys.push_back(torch::randn({n, 4}, torch::kDouble).to(o.device));
  }
  auto named = model->named_parameters();
  const auto params = gradaccum::torch_parameters(named);
  gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f64, 1.0);
  for (std::size_t k = 0; k < xs.size(); ++k) {
    model->zero_grad();
    torch::mse_loss(model->forward(xs[k]), ys[k], torch::Reduction::Mean).backward();  // mean over the microbatch
    window.accumulate_mean(params, gradaccum::torch_gradients(named), static_cast<double>(tokens[k]));
  }
  gradaccum::write_gradients(named, window.finish_mean(params).gradients);
  std::vector<at::Tensor> accumulated;
  for (const auto& p : model->parameters()) accumulated.push_back(p.grad().clone());

  model->zero_grad();
  torch::mse_loss(model->forward(torch::cat(xs)), torch::cat(ys), torch::Reduction::Mean).backward();
  double worst = 0.0;
  std::size_t k = 0;
  bool on_device = true;
  for (const auto& p : model->parameters()) {
    on_device = on_device && accumulated[k].device() == o.device;
    worst = std::max(worst, (accumulated[k++] - p.grad()).abs().max().item<double>());
  }
  char line[256];
  std::snprintf(line, sizeof line,
                "module on %s: accumulated mean vs full-batch gradient, max |diff| %.3g (F64, bound 1e-12), .grad() on "
                "the device",
                o.device.str().c_str(), worst);
  report(on_device && worst < 1e-12, line);
}

// --- 3. speed ---

void synchronize(const options& o) {
  if (o.device.is_cuda()) torch::cuda::synchronize();
}

/// Median seconds of `run` over o.repetitions calls, after one warm-up call.
double median_seconds(const options& o, const std::function<void()>& run) {
  run();
  synchronize(o);
  std::vector<double> seconds;
  for (int r = 0; r < o.repetitions; ++r) {
    const auto start = std::chrono::steady_clock::now();
    run();
    synchronize(o);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(seconds.begin(), seconds.begin() + seconds.size() / 2, seconds.end());
  return seconds[seconds.size() / 2];
}

void speed_line(const options& o, const std::string& what, double ours, double hand, double limit, bool at_most) {
  const double ratio = ours / hand;
  const bool ok = !o.device.is_cuda() || (at_most ? ratio <= limit : hand / ours >= limit);
  char line[512];
  std::snprintf(line, sizeof line, "speed %s: gradaccum %.3f ms, by hand %.3f ms, ratio %.2f (target %s %.1fx%s)",
                what.c_str(), ours * 1e3, hand * 1e3, ratio, at_most ? "<=" : "faster by >=", limit,
                o.device.is_cuda() ? "" : "; gated on CUDA only");
  report(ok, line);
}

/// Trainable parameters of `shape` named p0, p1, ..., on o.device, each with a `.grad()` of its
/// own (`out`) that write_gradients writes the window's mean into, as it does in training.
torch::OrderedDict<std::string, at::Tensor> named_parameters(const options& o, int count, std::int64_t elements) {
  torch::OrderedDict<std::string, at::Tensor> named;
  for (int i = 0; i < count; ++i) {
    at::Tensor p = torch::zeros({elements}, torch::TensorOptions().dtype(torch::kFloat).device(o.device));
    p.set_requires_grad(true);
    named.insert("p" + std::to_string(i), p);
  }
  return named;
}

/// One training window through gradaccum, as a loop writes it: each microbatch's gradients are
/// the parameters' `.grad()`s (set here, as backward would), taken by torch_gradients and
/// accumulated; the mean goes back into `.grad()` (the `out` tensors, written in place).
void window_through_gradaccum(gradaccum::weighted_gradients_accumulator<B>& window,
                              const gradaccum::parameter_set<B>& params,
                              const torch::OrderedDict<std::string, at::Tensor>& named,
                              const std::vector<std::vector<at::Tensor>>& grads, const std::vector<at::Tensor>& out,
                              const std::vector<double>& weights, bool mean) {
  for (std::size_t k = 0; k < grads.size(); ++k) {
    for (std::size_t i = 0; i < named.size(); ++i) named[i].value().mutable_grad() = grads[k][i];
    if (mean) {
      window.accumulate_mean(params, gradaccum::torch_gradients(named), weights[k]);
    } else {
      window.accumulate_sum(params, gradaccum::torch_gradients(named), weights[k]);
    }
  }
  for (std::size_t i = 0; i < named.size(); ++i) named[i].value().mutable_grad() = out[i];
  gradaccum::write_gradients(named, window.finish_mean(params).gradients);
}

/// The same window as a libtorch user writes it: `acc.add_(g)` (or `add_(g, w)`) per parameter
/// and microbatch, then one division.
void window_by_hand(std::vector<at::Tensor>& acc, const std::vector<std::vector<at::Tensor>>& grads,
                    const std::vector<double>& weights, bool mean) {
  double total = 0;
  for (const double w : weights) total += w;
  for (auto& a : acc) a.zero_();
  for (std::size_t k = 0; k < grads.size(); ++k) {
    for (std::size_t i = 0; i < acc.size(); ++i) {
      if (mean) {
        acc[i].add_(grads[k][i], weights[k]);
      } else {
        acc[i].add_(grads[k][i]);
      }
    }
  }
  for (auto& a : acc) a.div_(total);  // finish_mean divides by the total weight in both modes
}

/// gradaccum against the hand loop over `count` parameters of `elements` F32 values, 8 microbatches.
void compare_speed(const options& o, int count, std::int64_t elements, bool mean, const std::string& what, double limit,
                   bool at_most) {
  const std::vector<double> weights = {3, 1, 5, 2, 4, 7, 6, 8};
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(o.device);
  std::vector<std::vector<at::Tensor>> grads(weights.size());
  std::vector<at::Tensor> out;
  std::vector<at::Tensor> acc;
  for (auto& microbatch : grads) {
    for (int i = 0; i < count; ++i) microbatch.push_back(torch::randn({elements}, f32));
  }
  for (int i = 0; i < count; ++i) {
    out.push_back(torch::zeros({elements}, f32));
    acc.push_back(torch::zeros({elements}, f32));
  }
  const auto named = named_parameters(o, count, elements);
  const auto params = gradaccum::torch_parameters(named);
  gradaccum::weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
  const double ours =
      median_seconds(o, [&] { window_through_gradaccum(window, params, named, grads, out, weights, mean); });
  const double hand = median_seconds(o, [&] { window_by_hand(acc, grads, weights, mean); });
  bool same = true;  // both computed the same mean, to the contract's roundings
  for (int i = 0; i < count; ++i) same = same && torch::allclose(out[i], acc[i], 1e-5, 1e-6);
  speed_line(o, what, ours, hand, limit, at_most);
  report(same, "values of that window: gradaccum's mean == the hand loop's, to F32 rounding");
}

void check_speed(const options& o) {
  const std::int64_t large = o.quick ? (1 << 16) : (16 << 20);  // 64 MiB of F32
  const std::string size = o.quick ? "256 KiB" : "64 MiB";
  compare_speed(o, 1, large, false,
                "8 microbatches of one " + size + " F32 parameter, accumulate_sum vs add_(g), then div", 1.2, true);
  compare_speed(o, 1, large, true,
                "8 microbatches of one " + size + " F32 parameter, accumulate_mean vs add_(g, w), then div", 2.0, true);
  const int count = o.quick ? 100 : 1000;
  compare_speed(o, count, 1024, false,
                "8 microbatches of " + std::to_string(count) + " parameters of 4 KiB, accumulate_sum vs add_ each", 2.0,
                false);
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--quick") {
      o.quick = true;
      o.repetitions = 3;
    } else if (arg == "--device" && i + 1 < argc) {
      o.device = torch::Device(argv[++i]);
    } else if (arg == "--repetitions" && i + 1 < argc) {
      o.repetitions = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: gpu_check [--device cuda|cuda:N|cpu] [--quick] [--repetitions N]\n");
      return 2;
    }
  }
  if (o.device.is_cuda() && !torch::cuda::is_available()) {
    std::fprintf(stderr, "gpu_check: CUDA is not available to this libtorch; run with --device cpu\n");
    return 2;
  }
  std::printf("gpu_check on %s, libtorch %s\n", o.device.str().c_str(), TORCH_VERSION);
  try {
    check_bits(o);
    check_module(o);
    check_speed(o);
  } catch (const std::exception& e) {
    std::printf("MISS stopped by an exception: %s\n", e.what());
    return 1;
  }
  std::printf("%d check(s) missed\n", failures);
  return failures == 0 ? 0 : 1;
}
