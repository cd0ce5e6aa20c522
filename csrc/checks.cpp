#include "checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace rotary {
namespace detail {
namespace {

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

void check_head_tensor(const char* op, const char* name, const at::Tensor& x) {
  TORCH_CHECK_VALUE(
      x.dim() == 4, op, ": ", name, " must be 4-D [batch, heads, seq_len, head_dim], got shape ",
      x.sym_sizes());
  TORCH_CHECK_TYPE(
      is_supported_float(x.scalar_type()), op, ": ", name,
      " must be float32, float64, float16 or bfloat16, got ", x.scalar_type());
  const auto head_dim = x.sym_size(3);
  TORCH_CHECK_VALUE(
      head_dim > 0 && head_dim % 2 == 0, op, ": ", name,
      ".size(-1) (head_dim) must be even and > 0, got ", head_dim, " (shape ", x.sym_sizes(), ")");
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK_VALUE(
      t.device() == q.device(), op, ": ", name, " is on ", t.device(), " but q/x is on ", q.device(),
      "; move both to the same device");
}

}  // namespace

void check_rope_inputs(
    const char* op,
    const at::Tensor& q,
    const at::Tensor* k,
    const at::Tensor& freqs,
    const std::optional<at::Tensor>& positions) {
  const char* q_name = k ? "q" : "x";
  check_head_tensor(op, q_name, q);
  const auto head_dim = q.sym_size(3);
  if (k) {
    check_head_tensor(op, "k", *k);
    TORCH_CHECK_TYPE(
        k->scalar_type() == q.scalar_type(), op, ": k has dtype ", k->scalar_type(),
        " but q has dtype ", q.scalar_type(), "; q and k must share one dtype");
    TORCH_CHECK_VALUE(
        k->sym_size(0) == q.sym_size(0) && k->sym_size(2) == q.sym_size(2) && k->sym_size(3) == head_dim,
        op, ": k must match q in batch, seq_len and head_dim (dims 0, 2, 3): q has shape ",
        q.sym_sizes(), ", k has shape ", k->sym_sizes());
    check_same_device(op, "k", *k, q);
  }

  TORCH_CHECK_TYPE(
      freqs.scalar_type() == at::kComplexFloat, op,
      ": freqs must be complex64 (the table from rotary.rope_freqs or RotaryEmbedding.freqs), got ",
      freqs.scalar_type());
  TORCH_CHECK_VALUE(
      freqs.dim() == 2 && freqs.sym_size(1) * 2 == head_dim, op,
      ": freqs must have shape [max_seq_len, head_dim / 2] = [*, ", head_dim / 2, "] for head_dim ",
      head_dim, ", got ", freqs.sym_sizes());
  check_same_device(op, "freqs", freqs, q);

  if (positions) {
    const auto& p = *positions;
    TORCH_CHECK_TYPE(
        p.scalar_type() == at::kLong, op, ": positions must be int64, got ", p.scalar_type());
    const auto batch = q.sym_size(0);
    const auto seq = q.sym_size(2);
    const bool ok = p.dim() == 0 || (p.dim() == 1 && (p.sym_size(0) == batch || p.sym_size(0) == 1)) ||
        (p.dim() == 2 && (p.sym_size(0) == batch || p.sym_size(0) == 1) &&
         (p.sym_size(1) == seq || p.sym_size(1) == 1));
    TORCH_CHECK_VALUE(
        ok, op, ": positions must have shape [] or [batch] (offsets added to start_pos + s), or ",
        "[batch, seq_len] (absolute position ids added to start_pos) with batch = ", batch,
        ", seq_len = ", seq, "; got ", p.sym_sizes());
    check_same_device(op, "positions", p, q);
  }
}

at::Tensor make_output(const at::Tensor& x) {
  return at::empty_like(x);
}

namespace {

void fill_head_tensor(kernel::HeadTensor& t, const at::Tensor& in, const at::Tensor& out) {
  t.in = in.data_ptr();
  t.out = out.data_ptr();
  t.heads = in.size(1);
  for (int d = 0; d < 4; ++d) {
    t.in_stride[d] = in.stride(d);
    t.out_stride[d] = out.stride(d);
  }
}

void check_positions_in_table(const char* op, const kernel::RopeParams& p) {
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t s = 0; s < p.seq; ++s) {
      const int64_t pos = kernel::position_of(p, b, s);
      TORCH_CHECK_INDEX(
          pos >= 0 && pos < p.freqs_len, op, ": token (batch ", b, ", seq ", s, ") has position ", pos,
          " (start_pos ", p.start_pos, " + positions), outside the freqs table [0, ", p.freqs_len,
          "); build the table with max_seq_len > ", pos);
    }
  }
}

}  // namespace

PreparedRope prepare_rope(
    const char* op,
    const at::Tensor& q,
    const at::Tensor* k,
    const at::Tensor& freqs,
    int64_t start_pos,
    const std::optional<at::Tensor>& positions,
    bool interleaved,
    bool inverse) {
  check_rope_inputs(op, q, k, freqs, positions);
  TORCH_CHECK_VALUE(start_pos >= 0, op, ": start_pos must be >= 0, got ", start_pos);
  const int64_t seq = q.size(2);
  const int64_t table_len = freqs.size(0);
  if (!positions) {
    TORCH_CHECK_INDEX(
        seq == 0 || start_pos + seq <= table_len, op, ": start_pos + seq_len = ", start_pos, " + ", seq,
        " = ", start_pos + seq, " exceeds the freqs table length (max_seq_len) ", table_len);
  }

  PreparedRope r;
  r.out_q = make_output(q);
  if (k) r.out_k = make_output(*k);

  auto& p = r.params;
  fill_head_tensor(p.q, q, r.out_q);
  if (k) fill_head_tensor(p.k, *k, r.out_k);
  p.batch = q.size(0);
  p.seq = seq;
  p.head_dim = q.size(3);
  p.freqs = reinterpret_cast<const float*>(freqs.data_ptr());
  p.freqs_len = table_len;
  p.freqs_stride_pos = freqs.stride(0);
  p.freqs_stride_pair = freqs.stride(1);
  p.start_pos = start_pos;
  p.interleaved = interleaved;
  // A lazily conjugated table (freqs.conj()) holds e^{-i angle}: the same
  // memory read with the inverse rotation.
  p.inverse = freqs.is_conj() ? !inverse : inverse;

  if (positions) {
    const auto& pos = *positions;
    p.positions = pos.data_ptr<int64_t>();
    p.positions_are_offsets = pos.dim() < 2;
    if (pos.dim() >= 1 && pos.size(0) > 1) p.pos_stride_b = pos.stride(0);
    if (pos.dim() == 2 && pos.size(1) > 1) p.pos_stride_s = pos.stride(1);
    if (pos.is_cpu()) check_positions_in_table(op, p);
  }
  return r;
}

}  // namespace detail
}  // namespace rotary
