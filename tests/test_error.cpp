/// @file
/// @brief error.hpp: one exception type whose codes are `std::error_code`s.

#include <limits>
#include <ostream>  // doctest prints std::error_code through operator<<
#include <set>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>

#include <doctest/doctest.h>

#include <gradaccum/error.hpp>

using gradaccum::errc;

namespace {
constexpr errc all_codes[] = {errc::invalid_scalar,     errc::invalid_dtype,  errc::parameter_mismatch,
                              errc::unknown_parameters, errc::invalid_weight, errc::counter_overflow,
                              errc::empty_weight,       errc::invalid_state,  errc::invalid_record};
}  // namespace

TEST_CASE("errc is an error code enum of the gradaccum category") {
  static_assert(std::is_error_code_enum_v<errc>);
  const std::error_code code = errc::invalid_weight;  // implicit, through make_error_code
  CHECK(code == errc::invalid_weight);
  CHECK(code != errc::invalid_scalar);
  CHECK(code != std::errc::invalid_argument);
  CHECK(code.category() == gradaccum::error_category());
  CHECK(std::string(code.category().name()) == "gradaccum");
  CHECK(code.message() == "invalid weight");
  CHECK(static_cast<bool>(code));  // no code is 0, so every one reads as an error

  std::set<std::string> messages;
  for (const errc value : all_codes) {
    const std::error_code c = make_error_code(value);
    CHECK(c.value() != 0);
    CHECK_FALSE(c.message().empty());
    messages.insert(c.message());
  }
  CHECK(messages.size() == std::size(all_codes));
}

TEST_CASE("gradaccum::error carries its code, the offending id and a message") {
  static_assert(std::is_base_of_v<std::runtime_error, gradaccum::error>);
  const gradaccum::error with_id(errc::parameter_mismatch, "gradient 'fc1.weight' has shape [2, 3].", "fc1.weight");
  CHECK(with_id.code() == errc::parameter_mismatch);
  CHECK(with_id.error_code() == errc::parameter_mismatch);
  CHECK(with_id.error_code() == make_error_code(errc::parameter_mismatch));
  CHECK(with_id.param_id() == "fc1.weight");
  CHECK(std::string(with_id.what()) == "gradient 'fc1.weight' has shape [2, 3].");

  const gradaccum::error without_id(errc::empty_weight, "empty.");
  CHECK(without_id.param_id().empty());

  try {
    gradaccum::detail::fail(errc::counter_overflow, "full.");
  } catch (const std::runtime_error& e) {  // catchable as a standard exception
    CHECK(std::string(e.what()) == "full.");
    CHECK(dynamic_cast<const gradaccum::error&>(e).code() == errc::counter_overflow);
  }
}

TEST_CASE("messages print numbers exactly, in their shortest form") {
  using gradaccum::detail::number_text;
  CHECK(number_text(1e-45) == "1e-45");  // std::to_string printed 0.000000
  CHECK(number_text(-0.1) == "-0.1");
  CHECK(number_text(1024.0) == "1024");
  CHECK(number_text(1.0 / 3.0) == "0.3333333333333333");
  CHECK(number_text(-std::numeric_limits<double>::max()) == "-1.7976931348623157e+308");
  CHECK(number_text(std::numeric_limits<double>::quiet_NaN()) == "nan");
  CHECK(number_text(-std::numeric_limits<double>::infinity()) == "-inf");
}
