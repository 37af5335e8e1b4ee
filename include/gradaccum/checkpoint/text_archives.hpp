#pragma once
/// @file
/// @brief The JSON archives that checkpoint files are written and read with.
///
/// They write the document cereal's `JSONOutputArchive` writes (the same nodes, names and
/// version fields; numbers as the shortest text that reads back exactly), so cereal's
/// `JSONInputArchive` reads them too, and `json_input_archive` reads what cereal's JSON archive
/// writes. The library owns them because cereal's fail under memory pressure and on hostile
/// input:
///
/// - cereal's JSON archive finishes its document in a `noexcept` destructor, where RapidJSON
///   asserts (cereal makes that a throw, so `std::terminate`) when an exception left the
///   document unfinished. Here `finish()` completes the document and the destructor writes
///   nothing: a failed save leaves an unfinished document that the caller discards. Numbers are
///   formatted with `std::to_chars` into fixed buffers, and every write goes straight to the
///   stream buffer, whose exceptions propagate and whose short writes throw.
/// - RapidJSON's reader dereferences the null pointer of a failed `malloc`, recurses once per
///   nesting level, and keeps strings only up to their first NUL byte. `json_input_archive`
///   parses into standard containers (allocation failures throw `std::bad_alloc`), keeps every
///   byte of a string, reads numbers with `std::from_chars`, and bounds nesting by
///   `max_document_depth`.

#include <algorithm>
#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <cereal/cereal.hpp>

#include "gradaccum/error.hpp"

namespace gradaccum {

/// @brief Deepest nesting of objects and arrays a JSON checkpoint may have (records need 7);
/// the parser recurses once per level.
inline constexpr std::size_t max_document_depth = 32;

namespace detail {

/// Writes text to a stream buffer: what the buffer throws propagates, a short write throws.
class text_writer {
 public:
  explicit text_writer(std::ostream& stream) noexcept : buffer_(*stream.rdbuf()) {}

  void put(std::string_view text) {
    if (text.empty()) return;
    const auto size = static_cast<std::streamsize>(text.size());
    if (buffer_.sputn(text.data(), size) != size) throw cereal::Exception("failed to write the checkpoint document");
  }
  void put(char c) { put(std::string_view(&c, 1)); }
  void indent(std::size_t count, std::string_view unit) {
    for (std::size_t i = 0; i < count; ++i) put(unit);
  }

 private:
  std::streambuf& buffer_;
};

/// `value` as the shortest text that reads back to it; `"1024"` as `"1024.0"` when
/// `mark_real` (as RapidJSON writes doubles).
template <class T>
void put_number(text_writer& out, T value, bool mark_real) {
  std::array<char, 32> buffer{};
  const char* end = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value).ptr;
  const std::string_view text(buffer.data(), static_cast<std::size_t>(end - buffer.data()));
  out.put(text);
  if (mark_real && text.find_first_of(".eEn") == std::string_view::npos) out.put(".0");
}

template <class T>
concept text_leaf = std::is_arithmetic_v<T> || std::is_same_v<T, std::string>;

// ---- JSON output -----------------------------------------------------------------------------

/// @brief Writes the JSON document cereal's `JSONOutputArchive` writes (RapidJSON's pretty
/// layout, four spaces per level). Call `finish()` after the last value.
class json_output_archive : public cereal::OutputArchive<json_output_archive>, public cereal::traits::TextArchive {
 public:
  explicit json_output_archive(std::ostream& stream) : OutputArchive(this), out_(stream) {
    nodes_.push_back({node_state::start_object, 0});
  }

  /// Closes the outermost object: the document is complete.
  void finish() { finishNode(); }

  void startNode() {
    writeName();
    nodes_.push_back({node_state::start_object, 0});
  }
  void finishNode() {
    switch (nodes_.back().state) {
      case node_state::start_array: open('['); [[fallthrough]];
      case node_state::in_array: close(']'); break;
      case node_state::start_object: open('{'); [[fallthrough]];
      case node_state::in_object: close('}'); break;
    }
    nodes_.pop_back();
  }
  void setNextName(const char* name) noexcept { next_name_ = name; }
  void makeArray() noexcept { nodes_.back().state = node_state::start_array; }

  void saveValue(const std::string& text) {
    writeName();
    string(text);
  }
  template <class T>
    requires std::is_arithmetic_v<T>
  void saveValue(T value) {
    writeName();
    prefix();
    put_number(out_, value, std::is_floating_point_v<T>);
  }

 private:
  enum class node_state : std::uint8_t { start_object, in_object, start_array, in_array };
  struct node {
    node_state state;
    std::size_t counter;  // names "value0", "value1", ... of unnamed members
  };
  struct level {
    bool array;
    std::size_t values;  // keys and values written in it
  };

