/// @file
/// @brief records.hpp: records are plain values, and `validate` refuses malformed records and
/// inconsistent states with the right code and id.

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/records.hpp>

#include "test_helpers.hpp"

using namespace gradaccum;

static_assert(std::is_default_constructible_v<weighted_gradients_record>);
static_assert(std::is_copy_constructible_v<weighted_gradients_record>);
static_assert(std::is_copy_assignable_v<weighted_gradients_record>);
static_assert(std::is_nothrow_move_constructible_v<weighted_gradients_record>);
static_assert(std::is_trivially_copyable_v<weighted_accumulation_state>);

namespace {

gradients_params_record two_tensors() {
  return {{{"a", float_dtype::f32, {2, 3}, std::vector<float>{1, 2, 3, 4, 5, 6}},
           {"b", float_dtype::bf16, {2}, std::vector<std::uint16_t>{0x3f80, 0x4000}}}};
}

}  // namespace

TEST_CASE("a default record is an empty F32 window with loss scale 1, and is valid") {
  const weighted_gradients_record record;
  CHECK(record.gradients.tensors.empty());
  CHECK(record.state == weighted_accumulation_state{float_dtype::f32, 1.0, 0.0, 0});
  CHECK_NOTHROW(validate(record.gradients));
  CHECK_NOTHROW(validate(record.state));
}

TEST_CASE("records compare by value") {
  const weighted_gradients_record a{two_tensors(), {float_dtype::f32, 2.0, 3.0, 1}};
  weighted_gradients_record b = a;
  CHECK(a == b);
  std::get<std::vector<float>>(b.gradients.tensors[0].values)[5] = 7;
  CHECK(a != b);
}

TEST_CASE("validate(gradients_params_record) refuses what no tensor can hold") {
  CHECK_NOTHROW(validate(two_tensors()));
  const auto rejects = [](auto&& change, const char* id) {
    gradients_params_record record = two_tensors();
    change(record);
    GRADACCUM_CHECK_REJECTED(validate(record), errc::invalid_record, id);
  };
  rejects([](auto& r) { r.tensors[0].values = std::vector<float>(5); }, "a");
  rejects([](auto& r) { r.tensors[0].values = std::vector<double>(6); }, "a");           // values of another dtype
  rejects([](auto& r) { r.tensors[1].dtype = float_dtype::f32; }, "b");                  // 16-bit values
  rejects([](auto& r) { r.tensors[1].shape = std::vector<std::uint64_t>(9, 1); }, "b");  // rank above max_rank
  rejects([](auto& r) { r.tensors[1].shape = {std::uint64_t{1} << 63, 4}; }, "b");       // element count overflows
  rejects([](auto& r) { r.tensors[1].id = "a"; }, "a");                                  // duplicate id
}

TEST_CASE("validate(weighted_accumulation_state) refuses inconsistent counters") {
  constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();
  CHECK_NOTHROW(validate(weighted_accumulation_state{float_dtype::f64, 0x1p-150, 0x1p-150, 1}));
  CHECK_NOTHROW(validate(weighted_accumulation_state{float_dtype::f32, 1.0, 0.0, 5}));  // zero-weight microbatches
  for (const weighted_accumulation_state state : {
           weighted_accumulation_state{float_dtype::bf16, 1.0, 0.0, 0},
           weighted_accumulation_state{float_dtype::f32, 0.0, 0.0, 0},
           weighted_accumulation_state{float_dtype::f32, -2.0, 0.0, 0},
           weighted_accumulation_state{float_dtype::f32, not_a_number, 0.0, 0},
           weighted_accumulation_state{float_dtype::f32, 0x1p-150, 0.0, 0},
           weighted_accumulation_state{float_dtype::f32, 1.0, 0x1p128, 1},
           weighted_accumulation_state{float_dtype::f32, 1.0, 0x1p-150, 1},
           weighted_accumulation_state{float_dtype::f64, 1.0, -1.0, 1},
           weighted_accumulation_state{float_dtype::f64, 1.0, 1.0, 0},
       }) {
    INFO(test::describe(state));
    GRADACCUM_CHECK_REJECTED(validate(state), errc::invalid_state, "");
  }
}

TEST_CASE("validate's messages show ids escaped: a NUL byte or a terminal escape never reaches them raw") {
  const std::string nul("a\0b", 3);
  const std::string escape = "\x1b[2J";
  const auto message_of = [](const auto& invalid) {
    try {
      validate(invalid);
    } catch (const error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  gradients_params_record twice{
      {{nul, float_dtype::f32, {1}, std::vector<float>{1}}, {nul, float_dtype::f32, {1}, std::vector<float>{2}}}};
  CHECK(message_of(twice) == "record lists tensor 'a\\x00b' twice.");
  gradients_params_record short_values{{{escape, float_dtype::f32, {2}, std::vector<float>{1}}}};
  CHECK(message_of(short_values) == "record tensor '\\x1b[2J' has 1 values for shape [2].");
  gradients_params_record other_dtype{{{escape, float_dtype::f64, {1}, std::vector<float>{1}}}};
  CHECK(message_of(other_dtype) == "record tensor '\\x1b[2J' holds values of another dtype than its F64.");
  const weighted_gradients_record window{{{{escape, float_dtype::f64, {1}, std::vector<double>{1}}}},
                                         {float_dtype::f32, 1.0, 1.0, 1}};
  CHECK(message_of(window) ==
        "pending tensor '\\x1b[2J' has dtype F64 but the accumulation state's work dtype is F32.");
}
