#pragma once
/// @file
/// @brief Checks around cereal's XML input archive, and the strict number parsing that
/// replaces its lenient one.
///
/// cereal's XML archive parses with rapidxml, which recurses once per nesting level and keeps
/// strings up to their first NUL byte, and reads numbers with `std::sto*`, which accepts a
/// number's prefix ("2abc" as 2) and C notations ("0x10" as 16). Checkpoints are checked for
/// the first two before rapidxml sees them, and their numbers read as text and parsed here.

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include "gradaccum/checkpoint/text_archives.hpp"
#include "gradaccum/error.hpp"

namespace gradaccum::detail {

/// `text` as a T when it is exactly a decimal number of T (`std::from_chars`: no sign for
/// unsigned types, no leading '+', whitespace, hex prefix or trailing bytes).
template <class T>
std::optional<T> parse_number(std::string_view text) noexcept {
  T value{};
  const auto [end, problem] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (problem != std::errc{} || end != text.data() + text.size()) return std::nullopt;
  return value;
}

/// Deepest element nesting of an XML document, counted the way rapidxml reads tags; stops
/// counting once past `max_document_depth`.
inline std::size_t xml_depth(std::string_view text) noexcept {
  std::size_t depth = 0;
  std::size_t deepest = 0;
  const auto skip_past = [&](std::size_t from, std::string_view end) {
    const std::size_t found = text.find(end, from);
    return found == std::string_view::npos ? text.size() : found + end.size();
  };
  std::size_t i = 0;
  while (i < text.size() && deepest <= max_document_depth) {
    if (text[i] != '<') {
      ++i;
      continue;
    }
    const std::string_view rest = text.substr(i);
    if (rest.starts_with("</")) {
      depth -= depth > 0 ? 1 : 0;
      i = skip_past(i, ">");
    } else if (rest.starts_with("<?")) {
      i = skip_past(i, "?>");
    } else if (rest.starts_with("<!--")) {
      i = skip_past(i, "-->");
    } else if (rest.starts_with("<![CDATA[")) {
      i = skip_past(i, "]]>");
    } else if (rest.starts_with("<!")) {
      i = skip_past(i, ">");
    } else {  // an element: find its '>' outside quoted attribute values
      char quote = 0;
      std::size_t j = i + 1;
      for (; j < text.size(); ++j) {
        if (quote != 0) {
          quote = text[j] == quote ? '\0' : quote;
        } else if (text[j] == '"' || text[j] == '\'') {
          quote = text[j];
        } else if (text[j] == '>') {
          break;
        }
      }
      if (j >= text.size() || text[j - 1] != '/') deepest = std::max(deepest, ++depth);
      i = j + 1;
    }
  }
  return deepest;
}

/// Whether an XML document holds a NUL character, raw or as a character reference ("&#0;",
/// "&#x00;"): rapidxml would end the string there.
inline bool xml_holds_nul(std::string_view text) noexcept {
  if (text.find('\0') != std::string_view::npos) return true;
  for (std::size_t at = text.find("&#"); at != std::string_view::npos; at = text.find("&#", at + 2)) {
    std::string_view digits = text.substr(at + 2);
    const bool hex = !digits.empty() && (digits.front() == 'x' || digits.front() == 'X');
    if (hex) digits.remove_prefix(1);
    const std::size_t end = digits.find(';');
    if (end == std::string_view::npos || end == 0) continue;
    digits = digits.substr(0, end);
    if (std::all_of(digits.begin(), digits.end(), [](char c) { return c == '0'; })) return true;
  }
  return false;
}

/// Checks what cereal's XML parser would otherwise trust: nesting depth and NUL characters.
inline void check_xml_document(std::string_view bytes) {
  if (xml_depth(bytes) > max_document_depth) {
    fail(errc::invalid_record,
         "checkpoint XML nests elements deeper than " + std::to_string(max_document_depth) + " levels.");
  }
  if (xml_holds_nul(bytes)) {
    fail(errc::invalid_record, "checkpoint XML holds a NUL character, which no checkpoint string may hold.");
  }
}

}  // namespace gradaccum::detail