  void writeName() {
    node& top = nodes_.back();
    if (top.state == node_state::start_array) {
      open('[');
      top.state = node_state::in_array;
    } else if (top.state == node_state::start_object) {
      open('{');
      top.state = node_state::in_object;
    }
    if (top.state == node_state::in_array) return;
    if (next_name_ != nullptr) {
      string(std::exchange(next_name_, nullptr));
    } else {
      string("value" + std::to_string(top.counter++));
    }
  }

  /// What comes before a key or value: a comma and a new line, or ": " after a key.
  void prefix() {
    if (levels_.empty()) return;
    level& top = levels_.back();
    if (!top.array && top.values % 2 == 1) {
      out_.put(": ");
    } else {
      if (top.values > 0) out_.put(',');
      out_.put('\n');
      out_.indent(levels_.size(), "    ");
    }
    ++top.values;
  }
  void open(char bracket) {
    prefix();
    out_.put(bracket);
    levels_.push_back({bracket == '[', 0});
  }
  void close(char bracket) {
    const bool empty = levels_.back().values == 0;
    levels_.pop_back();
    if (!empty) {
      out_.put('\n');
      out_.indent(levels_.size(), "    ");
    }
    out_.put(bracket);
  }
  void string(std::string_view text) {
    prefix();
    out_.put('"');
    constexpr std::string_view hex = "0123456789abcdef";
    std::size_t plain = 0;  // start of the bytes not written yet
    for (std::size_t i = 0; i < text.size(); ++i) {
      const auto byte = static_cast<unsigned char>(text[i]);
      if (byte >= 0x20 && byte != '"' && byte != '\\') continue;
      out_.put(text.substr(plain, i - plain));
      plain = i + 1;
      if (byte == '"' || byte == '\\') {
        out_.put('\\');
        out_.put(static_cast<char>(byte));
      } else {
        out_.put("\\u00");
        out_.put(hex[byte >> 4]);
        out_.put(hex[byte & 0xf]);
      }
    }
    out_.put(text.substr(plain));
    out_.put('"');
  }

  text_writer out_;
  std::vector<node> nodes_;
  std::vector<level> levels_;
  const char* next_name_ = nullptr;
};

template <class T>
  requires(!text_leaf<T>)
void prologue(json_output_archive& ar, const T& /*value*/) {
  ar.startNode();
}
template <class T>
  requires(!text_leaf<T>)
void epilogue(json_output_archive& ar, const T& /*value*/) {
  ar.finishNode();
}
template <class T>
void prologue(json_output_archive& /*ar*/, const cereal::NameValuePair<T>& /*pair*/) {}
template <class T>
void epilogue(json_output_archive& /*ar*/, const cereal::NameValuePair<T>& /*pair*/) {}
template <class T>
void prologue(json_output_archive& ar, const cereal::SizeTag<T>& /*size*/) {
  ar.makeArray();
}
template <class T>
void epilogue(json_output_archive& /*ar*/, const cereal::SizeTag<T>& /*size*/) {}
template <text_leaf T>
void prologue(json_output_archive& /*ar*/, const T& /*value*/) {}
template <text_leaf T>
void epilogue(json_output_archive& /*ar*/, const T& /*value*/) {}

template <class T>
void save(json_output_archive& ar, const cereal::NameValuePair<T>& pair) {
  ar.setNextName(pair.name);
  ar(pair.value);
}
template <class T>
void save(json_output_archive& /*ar*/, const cereal::SizeTag<T>& /*size*/) {}
template <text_leaf T>
void save(json_output_archive& ar, const T& value) {
  ar.saveValue(value);
}

// ---- JSON input ------------------------------------------------------------------------------

/// @brief A parsed JSON value.
struct json_value {
  enum class kind : std::uint8_t { null, boolean, number, string, array, object };
  kind type = kind::null;
  std::string text;               // a string's bytes, a number's text
  std::vector<std::string> keys;  // an object's member names
  std::vector<json_value> items;  // an object's member values, an array's elements
};

/// @brief Parses a whole JSON document (RFC 8259, one value and whitespace around it).
/// @throws error(errc::invalid_record) naming the problem and its byte offset.
class json_parser {
 public:
  explicit json_parser(std::string_view text) noexcept : text_(text) {}

  json_value parse() {
    json_value root;
    skip_space();
    value(root, 0);
    skip_space();
    if (at_ != text_.size()) fail_at("has bytes after its value");
    return root;
  }

 private:
  [[noreturn]] void fail_at(std::string_view problem) const {
    fail(errc::invalid_record, "checkpoint is not valid JSON: the document " + std::string(problem) + " (at byte " +
                                   std::to_string(at_) + ").");
  }
  [[nodiscard]] bool more() const noexcept { return at_ < text_.size(); }
  [[nodiscard]] char peek() const noexcept { return more() ? text_[at_] : '\0'; }
  void skip_space() noexcept {
    while (more() && (peek() == ' ' || peek() == '\n' || peek() == '\t' || peek() == '\r')) ++at_;
  }
  void expect(char c) {
    if (peek() != c) fail_at(std::string("lacks a '") + c + "'");
    ++at_;
  }

