/// @file
/// @brief libFuzzer harness for the checkpoint loader of one format ($GRADACCUM_FUZZ_FORMAT:
/// binary, portable_binary or json), built by `-Dfuzz=true` with clang's
/// -fsanitize=fuzzer,address,undefined.
///
/// Any input must either load as a valid weighted record that saves and loads back to the same
/// bytes, or throw `gradaccum::error`; a crash, a sanitizer report, another exception (libFuzzer
/// reports it as a crash) or an allocation above -malloc_limit_mb is a finding. Binary inputs
/// also go through a plain cereal archive, which does not know how many bytes remain.

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

#include <cereal/archives/binary.hpp>

#include <gradaccum/checkpoint.hpp>

#include "fuzz_format.hpp"

namespace {

gradaccum::checkpoint_format format;

void round_trip(const gradaccum::weighted_gradients_record& record) {
  gradaccum::validate(record);
  const std::string saved = gradaccum::serialize_checkpoint(record, format);
  const auto reloaded = gradaccum::parse_checkpoint<gradaccum::weighted_gradients_record>(saved, format);
  if (gradaccum::serialize_checkpoint(reloaded, format) != saved) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  format = fuzz::format_from_environment();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    round_trip(gradaccum::parse_checkpoint<gradaccum::weighted_gradients_record>(bytes, format));
  } catch (const gradaccum::error&) {
  }
  if (format == gradaccum::checkpoint_format::binary) {
    try {
      std::istringstream in{std::string(bytes)};
      cereal::BinaryInputArchive archive(in);
      gradaccum::weighted_gradients_record record;
      archive(record);
      gradaccum::validate(record);
    } catch (const gradaccum::error&) {
    } catch (const cereal::Exception&) {  // documented: cereal reads the outermost version itself
    }
  }
  return 0;
}
