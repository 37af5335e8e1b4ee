// gradaccum-demo: trains a small character-level language model on English
// words with microbatches of unequal size and shows, with numbers, that
// token-weighted accumulation reproduces the full-batch gradient while the
// usual mean of per-microbatch mean losses does not; that F16/BF16
// microbatch gradients accumulate well in F32 under a fixed loss scale; and
// that a window checkpointed mid-way resumes bit-identically; and runs the whole
// training step after a window (clipping, dynamic loss scaling with a forced
// overflow that is skipped, Adam over the flat buffer).

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "experiments.hpp"
#include "model.hpp"
#include "report.hpp"
#include "text_data.hpp"

// Set by meson to the bundled word list's absolute path.
#ifndef GRADACCUM_DEMO_FALLBACK_DATA
#define GRADACCUM_DEMO_FALLBACK_DATA "examples/demo/fallback_words.txt"
#endif

namespace {

namespace fs = std::filesystem;
using demo::char_mlp;

constexpr const char* system_word_list = "/usr/share/dict/american-english";
constexpr float learning_rate = 1e-2f;
constexpr std::size_t report_every = 25;  // steps between plain progress lines and held-out evaluations
constexpr std::size_t max_heldout_words = 1000;
constexpr double check_weighted_below = 1e-5;
constexpr double check_naive_above = 1e-3;
constexpr std::size_t full_step_windows = 8;
constexpr std::size_t forced_overflow_window = 3;
constexpr double max_gradient_norm = 0.4;  // below most of these windows' norms: they get clipped

struct options {
  std::string data;
  std::size_t steps = 300;
  std::vector<std::size_t> plan = {3, 17, 40, 9};
  gradaccum::float_dtype dtype = gradaccum::float_dtype::f32;
  double loss_scale = 1024;
  std::uint64_t seed = 42;
  std::string out = "gradaccum-demo-out";
  bool check = false;
};

std::string dtype_name(gradaccum::float_dtype d) {
  return std::string(gradaccum::to_string(d));
}

std::string joined(const std::vector<std::size_t>& values, const char* separator) {
  std::string text;
  for (const std::size_t v : values) {
    text += (text.empty() ? "" : separator) + std::to_string(v);
  }
  return text;
}

struct dataset {
  fs::path path;
  std::vector<std::string> train;
  std::vector<std::string> heldout;
};

dataset load_data(const options& opt) {
  dataset d;
  d.path = !opt.data.empty()              ? fs::path(opt.data)
           : fs::exists(system_word_list) ? fs::path(system_word_list)
                                          : fs::path(GRADACCUM_DEMO_FALLBACK_DATA);
  if (!fs::is_regular_file(d.path)) {
    throw std::runtime_error("cannot read data file '" + d.path.string() + "'");
  }
  std::vector<std::string> words = demo::read_words(d.path);
  std::mt19937_64 rng(opt.seed);
  std::shuffle(words.begin(), words.end(), rng);
  const std::size_t heldout = std::min(max_heldout_words, words.size() / 10);
  const std::size_t needed = demo::plan_sequences(opt.plan);
  if (heldout == 0 || words.size() - heldout < needed) {
    throw std::runtime_error("data file '" + d.path.string() + "' has " + std::to_string(words.size()) +
                             " usable words; the plan needs " + std::to_string(needed) +
                             " per window plus 10% held out");
  }
  d.heldout.assign(words.end() - static_cast<std::ptrdiff_t>(heldout), words.end());
  words.resize(words.size() - heldout);
  d.train = std::move(words);
  return d;
}

struct training_result {
  std::vector<demo::curve_point> curve;
  double seconds = 0;
  std::size_t tokens = 0;  // processed by the three recipes together
  char_mlp<float> gradaccum_model;
};

// Trains three copies of the same model on the same windows; they differ
// only in how a window's microbatch gradients become one gradient.
training_result train(const char_mlp<float>& initial, demo::window_stream& stream, const demo::token_batch& heldout,
                      const demo::model_shape& shape, const options& opt) {
  const demo::parameters params = demo::parameter_set_of(initial);
  std::array<char_mlp<float>, 3> models = {initial, initial, initial};
  std::array<demo::adam, 3> optimizers = {demo::adam(shape, learning_rate), demo::adam(shape, learning_rate),
                                          demo::adam(shape, learning_rate)};
  gradaccum::weighted_gradients_accumulator<demo::backend> naive(opt.dtype, 1.0);
  gradaccum::weighted_gradients_accumulator<demo::backend> weighted(opt.dtype, 1.0);
  char_mlp<float> g = char_mlp<float>::zeros(shape);
  demo::progress_line progress(opt.steps, report_every);
  training_result result;
  const auto start = std::chrono::steady_clock::now();
  const auto seconds_since_start = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };

