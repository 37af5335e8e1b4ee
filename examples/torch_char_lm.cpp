// A character-level language model in torch::nn (an embedding and a GRU over the previous 3
// characters) trained on the demo's words with gradaccum on 2 MPI ranks:
//
//   mpirun -n 2 torch_char_lm [steps] [word file]
//
// Every step, a window of microbatches of unequal token counts is split over the ranks; each
// rank accumulates the gradients of its microbatches' loss SUMs, stored in BF16 as a
// mixed-precision run would hold them, into an F32 window weighted by tokens; allreduce_mean
// turns the ranks' sums into the full-batch mean, which goes into every parameter's .grad() for
// torch::optim::Adam. On the first step it also checks (and prints, as the demo does):
//  - the relative error of that mean against the full-batch gradient, and of the naive mean of
//    per-microbatch mean gradients, which weights a 3-token microbatch like a 30-token one;
//  - a checkpoint taken in the middle of the window, restored into a new accumulator and
//    continued, gives the uninterrupted window's sums bit for bit.
// Exits non-zero if a check fails.
#include <torch/torch.h>

#include <gradaccum/backends/torch.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>
#include <gradaccum/mpi.hpp>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "demo/text_data.hpp"

namespace {

using accumulator = gradaccum::weighted_gradients_accumulator<gradaccum::torch_backend>;
constexpr int context = 3;
constexpr double loss_scale = 1024.0;  // fixed for the window, as a mixed-precision run would

struct CharGruImpl : torch::nn::Module {
  CharGruImpl()
      : embed(register_module("embed", torch::nn::Embedding(demo::vocab_size, 16))),
        gru(register_module("gru", torch::nn::GRU(torch::nn::GRUOptions(16, 32).batch_first(true)))),
        head(register_module("head", torch::nn::Linear(32, demo::vocab_size))) {}

  /// Logits of the next character for each row of `contexts` ([tokens, context]).
  torch::Tensor forward(const torch::Tensor& contexts) {
    const auto hidden = std::get<1>(gru(embed(contexts)));  // [1, tokens, 32]
    return head(hidden.squeeze(0));
  }

  torch::nn::Embedding embed;
  torch::nn::GRU gru;
  torch::nn::Linear head;
};
TORCH_MODULE(CharGru);

struct tensors {
  torch::Tensor contexts;
  torch::Tensor targets;
};

tensors tensors_of(const demo::token_batch& mb) {
  const auto tokens = static_cast<std::int64_t>(mb.tokens());
  std::vector<std::int64_t> contexts(mb.contexts.begin(), mb.contexts.end());
  std::vector<std::int64_t> targets(mb.targets.begin(), mb.targets.end());
  return {torch::tensor(contexts).reshape({tokens, context}), torch::tensor(targets)};
}

/// Backward of the microbatch's loss (scaled SUM, or MEAN) into the model's .grad().
void backward(CharGru& model, const demo::token_batch& mb, bool mean) {
  const tensors t = tensors_of(mb);
  model->zero_grad();
  auto options = torch::nn::functional::CrossEntropyFuncOptions();
  if (mean) {
    options.reduction(torch::kMean);
  } else {
    options.reduction(torch::kSum);
  }
  const auto loss = torch::nn::functional::cross_entropy(model(t.contexts), t.targets, options);
  (mean ? loss : loss * loss_scale).backward();
}

/// The model's present gradients stored in BF16, as a mixed-precision backward pass holds them.
gradaccum::gradients_params<gradaccum::torch_backend> bf16_gradients(
    const torch::OrderedDict<std::string, torch::Tensor>& named) {
  gradaccum::gradients_params<gradaccum::torch_backend> grads;
  for (const auto& item : named) {
    if (item.value().grad().defined()) grads.insert(item.key(), item.value().grad().to(torch::kBFloat16));
  }
  return grads;
}

/// Every parameter's .grad() flattened into one F64 vector (zeros where undefined).
torch::Tensor flat_grads(const torch::OrderedDict<std::string, torch::Tensor>& named) {
  std::vector<torch::Tensor> parts;
  for (const auto& item : named) {
    const auto& g = item.value().grad();
    parts.push_back(g.defined() ? g.to(torch::kDouble).flatten()
                                : torch::zeros({item.value().numel()}, torch::kDouble));
  }
  return torch::cat(parts);
}

double relative_error(const torch::Tensor& g, const torch::Tensor& reference) {
  return ((g - reference).norm() / reference.norm()).item<double>();
}

std::filesystem::path word_file(int argc, char** argv) {
  if (argc > 2) return argv[2];
  return "/usr/share/dict/american-english";
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const bool root = rank == 0;
  const int steps = argc > 1 ? std::stoi(argv[1]) : 20;
  at::set_num_threads(1);  // one core per rank
  torch::manual_seed(7);   // the same initial model on every rank

  std::vector<std::string> words = demo::read_words(word_file(argc, argv));
  // Microbatches of 1 to 12 words: their token counts differ up to tenfold.
  demo::window_stream stream(std::move(words), {12, 1, 7, 3, 10, 2}, context, 42);
  CharGru model;
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(3e-3));
  auto named = model->named_parameters();
  const auto params = gradaccum::torch_parameters(named);

