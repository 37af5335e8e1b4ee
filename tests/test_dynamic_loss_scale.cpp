/// @file
/// @brief dynamic_loss_scale.hpp: PyTorch GradScaler's growth and backoff, DeepSpeed's hysteresis,
/// the floor and the F32 ceiling, resuming from a state, and every rejection leaving nothing made.

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/dynamic_loss_scale.hpp>

#include "test_helpers.hpp"

using gradaccum::dynamic_loss_scale;
using gradaccum::dynamic_loss_scale_options;
using gradaccum::dynamic_loss_scale_state;
using gradaccum::errc;

namespace {

/// Feeds `overflows` (true: the window held a non-finite value) and returns the scale after each.
std::vector<double> scales_after(dynamic_loss_scale& scaler, std::initializer_list<bool> overflows) {
  std::vector<double> scales;
  for (const bool overflow : overflows) {
    CHECK(scaler.update(overflow) == !overflow);  // step exactly when there was no overflow
    scales.push_back(scaler.scale());
  }
  return scales;
}

/// GradScaler's update (`torch._amp_update_scale_`, its CPU kernel; the CUDA one computes alike):
/// the scale is a float, multiplied by a double factor, and the double product is stored back.
struct grad_scaler {
  float scale;
  double growth_factor;
  double backoff_factor;
  int growth_interval;
  int growth_tracker = 0;

  void update(bool found_inf) {
    if (found_inf) {
      scale = static_cast<float>(scale * backoff_factor);
      growth_tracker = 0;
    } else if (++growth_tracker == growth_interval) {
      const auto grown = static_cast<float>(scale * growth_factor);
      if (std::isfinite(grown)) scale = grown;
      growth_tracker = 0;
    }
  }
};

}  // namespace

TEST_CASE("the defaults are GradScaler's: 2^16, x2 after 2000 good windows, x0.5 after an overflow") {
  dynamic_loss_scale scaler;
  CHECK(scaler.scale() == 65536.0);
  CHECK(scaler.state() == dynamic_loss_scale_state{65536.0, 0, 1});
  for (int i = 0; i < 1999; ++i) CHECK(scaler.update(false));
  CHECK(scaler.scale() == 65536.0);
  CHECK(scaler.state().growth_tracker == 1999);
  CHECK(scaler.update(false));
  CHECK(scaler.state() == dynamic_loss_scale_state{131072.0, 0, 1});
  CHECK_FALSE(scaler.update(true));
  CHECK(scaler.state() == dynamic_loss_scale_state{65536.0, 0, 1});
}

TEST_CASE("an overflow resets the run of good windows") {
  dynamic_loss_scale scaler({.init_scale = 8.0, .growth_interval = 3});
  CHECK(scales_after(scaler, {false, false, true, false, false, false, false}) ==
        std::vector<double>{8, 8, 4, 4, 4, 8, 8});
  CHECK(scaler.state().growth_tracker == 1);
}

TEST_CASE("hysteresis: overflows tolerated before backing off, restored when the scale grows (DeepSpeed)") {
  dynamic_loss_scale scaler({.init_scale = 64.0, .growth_interval = 2, .hysteresis = 2});
  // The first overflow only spends hysteresis; the next ones back off until the scale grows.
  CHECK(scales_after(scaler, {true, true, true}) == std::vector<double>{64, 32, 16});
  CHECK(scaler.state().hysteresis_left == 1);
  CHECK(scales_after(scaler, {false, false}) == std::vector<double>{16, 32});
  CHECK(scaler.state().hysteresis_left == 2);
  CHECK(scales_after(scaler, {true, false, true}) == std::vector<double>{32, 32, 16});
  CHECK(scaler.state() == dynamic_loss_scale_state{16.0, 0, 1});
}

TEST_CASE("the scale stops at min_scale going down and at the largest F32 power going up") {
  dynamic_loss_scale floor({.init_scale = 4.0, .min_scale = 1.0});  // DeepSpeed's floor
  CHECK(scales_after(floor, {true, true, true, true}) == std::vector<double>{2, 1, 1, 1});

  dynamic_loss_scale tiny({.init_scale = 0x1p-125});
  CHECK(scales_after(tiny, {true, true}) == std::vector<double>{0x1p-126, 0x1p-126});  // smallest normal F32

  dynamic_loss_scale ceiling({.init_scale = 0x1p126, .growth_interval = 1});
  // 2^128 is no F32: the scale stays, the run starts over, as GradScaler's finite check does.
  CHECK(scales_after(ceiling, {false, false, false}) == std::vector<double>{0x1p127, 0x1p127, 0x1p127});
  CHECK(ceiling.state().growth_tracker == 0);
}

TEST_CASE("resuming from a saved state continues exactly where the run left off") {
  const dynamic_loss_scale_options options{.init_scale = 1024.0, .growth_interval = 3, .hysteresis = 3};
  dynamic_loss_scale run(options);
  static_cast<void>(scales_after(run, {true, false, false}));
  dynamic_loss_scale resumed(options, run.state());
  CHECK(resumed.state() == run.state());
  CHECK(resumed.options() == options);
  for (const bool overflow : {false, true, true, true, false, false, false}) {
    CHECK(resumed.update(overflow) == run.update(overflow));
    CHECK(resumed.state() == run.state());
  }
}

