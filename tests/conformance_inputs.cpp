/// @file
/// @brief The conformance suite (conformance.hpp) on what goes in: parameter sets, gradients
/// containers, and gradients viewed in caller memory or reused across microbatches.

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "conformance.hpp"

namespace {

using namespace gradaccum;
using namespace gradaccum::test;

}  // namespace

TEST_SUITE_BEGIN("conformance");

// ---------------------------------------------------------------------------------------------
// parameter_set and gradients_params

TEST_CASE_TEMPLATE("parameter_set keeps parameters in order and counts a tied parameter once", B,
                   GRADACCUM_TEST_BACKENDS) {
  parameter_set<B> params;
  CHECK(params.empty());
  CHECK(params.add("embedding", filled<B, float>(shape_a, 0.0)) == 0);
  CHECK(params.add("head.bias", filled<B, double>(shape_b, 1.0)) == 1);
  // A decoder that reuses the embedding matrix adds it again: a tie, not a second parameter.
  CHECK(params.add("embedding", filled<B, float>(shape_a, 5.0)) == 0);
  REQUIRE(params.size() == 2);
  CHECK(params[0].id == "embedding");
  CHECK(params[0].shape == shape_a);
  CHECK(params[0].device == backend_fixture<B>::device());
  CHECK(params[1].id == "head.bias");
  CHECK(params[1].shape == shape_b);
  CHECK(params.find("head.bias") == std::optional<std::size_t>(1));
  CHECK(params.contains("embedding"));
  CHECK_FALSE(params.contains("head.weight"));

  SUBCASE("a tie with another shape is refused and changes nothing") {
    GRADACCUM_CHECK_REJECTED(params.add("embedding", filled<B, float>(shape_b, 0.0)), errc::parameter_mismatch,
                             "embedding");
    CHECK(params.size() == 2);
    CHECK(params[0].shape == shape_a);
  }
  if (const auto other = backend_fixture<B>::other_device()) {
    SUBCASE("a tie on another device is refused and changes nothing") {
      GRADACCUM_CHECK_REJECTED(params.add("embedding", filled<B, float>(shape_a, 0.0, *other)),
                               errc::parameter_mismatch, "embedding");
      CHECK(params.size() == 2);
      CHECK(params[0].device == backend_fixture<B>::device());
    }
  }
  if constexpr (gradaccum::detail::has_views<B>) {
    SUBCASE("a parameter can be added from a view of caller memory") {
      const auto storage = filled<B, float>(shape_b, 2.0);
      CHECK(params.add("viewed", backend_fixture<B>::view_of(storage)) == 2);
      CHECK(params[2].shape == shape_b);
    }
  }
}

