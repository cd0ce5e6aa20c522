#include "kv_checks.h"
#include "checks_positions.h"

#include <rotary/bounds.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace rotary {
namespace detail {
namespace {

// The [outer, heads, inner, head_dim] view of a cache (kv_params.h).
at::Tensor cache_view(const char* op, const char* name, const at::Tensor& c, const CacheLayoutName& layout) {
  const CacheLayout l = layout.value;
  TORCH_CHECK_VALUE(
      l != CacheLayout::kUnknown, op,
      ": kv_layout must be 'BHSD' or 'BSHD' (contiguous per sequence) or 'NHD' or 'HND' (paged), got '", layout, "'");
  const char* dims = l == CacheLayout::kBHSD ? "[batch, kv_heads, max_seq_len, head_dim]"
      : l == CacheLayout::kBSHD              ? "[batch, max_seq_len, kv_heads, head_dim]"
      : l == CacheLayout::kNHD               ? "[num_blocks, block_size, kv_heads, head_dim]"
                                             : "[num_blocks, kv_heads, block_size, head_dim]";
  TORCH_CHECK_VALUE(
      c.dim() == 4, op, ": ", name, " must be 4-D ", dims, " (kv_layout ", layout, "), got shape ", c.sym_sizes());
  return l == CacheLayout::kBSHD || l == CacheLayout::kNHD ? c.transpose(1, 2) : c;
}

// slot_mapping / cache_positions: one entry per token, [batch, seq] or
// flat [batch * seq] (packed: [total_tokens]).
void check_dest(const char* op, const char* name, const at::Tensor& d, const at::Tensor& kv_view, const at::Tensor& q,
                bool packed) {
  check_defined(op, name, d);
  TORCH_CHECK_TYPE(
      d.scalar_type() == at::kInt || d.scalar_type() == at::kLong, op, ": ", name, " must be int32 or int64, got ",
      d.scalar_type());
  const auto batch = kv_view.sym_size(0), seq = kv_view.sym_size(2);
  const bool ok = (d.dim() == 2 && d.sym_size(0) == batch && d.sym_size(1) == seq) ||
      (d.dim() == 1 && d.sym_size(0) == batch * seq);
  // Packed (cu_seqlens), the batch of 1 is the op's own view: not the caller's to name.
  TORCH_CHECK_VALUE(ok, op, ": ", name, " must have one entry per token, shape ",
                    packed ? c10::str("[total_tokens] = [", seq, "] (with cu_seqlens)")
                           : c10::str("[batch, seq_len] = [", batch, ", ", seq, "] or [batch * seq_len] = [",
                                      batch * seq, "]"),
                    ", got ", d.sym_sizes());
  TORCH_CHECK_VALUE(
      d.device() == q.device(), op, ": ", name, " is on ", d.device(), " but q is on ", q.device(),
      "; move both to the same device");
}

void check_scale(const char* op, const char* name, const std::optional<at::Tensor>& s, bool fp8, const at::Tensor& cache_v, const at::Tensor& q) {
  if (!s) return;
  check_defined(op, name, *s);
  TORCH_CHECK_VALUE(
      fp8, op, ": ", name, " is only for float8_e4m3fn caches; the caches have dtype ", cache_v.scalar_type(),
      " and are written unscaled");
  TORCH_CHECK_TYPE(s->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", s->scalar_type());
  const auto heads = cache_v.sym_size(1);
  const bool ok = s->dim() == 0 || (s->dim() == 1 && (s->sym_size(0) == 1 || s->sym_size(0) == heads));
  TORCH_CHECK_VALUE(
      ok, op, ": ", name, " must have shape [] or [1] (per tensor) or [kv_heads] = [", heads, "] (per head), got ",
      s->sym_sizes());
  TORCH_CHECK_VALUE(
      s->device() == q.device(), op, ": ", name, " is on ", s->device(), " but q is on ", q.device(),
      "; move both to the same device");
}

// Two tokens of one call written to one cache row or slot: which one the row
// holds would depend on the schedule, so a host-known duplicate is refused,
// naming both tokens. A row is (outer, inner, token b, token s).
using DestRow = std::array<int64_t, 4>;

void check_unique_dest(const char* op, std::vector<DestRow>& rows, const kernel::RopeParams& rp, bool host_seqlens,
                       int64_t block_size, const char* source) {
  std::sort(rows.begin(), rows.end());
  for (size_t i = 1; i < rows.size(); ++i) {
    const DestRow &a = rows[i - 1], &b = rows[i];
    if (a[0] != b[0] || a[1] != b[1]) continue;
    const std::string both =
        token_name(rp, a[2], a[3], host_seqlens) + " and " + token_name(rp, b[2], b[3], host_seqlens);
    if (block_size > 0) {  // paged: a slot of slot_mapping
      TORCH_CHECK_VALUE(false, op, ": ", both, " both go to slot ", a[0] * block_size + a[1], " (block ", a[0],
                        ", offset ", a[1], ") of ", source, "; each token of a call needs its own cache row");
    }
    TORCH_CHECK_VALUE(false, op, ": ", both, " both go to cache row ", a[1], " of sequence ", a[0], " (", source,
                      "); each token of a call needs its own cache row");
  }
}

void fill4(int64_t (&dst)[4], const at::Tensor& t) {
  for (int d = 0; d < 4; ++d) dst[d] = t.stride(d);
}

const float* scale_of(const std::optional<at::Tensor>& s, int64_t& stride) {
  stride = 0;
  if (!s) return nullptr;  // scale 1
  stride = s->dim() == 1 && s->size(0) > 1 ? s->stride(0) : 0;
  return s->data_ptr<float>();
}

// Equal shapes but for the last dim (head_dim in every layout).
bool same_but_head_dim(const at::Tensor& a, const at::Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t i = 0; i + 1 < a.dim(); ++i) {
    if (a.sym_size(i) != b.sym_size(i)) return false;
  }
  return true;
}

}  // namespace

void check_scale_values(const char* op, const char* name, const std::optional<at::Tensor>& s, const char* stored) {
  if (!s || !s->is_cpu() || s->numel() == 0) return;
  // A float32 [] or [heads] tensor (check_scale), read where it lies: tensor
  // ops for this took longer than a CPU decode step's cache write.
  const float* v = s->data_ptr<float>();
  const int64_t stride = s->dim() == 1 ? s->stride(0) : 0;
  for (int64_t i = 0; i < s->numel(); ++i) {
    const float x = v[i * stride];
    TORCH_CHECK_VALUE(
        std::isfinite(x) && x > 0, op, ": ", name, " must be finite and > 0 (", stored, " x / scale), got ", x,
        s->dim() ? " at head " + std::to_string(i) : std::string());
  }
}

KVCall check_kv_inputs(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& freqs, const RopeArgs& args, const KVArgs& kv) {
  const RopeCall rope = check_rope_inputs(op, q, &k, freqs, args);
  check_defined(op, "v", v);
  check_defined(op, "k_cache", k_cache);
  check_defined(op, "v_cache", v_cache);
  const at::Tensor& kview = rope.k;
  const at::Tensor vview = canonical_view(op, "v", v, args);
  TORCH_CHECK_TYPE(
      v.scalar_type() == k.scalar_type(), op, ": v has dtype ", v.scalar_type(), " but k has dtype ", k.scalar_type(),
      "; k and v must share one dtype");
  TORCH_CHECK_VALUE(
      same_but_head_dim(v, k), op,
      ": v must have the shape of k but for head_dim (MLA's v_head_dim may differ), got v ", v.sym_sizes(), " and k ",
      k.sym_sizes());
  TORCH_CHECK_VALUE(v.sym_size(-1) > 0, op, ": v's head_dim (its last dim) must be > 0, got v ", v.sym_sizes());
  TORCH_CHECK_VALUE(
      v.device() == q.device(), op, ": v is on ", v.device(), " but q is on ", q.device(), "; move both to the same device");

  const bool paged = is_paged(kv.kv_layout.value);
  const at::Tensor kc = cache_view(op, "k_cache", k_cache, kv.kv_layout);
  const at::Tensor vc = cache_view(op, "v_cache", v_cache, kv.kv_layout);
  TORCH_CHECK_VALUE(
      same_but_head_dim(k_cache, v_cache), op, ": k_cache and v_cache must have one shape but for head_dim, got ",
      k_cache.sym_sizes(), " and ", v_cache.sym_sizes());
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK_TYPE(
      ct == k.scalar_type() || ct == at::kFloat8_e4m3fn, op, ": k_cache must have the dtype of k (", k.scalar_type(),
      ") or float8_e4m3fn, got ", ct);
  TORCH_CHECK_TYPE(
      v_cache.scalar_type() == ct, op, ": v_cache has dtype ", v_cache.scalar_type(), " but k_cache has dtype ", ct,
      "; the two caches must share one dtype");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK_VALUE(
        c->device() == q.device(), op, ": ", c == &k_cache ? "k_cache" : "v_cache", " is on ", c->device(),
        " but q is on ", q.device(), "; move both to the same device");
  }
  TORCH_CHECK_VALUE(
      kc.sym_size(1) == kview.sym_size(1) && kc.sym_size(3) == kview.sym_size(3), op,
      ": the caches must have k's kv_heads = ", kview.sym_size(1), " and head_dim = ", kview.sym_size(3),
      " (kv_layout ", kv.kv_layout, "), got k_cache of shape ", k_cache.sym_sizes());
  TORCH_CHECK_VALUE(
      vc.sym_size(3) == vview.sym_size(3), op, ": v_cache must have v's head_dim = ", vview.sym_size(3),
      " (k's and v's may differ, as MLA's v_head_dim), got v_cache of shape ", v_cache.sym_sizes());
  if (!paged) {
    const auto seqs = args.cu_seqlens ? args.cu_seqlens->sym_size(0) - 1 : kview.sym_size(0);
    TORCH_CHECK_VALUE(
        kc.sym_size(0) == seqs, op, ": k_cache must have one row per sequence, ", seqs, " (",
        args.cu_seqlens ? "num_seqs of cu_seqlens" : "the batch of k", "), got ", kc.sym_size(0), " (shape ",
        k_cache.sym_sizes(), ")");
  }

