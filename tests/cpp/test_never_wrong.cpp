// The crash and out-of-bounds classes two trials found, from C++: integers
// near the int64 bounds and negative-bit views are refused by name (or
// served right), before anything is written. KVCache: test_never_wrong_kv_cache.cpp.
#include "helpers.h"
#include "reference.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <limits>
#include <sstream>

namespace {

using rotary_test::AllClose;
using rotary_test::ExpectError;
using rotary_test::ref_rope;
using rotary_test::SameBits;

constexpr int64_t kBig[] = {std::numeric_limits<int64_t>::max() - 7, std::numeric_limits<int64_t>::max(),
                            int64_t{1} << 62};

TEST(NeverWrong, RotaryOffsetNearInt64MaxIsRefusedEverywhere) {
  const auto f = rotary::rope_freqs(8, 16);
  for (const int64_t off : kBig) {
    auto q = at::randn({1, 2, 5, 16}), k = at::randn({1, 2, 5, 16});
    const auto q0 = q.clone(), k0 = k.clone();
    ExpectError<c10::ValueError>(
        [&] { rotary::apply_rope_qk_(q, k, f, 5, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "BHSD", off); },
        {"apply_rope_qk_", "rotary_offset + rotary_dim must fit in head_dim = 16", std::to_string(off)});
    EXPECT_TRUE(at::equal(q, q0) && at::equal(k, k0));
    ExpectError<c10::ValueError>(
        [&] { rotary::apply_rope(q, f, 5, true, std::nullopt, std::nullopt, false, std::nullopt, std::nullopt, "BHSD", off); },
        {"apply_rope", "rotary_offset + rotary_dim must fit"});
    ExpectError<c10::ValueError>(
        [&] {
          rotary::apply_rope(q.to(at::kMeta), f.to(at::kMeta), 5, true, std::nullopt, std::nullopt, false, std::nullopt,
                             std::nullopt, "BHSD", off);
        },
        {"apply_rope", "rotary_offset + rotary_dim must fit"});
    rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(8).max_seq_len(16).rotary_offset(off));
    ExpectError<c10::ValueError>([&] { rope->forward(q, k); }, {"head_dim must be >= rotary_offset + dim"});
  }
}

TEST(NeverWrong, NegativeBitKRotatesInPlace) {
  const auto f = rotary::rope_freqs(16, 16);
  auto q = at::randn({1, 2, 5, 16});
  const auto k = at::imag(at::complex(at::randn({1, 3, 5, 16}), at::randn({1, 3, 5, 16})).conj());
  ASSERT_TRUE(k.is_neg());
  // The float64 reference of the logical values (k.clone() resolves the bit).
  const auto want_q = ref_rope(q, 2), want_k = ref_rope(k.clone(), 2);
  auto kk = k;
  rotary::apply_rope_qk_(q, kk, f, 2);
  const auto tol = rotary_test::tolerance_for(at::kFloat);
  EXPECT_TRUE(AllClose(q, want_q, tol));
  EXPECT_TRUE(AllClose(k.clone(), want_k, tol));
}

// options changed without reset() take effect nowhere (torch's convention):
// forward and forward_with_cache both rotate as the module was built.
TEST(NeverWrong, OptionsChangedWithoutResetTakeNoEffect) {
  rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(16).max_seq_len(32));
  rope->options.interleaved(false).rotary_offset(4).theta(500.0);
  const auto q = at::randn({1, 2, 3, 16}), k = at::randn({1, 2, 3, 16}), v = at::randn({1, 2, 3, 16});
  const auto want_q = ref_rope(q, 0, true), want_k = ref_rope(k, 0, true);
  const auto tol = rotary_test::tolerance_for(at::kFloat);
  EXPECT_TRUE(AllClose(rope->forward(q, 0), want_q, tol));
  rotary::KVCache cache(rotary::KVCacheOptions(1, 2, 8, 16));
  auto q2 = q.clone(), k2 = k.clone();
  rope->forward_with_cache(q2, k2, v, cache);
  EXPECT_TRUE(AllClose(q2, want_q, tol));
  EXPECT_TRUE(AllClose(k2, want_k, tol));
  std::ostringstream printed;
  rope->pretty_print(printed);
  EXPECT_EQ(printed.str(), "rotary::RotaryEmbedding(dim=16, max_seq_len=32, theta=10000, interleaved=true)");
  rope->reset();  // now they do
  EXPECT_FALSE(rope->tables().options().interleaved());
  EXPECT_EQ(rope->tables().options().rotary_offset(), 4);
}

