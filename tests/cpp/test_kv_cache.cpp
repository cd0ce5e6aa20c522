// apply_rope_with_kv_cache_ from C++: the same bits as apply_rope_qk_ then
// index writes, the float64 reference in the cache, fp8 against torch's
// conversion, refused calls that write nothing; and, with CUDA built, the
// cache kernel's per-thread body run over its whole grid on the CPU,
// skipping device-side slots out of range.
#include "cpu/rope_cpu.h"
#include "helpers.h"
#include "checks/kv_checks.h"
#include "reference.h"

#ifdef ROTARY_EMULATION
#include "cuda/kv_cache_kernel.cuh"
#endif

#include <rotary/freqs.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace {

using rotary_test::SameBits;
using rotary_test::AllClose;
using rotary_test::ExpectError;
using rotary_test::ref_rope;
using rotary_test::tolerance_for;

struct Inputs {
  at::Tensor q, k, v, kc, vc, freqs, slots;
};

bool paged(const std::string& layout) {
  return layout == "NHD" || layout == "HND";
}

// [outer, heads, inner, D] view, as the op reads a cache.
at::Tensor view_of(const at::Tensor& c, const std::string& layout) {
  return layout == "BSHD" || layout == "NHD" ? c.transpose(1, 2) : c;
}

// B = 2, Hq = 4, Hk = 2, S = 3, D = 16, tokens at start_pos + s; paged pools
// of 3 blocks with a shuffled slot per token, the first one -1.
Inputs make(at::ScalarType dtype, const std::string& layout, int64_t block, at::ScalarType cache_dtype, int64_t seed) {
  at::manual_seed(seed);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  Inputs in;
  in.q = at::randn({2, 4, 3, 16}, f32).to(dtype);
  in.k = at::randn({2, 2, 3, 16}, f32).to(dtype);
  in.v = at::randn({2, 2, 3, 16}, f32).to(dtype);
  std::vector<int64_t> shape;
  if (paged(layout)) {
    shape = layout == "NHD" ? std::vector<int64_t>{3 + 6 / block, block, 2, 16}
                            : std::vector<int64_t>{3 + 6 / block, 2, block, 16};
    in.slots = at::randperm(shape[0] * block, at::kLong).narrow(0, 0, 6).reshape({2, 3});
    in.slots[0][0] = -1;
  } else {
    shape = layout == "BHSD" ? std::vector<int64_t>{2, 2, 12, 16} : std::vector<int64_t>{2, 12, 2, 16};
  }
  in.kc = (at::randn(shape, f32) * 3).to(cache_dtype);
  in.vc = (at::randn(shape, f32) * 3).to(cache_dtype);
  in.freqs = rotary::rope_freqs(16, 32);
  return in;
}

Inputs clone(const Inputs& in) {
  return {in.q.clone(), in.k.clone(), in.v.clone(), in.kc.clone(), in.vc.clone(), in.freqs, in.slots};
}

const std::vector<std::string> kLayouts = {"BHSD", "BSHD", "NHD", "HND"};

// Token (b, s) of the call: its cache row, or false when its slot is -1.
bool row_of(const Inputs& in, const std::string& layout, int64_t block, int64_t start, int64_t b, int64_t s,
            int64_t& outer, int64_t& inner) {
  if (!paged(layout)) {
    outer = b;
    inner = start + s;
    return true;
  }
  const int64_t slot = in.slots[b][s].item<int64_t>();
  outer = slot / block;
  inner = slot % block;
  return slot >= 0;
}

void call(Inputs& in, const std::string& layout, int64_t start, bool interleaved,
          const std::optional<at::Tensor>& k_scale = std::nullopt,
          const std::optional<at::Tensor>& v_scale = std::nullopt) {
  rotary::apply_rope_with_kv_cache_(
      in.q, in.k, in.v, in.kc, in.vc, in.freqs, start, interleaved, std::nullopt, std::nullopt, std::nullopt,
      std::nullopt, "BHSD", std::nullopt, paged(layout) ? std::optional<at::Tensor>(in.slots) : std::nullopt, layout,
      k_scale, v_scale);
}

