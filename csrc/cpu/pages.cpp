// The OS side of fresh output pages (Linux; elsewhere the answers are "not
// mapped" and "cannot", which only costs speed).
#include "pages.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace rotary {
namespace cpu {
namespace pages {

// Whether the pages of [p, p + bytes) are mapped already, from a sample of
// 8 pages. A page that is not faults in on its first write, and the OS zeroes
// it through the cache: a streaming store must then first write those zeros
// back, doubling the write traffic (out of place, in a process with glibc's
// defaults, that made the call 1.5-2x a clone). glibc hands blocks over its
// mmap threshold (32 MiB at most) to the program unmapped, so large outputs
// are fresh on every call; reused heap blocks are mapped.
bool mapped(const void* p, int64_t bytes) {
#if defined(__linux__)
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(p);
  for (int i = 0; i < 8; ++i) {
    const uintptr_t at = (begin + static_cast<uintptr_t>(bytes - 1) * i / 7) & ~(page - 1);
    unsigned char resident = 0;
    if (mincore(reinterpret_cast<void*>(at), page, &resident) != 0 || !(resident & 1)) return false;
  }
  return true;
#else
  return false;  // unknown: plain stores are never worse than a copy
#endif
}

// Maps the pages of [p, p + bytes) for writing, one madvise per call instead
// of one page fault per 4 KiB page on the first store (the trap, not the
// zeroing, is most of a fault's cost). False where the kernel cannot.
bool populate_for_write(void* p, int64_t bytes) {
#if defined(__linux__)
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  const auto end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes) + page - 1) & ~(page - 1);
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0;
#else
  return false;
#endif
}

// Asks for transparent huge pages over the 2 MiB-aligned interior of a fresh
// output: one fault per 2 MiB instead of 512 (populating 64 MiB took 17-21
// ms in 4 KiB pages, 10-11 ms in huge pages). Every byte of it is written,
// so nothing is bloated; a kernel without THP ignores the advice.
void advise_huge(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const auto end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

namespace {

// cpu0's cache of `level` from sysfs (0: the highest), in bytes; 0 where
// sysfs does not say. Sizes read "32768K".
int64_t sysfs_cache_bytes(long want) {
#if defined(__linux__)
  int64_t best_level = 0, best_bytes = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    FILE* level_file = std::fopen((dir + "level").c_str(), "r");
    if (level_file == nullptr) break;
    long level = 0;
    const bool has_level = std::fscanf(level_file, "%ld", &level) == 1;
    std::fclose(level_file);
    FILE* size_file = std::fopen((dir + "size").c_str(), "r");
    if (size_file == nullptr) continue;
    long long size = 0;
    char unit = 0;
    const int got = std::fscanf(size_file, "%lld%c", &size, &unit);
    std::fclose(size_file);
    if (!has_level || got < 1 || size <= 0 || level < best_level || (want != 0 && level != want)) continue;
    const int64_t scale = unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : unit == 'G' ? int64_t{1} << 30 : 1;
    best_level = level;
    best_bytes = size * scale;
  }
  return best_bytes;
#else
  (void)want;
  return 0;
#endif
}

}  // namespace

// sysfs first: it describes the slice a core shares (32 MiB on a Zen 5 VM
// whose socket has 384, all of which `sysconf` reports).
int64_t shared_cache_bytes() {
  if (const int64_t bytes = sysfs_cache_bytes(0)) return bytes;
#if defined(__linux__) && defined(_SC_LEVEL3_CACHE_SIZE)
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (llc > 0) return llc;
#endif
  return 0;
}

int64_t l2_cache_bytes() {
  if (const int64_t bytes = sysfs_cache_bytes(2)) return bytes;
#if defined(__linux__) && defined(_SC_LEVEL2_CACHE_SIZE)
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (l2 > 0) return l2;
#endif
  return 0;
}

bool intel_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned int max_leaf = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &max_leaf, &ebx, &ecx, &edx) == 0) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return std::strcmp(vendor, "GenuineIntel") == 0;
#else
  return false;
#endif
}

}  // namespace pages
}  // namespace cpu
}  // namespace rotary
