// Integer scores for keys grouped per token (AVX512-VNNI), for the paged
// attention kernel (paged_attention_kernel.cpp, compiled per ISA: isa.h).
// Empty unless the compiler targets AVX512-VNNI (the avx512 build).
//
// Why: the pages hold keys quantized per token in groups of G channels (the
// vLLM backend's format), so a score is
//
//   q . key_t = sum_g s_{t,g} (q_g . code_{t,g}) + z_{t,g} sum(q_g),
//
// and q_g . code_{t,g} can run as u8 x s8 dot products (vpdpbusd) straight on
// the packed codes, with q written once per task as int8 limbs (QueryLimbs,
// attention_int_keys.h: x ~= a (l0 + l1 / 254 + l2 / 254^2), a = max|q| / 127)
// instead of widening every key code to float.  Each group's int32 sums are
// turned into a float once per (key, row, group), then scaled by the key's
// s_{t,g}.
//
// Error: with d_c = q_c - q'_c (the limbs' rounding) and codes in [0, qmax],
// sum_c d_c code_c = qmax / 2 sum_c d_c + sum_c d_c (code_c - qmax / 2), so a
// limb set moves q_g . code by at most qmax * E_g, E_g = (|sum_{c in g} d_c| +
// sum_{c in g} |d_c|) / 2 (about half of qmax sum |d_c|: the d_c have both
// signs), and a score by at most qmax * sum_g s_{t,g} E_g.  fp16 / fp32
// queries take three limbs (E ~ max|q| 2^-23 per channel); bf16 queries two
// where that bound, with each group's largest scale in the tile, stays within
// kLimbScoreError, and three in the tiles where it does not (a peaked softmax
// needs the third).  The choice is made per query row and tile from that row's
// own limbs and the tile only, and a row that needs two limbs meets a zero
// third limb when its block of four rows runs three, which gives the same bits
// as two: a row's scores never depend on the other rows of its task (the
// paged kernel's chunked-prefill invariance).
#pragma once

#if defined(__AVX512VNNI__)

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "attention_int_keys.h"
#include "isa.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/nq_layout.h"

namespace nexuskv::core::NEXUSKV_ISA {

// Query limbs of one task's rows for per-token key groups, with the per-row,
// per-tile choice of two or three limbs.
struct TokenKeyLimbs {
  QueryLimbs ql;  // [rows] limbs (all three computed); ql.limbs unused
  int64_t groups, G, D;
  Buffer<float> e2;          // [rows, groups] E_g of two limbs (the bound above)
  Buffer<int8_t> third;      // [rows, padded * 4] limb 2 as QueryLimbs stores it
  Buffer<uint8_t> third_on;  // [rows] whether ql holds limb 2 (else zeros) now

  TokenKeyLimbs(int64_t rows, int64_t D_, int bits, int64_t G_, int64_t groups_, int min_limbs)
      : ql(rows, D_, bits, min_limbs), groups(groups_), G(G_), D(D_), e2(rows * groups_), third(rows * ql.padded * 4),
        third_on(rows) {}

  int8_t* limb2(int64_t r) const { return ql.data + (r * QueryLimbs::kMaxLimbs + 2) * ql.padded * 4; }

