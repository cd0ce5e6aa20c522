// Host emulation of apply_qk_norm_rope_with_kv_cache_'s one CUDA launch
// (norm_rope_kernel with a cache type: the blocks that normalize and rotate
// a row write its k and v into the caches), run over its whole grid on the
// CPU. It must leave q, k and both caches with the bits of the two launches
// it replaces (the prologue kernel, then the element-wise cache kernel), for
// every dtype, cache dtype (fp8 with per-tensor and per-head scales), cache
// layout, norm kind and feature (partial rotary inside the head, MLA's own
// v_dim, cache_positions, skipped and device-side out-of-range slots), with
// one block walking every row too; match the float64 reference (q, k and
// the cache rows where the call puts them); and agree with the CPU op.
#ifdef ROTARY_EMULATION

#include "checks/norm_checks.h"
#include "cuda/cuda_types.h"
#include "cuda/kv_cache_kernel.cuh"
#include "helpers.h"
#include "norm_emulation.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using rotary_test::dtype_name;
using rotary_test::opt;
using rotary_test::SameBits;

struct NormKVCase {
  std::string name;
  at::ScalarType dtype = at::kBFloat16;
  bool fp8 = false;
  bool per_head_scale = false;
  std::string kv_layout = "NHD";
  bool heads = false;  // norm "heads" (one norm over every head), else "head"
  bool interleaved = false;
  int64_t B = 2, S = 3, Hq = 4, Hk = 2, D = 32, rotary_dim = 32, rotary_offset = 0, vd = 32, start = 3;
  bool cache_positions = false;
  bool nd = false;  // N-D ids [3, B, S] (absolute), pair j on axis j % 3, as Qwen3-VL's M-RoPE
  std::optional<bool> vector_cache;  // the cache write's path, where a case checks it
};

constexpr int64_t kPageRows = 8, kCacheRows = 16;  // paged block size; contiguous S_max

bool paged(const NormKVCase& c) {
  return c.kv_layout == "NHD" || c.kv_layout == "HND";
}

struct NormKVInputs {
  at::Tensor q, k, v, kc, vc, slots, cache_positions, k_scale, v_scale, ids;
};

// A cache of `width` dims per head row in c's layout, random (fp8: its bits).
at::Tensor make_cache(const NormKVCase& c, int64_t width) {
  const int64_t outer = paged(c) ? (c.B * c.S + 2) / kPageRows + 2 : c.B;
  const int64_t inner = paged(c) ? kPageRows : kCacheRows;
  const bool heads_first = c.kv_layout == "BHSD" || c.kv_layout == "HND";
  const std::vector<int64_t> shape = heads_first ? std::vector<int64_t>{outer, c.Hk, inner, width}
                                                 : std::vector<int64_t>{outer, inner, c.Hk, width};
  return (at::randn(shape) * 3).to(c.fp8 ? at::kFloat8_e4m3fn : c.dtype);
}

// q, k and v as [B, H, S, D] views of [B, S, H, D] storage (strided heads).
NormKVInputs make(const NormKVCase& c, int64_t seed) {
  at::manual_seed(seed);
  NormKVInputs in;
  in.q = at::randn({c.B, c.S, c.Hq, c.D}).to(c.dtype).transpose(1, 2);
  in.k = at::randn({c.B, c.S, c.Hk, c.D}).to(c.dtype).transpose(1, 2);
  in.v = at::randn({c.B, c.S, c.Hk, c.vd}).to(c.dtype).transpose(1, 2);
  in.kc = make_cache(c, c.D);
  in.vc = make_cache(c, c.vd);
  if (paged(c)) {
    in.slots = at::randperm(in.kc.size(0) * kPageRows, at::kLong).narrow(0, 0, c.B * c.S).reshape({c.B, c.S}).contiguous();
    in.slots[0][0] = -1;
  }
  if (c.cache_positions) {
    std::vector<at::Tensor> rows;
    for (int64_t b = 0; b < c.B; ++b) rows.push_back(at::randperm(kCacheRows, at::kLong).narrow(0, 0, c.S));
    in.cache_positions = at::stack(rows).to(at::kInt);
  }
  if (c.fp8) std::tie(in.k_scale, in.v_scale) = rotary_test::fp8_scales(c.per_head_scale, c.Hk);
  if (c.nd) in.ids = at::randint(0, 60, {3, c.B, c.S}, at::kLong);
  return in;
}