// The unfused sequence: apply_rope_qk_, then one row copy per token.
void unfused(Inputs& in, const std::string& layout, int64_t block, int64_t start, bool interleaved,
             const std::function<at::Tensor(const at::Tensor&, bool)>& to_cache) {
  rotary::apply_rope_qk_(in.q, in.k, in.freqs, start, interleaved);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t s = 0; s < 3; ++s) {
      int64_t o = 0, i = 0;
      if (!row_of(in, layout, block, start, b, s, o, i)) continue;
      view_of(in.kc, layout).select(0, o).select(1, i).copy_(to_cache(in.k.select(0, b).select(1, s), true));
      view_of(in.vc, layout).select(0, o).select(1, i).copy_(to_cache(in.v.select(0, b).select(1, s), false));
    }
  }
}

TEST(KVCache, SameBitsAsUnfusedAndCloseToReference) {
  for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (const auto& layout : kLayouts) {
      for (const int64_t block : {1, 16, 17}) {
        if (!paged(layout) && block != 16) continue;
        for (const bool interleaved : {true, false}) {
          const std::string what = rotary_test::dtype_name(dtype) + " " + layout + " block " + std::to_string(block);
          Inputs fused = make(dtype, layout, block, dtype, 7);
          Inputs ref = clone(fused);
          const at::Tensor k_in = fused.k.clone();
          call(fused, layout, 4, interleaved);
          unfused(ref, layout, block, 4, interleaved, [](const at::Tensor& x, bool) { return x; });
          EXPECT_TRUE(SameBits(fused.q, ref.q)) << what + " q";
          EXPECT_TRUE(SameBits(fused.k, ref.k)) << what + " k";
          EXPECT_TRUE(SameBits(fused.kc, ref.kc)) << what + " k_cache";
          EXPECT_TRUE(SameBits(fused.vc, ref.vc)) << what + " v_cache";
          const at::Tensor expect = ref_rope(k_in, 4, interleaved);
          for (int64_t b = 0; b < 2; ++b) {
            for (int64_t s = 0; s < 3; ++s) {
              int64_t o = 0, i = 0;
              if (!row_of(fused, layout, block, 4, b, s, o, i)) continue;
              EXPECT_TRUE(AllClose(view_of(fused.kc, layout).select(0, o).select(1, i),
                                   expect.select(0, b).select(1, s), tolerance_for(dtype))) << what;
            }
          }
        }
      }
    }
  }
}

// inverse and rotary_offset through the C++ entry point: dims [4, 12) of
// each head rotate (an 8-dim table), the rest pass through, and the cache
// gets the whole rotated head. Bits of the unfused sequence, the float64
// reference on the span and the untouched dims around it.
TEST(KVCache, InverseAndRotaryOffset) {
  const at::Tensor table = rotary::rope_freqs(8, 32);
  for (const auto& layout : kLayouts) {
    for (const bool interleaved : {true, false}) {
      const std::string what = layout + (interleaved ? " interleaved" : " half");
      Inputs fused = make(at::kFloat, layout, 16, at::kFloat, 11);
      fused.freqs = table;
      Inputs ref = clone(fused);
      const at::Tensor k_in = fused.k.clone();
      const auto slots = paged(layout) ? std::optional<at::Tensor>(fused.slots) : std::nullopt;
      rotary::apply_rope_with_kv_cache_(
          fused.q, fused.k, fused.v, fused.kc, fused.vc, fused.freqs, 4, interleaved, std::nullopt, std::nullopt,
          std::nullopt, std::nullopt, "BHSD", std::nullopt, slots, layout, std::nullopt, std::nullopt,
          /*inverse=*/true, /*rotary_offset=*/4);
      rotary::apply_rope_qk_(ref.q, ref.k, ref.freqs, 4, interleaved, std::nullopt, std::nullopt, true, std::nullopt,
                             std::nullopt, "BHSD", 4);
      for (int64_t b = 0; b < 2; ++b) {
        for (int64_t s = 0; s < 3; ++s) {
          int64_t o = 0, i = 0;
          if (!row_of(ref, layout, 16, 4, b, s, o, i)) continue;
          view_of(ref.kc, layout).select(0, o).select(1, i).copy_(ref.k.select(0, b).select(1, s));
          view_of(ref.vc, layout).select(0, o).select(1, i).copy_(ref.v.select(0, b).select(1, s));
        }
      }
      EXPECT_TRUE(SameBits(fused.q, ref.q)) << what + " q";
      EXPECT_TRUE(SameBits(fused.k, ref.k)) << what + " k";
      EXPECT_TRUE(SameBits(fused.kc, ref.kc)) << what + " k_cache";
      EXPECT_TRUE(SameBits(fused.vc, ref.vc)) << what + " v_cache";
      const at::Tensor span = ref_rope(k_in.narrow(3, 4, 8), 4, interleaved, std::nullopt, /*inverse=*/true);
      EXPECT_TRUE(AllClose(fused.k.narrow(3, 4, 8), span, tolerance_for(at::kFloat))) << what;
      EXPECT_TRUE(SameBits(fused.k.narrow(3, 0, 4), k_in.narrow(3, 0, 4))) << what + " dims before the span";
      EXPECT_TRUE(SameBits(fused.k.narrow(3, 12, 4), k_in.narrow(3, 12, 4))) << what + " dims after the span";
    }
  }
}

