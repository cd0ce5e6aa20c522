// Host emulation of the fused KV-cache launch (cuda/rope_kv_kernel.cuh): the
// RoPE kernel's per-thread body with a CacheSink, run over its whole grid
// on the CPU, must leave q, k and both caches with the bits the CPU op
// gives, for every dtype, cache dtype (fp8 with per-tensor and per-head
// scales), cache layout, pairing and feature of the op (start_pos, partial
// rotary inside the head, inverse, cache_positions, packed varlen, N-D ids
// with pair_axes, MLA's own v_dim, skipped and out-of-range slots), at both
// index widths, with one block walking every row block, and with copy
// blocks copying v and the pass-through dims beside the rotation. Caches the
// fused kernel cannot vector-address take the two-launch path, emulated
// the same way.
#ifdef ROTARY_EMULATION

#include "checks/kv_checks.h"
#include "helpers.h"
#include "kv_emulation.h"

#include <rotary/freqs.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using rotary_test::dtype_name;
using rotary_test::opt;
using rotary_test::SameBits;

struct FusedCase {
  std::string name;
  at::ScalarType dtype = at::kBFloat16;
  bool fp8 = false;
  bool per_head_scale = false;
  std::string kv_layout = "BHSD";
  std::string layout = "BHSD";
  bool interleaved = false;
  int64_t B = 2, S = 3, Hq = 4, Hk = 2, D = 32, rotary_dim = 32, vd = 32;
  int64_t start = 3, rotary_offset = 0;
  bool inverse = false;
  std::string pos = "local";  // local, cache_positions, ids, axes, varlen
  bool fusable = true;        // can_fuse_cache must say so
  bool misaligned = false;    // cache rows one element apart from aligned
  bool packed = false;        // q, k, v as head slices of one [B, S, Hq + 2 Hk, D] projection (BSHD)
};

bool paged(const FusedCase& c) {
  return c.kv_layout == "NHD" || c.kv_layout == "HND";
}

using rotary_emulation::kBlock;
using rotary_emulation::kRows;

struct FusedInputs {
  at::Tensor q, k, v, kc, vc, freqs, slots, cache_positions, position_ids, cu_seqlens, k_scale, v_scale;
};

// A cache of `width` dims per head row in c's layout, filled with random
// values (fp8: their bits), or a view with rows one element wider.
at::Tensor make_cache(const FusedCase& c, int64_t outer, int64_t width) {
  const int64_t w = width + (c.misaligned ? 1 : 0);
  std::vector<int64_t> shape;
  if (c.kv_layout == "BHSD" || c.kv_layout == "HND") {
    shape = {outer, c.Hk, paged(c) ? kBlock : kRows, w};
  } else {
    shape = {outer, paged(c) ? kBlock : kRows, c.Hk, w};
  }
  at::Tensor t = (at::randn(shape) * 3).to(c.fp8 ? at::kFloat8_e4m3fn : c.dtype);
  return c.misaligned ? t.narrow(3, 0, width) : t;
}

// q/k/v as [B, H, S, D] or [B, S, H, D] per c.layout (varlen: [T, H, D]).
at::Tensor make_heads(const FusedCase& c, int64_t heads, int64_t dim, int64_t seq, int64_t batch) {
  const std::vector<int64_t> shape = c.pos == "varlen"   ? std::vector<int64_t>{seq, heads, dim}
                                     : c.layout == "BHSD" ? std::vector<int64_t>{batch, heads, seq, dim}
                                                          : std::vector<int64_t>{batch, seq, heads, dim};
  return at::randn(shape).to(c.dtype);
}