// A review of the C++ API: a clone taken while an options change was
// pending held this module's tables but the pending rule (a dynamic clone
// changed its answers at its first rebuild); a cache read a changed layout
// or capacity before reset(); a reset that could not allocate emptied it.
TEST(NeverWrong, PendingOptionsStayPendingInClonesAndCaches) {
  const auto scaling = rotary::RopeScaling("dynamic").factor(2.0).max_position_embeddings(16);
  rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(8).max_seq_len(64).scaling(scaling));
  rope->options.theta(5e5);
  auto copy = std::dynamic_pointer_cast<rotary::RotaryEmbeddingImpl>(rope->clone());
  EXPECT_EQ(copy->tables().options().theta(), 10000.0);
  EXPECT_EQ(copy->options.theta(), 5e5);  // still pending there, as here
  const auto x = at::randn({1, 2, 3, 8}), far = at::randn({1, 2, 40, 8});
  const auto first = copy->forward(x, 0);
  EXPECT_TRUE(SameBits(first, rope->forward(x, 0)));
  copy->forward(far, 0);  // grows the rule, then resets it
  EXPECT_TRUE(SameBits(copy->forward(x, 0), first));
  EXPECT_TRUE(AllClose(first, ref_rope(x, 0, true), rotary_test::tolerance_for(at::kFloat)));

  rotary::KVCache cache(rotary::KVCacheOptions(1, 2, 4, 8));
  auto q = at::randn({1, 2, 2, 8}), k = at::randn({1, 2, 2, 8});
  rope->forward_with_cache(q, k, at::randn({1, 2, 2, 8}), cache);
  const auto [keys, values] = cache->keys_values();
  cache->options.layout("BSHD").capacity(100);
  EXPECT_TRUE(SameBits(cache->keys_values().first, keys));  // still read as BHSD
  ExpectError<c10::IndexError>([&] { cache->advance(50); }, {"exceeds the capacity 4"});
  cache->options.layout("BHSD").capacity(int64_t{1} << 55);
  EXPECT_ANY_THROW(cache->reset());  // 2^60 elements: cannot allocate, the cache keeps its rows and length
  EXPECT_EQ(cache->length(), 2);
  cache->options.capacity(std::numeric_limits<int64_t>::max() / 4);
  ExpectError<c10::ValueError>([&] { cache->reset(); }, {"KVCache: batch * kv_heads * capacity * head_dim", "capacity"});
  EXPECT_EQ(cache->length(), 2);
  EXPECT_TRUE(SameBits(cache->keys_values().first, keys));
  cache->options.capacity(6);
  cache->reset();
  EXPECT_EQ(cache->length(), 0);
  EXPECT_EQ(cache->options_in_effect().capacity(), 6);
}

