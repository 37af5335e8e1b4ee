/// @file
/// @brief cereal.hpp: records round-trip through every cereal archive (binary, portable binary,
/// JSON, XML) with a plain `archive(record)`, bit for bit; text archives name their fields and
/// write dtypes as names; binary archives hold values as one raw row-major block; equal windows
/// give byte-identical archives; Eigen and xtensor restore each other's records; and a window
/// checkpointed after k microbatches, restored into a new accumulator and continued finishes
/// bit-identically to the uninterrupted window.

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/checkpoint.hpp>
#include <gradaccum/gradaccum.hpp>

#include "backend_fixtures.hpp"
#include "test_checkpoint_fixture.hpp"
#include "test_checkpoint_support.hpp"
#include "test_helpers.hpp"

using namespace gradaccum;
using test::all_formats;
using test::binary_archives;
using test::json_archives;
using test::load_plain;
using test::portable_binary_archives;
using test::save_plain;
using test::xml_archives;

namespace {

template <class T>
std::vector<T> bits_of(std::initializer_list<std::uint32_t> patterns) {
  using bits_type = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>;
  std::vector<T> values;
  for (std::uint32_t pattern : patterns) values.push_back(std::bit_cast<T>(static_cast<bits_type>(pattern)));
  return values;
}

constexpr float f32_max = std::numeric_limits<float>::max();
constexpr double f64_max = std::numeric_limits<double>::max();
constexpr float f32_inf = std::numeric_limits<float>::infinity();

/// Every dtype, zero-size and rank-0 tensors, and the edge values of each dtype: signed zeros,
/// smallest subnormals, largest finite values, infinities and the canonical quiet NaN.
gradients_params_record edge_values() {
  return {{
      {"a.f16", float_dtype::f16, {2, 3}, std::vector<std::uint16_t>{0x0000, 0x8000, 0x0001, 0x7bff, 0xfc00, 0x7e00}},
      {"b.bf16", float_dtype::bf16, {3, 1}, std::vector<std::uint16_t>{0x3f80, 0xff80, 0x0001}},
      {"c.f32",
       float_dtype::f32,
       {2, 4},
       std::vector<float>{0.1F, -0.0F, std::numeric_limits<float>::denorm_min(), f32_max, -f32_inf,
                          std::numeric_limits<float>::quiet_NaN(), 1.0F / 3.0F, -2.5e-38F}},
      {"d.f64",
       float_dtype::f64,
       {1, 5},
       std::vector<double>{0.1, std::numeric_limits<double>::denorm_min(), -f64_max, -0.0,
                           std::numeric_limits<double>::quiet_NaN()}},
      {"e.empty", float_dtype::f32, {0, 3}, std::vector<float>{}},
      {"f.scalar", float_dtype::f64, {}, std::vector<double>{2.5}},
  }};
}

/// A window state with every field away from its default.
constexpr weighted_accumulation_state edge_state{float_dtype::f64, 65536.0, 0x1p-1060,
                                                 std::numeric_limits<std::uint64_t>::max()};

/// The fixture window after `k` microbatches on backend B.
template <class B>
weighted_gradients_record window_record(std::size_t k) {
  const parameter_set<B> params = test::window::make_parameters<B>();
  weighted_gradients_accumulator<B> accumulator(test::window::work_dtype, test::window::loss_scale);
  test::window::run(accumulator, params, 0, k);
  return accumulator.try_to_record();
}

}  // namespace

TEST_CASE_TEMPLATE("every dtype, shape and edge value round-trips bit for bit", Archives, GRADACCUM_TEST_ARCHIVES) {
  const gradients_params_record record = edge_values();
  const auto loaded = load_plain<Archives, gradients_params_record>(save_plain<Archives>(record));
  GRADACCUM_CHECK_SAME_BITS(loaded, record);
}

TEST_CASE_TEMPLATE("every field of a state round-trips exactly, counters at their extremes", Archives,
                   GRADACCUM_TEST_ARCHIVES) {
  const auto loaded = load_plain<Archives, weighted_accumulation_state>(save_plain<Archives>(edge_state));
  GRADACCUM_CHECK_SAME_BITS(loaded, edge_state);
}

TEST_CASE_TEMPLATE("a weighted record round-trips bit for bit, empty or not, F32 or F64", Archives,
                   GRADACCUM_TEST_ARCHIVES) {
  for (std::size_t k : {0, 2, 7}) {
    CAPTURE(k);
    const weighted_gradients_record record = window_record<eigen_backend>(k);
    REQUIRE(record.state.microbatches == k);
    const auto loaded = load_plain<Archives, weighted_gradients_record>(save_plain<Archives>(record));
    GRADACCUM_CHECK_SAME_BITS(loaded, record);
  }
  const weighted_gradients_record f64_record{{{{"w", float_dtype::f64, {2, 1}, std::vector<double>{0.1, -1e300}}}},
                                             {float_dtype::f64, 0.5, 1e-300, 9}};
  GRADACCUM_CHECK_SAME_BITS((load_plain<Archives, weighted_gradients_record>(save_plain<Archives>(f64_record))),
                            f64_record);
}

