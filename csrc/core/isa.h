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
// on a CPU without AVX-512.  Which of them the compiler leaves out of line
// depends on the build type (-O0 keeps every one, -O2 some that -O3
// inlines), so "it was inlined" is no defence.  Hence:
//   - no std:: function or container (std::min, std::clamp, std::tanh,
//     std::isfinite, std::numeric_limits<>::max(), std::vector, std::sort:
//     each is an inline function with external linkage); the helpers below
//     instead, in the ISA namespace, and constants (constexpr, evaluated at
//     compile time) for the limits;
//   - the shared headers give their functions internal linkage
//     (NEXUSKV_HD_STATIC, nexuskv/core/hd.h) and their member functions
//     NEXUSKV_HD_INLINE;
//   - std::memcpy and the intrinsics are fine (a C library function, builtins).
// The ctest `isa_symbols` (tests/cpp/check_isa_symbols.cmake) fails on any
// global symbol of these objects outside nexuskv::core::<isa>, in every build
// type.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

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

// std::min / std::max / std::clamp as libstdc++ writes them (constexpr, references in
// and out, if/return), here in the ISA namespace: gcc 12 -O3 makes the same code of a
// kernel with these as with the std:: ones (objdump-compared).
template <typename T>
constexpr const T& min_of(const T& a, const T& b) {
  if (b < a) return b;
  return a;
}
template <typename T>
constexpr const T& max_of(const T& a, const T& b) {
  if (a < b) return b;
  return a;
}
template <typename T>
constexpr const T& clamp_of(const T& v, const T& lo, const T& hi) {  // lo <= hi
  return min_of(max_of(v, lo), hi);
}
// std::min({a, b, ...}) as min_of_list(a, b, ...): min_element over the list, the first
// smallest.  (The same result; gcc allocates registers a little differently around it.)
template <typename T>
constexpr const T* min_element_of(const T* first, const T* last) {
  if (first == last) return first;
  const T* result = first;
  while (++first != last)
    if (*first < *result) result = first;
  return result;
}
template <typename T, typename... More>
constexpr T min_of_list(const T& first, const More&... more) {
  const T list[] = {first, more...};
  return *min_element_of(list, list + 1 + sizeof...(More));
}

// std::tanh, std::sqrt, std::fabs and std::isfinite (float) are these builtins in libstdc++ and libc++.
#if defined(__GNUC__) || defined(__clang__)
NEXUSKV_INLINE float tanh_f(float x) { return __builtin_tanhf(x); }
NEXUSKV_INLINE float sqrt_f(float x) { return __builtin_sqrtf(x); }
NEXUSKV_INLINE float fabs_f(float x) { return __builtin_fabsf(x); }
NEXUSKV_INLINE bool isfinite_f(float x) { return __builtin_isfinite(x); }
#else  // (other compilers: the ISA rule is then not kept, nor checked)
NEXUSKV_INLINE float tanh_f(float x) { return std::tanh(x); }
NEXUSKV_INLINE float sqrt_f(float x) { return std::sqrt(x); }
NEXUSKV_INLINE float fabs_f(float x) { return std::fabs(x); }
NEXUSKV_INLINE bool isfinite_f(float x) { return std::isfinite(x); }
#endif

// Limits, evaluated at compile time (the functions of numeric_limits are never called).
constexpr float kFloatMax = std::numeric_limits<float>::max();
constexpr float kQuietNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

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