// Undefined tensors and out-of-range enums from C++ are named, not read.
TEST(NeverWrong, UndefinedTensorsAndBadEnumsAreNamed) {
  const auto f = rotary::rope_freqs(8, 16);
  const auto x = at::randn({1, 2, 3, 8});
  ExpectError<c10::ValueError>([&] { rotary::apply_rope(at::Tensor(), f); }, {"apply_rope: x is an undefined tensor"});
  ExpectError<c10::ValueError>([&] { rotary::apply_rope(x, f, 0, true, at::Tensor()); },
                               {"apply_rope: offsets is an undefined tensor", "std::nullopt"});
  ExpectError<c10::ValueError>([&] { rotary::apply_rope(x, at::Tensor()); }, {"apply_rope: freqs is an undefined tensor"});
  // The fused cache write names each of its tensors (a shape check read [0] for them).
  const auto kc = at::zeros({1, 2, 4, 8});
  const at::Tensor none;
  const std::pair<const char*, std::array<const at::Tensor*, 4>> cache_args[] = {
      {"v is an undefined tensor", {&none, &kc, &kc, &f}},
      {"k_cache is an undefined tensor", {&x, &none, &kc, &f}},
      {"v_cache is an undefined tensor", {&x, &kc, &none, &f}},
      {"freqs is an undefined tensor", {&x, &kc, &kc, &none}}};
  for (const auto& [message, a] : cache_args) {
    at::Tensor q = x.clone(), k = x.clone(), k_cache = *a[1], v_cache = *a[2];
    ExpectError<c10::ValueError>(
        [&] { rotary::apply_rope_with_kv_cache_(q, k, *a[0], k_cache, v_cache, *a[3]); },
        {std::string("apply_rope_with_kv_cache_: ") + message});
  }
  // Every optional tensor, given as an undefined one: named, never read as
  // UNKNOWN_SCALAR (nor two undefined positions as "both").
  using rotary::RopeFuncOptions;
  const auto undefined = [](const char* op, const char* name) {
    return std::vector<std::string>{std::string(op) + ": " + name + " is an undefined tensor", "std::nullopt"};
  };
  ExpectError<c10::ValueError>([&] { rotary::apply_rope(x, f, RopeFuncOptions().offsets(none).position_ids(none)); },
                               undefined("apply_rope", "offsets"));
  ExpectError<c10::ValueError>([&] { rotary::apply_rope(x, f, RopeFuncOptions().position_ids(none)); },
                               undefined("apply_rope", "position_ids"));
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(x, f, RopeFuncOptions().position_ids(none).pair_axes(std::vector<int64_t>{0, 1})); },
      undefined("apply_rope", "position_ids"));
  ExpectError<c10::ValueError>([&] { rotary::apply_rope(x, f, RopeFuncOptions().inv_freq(none)); },
                               undefined("apply_rope", "inv_freq"));
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_rope(at::randn({3, 2, 8}), f, RopeFuncOptions().cu_seqlens(none)); },
      undefined("apply_rope", "cu_seqlens"));
  ExpectError<c10::ValueError>(
      [&] {
        rotary::apply_rope_cos_sin(x, x, at::ones({16, 8}), none,
                                   rotary::CosSinFuncOptions().position_ids(at::arange(3)));
      },
      undefined("apply_rope_cos_sin", "sin"));
  ExpectError<c10::ValueError>(
      [&] { rotary::apply_qk_norm_rope(x, x, f, RopeFuncOptions(), rotary::QKNormFuncOptions().q_fp8_scale(none)); },
      undefined("apply_qk_norm_rope", "q_fp8_scale"));
  const auto fp8 = at::zeros({1, 2, 4, 8}).to(at::kFloat8_e4m3fn);
  for (const char* name : {"cache_positions", "slot_mapping", "k_scale", "v_scale"}) {
    rotary::KVCacheFuncOptions o;
    if (std::string(name) == "cache_positions") o.cache_positions(none);
    if (std::string(name) == "slot_mapping") o.slot_mapping(none).kv_layout("NHD");
    if (std::string(name) == "k_scale") o.k_scale(none);
    if (std::string(name) == "v_scale") o.v_scale(none);
    at::Tensor q = x.clone(), k = x.clone();
    const bool scale = std::string(name).find("scale") != std::string::npos;
    at::Tensor k_cache = scale ? fp8.clone() : o.slot_mapping() ? at::zeros({2, 4, 2, 8}) : kc.clone();
    at::Tensor v_cache = k_cache.clone();
    const at::Tensor q_before = q.clone();
    ExpectError<c10::ValueError>([&] { rotary::apply_rope_with_kv_cache_(q, k, x, k_cache, v_cache, f, o); },
                                 undefined("apply_rope_with_kv_cache_", name));
    EXPECT_TRUE(at::equal(q, q_before));
  }
  rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(8));
  ExpectError<c10::ValueError>([&] { rope->forward(x, 0, std::nullopt, at::Tensor()); },
                               {"position_ids is an undefined tensor"});
  EXPECT_EQ(rotary::angle_dtype_name(at::kHalf), "Half");
  ExpectError<c10::ValueError>([] { rotary::validate(rotary::RopeScaling("linear").factor(2.0), -2); },
                               {"rotary_dim must be even and > 0, got -2"});
  ExpectError<c10::ValueError>([] { rotary::to_string(static_cast<rotary::RopeType>(99)); },
                               {"RopeType 99 is not a rule"});
}

// A module's host-driven rule installs new tables into the same buffers: the
// backward of an earlier output used them (3.5 off for dynamic, 4.5 for
// longrope) instead of the tables its forward read.
TEST(NeverWrong, BackwardUsesTheTablesOfItsForward) {
  for (const auto& sc : {rotary::RopeScaling("dynamic").factor(4.0).max_position_embeddings(16),
                         rotary::RopeScaling("longrope").factor(4.0).original_max_position_embeddings(16)
                             .short_factor({1, 1, 1, 1}).long_factor({1, 4, 16, 64})}) {
    auto make = [&] { return rotary::RotaryEmbedding(rotary::RotaryEmbeddingOptions(8).max_seq_len(128).scaling(sc)); };
    auto moved = make(), still = make();
    moved->forward(at::randn({1, 1, 4, 8}), 40);  // past the threshold: new tables
    still->forward(at::randn({1, 1, 4, 8}), 40);
    auto x = at::randn({1, 1, 4, 8}, at::kDouble);
    auto xa = x.clone().requires_grad_(), xb = x.clone().requires_grad_();
    auto ya = moved->forward(xa, 40), yb = still->forward(xb, 40);
    moved->forward(at::randn({1, 1, 2, 8}), 0);  // back under it: the tables change again
    const auto g = at::randn_like(ya);
    ya.backward(g);
    yb.backward(g);
    EXPECT_TRUE(at::equal(xa.grad(), xb.grad())) << sc.type() << ": " << (xa.grad() - xb.grad()).abs().max();
  }
}

}  // namespace
