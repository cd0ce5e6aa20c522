// The fibers that run an emulated CUDA block (fiber_block.h): a barrier
// orders every thread's writes before every thread's reads, a warp's
// barrier its lanes', and threads that diverge at a barrier abort the run
// instead of hanging it.
#ifdef ROTARY_EMULATION

#include "fiber_block.h"

#include <gtest/gtest.h>

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
