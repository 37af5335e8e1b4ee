#pragma once
/// @file
/// @brief The variant that holds one gradient of any supported element type, owned or viewed,
/// and the storage whose elements (the gradients) never move.

#include <algorithm>
#include <array>
#include <cstddef>
#include <iterator>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "gradaccum/backend.hpp"
#include "gradaccum/device_buffers.hpp"
#include "gradaccum/type_list.hpp"

namespace gradaccum::detail {

/// Holds a view. Views of caller memory (such as `Eigen::Map`) are often not assignable;
/// this re-seats instead, so the variant that holds them stays a regular type.
template <class V>
struct view_slot {
  V view;

  explicit view_slot(V v) noexcept(std::is_nothrow_move_constructible_v<V>) : view(std::move(v)) {}
  view_slot(const view_slot&) = default;
  view_slot(view_slot&&) noexcept = default;
  view_slot& operator=(const view_slot& other) noexcept(std::is_nothrow_copy_constructible_v<V>) {
    if (this != &other) {
      std::destroy_at(&view);
      std::construct_at(&view, other.view);
    }
    return *this;
  }
  view_slot& operator=(view_slot&& other) noexcept { return *this = static_cast<const view_slot&>(other); }
  ~view_slot() = default;
};

template <class X>
constexpr const X& unwrap(const X& x) noexcept {
  return x;
}
template <class V>
constexpr const V& unwrap(const view_slot<V>& slot) noexcept {
  return slot.view;
}

/// Calls `f` with the tensor or view held by `value` (never with the slot wrapping a view).
template <class F, class Variant>
decltype(auto) visit_gradient(F&& f, const Variant& value) {
  return std::visit([&](const auto& alternative) -> decltype(auto) { return f(unwrap(alternative)); }, value);
}

template <class B, class List, bool Views = has_views<B>>
struct gradient_variant;
template <class B, class... Ts>
struct gradient_variant<B, type_list<Ts...>, false> {
  using type = std::variant<typename B::template tensor<Ts>...>;
};
template <class B, class... Ts>
struct gradient_variant<B, type_list<Ts...>, true> {
  using type = std::variant<typename B::template tensor<Ts>..., view_slot<typename B::template view<Ts>>...>;
};

/// Owned tensors of every element type, then (if the backend has them) views of every type.
template <class B>
using gradient_variant_t = typename gradient_variant<B, typename B::element_types>::type;

template <class B, class X, class List>
struct element_of_impl {
  using type = void;
};
template <class B, class X, class T, class... Ts>
struct element_of_impl<B, X, type_list<T, Ts...>> {
  static constexpr bool matches = [] {
    if constexpr (has_views<B>) {
      return std::is_same_v<X, typename B::template tensor<T>> || std::is_same_v<X, typename B::template view<T>>;
    } else {
      return std::is_same_v<X, typename B::template tensor<T>>;
    }
  }();
  using type = std::conditional_t<matches, T, typename element_of_impl<B, X, type_list<Ts...>>::type>;
};

/// The element type of a gradient alternative X (a tensor<T> or view<T> of B), else void.
template <class B, class X>
using element_of = typename element_of_impl<B, std::remove_cvref_t<X>, typename B::element_types>::type;

template <class B, class X>
concept is_gradient_alternative = !std::is_void_v<element_of<B, X>>;

/// The dtypes of a list of element types, in order.
template <class... Ts>
constexpr std::array<float_dtype, sizeof...(Ts)> dtypes_of(type_list<Ts...> /*types*/) noexcept {
  return {dtype_of<Ts>...};
}

/// The backend element type whose dtype is `D`, else void.
template <class List, float_dtype D>
struct element_with_dtype {
  using type = void;
};
template <class T, class... Ts, float_dtype D>
struct element_with_dtype<type_list<T, Ts...>, D> {
  using type = std::conditional_t<dtype_of<T> == D, T, typename element_with_dtype<type_list<Ts...>, D>::type>;
};

/// @brief A sequence whose elements never move once constructed: each lives in its own heap
/// node and the sequence holds pointers, so growing, erasing, clearing and moving the sequence
/// move pointers only. Holding gradients, it keeps the library from relying on a tensor's move
/// being truly noexcept: xtensor 0.24 declares its move noexcept, but moving a shape above
/// rank 4 allocates, so a vector that relocated its tensors under memory pressure terminated.
///
/// `reserve(n)` allocates the nodes for n elements up front, in one block, so `push_back`
/// within them only constructs (it throws only if T's move constructor does), and growing
/// geometrically allocates O(log n) times.
template <class T>
class stable_vector {
 public:
  template <bool Const>
  class basic_iterator {
   public:
    using iterator_category = std::random_access_iterator_tag;
    using value_type = T;
    using difference_type = std::ptrdiff_t;
    using pointer = std::conditional_t<Const, const T*, T*>;
    using reference = std::conditional_t<Const, const T&, T&>;

