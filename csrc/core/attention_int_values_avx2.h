// Integer p . V for per-token value groups on AVX2 without VNNI, for the
// fused attention kernel (attention_kernel.cpp, compiled per ISA: isa.h).
// Empty unless the compiler targets AVX2 and not AVX512-VNNI (the avx2 build).
//
// Why: as in attention_int_values.h, widening every code to float once per
// token (and storing and reloading the float tile) cost more than the FMAs.
// Here the folded weights w_t = p_t * scale_t (one per token and channel
// group) are written as int16 limbs,
//
//   w_t ~= a * (l0_t + l1_t / 65534),  a = max_t |w_t| / 32767,
//
// and the codes of two tokens are interleaved per channel (one vpunpck{l,h}bw
// of their masked planes) and widened to int16, so that one vpmaddwd with the
// two tokens' limbs broadcast as one int32 adds both tokens' products to 8
// channels.  Per two tokens and 16 channels: two loads, the plane masks, two
// unpacks and two widenings shared by every query row, then per row and limb
// one broadcast, two vpmaddwd and two adds.  No code is converted to float;
// the int32 sums become floats once per tile.
//
// Error: each weight is off by at most a / (2 * 65534^(L-1)), i.e. max_t w_t /
// 65534 for L = 1 (finer than the VNNI kernel's two int8 limbs, max / 64516)
// and far below float32 rounding for L = 2; so per tile of n tokens,
// |d acc_c| <= n * qmax * max_t w_t / (2 * 32767 * 65534^(L-1)) (tested
// against float64).  L: one for bf16 queries, two for fp16 and fp32.
// Every integer sum is exact: 2 * 32767 * 255 * kTileTokens / 2 < 2^31.
#pragma once

#if defined(__AVX2__) && !defined(__AVX512VNNI__)

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "isa.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/nq_layout.h"

namespace nexuskv::core::NEXUSKV_ISA {

// The int16 limbs of the folded value weights of up to four query rows, for one tile.
struct WeightLimbs16 {
  static constexpr int64_t kMaxLimbs = 2, kRows = 4;
  static constexpr int64_t kTokens = (kTileTokens + 7) / 8 * 8;  // whole 8-token vectors
  int64_t groups = 0;                                            // channel groups per token (at most)
  int64_t limbs = 1;                                             // 1 (bf16 queries) or 2
  int16_t* data = nullptr;  // [groups, kRows, kMaxLimbs, kTokens]: tokens t, t + 1 form one int32
  float* a = nullptr;       // [kRows, groups] limb unit (NaN when a weight is not finite)

  WeightLimbs16(int64_t groups_, int64_t limbs_)
      : groups(groups_), limbs(limbs_), data(new int16_t[size_t(groups_ * kRows * kMaxLimbs * kTokens)]()),
        a(new float[size_t(kRows * groups_)]()) {}
  ~WeightLimbs16() {
    delete[] data;
    delete[] a;
  }
  WeightLimbs16(const WeightLimbs16&) = delete;
  WeightLimbs16& operator=(const WeightLimbs16&) = delete;

  // Limb l of row i, group b: kTokens int16, token order.
  int16_t* limb(int64_t i, int64_t l, int64_t b) { return data + ((b * kRows + i) * kMaxLimbs + l) * kTokens; }
  const int16_t* limb(int64_t i, int64_t l, int64_t b) const {
    return data + ((b * kRows + i) * kMaxLimbs + l) * kTokens;
  }

