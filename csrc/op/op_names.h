// The ops that take a table: every key whose rule is the same for all of
// them (math_bits.cpp's conjugate and negative bits, layouts.cpp's
// refusals) registers this one list.
#pragma once

namespace rotary {
namespace detail {

constexpr const char* kTableOps[] = {
    "apply_rope", "apply_rope_qk", "apply_rope_", "apply_rope_qk_", "apply_rope_with_kv_cache_",
    "apply_qk_norm_rope", "apply_qk_norm_rope_", "apply_qk_norm_rope_with_kv_cache_"};

}  // namespace detail
}  // namespace rotary
