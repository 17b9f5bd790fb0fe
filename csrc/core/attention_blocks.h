// Building blocks of the CPU attention kernels (per ISA, isa.h): the
// softmax exp, float sums, dots and maxima that vectorize without
// -ffast-math, packed code rows widened to float, q . k for 4 x 4 rows, and
// float p . V for up to four query rows per value load (the integer p . V on
// packed codes: attention_int_values.h).  Shared by the contiguous cache's kernel
// (attention_kernel.cpp) and the paged one (paged_attention_kernel.cpp);
// internal linkage, as isa.h requires.
#pragma once

#include <cstring>
#include <limits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "isa.h"
#include "nexuskv/core/half.h"
#include "nexuskv/core/nq_layout.h"

namespace nexuskv::core::NEXUSKV_ISA {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for softmax arguments x <= 0, branch-free so that loops over it
// vectorize (std::exp does not without -ffast-math).  Cody-Waite reduction
// x = n*ln2 + r, |r| <= ln2/2, degree-6 Taylor polynomial: relative error
// < 2e-7.  Returns exactly 0 below -87 (and for -inf).
inline float exp_nonpos(float x) {
  const float xc = x > -87.f ? x : -87.f;
  const float n = (xc * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = (xc - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const float two_n = bits_float(uint32_t(int32_t(n) + 127) << 23);
  return x < -87.f ? 0.f : p * two_n;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// exp_nonpos of eight lanes, the same steps.  Why by hand: GCC leaves the
// softmax loop over exp_nonpos scalar for AVX2 (13 % of a 4-bit decode).
NEXUSKV_INLINE __m256 exp_nonpos8(__m256 x) {
  const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-87.f));  // (a NaN x gives -87, as x > -87 ? x : -87)
  const __m256 big = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504f), big), big);
  const __m256 r =
      _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), xc));
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256 two_n =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ), _mm256_mul_ps(p, two_n));
}
#endif

// sr[j] = exp_nonpos(sr[j] - m) for j in [lo, hi), 0 for the other j < n.
inline void exp_shifted(float* __restrict sr, int64_t n, int64_t lo, int64_t hi, float m) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(int(j)), lane);
    const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(int(lo) - 1)),
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32(int(hi)), idx));
    const __m256i store = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), idx);  // lanes < n
    const __m256 x = _mm256_sub_ps(_mm256_maskload_ps(sr + j, store), _mm256_set1_ps(m));
    _mm256_maskstore_ps(sr + j, store, _mm256_and_ps(exp_nonpos8(x), _mm256_castsi256_ps(in)));
  }
#else
  for (int64_t j = 0; j < n; ++j) sr[j] = j >= lo && j < hi ? exp_nonpos(sr[j] - m) : 0.f;
#endif
}

#if defined(__AVX512F__)
// Lanes [0, m) of a 16-float vector (m >= 16: all; m <= 0: none).
inline __mmask16 first_lanes(int64_t m) {
  return m >= 16 ? __mmask16(0xffff) : m <= 0 ? __mmask16(0) : __mmask16((1u << m) - 1);
}

// Sum of v[0..n): 16 lanes, then one reduction (a tile's rows are 32 floats:
// two loads, instead of a 16-partial sum folded with 15 dependent scalar adds).
inline float sum_f(const float* __restrict v, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(first_lanes(n - i), v + i));
  return _mm512_reduce_add_ps(acc);
}

// Dot product of a[0..n) and b[0..n), the same way.
inline float dot_f(const float* __restrict a, const float* __restrict b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first_lanes(n - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// False if v[0..n) holds a NaN or an Inf (v * 0 is NaN exactly then).
inline bool all_finite(const float* __restrict v, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16)
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(n - i), v + i), _mm512_setzero_ps()));
  return _mm512_reduce_add_ps(acc) == 0.f;
}

