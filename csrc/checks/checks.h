// One validator and one launch-description builder, shared by every backend,
// so a bad input gets the same message on CPU, CUDA and Meta.
#pragma once

#include "params/layouts.h"
#include "params/rope_params.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/OptionalArrayRef.h>
#include <c10/util/string_view.h>

namespace rotary {
namespace detail {

// The arguments every rotary op shares after its tensors, in schema order.
struct RopeArgs {
  int64_t start_pos = 0;
  bool interleaved = true;
  const std::optional<at::Tensor>& offsets;       // [] / [batch]: start_pos + offsets[b] + s
  const std::optional<at::Tensor>& position_ids;  // [seq] / [batch, seq]: absolute ids
  bool inverse = false;
  const std::optional<at::Tensor>& cu_seqlens;
  const std::optional<at::Tensor>& inv_freq;
  LayoutName layout;                   // parsed once; its text for messages
  int64_t rotary_offset = 0;           // rotated dims [offset, offset + rotary_dim)
  at::OptionalIntArrayRef pair_axes;   // N-D positions: pair j reads axis pair_axes[j]
};

// A call as validated: what the checks built on the way, kept so nothing
// is checked or viewed twice (the KV op extends it, prepare_rope reads it).
struct RopeCall {
  at::Tensor q;  // the [batch, heads, seq, head_dim] views the kernels index
  at::Tensor k;  // undefined for the single-tensor ops
};

// Shape, dtype and device checks that need no tensor values (Meta-safe).
// k is null for the single-tensor ops.
RopeCall check_rope_inputs(
    const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& freqs, const RopeArgs& args);

// The [batch, heads, seq, head_dim] view the kernels index; never a copy.
// Packed varlen input [T, H, D] becomes [1, H, T, D].
at::Tensor canonical_view(const char* op, const char* name, const at::Tensor& x, const RopeArgs& args);

// In-place targets: no two elements of x share memory; w shares none with t
// (exact for any strides, overlap.h). `why` ends the message.
void check_distinct(const char* op, const char* name, const at::Tensor& x);
void check_disjoint(
    const char* op, const char* written, const at::Tensor& w, const char* other, const at::Tensor& t,
    const char* why = "the rotation would overwrite an input it reads");

// Where an out-of-place kernel writes: same dtype, shape and (for dense
// inputs) layout as the input. Meta calls this too, so strides agree.
at::Tensor make_output(const at::Tensor& x);

// checks_axes.cpp: the rotated span, and N-D positions (pair_axes with a
// leading axis dim on position_ids): shapes and values of pair_axes here, the
// launch fields and the by-value table check in prepare_rope.
void check_rotary_span(const char* op, const c10::SymInt& head_dim, const at::Tensor& freqs, const RopeArgs& args);
void check_axes_positions(const char* op, const at::Tensor& q_view, const at::Tensor& freqs, const RopeArgs& args);
void fill_axes(kernel::RopeParams& p, const at::Tensor& positions, const RopeArgs& args);
void check_axes_in_table(const char* op, const kernel::RopeParams& p);

struct PreparedRope {
  at::Tensor out_q;
  at::Tensor out_k;  // undefined for the single-tensor ops
  at::Tensor positions;  // int32/int64 offsets or ids the kernel reads (a copy only for other dtypes)
  kernel::RopeParams params;
};

// Validates everything that can be checked on the host without a device sync
// (position and cu_seqlens tensors on the CPU are checked by value too),
// allocates the outputs (or, in place, aliases the inputs) and fills the
// framework-free launch description. Nothing is written before it returns.
PreparedRope prepare_rope(
    const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& freqs, const RopeArgs& args,
    bool in_place);
// The same for a call check_rope_inputs has validated already.
PreparedRope prepare_rope(
    const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& freqs, const RopeArgs& args,
    bool in_place, const RopeCall& call);

}  // namespace detail
}  // namespace rotary