  // Row i's weights w [nb, kTileTokens] (group b's at w + b * kTileTokens, n
  // tokens each, n <= kTileTokens) as limbs; tokens [n, kTokens) get zero.
  void set(int64_t i, const float* w, int64_t nb, int64_t n) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t b = 0; b < nb; ++b) {
      const float* wb = w + b * kTileTokens;
      __m256 vmax = _mm256_setzero_ps();
      int bad = 0;  // lanes that saw a NaN or an Inf (x * 0 is NaN exactly then)
      for (int64_t t = 0; t < n; t += 8) {
        const __m256 x = _mm256_maskload_ps(wb + t, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - t)), lane));
        const __m256 x0 = _mm256_mul_ps(x, _mm256_setzero_ps());
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(x, abs_mask));
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
      }
      if (bad) {
        a[i * groups + b] = kQuietNaN;  // its output channels become NaN, as float FMAs would make them
        continue;
      }
      alignas(32) float m8[8];
      _mm256_store_ps(m8, vmax);
      float wmax = 0.f;
      for (int l = 0; l < 8; ++l) wmax = max_f(wmax, m8[l]);
      a[i * groups + b] = wmax / 32767.f;
      const float inv_max = wmax > 0.f ? 32767.f / wmax : 0.f;  // inf for denormal wmax: clamped (limbs 0)
      const __m256 inv = _mm256_set1_ps(inv_max <= kFloatMax ? inv_max : 0.f);
      for (int64_t t = 0; t < kTokens; t += 8) {
        const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - t)), lane);
        __m256 rest = _mm256_mul_ps(_mm256_maskload_ps(wb + t, in), inv);  // in [-32767, 32767]
        for (int64_t l = 0; l < limbs; ++l) {
          const __m256 limb_f = _mm256_round_ps(rest, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          rest = _mm256_mul_ps(_mm256_sub_ps(rest, limb_f), _mm256_set1_ps(65534.f));
          const __m256i i32 = _mm256_cvtps_epi32(limb_f);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(limb(i, l, b) + t),
                           _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1)));
        }
      }
    }
  }
};

// acc_i[c, c + 16) += sum_t w_i[t, b] * code_{t,c} for R query rows and one
// 16-channel plane (group b, bit shift `shift` in the 16-byte chunk at chunk0
// of each packed row) of the n tokens: two tokens per iteration, R * L * 2 <= 8
// accumulators.  Inlined into an unrolled plane loop, so that the shift is an
// immediate (a shift count in a register spilled the accumulators).
template <int R, int kBits, int L>
NEXUSKV_INLINE void pv_int16_plane(float* const* acc, const WeightLimbs16& wl, int64_t r0, int64_t c, int64_t b,
                                   const uint8_t* __restrict chunk0, int64_t row_bytes, int64_t n, int shift) {
  const __m128i mask = _mm_set1_epi8(char(layout::kPlaneMask<kBits>));
  const int16_t* w[R][L];
  __m256i s[R][L][2];
  for (int i = 0; i < R; ++i)
    for (int l = 0; l < L; ++l) w[i][l] = wl.limb(r0 + i, l, b), s[i][l][0] = s[i][l][1] = _mm256_setzero_si256();
  auto plane_of = [&](const uint8_t* row) {
    const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
    return kBits == 8 ? z : _mm_and_si128(_mm_srli_epi16(z, shift), mask);
  };
  const uint8_t* r = chunk0;
  for (int64_t t = 0; t < n; t += 2, r += 2 * row_bytes) {
    // A last odd token pairs with itself; its partner's limbs are zero.
    const __m128i pa = plane_of(r), pb = plane_of(t + 1 < n ? r + row_bytes : r);
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(pa, pb));  // channels 0..7: (t, t + 1) pairs
    const __m256i hi = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(pa, pb));  // channels 8..15
    for (int i = 0; i < R; ++i)
      for (int l = 0; l < L; ++l) {
        int32_t pair;
        std::memcpy(&pair, w[i][l] + t, sizeof(pair));
        const __m256i wp = _mm256_set1_epi32(pair);
        s[i][l][0] = _mm256_add_epi32(s[i][l][0], _mm256_madd_epi16(lo, wp));
        s[i][l][1] = _mm256_add_epi32(s[i][l][1], _mm256_madd_epi16(hi, wp));
      }
  }
  for (int i = 0; i < R; ++i) {
    const __m256 unit = _mm256_set1_ps(wl.a[(r0 + i) * wl.groups + b]);
    for (int h = 0; h < 2; ++h) {
      // Horner over the limbs: f = s_0 + s_1 / 65534, times the unit a.
      __m256 f = _mm256_cvtepi32_ps(s[i][L - 1][h]);
      for (int l = L - 2; l >= 0; --l)
        f = _mm256_fmadd_ps(f, _mm256_set1_ps(1.f / 65534.f), _mm256_cvtepi32_ps(s[i][l][h]));
      float* dst = acc[r0 + i] + c + 8 * h;
      _mm256_storeu_ps(dst, _mm256_fmadd_ps(f, unit, _mm256_loadu_ps(dst)));
    }
  }
}

