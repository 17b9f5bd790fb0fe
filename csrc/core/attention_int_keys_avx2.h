// Integer scores for per-channel keys on AVX2 without VNNI, for the fused
// attention kernel (attention_kernel.cpp, compiled per ISA: isa.h).  Empty
// unless the compiler targets AVX2 and not AVX512-VNNI (the avx2 build).
//
// Why: as in attention_int_keys.h, converting every code to float (a shift,
// a mask, two widenings and two conversions per 16 codes, then a store and a
// reload) costs more than the dot products.  Here the queries, with the key
// group's scales folded in (x = q * key_scale per channel), are written as
// int16 limbs,
//
//   x_c ~= a * (l0_c + l1_c / 65534),  a = max_c |x_c| / 32767,
//
// and the masked plane codes are widened to int16 for vpmaddwd (16 products
// per instruction, pairs summed into int32 lanes).  AVX2 has no u8 x s8 dot
// product into int32; vpmaddubsw saturates its int16 pair sums for 8-bit
// codes, so int16 it is.  One int16 limb is as fine as two int8 limbs of the
// VNNI kernel (per channel off by at most a / 2 = max|x| / 65534, against
// max|x| / 64516), two as fine as three and more.  The limb count follows
// the same rule: fp16 and fp32 queries take two; bf16 queries take one when
// it keeps every score of the key group within kLimbScoreError of exact
// (qmax * a * sum_c |x_c / a - l0_c|), else two.
// Every integer sum is exact: |l| * code * D <= 32767 * 255 * 256 < 2^31.
//
// Layout of the limbs (QueryLimbs16::data): [rows, 2, padded D] int16 in
// channel order; plane j of packed chunk c is channels c * C + 16 j + [0, 16)
// (nq_layout.h), i.e. 32 contiguous bytes of limbs.
#pragma once

#if defined(__AVX2__) && !defined(__AVX512VNNI__)

#include <immintrin.h>

#include <cstdint>

#include "attention_int_keys.h"
#include "isa.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/nq_layout.h"

namespace nexuskv::core::NEXUSKV_ISA {

// Limbs of the folded queries of one task (all its rows), for the current key group.
struct QueryLimbs16 {
  static constexpr int64_t kMaxLimbs = 2;
  int64_t rows = 0, padded = 0;
  int64_t limbs = 0;        // in use for the current key group (set())
  int64_t min_limbs = 0;    // 1: bf16 queries (a second where needed), 2: fp16 / fp32
  float qmax = 0;           // the largest code
  int16_t* data = nullptr;  // [rows, kMaxLimbs, padded]
  float* a = nullptr;       // [rows] limb unit (NaN when the row's x is not finite)

  QueryLimbs16(int64_t rows_, int64_t D, int bits, int min_limbs_)
      : rows(rows_), padded(layout::padded_channels(bits, D)), limbs(min_limbs_), min_limbs(min_limbs_),
        qmax(float((1 << bits) - 1)), data(new int16_t[size_t(rows_ * kMaxLimbs * padded)]()),
        a(new float[size_t(rows_)]) {}
  ~QueryLimbs16() {
    delete[] data;
    delete[] a;
  }
  QueryLimbs16(const QueryLimbs16&) = delete;
  QueryLimbs16& operator=(const QueryLimbs16&) = delete;

  const int16_t* row(int64_t r, int64_t l) const { return data + (r * kMaxLimbs + l) * padded; }

  // Writes the limbs of x [rows, D], D % 16 == 0 (channels past D stay zero),
  // and chooses how many are used.
  void set(const float* x, int64_t D) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    float worst_one_limb_error = 0.f;  // max over rows of qmax * a * sum_c |x_c / a - l0_c|
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * D;
      __m256 vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 v = _mm256_loadu_ps(xr + c);
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, abs_mask));
        vsum = _mm256_add_ps(vsum, v);  // max_ps drops a NaN operand: the sum keeps it
      }
      alignas(32) float m8[8], s8[8];
      _mm256_store_ps(m8, vmax), _mm256_store_ps(s8, vsum);
      float amax = 0.f, sum = 0.f;
      for (int l = 0; l < 8; ++l) amax = max_f(amax, m8[l]), sum += s8[l];
      if (!isfinite_f(sum) || !(amax <= kFloatMax)) {
        a[r] = kQuietNaN;  // NaN or Inf in q: its scores become NaN
        continue;
      }
      a[r] = amax / 32767.f;
      const float inv_max = amax > 0.f ? 32767.f / amax : 0.f;
      const __m256 inv = _mm256_set1_ps(inv_max <= kFloatMax ? inv_max : 0.f);  // (tiny amax: limbs 0)
      __m256 rest_sum = _mm256_setzero_ps();
      for (int64_t c = 0; c < D; c += 8) {
        __m256 rest = _mm256_mul_ps(_mm256_loadu_ps(xr + c), inv);  // in [-32767, 32767]
        for (int64_t l = 0; l < kMaxLimbs; ++l) {
          const __m256 limb = _mm256_round_ps(rest, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          rest = _mm256_sub_ps(rest, limb);
          if (l == 0) rest_sum = _mm256_add_ps(rest_sum, _mm256_and_ps(rest, abs_mask));
          rest = _mm256_mul_ps(rest, _mm256_set1_ps(65534.f));
          const __m256i i32 = _mm256_cvtps_epi32(limb);
          const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(data + (r * kMaxLimbs + l) * padded + c), i16);
        }
      }
      alignas(32) float r8[8];
      _mm256_store_ps(r8, rest_sum);
      float rsum = 0.f;
      for (int l = 0; l < 8; ++l) rsum += r8[l];
      worst_one_limb_error = max_f(worst_one_limb_error, qmax * a[r] * rsum);
    }
    limbs = min_limbs >= 2 || worst_one_limb_error > kLimbScoreError ? 2 : 1;
  }
};