// x / scale in float32 (float64 for double), clamped, then torch's own
// float -> float8_e4m3fn conversion.
at::Tensor quantize(const at::Tensor& x, const at::Tensor& scale) {
  const auto work = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor s = scale.dim() == 1 && scale.numel() > 1 ? scale.reshape({-1, 1}) : scale;
  return (x.to(work) / s.to(work)).clamp(-448, 448).to(at::kFloat8_e4m3fn);
}

TEST(KVCache, Fp8CacheMatchesTorchConversion) {
  for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (const auto& layout : kLayouts) {
      for (const bool per_head : {false, true}) {
        const at::Tensor ks = per_head ? at::tensor({0.03f, 0.5f}) : at::tensor(0.02f);
        const at::Tensor vs = per_head ? at::tensor({2.0f, 0.01f}) : at::tensor(0.3f);
        Inputs fused = make(dtype, layout, 16, at::kFloat8_e4m3fn, 11);
        fused.v.mul_(100);  // saturates some values at +-448
        Inputs ref = clone(fused);
        call(fused, layout, 2, true, ks, vs);
        unfused(ref, layout, 16, 2, true, [&](const at::Tensor& x, bool is_k) { return quantize(x, is_k ? ks : vs); });
        const std::string what = rotary_test::dtype_name(dtype) + " " + layout + (per_head ? " per head" : "");
        EXPECT_TRUE(SameBits(fused.kc, ref.kc)) << what + " k_cache";
        EXPECT_TRUE(SameBits(fused.vc, ref.vc)) << what + " v_cache";
      }
    }
  }
}

TEST(KVCache, RefusedCallsWriteNothing) {
  Inputs in = make(at::kFloat, "NHD", 4, at::kFloat, 3);
  const Inputs saved = clone(in);
  const auto unchanged = [&] {
    for (const auto& [a, b] : {std::pair{in.q, saved.q}, {in.k, saved.k}, {in.v, saved.v}, {in.kc, saved.kc},
                               {in.vc, saved.vc}}) {
      EXPECT_TRUE(at::equal(a, b));
    }
  };
  in.slots[1][2] = in.kc.size(0) * 4;  // one slot past the pool
  ExpectError<c10::IndexError>([&] { call(in, "NHD", 0, true); }, {"slot_mapping of token (batch 1, seq 2)", "-1 skips"});
  unchanged();
  in.slots[1][2] = -1;
  Inputs contiguous = make(at::kFloat, "BHSD", 16, at::kFloat, 3);
  const Inputs saved_c = clone(contiguous);
  ExpectError<c10::IndexError>([&] { call(contiguous, "BHSD", 10, true); }, {"exceeds the cache's max_seq_len 12"});
  EXPECT_TRUE(at::equal(contiguous.kc, saved_c.kc));
  EXPECT_TRUE(at::equal(contiguous.q, saved_c.q));
  ExpectError<c10::ValueError>(
      [&] {
        rotary::apply_rope_with_kv_cache_(in.q, in.k, in.v, in.kc, in.vc, in.freqs, 0, true, std::nullopt,
                                          std::nullopt, std::nullopt, std::nullopt, "BHSD", std::nullopt, in.slots,
                                          "NHD", at::tensor(1.0, at::kDouble));
      },
      {"k_scale is only for float8_e4m3fn"});
  unchanged();
}