  // Limbs of q [rows, D] (D % 16 == 0) and each row's two-limb E_g per group.
  void set(const float* q) {
    ql.set(q, D);
    for (int64_t r = 0; r < ql.rows; ++r) {
      const float* x = q + r * D;
      const __m512 a = _mm512_set1_ps(ql.a[r]), abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
      for (int64_t g = 0; g < groups; ++g) {
        __m512 e = _mm512_setzero_ps(), d = _mm512_setzero_ps();
        for (int64_t c = g * G; c < (g + 1) * G && c < D; c += 16) {  // (G % 16 == 0, D % 16 == 0)
          const auto limb = [&](int64_t l) {
            return _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql.block(r, l, c / 16)))));
          };
          const __m512 two = _mm512_mul_ps(a, _mm512_fmadd_ps(limb(1), _mm512_set1_ps(1.f / 254.f), limb(0)));
          const __m512 delta = _mm512_sub_ps(_mm512_loadu_ps(x + c), two);
          e = _mm512_add_ps(e, _mm512_and_ps(delta, abs_mask)), d = _mm512_add_ps(d, delta);
        }
        e2.p[r * groups + g] = 0.5f * (fabs_f(_mm512_reduce_add_ps(d)) + _mm512_reduce_add_ps(e));
      }
      std::memcpy(third.p + r * ql.padded * 4, limb2(r), size_t(ql.padded * 4));
      third_on.p[r] = 1;
    }
  }

  // Chooses each row's limbs for a tile whose keys have at most smax[g] as
  // group g's scale and puts zeros in the third limb of the rows that take
  // two; three[rb] says whether a row of block rb takes three (then the block
  // runs three limbs, its rows that take two on zeros: the same bits as two).
  void choose(const float* smax, uint8_t* three) {
    for (int64_t r = 0; r < ql.rows; ++r) {
      bool t = ql.min_limbs >= 3;
      if (!t) {
        float bound = 0.f;
        for (int64_t g = 0; g < groups; ++g) bound += smax[g] * e2.p[r * groups + g];
        t = !(ql.qmax * bound <= kLimbScoreError);  // (NaN: three)
      }
      if (t != bool(third_on.p[r])) {
        if (t)
          std::memcpy(limb2(r), third.p + r * ql.padded * 4, size_t(ql.padded * 4));
        else
          std::memset(limb2(r), 0, size_t(ql.padded * 4));
        third_on.p[r] = t;
      }
      if (r % 4 == 0) three[r / 4] = 0;
      three[r / 4] |= uint8_t(t);
    }
  }
};

// Scores of four keys (j .. j + 3) for the four query rows [r0, r0 + 4): per
// group, the int32 sums of the limbs (as int_scores_block's) turned into float,
// times a_r and s_{j,g}, plus z_{j,g} sum(q_g); w[r * kTile + j + k].
// plane: the keys' 16-channel blocks; sk, zk: per group, the keys' scales and
// zeros by lane (4 k + i); qsum4: [groups, 4] the rows' sum(q_g).
template <int L, int kTile>
NEXUSKV_INLINE void token_key_rows(const TokenKeyLimbs& tl, int64_t r0, int j, const __m512i* plane, const __m512* sk,
                                   const __m512* zk, const float* qsum4, float* w) {
  const QueryLimbs& ql = tl.ql;
  const int blocks = int(tl.D / 16), per_group = int(tl.G / 16);  // (no division in the loops)
  const __m512 av = _mm512_broadcast_f32x4(_mm_loadu_ps(ql.a + r0));
  __m512 score = _mm512_setzero_ps();
  int g = 0;
  for (int b0 = 0; b0 < blocks; b0 += per_group, ++g) {
    __m512i acc[4][L];
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < L; ++l) acc[i][l] = _mm512_setzero_si512();
    for (int cb = b0; cb < b0 + per_group && cb < blocks; ++cb)
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < L; ++l)
          acc[i][l] = _mm512_dpbusd_epi32(acc[i][l], plane[cb], _mm512_loadu_si512(ql.block(r0 + i, l, cb)));
    // Group g: lane 4k + i of f = row i's dot with key k (attention_int_keys.h).
    const __m512 f = limb_dot_floats(acc);
    score = _mm512_fmadd_ps(_mm512_mul_ps(f, av), sk[g], score);
    score = _mm512_fmadd_ps(zk[g], _mm512_broadcast_f32x4(_mm_loadu_ps(qsum4 + 4 * g)), score);
  }
  // Lane 4k + i -> 4i + k: row i's four scores in the i-th 128-bit lane.
  alignas(64) float out[16];
  const __m512i to_rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_store_ps(out, _mm512_permutexvar_ps(to_rows, score));
  for (int i = 0; i < 4; ++i) std::memcpy(w + (r0 + i) * kTile + j, out + 4 * i, 4 * sizeof(float));
}

