// One validator and one launch-description builder, shared by every backend,
// so a bad input gets the same message on CPU, CUDA and Meta.
#pragma once

#include "params/layouts.h"
#include "params/rope_params.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/OptionalArrayRef.h>
#include <c10/util/string_view.h>

#include <string>
#include <utility>
#include <vector>

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

// Where each token's position comes from, as kernel::position_of reads it.
struct Positions {
  enum class Kind : uint8_t {
    kLocal,    // start_pos + s (s counts within a packed sequence)
    kOffsets,  // start_pos + offsets[b] + s
    kIds,      // position_ids: absolute
    kAxes,     // position_ids [n_axes, ...]: pair j reads axis pair_axes[j]
  };
  Kind kind = Kind::kLocal;
  int64_t start_pos = 0;              // checked in [0, 2^60)
  const at::Tensor* given = nullptr;  // the offsets or ids as passed
  at::IntArrayRef pair_axes;          // kAxes only
  const char* name() const {
    return kind == Kind::kOffsets ? "offsets" : "position_ids";
  }
};

// A call as validated, built once from the schema's arguments: prepare_rope
// reads only this, and the KV op extends it (KVCall), so nothing is checked
// or viewed twice. Pointers are into the call's own arguments.
struct RopeCall {
  at::Tensor q;                 // the [batch, heads, seq, head_dim] views the kernels index
  at::Tensor k;                 // undefined for the single-tensor ops
  const at::Tensor* freqs = nullptr;  // complex64, or its torch.view_as_real
  Positions positions;
  Layout layout = Layout::kBHSD;
  int64_t rotary_offset = 0;    // rotated dims [rotary_offset, rotary_offset + rotary_dim)
  bool interleaved = true;
  bool inverse = false;         // as asked; a conjugated table flips it
  const at::Tensor* cu_seqlens = nullptr;
  const at::Tensor* inv_freq = nullptr;
  // The table as complex64, as the kernels read it (not Meta-safe).
  at::Tensor table() const;
};

// Shape, dtype and device checks that need no tensor values (Meta-safe).
// k is null for the single-tensor ops.
RopeCall check_rope_inputs(
    const char* op, const at::Tensor& q, const at::Tensor* k, const at::Tensor& freqs, const RopeArgs& args);

// The [batch, heads, seq, head_dim] view the kernels index; never a copy.
// Packed varlen input [T, H, D] becomes [1, H, T, D].
at::Tensor canonical_view(const char* op, const char* name, const at::Tensor& x, const RopeArgs& args);
// The same view of a tensor already checked (an output shaped like its input).
at::Tensor canonical_view(const at::Tensor& x, Layout layout, bool varlen);

// `name` on q's device, and an integer (not bool) tensor: the words every
// op's messages use.
void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q);
// An undefined at::Tensor (C++) is refused by name, before its dtype is read.
void check_defined(const char* op, const char* name, const at::Tensor& t);
// c10::TypeError unless t is a dense (strided, not nested or quantized)
// tensor, naming what it is: sparse, mkldnn and nested tensors have no
// strides to read, and a quantized one's values are not its elements.
void check_dense(const char* op, const char* name, const at::Tensor& t);
// A call that reached a layout's refusal: the first argument that is not
// dense, named; (name, tensor) pairs in the schema's order.
[[noreturn]] void refuse_not_dense(const std::string& op, const std::vector<std::pair<std::string, at::Tensor>>& args);
void check_integer_dtype(const char* op, const char* name, const at::Tensor& t);
// One of the four float dtypes the kernels take.
void check_float_dtype(const char* op, const char* name, const at::Tensor& t);
void check_same_dtype_as_q(const char* op, const at::Tensor& k, const at::Tensor& q);

// In-place targets: x can be updated in place here (not an inference tensor
// outside inference mode) and no two of its elements share memory; w shares none with t
// (exact for any strides, overlap.h). `why` ends the message.
void check_distinct(const char* op, const char* name, const at::Tensor& x);
void check_disjoint(
    const char* op, const char* written, const at::Tensor& w, const char* other, const at::Tensor& t,
    const char* why = "the rotation would overwrite an input it reads");

// Where an out-of-place kernel writes: same shape and (for dense inputs)
// strides as the input, in x's dtype or `dtype`. Meta calls this too, so
// strides agree, size-1 and empty dims included.
at::Tensor make_output(const at::Tensor& x, std::optional<at::ScalarType> dtype = std::nullopt);

// checks_axes.cpp: the rotated span, and N-D positions (pair_axes with a
// leading axis dim on position_ids): shapes and values of pair_axes here, the
// launch fields and the by-value table check in prepare_rope.
void check_rotary_span(const char* op, const c10::SymInt& head_dim, const at::Tensor& freqs, const RopeArgs& args);
void check_axes_positions(const char* op, const at::Tensor& q_view, const at::Tensor& freqs, const RopeArgs& args);
void fill_axes(kernel::RopeParams& p, const at::Tensor& positions, at::IntArrayRef pair_axes);
// axis_max[a]: the largest |inv_freq| of axis a's pairs when inv_freq is on
// the host (else 0): an axis's positions turn only its own pairs.
void check_axes_in_table(const char* op, const kernel::RopeParams& p, const double* axis_max);

// The CUDA kernels count a row's heads (q's + k's) and a head's elements
// (head_dim, and v's when the caches are written) in 32 bits: at most
// kMaxCudaExtent of each, checked for every CUDA call (and the launch model).
constexpr int64_t kMaxCudaExtent = int64_t{1} << 30;
void check_cuda_extents(const char* op, int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t v_dim = 0);
inline void check_cuda_extents(const char* op, const kernel::RopeParams& p, int64_t v_dim = 0) {
  check_cuda_extents(op, p.q.heads, p.k.heads, p.head_dim, v_dim);
}

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
// The same for a call check_rope_inputs has validated already; out_q, when
// given, is the out-of-place q the caller allocated (the prologue's fp8 q).
PreparedRope prepare_rope(
    const char* op, const at::Tensor& q, const at::Tensor* k, const RopeCall& call, bool in_place,
    const at::Tensor* out_q = nullptr);

}  // namespace detail
}  // namespace rotary