#ifdef ROTARY_EMULATION
// The cache kernel's per-thread body over its whole grid, after the CPU
// rotation: the same caches as the CPU op; slots made out of range after the
// host check (as device-side values are) are skipped.
template <typename T, typename Cache>
void emulate(const rotary::kernel::KVCacheParams& p) {
  for (int64_t i = 0; i < rotary::kernel::kv_cache_threads(p); ++i) rotary::kernel::kv_cache_thread<T, Cache>(p, i);
}

TEST(KVCacheEmulation, WholeGridMatchesCpuOpAndSkipsBadSlots) {
  for (const auto& layout : kLayouts) {
    for (const bool fp8 : {false, true}) {
      const auto cdt = fp8 ? at::kFloat8_e4m3fn : at::kBFloat16;
      Inputs op = make(at::kBFloat16, layout, 17, cdt, 5);
      Inputs emu = clone(op);
      const std::optional<at::Tensor> scale = fp8 ? std::optional<at::Tensor>(at::tensor(0.25f)) : std::nullopt;
      const std::optional<at::Tensor> slots = paged(layout) ? std::optional<at::Tensor>(emu.slots) : std::nullopt;
      const rotary::detail::RopeArgs args{1, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "BHSD"};
      const rotary::detail::KVArgs kv{std::nullopt, slots, layout, scale, scale};
      auto prepared = rotary::detail::prepare_kv("test", emu.q, emu.k, emu.v, emu.kc, emu.vc, emu.freqs, args, kv);
      if (paged(layout)) {  // device-side values are not checked: out of range is skipped
        emu.slots[1][1] = emu.kc.size(0) * 17;
        emu.slots[1][2] = -5;
        op.slots[1][1] = op.slots[1][2] = -1;
      }
      rotary::cpu::rope_cpu(prepared.params.rope, at::kBFloat16);
      if (fp8) {
        emulate<c10::BFloat16, uint8_t>(prepared.params);
      } else {
        emulate<c10::BFloat16, c10::BFloat16>(prepared.params);
      }
      call(op, layout, 1, true, scale, scale);
      EXPECT_TRUE(SameBits(emu.k, op.k)) << layout + " k";
      EXPECT_TRUE(SameBits(emu.kc, op.kc)) << layout + " k_cache";
      EXPECT_TRUE(SameBits(emu.vc, op.vc)) << layout + " v_cache";
    }
  }
}

// MLA: v rows narrower or wider than k's; the grid covers the wider row.
TEST(KVCacheEmulation, VHeadDimOfItsOwn) {
  for (const int64_t vd : {6, 24}) {
    const auto q = at::randn({1, 2, 5, 16}), k = at::randn({1, 2, 5, 16}), v = at::randn({1, 2, 5, vd});
    const auto kc = at::full({1, 2, 8, 16}, NAN), vc = at::full({1, 2, 8, vd}, NAN);
    const auto freqs = rotary::rope_freqs(8, 32);
    at::Tensor eq = q.clone(), ek = k.clone(), ekc = kc.clone(), evc = vc.clone();
    at::Tensor oq = q.clone(), ok = k.clone(), okc = kc.clone(), ovc = vc.clone();
    const rotary::detail::RopeArgs args{2, false, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt,
                                        "BHSD", 8};
    const rotary::detail::KVArgs kv{std::nullopt, std::nullopt, "BHSD", std::nullopt, std::nullopt};
    auto prepared = rotary::detail::prepare_kv("test", eq, ek, v, ekc, evc, freqs, args, kv);
    rotary::cpu::rope_cpu(prepared.params.rope, at::kFloat);
    emulate<float, float>(prepared.params);
    rotary::apply_rope_with_kv_cache_(oq, ok, v, okc, ovc, freqs, 2, false, std::nullopt, std::nullopt, std::nullopt,
                                      std::nullopt, "BHSD", std::nullopt, std::nullopt, "BHSD", std::nullopt,
                                      std::nullopt, false, 8);
    EXPECT_TRUE(SameBits(ek, ok)) << "k";
    EXPECT_TRUE(SameBits(ekc, okc)) << "k_cache";
    EXPECT_TRUE(SameBits(evc, ovc)) << "v_cache";
    EXPECT_TRUE(at::equal(ovc.narrow(2, 2, 5), v)) << "v rows at positions 2..6";
    EXPECT_TRUE(at::isnan(ovc.narrow(2, 0, 2)).all().item<bool>()) << "rows before start_pos untouched";
  }
}
#endif

}  // namespace
