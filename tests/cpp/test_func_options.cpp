// The functional ops with their keyword arguments as options
// (rotary/func_options.h): each option reaches the op, against the float64
// reference, and the defaults are the positional call's.
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/func_options.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

// A named namespace: the unity build puts several test files in one unit.
namespace func_options_test {

using rotary_test::AllClose;
using rotary_test::SameBits;
using rotary_test::Tolerance;

// The table is complex64: float64 data is rotated to its ~6e-8 (rotary_test::kF64).
constexpr Tolerance kExact = rotary_test::kF64, kNorm = rotary_test::kF64, kClose32 = rotary_test::kF32;
constexpr int64_t B = 2, Hq = 4, Hk = 2, S = 5, D = 16;

TEST(FuncOptions, RopeOptionsReachTheOp) {
  at::manual_seed(71);
  const at::Tensor f = rotary::rope_freqs(D, 64);
  const at::Tensor x = rotary_test::randn({B, S, Hq, D}, at::kDouble);  // BSHD
  const at::Tensor ids = at::randint(0, 60, {B, S}, at::kLong);
  const at::Tensor y = rotary::apply_rope(
      x, f, rotary::RopeFuncOptions().position_ids(ids).layout("BSHD").interleaved(false).inverse(true));
  const at::Tensor want = rotary_test::ref_rope(x.transpose(1, 2), 0, false, ids, /*inverse=*/true).transpose(1, 2);
  EXPECT_TRUE(AllClose(y, want, kExact));
  // Defaults: the positional call's bits.
  const at::Tensor q = rotary_test::randn({B, Hq, S, D}), k = rotary_test::randn({B, Hk, S, D});
  EXPECT_TRUE(SameBits(rotary::apply_rope(q, f, rotary::RopeFuncOptions()), rotary::apply_rope(q, f)));
  auto [q2, k2] = rotary::apply_rope_qk(q, k, f, rotary::RopeFuncOptions().start_pos(7));
  EXPECT_TRUE(AllClose(q2, rotary_test::ref_rope(q, 7), kClose32));
  EXPECT_TRUE(AllClose(k2, rotary_test::ref_rope(k, 7), kClose32));
  // A partial span at an offset, and N-D positions through pair_axes.
  const at::Tensor half = rotary::rope_freqs(8, 64);
  const at::Tensor z = rotary::apply_rope(x, half, rotary::RopeFuncOptions().layout("BSHD").rotary_offset(4));
  EXPECT_TRUE(AllClose(z, rotary_test::ref_rope_span(x.transpose(1, 2), 0, true, 4, 8).transpose(1, 2), kExact));
  const at::Tensor axes_ids = at::randint(0, 60, {2, B, S}, at::kLong);
  const std::vector<int64_t> axes = {0, 1, 1, 0};
  const at::Tensor w = rotary::apply_rope(
      x, half, rotary::RopeFuncOptions().layout("BSHD").position_ids(axes_ids).pair_axes(axes));
  const at::Tensor want_nd = rotary_test::ref_rope_at(x.transpose(1, 2), 0, true, 0, 8, axes_ids, axes);
  EXPECT_TRUE(AllClose(w, want_nd.transpose(1, 2), kExact));
}

TEST(FuncOptions, InPlaceAndErrors) {
  at::manual_seed(72);
  const at::Tensor f = rotary::rope_freqs(D, 16);
  at::Tensor x = rotary_test::randn({B, Hq, S, D}, at::kDouble);
  const at::Tensor want = rotary_test::ref_rope(x, 3);
  rotary::apply_rope_(x, f, rotary::RopeFuncOptions().start_pos(3));
  EXPECT_TRUE(AllClose(x, want, kExact));
  const at::Tensor before = x.clone();
  EXPECT_THROW(rotary::apply_rope_(x, f, rotary::RopeFuncOptions().start_pos(30)), c10::IndexError);
  EXPECT_THROW(rotary::apply_rope_(x, f, rotary::RopeFuncOptions().layout("bhsd")), c10::ValueError);
  EXPECT_TRUE(SameBits(x, before));
}

TEST(FuncOptions, CacheWriteAndPrologue) {
  at::manual_seed(73);
  const at::Tensor f = rotary::rope_freqs(D, 64);
  at::Tensor q = rotary_test::randn({1, Hq, S, D}, at::kDouble), k = rotary_test::randn({1, Hk, S, D}, at::kDouble);
  const at::Tensor v = rotary_test::randn({1, Hk, S, D}, at::kDouble);
  const at::Tensor q0 = q.clone(), k0 = k.clone();
  // Paged NHD: token s into slot 3 + s of blocks of 4.
  at::Tensor kc = at::full({4, 4, Hk, D}, std::nan(""), at::kDouble), vc = kc.clone();
  const at::Tensor slots = at::arange(3, 3 + S, at::kLong);
  rotary::apply_rope_with_kv_cache_(
      q, k, v, kc, vc, f, rotary::KVCacheFuncOptions().start_pos(2).slot_mapping(slots).kv_layout("NHD"));
  const at::Tensor want_k = rotary_test::ref_rope(k0, 2);
  EXPECT_TRUE(AllClose(k, want_k, kExact));
  EXPECT_TRUE(SameBits(kc.view({16, Hk, D}).narrow(0, 3, S), k[0].transpose(0, 1)));
  EXPECT_TRUE(SameBits(vc.view({16, Hk, D}).narrow(0, 3, S), v[0].transpose(0, 1)));
  EXPECT_TRUE(kc.view({16, Hk, D}).narrow(0, 0, 3).isnan().all().item<bool>());
  // The prologue: norm "head" with weights and Gemma's offset.
  const at::Tensor wq = rotary_test::randn({D}, at::kDouble), wk = rotary_test::randn({D}, at::kDouble);
  auto [qn, kn] = rotary::apply_qk_norm_rope(
      q0, k0, f, rotary::RopeFuncOptions().start_pos(5),
      rotary::QKNormFuncOptions().q_weight(wq).k_weight(wk).eps(1e-5).weight_offset(1.0));
  EXPECT_TRUE(AllClose(qn, rotary_test::ref_norm_rope(q0, wq, false, 1e-5, 1.0, 5, true, 0, D), kNorm));
  EXPECT_TRUE(AllClose(kn, rotary_test::ref_norm_rope(k0, wk, false, 1e-5, 1.0, 5, true, 0, D), kNorm));
}

}  // namespace func_options_test
