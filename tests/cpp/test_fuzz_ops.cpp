// A seeded fuzz of the four ops from C++, so that the ASan + UBSan build
// runs them over random shapes, dtypes, layouts and strides too: views that
// overlap themselves or each other, packed qkv slices, positions, inv_freq
// (rows past the table), conjugate tables, inverse and partial rotary.
// Accepted calls must match the float64 reference; refused in-place calls
// must leave every byte alone. ROTARY_FUZZ_CASES (default 60) and
// ROTARY_FUZZ_SEED (default 0) pick the cases; `make fuzz` runs more.
#include "fuzz_draw.h"
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>
#include <rotary/ops.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

std::vector<int64_t> element_offsets(const at::Tensor& t) {
  std::vector<int64_t> out{t.storage_offset()};
  for (int64_t d = 0; d < t.dim(); ++d) {
    std::vector<int64_t> next;
    for (int64_t o : out) {
      for (int64_t i = 0; i < t.size(d); ++i) next.push_back(o + i * t.stride(d));
    }
    out.swap(next);
  }
  return t.numel() == 0 ? std::vector<int64_t>{} : out;
}

bool overlaps_itself(const at::Tensor& t) {
  const auto o = element_offsets(t);
  return std::set<int64_t>(o.begin(), o.end()).size() < o.size();
}

bool share_elements(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_alias_of(b)) return false;
  const auto oa = element_offsets(a);
  const std::set<int64_t> s(oa.begin(), oa.end());
  for (int64_t o : element_offsets(b)) {
    if (s.count(o)) return true;
  }
  return false;
}

struct FuzzCase {
  std::mt19937_64 rng;
  explicit FuzzCase(uint64_t seed) : rng(seed) {}
  int64_t pick(int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  }
  bool chance(double p) {
    return std::uniform_real_distribution<double>(0, 1)(rng) < p;
  }
  at::Tensor buffer(int64_t n, at::ScalarType dtype) {
    return at::randn({std::max<int64_t>(n, 1)}, at::kDouble).to(dtype);
  }
  // A [B, H, S, D] view with a random memory layout (maybe overlapping itself).
  at::Tensor view(at::IntArrayRef shape, at::ScalarType dtype, std::vector<at::Tensor>& buffers) {
    const int64_t n = c10::multiply_integers(shape);
    switch (pick(0, 3)) {
      case 0: {  // stored as [B, S, H, D]
        buffers.push_back(buffer(n, dtype));
        return buffers.back().narrow(0, 0, n).view({shape[0], shape[2], shape[1], shape[3]}).transpose(1, 2);
      }
      case 1: {  // every other element of the last dim
        buffers.push_back(buffer(2 * n, dtype));
        return buffers.back().narrow(0, 0, 2 * n).view({shape[0], shape[1], shape[2], 2 * shape[3]}).slice(3, 0, 2 * shape[3], 2);
      }
      case 2: {  // arbitrary small strides
        std::vector<int64_t> strides;
        int64_t span = 1;
        for (size_t d = 0; d < shape.size(); ++d) {
          strides.push_back(std::vector<int64_t>{0, 1, 2, 3, 4, 6, 8, 16, 32}[pick(0, 8)]);
          span += (shape[d] - 1) * strides.back();
        }
        const int64_t off = pick(0, 3);
        buffers.push_back(buffer(span + off, dtype));
        return buffers.back().as_strided(shape, strides, off);
      }
      default:
        buffers.push_back(buffer(n, dtype));
        return buffers.back().narrow(0, 0, n).view(shape);
    }
  }
};