// The fused launch on `fused`; the prologue launch then the element-wise
// cache kernel on `two` (run with the torch types, which share the CUDA
// types' bits).
template <typename scalar_t, typename CacheCpu>
bool emulate(const rotary::detail::PreparedNormKV& fused, const rotary::detail::PreparedNormKV& two, int64_t blocks) {
  using T = typename rotary::cuda::CudaType<scalar_t>::type;
  using Cache = std::conditional_t<std::is_same_v<CacheCpu, uint8_t>, uint8_t, T>;
  rotary_test::emulate_norm_rope<T, Cache>(fused.kv.params, fused.norm.params, blocks);
  rotary_test::emulate_norm_rope<T>(two.kv.params, two.norm.params, blocks);
  for (int64_t i = 0; i < rotary::kernel::kv_cache_threads(two.kv.params); ++i) {
    rotary::kernel::kv_cache_thread<scalar_t, CacheCpu>(two.kv.params, i);
  }
  // Whether the launch writes the caches as vectors (norm_cache_vectors).
  return rotary::kernel::norm_grid_for<T, Cache>(fused.kv.params, blocks).cache_vector;
}

// A cache as float64 values (fp8 bytes decoded), a copy.
at::Tensor values(const at::Tensor& cache) {
  return cache.to(at::kDouble).clone();
}

// Scale s of head h: one per tensor or per head; none is 1.
double scale_of(const at::Tensor& s, int64_t h) {
  return !s.defined() ? 1.0 : s.numel() == 1 ? s.item<double>() : s[h].item<double>();
}

// The caches the call must leave, in float64: op's, with the rows of every
// written token (slot -1 skipped) set from k's float64 reference and from v,
// divided by their fp8 scales (the fp8 rounding is the tolerance's).
std::pair<at::Tensor, at::Tensor> expected_caches(const NormKVCase& c, const NormKVInputs& op, const at::Tensor& slots,
                                                  const at::Tensor& ref_k) {
  at::Tensor kc = values(op.kc), vc = values(op.vc);
  const at::Tensor v = op.v.to(at::kDouble);
  const bool heads_first = c.kv_layout == "BHSD" || c.kv_layout == "HND";
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t s = 0; s < c.S; ++s) {
      int64_t outer = b, inner = c.start + s;
      if (paged(c)) {
        const int64_t slot = slots[b][s].item<int64_t>();
        if (slot < 0) continue;
        outer = slot / kPageRows, inner = slot % kPageRows;
      } else if (c.cache_positions) {
        inner = op.cache_positions[b][s].item<int64_t>();
      }
      for (int64_t h = 0; h < c.Hk; ++h) {
        (heads_first ? kc[outer][h][inner] : kc[outer][inner][h]).copy_(ref_k[b][h][s] / scale_of(op.k_scale, h));
        (heads_first ? vc[outer][h][inner] : vc[outer][inner][h]).copy_(v[b][h][s] / scale_of(op.v_scale, h));
      }
    }
  }
  return {kc, vc};
}

