// What the decode kernels' warps share (paged_decode.cuh on vLLM's pages,
// contig_decode.cuh on the contiguous KVCache): each of a block's 4 warps is
// an attention of its own over its 16-key chunks, kSub of them an iteration,
// for one tile of up to 8 query rows; the warps merge once at the end.  The
// two kernels differ in where the chunks come from (the copies) and in how
// the keys are scaled (per token and channel group on pages, per channel and
// token group in the contiguous cache, or per token there too): keys per
// token score the same way on both (token_keys_iteration), keys per channel
// in contig_decode.cuh, and DecodeWarp does the rest of an iteration, which
// is the same:
//  - q . code on integer MMAs (key_scores: m16n8k32, m16n8k16 for groups of 16
//    channels; 16 keys x 8 rows, exact): the key codes as u8 (their words by
//    ldmatrix, one LOP3 per four codes and a shift), the queries as 16-bit
//    integers in two byte limbs (s8 hi, u8 lo), hi x 256 + lo as a float;
//  - the online softmax on the accumulator fragments: lane (g, t) holds keys
//    2g, 2g + 1 (stage_row: the MMAs' rows g, g + 8) of rows 2t, 2t + 1, so a
//    row's max is 3 shuffles over g; base-2 exponentials (log2 e in the
//    queries; the cap x log2 e);
//  - P . V as O^T = V^T . W^T (m16n8k16: 16 channels x 8 rows, k = the 16
//    keys): the weights p x value scale x a power of two per value group, in
//    fp16 hi + lo, go from the score fragments (keys x rows) to the B
//    fragments (rows x keys) by movmatrix; the A fragments are value codes of
//    two keys per register, by ldmatrix's transpose (bytes 2g, 2g + 1 of two
//    key rows in one register), masked in place as fp16 subnormals (one LOP3
//    a register: codes_subnormal_half2: the m-tile's accumulators in units of
//    2^(bits plane - 24)), the channels of an m-tile in the order that gives
//    them (row g <-> byte 2g, row g + 8 <-> byte 2g + 1 of the chunk's
//    plane); both undone when the partial is written;
//  - the value zeros summed as p x zero per lane, the accumulators rescaled
//    by the max's change and the value normalizer's (both powers of two or
//    exponentials, the same for every channel of a row and group), once per
//    iteration (one max, one normalizer for its 16 kSub keys; whether the
//    normalizer moves, one vote on the value scales' packed max: VHMNMX);
//  - the iterations every row sees whole (all but a few per warp and split:
//    the split's ends, a window's start, the causal end) run a steady loop
//    with no mask, no soft-cap and no skipped keys (benchmarks/cuda_budget.py
//    counts it); the others, and every iteration under a soft-cap, a masked
//    copy (kEdge).
// The end: each warp sums its lanes' denominators and zeros, the 4 warps'
// (max, sum, accumulators) merge through shared memory into the split's
// partial ([D] acc, max x ln 2, sum).
#pragma once

#include <cstddef>

#include "attention_mma.cuh"