  void value(json_value& out, std::size_t depth) {
    switch (peek()) {
      case '{': return container(out, depth, json_value::kind::object, '}');
      case '[': return container(out, depth, json_value::kind::array, ']');
      case '"': out.type = json_value::kind::string; return string(out.text);
      case 't': return literal(out, "true", json_value::kind::boolean);
      case 'f': return literal(out, "false", json_value::kind::boolean);
      case 'n': return literal(out, "null", json_value::kind::null);
      default: return number(out);
    }
  }

  void container(json_value& out, std::size_t depth, json_value::kind type, char end) {
    if (depth + 1 > max_document_depth) {
      fail(errc::invalid_record,
           "checkpoint JSON nests deeper than " + std::to_string(max_document_depth) + " levels.");
    }
    out.type = type;
    ++at_;
    skip_space();
    if (peek() == end) {
      ++at_;
      return;
    }
    for (;;) {
      if (type == json_value::kind::object) {
        if (peek() != '"') fail_at("has an object member without a name");
        string(out.keys.emplace_back());
        skip_space();
        expect(':');
        skip_space();
      }
      value(out.items.emplace_back(), depth + 1);
      skip_space();
      if (peek() == end) {
        ++at_;
        return;
      }
      expect(',');
      skip_space();
    }
  }

  void literal(json_value& out, std::string_view word, json_value::kind type) {
    if (text_.substr(at_, word.size()) != word) fail_at("holds an unknown word");
    out.type = type;
    out.text = word;
    at_ += word.size();
  }

  void number(json_value& out) {
    const std::size_t start = at_;
    // What RapidJSON writes, and cereal's archive reads, for non-finite doubles.
    for (const std::string_view word : {"NaN", "Infinity", "-Infinity"}) {
      if (text_.substr(at_, word.size()) == word) {
        at_ += word.size();
        out.type = json_value::kind::number;
        out.text = word;
        return;
      }
    }
    const auto digits = [&] {
      const std::size_t first = at_;
      while (more() && peek() >= '0' && peek() <= '9') ++at_;
      return at_ - first;
    };
    if (peek() == '-') ++at_;
    const std::size_t first_digit = at_;
    const std::size_t integer = digits();
    if (integer == 0 || (integer > 1 && text_[first_digit] == '0')) fail_at("holds a malformed number");
    if (peek() == '.') {
      ++at_;
      if (digits() == 0) fail_at("holds a malformed number");
    }
    if (peek() == 'e' || peek() == 'E') {
      ++at_;
      if (peek() == '+' || peek() == '-') ++at_;
      if (digits() == 0) fail_at("holds a malformed number");
    }
    out.type = json_value::kind::number;
    out.text = text_.substr(start, at_ - start);
  }

  void string(std::string& out) {
    ++at_;  // the opening quote
    for (;;) {
      if (!more()) fail_at("ends inside a string");
      const char c = text_[at_++];
      if (c == '"') return;
      if (static_cast<unsigned char>(c) < 0x20) fail_at("holds a control character inside a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      const char escaped = more() ? text_[at_++] : '\0';
      switch (escaped) {
        case '"':
        case '\\':
        case '/': out += escaped; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': code_point(out); break;
        default: fail_at("holds an unknown escape in a string");
      }
    }
  }

  std::uint32_t hex4() {
    std::uint32_t value = 0;
    const char* begin = text_.data() + at_;
    const auto [end, problem] = std::from_chars(begin, begin + std::min<std::size_t>(4, text_.size() - at_), value, 16);
    if (problem != std::errc{} || end != begin + 4) fail_at("holds a malformed \\u escape");
    at_ += 4;
    return value;
  }

  /// A \u escape (and the low surrogate of a pair) as UTF-8.
  void code_point(std::string& out) {
    std::uint32_t code = hex4();
    if (code >= 0xd800 && code < 0xdc00) {
      if (text_.substr(at_, 2) != "\\u") fail_at("holds an unpaired surrogate");
      at_ += 2;
      const std::uint32_t low = hex4();
      if (low < 0xdc00 || low >= 0xe000) fail_at("holds an unpaired surrogate");
      code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
    } else if (code >= 0xdc00 && code < 0xe000) {
      fail_at("holds an unpaired surrogate");
    }
    const auto put = [&](std::uint32_t bits) { out += static_cast<char>(bits); };
    if (code < 0x80) {
      put(code);
    } else if (code < 0x800) {
      put(0xc0 | (code >> 6));
      put(0x80 | (code & 0x3f));
    } else if (code < 0x10000) {
      put(0xe0 | (code >> 12));
      put(0x80 | ((code >> 6) & 0x3f));
      put(0x80 | (code & 0x3f));
    } else {
      put(0xf0 | (code >> 18));
      put(0x80 | ((code >> 12) & 0x3f));
      put(0x80 | ((code >> 6) & 0x3f));
      put(0x80 | (code & 0x3f));
    }
  }

  std::string_view text_;
  std::size_t at_ = 0;
};

/// @brief Reads what cereal's `JSONInputArchive` reads, from a document parsed whole first.
/// Structural problems throw `cereal::Exception`, as cereal's archive does.
class json_input_archive : public cereal::InputArchive<json_input_archive>, public cereal::traits::TextArchive {
 public:
  /// @throws error(errc::invalid_record) when `document` is not JSON or its root not an object.
  explicit json_input_archive(std::string_view document) : InputArchive(this), root_(json_parser(document).parse()) {
    if (root_.type != json_value::kind::object)
      fail(errc::invalid_record, "checkpoint JSON holds no record: its root is not an object.");
    cursors_.push_back({&root_, 0});
  }

