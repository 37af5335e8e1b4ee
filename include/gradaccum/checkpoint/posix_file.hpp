#pragma once
/// @file
/// @brief POSIX files for checkpoints: a buffered writer and reader over file descriptors, and
/// the temporary file that replaces a checkpoint atomically.
///
/// - `file_source` reads regular files only: a FIFO, device or socket is refused with
///   `std::filesystem::filesystem_error` before anything could block on it.
/// - `atomic_file` writes `.gradaccum-<16 hex digits>.tmp` beside the target, whatever the
///   target's name, then fsyncs and renames it over the target. A writer killed before the
///   rename leaves that file behind; loaders never read it (it is not the checkpoint's path),
///   so it is safely ignored and may be deleted.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <ostream>
#include <streambuf>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gradaccum/checkpoint/record_fields.hpp"

namespace gradaccum::detail {

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

/// @brief Writes through a 1 MiB buffer to a file; writes of 256 KiB or more (bulk values) go
/// straight to the file after what is buffered. Remembers the errno of the first failed write.
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
    if (count <= 0) return 0;  // an empty block may come with a null pointer, which memcpy must not see
    const auto size = static_cast<std::size_t>(count);
    if (size >= direct_write_bytes) return drain() && write_all(data, size) ? count : 0;
    if (size <= static_cast<std::size_t>(epptr() - pptr())) {
      std::memcpy(pptr(), data, size);
      pbump(static_cast<int>(size));
      return count;
    }
    if (!drain()) return 0;
    std::memcpy(pptr(), data, size);
    pbump(static_cast<int>(size));
    return count;
  }

  int sync() override { return drain() ? 0 : -1; }

 private:
  static constexpr std::size_t buffer_size = std::size_t{1} << 20;
  static constexpr std::size_t direct_write_bytes = std::size_t{1} << 18;  // a save's pieces of values

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

/// @brief Reads a regular file through a 64 KiB buffer; reads of 16 KiB or more (bulk values) go
/// straight into the destination. Knows how many bytes remain.
class file_source final : public sized_streambuf {
 public:
  /// @throws std::filesystem::filesystem_error when the file cannot be opened or is not regular.
  explicit file_source(const std::filesystem::path& path) : path_(path), buffer_(buffer_size) {
    // A FIFO or a device would block open() or read() until some other process acts, and is
    // never a checkpoint: refuse it by stat before opening, and again by fstat after opening
    // without blocking (the path may have been replaced in between).
    struct ::stat status {};
    if (::stat(path.c_str(), &status) != 0) fail_io("open checkpoint", path, errno);
    if (!S_ISREG(status.st_mode)) fail_io("read checkpoint (not a regular file)", path, EINVAL);
    file_ = file_descriptor(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
    if (file_.get() < 0) fail_io("open checkpoint", path, errno);
    if (::fstat(file_.get(), &status) != 0) fail_io("inspect checkpoint", path, errno);
    if (!S_ISREG(status.st_mode)) fail_io("read checkpoint (not a regular file)", path, EINVAL);
    unread_ = static_cast<std::uint64_t>(status.st_size);
    setg(buffer_.data(), buffer_.data(), buffer_.data());
  }

  [[nodiscard]] std::uint64_t remaining() const noexcept override {
    return unread_ + static_cast<std::uint64_t>(egptr() - gptr());
  }

  /// Up to `count` of the next bytes, not consumed: at most the buffer's 64 KiB, fewer only at
  /// the end of the file (or after a failed read).
  std::string_view peek(std::size_t count) override {
    if (static_cast<std::size_t>(egptr() - gptr()) < count && gptr() != buffer_.data()) {
      // Move what is left to the front, so the rest of `count` fits behind it.
      const auto left = static_cast<std::size_t>(egptr() - gptr());
      std::memmove(buffer_.data(), gptr(), left);
      setg(buffer_.data(), buffer_.data(), buffer_.data() + left);
    }
    const auto held = static_cast<std::size_t>(egptr() - gptr());
    if (held < count && held < buffer_.size()) {
      const std::size_t got = read_some(egptr(), buffer_.size() - held);
      setg(buffer_.data(), buffer_.data(), egptr() + got);
    }
    return {gptr(), std::min(count, static_cast<std::size_t>(egptr() - gptr()))};
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
    if (count <= 0) return 0;  // an empty block may come with a null pointer, which memcpy must not see
    const auto wanted = static_cast<std::size_t>(count);
    std::size_t done = std::min(wanted, static_cast<std::size_t>(egptr() - gptr()));
    std::memcpy(data, gptr(), done);
    gbump(static_cast<int>(done));
    if (wanted >= direct_read_bytes) {  // the rest, however short, so the buffer stays empty
      return static_cast<std::streamsize>(done + read_some(data + done, wanted - done));
    }
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
  // Reads from this size on take what the buffer holds and read the rest directly, leaving the
  // buffer empty: a checkpoint's values arrive in pieces of 32 KiB (see `loaded_block_bytes`),
  // which would otherwise keep refilling it and all be copied twice.
  static constexpr std::size_t direct_read_bytes = std::size_t{1} << 14;

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
  explicit atomic_file(std::filesystem::path target)
      : target_(std::move(target)), directory_(target_.parent_path().empty() ? "." : target_.parent_path()) {
    for (;;) {  // O_EXCL skips a name taken by another writer or left by a killed one
      temporary_ = directory_ / temporary_name();
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
    // Nothing after the rename allocates unless it fails: a save that throws for lack of memory
    // has left the previous checkpoint in place.
    file_descriptor dir(::open(directory_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (dir.get() < 0 || (::fsync(dir.get()) != 0 && errno != EINVAL)) fail_io("sync directory", directory_, errno);
  }

  /// Prefix of every temporary file name: what a writer killed before its rename leaves behind.
  static constexpr std::string_view temporary_prefix = ".gradaccum-";

 private:
  /// `.gradaccum-<16 hex digits>.tmp`: 31 bytes whatever the target's name, so any name up to
  /// NAME_MAX can be saved. The digits mix the pid, the time and a counter, so writers in
  /// different processes or threads rarely collide (and O_EXCL catches it when they do).
  static std::string temporary_name() {
    static std::atomic<std::uint64_t> counter{0};
    std::uint64_t x = static_cast<std::uint64_t>(::getpid()) << 40 ^
                      static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                      counter.fetch_add(0x9e3779b97f4a7c15U);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9U;  // splitmix64's finalizer
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebU;
    x ^= x >> 31;
    std::string name(temporary_prefix);
    constexpr std::string_view hex = "0123456789abcdef";
    for (int shift = 60; shift >= 0; shift -= 4) name += hex[(x >> shift) & 0xf];
    return name + ".tmp";
  }

  std::filesystem::path target_;
  std::filesystem::path directory_;
  std::filesystem::path temporary_;
  file_descriptor file_;
  bool committed_ = false;
};

}  // namespace gradaccum::detail
