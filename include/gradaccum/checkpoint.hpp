#pragma once
/// @file
/// @brief Checkpoint files: records and accumulators saved and loaded by path, atomically.
///
/// `<gradaccum/cereal.hpp>` makes records cereal-serializable; this header adds files (POSIX):
///
/// - `save_checkpoint(path, record_or_accumulator[, format])` writes a temporary file next to
///   `path`, flushes and fsyncs it, renames it over `path` and fsyncs the directory. A crash at
///   any moment leaves either the previous checkpoint or the new one at `path`, never a torn
///   file (a stale `.<name>.tmp.*` file may remain beside it and can be deleted).
/// - `save_checkpoint_async(path, accumulator[, format])` snapshots the accumulator (one copy of
///   the pending values on the calling thread) and writes on another thread. Saves to one path
///   land in the order they finish: wait for one before starting the next if order matters.
/// - `load_checkpoint<Record>(path[, format])` and `load_checkpoint(path, params, accumulator
///   [, format])` read untrusted bytes: every problem with the content throws `gradaccum::error`
///   (`errc::invalid_record` or `errc::invalid_state`) naming the problem and the path; nothing
///   larger than the file is ever allocated; JSON and XML documents nesting deeper than
///   `max_document_depth` are rejected before cereal's recursive parsers see them; an
///   accumulator is changed only when everything loaded and validated.
/// - `serialize_checkpoint` / `parse_checkpoint` do the same in memory.
///
/// The format is explicit or follows the extension: `.bin` binary (native byte order, fastest),
/// `.pbin` portable binary (little-endian tagged, any machine), `.json`, `.xml` (case-insensitive).
/// Problems with the file itself (missing, unreadable, disk full, unknown extension) throw
/// `std::filesystem::filesystem_error` naming the path.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <future>
#include <optional>
#include <ostream>
#include <sstream>
#include <streambuf>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cereal/archives/binary.hpp>
#include <cereal/archives/json.hpp>
#include <cereal/archives/portable_binary.hpp>
#include <cereal/archives/xml.hpp>
#ifdef CEREAL_RAPIDJSON_NAMESPACE
#include <cereal/external/rapidjson/error/en.h>
#else
#include <rapidjson/error/en.h>  // Debian's cereal uses the system rapidjson
#endif

#include "gradaccum/cereal.hpp"
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

/// @brief Deepest nesting of objects, arrays or elements a JSON or XML checkpoint may have
/// (records need 7); cereal's parsers recurse once per level.
inline constexpr std::size_t max_document_depth = 32;

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