FusedInputs make(const FusedCase& c, int64_t seed) {
  at::manual_seed(seed);
  FusedInputs in;
  const bool varlen = c.pos == "varlen";
  const std::vector<int64_t> lens = {3, 1, 4};
  const int64_t batch = varlen ? 1 : c.B, seq = varlen ? 8 : c.S;
  if (c.packed) {
    const at::Tensor qkv = at::randn({batch, seq, c.Hq + 2 * c.Hk, c.D}).to(c.dtype);
    in.q = qkv.narrow(2, 0, c.Hq);
    in.k = qkv.narrow(2, c.Hq, c.Hk);
    in.v = qkv.narrow(2, c.Hq + c.Hk, c.Hk);
  } else {
    in.q = make_heads(c, c.Hq, c.D, seq, batch);
    in.k = make_heads(c, c.Hk, c.D, seq, batch);
    in.v = make_heads(c, c.Hk, c.vd, seq, batch);
  }
  in.freqs = rotary::rope_freqs(c.rotary_dim, 64);
  const int64_t outer = paged(c) ? (c.B * c.S + 5) / kBlock + 2 : (varlen ? 3 : c.B);
  in.kc = make_cache(c, outer, c.D);
  in.vc = make_cache(c, outer, c.vd);
  if (paged(c)) {
    in.slots = at::randperm(outer * kBlock, at::kLong).narrow(0, 0, batch * seq).reshape({batch, seq}).contiguous();
    in.slots[0][0] = -1;
  }
  if (varlen) in.cu_seqlens = at::tensor(std::vector<int64_t>{0, 3, 4, 8}, at::kInt);
  if (c.pos == "cache_positions" || c.pos == "axes") {
    std::vector<at::Tensor> rows;
    for (int64_t b = 0; b < batch; ++b) rows.push_back(at::randperm(kRows, at::kLong).narrow(0, 0, seq));
    in.cache_positions = at::stack(rows).to(at::kInt);
  }
  if (c.pos == "ids") {  // distinct rows start + id < kRows
    std::vector<at::Tensor> rows;
    for (int64_t b = 0; b < batch; ++b) rows.push_back(at::randperm(kRows - c.start, at::kLong).narrow(0, 0, seq));
    in.position_ids = at::stack(rows);
  }
  if (c.pos == "axes") in.position_ids = at::randint(0, 40, {3, batch, seq}, at::kLong);
  if (c.fp8) std::tie(in.k_scale, in.v_scale) = rotary_test::fp8_scales(c.per_head_scale, c.Hk);
  return in;
}

std::vector<int64_t> pair_axes(const FusedCase& c) {
  std::vector<int64_t> axes;
  for (int64_t j = 0; j < c.rotary_dim / 2; ++j) axes.push_back((j * 7) % 3);
  return axes;
}

void check(const FusedCase& c) {
  // All blocks, rows copying their own; one block walking every row block;
  // all blocks with copy blocks.
  const std::vector<std::pair<int64_t, bool>> modes = {{int64_t{1} << 40, false}, {1, false}, {int64_t{1} << 40, true}};
  for (const bool index64 : {false, true}) {
    for (const auto& [max_blocks, copy_blocks] : modes) {
      const std::string what = c.name + (index64 ? " int64" : " int32") + (max_blocks == 1 ? " one block" : "") +
          (copy_blocks ? " copy blocks" : "");
      const FusedInputs op = make(c, 7);
      FusedInputs emu = rotary_test::copy_cache_inputs(op);
      const std::vector<int64_t> axes = pair_axes(c);
      const at::OptionalIntArrayRef axes_ref = c.pos == "axes" ? at::OptionalIntArrayRef(axes) : std::nullopt;
      const auto offsets = std::optional<at::Tensor>(), inv_freq = std::optional<at::Tensor>();
      const auto ids = opt(emu.position_ids), cu = opt(emu.cu_seqlens), cache_pos = opt(emu.cache_positions);
      const auto slots = opt(emu.slots), k_scale = opt(emu.k_scale), v_scale = opt(emu.v_scale);
      const rotary::detail::RopeArgs args{c.start, c.interleaved, offsets, ids, c.inverse, cu, inv_freq,
                                          c.layout, c.rotary_offset, axes_ref};
      const rotary::detail::KVArgs kvargs{cache_pos, slots, c.kv_layout, k_scale, v_scale};
      auto prepared = rotary::detail::prepare_kv("test", emu.q, emu.k, emu.v, emu.kc, emu.vc, emu.freqs, args, kvargs);
      FusedInputs want = op;  // the CPU op's inputs; device-side bad slots become its -1
      if (paged(c)) {     // out of range after the host check, as device-side values are: skipped
        emu.slots[1][1] = emu.kc.size(0) * kBlock;
        emu.slots[1][2] = -5;
        want.slots = op.slots.clone();
        want.slots[1][1] = want.slots[1][2] = -1;
      }
      bool fused = false;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.dtype, "emulate", [&] {
        fused = c.fp8 ? rotary_emulation::emulate_kv<scalar_t, uint8_t>(prepared.params, index64, max_blocks, copy_blocks)
                      : rotary_emulation::emulate_kv<scalar_t, scalar_t>(prepared.params, index64, max_blocks,
                                                                         copy_blocks);
      });
      EXPECT_EQ(fused, c.fusable) << what << ": can_fuse_cache";
      const at::Tensor kc_before = op.kc.clone();
      rotary::apply_rope_with_kv_cache_(want.q, want.k, want.v, want.kc, want.vc, want.freqs, c.start, c.interleaved,
                                        std::nullopt, opt(want.position_ids), opt(want.cu_seqlens), std::nullopt,
                                        c.layout, opt(want.cache_positions), opt(want.slots), c.kv_layout,
                                        opt(want.k_scale), opt(want.v_scale), c.inverse, c.rotary_offset, axes_ref);
      // The op wrote rows (so equal bits are not two untouched caches).
      ASSERT_FALSE(at::equal(kc_before.contiguous().view(at::kByte), want.kc.contiguous().view(at::kByte))) << what;
      EXPECT_TRUE(SameBits(emu.q, want.q)) << what + " q";
      EXPECT_TRUE(SameBits(emu.k, want.k)) << what + " k";
      EXPECT_TRUE(SameBits(emu.kc, want.kc)) << what + " k_cache";
      EXPECT_TRUE(SameBits(emu.vc, want.vc)) << what + " v_cache";
    }
  }
}

