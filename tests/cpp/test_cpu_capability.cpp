// The CPU kernels are built once per capability (DEFAULT, AVX2, AVX512,
// AVX512_BF16). Each build this CPU can run is forced in turn on the same
// launch: every one must match the float64 reference and give exactly the
// bits of DEFAULT (portable at::vec arrays), on finite inputs and on NaN, Inf
// and denormals alike; the prologue kernel (q/k RMSNorm + RoPE) too.
#include "helpers.h"
#include "reference.h"

#include <rotary/freqs.h>

#include "checks/checks.h"
#include "checks/norm_checks.h"
#include "cpu/kernel/fp8_kernel.h"
#include "cpu/pages.h"
#include "cpu/rope_cpu.h"
#include "params/fp8.h"

#include <ATen/ATen.h>
#include <ATen/Version.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using rotary::cpu::Capability;
using rotary_test::AllClose;
using rotary_test::dtype_name;
using rotary_test::SameBits;
using rotary_test::tolerance_for;

std::vector<Capability> runnable_capabilities() {
  std::vector<Capability> caps;
  for (int c = 0; c <= static_cast<int>(rotary::cpu::capability_from_aten()); ++c) {
    caps.push_back(static_cast<Capability>(c));
  }
  return caps;
}

struct CapabilityCase {
  const char* name;
  std::vector<int64_t> q_shape, k_shape;  // in `layout`
  const char* layout;
  int64_t rotary_dim;
  bool interleaved, inverse, in_place;
  bool strided_last_dim = false;  // every other element of a 2x wider tensor
};

// Heads-major (blocks of 4 heads plus a remainder), token-major, decode,
// partial rotary, head_dim with a tail past the last full vector, strided
// elements, in place, and one case big enough for the streaming stores.
std::vector<CapabilityCase> cases() {
  return {
      {"bhsd", {2, 5, 33, 64}, {2, 3, 33, 64}, "BHSD", 64, true, false, false},
      {"bhsd_half", {2, 5, 33, 64}, {2, 3, 33, 64}, "BHSD", 64, false, false, false},
      {"bshd_inverse", {2, 17, 6, 128}, {2, 17, 2, 128}, "BSHD", 128, true, true, false},
      {"sbhd_half", {9, 2, 4, 128}, {9, 2, 1, 128}, "SBHD", 128, false, false, false},
      {"decode", {8, 1, 32, 128}, {8, 1, 8, 128}, "BSHD", 128, true, false, false},
      {"tail", {1, 3, 21, 36}, {1, 2, 21, 36}, "BHSD", 36, true, false, false},
      {"tail_half", {1, 3, 21, 52}, {1, 2, 21, 52}, "BHSD", 52, false, false, false},
      {"partial", {1, 4, 19, 96}, {1, 2, 19, 96}, "BHSD", 32, false, false, false},
      {"in_place", {2, 6, 25, 64}, {2, 2, 25, 64}, "BHSD", 64, true, false, true},
      {"strided", {1, 3, 11, 32}, {1, 2, 11, 32}, "BHSD", 32, true, false, false, true},
      {"streaming", {1, 32, 2048, 128}, {1, 8, 2048, 128}, "BHSD", 128, false, false, false},
  };
}

at::Tensor make_input(const std::vector<int64_t>& shape, at::ScalarType dtype, bool strided, bool specials) {
  std::vector<int64_t> full = shape;
  if (strided) full.back() *= 2;
  at::Tensor x = at::randn(full, at::kDouble);
  if (specials) {
    // Every fifth element special: NaN, +-Inf, fp32 denormals, huge values,
    // and values whose 16-bit rounding is a tie.
    const double vals[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity(), 1e-40, -3e-39, 3e38, 1.0 + 1.0 / 256};
    auto flat = x.view({-1});
    for (int64_t i = 0; i < flat.numel(); i += 5) flat[i] = vals[(i / 5) % 7];
  }
  x = x.to(dtype);
  return strided ? x.slice(-1, 0, x.size(-1), 2) : x;
}