  TORCH_CHECK_VALUE(
      paged == kv.slot_mapping.has_value(), op,
      paged ? ": a paged cache (kv_layout NHD/HND) needs slot_mapping"
            : ": slot_mapping is for paged caches (kv_layout 'NHD' or 'HND'); with a contiguous cache pass cache_positions");
  TORCH_CHECK_VALUE(
      !(paged && kv.cache_positions), op,
      ": cache_positions is for contiguous caches (kv_layout 'BHSD' or 'BSHD'); a paged cache takes slot_mapping");
  // N-D ids (M-RoPE, axial) say how a token turns, not where it is stored.
  TORCH_CHECK_VALUE(
      paged || kv.cache_positions || !args.pair_axes, op,
      ": with pair_axes (N-D position_ids) a contiguous cache needs cache_positions: a token's rotary positions "
      "are not its cache row");
  if (kv.slot_mapping) check_dest(op, "slot_mapping", *kv.slot_mapping, rope.q, q, args.cu_seqlens.has_value());
  if (kv.cache_positions) {
    check_dest(op, "cache_positions", *kv.cache_positions, rope.q, q, args.cu_seqlens.has_value());
  }
  const bool fp8 = ct == at::kFloat8_e4m3fn;
  check_scale(op, "k_scale", kv.k_scale, fp8, kc, q);
  check_scale(op, "v_scale", kv.v_scale, fp8, kc, q);
  return {rope, vview, kc, vc, k_cache.sym_sizes()};
}

