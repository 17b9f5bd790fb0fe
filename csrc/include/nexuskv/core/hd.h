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

// Full unrolling of a loop with a constant trip count (the planes of a chunk).
#if defined(__CUDACC__) || defined(__clang__)
#define NEXUSKV_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define NEXUSKV_UNROLL _Pragma("GCC unroll 16")
#else
#define NEXUSKV_UNROLL
#endif
