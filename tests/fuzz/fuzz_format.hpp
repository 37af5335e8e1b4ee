#pragma once
/// @file
/// @brief The checkpoint format a harness fuzzes, from $GRADACCUM_FUZZ_FORMAT: one executable per
/// harness serves every format, so each harness compiles once.

#include <cstdio>
#include <cstdlib>
#include <optional>

#include <gradaccum/checkpoint.hpp>

namespace fuzz {

/// The format $GRADACCUM_FUZZ_FORMAT names; exits with a message when it names none.
inline gradaccum::checkpoint_format format_from_environment() {
  const char* name = std::getenv("GRADACCUM_FUZZ_FORMAT");
  const std::optional<gradaccum::checkpoint_format> format =
      name != nullptr ? gradaccum::parse_checkpoint_format(name) : std::nullopt;
  if (!format) {
    std::fprintf(stderr, "set GRADACCUM_FUZZ_FORMAT to binary, portable_binary or json\n");
    std::exit(2);
  }
  return *format;
}

}  // namespace fuzz