namespace nexuskv::cuda {

constexpr int kDecodeChunk = 16;                   // keys of a chunk (a warp takes kSub an iteration)
constexpr int kDecodeWarps = kMmaThreads / kWarp;  // 4: a block takes 64 keys a chunk round
constexpr int kDecodeRows = 8;                     // query rows of a block: one MMA n side
static_assert(kDecodeChunk * kDecodeWarps == kMmaTile, "the block's keys per round: one 64-key tile");

// Chunks of 16 keys per warp iteration (one max, one rescale of the
// accumulators and one round of copies for all of them): 1 at 8 bits (bound
// by its bytes; its stages would not fit 3 blocks per SM twice over), 2 at 4
// bits, 4 at 2 bits, whose few bytes a tile leave the least room for that
// per-iteration work.  A divisor of 32: the paged copies give each chunk 32 /
// kSub lanes.
constexpr int decode_chunks_per_iteration(int bits) { return bits == 8 ? 1 : bits == 4 ? 2 : 4; }

// Bytes between two code rows of a chunk in shared memory: 16 more than the
// row for rows of 32 bytes or more, so that the 8 rows of an ldmatrix matrix
// (16 bytes of 8 consecutive rows) lie on distinct banks; rows of 16 bytes
// are conflict-free as they are.
template <int kRB>
constexpr int decode_row_stride() {
  return kRB >= 32 ? kRB + 16 : kRB;
}

// One warp's chunk in shared memory (16-byte aligned: the cp.async targets).
template <int kRB, typename X, int kBg>
struct alignas(16) DecodeStage {
  static constexpr int kRS = decode_row_stride<kRB>();
  uint8_t k_codes[kDecodeChunk][kRS];  // packed K rows, in stage_row order
  uint8_t v_codes[kDecodeChunk][kRS];  // packed V rows, in stage_row order
  // key scale, key zero (pages: per key and group; the contiguous cache's keys
  // per channel leave them unused), value scale, value zero: [16, Bg] each
  X meta[4][kDecodeChunk * kBg];
};

// What the decode kernels' shared memory holds in one place at different
// times: the stages of the loop, the queries before it, the warps' merge after.
template <int kD, int kRB, typename X, int kBg, int kSub>
union DecodeBuffers {
  struct Merge {                               // each warp's attention, after the last chunk
    float acc[kDecodeWarps][kDecodeRows][kD];  // sum of p x value scale x code (channels in order), / the normalizer
    float m[kDecodeWarps][kDecodeRows];        // max (base 2)
    float l[kDecodeWarps][kDecodeRows];        // sum of p (NaN: a bad score)
    float z[kDecodeWarps][kDecodeRows][kBg];   // sum of p x value zero per group
  };
  DecodeStage<kRB, X, kBg> stage[kDecodeWarps][2][kSub];  // per warp two stages of an iteration's kSub chunks
  float q[kDecodeRows][kD];                               // the block's queries (set-up only)
  Merge merge;
};

// A warp of a decode kernel.  kStride: keys from an iteration's chunk to the
// next (64 on pages: the block's 4 warps interleave their chunks; 16 in the
// contiguous cache: an iteration's chunks are consecutive, in one key group).
// Smem: the kernel's shared memory (buf: DecodeBuffers; key_first, key_end
// [kDecodeRows]: each row's visible keys; first: the block's earliest).
template <typename X, int kBits, int kD, int kBg, int kStride, typename Smem>
struct DecodeWarp {
  static constexpr int kRB = int(core::row_bytes(kBits, kD));
  static_assert(kRB % 16 == 0, "code rows: whole 16-byte copies");
  static_assert(sizeof(X) == 2, "2-byte meta: fp16 / bf16");
  static constexpr int kKSteps = kD / 16;  // k-steps of q . K
  static constexpr int kMTiles = kD / 16;  // P . V m-tiles (16 channels): every one in each warp
  static constexpr int kPlanes = core::layout::kPlanes<kBits>;
  static constexpr int kCodeChunks = kRB / 16;  // 16-byte chunks of a code row (kPlanes m-tiles each)
  static constexpr int kGroup = kD / kBg;       // channels per value group (and key group: keys per token)
  static_assert(kGroup % 16 == 0 && kBg * kGroup == kD, "whole groups of 16-channel k-steps");
  static_assert(kCodeChunks * kPlanes == kMTiles, "a chunk's planes are its m-tiles");
  static constexpr int kSub = decode_chunks_per_iteration(kBits);
  static constexpr int kRows = kDecodeRows;
  static constexpr int kRS = decode_row_stride<kRB>();
  using Stage = DecodeStage<kRB, X, kBg>;
  static constexpr int32_t kStep = kMmaTile * kSub;                      // keys from a warp's iteration to its next
  static constexpr int32_t kSpan = (kSub - 1) * kStride + kDecodeChunk;  // an iteration's first key to past its last
  // A normalizer that constrains nothing (no visible non-zero value scale yet).
  static constexpr float kNoNormalizer = 1.2676506e30f;  // 2^100, pow2_normalizer's largest
  static constexpr float kLog2e = 1.4426950408889634f;   // base-2 scores: x log2 e

  Smem& sm;
  const int warp, lane, g, t;
  int32_t ldsm_row = 0;  // the code row (bytes from the first) whose address the lane gives ldmatrix

  NKV_DEVICE explicit DecodeWarp(Smem& smem)
      : sm(smem), warp(int(threadIdx.x) / kWarp), lane(int(threadIdx.x) % kWarp), g(lane / 4), t(lane % 4) {
    // ldmatrix: lane 8 i + r gives row r of matrix i: rows 8 (i % 2) + r of code chunk i / 2.
    ldsm_row = ((lane / 8) % 2 * 8 + lane % 8) * kRS + 16 * (lane / 16);
  }

  // The stage row of a chunk's key k: (k % 2) 8 + k / 2, so that the MMAs'
  // row m (of q . K's A, of P . V's k) is key 2 (m % 8) + m / 8 and lane (g,
  // t), which holds rows g and g + 8, holds keys 2g and 2g + 1, whose meta
  // lie side by side (one load per array: meta_pair).  (Rows k and k + 2n:
  // stage rows n apart.)
  NKV_HOST_DEVICE static constexpr int stage_row(int k) { return k % 2 * 8 + k / 2; }

  // ---- meta ----------------------------------------------------------------------------------

  // The kBg meta values of array arr of the lane's keys 2g (out[0]) and 2g +
  // 1 (out[1]), as floats: one 4-, 8- or 16-byte load.
  NKV_DEVICE void meta_pair(const Stage& S, int arr, float (&out)[2][kBg]) const {
    uint32_t w[kBg];
    meta_words(S, arr, w);
#pragma unroll
    for (int n = 0; n < 2 * kBg; ++n)
      out[n / kBg][n % kBg] = meta_bits_float(n % 2 ? w[n / 2] >> 16 : w[n / 2] & 0xffffu);
  }
  // The same as loaded: element n (key 2g + n / kBg, group n % kBg) in half n % 2 of word n / 2.
  NKV_DEVICE void meta_words(const Stage& S, int arr, uint32_t (&w)[kBg]) const {
    const X* e = &S.meta[arr][2 * g * kBg];
    if constexpr (kBg == 1) {
      w[0] = *reinterpret_cast<const uint32_t*>(e);
    } else if constexpr (kBg == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(e);
      w[0] = v.x, w[1] = v.y;
    } else {
      const uint4 v = *reinterpret_cast<const uint4*>(e);
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    }
  }
  NKV_HOST_DEVICE static float meta_bits_float(uint32_t bits) {
    if constexpr (std::is_same_v<X, core::bf16_t>)
      return bits_float(bits << 16);
    else
      return half_bits_to_float(uint16_t(bits));
  }
  // X's bits nearest f (core::from_float).
  NKV_HOST_DEVICE static uint32_t float_to_x(float f) { return core::from_float<X>(f).bits; }

