// The KVCache classes the C++ trials found: options, lengths past int64,
// reset(), and archives (incomplete, of another dtype, fp8 without scales)
// are refused by name before anything is written.
#include "helpers.h"

#include <rotary/rotary.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cstdint>
#include <limits>
#include <sstream>

namespace {

using rotary_test::ExpectError;

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
  ExpectError<c10::ValueError>([&] { cache->advance(-2); }, {"KVCache.advance: tokens must be >= 0, got -2"});
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

}  // namespace