  for (std::size_t step = 1; step <= opt.steps; ++step) {
    const demo::window w = stream.next();
    const auto tokens = static_cast<double>(w.tokens());
    demo::curve_point point;
    point.step = step;
    point.tokens = w.tokens();

    point.train_loss[0] = demo::loss_and_gradients(models[0], w.merged(), static_cast<float>(1 / tokens), g) / tokens;
    optimizers[0].step(models[0], g);

    // Both microbatch recipes feed mean-loss gradients; only the weight
    // differs: 1 per microbatch (naive) or the microbatch's token count.
    for (std::size_t r = 1; r <= 2; ++r) {
      auto& acc = r == 1 ? naive : weighted;
      double loss_sum = 0;
      for (const demo::token_batch& mb : w.microbatches) {
        const auto mb_tokens = static_cast<double>(mb.tokens());
        loss_sum += demo::loss_and_gradients(models[r], mb, static_cast<float>(1 / mb_tokens), g);
        acc.accumulate_mean(params, demo::views_of(g), r == 1 ? 1.0 : mb_tokens);
      }
      point.train_loss[r] = loss_sum / tokens;
      optimizers[r].step(models[r], demo::model_gradients<float>(acc.finish_mean(params).gradients, shape));
    }
    result.tokens += 3 * w.tokens();

    if (step == 1 || step % report_every == 0 || step == opt.steps) {
      std::array<double, 3> losses{};
      for (std::size_t r = 0; r < 3; ++r) {
        losses[r] = demo::loss_sum(models[r], heldout) / static_cast<double>(heldout.tokens());
      }
      point.heldout_loss = losses;
    }
    progress.update(point, static_cast<double>(result.tokens) / seconds_since_start());
    result.curve.push_back(point);
  }
  result.seconds = seconds_since_start();
  result.gradaccum_model = models[2];
  return result;
}

struct precision_row {
  std::string label;
  double error = 0;
};

// Everything measured on single windows, after training: mid-training
// gradients are the realistic case.
struct window_measurements {
  std::array<demo::exactness_result, 2> exactness;
  std::vector<precision_row> precision;
  demo::resume_result resume;
  demo::full_step_result full_step;
};

window_measurements measure(const char_mlp<float>& model, const demo::window& first, const demo::window& last,
                            const std::vector<demo::window>& windows, const demo::model_shape& shape,
                            const options& opt, const fs::path& out) {
  const std::size_t full = demo::plan_sequences(opt.plan);
  const std::string last_label =
      "last window of epoch 0 (" + (last.sequences() < full ? "short: " + std::to_string(last.sequences()) + " of " +
                                                                  std::to_string(full) + " sequences)"
                                                            : std::string("full)"));
  const char_mlp<double> reference = demo::reference_gradient(model, first, shape);
  char scale[32];
  std::snprintf(scale, sizeof scale, "%g", opt.loss_scale);
  return {
      .exactness = {demo::measure_exactness("window 0 of epoch 0", model, first, shape, opt.dtype),
                    demo::measure_exactness(last_label, model, last, shape, opt.dtype)},
      .precision = {{"F32 gradients, loss scale 1",
                     demo::mixed_precision_error<float>(model, first, shape, 1.0, reference)},
                    {std::string("BF16 gradients, loss scale ") + scale,
                     demo::mixed_precision_error<Eigen::bfloat16>(model, first, shape, opt.loss_scale, reference)},
                    {std::string("F16 gradients, loss scale ") + scale,
                     demo::mixed_precision_error<Eigen::half>(model, first, shape, opt.loss_scale, reference)}},
      .resume = demo::check_resume(model, first, shape, opt.dtype, out / "resume_checkpoint.bin"),
      .full_step = demo::train_full_steps(model, windows, forced_overflow_window, learning_rate, max_gradient_norm),
  };
}

