// The threads of one CUDA block run on the calling host thread as fibers,
// for a host emulation that runs a kernel's own body with its barriers. A
// fiber runs until it waits at a barrier (its block's, or its warp's), then
// another one runs; a barrier opens once every thread of its group has
// arrived. Which one runs next is the schedule's: every thread in turn, or
// the lowest one that can, so that a warp runs ahead of the later warps as
// far as its own barriers let it (a missing block barrier shows under one
// or the other). A scan in which no fiber can run while some have not
// finished means the threads diverged at a barrier (a kernel bug that hangs
// a GPU): it aborts.
// Under AddressSanitizer every switch is announced to it
// (__sanitizer_start/finish_switch_fiber), so that it follows the stacks.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>

namespace rotary_test {

enum class Schedule { kRoundRobin, kLowestFirst };

class FiberBlock {
 public:
  explicit FiberBlock(int threads) : fibers_(threads), block_{threads}, warps_((threads + 31) / 32) {
    for (Fiber& f : fibers_) f.stack = make_stack();
    for (size_t w = 0; w < warps_.size(); ++w) {
      warps_[w].size = static_cast<int>(w + 1 < warps_.size() ? 32 : threads - 32 * w);
    }
  }
  FiberBlock(const FiberBlock&) = delete;
  FiberBlock& operator=(const FiberBlock&) = delete;

  // Runs body(tid) for every thread tid of the block, to the end.
  void run(const std::function<void(int)>& body, Schedule schedule = Schedule::kRoundRobin) {
    body_ = &body;
    schedule_ = schedule;
    for (size_t t = 0; t < fibers_.size(); ++t) {
      Fiber& f = fibers_[t];
      f = Fiber{std::move(f.stack)};
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack.get();
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_link = &scheduler_;
      makecontext(&f.context, reinterpret_cast<void (*)()>(&FiberBlock::entry), 2, this_high(), this_low());
      f.tid = static_cast<int>(t);
    }
    for (;;) {
      bool ran = false, left = false;
      for (Fiber& f : fibers_) {
        if (f.done) continue;
        left = true;
        if (f.waiting != nullptr && f.waiting->generation == f.generation) continue;
        f.waiting = nullptr;
        running_ = f.tid;
        void* fake = nullptr;
        start_switch(&fake, f.stack.get(), kStackBytes);
        swapcontext(&scheduler_, &f.context);
        finish_switch(fake);
        ran = true;
        if (schedule_ == Schedule::kLowestFirst) break;  // scan again from thread 0
      }
      if (!left) return;
      if (!ran) {
        std::fprintf(stderr, "fiber block: the threads diverged at a barrier\n");
        std::abort();
      }
    }
  }

  // The schedule from the next switch on (a body may change it as it goes).
  void schedule(Schedule s) { schedule_ = s; }

  // __syncthreads() and __syncwarp() of thread tid.
  void sync_block(int tid) { wait(tid, block_); }
  void sync_warp(int tid) { wait(tid, warps_[tid / 32]); }

 private:
  // 64 KiB a fiber (the emulated bodies use a few; ASan's redzones more),
  // above a page that faults: an overflow crashes instead of writing over
  // the heap.
  static constexpr size_t kStackBytes = size_t{64} << 10;
  static size_t guard_bytes() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
  struct Unmap {
    void operator()(char* stack) const { munmap(stack - guard_bytes(), guard_bytes() + kStackBytes); }
  };
  using Stack = std::unique_ptr<char, Unmap>;
  static Stack make_stack() {
    const size_t guard = guard_bytes();
    void* base = mmap(nullptr, guard + kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED || mprotect(base, guard, PROT_NONE) != 0) {
      std::fprintf(stderr, "fiber block: no memory for a fiber's stack\n");
      std::abort();
    }
    return Stack(static_cast<char*>(base) + guard);
  }
  struct Group {
    int size = 0, arrived = 0;
    uint64_t generation = 0;
  };
  struct Fiber {
    Stack stack;
    ucontext_t context{};
    int tid = 0;
    bool done = false;
    Group* waiting = nullptr;  // the barrier it waits at, in `generation`
    uint64_t generation = 0;
    void* fake = nullptr;  // its fake stack while it is switched out (ASan)
  };

  void wait(int tid, Group& g) {
    if (++g.arrived == g.size) {  // the last to arrive opens it and runs on
      g.arrived = 0;
      ++g.generation;
      return;
    }
    Fiber& f = fibers_[tid];
    f.waiting = &g;
    f.generation = g.generation;
    start_switch(&f.fake, scheduler_bottom_, scheduler_size_);
    swapcontext(&f.context, &scheduler_);
    finish_switch(f.fake);
  }

  // AddressSanitizer's fiber annotations (nothing otherwise): a switch to
  // the stack at [bottom, bottom + size), saving this one's fake stack
  // (null: this stack ends), and its end on the other side, which learns
  // the scheduler's stack from the first switch to a fiber.
  void start_switch(void** fake, const void* bottom, size_t size) {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(fake, bottom, size);
#else
    (void)fake, (void)bottom, (void)size;
#endif
  }
  void finish_switch(void* fake) {
#if defined(__SANITIZE_ADDRESS__)
    const void* bottom = nullptr;
    size_t size = 0;
    __sanitizer_finish_switch_fiber(fake, &bottom, &size);
    if (bottom != nullptr && scheduler_bottom_ == nullptr) {
      scheduler_bottom_ = bottom;
      scheduler_size_ = size;
    }
#else
    (void)fake;
#endif
  }

  // makecontext passes int arguments: the block's address in two halves.
  int this_high() const { return static_cast<int>(reinterpret_cast<uintptr_t>(this) >> 32); }
  int this_low() const { return static_cast<int>(reinterpret_cast<uintptr_t>(this) & 0xffffffffu); }
  static void entry(int high, int low) {
    auto* self = reinterpret_cast<FiberBlock*>((static_cast<uintptr_t>(static_cast<uint32_t>(high)) << 32) |
                                               static_cast<uint32_t>(low));
    const int tid = self->running_;
    self->finish_switch(nullptr);
    (*self->body_)(tid);
    self->fibers_[tid].done = true;
    self->start_switch(nullptr, self->scheduler_bottom_, self->scheduler_size_);  // returns to the scheduler (uc_link)
  }

  std::vector<Fiber> fibers_;
  Group block_;
  std::vector<Group> warps_;
  ucontext_t scheduler_{};
  const void* scheduler_bottom_ = nullptr;  // the scheduler's stack (ASan)
  size_t scheduler_size_ = 0;
  const std::function<void(int)>* body_ = nullptr;
  int running_ = 0;
  Schedule schedule_ = Schedule::kRoundRobin;
};

}  // namespace rotary_test
