#pragma once
/// @file
/// @brief Shared by the checkpoint tests: the archives of each format, plain `archive(value)`
/// round trips, and how doctest prints a `checkpoint_format`.

#include <array>
#include <sstream>
#include <string>

#include <doctest/doctest.h>

#include <gradaccum/checkpoint.hpp>

template <>
struct doctest::StringMaker<gradaccum::checkpoint_format> {
  static doctest::String convert(gradaccum::checkpoint_format format) { return std::string(to_string(format)).c_str(); }
};

namespace gradaccum::test {

/// @brief The file extension that names `format` (`checkpoint_format_for` reads it back).
inline std::string extension_of(checkpoint_format format) {
  switch (format) {
    case checkpoint_format::binary: return ".bin";
    case checkpoint_format::portable_binary: return ".pbin";
    case checkpoint_format::json: return ".json";
    case checkpoint_format::xml: return ".xml";
  }
  return "";
}

inline constexpr std::array<checkpoint_format, 4> all_formats = {
    checkpoint_format::binary, checkpoint_format::portable_binary, checkpoint_format::json, checkpoint_format::xml};

/// @brief The input and output archive of one checkpoint format.
template <checkpoint_format F>
struct archives {
  static constexpr checkpoint_format format = F;
  using input = typename detail::archives_of<F>::input;
  using output = typename detail::archives_of<F>::output;
};
using binary_archives = archives<checkpoint_format::binary>;
using portable_binary_archives = archives<checkpoint_format::portable_binary>;
using json_archives = archives<checkpoint_format::json>;
using xml_archives = archives<checkpoint_format::xml>;

/// @brief What a user writes: `archive(value)` with a plain cereal archive.
template <class Archives, class T>
std::string save_plain(const T& value) {
  std::ostringstream out;
  {
    typename Archives::output archive(out);
    archive(value);
  }  // text archives finish their document when destroyed
  return out.str();
}

template <class Archives, class T>
T load_plain(const std::string& bytes) {
  std::istringstream in(bytes);
  typename Archives::input archive(in);
  T value;
  archive(value);
  return value;
}

}  // namespace gradaccum::test

TYPE_TO_STRING(gradaccum::test::binary_archives);
TYPE_TO_STRING(gradaccum::test::portable_binary_archives);
TYPE_TO_STRING(gradaccum::test::json_archives);
TYPE_TO_STRING(gradaccum::test::xml_archives);

/// @brief Every archive, for `TEST_CASE_TEMPLATE`.
#define GRADACCUM_TEST_ARCHIVES                                                                                \
  gradaccum::test::binary_archives, gradaccum::test::portable_binary_archives, gradaccum::test::json_archives, \
      gradaccum::test::xml_archives
