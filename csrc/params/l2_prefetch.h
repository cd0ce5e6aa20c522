// The CUDA RoPE launches' L2 prefetch switch (params/launch_shape.cpp): no
// headers, so the framework-free launch and rotary._C both include it.
#pragma once

namespace rotary {
namespace kernel {

// Whether a grid-stride RoPE launch prefetches each thread's next row into
// L2 (on unless switched off), and the switch, which returns the previous
// setting (rotary._C._cuda_set_l2_prefetch: benchmarks compare both).
bool l2_prefetch();
bool set_l2_prefetch(bool on);

}  // namespace kernel
}  // namespace rotary
