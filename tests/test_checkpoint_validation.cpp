/// @file
/// @brief Records that parse but must not load: negative, fractional or NaN counters and scales,
/// unknown dtype names, an id listed twice, another format version, values a text archive cannot
/// hold, documents cereal's parsers mishandle, trailing bytes. Each gives `gradaccum::error` with
/// the right code and a message naming the problem, in every format that can carry it.

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/backends/eigen.hpp>
#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "test_checkpoint_forgery.hpp"
#include "test_checkpoint_support.hpp"
#include "test_helpers.hpp"

using namespace gradaccum;
using namespace gradaccum::test;

TEST_CASE("negative, fractional or NaN counters and scales are refused as invalid states") {
  const std::string json = serialize_checkpoint(valid_window, checkpoint_format::json);
  const std::string xml = test::save_plain<test::xml_archives>(valid_window);
  const checkpoint_format as_json = checkpoint_format::json;
  const read_as as_xml = cereal_xml;
  const weighted_accumulation_state valid = valid_window.state;
  // Text that does not read as the field's type: refused before the state's checksum is.
  const auto json_state = [&](std::string_view field, std::string_view text) {
    return with_state(json, as_json, field, text, valid);
  };
  check_refused(json_state("microbatches", "-1"), as_json, errc::invalid_state, "",
                {"'microbatches'", "non-negative integer"});
  check_refused(json_state("microbatches", "2.5"), as_json, errc::invalid_state, "",
                {"'microbatches'", "non-negative integer"});
  check_refused(json_state("microbatches", "18446744073709551616"), as_json, errc::invalid_state, "",
                {"'microbatches'"});
  check_refused(json_state("loss_scale", "\"big\""), as_json, errc::invalid_state, "",
                {"'loss_scale'", "not a number"});
  // cereal reads XML integers with std::stoull, which takes "-1" for 2^64 - 1; these loaders do not.
  check_refused(with_state(xml, as_xml, "microbatches", "-1", valid), as_xml, errc::invalid_state, "",
                {"'microbatches'", "'-1' is not a non-negative integer"});
  // Values that read but make no valid state, under a checksum that matches them.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const auto forged = [&](double loss_scale, double total_weight, std::uint64_t microbatches) {
    return weighted_accumulation_state{float_dtype::f32, loss_scale, total_weight, microbatches};
  };
  check_refused(with_state(json, as_json, "total_weight", "NaN", forged(1024.0, nan, 2)), as_json, errc::invalid_state,
                "", {"total weight"});
  check_refused(with_state(xml, as_xml, "total_weight", "nan", forged(1024.0, nan, 2)), as_xml, errc::invalid_state, "",
                {"total weight"});
  check_refused(with_state(json, as_json, "total_weight", "-7.0", forged(1024.0, -7.0, 2)), as_json,
                errc::invalid_state, "", {"total weight -7"});
  check_refused(with_state(json, as_json, "loss_scale", "-Infinity", forged(-inf, 7.0, 2)), as_json,
                errc::invalid_state, "", {"loss scale"});
  check_refused(with_state(json, as_json, "microbatches", "0", forged(1024.0, 7.0, 0)), as_json, errc::invalid_state,
                "", {"no microbatches"});
  check_refused(with_state(json, as_json, "total_weight", "0.0", forged(1024.0, 0.0, 2)), as_json, errc::invalid_state,
                "", {"zero total weight but pending"});
  // Unchanged text under the forged checksum: the checksum refuses it.
  check_refused(with_state(json, as_json, "total_weight", "7.0", forged(1024.0, 8.0, 2)), as_json, errc::invalid_record,
                "", {"accumulation state has checksum"});
  for (double weight : {nan, -inf, -1.0}) {
    CAPTURE(weight);
    check_refused(window_with_state("F32", 1.0, weight, 1), checkpoint_format::binary, errc::invalid_state, "",
                  {"total weight"});
  }
  check_refused(window_with_state("F64", 0.0, 1.0, 1), checkpoint_format::binary, errc::invalid_state, "",
                {"loss scale 0"});
}