void check(const NormKVCase& c) {
  const at::Tensor freqs = rotary::rope_freqs(c.rotary_dim, 64);
  std::vector<int64_t> axes;  // N-D: pair j's axis
  for (int64_t j = 0; c.nd && j < c.rotary_dim / 2; ++j) axes.push_back(j % 3);
  const int64_t start = c.nd ? 0 : c.start;  // N-D ids are absolute
  const at::Tensor qw = 1 + 0.5 * at::randn({c.heads ? c.Hq * c.D : c.D});
  const at::Tensor kw = 1 + 0.5 * at::randn({c.heads ? c.Hk * c.D : c.D});
  const std::optional<at::Tensor> oqw(qw), okw(kw), none;
  const char* norm = c.heads ? "heads" : "head";
  // A block per row; one block walking every row; 2 blocks, a stride of 2
  // rows that wraps past a batch row's S = 3 (the (b, s) step's carry).
  for (const int64_t blocks : {int64_t{1} << 20, int64_t{1}, int64_t{2}}) {
    const std::string what = c.name + (blocks < 4 ? " " + std::to_string(blocks) + " blocks" : "");
    const NormKVInputs op = make(c, 11);
    NormKVInputs fused = rotary_test::copy_cache_inputs(op), two = rotary_test::copy_cache_inputs(op);
    auto prepare = [&](NormKVInputs& in) {
      const auto cache_pos = opt(in.cache_positions), slots = opt(in.slots);
      const auto k_scale = opt(in.k_scale), v_scale = opt(in.v_scale);
      const auto ids = opt(in.ids);
      const rotary::detail::RopeArgs args{start, c.interleaved, none, ids, false, none, none,
                                          "BHSD", c.rotary_offset,
                                          c.nd ? at::OptionalIntArrayRef(axes) : at::OptionalIntArrayRef()};
      const rotary::detail::KVArgs kvargs{cache_pos, slots, c.kv_layout, k_scale, v_scale};
      const rotary::detail::NormArgs nargs{oqw, okw, 1e-5, norm, 0.0, none};
      return rotary::detail::prepare_norm_kv("test", in.q, in.k, in.v, in.kc, in.vc, freqs, args, kvargs, nargs);
    };
    const auto p_fused = prepare(fused);
    const auto p_two = prepare(two);
    NormKVInputs want = op;  // the CPU op's inputs; device-side bad slots become its -1
    if (paged(c)) {  // out of range after the host check, as device-side values are: skipped
      const int64_t n = c.B * c.S;  // the last two tokens (the first is -1 already)
      for (NormKVInputs* in : {&fused, &two}) {
        in->slots.view(-1)[n - 1] = in->kc.size(0) * kPageRows;
        in->slots.view(-1)[n - 2] = -5;
      }
      want.slots = op.slots.clone();
      want.slots.view(-1)[n - 1] = want.slots.view(-1)[n - 2] = -1;
    }
    bool vector_cache = false;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.dtype, "emulate", [&] {
      if (c.fp8) {
        vector_cache = emulate<scalar_t, uint8_t>(p_fused, p_two, blocks);
      } else {
        vector_cache = emulate<scalar_t, scalar_t>(p_fused, p_two, blocks);
      }
    });
    if (c.vector_cache) EXPECT_EQ(vector_cache, *c.vector_cache) << what + ": the cache write's path";
    // The launch wrote rows (so equal bits are not two untouched caches).
    ASSERT_FALSE(SameBits(fused.kc, op.kc)) << what;
    ASSERT_FALSE(SameBits(fused.vc, op.vc)) << what;
    EXPECT_TRUE(SameBits(fused.q, two.q)) << what + " q";
    EXPECT_TRUE(SameBits(fused.k, two.k)) << what + " k";
    EXPECT_TRUE(SameBits(fused.kc, two.kc)) << what + " k_cache";
    EXPECT_TRUE(SameBits(fused.vc, two.vc)) << what + " v_cache";

    // The float64 reference: q and k within the dtype's tolerance, the
    // caches' rows where the call puts them, within one rounding to the
    // cache dtype (fp8: half a step, 2^-4 relative, plus k's own error).
    const auto tol = rotary_test::tolerance_for(c.dtype);
    const rotary_test::Tolerance fp8_tol{1e-2, 0.07};
    const auto reference = [&](const at::Tensor& x, const at::Tensor& w) {
      return rotary_test::ref_norm_rope(x, w, c.heads, 1e-5, 0.0, start, c.interleaved, c.rotary_offset, c.rotary_dim,
                                        opt(op.ids), axes);
    };
    const at::Tensor ref_q = reference(op.q, qw);
    const at::Tensor ref_k = reference(op.k, kw);
    EXPECT_TRUE(rotary_test::AllClose(fused.q, ref_q, tol)) << what + " q vs reference";
    EXPECT_TRUE(rotary_test::AllClose(fused.k, ref_k, tol)) << what + " k vs reference";
    const auto [ref_kc, ref_vc] = expected_caches(c, op, want.slots, ref_k);
    EXPECT_TRUE(rotary_test::AllClose(values(fused.kc), ref_kc, c.fp8 ? fp8_tol : tol)) << what + " k_cache vs reference";
    EXPECT_TRUE(rotary_test::AllClose(values(fused.vc), ref_vc, c.fp8 ? fp8_tol : rotary_test::Tolerance{0.0, 0.0}))
        << what + " v_cache vs reference";

    // The CPU op (its own kernel and reduction order): q and k within the
    // dtype's tolerance, v's cache rows equal, k's within one step of the
    // cache dtype (fp8: 2^-3 relative).
    rotary::apply_qk_norm_rope_with_kv_cache_(
        want.q, want.k, want.v, want.kc, want.vc, freqs, start, c.interleaved, std::nullopt, opt(want.ids),
        std::nullopt, std::nullopt, "BHSD", opt(want.cache_positions), opt(want.slots), c.kv_layout,
        opt(want.k_scale), opt(want.v_scale), false, c.rotary_offset,
        c.nd ? at::OptionalIntArrayRef(axes) : at::OptionalIntArrayRef(), oqw, okw, 1e-5, norm);
    EXPECT_TRUE(rotary_test::AllClose(fused.q, want.q, tol)) << what + " q vs CPU";
    EXPECT_TRUE(rotary_test::AllClose(fused.k, want.k, tol)) << what + " k vs CPU";
    EXPECT_TRUE(SameBits(fused.vc, want.vc)) << what + " v_cache vs CPU";
    const rotary_test::Tolerance cache_tol = c.fp8 ? rotary_test::Tolerance{1e-2, 0.13} : tol;
    EXPECT_TRUE(rotary_test::AllClose(values(fused.kc), values(want.kc), cache_tol)) << what + " k_cache vs CPU";
  }
}

