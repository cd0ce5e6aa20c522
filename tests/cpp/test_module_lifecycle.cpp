// The C++ modules' lifecycle where a review found them wrong: clone() with a
// pending change to `options` (the KVCache copy said it held what its buffers
// did not; an unbuildable pending option made clone() throw), reset() of a
// grown dynamic rule, a grown state restored at 2^40 and past, the layout
// named before the rows, undefined tensors and a move to meta named.
#include "helpers.h"
#include "reference.h"

#include <rotary/rotary.h>

#include <gtest/gtest.h>
#include <torch/types.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <tuple>

namespace {

using rotary::KVCache;
using rotary::KVCacheImpl;
using rotary::KVCacheOptions;
using rotary::RotaryEmbedding;
using rotary::RotaryEmbeddingImpl;
using rotary::RotaryEmbeddingOptions;
using rotary_test::ExpectError;
using rotary_test::seeded_randn;
using rotary_test::ref_rope;

KVCache clone_of(const KVCache& cache) {
  return KVCache(std::dynamic_pointer_cast<KVCacheImpl>(cache->clone()));
}

rotary::RopeScaling dynamic(double factor) {
  return rotary::RopeScaling("dynamic").factor(factor).max_position_embeddings(32);
}

// reset() after options.dtype changed: the buffers take the new dtype
// (Tensor::set_ kept the old one: a narrower dtype failed half-way, with the
// length already 0, and a wider one left buffers the options contradict).
TEST(ModuleLifecycle, KVCacheResetTakesAChangedDtype) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(64));
  const std::pair<at::ScalarType, at::ScalarType> changes[] = {
      {at::kFloat, at::kHalf}, {at::kFloat, at::kDouble}, {at::kBFloat16, at::kHalf}, {at::kFloat, at::kFloat8_e4m3fn}};
  for (const auto& [from, to] : changes) {
    KVCache cache(KVCacheOptions(1, 2, 8, 16).dtype(from));
    auto q = seeded_randn({1, 2, 3, 16}, 11).to(from), k = seeded_randn({1, 2, 3, 16}, 12).to(from);
    rope->forward_with_cache(q, k, seeded_randn({1, 2, 3, 16}, 13).to(from), cache);
    const at::Tensor buffer = cache->k;  // the registered buffer, the same tensor after the reset
    cache->options.dtype(to);
    cache->reset();
    EXPECT_EQ(cache->length(), 0);
    EXPECT_EQ(cache->options_in_effect().dtype(), to);
    EXPECT_EQ(cache->k.scalar_type(), to);
    EXPECT_EQ(cache->v.scalar_type(), to);
    EXPECT_EQ(buffer.scalar_type(), to);
    EXPECT_EQ(cache->named_buffers()["k"].scalar_type(), to);
    const auto step = to == at::kFloat8_e4m3fn ? from : to;
    auto q1 = seeded_randn({1, 2, 1, 16}, 14).to(step), k1 = seeded_randn({1, 2, 1, 16}, 15).to(step);
    const auto keys = std::get<1>(rope->forward_with_cache(q1, k1, seeded_randn({1, 2, 1, 16}, 16).to(step), cache));
    EXPECT_EQ(cache->length(), 1);
    EXPECT_LT((keys.to(at::kDouble) - ref_rope(k1.to(at::kDouble), 0)).abs().max().item<double>(),
              to == at::kFloat8_e4m3fn ? 0.26 : 1e-2);  // fp8: half a step below 8
  }
}

TEST(ModuleLifecycle, KVCacheCloneHoldsWhatItsBuffersHold) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(64));
  // kv_heads == capacity: a BSHD buffer has the BHSD one's shape, so only the options tell them apart.
  KVCache cache(KVCacheOptions(1, 4, 4, 16));
  auto q = seeded_randn({1, 4, 2, 16}, 1), k = seeded_randn({1, 4, 2, 16}, 2), v = seeded_randn({1, 4, 2, 16}, 3);
  rope->forward_with_cache(q, k, v, cache);
  cache->options.layout("BSHD");  // pending until reset()
  KVCache copy = clone_of(cache);
  EXPECT_EQ(copy->options_in_effect().layout(), "BHSD");
  EXPECT_EQ(copy->options.layout(), "BSHD");  // still pending in the copy
  EXPECT_EQ(copy->length(), 2);
  const auto [ka, va] = cache->keys_values();
  const auto [kb, vb] = copy->keys_values();
  EXPECT_TRUE(rotary_test::SameBits(ka, kb));
  EXPECT_TRUE(rotary_test::SameBits(va, vb));
  // The next step lands at row 2 of both, as the float64 reference says.
  auto q1 = seeded_randn({1, 4, 1, 16}, 4), k1 = seeded_randn({1, 4, 1, 16}, 5), v1 = seeded_randn({1, 4, 1, 16}, 6);
  auto q2 = q1.clone(), k2 = k1.clone(), v2 = v1.clone();
  const auto want = ref_rope(k1, 2);
  const auto keys_a = std::get<1>(rope->forward_with_cache(q1, k1, v1, cache));
  const auto keys_b = std::get<1>(rope->forward_with_cache(q2, k2, v2, copy));
  EXPECT_TRUE(rotary_test::SameBits(keys_a, keys_b));
  EXPECT_LT((keys_b.narrow(2, 2, 1).to(at::kDouble) - want).abs().max().item<double>(), 1e-6);

  for (const auto dtype : {at::kHalf, at::kFloat8_e4m3fn}) {  // fp8: the scale buffers differ in number
    KVCache c(KVCacheOptions(1, 2, 4, 16));
    c->options.dtype(dtype).capacity(16);
    KVCache d = clone_of(c);
    EXPECT_EQ(d->options_in_effect().dtype(), at::kFloat);
    EXPECT_EQ(d->options_in_effect().capacity(), 4);
    auto q3 = seeded_randn({1, 2, 1, 16}, 7), k3 = seeded_randn({1, 2, 1, 16}, 8), v3 = seeded_randn({1, 2, 1, 16}, 9);
    rope->forward_with_cache(q3, k3, v3, d);  // a float32 step into the float32 copy
    EXPECT_EQ(d->length(), 1);
  }
}

