// Per-ISA compilation of the CPU kernels: the one instruction-set dispatch
// mechanism of the core.
//
// The kernel sources (NEXUSKV_ISA_SOURCES in CMakeLists.txt) are compiled
// once per instruction set the build targets, each time with NEXUSKV_ISA set
// to its name and that ISA's compiler flags: generic (the build's baseline),
// avx2 (AVX2 + FMA + F16C) and avx512 (AVX-512 F/BW/VL/DQ + VNNI).  What they
// define lives in namespace nexuskv::core::<isa>; cpu_isa.cpp chooses one at
// run time (nexuskv/core/cpu_isa.h) and isa_kernels.h declares what each
// provides.  Intrinsics are guarded by the compiler's own macros (__AVX2__,
// __F16C__, __AVX512F__, __AVX512VNNI__), so the portable build is the same
// source without them.
//
// The rule for these sources: nothing they compile may have external linkage
// outside their ISA namespace.  The linker keeps ONE copy of every inline
// function or template instantiation with external linkage, and the copy it
// keeps may be the AVX-512 one, which would then also serve the portable path
// on a CPU without AVX-512.  So they use the helpers below instead of
// std::vector / std::sort / std::min over floats, and the shared headers mark
// their functions NEXUSKV_HD_INLINE or static.  The ctest `isa_symbols`
// checks the object files for it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "nexuskv/core/cpu_isa.h"

#ifndef NEXUSKV_ISA
#define NEXUSKV_ISA generic
#endif

#if defined(__GNUC__) || defined(__clang__)
#define NEXUSKV_INLINE inline __attribute__((always_inline))
#define NEXUSKV_NOINLINE __attribute__((noinline))
#else
#define NEXUSKV_INLINE inline
#define NEXUSKV_NOINLINE
#endif

namespace nexuskv::core::NEXUSKV_ISA {

// The CpuIsa this translation unit is compiled for (its kernels pass it to note_kernel_isa).
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr CpuIsa kThisIsa = CpuIsa::kAvx512;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr CpuIsa kThisIsa = CpuIsa::kAvx2;
#else
constexpr CpuIsa kThisIsa = CpuIsa::kGeneric;
#endif

// Scratch memory of one kernel call: new[] / delete[], zero-initialized
// (code rows rely on their padding staying zero).
template <typename T>
struct Buffer {
  explicit Buffer(int64_t n) : p(new T[size_t(n > 0 ? n : 1)]()) {}
  ~Buffer() { delete[] p; }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data() const { return p; }
  T* p;
};

// std::min / std::max semantics (the first argument on ties and unordered).
NEXUSKV_INLINE float min_f(float a, float b) { return b < a ? b : a; }
NEXUSKV_INLINE float max_f(float a, float b) { return a < b ? b : a; }

NEXUSKV_INLINE int64_t min_i(int64_t a, int64_t b) { return b < a ? b : a; }

NEXUSKV_INLINE void fill_f(float* p, int64_t n, float v) {
  for (int64_t i = 0; i < n; ++i) p[i] = v;
}

// Ascending sort of a few bytes (outlier positions: k < group_size <= 256).
NEXUSKV_INLINE void sort_bytes(uint8_t* v, int64_t n) {
  for (int64_t i = 1; i < n; ++i) {
    const uint8_t x = v[i];
    int64_t j = i;
    for (; j > 0 && v[j - 1] > x; --j) v[j] = v[j - 1];
    v[j] = x;
  }
}

}  // namespace nexuskv::core::NEXUSKV_ISA