  static constexpr int kScaleWords = kBg == 1 ? 1 : kBg / 2;  // meta words of one key's groups (1: both keys')
  // The state of the lane's two rows (2t + r, r = 0, 1) and of its m-tiles.
  struct Rows {
    float m[2], l[2];  // running max (base 2), this lane's part of the denominator
    float z[2][kBg];   // this lane's part of sum p x value zero per group
    float vup[kBg];    // the value weights' power of two per group (the accumulators' unit)
    // value_normalizer_holds's limits: per half of meta_words's words (word n % kScaleWords),
    // X bits of the largest value below 2^15 / vup of the half's group
    uint32_t vlim[kScaleWords];
    float acc[kMTiles][4];  // / the group's normalizer, in units of 2^(kBits plane - 24) (codes_subnormal_half2)
  };
  NKV_DEVICE void init(Rows& st) const {
    const float kNegInf = bits_float(0xff800000u);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int b = 0; b < kBg; ++b) st.z[r][b] = 0.f;
      st.m[r] = kNegInf, st.l[r] = 0.f;
    }
#pragma unroll
    for (int b = 0; b < kBg; ++b) st.vup[b] = kNoNormalizer;
    set_scale_limits(st);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) st.acc[mt][i] = 0.f;
  }

  // ---- q . code ------------------------------------------------------------------------------

  // The queries' B fragments of q . K (16-channel units v: channels 16 v + 4t + j in byte j).
  struct QueryLimbs {
    uint32_t hi[kKSteps], lo[kKSteps];  // (q >> 8) as s8, q & 255 as u8
  };
  // The limbs of four queries (channels 16 v + 4t + j, j = 0..3) given as 16-bit integers in
  // the low halves of i (-2^15 <= them < 2^15; the bits above unread): bytes 0 of i[0..3] -> lo,
  // bytes 1 -> hi (four PRMTs).
  NKV_DEVICE static void limbs_of(const int32_t (&i)[4], uint32_t& hi, uint32_t& lo) {
    const uint32_t t01 = byte_perm(uint32_t(i[0]), uint32_t(i[1]), 0x5140u);
    const uint32_t t23 = byte_perm(uint32_t(i[2]), uint32_t(i[3]), 0x5140u);
    lo = byte_perm(t01, t23, 0x5410u), hi = byte_perm(t01, t23, 0x7632u);
  }
  // Words of a chunk's code rows by ldmatrix, code chunks cc and cc + 1 (one
  // ldmatrix; cc alone with a single code chunk): w[i][h] of lane (g, t) is
  // word t (bytes 4t .. 4t + 3) of code chunk cc + i of row g + 8 h; with
  // kTrans, bytes 2g, 2g + 1 of rows 2t + 8 h (bits 0..15) and 2t + 8 h + 1
  // (bits 16..31).  `rows`: the shared address of the stage's K or V code
  // rows.  (Loaded where they are used: at 8 bits D128 all of a chunk's words
  // at once would take 16 registers.)
  static constexpr int kPairChunks = kCodeChunks > 1 ? 2 : 1;
  template <bool kTrans>
  NKV_DEVICE void code_words(uint32_t rows, int cc, uint32_t (&w)[kPairChunks][2]) const {
    if constexpr (kPairChunks == 1) {
      uint32_t m[2];
      ldmatrix<kTrans>(m, rows + uint32_t(ldsm_row));
      w[0][0] = m[0], w[0][1] = m[1];
    } else {
      uint32_t m[4];
      ldmatrix<kTrans>(m, rows + uint32_t(ldsm_row + 16 * cc));
      w[0][0] = m[0], w[0][1] = m[1], w[1][0] = m[2], w[1][1] = m[3];
    }
  }
  // Byte j of a key row's register of unit v (channels 16 v + 4t + j), from
  // the row's words of code chunk 16 v / kC (code_words): the unit's codes
  // (plane v % kPlanes, as key_codes_fragment reads them) as u8, one shift
  // and one LOP3 per four.
  NKV_DEVICE static uint32_t key_codes_u8(uint32_t w, int v) {
    if constexpr (kBits == 8)
      return w;
    else
      return (w >> (kBits * (v % kPlanes))) & (0x01010101u * ((1u << kBits) - 1u));
  }
  // The chunk's q . code per group of kD / kKG channels as floats, from
  // integer MMAs (u8 codes x the s8 hi and u8 lo limbs, int32: exact; 256 hi
  // + lo < 2^31 at 8 bits and 128 channels a group): m16n8k32 for groups of
  // 32 channels or more, m16n8k16 for groups of 16.  `stage`: the chunk's
  // Stage's shared address; c[b][i]: key 2g + i / 2, row 2t + i % 2.
  template <int kKG>
  NKV_DEVICE void key_scores(uint32_t stage, const QueryLimbs& qf, float (&c)[kKG][4]) const {
    constexpr int kKGroup = kD / kKG;
    int32_t ch[kKG][4] = {}, cl[kKG][4] = {};
#pragma unroll
    for (int cc = 0; cc < kCodeChunks; cc += kPairChunks) {
      uint32_t w[kPairChunks][2];
      code_words<false>(stage + uint32_t(offsetof(Stage, k_codes)), cc, w);
      // the units of code chunks cc ..: v = cc kPlanes ..
      if constexpr (kKGroup >= 32) {
#pragma unroll
        for (int v = cc * kPlanes; v < (cc + kPairChunks) * kPlanes; v += 2) {
          const uint32_t(&w0)[2] = w[v / kPlanes - cc], (&w1)[2] = w[(v + 1) / kPlanes - cc];
          const uint32_t a[4] = {key_codes_u8(w0[0], v), key_codes_u8(w0[1], v), key_codes_u8(w1[0], v + 1),
                                 key_codes_u8(w1[1], v + 1)};
          const uint32_t bh[2] = {qf.hi[v], qf.hi[v + 1]}, bl[2] = {qf.lo[v], qf.lo[v + 1]};
          const int b = 16 * v / kKGroup;
          mma_16832_u8<true>(ch[b], a, bh);
          mma_16832_u8<false>(cl[b], a, bl);
        }
      } else {
#pragma unroll
        for (int v = cc * kPlanes; v < (cc + kPairChunks) * kPlanes; ++v) {
          const uint32_t a[2] = {key_codes_u8(w[v / kPlanes - cc][0], v), key_codes_u8(w[v / kPlanes - cc][1], v)};
          const int b = 16 * v / kKGroup;
          mma_16816_u8<true>(ch[b], a, qf.hi[v]);
          mma_16816_u8<false>(cl[b], a, qf.lo[v]);
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kKG; ++b)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[b][i] = float(ch[b][i] * 256 + cl[b][i]);
  }

  // ---- keys per token ------------------------------------------------------------------------
  // (vLLM's pages, paged_decode.cuh, and the contiguous cache's keys per
  // token, contig_decode.cuh: each key's codes scaled per group of kD / kBg
  // channels, its scales and zeros in the stage's meta arrays 0 and 1 beside
  // the values'.)  A score is sum_b scale_b (q_b . code_b) + zero_b sum(q_b):
  // q . code per group on the integer MMAs (key_scores, the queries' limbs
  // held for the whole block), then x the key's group scale, + the zeros' MMA.

  // The lane's limbs of row g's query q (its kD floats; x up, the row's
  // power of two: 2^14 <= max |q| up < 2^15): 16-bit integers, round to
  // nearest, at most 2^-15 of the largest; the clamp only meets +-inf, whose
  // row the group sums make NaN.
  NKV_DEVICE void token_query_limbs(const float* q, float up, QueryLimbs& qf) const {
#pragma unroll
    for (int v = 0; v < kKSteps; ++v) {
      int32_t x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = int32_t(fminf(fmaxf(rintf(q[16 * v + 4 * t + j] * up), -32768.f), 32767.f));
      limbs_of(x, qf.hi[v], qf.lo[v]);
    }
  }

  // The keys' zeros x the rows' sums of q per group, summed over the groups, on
  // one fp16 / bf16 MMA a chunk (m16n8k8: 16 keys x 8 rows, the layout of
  // key_scores's c), in place of 2 Bg conversions and 4 Bg FFMAs a lane: A
  // holds the zeros as they lie in the stage (raw meta bits: exact), B the
  // rows' sums in two terms, hi + lo (B's k slot kBg n + b: term n of the sum
  // over group b; 0 past 2 kBg), whose products are exact: 16 significant
  // bits of the sum in bf16 (2^-17 of the zero's part of a score, 2^-2 of
  // the 16-bit queries' own rounding of it at groups of 16 channels), 22 in
  // fp16.  fp16's terms are of the sum x 2^-8 (|sum| < 2^15 x 128 channels:
  // in fp16's range), the result x kZeroUnit = 2^8 (exact).
  static constexpr float kZeroUnit = std::is_same_v<X, core::bf16_t> ? 1.f : 256.f;
  // The lane's B fragment: row g, k slots 2t, 2t + 1, from sm.qsum (the rows'
  // normalized sums of q per key group).
  NKV_DEVICE uint32_t zero_query_fragment() const {
    static_assert(2 * kBg <= 8, "two terms of each group's sum in one k = 8 MMA");
    uint32_t z = 0;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int k = 2 * t + e, n = k / kBg;
      if (n < 2) {
        // term n of the sum: what the terms before it left, rounded to X (an exact difference)
        float rest = sm.qsum[g][k % kBg] / kZeroUnit;
        if (n == 1) rest -= meta_bits_float(float_to_x(rest));
        z |= float_to_x(rest) << (16 * e);
      }
    }
    return z;
  }
  // The A fragment: rows g (key 2g) and g + 8 (key 2g + 1), k slots 2t, 2t +
  // 1 = the key's zeros of groups 2t % kBg (and + 1), as loaded: one word a
  // key (one group: its half twice).
  NKV_DEVICE void zero_fragment(const Stage& S, uint32_t (&a)[2]) const {
    if constexpr (kBg == 1) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(&S.meta[1][2 * g]);  // keys 2g, 2g + 1
      a[0] = byte_perm(w, 0u, 0x1010u), a[1] = byte_perm(w, 0u, 0x3232u);
    } else {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(&S.meta[1][2 * g * kBg]) + t % (kBg / 2);
      a[0] = row[0], a[1] = row[kBg / 2];
    }
  }

  // One iteration of keys per token (the kernels' chunk): kSub chunks of 16
  // keys at c0 + kStride j, from stages S[j], into the lane's state; its
  // scores, then attend.  qf, zq: the lane's query limbs and zeros' B
  // fragment; qdl: its rows' 1 / normalizer.  kEdge: an iteration where some
  // row may not see some key (the split's ends, a row's window or causal end;
  // a chunk past the split's keys: on pages not copied, in the contiguous
  // cache copied from the capacity past them) or with a soft-cap: masked,
  // capped.  A steady iteration returns false, having changed nothing, where
  // one of its value scales would move the value normalizer
  // (value_normalizer_holds).
  template <bool kEdge>
  NKV_DEVICE bool token_keys_iteration(const Stage (&S)[kSub], uint32_t stages, int32_t c0, int32_t hi,
                                       const QueryLimbs& qf, uint32_t zq, const float (&qdl)[2], float softcap,
                                       Rows& st) const {
    if constexpr (!kEdge)
      if (!value_normalizer_holds(S, st)) return false;
    // Scores (base 2: log2 e is in the queries), soft-cap, mask; a visible score that is not
    // finite makes its row NaN.  s[j][i]: chunk j's key 2g + i / 2, row 2t + i % 2, x the row's
    // normalizer qdl on the edge; in steady iterations qdl, a power of two, goes into the
    // exponentials' FMA (attend's unit).
    float s[kSub][4];
    bool bad[2] = {false, false};
    const SoftCap cap(kEdge ? softcap * kLog2e : 0.f);  // cap tanh(x / cap) on base-2 scores: the cap x log2 e
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      // S^T = K . Q^T per key group, exact in integers: c[b][i] holds key 2g + i / 2, row 2t + i % 2.
      float c[kBg][4];
      key_scores<kBg>(stages + uint32_t(j * sizeof(Stage)), qf, c);
      // + sum over the groups of key zero x the row's sum of q, on one MMA (same layout as c)
      float zs[4] = {0.f, 0.f, 0.f, 0.f};
      {
        uint32_t za[2];
        zero_fragment(S[j], za);
        mma_1688<std::is_same_v<X, core::bf16_t>>(zs, za, zq);
      }
      float kscale[2][kBg];
      meta_pair(S[j], 0, kscale);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int kk = i / 2, r = i % 2;
        float x = zs[i] * kZeroUnit;
#pragma unroll
        for (int b = 0; b < kBg; ++b) x = fmaf(c[b][i], kscale[kk][b], x);
        s[j][i] = kEdge ? edge_score(x * qdl[r], cap, c0, j, kk, r, bad) : x;
      }
    }
    constexpr float kOne[2] = {1.f, 1.f};
    constexpr float kZero[2] = {0.f, 0.f};
    attend<kEdge>(S, stages, c0, hi, s, bad, kEdge ? kOne : qdl, kZero, st);
    return true;
  }

  // A score of chunk j of the iteration at c0 (key 2g + kk, row 2t + r) on
  // the edge: capped, then -inf where the row does not see the key; bad[r]
  // set where a visible one is not finite.
  NKV_DEVICE float edge_score(float x, const SoftCap& cap, int32_t c0, int j, int kk, int r, bool (&bad)[2]) const {
    const float kNegInf = bits_float(0xff800000u);
    if (cap.cap > 0.f) x = cap(x);
    const int32_t kp = c0 + kStride * j + 2 * g + kk;
    const bool vis = kp < sm.key_end[2 * t + r] && kp >= sm.key_first[2 * t + r];
    bad[r] = bad[r] || (vis && non_finite(x));
    return vis ? x : kNegInf;
  }

  // ---- softmax and P . V ---------------------------------------------------------------------

  // The rest of an iteration at c0, from its chunks' scores s[j][i] (key 2g +
  // i / 2, row 2t + i % 2; base 2; on the edge masked, bad[r] where a row saw
  // a score that is not finite), in the stages S (shared address `stages`):
  // the online softmax, the rescale, the zeros and acc += V^T W^T.  In steady
  // iterations (every key visible, no cap) the score of row r is s x unit[r]
  // (the kernel's normalizer on the exponentials' FMA: exact where it is a
  // power of two, the largest score's argument exactly 0), and a score that
  // is not finite reaches the denominator as NaN through its exponential's
  // argument x 0 (NaN for +-inf and NaN, 0 otherwise), the row NaN as on the
  // edge (and where two scores lie 2^128 apart, beyond fp32's range, where
  // the edge's is not).  With kShift (the contiguous cache's keys per
  // channel: s their integers, unit and shift the row's factor and bias, so
  // that each score is one FMA, its argument's) the score is s x unit +
  // shift, and since s is finite the check is once a row, on unit and
  // shift - max: the row NaN where the factor, the bias or the largest score
  // is not finite, as on the edge; a score that would overflow to -inf below a
  // finite largest one takes weight 0 here (the edge's and the CPU kernel's
  // row is NaN: scores past fp32's range, |q' code| ~ 1e36 a channel).  The
  // edge's unit is 1, its shift 0.
  template <bool kEdge, bool kShift = false>
  NKV_DEVICE void attend(const Stage (&S)[kSub], uint32_t stages, int32_t c0, int32_t hi, const float (&s)[kSub][4],
                         const bool (&bad)[2], const float (&unit)[2], const float (&shift)[2], Rows& st) const {
    static_assert(!(kEdge && kShift), "edge scores come whole");
    const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);
    // The online softmax of the lane's two rows: the max over the kSub x 16 keys (lanes g).
    float alpha[2], pr[kSub][4];
    float nan_if_bad[2] = {0.f, 0.f};  // (steady iterations) 0, or NaN after a score that is not finite
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = fmaxf(s[0][r], s[0][r + 2]);
#pragma unroll
      for (int j = 1; j < kSub; ++j) mx = fmaxf(mx, fmaxf(s[j][r], s[j][r + 2]));
      for (int o = 4; o < kWarp; o *= 2) mx = fmaxf(mx, shfl_xor(mx, o));
      // (unit > 0 or NaN: the largest s gives the largest score)
      const float m_new = fmaxf(st.m[r], kShift ? fmaf(mx, unit[r], shift[r]) : mx * unit[r]);
      // (no visible key yet: every weight 0; a steady iteration's keys are all visible)
      const float mu = kEdge && m_new == kNegInf ? 0.f : m_new;
      const float base = kShift ? shift[r] - mu : -mu;  // each key's argument: s x unit + base
      alpha[r] = fast_exp2(st.m[r] - mu);
      // (kShift: s finite, so a score is not finite only through the row's unit or base: one
      // check a row; a score past fp32's range below the largest takes weight 0: see above)
      if constexpr (kShift) nan_if_bad[r] = fmaf(base, 0.f, unit[r] * 0.f);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kSub; ++j)
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const float arg = fmaf(s[j][r + 2 * kk], unit[r], base);
          if constexpr (!kEdge && !kShift) nan_if_bad[r] = fmaf(arg, 0.f, nan_if_bad[r]);
          pr[j][r + 2 * kk] = fast_exp2(arg);
          sum += pr[j][r + 2 * kk];
        }
      if constexpr (kEdge)
        st.l[r] = bad[r] ? kNaN : st.l[r] * alpha[r] + sum;
      else
        st.l[r] = st.l[r] * alpha[r] + sum + nan_if_bad[r];
      st.m[r] = m_new;
    }
    // Rescale by the max's change and (on the edge) the value normalizer's, once per iteration.
    float ar[kBg][2];
    if constexpr (kEdge) {
      float ratio[kBg];
      move_value_normalizer(S, c0, hi, st, ratio);
#pragma unroll
      for (int b = 0; b < kBg; ++b) ar[b][0] = alpha[0] * ratio[b], ar[b][1] = alpha[1] * ratio[b];
    } else {
#pragma unroll
      for (int b = 0; b < kBg; ++b) ar[b][0] = alpha[0], ar[b][1] = alpha[1];
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) st.acc[mt][i] *= ar[16 * mt / kGroup][i % 2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int b = 0; b < kBg; ++b) st.z[r][b] *= alpha[r];
    // Per chunk: the zeros and acc += V^T W^T.  (On the edge a weight of 0
    // skips its key: the meta of masked keys is whatever the stage held.)
    const auto seen = [](float w, float x) { return !kEdge || w != 0.f ? x : 0.f; };
    const auto times = [&](float w, float x) { return w * seen(w, x); };
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      float vscale[2][kBg], vzero[2][kBg];
      meta_pair(S[j], 2, vscale);
      meta_pair(S[j], 3, vzero);
      // Zeros: sum p x value zero per row and group.
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int b = 0; b < kBg; ++b)
          st.z[r][b] = fmaf(pr[j][r + 2], seen(pr[j][r + 2], vzero[1][b]),
                            fmaf(pr[j][r], seen(pr[j][r], vzero[0][b]), st.z[r][b]));
      // The B fragments of P . V per group: w = p x value scale x vup as fp16 hi
      // + lo in the score layout (key 2g + kk, rows 2t, 2t + 1: one 8x8 matrix
      // per kk), transposed to rows x keys (k slots 2t, 2t + 1 of row g) by movmatrix.
      uint32_t bh[kBg][2], bl[kBg][2];
