// The CUDA RoPE launches' switches (params/launch_shape.cpp): L2 prefetch
// and the fused KV-cache launch's copy blocks. No headers, so the
// framework-free launch and rotary._C both include it.
#pragma once

namespace rotary {
namespace kernel {

// Whether a grid-stride RoPE launch prefetches each thread's next row into
// L2 (on unless switched off), and the switch, which returns the previous
// setting (rotary._C._cuda_set_l2_prefetch: benchmarks compare both).
bool l2_prefetch();
bool set_l2_prefetch(bool on);

// Whether a fused KV-cache launch whose rows fit in one wave adds copy
// blocks (use_copy_blocks; on unless switched off), and its switch
// (rotary._C._cuda_set_copy_blocks), which returns the previous setting.
bool copy_blocks();
bool set_copy_blocks(bool on);

}  // namespace kernel
}  // namespace rotary
