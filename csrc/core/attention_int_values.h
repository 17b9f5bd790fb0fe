// Integer p . V for per-token value groups (AVX512-VNNI), for the fused
// attention kernel (attention_kernel.cpp, compiled per ISA: isa.h).  Empty
// unless the compiler targets AVX512-VNNI (__AVX512VNNI__, the avx512 build).
//
// Why: with the values' per-token scales folded into the softmax weights,
// w_t = p_t * scale_t (one per token and channel group), a tile adds
//
//   acc_c += sum_t w_t * code_{t,c}
//
// to every output channel c.  As float FMAs every code is widened to float
// once per token (two conversions per 16 channels, shared only by the GQA
// group's query rows), which cost as much as the FMAs and made 2-bit no
// faster than 4-bit.  Here the weights are written as int8 limbs, as the
// queries are for the keys (attention_int_keys.h),
//
//   w_t ~= a * (l0_t + l1_t / 254 + l2_t / 254^2),  a = max_t w_t / 127,
//
// and the codes of four tokens are interleaved in registers so that one
// vpdpbusd adds four tokens' u8 code x s8 limb products to each of 16
// channels: per four tokens and packed chunk, one load and three inserts
// (the chunk of each token in a 128-bit lane), one vpermd and one vpshufb
// (the 4 x 16 byte transpose), the plane masks, then one vpdpbusd per plane,
// query row and limb.  No code is converted to float; the int32 sums are
// turned into floats once per tile.
//
// Error: each weight is off by at most a / (2 * 254^(L-1)) (round to nearest
// limb by limb), i.e. max_t w_t * 2^-16 for L = 2 and * 2^-23 for L = 3, so
// acc_c moves by at most that times sum_t code_{t,c} <= n * qmax: per tile of
// n tokens, |d acc_c| <= n * qmax * max_t w_t / (2 * 127 * 254^(L-1))
// (tested against float64).  L follows the query dtype as the key limbs do: 2
// for bf16 (output rounding 2^-8 dwarfs it), 3 for fp16 and fp32.
// Every integer sum is exact: |l| * code * kTileTokens <= 127 * 255 * 32 < 2^31.
#pragma once

#if defined(__AVX512VNNI__)

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "attention_blocks.h"
#include "attention_int_keys.h"
#include "isa.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/nq_layout.h"
#include "vnni_broadcast_dot.h"

namespace nexuskv::core::NEXUSKV_ISA {

// The limbs of the folded value weights of up to four query rows, for one tile.
struct WeightLimbs {
  static constexpr int64_t kMaxLimbs = 3, kRows = 4;
  static constexpr int64_t kTokens = (kTileTokens + 15) / 16 * 16;  // whole 16-token vectors
  int64_t groups = 0;                                               // channel groups per token (at most)
  int64_t limbs = 2;                                                // 2 (bf16 queries) or 3
  // [groups, kRows, kMaxLimbs, kTokens]: four consecutive tokens' limbs form
  // one int32 that the kernel broadcasts straight from memory; every (row,
  // limb) of a group sits at a constant distance from the group's start.
  int8_t* data = nullptr;
  float* a = nullptr;  // [kRows, groups] limb unit (NaN when a weight is not finite)

  WeightLimbs(int64_t groups_, int64_t limbs_)
      : groups(groups_), limbs(limbs_), data(new int8_t[size_t(groups_ * kRows * kMaxLimbs * kTokens)]()),
        a(new float[size_t(kRows * groups_)]()) {}
  ~WeightLimbs() {
    delete[] data;
    delete[] a;
  }
  WeightLimbs(const WeightLimbs&) = delete;
  WeightLimbs& operator=(const WeightLimbs&) = delete;

  // Limb l of row i, group b: kTokens int8, token order.
  int8_t* limb(int64_t i, int64_t l, int64_t b) { return data + ((b * kRows + i) * kMaxLimbs + l) * kTokens; }
  const int8_t* group_limbs(int64_t b) const { return data + b * kRows * kMaxLimbs * kTokens; }

