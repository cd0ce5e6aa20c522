// Host emulation of the CUDA kernel's memory traffic (rope_emulation.h): the
// bytes every store writes, the lines every prefetch asks for, and the index
// width a launch's extent allows.
#ifdef ROTARY_EMULATION

#include "rope_emulation.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using namespace rotary_emulation;
using Opt = std::optional<at::Tensor>;

// Every byte of every output element is stored exactly once, and nothing
// else is: the pass-through dims out of place, only the rotated dims in place.
TEST(CudaEmulation, WritesEachOutputElementOnce) {
  at::manual_seed(21);
  const int64_t D = 128, R = 64;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (bool interleaved : {true, false}) {
      for (bool in_place : {false, true}) {
        for (auto layout : {Layout::kPackedQkv, Layout::kStridedLastDim}) {
          auto [q, k] = make_qk(layout, 2, 5, 3, 7, D, dtype);
          const Opt none;
          const rotary::detail::RopeArgs args{1, interleaved, none, none, false, none, none, "BHSD"};
          // params point into the table: it must outlive the emulation (a
          // temporary here once had it read freed memory, which ASan found).
          const at::Tensor table = reference_table(16, R);
          const auto prepared = rotary::detail::prepare_rope("emulate", q, &k, table, args, in_place);
          const bool can_vector = vectorizable(dtype, prepared.params);
          for (bool vectorized : {true, false}) {
            if (vectorized && !can_vector) continue;
            for (const Variant& v : variants(vectorized)) {
              SCOPED_TRACE(std::string(c10::toString(dtype)) + (interleaved ? " interleaved " : " half ") +
                           layout_name(layout) + (in_place ? " in place" : "") +
                           (vectorized ? " vector" : " strided") + (v.index64 ? " int64" : " int32") +
                           " max_blocks " + std::to_string(v.max_blocks));
              CountingStore::counts().clear();
              emulate_dtype<CountingStore>(dtype, prepared.params, v);
              const int64_t elem = prepared.out_q.element_size();
              int64_t expected_bytes = 0, wrong = 0;
              for (const auto& out : {prepared.out_q, prepared.out_k}) {
                auto* base = static_cast<const char*>(out.data_ptr());
                for (int64_t b = 0; b < out.size(0); ++b)
                  for (int64_t h = 0; h < out.size(1); ++h)
                    for (int64_t s = 0; s < out.size(2); ++s)
                      for (int64_t d = 0; d < D; ++d) {
                        const int want = (d < R || !in_place) ? 1 : 0;
                        const auto at = reinterpret_cast<uintptr_t>(base) +
                            elem * (b * out.stride(0) + h * out.stride(1) + s * out.stride(2) + d * out.stride(3));
                        for (int64_t i = 0; i < elem; ++i) {
                          const auto it = CountingStore::counts().find(at + i);
                          wrong += (it == CountingStore::counts().end() ? 0 : it->second) != want;
                        }
                        expected_bytes += want * elem;
                      }
              }
              int64_t written = 0;
              for (const auto& [addr, n] : CountingStore::counts()) written += n;
              EXPECT_EQ(wrong, 0) << "bytes written other than once";
              EXPECT_EQ(written, expected_bytes) << "bytes written outside the outputs";
            }
          }
        }
      }
    }
  }
}

