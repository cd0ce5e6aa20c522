// A seeded fuzz of apply_rope_with_kv_cache_'s CUDA launch through its host
// emulation (kv_emulation.h): random calls (fuzz_draw.h's rotation, in
// place, with the inverse 1 in 5; v of its own width; a cache of k's dtype
// or fp8 with per-tensor or per-head scales, contiguous BHSD / BSHD or paged
// NHD / HND, rows aligned or one element apart; slots with skipped and
// device-side out-of-range entries; cache_positions) at both index widths,
// with one block walking every row and with copy blocks. q, k and both
// caches must have the CPU op's bits, and q and k the float64 reference's
// values. The same calls with the prologue's norm
// (apply_qk_norm_rope_with_kv_cache_, its own launch: norm_emulation.h) on
// three grids must match the CPU op within the dtype's tolerance (its
// reduction order is its own), v's cache rows bit for bit, and the float64
// reference. ROTARY_FUZZ_CASES (default 40) and ROTARY_FUZZ_SEED (default
// 0) pick the cases.
#ifdef ROTARY_EMULATION

#include "checks/kv_checks.h"
#include "checks/norm_checks.h"
#include "fuzz_draw.h"
#include "helpers.h"
#include "kv_emulation.h"
#include "norm_emulation.h"

#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

using rotary_test::Draw;
using rotary_test::RopeDraw;

using rotary_emulation::kBlock;
using rotary_emulation::kRows;

struct KVDraw {
  RopeDraw rope;
  bool inverse = false, fp8 = false, misaligned = false;
  std::string kv_layout;
  at::Tensor v, kc, vc, slots, cache_positions, k_scale, v_scale;
  int64_t out_of_range = -1;  // a token whose device-side slot is past the cache (flat index), or -1
  std::string what;
};

bool paged(const KVDraw& c) {
  return c.kv_layout == "NHD" || c.kv_layout == "HND";
}

KVDraw draw_kv(Draw& d) {
  static const char* kLayouts[] = {"BHSD", "BSHD", "NHD", "HND"};
  KVDraw c;
  c.rope = rotary_test::draw_rope(d);
  RopeDraw& r = c.rope;
  r.in_place = true;  // the KV op rotates in place
  c.inverse = d.coin(0.2);
  c.kv_layout = kLayouts[d.in(0, 3)];
  const at::Tensor k = r.bhsd(r.k);
  const int64_t B = k.size(0), Hk = k.size(1), S = k.size(2), D = k.size(3);
  const int64_t vd = d.coin() ? D : 2 * d.in(1, D);
  const at::ScalarType dtype = k.scalar_type();
  at::Tensor v = d.coin() ? rotary_test::randn({B, S, Hk, vd}, dtype).transpose(1, 2)
                          : rotary_test::randn({B, Hk, S, vd}, dtype);
  c.v = r.varlen ? v.squeeze(0).transpose(0, 1) : v;
  c.fp8 = d.coin(0.3);
  c.misaligned = d.coin(0.15);
  // Contiguous caches: a row per sequence; paged: enough blocks for every token.
  const int64_t seqs = r.varlen ? r.cu_seqlens->size(0) - 1 : B;
  const int64_t outer = paged(c) ? (B * S + 5) / kBlock + 2 : seqs;
  const int64_t inner = paged(c) ? kBlock : kRows;
  const bool heads_first = c.kv_layout == "BHSD" || c.kv_layout == "HND";
  const auto cache = [&](int64_t width) {
    const int64_t w = width + (c.misaligned ? 1 : 0);
    const std::vector<int64_t> shape =
        heads_first ? std::vector<int64_t>{outer, Hk, inner, w} : std::vector<int64_t>{outer, inner, Hk, w};
    return (at::randn(shape) * 3).to(c.fp8 ? at::kFloat8_e4m3fn : dtype).narrow(3, 0, width);
  };
  c.kc = cache(D);
  c.vc = cache(vd);
  if (paged(c)) {
    c.slots = at::randperm(outer * kBlock, at::kLong).narrow(0, 0, B * S).reshape({B, S}).contiguous();
    if (d.coin()) c.slots.view(-1)[d.in(0, B * S - 1)] = -1;
    if (d.coin(0.3)) c.out_of_range = d.in(0, B * S - 1);
  } else if (!r.axes.empty() || r.ids || r.inv_freq || d.coin()) {
    // N-D ids are not rows; ids may repeat or pass the rows: distinct rows of their own.
    std::vector<at::Tensor> rows;
    for (int64_t b = 0; b < B; ++b) rows.push_back(at::randperm(kRows, at::kLong).narrow(0, 0, S));
    c.cache_positions = at::stack(rows).to(d.coin() ? at::kInt : at::kLong);
    if (r.varlen) c.cache_positions = c.cache_positions.view(-1);  // [total_tokens]
  }
  if (c.fp8) std::tie(c.k_scale, c.v_scale) = rotary_test::fp8_scales(d.coin(), Hk);
  c.what = r.what + (c.inverse ? ", inverse" : "") + ", v_dim " + std::to_string(vd) + ", " + c.kv_layout +
      (c.fp8 ? " fp8" : "") + (c.misaligned ? " misaligned" : "") + (c.cache_positions.defined() ? ", cache_positions" : "") +
      (c.out_of_range >= 0 ? ", a slot past the cache" : "");
  return c;
}

