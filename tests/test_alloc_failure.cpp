/// @file
/// @brief The strong guarantee when memory runs out: every mutating call either completes or
/// leaves values and counters exactly as they were, whichever allocation fails; and once every
/// parameter has its pending tensor, accumulating allocates nothing.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include <gradaccum/gradaccum.hpp>

#include "alloc_failure.hpp"
#include "backend_fixtures.hpp"
#include "test_helpers.hpp"

namespace {

using namespace gradaccum;
using namespace gradaccum::test;

const tensor_shape shape_a{2, 3};
const tensor_shape shape_b{3, 2};

template <class B, class T = float>
gradients_params<B> gradients_ab(double factor) {
  gradients_params<B> grads;
  grads.insert("a", make_tensor<B, T>(shape_a, multiples(shape_a, factor)));
  grads.insert("b", make_tensor<B, T>(shape_b, multiples(shape_b, -factor)));
  return grads;
}

template <class B>
parameter_set<B> parameters_ab() {
  return make_parameters<B>({{"a", shape_a}, {"b", shape_b}, {"c", {1, 1}}});
}

}  // namespace

TEST_SUITE_BEGIN("alloc_failure");

TEST_CASE_TEMPLATE("accumulating allocates nothing once every parameter has its pending tensor", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = parameters_ab<B>();
  const auto owned = gradients_ab<B>(1);
  weighted_gradients_accumulator<B> acc(float_dtype::f32, 2.0);
  acc.accumulate_sum(params, owned, 3);  // creates the pending tensors
  CHECK(allocations_of([&] { acc.accumulate_sum(params, owned, 3); }) == 0);
  CHECK(allocations_of([&] { acc.accumulate_mean(params, owned, 5); }) == 0);
  CHECK(allocations_of([&] { acc.accumulate_sum(params, owned, 0); }) == 0);
  std::uint64_t microbatches = 4;
  for_each_16bit_type<B>([&]<class T>() {
    const auto half = gradients_ab<B, T>(1);
    CHECK(allocations_of([&] { acc.accumulate_mean(params, half, 2); }) == 0);
    ++microbatches;
  });
  if constexpr (detail::has_views<B>) {
    const auto a = make_tensor<B, float>(shape_a, multiples(shape_a, 1));
    const auto b = make_tensor<B, double>(shape_b, multiples(shape_b, 1));
    gradients_params<B> viewed;
    viewed.insert("a", backend_fixture<B>::view_of(a));
    viewed.insert("b", backend_fixture<B>::view_of(b));
    CHECK(allocations_of([&] { acc.accumulate_sum(params, viewed, 1); }) == 0);
    CHECK(allocations_of([&] { acc.accumulate_mean(params, viewed, 4); }) == 0);
    // Reused for the next microbatch: views re-seated under the same ids.
    CHECK(allocations_of([&] {
            viewed.insert_or_assign("a", backend_fixture<B>::view_of(a));
            viewed.insert_or_assign("b", backend_fixture<B>::view_of(b));
            acc.accumulate_sum(params, viewed, 1);
          }) == 0);
    microbatches += 3;
  }
  CHECK(acc.state().microbatches == microbatches);  // every call above was accepted

  gradients_accumulator<B> plain;
  plain.accumulate_with_dtype(params, owned, float_dtype::f64);
  CHECK(allocations_of([&] { plain.accumulate_with_dtype(params, owned, float_dtype::f64); }) == 0);
}

TEST_CASE_TEMPLATE("an allocation failure in accumulate_sum leaves the window as it was", B, GRADACCUM_TEST_BACKENDS) {
  const auto params = parameters_ab<B>();
  weighted_gradients_accumulator<B> acc(float_dtype::f64, 2.0);
  const auto grads = gradients_ab<B>(1);
  const auto unchanged_from = [&](const weighted_gradients_record& before) {
    return [&acc, before] { GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before); };
  };

  // The first microbatch creates every pending tensor.
  const auto empty = acc.try_to_record();
  CHECK(fail_each_allocation([&] { acc.accumulate_sum(params, grads, 3); }, unchanged_from(empty)) > 0);
  CHECK(acc.state().microbatches == 1);

  // A new id joins a window that already has pending tensors.
  const auto before = acc.try_to_record();
  gradients_params<B> c;
  c.insert("c", make_tensor<B, float>({1, 1}, {5}));
  fail_each_allocation([&] { acc.accumulate_mean(params, c, 2); }, unchanged_from(before));
  CHECK(acc.state().microbatches == 2);
  CHECK(acc.pending().size() == 3);

  // The same window against a copy of the parameter set (ids resolved afresh).
  const auto copied_params = params;
  const auto before_copy = acc.try_to_record();
  fail_each_allocation([&] { acc.accumulate_sum(copied_params, grads, 1); }, unchanged_from(before_copy));
  CHECK(acc.state().microbatches == 3);
}