  // Row i's weights w [nb, kTileTokens] (group b's at w + b * kTileTokens, n
  // tokens each, n <= kTileTokens) as limbs; tokens [n, kTokens) get zero.
  void set(int64_t i, const float* w, int64_t nb, int64_t n) {
    // The unit from max |w|: the weights are >= 0 for scales of the format (>= 0), and
    // stay right (first limb in [-127, 127]) for a caller's negative ones.
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < nb; ++b) {
      const float* wb = w + b * kTileTokens;
      __m512 vmax = _mm512_setzero_ps();
      __mmask16 bad = 0;  // lanes that saw a NaN or an Inf (fpclass: QNaN, +0x08 +Inf, 0x10 -Inf, SNaN)
      for (int64_t t = 0; t < n; t += 16) {
        const __m512 x = _mm512_maskz_loadu_ps(first_lanes(n - t), wb + t);
        vmax = _mm512_max_ps(vmax, _mm512_and_ps(x, abs_mask)), bad |= _mm512_fpclass_ps_mask(x, 0x99);
      }
      const float wmax = _mm512_reduce_max_ps(vmax);
      if (bad) {
        a[i * groups + b] = kQuietNaN;  // its output channels become NaN, as float FMAs would make them
        continue;
      }
      a[i * groups + b] = wmax / 127.f;
      const float inv_max = wmax > 0.f ? 127.f / wmax : 0.f;  // inf below ~4e-37: clamped (limbs 0 then)
      const __m512 inv = _mm512_set1_ps(inv_max <= kFloatMax ? inv_max : 0.f);
      for (int64_t t = 0; t < kTokens; t += 16) {
        __m512 rest = _mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(n - t), wb + t), inv);  // in [-127, 127]
        for (int64_t l = 0; l < limbs; ++l)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(limb(i, l, b) + t), take_limb(rest));
      }
    }
  }
};

// The 16-byte chunk at `offset` of four tokens' packed rows, transposed: dword
// c of the result holds byte c of each token's chunk, in token order (so a
// vpdpbusd lane adds the four tokens of one byte column).
NEXUSKV_INLINE __m512i four_token_chunk(const uint8_t* r0, const uint8_t* r1, const uint8_t* r2, const uint8_t* r3,
                                        int64_t offset) {
  auto load = [&](const uint8_t* r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + offset)); };
  __m512i z = _mm512_castsi128_si512(load(r0));  // lane k: token k's 16 bytes
  z = _mm512_inserti32x4(z, load(r1), 1);
  z = _mm512_inserti32x4(z, load(r2), 2);
  z = _mm512_inserti32x4(z, load(r3), 3);
  // Dword 4k + m (token k, bytes 4m..4m+3) -> 4m + k, then in each lane byte
  // 4k + p -> 4p + k: lane m = columns 4m..4m+3, four tokens each.
  z = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
  const __m512i bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  return _mm512_shuffle_epi8(z, bytes);
}