// Call c on every launch of it against the CPU op and the float64 reference;
// whether the launch is the fused one.
bool check_call(const KVDraw& c) {
  const RopeDraw& r = c.rope;
  const at::ScalarType dtype = r.q.scalar_type();
  const auto copy = [](const at::Tensor& t) { return rotary_test::same_strides(t); };
  const auto opt = rotary_test::opt;
  // The CPU op, with a device-side out-of-range slot as the -1 it is skipped as.
  at::Tensor want_q = copy(r.q), want_k = copy(r.k), want_kc = copy(c.kc), want_vc = copy(c.vc);
  at::Tensor want_slots = c.slots.defined() ? c.slots.clone() : c.slots;
  if (c.out_of_range >= 0) want_slots.view(-1)[c.out_of_range] = -1;
  rotary::apply_rope_with_kv_cache_(want_q, want_k, c.v, want_kc, want_vc, r.table, r.start_pos(), r.interleaved,
                                    r.offsets, r.ids, r.cu_seqlens, r.inv_freq, r.layout(), opt(c.cache_positions),
                                    opt(want_slots), c.kv_layout, opt(c.k_scale), opt(c.v_scale), c.inverse, r.off,
                                    r.pair_axes());
  const at::Tensor ref_q = r.reference(r.bhsd(r.q), c.inverse), ref_k = r.reference(r.bhsd(r.k), c.inverse);
  const auto tol = rotary_test::tolerance_for(dtype);
  EXPECT_TRUE(rotary_test::AllClose(r.bhsd(want_q), ref_q, tol)) << "CPU q vs reference";
  const std::vector<std::pair<int64_t, bool>> modes = {{int64_t{1} << 40, false}, {1, false}, {int64_t{1} << 40, true}};
  bool all_fused = true;  // the launch is the call's, whatever the grid
  for (const bool index64 : {false, true}) {
    for (const auto& [max_blocks, copy_blocks] : modes) {
      SCOPED_TRACE(std::string(index64 ? "int64" : "int32") + (max_blocks == 1 ? ", one block" : "") +
                   (copy_blocks ? ", copy blocks" : ""));
      at::Tensor q = copy(r.q), k = copy(r.k), kc = copy(c.kc), vc = copy(c.vc);
      at::Tensor slots = c.slots.defined() ? c.slots.clone() : c.slots;
      const auto cache_pos = opt(c.cache_positions), slot_arg = opt(slots);
      const auto k_scale = opt(c.k_scale), v_scale = opt(c.v_scale);
      const rotary::detail::KVArgs kvargs{cache_pos, slot_arg, c.kv_layout, k_scale, v_scale};
      const auto prepared = rotary::detail::prepare_kv("fuzz", q, k, c.v, kc, vc, r.table, r.args(c.inverse), kvargs);
      if (c.out_of_range >= 0) slots.view(-1)[c.out_of_range] = kc.size(0) * kBlock;  // after the host check
      bool fused = false;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "emulate", [&] {
        fused = c.fp8 ? rotary_emulation::emulate_kv<scalar_t, uint8_t>(prepared.params, index64, max_blocks,
                                                                        copy_blocks)
                      : rotary_emulation::emulate_kv<scalar_t, scalar_t>(prepared.params, index64, max_blocks,
                                                                         copy_blocks);
      });
      all_fused = all_fused && fused;
      EXPECT_TRUE(rotary_test::SameBits(q, want_q)) << "q";
      EXPECT_TRUE(rotary_test::SameBits(k, want_k)) << "k";
      EXPECT_TRUE(rotary_test::SameBits(kc, want_kc)) << "k_cache";
      EXPECT_TRUE(rotary_test::SameBits(vc, want_vc)) << "v_cache";
      EXPECT_TRUE(rotary_test::AllClose(r.bhsd(k), ref_k, tol)) << "k vs reference";
    }
  }
  return all_fused;
}

TEST(KVEmulationFuzz, SeededCallsHaveTheCpuOpsBitsOnEveryLaunch) {
  rotary_test::run_fuzz(draw_kv, check_call, "the fused launch");
}

