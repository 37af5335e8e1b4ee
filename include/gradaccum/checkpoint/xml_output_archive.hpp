#pragma once
/// @file
/// @brief The XML archive checkpoint files are written with (see `text_archives.hpp` for why the
/// library writes its own text archives).

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

#include "gradaccum/checkpoint/text_archives.hpp"

namespace gradaccum::detail {

// ---- XML output ------------------------------------------------------------------------------

/// @brief Writes the XML document cereal's `XMLOutputArchive` writes (rapidxml's layout: a
/// declaration, a `cereal` root, one tab per level), element by element as values arrive.
/// Call `finish()` after the last value.
class xml_output_archive : public cereal::OutputArchive<xml_output_archive>, public cereal::traits::TextArchive {
 public:
  explicit xml_output_archive(std::ostream& stream) : OutputArchive(this), out_(stream) {
    out_.put("<?xml version=\"1.0\" encoding=\"utf-8\"?>\n");
    nodes_.push_back({"cereal", {}, 0, false});
  }

  /// Closes the root element: the document is complete.
  void finish() { finishNode(); }

  void startNode() {
    element& parent = nodes_.back();
    std::string name =
        next_name_ != nullptr ? std::exchange(next_name_, nullptr) : "value" + std::to_string(parent.counter++);
    open_for_children(parent);
    nodes_.push_back({std::move(name), {}, 0, false});
  }
  void finishNode() {
    const element& top = nodes_.back();
    if (!top.written) {  // no child and no value
      start_tag(top);
      out_.put("/>\n");
    } else if (top.counter != std::numeric_limits<std::size_t>::max()) {  // had children
      out_.indent(nodes_.size() - 1, "\t");
      out_.put("</");
      out_.put(top.name);
      out_.put(">\n");
    }
    nodes_.pop_back();
  }
  void setNextName(const char* name) noexcept { next_name_ = name; }
  void appendAttribute(const char* name, const char* value) {
    nodes_.back().attributes += std::string(" ") + name + "=\"" + value + "\"";
  }

  void saveValue(const std::string& text) {
    // rapidxml trims leading and trailing whitespace unless told to preserve it.
    constexpr std::string_view space = " \t\n\r";
    if (!text.empty() &&
        (space.find(text.front()) != std::string_view::npos || space.find(text.back()) != std::string_view::npos)) {
      appendAttribute("xml:space", "preserve");
    }
    value_start();
    std::size_t plain = 0;
    for (std::size_t i = 0; i < text.size(); ++i) {
      const std::string_view entity = text[i] == '<'    ? "&lt;"
                                      : text[i] == '>'  ? "&gt;"
                                      : text[i] == '&'  ? "&amp;"
                                      : text[i] == '"'  ? "&quot;"
                                      : text[i] == '\'' ? "&apos;"
                                                        : "";
      if (entity.empty()) continue;
      out_.put(std::string_view(text).substr(plain, i - plain));
      out_.put(entity);
      plain = i + 1;
    }
    out_.put(std::string_view(text).substr(plain));
    value_end();
  }
  template <class T>
    requires std::is_arithmetic_v<T>
  void saveValue(T value) {
    value_start();
    put_number(out_, value, false);
    value_end();
  }

 private:
  struct element {
    std::string name;
    std::string attributes;  // " name=\"value\"" each
    std::size_t counter;     // names "value0", ... of unnamed children; max once a value was written
    bool written;            // its start tag is out
  };

  void start_tag(const element& e) {
    out_.indent(nodes_.size() - 1, "\t");
    out_.put('<');
    out_.put(e.name);
    out_.put(e.attributes);
  }
  void open_for_children(element& e) {
    if (e.written) return;
    start_tag(e);
    out_.put(">\n");
    e.written = true;
  }
  void value_start() {
    element& top = nodes_.back();
    if (top.written) throw cereal::Exception("an XML element holds a value and other content");
    start_tag(top);
    out_.put('>');
    top.written = true;
    top.counter = std::numeric_limits<std::size_t>::max();
  }
  void value_end() {
    out_.put("</");
    out_.put(nodes_.back().name);
    out_.put(">\n");
  }

  text_writer out_;
  std::vector<element> nodes_;
  const char* next_name_ = nullptr;
};

template <class T>
void prologue(xml_output_archive& ar, const T& /*value*/) {
  ar.startNode();
}
template <class T>
void epilogue(xml_output_archive& ar, const T& /*value*/) {
  ar.finishNode();
}
template <class T>
void prologue(xml_output_archive& /*ar*/, const cereal::NameValuePair<T>& /*pair*/) {}
template <class T>
void epilogue(xml_output_archive& /*ar*/, const cereal::NameValuePair<T>& /*pair*/) {}
template <class T>
void prologue(xml_output_archive& ar, const cereal::SizeTag<T>& /*size*/) {
  ar.appendAttribute("size", "dynamic");
}
template <class T>
void epilogue(xml_output_archive& /*ar*/, const cereal::SizeTag<T>& /*size*/) {}

template <class T>
void save(xml_output_archive& ar, const cereal::NameValuePair<T>& pair) {
  ar.setNextName(pair.name);
  ar(pair.value);
}
template <class T>
void save(xml_output_archive& /*ar*/, const cereal::SizeTag<T>& /*size*/) {}
template <text_leaf T>
void save(xml_output_archive& ar, const T& value) {
  ar.saveValue(value);
}

}  // namespace gradaccum::detail