void print_summary(const window_measurements& m, const training_result& training, const options& opt) {
  const std::string work = " (" + dtype_name(opt.dtype) + " window)";
  std::printf("\n=========================== gradaccum demo: summary ===========================\n");
  std::printf("gradient exactness: relative L2 error vs the full-batch gradient computed in F64\n");
  for (const demo::exactness_result& r : m.exactness) {
    std::size_t total = 0;
    for (const std::size_t t : r.microbatch_tokens) {
      total += t;
    }
    std::printf("  %s: %zu microbatches, %s = %zu tokens\n", r.label.c_str(), r.microbatch_tokens.size(),
                joined(r.microbatch_tokens, "+").c_str(), total);
    std::printf("    %-62s %9.2e\n", "full batch in F32 (the F32 rounding floor)", r.full_batch_f32);
    std::printf("    %-62s %9.2e\n", ("gradaccum accumulate_mean, weight = tokens" + work).c_str(), r.accumulate_mean);
    std::printf("    %-62s %9.2e\n", ("gradaccum accumulate_sum, weight = tokens" + work).c_str(), r.accumulate_sum);
    std::printf("    %-62s %9.2e%s\n", "naive mean of per-microbatch mean losses", r.naive,
                r.naive > check_naive_above ? "  <- wrong" : "");
  }
  std::printf("mixed precision (window 0): microbatch gradients stored in F16/BF16, accumulated in F32\n");
  for (const precision_row& row : m.precision) {
    std::printf("    %-62s %9.2e\n", row.label.c_str(), row.error);
  }
  std::printf("exact resume (window 0): checkpoint after %zu of %zu microbatches (%ju bytes)\n", m.resume.split_after,
              m.resume.microbatches, m.resume.checkpoint_bytes);
  std::printf("    %s\n", m.resume.checkpoint.c_str());
  if (m.resume.mismatch.empty()) {
    std::printf("    resume: bit-identical\n");
  } else {
    std::printf("    resume: MISMATCH (%s)\n", m.resume.mismatch.c_str());
  }

  const demo::full_step_result& step = m.full_step;
  std::printf("the whole step (%zu windows): finish_mean -> clip_by_global_norm(%g) -> loss scale update -> Adam\n",
              step.scales.size(), max_gradient_norm);
  std::string scales;
  std::string norms;
  for (std::size_t i = 0; i < step.scales.size(); ++i) {
    char cell[32];
    std::snprintf(cell, sizeof cell, "%s%g", i == 0 ? "" : " ", step.scales[i]);
    scales += cell;
    std::snprintf(cell, sizeof cell, "%s%.3g", i == 0 ? "" : " ", step.norms[i]);
    norms += cell;
  }
  std::printf("    loss scale per window:        %s\n", scales.c_str());
  std::printf("    gradient norm before clipping: %s\n", norms.c_str());
  for (const std::size_t skipped : step.skipped) {
    std::printf("    window %zu overflowed (an infinity forced into its gradients): step skipped, scale %g -> %g\n",
                skipped, step.scales[skipped],
                skipped + 1 < step.scales.size() ? step.scales[skipped + 1] : step.scales[skipped] / 2);
  }
  std::printf("    mean train loss: first window %.4f, last window %.4f\n", step.first_loss, step.last_loss);

  std::printf("training: %zu Adam steps (lr %g) per recipe, %s work dtype   train loss  held-out\n", opt.steps,
              static_cast<double>(learning_rate), dtype_name(opt.dtype).c_str());
  const demo::curve_point& final_point = training.curve.back();
  for (std::size_t r = 0; r < 3; ++r) {
    std::printf("    %-53s %10.4f %9.4f\n", demo::recipe_names[r], final_point.train_loss[r],
                (*final_point.heldout_loss)[r]);
  }
  double naive_gap = 0;
  double weighted_gap = 0;
  for (const demo::curve_point& p : training.curve) {
    naive_gap = std::max(naive_gap, std::abs(p.train_loss[1] - p.train_loss[0]));
    weighted_gap = std::max(weighted_gap, std::abs(p.train_loss[2] - p.train_loss[0]));
  }
  std::printf("    max |train loss - full batch| over all steps: gradaccum %.1e, naive %.1e\n", weighted_gap,
              naive_gap);
  std::printf("    %.1f s, %.0f tokens/s (3 recipes)\n", training.seconds,
              static_cast<double>(training.tokens) / training.seconds);
}

