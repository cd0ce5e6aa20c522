// Host emulation of the prologue's CUDA kernel (cuda/norm_rope_kernel.cuh):
// every block of the grid and every thread of it, through norm_partial and
// norm_finish with the kernel's reduction order, on the CPU; compared with a
// float64 norm-then-rope reference, and the bits across grid sizes. Checks
// the CUDA indexing (head walks, pass-through dims, the grid-stride row walk
// with its (b, s) step and packed-sequence search) in CI, where there is no
// GPU.
#ifdef ROTARY_EMULATION

#include "checks/norm_checks.h"
#include "helpers.h"
#include "norm_emulation.h"
#include "reference.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>

#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

struct NormCase {
  std::string name;
  at::ScalarType dtype;
  bool heads;
  bool interleaved;
  int64_t D, r, off, Hq, Hk;
  bool in_place;
  bool fp8_q = false;  // q out as float8_e4m3fn, per-head scales (Hq > 1; Hq 1: a [] scale)
  // Token positions: start + s; + offsets[b]; ids[b][s]; packed sequences
  // (cu_seqlens, THD), start + the index within each sequence; or N-D ids
  // [3, B, S], pair j on axis j % 3 (as Qwen3-VL's interleaved M-RoPE), or on
  // sections of a half, a quarter and a quarter of the pairs (Qwen2-VL's).
  enum class Pos { kLocal, kOffsets, kIds, kVarlen, kAxes, kSections } pos = Pos::kLocal;
  bool vector = false;  // the case takes the vector path (norm_vector.cuh)
  // Ids (N-D) below id_end; past the 64-row table, inv_freq computes them.
  int64_t id_end = 50;
};

// Packed sequences of 4, 1 and 6 tokens: a grid stride of 2 or 5 rows
// crosses into the next sequence and past it.
constexpr int64_t kPacked[] = {0, 4, 5, 11};

// Positions of case c for q [B, H, S, D] in the float64 reference's
// convention (op_positions turns them into the op's arguments), and the
// packed sequences, whose reference positions are ids: each token's index in
// its sequence, for the reference only.
struct NormPositions {
  std::optional<at::Tensor> cu_seqlens, ref;
  std::vector<int64_t> axes;  // N-D: each pair's axis of ref [3, B, S]
};
NormPositions positions_of(const NormCase& c, int64_t B, int64_t S) {
  NormPositions p;
  switch (c.pos) {
    case NormCase::Pos::kAxes:
    case NormCase::Pos::kSections: {
      const int64_t pairs = c.r / 2;
      p.ref = at::randint(0, c.id_end, {3, B, S}, at::kLong);
      if (c.id_end > 50) {  // both kinds of row: every id of (0, 0) in the table, (1, 2)'s axis 1 past it
        p.ref->select(1, 0).select(1, 0).fill_(3);
        (*p.ref)[1][1][2].fill_(c.id_end - 1);
      }
      for (int64_t j = 0; j < pairs; ++j) {
        p.axes.push_back(c.pos == NormCase::Pos::kAxes ? j % 3 : j < pairs / 2 ? 0 : j < 3 * pairs / 4 ? 1 : 2);
      }
      break;
    }
    case NormCase::Pos::kLocal: break;
    case NormCase::Pos::kOffsets: p.ref = at::randint(0, 40, {B}, at::kInt); break;
    case NormCase::Pos::kIds: p.ref = at::randint(0, 50, {B, S}, at::kLong); break;
    case NormCase::Pos::kVarlen: {
      p.cu_seqlens = at::tensor(std::vector<int64_t>(std::begin(kPacked), std::end(kPacked)), at::kInt);
      std::vector<int64_t> local;
      for (size_t i = 0; i + 1 < std::size(kPacked); ++i) {
        for (int64_t t = 0; t < kPacked[i + 1] - kPacked[i]; ++t) local.push_back(t);
      }
      p.ref = at::tensor(local, at::kLong).view({1, S});
      break;
    }
  }
  return p;
}

class NormEmulation : public ::testing::TestWithParam<NormCase> {};

