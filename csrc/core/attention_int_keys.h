// Integer scores for per-channel keys (AVX512-VNNI), for the fused attention
// kernel (attention_kernel.cpp, compiled per ISA: isa.h).  Empty unless the
// compiler targets AVX512-VNNI (__AVX512VNNI__, the avx512 build).
//
// Why: converting every 2/4/8-bit key code to float costs as much as the
// float FMAs themselves.  With the key group's scales folded into the
// queries, x = q * key_scale (per channel), a score is
//
//   q . key = sum_c x_c * code_c + q . zero,
//
// and the codes are already unsigned bytes once masked out of their packed
// row.  So x is written as int8 limbs,
//
//   x_c ~= a * (l0_c + l1_c / 254 + l2_c / 254^2),  a = max_c |x_c| / 127,
//
// and sum_c x_c * code_c runs as u8 x s8 dot products (vpdpbusd, 64 per
// instruction) straight on the packed codes.  Each limb is the rounded
// remainder of the one before, so the limb error per channel is at most
// a / (2 * 254^(L-1)), i.e. max|x| * 2^-16 for L = 2 and max|x| * 2^-23 for
// L = 3.  The score moves by at most eps = sum_c |x_c - x'_c| * code_c <=
// qmax * sum_c |x_c - x'_c|, each output element by at most
// (exp(2 eps) - 1) * max|v| (tested against float64).  fp16 and fp32 queries
// always take L = 3 (fp16's 11-bit significand leaves two limbs only 5 bits
// of margin; fp32: the size of float32 rounding).  bf16 queries take L = 2
// when that keeps every score of the key group within kLimbScoreError of
// exact, and L = 3 where the scores demand it: the bound grows with max|x|,
// and a very peaked softmax (scores ~5e3) once lost 1-1.7 % per row to two
// limbs.  Two limbs suffice for the usual logits (they then add less than the
// bf16 queries' own rounding) and save a third of the dot products.
// Every integer sum is exact: |l| * code * D <= 127 * 255 * 256 < 2^31.
//
// Layout of the limbs (QueryLimbs::data): [rows, limbs, padded D / 16, 4, 16]
// in channel order, each 16-channel block written four times.  Plane j of
// packed chunk c (nq_layout.h: channels c*C + 16j + [0, 16), C = 16 * planes)
// is then the 64 bytes of block c * planes + j, one copy for each of the four
// keys whose chunk c sit in the four 128-bit lanes of one register, so that
// vpdpbusd reads them as its memory operand (no broadcast instruction).
#pragma once

#include "isa.h"

namespace nexuskv::core::NEXUSKV_ISA {
// The most a bf16 query's limbs may move a score (logits: the softmax scale
// is in x) before one more limb is taken: 2^-9, i.e. each output element
// within 0.4 % of max|v|.  Also the rule of the AVX2 kernel's int16 limbs
// (attention_int_keys_avx2.h).
constexpr float kLimbScoreError = 1.f / 512.f;
}  // namespace nexuskv::core::NEXUSKV_ISA

#if defined(__AVX512VNNI__)

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "isa.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/nq_layout.h"

namespace nexuskv::core::NEXUSKV_ISA {

// The next int8 limb of rest (in [-127, 127]), rounded to nearest, 16 at a
// time; rest becomes the remainder times the radix 254, again in [-127, 127].
// The one limb split of the integer kernels (query limbs here, value-weight
// limbs in attention_int_values.h).
NEXUSKV_INLINE __m128i take_limb(__m512& rest) {
  const __m512 limb = _mm512_roundscale_ps(rest, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  rest = _mm512_mul_ps(_mm512_sub_ps(rest, limb), _mm512_set1_ps(254.f));
  return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(limb));
}

// Limbs of the folded queries of one task (all its rows), for the current key group.
struct QueryLimbs {
  static constexpr int64_t kMaxLimbs = 3;
  int64_t rows = 0, padded = 0;
  int64_t limbs = 0;       // in use for the current key group (set())
  int64_t min_limbs = 0;   // 2: bf16 queries (a third where needed), 3: fp16 / fp32
  float qmax = 0;          // the largest code
  int8_t* data = nullptr;  // [rows, kMaxLimbs, padded / 16, 4, 16]
  float* a = nullptr;      // [rows] limb unit (NaN when the row's x is not finite)