  std::vector<std::string> failures;
  const auto check = [&](bool ok, const std::string& what) {
    if (!ok) failures.push_back(what);
  };
  for (int step = 0; step < steps; ++step) {
    const demo::window w = stream.next();
    accumulator window(gradaccum::float_dtype::f32, loss_scale);
    std::vector<std::size_t> mine;
    for (std::size_t i = static_cast<std::size_t>(rank); i < w.microbatches.size();
         i += static_cast<std::size_t>(ranks))
      mine.push_back(i);
    for (std::size_t k = 0; k < mine.size(); ++k) {
      backward(model, w.microbatches[mine[k]], /*mean=*/false);
      window.accumulate_sum(params, bf16_gradients(named), static_cast<double>(w.microbatches[mine[k]].tokens()));
      if (step == 0 && k == 0) {
        // Mid-window checkpoint: saved, restored into a new accumulator that finishes the window.
        const auto path = std::filesystem::temp_directory_path() / ("torch_char_lm." + std::to_string(rank) + ".bin");
        gradaccum::save_checkpoint(path, window.try_to_record());
        accumulator resumed(gradaccum::float_dtype::f64, 1.0);
        resumed.load_record(params, gradaccum::load_checkpoint<gradaccum::weighted_gradients_record>(path));
        std::filesystem::remove(path);
        for (std::size_t j = 1; j < mine.size(); ++j) {
          backward(model, w.microbatches[mine[j]], /*mean=*/false);
          const auto grads = bf16_gradients(named);
          const auto tokens = static_cast<double>(w.microbatches[mine[j]].tokens());
          resumed.accumulate_sum(params, grads, tokens);
          window.accumulate_sum(params, grads, tokens);
        }
        const bool same = resumed.try_to_record() == window.try_to_record();
        check(same, "resume is not bit-identical");
        if (root) {
          std::printf("exact resume: checkpoint after 1 of %zu microbatches on rank 0: %s\n", mine.size(),
                      same ? "bit-identical" : "MISMATCH");
        }
        break;
      }
    }
    const double tokens = static_cast<double>(w.tokens());
    auto mean = gradaccum::allreduce_mean(params, window.finish_sums(), MPI_COMM_WORLD);
    check(mean.state.total_weight == tokens, "the reduced weight is not the window's token count");

    if (step == 0) {
      // References on every rank (the window is known everywhere): the full batch, and the naive
      // mean of per-microbatch mean gradients.
      backward(model, w.merged(), /*mean=*/true);
      const torch::Tensor full = flat_grads(named);
      torch::Tensor naive = torch::zeros_like(full);
      for (const demo::token_batch& mb : w.microbatches) {
        backward(model, mb, /*mean=*/true);
        naive += flat_grads(named) / static_cast<double>(w.microbatches.size());
      }
      gradaccum::write_gradients(named, mean.gradients);
      const double weighted_error = relative_error(flat_grads(named), full);
      const double naive_error = relative_error(naive, full);
      if (root) {
        std::printf("window 0: %zu microbatches, %.0f tokens, over %d ranks\n", w.microbatches.size(), tokens, ranks);
        std::printf("relative L2 error vs the full-batch gradient:\n");
        std::printf("  gradaccum, BF16 gradients, F32 window, weight = tokens   %9.2e\n", weighted_error);
        std::printf("  naive mean of per-microbatch mean gradients             %9.2e\n", naive_error);
      }
      // BF16 keeps 8 significant bits: its rounding alone is a relative error up to 2^-9.
      check(weighted_error < 4e-3, "the weighted mean is off by more than BF16 rounding");
      check(naive_error > 10 * weighted_error, "the naive mean is not visibly wrong (plan too uniform?)");
    } else {
      gradaccum::write_gradients(named, mean.gradients);
    }
    optimizer.step();

    if (step == 0 || step + 1 == steps) {
      const tensors all = tensors_of(w.merged());
      const double loss = torch::nn::functional::cross_entropy(model(all.contexts), all.targets).item<double>();
      if (root) std::printf("step %2d: loss %.4f on the window just stepped on\n", step, loss);
    }
  }
  for (const std::string& failure : failures)
    std::fprintf(stderr, "rank %d: check failed: %s\n", rank, failure.c_str());
  int failed = failures.empty() ? 0 : 1;
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (root) std::printf("%s\n", failed ? "torch_char_lm: FAILED" : "torch_char_lm: all checks passed");
  MPI_Finalize();
  return failed;
}