// acc_i[c] += sum_t w_i[t, group(c)] * code_{t,c} for R query rows (R <= 4),
// the n tokens whose packed rows start at codes (bits 2, 4 or 8), from the
// rows' weight limbs; group(c) = c / G (G % 16 == 0).
template <int R, int kBits, int L>
void pv_int_block(float* const* acc, const WeightLimbs& wl, int64_t G, const uint8_t* __restrict codes,
                  int64_t row_bytes, int64_t n, int64_t D) {
  static_assert(kBits != 3, "3-bit chunks are not 16-byte planes");
  constexpr int kPlanes = layout::kPlanes<kBits>, kChunk = layout::kChunkChannels<kBits>;
  // Planes per pass over the tokens: as many as 24 accumulators allow.
  constexpr int kPass = kPlanes * R * L <= 24 ? kPlanes : kPlanes / 2 * R * L <= 24 ? kPlanes / 2 : 1;
  const __m512i mask = _mm512_set1_epi8(char(layout::kPlaneMask<kBits>));
  for (int64_t c0 = 0; c0 < D; c0 += kChunk) {
    const int64_t offset = layout::kChunkBytes<kBits> * (c0 / kChunk);
    const int planes = (D - c0) / 16 < kPlanes ? int((D - c0) / 16) : kPlanes;  // a partial last chunk
    for (int p0 = 0; p0 < planes; p0 += kPass) {
      const int8_t* wq[kPass];  // limbs of plane p0 + j's channel group
      __m512i s[kPass][R][L];
      for (int j = 0; j < kPass; ++j) {
        wq[j] = wl.group_limbs(p0 + j < planes ? (c0 + 16 * (p0 + j)) / G : 0);
        for (int i = 0; i < R; ++i)
          for (int l = 0; l < L; ++l) s[j][i][l] = _mm512_setzero_si512();
      }
      const uint8_t* r = codes;
      for (int64_t t = 0; t < n; t += 4, r += 4 * row_bytes) {
        const uint8_t *r1 = r + row_bytes, *r2 = r + 2 * row_bytes, *r3 = r + 3 * row_bytes;
        if (t + 4 > n) {  // a partial block repeats its last token (whose limbs there are zero)
          const uint8_t* last = codes + (n - 1) * row_bytes;
          r1 = t + 1 < n ? r1 : last, r2 = t + 2 < n ? r2 : last, r3 = last;
        }
        const __m512i z = four_token_chunk(r, r1, r2, r3, offset);
        // Every plane of the pass, also those past a partial last chunk (rows are
        // padded to whole chunks: nq_layout.h), whose sums are not stored: no
        // branch in the loop.
        NEXUSKV_UNROLL
        for (int j = 0; j < kPass; ++j) {
          // Plane p0 + j: every byte shifted by its plane_shift, masked (nq_layout.h).
          const __m512i plane =
              kBits == 8 ? z : _mm512_and_si512(_mm512_srli_epi16(z, layout::plane_shift<kBits>(p0 + j)), mask);
          for (int i = 0; i < R; ++i)
            for (int l = 0; l < L; ++l)
              dpbusd_bcast(s[j][i][l], plane, wq[j] + (i * WeightLimbs::kMaxLimbs + l) * WeightLimbs::kTokens + t);
        }
      }
      for (int j = 0; j < kPass && p0 + j < planes; ++j) {
        const int64_t c = c0 + 16 * (p0 + j), b = c / G;
        for (int i = 0; i < R; ++i) {
          // Horner over the limbs: f = s_0 + (s_1 + s_2 / 254) / 254, times the unit a.
          __m512 f = _mm512_cvtepi32_ps(s[j][i][L - 1]);
          for (int l = L - 2; l >= 0; --l)
            f = _mm512_fmadd_ps(f, _mm512_set1_ps(1.f / 254.f), _mm512_cvtepi32_ps(s[j][i][l]));
          _mm512_storeu_ps(acc[i] + c,
                           _mm512_fmadd_ps(f, _mm512_set1_ps(wl.a[i * wl.groups + b]), _mm512_loadu_ps(acc[i] + c)));
        }
      }
    }
  }
}

template <int R>
void pv_int_bits(int bits, float* const* acc, const WeightLimbs& wl, int64_t G, const uint8_t* codes, int64_t row_bytes,
                 int64_t n, int64_t D) {
  const bool three = wl.limbs == 3;
  switch (bits) {
    case 2:
      three ? pv_int_block<R, 2, 3>(acc, wl, G, codes, row_bytes, n, D)
            : pv_int_block<R, 2, 2>(acc, wl, G, codes, row_bytes, n, D);
      break;
    case 4:
      three ? pv_int_block<R, 4, 3>(acc, wl, G, codes, row_bytes, n, D)
            : pv_int_block<R, 4, 2>(acc, wl, G, codes, row_bytes, n, D);
      break;
    default:
      three ? pv_int_block<R, 8, 3>(acc, wl, G, codes, row_bytes, n, D)
            : pv_int_block<R, 8, 2>(acc, wl, G, codes, row_bytes, n, D);
      break;
  }
}

// acc_i += p_i . V for R <= 4 rows of folded weights already in wl (set()).
NEXUSKV_INLINE void pv_int_rows(int R, int bits, float* const* acc, const WeightLimbs& wl, int64_t G,
                                const uint8_t* codes, int64_t row_bytes, int64_t n, int64_t D) {
  switch (R) {
    case 1: pv_int_bits<1>(bits, acc, wl, G, codes, row_bytes, n, D); break;
    case 2: pv_int_bits<2>(bits, acc, wl, G, codes, row_bytes, n, D); break;
    case 3: pv_int_bits<3>(bits, acc, wl, G, codes, row_bytes, n, D); break;
    default: pv_int_bits<4>(bits, acc, wl, G, codes, row_bytes, n, D); break;
  }
}

}  // namespace nexuskv::core::NEXUSKV_ISA

#endif  // __AVX512VNNI__