TEST(ModuleLifecycle, CloneRunsWhatTheModuleRunsWithAnUnbuildablePendingOption) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(32));
  rope->options.max_seq_len(0);  // refused at reset(), pending until then
  auto copy = std::dynamic_pointer_cast<RotaryEmbeddingImpl>(rope->clone());
  ASSERT_NE(copy, nullptr);
  EXPECT_EQ(copy->options.max_seq_len(), 0);
  const auto x = seeded_randn({1, 2, 5, 16}, 10);
  EXPECT_TRUE(rotary_test::SameBits(copy->forward(x, 3), rope->forward(x, 3)));
  EXPECT_LT((copy->forward(x, 3).to(at::kDouble) - ref_rope(x, 3)).abs().max().item<double>(), 1e-6);
  ExpectError<c10::ValueError>([&] { copy->reset(); }, {"max_seq_len must be > 0"});
}

TEST(ModuleLifecycle, ResetStartsAGrownDynamicRuleAfresh) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(32).scaling(dynamic(2.0)));
  rope->update_for_reach(100);
  ASSERT_EQ(rope->tables().state(), 100);
  rope->options.scaling(dynamic(4.0));
  rope->reset();
  EXPECT_EQ(rope->tables().state(), 0);
  RotaryEmbedding fresh(RotaryEmbeddingOptions(16).max_seq_len(32).scaling(dynamic(4.0)));
  const auto x = seeded_randn({1, 2, 4, 16}, 11);
  EXPECT_TRUE(rotary_test::SameBits(rope->forward(x, 40), fresh->forward(x, 40)));
}

TEST(ModuleLifecycle, AGrownStateFarOutIsRestoredExactly) {
  // 5e15 + 1 restored as 5e15 + 17 (the window around inv_freq[1]'s estimate missed
  // it), and past 9e15 a module refused its own state: read from the last pair now.
  for (const int64_t reach : {int64_t{1} << 40, (int64_t{1} << 40) + 1, int64_t{1} << 50, int64_t{5000000000000001},
                              int64_t{20000000000000001}, (int64_t{1} << 60) - 3}) {
    RotaryEmbedding saved(RotaryEmbeddingOptions(128).max_seq_len(32).scaling(dynamic(2.0)));
    saved->update_for_reach(reach);
    RotaryEmbedding loaded(RotaryEmbeddingOptions(128).max_seq_len(32).scaling(dynamic(2.0)));
    loaded->load_tables(saved->freqs, saved->inv_freq);
    if (reach <= (int64_t{1} << 53)) {
      EXPECT_EQ(loaded->tables().state(), reach);
    } else {  // the rule reads L in doubles: lengths that round alike give one table
      EXPECT_LE(std::abs(loaded->tables().state() - reach), reach >> 40);
    }
    EXPECT_TRUE(at::equal(loaded->inv_freq, saved->inv_freq));
    const auto x = seeded_randn({1, 1, 2, 128}, 17);
    EXPECT_TRUE(at::equal(loaded->forward(x, reach - 2), saved->forward(x, reach - 2)));
  }
}

TEST(ModuleLifecycle, AnUnknownLayoutIsNamedBeforeTheRows) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(8).angle_dtype(at::kFloat));
  const auto x = seeded_randn({1, 2, 20, 16}, 12);
  ExpectError<c10::ValueError>([&] { rope->forward(x, 0, std::nullopt, std::nullopt, "bshd"); },
                               {"RotaryEmbedding: layout must be 'BHSD', 'BSHD' or 'SBHD', got 'bshd'"});
}

