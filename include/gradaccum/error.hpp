#pragma once
/// @file
/// @brief The single exception type of the library and its error codes.

#include <charconv>
#include <stdexcept>
#include <string>
#include <system_error>
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
/// Out of line and cold so that the checks on hot paths stay small.
[[noreturn]] inline void fail(errc code, const std::string& message, std::string param_id = {}) {
  throw error(code, message, std::move(param_id));
}

/// The shortest text that reads back as `value` (std::to_string would print 1e-45 as 0.000000).
inline std::string number_text(double value) {
  char text[32];  // the shortest round-trip form of a double needs at most 24 characters
  return {text, std::to_chars(text, text + sizeof text, value).ptr};
}
}  // namespace detail

}  // namespace gradaccum

template <>
struct std::is_error_code_enum<gradaccum::errc> : std::true_type {};