TEST_CASE("options outside their ranges are invalid_scalar") {
  constexpr double inf = std::numeric_limits<double>::infinity();
  constexpr double nan = std::numeric_limits<double>::quiet_NaN();
  const auto rejected = [](const dynamic_loss_scale_options& options) {
    GRADACCUM_CHECK_REJECTED(dynamic_loss_scale{options}, errc::invalid_scalar, "");
  };
  for (const double scale : {0.0, -1.0, inf, nan, 1e39, 1e-50}) rejected({.init_scale = scale});
  for (const double factor : {1.0, 0.5, inf, nan}) rejected({.growth_factor = factor});
  for (const double factor : {1.0, 0.0, -0.5, 2.0, nan}) rejected({.backoff_factor = factor});
  rejected({.growth_interval = 0});
  rejected({.hysteresis = 0});
  for (const double floor : {0.0, -1.0, nan, 1e-50}) rejected({.min_scale = floor});
  rejected({.init_scale = 0.5, .min_scale = 1.0});
  rejected({.init_scale = 0.1});  // the scale is an F32: no value rounds silently
  rejected({.min_scale = 0.1});
}

TEST_CASE("a state these options cannot reach is invalid_state") {
  const dynamic_loss_scale_options options{.growth_interval = 10, .hysteresis = 2, .min_scale = 1.0};
  for (const dynamic_loss_scale_state& state : std::vector<dynamic_loss_scale_state>{
           {0.5, 0, 1},                                       // below min_scale
           {std::numeric_limits<double>::infinity(), 0, 1},   // not a scale
           {1e39, 0, 1},                                      // no F32
           {std::numeric_limits<double>::quiet_NaN(), 0, 1},  //
           {1024.0, 10, 1},                                   // growth_tracker == growth_interval
           {1024.0, 0, 0},                                    // no hysteresis left
           {1024.0, 0, 3},                                    // more than the options allow
       }) {
    INFO("scale " << state.scale << ", growth_tracker " << state.growth_tracker << ", hysteresis_left "
                  << state.hysteresis_left);
    GRADACCUM_CHECK_REJECTED((dynamic_loss_scale{options, state}), errc::invalid_state, "");
  }
  CHECK(dynamic_loss_scale(options, {1.0, 9, 2}).scale() == 1.0);  // the edges themselves are fine
}

TEST_CASE("any factors give GradScaler's F32 scale bit for bit") {
  // Growth 1.5 for 100 windows, backing off by 0.3 at every seventh: a scale kept in F64
  // drifts from GradScaler's from the first growth that rounds.
  dynamic_loss_scale scaler({.init_scale = 65536.0, .growth_factor = 1.5, .backoff_factor = 0.3, .growth_interval = 1});
  grad_scaler reference{65536.0F, 1.5, 0.3, 1};
  double f64_scale = 65536.0;
  int differs_from_f64 = 0;
  for (int window = 1; window <= 100; ++window) {
    const bool overflow = window % 7 == 0;
    scaler.update(overflow);
    reference.update(overflow);
    f64_scale *= overflow ? 0.3 : 1.5;
    INFO("window " << window);
    CHECK(std::bit_cast<std::uint64_t>(scaler.scale()) ==
          std::bit_cast<std::uint64_t>(static_cast<double>(reference.scale)));
    differs_from_f64 += scaler.scale() != f64_scale ? 1 : 0;
  }
  CHECK(differs_from_f64 > 50);
  CHECK(scaler.scale() == 0x1.fc3384p+41);  // the reference's scale after window 100

  // The growth that is not finite as an F32 is skipped, as GradScaler skips it.
  dynamic_loss_scale ceiling({.init_scale = 0x1.fffffep127, .growth_factor = 1.5, .growth_interval = 1});
  CHECK(scales_after(ceiling, {false}) == std::vector<double>{0x1.fffffep127});
}

TEST_CASE("a state is checked against what the options reach") {
  const auto rejected = [](const dynamic_loss_scale_options& options, double scale) {
    INFO("scale " << scale);
    GRADACCUM_CHECK_REJECTED((dynamic_loss_scale{options, {scale, 0, 1}}), errc::invalid_state, "");
  };
  SUBCASE("power-of-two factors: init_scale or min_scale times a power of two") {
    rejected({}, 3.0);
    rejected({}, 65536.0 * 1.5);
    CHECK(dynamic_loss_scale({}, {0x1p-3, 0, 1}).scale() == 0x1p-3);
    // Factors 4 and 1/4: only even powers, from 48 or from the floor 1 that 48 backs off to.
    dynamic_loss_scale scaler({.init_scale = 48.0, .growth_factor = 4.0, .backoff_factor = 0.25, .min_scale = 1.0});
    CHECK(scales_after(scaler, {true, true, true}) == std::vector<double>{12, 3, 1});
    const dynamic_loss_scale_options quarter = scaler.options();
    for (const double scale : {3.0, 12.0, 192.0, 1.0, 4.0, 16.0}) {
      CHECK(dynamic_loss_scale(quarter, {scale, 0, 1}).scale() == scale);
    }
    for (const double scale : {6.0, 24.0, 2.0, 8.0, 5.0}) rejected(quarter, scale);
  }
  SUBCASE("a run with growth factor 3 does not resume under the defaults") {
    dynamic_loss_scale run({.growth_factor = 3.0, .growth_interval = 2});
    static_cast<void>(scales_after(run, {false, false, true}));
    CHECK(run.scale() == 98304.0);
    GRADACCUM_CHECK_REJECTED((dynamic_loss_scale{{.growth_interval = 2}, run.state()}), errc::invalid_state, "");
    CHECK(dynamic_loss_scale(run.options(), run.state()).state() == run.state());
  }
  SUBCASE("any factors: an F32 value") {
    const dynamic_loss_scale_options options{.growth_factor = 1.5, .backoff_factor = 0.3};
    rejected(options, 0.1);
    rejected(options, 65536.0 + 0x1p-20);
    CHECK(dynamic_loss_scale(options, {0x1.99999ap-4, 0, 1}).scale() == 0x1.99999ap-4);  // 0.1 as an F32
  }
}