void run_case(uint64_t seed) {
  FuzzCase c(seed);
  const int op = static_cast<int>(c.pick(0, 3));  // apply_rope, apply_rope_qk, apply_rope_, apply_rope_qk_
  const bool qk = op % 2 == 1, in_place = op >= 2;
  const at::ScalarType dtype = std::vector<at::ScalarType>{at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}[c.pick(0, 3)];
  const int64_t B = c.pick(1, 2), Hq = c.pick(1, 3), Hk = c.pick(1, 2), S = c.pick(0, 6);
  const int64_t D = 2 * c.pick(1, 8), rd = 2 * c.pick(1, D / 2), L = c.pick(1, 16);
  const bool use_inv = c.chance(0.5), conj = c.chance(0.25), inverse = c.chance(0.3), interleaved = c.chance(0.5);
  const int64_t start = c.pick(0, 3);
  std::vector<at::Tensor> buffers;
  at::Tensor q, k;
  if (qk && c.chance(0.4)) {  // q and k sliced out of one packed tensor, maybe overlapping
    const int64_t shift = c.chance(0.3) ? -1 : 0;
    buffers.push_back(c.buffer(B * S * (Hq + Hk) * D, dtype));
    const auto packed = buffers.back().narrow(0, 0, B * S * (Hq + Hk) * D).view({B, S, Hq + Hk, D}).transpose(1, 2);
    q = packed.narrow(1, 0, Hq);
    k = packed.narrow(1, Hq + shift, Hk);
  } else {
    q = c.view({B, Hq, S, D}, dtype, buffers);
    if (qk) k = c.view({B, Hk, S, D}, dtype, buffers);
  }
  std::optional<at::Tensor> positions, inv;
  int64_t max_row = start + S - 1;
  if (c.chance(0.4) && S > 0) {
    const int64_t hi = use_inv ? L + 8 : L;
    if (c.chance(0.5)) {
      positions = at::randint(0, hi, {B, S}, at::kLong);
      max_row = start + positions->max().item<int64_t>();
    } else {
      positions = at::randint(0, std::max<int64_t>(1, hi - S + 1), {B}, at::kLong);
      max_row = start + positions->max().item<int64_t>() + S - 1;
    }
  }
  if (use_inv) inv = at::tensor(rotary::compute_frequencies(rd, 10000.0).inv_freq, at::kDouble);
  at::Tensor freqs = rotary::rope_freqs(rd, L);
  if (conj) freqs = freqs.conj();

  std::string refusal;  // what the documented rules say about this call
  if (in_place && (overlaps_itself(q) || (qk && (overlaps_itself(k) || share_elements(q, k))))) {
    refusal = "overlap";
  } else if (S > 0 && !use_inv && max_row >= L) {
    refusal = "past the table";
  }
  std::vector<at::Tensor> saved;
  for (const auto& b : buffers) saved.push_back(b.clone());
  // Copies: in place, q and k themselves change.
  const at::Tensor q0 = q.to(at::kDouble, false, true), k0 = qk ? k.to(at::kDouble, false, true) : at::Tensor();
  SCOPED_TRACE("seed " + std::to_string(seed) + " op " + std::to_string(op) + " " + c10::toString(dtype) +
               " q " + c10::str(q.sizes(), q.strides()) + (qk ? " k " + c10::str(k.sizes(), k.strides()) : "") +
               " rd " + std::to_string(rd) + " L " + std::to_string(L) + " refusal '" + refusal + "'");

  std::vector<at::Tensor> outs;
  try {
    const auto P = rotary_test::op_positions(start, positions);  // the reference convention as op arguments
    if (op == 0) outs = {rotary::apply_rope(q, freqs, P.start_pos, interleaved, P.offsets, P.position_ids, inverse, std::nullopt, inv)};
    if (op == 1) {
      auto [oq, ok] = rotary::apply_rope_qk(q, k, freqs, P.start_pos, interleaved, P.offsets, P.position_ids, inverse, std::nullopt, inv);
      outs = {oq, ok};
    }
    if (op == 2) outs = {rotary::apply_rope_(q, freqs, P.start_pos, interleaved, P.offsets, P.position_ids, inverse, std::nullopt, inv)};
    if (op == 3) {
      rotary::apply_rope_qk_(q, k, freqs, P.start_pos, interleaved, P.offsets, P.position_ids, inverse, std::nullopt, inv);
      outs = {q, k};
    }
  } catch (const c10::Error& e) {
    ASSERT_FALSE(refusal.empty()) << "refused a valid call: " << e.what_without_backtrace();
    if (refusal == "overlap") {
      EXPECT_NE(dynamic_cast<const c10::ValueError*>(&e), nullptr) << e.what_without_backtrace();
    } else {
      EXPECT_NE(dynamic_cast<const c10::IndexError*>(&e), nullptr) << e.what_without_backtrace();
    }
    for (size_t i = 0; i < buffers.size(); ++i) EXPECT_TRUE(at::equal(buffers[i], saved[i])) << "input bytes changed";
    return;
  }
  ASSERT_TRUE(refusal.empty()) << "accepted a call that must be refused";
  const bool turn_back = inverse != conj;
  const auto tol = rotary_test::tolerance_for(dtype);
  const at::Tensor ins[2] = {q0, k0};
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor& x = ins[i];
    const at::Tensor expected = at::cat(
        {rotary_test::ref_rope(x.slice(3, 0, rd), start, interleaved, positions, turn_back), x.slice(3, rd)}, 3);
    EXPECT_TRUE(rotary_test::AllClose(outs[i], expected, tol)) << (i ? "k" : "q");
  }
}

TEST(FuzzOps, SeededCasesMatchTheReferenceOrAreRefusedUntouched) {
  const int64_t cases = rotary_test::fuzz_env("ROTARY_FUZZ_CASES", 60);
  const int64_t seed = rotary_test::fuzz_env("ROTARY_FUZZ_SEED", 0);
  for (int64_t i = 0; i < cases && !::testing::Test::HasFailure(); ++i) {
    run_case(static_cast<uint64_t>(seed + i) * 0x9E3779B97F4A7C15ull + 1);
  }
}

}  // namespace