// What --check requires; empty when everything holds.
std::vector<std::string> check_failures(const window_measurements& m) {
  std::vector<std::string> failures;
  for (const demo::exactness_result& r : m.exactness) {
    if (!(r.accumulate_mean < check_weighted_below && r.accumulate_sum < check_weighted_below)) {
      failures.push_back(r.label + ": weighted accumulation error is not below 1e-5");
    }
    if (!(r.naive > check_naive_above)) {
      failures.push_back(r.label + ": naive error is not above 1e-3 (plan too uniform?)");
    }
  }
  if (!m.resume.mismatch.empty()) {
    failures.push_back("resume is not bit-identical: " + m.resume.mismatch);
  }
  const demo::full_step_result& step = m.full_step;
  if (step.skipped != std::vector<std::size_t>{forced_overflow_window}) {
    failures.emplace_back("the whole step: exactly the forced overflow window must be skipped");
  }
  for (std::size_t i = 0; i + 1 < step.scales.size(); ++i) {
    const double expected = i == forced_overflow_window ? step.scales[i] / 2 : step.scales[i];
    if (step.scales[i + 1] != expected || std::isfinite(step.norms[i]) == (i == forced_overflow_window)) {
      failures.push_back("the whole step: window " + std::to_string(i) + "'s scale or norm is wrong");
    }
  }
  return failures;
}

int run(const options& opt) {
  // The model's matrices are small: when built with OpenMP, Eigen's threaded products cost more in
  // hand-offs than they save (ten times more on a busy machine).
  Eigen::setNbThreads(1);
  const dataset data = load_data(opt);
  const fs::path out(opt.out);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) {
    throw std::runtime_error("cannot create output directory '" + out.string() + "': " + ec.message());
  }
  const demo::model_shape shape;
  std::mt19937_64 rng(opt.seed);
  const char_mlp<float> initial = demo::init_model(shape, rng);
  demo::window_stream stream(data.train, opt.plan, shape.context, opt.seed + 1);
  const demo::token_batch heldout = demo::make_batch(data.heldout, shape.context);
  // The measurement windows: the first and the (usually short) last of epoch 0.
  const demo::window first = stream.at(0);
  const demo::window last = stream.at(stream.windows_per_epoch() - 1);

  std::size_t parameter_count = 0;
  demo::for_each_tensor(initial, [&](std::string_view, const demo::matrix<float>& t) {
    parameter_count += static_cast<std::size_t>(t.size());
  });
  std::printf("data: %s (%zu words for training, %zu held out)\n", data.path.c_str(), data.train.size(),
              data.heldout.size());
  std::printf("model: %d previous chars -> embed %d -> tanh %d -> softmax %d (%zu parameters)\n", shape.context,
              shape.embed, shape.hidden, shape.vocab, parameter_count);
  std::printf("plan: %s sequences per microbatch, %zu windows per epoch\n", joined(opt.plan, ",").c_str(),
              stream.windows_per_epoch());
  std::printf("training %zu steps with each recipe: full batch, naive mean of means, gradaccum\n", opt.steps);
  std::fflush(stdout);

  const training_result training = train(initial, stream, heldout, shape, opt);
  const fs::path csv = out / "loss_curves.csv";
  const fs::path png = out / "loss_curves.png";
  demo::write_csv(csv, training.curve);
  const std::string plot_problem = demo::plot_png(csv, png, out / "loss_curves.gp");
  std::vector<demo::window> step_windows;
  for (std::size_t i = 0; i < full_step_windows; ++i) step_windows.push_back(stream.at(i % stream.windows_per_epoch()));
  const window_measurements m = measure(training.gradaccum_model, first, last, step_windows, shape, opt, out);

  print_summary(m, training, opt);
  std::printf("files:\n    %s\n", csv.c_str());
  if (plot_problem.empty()) {
    std::printf("    %s\n", png.c_str());
  } else {
    std::printf("    no PNG plot: %s\n", plot_problem.c_str());
  }
  if (!opt.check) {
    return 0;
  }
  const std::vector<std::string> failures = check_failures(m);
  for (const std::string& f : failures) {
    std::fprintf(stderr, "check failed: %s\n", f.c_str());
  }
  std::printf("check: %s\n", failures.empty() ? "passed" : "FAILED");
  return failures.empty() ? 0 : 1;
}

