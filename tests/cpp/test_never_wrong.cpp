// The crash and out-of-bounds classes two trials found, from C++: integers
// near the int64 bounds, negative-bit views and KVCache options are refused
// by name (or served right), before anything is written.
#include "helpers.h"
#include "reference.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

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

TEST(NeverWrong, KVCacheOptionsAreChecked) {
  using rotary::KVCacheOptions;
  ExpectError<c10::ValueError>([] { rotary::KVCache(KVCacheOptions(1, 2, 8, 15)); }, {"head_dim must be even", "15"});
  ExpectError<c10::ValueError>(
      [] { rotary::KVCache(KVCacheOptions(1, 2, 8, 16).k_scale(2.0)); }, {"k_scale is only for float8_e4m3fn caches"});
  for (const double bad : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(), 1e300}) {
    ExpectError<c10::ValueError>(
        [&] { rotary::KVCache(KVCacheOptions(1, 2, 8, 16).dtype(at::kFloat8_e4m3fn).v_scale(bad)); },
        {"v_scale must be finite and > 0"});
  }
  rotary::KVCache cache(KVCacheOptions(1, 2, 8, 16).dtype(at::kFloat8_e4m3fn).k_scale(0.5));
  ExpectError<c10::TypeError>([&] { cache->keys_values(at::kInt); }, {"keys_values: dtype must be"});
  cache->to(at::kHalf);  // a parent's cast: the cache keeps its dtype
  EXPECT_EQ(cache->k.scalar_type(), at::kFloat8_e4m3fn);
}

// A trial of the C++ API: advance past int64 wrapped the length, reset()
// threw on any built cache, and a saved cache lost its length and loaded
// into a cache of another dtype as that dtype's bytes (read out of bounds).
TEST(NeverWrong, KVCacheLengthResetAndSaveLoad) {
  using rotary::KVCacheOptions;
  rotary::KVCache cache(KVCacheOptions(1, 2, 8, 16));
  cache->advance(3);
  ExpectError<c10::IndexError>([&] { cache->advance(std::numeric_limits<int64_t>::max()); }, {"exceeds the capacity 8"});
  EXPECT_EQ(cache->length(), 3);
  const at::Tensor k = cache->k;
  cache->k.fill_(2.0);
  cache->reset();
  EXPECT_EQ(cache->length(), 0);  // zero rows are not keys: a reset empties the cache
  EXPECT_TRUE(cache->k.is_same(k) && cache->k.eq(0).all().item<bool>());  // the registered buffer, zeroed
  EXPECT_EQ(cache->named_buffers().size(), 2u);
  // A smaller capacity: the length cannot outlive it.
  cache->advance(6);
  cache->options.capacity(4);
  cache->reset();
  EXPECT_EQ(cache->length(), 0);
  EXPECT_EQ(cache->k.size(2), 4);
  cache->options.capacity(8);
  cache->reset();
  cache->advance(3);
  cache->k.fill_(3.0);
  auto copy = std::dynamic_pointer_cast<rotary::KVCacheImpl>(cache->clone());  // reset() on a copy
  EXPECT_TRUE(!copy->k.is_same(cache->k) && copy->k.eq(3).all().item<bool>() && cache->k.eq(3).all().item<bool>());
  EXPECT_EQ(copy->length(), 3);
  EXPECT_TRUE(copy->named_buffers()["k"].is_same(copy->k));
  cache->k.zero_();

  cache->k.copy_(at::randn_like(cache->k));
  std::stringstream stream;
  torch::save(cache, stream);
  rotary::KVCache same(KVCacheOptions(1, 2, 8, 16));
  torch::load(same, stream);
  EXPECT_EQ(same->length(), 3);
  EXPECT_TRUE(at::equal(same->k, cache->k));
  for (const auto& other : {KVCacheOptions(1, 2, 8, 16).dtype(at::kHalf), KVCacheOptions(1, 2, 4, 16)}) {
    rotary::KVCache wrong(other);
    const at::Tensor before = wrong->k.clone();
    std::stringstream again;
    torch::save(cache, again);
    ExpectError<c10::ValueError>([&] { torch::load(wrong, again); }, {"KVCache.load: saved k is Float", "this cache's is"});
    EXPECT_TRUE(at::equal(wrong->k, before));
    EXPECT_EQ(wrong->length(), 0);
  }
  // A BSHD cache of the same buffer shape: the layout is saved and checked.
  rotary::KVCache bshd(KVCacheOptions(1, 8, 2, 16).layout("BSHD"));
  const at::Tensor before = bshd->k.clone();
  std::stringstream third;
  torch::save(cache, third);
  ExpectError<c10::ValueError>([&] { torch::load(bshd, third); },
                               {"KVCache.load: the state was saved from a 'BHSD' cache, this one is 'BSHD'"});
  EXPECT_TRUE(at::equal(bshd->k, before));
}