// max of v[0..n), -inf when n <= 0 (a NaN may or may not be seen: callers
// check all_finite).
inline float max_range(const float* __restrict v, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(kNegInf);
  __m512 acc = lowest;
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_max_ps(acc, _mm512_mask_loadu_ps(lowest, first_lanes(n - i), v + i));
  return _mm512_reduce_max_ps(acc);
}
#else
// Sum of v[0..n) with 16 independent partial sums (an in-order float sum
// cannot be vectorized without -ffast-math).
inline float sum_f(const float* __restrict v, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) part[l] += v[i + l];
  for (; i < n; ++i) part[0] += v[i];
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += part[l];
  return s;
}

// Dot product of a[0..n) and b[0..n), the same way.
inline float dot_f(const float* __restrict a, const float* __restrict b, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) part[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) part[0] += a[i] * b[i];
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += part[l];
  return s;
}

// False if v[0..n) holds a NaN or an Inf (v * 0 is NaN exactly then).
inline bool all_finite(const float* __restrict v, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) part[l] += v[i + l] * 0.f;
  for (; i < n; ++i) part[0] += v[i] * 0.f;
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += part[l];
  return s == 0.f;
}

// max of v[0..n), -inf when n <= 0.
inline float max_range(const float* __restrict v, int64_t n) {
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) m = max_f(m, v[i]);
  return m;
}
#endif

#if defined(__AVX2__)
// Plane j of one chunk (nq_layout.h) as 16 codes in two float vectors: lanes
// 0..7 in lo, 8..15 in hi.  One 16-byte load, a shift and a mask per plane;
// 3 bits add bit 2 of lane l from byte 16 + l % 8, bit 2 j + l / 8.  Why not
// the scalar plane_lane_code loop: compilers turn its 16 lanes into byte
// extractions and inserts (measured: 70 % of a 4-bit decode on an AVX2 CPU).
template <int kBits>
NEXUSKV_INLINE void plane_floats(const uint8_t* chunk, int j, __m256& lo, __m256& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk));
  const __m128i codes = kBits == 8 ? bytes
                                   : _mm_and_si128(_mm_srli_epi16(bytes, layout::plane_shift<kBits>(j)),
                                                   _mm_set1_epi8(char(layout::kPlaneMask<kBits>)));
  __m256i c_lo = _mm256_cvtepu8_epi32(codes), c_hi = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(codes, codes));
  if constexpr (kBits == 3) {
    const __m256i high = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk + 16)));
    const __m256i one = _mm256_set1_epi32(1);
    c_lo = _mm256_or_si256(c_lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, 2 * j), one), 2));
    c_hi = _mm256_or_si256(c_hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, 2 * j + 1), one), 2));
  }
  lo = _mm256_cvtepi32_ps(c_lo), hi = _mm256_cvtepi32_ps(c_hi);
}
#endif

// dst[c] = code(c) * s[c] + z[c] for one packed row, c < D (D % 16 == 0);
// with kAffine false just dst[c] = code(c) (scales are folded elsewhere).
// Plane by plane (nq_layout.h), so that every shift is a constant.
template <int kBits, bool kAffine = true>
void dequant_row(const uint8_t* __restrict packed, int64_t D, const float* __restrict s, const float* __restrict z,
                 float* __restrict dst) {
  constexpr int kChunk = layout::kChunkChannels<kBits>, kPlanes = layout::kPlanes<kBits>;
  for (int64_t base = 0; base < D; base += kChunk, packed += layout::kChunkBytes<kBits>) {
    // Full chunks unroll over a constant number of planes; a partial last chunk holds D - base channels.
    const int planes = base + kChunk <= D ? kPlanes : int((D - base) / 16);
    NEXUSKV_UNROLL
    for (int j = 0; j < kPlanes; ++j) {
      if (j >= planes) break;
      const int64_t c0 = base + 16 * j;
#if defined(__AVX2__)
      __m256 lo, hi;
      plane_floats<kBits>(packed, j, lo, hi);
      if constexpr (kAffine) {
        lo = _mm256_fmadd_ps(lo, _mm256_loadu_ps(s + c0), _mm256_loadu_ps(z + c0));
        hi = _mm256_fmadd_ps(hi, _mm256_loadu_ps(s + c0 + 8), _mm256_loadu_ps(z + c0 + 8));
      }
      _mm256_storeu_ps(dst + c0, lo);
      _mm256_storeu_ps(dst + c0 + 8, hi);
#else
      for (int l = 0; l < 16; ++l) {
        const uint32_t code = layout::plane_lane_code<kBits>(packed, j, l);
        if constexpr (kAffine)
          dst[c0 + l] = float(code) * s[c0 + l] + z[c0 + l];
        else
          dst[c0 + l] = float(code);
      }
#endif
    }
  }
}