TEST_CASE("dtype names are checked: unknown names, other cases, non-work dtypes in the state") {
  const std::string json = serialize_checkpoint(valid_window, checkpoint_format::json);
  check_refused(replaced(json, "\"dtype\": \"F32\"", "\"dtype\": \"F128\""), checkpoint_format::json,
                errc::invalid_state, "", {"accumulation state", "unknown dtype name 'F128'"});
  check_refused(replaced(json, "\"dtype\": \"F32\"", "\"dtype\": \"f32\""), checkpoint_format::json,
                errc::invalid_state, "", {"unknown dtype name 'f32'"});
  weighted_accumulation_state f16 = valid_window.state;
  f16.dtype = float_dtype::f16;
  check_refused(with_state(json, checkpoint_format::json, "dtype", "\"F16\"", f16), checkpoint_format::json,
                errc::invalid_state, "", {"work dtype F16", "only F32 and F64"});
  check_refused(replaced(json, "\"dtype\": \"F32\"", "\"dtype\": \"Q8\"", 1), checkpoint_format::json,
                errc::invalid_record, "b", {"record tensor 'b'", "unknown dtype name 'Q8'"});
  check_refused(replaced(json, "\"dtype\": \"F32\"", "\"dtype\": 32", 2), checkpoint_format::json, errc::invalid_record,
                "w", {"record tensor 'w'", "'dtype'", "not a string"});
  // A tensor of another dtype than the state's (both F32 and F64 are known names).
  binary_bytes f64_entry;
  f64_entry.entry("w", 3, {1, 1}, 0);
  binary_bytes f64_value;
  f64_value.f64(2.0);
  check_refused(forged_window(1, f64_entry.str(), f64_value.str(), 8), checkpoint_format::binary, errc::invalid_state,
                "w", {"'w' has dtype F64", "work dtype is F32"});
  check_refused(window_with_state(std::string_view("F\x01\xff", 3), 1.0, 1.0, 1), checkpoint_format::binary,
                errc::invalid_state, "", {"unknown dtype name 'F\\x01\\xff'"});
}

TEST_CASE("a record listing an id twice is refused, naming it") {
  binary_bytes block;
  block.values({1, 2, 3});
  binary_bytes twice;
  twice.entry("w", 2, {1, 1}, 0).entry("w", 2, {1, 1}, 4);
  check_refused(forged_window(2, twice.str(), block.str().substr(0, 8), 8), checkpoint_format::binary,
                errc::invalid_record, "w", {"lists tensor 'w' twice"});
  // Out of order, the duplicates are not neighbours.
  binary_bytes unsorted;
  unsorted.entry("w", 2, {1, 1}, 0).entry("a", 2, {1, 1}, 4).entry("w", 2, {1, 1}, 8);
  check_refused(forged_window(3, unsorted.str(), block.str(), 12), checkpoint_format::binary, errc::invalid_record, "w",
                {"lists tensor 'w' twice"});
  // Out of order without duplicates is a valid record, and keeps its order.
  binary_bytes reversed;
  reversed.entry("w", 2, {1, 1}, 0).entry("a", 2, {1, 1}, 4);
  const auto loaded = parse_checkpoint<weighted_gradients_record>(
      forged_window(2, reversed.str(), block.str().substr(0, 8), 8), checkpoint_format::binary);
  CHECK(loaded.gradients.tensors[0].id == "w");
  CHECK(loaded.gradients.tensors[1].id == "a");
  // In a text archive, under a checksum that matches (the ids are hashed).
  weighted_gradients_record renamed = valid_window;
  renamed.gradients.tensors[1].id = "c";
  const std::string json = serialize_checkpoint(renamed, checkpoint_format::json);
  detail::content_hash hash;
  for (const tensor_record& tensor : valid_window.gradients.tensors) {
    const auto& values = std::get<std::vector<float>>(tensor.values);
    detail::hash_tensor_header(hash, "b", tensor.dtype, tensor.shape, values.size());
    hash.add_text_values(std::span<const float>(values));
  }
  std::string twice_json = replaced(json, "\"id\": \"c\"", "\"id\": \"b\"");
  const std::size_t checksum_at = twice_json.rfind("\"checksum\": ") + 12;  // the gradients' is the last
  twice_json.replace(checksum_at, twice_json.find('\n', checksum_at) - checksum_at, std::to_string(hash.digest()));
  check_refused(twice_json, checkpoint_format::json, errc::invalid_record, "b", {"lists tensor 'b' twice"});
}

