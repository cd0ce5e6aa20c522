// A seeded fuzz of the CUDA RoPE kernel through its host emulation
// (rope_emulation.h): random apply_rope_qk calls (fuzz_draw.h, and the
// inverse rotation) on every launch the kernel can take for them: the
// vector path where the call allows it and the strided path always, 32- and
// 64-bit index math, a grid of every row block and one of 2 that wraps, with
// and without the L2 prefetch of next rows. Each must match the float64
// reference, the CPU op and the others bit for bit. ROTARY_FUZZ_CASES
// (default 40) and ROTARY_FUZZ_SEED (default 0) pick the cases.
#ifdef ROTARY_EMULATION

#include "fuzz_draw.h"
#include "helpers.h"
#include "reference.h"
#include "rope_emulation.h"

#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

using rotary_emulation::Variant;
using rotary_test::Draw;
using rotary_test::RopeDraw;

// Call r on every launch of it against the float64 reference and the CPU op;
// whether the vector path can take it.
bool check_call(const RopeDraw& r, bool inverse) {
  const at::ScalarType dtype = r.q.scalar_type();
  const auto tol = rotary_test::tolerance_for(dtype);
  const at::Tensor ref[2] = {r.reference(r.bhsd(r.q), inverse), r.reference(r.bhsd(r.k), inverse)};
  const auto [cpu_q, cpu_k] = rotary::apply_rope_qk(r.q, r.k, r.table, r.start_pos(), r.interleaved, r.offsets, r.ids,
                                                    inverse, r.cu_seqlens, r.inv_freq, r.layout(), r.off,
                                                    r.pair_axes());
  const at::Tensor cpu[2] = {r.bhsd(cpu_q), r.bhsd(cpu_k)};
  at::Tensor first[2];
  bool vector = false;
  for (const bool vectorized : {true, false}) {
    std::vector<Variant> variants = rotary_emulation::variants(vectorized);
    variants.push_back({vectorized, false, 2, false});  // a wrapping grid without the prefetch
    for (const Variant& v : variants) {
      SCOPED_TRACE(std::string(vectorized ? "vector" : "strided") + (v.index64 ? ", int64" : ", int32 if it fits") +
                   ", " + std::to_string(v.max_blocks) + " blocks at most" + (v.prefetch ? "" : ", no prefetch"));
      at::Tensor q = rotary_test::same_strides(r.q), k = rotary_test::same_strides(r.k);
      const auto prepared = rotary::detail::prepare_rope("fuzz", q, &k, r.table, r.args(inverse), r.in_place);
      if (vectorized && !rotary_emulation::vectorizable(dtype, prepared.params)) break;
      vector = vector || vectorized;
      if (!r.in_place) rotary_emulation::poison(prepared);
      rotary_emulation::emulate_dtype(dtype, prepared.params, v);
      const at::Tensor out[2] = {r.bhsd(prepared.out_q), r.bhsd(prepared.out_k)};
      for (int t = 0; t < 2; ++t) {
        EXPECT_TRUE(rotary_test::AllClose(out[t], ref[t], tol)) << (t ? "k" : "q") << " vs reference";
        EXPECT_TRUE(rotary_test::AllClose(out[t], cpu[t], tol)) << (t ? "k" : "q") << " vs CPU";
        if (!first[t].defined()) {
          first[t] = out[t].to(at::kDouble);
        } else {
          EXPECT_TRUE(at::equal(first[t], out[t].to(at::kDouble))) << (t ? "k" : "q") << ": launch-dependent bits";
        }
      }
    }
  }
  return vector;
}

TEST(RopeEmulationFuzz, SeededCallsMatchTheReferenceTheCpuOpAndEveryLaunch) {
  rotary_test::run_fuzz(
      [](Draw& d, std::string& what) {
        const RopeDraw r = rotary_test::draw_rope(d);
        const bool inverse = d.coin(0.2);
        what = r.what + (inverse ? ", inverse" : "");
        SCOPED_TRACE(what);
        return check_call(r, inverse);
      },
      "the vector path");
}

}  // namespace

#endif  // ROTARY_EMULATION