#pragma unroll
      for (int b = 0; b < kBg; ++b)
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const float sv = vscale[kk][b] * st.vup[b];
          const float w0 = times(pr[j][2 * kk], sv), w1 = times(pr[j][2 * kk + 1], sv);
          uint32_t hi2, lo2;
          split_half2(w0, w1, hi2, lo2);
          bh[b][kk] = movmatrix_trans(hi2);
          bl[b][kk] = movmatrix_trans(lo2);
        }
      // Bytes 2g, 2g + 1 of the chunk's stage rows 2t, 2t + 1 (pair 0) and 2t + 8, 2t + 9 (pair 1) per
      // code chunk, by ldmatrix's transpose: a register holds byte 2g (+ 1 after >> 8) of both keys
      // of a pair in its bytes 0 and 2.
      uint32_t vw[kPairChunks][2];
#pragma unroll
      for (int cc = 0; cc < kCodeChunks; ++cc) {
        if (cc % kPairChunks == 0)
          code_words<true>(stages + uint32_t(j * sizeof(Stage) + offsetof(Stage, v_codes)), cc, vw);
        const uint32_t* x = vw[cc % kPairChunks];
        const uint32_t pw[4] = {x[0], x[0] >> 8, x[1], x[1] >> 8};
#pragma unroll
        for (int pl = 0; pl < kPlanes; ++pl) {
          const int mt = cc * kPlanes + pl, b = 16 * mt / kGroup;
          uint32_t av[4];  // rows g (byte 2g), g + 8 (byte 2g + 1); k slots 2t.. then 2t + 8..
#pragma unroll
          for (int i = 0; i < 4; ++i) av[i] = codes_subnormal_half2<kBits>(pw[i], pl);
          mma_16816(st.acc[mt], av, bh[b]);
          mma_16816(st.acc[mt], av, bl[b]);
        }
      }
    }
  }

  // ---- the value normalizer ------------------------------------------------------------------

  // The value weights' power of two per group, vup: 2^14 <= max |value scale|
  // x vup < 2^15 over the visible keys so far (keys before the block's first
  // visible one, sm.first, may be memory never written; chunks past its last,
  // hi, are not copied on pages, the capacity past the keys in the contiguous
  // cache), kept at the smallest so far: the accumulators are
  // rescaled by `ratio` (a power of two: exact) when an iteration's scales
  // move it.  Scales below 2^-86 constrain nothing (2^100 at most:
  // pow2_normalizer's cap; the subnormal ones too, whose weights are below
  // fp16's either way).
  NKV_DEVICE void move_value_normalizer(const Stage (&S)[kSub], int32_t c0, int32_t hi, Rows& st,
                                        float (&ratio)[kBg]) const {
    constexpr float kMinNormal = 1.17549435e-38f;  // 2^-126
    float mx = 0.f;
#pragma unroll
    for (int j = 0; j < kSub; ++j)
#pragma unroll
      for (int e0 = 0; e0 < kDecodeChunk * kBg; e0 += kWarp) {
        const int e = e0 + lane, kp = c0 + kStride * j + e / kBg;
        if (e < kDecodeChunk * kBg && kp >= sm.first && kp < hi) mx = fmaxf(mx, fabsf(fast_float(S[j].meta[2][e])));
      }
    for (int o = kWarp / 2; o >= kBg; o /= 2) mx = fmaxf(mx, shfl_xor(mx, o));
    const float up = mx >= kMinNormal ? pow2_normalizer(mx) : kNoNormalizer;  // lane b: group b % kBg's
#pragma unroll
    for (int b = 0; b < kBg; ++b) {
      const float vup = fminf(st.vup[b], shfl(up, b));
      ratio[b] = vup * pow2_inverse(st.vup[b]);
      st.vup[b] = vup;
    }
    set_scale_limits(st);
  }
  // Rows::vlim from vup: per group, the largest X value v with v x vup < 2^15
  // (2^15 / vup a power of two, rounded to X and stepped down one unit where
  // that is not below it: X's largest finite value past X's range, 0 below it).
  NKV_DEVICE static void set_scale_limits(Rows& st) {
    uint32_t lim[kBg];
#pragma unroll
    for (int b = 0; b < kBg; ++b) {
      const float f = 32768.f * pow2_inverse(st.vup[b]);  // (+inf for vup = 2^-113: X's largest)
      const uint32_t bits = float_to_x(f);
      lim[b] = bits != 0 && meta_bits_float(bits) >= f ? bits - 1 : bits;
    }
#pragma unroll
    for (int m = 0; m < kScaleWords; ++m) st.vlim[m] = lim[kBg == 1 ? 0 : 2 * m] | lim[kBg == 1 ? 0 : 2 * m + 1] << 16;
  }
  // Whether a steady iteration's value scales (every key visible) leave vup
  // where it is, as move_value_normalizer would: yes unless some |scale| x vup
  // reaches 2^15 (its max's normalizer would be below vup; exact: vup is a
  // power of two), i.e. some |scale| lies above its group's limit vlim.  On the
  // scales as loaded, two to a word: the words' running max from the limits
  // (pair_pick; a NaN scale is passed over, as move_value_normalizer's fmaxf
  // does) differs from them where one does; fp16 takes |scale| in the max
  // (VHMNMX's operand modifier), bf16 a running min from -vlim beside it (its
  // abs would be one more instruction a word).  Sign bits aside: +-0 limits.
  // The lanes' keys 2g, 2g + 1 cover the chunk; one vote.
  NKV_DEVICE bool value_normalizer_holds(const Stage (&S)[kSub], const Rows& st) const {
    constexpr bool kBf16 = std::is_same_v<X, core::bf16_t>;
    constexpr uint32_t kSigns = 0x80008000u;
    uint32_t up[kScaleWords], down[kScaleWords];
#pragma unroll
    for (int m = 0; m < kScaleWords; ++m) up[m] = st.vlim[m], down[m] = st.vlim[m] ^ kSigns;
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      uint32_t w[kBg];
      meta_words(S[j], 2, w);
#pragma unroll
      for (int n = 0; n < kBg; ++n) {
        const int m = n % kScaleWords;
        if constexpr (kBf16) {
          up[m] = pair_pick<true, true>(up[m], w[n]);
          down[m] = pair_pick<true, false>(down[m], w[n]);
        } else {
          up[m] = pair_pick<false, true>(up[m], pair_abs<false>(w[n]));
        }
      }
    }
    uint32_t moved = 0;