template <typename T>
void run_case(const NormCase& c, const rotary::detail::PreparedNormRope& prepared, int64_t blocks) {
  rotary::kernel::KVCacheParams kv;  // no caches
  kv.rope = prepared.rope.params;
  rotary_test::emulate_norm_rope<T>(kv, prepared.norm.params, blocks);
}

void emulate_dtype(const NormCase& c, const rotary::detail::PreparedNormRope& prepared, int64_t blocks) {
  switch (c.dtype) {
    case at::kFloat: return run_case<float>(c, prepared, blocks);
    case at::kDouble: return run_case<double>(c, prepared, blocks);
    case at::kHalf: return run_case<__half>(c, prepared, blocks);
    default: return run_case<__nv_bfloat16>(c, prepared, blocks);
  }
}

TEST_P(NormEmulation, MatchesReferenceOnEveryGrid) {
  const NormCase& c = GetParam();
  const bool varlen = c.pos == NormCase::Pos::kVarlen;
  const int64_t B = varlen ? 1 : 2, S = varlen ? kPacked[std::size(kPacked) - 1] : 3;
  const auto opts = at::TensorOptions().dtype(c.dtype);
  // BSHD storage read as BHSD: strided heads, as a projection output is;
  // packed inputs are THD, that storage without the batch.
  const at::Tensor q0 = at::randn({B, S, c.Hq, c.D}, opts).transpose(1, 2);
  const at::Tensor k0 = at::randn({B, S, c.Hk, c.D}, opts).transpose(1, 2);
  const auto op_view = [&](const at::Tensor& x) { return varlen ? x.squeeze(0).transpose(0, 1) : x; };
  const auto ref_view = [&](const at::Tensor& x) { return varlen ? x.transpose(0, 1).unsqueeze(0) : x; };
  const NormPositions pos = positions_of(c, B, S);
  const at::Tensor qw = 1 + 0.5 * at::randn({c.heads ? c.Hq * c.D : c.D});
  const at::Tensor kw = 1 + 0.5 * at::randn({c.heads ? c.Hk * c.D : c.D});
  const at::Tensor table = at::polar(
      at::ones({64, c.r / 2}),
      at::outer(at::arange(64, at::kDouble), 1.0 / at::pow(10000.0, at::arange(0, c.r, 2, at::kDouble) / c.r))
          .to(at::kFloat));
  const int64_t start = 5;
  const bool nd = !pos.axes.empty();  // N-D ids: absolute, start added to them
  const rotary_test::OpPositions op_pos = nd ? rotary_test::OpPositions{0, std::nullopt, *pos.ref + start}
                                             : rotary_test::op_positions(start, varlen ? std::nullopt : pos.ref);
  // Past the table's 64 rows the kernel computes the rotation from inv_freq.
  const std::optional<at::Tensor> inv_freq = c.id_end + start <= 64 ? std::nullopt
      : std::optional<at::Tensor>(1.0 / at::pow(10000.0, at::arange(0, c.r, 2, at::kDouble) / c.r));
  const auto reference = [&](const at::Tensor& x, const at::Tensor& w) {
    return rotary_test::ref_norm_rope(x, w, c.heads, 1e-5, 0.0, start, c.interleaved, c.off, c.r, pos.ref, pos.axes);
  };
  constexpr int64_t kGrids[] = {int64_t{1} << 20, 2, 5};  // a block per row; (b, s) steps (0, 2), (1, 2) at S = 3
  at::Tensor out[3][2];
  for (int i = 0; i < 3; ++i) {
    const int64_t blocks = kGrids[i];
    at::Tensor q = op_view(q0).clone(), k = op_view(k0).clone();
    const std::optional<at::Tensor> oqw(qw), okw(kw);
    std::optional<at::Tensor> none;
    const std::optional<at::Tensor> q_scale = !c.fp8_q ? std::nullopt
        : c.Hq > 1                                        ? std::optional<at::Tensor>(at::linspace(0.004, 0.02, c.Hq))
                                                          : std::optional<at::Tensor>(at::full({}, 0.011));
    const rotary::detail::RopeArgs args{op_pos.start_pos, c.interleaved, op_pos.offsets, op_pos.position_ids, false,
                                        pos.cu_seqlens, inv_freq, varlen ? "THD" : "BHSD", c.off,
                                        nd ? at::OptionalIntArrayRef(pos.axes) : at::OptionalIntArrayRef()};
    const rotary::detail::NormArgs nargs{oqw, okw, 1e-5, c.heads ? "heads" : "head", 0.0, q_scale};
    const auto prepared = rotary::detail::prepare_norm_rope("emulation", q, k, table, args, nargs, c.in_place);
    if (c.fp8_q) {
      prepared.rope.out_q.view(at::kByte).fill_(0x7f);  // NaN in float8_e4m3fn
      prepared.rope.out_k.fill_(std::numeric_limits<double>::quiet_NaN());
    } else if (!c.in_place) {
      prepared.rope.out_q.fill_(std::numeric_limits<double>::quiet_NaN());
      prepared.rope.out_k.fill_(std::numeric_limits<double>::quiet_NaN());
    }
    const auto& rp = prepared.rope.params;
    EXPECT_EQ(rotary::kernel::norm_grid(rp, blocks, q.element_size()).items > 0, c.vector)
        << c.name << ": the vector path's choice";
    emulate_dtype(c, prepared, blocks);
    out[i][0] = ref_view(prepared.rope.out_q);
    out[i][1] = ref_view(prepared.rope.out_k);
    const at::Tensor* x[2] = {&q0, &k0};
    const at::Tensor* w[2] = {&qw, &kw};
    for (int t = 0; t < 2; ++t) {
      const at::Tensor want = reference(*x[t], *w[t]);
      if (c.fp8_q && t == 0) {  // fp8: x / scale, saturated, within half an fp8 ulp (2^-4)
        const at::Tensor q8 = (want / q_scale->to(at::kDouble).expand({c.Hq}).view({1, c.Hq, 1, 1})).clamp(-448, 448);
        EXPECT_TRUE(rotary_test::AllClose(out[i][t].to(at::kDouble), q8, {1e-3, 0.0625})) << c.name << " fp8 q";
        continue;
      }
      EXPECT_TRUE(rotary_test::AllClose(out[i][t], want, rotary_test::tolerance_for(c.dtype)))
          << c.name << (t ? " k" : " q") << " blocks " << blocks;
    }
  }
  for (int i = 1; i < 3; ++i) {
    for (int t = 0; t < 2; ++t) {
      EXPECT_TRUE(at::equal(out[0][t].to(at::kDouble), out[i][t].to(at::kDouble)))
          << c.name << ": grid-dependent bits, " << kGrids[i] << " blocks";
    }
  }
}

