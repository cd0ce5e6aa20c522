// Seeded draws of valid RoPE calls for the fuzz tests: test_fuzz_ops.cpp
// (the ops), test_rope_emulation_fuzz.cpp and test_norm_emulation_fuzz.cpp
// (the CUDA kernels through their host emulation), and their driver
// (run_fuzz).
#pragma once

#include "checks/checks.h"
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace rotary_test {

inline int64_t fuzz_env(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

struct Draw {
  std::mt19937_64 rng;
  explicit Draw(int64_t seed) : rng(static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull + 17) {}
  int64_t in(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }
  bool coin(double p = 0.5) { return std::bernoulli_distribution(p)(rng); }
};

// Runs fn(d, what) for each case ROTARY_FUZZ_CASES (default 40) and
// ROTARY_FUZZ_SEED (default 0) pick, each with its own Draw and torch seed:
// fn draws a call, names it in `what` and checks it, returning whether it
// took the path `counted` names. Every drawn call is valid, so one that
// throws (a refusal) fails. With `counted`, 20 or more cases must reach
// both that path and another (a fuzz that never took one says nothing of
// it): more than a fifth of them, fewer than nine in ten.
template <typename Fn>
void run_fuzz(Fn&& fn, const char* counted = nullptr) {
  const int64_t cases = fuzz_env("ROTARY_FUZZ_CASES", 40), seed = fuzz_env("ROTARY_FUZZ_SEED", 0);
  int64_t taken = 0;
  for (int64_t i = seed; i < seed + cases; ++i) {
    Draw d(i);
    at::manual_seed(static_cast<uint64_t>(i));
    std::string what;
    try {
      taken += fn(d, what) ? 1 : 0;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "case " << i << " (" << what << ") refused: " << e.what();
    }
  }
  if (counted != nullptr && cases >= 20) {
    EXPECT_GT(taken, cases / 5) << counted;
    EXPECT_LT(taken, cases - cases / 10) << counted;
  }
}
// The same with a call drawn by draw(d), named by its `what`, and checked
// by check(call).
template <typename DrawFn, typename CheckFn>
void run_fuzz(DrawFn draw, CheckFn check, const char* counted) {
  run_fuzz(
      [&](Draw& d, std::string& what) {
        const auto call = draw(d);
        what = call.what;
        SCOPED_TRACE(what);
        return check(call);
      },
      counted);
}

// One rotation of q [B, Hq, S, D] and k (THD when packed): its arguments, and
// how its positions read in the float64 reference (ref_rope_span[_nd]).
struct RopeDraw {
  std::string what;
  at::Tensor q, k, table;
  std::optional<at::Tensor> offsets, ids, cu_seqlens, inv_freq, ref_pos;
  std::vector<int64_t> axes;  // N-D: pair j's axis
  int64_t start = 0, off = 0, r = 0;
  bool interleaved = false, in_place = false, varlen = false;

  at::OptionalIntArrayRef pair_axes() const {
    return axes.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(axes);
  }
  int64_t start_pos() const { return ids ? 0 : start; }  // ids are absolute
  const char* layout() const { return varlen ? "THD" : "BHSD"; }
  rotary::detail::RopeArgs args(bool inverse = false) const {
    return {start_pos(), interleaved, offsets, ids, inverse, cu_seqlens, inv_freq, layout(), off, pair_axes()};
  }
  // An output in [B, H, S, D], as the reference gives it.
  at::Tensor bhsd(const at::Tensor& x) const { return varlen ? x.transpose(0, 1).unsqueeze(0) : x; }
  // x [B, H, S, D] (float64) rotated as this call rotates it.
  at::Tensor reference(const at::Tensor& x, bool inverse = false) const {
    return ref_rope_at(x, start, interleaved, off, r, ref_pos, axes, inverse);
  }
};

// q [B, Hq, S, D] and k laid out as the tests' layouts (make_qk), or with
// rows one element wider (misaligned rows: unlike make_qk's misaligned base,
// they stay misaligned in a same_strides copy, which the emulations run on).
constexpr Layout kFuzzLayouts[] = {Layout::kTransposed, Layout::kContiguous, Layout::kPackedQkv,
                                   Layout::kStridedLastDim};
inline const char* fuzz_layout_name(int storage) {
  return storage < 4 ? layout_name(kFuzzLayouts[storage]) : "misaligned rows";
}
inline std::pair<at::Tensor, at::Tensor> fuzz_qk(int storage, int64_t B, int64_t Hq, int64_t Hk, int64_t S, int64_t D,
                                                 at::ScalarType dtype) {
  if (storage < 4) return make_qk(kFuzzLayouts[storage], B, Hq, Hk, S, D, dtype);
  return {randn({B, Hq, S, D + 1}, dtype).narrow(-1, 0, D), randn({B, Hk, S, D + 1}, dtype).narrow(-1, 0, D)};
}

// A valid call: dtype, head dim 8-256, a whole, vector-shaped or any even
// span at any even offset, pairing, 1-6 q and 1-3 k heads (now and then none on
// one side: a rank of an uneven head split), positions (start,
// offsets, ids, N-D ids of 1-3 axes, packed sequences), ids past the table
// with inv_freq, the layouts of fuzz_qk, in place or not.
inline RopeDraw draw_rope(Draw& d) {
  static const at::ScalarType kTypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};
  static const int64_t kDims[] = {8, 16, 24, 32, 48, 64, 96, 128, 256};
  RopeDraw c;
  const at::ScalarType dtype = kTypes[d.in(0, 3)];
  const int64_t D = kDims[d.in(0, 8)];
  const int64_t v = 16 / static_cast<int64_t>(at::elementSize(dtype));  // elements per 16-byte vector
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
  const int pos = static_cast<int>(d.in(0, 4));  // local, offsets, ids, N-D ids, packed
  c.varlen = pos == 4;
  const int none = d.coin(0.08) ? static_cast<int>(d.in(1, 2)) : 0;  // 1: no q heads, 2: no k heads
  const int64_t Hq = none == 1 ? 0 : d.in(1, 6), Hk = none == 2 ? 0 : d.in(1, 3);
  const int64_t B = c.varlen ? 1 : d.in(1, 3), S = c.varlen ? d.in(2, 7) : d.in(1, 4);
  const int storage = static_cast<int>(d.coin(0.5) ? d.in(0, 1) : d.in(2, 4));
  std::tie(c.q, c.k) = fuzz_qk(storage, B, Hq, Hk, S, D, dtype);
  const bool past = d.coin(0.25);  // ids past the table's 64 rows: inv_freq computes them
  const int64_t id_end = past ? 90 : 55;
  c.start = d.in(0, 8);
  if (pos == 1) c.offsets = c.ref_pos = at::randint(0, 40, {B}, at::kLong);
  if (pos == 2) c.ref_pos = at::randint(0, id_end, {B, S}, at::kLong);
  if (pos == 3) {  // 2 or 3 axes drawn; the ids have one per axis used
    const int64_t drawn = d.in(2, 3);
    int64_t n_axes = 1;
    for (int64_t j = 0; j < c.r / 2; ++j) {
      c.axes.push_back(d.in(0, drawn - 1));
      n_axes = std::max(n_axes, c.axes.back() + 1);
    }
    c.ref_pos = at::randint(0, id_end, {n_axes, B, S}, at::kLong);
  }
  if (pos == 2 || pos == 3) c.ids = *c.ref_pos + c.start;
  if (c.varlen) {
    std::vector<int64_t> cu{0}, local;  // local: each token's position past start_pos
    while (cu.back() < S) cu.push_back(std::min(S, cu.back() + d.in(1, 4)));
    // Now and then one start per sequence ([num_seqs] offsets), int32 or int64.
    const int64_t seqs = static_cast<int64_t>(cu.size()) - 1;
    const at::Tensor starts = d.coin(0.4) ? at::randint(0, 40, {seqs}, at::kLong) : at::Tensor();
    for (int64_t i = 0; i < seqs; ++i) {
      const int64_t first = starts.defined() ? starts[i].item<int64_t>() : 0;
      for (int64_t t = 0; t < cu[i + 1] - cu[i]; ++t) local.push_back(first + t);
    }
    if (starts.defined()) c.offsets = d.coin() ? starts.to(at::kInt) : starts;
    c.cu_seqlens = at::tensor(cu, at::kInt);
    c.ref_pos = at::tensor(local, at::kLong).view({1, S});
    c.q = c.q.squeeze(0).transpose(0, 1);  // THD
    c.k = c.k.squeeze(0).transpose(0, 1);
  }
  if (past) c.inv_freq = 1.0 / at::pow(10000.0, at::arange(0, c.r, 2, at::kDouble) / c.r);
  c.table = rotary::rope_freqs(c.r, 64);
  c.in_place = d.coin(0.3);
  std::ostringstream os;
  os << c10::toString(dtype) << " D " << D << " r " << c.r << " off " << c.off
     << (c.interleaved ? " interleaved" : " half") << " Hq " << Hq << " Hk " << Hk << " B " << B << " S " << S
     << " positions " << pos << " layout " << fuzz_layout_name(storage) << (past ? " past the table" : "")
     << (c.in_place ? " in place" : "");
  c.what = os.str();
  return c;
}

}  // namespace rotary_test
