// Whole-row conversions of the CPU kernels (per ISA, isa.h): n values of a
// storage type to float32 and back, with the scalar conversions of half.h in
// loops the compiler vectorizes, or F16C's hardware conversion of fp16 where
// the ISA has it (the same results: round to nearest even, exact widening;
// tested in test_core.cpp, "NQ kernels give identical bits on every ISA").
#pragma once

#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "isa.h"
#include "nexuskv/core/half.h"
#include "nexuskv/core/nq_kernels.h"

namespace nexuskv::core::NEXUSKV_ISA {

// Rows<T>::load converts n values to float32 and reports whether any is NaN
// or Inf; Rows<T>::widen only converts; Rows<T>::store converts n floats back
// (nearest).
template <typename T>
struct Rows {
  static NEXUSKV_INLINE void widen(const T* src, int64_t n, float* dst) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst, src, size_t(n) * sizeof(float));
    } else if constexpr (std::is_same_v<T, bf16_t>) {
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i].bits);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i].bits);
    }
  }

  static NEXUSKV_INLINE bool load(const T* src, int64_t n, float* dst) {
    uint32_t bad = 0;
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t i = 0; i < n; ++i) {
        dst[i] = src[i];
        bad |= uint32_t((float_bits(src[i]) & 0x7f800000u) == 0x7f800000u);
      }
    } else if constexpr (std::is_same_v<T, bf16_t>) {
      for (int64_t i = 0; i < n; ++i) {
        dst[i] = bf16_to_float(src[i].bits);
        bad |= uint32_t((src[i].bits & 0x7f80u) == 0x7f80u);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        dst[i] = half_to_float(src[i].bits);
        bad |= uint32_t((src[i].bits & 0x7c00u) == 0x7c00u);
      }
    }
    return bad != 0;
  }

  static NEXUSKV_INLINE void store(const float* src, int64_t n, T* dst) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst, src, size_t(n) * sizeof(float));
    } else if constexpr (std::is_same_v<T, bf16_t>) {
      for (int64_t i = 0; i < n; ++i) dst[i].bits = float_to_bf16(src[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i].bits = float_to_half(src[i]);
    }
  }
};

#if defined(__F16C__)
// fp16 through F16C, 8 values per instruction; the tails go through half.h.
template <>
struct Rows<half_t> {
  static NEXUSKV_INLINE void widen(const half_t* src, int64_t n, float* dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < n; ++i) dst[i] = half_to_float(src[i].bits);
  }
  static NEXUSKV_INLINE bool load(const half_t* src, int64_t n, float* dst) {
    const __m128i exp = _mm_set1_epi16(0x7c00);
    __m128i bad = _mm_setzero_si128();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
      bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, exp), exp));
    }
    bool any = !_mm_testz_si128(bad, bad);
    for (; i < n; ++i) {
      dst[i] = half_to_float(src[i].bits);
      any |= (src[i].bits & 0x7c00u) == 0x7c00u;
    }
    return any;
  }
  static NEXUSKV_INLINE void store(const float* src, int64_t n, half_t* dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) dst[i].bits = float_to_half(src[i]);
  }
};
#endif

// Loads x[row, t, 0..D) as float32 into dst; gathers first when channels are strided.
template <typename In>
NEXUSKV_INLINE bool load_x_row(const StridedRows<In>& x, const In* src, int64_t D, float* dst, In* gather) {
  if (x.stride_d != 1) {
    for (int64_t d = 0; d < D; ++d) gather[d] = src[d * x.stride_d];
    src = gather;
  }
  return Rows<In>::load(src, D, dst);
}

}  // namespace nexuskv::core::NEXUSKV_ISA