#pragma unroll
    for (int m = 0; m < kScaleWords; ++m) moved |= (up[m] ^ st.vlim[m]) | (kBf16 ? down[m] ^ st.vlim[m] ^ kSigns : 0u);
    const bool holds = !any_lane((moved & ~kSigns) != 0);
    NKV_EMU_COUNT(decode_steady, lane == 0 && holds);
    NKV_EMU_COUNT(decode_normalizer, lane == 0 && !holds);
    return holds;
  }

  // ---- the loop and the end ------------------------------------------------------------------

  // The warp's iterations from `start` (its first chunk) while below hi, kStep
  // apart, in its two stages (sidx 0, 1: sm.buf.stage[warp][sidx], at shared
  // address `stage`): k.prefetch(c0, stage, sidx) issues the copies of the
  // iteration at c0 (one commit group), k.chunk<kEdge>(S, stage, sidx, c0, st) runs it (a
  // steady one returns false, having changed nothing, where its value scales
  // would move the normalizer: the edge's copy takes it).  The iterations
  // inside [all_lo, all_hi), the keys every row sees, run the steady loop.
  template <typename K>
  NKV_DEVICE void loop(K& k, int32_t start, int32_t hi, int32_t all_lo, int32_t all_hi, Rows& st) const {
    const uint32_t stages = shared_address(&sm.buf.stage[warp][0][0]);
    if (start < hi) k.prefetch(start, stages, 0);
    int sidx = 0;
    const auto stage_at = [&](int i) { return stages + uint32_t(i) * uint32_t(kSub * sizeof(Stage)); };
    // The iteration at c0: the next one's copies issued, c0's in the stage and visible to the warp.
    const auto fetch = [&](int32_t c0) {
      if (c0 + kStep < hi)
        k.prefetch(c0 + kStep, stage_at(sidx ^ 1), sidx ^ 1);
      else
        cp_async_commit();  // an empty group keeps wait<1> meaning "this iteration's group is done"
      cp_async_wait<1>();
      __syncwarp();  // every lane's copies of the iteration are visible to the warp
    };
    const auto done = [&] {
      __syncwarp();  // every lane is done with the stage before the next prefetch refills it
      sidx ^= 1;
    };
    for (int32_t c0 = start; c0 < hi;) {
      fetch(c0);
      if (c0 >= all_lo && c0 + kSpan <= all_hi) {
        bool steady;
        // the steady loop (benchmarks/cuda_budget.py counts it); it leaves with c0 fetched where
        // c0's value scales move the normalizer (the edge's copy takes that iteration)
        while ((steady = k.template chunk<false>(sm.buf.stage[warp][sidx], stage_at(sidx), sidx, c0, st))) {
          done();
          c0 += kStep;
          if (c0 + kSpan > all_hi) break;
          fetch(c0);
        }
        if (steady) continue;
      }
      k.template chunk<true>(sm.buf.stage[warp][sidx], stage_at(sidx), sidx, c0, st);
      done();
      c0 += kStep;
    }
    cp_async_wait<0>();
  }

  // After the loop (every warp calls it): the warps' rows merged into the
  // partials, partial_of(r) (null for a row without one) receiving [D] acc
  // (value zeros included), max x ln 2 and the sum (NaN once sm.flag is set:
  // lane_flag, a lane's own finding in the loop, is ORed into it).  Starts
  // with a barrier (the merge area overlays the stages).
  template <typename PartialOf>
  NKV_DEVICE void merge(Rows& st, uint32_t lane_flag, PartialOf partial_of) {
    const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);
    constexpr float kLn2 = 0.6931471805599453f;
    // The warp's rows: the lanes' denominators and zeros summed over g.
