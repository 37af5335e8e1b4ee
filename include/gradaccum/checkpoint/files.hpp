#pragma once
/// @file
/// @brief The definitions behind `<gradaccum/checkpoint.hpp>`: formats, archives and files.
///
/// Included by `checkpoint.hpp` (inline, the default) or compiled once by `src/checkpoint.cpp`
/// when `GRADACCUM_SEPARATE_COMPILATION` is defined. Nothing here depends on a backend: an
/// accumulator's values arrive as record views and leave through a `tensor_sink`.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <ostream>
#include <streambuf>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>

#include "gradaccum/cereal.hpp"
#include "gradaccum/checkpoint/binary_archives.hpp"
#include "gradaccum/checkpoint/declarations.hpp"
#include "gradaccum/checkpoint/posix_file.hpp"
#include "gradaccum/checkpoint/tensor_sink.hpp"
#include "gradaccum/checkpoint/text_archives.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/records.hpp"

namespace gradaccum {

namespace detail {

// ---- Formats -----------------------------------------------------------------------------------

constexpr bool is_text_format(checkpoint_format format) noexcept {
  return format == checkpoint_format::json;
}

/// The name of the outermost node, which tells text readers what the document holds; a view
/// is written as the record it borrows from.
template <class R>
constexpr const char* record_name() noexcept {
  if constexpr (std::is_same_v<R, weighted_gradients_record> || std::is_same_v<R, weighted_gradients_view>) {
    return "weighted_gradients_record";
  } else if constexpr (std::is_same_v<R, gradients_params_record> || std::is_same_v<R, gradients_view>) {
    return "gradients_params_record";
  } else {
    static_assert(std::is_same_v<R, weighted_accumulation_state>);
    return "weighted_accumulation_state";
  }
}

/// The name of the node that follows a window's record in a file that also holds its loss scale.
inline constexpr const char* loss_scale_node = "dynamic_loss_scale_state";

/// Writes a record or a view of one, then `scale` when given: JSON with the library's archive
/// (`checkpoint/text_archives.hpp`), which completes its document in `finish()`, so a save that
/// throws midway leaves an unfinished one and never terminates; both binary formats with one
/// archive (`checkpoint/binary_archives.hpp`).
template <class R>
void write_record(std::ostream& out, const R& record, checkpoint_format format,
                  const dynamic_loss_scale_state* scale = nullptr) {
  const auto write = [&](auto& archive) {
    archive(cereal::make_nvp(record_name<R>(), record));
    if (scale != nullptr) archive(cereal::make_nvp(loss_scale_node, *scale));
  };
  if (is_text_format(format)) {
    json_output_archive archive(out);
    write(archive);
    archive.finish();
  } else {
    binary_output_archive archive(out, format == checkpoint_format::portable_binary);
    write(archive);
  }
}

// ---- Reading -------------------------------------------------------------------------------------

/// @brief Bytes in memory as a `sized_streambuf`.
class memory_streambuf final : public sized_streambuf {
 public:
  explicit memory_streambuf(std::string_view bytes) noexcept {
    char* begin = const_cast<char*>(bytes.data());  // the get area is only ever read
    setg(begin, begin, begin + bytes.size());
  }
  [[nodiscard]] std::uint64_t remaining() const noexcept override {
    return static_cast<std::uint64_t>(egptr() - gptr());
  }
  std::string_view peek(std::size_t count) noexcept override {
    return {gptr(), std::min(count, static_cast<std::size_t>(egptr() - gptr()))};
  }
};

/// @brief Appends to a string. Unlike `std::stringbuf`, whose failed allocation an
/// `std::ostream` swallows, what the string throws reaches the archive writing.
class string_sink final : public std::streambuf {
 public:
  explicit string_sink(std::string& out) noexcept : out_(out) {}

 protected:
  int_type overflow(int_type c) override {
    if (!traits_type::eq_int_type(c, traits_type::eof())) out_.push_back(traits_type::to_char_type(c));
    return traits_type::not_eof(c);
  }
  std::streamsize xsputn(const char* data, std::streamsize count) override {
    if (count > 0) out_.append(data, static_cast<std::size_t>(count));
    return count;
  }