TEST_CASE("a format version other than this build's is refused for every record type") {
  std::string binary = serialize_checkpoint(valid_window, checkpoint_format::binary);
  binary[0] = 4;  // the weighted record's version comes first
  check_refused(binary, checkpoint_format::binary, errc::invalid_record, "",
                {"weighted gradients record has format version 4; this build reads version 5 only."});
  const std::string json = serialize_checkpoint(valid_window, checkpoint_format::json);
  const char* types[] = {"weighted gradients record", "accumulation state", "gradients record", "tensor record"};
  for (int occurrence = 0; occurrence < 4; ++occurrence) {
    CAPTURE(types[occurrence]);
    check_refused(replaced(json, "\"cereal_class_version\": 5", "\"cereal_class_version\": 4", occurrence),
                  checkpoint_format::json, errc::invalid_record, "",
                  {types[occurrence], "format version 4; this build reads version 5 only."});
  }
  const std::string xml = test::save_plain<test::xml_archives>(valid_window);
  check_refused(replaced(xml, "<cereal_class_version>5<", "<cereal_class_version>7<", 3), cereal_xml,
                errc::invalid_record, "", {"tensor record has format version 7"});
  std::string portable = serialize_checkpoint(valid_window, checkpoint_format::portable_binary);
  portable[1] = 3;  // after the byte-order byte
  check_refused(portable, checkpoint_format::portable_binary, errc::invalid_record, "",
                {"weighted gradients record has format version 3; this build reads version 5 only."});
}

TEST_CASE("values a text archive cannot hold for their dtype are refused") {
  const std::string json = serialize_checkpoint(valid_window, checkpoint_format::json);
  check_refused(replaced(json, "\"0.5 -1\"", "\"0.5 1e300\""), checkpoint_format::json, errc::invalid_record, "b",
                {"record tensor 'b'", "the value '1e300', which is not an F32 value"});
  check_refused(replaced(json, "\"0.5 -1\"", "\"0.5 -1x\""), checkpoint_format::json, errc::invalid_record, "b",
                {"record tensor 'b'", "the value '-1x', which is not an F32 value"});
  check_refused(replaced(json, "\"0.5 -1\"", "[0.5, -1]"), checkpoint_format::json, errc::invalid_record, "b",
                {"record tensor 'b'", "'values'", "not a string of numbers"});
  check_refused(replaced(json, "\"0.5 -1\"", "\"0.5\""), checkpoint_format::json, errc::invalid_record, "b",
                {"holds 1 values for the 2 elements"});
  check_refused(replaced(json, "\"0.5 -1\"", "\"0.5 -1 2\""), checkpoint_format::json, errc::invalid_record, "b",
                {"holds more values than the 2 of its shape"});
  // Too short for the shape's element count before anything is allocated for it.
  check_refused(replaced(json, "\"0.5 -1\"", "\"1\""), checkpoint_format::json, errc::invalid_record, "b",
                {"1 characters of values, too few for the 2 elements"});
  // Any whitespace separates; what to_chars writes for infinities reads back.
  weighted_gradients_record infinite = valid_window;
  std::get<std::vector<float>>(infinite.gradients.tensors[0].values)[1] = -std::numeric_limits<float>::infinity();
  const std::string spaced =
      replaced(serialize_checkpoint(infinite, checkpoint_format::json), "\"0.5 -inf\"", "\" 0.5\\n\\t-inf \"");
  GRADACCUM_CHECK_SAME_BITS(parse_checkpoint<weighted_gradients_record>(spaced, checkpoint_format::json), infinite);
  const gradients_params_record half{{{"h", float_dtype::f16, {1, 1}, std::vector<std::uint16_t>{0x3c00}}}};
  const std::string half_json = serialize_checkpoint(half, checkpoint_format::json);
  try {
    (void)parse_checkpoint<gradients_params_record>(replaced(half_json, "15360", "70000"), checkpoint_format::json);
    FAIL("a 16-bit value of 70000 loaded");
  } catch (const error& e) {
    CHECK(e.code() == errc::invalid_record);
    CHECK(std::string(e.what()).find("'70000', which is not a 16-bit pattern") != std::string::npos);
  }
  const std::string half_xml = test::save_plain<test::xml_archives>(half);
  const auto load_xml = [](const std::string& bytes) {
    return test::load_plain<test::xml_archives, gradients_params_record>(bytes);
  };
  CHECK_THROWS_AS((void)load_xml(replaced(half_xml, ">15360<", ">-4294901761<")), error);
}

