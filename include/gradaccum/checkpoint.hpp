#pragma once
/// @file
/// @brief Checkpoint files: records and accumulators saved and loaded by path, atomically.
///
/// `<gradaccum/cereal.hpp>` makes records cereal-serializable; this header adds files (POSIX):
///
/// - `save_checkpoint(path, record_or_accumulator[, format])` writes a temporary file next to
///   `path`, flushes and fsyncs it, renames it over `path` and fsyncs the directory. A crash at
///   any moment leaves either the previous checkpoint or the new one at `path`, never a torn
///   file. A writer killed before its rename leaves `.gradaccum-<16 hex digits>.tmp` beside
///   it, which no loader reads (safely ignored; it may be deleted). Any name up to NAME_MAX
///   saves. A save that returns wrote exactly the record's bytes; one that throws, whatever
///   allocation failed, left the previous file.
/// - `save_checkpoint_async(path, accumulator[, format])` snapshots the accumulator (one copy of
///   the pending values on the calling thread) and writes on another thread. Saves to one path
///   land in the order they finish: wait for one before starting the next if order matters.
/// - `load_checkpoint<Record>(path[, format])` and `load_checkpoint(path, params, accumulator
///   [, format])` read untrusted bytes: every problem with the content throws `gradaccum::error`
///   (`errc::invalid_record` or `errc::invalid_state`) naming the problem and the path; nothing
///   larger than the file is ever allocated; checksums refuse any changed content; JSON and XML
///   documents nesting deeper than `max_document_depth` are rejected; an accumulator is changed
///   only when everything loaded and validated. Files that are not regular (FIFO, device,
///   socket) are refused without blocking. Only `record_format_version` loads: a file of
///   another version is refused naming it. A file read as another archive than the one that
///   wrote it (binary, portable binary, JSON, XML: told by its first bytes), or holding another
///   record type than the one asked for (told by the tag every record starts with), is refused
///   naming what it is.
/// - `save_checkpoint(path, accumulator, scaler[, format])` and `load_checkpoint(path, params,
///   accumulator, scaler[, format])` keep a window and the `dynamic_loss_scale` that drives it in
///   one file, written and restored together: a resumed run continues with the same pending
///   values, scale and counters, bit for bit. Loading such a file without the scaler (or a file
///   without one with it) is refused, so neither is lost silently. `load_checkpoint_contents<R>(path)`
///   reads such a file with or without the scaler's state, for tools that show a file.
/// - `checkpoint_version(path)` tells a file's record format version, also of a version this
///   build does not load.
/// - `serialize_checkpoint` / `parse_checkpoint` do the same in memory.
///
/// The format is explicit or follows the extension: `.bin` binary (native byte order, fastest),
/// `.pbin` portable binary (little-endian tagged, any machine), `.json`, `.xml` (case-insensitive).
/// Problems with the file itself (missing, unreadable, not regular, disk full, unknown
/// extension) throw `std::filesystem::filesystem_error` naming the path; running out of memory
/// throws `std::bad_alloc`. JSON and XML files are written by the library's archives and JSON
/// files read by its own parser (`detail/text_archives.hpp`); XML files are read by cereal's
/// archive behind the checks of `detail/text_guards.hpp`.

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <future>
#include <optional>
#include <ostream>
#include <streambuf>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>

#include <cereal/archives/binary.hpp>
#include <cereal/archives/json.hpp>
#include <cereal/archives/portable_binary.hpp>
#include <cereal/archives/xml.hpp>

#include "gradaccum/cereal.hpp"
#include "gradaccum/detail/posix_file.hpp"
#include "gradaccum/detail/text_archives.hpp"
#include "gradaccum/detail/text_guards.hpp"
#include "gradaccum/dynamic_loss_scale.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/parameter_set.hpp"
#include "gradaccum/records.hpp"