PreparedKV prepare_kv(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& freqs, const RopeArgs& args, const KVArgs& kv) {
  return prepare_kv(op, q, k, v, freqs, check_kv_inputs(op, q, k, v, k_cache, v_cache, freqs, args, kv), kv);
}

PreparedKV prepare_kv(
    const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& freqs,
    const KVCall& call, const KVArgs& kv) {
  PreparedKV r{prepare_rope(op, q, &k, call.rope, /*in_place=*/true), at::Tensor(), {}};
  const at::Tensor& kc = call.k_cache;
  const at::Tensor& vc = call.v_cache;
  const at::Tensor& vview = call.v;

  // Aliasing: each cache is written; v is read after q and k are rotated.
  const char* why = "the cache write would overwrite a tensor it reads or writes";
  check_distinct(op, "k_cache", kc);
  check_distinct(op, "v_cache", vc);
  check_disjoint(op, "k_cache", kc, "v_cache", vc, why);
  check_disjoint(op, "q", q, "v", v, "v would be read after q is rotated");
  check_disjoint(op, "k", k, "v", v, "v would be read after k is rotated");
  const std::pair<const char*, const std::optional<at::Tensor>*> kv_read[] = {
      {"cache_positions", &kv.cache_positions}, {"slot_mapping", &kv.slot_mapping}, {"k_scale", &kv.k_scale},
      {"v_scale", &kv.v_scale}};
  for (const at::Tensor* c : {&kc, &vc}) {
    const char* name = c == &kc ? "k_cache" : "v_cache";
    check_disjoint(op, name, *c, "q", q, why);
    check_disjoint(op, name, *c, "k", k, why);
    check_disjoint(op, name, *c, "v", v, why);
    check_disjoint(op, name, *c, "freqs", freqs, why);
    const std::pair<const char*, const at::Tensor*> rope_read[] = {
        {call.rope.positions.name(), call.rope.positions.given}, {"cu_seqlens", call.rope.cu_seqlens},
        {"inv_freq", call.rope.inv_freq}};
    for (const auto& [read, t] : rope_read) {
      if (t) check_disjoint(op, name, *c, read, *t, why);
    }
    for (const auto& [read, t] : kv_read) {
      if (*t) check_disjoint(op, name, *c, read, **t, why);
    }
  }
  for (const auto& [read, t] : kv_read) {
    if (!*t) continue;
    check_disjoint(op, "q", q, read, **t);
    check_disjoint(op, "k", k, read, **t);
  }

  auto& p = r.params;
  p.rope = r.rope.params;
  p.v = vview.data_ptr();
  fill4(p.v_stride, vview);
  p.v_dim = vview.size(3);
  if (vview.is_cuda()) check_cuda_extents(op, p.rope, p.v_dim);
  p.k_cache = kc.data_ptr();
  p.v_cache = vc.data_ptr();
  fill4(p.kc_stride, kc);
  fill4(p.vc_stride, vc);
  p.outer = kc.size(0);
  p.inner = kc.size(2);
  p.paged = is_paged(kv.kv_layout.value);
  const auto& dest = kv.slot_mapping ? kv.slot_mapping : kv.cache_positions;
  if (dest) {
    r.dest = *dest;
    p.dest = r.dest.data_ptr();
    p.dest_int32 = r.dest.scalar_type() == at::kInt;
    if (r.dest.dim() == 2) {
      p.dest_stride_b = r.dest.stride(0);
      p.dest_stride_s = r.dest.stride(1);
    } else {  // flat: token (b, s) is entry b * seq + s
      p.dest_stride_b = p.rope.seq * r.dest.stride(0);
      p.dest_stride_s = r.dest.stride(0);
    }
  }
  p.fp8 = kc.scalar_type() == at::kFloat8_e4m3fn;
  p.k_scale = scale_of(kv.k_scale, p.k_scale_stride);
  p.v_scale = scale_of(kv.v_scale, p.v_scale_stride);
  check_scale_values(op, "k_scale", kv.k_scale);
  check_scale_values(op, "v_scale", kv.v_scale);

  // Values known on the host are range-checked here, before any write; on
  // the device an out-of-range slot or position is skipped (kv_params.h).
  const auto& rp = p.rope;
  const at::Tensor* cu = call.rope.cu_seqlens;
  const bool host_seqlens = !cu || cu->is_cpu();
  const bool host_rope = (rp.positions == nullptr || r.rope.positions.is_cpu()) && host_seqlens;
  const bool host = dest ? r.dest.is_cpu() && (p.paged || host_seqlens) : host_rope;
  if (!host || rp.batch * rp.seq == 0) return r;
  if (!dest && rp.positions == nullptr && rp.cu_seqlens == nullptr) {
    TORCH_CHECK_INDEX(
        bounds::span_fits(rp.start_pos, rp.seq, p.inner), op, ": start_pos + seq_len = ", rp.start_pos, " + ", rp.seq,
        " exceeds the cache's max_seq_len ", p.inner, " (k_cache shape ", call.k_cache_shape, ")");
    return r;
  }
  std::vector<DestRow> rows;
  rows.reserve(static_cast<size_t>(rp.batch * rp.seq));
  for (int64_t b = 0; b < rp.batch; ++b) {
    for (int64_t s = 0; s < rp.seq; ++s) {
      if (p.paged) {
        const int64_t slot = kernel::dest_entry(p, b, s);
        TORCH_CHECK_INDEX(
            slot >= -1 && slot < p.outer * p.inner, op, ": slot_mapping of ", token_name(rp, b, s, host_seqlens), " is ",
            slot, ", outside the paged cache's ", p.outer * p.inner, " slots (num_blocks ", p.outer, " x block_size ",
            p.inner, "); -1 skips a token");
        if (slot >= 0) rows.push_back({slot / p.inner, slot % p.inner, b, s});
        continue;
      }
      int64_t outer = 0, inner = 0;
      kernel::cache_row(p, b, s, outer, inner);
      TORCH_CHECK_INDEX(
          inner >= 0 && inner < p.inner, op, ": ", token_name(rp, b, s, host_seqlens), " goes to cache position ", inner,
          dest ? " (cache_positions)" : " (its rotary position)", ", outside the cache's max_seq_len ", p.inner,
          " (k_cache shape ", call.k_cache_shape, ")");
      rows.push_back({outer, inner, b, s});
    }
  }
  check_unique_dest(op, rows, rp, host_seqlens, p.paged ? p.inner : 0,
                    p.paged ? "slot_mapping" : dest ? "cache_positions" : "their rotary positions");
  return r;
}

}  // namespace detail
}  // namespace rotary