/// Calls `f.template operator()<archives_of<format>>()`.
template <class F>
decltype(auto) visit_format(checkpoint_format format, F&& f) {
  switch (format) {
    case checkpoint_format::portable_binary:
      return std::forward<F>(f).template operator()<archives_of<checkpoint_format::portable_binary>>();
    case checkpoint_format::json: return std::forward<F>(f).template operator()<archives_of<checkpoint_format::json>>();
    case checkpoint_format::xml: return std::forward<F>(f).template operator()<archives_of<checkpoint_format::xml>>();
    case checkpoint_format::binary: break;
  }
  return std::forward<F>(f).template operator()<archives_of<checkpoint_format::binary>>();
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

/// Writes a record or a view of one.
template <class R>
void write_record(std::ostream& out, const R& record, checkpoint_format format) {
  visit_format(format, [&]<class Archives>() {
    typename Archives::output archive(out);
    archive(cereal::make_nvp(record_name<R>(), record));
  });  // JSON and XML archives write their last bytes when destroyed, here
}

// ---- Text documents ------------------------------------------------------------------------------

#ifdef CEREAL_RAPIDJSON_NAMESPACE
namespace json_parser = CEREAL_RAPIDJSON_NAMESPACE;
#else
namespace json_parser = RAPIDJSON_NAMESPACE;
#endif

/// While a non-recursive parser checks the syntax (numbers as text), counts nesting and looks
/// for numbers RapidJSON 1.1 cannot read: its full-precision conversion, which cereal's parse
/// uses, calls clz(0) and reads garbage for a zero mantissa with an exponent ("0e-300") and for
/// mantissas of more than 20 digits that round up past 2^64 - 1, and indexes its table of powers
/// of ten out of bounds when the last digit's decimal exponent is below -348
/// ("1844044.1841844674401e-337"). Nothing cereal writes has any of these (doubles take 17
/// digits and their last digit's exponent is at least -324 - 16, 64-bit integers 20 digits).
struct json_document_check : json_parser::BaseReaderHandler<json_parser::UTF8<>, json_document_check> {
  std::size_t depth = 0;
  bool too_deep = false;
  std::string misread_number;

  bool enter() noexcept {
    too_deep = ++depth > max_document_depth;
    return !too_deep;
  }
  bool StartObject() noexcept { return enter(); }
  bool StartArray() noexcept { return enter(); }
  bool EndObject(json_parser::SizeType /*members*/) noexcept { return --depth, true; }
  bool EndArray(json_parser::SizeType /*elements*/) noexcept { return --depth, true; }
  bool RawNumber(const char* text, json_parser::SizeType length, bool /*copy*/) {
    const std::string_view number(text, length);
    const std::size_t exponent = number.find_first_of("eE");
    const std::string_view mantissa = number.substr(0, exponent);
    const auto digits = std::count_if(mantissa.begin(), mantissa.end(), [](char c) { return c >= '0' && c <= '9'; });
    const bool zero_with_exponent =
        exponent != std::string_view::npos && mantissa.find_first_not_of("-0.") == std::string_view::npos;
    if (digits <= 20 && !zero_with_exponent && last_digit_exponent_in_range(number, exponent)) return true;
    misread_number = number;
    return false;
  }

  /// Whether the decimal exponent of the number's last digit lies in [-340, 308].
  static bool last_digit_exponent_in_range(std::string_view number, std::size_t exponent) noexcept {
    long long value = 0;  // the written exponent; an unreadable one is out of range
    if (exponent != std::string_view::npos) {
      std::string_view text = number.substr(exponent + 1);
      if (!text.empty() && text.front() == '+') text.remove_prefix(1);
      const auto [end, status] = std::from_chars(text.data(), text.data() + text.size(), value);
      if (status != std::errc{} || end != text.data() + text.size()) return false;
    }
    const std::size_t point = number.find('.');
    const std::size_t fraction_end = exponent == std::string_view::npos ? number.size() : exponent;
    const auto fraction_digits =
        static_cast<long long>(point == std::string_view::npos || point > fraction_end ? 0 : fraction_end - point - 1);
    // Both terms are bounded first, so the difference cannot overflow.
    if (value < -400 || value > 400) return false;
    const long long last_digit = value - fraction_digits;
    return last_digit >= -340 && last_digit <= 308;
  }
};

/// Deepest element nesting of an XML document, counted the way rapidxml reads tags; stops
/// counting once past `max_document_depth`.
inline std::size_t xml_depth(std::string_view text) noexcept {
  std::size_t depth = 0;
  std::size_t deepest = 0;
  const auto skip_past = [&](std::size_t from, std::string_view end) {
    const std::size_t found = text.find(end, from);
    return found == std::string_view::npos ? text.size() : found + end.size();
  };
  std::size_t i = 0;
  while (i < text.size() && deepest <= max_document_depth) {
    if (text[i] != '<') {
      ++i;
      continue;
    }
    const std::string_view rest = text.substr(i);
    if (rest.starts_with("</")) {
      depth -= depth > 0 ? 1 : 0;
      i = skip_past(i, ">");
    } else if (rest.starts_with("<?")) {
      i = skip_past(i, "?>");
    } else if (rest.starts_with("<!--")) {
      i = skip_past(i, "-->");
    } else if (rest.starts_with("<![CDATA[")) {
      i = skip_past(i, "]]>");
    } else if (rest.starts_with("<!")) {
      i = skip_past(i, ">");
    } else {  // an element: find its '>' outside quoted attribute values
      char quote = 0;
      std::size_t j = i + 1;
      for (; j < text.size(); ++j) {
        if (quote != 0) {
          quote = text[j] == quote ? '\0' : quote;
        } else if (text[j] == '"' || text[j] == '\'') {
          quote = text[j];
        } else if (text[j] == '>') {
          break;
        }
      }
      if (j >= text.size() || text[j - 1] != '/') deepest = std::max(deepest, ++depth);
      i = j + 1;
    }
  }
  return deepest;
}

/// Checks what cereal's JSON and XML parsers would otherwise trust: syntax (JSON, with the
/// parser's error and offset) and nesting depth.
inline void check_text_document(std::string_view bytes, checkpoint_format format) {
  if (format == checkpoint_format::xml) {
    if (xml_depth(bytes) > max_document_depth) {
      fail(errc::invalid_record,
           "checkpoint XML nests elements deeper than " + std::to_string(max_document_depth) + " levels.");
    }
    return;
  }
  // Reads `bytes` the way cereal's stream wrapper does: a NUL byte or the end is the end.
  struct bytes_stream {
    using Ch = char;
    std::string_view text;
    std::size_t position = 0;
    Ch Peek() const noexcept { return position < text.size() ? text[position] : '\0'; }
    Ch Take() noexcept { return position < text.size() ? text[position++] : '\0'; }
    std::size_t Tell() const noexcept { return position; }
    // Writing is for in-situ parsing, which this is not.
    Ch* PutBegin() noexcept { return nullptr; }
    void Put(Ch /*c*/) noexcept {}
    std::size_t PutEnd(Ch* /*begin*/) noexcept { return 0; }
  } stream{bytes};
  json_document_check handler;
  json_parser::Reader reader;
  constexpr unsigned flags =
      json_parser::kParseIterativeFlag | json_parser::kParseNumbersAsStringsFlag | json_parser::kParseNanAndInfFlag;
  const json_parser::ParseResult result = reader.Parse<flags>(stream, handler);
  if (handler.too_deep) {
    fail(errc::invalid_record, "checkpoint JSON nests deeper than " + std::to_string(max_document_depth) + " levels.");
  }
  if (!handler.misread_number.empty()) {
    fail(errc::invalid_record, "checkpoint JSON holds the number " + quote(handler.misread_number) +
                                   ", which its JSON parser (RapidJSON 1.1) misreads: checkpoint numbers have at "
                                   "most 20 digits and an exponent within a double's range, and zero is written 0.0.");
  }
  if (result.IsError()) {
    fail(errc::invalid_record,
         "checkpoint is not valid JSON: " + std::string(json_parser::GetParseError_En(result.Code())) + " (at byte " +
             std::to_string(result.Offset()) + ").");
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
};

/// Reads `into` (a record, or a loader's sink target such as `weighted_into<S>`) from
/// `source` with the hardened loaders, as the outermost object of a document holding a record
/// of type R; cereal's own failures (a short outermost version, a root that is not an object)
/// become `error(errc::invalid_record)` too. Binary input must end with the record.
template <checkpoint_record R, class Into>
void read_into(sized_streambuf& source, checkpoint_format format, Into& into) {
  const auto fail_with = [&](const char* cause) {
    // Outside our loaders, cereal only reads a binary input's version and byte order tag.
    fail(errc::invalid_record, "checkpoint is not a valid " + std::string(to_string(format)) + " " + record_name<R>() +
                                   (is_text_format(format) ? "" : ": the input is truncated") + " (" + cause + ").");
  };
  try {
    visit_format(format, [&]<class Archives>() {
      sized_input_archive<typename Archives::input> archive(source);
      // cereal's XML archive dereferences a null node when asked for a record it does not hold.
      if constexpr (requires { archive.getNodeName(); }) {
        if (archive.getNodeName() == nullptr) fail(errc::invalid_record, "checkpoint holds no record.");
      }
      archive(into);
    });
  } catch (const cereal::Exception& e) {
    fail_with(e.what());
  } catch (const std::logic_error& e) {
    fail_with(e.what());
  }
  if (!is_text_format(format) && source.remaining() != 0) {
    fail(errc::invalid_record, "checkpoint has " + std::to_string(source.remaining()) +
                                   " bytes after its record; it is not one " + std::string(to_string(format)) +
                                   " record.");
  }
}

/// Runs `read(source)` over `bytes`; text documents are checked first (`check_text_document`).
template <class F>
void read_bytes(std::string_view bytes, checkpoint_format format, F&& read) {
  if (is_text_format(format)) check_text_document(bytes, format);
  memory_streambuf source(bytes);
  std::forward<F>(read)(source);
}

// ---- Files ---------------------------------------------------------------------------------------

[[noreturn]] inline void fail_io(const std::string& what, const std::filesystem::path& path, int code) {
  throw std::filesystem::filesystem_error("gradaccum: cannot " + what, path,
                                          std::error_code(code, std::generic_category()));
}

/// @brief An open file descriptor, closed when destroyed.
class file_descriptor {
 public:
  file_descriptor() noexcept = default;
  explicit file_descriptor(int fd) noexcept : fd_(fd) {}
  file_descriptor(file_descriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  file_descriptor& operator=(file_descriptor&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  file_descriptor(const file_descriptor&) = delete;
  file_descriptor& operator=(const file_descriptor&) = delete;
  ~file_descriptor() {
    if (fd_ >= 0) ::close(fd_);
  }

  [[nodiscard]] int get() const noexcept { return fd_; }
  /// Closes now; returns the errno of a failed close, 0 on success.
  int close() noexcept {
    const int fd = std::exchange(fd_, -1);
    return fd >= 0 && ::close(fd) != 0 ? errno : 0;
  }

 private:
  int fd_ = -1;
};

/// @brief Writes through a 1 MiB buffer to a file; writes at least as large as the buffer
/// (bulk values) go straight to the file. Remembers the errno of the first failed write.
class file_sink final : public std::streambuf {
 public:
  explicit file_sink(int fd) : fd_(fd), buffer_(buffer_size) { setp(buffer_.data(), buffer_.data() + buffer_.size()); }

  /// Writes out what is buffered; false (see `error`) if that failed now or before.
  bool drain() noexcept {
    const bool written = write_all(pbase(), static_cast<std::size_t>(pptr() - pbase()));
    setp(buffer_.data(), buffer_.data() + buffer_.size());
    return written;
  }
  [[nodiscard]] int error() const noexcept { return error_; }

 protected:
  int_type overflow(int_type c) override {
    if (!drain()) return traits_type::eof();
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }

  std::streamsize xsputn(const char* data, std::streamsize count) override {
    const auto size = static_cast<std::size_t>(count);
    if (size <= static_cast<std::size_t>(epptr() - pptr())) {
      std::memcpy(pptr(), data, size);
      pbump(static_cast<int>(size));
      return count;
    }
    if (!drain()) return 0;
    if (size >= buffer_size) return write_all(data, size) ? count : 0;
    std::memcpy(pptr(), data, size);
    pbump(static_cast<int>(size));
    return count;
  }

  int sync() override { return drain() ? 0 : -1; }

 private:
  static constexpr std::size_t buffer_size = std::size_t{1} << 20;

  bool write_all(const char* data, std::size_t size) noexcept {
    while (size > 0 && error_ == 0) {
      const ::ssize_t written = ::write(fd_, data, std::min<std::size_t>(size, std::size_t{1} << 30));
      if (written < 0) {
        if (errno != EINTR) error_ = errno;
        continue;
      }
      data += written;
      size -= static_cast<std::size_t>(written);
    }
    return error_ == 0;
  }

  int fd_;
  std::vector<char> buffer_;
  int error_ = 0;
};

/// @brief Reads a regular file through a 64 KiB buffer; reads at least as large as the buffer
/// (bulk values) go straight into the destination. Knows how many bytes remain.
class file_source final : public sized_streambuf {
 public:
  /// @throws std::filesystem::filesystem_error when the file cannot be opened or is not regular.
  explicit file_source(const std::filesystem::path& path) : path_(path), buffer_(buffer_size) {
    file_ = file_descriptor(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (file_.get() < 0) fail_io("open checkpoint", path, errno);
    struct ::stat status {};
    if (::fstat(file_.get(), &status) != 0) fail_io("inspect checkpoint", path, errno);
    if (!S_ISREG(status.st_mode)) fail_io("read checkpoint (not a regular file)", path, EINVAL);
    unread_ = static_cast<std::uint64_t>(status.st_size);
    setg(buffer_.data(), buffer_.data(), buffer_.data());
  }

  [[nodiscard]] std::uint64_t remaining() const noexcept override {
    return unread_ + static_cast<std::uint64_t>(egptr() - gptr());
  }

  /// The whole rest of the file.
  std::string read_all() {
    std::string bytes(static_cast<std::size_t>(remaining()), '\0');
    bytes.resize(static_cast<std::size_t>(sgetn(bytes.data(), static_cast<std::streamsize>(bytes.size()))));
    throw_if_failed();
    return bytes;
  }

  /// @throws std::filesystem::filesystem_error if a read failed (as opposed to a short file).
  void throw_if_failed() const {
    if (error_ != 0) fail_io("read checkpoint", path_, error_);
  }

 protected:
  int_type underflow() override {
    if (gptr() == egptr()) {
      const std::size_t got = read_some(buffer_.data(), buffer_.size());
      setg(buffer_.data(), buffer_.data(), buffer_.data() + got);
    }
    return gptr() == egptr() ? traits_type::eof() : traits_type::to_int_type(*gptr());
  }

  std::streamsize xsgetn(char* data, std::streamsize count) override {
    const auto wanted = static_cast<std::size_t>(count);
    std::size_t done = std::min(wanted, static_cast<std::size_t>(egptr() - gptr()));
    std::memcpy(data, gptr(), done);
    gbump(static_cast<int>(done));
    if (wanted - done >= buffer_size) return static_cast<std::streamsize>(done + read_some(data + done, wanted - done));
    while (done < wanted && !traits_type::eq_int_type(underflow(), traits_type::eof())) {
      const std::size_t step = std::min(wanted - done, static_cast<std::size_t>(egptr() - gptr()));
      std::memcpy(data + done, gptr(), step);
      gbump(static_cast<int>(step));
      done += step;
    }
    return static_cast<std::streamsize>(done);
  }

 private:
  static constexpr std::size_t buffer_size = std::size_t{1} << 16;

  std::size_t read_some(char* data, std::size_t size) noexcept {
    std::size_t done = 0;
    while (done < size && error_ == 0) {
      const ::ssize_t got = ::read(file_.get(), data + done, std::min<std::size_t>(size - done, std::size_t{1} << 30));
      if (got == 0) break;
      if (got < 0) {
        if (errno != EINTR) error_ = errno;
        continue;
      }
      done += static_cast<std::size_t>(got);
    }
    unread_ -= std::min<std::uint64_t>(unread_, done);
    return done;
  }

  std::filesystem::path path_;
  file_descriptor file_;
  std::vector<char> buffer_;
  std::uint64_t unread_ = 0;
  int error_ = 0;
};

/// @brief A temporary file next to `target` that replaces it atomically on `commit`, and is
/// removed if never committed.
class atomic_file {
 public:
  /// @throws std::filesystem::filesystem_error when the temporary cannot be created.
  explicit atomic_file(std::filesystem::path target) : target_(std::move(target)) {
    static std::atomic<std::uint64_t> counter{0};
    const std::filesystem::path directory = target_.parent_path();
    for (;;) {  // a name left by a crashed process with a recycled pid is skipped
      // Appended piece by piece: GCC 12 at -O3 reports a false -Wrestrict in `"." + string&&`.
      std::string name = ".";
      name += target_.filename().string();
      name += ".tmp.";
      name += std::to_string(::getpid());
      name += '.';
      name += std::to_string(counter.fetch_add(1));
      temporary_ = directory / name;
      file_ = file_descriptor(::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
      if (file_.get() >= 0) break;
      if (errno != EEXIST) fail_io("create a temporary checkpoint", temporary_, errno);
    }
  }
  atomic_file(const atomic_file&) = delete;
  atomic_file& operator=(const atomic_file&) = delete;
  ~atomic_file() {
    if (!committed_) {
      file_.close();
      ::unlink(temporary_.c_str());
    }
  }

  /// Runs `write(std::ostream&)` on the temporary, then flushes it, fsyncs it, renames it over
  /// the target and fsyncs the directory, so the rename survives a power loss.
  /// @throws std::filesystem::filesystem_error for a failed write, sync or rename (the target
  /// is untouched unless the rename happened), and whatever `write` throws.
  template <class F>
  void write_and_commit(F&& write) {
    file_sink sink(file_.get());
    try {
      std::ostream stream(&sink);
      std::forward<F>(write)(stream);
    } catch (...) {
      if (sink.error() != 0) fail_io("write checkpoint", temporary_, sink.error());
      throw;
    }
    if (!sink.drain()) fail_io("write checkpoint", temporary_, sink.error());
    if (::fsync(file_.get()) != 0) fail_io("sync checkpoint", temporary_, errno);
    if (const int closed = file_.close(); closed != 0) fail_io("close checkpoint", temporary_, closed);
    if (::rename(temporary_.c_str(), target_.c_str()) != 0) fail_io("rename checkpoint into place", target_, errno);
    committed_ = true;
    const std::filesystem::path directory = target_.parent_path().empty() ? "." : target_.parent_path();
    file_descriptor dir(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (dir.get() < 0 || (::fsync(dir.get()) != 0 && errno != EINVAL)) fail_io("sync directory", directory, errno);
  }

 private:
  std::filesystem::path target_;
  std::filesystem::path temporary_;
  file_descriptor file_;
  bool committed_ = false;
};

/// Prefixes a content error with the file it came from.
[[noreturn]] inline void fail_in_file(const error& e, const std::filesystem::path& path) {
  throw error(e.code(), "checkpoint " + quote(path.string()) + ": " + e.what(), e.param_id());
}

/// Writes `record` (or a view of one) to `path` atomically.
template <class R>
void save_file(const std::filesystem::path& path, const R& record, checkpoint_format format) {
  atomic_file file(path);
  file.write_and_commit([&](std::ostream& out) { write_record(out, record, format); });
}

/// Runs `read(source)` over the file at `path`; text documents are read whole and checked first.
/// Content errors name the path; a failed read is a filesystem_error.
template <class F>
void read_file(const std::filesystem::path& path, checkpoint_format format, F&& read) {
  file_source source(path);
  try {
    if (is_text_format(format)) {
      read_bytes(source.read_all(), format, std::forward<F>(read));
    } else {
      std::forward<F>(read)(source);
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

}  // namespace detail

// ---- Memory ------------------------------------------------------------------------------------

/// @brief The bytes of `record` in `format`, as `save_checkpoint` writes them.
/// @throws error when `record` is invalid (see `validate`): it would not load back.
template <checkpoint_record R>
[[nodiscard]] std::string serialize_checkpoint(const R& record, checkpoint_format format) {
  std::ostringstream out;
  detail::write_record(out, record, format);
  return std::move(out).str();
}

/// @brief Reads a record from untrusted bytes.
/// @throws error(errc::invalid_record) or error(errc::invalid_state) naming the problem.
template <checkpoint_record R>
[[nodiscard]] R parse_checkpoint(std::string_view bytes, checkpoint_format format) {
  R record;
  detail::read_bytes(bytes, format,
                     [&](detail::sized_streambuf& source) { detail::read_into<R>(source, format, record); });
  return record;
}

// ---- Files -------------------------------------------------------------------------------------

/// @brief Writes `record` to `path` atomically, in `format` or the one its extension names.
/// @throws error when `record` is invalid (the file at `path` is untouched);
/// std::filesystem::filesystem_error when the file cannot be written.
template <checkpoint_record R>
void save_checkpoint(const std::filesystem::path& path, const R& record,
                     std::optional<checkpoint_format> format = std::nullopt) {
  detail::save_file(path, record, format ? *format : checkpoint_format_for(path));
}

/// @brief Reads a record of type `R` from `path`.
/// @throws error(errc::invalid_record) or error(errc::invalid_state) naming the problem and the
/// path; std::filesystem::filesystem_error when the file cannot be read.
template <checkpoint_record R>
[[nodiscard]] R load_checkpoint(const std::filesystem::path& path,
                                std::optional<checkpoint_format> format = std::nullopt) {
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  R record;
  detail::read_file(path, resolved,
                    [&](detail::sized_streambuf& source) { detail::read_into<R>(source, resolved, record); });
  return record;
}

/// @brief Saves an accumulator's record (`try_to_record()`): pending values, and for a weighted
/// accumulator the window's state. Values are written straight from the pending tensors where
/// the backend's layout allows (`visit_record`), so nothing is copied first.
template <class Accumulator>
  requires requires(const Accumulator& accumulator) {
    { accumulator.try_to_record() } -> checkpoint_record;
  }
void save_checkpoint(const std::filesystem::path& path, const Accumulator& accumulator,
                     std::optional<checkpoint_format> format = std::nullopt) {
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  accumulator.visit_record([&](const auto& view) { detail::save_file(path, view, resolved); });
}

/// @brief Restores an accumulator from `path` (with the checks of `load_record` against
/// `params`), reading values straight into new backend tensors where the backend's layout
/// allows. The accumulator is unchanged unless everything loaded and validated.
/// @throws what `load_checkpoint<R>` and the accumulator's `load_record` throw.
template <class Accumulator, class B>
  requires requires(const Accumulator& accumulator) {
    { accumulator.try_to_record() } -> checkpoint_record;
  }
void load_checkpoint(const std::filesystem::path& path, const parameter_set<B>& params, Accumulator& accumulator,
                     std::optional<checkpoint_format> format = std::nullopt) {
  using record_type = decltype(accumulator.try_to_record());
  using restorer = typename Accumulator::restorer;
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  restorer sink(accumulator, params);
  detail::into_for<record_type, restorer> into{&sink};
  detail::read_file(path, resolved,
                    [&](detail::sized_streambuf& source) { detail::read_into<record_type>(source, resolved, into); });
  std::move(sink).commit();
}

/// @brief Writes `record` on another thread; `get()` on the result rethrows what
/// `save_checkpoint` threw.
template <checkpoint_record R>
[[nodiscard]] std::future<void> save_checkpoint_async(std::filesystem::path path, R record,
                                                      std::optional<checkpoint_format> format = std::nullopt) {
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  return std::async(std::launch::async, [path = std::move(path), record = std::move(record), resolved] {
    save_checkpoint(path, record, resolved);
  });
}

/// @brief Snapshots `accumulator` as of this call (a copy of it: one copy of the pending
/// values on the calling thread) and writes the copy on another thread, straight from its
/// tensors; the accumulator may be used again as soon as this returns.
template <class Accumulator>
  requires std::copy_constructible<Accumulator> && requires(const Accumulator& accumulator) {
    { accumulator.try_to_record() } -> checkpoint_record;
  }
[[nodiscard]] std::future<void> save_checkpoint_async(std::filesystem::path path, const Accumulator& accumulator,
                                                      std::optional<checkpoint_format> format = std::nullopt) {
  const checkpoint_format resolved = format ? *format : checkpoint_format_for(path);
  return std::async(std::launch::async, [path = std::move(path), snapshot = accumulator, resolved] {
    save_checkpoint(path, snapshot, resolved);
  });
}

}  // namespace gradaccum