namespace gradaccum {

/// @brief The cereal archive a checkpoint is written with.
enum class checkpoint_format : std::uint8_t { binary, portable_binary, json, xml };

/// @brief "binary", "portable_binary", "json", "xml".
constexpr std::string_view to_string(checkpoint_format format) noexcept {
  switch (format) {
    case checkpoint_format::binary: return "binary";
    case checkpoint_format::portable_binary: return "portable_binary";
    case checkpoint_format::json: return "json";
    case checkpoint_format::xml: return "xml";
  }
  return "?";
}

/// @brief Inverse of `to_string`; empty for any other text.
constexpr std::optional<checkpoint_format> parse_checkpoint_format(std::string_view name) noexcept {
  for (auto format : {checkpoint_format::binary, checkpoint_format::portable_binary, checkpoint_format::json,
                      checkpoint_format::xml}) {
    if (to_string(format) == name) return format;
  }
  return std::nullopt;
}

/// @brief The format a path's extension names: `.bin`, `.pbin`, `.json`, `.xml` (any case).
/// @throws std::filesystem::filesystem_error (std::errc::invalid_argument) for any other extension.
inline checkpoint_format checkpoint_format_for(const std::filesystem::path& path) {
  std::string extension = path.extension().string();
  for (char& c : extension) c = (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
  if (extension == ".bin") return checkpoint_format::binary;
  if (extension == ".pbin") return checkpoint_format::portable_binary;
  if (extension == ".json") return checkpoint_format::json;
  if (extension == ".xml") return checkpoint_format::xml;
  throw std::filesystem::filesystem_error("gradaccum: cannot tell a checkpoint format from the extension '" +
                                              extension +
                                              "'; use .bin, .pbin, .json or .xml, or pass a checkpoint_format",
                                          path, std::make_error_code(std::errc::invalid_argument));
}

/// @brief The records a checkpoint holds.
template <class R>
concept checkpoint_record =
    std::is_same_v<R, weighted_gradients_record> || std::is_same_v<R, gradients_params_record> ||
    std::is_same_v<R, weighted_accumulation_state>;

/// @brief An accumulator a checkpoint can hold: it has `try_to_record()` (and a `restorer`).
template <class A>
concept checkpointable = requires(const A& accumulator) {
  { accumulator.try_to_record() } -> checkpoint_record;
};

// ---- Memory ------------------------------------------------------------------------------------

/// @brief The bytes of `record` in `format`, as `save_checkpoint` writes them.
/// @throws error when `record` is invalid (see `validate`): it would not load back.
template <checkpoint_record R>
[[nodiscard]] std::string serialize_checkpoint(const R& record, checkpoint_format format);

/// @brief Reads a record from untrusted bytes.
/// @throws error(errc::invalid_record) or error(errc::invalid_state) naming the problem.
template <checkpoint_record R>
[[nodiscard]] R parse_checkpoint(std::string_view bytes, checkpoint_format format);

/// @brief Writes `record` to `path` atomically, in `format` or the one its extension names.
/// @throws error when `record` is invalid (the file at `path` is untouched);
/// std::filesystem::filesystem_error when the file cannot be written.
template <checkpoint_record R>
void save_checkpoint(const std::filesystem::path& path, const R& record,
                     std::optional<checkpoint_format> format = std::nullopt);

/// @brief The format version of the outermost record of the checkpoint at `path`, read from its
/// first bytes without loading it (also of a version this build does not load).
/// @throws error(errc::invalid_record) for a file that does not start like a checkpoint of
/// `format` (one of another archive is named);
/// std::filesystem::filesystem_error when the file cannot be read.
inline std::uint32_t checkpoint_version(const std::filesystem::path& path,
                                        std::optional<checkpoint_format> format = std::nullopt);

/// @brief Reads a record of type `R` from `path`.
/// @throws error(errc::invalid_record) or error(errc::invalid_state) naming the problem and the
/// path; std::filesystem::filesystem_error when the file cannot be read.
template <checkpoint_record R>
[[nodiscard]] R load_checkpoint(const std::filesystem::path& path,
                                std::optional<checkpoint_format> format = std::nullopt);

/// @brief A record and, when the file holds one after it, the loss scale state saved with it.
template <checkpoint_record R>
struct checkpoint_contents {
  R record;
  std::optional<dynamic_loss_scale_state> loss_scale;
};

/// @brief Reads what a checkpoint file holds, as `load_checkpoint<R>` does, whether or not a
/// window was saved with its `dynamic_loss_scale` (`save_checkpoint(path, accumulator, scaler)`):
/// for tools that show a file. The loss scale state is checked on its own (a positive F32
/// scale, hysteresis_left ≥ 1), not against any scaler's options.
/// @throws what `load_checkpoint<R>` throws.
template <checkpoint_record R>
[[nodiscard]] checkpoint_contents<R> load_checkpoint_contents(const std::filesystem::path& path,
                                                              std::optional<checkpoint_format> format = std::nullopt);

/// @brief Saves an accumulator's record (`try_to_record()`): pending values, and for a weighted
/// accumulator the window's state. Values are written straight from the pending tensors where
/// the backend's layout allows (`visit_record`), so nothing is copied first.
template <checkpointable Accumulator>
void save_checkpoint(const std::filesystem::path& path, const Accumulator& accumulator,
                     std::optional<checkpoint_format> format = std::nullopt);

/// @brief Restores an accumulator from `path` (with the checks of `load_record` against
/// `params`), reading values straight into new backend tensors where the backend's layout
/// allows. The accumulator is unchanged unless everything loaded and validated.
/// @throws what `load_checkpoint<R>` and the accumulator's `load_record` throw.
template <checkpointable Accumulator, class B>
void load_checkpoint(const std::filesystem::path& path, const parameter_set<B>& params, Accumulator& accumulator,
                     std::optional<checkpoint_format> format = std::nullopt);

/// @brief Saves an accumulator's record followed by `scaler`'s state, in one file: the window and
/// the loss scale that drives it are committed together (a crash leaves both old or both new).
template <checkpointable Accumulator>
void save_checkpoint(const std::filesystem::path& path, const Accumulator& accumulator,
                     const dynamic_loss_scale& scaler, std::optional<checkpoint_format> format = std::nullopt);

/// @brief Restores an accumulator and `scaler` from a file `save_checkpoint(path, accumulator,
/// scaler)` wrote. The saved state must be one `scaler`'s options can reach (the checks of
/// `dynamic_loss_scale(options, state)`); neither changes unless both loaded and validated.
/// @throws what `load_checkpoint(path, params, accumulator)` throws; error(errc::invalid_record)
/// for a file without a loss scale state (and, from that overload, for a file with one).
template <checkpointable Accumulator, class B>
void load_checkpoint(const std::filesystem::path& path, const parameter_set<B>& params, Accumulator& accumulator,
                     dynamic_loss_scale& scaler, std::optional<checkpoint_format> format = std::nullopt);

/// @brief Writes `record` on another thread; `get()` on the result rethrows what
/// `save_checkpoint` threw.
template <checkpoint_record R>
[[nodiscard]] std::future<void> save_checkpoint_async(std::filesystem::path path, R record,
                                                      std::optional<checkpoint_format> format = std::nullopt);

/// @brief Snapshots `accumulator` as of this call (a copy of it: one copy of the pending
/// values on the calling thread) and writes the copy on another thread, straight from its
/// tensors; the accumulator may be used again as soon as this returns.
template <checkpointable Accumulator>
  requires std::copy_constructible<Accumulator>
[[nodiscard]] std::future<void> save_checkpoint_async(std::filesystem::path path, const Accumulator& accumulator,
                                                      std::optional<checkpoint_format> format = std::nullopt);

/// @brief `save_checkpoint(path, accumulator, scaler)` on another thread, from a snapshot of both
/// as of this call.
template <checkpointable Accumulator>
  requires std::copy_constructible<Accumulator>
[[nodiscard]] std::future<void> save_checkpoint_async(std::filesystem::path path, const Accumulator& accumulator,
                                                      const dynamic_loss_scale& scaler,
                                                      std::optional<checkpoint_format> format = std::nullopt);

// ---- Implementation ------------------------------------------------------------------------------

namespace detail {

// ---- Formats -----------------------------------------------------------------------------------

template <checkpoint_format F>
struct archives_of;
template <>
struct archives_of<checkpoint_format::binary> {
  using input = cereal::BinaryInputArchive;
  using output = cereal::BinaryOutputArchive;
};
template <>
struct archives_of<checkpoint_format::portable_binary> {
  using input = cereal::PortableBinaryInputArchive;
  using output = cereal::PortableBinaryOutputArchive;
};
template <>
struct archives_of<checkpoint_format::json> {
  using input = cereal::JSONInputArchive;
  using output = cereal::JSONOutputArchive;
};
template <>
struct archives_of<checkpoint_format::xml> {
  using input = cereal::XMLInputArchive;
  using output = cereal::XMLOutputArchive;
};

/// The archives checkpoint files are read and written with: cereal's binary ones, the library's
/// JSON archives and XML writer, cereal's XML reader (see `detail/text_archives.hpp`).
template <checkpoint_format F>
struct checkpoint_archives_of : archives_of<F> {};
template <>
struct checkpoint_archives_of<checkpoint_format::json> {
  using input = json_input_archive;
  using output = json_output_archive;
};
template <>
struct checkpoint_archives_of<checkpoint_format::xml> {
  using input = cereal::XMLInputArchive;
  using output = xml_output_archive;
};

/// Calls `f.template operator()<checkpoint_archives_of<format>>()`.
template <class F>
decltype(auto) visit_format(checkpoint_format format, F&& f) {
  switch (format) {
    case checkpoint_format::portable_binary:
      return std::forward<F>(f).template operator()<checkpoint_archives_of<checkpoint_format::portable_binary>>();
    case checkpoint_format::json:
      return std::forward<F>(f).template operator()<checkpoint_archives_of<checkpoint_format::json>>();
    case checkpoint_format::xml:
      return std::forward<F>(f).template operator()<checkpoint_archives_of<checkpoint_format::xml>>();
    case checkpoint_format::binary: break;
  }
  return std::forward<F>(f).template operator()<checkpoint_archives_of<checkpoint_format::binary>>();
}

constexpr bool is_text_format(checkpoint_format format) noexcept {
  return format == checkpoint_format::json || format == checkpoint_format::xml;
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

/// Writes a record or a view of one, then `scale` when given. The library's text archives
/// complete their document in `finish()`, so a save that throws midway leaves an unfinished one
/// and never terminates.
template <class R>
void write_record(std::ostream& out, const R& record, checkpoint_format format,
                  const dynamic_loss_scale_state* scale = nullptr) {
  visit_format(format, [&]<class Archives>() {
    typename Archives::output archive(out);
    archive(cereal::make_nvp(record_name<R>(), record));
    if (scale != nullptr) archive(cereal::make_nvp(loss_scale_node, *scale));
    if constexpr (requires { archive.finish(); }) archive.finish();
  });
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

/// Whether a checkpoint holds a loss scale state after its record: it must not, it must, or it
/// may.
enum class loss_scale_part : std::uint8_t { refused, required, optional };

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
    fail(errc::invalid_record, std::string("checkpoint holds more than its ") + record_name<R>() +
                                   (with_scale ? " and loss scale" : "") +
                                   " (a window saved with its dynamic_loss_scale loads with "
                                   "load_checkpoint(path, params, accumulator, scaler)).");
  };
  // After the record: `more` tells whether the input holds anything else (binary input left
  // over without a scale is reported below, with its size).
  const auto read_scale = [&](auto& archive, bool more) {
    if (!more) {
      if (part == loss_scale_part::required) {
        fail(errc::invalid_record, std::string("checkpoint holds no dynamic loss scale after its ") + record_name<R>() +
                                       "; load it without a scaler.");
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
    fail(errc::invalid_record, "checkpoint is not a valid " + std::string(to_string(format)) + " " + record_name<R>() +
                                   (is_text_format(format) ? "" : ": the input is truncated") + " (" + cause + ").");
  };
  try {
    visit_format(format, [&]<class Archives>() {
      using input = typename Archives::input;
      if constexpr (std::is_same_v<input, json_input_archive>) {
        input archive(text);
        archive(into);
        read_scale(archive, archive.root_members() > 1);
        if (archive.root_members() > (scale != nullptr && scale->has_value() ? 2U : 1U)) refuse_more();
      } else {
        sized_input_archive<input> archive(source);
        // cereal's XML archive dereferences a null node when asked for a record it does not hold.
        if constexpr (requires { archive.getNodeName(); }) {
          if (archive.getNodeName() == nullptr) fail(errc::invalid_record, "checkpoint holds no record.");
        }
        archive(into);
        if constexpr (requires { archive.getNodeName(); }) {
          read_scale(archive, archive.getNodeName() != nullptr);
          if (archive.getNodeName() != nullptr) refuse_more();
        } else {
          read_scale(archive, source.remaining() != 0);
        }
      }
    });
  } catch (const cereal::Exception& e) {
    fail_with(e.what());
  } catch (const std::logic_error& e) {
    fail_with(e.what());
  }
  if (!is_text_format(format) && source.remaining() != 0) {
    fail(errc::invalid_record, "checkpoint has " + std::to_string(source.remaining()) + " bytes after its " +
                                   (with_scale ? "record and loss scale" : "record") + "; it is not one " +
                                   std::string(to_string(format)) + " record" +
                                   (with_scale ? ""
                                               : " (a window saved with its dynamic_loss_scale loads with "
                                                 "load_checkpoint(path, params, accumulator, scaler))") +
                                   ".");
  }
}

/// "a binary archive", "a portable binary archive", "a JSON document", "an XML document".
constexpr std::string_view archive_description(checkpoint_format format) noexcept {
  switch (format) {
    case checkpoint_format::portable_binary: return "a portable binary archive";
    case checkpoint_format::json: return "a JSON document";
    case checkpoint_format::xml: return "an XML document";
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

/// The archive that wrote a checkpoint starting with `head`: a JSON or XML document by its first
/// character; a binary or portable binary archive by where a record tag lies (after the class
/// version; in a portable binary archive after its byte-order byte, 0 or 1, too), or, for
/// records of the formats before tags (2 to 4), where one of their versions does. Empty when
/// it starts like none of these or is too short to tell.
inline std::optional<checkpoint_format> archive_of(std::string_view head) noexcept {
  const std::size_t first = head.find_first_not_of(" \t\r\n");
  if (first != std::string_view::npos && head[first] == '{') return checkpoint_format::json;
  if (first != std::string_view::npos && head[first] == '<') return checkpoint_format::xml;
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
    fail(errc::invalid_record, "checkpoint is " + std::string(archive_description(*found)) + ", not " +
                                   std::string(archive_description(format)) + "; load it as " +
                                   std::string(to_string(*found)) + ".");
  }
  if (!found && !is_text_format(format) && head.size() >= archive_head_bytes) {
    fail(errc::invalid_record, "checkpoint does not start like " + std::string(archive_description(format)) +
                                   " of a gradaccum record: its first bytes are " + quote(head) + ".");
  }
}

/// How much of a document's start `check_archive` sees: enough to skip leading whitespace.
inline constexpr std::size_t text_head_bytes = 64;

/// Runs `read(source, bytes)` over `bytes`; XML documents are checked first
/// (`check_xml_document`).
template <class F>
void read_bytes(std::string_view bytes, checkpoint_format format, F&& read) {
  check_archive(bytes.substr(0, text_head_bytes), format);
  if (format == checkpoint_format::xml) check_xml_document(bytes);
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

/// Sink targets of the records accumulators save (see `<gradaccum/cereal.hpp>`).
template <checkpoint_record R, class Sink>
using into_for =
    std::conditional_t<std::is_same_v<R, weighted_gradients_record>, weighted_into<Sink>, gradients_into<Sink>>;

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
  } else {
    // The first number after the key; for the tag, the first string after it.
    const bool json = format == checkpoint_format::json;
    const auto after = [&](std::string_view key) {
      const std::size_t at = head.find(key);
      return at == std::string_view::npos ? std::string_view() : head.substr(at + key.size());
    };
    std::string_view rest = after(json ? "\"cereal_class_version\"" : "<cereal_class_version>");
    rest.remove_prefix(std::min(rest.find_first_of("0123456789"), rest.size()));
    version = parse_number<std::uint32_t>(rest.substr(0, rest.find_first_not_of("0123456789")));
    std::string_view name = after(json ? "\"record\"" : "<record>");
    if (json) name.remove_prefix(std::min(name.find('"') + 1, name.size()));
    start.record = find_tag(name.substr(0, name.find(json ? '"' : '<')), false);
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

}  // namespace detail

template <checkpoint_record R>
std::string serialize_checkpoint(const R& record, checkpoint_format format) {
  std::string bytes;
  detail::string_sink sink(bytes);
  std::ostream out(&sink);
  detail::write_record(out, record, format);
  return bytes;
}

template <checkpoint_record R>
R parse_checkpoint(std::string_view bytes, checkpoint_format format) {
  R record;
  detail::read_bytes(bytes, format, [&](detail::sized_streambuf& source, std::string_view text) {
    detail::read_into<R>(source, text, format, record);
  });
  return record;
}

template <checkpoint_record R>
void save_checkpoint(const std::filesystem::path& path, const R& record, std::optional<checkpoint_format> format) {
  detail::save_file(path, record, format ? *format : checkpoint_format_for(path));
}

inline std::uint32_t checkpoint_version(const std::filesystem::path& path, std::optional<checkpoint_format> format) {
  return detail::read_start(path, format ? *format : checkpoint_format_for(path)).version;
}

template <checkpoint_record R>
R load_checkpoint(const std::filesystem::path& path, std::optional<checkpoint_format> format) {
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  R record;
  detail::read_file(path, resolved, [&](detail::sized_streambuf& source, std::string_view text) {
    detail::read_into<R>(source, text, resolved, record);
  });
  return record;
}

template <checkpoint_record R>
checkpoint_contents<R> load_checkpoint_contents(const std::filesystem::path& path,
                                                std::optional<checkpoint_format> format) {
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  checkpoint_contents<R> contents;
  detail::read_file(path, resolved, [&](detail::sized_streambuf& source, std::string_view text) {
    detail::read_into<R>(source, text, resolved, contents.record, detail::loss_scale_part::optional,
                         &contents.loss_scale);
  });
  return contents;
}

namespace detail {

/// `save_checkpoint` of an accumulator, followed by `scaler`'s state when given.
template <class Accumulator>
void save_accumulator(const std::filesystem::path& path, const Accumulator& accumulator,
                      const dynamic_loss_scale* scaler, std::optional<checkpoint_format> format) {
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  const dynamic_loss_scale_state* scale = scaler != nullptr ? &scaler->state() : nullptr;
  accumulator.visit_record([&](const auto& view) { save_file(path, view, resolved, scale); });
}

/// `load_checkpoint` into an accumulator, and into `scaler` when given (the file must then hold
/// its state, else must not); both change only once everything loaded and validated.
template <class Accumulator, class B>
void load_accumulator(const std::filesystem::path& path, const parameter_set<B>& params, Accumulator& accumulator,
                      dynamic_loss_scale* scaler, std::optional<checkpoint_format> format) {
  using record_type = decltype(accumulator.try_to_record());
  using restorer = typename Accumulator::restorer;
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  restorer sink(accumulator, params);
  into_for<record_type, restorer> into{&sink};
  std::optional<dynamic_loss_scale> restored;
  read_file(path, resolved, [&](sized_streambuf& source, std::string_view text) {
    std::optional<dynamic_loss_scale_state> state;
    read_into<record_type>(source, text, resolved, into,
                           scaler != nullptr ? loss_scale_part::required : loss_scale_part::refused, &state);
    if (scaler != nullptr) restored.emplace(scaler->options(), *state);  // an unreachable state throws here
  });
  std::move(sink).commit();  // neither of these two can throw
  if (scaler != nullptr) *scaler = *restored;
}

}  // namespace detail

template <checkpointable Accumulator>
void save_checkpoint(const std::filesystem::path& path, const Accumulator& accumulator,
                     std::optional<checkpoint_format> format) {
  detail::save_accumulator(path, accumulator, nullptr, format);
}

template <checkpointable Accumulator, class B>
void load_checkpoint(const std::filesystem::path& path, const parameter_set<B>& params, Accumulator& accumulator,
                     std::optional<checkpoint_format> format) {
  detail::load_accumulator(path, params, accumulator, nullptr, format);
}

template <checkpointable Accumulator>
void save_checkpoint(const std::filesystem::path& path, const Accumulator& accumulator,
                     const dynamic_loss_scale& scaler, std::optional<checkpoint_format> format) {
  detail::save_accumulator(path, accumulator, &scaler, format);
}

template <checkpointable Accumulator, class B>
void load_checkpoint(const std::filesystem::path& path, const parameter_set<B>& params, Accumulator& accumulator,
                     dynamic_loss_scale& scaler, std::optional<checkpoint_format> format) {
  detail::load_accumulator(path, params, accumulator, &scaler, format);
}

template <checkpoint_record R>
std::future<void> save_checkpoint_async(std::filesystem::path path, R record, std::optional<checkpoint_format> format) {
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  return std::async(std::launch::async, [path = std::move(path), record = std::move(record), resolved] {
    save_checkpoint(path, record, resolved);
  });
}

template <checkpointable Accumulator>
  requires std::copy_constructible<Accumulator>
std::future<void> save_checkpoint_async(std::filesystem::path path, const Accumulator& accumulator,
                                        std::optional<checkpoint_format> format) {
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  return std::async(std::launch::async, [path = std::move(path), snapshot = accumulator, resolved] {
    save_checkpoint(path, snapshot, resolved);
  });
}

template <checkpointable Accumulator>
  requires std::copy_constructible<Accumulator>
std::future<void> save_checkpoint_async(std::filesystem::path path, const Accumulator& accumulator,
                                        const dynamic_loss_scale& scaler, std::optional<checkpoint_format> format) {
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  return std::async(std::launch::async, [path = std::move(path), snapshot = accumulator, scaler, resolved] {
    save_checkpoint(path, snapshot, scaler, resolved);
  });
}

}  // namespace gradaccum