TEST_CASE_TEMPLATE("the record's parse_checkpoint and serialize_checkpoint agree with plain archives", Archives,
                   GRADACCUM_TEST_CHECKPOINT_ARCHIVES) {
  const weighted_gradients_record record = window_record<eigen_backend>(4);
  const std::string bytes = serialize_checkpoint(record, Archives::format);
  GRADACCUM_CHECK_SAME_BITS(parse_checkpoint<weighted_gradients_record>(bytes, Archives::format), record);
  GRADACCUM_CHECK_SAME_BITS((load_plain<Archives, weighted_gradients_record>(bytes)), record);
  GRADACCUM_CHECK_SAME_BITS(parse_checkpoint<weighted_gradients_record>(save_plain<Archives>(record), Archives::format),
                            record);
}

TEST_CASE("a portable binary checkpoint of the other byte order loads as cereal's own archive reads it") {
  // What a machine of the other byte order writes: cereal's portable binary archive with that
  // order's byte and every number swapped.
  using options = cereal::PortableBinaryOutputArchive::Options;
  const weighted_gradients_record record = window_record<eigen_backend>(4);
  std::ostringstream out;
  {
    cereal::PortableBinaryOutputArchive archive(
        out, std::endian::native == std::endian::little ? options::BigEndian() : options::LittleEndian());
    archive(record);
  }
  const std::string foreign = out.str();
  REQUIRE(foreign != save_plain<portable_binary_archives>(record));
  GRADACCUM_CHECK_SAME_BITS((load_plain<portable_binary_archives, weighted_gradients_record>(foreign)), record);
  GRADACCUM_CHECK_SAME_BITS(parse_checkpoint<weighted_gradients_record>(foreign, checkpoint_format::portable_binary),
                            record);
}

TEST_CASE_TEMPLATE("one archive holds several records, each loading back", Archives, GRADACCUM_TEST_ARCHIVES) {
  // cereal writes a type's version only the first time an archive holds that type: the
  // loaders must track this as the savers do, whatever mix of records an archive holds.
  const gradients_params_record gradients = edge_values();
  const weighted_gradients_record window = window_record<eigen_backend>(4);
  std::ostringstream out;
  {
    typename Archives::output archive(out);
    archive(gradients.tensors[2], gradients, window, window);
  }
  std::istringstream in(out.str());
  typename Archives::input archive(in);
  tensor_record tensor;
  gradients_params_record loaded_gradients;
  weighted_gradients_record first;
  weighted_gradients_record second;
  archive(tensor, loaded_gradients, first, second);
  CHECK(tensor.id == gradients.tensors[2].id);
  CHECK(tensor.shape == gradients.tensors[2].shape);
  GRADACCUM_CHECK_SAME_BITS(tensor.values, gradients.tensors[2].values);
  GRADACCUM_CHECK_SAME_BITS(loaded_gradients, gradients);
  GRADACCUM_CHECK_SAME_BITS(first, window);
  GRADACCUM_CHECK_SAME_BITS(second, window);
}

TEST_CASE("binary archives keep every bit of a NaN; text archives keep it a NaN") {
  // Negative NaNs and payloads, which arithmetic on overflowed windows can produce.
  const gradients_params_record record{{
      {"f32", float_dtype::f32, {1, 3}, bits_of<float>({0xffc00000, 0x7f800001, 0x7fc0beef})},
      {"f64", float_dtype::f64, {1, 1}, std::vector<double>{-std::numeric_limits<double>::quiet_NaN()}},
  }};
  GRADACCUM_CHECK_SAME_BITS((load_plain<binary_archives, gradients_params_record>(save_plain<binary_archives>(record))),
                            record);
  GRADACCUM_CHECK_SAME_BITS(
      (load_plain<portable_binary_archives, gradients_params_record>(save_plain<portable_binary_archives>(record))),
      record);
  for (const gradients_params_record& loaded :
       {load_plain<json_archives, gradients_params_record>(save_plain<json_archives>(record)),
        load_plain<xml_archives, gradients_params_record>(save_plain<xml_archives>(record))}) {
    for (float value : std::get<std::vector<float>>(loaded.tensors[0].values)) CHECK(std::isnan(value));
    CHECK(std::isnan(std::get<std::vector<double>>(loaded.tensors[1].values)[0]));
  }
}