inline void dequant_row_bits(int bits, const uint8_t* packed, int64_t D, const float* s, const float* z, float* dst) {
  switch (bits) {
    case 2: dequant_row<2>(packed, D, s, z, dst); break;
    case 3: dequant_row<3>(packed, D, s, z, dst); break;
    case 4: dequant_row<4>(packed, D, s, z, dst); break;
    default: dequant_row<8>(packed, D, s, z, dst); break;
  }
}

inline void codes_row_bits(int bits, const uint8_t* packed, int64_t D, float* dst) {
  switch (bits) {
    case 2: dequant_row<2, false>(packed, D, nullptr, nullptr, dst); break;
    case 3: dequant_row<3, false>(packed, D, nullptr, nullptr, dst); break;
    case 4: dequant_row<4, false>(packed, D, nullptr, nullptr, dst); break;
    default: dequant_row<8, false>(packed, D, nullptr, nullptr, dst); break;
  }
}

// out[i * 4 + j] = q_i . k_j over channels [0, n) for four query rows and four
// key rows ldk floats apart: vector lanes while whole, then a scalar tail (a
// channel group of a width that is not a multiple of the vector, paged kernel).
inline void dot4x4(const float* const* q, const float* __restrict k, int64_t n, int64_t ldk, float* out) {
  int64_t d = 0;
#if defined(__AVX512F__)
  __m512 a[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) a[i][j] = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16) {
    __m512 kv[4];
    for (int j = 0; j < 4; ++j) kv[j] = _mm512_loadu_ps(k + j * ldk + d);
    for (int i = 0; i < 4; ++i) {
      const __m512 qv = _mm512_loadu_ps(q[i] + d);
      for (int j = 0; j < 4; ++j) a[i][j] = _mm512_fmadd_ps(qv, kv[j], a[i][j]);
    }
  }
  // Sum each accumulator: fold 512 -> 256 bits, then three hadds give the four sums of a row.
  for (int i = 0; i < 4; ++i) {
    __m256 y[4];
    for (int j = 0; j < 4; ++j)
      y[j] = _mm256_add_ps(_mm512_castps512_ps256(a[i][j]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i][j]), 1)));
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
    _mm_storeu_ps(out + 4 * i, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
#elif defined(__AVX2__)
  __m256 a[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) a[i][j] = _mm256_setzero_ps();
  for (; d + 8 <= n; d += 8) {
    __m256 kv[4];
    for (int j = 0; j < 4; ++j) kv[j] = _mm256_loadu_ps(k + j * ldk + d);
    for (int i = 0; i < 4; ++i) {
      const __m256 qv = _mm256_loadu_ps(q[i] + d);
      for (int j = 0; j < 4; ++j) a[i][j] = _mm256_fmadd_ps(qv, kv[j], a[i][j]);
    }
  }
  for (int i = 0; i < 4; ++i) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]), _mm256_hadd_ps(a[i][2], a[i][3]));
    _mm_storeu_ps(out + 4 * i, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
#else
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) {
      float acc[8] = {};
      for (int64_t e = 0; e + 8 <= n; e += 8)
        for (int l = 0; l < 8; ++l) acc[l] += q[i][e + l] * k[j * ldk + e + l];
      float sum = 0.f;
      for (int l = 0; l < 8; ++l) sum += acc[l];
      out[4 * i + j] = sum;
    }
  d = n / 8 * 8;