    basic_iterator() noexcept = default;
    explicit basic_iterator(T* const* at) noexcept : at_(at) {}
    operator basic_iterator<true>() const noexcept { return basic_iterator<true>(at_); }  // NOLINT: as pointers

    reference operator*() const noexcept { return **at_; }
    pointer operator->() const noexcept { return *at_; }
    reference operator[](difference_type n) const noexcept { return *at_[n]; }
    basic_iterator& operator++() noexcept { return ++at_, *this; }
    basic_iterator operator++(int) noexcept { return basic_iterator(at_++); }
    basic_iterator& operator--() noexcept { return --at_, *this; }
    basic_iterator operator--(int) noexcept { return basic_iterator(at_--); }
    basic_iterator& operator+=(difference_type n) noexcept { return at_ += n, *this; }
    basic_iterator& operator-=(difference_type n) noexcept { return at_ -= n, *this; }
    friend basic_iterator operator+(basic_iterator it, difference_type n) noexcept { return it += n; }
    friend basic_iterator operator+(difference_type n, basic_iterator it) noexcept { return it += n; }
    friend basic_iterator operator-(basic_iterator it, difference_type n) noexcept { return it -= n; }
    friend difference_type operator-(basic_iterator a, basic_iterator b) noexcept { return a.at_ - b.at_; }
    friend bool operator==(basic_iterator a, basic_iterator b) noexcept { return a.at_ == b.at_; }
    friend auto operator<=>(basic_iterator a, basic_iterator b) noexcept { return a.at_ <=> b.at_; }

   private:
    T* const* at_ = nullptr;
  };
  using iterator = basic_iterator<false>;
  using const_iterator = basic_iterator<true>;