TEST(ModuleLifecycle, ForwardWithCacheNamesAnUndefinedTensor) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(16));
  KVCache cache(KVCacheOptions(1, 2, 4, 16));
  for (const char* name : {"q", "k", "v"}) {
    at::Tensor q = seeded_randn({1, 2, 1, 16}, 13), k = seeded_randn({1, 2, 1, 16}, 14), v = seeded_randn({1, 2, 1, 16}, 15);
    (name[0] == 'q' ? q : name[0] == 'k' ? k : v) = at::Tensor();
    ExpectError<c10::ValueError>([&] { rope->forward_with_cache(q, k, v, cache); },
                                 {std::string("RotaryEmbedding.forward_with_cache: ") + name +
                                  " is an undefined tensor"});
    EXPECT_EQ(cache->length(), 0);
  }
}

TEST(ModuleLifecycle, AMoveToMetaIsNamed) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(16));
  KVCache cache(KVCacheOptions(1, 2, 4, 16));
  ExpectError<c10::ValueError>([&] { rope->to(at::kMeta); },
                               {"rotary::RotaryEmbedding: a C++ module holds real buffers and cannot move to the meta"});
  ExpectError<c10::ValueError>([&] { cache->to(at::kMeta); }, {"rotary::KVCache: a C++ module holds real buffers"});
  EXPECT_TRUE(rope->freqs.device().is_cpu() && cache->k.device().is_cpu());
}

// One writer at a time: a second append while one is in progress would
// read the same length() and write the same rows. It is refused by name and
// writes nothing; once the first is done, the next is served.
TEST(ModuleLifecycle, AKVCacheTakesOneWriterAtATime) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(16));
  KVCache cache(KVCacheOptions(1, 2, 4, 16));
  at::Tensor q = seeded_randn({1, 2, 1, 16}, 17), k = seeded_randn({1, 2, 1, 16}, 18);
  const at::Tensor v = seeded_randn({1, 2, 1, 16}, 19), q0 = q.clone(), k0 = k.clone(), kc0 = cache->k.clone();
  {
    const auto writing = cache->begin_write("another writer");
    ExpectError<c10::Error>([&] { rope->forward_with_cache(q, k, v, cache); },
                            {"RotaryEmbedding.forward_with_cache: another call is writing this KVCache (one writer at "
                             "a time"});
    ExpectError<c10::Error>([&] { cache->truncate(0); }, {"KVCache.truncate: another call is writing this KVCache"});
    ExpectError<c10::Error>([&] { cache->reset(); }, {"KVCache.reset: another call is writing this KVCache"});
    // A move swaps the buffers the writer is writing (it wrote the old ones and lost its rows).
    ExpectError<c10::Error>([&] { cache->to(torch::kCPU); }, {"KVCache.to: another call is writing this KVCache"});
    EXPECT_TRUE(torch::equal(q, q0) && torch::equal(k, k0) && torch::equal(cache->k, kc0));
    EXPECT_EQ(cache->length(), 0);
  }
  rope->forward_with_cache(q, k, v, cache);
  EXPECT_EQ(cache->length(), 1);
  EXPECT_EQ(clone_of(cache)->length(), 1);  // a copy is not being written: it takes a writer
}

// A process forked during a write holds a write that never ends there: it
// said "another call is writing" for every call after, naming nothing to
// wait for. The child is told it was forked mid-write; reset() takes over.
TEST(ModuleLifecycle, AKVCacheForkedMidWriteSaysSoAndResetTakesOver) {
  RotaryEmbedding rope(RotaryEmbeddingOptions(16).max_seq_len(16));
  KVCache cache(KVCacheOptions(1, 2, 4, 16));
  const at::Tensor q = seeded_randn({1, 2, 1, 16}, 17), k = seeded_randn({1, 2, 1, 16}, 18),
                   v = seeded_randn({1, 2, 1, 16}, 19);
  const auto writing = cache->begin_write("a writer in the parent");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // no gtest assertion here: the exit status is the verdict
    const auto refused = [&](const std::function<void()>& call, const std::string& words) {
      try {
        call();
      } catch (const c10::Error& e) {
        return std::string(e.what_without_backtrace()).find(words) != std::string::npos;
      }
      return false;
    };
    const std::string forked = "this KVCache was being written by process " + std::to_string(::getppid()) +
                               " when this process was forked from it";
    at::Tensor q1 = q.clone(), k1 = k.clone();
    bool ok = refused([&] { rope->forward_with_cache(q1, k1, v, cache); },
                      "RotaryEmbedding.forward_with_cache: " + forked) &&
              refused([&] { cache->truncate(0); }, "KVCache.truncate: " + forked);
    try {
      cache->reset();
      rope->forward_with_cache(q1, k1, v, cache);
      ok = ok && cache->length() == 1;
    } catch (...) {
      ok = false;
    }
    std::_Exit(ok ? 0 : 3);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  ExpectError<c10::Error>([&] { cache->truncate(0); }, {"KVCache.truncate: another call is writing this KVCache"});
}

}  // namespace
