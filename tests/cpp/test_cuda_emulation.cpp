// Host emulation of the CUDA kernel: runs rope_thread, the exact per-thread
// body of the GPU kernel, over its whole grid on the CPU and compares with the
// float64 reference. Checks the CUDA indexing, vector path and fallbacks in CI,
// where there is no GPU.
#ifdef ROTARY_EMULATION

#include "helpers.h"
#include "reference.h"
#include "rope_emulation.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace rotary_emulation;

struct EmulationCase {
  at::ScalarType dtype;
  int64_t head_dim;
  int64_t hq, hk;
  int64_t seq;
  int64_t start_pos;
  bool interleaved;
  Layout layout;
  int positions_rank;  // -1: none; 0, 1, 2
  bool inverse;
  int64_t rotary_dim = 0;  // 0: head_dim
  bool in_place = false;
};

using Opt = std::optional<at::Tensor>;

// Reference with partial rotary: dims past rotary_dim are copied.
at::Tensor reference_partial(
    const at::Tensor& x, int64_t rotary_dim, int64_t start, bool interleaved, const Opt& positions, bool inverse) {
  const auto rotated = rotary_test::ref_rope(x.narrow(3, 0, rotary_dim), start, interleaved, positions, inverse);
  return at::cat({rotated, x.narrow(3, rotary_dim, x.size(3) - rotary_dim).to(at::kDouble).cpu()}, 3);
}

std::string describe(const EmulationCase& c) {
  return std::string(c10::toString(c.dtype)) + " D=" + std::to_string(c.head_dim) + " Hq=" +
      std::to_string(c.hq) + " Hk=" + std::to_string(c.hk) + " S=" + std::to_string(c.seq) + " start=" +
      std::to_string(c.start_pos) + (c.interleaved ? " interleaved " : " half ") + layout_name(c.layout) +
      " positions_rank=" + std::to_string(c.positions_rank) + (c.inverse ? " inverse" : "") + " rotary_dim=" +
      std::to_string(c.rotary_dim) + (c.in_place ? " in place" : "");
}

// Runs one case through the emulated grid (vector path when allowed, and the
// strided path always) and checks every output element against the reference.
void run_case(const EmulationCase& c) {
  SCOPED_TRACE(describe(c));
  const int64_t B = 2;
  const int64_t table_len = c.start_pos + c.seq + 8;
  const uint64_t seed = static_cast<uint64_t>(at::randint(1, int64_t{1} << 40, {1}, at::kLong).item<int64_t>());
  at::manual_seed(seed);
  auto [q, k] = make_qk(c.layout, B, c.hq, c.hk, c.seq, c.head_dim, c.dtype);
  const auto q_before = q.clone();
  const auto k_before = k.clone();

  std::optional<at::Tensor> positions;
  if (c.positions_rank == 0) positions = at::tensor(int64_t{3});
  if (c.positions_rank == 1) positions = at::randint(0, 8, {B}, at::kLong);
  if (c.positions_rank == 2) positions = at::randint(0, c.start_pos + c.seq, {B, c.seq}, at::kLong);

  const int64_t rotary_dim = c.rotary_dim ? c.rotary_dim : c.head_dim;
  const auto freqs = reference_table(table_len, rotary_dim);
  const auto expected_q = reference_partial(q, rotary_dim, c.start_pos, c.interleaved, positions, c.inverse);
  const auto expected_k = reference_partial(k, rotary_dim, c.start_pos, c.interleaved, positions, c.inverse);
  const Opt none;
  const auto P = rotary_test::op_positions(c.start_pos, positions);
  const rotary::detail::RopeArgs args{P.start_pos, c.interleaved, P.offsets, P.position_ids, c.inverse, none, none,
                                      "BHSD"};

  // Every variant of the launch: vector and strided path, 32- and 64-bit
  // index math, a grid with one block per row block and one of two blocks
  // (every block wraps around the grid-stride loop).
  for (bool try_vector : {true, false}) {
    for (bool index64 : {false, true}) {
      for (int64_t max_blocks : {int64_t{1} << 40, int64_t{2}}) {
        // In place, each pass rotates a fresh copy of the inputs in the same layout.
        at::Tensor q_run = q, k_run = k;
        if (c.in_place) {
          at::manual_seed(seed);
          std::tie(q_run, k_run) = make_qk(c.layout, B, c.hq, c.hk, c.seq, c.head_dim, c.dtype);
        }
        auto prepared = rotary::detail::prepare_rope("emulate", q_run, &k_run, freqs, args, c.in_place);
        if (!c.in_place) {
          prepared.out_q.fill_(std::numeric_limits<double>::quiet_NaN());
          prepared.out_k.fill_(std::numeric_limits<double>::quiet_NaN());
        }
        const auto& p = prepared.params;
        const bool can_vector = vectorizable(c.dtype, p);
        if (c.layout == Layout::kMisaligned || c.layout == Layout::kStridedLastDim) {
          EXPECT_FALSE(can_vector) << "vector path must fall back";
        }
        if ((c.layout == Layout::kContiguous || c.layout == Layout::kTransposed) && c.head_dim % 32 == 0 &&
            rotary_dim % 32 == 0) {
          EXPECT_TRUE(can_vector) << "aligned input should take the vector path";
        }
        Variant v;
        v.vectorized = try_vector && can_vector;
        v.index64 = index64;
        v.max_blocks = max_blocks;
        emulate_dtype(c.dtype, p, v);
        SCOPED_TRACE(std::string(v.vectorized ? "vector path" : "strided path") +
                     (index64 ? ", int64 index" : ", int32 index") + ", max_blocks " + std::to_string(max_blocks));
        const double tol = tolerance(c.dtype);
        EXPECT_TRUE(at::allclose(prepared.out_q.to(at::kDouble), expected_q, tol, tol));
        EXPECT_TRUE(at::allclose(prepared.out_k.to(at::kDouble), expected_k, tol, tol));
        EXPECT_FALSE(prepared.out_q.isnan().any().item<bool>()) << "unwritten q element";
        EXPECT_FALSE(prepared.out_k.isnan().any().item<bool>()) << "unwritten k element";
      }
    }
  }
  EXPECT_TRUE(at::equal(q, q_before));
  EXPECT_TRUE(at::equal(k, k_before));
}