// CLI11's stock range checks print the whole range of the type; these say
// what is expected in a few words.
const CLI::Validator positive_integer(
    [](std::string& text) {
      std::uint32_t value = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
      return ec == std::errc() && end == text.data() + text.size() && value > 0
                 ? std::string()
                 : "expected a positive integer below 2^32, got '" + text + "'";
    },
    "POSITIVE");

const CLI::Validator positive_number(
    [](std::string& text) {
      double value = 0;
      return CLI::detail::lexical_cast(text, value) && std::isfinite(value) && value > 0
                 ? std::string()
                 : "expected a positive number, got '" + text + "'";
    },
    "POSITIVE");

// Parses the command line into `opt`; returns an exit code when the program
// should stop instead (help was printed, or a flag was bad).
std::optional<int> parse_command_line(int argc, char** argv, options& opt) {
  std::string dtype = "f32";
  CLI::App app{
      "Trains a character-level language model with unequal microbatches and shows "
      "exact token-weighted gradient accumulation with gradaccum."};
  app.add_option("--data", opt.data,
                 "Text or word list to train on (default: " + std::string(system_word_list) +
                     " if present, else the bundled word list)");
  app.add_option("--steps", opt.steps, "Optimizer steps per recipe")->check(positive_integer)->capture_default_str();
  app.add_option("--plan", opt.plan, "Sequences per microbatch in a window, e.g. 3,17,40,9")
      ->delimiter(',')
      ->check(positive_integer)
      ->capture_default_str();
  app.add_option("--dtype", dtype, "Work dtype of the accumulators: f32 or f64")
      ->check(CLI::IsMember({"f32", "f64"}, CLI::ignore_case))
      ->capture_default_str();
  app.add_option("--loss-scale", opt.loss_scale, "Fixed loss scale for the F16/BF16 microbatch gradients")
      ->check(positive_number)
      ->capture_default_str();
  app.add_option("--seed", opt.seed, "Random seed (data order and initial weights)")->capture_default_str();
  app.add_option("--out", opt.out, "Output directory for the CSV, plot and checkpoint")->capture_default_str();
  app.add_flag("--check", opt.check,
               "Exit non-zero unless weighted accumulation is exact, the naive recipe is "
               "visibly wrong, resume is bit-identical and the whole step skips exactly the forced "
               "overflow window (for CI; use a small --steps)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "gradaccum-demo: %s (see --help)\n", e.what());
    return 2;
  }
  opt.dtype = dtype == "f64" ? gradaccum::float_dtype::f64 : gradaccum::float_dtype::f32;
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    options opt;
    if (const std::optional<int> exit_code = parse_command_line(argc, argv, opt)) return *exit_code;
    return run(opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gradaccum-demo: error: %s\n", e.what());
    return 1;
  }
}