  QueryLimbs(int64_t rows_, int64_t D, int bits, int min_limbs_)
      : rows(rows_), padded(layout::padded_channels(bits, D)), limbs(min_limbs_), min_limbs(min_limbs_),
        qmax(float((1 << bits) - 1)), data(new int8_t[size_t(rows_ * kMaxLimbs * padded * 4)]()),
        a(new float[size_t(rows_)]) {}
  ~QueryLimbs() {
    delete[] data;
    delete[] a;
  }
  QueryLimbs(const QueryLimbs&) = delete;
  QueryLimbs& operator=(const QueryLimbs&) = delete;

  // The 16 limbs l of row r for packed block `block` (chunk * planes + plane), four times.
  const int8_t* block(int64_t r, int64_t l, int64_t block) const {
    return data + ((r * kMaxLimbs + l) * padded + 16 * block) * 4;
  }

  // Writes the limbs of x [rows, D], D % 16 == 0 (channels past D stay zero),
  // and chooses how many are used (min_limbs, or 3 where two would move a
  // score by more than kLimbScoreError).
  void set(const float* x, int64_t D) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    float worst_two_limb_error = 0.f;  // max over rows of qmax * sum_c |x_c - x'_c| with two limbs
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * D;
      __m512 vmax = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 16) vmax = _mm512_max_ps(vmax, _mm512_and_ps(_mm512_loadu_ps(xr + c), abs_mask));
      // max_ps drops a NaN operand, so check the row's sum too.
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 16) vsum = _mm512_add_ps(vsum, _mm512_loadu_ps(xr + c));
      const float amax = _mm512_reduce_max_ps(vmax);
      if (!isfinite_f(_mm512_reduce_add_ps(vsum)) || !(amax <= kFloatMax)) {
        a[r] = kQuietNaN;  // NaN or Inf in q: its scores become NaN
        continue;
      }
      a[r] = amax / 127.f;
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m512 rest_after_two = _mm512_setzero_ps();  // sum of |x / a - (l0 + l1 / 254)| * 254^2
      for (int64_t c = 0; c < D; c += 16) {
        __m512 rest = _mm512_mul_ps(_mm512_loadu_ps(xr + c), inv);  // in [-127, 127]
        for (int64_t l = 0; l < kMaxLimbs; ++l) {
          if (l == 2) rest_after_two = _mm512_add_ps(rest_after_two, _mm512_and_ps(rest, abs_mask));
          _mm512_storeu_si512(data + ((r * kMaxLimbs + l) * padded + c) * 4, _mm512_broadcast_i32x4(take_limb(rest)));
        }
      }
      worst_two_limb_error =
          max_f(worst_two_limb_error, qmax * a[r] / (254.f * 254.f) * _mm512_reduce_add_ps(rest_after_two));
    }
    limbs = min_limbs >= 3 || worst_two_limb_error > kLimbScoreError ? 3 : 2;
  }
};

// Lane group k of acc[i][l] holds four partial sums of row i's limb-l dot
// with key k (rows past R count as zero): adds them up, four rows at once, and
// combines the limbs by Horner, f = sum_0 + (sum_1 + sum_2 / 254) / 254, so
// that lane 4k + i of f is row i's dot with key k in limb units.  Also the
// paged kernel's (paged_int_keys.h).
template <int R, int L>
NEXUSKV_INLINE __m512 limb_dot_floats(const __m512i (&acc)[R][L]) {
  __m512 f = _mm512_setzero_ps();
  for (int l = L - 1; l >= 0; --l) {
    __m512i a4[4];
    for (int i = 0; i < 4; ++i) a4[i] = i < R ? acc[i][l] : _mm512_setzero_si512();
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a4[0], a4[1]), _mm512_unpackhi_epi32(a4[0], a4[1]));
    const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a4[2], a4[3]), _mm512_unpackhi_epi32(a4[2], a4[3]));
    const __m512i sum = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
    f = _mm512_fmadd_ps(f, _mm512_set1_ps(l == L - 1 ? 0.f : 1.f / 254.f), _mm512_cvtepi32_ps(sum));
  }
  return f;
}