TEST_CASE_TEMPLATE("gradients_params holds present gradients of any element type, keyed by id", B,
                   GRADACCUM_TEST_BACKENDS) {
  gradients_params<B> grads;
  CHECK(grads.empty());
  CHECK(grads.size() == 0);
  grads.insert("a", make_tensor<B, float>(shape_a, {1, 2, 3, 4, 5, 6}));
  grads.insert("b", make_tensor<B, double>(shape_b, {6, 5, 4, 3, 2, 1}));
  CHECK(grads.size() == 2);
  CHECK(grads.contains("a"));
  CHECK_FALSE(grads.contains("c"));  // absent means absent
  CHECK(grads.dtype("a") == std::optional(float_dtype::f32));
  CHECK(grads.dtype("b") == std::optional(float_dtype::f64));
  CHECK(values_of<float>(grads, "a") == std::vector<float>{1, 2, 3, 4, 5, 6});
  CHECK(values_of<double>(grads, "b") == std::vector<double>{6, 5, 4, 3, 2, 1});
  CHECK(grads.template get<double>("a") == nullptr);                         // another element type
  CHECK(grads.template get<float>("c") == nullptr);                          // absent
  CHECK(grads.template get_at<float>(0) == grads.template get<float>("a"));  // by position, in order
  CHECK(grads.template get_at<double>(1) == grads.template get<double>("b"));
  CHECK(grads.template get_at<double>(0) == nullptr);

  SUBCASE("insert refuses an id that is present, changing nothing; insert_or_assign replaces") {
    GRADACCUM_CHECK_REJECTED(grads.insert("a", make_tensor<B, double>(shape_a, {7, 7, 7, 7, 7, 7})),
                             errc::invalid_record, "a");
    CHECK(message_of([&] {
            grads.insert("a", make_tensor<B, float>(shape_a, {7, 7, 7, 7, 7, 7}));
          }).find("insert_or_assign") != std::string::npos);
    CHECK(grads.size() == 2);
    CHECK(values_of<float>(grads, "a") == std::vector<float>{1, 2, 3, 4, 5, 6});
    grads.insert_or_assign("a", make_tensor<B, double>(shape_a, {7, 7, 7, 7, 7, 7}));
    CHECK(grads.size() == 2);
    CHECK(grads.template get<float>("a") == nullptr);
    CHECK(values_of<double>(grads, "a") == std::vector<double>(6, 7.0));
    grads.insert_or_assign("c", make_tensor<B, float>(shape_a, {1, 1, 1, 1, 1, 1}));  // absent: inserted
    CHECK(grads.size() == 3);
  }
  SUBCASE("16-bit gradients keep their dtype") {
    for_each_16bit_type<B>([&]<class T>() {
      grads.insert_or_assign("h", make_tensor<B, T>(shape_a, {1, 2, 3, 4, 5, 6}));
      CHECK(grads.dtype("h") == std::optional(dtype_of<T>));
      CHECK(grads.template get<T>("h") != nullptr);
    });
  }
  if constexpr (gradaccum::detail::has_views<B>) {
    SUBCASE("a view is held as a view: visible to find_value, not to get<T>") {
      const auto storage = make_tensor<B, float>(shape_a, {1, 2, 3, 4, 5, 6});
      grads.insert("v", backend_fixture<B>::view_of(storage));
      CHECK(grads.contains("v"));
      CHECK(grads.find_value("v") != nullptr);
      CHECK(grads.template get<float>("v") == nullptr);
      CHECK(grads.template get_at<float>(2) == nullptr);  // views are never handed out mutably
      CHECK(grads.dtype("v") == std::optional(float_dtype::f32));
    }
  }
  SUBCASE("erase removes one id and keeps the others") {
    CHECK(grads.erase("a"));
    CHECK_FALSE(grads.erase("a"));
    CHECK(grads.size() == 1);
    CHECK(values_of<double>(grads, "b") == std::vector<double>{6, 5, 4, 3, 2, 1});
  }
}

// ---------------------------------------------------------------------------------------------
// Views

TEST_CASE_TEMPLATE("gradients viewed in caller memory accumulate exactly like owned ones", B, GRADACCUM_TEST_BACKENDS) {
  if constexpr (gradaccum::detail::has_views<B>) {
    const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
    const auto a = make_tensor<B, float>(shape_a, {0.1, 0.2, 0.3, 0.4, 0.5, 0.6});
    const auto b = make_tensor<B, double>(shape_b, {-0.1, -0.2, -0.3, -0.4, -0.5, -0.6});
    gradients_params<B> owned;
    owned.insert("a", a);
    owned.insert("b", b);
    gradients_params<B> viewed;
    viewed.insert("a", backend_fixture<B>::view_of(a));
    viewed.insert("b", backend_fixture<B>::view_of(b));

    weighted_gradients_accumulator<B> from_owned(float_dtype::f32, 3.0);
    weighted_gradients_accumulator<B> from_views(float_dtype::f32, 3.0);
    for (const double weight : {3.0, 5.0}) {
      from_owned.accumulate_mean(params, owned, weight);
      from_views.accumulate_mean(params, viewed, weight);
    }
    GRADACCUM_CHECK_SAME_BITS(from_views.try_to_record(), from_owned.try_to_record());
  }
}