TEST(CudaEmulation, HeadDimsDtypesPairings) {
  at::manual_seed(11);
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (int64_t d : {64, 80, 128, 256}) {
      for (bool interleaved : {true, false}) {
        run_case({dtype, d, 3, 1, 5, 0, interleaved, Layout::kContiguous, -1, false});
      }
    }
  }
}

TEST(CudaEmulation, LayoutsFallBackWithoutCopies) {
  at::manual_seed(12);
  for (auto layout : {Layout::kTransposed, Layout::kPackedQkv, Layout::kMisaligned, Layout::kStridedLastDim}) {
    for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble}) {
      for (bool interleaved : {true, false}) {
        run_case({dtype, 64, 4, 2, 3, 2, interleaved, layout, -1, false});
      }
    }
  }
}

TEST(CudaEmulation, HeadCountsDecodeAndStartPos) {
  at::manual_seed(13);
  for (auto [hq, hk] : {std::pair<int64_t, int64_t>{1, 1}, {5, 5}, {7, 1}, {8, 3}}) {
    for (int64_t seq : {1, 6}) {
      for (int64_t start : {0, 37}) {
        run_case({at::kBFloat16, 128, hq, hk, seq, start, hq % 2 == 1, Layout::kContiguous, -1, false});
      }
    }
  }
}

TEST(CudaEmulation, PositionsAndInverse) {
  at::manual_seed(14);
  for (int rank : {0, 1, 2}) {
    for (bool inverse : {false, true}) {
      for (auto dtype : {at::kFloat, at::kBFloat16}) {
        run_case({dtype, 80, 3, 2, 4, 5, rank != 1, Layout::kContiguous, rank, inverse});
      }
    }
  }
}

TEST(CudaEmulation, PositionOutsideTableYieldsNanWithoutReading) {
  at::manual_seed(15);
  auto q = at::randn({1, 2, 3, 8});
  auto k = at::randn({1, 1, 3, 8});
  auto freqs = at::randn({4, 4}, at::kComplexFloat);
  Opt positions = at::tensor({int64_t{0}, int64_t{1}, int64_t{2}}).view({1, 3});
  const Opt none;
  const rotary::detail::RopeArgs args{0, true, none, positions, false, none, none, "BHSD"};
  auto prepared = rotary::detail::prepare_rope("emulate", q, &k, freqs, args, false);
  // Device-side positions are not checked on the host; emulate one that is
  // past the end (and one negative) the way the GPU would see it.
  std::vector<int64_t> bad = {1, 1000000, -5};
  auto p = prepared.params;
  p.positions = bad.data();
  emulate<float>(p, false);
  auto out = prepared.out_q;
  EXPECT_FALSE(out.select(2, 0).isnan().any().item<bool>());
  EXPECT_TRUE(out.select(2, 1).isnan().all().item<bool>());
  EXPECT_TRUE(out.select(2, 2).isnan().all().item<bool>());
}

