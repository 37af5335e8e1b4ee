#pragma once
/// @file
/// @brief The single exception type of the library and its error codes.

#include <charconv>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>

namespace gradaccum {

/// @brief What went wrong. Every rejection leaves the object it was called on unchanged.
enum class errc {
  invalid_scalar = 1,  ///< a scale or divisor is not finite, not positive or narrows to 0 in F32
  invalid_dtype,       ///< a dtype that cannot be used here (work dtypes are F32 and F64)
  parameter_mismatch,  ///< a gradient's shape or device differs from its parameter's
  unknown_parameters,  ///< a gradient or record names an id that is not in the parameter set
  invalid_weight,      ///< a microbatch weight (or the running total) is negative or not representable
  counter_overflow,    ///< the microbatch counter cannot be incremented
  empty_weight,        ///< a mean was asked of a window whose total weight is zero
  invalid_state,       ///< counters, loss scale or dtypes of a state are inconsistent
  invalid_record,      ///< a record is malformed (duplicate ids, sizes that disagree with shapes, ...)
};

/// @brief The `std::error_category` of `errc`, so codes compare with `std::error_code`.
inline const std::error_category& error_category() noexcept {
  struct category final : std::error_category {
    const char* name() const noexcept override { return "gradaccum"; }
    std::string message(int code) const override {
      switch (static_cast<errc>(code)) {
        case errc::invalid_scalar: return "invalid scalar";
        case errc::invalid_dtype: return "invalid dtype";
        case errc::parameter_mismatch: return "parameter mismatch";
        case errc::unknown_parameters: return "unknown parameters";
        case errc::invalid_weight: return "invalid weight";
        case errc::counter_overflow: return "counter overflow";
        case errc::empty_weight: return "empty weight";
        case errc::invalid_state: return "invalid state";
        case errc::invalid_record: return "invalid record";
      }
      return "unknown gradaccum error";
    }
  };
  static const category instance;
  return instance;
}

inline std::error_code make_error_code(errc code) noexcept {
  return {static_cast<int>(code), error_category()};
}

/// @brief Thrown by every checked operation: a code, the offending parameter id (if any)
/// and a one-sentence message.
class error : public std::runtime_error {
 public:
  error(errc code, const std::string& message, std::string param_id = {})
      : std::runtime_error(message), code_(code), param_id_(std::move(param_id)) {}

  [[nodiscard]] errc code() const noexcept { return code_; }
  /// Empty when the problem is not about one parameter.
  [[nodiscard]] const std::string& param_id() const noexcept { return param_id_; }
  [[nodiscard]] std::error_code error_code() const noexcept { return make_error_code(code_); }

 private:
  errc code_;
  std::string param_id_;
};

namespace detail {

/// The shortest text that reads back as `value` (std::to_string would print 1e-45 as 0.000000).
inline std::string number_text(double value) {
  char text[32];  // the shortest round-trip form of a double needs at most 24 characters
  return {text, std::to_chars(text, text + sizeof text, value).ptr};
}

/// Appends `value` in decimal (as std::to_string writes integers).
template <class Int>
void append_number(std::string& out, Int value) {
  char text[24];
  out.append(text, std::to_chars(text, text + sizeof text, value).ptr);
}

/// Appends "[3, 4]": dimensions as `tensor_shape::to_string` and messages write them.
inline void append_dims(std::string& out, std::span<const std::size_t> dims) {
  out += '[';
  for (std::size_t axis = 0; axis < dims.size(); ++axis) {
    if (axis != 0) out += ", ";
    append_number(out, dims[axis]);
  }
  out += ']';
}

/// @brief A piece of an error message: text, a number or a shape's dimensions, written out only
/// when `fail` builds the message. A check in a template then compiles to a compare and a call
/// instead of the string arithmetic of its message, in every instantiation.
class message_piece {
 public:
  message_piece(const char* text) noexcept : text_(text) {}
  message_piece(std::string_view text) noexcept : text_(text) {}
  message_piece(const std::string& text) noexcept : text_(text) {}
  template <std::integral I>
    requires(!std::same_as<I, bool> && !std::same_as<I, char>)
  message_piece(I value) noexcept {
    if constexpr (std::is_signed_v<I>) {
      kind_ = kind::signed_integer;
      signed_ = value;
    } else {
      kind_ = kind::unsigned_integer;
      unsigned_ = value;
    }
  }
  message_piece(double value) noexcept : kind_(kind::real), real_(value) {}
  message_piece(std::span<const std::size_t> dims) noexcept : kind_(kind::dims), dims_(dims) {}

  void append_to(std::string& out) const {
    switch (kind_) {
      case kind::text: out += text_; break;
      case kind::signed_integer: append_number(out, signed_); break;
      case kind::unsigned_integer: append_number(out, unsigned_); break;
      case kind::real: out += number_text(real_); break;
      case kind::dims: append_dims(out, dims_); break;
    }
  }

 private:
  enum class kind : std::uint8_t { text, signed_integer, unsigned_integer, real, dims };
  kind kind_ = kind::text;
  union {
    std::string_view text_;
    long long signed_;
    unsigned long long unsigned_;
    double real_;
    std::span<const std::size_t> dims_;
  };
};

/// Throws `error(code, message, param_id)`. Out of line and cold so that the checks on hot
/// paths stay small.
[[noreturn, gnu::cold, gnu::noinline]] inline void fail(errc code, const std::string& message,
                                                        std::string param_id = {}) {
  throw error(code, message, std::move(param_id));
}

/// The pieces back to back. A template of nothing, so that `GRADACCUM_EXTERN_TEMPLATES` can
/// compile it (and the number formatting under it) in one file of a program instead of in each.
template <class = void>
std::string message_text(std::initializer_list<message_piece> message) {
  std::string text;
  for (const message_piece& piece : message) piece.append_to(text);
  return text;
}

/// Throws an `error` whose message is the pieces back to back.
[[noreturn, gnu::cold, gnu::noinline]] inline void fail(errc code, std::initializer_list<message_piece> message,
                                                        std::string_view param_id = {}) {
  throw error(code, message_text(message), std::string(param_id));
}

}  // namespace detail

}  // namespace gradaccum

template <>
struct std::is_error_code_enum<gradaccum::errc> : std::true_type {};