TEST_CASE("documents cereal's parsers mishandle are refused, or read exactly") {
  // Nesting deeper than any record: RapidJSON recurses once per level.
  constexpr std::size_t depth = 200000;
  check_refused(std::string(depth, '[') + std::string(depth, ']'), checkpoint_format::json, errc::invalid_record, "",
                {"nests deeper than 32"});
  check_refused("{\"a\": [1, 2,]}", checkpoint_format::json, errc::invalid_record, "", {"not valid JSON", "byte 12"});
  // Numbers RapidJSON 1.1 misread (its full-precision conversion calls clz(0) and indexes its
  // table of powers of ten out of bounds) are read exactly now; a changed weight fails the checksum.
  const std::string json = serialize_checkpoint(valid_window, checkpoint_format::json);
  for (const char* number : {"0e-300", "184467440737095516156"}) {
    CAPTURE(number);
    check_refused(replaced(json, "7.0", number), checkpoint_format::json, errc::invalid_record, "", {"checksum"});
  }
  for (const char* number : {"1844044.1841844674401e-337", "184.184e-9223372036854775807"}) {  // below any double
    CAPTURE(number);
    check_refused(replaced(json, "7.0", number), checkpoint_format::json, errc::invalid_state, "", {"'total_weight'"});
  }
  const std::string scaled_twenty_digits = replaced(json, "7.0", "70000000000000000000e-19");
  GRADACCUM_CHECK_SAME_BITS(parse_checkpoint<weighted_gradients_record>(scaled_twenty_digits, checkpoint_format::json),
                            valid_window);
  const std::string twenty_digits = replaced(json, "7.0", "7.0000000000000000000");
  GRADACCUM_CHECK_SAME_BITS(parse_checkpoint<weighted_gradients_record>(twenty_digits, checkpoint_format::json),
                            valid_window);
}

TEST_CASE("bytes after a binary record, or a document without the record, are refused") {
  check_refused(serialize_checkpoint(valid_window, checkpoint_format::binary) + std::string(4, '\0'),
                checkpoint_format::binary, errc::invalid_record, "", {"4 bytes after its record"});
  check_refused(
      "{\"weighted_gradients_record\": {\"cereal_class_version\": 5, \"record\": \"weighted_gradients_record\"}}",
      checkpoint_format::json, errc::invalid_state, "", {"'state'", "missing"});
  check_refused("[1, 2]", checkpoint_format::json, errc::invalid_record, "", {"holds no record"});
  check_refused("{\"value0\": 5}", checkpoint_format::json, errc::invalid_record, "", {"not a valid json"});
}