TEST(CudaEmulation, PartialRotaryAndInPlace) {
  at::manual_seed(16);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (bool interleaved : {true, false}) {
      for (bool in_place : {false, true}) {
        for (auto layout : {Layout::kContiguous, Layout::kPackedQkv, Layout::kStridedLastDim}) {
          // 64 of 128 dims rotated (vector path with a copied tail), and 32 of 80.
          run_case({dtype, 128, 4, 2, 3, 7, interleaved, layout, -1, false, 64, in_place});
          run_case({dtype, 80, 3, 1, 2, 0, interleaved, layout, 1, true, 32, in_place});
        }
      }
    }
  }
}

TEST(CudaEmulation, PositionsPastTableUseInvFreq) {
  at::manual_seed(17);
  const int64_t D = 64;
  auto q = at::randn({2, 3, 4, D});
  auto k = at::randn({2, 1, 4, D});
  auto inv_freq = at::empty({D / 2}, at::kDouble);
  for (int64_t j = 0; j < D / 2; ++j) inv_freq[j] = rotary_test::ref_inv_freq(j, D);
  const auto freqs = reference_table(8, D);  // far shorter than the positions used
  const Opt positions = at::tensor({int64_t{5}, int64_t{100000}});
  const Opt none;
  const rotary::detail::RopeArgs args{3, true, positions, none, false, none, Opt(inv_freq), "BHSD"};
  auto prepared = rotary::detail::prepare_rope("emulate", q, &k, freqs, args, false);
  for (bool vectorized : {true, false}) {
    for (const Variant& v : variants(vectorized)) {
      poison(prepared);
      emulate_dtype(at::kFloat, prepared.params, v);
      EXPECT_TRUE(
          at::allclose(prepared.out_q.to(at::kDouble), rotary_test::ref_rope(q, 3, true, positions), 2e-5, 2e-5));
      EXPECT_TRUE(
          at::allclose(prepared.out_k.to(at::kDouble), rotary_test::ref_rope(k, 3, true, positions), 2e-5, 2e-5));
    }
  }
}

// Packed sequences, with empty ones and, in the second batch, more
// sequences than rows a grid step covers: a thread's search from its last
// row's sequence then gallops over several of them.
TEST(CudaEmulation, PackedVarlen) {
  at::manual_seed(18);
  const int64_t D = 256;  // 32 lanes a row: 8 rows a block
  const std::vector<std::vector<int64_t>> batches = {
      {0, 3, 3, 10, 11}, {0, 0, 1, 1, 1, 4, 5, 5, 9, 10, 12, 12, 13, 14, 20, 21, 22, 23, 23, 30}};
  for (const auto& ends : batches) {
    const int64_t T = ends.back();
    for (auto cu_dtype : {at::kInt, at::kLong}) {
      for (bool interleaved : {true, false}) {
        auto q = at::randn({T, 4, D}, at::kBFloat16);
        auto k = at::randn({T, 2, D}, at::kBFloat16);
        const auto cu = at::tensor(ends).to(cu_dtype);
        const auto freqs = reference_table(32, D);
        const Opt none;
        const Opt cu_opt(cu);
        const rotary::detail::RopeArgs args{2, interleaved, none, none, false, cu_opt, none, "THD"};
        auto prepared = rotary::detail::prepare_rope("emulate", q, &k, freqs, args, false);
        if (T > 11) EXPECT_GT(grid_for(at::kBFloat16, prepared.params, true).row_blocks, 2) << "two blocks walk";
        for (bool vectorized : {true, false}) {
          for (const Variant& v : variants(vectorized)) {
            poison(prepared);
            emulate_dtype(at::kBFloat16, prepared.params, v);
            // Reference: each sequence on its own, starting at start_pos.
            for (size_t n = 0; n + 1 < ends.size(); ++n) {
              const int64_t begin = ends[n], len = ends[n + 1] - ends[n];
              if (len == 0) continue;
              for (const auto& [in, out] : {std::pair{q, prepared.out_q}, std::pair{k, prepared.out_k}}) {
                const auto seq_in = in.narrow(0, begin, len).transpose(0, 1).unsqueeze(0);
                const auto expected = rotary_test::ref_rope(seq_in, 2, interleaved)[0].transpose(0, 1);
                EXPECT_TRUE(at::allclose(out.narrow(0, begin, len).to(at::kDouble), expected, 3e-2, 3e-2))
                    << "sequence " << n << ", max_blocks " << v.max_blocks;
              }
            }
          }
        }
      }
    }
  }
}