TEST_CASE_TEMPLATE("pending tensors of every rank survive an allocation failure while a new id joins", B,
                   GRADACCUM_TEST_BACKENDS) {
  // Growing the pending storage must not move tensors: xtensor 0.24's noexcept move of a shape
  // above rank 4 allocates, and a failure there terminated.
  for (std::size_t rank = 0; rank <= max_rank; ++rank) {
    std::vector<std::uint64_t> dims(rank, 1);
    if (rank > 0) dims[0] = 2;
    const tensor_shape shape{std::span<const std::uint64_t>(dims)};
    if (!tensors_can_have<B>(shape)) continue;
    CAPTURE(shape.to_string());
    const auto device = backend_fixture<B>::device();
    parameter_set<B> params;
    params.add("big", shape, device);
    for (int i = 0; i < 4; ++i) params.add("new" + std::to_string(i), tensor_shape{1, 1}, device);
    gradients_params<B> big;
    big.insert("big", make_tensor<B, float>(shape, multiples(shape, 1)));
    weighted_gradients_accumulator<B> acc(float_dtype::f32, 1.0);
    acc.accumulate_sum(params, big, 1);
    for (int i = 0; i < 4; ++i) {  // each joins a window whose storage must grow
      gradients_params<B> fresh;
      fresh.insert("new" + std::to_string(i), make_tensor<B, float>({1, 1}, {2}));
      const auto before = acc.try_to_record();
      fail_each_allocation([&] { acc.accumulate_sum(params, fresh, 1); },
                           [&] { GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before); });
    }
    CHECK(acc.pending().size() == 5);
  }
}

TEST_CASE_TEMPLATE("an allocation failure while converting pending sums to another dtype changes nothing", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = parameters_ab<B>();
  gradients_accumulator<B> acc;
  acc.accumulate(params, gradients_ab<B>(0.25));  // F32 pending tensors
  const auto before = acc.try_to_record();
  gradients_params<B> only_a;
  only_a.insert("a", make_tensor<B, float>(shape_a, multiples(shape_a, 1)));
  fail_each_allocation([&] { acc.accumulate_with_dtype(params, only_a, float_dtype::f64); },
                       [&] { GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before); });
  CHECK(acc.pending().dtype("a") == std::optional(float_dtype::f64));
  CHECK(acc.pending().dtype("b") == std::optional(float_dtype::f64));
}

TEST_CASE_TEMPLATE("an allocation failure in load_record, from_accumulator or finish_mean changes nothing", B,
                   GRADACCUM_TEST_BACKENDS) {
  const auto params = parameters_ab<B>();
  weighted_gradients_accumulator<B> source(float_dtype::f32, 4.0);
  source.accumulate_sum(params, gradients_ab<B>(1), 2);
  const weighted_gradients_record checkpoint = source.try_to_record();

  weighted_gradients_accumulator<B> acc(float_dtype::f64, 1.0);
  acc.accumulate_mean(params, gradients_ab<B, double>(7), 1);
  const auto before = acc.try_to_record();
  fail_each_allocation([&] { acc.load_record(params, checkpoint); },
                       [&] { GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), before); });
  GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), checkpoint);

  gradients_accumulator<B> sums;
  sums.load_record(params, checkpoint.gradients);
  const auto sums_before = sums.try_to_record();
  std::optional<weighted_gradients_accumulator<B>> restored;
  fail_each_allocation(
      [&] {
        restored.emplace(
            weighted_gradients_accumulator<B>::from_accumulator(params, std::move(sums), checkpoint.state));
      },
      [&] { GRADACCUM_CHECK_SAME_BITS(sums.try_to_record(), sums_before); });
  REQUIRE(restored.has_value());
  GRADACCUM_CHECK_SAME_BITS(restored->try_to_record(), checkpoint);

  std::optional<accumulated_gradients<B>> finished;
  fail_each_allocation([&] { finished.emplace(acc.finish_mean(params)); },
                       [&] { GRADACCUM_CHECK_SAME_BITS(acc.try_to_record(), checkpoint); });
  REQUIRE(finished.has_value());
  CHECK(values_of<float>(finished->gradients, "a") == as<float>(multiples(shape_a, 0.125)));
}