// acc_i[c] += sum_t w_i[t, group(c)] * code_{t,c} for R query rows (rows r0 ..
// r0 + R of wl and acc), the n tokens whose packed rows start at codes (bits
// 2, 4 or 8), from the rows' weight limbs; group(c) = c / G (G % 16 == 0).
// One plane (16 channels) per pass over the tokens.
template <int R, int kBits, int L>
void pv_int16_block(float* const* acc, const WeightLimbs16& wl, int64_t r0, int64_t G, const uint8_t* __restrict codes,
                    int64_t row_bytes, int64_t n, int64_t D) {
  static_assert(kBits != 3, "3-bit chunks are not 16-byte planes");
  static_assert(R * L <= 4, "accumulators");
  constexpr int kPlanes = layout::kPlanes<kBits>, kChunk = layout::kChunkChannels<kBits>;
  for (int64_t c0 = 0; c0 < D; c0 += kChunk) {
    const uint8_t* chunk0 = codes + layout::kChunkBytes<kBits> * (c0 / kChunk);
    const int planes = (D - c0) / 16 < kPlanes ? int((D - c0) / 16) : kPlanes;  // a partial last chunk
    NEXUSKV_UNROLL
    for (int p = 0; p < kPlanes; ++p) {
      if (p >= planes) break;
      const int64_t c = c0 + 16 * p;
      pv_int16_plane<R, kBits, L>(acc, wl, r0, c, c / G, chunk0, row_bytes, n, layout::plane_shift<kBits>(p));
    }
  }
}

template <int kBits, int L>
void pv_int16_rows(int R, float* const* acc, const WeightLimbs16& wl, int64_t G, const uint8_t* codes,
                   int64_t row_bytes, int64_t n, int64_t D) {
  // Rows in groups of 4 / L (one limb: all four at once; two: pairs).
  constexpr int kStep = 4 / L;
  for (int r0 = 0; r0 < R; r0 += kStep) {
    switch (R - r0 < kStep ? R - r0 : kStep) {
      case 1: pv_int16_block<1, kBits, L>(acc, wl, r0, G, codes, row_bytes, n, D); break;
      case 2: pv_int16_block<2, kBits, L>(acc, wl, r0, G, codes, row_bytes, n, D); break;
      case 3:
        if constexpr (kStep >= 3) pv_int16_block<3, kBits, L>(acc, wl, r0, G, codes, row_bytes, n, D);
        break;
      default:
        if constexpr (kStep >= 4) pv_int16_block<4, kBits, L>(acc, wl, r0, G, codes, row_bytes, n, D);
        break;
    }
  }
}

// acc_i += p_i . V for R <= 4 rows of folded weights already in wl (set()).
NEXUSKV_INLINE void pv_int_rows(int R, int bits, float* const* acc, const WeightLimbs16& wl, int64_t G,
                                const uint8_t* codes, int64_t row_bytes, int64_t n, int64_t D) {
  const bool two = wl.limbs == 2;
  switch (bits) {
    case 2:
      two ? pv_int16_rows<2, 2>(R, acc, wl, G, codes, row_bytes, n, D)
          : pv_int16_rows<2, 1>(R, acc, wl, G, codes, row_bytes, n, D);
      break;
    case 4:
      two ? pv_int16_rows<4, 2>(R, acc, wl, G, codes, row_bytes, n, D)
          : pv_int16_rows<4, 1>(R, acc, wl, G, codes, row_bytes, n, D);
      break;
    default:
      two ? pv_int16_rows<8, 2>(R, acc, wl, G, codes, row_bytes, n, D)
          : pv_int16_rows<8, 1>(R, acc, wl, G, codes, row_bytes, n, D);
      break;
  }
}

}  // namespace nexuskv::core::NEXUSKV_ISA

#endif  // __AVX2__ && !__AVX512VNNI__
