// The exact overlap tests of the in-place ops (csrc/checks/overlap.h) against
// enumerating every element's bytes, on random small strided views: any
// dims, zero and repeated strides, offsets, and two dtypes over one buffer.
#include "checks/overlap.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

namespace {

using rotary::detail::Overlap;

// Every byte address of every element of t.
std::vector<std::set<int64_t>> element_bytes(const at::Tensor& t) {
  const auto base = reinterpret_cast<int64_t>(t.const_data_ptr());
  std::vector<int64_t> offsets{0};
  for (int64_t d = 0; d < t.dim(); ++d) {
    std::vector<int64_t> next;
    for (int64_t o : offsets) {
      for (int64_t i = 0; i < t.size(d); ++i) next.push_back(o + i * t.stride(d));
    }
    offsets.swap(next);
  }
  std::vector<std::set<int64_t>> out;
  if (t.numel() == 0) return out;
  for (int64_t o : offsets) {
    std::set<int64_t> bytes;
    for (int64_t b = 0; b < t.element_size(); ++b) bytes.insert(base + o * t.element_size() + b);
    out.push_back(bytes);
  }
  return out;
}

bool brute_self(const at::Tensor& t) {
  const auto e = element_bytes(t);
  std::set<int64_t> starts;
  for (const auto& s : e) starts.insert(*s.begin());
  return starts.size() < e.size();
}

bool brute_mutual(const at::Tensor& a, const at::Tensor& b) {
  std::set<int64_t> all;
  for (const auto& s : element_bytes(a)) all.insert(s.begin(), s.end());
  for (const auto& s : element_bytes(b)) {
    for (int64_t x : s) {
      if (all.count(x)) return true;
    }
  }
  return false;
}

at::Tensor random_view(std::mt19937& rng, const at::Tensor& buf) {
  const int dims = std::uniform_int_distribution<int>(1, 4)(rng);
  std::vector<int64_t> sizes, strides;
  int64_t span = 0;
  for (int d = 0; d < dims; ++d) {
    sizes.push_back(std::uniform_int_distribution<int64_t>(0, 4)(rng));
    strides.push_back(std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 8, 12, 16}[rng() % 10]);
    span += std::max<int64_t>(sizes.back() - 1, 0) * strides.back();
  }
  const int64_t room = buf.numel() - span - 1;
  const int64_t offset = room > 0 ? std::uniform_int_distribution<int64_t>(0, std::min<int64_t>(room, 24))(rng) : 0;
  return buf.as_strided(sizes, strides, offset);
}

TEST(MemoryOverlap, SelfOverlapIsExact) {
  std::mt19937 rng(7);
  const at::Tensor buf = at::zeros({256});
  for (int i = 0; i < 4000; ++i) {
    const at::Tensor t = random_view(rng, buf);
    const Overlap o = rotary::detail::self_overlap(t);
    ASSERT_NE(o, Overlap::Unknown) << t.sizes() << t.strides();
    EXPECT_EQ(o == Overlap::Yes, brute_self(t)) << t.sizes() << t.strides();
  }
}

TEST(MemoryOverlap, MutualOverlapIsExactAcrossDtypes) {
  std::mt19937 rng(11);
  const at::Tensor buf = at::zeros({256}, at::kDouble);
  const at::Tensor as_float = buf.view(at::kFloat);  // the same bytes, half-width elements
  for (int i = 0; i < 4000; ++i) {
    const at::Tensor a = random_view(rng, buf);
    const at::Tensor b = random_view(rng, i % 2 ? as_float : buf);
    const Overlap o = rotary::detail::mutual_overlap(a, b);
    ASSERT_NE(o, Overlap::Unknown);
    EXPECT_EQ(o == Overlap::Yes, brute_mutual(a, b)) << a.sizes() << a.strides() << a.storage_offset() << " vs "
                                                      << b.sizes() << b.strides() << b.storage_offset();
  }
}

TEST(MemoryOverlap, PackedQkvSlicesAreDisjointAndCheap) {
  const at::Tensor qkv = at::empty({2, 64, 32 + 2 * 8, 128});  // [B, S, Hq + 2 Hkv, D]
  const auto q = qkv.narrow(2, 0, 32).transpose(1, 2), k = qkv.narrow(2, 32, 8).transpose(1, 2);
  EXPECT_EQ(rotary::detail::mutual_overlap(q, k), Overlap::No);
  EXPECT_EQ(rotary::detail::mutual_overlap(q, qkv.narrow(2, 31, 8).transpose(1, 2)), Overlap::Yes);
  EXPECT_EQ(rotary::detail::self_overlap(q), Overlap::No);
  EXPECT_EQ(rotary::detail::self_overlap(qkv.as_strided({2, 64, 4}, {0, 4, 1})), Overlap::Yes);
}

}  // namespace