TEST_CASE_TEMPLATE("an allocation failure in parameter_set::add changes nothing", B, GRADACCUM_TEST_BACKENDS) {
  parameter_set<B> params;
  const auto parameter = filled<B, float>(shape_a, 0);
  // Enough parameters to grow every container a few times.
  for (int i = 0; i < 20; ++i) {
    const std::string id = "layer" + std::to_string(i) + ".weight.with.a.long.name";
    const std::size_t size_before = params.size();
    fail_each_allocation([&] { params.add(id, parameter); },
                         [&] {
                           CHECK(params.size() == size_before);
                           CHECK_FALSE(params.contains(id));
                           for (std::size_t k = 0; k < params.size(); ++k)
                             CHECK(params.find(params[k].id) == std::optional(k));
                         });
    CHECK(params.find(id) == std::optional(size_before));
  }
}

TEST_CASE_TEMPLATE("an allocation failure in gradients_params::insert changes nothing", B, GRADACCUM_TEST_BACKENDS) {
  gradients_params<B> grads;
  const auto tensor = make_tensor<B, float>(shape_a, multiples(shape_a, 1));
  const auto unchanged = [&](std::size_t size) {
    return [&grads, size] {
      CHECK(grads.size() == size);
      for (const auto& entry : grads) {
        CHECK(values_of<float>(grads, entry.id) == as<float>(multiples(shape_a, 1)));
      }
    };
  };
  for (int i = 0; i < 20; ++i) {
    const std::string id = "layer" + std::to_string(i) + ".weight.with.a.long.name";
    fail_each_allocation([&] { grads.insert(id, tensor); }, unchanged(grads.size()));
    CHECK(grads.contains(id));
  }
  SUBCASE("replacing a gradient") {
    const auto other = make_tensor<B, float>(shape_a, multiples(shape_a, 10));
    fail_each_allocation([&] { grads.insert_or_assign("layer3.weight.with.a.long.name", other); },
                         unchanged(grads.size()));
    CHECK(values_of<float>(grads, "layer3.weight.with.a.long.name") == as<float>(multiples(shape_a, 10)));
  }
}

TEST_CASE_TEMPLATE("building a parameter set or a microbatch's gradients allocates amortized O(1) per entry", B,
                   GRADACCUM_TEST_BACKENDS) {
  // Models have thousands of parameters: appending must not reallocate every container each time.
  constexpr int entries = 2000;
  std::vector<std::string> ids;  // short enough to be stored inline, so only containers allocate
  std::vector<tensor_t<B, float>> tensors;
  ids.reserve(entries);
  tensors.reserve(entries);
  for (int i = 0; i < entries; ++i) {
    ids.push_back("p" + std::to_string(i));
    tensors.push_back(filled<B, float>({1, 1}, 1));
  }
  const auto device = backend_fixture<B>::device();

  parameter_set<B> params;
  const std::size_t set_allocations = allocations_of([&] {
    for (const std::string& id : ids) params.add(id, tensor_shape{1, 1}, device);
  });
  CHECK(params.size() == entries);
  CHECK(set_allocations < 64);

  gradients_params<B> grads;
  const std::size_t grads_allocations = allocations_of([&] {
    for (int i = 0; i < entries; ++i) grads.insert(ids[i], std::move(tensors[i]));
  });
  CHECK(grads.size() == entries);
  CHECK(grads_allocations < 64);
}

TEST_SUITE_END();
