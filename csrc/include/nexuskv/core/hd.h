// NEXUSKV_HD marks the functions of the torch-free core that host and device
// code share (the byte layout, the 16-bit conversions, the attention params):
// __host__ __device__ under nvcc, nothing in a plain C++ build, so that the
// same header is the one definition for the CPU kernels and the CUDA kernels.
#pragma once

#if defined(__CUDACC__)
#define NEXUSKV_HD __host__ __device__
#define NEXUSKV_HD_INLINE __host__ __device__ __forceinline__
#else
#define NEXUSKV_HD
#if defined(__GNUC__) || defined(__clang__)
#define NEXUSKV_HD_INLINE inline __attribute__((always_inline))
#else
#define NEXUSKV_HD_INLINE inline
#endif
#endif

// Every namespace-scope function of the core headers has internal linkage:
// NEXUSKV_HD_STATIC (static inline), or `static NEXUSKV_HD_INLINE` where it
// must be inlined; member functions are NEXUSKV_HD_INLINE (always inlined,
// never emitted out of line).  Why: the CPU kernels include these headers in
// translation units compiled once per instruction set (csrc/core/isa.h, with
// -mavx2 or -mavx512f).  An ordinary `inline` function that one of them does
// not inline (-O0 keeps them all, -O2 some) is emitted there as a weak symbol,
// the linker keeps ONE copy for every caller in the library, and the copy it
// keeps may be the AVX-512 one: an illegal instruction in the portable path
// on a CPU without AVX-512.  A static function is a private copy per
// translation unit, compiled with that unit's flags.  (The ctest isa_symbols
// checks the per-ISA objects in every build type.)
#define NEXUSKV_HD_STATIC static inline NEXUSKV_HD

// Full unrolling of a loop with a constant trip count (the planes of a chunk).
#if defined(__CUDACC__) || defined(__clang__)
#define NEXUSKV_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define NEXUSKV_UNROLL _Pragma("GCC unroll 16")
#else
#define NEXUSKV_UNROLL
#endif