constexpr NormCase::Pos kLocal = NormCase::Pos::kLocal;

INSTANTIATE_TEST_SUITE_P(
    Grid, NormEmulation,
    ::testing::Values(
        NormCase{"fp32_head_half_partial", at::kFloat, false, false, 64, 32, 16, 4, 2, false, false, kLocal, true},
        NormCase{"fp32_heads_interleaved", at::kFloat, true, true, 32, 32, 0, 3, 1, false, false, kLocal, true},
        NormCase{"bf16_head_d256_gqa", at::kBFloat16, false, false, 256, 256, 0, 8, 1, false, false, kLocal, true},
        NormCase{"fp16_heads_in_place", at::kHalf, true, false, 48, 16, 8, 2, 2, true, false, kLocal, true},
        NormCase{"fp64_head_d512", at::kDouble, false, true, 512, 128, 0, 2, 1, true},
        NormCase{"fp32_head_d16", at::kFloat, false, true, 16, 8, 4, 5, 3, false, false, kLocal, true},
        NormCase{"bf16_head_fp8_q", at::kBFloat16, false, false, 64, 32, 16, 4, 2, false, true, kLocal, true},
        NormCase{"fp32_heads_fp8_q", at::kFloat, true, true, 32, 32, 0, 3, 1, false, true, kLocal, true},
        NormCase{"bf16_head_offsets", at::kBFloat16, false, false, 64, 64, 0, 4, 2, false, false,
                 NormCase::Pos::kOffsets, true},
        NormCase{"fp32_heads_ids", at::kFloat, true, true, 32, 16, 8, 3, 1, true, false, NormCase::Pos::kIds, true},
        NormCase{"fp16_head_varlen", at::kHalf, false, false, 64, 32, 16, 4, 2, false, false, NormCase::Pos::kVarlen,
                 true},
        NormCase{"fp64_heads_varlen_in_place", at::kDouble, true, true, 32, 32, 0, 2, 2, true, false,
                 NormCase::Pos::kVarlen},
        // Norm "heads" on the vector path: 48 heads (a warp takes two steps
        // of them, the sums span both), fp8 q, packed sequences; 24 dims of
        // bf16 in interleaved pairs stay on the element path.
        NormCase{"bf16_heads_d128_two_steps", at::kBFloat16, true, false, 128, 128, 0, 40, 8, false, false,
                 NormCase::Pos::kOffsets, true},
        NormCase{"bf16_heads_interleaved_partial_fp8_q", at::kBFloat16, true, true, 64, 32, 16, 4, 2, false, true,
                 kLocal, true},
        NormCase{"fp16_heads_varlen_in_place", at::kHalf, true, false, 64, 64, 0, 4, 2, true, false,
                 NormCase::Pos::kVarlen, true},
        NormCase{"bf16_heads_interleaved_r24_element_path", at::kBFloat16, true, true, 64, 24, 8, 4, 2, false, false,
                 kLocal, false},
        // N-D positions on the vector path: each pair's cos/sin from its
        // axis's table row; rows with an id past the table (inv_freq) take
        // the element path.
        NormCase{"bf16_head_mrope_interleaved_axes", at::kBFloat16, false, false, 128, 128, 0, 4, 2, false, false,
                 NormCase::Pos::kAxes, true},
        NormCase{"fp32_heads_sections_in_place", at::kFloat, true, true, 64, 48, 8, 3, 1, true, false,
                 NormCase::Pos::kSections, true},
        NormCase{"fp16_head_axes_fp8_q_partial", at::kHalf, false, true, 64, 32, 16, 4, 2, false, true,
                 NormCase::Pos::kAxes, true},
        NormCase{"bf16_head_axes_past_the_table", at::kBFloat16, false, false, 64, 64, 0, 4, 2, false, false,
                 NormCase::Pos::kAxes, true, 90},
        NormCase{"bf16_head_varlen_fp8_q", at::kBFloat16, false, true, 64, 64, 0, 4, 2, false, true,
                 NormCase::Pos::kVarlen, true},
        // fp8 q on the vector path: each dtype and pairing, pass-through
        // items, a per-tensor scale, per-token positions; fp64 fp8 q stays
        // on the element path.
        NormCase{"fp32_head_interleaved_fp8_q", at::kFloat, false, true, 64, 64, 0, 4, 2, false, true, kLocal, true},
        NormCase{"fp16_head_half_partial_fp8_q", at::kHalf, false, false, 128, 64, 32, 5, 1, false, true,
                 NormCase::Pos::kOffsets, true},
        NormCase{"fp32_head_half_partial_fp8_q_per_tensor", at::kFloat, false, false, 64, 32, 16, 1, 2, false, true,
                 kLocal, true},
        NormCase{"bf16_head_ids_fp8_q", at::kBFloat16, false, false, 64, 64, 0, 3, 1, false, true,
                 NormCase::Pos::kIds, true},
        NormCase{"fp64_head_fp8_q", at::kDouble, false, false, 32, 32, 0, 3, 1, false, true},
        // The vector path: interleaved in place, a head of 32 items (a whole
        // warp). The element path: fp64 (either pairing), 40 items (wider
        // than a warp), interleaved pairs of 1.5 vectors (24 dims of bf16).
        NormCase{"bf16_head_interleaved_in_place", at::kBFloat16, false, true, 128, 128, 0, 4, 2, true, false, kLocal,
                 true},
        NormCase{"fp64_head_half_partial", at::kDouble, false, false, 32, 16, 8, 3, 1, false, false, kLocal, false},
        NormCase{"fp64_head_interleaved", at::kDouble, false, true, 32, 32, 0, 2, 2, true, false, kLocal, false},
        NormCase{"fp16_head_d512", at::kHalf, false, false, 512, 512, 0, 2, 1, false, false, kLocal, true},
        NormCase{"bf16_head_d640_element_path", at::kBFloat16, false, false, 640, 640, 0, 2, 1, false, false, kLocal,
                 false},
        NormCase{"bf16_head_interleaved_r24_element_path", at::kBFloat16, false, true, 64, 24, 8, 4, 2, false, false,
                 kLocal, false}),
    [](const ::testing::TestParamInfo<NormCase>& info) { return info.param.name; });

