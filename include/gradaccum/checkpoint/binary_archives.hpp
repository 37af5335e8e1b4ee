#pragma once
/// @file
/// @brief The archives binary and portable binary checkpoint files are written and read with.
///
/// - `binary_output_archive(stream, portable)` writes what cereal's `BinaryOutputArchive` writes
///   or, when `portable`, what its `PortableBinaryOutputArchive` writes with default options
///   (one byte, 1 on a little-endian machine and 0 on a big-endian one, then the same bytes).
/// - `binary_input_archive(stream, portable)` reads them as cereal's input archives do: a
///   portable archive swaps every value whose byte order differs from this machine's.
///
/// Why not cereal's four classes: one archive type for both formats means the record code is
/// compiled once for binary files instead of twice, in every file that saves or loads a
/// checkpoint (about a fifth of the checkpoint code a program compiles). The bytes and the
/// exceptions (`cereal::Exception` with cereal's messages) are cereal's.

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>

#include <cereal/cereal.hpp>

namespace gradaccum::detail {

class binary_output_archive : public cereal::OutputArchive<binary_output_archive, cereal::AllowEmptyClassElision> {
 public:
  binary_output_archive(std::ostream& stream, bool portable) : OutputArchive(this), buffer_(*stream.rdbuf()) {
    if (portable) (*this)(static_cast<std::uint8_t>(std::endian::native == std::endian::little));
  }

  void saveBinary(const void* data, std::streamsize size) {
    const std::streamsize written = buffer_.sputn(static_cast<const char*>(data), size);
    if (written != size) {
      throw cereal::Exception("Failed to write " + std::to_string(size) + " bytes to output stream! Wrote " +
                              std::to_string(written));
    }
  }

 private:
  std::streambuf& buffer_;
};

class binary_input_archive : public cereal::InputArchive<binary_input_archive, cereal::AllowEmptyClassElision> {
 public:
  binary_input_archive(std::istream& stream, bool portable) : InputArchive(this), buffer_(*stream.rdbuf()) {
    if (portable) {
      std::uint8_t little = 0;
      (*this)(little);
      swap_ = (static_cast<std::uint8_t>(std::endian::native == std::endian::little) ^ little) != 0;
    }
  }

  /// Reads `size` bytes of values of `element_size` bytes each.
  void loadBinary(void* data, std::streamsize size, std::size_t element_size = 1) {
    const std::streamsize read = buffer_.sgetn(static_cast<char*>(data), size);
    if (read != size) {
      throw cereal::Exception("Failed to read " + std::to_string(size) + " bytes from input stream! Read " +
                              std::to_string(read));
    }
    if (swap_ && element_size > 1) {
      auto* bytes = static_cast<unsigned char*>(data);
      for (std::streamsize at = 0; at + static_cast<std::streamsize>(element_size) <= size;
           at += static_cast<std::streamsize>(element_size)) {
        std::reverse(bytes + at, bytes + at + element_size);
      }
    }
  }

 private:
  std::streambuf& buffer_;
  bool swap_ = false;
};

template <class T>
  requires std::is_arithmetic_v<T>
void CEREAL_SAVE_FUNCTION_NAME(binary_output_archive& ar, const T& value) {
  ar.saveBinary(std::addressof(value), sizeof(T));
}
template <class T>
  requires std::is_arithmetic_v<T>
void CEREAL_LOAD_FUNCTION_NAME(binary_input_archive& ar, T& value) {
  ar.loadBinary(std::addressof(value), sizeof(T), sizeof(T));
}

/// Names are not written; sizes are plain numbers (as cereal's binary archives do).
template <class Archive>
concept binary_archive = std::same_as<Archive, binary_output_archive> || std::same_as<Archive, binary_input_archive>;

template <binary_archive Archive, class T>
void CEREAL_SERIALIZE_FUNCTION_NAME(Archive& ar, cereal::NameValuePair<T>& pair) {
  ar(pair.value);
}
template <binary_archive Archive, class T>
void CEREAL_SERIALIZE_FUNCTION_NAME(Archive& ar, cereal::SizeTag<T>& size) {
  ar(size.size);
}

template <class T>
void CEREAL_SAVE_FUNCTION_NAME(binary_output_archive& ar, const cereal::BinaryData<T>& data) {
  ar.saveBinary(data.data, static_cast<std::streamsize>(data.size));
}
template <class T>
void CEREAL_LOAD_FUNCTION_NAME(binary_input_archive& ar, cereal::BinaryData<T>& data) {
  using element = std::remove_pointer_t<T>;
  ar.loadBinary(data.data, static_cast<std::streamsize>(data.size),
                sizeof(std::conditional_t<std::is_void_v<element>, char, element>));
}

}  // namespace gradaccum::detail

CEREAL_SETUP_ARCHIVE_TRAITS(gradaccum::detail::binary_input_archive, gradaccum::detail::binary_output_archive)
