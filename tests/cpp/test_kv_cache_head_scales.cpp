// rotary::KVCache with one float8 scale per kv head (k_head_scales): each
// head stored at its own scale (against torch's conversion of x / scale),
// dequantised per head, kept by clone(), and refused by name when the list
// does not fit the cache.
#include "helpers.h"
#include "reference.h"

#include <rotary/rotary.h>

#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/types.h>

#include <memory>
#include <sstream>
#include <tuple>
#include <vector>

namespace kv_head_scales {  // named: the unity build joins test files

using rotary::KVCache;
using rotary::KVCacheImpl;
using rotary::KVCacheOptions;
using rotary::RotaryEmbedding;
using rotary::RotaryEmbeddingOptions;
using rotary_test::ExpectError;
using rotary_test::seeded_randn;

// (x / scale[h]).clamp(-448, 448) as float8, head by head ([B, H, S, D]).
at::Tensor quantized(const at::Tensor& x, const std::vector<double>& scales) {
  const auto s = at::tensor(std::vector<float>(scales.begin(), scales.end())).view({1, -1, 1, 1});
  return (x / s).clamp(-448, 448).to(at::kFloat8_e4m3fn);
}

TEST(KVCacheHeadScales, EachHeadAtItsOwnScale) {
  const std::vector<double> ks = {0.5, 2.0, 0.125}, vs = {0.25, 4.0, 1.0};
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(64));
  KVCache cache(KVCacheOptions(2, 3, 8, 16).dtype(at::kFloat8_e4m3fn).k_head_scales(ks).v_head_scales(vs));
  EXPECT_EQ(cache->k_scale.sizes(), at::IntArrayRef({3}));
  auto q = seeded_randn({2, 6, 5, 16}, 1), k = seeded_randn({2, 3, 5, 16}, 2), v = seeded_randn({2, 3, 5, 16}, 3);
  const auto want_k = std::get<1>(rope->forward(q, k));
  rope->forward_with_cache(q, k, v, cache);
  const auto stored_k = cache->k.narrow(2, 0, 5), stored_v = cache->v.narrow(2, 0, 5);
  EXPECT_TRUE(rotary_test::SameBits(stored_k, quantized(want_k, ks)));
  EXPECT_TRUE(rotary_test::SameBits(stored_v, quantized(v, vs)));
  const auto [keys, values] = cache->keys_values();
  const auto per_head = at::tensor(std::vector<float>{0.5f, 2.0f, 0.125f}).view({1, 3, 1, 1});
  EXPECT_TRUE(at::equal(keys, stored_k.to(at::kFloat) * per_head));  // powers of two: exact
  // clone() keeps the scales the buffers hold.
  KVCache copy(std::dynamic_pointer_cast<KVCacheImpl>(cache->clone()));
  EXPECT_TRUE(at::equal(copy->k_scale, cache->k_scale));
  EXPECT_TRUE(at::equal(std::get<0>(copy->keys_values()), keys));
  std::ostringstream repr;
  cache->pretty_print(repr);
  EXPECT_NE(repr.str().find("k_scale=[0.5, 2, 0.125]"), std::string::npos) << repr.str();
}

TEST(KVCacheHeadScales, RefusedByName) {
  const auto fp8 = KVCacheOptions(1, 3, 4, 8).dtype(at::kFloat8_e4m3fn);
  ExpectError<c10::ValueError>([&] { KVCache(KVCacheOptions(fp8).k_head_scales({1.0, 2.0})); },
                               {"KVCache: k_scale per head must have kv_heads = 3 entries, got 2"});
  ExpectError<c10::ValueError>([&] { KVCache(KVCacheOptions(fp8).v_head_scales({1.0, -1.0, 1.0})); },
                               {"KVCache: v_scale[1] must be finite and > 0 as a float32, got -1"});
  ExpectError<c10::ValueError>([&] { KVCache(KVCacheOptions(fp8).k_scale(0.5).k_head_scales({1.0, 1.0, 1.0})); },
                               {"KVCache: k_scale is given per tensor and per head; pass one"});
  ExpectError<c10::ValueError>([&] { KVCache(KVCacheOptions(1, 3, 4, 8).k_head_scales({1.0, 1.0, 1.0})); },
                               {"k_scale is only for float8_e4m3fn caches"});
}

// One saved scale means the same for every head: torch::load puts it in
// each head of a per-head cache.
TEST(KVCacheHeadScales, OneSavedScaleLoadsPerHead) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(64));
  KVCache single(KVCacheOptions(1, 3, 8, 16).dtype(at::kFloat8_e4m3fn).k_scale(0.25).v_scale(0.5));
  auto q = seeded_randn({1, 3, 4, 16}, 4), k = seeded_randn({1, 3, 4, 16}, 5);
  rope->forward_with_cache(q, k, seeded_randn({1, 3, 4, 16}, 6), single);
  std::stringstream stream;
  torch::save(single, stream);
  KVCache per_head(KVCacheOptions(1, 3, 8, 16).dtype(at::kFloat8_e4m3fn).k_head_scales({1, 1, 1}).v_head_scales({2, 2, 2}));
  torch::load(per_head, stream);
  EXPECT_TRUE(at::equal(per_head->k_scale, at::full({3}, 0.25f)));
  EXPECT_TRUE(at::equal(per_head->v_scale, at::full({3}, 0.5f)));
  EXPECT_EQ(per_head->length(), 4);
  EXPECT_TRUE(at::equal(std::get<0>(per_head->keys_values()), std::get<0>(single->keys_values())));
}

}  // namespace kv_head_scales
