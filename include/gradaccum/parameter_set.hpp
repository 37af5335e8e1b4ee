#pragma once
/// @file
/// @brief `parameter_set<B>`: ids, shapes and devices of a model's trainable parameters.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradaccum/backend.hpp"
#include "gradaccum/detail/gradient_input.hpp"
#include "gradaccum/detail/id_index.hpp"
#include "gradaccum/detail/variant.hpp"
#include "gradaccum/error.hpp"
#include "gradaccum/shape.hpp"

namespace gradaccum {

/// @brief The trainable parameters of a model, in the order they were added.
///
/// Each parameter gets a dense position when added; gradients are resolved to positions
/// (checking the id at the expected position first, hashing only on a miss), so accumulating
/// a model's gradients does not hash thousands of strings per call. Adding an id a second
/// time declares a tied parameter: it is counted once, and its geometry must agree.
template <class B>
class parameter_set {
  static_assert(detail::check_backend<B>());

 public:
  using device_type = typename B::device_type;

  struct parameter {
    std::string id;
    tensor_shape shape;
    device_type device;
  };

  parameter_set() = default;
  // A copy is a different set (it may grow differently), so it gets its own identity.
  parameter_set(const parameter_set& other) : params_(other.params_), index_(other.index_) {}
  parameter_set(parameter_set&& other) noexcept
      : params_(std::move(other.params_)),
        index_(std::move(other.index_)),
        identity_(std::exchange(other.identity_, next_identity())) {}
  parameter_set& operator=(const parameter_set& other) {
    if (this != &other) *this = parameter_set(other);
    return *this;
  }
  parameter_set& operator=(parameter_set&& other) noexcept {
    params_ = std::move(other.params_);
    index_ = std::move(other.index_);
    identity_ = std::exchange(other.identity_, next_identity());
    return *this;
  }
  ~parameter_set() = default;

  /// @brief Adds the parameter `id` with the shape and device of `tensor`: anything
  /// `gradients_params::insert` takes (see `<gradaccum/detail/gradient_input.hpp>`).
  /// @returns its position. Re-adding an id with the same geometry returns the first position.
  /// @throws error(errc::parameter_mismatch) when a tied id is re-added with other geometry, or
  /// for a shape the backend cannot represent.
  template <class X>
  std::size_t add(std::string_view id, X&& tensor) {
    // Only its geometry is read, now, so even a temporary is viewed (an lvalue) rather than
    // copied: a temporary Eigen::VectorXf is [n] like a variable, not the n x 1 matrix of a copy.
    if constexpr (detail::gradient_input<B, const std::remove_reference_t<X>&>) {
      return detail::visit_input<B>(
          [&](const auto& input) {
            const auto& geometry = detail::uncopied(input);  // what a gradient would copy is not copied
            return add(id, detail::shape_of<B>(geometry, id), B::device(geometry));
          },
          detail::as_alternative<B>(id, std::as_const(tensor)));
    } else {
      detail::reject_input<B, X>();
      return 0;
    }
  }

  /// @brief Adds the parameter `id` with explicit geometry; same rules as above.
  std::size_t add(std::string_view id, const tensor_shape& shape, const device_type& device);

  /// @brief Position of `id`, if present.
  [[nodiscard]] std::optional<std::size_t> find(std::string_view id) const noexcept {
    return index_.find(id, key_of());
  }

  /// @brief Position of `id`, checking `hint` first: gradients given in parameter order
  /// resolve with one string comparison each.
  [[nodiscard]] std::optional<std::size_t> find(std::string_view id, std::size_t hint) const noexcept {
    if (hint < params_.size() && params_[hint].id == id) return hint;
    return find(id);
  }

  [[nodiscard]] bool contains(std::string_view id) const noexcept { return find(id).has_value(); }
  [[nodiscard]] std::size_t size() const noexcept { return params_.size(); }
  [[nodiscard]] bool empty() const noexcept { return params_.empty(); }
  [[nodiscard]] const parameter& operator[](std::size_t position) const noexcept { return params_[position]; }
  [[nodiscard]] auto begin() const noexcept { return params_.begin(); }
  [[nodiscard]] auto end() const noexcept { return params_.end(); }

  /// @brief Distinguishes live sets: positions resolved against a set with the same identity
  /// stay valid (a set only ever appends).
  [[nodiscard]] std::uint64_t identity() const noexcept { return identity_; }

 private:
  auto key_of() const noexcept {
    return [this](std::size_t position) -> std::string_view { return params_[position].id; };
  }

  static std::uint64_t next_identity() noexcept { return detail::next_stamp(); }

  std::vector<parameter> params_;
  detail::id_index index_;
  std::uint64_t identity_ = next_identity();
};

// Defined outside the class, so that `GRADACCUM_EXTERN_TEMPLATES` keeps it out of the caller's file.
template <class B>
std::size_t parameter_set<B>::add(std::string_view id, const tensor_shape& shape, const device_type& device) {
  if (const auto position = find(id)) {
    const parameter& tied = params_[*position];
    if (!detail::same_shape<B>(tied.shape, shape)) {
      detail::fail(errc::parameter_mismatch,
                   {"tied parameter '", id, "' was added with shape ", tied.shape.dims(), " and again with shape ",
                    shape.dims(), "."},
                   id);
    }
    if (!(tied.device == device)) {
      detail::fail(errc::parameter_mismatch, {"tied parameter '", id, "' was added again on another device."}, id);
    }
    return *position;
  }
  parameter added{std::string(id), shape, device};
  detail::reserve_geometric(params_, params_.size() + 1);
  index_.reserve(params_.size() + 1, key_of());
  params_.push_back(std::move(added));  // cannot throw: capacity is reserved
  index_.insert(params_.size() - 1, params_.back().id);
  return params_.size() - 1;
}

}  // namespace gradaccum