// The forward search a kernel's row walk uses equals the binary search from
// every earlier sequence, empty sequences included.
TEST(CudaEmulation, VarlenSearchFromAnEarlierSequence) {
  const std::vector<int64_t> ends = {0, 0, 1, 1, 1, 4, 5, 5, 9, 10, 12, 12, 13, 14, 20, 21, 22, 23, 23, 30};
  for (auto cu_dtype : {at::kInt, at::kLong}) {
    const auto cu = at::tensor(ends).to(cu_dtype);
    RopeParams p;
    p.cu_seqlens = cu.data_ptr();
    p.cu_seqlens_int32 = cu_dtype == at::kInt;
    p.num_seqs = static_cast<int64_t>(ends.size()) - 1;
    for (int64_t s = 0; s < ends.back(); ++s) {
      int64_t want = 0;  // the last sequence starting at or before s
      for (int64_t n = 0; n < p.num_seqs; ++n) want = ends[n] <= s ? n : want;
      EXPECT_EQ(rotary::kernel::sequence_of(p, s), want) << "token " << s;
      for (int64_t from = 0; from <= want; ++from) {
        EXPECT_EQ(rotary::kernel::sequence_of(p, s, from), want) << "token " << s << " from " << from;
      }
    }
  }
}

// Rows of many heads: a block holds rows_per_block rows that do not divide
// the row count (a partial last row block), and two blocks wrap around it.
TEST(CudaEmulation, PartialRowBlocksAndGridStride) {
  at::manual_seed(19);
  for (bool interleaved : {true, false}) {
    for (auto layout : {Layout::kContiguous, Layout::kTransposed}) {
      // 27 + 3 heads: not a multiple of the 4 or 8 heads a thread holds.
      const EmulationCase c{at::kBFloat16, 128, 27, 3, 5, 9, interleaved, layout, -1, false};
      auto q = at::randn({2, 27, 5, 128}, at::kBFloat16);
      auto k = at::randn({2, 3, 5, 128}, at::kBFloat16);
      const Opt none;
      const rotary::detail::RopeArgs args{0, interleaved, none, none, false, none, none, "BHSD"};
      const at::Tensor table = reference_table(16, 128);  // params point into it
      const auto prepared = rotary::detail::prepare_rope("emulate", q, &k, table, args, false);
      const Grid g = grid_for(at::kBFloat16, prepared.params, true);
      EXPECT_GT(g.rows_per_block, 1);
      EXPECT_NE(g.rows % g.rows_per_block, 0) << "rows " << g.rows << " per block " << g.rows_per_block;
      EXPECT_GT(g.row_blocks, 2);
      EXPECT_EQ(g.block_threads % 32, 0) << "every warp full";
      run_case(c);
    }
  }
}

// A row wider than a block: more pair groups than threads (each thread loops
// over groups) and several head batches per thread.
TEST(CudaEmulation, WideRowsLoopOverGroupsAndHeads) {
  at::manual_seed(20);
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (bool interleaved : {true, false}) {
      for (auto layout : {Layout::kContiguous, Layout::kStridedLastDim}) {
        auto [q, k] = make_qk(layout, 1, 37, 5, 2, 640, dtype);
        const Opt none;
        const rotary::detail::RopeArgs args{0, interleaved, none, none, false, none, none, "BHSD"};
        const at::Tensor table = reference_table(8, 640);  // params point into it
        const auto prepared = rotary::detail::prepare_rope("emulate", q, &k, table, args, false);
        const bool vectorized = vectorizable(dtype, prepared.params);
        const Grid g = grid_for(dtype, prepared.params, vectorized);
        if (!vectorized || (dtype == at::kDouble && interleaved)) {  // one pair per group: 320 groups
          EXPECT_LT(g.group_threads, g.groups);
        }
        EXPECT_LT(g.chunks * 8, g.heads) << "several head batches per thread";
        run_case({dtype, 640, 37, 5, 2, 3, interleaved, layout, -1, false});
      }
    }
  }
}

}  // namespace

#endif  // ROTARY_EMULATION
