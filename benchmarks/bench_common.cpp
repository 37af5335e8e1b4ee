/// @file
/// @brief Definitions behind bench_common.hpp: options, the buffer pool and `run`.

#include "bench_common.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace ga_bench {

options& opts() noexcept {
  static options instance;
  return instance;
}

buffer_pool& pool() {
  static buffer_pool instance;
  return instance;
}

int openmp_threads() noexcept {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

namespace {

std::size_t parse_bytes(const std::string& text) {
  std::size_t end = 0;
  const double value = std::stod(text, &end);
  double scale = 1;
  if (end < text.size()) {
    switch (text[end]) {
      case 'k':
      case 'K': scale = KiB; break;
      case 'm':
      case 'M': scale = MiB; break;
      case 'g':
      case 'G': scale = 1024.0 * MiB; break;
      default: throw std::invalid_argument("bad size suffix in '" + text + "'");
    }
  }
  return static_cast<std::size_t>(value * scale);
}

bool take(std::string_view arg, std::string_view flag, std::string& value) {
  if (arg.size() <= flag.size() || arg.substr(0, flag.size()) != flag || arg[flag.size()] != '=') return false;
  value = std::string(arg.substr(flag.size() + 1));
  return true;
}

}  // namespace

int run(int argc, char** argv, const std::function<void()>& register_cases) {
  std::vector<char*> rest;
  rest.reserve(static_cast<std::size_t>(argc) + 1);
  for (int i = 0; i < argc; ++i) {
    const std::string_view arg = argv[i];
    std::string value;
    try {
      if (take(arg, "--ga_max_bytes", value)) {
        opts().max_bytes = parse_bytes(value);
      } else if (take(arg, "--ga_min_time", value)) {
        opts().min_time = std::stod(value);
      } else if (take(arg, "--ga_min_time_large", value)) {
        opts().min_time_large = std::stod(value);
      } else {
        rest.push_back(argv[i]);
      }
    } catch (const std::exception&) {
      std::fprintf(stderr, "%s: bad value in '%s'\n", argv[0], argv[i]);
      return 2;
    }
  }
  register_cases();
  benchmark::AddCustomContext("ga_max_bytes", std::to_string(opts().max_bytes));
  if (opts().torch_threads > 0) benchmark::AddCustomContext("ga_torch_threads", std::to_string(opts().torch_threads));
  int rest_argc = static_cast<int>(rest.size());
  rest.push_back(nullptr);
  benchmark::Initialize(&rest_argc, rest.data());
  if (benchmark::ReportUnrecognizedArguments(rest_argc, rest.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace ga_bench
