// A seeded fuzz of the prologue's CUDA kernel through its host emulation
// (norm_emulation.h), so that every path of it (vector and element, norm
// "head" and "heads", 1-D and N-D positions, packed sequences, fp8 q, rows
// past the table) meets random calls without a GPU (fuzz_draw.h: dtypes,
// head sizes, rotated spans and offsets, head counts, pairings, aligned,
// misaligned, packed and strided rows, in place or not; here the norm, its
// weights, fp8 q and the inverse rotation). Each call runs on a grid of a
// block per row and of 1 to 3 blocks (the grid-stride walk) and must match
// the float64 reference, the CPU op (its own kernel) and itself across
// grids, bit for bit. ROTARY_FUZZ_CASES (default 40) and ROTARY_FUZZ_SEED
// (default 0) pick the cases.
#ifdef ROTARY_EMULATION

#include "checks/norm_checks.h"
#include "fuzz_draw.h"
#include "helpers.h"
#include "norm_emulation.h"
#include "reference.h"

#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>
#include <optional>
#include <string>

namespace {

using rotary_test::Draw;
using rotary_test::RopeDraw;

// A call: a drawn rotation, its norm and weights, and fp8 q.
struct FuzzCall {
  RopeDraw rope;
  at::Tensor qw, kw;
  std::optional<at::Tensor> q_scale;
  bool heads = false, inverse = false;
  std::string what;
};

FuzzCall draw_call(Draw& d) {
  FuzzCall c;
  c.rope = rotary_test::draw_rope(d);
  const RopeDraw& r = c.rope;
  const int64_t Hq = r.bhsd(r.q).size(1), Hk = r.bhsd(r.k).size(1), D = r.q.size(-1);
  c.heads = d.coin();
  c.inverse = d.coin(0.2);
  c.qw = 1 + 0.5 * at::randn({c.heads ? Hq * D : D});
  c.kw = 1 + 0.5 * at::randn({c.heads ? Hk * D : D});
  if (!r.in_place && d.coin(0.2)) c.q_scale = Hq > 1 && d.coin() ? at::rand({Hq}) * 0.02 + 0.004 : at::full({}, 0.011);
  c.what = r.what + (c.heads ? ", norm heads" : ", norm head") + (c.q_scale ? ", fp8 q" : "") +
      (c.inverse ? ", inverse" : "");
  return c;
}

template <typename T>
void emulate_as(const rotary::detail::PreparedNormRope& prepared, int64_t blocks) {
  rotary::kernel::KVCacheParams kv;  // no caches
  kv.rope = prepared.rope.params;
  rotary_test::emulate_norm_rope<T>(kv, prepared.norm.params, blocks);
}

// The emulated launch of call c on `blocks` blocks: q and k out, in [B, H,
// S, D], and whether the launch takes the vector instantiation.
struct Emulated {
  at::Tensor q, k;
  bool vector;
};
Emulated run_emulation(const FuzzCall& c, int64_t blocks) {
  const RopeDraw& r = c.rope;
  at::Tensor q = rotary_test::same_strides(r.q), k = rotary_test::same_strides(r.k);
  const std::optional<at::Tensor> qw(c.qw), kw(c.kw);
  const rotary::detail::NormArgs nargs{qw, kw, 1e-5, c.heads ? "heads" : "head", 0.0, c.q_scale};
  const auto prepared = rotary::detail::prepare_norm_rope("fuzz", q, k, r.table, r.args(c.inverse), nargs, r.in_place);
  if (c.q_scale) {
    prepared.rope.out_q.view(at::kByte).fill_(0x7f);  // NaN in float8_e4m3fn
  } else if (!r.in_place) {
    prepared.rope.out_q.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  if (!r.in_place) prepared.rope.out_k.fill_(std::numeric_limits<double>::quiet_NaN());
  switch (r.q.scalar_type()) {
    case at::kFloat: emulate_as<float>(prepared, blocks); break;
    case at::kDouble: emulate_as<double>(prepared, blocks); break;
    case at::kHalf: emulate_as<__half>(prepared, blocks); break;
    default: emulate_as<__nv_bfloat16>(prepared, blocks); break;
  }
  return {r.bhsd(prepared.rope.out_q), r.bhsd(prepared.rope.out_k),
          rotary::kernel::norm_grid(prepared.rope.params, blocks, r.q.element_size()).items > 0};
}

// Call c on the emulated grids against the float64 reference and the CPU op;
// whether the launch takes its vector instantiation.
bool check_call(const FuzzCall& c) {
  const RopeDraw& r = c.rope;
  const at::ScalarType dtype = r.q.scalar_type();
  // The float64 reference and the CPU op.
  const at::Tensor ref[2] = {r.reference(rotary_test::ref_norm(r.bhsd(r.q), c.qw, c.heads, 1e-5, 0.0), c.inverse),
                             r.reference(rotary_test::ref_norm(r.bhsd(r.k), c.kw, c.heads, 1e-5, 0.0), c.inverse)};
  const auto [cpu_q, cpu_k] = rotary::apply_qk_norm_rope(
      r.q, r.k, r.table, r.start_pos(), r.interleaved, r.offsets, r.ids, c.inverse, r.cu_seqlens, r.inv_freq, r.layout(),
      r.off, r.pair_axes(), c.qw, c.kw, 1e-5, c.heads ? "heads" : "head", 0.0, c.q_scale);
  const at::Tensor cpu[2] = {r.bhsd(cpu_q), r.bhsd(cpu_k)};
  at::Tensor first[2];
  bool vector = false;
  for (const int64_t blocks : {int64_t{1} << 20, int64_t{1}, int64_t{2}, int64_t{3}}) {
    SCOPED_TRACE(std::to_string(blocks) + " blocks");
    const Emulated e = run_emulation(c, blocks);
    const at::Tensor out[2] = {e.q, e.k};
    vector = vector || e.vector;
    for (int t = 0; t < 2; ++t) {
      if (t == 0 && c.q_scale) {  // fp8: x / scale within half an fp8 step; the CPU op's bytes within one
        const at::Tensor scale = c.q_scale->to(at::kDouble).reshape({1, -1, 1, 1});
        EXPECT_TRUE(rotary_test::AllClose(out[t].to(at::kDouble), (ref[t] / scale).clamp(-448, 448), {1e-3, 0.0625}));
        EXPECT_TRUE(rotary_test::AllClose(out[t].to(at::kDouble), cpu[t].to(at::kDouble), {1e-2, 0.13}));
      } else {
        EXPECT_TRUE(rotary_test::AllClose(out[t], ref[t], rotary_test::tolerance_for(dtype))) << (t ? "k" : "q");
        EXPECT_TRUE(rotary_test::AllClose(out[t], cpu[t], rotary_test::tolerance_for(dtype))) << (t ? "k" : "q");
      }
      if (!first[t].defined()) {
        first[t] = out[t].to(at::kDouble);
      } else {
        EXPECT_TRUE(at::equal(first[t], out[t].to(at::kDouble))) << "grid-dependent bits";
      }
    }
  }
  return vector;
}

TEST(NormEmulationFuzz, SeededCallsMatchTheReferenceTheCpuOpAndEveryGrid) {
  rotary_test::run_fuzz(draw_call, check_call, "the vector instantiation");
}

}  // namespace

#endif  // ROTARY_EMULATION