// The launch of one case under one capability; returns (out_q, out_k).
std::pair<at::Tensor, at::Tensor> run(
    const CapabilityCase& c, const at::Tensor& q, const at::Tensor& k, const at::Tensor& freqs, Capability cap) {
  const std::optional<at::Tensor> none;
  const rotary::detail::RopeArgs args{3, c.interleaved, none, none, c.inverse, none, none, c.layout};
  const at::Tensor qi = c.in_place ? q.clone() : q;
  const at::Tensor ki = c.in_place ? k.clone() : k;
  auto prepared = rotary::detail::prepare_rope("test", qi, &ki, freqs, args, c.in_place);
  if (!c.in_place) {  // poison: an unwritten element shows up as NaN
    prepared.out_q.fill_(std::numeric_limits<double>::quiet_NaN());
    prepared.out_k.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  rotary::cpu::rope_cpu(prepared.params, q.scalar_type(), cap);
  return {prepared.out_q, prepared.out_k};
}

// The BHSD view of a tensor given in `layout`, as float64, for the reference.
at::Tensor to_bhsd(const at::Tensor& x, const std::string& layout) {
  if (layout == "BSHD") return x.transpose(1, 2);
  if (layout == "SBHD") return x.permute({1, 2, 0, 3});
  return x;
}

at::Tensor reference(const CapabilityCase& c, const at::Tensor& x) {
  const at::Tensor v = to_bhsd(x, c.layout).to(at::kDouble);
  at::Tensor out = v.clone();
  out.narrow(3, 0, c.rotary_dim).copy_(rotary_test::ref_rope(
      v.narrow(3, 0, c.rotary_dim).contiguous(), 3, c.interleaved, std::nullopt, c.inverse));
  return out;
}

TEST(CpuCapability, MatchesAtenPick) {
  const std::string aten = at::get_cpu_capability();
  const Capability ours = rotary::cpu::capability_from_aten();
  std::cout << "[ capability ] ATen " << aten << ", kernel build " << rotary::cpu::capability_name(ours) << "\n";
  if (aten == "AVX512" || aten == "AVX2") {
#if defined(__x86_64__)
    EXPECT_NE(ours, Capability::kDefault);
#endif
    // An explicit ATEN_CPU_CAPABILITY=avx512 (a CTest entry of its own) gets
    // plain AVX512, also on a CPU with AVX512_BF16.
    const char* asked = std::getenv("ATEN_CPU_CAPABILITY");
    if (asked != nullptr && std::string(asked) == "avx512") EXPECT_NE(ours, Capability::kAvx512Bf16);
  } else {
    EXPECT_EQ(ours, Capability::kDefault);
  }
}

TEST(CpuCapability, EveryBuildGivesTheBitsOfDefault) {
  const auto caps = runnable_capabilities();
  std::string names;
  for (auto cap : caps) names += std::string(" ") + rotary::cpu::capability_name(cap);
  std::cout << "[ capability ] compared:" << names << "\n";
  at::manual_seed(11);
  for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (const auto& c : cases()) {
      const auto freqs = rotary::rope_freqs(c.rotary_dim, 4096);
      for (const bool specials : {false, true}) {
        const at::Tensor q = make_input(c.q_shape, dtype, c.strided_last_dim, specials);
        const at::Tensor k = make_input(c.k_shape, dtype, c.strided_last_dim, specials);
        const auto base = run(c, q, k, freqs, Capability::kDefault);
        const std::string where =
            std::string(c.name) + " " + dtype_name(dtype) + (specials ? " specials" : " finite");
        if (!specials) {
          EXPECT_TRUE(AllClose(to_bhsd(base.first, c.layout), reference(c, q), tolerance_for(dtype))) << where;
          EXPECT_TRUE(AllClose(to_bhsd(base.second, c.layout), reference(c, k), tolerance_for(dtype))) << where;
        }
        if (c.strided_last_dim) {  // the scalar path against the vector one
          CapabilityCase dense = c;
          dense.strided_last_dim = false;
          const auto d = run(dense, q.contiguous(), k.contiguous(), freqs, Capability::kDefault);
          EXPECT_TRUE(SameBits(base.first, d.first)) << where << " q strided vs contiguous";
          EXPECT_TRUE(SameBits(base.second, d.second)) << where << " k strided vs contiguous";
        }
        for (const auto cap : caps) {
          if (cap == Capability::kDefault) continue;
          const auto got = run(c, q, k, freqs, cap);
          EXPECT_TRUE(SameBits(got.first, base.first)) << where << " q " << rotary::cpu::capability_name(cap);
          EXPECT_TRUE(SameBits(got.second, base.second)) << where << " k " << rotary::cpu::capability_name(cap);
        }
      }
    }
  }
}

struct NormCapabilityCase {
  const char* name;
  std::vector<int64_t> q_shape, k_shape;  // in `layout`
  const char* layout;
  bool interleaved, heads, in_place, fp8_q;
};

// Norm per head and across heads, both pairings, decode, in place, fp8 q.
std::vector<NormCapabilityCase> norm_cases() {
  return {
      {"head", {2, 4, 9, 64}, {2, 2, 9, 64}, "BHSD", true, false, false, false},
      {"heads_half", {2, 9, 4, 128}, {2, 9, 2, 128}, "BSHD", false, true, false, false},
      {"decode", {8, 1, 32, 128}, {8, 1, 8, 128}, "BSHD", true, false, false, false},
      {"in_place_half", {1, 3, 17, 96}, {1, 1, 17, 96}, "BHSD", false, false, true, false},
      {"fp8_q", {2, 4, 5, 64}, {2, 2, 5, 64}, "BHSD", true, false, false, true},
  };
}

