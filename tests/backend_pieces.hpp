#pragma once
/// @file
/// @brief A minimal backend assembled from one struct per required piece, so that tests can
/// leave out (or replace) exactly one piece and see what the library says about it.
///
/// `minimal_backend` has every piece of `tensor_backend`, `serializable_backend` adds the two
/// row-major functions, and `missing_*` / `*_instead` lack or break one piece each. The storage
/// and arithmetic are the test-only `vector_backend`'s; the pieces only forward to it.
/// static_concepts.cpp asserts which of these types are backends; backend_diagnostic.cpp hands
/// each broken one to the library and must fail to compile with a message naming the piece.

#include <cstdint>
#include <span>
#include <type_traits>

#include <gradaccum/backend.hpp>
#include <gradaccum/shape.hpp>
#include <gradaccum/type_list.hpp>

#include "test_backend.hpp"

namespace gradaccum::test::pieces {

template <class T>
using tensor_type = vector_backend::tensor<T>;

struct device_type_piece {
  using device_type = vector_backend::device_type;
};
struct element_types_piece {
  using element_types = type_list<float, double>;
};
struct tensor_piece {
  template <class T>
  using tensor = tensor_type<T>;
};
struct shape_piece {
  template <class T>
  static tensor_shape shape(const tensor_type<T>& t) noexcept {
    return vector_backend::shape(t);
  }
};
struct device_piece {
  template <class T>
  static vector_backend::device_type device(const tensor_type<T>& t) noexcept {
    return vector_backend::device(t);
  }
};
struct add_scaled_piece {
  template <class W, class T>
  static void add_scaled(std::span<W> acc, const tensor_type<T>& g, W scale) noexcept {
    vector_backend::add_scaled(acc, g, scale);
  }
};
struct map_piece {
  template <class W>
  static vector_backend::view<W> map(std::span<const W> values, const tensor_shape& shape,
                                     const vector_backend::device_type& device) noexcept {
    return vector_backend::map(values, shape, device);
  }
};
struct convert_piece {
  template <class W, class T>
  static tensor_type<W> convert(const tensor_type<T>& t) {
    return vector_backend::convert<W>(t);
  }
};
struct to_row_major_piece {
  template <class T>
  static void to_row_major(const tensor_type<T>& t, std::span<T> out) {
    vector_backend::to_row_major(t, out);
  }
};
struct from_row_major_piece {
  template <class T>
  static tensor_type<T> from_row_major(std::span<const T> values, const tensor_shape& shape,
                                       const vector_backend::device_type& device) {
    return vector_backend::from_row_major(values, shape, device);
  }
};

/// Stands where a left-out piece was (one distinct empty base per piece).
template <class Piece>
struct left_out {};

/// Derives from every piece but `Omitted`.
template <class Omitted, class... Pieces>
struct assembled_without : std::conditional_t<std::is_same_v<Omitted, Pieces>, left_out<Pieces>, Pieces>... {};

template <class Omitted>
using backend_without =
    assembled_without<Omitted, device_type_piece, element_types_piece, tensor_piece, shape_piece, device_piece,
                      add_scaled_piece, map_piece, convert_piece, to_row_major_piece, from_row_major_piece>;

/// A broken replacement for one piece: the backend has every other piece and `Replacement`.
template <class Replaced, class Replacement>
struct backend_replacing : backend_without<Replaced>, Replacement {};

// Replacements that keep a piece's name but break its requirement.
struct incomparable_device {
  incomparable_device(int /*device*/) {}  // NOLINT(google-explicit-constructor): device() returns int
};
struct incomparable_device_type_piece {
  using device_type = incomparable_device;
};
struct float_only_element_types_piece {
  using element_types = type_list<float>;
};
struct unknown_element_types_piece {  // std::uint16_t has no element_dtype: is it F16 or BF16?
  using element_types = type_list<std::uint16_t, float, double>;
};
struct throwing_add_scaled_piece {  // not noexcept: accumulation commits after validating, it cannot throw
  template <class W, class T>
  static void add_scaled(std::span<W> acc, const tensor_type<T>& g, W scale) {
    vector_backend::add_scaled(acc, g, scale);
  }
};
/// Declares views, but no other piece accepts them.
struct unsupported_view_piece {
  template <class T>
  using view = vector_backend::view<T>;
};

}  // namespace gradaccum::test::pieces

namespace gradaccum::test {

/// Every piece of `serializable_backend` (so also of `tensor_backend`).
using minimal_backend = pieces::backend_without<void>;

using missing_device_type = pieces::backend_without<pieces::device_type_piece>;
using missing_element_types = pieces::backend_without<pieces::element_types_piece>;
using missing_tensor = pieces::backend_without<pieces::tensor_piece>;
using missing_shape = pieces::backend_without<pieces::shape_piece>;
using missing_device = pieces::backend_without<pieces::device_piece>;
using missing_add_scaled = pieces::backend_without<pieces::add_scaled_piece>;
using missing_map = pieces::backend_without<pieces::map_piece>;
using missing_convert = pieces::backend_without<pieces::convert_piece>;
using missing_to_row_major = pieces::backend_without<pieces::to_row_major_piece>;
using missing_from_row_major = pieces::backend_without<pieces::from_row_major_piece>;

using incomparable_device_type_instead =
    pieces::backend_replacing<pieces::device_type_piece, pieces::incomparable_device_type_piece>;
using float_only_element_types_instead =
    pieces::backend_replacing<pieces::element_types_piece, pieces::float_only_element_types_piece>;
using unknown_element_types_instead =
    pieces::backend_replacing<pieces::element_types_piece, pieces::unknown_element_types_piece>;
using throwing_add_scaled_instead =
    pieces::backend_replacing<pieces::add_scaled_piece, pieces::throwing_add_scaled_piece>;
/// `backend_without<void>` leaves nothing out: it only adds the view declaration.
using unsupported_view_instead = pieces::backend_replacing<void, pieces::unsupported_view_piece>;

}  // namespace gradaccum::test