TEST_CASE_TEMPLATE("a gradients_params reused across microbatches is checked in full on every call", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
  gradients_params<B> grads = gradient<B>("b", shape_b, multiples(shape_b, 1));
  grads.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  acc.accumulate_sum(params, grads, 1);

  // insert_or_assign under the same ids replaces the values.
  grads.insert_or_assign("a", make_tensor<B, float>(shape_a, multiples(shape_a, 10)));
  acc.accumulate_sum(params, grads, 1);
  CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 11)));
  CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 2)));

  const auto before = acc.try_to_record();
  const auto rejects = [&](errc code, std::string_view id) {
    GRADACCUM_CHECK_REJECTED(acc.accumulate_sum(params, grads, 1), code, id);
    GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
  };
  // Same ids, but a value of another shape: replaced, or changed in place through get<T>.
  grads.insert_or_assign("a", make_tensor<B, float>(shape_b, multiples(shape_b, 1)));
  rejects(errc::parameter_mismatch, "a");
  grads.insert_or_assign("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  *grads.template get<float>("a") = make_tensor<B, float>(shape_b, multiples(shape_b, 1));
  rejects(errc::parameter_mismatch, "a");
  grads.insert_or_assign("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  // Changed ids are resolved again.
  CHECK(grads.erase("b"));
  grads.insert("z", make_tensor<B, float>(shape_b, multiples(shape_b, 1)));
  rejects(errc::unknown_parameters, "z");
  grads.clear();
  grads.insert("b", make_tensor<B, float>(shape_b, multiples(shape_b, 100)));
  acc.accumulate_sum(params, grads, 1);
  CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 11)));
  CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 102)));

  // The same gradients against another set (other positions), and against a set that grew.
  auto reordered = make_parameters<B>({{"c", shape_a}, {"b", shape_b}, {"a", shape_a}});
  grads.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  acc.accumulate_sum(reordered, grads, 1);
  reordered.add("d", make_tensor<B, float>(shape_b, multiples(shape_b, 0)));
  const gradients_params<B> copy = grads;
  acc.accumulate_sum(reordered, copy, 1);
  CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 13)));
  CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 302)));

  if constexpr (gradaccum::detail::has_views<B>) {
    // A re-seated view, another parameter set or a repeated refused call is checked again.
    const auto good = make_tensor<B, float>(shape_a, multiples(shape_a, 1));
    const auto misshapen = make_tensor<B, float>(shape_b, multiples(shape_b, 1));
    gradients_params<B> viewed;
    viewed.insert_or_assign("a", backend_fixture<B>::view_of(good));
    weighted_gradients_accumulator<B> window(float_dtype::f32, 1.0);
    window.accumulate_sum(params, viewed, 1);
    window.accumulate_sum(params, viewed, 1);
    const auto kept = window.try_to_record();
    viewed.insert_or_assign("a", backend_fixture<B>::view_of(misshapen));
    for (int attempt = 0; attempt < 2; ++attempt) {
      GRADACCUM_CHECK_REJECTED(window.accumulate_sum(params, viewed, 1), errc::parameter_mismatch, "a");
    }
    viewed.insert_or_assign("a", backend_fixture<B>::view_of(good));
    const auto transposed = make_parameters<B>({{"a", shape_b}});
    GRADACCUM_CHECK_REJECTED(window.accumulate_sum(transposed, viewed, 1), errc::parameter_mismatch, "a");
    GRADACCUM_CHECK_SAME_BITS(window.try_to_record(), kept);
    window.accumulate_sum(params, viewed, 1);
    CHECK(values_of<float>(window.pending(), "a") == as<float>(multiples(shape_a, 3)));
  }
}

TEST_CASE_TEMPLATE("bound gradients check their owned tensors on every call, whatever replaced what", B,
                   GRADACCUM_TEST_BACKENDS) {
  // Views are checked once, at insert; owned tensors, which get<T> hands out mutably, on every
  // call. Each way an entry changes kind (tensor over view, view over tensor, erase, clear)
  // must keep the owned ones checked.
  const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
  gradients_params<B> grads(params);
  const auto ones_a = make_tensor<B, float>(shape_a, multiples(shape_a, 1));
  const auto misshapen = [] { return make_tensor<B, float>(shape_b, multiples(shape_b, 1)); };
  const auto owned_a_is_checked = [&] {
    const auto before = acc.try_to_record();
    const auto kept = *grads.template get<float>("a");
    *grads.template get<float>("a") = misshapen();
    GRADACCUM_CHECK_REJECTED(acc.accumulate_sum(params, grads, 1), errc::parameter_mismatch, "a");
    GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before);
    *grads.template get<float>("a") = kept;
  };
  grads.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  grads.insert("b", make_tensor<B, float>(shape_b, multiples(shape_b, 2)));
  grads.insert_or_assign("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));  // a tensor over a tensor
  CHECK(grads.owned_count() == 2);
  owned_a_is_checked();
  acc.accumulate_sum(params, grads, 1);
  if constexpr (gradaccum::detail::has_views<B>) {
    const auto fives_b = make_tensor<B, float>(shape_b, multiples(shape_b, 5));
    grads.insert_or_assign("b", backend_fixture<B>::view_of(fives_b));  // a view over a tensor
    CHECK(grads.owned_count() == 1);
    owned_a_is_checked();
    acc.accumulate_sum(params, grads, 1);
    grads.insert_or_assign("a", backend_fixture<B>::view_of(ones_a));  // a view over a tensor
    CHECK(grads.owned_count() == 0);
    acc.accumulate_sum(params, grads, 1);
    grads.insert_or_assign("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));  // a tensor over a view
    CHECK(grads.owned_count() == 1);
    owned_a_is_checked();
    acc.accumulate_sum(params, grads, 1);
    CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 4)));
    CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 17)));
    CHECK(grads.erase("b"));  // erasing a view keeps the count
    CHECK(grads.owned_count() == 1);
    owned_a_is_checked();
  } else {
    CHECK(grads.erase("b"));
    CHECK(grads.owned_count() == 1);
  }
  CHECK(grads.erase("a"));
  CHECK(grads.owned_count() == 0);
  grads.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  CHECK(grads.owned_count() == 1);
  owned_a_is_checked();
  grads.clear();
  CHECK(grads.owned_count() == 0);
  grads.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  CHECK(grads.owned_count() == 1);
  owned_a_is_checked();
}