// The vector path asks L2 for each block's next row: one prefetch per 128
// bytes of every q and k head of exactly the rows a block reaches after its
// first, none when every row has its own block, the switch off or the
// element path (rows a misaligned element apart).
TEST(NormEmulationPrefetch, AsksForEachBlocksNextRow) {
  at::manual_seed(31);
  const int64_t B = 2, S = 5, Hq = 3, Hk = 2;
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    for (int64_t D : {int64_t{128}, int64_t{80}}) {
      for (bool transposed : {false, true}) {
        for (const std::string norm : {"head", "heads", "head, misaligned"}) {
          const auto opts = at::TensorOptions().dtype(dtype);
          const bool vector = norm != "head, misaligned";
          auto make = [&](int64_t h) {
            const int64_t w = vector ? D : D + 1;  // misaligned: rows D + 1 elements apart
            const at::Tensor x =
                transposed ? at::randn({B, S, h, w}, opts).transpose(1, 2) : at::randn({B, h, S, w}, opts);
            return x.narrow(-1, 0, D);
          };
          const at::Tensor q = make(Hq), k = make(Hk);
          const at::Tensor table = at::polar(at::ones({16, D / 2}), at::rand({16, D / 2}));
          const std::optional<at::Tensor> none;
          const rotary::detail::RopeArgs args{1, false, none, none, false, none, none, "BHSD", 0, {}};
          const std::string kind = norm.substr(0, norm.find(','));  // NormArgs holds a view of it
          const rotary::detail::NormArgs nargs{none, none, 1e-5, kind, 0.0, none};
          const auto prepared = rotary::detail::prepare_norm_rope("emulation", q, k, table, args, nargs, false);
          const auto& rp = prepared.rope.params;
          ASSERT_EQ(rotary::kernel::norm_grid(rp, 3, q.element_size()).items > 0, vector);
          for (const auto& [blocks, on] : {std::pair<int64_t, bool>{3, true}, {7, true}, {B * S, true}, {3, false}}) {
            SCOPED_TRACE(std::string(c10::toString(dtype)) + " D=" + std::to_string(D) +
                         (transposed ? " BSHD storage" : " BHSD") + " norm " + norm + " blocks " +
                         std::to_string(blocks) + (on ? "" : " switch off"));
            std::vector<uintptr_t> got, want;
            rotary::kernel::KVCacheParams kv;
            kv.rope = rp;
            const bool prior = rotary::kernel::set_l2_prefetch(on);  // the grid reads it
            if (dtype == at::kFloat) {
              rotary_test::emulate_norm_rope<float>(kv, prepared.norm.params, blocks, &got);
            } else {
              rotary_test::emulate_norm_rope<__nv_bfloat16>(kv, prepared.norm.params, blocks, &got);
            }
            rotary::kernel::set_l2_prefetch(prior);
            const int64_t elem = q.element_size();
            const int64_t lines = (D * elem + 127) / 128;
            for (int64_t row = blocks; on && vector && row < B * S; ++row) {
              const int64_t b = row / S, s = row % S;
              for (const at::Tensor* x : {&q, &k}) {
                for (int64_t h = 0; h < x->size(1); ++h) {
                  const auto head = reinterpret_cast<uintptr_t>(x->data_ptr()) +
                      elem * (b * x->stride(0) + h * x->stride(1) + s * x->stride(2));
                  for (int64_t l = 0; l < lines; ++l) want.push_back(head + 128 * l);
                }
              }
            }
            std::sort(got.begin(), got.end());
            std::sort(want.begin(), want.end());
            EXPECT_EQ(got, want);
          }
        }
      }
    }
  }
}

}  // namespace

#endif  // ROTARY_EMULATION
