// The CPU builds of the kernels (each kernel/*.cpp is compiled once per
// build, into namespace rotary::cpu::<build>), listed once: the kernel
// headers declare every build from this list and the drivers pick one with
// ROTARY_CPU_DISPATCH. The x86 builds exist where CMake compiled them.
#pragma once

// X(namespace, Capability enumerator, extra...) for every build compiled in.
#if defined(ROTARY_CPU_AVX2)
#define ROTARY_CPU_IF_AVX2(X, ...) X(AVX2, kAvx2, __VA_ARGS__)
#else
#define ROTARY_CPU_IF_AVX2(X, ...)
#endif
#if defined(ROTARY_CPU_AVX512)
#define ROTARY_CPU_IF_AVX512(X, ...) X(AVX512, kAvx512, __VA_ARGS__)
#else
#define ROTARY_CPU_IF_AVX512(X, ...)
#endif
#if defined(ROTARY_CPU_AVX512_BF16)
#define ROTARY_CPU_IF_AVX512_BF16(X, ...) X(AVX512_BF16, kAvx512Bf16, __VA_ARGS__)
#else
#define ROTARY_CPU_IF_AVX512_BF16(X, ...)
#endif
#define ROTARY_CPU_BUILDS(X, ...)                                                            \
  X(DEFAULT, kDefault, __VA_ARGS__)                                                          \
  ROTARY_CPU_IF_AVX2(X, __VA_ARGS__) ROTARY_CPU_IF_AVX512(X, __VA_ARGS__)                    \
  ROTARY_CPU_IF_AVX512_BF16(X, __VA_ARGS__)

// The one switch over the builds: returns `call`, an expression that names
// the build's namespace as isa::, evaluated in the build for `cap`. A
// capability this library was not built with runs DEFAULT (the callers cap
// cap at capability_from_aten(), so this is never a silent downgrade).
#define ROTARY_CPU_DISPATCH_CASE(NS, ENUM, ...)    \
  case ::rotary::cpu::Capability::ENUM: {         \
    namespace isa = ::rotary::cpu::NS;            \
    return __VA_ARGS__;                           \
  }
#define ROTARY_CPU_DISPATCH(cap, ...)                         \
  switch (cap) {                                              \
    ROTARY_CPU_BUILDS(ROTARY_CPU_DISPATCH_CASE, __VA_ARGS__)  \
    default: {                                                \
      namespace isa = ::rotary::cpu::DEFAULT;                 \
      return __VA_ARGS__;                                     \
    }                                                         \
  }