// w[r * kTile + j] = q_r . key_j for every query row (row_blocks blocks of
// four, three[rb]: block rb runs three limbs) and the kTile keys of a tile
// (rows pointers; keys outside the tile's read range point at zeros, and their
// scales are zero).  The planes of four keys are extracted once and met by
// every block of rows (a prefill task has up to 16 queries x the GQA group).
// qsum4: [row_blocks, groups, 4] sum(q_g) of each block's four rows.
template <int kBits, int kTile>
void token_key_scores(const TokenKeyLimbs& tl, int64_t row_blocks, const uint8_t* three, const uint8_t* const* keys,
                      const float* kscale, const float* kzero, const float* qsum4, float* w) {
  static_assert(kBits != 3, "3-bit chunks are not 16-byte planes");
  constexpr int kPlanes = layout::kPlanes<kBits>, kChunk = layout::kChunkBytes<kBits>;
  constexpr int kMaxBlocks = int(kMaxHeadDim / 16);  // (the caller checks D <= kMaxHeadDim)
  const __m512i mask = _mm512_set1_epi8(char(layout::kPlaneMask<kBits>));
  const int64_t blocks = tl.D / 16, groups = tl.groups;
  // Lane 4k + i takes key k's value: four floats, each to four lanes.
  const __m512i by_key = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512i plane[kMaxBlocks];
  __m512 sk[kMaxBlocks], zk[kMaxBlocks];  // per group: the four keys' scales and zeros by lane
  for (int j = 0; j < kTile; j += 4) {
    for (int64_t cb = 0; cb < blocks; cb += kPlanes) {  // chunk cb / kPlanes of the four keys, one per 128-bit lane
      const int64_t off = kChunk * (cb / kPlanes);
      __m512i z = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keys[j] + off)));
      z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys[j + 1] + off)), 1);
      z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys[j + 2] + off)), 2);
      z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys[j + 3] + off)), 3);
      for (int p = 0; p < kPlanes && cb + p < blocks; ++p)
        plane[cb + p] = kBits == 8 ? z : _mm512_and_si512(_mm512_srli_epi16(z, layout::plane_shift<kBits>(p)), mask);
    }
    for (int64_t g = 0; g < groups; ++g) {
      sk[g] = _mm512_permutexvar_ps(by_key, _mm512_castps128_ps512(_mm_loadu_ps(kscale + g * kTile + j)));
      zk[g] = _mm512_permutexvar_ps(by_key, _mm512_castps128_ps512(_mm_loadu_ps(kzero + g * kTile + j)));
    }
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const float* q4 = qsum4 + rb * groups * 4;
      if (three[rb])
        token_key_rows<3, kTile>(tl, 4 * rb, j, plane, sk, zk, q4, w);
      else
        token_key_rows<2, kTile>(tl, 4 * rb, j, plane, sk, zk, q4, w);
    }
  }
}

template <int kTile>
void token_key_scores_bits(int bits, const TokenKeyLimbs& tl, int64_t row_blocks, const uint8_t* three,
                           const uint8_t* const* keys, const float* kscale, const float* kzero, const float* qsum4,
                           float* w) {
  switch (bits) {
    case 2: token_key_scores<2, kTile>(tl, row_blocks, three, keys, kscale, kzero, qsum4, w); break;
    case 4: token_key_scores<4, kTile>(tl, row_blocks, three, keys, kscale, kzero, qsum4, w); break;
    default: token_key_scores<8, kTile>(tl, row_blocks, three, keys, kscale, kzero, qsum4, w); break;
  }
}

}  // namespace nexuskv::core::NEXUSKV_ISA

#endif  // __AVX512VNNI__