TEST_CASE("text archives name every field and record type, write dtypes as names and carry the format version") {
  const weighted_gradients_record record{{{{"fc1.bias", float_dtype::f32, {1, 2}, std::vector<float>{0.5F, -2.0F}}}},
                                         {float_dtype::f32, 1024.0, 3.0, 2}};
  const std::string json = serialize_checkpoint(record, checkpoint_format::json);
  for (const char* expected :
       {"\"weighted_gradients_record\": {", "\"cereal_class_version\": 5", "\"record\": \"weighted_gradients_record\"",
        "\"record\": \"weighted_accumulation_state\"", "\"record\": \"gradients_params_record\"", "\"state\": {",
        "\"dtype\": \"F32\"", "\"loss_scale\": 1024.0", "\"total_weight\": 3.0", "\"microbatches\": 2",
        "\"gradients\": {", "\"tensors\": [", "\"id\": \"fc1.bias\"", "\"shape\": [", "\"values\": \"0.5 -2\""}) {
    CHECK_MESSAGE(json.find(expected) != std::string::npos, "JSON lacks " << expected << ":\n" << json);
  }
  const std::string xml = save_plain<xml_archives>(record);  // cereal's own XML archive
  for (const char* expected :
       {"<cereal_class_version>5</cereal_class_version>", "<record>weighted_gradients_record</record>",
        "<dtype>F32</dtype>", "<loss_scale>1024</loss_scale>", "<microbatches>2</microbatches>", "<id>fc1.bias</id>",
        "<shape size=\"dynamic\">", "<values>0.5 -2</values>"}) {
    CHECK_MESSAGE(xml.find(expected) != std::string::npos, "XML lacks " << expected << ":\n" << xml);
  }
  // 16-bit values are their bit patterns: 0x3c00 is F16 1.0.
  const gradients_params_record half{{{"h", float_dtype::f16, {1, 2}, std::vector<std::uint16_t>{0x3c00, 0}}}};
  CHECK(serialize_checkpoint(half, checkpoint_format::json).find("\"values\": \"15360 0\"") != std::string::npos);
  CHECK(save_plain<xml_archives>(half).find(">15360 0<") != std::string::npos);
}

TEST_CASE("text archives write each value as its shortest round-trip text") {
  // 0.1F as a double would be 0.10000000149011612; the float's shortest text is 0.1.
  const gradients_params_record record{{
      {"f32", float_dtype::f32, {1, 4}, std::vector<float>{0.1F, 1.0F / 3.0F, -0.0F, 3e38F}},
      {"f64", float_dtype::f64, {1, 2}, std::vector<double>{0.1, -std::numeric_limits<double>::infinity()}},
  }};
  const std::string json = serialize_checkpoint(record, checkpoint_format::json);
  CHECK_MESSAGE(json.find("\"values\": \"0.1 0.33333334 -0 3e+38\"") != std::string::npos, json);
  CHECK_MESSAGE(json.find("\"values\": \"0.1 -inf\"") != std::string::npos, json);
}

TEST_CASE("binary archives hold a tensor's values as one raw row-major block") {
  // Eigen stores column-major; records, and so archives, are row-major whatever the backend.
  eigen_backend::tensor<float> matrix(2, 3);
  for (Eigen::Index r = 0; r < 2; ++r) {
    for (Eigen::Index c = 0; c < 3; ++c) matrix(r, c) = static_cast<float>(10 * r + c);
  }
  parameter_set<eigen_backend> params;
  params.add("m", matrix);
  gradients_params<eigen_backend> grads;
  grads.insert("m", matrix);
  weighted_gradients_accumulator<eigen_backend> accumulator(float_dtype::f32, 1.0);
  accumulator.accumulate_sum(params, grads, 1.0);
  const weighted_gradients_record record = accumulator.try_to_record();

  const std::vector<float> row_major = {0, 1, 2, 10, 11, 12};
  GRADACCUM_CHECK_SAME_BITS(record.gradients.tensors[0].values, record_values(row_major));
  for (checkpoint_format format : {checkpoint_format::binary, checkpoint_format::portable_binary}) {
    CAPTURE(format);
    const std::string bytes = serialize_checkpoint(record, format);
    // Both archives are little-endian here.
    const std::string block(reinterpret_cast<const char*>(row_major.data()), row_major.size() * sizeof(float));
    CHECK(bytes.find(block) != std::string::npos);
  }
}

