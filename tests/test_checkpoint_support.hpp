#pragma once
/// @file
/// @brief Shared by the checkpoint tests: cereal's archives (those of each checkpoint format, and
/// its XML archive, which records serialize through as through any cereal archive), plain
/// `archive(value)` round trips, and how doctest prints a `checkpoint_format`.

#include <array>
#include <sstream>
#include <string>

#include <doctest/doctest.h>
#include <cereal/archives/binary.hpp>
#include <cereal/archives/json.hpp>
#include <cereal/archives/portable_binary.hpp>
#include <cereal/archives/xml.hpp>

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
  }
  return "";
}

inline constexpr std::array<checkpoint_format, 3> all_formats = {
    checkpoint_format::binary, checkpoint_format::portable_binary, checkpoint_format::json};

/// @brief cereal's input and output archive of one checkpoint format.
template <checkpoint_format F, class Input, class Output>
struct archives {
  static constexpr checkpoint_format format = F;
  using input = Input;
  using output = Output;
};
using binary_archives = archives<checkpoint_format::binary, cereal::BinaryInputArchive, cereal::BinaryOutputArchive>;
using portable_binary_archives = archives<checkpoint_format::portable_binary, cereal::PortableBinaryInputArchive,
                                          cereal::PortableBinaryOutputArchive>;
using json_archives = archives<checkpoint_format::json, cereal::JSONInputArchive, cereal::JSONOutputArchive>;
/// cereal's XML archives: no checkpoint format, but records serialize through them too.
struct xml_archives {
  using input = cereal::XMLInputArchive;
  using output = cereal::XMLOutputArchive;
};

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

/// @brief The archives of every checkpoint format, for `TEST_CASE_TEMPLATE`.
#define GRADACCUM_TEST_CHECKPOINT_ARCHIVES \
  gradaccum::test::binary_archives, gradaccum::test::portable_binary_archives, gradaccum::test::json_archives

/// @brief Every cereal archive, for `TEST_CASE_TEMPLATE`.
#define GRADACCUM_TEST_ARCHIVES GRADACCUM_TEST_CHECKPOINT_ARCHIVES, gradaccum::test::xml_archives
