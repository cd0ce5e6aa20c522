// The fibers that run an emulated CUDA block (fiber_block.h): a barrier
// orders every thread's writes before every thread's reads, a warp's
// barrier its lanes', the two schedules order warps differently, and
// threads that diverge at a barrier abort the run instead of hanging it.
#ifdef ROTARY_EMULATION

#include "fiber_block.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace {

TEST(FiberBlock, BarriersOrderWritesBeforeReads) {
  constexpr int kThreads = 80;  // two whole warps and a partial one
  rotary_test::FiberBlock block(kThreads);
  std::vector<int> a(kThreads, -1), seen_block(kThreads, -1), seen_warp(kThreads, -1);
  for (int round = 0; round < 2; ++round) {  // the block runs again from the start
    block.run([&](int tid) {
      a[tid] = 1000 * round + tid;
      block.sync_block(tid);
      seen_block[tid] = a[(tid + 37) % kThreads];  // another warp's thread
      block.sync_block(tid);
      a[tid] = -tid;
      block.sync_warp(tid);
      const int lanes = tid < 64 ? 32 : kThreads - 64;
      seen_warp[tid] = a[tid / 32 * 32 + (tid % 32 + 1) % lanes];
    });
    for (int t = 0; t < kThreads; ++t) {
      EXPECT_EQ(seen_block[t], 1000 * round + (t + 37) % kThreads) << "thread " << t;
      const int lanes = t < 64 ? 32 : kThreads - 64;
      EXPECT_EQ(seen_warp[t], -(t / 32 * 32 + (t % 32 + 1) % lanes)) << "thread " << t;
    }
  }
}

// Round robin takes every thread to its barrier before any passes it; the
// lowest-first schedule runs warp 0 to its end before warp 1 starts (only
// warp barriers here), as a GPU may.
TEST(FiberBlock, TheSchedulesInterleaveWarpsDifferently) {
  for (const auto schedule : {rotary_test::Schedule::kRoundRobin, rotary_test::Schedule::kLowestFirst}) {
    rotary_test::FiberBlock block(64);
    std::vector<int> order;
    block.run(
        [&](int tid) {
          order.push_back(tid);
          block.sync_warp(tid);
          block.sync_warp(tid);
          order.push_back(tid);
        },
        schedule);
    ASSERT_EQ(order.size(), 128u);
    const auto first_of_warp1 = std::find_if(order.begin(), order.end(), [](int t) { return t >= 32; });
    const auto last_of_warp0 = std::find_if(order.rbegin(), order.rend(), [](int t) { return t < 32; });
    const bool warp0_first = first_of_warp1 - order.begin() > order.rend() - last_of_warp0 - 1;
    EXPECT_EQ(warp0_first, schedule == rotary_test::Schedule::kLowestFirst);
  }
}

TEST(FiberBlockDeathTest, ADivergedBarrierAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the process has torch's threads: re-run, not fork
  EXPECT_DEATH(
      {
        rotary_test::FiberBlock block(64);
        block.run([&](int tid) {
          if (tid != 3) block.sync_block(tid);  // thread 3 never arrives
        });
      },
      "diverged at a barrier");
}

}  // namespace

#endif  // ROTARY_EMULATION