TEST_CASE_TEMPLATE("equal windows give byte-identical archives, whatever order gradients arrived in", Archives,
                   GRADACCUM_TEST_ARCHIVES) {
  const parameter_set<eigen_backend> params = test::window::make_parameters<eigen_backend>();
  weighted_gradients_accumulator<eigen_backend> forward(test::window::work_dtype, test::window::loss_scale);
  weighted_gradients_accumulator<eigen_backend> backward(test::window::work_dtype, test::window::loss_scale);
  test::window::run(forward, params, 0, 5);
  for (std::size_t i = 0; i < 5; ++i) {
    const auto grads = test::window::gradients_of<eigen_backend>(i);
    std::vector<const gradients_params<eigen_backend>::entry*> entries;
    for (const auto& entry : grads) entries.push_back(&entry);
    gradients_params<eigen_backend> reversed;
    for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
      detail::visit_gradient([&](const auto& value) { reversed.insert((*it)->id, value); }, (*it)->value);
    }
    const auto& batch = test::window::microbatches[i];
    if (batch.mean) {
      backward.accumulate_mean(params, reversed, batch.weight);
    } else {
      backward.accumulate_sum(params, reversed, batch.weight);
    }
  }
  CHECK(save_plain<Archives>(forward.try_to_record()) == save_plain<Archives>(backward.try_to_record()));
}

/// Checkpoints the fixture window of backend From after k microbatches, restores it into a new
/// accumulator of backend To (through `format`), continues, and returns the finished mean.
template <class From, class To>
gradients_params_record resumed_mean(std::size_t k, checkpoint_format format) {
  const std::string bytes = serialize_checkpoint(window_record<From>(k), format);
  const parameter_set<To> params = test::window::make_parameters<To>();
  // Another dtype and loss scale: the restored window adopts the record's.
  weighted_gradients_accumulator<To> resumed(float_dtype::f64, 1.0);
  resumed.load_record(params, parse_checkpoint<weighted_gradients_record>(bytes, format));
  test::window::run(resumed, params, k, test::window::microbatches.size());
  return resumed.finish_mean(params).gradients.to_record();
}

TEST_CASE_TEMPLATE("a window checkpointed after k microbatches and continued finishes bit-identically", B,
                   GRADACCUM_TEST_BACKENDS) {
  const gradients_params_record uninterrupted = test::window::uninterrupted_mean<B>();
  REQUIRE(uninterrupted.tensors.size() == test::window::parameters.size());
  for (checkpoint_format format : all_formats) {
    for (std::size_t k = 0; k <= test::window::microbatches.size(); ++k) {
      CAPTURE(format);
      CAPTURE(k);
      GRADACCUM_CHECK_SAME_BITS((resumed_mean<B, B>(k, format)), uninterrupted);
    }
  }
}

#if GRADACCUM_TEST_XTENSOR
TEST_CASE("Eigen and xtensor restore each other's records exactly, in every archive") {
  const gradients_params_record uninterrupted = test::window::uninterrupted_mean<eigen_backend>();
  GRADACCUM_CHECK_SAME_BITS(test::window::uninterrupted_mean<xtensor_backend>(), uninterrupted);
  for (checkpoint_format format : all_formats) {
    CAPTURE(format);
    // The same window gives the same record on either backend, so the same bytes.
    CHECK(serialize_checkpoint(window_record<eigen_backend>(4), format) ==
          serialize_checkpoint(window_record<xtensor_backend>(4), format));
    for (std::size_t k : {1, 4, 6}) {
      CAPTURE(k);
      GRADACCUM_CHECK_SAME_BITS((resumed_mean<eigen_backend, xtensor_backend>(k, format)), uninterrupted);
      GRADACCUM_CHECK_SAME_BITS((resumed_mean<xtensor_backend, eigen_backend>(k, format)), uninterrupted);
    }
  }
}
#endif

TEST_CASE_TEMPLATE("a plain archive(record) of another record type is refused naming both", Archives,
                   GRADACCUM_TEST_ARCHIVES) {
  const weighted_gradients_record window{{{{"w", float_dtype::f32, {1, 1}, std::vector<float>{2.0F}}}},
                                         {float_dtype::f32, 1.0, 1.0, 1}};
  const auto refused = [](const std::string& bytes, const auto& expected_type, const std::string& message) {
    using R = std::decay_t<decltype(expected_type)>;
    try {
      (void)load_plain<Archives, R>(bytes);
      FAIL("loaded");
    } catch (const error& e) {
      CHECK(e.code() == errc::invalid_record);
      CHECK(std::string(e.what()) == message);
    }
  };
  refused(save_plain<Archives>(window), gradients_params_record{},
          "expected a gradients_params_record, but the input holds a weighted_gradients_record.");
  refused(save_plain<Archives>(window.gradients), weighted_accumulation_state{},
          "expected a weighted_accumulation_state, but the input holds a gradients_params_record.");
  refused(save_plain<Archives>(window.state), dynamic_loss_scale_state{},
          "expected a dynamic_loss_scale_state, but the input holds a weighted_accumulation_state.");
  refused(save_plain<Archives>(dynamic_loss_scale_state{}), weighted_gradients_record{},
          "expected a weighted_gradients_record, but the input holds a dynamic_loss_scale_state.");
}
