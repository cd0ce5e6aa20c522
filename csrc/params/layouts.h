// The layouts the ops read, as types. The schemas take them as strings;
// each is parsed once, where a call's arguments are gathered (RopeArgs,
// KVArgs, the module shell), and its text is kept only for messages.
#pragma once

#include <c10/util/string_view.h>

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <utility>

namespace rotary {

// q, k and v: [batch, heads, seq, head_dim] as BHSD, BSHD or SBHD, or
// packed [total_tokens, heads, head_dim] (THD) with cu_seqlens.
enum class Layout : uint8_t { kBHSD, kBSHD, kSBHD, kTHD, kUnknown };
// The caches: contiguous per sequence (BHSD, BSHD) or paged (NHD, HND).
enum class CacheLayout : uint8_t { kBHSD, kBSHD, kNHD, kHND, kUnknown };

// The enum value named s, or `unknown`.
template <typename E, size_t N>
E parse_name(c10::string_view s, const std::pair<const char*, E> (&names)[N], E unknown) {
  for (const auto& [name, value] : names) {
    if (s == name) return value;
  }
  return unknown;
}
inline Layout parse_layout(c10::string_view s) {
  static constexpr std::pair<const char*, Layout> kNames[] = {
      {"BHSD", Layout::kBHSD}, {"BSHD", Layout::kBSHD}, {"SBHD", Layout::kSBHD}, {"THD", Layout::kTHD}};
  return parse_name(s, kNames, Layout::kUnknown);
}
inline CacheLayout parse_cache_layout(c10::string_view s) {
  static constexpr std::pair<const char*, CacheLayout> kNames[] = {
      {"BHSD", CacheLayout::kBHSD}, {"BSHD", CacheLayout::kBSHD}, {"NHD", CacheLayout::kNHD}, {"HND", CacheLayout::kHND}};
  return parse_name(s, kNames, CacheLayout::kUnknown);
}
// Where batch, seq and heads sit in a 4-D q / k / v of a layout, and its
// dims as messages write them (BHSD for anything but BSHD and SBHD).
struct LayoutAxes {
  int batch, seq, heads;
  const char* dims;
};
inline LayoutAxes axes_of(Layout l) {
  switch (l) {
    case Layout::kBSHD: return {0, 1, 2, "[batch, seq_len, heads, head_dim]"};
    case Layout::kSBHD: return {1, 0, 2, "[seq_len, batch, heads, head_dim]"};
    default: return {0, 2, 1, "[batch, heads, seq_len, head_dim]"};
  }
}
// The heads axis of q / k as passed: packed [total_tokens, heads, head_dim]
// with cu_seqlens (varlen), else the layout's.
inline int heads_axis(Layout l, bool varlen) {
  return varlen ? 1 : axes_of(l).heads;
}
inline bool is_paged(CacheLayout l) {
  return l == CacheLayout::kNHD || l == CacheLayout::kHND;
}

// A layout argument: the parsed value, and the text the caller gave.
// Implicit from the schema's string, so a call's arguments convert as they
// are gathered; unknown text parses to kUnknown and the validator names it.
template <typename E, E (*Parse)(c10::string_view)>
struct LayoutArg {
  LayoutArg(c10::string_view s) : value(Parse(s)), text(s) {}  // NOLINT: implicit by design
  LayoutArg(const char* s) : LayoutArg(c10::string_view(s)) {}  // NOLINT
  LayoutArg(const std::string& s) : LayoutArg(c10::string_view(s)) {}  // NOLINT: the text views s
  E value;
  c10::string_view text;
};
template <typename E, E (*Parse)(c10::string_view)>
std::ostream& operator<<(std::ostream& os, const LayoutArg<E, Parse>& l) {
  return os << l.text;
}
using LayoutName = LayoutArg<Layout, parse_layout>;
using CacheLayoutName = LayoutArg<CacheLayout, parse_cache_layout>;

}  // namespace rotary