int64_t heads_of(const NormCapabilityCase& c, const std::vector<int64_t>& shape) {
  return std::string(c.layout) == "BHSD" ? shape[1] : shape[2];
}

// The prologue (apply_qk_norm_rope) of one case under one capability.
std::pair<at::Tensor, at::Tensor> run_norm(
    const NormCapabilityCase& c, const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw,
    const at::Tensor& kw, const at::Tensor& freqs, Capability cap) {
  const std::optional<at::Tensor> none, oqw(qw), okw(kw);
  const std::optional<at::Tensor> scale =
      c.fp8_q ? std::optional<at::Tensor>(at::linspace(0.004, 0.02, heads_of(c, c.q_shape))) : none;
  const rotary::detail::RopeArgs args{3, c.interleaved, none, none, false, none, none, c.layout};
  const rotary::detail::NormArgs nargs{oqw, okw, 1e-5, c.heads ? "heads" : "head", 0.0, scale};
  const at::Tensor qi = c.in_place ? q.clone() : q;
  const at::Tensor ki = c.in_place ? k.clone() : k;
  const auto prepared = rotary::detail::prepare_norm_rope("test", qi, ki, freqs, args, nargs, c.in_place);
  if (c.fp8_q) {
    prepared.rope.out_q.view(at::kByte).fill_(0x7f);  // NaN in float8_e4m3fn
  } else if (!c.in_place) {
    prepared.rope.out_q.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  if (!c.in_place) prepared.rope.out_k.fill_(std::numeric_limits<double>::quiet_NaN());
  rotary::cpu::norm_rope_cpu(prepared.rope.params, prepared.norm.params, q.scalar_type(), nullptr, cap);
  return {c.fp8_q ? prepared.rope.out_q.view(at::kByte) : prepared.rope.out_q, prepared.rope.out_k};
}

TEST(CpuCapability, EveryPrologueBuildGivesTheBitsOfDefault) {
  const auto caps = runnable_capabilities();
  at::manual_seed(12);
  for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (const auto& c : norm_cases()) {
      const int64_t D = c.q_shape.back();
      const auto freqs = rotary::rope_freqs(D, 4096);
      for (const bool specials : {false, true}) {
        at::Tensor q = at::randn(c.q_shape, at::kDouble), k = at::randn(c.k_shape, at::kDouble);
        // Norm "heads": one weight per element of a token's heads.
        at::Tensor qw = 1 + 0.5 * at::randn({c.heads ? heads_of(c, c.q_shape) * D : D});
        at::Tensor kw = 1 + 0.5 * at::randn({c.heads ? heads_of(c, c.k_shape) * D : D});
        if (specials) {
          // A NaN in one head and an Inf in another (their heads' sums), and
          // fp32-denormal weights, whose outputs round from fp32 denormals.
          q.view({-1})[3] = std::numeric_limits<double>::quiet_NaN();
          k.view({-1})[D + 5] = std::numeric_limits<double>::infinity();
          qw.slice(0, 0, qw.numel(), 7).fill_(1e-39);
          kw.slice(0, 1, kw.numel(), 5).fill_(-3e-39);
        }
        q = q.to(dtype);
        k = k.to(dtype);
        qw = qw.to(at::kFloat);
        kw = kw.to(at::kFloat);
        const auto base = run_norm(c, q, k, qw, kw, freqs, Capability::kDefault);
        const std::string where =
            std::string(c.name) + " " + dtype_name(dtype) + (specials ? " specials" : " finite");
        if (!specials) {  // DEFAULT against the float64 reference (fp8 q: the prologue op tests')
          const at::Tensor* x[2] = {&q, &k};
          const at::Tensor* w[2] = {&qw, &kw};
          const at::Tensor* got[2] = {&base.first, &base.second};
          for (int t = c.fp8_q ? 1 : 0; t < 2; ++t) {
            const at::Tensor want = rotary_test::ref_norm_rope(to_bhsd(*x[t], c.layout), *w[t], c.heads, 1e-5, 0.0, 3,
                                                               c.interleaved, 0, D);
            EXPECT_TRUE(AllClose(to_bhsd(*got[t], c.layout), want, tolerance_for(dtype))) << where << (t ? " k" : " q");
          }
        }
        for (const auto cap : caps) {
          if (cap == Capability::kDefault) continue;
          const auto got = run_norm(c, q, k, qw, kw, freqs, cap);
          EXPECT_TRUE(SameBits(got.first, base.first)) << where << " q " << rotary::cpu::capability_name(cap);
          EXPECT_TRUE(SameBits(got.second, base.second)) << where << " k " << rotary::cpu::capability_name(cap);
        }
      }
    }
  }
}

