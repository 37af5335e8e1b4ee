/// @file
/// @brief cereal.hpp: the loss scaler's state round-trips bit for bit through every cereal
/// archive with a plain `archive(state)`, names its fields in text archives, and a state that
/// no scaler can have is refused on load with `invalid_state`, leaving the target as it was.

#include <bit>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

#include <doctest/doctest.h>
#include <cereal/archives/binary.hpp>
#include <cereal/archives/json.hpp>
#include <cereal/archives/portable_binary.hpp>
#include <cereal/archives/xml.hpp>

#include <gradaccum/cereal.hpp>
#include <gradaccum/checkpoint/text_archives.hpp>
#include <gradaccum/dynamic_loss_scale.hpp>

#include "test_helpers.hpp"

using gradaccum::dynamic_loss_scale;
using gradaccum::dynamic_loss_scale_options;
using gradaccum::dynamic_loss_scale_state;
using gradaccum::errc;

namespace {

template <class Input, class Output>
struct archive_pair {
  using input = Input;
  using output = Output;
};
using binary = archive_pair<cereal::BinaryInputArchive, cereal::BinaryOutputArchive>;
using portable_binary = archive_pair<cereal::PortableBinaryInputArchive, cereal::PortableBinaryOutputArchive>;
// JSON through the library's own archives, as checkpoint files are written and read (cereal's
// JSON archive runs RapidJSON code that UndefinedBehaviorSanitizer reports).
using json = archive_pair<gradaccum::detail::json_input_archive, gradaccum::detail::json_output_archive>;
using xml = archive_pair<cereal::XMLInputArchive, cereal::XMLOutputArchive>;

template <class Archives>
std::string saved(const dynamic_loss_scale_state& state) {
  std::ostringstream out;
  {
    typename Archives::output archive(out);
    archive(state);
    if constexpr (requires { archive.finish(); }) archive.finish();
  }  // text archives finish their document when destroyed
  return out.str();
}

template <class Archives>
void load_into(const std::string& bytes, dynamic_loss_scale_state& state) {
  if constexpr (std::is_constructible_v<typename Archives::input, std::string_view>) {
    typename Archives::input archive{std::string_view(bytes)};
    archive(state);
  } else {
    std::istringstream in(bytes);
    typename Archives::input archive(in);
    archive(state);
  }
}

}  // namespace

TYPE_TO_STRING(binary);
TYPE_TO_STRING(portable_binary);
TYPE_TO_STRING(json);
TYPE_TO_STRING(xml);

TEST_CASE_TEMPLATE("a loss scale state round-trips bit for bit and resumes the same run", Archives, binary,
                   portable_binary, json, xml) {
  const dynamic_loss_scale_options options{.init_scale = 0x1.8p-3, .backoff_factor = 0.3, .hysteresis = 5};
  dynamic_loss_scale scaler(options);
  for (const bool overflow : {true, false, true}) scaler.update(overflow);  // 0.1875 · 0.3: full mantissa
  const dynamic_loss_scale_state state = scaler.state();
  CHECK(state.hysteresis_left == 3);

  dynamic_loss_scale_state loaded{1.0, 7, 9};
  load_into<Archives>(saved<Archives>(state), loaded);
  CHECK(loaded == state);
  CHECK(std::bit_cast<std::uint64_t>(loaded.scale) == std::bit_cast<std::uint64_t>(state.scale));
  CHECK(saved<Archives>(loaded) == saved<Archives>(state));

  dynamic_loss_scale resumed(options, loaded);
  for (const bool overflow : {true, true, true, false}) {
    CHECK(resumed.update(overflow) == scaler.update(overflow));
    CHECK(resumed.state() == scaler.state());
  }
}

TEST_CASE("text archives name the fields") {
  const std::string text = saved<json>({1024.0, 12, 1});
  CHECK(text.find("\"scale\": 1024") != std::string::npos);
  CHECK(text.find("\"growth_tracker\": 12") != std::string::npos);
  CHECK(text.find("\"hysteresis_left\": 1") != std::string::npos);
}

TEST_CASE_TEMPLATE("a state no scaler can have is invalid_state on load, and the target is unchanged", Archives, binary,
                   portable_binary, json, xml) {
  for (const dynamic_loss_scale_state& bad :
       // (An infinite scale is covered by 1e39, not an F32 value either; JSON cannot hold an
       // infinity as a number, so there the checksum refuses it first.)
       {dynamic_loss_scale_state{0.0, 0, 1}, dynamic_loss_scale_state{-2.0, 0, 1}, dynamic_loss_scale_state{1e39, 0, 1},
        dynamic_loss_scale_state{8.0, 0, 0}}) {
    INFO("scale " << bad.scale << ", hysteresis_left " << bad.hysteresis_left);
    const std::string bytes = saved<Archives>(bad);  // saving does not judge: the scaler never makes these
    dynamic_loss_scale_state target{512.0, 3, 2};
    GRADACCUM_CHECK_REJECTED(load_into<Archives>(bytes, target), errc::invalid_state, "");
    CHECK(target == dynamic_loss_scale_state{512.0, 3, 2});
  }
}