// Every dtype, cache dtype, cache layout and norm kind.
TEST(NormKVEmulation, DtypesLayoutsNorms) {
  rotary_test::for_each_cache_case<NormKVCase>([](const NormKVCase& base) {
    for (const bool heads : {false, true}) {
      NormKVCase c = base;
      c.name += heads ? " heads" : " head";
      c.heads = heads;
      c.interleaved = heads;
      check(c);
    }
  });
}

// The op's features, both pairings.
TEST(NormKVEmulation, Features) {
  std::vector<NormKVCase> cases;
  auto add = [&](const std::string& name, auto edit) { rotary_test::add_both_pairings(cases, name, edit); };
  add("partial span inside the head", [](NormKVCase& c) { c.D = 64, c.rotary_dim = 32, c.rotary_offset = 16, c.vd = 64; });
  add("decode S=1, start 0", [](NormKVCase& c) { c.start = 0, c.S = 1, c.B = 5; });
  add("cache_positions", [](NormKVCase& c) { c.cache_positions = true, c.kv_layout = "BSHD"; });
  add("MLA v_dim 16", [](NormKVCase& c) { c.vd = 16, c.kv_layout = "HND"; });
  add("MLA v_dim 48, norm heads", [](NormKVCase& c) { c.vd = 48, c.heads = true; });
  add("fp8 per-head scales", [](NormKVCase& c) { c.fp8 = true, c.per_head_scale = true; });
  add("GQA 8/1 heads, D 128", [](NormKVCase& c) {
    c.Hq = 8, c.Hk = 1, c.D = 128, c.rotary_dim = 64, c.vd = 128, c.vector_cache = true;
  });
  // v rows of 20 bf16 elements are not whole vectors: the vector path's
  // launch writes the caches element by element.
  add("v_dim 20, element-wise cache write", [](NormKVCase& c) { c.vd = 20, c.vector_cache = false; });
  add("fp8, vector cache write", [](NormKVCase& c) { c.fp8 = true, c.vector_cache = true; });
  add("N-D ids, vector cache write", [](NormKVCase& c) { c.nd = true, c.D = 64, c.rotary_dim = 48, c.rotary_offset = 8,
                                                        c.vd = 64, c.vector_cache = true; });
  add("N-D ids, norm heads, cache_positions", [](NormKVCase& c) {
    c.nd = true, c.heads = true, c.cache_positions = true, c.kv_layout = "BSHD";
  });
  add("many rows", [](NormKVCase& c) { c.B = 3, c.S = 20, c.kv_layout = "HND"; });
  // 12 x 96 cache elements a row: 9 per thread of 128, a full batch and
  // one more, whose elements cross heads (96 is not the thread count).
  add("wide rows, two cache batches", [](NormKVCase& c) { c.Hq = 24, c.Hk = 12, c.D = 96, c.rotary_dim = 96, c.vd = 96; });
  for (const NormKVCase& c : cases) check(c);
}

}  // namespace

#endif  // ROTARY_EMULATION