// scores[(r0 + i) * kTileTokens + j0 + k] = q_i . key_k for R rows (R <= 4)
// and the keys [j0, j0 + 4) of a tile (a partial block repeats its last key),
// from the packed codes and the limbs: a_i * sum_l 254^-l * (l_l . codes) + bias_i.
template <int kBits, int R, int L>
void int_scores_block(const QueryLimbs& ql, int64_t r0, const uint8_t* const* key_rows, const float* bias,
                      float* scores, int64_t j0, int64_t n) {
  static_assert(kBits != 3, "3-bit chunks are not 16-byte planes");
  constexpr int kPlanes = layout::kPlanes<kBits>, kChunk = layout::kChunkBytes<kBits>;
  const __m512i mask = _mm512_set1_epi8(char(layout::kPlaneMask<kBits>));
  __m512i acc[R][L];
  const int8_t* limbs[R][L];  // block 0 of each row's limbs; block b is 64 * b bytes on
  for (int i = 0; i < R; ++i)
    for (int l = 0; l < L; ++l) acc[i][l] = _mm512_setzero_si512(), limbs[i][l] = ql.block(r0 + i, l, 0);
  for (int64_t c = 0; c < ql.padded / layout::kChunkChannels<kBits>; ++c) {
    // Chunk c of the four keys, one per 128-bit lane.
    auto chunk = [&](int k) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(key_rows[k] + kChunk * c)); };
    __m512i z = _mm512_castsi128_si512(chunk(0));
    z = _mm512_inserti32x4(z, chunk(1), 1);
    z = _mm512_inserti32x4(z, chunk(2), 2);
    z = _mm512_inserti32x4(z, chunk(3), 3);
    NEXUSKV_UNROLL
    for (int j = 0; j < kPlanes; ++j) {
      // Plane j: every byte lane shifted by plane_shift(j), masked (nq_layout.h).
      const __m512i plane =
          kBits == 8 ? z : _mm512_and_si512(_mm512_srli_epi16(z, layout::plane_shift<kBits>(j)), mask);
      for (int i = 0; i < R; ++i)
        for (int l = 0; l < L; ++l)
          acc[i][l] = _mm512_dpbusd_epi32(acc[i][l], plane, _mm512_loadu_si512(limbs[i][l] + 64 * (c * kPlanes + j)));
    }
  }
  __m512 f = limb_dot_floats(acc);
  alignas(64) float a4[4] = {}, b4[4] = {};
  for (int i = 0; i < R; ++i) a4[i] = ql.a[r0 + i], b4[i] = bias[r0 + i];
  f = _mm512_fmadd_ps(f, _mm512_broadcast_f32x4(_mm_load_ps(a4)), _mm512_broadcast_f32x4(_mm_load_ps(b4)));
  // Lane 4k + i -> 4i + k: row i's four scores in the i-th 128-bit lane.
  f = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
  alignas(64) float out[16];
  _mm512_store_ps(out, f);
  const int64_t keys = n - j0 < 4 ? n - j0 : 4;
  for (int i = 0; i < R; ++i)
    for (int64_t k = 0; k < keys; ++k) scores[(r0 + i) * kTileTokens + j0 + k] = out[4 * i + k];
}

template <int kBits, int L>
void int_scores_rows(const QueryLimbs& ql, const uint8_t* codes, int64_t row_bytes, int64_t n, const float* bias,
                     float* scores) {
  for (int64_t r0 = 0; r0 < ql.rows; r0 += 4) {
    const int64_t R = ql.rows - r0 < 4 ? ql.rows - r0 : 4;
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
      const uint8_t* key_rows[4];
      for (int64_t k = 0; k < 4; ++k) key_rows[k] = codes + (j0 + k < n ? j0 + k : n - 1) * row_bytes;
      switch (R) {
        case 1: int_scores_block<kBits, 1, L>(ql, r0, key_rows, bias, scores, j0, n); break;
        case 2: int_scores_block<kBits, 2, L>(ql, r0, key_rows, bias, scores, j0, n); break;
        case 3: int_scores_block<kBits, 3, L>(ql, r0, key_rows, bias, scores, j0, n); break;
        default: int_scores_block<kBits, 4, L>(ql, r0, key_rows, bias, scores, j0, n); break;
      }
    }
  }
}

// Scores of the n keys whose packed rows start at codes (bits 2, 4 or 8).
NEXUSKV_INLINE void int_scores(const QueryLimbs& ql, int bits, const uint8_t* codes, int64_t row_bytes, int64_t n,
                               const float* bias, float* scores) {
  const bool three = ql.limbs == 3;
  switch (bits) {
    case 2:
      three ? int_scores_rows<2, 3>(ql, codes, row_bytes, n, bias, scores)
            : int_scores_rows<2, 2>(ql, codes, row_bytes, n, bias, scores);
      break;
    case 4:
      three ? int_scores_rows<4, 3>(ql, codes, row_bytes, n, bias, scores)
            : int_scores_rows<4, 2>(ql, codes, row_bytes, n, bias, scores);
      break;
    default:
      three ? int_scores_rows<8, 3>(ql, codes, row_bytes, n, bias, scores)
            : int_scores_rows<8, 2>(ql, codes, row_bytes, n, bias, scores);
      break;
  }
}

}  // namespace nexuskv::core::NEXUSKV_ISA

#endif  // __AVX512VNNI__