  stable_vector() noexcept = default;
  stable_vector(const stable_vector& other) : stable_vector() {
    reserve(other.size_);
    for (const T& value : other) push_back(value);
  }
  stable_vector(stable_vector&& other) noexcept
      : nodes_(std::move(other.nodes_)), blocks_(std::move(other.blocks_)), size_(std::exchange(other.size_, 0)) {}
  stable_vector& operator=(const stable_vector& other) {
    stable_vector copy(other);
    swap(copy);
    return *this;
  }
  stable_vector& operator=(stable_vector&& other) noexcept {
    stable_vector taken(std::move(other));
    swap(taken);
    return *this;
  }
  ~stable_vector() {
    clear();
    for (const block& b : blocks_) std::allocator<T>().deallocate(b.nodes, b.count);
  }
  void swap(stable_vector& other) noexcept {
    nodes_.swap(other.nodes_);
    blocks_.swap(other.blocks_);
    std::swap(size_, other.size_);
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// Elements that fit in the nodes allocated so far.
  [[nodiscard]] std::size_t capacity() const noexcept { return nodes_.size(); }
  T& operator[](std::size_t i) noexcept { return *nodes_[i]; }
  const T& operator[](std::size_t i) const noexcept { return *nodes_[i]; }
  T& back() noexcept { return *nodes_[size_ - 1]; }
  iterator begin() noexcept { return iterator(nodes_.data()); }
  iterator end() noexcept { return iterator(nodes_.data() + size_); }
  const_iterator begin() const noexcept { return const_iterator(nodes_.data()); }
  const_iterator end() const noexcept { return const_iterator(nodes_.data() + size_); }
  const_iterator cbegin() const noexcept { return begin(); }
  const_iterator cend() const noexcept { return end(); }

  /// Allocates nodes for `count` elements; nothing changes if that fails.
  void reserve(std::size_t count) {
    if (count <= nodes_.size()) return;
    nodes_.reserve(count);
    blocks_.reserve(blocks_.size() + 1);
    const std::size_t added = count - nodes_.size();
    T* const nodes = std::allocator<T>().allocate(added);
    blocks_.push_back({nodes, added});  // cannot throw: both vectors have room
    for (std::size_t i = 0; i < added; ++i) nodes_.push_back(nodes + i);
  }

  /// Precondition: `size() < capacity()`.
  void push_back(T&& value) noexcept(std::is_nothrow_move_constructible_v<T>) {
    std::construct_at(nodes_[size_], std::move(value));
    ++size_;
  }
  /// Constructs an element in the next spare node: `make(node)` must construct a T at `node`
  /// (placement new, so that a prvalue initializes the node itself and nothing is moved).
  /// Precondition: `size() < capacity()`. If `make` throws, nothing changed.
  template <class Make>
  void emplace_back_with(Make&& make) {
    std::forward<Make>(make)(static_cast<void*>(nodes_[size_]));
    ++size_;
  }

  /// Replaces the `i`-th element by one `make` constructs in a spare node (see
  /// `emplace_back_with`), so the old one stays whole if that throws. Precondition:
  /// `size() < capacity()`.
  template <class Make>
  void replace_with(std::size_t i, Make&& make) {
    std::forward<Make>(make)(static_cast<void*>(nodes_[size_]));
    std::destroy_at(nodes_[i]);
    std::swap(nodes_[i], nodes_[size_]);
  }

  /// Copies straight into the node (a copy, then a move, would move the tensor).
  void push_back(const T& value) {
    std::construct_at(nodes_[size_], value);
    ++size_;
  }

  /// Destroys the `i`-th element; the later ones move up (their pointers do).
  void erase(std::size_t i) noexcept {
    std::destroy_at(nodes_[i]);
    std::rotate(nodes_.begin() + static_cast<std::ptrdiff_t>(i), nodes_.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                nodes_.begin() + static_cast<std::ptrdiff_t>(size_));
    --size_;
  }

  void clear() noexcept {
    for (std::size_t i = 0; i < size_; ++i) std::destroy_at(nodes_[i]);
    size_ = 0;
  }

 private:
  struct block {
    T* nodes;
    std::size_t count;
  };

  std::vector<T*> nodes_;  // the first size_ hold elements; the rest are allocated and spare
  std::vector<block> blocks_;
  std::size_t size_ = 0;
};

/// Whether moving `t` cannot allocate: the backend's `moves_without_allocating(t)` where it has
/// one, else true. A tensor for which it is false is copied into its entry instead of moved
/// (the copy may throw `std::bad_alloc`; the move, declared noexcept, would terminate).
template <class B, class X>
bool moves_without_allocating(const X& x) noexcept {
  if constexpr (requires { B::moves_without_allocating(x); }) {
    return B::moves_without_allocating(x);
  } else {
    return true;
  }
}

/// Reserves room for `count` elements, growing geometrically (see `reserve_geometric` for
/// vectors): nodes are allocated for twice the elements at a time.
template <class T>
void reserve_geometric(stable_vector<T>& v, std::size_t count) {
  if (count > v.capacity()) v.reserve(std::max(count, 2 * v.capacity()));
}

/// Where an add writes: a host segment, or for a `device_buffers_backend` a device buffer and
/// the segment's offset in it.
template <class B, class W>
struct device_target {
  typename B::template buffer<W>* buffer;
  std::size_t offset;
};
template <class B, class W>
using add_target = std::conditional_t<device_buffers_backend<B>, device_target<B, W>, std::span<W>>;

/// The adds of one stored alternative into F32 and F64 sums. An entry takes them where its
/// type is known (at insert), so a program instantiates the kernels of the element types it
/// inserts, not of every type the backend supports.
template <class B>
struct gradient_adds {
  template <class W>
  using add = void (*)(add_target<B, W>, const gradient_variant_t<B>&, W) noexcept;
  add<float> f32;
  add<double> f64;
};

template <class B, class Stored, class W>
void add_stored(add_target<B, W> acc, const gradient_variant_t<B>& value, W scale) noexcept {
  if constexpr (device_buffers_backend<B>) {
    B::add_scaled(*acc.buffer, acc.offset, unwrap(*std::get_if<Stored>(&value)), scale);
  } else {
    B::add_scaled(acc, unwrap(*std::get_if<Stored>(&value)), scale);
  }
}

template <class B, class Stored>
inline constexpr gradient_adds<B> adds_of{&add_stored<B, Stored, float>, &add_stored<B, Stored, double>};

}  // namespace gradaccum::detail
