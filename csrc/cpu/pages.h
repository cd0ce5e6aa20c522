// Page state of a CPU output: whether its pages are mapped, and mapping
// them ahead of the first store (rope_cpu.cpp decides when); and the caches
// that set the streaming line and the software prefetch.
#pragma once

#include <cstdint>

namespace rotary {
namespace cpu {
namespace pages {

// Whether the pages of [p, p + bytes) are mapped, from a sample of 8 pages.
bool mapped(const void* p, int64_t bytes);
// Maps [p, p + bytes) for writing in one call; false where the OS cannot.
bool populate_for_write(void* p, int64_t bytes);
// Asks for transparent huge pages over the 2 MiB-aligned interior.
void advise_huge(void* p, int64_t bytes);
// Bytes of the highest-level cache that cpu0 shares with its neighbours; 0
// where the OS does not say.
int64_t shared_cache_bytes();
// Bytes of cpu0's level-2 cache (its own); 0 where the OS does not say.
int64_t l2_cache_bytes();
// Whether the CPU is Intel's (cpuid's vendor): its server L3 is one mesh
// across the socket, further from a core than a Zen slice.
bool intel_cpu();

}  // namespace pages
}  // namespace cpu
}  // namespace rotary
