// A seeded fuzz of the prologue's CUDA kernel through its host emulation
// (norm_emulation.h), so that every path of it (vector and element, norm
// "head" and "heads", 1-D and N-D positions, packed sequences, fp8 q, rows
// past the table) meets random shapes without a GPU: dtypes, head sizes,
// rotated spans and offsets, head counts, pairings, aligned and misaligned
// rows, in place or not. Each call runs on a grid of a block per row and of
// 1 to 3 blocks (the grid-stride walk) and must match the float64
// reference, the CPU op (its own kernel) and itself across grids, bit for
// bit. ROTARY_FUZZ_CASES (default 40) and ROTARY_FUZZ_SEED (default 0) pick
// the cases, as in test_fuzz_ops.cpp.
#ifdef ROTARY_EMULATION

#include "checks/norm_checks.h"
#include "helpers.h"
#include "norm_emulation.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

int64_t fuzz_env(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

struct Draw {
  std::mt19937_64 rng;
  int64_t in(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }
  bool coin(double p = 0.5) { return std::bernoulli_distribution(p)(rng); }
};

enum class Pos { kLocal, kOffsets, kIds, kAxes, kVarlen };

// One call: its arguments, and how its positions read in the reference.
struct FuzzCall {
  std::string what;
  at::Tensor q, k, qw, kw, table;
  std::optional<at::Tensor> offsets, ids, cu_seqlens, inv_freq, q_scale, ref_pos;
  std::vector<int64_t> axes;
  int64_t start = 0, off = 0, r = 0;
  bool interleaved = false, heads = false, in_place = false, varlen = false;
};

// q and k as the layouts projections give: [B, H, S, D] views of BSHD
// storage or BHSD storage, or (misaligned) rows one element wider.
at::Tensor make_input(int storage, int64_t B, int64_t H, int64_t S, int64_t D, at::ScalarType dtype) {
  const int64_t w = storage == 2 ? D + 1 : D;
  const at::Tensor x = storage == 0 ? rotary_test::randn({B, S, H, w}, dtype).transpose(1, 2)
                                    : rotary_test::randn({B, H, S, w}, dtype);
  return x.narrow(-1, 0, D);
}

FuzzCall draw_call(Draw& d) {
  static const at::ScalarType kTypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};
  static const int64_t kDims[] = {8, 16, 24, 32, 48, 64, 96, 128, 256};
  FuzzCall c;
  const at::ScalarType dtype = kTypes[d.in(0, 3)];
  const int64_t D = kDims[d.in(0, 8)];
  const int64_t v = 16 / at::elementSize(dtype);  // elements per 16-byte vector
  // The span: whole, or a multiple of 2v at a multiple of v (vector-shaped),
  // or any even width at any even offset.
  if (d.coin(0.4)) {
    c.r = D;
  } else if (d.coin() && D >= 2 * v) {
    c.r = 2 * v * d.in(1, D / (2 * v));
    c.off = v * d.in(0, (D - c.r) / v);
  } else {
    c.r = 2 * d.in(1, D / 2);
    c.off = 2 * d.in(0, (D - c.r) / 2);
  }
  c.interleaved = d.coin();
  c.heads = d.coin();
  const Pos pos = static_cast<Pos>(d.in(0, 4));
  c.varlen = pos == Pos::kVarlen;
  const int64_t Hq = d.in(1, 6), Hk = d.in(1, 3);
  const int64_t B = c.varlen ? 1 : d.in(1, 3), S = c.varlen ? d.in(2, 7) : d.in(1, 4);
  const int storage = static_cast<int>(d.in(0, 4) == 0 ? 2 : d.in(0, 1));  // misaligned 1 in 5
  c.q = make_input(storage, B, Hq, S, D, dtype);
  c.k = make_input(storage, B, Hk, S, D, dtype);
  const bool past = d.coin(0.25);  // ids past the table's 64 rows: inv_freq computes them
  const int64_t id_end = past ? 90 : 55;
  c.start = d.in(0, 8);
  switch (pos) {
    case Pos::kLocal: break;
    case Pos::kOffsets: c.offsets = c.ref_pos = at::randint(0, 40, {B}, at::kLong); break;
    case Pos::kIds: c.ref_pos = at::randint(0, id_end, {B, S}, at::kLong); break;
    case Pos::kAxes: {  // 2 or 3 axes (fewer when a narrow span leaves one unused: ids have one per axis used)
      const int64_t drawn = d.in(2, 3);
      int64_t n_axes = 1;
      for (int64_t j = 0; j < c.r / 2; ++j) {
        c.axes.push_back(d.in(0, drawn - 1));
        n_axes = std::max(n_axes, c.axes.back() + 1);
      }
      c.ref_pos = at::randint(0, id_end, {n_axes, B, S}, at::kLong);
      break;
    }
    case Pos::kVarlen: {
      std::vector<int64_t> cu{0}, local;
      while (cu.back() < S) cu.push_back(std::min(S, cu.back() + d.in(1, 4)));
      for (size_t i = 0; i + 1 < cu.size(); ++i) {
        for (int64_t t = 0; t < cu[i + 1] - cu[i]; ++t) local.push_back(t);
      }
      c.cu_seqlens = at::tensor(cu, at::kInt);
      c.ref_pos = at::tensor(local, at::kLong).view({1, S});
      c.q = c.q.squeeze(0).transpose(0, 1);  // THD
      c.k = c.k.squeeze(0).transpose(0, 1);
      break;
    }
  }
  if (pos == Pos::kIds || pos == Pos::kAxes) c.ids = *c.ref_pos + c.start;  // absolute: start_pos 0
  if (past) c.inv_freq = 1.0 / at::pow(10000.0, at::arange(0, c.r, 2, at::kDouble) / c.r);
  c.table = rotary::rope_freqs(c.r, 64);
  c.qw = 1 + 0.5 * at::randn({c.heads ? Hq * D : D});
  c.kw = 1 + 0.5 * at::randn({c.heads ? Hk * D : D});
  c.in_place = d.coin(0.3);
  if (!c.in_place && d.coin(0.2)) c.q_scale = Hq > 1 && d.coin() ? at::rand({Hq}) * 0.02 + 0.004 : at::full({}, 0.011);
  std::ostringstream os;
  os << c10::toString(dtype) << " D " << D << " r " << c.r << " off " << c.off << (c.interleaved ? " interleaved" : " half")
     << (c.heads ? " heads" : " head") << " Hq " << Hq << " Hk " << Hk << " B " << B << " S " << S << " pos "
     << static_cast<int>(pos) << " storage " << storage << (past ? " past" : "") << (c.in_place ? " in place" : "")
     << (c.q_scale ? " fp8 q" : "");
  c.what = os.str();
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
  at::Tensor q = c.q.clone(), k = c.k.clone();
  const std::optional<at::Tensor> qw(c.qw), kw(c.kw), none;
  const rotary::detail::RopeArgs args{c.ids ? 0 : c.start, c.interleaved, c.offsets, c.ids, false, c.cu_seqlens,
                                      c.inv_freq, c.varlen ? "THD" : "BHSD", c.off,
                                      c.axes.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(c.axes)};
  const rotary::detail::NormArgs nargs{qw, kw, 1e-5, c.heads ? "heads" : "head", 0.0, c.q_scale};
  const auto prepared = rotary::detail::prepare_norm_rope("fuzz", q, k, c.table, args, nargs, c.in_place);
  if (c.q_scale) {
    prepared.rope.out_q.view(at::kByte).fill_(0x7f);  // NaN in float8_e4m3fn
  } else if (!c.in_place) {
    prepared.rope.out_q.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  if (!c.in_place) prepared.rope.out_k.fill_(std::numeric_limits<double>::quiet_NaN());
  switch (c.q.scalar_type()) {
    case at::kFloat: emulate_as<float>(prepared, blocks); break;
    case at::kDouble: emulate_as<double>(prepared, blocks); break;
    case at::kHalf: emulate_as<__half>(prepared, blocks); break;
    default: emulate_as<__nv_bfloat16>(prepared, blocks); break;
  }
  const auto bhsd = [&](const at::Tensor& x) { return c.varlen ? x.transpose(0, 1).unsqueeze(0) : x; };
  return {bhsd(prepared.rope.out_q), bhsd(prepared.rope.out_k),
          rotary::kernel::norm_grid(prepared.rope.params, blocks, c.q.element_size()).items > 0};
}

// Call c on the emulated grids against the float64 reference and the CPU op
// (counting the calls the launch takes on its vector instantiation).
void check_call(const FuzzCall& c, int64_t& vector_calls) {
  const auto bhsd = [&](const at::Tensor& x) { return c.varlen ? x.transpose(0, 1).unsqueeze(0) : x; };
  const at::ScalarType dtype = c.q.scalar_type();
  // The float64 reference and the CPU op.
  const auto reference = [&](const at::Tensor& x, const at::Tensor& w) {
    return c.axes.empty()
        ? rotary_test::ref_norm_rope(bhsd(x), w, c.heads, 1e-5, 0.0, c.start, c.interleaved, c.off, c.r, c.ref_pos)
        : rotary_test::ref_norm_rope_nd(bhsd(x), w, c.heads, 1e-5, 0.0, c.start, c.interleaved, c.off, c.r,
                                        *c.ref_pos, c.axes);
  };
  const at::Tensor ref[2] = {reference(c.q, c.qw), reference(c.k, c.kw)};
  const auto [cpu_q, cpu_k] = rotary::apply_qk_norm_rope(
      c.q, c.k, c.table, c.ids ? 0 : c.start, c.interleaved, c.offsets, c.ids, false, c.cu_seqlens, c.inv_freq,
      c.varlen ? "THD" : "BHSD", c.off, c.axes.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(c.axes),
      c.qw, c.kw, 1e-5, c.heads ? "heads" : "head", 0.0, c.q_scale);
  const at::Tensor cpu[2] = {bhsd(cpu_q), bhsd(cpu_k)};
  at::Tensor first[2];
  for (const int64_t blocks : {int64_t{1} << 20, int64_t{1}, int64_t{2}, int64_t{3}}) {
    SCOPED_TRACE(std::to_string(blocks) + " blocks");
    const Emulated e = run_emulation(c, blocks);
    const at::Tensor out[2] = {e.q, e.k};
    vector_calls += blocks == 1 && e.vector;
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
}

TEST(NormEmulationFuzz, SeededCallsMatchTheReferenceTheCpuOpAndEveryGrid) {
  const int64_t cases = fuzz_env("ROTARY_FUZZ_CASES", 40), seed = fuzz_env("ROTARY_FUZZ_SEED", 0);
  int64_t vector_calls = 0;
  for (int64_t i = seed; i < seed + cases; ++i) {
    Draw d{std::mt19937_64(static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull + 17)};
    at::manual_seed(static_cast<uint64_t>(i));
    const FuzzCall c = draw_call(d);
    SCOPED_TRACE("case " + std::to_string(i) + ": " + c.what);
    try {
      check_call(c, vector_calls);
    } catch (const std::exception& e) {  // every drawn call is valid: a refusal is a failure
      ADD_FAILURE() << "refused: " << e.what();
    }
  }
  // The draw reaches both paths (a fuzz that never took the vector path
  // would say nothing of it).
  if (cases >= 20) {
    EXPECT_GT(vector_calls, cases / 5);
    EXPECT_LT(vector_calls, cases - cases / 10);
  }
}

}  // namespace

#endif  // ROTARY_EMULATION