// The prologue's launch with the cache write: call c with norm "head" or
// "heads" and random weights.
void check_norm_call(const KVDraw& c, bool heads) {
  const RopeDraw& r = c.rope;
  const at::ScalarType dtype = r.q.scalar_type();
  const auto copy = [](const at::Tensor& t) { return rotary_test::same_strides(t); };
  const auto opt = rotary_test::opt;
  const int64_t Hq = r.bhsd(r.q).size(1), Hk = r.bhsd(r.k).size(1), D = r.q.size(-1);
  const at::Tensor qw = 1 + 0.5 * at::randn({heads ? Hq * D : D}), kw = 1 + 0.5 * at::randn({heads ? Hk * D : D});
  const std::optional<at::Tensor> oqw(qw), okw(kw), none;
  const char* norm = heads ? "heads" : "head";
  at::Tensor want_q = copy(r.q), want_k = copy(r.k), want_kc = copy(c.kc), want_vc = copy(c.vc);
  at::Tensor want_slots = c.slots.defined() ? c.slots.clone() : c.slots;
  if (c.out_of_range >= 0) want_slots.view(-1)[c.out_of_range] = -1;
  rotary::apply_qk_norm_rope_with_kv_cache_(
      want_q, want_k, c.v, want_kc, want_vc, r.table, r.start_pos(), r.interleaved, r.offsets, r.ids, r.cu_seqlens,
      r.inv_freq, r.layout(), opt(c.cache_positions), opt(want_slots), c.kv_layout, opt(c.k_scale), opt(c.v_scale),
      c.inverse, r.off, r.pair_axes(), oqw, okw, 1e-5, norm);
  const auto tol = rotary_test::tolerance_for(dtype);
  const rotary_test::Tolerance cache_tol = c.fp8 ? rotary_test::Tolerance{1e-2, 0.13} : tol;
  const at::Tensor ref_q = r.reference(rotary_test::ref_norm(r.bhsd(r.q), qw, heads, 1e-5, 0.0), c.inverse);
  const at::Tensor ref_k = r.reference(rotary_test::ref_norm(r.bhsd(r.k), kw, heads, 1e-5, 0.0), c.inverse);
  for (const int64_t blocks : {int64_t{1} << 20, int64_t{1}, int64_t{2}}) {
    SCOPED_TRACE(std::to_string(blocks) + " blocks");
    at::Tensor q = copy(r.q), k = copy(r.k), kc = copy(c.kc), vc = copy(c.vc);
    at::Tensor slots = c.slots.defined() ? c.slots.clone() : c.slots;
    const auto cache_pos = opt(c.cache_positions), slot_arg = opt(slots);
    const auto k_scale = opt(c.k_scale), v_scale = opt(c.v_scale);
    const rotary::detail::KVArgs kvargs{cache_pos, slot_arg, c.kv_layout, k_scale, v_scale};
    const rotary::detail::NormArgs nargs{oqw, okw, 1e-5, norm, 0.0, none};
    const auto prepared =
        rotary::detail::prepare_norm_kv("fuzz", q, k, c.v, kc, vc, r.table, r.args(c.inverse), kvargs, nargs);
    if (c.out_of_range >= 0) slots.view(-1)[c.out_of_range] = kc.size(0) * kBlock;  // after the host check
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "emulate", [&] {
      using T = typename rotary::cuda::CudaType<scalar_t>::type;
      c.fp8 ? rotary_test::emulate_norm_rope<T, uint8_t>(prepared.kv.params, prepared.norm.params, blocks)
            : rotary_test::emulate_norm_rope<T, T>(prepared.kv.params, prepared.norm.params, blocks);
    });
    EXPECT_TRUE(rotary_test::AllClose(r.bhsd(q), ref_q, tol)) << "q vs reference";
    EXPECT_TRUE(rotary_test::AllClose(r.bhsd(k), ref_k, tol)) << "k vs reference";
    EXPECT_TRUE(rotary_test::AllClose(q, want_q, tol)) << "q vs CPU";
    EXPECT_TRUE(rotary_test::AllClose(k, want_k, tol)) << "k vs CPU";
    EXPECT_TRUE(rotary_test::AllClose(kc.to(at::kDouble), want_kc.to(at::kDouble), cache_tol)) << "k_cache vs CPU";
    EXPECT_TRUE(rotary_test::SameBits(vc, want_vc)) << "v_cache vs CPU";
  }
}

TEST(KVEmulationFuzz, SeededPrologueCallsMatchTheCpuOpOnEveryGrid) {
  rotary_test::run_fuzz([](Draw& d, std::string& what) {
    const KVDraw c = draw_kv(d);
    const bool heads = d.coin();
    what = c.what + (heads ? ", norm heads" : ", norm head");
    SCOPED_TRACE(what);
    check_norm_call(c, heads);
    return false;
  });
}

}  // namespace

#endif  // ROTARY_EMULATION