// The four int32 sums of rows 0..3 from their 8-lane accumulators.
NEXUSKV_INLINE __m128i sum_rows4(__m256i r0, __m256i r1, __m256i r2, __m256i r3) {
  const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(r0, r1), _mm256_hadd_epi32(r2, r3));
  return _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

// scores[(r0 + i) * kTileTokens + j] = q_i . key_j for R rows (R <= 4) and
// the n keys of a tile whose packed rows start at codes, from the limbs:
// a_i * (s_0 + s_1 / 65534) + bias_i.  One key at a time: per plane one
// shift, one mask, one widening, then one vpmaddwd and one add per row and
// limb (R * L <= 8 accumulators, no spills); 4 rows reduced together.
template <int kBits, int R, int L>
void int16_scores_keys(const QueryLimbs16& ql, int64_t r0, const uint8_t* codes, int64_t row_bytes, int64_t n,
                       const float* bias, float* scores) {
  static_assert(kBits != 3, "3-bit chunks are not 16-byte planes");
  constexpr int kPlanes = layout::kPlanes<kBits>, kChunk = layout::kChunkBytes<kBits>;
  const int64_t chunks = ql.padded / layout::kChunkChannels<kBits>;
  const __m128i mask = _mm_set1_epi8(char(layout::kPlaneMask<kBits>));
  const int16_t* limbs[R][L];
  for (int i = 0; i < R; ++i)
    for (int l = 0; l < L; ++l) limbs[i][l] = ql.row(r0 + i, l);
  alignas(16) float a4[4] = {}, b4[4] = {};
  for (int i = 0; i < R; ++i) a4[i] = ql.a[r0 + i], b4[i] = bias[r0 + i];
  const __m128 a = _mm_load_ps(a4), b = _mm_load_ps(b4);
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* key = codes + j * row_bytes;
    __m256i acc[R][L];
    for (int i = 0; i < R; ++i)
      for (int l = 0; l < L; ++l) acc[i][l] = _mm256_setzero_si256();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i*>(key + kChunk * c));
      NEXUSKV_UNROLL
      for (int p = 0; p < kPlanes; ++p) {
        const __m256i codes16 = _mm256_cvtepu8_epi16(
            kBits == 8 ? z : _mm_and_si128(_mm_srli_epi16(z, layout::plane_shift<kBits>(p)), mask));
        const int64_t at = 16 * (c * kPlanes + p);
        for (int i = 0; i < R; ++i)
          for (int l = 0; l < L; ++l)
            acc[i][l] = _mm256_add_epi32(
                acc[i][l],
                _mm256_madd_epi16(codes16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(limbs[i][l] + at))));
      }
    }
    // Horner over the limbs: f = s_0 + s_1 / 65534, rows 0..3 in the four lanes.
    __m128 f = _mm_setzero_ps();
    for (int l = L - 1; l >= 0; --l) {
      const __m256i zero = _mm256_setzero_si256();
      const __m128i s = sum_rows4(acc[0][l], R > 1 ? acc[R > 1 ? 1 : 0][l] : zero, R > 2 ? acc[R > 2 ? 2 : 0][l] : zero,
                                  R > 3 ? acc[R > 3 ? 3 : 0][l] : zero);
      f = _mm_fmadd_ps(f, _mm_set1_ps(l == L - 1 ? 0.f : 1.f / 65534.f), _mm_cvtepi32_ps(s));
    }
    alignas(16) float out[4];
    _mm_store_ps(out, _mm_fmadd_ps(f, a, b));
    for (int i = 0; i < R; ++i) scores[(r0 + i) * kTileTokens + j] = out[i];
  }
}

template <int kBits, int L>
void int16_scores_rows(const QueryLimbs16& ql, const uint8_t* codes, int64_t row_bytes, int64_t n, const float* bias,
                       float* scores) {
  for (int64_t r0 = 0; r0 < ql.rows; r0 += 4) {
    switch (ql.rows - r0 < 4 ? ql.rows - r0 : 4) {
      case 1: int16_scores_keys<kBits, 1, L>(ql, r0, codes, row_bytes, n, bias, scores); break;
      case 2: int16_scores_keys<kBits, 2, L>(ql, r0, codes, row_bytes, n, bias, scores); break;
      case 3: int16_scores_keys<kBits, 3, L>(ql, r0, codes, row_bytes, n, bias, scores); break;
      default: int16_scores_keys<kBits, 4, L>(ql, r0, codes, row_bytes, n, bias, scores); break;
    }
  }
}

// Scores of the n keys whose packed rows start at codes (bits 2, 4 or 8).
NEXUSKV_INLINE void int_scores(const QueryLimbs16& ql, int bits, const uint8_t* codes, int64_t row_bytes, int64_t n,
                               const float* bias, float* scores) {
  const bool two = ql.limbs == 2;
  switch (bits) {
    case 2:
      two ? int16_scores_rows<2, 2>(ql, codes, row_bytes, n, bias, scores)
          : int16_scores_rows<2, 1>(ql, codes, row_bytes, n, bias, scores);
      break;
    case 4:
      two ? int16_scores_rows<4, 2>(ql, codes, row_bytes, n, bias, scores)
          : int16_scores_rows<4, 1>(ql, codes, row_bytes, n, bias, scores);
      break;
    default:
      two ? int16_scores_rows<8, 2>(ql, codes, row_bytes, n, bias, scores)
          : int16_scores_rows<8, 1>(ql, codes, row_bytes, n, bias, scores);
      break;
  }
}

}  // namespace nexuskv::core::NEXUSKV_ISA

#endif  // __AVX2__ && !__AVX512VNNI__
