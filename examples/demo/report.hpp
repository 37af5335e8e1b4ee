// Output of the training run: the progress line, the loss-curve CSV and
// its gnuplot rendering.
#pragma once

#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace demo {

inline constexpr std::array<const char*, 3> recipe_names = {"full batch", "naive mean of means",
                                                            "gradaccum (token-weighted)"};

struct curve_point {
  std::size_t step = 0;  // 1-based optimizer step
  std::size_t tokens = 0;
  std::array<double, 3> train_loss{};  // window mean loss before the step, per recipe
  std::optional<std::array<double, 3>> heldout_loss;
};

// Step, loss and throughput: rewritten in place on a terminal, otherwise a
// plain line every `every` steps so logs stay short.
class progress_line {
 public:
  progress_line(std::size_t total_steps, std::size_t every)
      : total_(total_steps), every_(every), tty_(isatty(fileno(stdout)) != 0) {}

  void update(const curve_point& p, double tokens_per_second) {
    const bool last = p.step == total_;
    if (tty_) {
      const auto now = std::chrono::steady_clock::now();
      if (!last && now - shown_ < std::chrono::milliseconds(100)) {
        return;
      }
      shown_ = now;
      std::printf("\r");
    } else if (p.step % every_ != 0 && !last) {
      return;
    }
    std::printf("step %4zu/%zu  loss: full %.4f  naive %.4f  gradaccum %.4f  %6.0f tok/s", p.step, total_,
                p.train_loss[0], p.train_loss[1], p.train_loss[2], tokens_per_second);
    std::printf(tty_ && !last ? "  " : "\n");
    std::fflush(stdout);
  }

 private:
  std::size_t total_;
  std::size_t every_;
  bool tty_;
  std::chrono::steady_clock::time_point shown_{};
};

inline void write_csv(const std::filesystem::path& path, const std::vector<curve_point>& curve) {
  std::ofstream out(path);
  out << "step,window_tokens,train_full_batch,train_naive,train_gradaccum,"
         "heldout_full_batch,heldout_naive,heldout_gradaccum\n";
  out.precision(9);
  for (const curve_point& p : curve) {
    out << p.step << ',' << p.tokens;
    for (const double loss : p.train_loss) {
      out << ',' << loss;
    }
    for (std::size_t r = 0; r < 3; ++r) {
      out << ',';
      if (p.heldout_loss) {
        out << (*p.heldout_loss)[r];
      }
    }
    out << '\n';
  }
  if (!out.flush()) {
    throw std::runtime_error("cannot write '" + path.string() + "'");
  }
}

// A path as a gnuplot single-quoted string (a quote is written twice).
inline std::string gnuplot_quoted(const std::filesystem::path& path) {
  std::string quoted = "'";
  for (const char c : path.string()) {
    quoted += c == '\'' ? std::string("''") : std::string(1, c);
  }
  return quoted + "'";
}

// Writes the gnuplot script next to the CSV and runs gnuplot on it. Returns
// an empty string on success, else why there is no PNG.
inline std::string plot_png(const std::filesystem::path& csv, const std::filesystem::path& png,
                            const std::filesystem::path& script) {
  {
    std::ofstream gp(script);
    gp << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
          "    set terminal pngcairo size 1000,760 font ',10'\n"
          "} else {\n"
          "    set terminal png size 1000,760\n"
          "}\n"
          "set output "
       << gnuplot_quoted(png)
       << "\n"
          "set datafile separator ','\n"
          "set key autotitle columnhead top right\n"
          "set grid\n"
          "set multiplot layout 2,1\n"
          "set title 'Training loss per step (window mean over tokens) and held-out loss'\n"
          "set xlabel 'optimizer step'\n"
          "set ylabel 'cross-entropy (nats/char)'\n"
          "plot "
       << gnuplot_quoted(csv)
       << " using 1:3 with lines lw 1 lc rgb '#9ecae1' title 'train: full batch', \\\n"
          "     '' using 1:4 with lines lw 1 lc rgb '#fdae6b' title 'train: naive mean of means', \\\n"
          "     '' using 1:5 with lines lw 1 dt 2 lc rgb '#74c476' title 'train: gradaccum', \\\n"
          "     '' using 1:6 with linespoints lw 2 pt 7 lc rgb '#08519c' title 'held-out: full batch', \\\n"
          "     '' using 1:7 with linespoints lw 2 pt 5 lc rgb '#d94801' title 'held-out: naive mean of means', \\\n"
          "     '' using 1:8 with linespoints lw 2 pt 9 dt 2 lc rgb '#006d2c' title 'held-out: gradaccum'\n"
          "set title 'Training loss minus the full-batch run (same windows)'\n"
          "set ylabel 'loss difference'\n"
          "plot "
       << gnuplot_quoted(csv)
       << " using 1:($4-$3) with lines lw 2 lc rgb '#d94801' title 'naive mean of means - full batch', \\\n"
          "     '' using 1:($5-$3) with lines lw 2 lc rgb '#006d2c' title 'gradaccum - full batch'\n"
          "unset multiplot\n";
    if (!gp.flush()) {
      return "cannot write '" + script.string() + "'";
    }
  }
  // Spawned directly (no shell) so paths need no shell quoting and a
  // missing gnuplot shows up as ENOENT.
  std::string program = "gnuplot";
  std::string script_arg = script.string();
  std::array<char*, 3> argv = {program.data(), script_arg.data(), nullptr};
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, "gnuplot", nullptr, nullptr, argv.data(), environ);
  if (spawned == ENOENT) {
    return "gnuplot is not installed";
  }
  if (spawned != 0) {
    return "cannot run gnuplot";
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return "gnuplot failed (script " + script.string() + ")";
  }
  return {};
}

}  // namespace demo