#endif
  for (; d < n; ++d)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) out[4 * i + j] += q[i][d] * k[j * ldk + d];
}

// The same over four key rows of D floats each (D % 16 == 0: no tail).
inline void dot4x4(const float* const* q, const float* __restrict k, int64_t D, float* out) { dot4x4(q, k, D, D, out); }

// acc_i[d] += sum_j w_i[(d / G) * bstride + j] * v[j * ldv + d], d < D, for R
// query rows at once (each V load serves all R rows): one weight per token and
// channel group of G channels (G % 16 == 0 where bstride != 0), groups bstride
// apart; bstride = 0 and G = D for one weight per token.  Blocks of 16 channels,
// then a scalar tail (D % 16 != 0: a channel group of the paged kernel).
template <int R>
void pv_block(float* const* acc, const float* const* w, int64_t bstride, int64_t G, const float* __restrict v,
              int64_t n, int64_t D, int64_t ldv) {
  int64_t d0 = 0;
  for (; d0 + 16 <= D; d0 += 16) {
    const int64_t b = (d0 / G) * bstride;
#if defined(__AVX512F__)
    __m512 a[R];
    for (int i = 0; i < R; ++i) a[i] = _mm512_loadu_ps(acc[i] + d0);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 vj = _mm512_loadu_ps(v + j * ldv + d0);
      for (int i = 0; i < R; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i][b + j]), vj, a[i]);
    }
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(acc[i] + d0, a[i]);
#elif defined(__AVX2__)
    __m256 a[R][2];
    for (int i = 0; i < R; ++i) a[i][0] = _mm256_loadu_ps(acc[i] + d0), a[i][1] = _mm256_loadu_ps(acc[i] + d0 + 8);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * ldv + d0), v1 = _mm256_loadu_ps(v + j * ldv + d0 + 8);
      for (int i = 0; i < R; ++i) {
        const __m256 wj = _mm256_set1_ps(w[i][b + j]);
        a[i][0] = _mm256_fmadd_ps(wj, v0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(wj, v1, a[i][1]);
      }
    }
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(acc[i] + d0, a[i][0]), _mm256_storeu_ps(acc[i] + d0 + 8, a[i][1]);
#else
    for (int i = 0; i < R; ++i) {
      float a[16];
      std::memcpy(a, acc[i] + d0, sizeof(a));
      for (int64_t j = 0; j < n; ++j)
        for (int l = 0; l < 16; ++l) a[l] += w[i][b + j] * v[j * ldv + d0 + l];
      std::memcpy(acc[i] + d0, a, sizeof(a));
    }
#endif
  }
  for (; d0 < D; ++d0) {
    const int64_t b = (d0 / G) * bstride;
    for (int i = 0; i < R; ++i) {
      float a = acc[i][d0];
      for (int64_t j = 0; j < n; ++j) a += w[i][b + j] * v[j * ldv + d0];
      acc[i][d0] = a;
    }
  }
}

inline void pv_rows(int R, float* const* acc, const float* const* w, int64_t bstride, int64_t G, const float* v,
                    int64_t n, int64_t D, int64_t ldv) {
  switch (R) {
    case 1: pv_block<1>(acc, w, bstride, G, v, n, D, ldv); break;
    case 2: pv_block<2>(acc, w, bstride, G, v, n, D, ldv); break;
    case 3: pv_block<3>(acc, w, bstride, G, v, n, D, ldv); break;
    default: pv_block<4>(acc, w, bstride, G, v, n, D, ldv); break;
  }
}

}  // namespace
}  // namespace nexuskv::core::NEXUSKV_ISA