#pragma unroll
    for (int r = 0; r < 2; ++r)
      for (int o = 4; o < kWarp; o *= 2) {
        st.l[r] += shfl_xor(st.l[r], o);
#pragma unroll
        for (int b = 0; b < kBg; ++b) st.z[r][b] += shfl_xor(st.z[r][b], o);
      }
    // (by each lane that met one: no vote after the loop, whose reconvergence the compiler pays
    // for inside it)
    if (lane_flag != 0) atomic_or(&sm.flag, lane_flag);
    NKV_SYNC();  // every warp is done with its stages: the merge area overlays them
    auto& M = sm.buf.merge;
    if (g == 0)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        M.m[warp][2 * t + r] = st.m[r], M.l[warp][2 * t + r] = st.l[r];
#pragma unroll
        for (int b = 0; b < kBg; ++b) M.z[warp][2 * t + r][b] = st.z[r][b];
      }
      // acc[mt][i]: channel 16 mt + 2g + i / 2 (the loads' order), row 2t + i % 2; in the codes' unit
      // (x 2^(24 - kBits plane) first: a finite acc stays finite), then / the group's normalizer.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const float unit = subnormal_code_unit_inverse<kBits>(mt % kPlanes);
      const float down = pow2_inverse(st.vup[16 * mt / kGroup]);  // (up to 2^113: with unit, 2^137 = inf)
#pragma unroll
      for (int i = 0; i < 4; ++i) M.acc[warp][2 * t + i % 2][16 * mt + 2 * g + i / 2] = st.acc[mt][i] * unit * down;
    }
    NKV_SYNC();
    // The partials: the 4 warps merged per row (max, sum, accumulators + zeros).
    const bool poisoned = sm.flag != 0;
    for (int e = int(threadIdx.x); e < kRows * kD; e += kMmaThreads) {
      const int r = e / kD, ch = e % kD, b = ch / kGroup;
      float* pr = partial_of(r);
      if (pr == nullptr) continue;
      float mx = kNegInf;
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) mx = fmaxf(mx, M.m[w][r]);
      float o = 0.f, l = 0.f;
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float ew = M.m[w][r] == kNegInf ? 0.f : fast_exp2(M.m[w][r] - mx);
        o += ew * (M.acc[w][r][ch] + M.z[w][r][b]);
        l += ew * M.l[w][r];
      }
      pr[ch] = o;
      if (ch == 0) pr[kD] = mx * kLn2, pr[kD + 1] = poisoned ? kNaN : l;
    }
  }
};

}  // namespace nexuskv::cuda