// The fp8 row (the CPU fp8 KV-cache write) of each build against the scalar
// kernel::quantize_fp8 (which test_fp8.cpp holds to c10's encoding): every
// rounding point of float32 (the top 20 bits under low bits on and around
// them), every float16 and bfloat16, with and without scales, special ones
// included; rows of odd length, so vectors and the scalar tail both run.
template <typename T>
void expect_fp8_rows(const std::vector<T>& x, Capability cap, const char* what) {
  using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const float specials[] = {0.37f, 3.1e-3f, 1e-30f, 448.0f / 240.0f, -2.5f, 0.0f,
                            std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  std::vector<uint8_t> got(x.size());
  for (int i = -1; i < static_cast<int>(std::size(specials)); ++i) {
    const float* scale = i < 0 ? nullptr : &specials[i];
    if (i >= 4 && x.size() > (1u << 16)) continue;  // the special scales on the 16-bit sets only
    [&] { ROTARY_CPU_DISPATCH(cap, isa::quantize_fp8_row(x.data(), static_cast<int64_t>(x.size()), scale, got.data())) }();
    int64_t bad = 0;
    for (size_t j = 0; j < x.size(); ++j) {
      const uint8_t want = rotary::kernel::quantize_fp8(static_cast<acc_t>(x[j]), scale);
      if (got[j] != want && bad++ < 3) {
        ADD_FAILURE() << what << " " << rotary::cpu::capability_name(cap) << " scale "
                      << (scale ? *scale : 1.0f) << " element " << j << ": got 0x" << std::hex << int(got[j])
                      << ", want 0x" << int(want);
      }
    }
    EXPECT_EQ(bad, 0) << what << " " << rotary::cpu::capability_name(cap);
  }
}

TEST(CpuCapability, EveryBuildQuantizesFp8RowsAsTheScalarEncoder) {
  constexpr uint32_t kLow[] = {0x000, 0x001, 0x7ff, 0x800, 0x801, 0xfff};
  std::vector<float> f;
  for (uint32_t top = 0; top < (1u << 20); ++top) {
    for (const uint32_t low : kLow) f.push_back(rotary::kernel::float_of_bits(top << 12 | low));
  }
  f.push_back(1.0f);  // an odd length
  std::vector<c10::Half> h;
  std::vector<c10::BFloat16> b;
  for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
    h.push_back(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()));
    b.push_back(c10::BFloat16(static_cast<uint16_t>(bits), c10::BFloat16::from_bits()));
  }
  h.push_back(h[1]);
  b.push_back(b[1]);
  const std::vector<double> d(f.begin(), f.begin() + (1 << 16) + 3);
  for (const auto cap : runnable_capabilities()) {
    expect_fp8_rows(f, cap, "float32");
    expect_fp8_rows(h, cap, "float16");
    expect_fp8_rows(b, cap, "bfloat16");
    expect_fp8_rows(d, cap, "float64");
  }
}

// The streaming line comes from the cache a core shares: on Linux, the L3
// that sysfs lists for cpu0 (a slice: `sysconf` may give the socket's sum).
TEST(CpuHost, SharedCacheIsTheL3SliceOfCpu0) {
  std::ifstream level("/sys/devices/system/cpu/cpu0/cache/index3/level");
  std::ifstream size("/sys/devices/system/cpu/cpu0/cache/index3/size");
  int lvl = 0;
  long long kib = 0;
  std::string unit;
  if (!(level >> lvl) || lvl != 3 || !(size >> kib >> unit) || unit != "K") {
    GTEST_SKIP() << "no level-3 cache in sysfs as index3, in KiB";
  }
  EXPECT_EQ(rotary::cpu::pages::shared_cache_bytes(), kib * 1024);
}

// The software prefetch below the streaming line weighs a thread's data
// against its own L2: the level-2 cache sysfs lists for cpu0.
TEST(CpuHost, L2IsTheLevel2CacheOfCpu0) {
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level(dir + "level"), size(dir + "size");
    int lvl = 0;
    long long kib = 0;
    std::string unit;
    if (!(level >> lvl)) break;
    if (lvl != 2) continue;
    if (!(size >> kib >> unit) || unit != "K") break;
    EXPECT_EQ(rotary::cpu::pages::l2_cache_bytes(), kib * 1024);
    return;
  }
  GTEST_SKIP() << "no level-2 cache in sysfs, in KiB";
}

}  // namespace