  void startNode() {
    const json_value& node = next();
    if (node.type != json_value::kind::object && node.type != json_value::kind::array) {
      throw cereal::Exception("expected a JSON object or array");
    }
    cursors_.push_back({&node, 0});
  }
  void finishNode() { cursors_.pop_back(); }
  void setNextName(const char* name) noexcept { next_name_ = name; }
  void loadSize(cereal::size_type& size) const noexcept { size = cursors_.back().node->items.size(); }
  /// How many members the document's root object has (a checkpoint holds one record, or two).
  [[nodiscard]] std::size_t root_members() const noexcept { return root_.items.size(); }

  void loadValue(std::string& text) {
    const json_value& value = next();
    if (value.type != json_value::kind::string) throw cereal::Exception("expected a JSON string");
    text = value.text;
  }
  template <class T>
    requires std::is_arithmetic_v<T>
  void loadValue(T& number) {
    const json_value& value = next();
    const char* begin = value.text.data();
    const char* end = begin + value.text.size();
    const auto [stop, problem] = std::from_chars(begin, end, number);
    if (value.type != json_value::kind::number || problem != std::errc{} || stop != end) {
      throw cereal::Exception("expected a JSON number that fits its field");
    }
  }

 private:
  struct cursor {
    const json_value* node;
    std::size_t index;
  };

  /// The value to read now: the member of the next name, else the next member or element.
  const json_value& next() {
    cursor& at = cursors_.back();
    if (const char* name = std::exchange(next_name_, nullptr)) {
      const auto& keys = at.node->keys;
      const auto found = std::find(keys.begin(), keys.end(), std::string_view(name));
      if (found == keys.end()) throw cereal::Exception("JSON member '" + std::string(name) + "' not found");
      at.index = static_cast<std::size_t>(found - keys.begin());
    }
    if (at.index >= at.node->items.size()) throw cereal::Exception("no more JSON values to read");
    return at.node->items[at.index++];
  }

  json_value root_;
  std::vector<cursor> cursors_;
  const char* next_name_ = nullptr;
};

template <class T>
  requires(!text_leaf<T>)
void prologue(json_input_archive& ar, const T& /*value*/) {
  ar.startNode();
}
template <class T>
  requires(!text_leaf<T>)
void epilogue(json_input_archive& ar, const T& /*value*/) {
  ar.finishNode();
}
template <class T>
void prologue(json_input_archive& /*ar*/, const cereal::NameValuePair<T>& /*pair*/) {}
template <class T>
void epilogue(json_input_archive& /*ar*/, const cereal::NameValuePair<T>& /*pair*/) {}
template <class T>
void prologue(json_input_archive& /*ar*/, const cereal::SizeTag<T>& /*size*/) {}
template <class T>
void epilogue(json_input_archive& /*ar*/, const cereal::SizeTag<T>& /*size*/) {}
template <text_leaf T>
void prologue(json_input_archive& /*ar*/, const T& /*value*/) {}
template <text_leaf T>
void epilogue(json_input_archive& /*ar*/, const T& /*value*/) {}

template <class T>
void load(json_input_archive& ar, cereal::NameValuePair<T>& pair) {
  ar.setNextName(pair.name);
  ar(pair.value);
}
template <class T>
void load(json_input_archive& ar, cereal::SizeTag<T>& size) {
  ar.loadSize(size.size);
}
template <text_leaf T>
void load(json_input_archive& ar, T& value) {
  ar.loadValue(value);
}

}  // namespace detail
}  // namespace gradaccum

CEREAL_SETUP_ARCHIVE_TRAITS(gradaccum::detail::json_input_archive, gradaccum::detail::json_output_archive)