TEST_CASE_TEMPLATE("calls repeated with unchanged views add into the right tensors after every change", B,
                   GRADACCUM_TEST_BACKENDS) {
  if constexpr (gradaccum::detail::has_views<B>) {
    // An accumulator skips checking views (of a backend whose views keep their geometry) that
    // did not change since the last call: re-seated views, a copy of the gradients, a copy of
    // the accumulator, new pending tensors and a work dtype change must each be followed.
    const auto params = make_parameters<B>({{"a", shape_a}, {"b", shape_b}});
    const auto ones_a = make_tensor<B, float>(shape_a, multiples(shape_a, 1));
    const auto tens_a = make_tensor<B, float>(shape_a, multiples(shape_a, 10));
    const auto ones_b = make_tensor<B, double>(shape_b, multiples(shape_b, 1));
    gradients_params<B> viewed;
    viewed.insert("a", backend_fixture<B>::view_of(ones_a));
    viewed.insert("b", backend_fixture<B>::view_of(ones_b));
    gradients_accumulator<B> acc;
    const auto call = [&](const gradients_params<B>& grads, int times) {
      for (int k = 0; k < times; ++k) acc.accumulate_with_dtype(params, grads, float_dtype::f32);
    };
    call(viewed, 4);
    CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 4)));
    CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 4)));

    viewed.insert_or_assign("a", backend_fixture<B>::view_of(tens_a));  // re-seated
    call(viewed, 3);
    CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 34)));
    {
      auto copy = std::make_unique<gradients_params<B>>(viewed);  // same versions, other entries
      viewed.insert_or_assign("a", backend_fixture<B>::view_of(ones_a));
      call(*copy, 2);
      copy.reset();
      call(viewed, 2);
    }
    CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 56)));
    CHECK(values_of<float>(acc.pending(), "b") == as<float>(multiples(shape_b, 11)));

    {  // a copy of the accumulator adds into its own tensors, not the original's
      gradients_accumulator<B> copied = acc;
      copied.accumulate_with_dtype(params, viewed, float_dtype::f32);
      CHECK(values_of<float>(copied.pending(), "a") == as<float>(multiples(shape_a, 57)));
      CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 56)));
      gradients_accumulator<B> moved = std::move(copied);
      moved.accumulate_with_dtype(params, viewed, float_dtype::f32);
      CHECK(values_of<float>(moved.pending(), "a") == as<float>(multiples(shape_a, 58)));
    }
    const flat_gradients<B> taken = acc.grads();  // a new buffer from here on
    call(viewed, 3);
    CHECK(values_of<float>(taken, "a") == as<float>(multiples(shape_a, 56)));
    CHECK(values_of<float>(acc.pending(), "a") == as<float>(multiples(shape_a, 3)));

    for (int k = 0; k < 3; ++k) acc.accumulate_with_dtype(params, viewed, float_dtype::f64);  // converted
    CHECK(values_of<double>(acc.pending(), "a") == as<double>(multiples(shape_a, 6)));
    CHECK(values_of<double>(acc.pending(), "b") == as<double>(multiples(shape_b, 6)));
    acc.accumulate_scaled(params, viewed, 0.5, float_dtype::f64);
    CHECK(values_of<double>(acc.pending(), "a") == as<double>(multiples(shape_a, 6.5)));
  }
}

TEST_SUITE_END();