// Every dtype, cache dtype, cache layout and pairing.
TEST(KVFusedEmulation, DtypesLayoutsPairings) {
  rotary_test::for_each_cache_case<FusedCase>([](const FusedCase& base) {
    for (const bool interleaved : {false, true}) {
      FusedCase c = base;
      c.name += interleaved ? " interleaved" : " half";
      c.interleaved = interleaved;
      c.fusable = !(c.fp8 && c.dtype == at::kDouble);  // float64 with fp8 keeps two launches
      check(c);
    }
  });
}

// Every feature of the op, on the fused path, both pairings.
TEST(KVFusedEmulation, Features) {
  std::vector<FusedCase> cases;
  auto add = [&](const std::string& name, auto edit) { rotary_test::add_both_pairings(cases, name, edit); };
  add("partial span inside the head", [](FusedCase& c) { c.D = 64, c.rotary_dim = 32, c.rotary_offset = 16, c.vd = 64; });
  add("partial span at the start", [](FusedCase& c) { c.D = 48, c.rotary_dim = 32, c.vd = 48, c.kv_layout = "NHD"; });
  add("inverse", [](FusedCase& c) { c.inverse = true, c.kv_layout = "HND"; });
  add("start 0, decode S=1", [](FusedCase& c) { c.start = 0, c.S = 1, c.B = 5; });
  add("cache_positions", [](FusedCase& c) { c.pos = "cache_positions"; });
  add("position_ids", [](FusedCase& c) { c.pos = "ids", c.start = 0, c.kv_layout = "BSHD"; });
  add("pair_axes", [](FusedCase& c) { c.pos = "axes", c.start = 0; });
  add("varlen", [](FusedCase& c) { c.pos = "varlen"; });
  add("BSHD q/k/v", [](FusedCase& c) { c.layout = "BSHD", c.kv_layout = "NHD"; });
  add("MLA v_dim 16", [](FusedCase& c) { c.vd = 16, c.kv_layout = "HND"; });
  add("MLA v_dim 48", [](FusedCase& c) { c.vd = 48; });
  // More copy chunks in a row than its block has threads: a copy thread walks several.
  add("v rows wider than the block", [](FusedCase& c) { c.vd = 512, c.B = 1, c.S = 2, c.Hk = 3; });
  add("fp8 per-head scales", [](FusedCase& c) { c.fp8 = true, c.per_head_scale = true, c.kv_layout = "NHD"; });
  add("fp32 fp8 partial", [](FusedCase& c) {
    c.dtype = at::kFloat, c.fp8 = true, c.D = 48, c.rotary_dim = 16, c.rotary_offset = 8, c.vd = 24;
  });
  add("GQA 8/1 heads", [](FusedCase& c) { c.Hq = 8, c.Hk = 1; });
  add("packed qkv projection", [](FusedCase& c) { c.packed = true, c.layout = "BSHD", c.kv_layout = "NHD"; });
  add("packed qkv, fp8", [](FusedCase& c) { c.packed = true, c.layout = "BSHD", c.fp8 = true; });
  add("many rows, paged", [](FusedCase& c) { c.B = 4, c.S = 45, c.kv_layout = "HND"; });
  add("many rows, contiguous", [](FusedCase& c) { c.B = 3, c.S = 50, c.start = 7, c.pos = "cache_positions"; });
  // Not vector-addressable: the two launches.
  add("misaligned cache rows", [](FusedCase& c) { c.misaligned = true, c.fusable = false; });
  add("v_dim not a whole vector", [](FusedCase& c) { c.vd = 12, c.fusable = false; });
  for (const FusedCase& c : cases) check(c);
}

}  // namespace

#endif  // ROTARY_EMULATION