// A thread of a grid-stride launch asks L2 for its next row while it loads
// this one: one prefetch per 128-byte line that a vector of that row opens,
// for exactly the rows some thread reaches after its first (the q/k bytes
// the kernel reads: all of a head out of place, the rotated span in place),
// and none when every row has its own block or the setting is off.
TEST(CudaEmulation, PrefetchesEachThreadsNextRow) {
  at::manual_seed(22);
  const int64_t D = 128;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (bool interleaved : {true, false}) {
      for (bool in_place : {false, true}) {
        for (int64_t R : {int64_t{128}, int64_t{64}}) {
          for (auto layout : {Layout::kContiguous, Layout::kTransposed, Layout::kPackedQkv}) {
            auto [q, k] = make_qk(layout, 2, 5, 3, 7, D, dtype);
            const Opt none;
            const rotary::detail::RopeArgs args{1, interleaved, none, none, false, none, none, "BHSD"};
            const at::Tensor table = reference_table(16, R);
            const auto prepared = rotary::detail::prepare_rope("emulate", q, &k, table, args, in_place);
            const RopeParams& p = prepared.params;
            ASSERT_TRUE(vectorizable(dtype, p));
            const Grid g = grid_for(dtype, p, true);
            const int64_t elem = q.element_size();
            const int64_t vector_elems = rotary::kernel::kVectorBytes / elem;
            for (int64_t max_blocks : {int64_t{1} << 40, int64_t{3}, int64_t{1}}) {
              for (bool on : {true, false}) {
                SCOPED_TRACE(std::string(c10::toString(dtype)) + (interleaved ? " interleaved " : " half ") +
                             layout_name(layout) + (in_place ? " in place" : "") + " R=" + std::to_string(R) +
                             " max_blocks " + std::to_string(max_blocks) + (on ? "" : " prefetch off"));
                Variant v;
                v.max_blocks = max_blocks;
                v.prefetch = on;
                CountingStore::prefetches().clear();
                emulate_dtype<CountingStore>(dtype, p, v);
                std::vector<uintptr_t> want;
                const int64_t first_pass = std::min(g.row_blocks, max_blocks) * g.rows_per_block;
                for (const rotary::kernel::HeadTensor* t : {&p.q, &p.k}) {
                  const auto* base = static_cast<const char*>(t->in);
                  for (int64_t b = 0; b < p.batch; ++b)
                    for (int64_t s = 0; s < p.seq; ++s) {
                      if (!on || b * p.seq + s < first_pass) continue;
                      for (int64_t h = 0; h < t->heads; ++h)
                        for (int64_t d = 0; d < (in_place ? R : D); d += vector_elems) {
                          const auto at = reinterpret_cast<uintptr_t>(base) +
                              elem * (b * t->in_stride[0] + h * t->in_stride[1] + s * t->in_stride[2] + d);
                          if (at % 128 < 16) want.push_back(at);
                        }
                    }
                }
                auto got = CountingStore::prefetches();
                std::sort(got.begin(), got.end());
                std::sort(want.begin(), want.end());
                EXPECT_EQ(got, want);
                if (on && max_blocks < g.row_blocks) EXPECT_FALSE(got.empty());
              }
            }
          }
        }
      }
    }
  }
}

// The 32-bit index path is taken only when every offset fits.
TEST(CudaEmulation, IndexWidthFollowsTheExtent) {
  RopeParams p;
  p.batch = 1;
  p.head_dim = 128;
  p.rotary_dim = 128;
  p.q.heads = 32;
  p.k.heads = 8;
  auto contiguous = [&](rotary::kernel::HeadTensor& t) {
    const int64_t st[4] = {t.heads * p.seq * p.head_dim, p.seq * p.head_dim, p.head_dim, 1};
    for (int d = 0; d < 4; ++d) t.in_stride[d] = t.out_stride[d] = st[d];
  };
  p.seq = 4096;  // 2^24 q elements
  contiguous(p.q);
  contiguous(p.k);
  const Grid small = rotary::kernel::make_grid<__nv_bfloat16, true, true>(p);
  EXPECT_TRUE(rotary::kernel::fits_int32(p, small));
  p.seq = int64_t{1} << 20;  // 2^32 q elements: the last offset is past int32
  contiguous(p.q);
  contiguous(p.k);
  EXPECT_FALSE(rotary::kernel::fits_int32(p, rotary::kernel::make_grid<__nv_bfloat16, true, true>(p)));
  // k alone too large (out only), q small.
  p.seq = 4096;
  contiguous(p.q);
  contiguous(p.k);
  p.k.out_stride[0] = int64_t{1} << 31;
  p.batch = 2;
  EXPECT_FALSE(rotary::kernel::fits_int32(p, rotary::kernel::make_grid<__nv_bfloat16, true, true>(p)));
}

}  // namespace

#endif  // ROTARY_EMULATION