// An archive must hold every piece of the state, each of its kind; a refused
// load leaves the cache as it was.
TEST(NeverWrong, KVCacheLoadRefusesAnIncompleteArchive) {
  using rotary::KVCacheOptions;
  rotary::KVCache src(KVCacheOptions(1, 2, 8, 16));
  src->k.copy_(at::randn_like(src->k));
  const auto write = [&](const char* skip, const c10::IValue& length, const c10::IValue& layout) {
    torch::serialize::OutputArchive a;
    a.write("k", src->k, true);
    a.write("v", src->v, true);
    if (std::string(skip) != "length") {
      if (length.isTensor()) a.write("length", length.toTensor(), true);
      else a.write("length", length);
    }
    if (std::string(skip) != "layout") a.write("layout", layout);
    std::stringstream stream;
    a.save_to(stream);
    return stream.str();
  };
  const c10::IValue len(at::tensor(int64_t{3})), bhsd(std::string("BHSD"));
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {write("length", len, bhsd), {"KVCache.load: the archive has no 'length'", "all of its state or none"}},
      {write("layout", len, bhsd), {"KVCache.load: the archive has no 'layout'"}},
      {write("", c10::IValue(int64_t{3}), bhsd), {"KVCache.load: the archive has no 'length'"}},
      {write("", c10::IValue(at::tensor(3.7)), bhsd), {"the saved 'length' must be one integer, got Double"}},
      {write("", c10::IValue(at::ones({}, at::kBool)), bhsd), {"the saved 'length' must be one integer, got Bool"}},
      {write("", c10::IValue(at::tensor(1e30)), bhsd), {"the saved 'length' must be one integer"}},
      {write("", c10::IValue(at::tensor({int64_t{1}, int64_t{2}})), bhsd), {"must be one integer, got Long [2]"}},
      {write("", len, c10::IValue(int64_t{5})), {"the saved 'layout' must be a string, got Int"}},
  };
  for (const auto& [bytes, words] : cases) {
    rotary::KVCache dst(KVCacheOptions(1, 2, 8, 16));
    dst->advance(4);
    std::stringstream stream(bytes);
    ExpectError<c10::ValueError>([&] { torch::load(dst, stream); }, words);
    EXPECT_EQ(dst->length(), 4);
    EXPECT_TRUE(dst->k.eq(0).all().item<bool>());
  }
  rotary::KVCache dst(KVCacheOptions(1, 2, 8, 16));
  std::stringstream whole(write("", len, bhsd));
  torch::load(dst, whole);
  EXPECT_EQ(dst->length(), 3);
  EXPECT_TRUE(at::equal(dst->k, src->k));
  // A RotaryEmbedding archive names its missing table.
  torch::serialize::OutputArchive a;
  a.write("inv_freq", at::ones({4}, at::kDouble), true);
  std::stringstream no_freqs;
  a.save_to(no_freqs);
  rotary::RotaryEmbedding rope(rotary::RotaryEmbeddingOptions(8));
  ExpectError<c10::ValueError>([&] { torch::load(rope, no_freqs); }, {"RotaryEmbedding.load: the archive has no 'freqs'"});
}

// An fp8 cache's scales decode its bytes: an archive without them was loaded
// and its bytes read with the cache's own scale (16 for a saved 1).
TEST(NeverWrong, Fp8KVCacheLoadRefusesAnArchiveWithoutItsScales) {
  using rotary::KVCacheOptions;
  const auto fp8 = [](double scale) {
    return rotary::KVCache(KVCacheOptions(1, 1, 4, 8).dtype(at::kFloat8_e4m3fn).k_scale(scale).v_scale(scale));
  };
  rotary::KVCache src = fp8(0.25);
  src->k.copy_((at::randn({1, 1, 4, 8}) / 0.25).to(at::kFloat8_e4m3fn));
  src->advance(4);
  for (const char* skip : {"k_scale", "v_scale"}) {
    torch::serialize::OutputArchive a;
    for (const char* name : {"k", "v", "k_scale", "v_scale"}) {
      if (std::string(name) == skip) continue;
      const at::Tensor& t = std::string(name) == "k" ? src->k : std::string(name) == "v" ? src->v
                            : std::string(name) == "k_scale" ? src->k_scale : src->v_scale;
      a.write(name, t, true);
    }
    a.write("length", at::tensor(int64_t{4}), true);
    a.write("layout", c10::IValue(std::string("BHSD")));
    std::stringstream stream;
    a.save_to(stream);
    rotary::KVCache dst = fp8(4.0);
    const at::Tensor before = dst->k.clone();
    ExpectError<c10::ValueError>([&] { torch::load(dst, stream); },
                                 {std::string("KVCache.load: the archive has no '") + skip + "'", "float8_e4m3fn"});
    EXPECT_EQ(dst->length(), 0);
    EXPECT_TRUE(at::equal(dst->k.view(at::kByte), before.view(at::kByte)));
    EXPECT_EQ(dst->k_scale.item<float>(), 4.0f);
  }
  std::stringstream whole;
  torch::save(src, whole);
  rotary::KVCache dst = fp8(4.0);
  torch::load(dst, whole);
  EXPECT_EQ(dst->k_scale.item<float>(), 0.25f);
  EXPECT_TRUE(at::equal(dst->k.view(at::kByte), src->k.view(at::kByte)));
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
