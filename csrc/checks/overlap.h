// Exact memory-overlap tests for strided views, for the in-place ops.
// at::has_internal_overlap and at::get_overlap_status give up (TooHard) on
// any non-dense view; these decide such views exactly, within a work bound.
#pragma once

#include <ATen/core/Tensor.h>

namespace rotary {
namespace detail {

enum class Overlap { No, Yes, Unknown };  // Unknown: the work bound ran out

// Do two different indices of x address overlapping bytes?
Overlap self_overlap(const at::Tensor& x);

// Does an element of a share a byte with an element of b? Any dtypes.
Overlap mutual_overlap(const at::Tensor& a, const at::Tensor& b);

}  // namespace detail
}  // namespace rotary