 private:
  std::string& out_;
};

/// Reads `into` (a record, or a loader's sink target such as `weighted_into<S>`) from
/// `source` (text formats: from `text`, the whole document) with the hardened loaders, as the
/// outermost object of a document holding a record of type R, then the loss scale state that
/// follows it into `scale` as `part` allows; cereal's own failures (a short outermost version,
/// a root that is not an object) become `error(errc::invalid_record)` too. The document must hold
/// nothing else: binary input ends there, a text document has no other outermost node.
template <checkpoint_record R, class Into>
void read_into(sized_streambuf& source, std::string_view text, checkpoint_format format, Into& into,
               loss_scale_part part = loss_scale_part::refused,
               std::optional<dynamic_loss_scale_state>* scale = nullptr) {
  const bool with_scale = part != loss_scale_part::refused;
  const auto refuse_more = [&] {
    fail(errc::invalid_record,
         {"checkpoint holds more than its ", record_name<R>(), with_scale ? " and loss scale" : "",
          " (a window saved with its dynamic_loss_scale loads with "
          "load_checkpoint(path, params, accumulator, scaler))."});
  };
  // After the record: `more` tells whether the input holds anything else (binary input left
  // over without a scale is reported below, with its size).
  const auto read_scale = [&](auto& archive, bool more) {
    if (!more) {
      if (part == loss_scale_part::required) {
        fail(errc::invalid_record,
             {"checkpoint holds no dynamic loss scale after its ", record_name<R>(), "; load it without a scaler."});
      }
      return;
    }
    if (!with_scale) {
      if (is_text_format(format)) refuse_more();
      return;
    }
    dynamic_loss_scale_state state;
    archive(cereal::make_nvp(loss_scale_node, state));
    scale->emplace(state);
  };
  const auto fail_with = [&](const char* cause) {
    // Outside our loaders, cereal only reads a binary input's version and byte order tag.
    fail(errc::invalid_record, {"checkpoint is not a valid ", to_string(format), " ", record_name<R>(),
                                is_text_format(format) ? "" : ": the input is truncated", " (", cause, ")."});
  };
  try {
    if (is_text_format(format)) {
      json_input_archive archive(text);
      archive(into);
      read_scale(archive, archive.root_members() > 1);
      if (archive.root_members() > (scale != nullptr && scale->has_value() ? 2U : 1U)) refuse_more();
    } else {
      sized_input_archive<binary_input_archive> archive(source, format == checkpoint_format::portable_binary);
      archive(into);
      read_scale(archive, source.remaining() != 0);
    }
  } catch (const cereal::Exception& e) {
    fail_with(e.what());
  } catch (const std::logic_error& e) {
    fail_with(e.what());
  }
  if (!is_text_format(format) && source.remaining() != 0) {
    fail(errc::invalid_record,
         {"checkpoint has ", source.remaining(), " bytes after its ", with_scale ? "record and loss scale" : "record",
          "; it is not one ", to_string(format), " record",
          with_scale ? ""
                     : " (a window saved with its dynamic_loss_scale loads with "
                       "load_checkpoint(path, params, accumulator, scaler))",
          "."});
  }
}

/// "a binary archive", "a portable binary archive", "a JSON document".
constexpr std::string_view archive_description(checkpoint_format format) noexcept {
  switch (format) {
    case checkpoint_format::portable_binary: return "a portable binary archive";
    case checkpoint_format::json: return "a JSON document";
    case checkpoint_format::binary: break;
  }
  return "a binary archive";
}

/// The u32 at `at` of `head`, of the given byte order, if `head` holds it.
inline std::optional<std::uint32_t> u32_at(std::string_view head, std::size_t at, bool little) noexcept {
  if (head.size() < at + 4) return std::nullopt;
  std::uint32_t value = 0;
  for (std::size_t i = 0; i < 4; ++i) {
    const auto byte = static_cast<std::uint32_t>(static_cast<unsigned char>(head[at + (little ? i : 3 - i)]));
    value |= byte << (8 * i);
  }
  return value;
}

/// Bytes of a checkpoint's start that tell its archive: a portable binary archive's byte-order
/// byte, the class version and the record tag.
inline constexpr std::size_t archive_head_bytes = 1 + 4 + record_magic_bytes;

/// The archive that wrote a checkpoint starting with `head`: a JSON document by its first
/// character; a binary or portable binary archive by where a record tag lies (after the class
/// version; in a portable binary archive after its byte-order byte, 0 or 1, too), or, for
/// records of the formats before tags (2 to 4), where one of their versions does. Empty when
/// it starts like none of these or is too short to tell.
inline std::optional<checkpoint_format> archive_of(std::string_view head) noexcept {
  const std::size_t first = head.find_first_not_of(" \t\r\n");
  if (first != std::string_view::npos && head[first] == '{') return checkpoint_format::json;
  const bool byte_order = !head.empty() && (head[0] == 0 || head[0] == 1);
  const auto tag_at = [&](std::size_t at) {
    return head.size() >= at + record_magic_bytes && find_tag(head.substr(at, record_magic_bytes), true) != nullptr;
  };
  if (tag_at(4)) return checkpoint_format::binary;
  if (byte_order && tag_at(5)) return checkpoint_format::portable_binary;
  const auto before_tags = [](std::optional<std::uint32_t> version) {
    return version && *version >= 2 && *version < record_format_version;
  };
  if (before_tags(u32_at(head, 0, std::endian::native == std::endian::little))) return checkpoint_format::binary;
  if (byte_order && before_tags(u32_at(head, 1, head[0] == 1))) return checkpoint_format::portable_binary;
  return std::nullopt;
}

/// Refuses a checkpoint that starts like another archive than `format`'s, naming it, or a binary
/// one that starts like no checkpoint at all.
inline void check_archive(std::string_view head, checkpoint_format format) {
  const std::optional<checkpoint_format> found = archive_of(head);
  if (found && *found != format) {
    fail(errc::invalid_record, {"checkpoint is ", archive_description(*found), ", not ", archive_description(format),
                                "; load it as ", to_string(*found), "."});
  }
  if (!found && !is_text_format(format) && head.size() >= archive_head_bytes) {
    fail(errc::invalid_record, {"checkpoint does not start like ", archive_description(format),
                                " of a gradaccum record: its first bytes are ", quote(head), "."});
  }
}

/// How much of a document's start `check_archive` sees: enough to skip leading whitespace.
inline constexpr std::size_t text_head_bytes = 64;

/// Runs `read(source, bytes)` over `bytes`.
template <class F>
void read_bytes(std::string_view bytes, checkpoint_format format, F&& read) {
  check_archive(bytes.substr(0, text_head_bytes), format);
  memory_streambuf source(bytes);
  std::forward<F>(read)(source, bytes);
}

/// Prefixes a content error with the file it came from.
[[noreturn]] inline void fail_in_file(const error& e, const std::filesystem::path& path) {
  throw error(e.code(), "checkpoint " + quote(path.string()) + ": " + e.what(), e.param_id());
}

/// Writes `record` (or a view of one), and `scale` when given, to `path` atomically.
template <class R>
void save_file(const std::filesystem::path& path, const R& record, checkpoint_format format,
               const dynamic_loss_scale_state* scale = nullptr) {
  atomic_file file(path);
  file.write_and_commit([&](std::ostream& out) { write_record(out, record, format, scale); });
}

/// Runs `read(source, text)` over the file at `path`; text documents are read whole first.
/// Content errors name the path; a failed read is a filesystem_error.
template <class F>
void read_file(const std::filesystem::path& path, checkpoint_format format, F&& read) {
  file_source source(path);
  try {
    if (is_text_format(format)) {
      read_bytes(source.read_all(), format, std::forward<F>(read));
    } else {
      check_archive(source.peek(archive_head_bytes), format);
      std::forward<F>(read)(source, std::string_view());
    }
  } catch (const error& e) {
    source.throw_if_failed();  // an I/O error, not bad content
    fail_in_file(e, path);
  }
}

/// @brief What a checkpoint's first bytes tell: its outermost record's format version and, from
/// format 5 on, that record's type (else null).
struct checkpoint_start {
  std::uint32_t version = 0;
  const record_tag* record = nullptr;
};

/// The start of a document of `format` whose first bytes are `head`.
/// @throws error(errc::invalid_record) when `head` starts like another archive or like no record.
inline checkpoint_start start_of(std::string_view head, checkpoint_format format) {
  check_archive(head.substr(0, is_text_format(format) ? text_head_bytes : archive_head_bytes), format);
  checkpoint_start start;
  std::optional<std::uint32_t> version;
  if (format == checkpoint_format::binary) {
    version = u32_at(head, 0, std::endian::native == std::endian::little);
    if (head.size() >= 4 + record_magic_bytes) start.record = find_tag(head.substr(4, record_magic_bytes), true);
  } else if (format == checkpoint_format::portable_binary) {
    version = head.empty() ? std::nullopt : u32_at(head, 1, head[0] == 1);  // after the byte-order byte
    if (head.size() >= 5 + record_magic_bytes) start.record = find_tag(head.substr(5, record_magic_bytes), true);
  } else {  // JSON: the first number after the key; for the tag, the first string after it
    const auto after = [&](std::string_view key) {
      const std::size_t at = head.find(key);
      return at == std::string_view::npos ? std::string_view() : head.substr(at + key.size());
    };
    std::string_view rest = after("\"cereal_class_version\"");
    rest.remove_prefix(std::min(rest.find_first_of("0123456789"), rest.size()));
    version = parse_number<std::uint32_t>(rest.substr(0, rest.find_first_not_of("0123456789")));
    std::string_view name = after("\"record\"");
    name.remove_prefix(std::min(name.find('"') + 1, name.size()));
    start.record = find_tag(name.substr(0, name.find('"')), false);
  }
  if (!version) fail(errc::invalid_record, "checkpoint does not start with a record's format version.");
  start.version = *version;
  return start;
}

/// The start of the checkpoint at `path` (see `start_of`), read from its first 4 KiB.
inline checkpoint_start read_start(const std::filesystem::path& path, checkpoint_format format) {
  file_source source(path);
  std::string head(static_cast<std::size_t>(std::min<std::uint64_t>(source.remaining(), 4096)), '\0');
  head.resize(static_cast<std::size_t>(source.sgetn(head.data(), static_cast<std::streamsize>(head.size()))));
  source.throw_if_failed();
  try {
    return start_of(head, format);
  } catch (const error& e) {
    fail_in_file(e, path);
  }
}

template <class R>
std::string serialize_any(const R& record, checkpoint_format format) {
  std::string bytes;
  string_sink sink(bytes);
  std::ostream out(&sink);
  write_record(out, record, format);
  return bytes;
}

template <class R>
void parse_any(std::string_view bytes, checkpoint_format format, R& record) {
  read_bytes(bytes, format,
             [&](sized_streambuf& source, std::string_view text) { read_into<R>(source, text, format, record); });
}

/// Reads the file at `path`, holding a record of type R, into `into`: that record, or a sink target.
template <class R, class Into>
void load_any_file(const std::filesystem::path& path, checkpoint_format format, Into& into, loss_scale_part part,
                   std::optional<dynamic_loss_scale_state>* scale) {
  read_file(path, format, [&](sized_streambuf& source, std::string_view text) {
    read_into<R>(source, text, format, into, part, scale);
  });
}
GRADACCUM_CHECKPOINT_DEFINE std::string serialize_record(const weighted_gradients_record& record,
                                                         checkpoint_format format) {
  return serialize_any(record, format);
}
GRADACCUM_CHECKPOINT_DEFINE std::string serialize_record(const gradients_params_record& record,
                                                         checkpoint_format format) {
  return serialize_any(record, format);
}
GRADACCUM_CHECKPOINT_DEFINE std::string serialize_record(const weighted_accumulation_state& record,
                                                         checkpoint_format format) {
  return serialize_any(record, format);
}

GRADACCUM_CHECKPOINT_DEFINE void parse_record(std::string_view bytes, checkpoint_format format,
                                              weighted_gradients_record& record) {
  parse_any(bytes, format, record);
}
GRADACCUM_CHECKPOINT_DEFINE void parse_record(std::string_view bytes, checkpoint_format format,
                                              gradients_params_record& record) {
  parse_any(bytes, format, record);
}
GRADACCUM_CHECKPOINT_DEFINE void parse_record(std::string_view bytes, checkpoint_format format,
                                              weighted_accumulation_state& record) {
  parse_any(bytes, format, record);
}

GRADACCUM_CHECKPOINT_DEFINE void save_record_file(const std::filesystem::path& path,
                                                  const weighted_gradients_record& record, checkpoint_format format,
                                                  const dynamic_loss_scale_state* scale) {
  save_file(path, record, format, scale);
}
GRADACCUM_CHECKPOINT_DEFINE void save_record_file(const std::filesystem::path& path,
                                                  const gradients_params_record& record, checkpoint_format format,
                                                  const dynamic_loss_scale_state* scale) {
  save_file(path, record, format, scale);
}
GRADACCUM_CHECKPOINT_DEFINE void save_record_file(const std::filesystem::path& path,
                                                  const weighted_accumulation_state& record, checkpoint_format format,
                                                  const dynamic_loss_scale_state* scale) {
  save_file(path, record, format, scale);
}
GRADACCUM_CHECKPOINT_DEFINE void save_record_file(const std::filesystem::path& path,
                                                  const weighted_gradients_view& record, checkpoint_format format,
                                                  const dynamic_loss_scale_state* scale) {
  save_file(path, record, format, scale);
}
GRADACCUM_CHECKPOINT_DEFINE void save_record_file(const std::filesystem::path& path, const gradients_view& record,
                                                  checkpoint_format format, const dynamic_loss_scale_state* scale) {
  save_file(path, record, format, scale);
}

GRADACCUM_CHECKPOINT_DEFINE void load_record_file(const std::filesystem::path& path, checkpoint_format format,
                                                  weighted_gradients_record& record, loss_scale_part part,
                                                  std::optional<dynamic_loss_scale_state>* scale) {
  load_any_file<weighted_gradients_record>(path, format, record, part, scale);
}
GRADACCUM_CHECKPOINT_DEFINE void load_record_file(const std::filesystem::path& path, checkpoint_format format,
                                                  gradients_params_record& record, loss_scale_part part,
                                                  std::optional<dynamic_loss_scale_state>* scale) {
  load_any_file<gradients_params_record>(path, format, record, part, scale);
}
GRADACCUM_CHECKPOINT_DEFINE void load_record_file(const std::filesystem::path& path, checkpoint_format format,
                                                  weighted_accumulation_state& record, loss_scale_part part,
                                                  std::optional<dynamic_loss_scale_state>* scale) {
  load_any_file<weighted_accumulation_state>(path, format, record, part, scale);
}

GRADACCUM_CHECKPOINT_DEFINE void load_window_file(const std::filesystem::path& path, checkpoint_format format,
                                                  tensor_sink& sink, loss_scale_part part,
                                                  std::optional<dynamic_loss_scale_state>* scale) {
  weighted_into<tensor_sink> into{&sink};
  load_any_file<weighted_gradients_record>(path, format, into, part, scale);
}
GRADACCUM_CHECKPOINT_DEFINE void load_gradients_file(const std::filesystem::path& path, checkpoint_format format,
                                                     tensor_sink& sink, loss_scale_part part,
                                                     std::optional<dynamic_loss_scale_state>* scale) {
  gradients_into<tensor_sink> into{&sink};
  load_any_file<gradients_params_record>(path, format, into, part, scale);
}

}  // namespace detail

GRADACCUM_CHECKPOINT_INLINE std::uint32_t checkpoint_version(const std::filesystem::path& path,
                                                             std::optional<checkpoint_format> format) {
  return detail::read_start(path, detail::resolve_format(path, format)).version;
}

}  // namespace gradaccum
