// The paged attention of decode steps on tensor cores: one row tile of up to 8
// query rows (a request's GQA group, core::paged_tile_rows) per block, each of
// the block's 4 warps an attention of its own over every fourth 16-key chunk
// of the split's keys, merged once at the end.  Designed from the byte budget
// of benchmarks/cuda_budget.py: at decode the 8 rows make an MMA's n side, so
// the per-tile work that does not scale with the bytes (block barriers, the
// scores' round trip through shared memory, a softmax row per warp, the page
// lookups of every chunk by every warp) was most of paged_mma.cuh's tile loop.
//
// A warp's iteration takes kSub of its chunks (3 at 2 bits, 2 at 4, 1 at 8;
// see kSub), c0, c0 + 64, ..., all in registers but the copies:
//  - its pages: the warp looks up its own chunks' head pages (no shuffles, no
//    block barrier) and copies each chunk's K, V codes and four [16, Bg] meta
//    rows by cp.async into its own two stages (a lane one code row, from a
//    pointer it holds into the head's page of block 0); the next iteration's
//    copies are in flight during this one's math;
//  - S^T = K . Q^T per key group on integer MMAs (m16n8k32, m16n8k16 for
//    groups of 16 channels: 16 keys x 8 rows), exact: the key codes as u8
//    (their words by ldmatrix, one LOP3 per four codes and a shift), the
//    queries as 16-bit integers in two byte limbs (s8 hi, u8 lo; the B
//    fragments held in registers for the whole block), hi x 256 + lo as a
//    float, then x the key's group scale + its zero x the row's sum of q
//    over the group;
//  - the online softmax on the accumulator fragments: lane (g, t) holds keys
//    g, g + 8 of rows 2t, 2t + 1, so a row's max is 3 shuffles over g; base-2
//    exponentials (log2 e folded into the queries' normalizer and the cap);
//  - P . V as O^T = V^T . W^T (m16n8k16: 16 channels x 8 rows, k = the 16
//    keys): the weights p x value scale x a power of two per value group, in
//    fp16 hi + lo, go from the score fragments (keys x rows) to the B
//    fragments (rows x keys) by movmatrix; the A fragments are value codes of
//    two keys per register, by ldmatrix's transpose (bytes 2g, 2g + 1 of two
//    key rows in one register), the channels of an m-tile in the order that
//    gives them (row g <-> byte 2g, row g + 8 <-> byte 2g + 1 of the chunk's
//    plane), un-permuted when the partial is written;
//  - the value zeros summed as p x zero per lane, the accumulators rescaled
//    by the max's change and the value normalizer's (both powers of two or
//    exponentials, the same for every channel of a row and group), once per
//    iteration (one max, one normalizer for its 16 kSub keys);
//  - the chunks every row sees whole (all but a few per warp and split: the
//    split's ends, a window's start, the causal end) run a steady loop with
//    no mask, no soft-cap and no skipped keys; the others, and every chunk
//    under a soft-cap, a masked copy of the chunk (chunk<kEdge>).
// The end: each warp sums its lanes' denominators and zeros, the 4 warps'
// (max, sum, accumulators) merge through shared memory into the split's
// partial, in paged_mma.cuh's format (paged_mma_merge_kernel runs after).
//
// Precision: keys and values exact as codes; queries rounded to 16-bit
// integers after the row's power-of-two normalization (2^14 <= max |q| <
// 2^15: at most 2^-15 of the row's largest |q|, 16 times finer than fp16 for
// the large channels; the 16-row kernel splits them in fp16 hi + lo); q . K
// exact in int32, then one rounding to float; weights hi + lo (~22 bits;
// one fp16 term, as FlashAttention's P, would err by 2^-11 of p x (value -
// its zero) per key, coherent over a group's channels, which the output's
// un-rotation gathers: past the bf16 tolerance's margin, not only fp16's);
// fp32 accumulation.  Compiles; untested on a GPU until a lent one runs
// benchmarks/gpu_check.sh (tests/python/test_cuda_paged.py compares it with
// float64 and with the SIMT kernel); on the host, emulated,
// it matches the CPU kernel in every format it takes (test_cuda_emulated.cpp).
#pragma once

#include <cstddef>

#include "paged_mma.cuh"

namespace nexuskv::cuda {

constexpr int kDecodeChunk = 16;                   // keys of a chunk (a warp takes kSub an iteration)
constexpr int kDecodeWarps = kMmaThreads / kWarp;  // 4: a block takes 64 keys a chunk round
static_assert(kDecodeChunk * kDecodeWarps == kMmaTile, "the block's keys per round: one 64-key tile");

// Bytes between two code rows of a chunk in shared memory: 16 more than the
// row for rows of 32 bytes or more, so that the 8 rows of an ldmatrix matrix
// (16 bytes of 8 consecutive rows) lie on distinct banks; rows of 16 bytes
// are conflict-free as they are.
template <int kRB>
constexpr int decode_row_stride() {
  return kRB >= 32 ? kRB + 16 : kRB;
}

template <int kD, int kRB, typename X, int kBg, int kSub>
struct alignas(16) PagedDecodeSmem {
  static constexpr int kRS = decode_row_stride<kRB>();
  static constexpr int kRows = core::kPagedDecodeTileRows;  // 8
  struct alignas(16) Stage {                                // one warp's chunk; 16-byte aligned: the cp.async targets
    uint8_t k_codes[kDecodeChunk][kRS];                     // packed K rows
    uint8_t v_codes[kDecodeChunk][kRS];                     // packed V rows
    X meta[4][kDecodeChunk * kBg];  // key scale, key zero, value scale, value zero: [16, Bg] each
  };
  struct Merge {                         // each warp's attention, after the last chunk
    float acc[kDecodeWarps][kRows][kD];  // sum of p x value scale x code (channels in order), / the normalizer
    float m[kDecodeWarps][kRows];        // max (base 2)
    float l[kDecodeWarps][kRows];        // sum of p (NaN: a bad score)
    float z[kDecodeWarps][kRows][kBg];   // sum of p x value zero per group
  };
  union {
    Stage stage[kDecodeWarps][2][kSub];  // per warp two stages of an iteration's kSub chunks
    float q[kRows][kD];                  // the block's queries, before they are folded (set-up only)
    Merge merge;
  } buf;
  uint4 qfrag[1][kD / 16][kWarp];  // fold_queries's fp16 fragments (unused: the integer limbs come from buf.q)
  float qsum[kRows][kBg];          // normalized sum of the row's q over each key group
  float qdown[kRows];              // 1 / the row's normalizer
  int32_t key_first[kRows];        // the row's visible keys: [key_first, key_end)
  int32_t key_end[kRows];
  int32_t first;  // the block's earliest visible key (PagedBlockWork::first; fewer registers)
  uint32_t flag;
};

template <typename X, int kBits, int kD, int kBg>
struct PagedDecodeKernel : PagedBlockWork<X> {
  static constexpr int kRB = int(core::row_bytes(kBits, kD));
  static_assert(kRB % 16 == 0, "code rows: whole 16-byte copies");
  static_assert(sizeof(X) == 2, "2-byte meta: the copy plan and meta_of (paged_mma_takes checks x_bytes)");
  static constexpr int kKSteps = kD / 16;  // k-steps of q . K
  static constexpr int kMTiles = kD / 16;  // P . V m-tiles (16 channels): every one in each warp
  static constexpr int kPlanes = core::layout::kPlanes<kBits>;
  static constexpr int kCodeChunks = kRB / 16;  // 16-byte chunks of a code row (kPlanes m-tiles each)
  static constexpr int kGroup = kD / kBg;       // channels per key / value group
  static_assert(kGroup % 16 == 0 && kBg * kGroup == kD, "whole groups of 16-channel k-steps");
  static_assert(kCodeChunks * kPlanes == kMTiles, "a chunk's planes are its m-tiles");
  // Chunks of 16 keys per warp iteration (one max, one rescale of the
  // accumulators and one value normalizer for all of them): 1 at 8 bits
  // (bound by its bytes; its stages would not fit 3 blocks per SM twice
  // over), 2 at 4 bits, 3 at 2 bits, whose few bytes a tile leave the least
  // room for that per-iteration work; at 2 bits D128 in four groups 4, with 2
  // blocks per SM (at 168 registers 3 chunks spilled 8-16 bytes, 2 spilled 8
  // on sm_90; its 8 warps keep ~37 KB in flight, as 12 with 2 chunks).
  static constexpr int kSub = kBits == 8 ? 1 : kBits == 4 ? 2 : kBg == 4 && kD == 128 ? 4 : 3;
  using Smem = PagedDecodeSmem<kD, kRB, X, kBg, kSub>;
  using Stage = typename Smem::Stage;
  static constexpr int kRows = Smem::kRows;
  // Blocks per SM the registers must allow: 4 (<= 128 registers); 3 (<= 168)
  // at four groups and at D128 (two chunks or more an iteration, or rows of
  // 128 bytes at 8 bits), which spilled 4-16 bytes at 128 (3 blocks keep ~30
  // KB in flight at 2 bits D128, ~55 KB at 4 bits, ~110 KB at 8 bits); 2 (<=
  // 255) at D128 in four groups below 8 bits, which spilled 8 bytes at 168
  // (sm_90 at 2 bits, sm_80 at 4 bits; 2 blocks keep ~37 KB and ~41 KB).
  static constexpr int kMinBlocks = kBg == 4 && kD == 128 && kBits < 8 ? 2 : kBg == 4 || kD == 128 ? 3 : 4;
  // A normalizer that constrains nothing (no visible non-zero value scale yet).
  static constexpr float kNoNormalizer = 1.2676506e30f;  // 2^100, pow2_normalizer's largest
  static constexpr float kLog2e = 1.4426950408889634f;   // base-2 scores: x log2 e

  using Work = PagedBlockWork<X>;
  using Work::a, Work::p, Work::ix, Work::h, Work::rows, Work::lo, Work::hi, Work::first, Work::table;
  using Work::partial_of;
  Smem& sm;
  const int warp, lane, g, t;

  NKV_DEVICE PagedDecodeKernel(const PagedMmaArgs<X>& args, Smem& smem)
      : Work(args), sm(smem), warp(int(threadIdx.x) / kWarp), lane(int(threadIdx.x) % kWarp), g(lane / 4), t(lane % 4) {
  }

  // ---- copies --------------------------------------------------------------------------------

  // The copies of one chunk: its K and V code rows (16 rows of kRB bytes
  // each, contiguous in the head page from the chunk's first slot) and its
  // four [16, Bg] meta rows (2 Bg 16-byte pieces each).  Lane l copies code
  // row l % 16 of K (l < 16) or V, whole (kRB / 16 pieces, a compile-time
  // distance apart on both sides), and meta piece l; its sources as pointers
  // into the head's page of block 0 (worked out once per block), so that a
  // chunk's copies cost one multiply-add per pointer past the page lookup.
  static constexpr int kRowCopies = kRB / 16, kMetaPieces = 4 * 2 * kBg;
  static_assert(kMetaPieces <= kWarp, "a chunk's meta pieces: one round of the warp");
  const uint8_t* code_src = nullptr;   // the lane's code row in block 0's head page, at slot 0
  const uint8_t* meta_src = nullptr;   // the lane's meta piece there (lanes below kMetaPieces)
  int32_t code_dst = 0, meta_dst = 0;  // their bytes from the Stage's start
  int32_t ldsm_row = 0;                // the code row (bytes from the first) whose address the lane gives ldmatrix
  uint32_t block_bytes = 0;            // bytes between a head's pages of two blocks (< 2^32: paged_mma_takes)
  bool bad_block = false;              // a block id outside the pool was met (the block is poisoned)

  NKV_DEVICE void copy_plan() {
    // ldmatrix: lane 8 i + r gives row r of matrix i: rows 8 (i % 2) + r of code chunk i / 2.
    ldsm_row = ((lane / 8) % 2 * 8 + lane % 8) * Smem::kRS + 16 * (lane / 16);
    const uint8_t* head_pages = p.pages + int64_t(h) * ix.head_page_bytes;  // kv head h's page of block 0
    const int half = lane / kDecodeChunk, row = lane % kDecodeChunk;
    code_src = head_pages + ix.off.codes[half] + row * kRB;
    code_dst = int32_t((half ? offsetof(Stage, v_codes) : offsetof(Stage, k_codes)) + row * Smem::kRS);
    block_bytes = uint32_t(int64_t(p.pool.kv_heads) * ix.head_page_bytes);
    if (lane < kMetaPieces) {
      const int arr = lane / (2 * kBg), mp = lane % (2 * kBg);
      meta_src = head_pages + ix.off.scale[0] + arr * ix.meta_array_bytes + 16 * mp;
      meta_dst = int32_t(offsetof(Stage, meta) + arr * sizeof(Stage::meta[0])) + 16 * mp;
    }
  }

  // Issues the copies of the iteration at key c0 into `stage` (one commit
  // group): chunk j at c0 + 64 j (none past the split's keys) into the j-th
  // Stage.  A block id outside the pool copies nothing and poisons the block
  // (every chunk from the aligned first key on holds a visible key).
  NKV_DEVICE void prefetch(int32_t c0, uint32_t stage) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const int32_t key = c0 + kMmaTile * j;
      if (j > 0 && key >= hi) break;
      uint32_t col, slot;
      ix.block.divmod(uint32_t(key), col, slot);
      const uint32_t id = uint32_t(table[col]);
      if (id < uint32_t(p.pool.num_blocks)) {                         // (a negative id: above every count)
        const uint64_t page = uint64_t(id) * block_bytes;             // block id's head page from block 0's
        const uint8_t* src = code_src + page + slot * uint32_t(kRB);  // (< 2^31 bytes into the page)
        const uint32_t at = stage + uint32_t(j * sizeof(Stage));
#pragma unroll
        for (int i = 0; i < kRowCopies; ++i) cp_async16(at + uint32_t(code_dst + 16 * i), src + 16 * i);
        if (lane < kMetaPieces) cp_async16(at + uint32_t(meta_dst), meta_src + page + slot * uint32_t(2 * kBg));
      } else {
        bad_block = true;  // (reported once after the loop: no atomic in it)
      }
    }
    cp_async_commit();
  }

  // ---- the chunk -----------------------------------------------------------------------------

  // kBg meta values of key `key` of array arr, as floats: one 2-, 4- or 8-byte load.
  NKV_DEVICE void meta_of(const Stage& S, int arr, int key, float (&out)[kBg]) const {
    const X* e = &S.meta[arr][key * kBg];
    if constexpr (kBg == 1) {
      out[0] = fast_float(e[0]);
    } else if constexpr (kBg == 2) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(e);
      out[0] = meta_bits_float(w & 0xffffu), out[1] = meta_bits_float(w >> 16);
    } else {
      const uint2 w = *reinterpret_cast<const uint2*>(e);
      out[0] = meta_bits_float(w.x & 0xffffu), out[1] = meta_bits_float(w.x >> 16);
      out[2] = meta_bits_float(w.y & 0xffffu), out[3] = meta_bits_float(w.y >> 16);
    }
  }
  NKV_DEVICE static float meta_bits_float(uint32_t bits) {
    if constexpr (std::is_same_v<X, core::bf16_t>)
      return bits_float(bits << 16);
    else
      return half_bits_to_float(uint16_t(bits));
  }

  // The state of the lane's two rows (2t + r, r = 0, 1) and of its m-tiles.
  struct Rows {
    float m[2], l[2];  // running max (base 2), this lane's part of the denominator
    float z[2][kBg];   // this lane's part of sum p x value zero per group
    float vup[kBg];    // the value weights' power of two per group (the accumulators' unit)
    float acc[kMTiles][4];
  };

  // The queries' B fragments of q . K (16-channel units v: channels 16 v + 4t + j in byte j).
  struct QueryLimbs {
    uint32_t hi[kKSteps], lo[kKSteps];  // (q >> 8) as s8, q & 255 as u8
  };
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
  // The chunk's q . code per key group as floats, from integer MMAs (u8 codes
  // x the s8 hi and u8 lo limbs, int32: exact; 256 hi + lo < 2^31 at 8 bits
  // and 128 channels a group): m16n8k32 for groups of 32 channels or more,
  // m16n8k16 for groups of 16.
  NKV_DEVICE void key_scores(uint32_t stage, const QueryLimbs& qf, float (&c)[kBg][4]) const {
    int32_t ch[kBg][4] = {}, cl[kBg][4] = {};
#pragma unroll
    for (int cc = 0; cc < kCodeChunks; cc += kPairChunks) {
      uint32_t w[kPairChunks][2];
      code_words<false>(stage + uint32_t(offsetof(Stage, k_codes)), cc, w);
      // the units of code chunks cc ..: v = cc kPlanes ..
      if constexpr (kGroup >= 32) {
#pragma unroll
        for (int v = cc * kPlanes; v < (cc + kPairChunks) * kPlanes; v += 2) {
          const uint32_t(&w0)[2] = w[v / kPlanes - cc], (&w1)[2] = w[(v + 1) / kPlanes - cc];
          const uint32_t a[4] = {key_codes_u8(w0[0], v), key_codes_u8(w0[1], v), key_codes_u8(w1[0], v + 1),
                                 key_codes_u8(w1[1], v + 1)};
          const uint32_t bh[2] = {qf.hi[v], qf.hi[v + 1]}, bl[2] = {qf.lo[v], qf.lo[v + 1]};
          const int b = 16 * v / kGroup;
          mma_16832_u8<true>(ch[b], a, bh);
          mma_16832_u8<false>(cl[b], a, bl);
        }
      } else {
#pragma unroll
        for (int v = cc * kPlanes; v < (cc + kPairChunks) * kPlanes; ++v) {
          const uint32_t a[2] = {key_codes_u8(w[v / kPlanes - cc][0], v), key_codes_u8(w[v / kPlanes - cc][1], v)};
          const int b = 16 * v / kGroup;
          mma_16816_u8<true>(ch[b], a, qf.hi[v]);
          mma_16816_u8<false>(cl[b], a, qf.lo[v]);
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kBg; ++b)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[b][i] = float(ch[b][i] * 256 + cl[b][i]);
  }

  // One iteration of the warp: kSub chunks of 16 keys, at c0 + 64 j, from
  // stages S[j] into the lane's state (one max, one rescale, one normalizer
  // per iteration).  kEdge: an iteration where some row may not see some key
  // (the split's ends, a row's window or causal end; a chunk past the split's
  // keys, not copied) or with a soft-cap: masked, capped, the keys it cannot
  // see skipped.  The rest, the steady iterations, see every key on every row
  // (and have no cap): nothing to mask or skip, and a score that is not
  // finite reaches the denominator as NaN through x * 0 (NaN for +-inf and
  // NaN, 0 otherwise), the row NaN as on the edge.
  template <bool kEdge>
  NKV_DEVICE void chunk(const Stage (&S)[kSub], uint32_t stages, int32_t c0, const QueryLimbs& qf,
                        const float (&qs)[2][kBg], const float (&qdl)[2], Rows& st) const {
    const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);
    // Scores (base 2), soft-cap, mask; a visible score that is not finite makes its row NaN.
    // s[j][i]: chunk j's key g + 8 (i / 2), row 2t + i % 2.
    float s[kSub][4];
    bool bad[2] = {false, false};
    const SoftCap cap(kEdge ? p.softcap * kLog2e : 0.f);  // cap tanh(x / cap) on base-2 scores: the cap x log2 e
    float nan_if_bad[2] = {0.f, 0.f};  // (steady iterations) 0, or NaN after a score that is not finite
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      // S^T = K . Q^T per key group, exact in integers: c[b][i] holds key g + 8 (i / 2), row 2t + i % 2.
      float c[kBg][4];
      key_scores(stages + uint32_t(j * sizeof(Stage)), qf, c);
      float kscale[2][kBg], kzero[2][kBg];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        meta_of(S[j], 0, g + 8 * kk, kscale[kk]);
        meta_of(S[j], 1, g + 8 * kk, kzero[kk]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int kk = i / 2, r = i % 2;
        float x = 0.f;
#pragma unroll
        for (int b = 0; b < kBg; ++b) x = fmaf(kzero[kk][b], qs[r][b], fmaf(c[b][i], kscale[kk][b], x));
        x *= qdl[r];
        if constexpr (kEdge) {
          if (cap.cap > 0.f) x = cap(x);
          const int32_t kp = c0 + kMmaTile * j + g + 8 * kk;
          const bool vis = kp < sm.key_end[2 * t + r] && kp >= sm.key_first[2 * t + r];
          bad[r] = bad[r] || (vis && non_finite(x));
          s[j][i] = vis ? x : kNegInf;
        } else {
          nan_if_bad[r] = fmaf(x, 0.f, nan_if_bad[r]);
          s[j][i] = x;
        }
      }
    }
    // The online softmax of the lane's two rows: the max over the kSub x 16 keys (lanes g).
    float alpha[2], pr[kSub][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = fmaxf(s[0][r], s[0][r + 2]);
#pragma unroll
      for (int j = 1; j < kSub; ++j) mx = fmaxf(mx, fmaxf(s[j][r], s[j][r + 2]));
      for (int o = 4; o < kWarp; o *= 2) mx = fmaxf(mx, shfl_xor(mx, o));
      const float m_new = fmaxf(st.m[r], mx);
      // (no visible key yet: every weight 0; a steady iteration's keys are all visible)
      const float mu = kEdge && m_new == kNegInf ? 0.f : m_new;
      alpha[r] = fast_exp2(st.m[r] - mu);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        pr[j][r] = fast_exp2(s[j][r] - mu);
        pr[j][r + 2] = fast_exp2(s[j][r + 2] - mu);
        sum += pr[j][r] + pr[j][r + 2];
      }
      if constexpr (kEdge)
        st.l[r] = bad[r] ? kNaN : st.l[r] * alpha[r] + sum;
      else
        st.l[r] = st.l[r] * alpha[r] + sum + nan_if_bad[r];
      st.m[r] = m_new;
    }
    // The value weights' power of two per group over the iteration's visible
    // keys (keys before the block's first visible one may be pages never
    // written, chunks past its last are not copied): 2^14 <= max |value
    // scale| x it < 2^15, kept at the smallest so far (the accumulators are
    // rescaled when it moves; a power of two: exact).
    float ratio[kBg];
    {
      float mx = 0.f;
#pragma unroll
      for (int j = 0; j < kSub; ++j)
#pragma unroll
        for (int e0 = 0; e0 < kDecodeChunk * kBg; e0 += kWarp) {
          const int e = e0 + lane, kp = c0 + kMmaTile * j + e / kBg;
          if (e < kDecodeChunk * kBg && (!kEdge || (kp >= sm.first && kp < hi)))
            mx = fmaxf(mx, fabsf(fast_float(S[j].meta[2][e])));
        }
      for (int o = kWarp / 2; o >= kBg; o /= 2) mx = fmaxf(mx, shfl_xor(mx, o));
      const float up = mx > 0.f ? pow2_normalizer(mx) : kNoNormalizer;  // lane b: group b % kBg's
#pragma unroll
      for (int b = 0; b < kBg; ++b) {
        const float vup = fminf(st.vup[b], shfl(up, b));
        ratio[b] = vup * pow2_inverse(st.vup[b]);
        st.vup[b] = vup;
      }
    }
    // Rescale by the max's change and the normalizer's, once per iteration.
    float ar[kBg][2];
#pragma unroll
    for (int b = 0; b < kBg; ++b) ar[b][0] = alpha[0] * ratio[b], ar[b][1] = alpha[1] * ratio[b];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) st.acc[mt][i] *= ar[16 * mt / kGroup][i % 2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int b = 0; b < kBg; ++b) st.z[r][b] *= alpha[r];
    // Per chunk: the zeros and acc += V^T W^T.
    const auto times = [](float w, float x) { return !kEdge || w != 0.f ? w * x : 0.f; };
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      float vscale[2][kBg], vzero[2][kBg];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        meta_of(S[j], 2, g + 8 * kk, vscale[kk]);
        meta_of(S[j], 3, g + 8 * kk, vzero[kk]);
      }
      // Zeros: sum p x value zero per row and group (on the edge a weight of 0
      // skips its key: the meta of masked keys is whatever the stage held).
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int b = 0; b < kBg; ++b) st.z[r][b] += times(pr[j][r], vzero[0][b]) + times(pr[j][r + 2], vzero[1][b]);
      // The B fragments of P . V per group: w = p x value scale x vup as fp16 hi
      // + lo in the score layout (key g + 8 kk, rows 2t, 2t + 1: one 8x8 matrix
      // per kk), transposed to rows x keys (keys 2t, 2t + 1 of row g) by movmatrix.
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
      // Bytes 2g, 2g + 1 of the chunk's code rows 2t, 2t + 1 (pair 0) and 2t + 8, 2t + 9 (pair 1) per
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
          uint32_t av[4];  // rows g (byte 2g), g + 8 (byte 2g + 1); keys 2t.. then 2t + 8..
#pragma unroll
          for (int i = 0; i < 4; ++i) av[i] = codes_half2<kBits>(pw[i], pl);
          mma_16816(st.acc[mt], av, bh[b]);
          mma_16816(st.acc[mt], av, bl[b]);
        }
      }
    }
  }

  // ---- the block -----------------------------------------------------------------------------

  NKV_DEVICE void run() {
    const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);
    constexpr float kLn2 = 0.6931471805599453f;
    bool bad_len;
    if (!this->setup(bad_len) || this->no_keys(bad_len, kD)) return;
    if (threadIdx.x == 0) sm.flag = 0, sm.first = first;
    if (threadIdx.x < kRows) {  // row r's visible keys (rows past `rows`: positions no row reads)
      const int r = int(threadIdx.x);
      const int32_t qp = this->row_position(r);
      sm.key_end[r] = qp + 1 < hi ? qp + 1 : hi;
      sm.key_first[r] = this->row_first_key(qp);
    }
    NKV_SYNC();
    this->template fold_queries<kD, kBg, kRows>(sm, kRows);  // (ends with a barrier)
    copy_plan();
    // The lane's B fragments of q . K: row g's normalized query as a 16-bit
    // integer (2^14 <= max |q| < 2^15: round to nearest, at most 2^-15 of the
    // largest; the clamp only meets +-inf, whose row the group sums make
    // NaN), in two byte limbs, hi (s8) and lo (u8), channels 16 v + 4t + j in
    // byte j of unit v; then its rows' group sums and normalizers (x log2 e).
    QueryLimbs qf;
    {
      const float up = pow2_inverse(sm.qdown[g]);
#pragma unroll
      for (int v = 0; v < kKSteps; ++v) {
        uint32_t h = 0, l = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float x = fminf(fmaxf(rintf(sm.buf.q[g][16 * v + 4 * t + j] * up), -32768.f), 32767.f);
          const uint32_t q16 = uint32_t(int32_t(x));
          h |= ((q16 >> 8) & 0xffu) << (8 * j), l |= (q16 & 0xffu) << (8 * j);
        }
        qf.hi[v] = h, qf.lo[v] = l;
      }
    }
    NKV_SYNC();  // every warp has read sm.buf.q before the stages overlay it
    float qs[2][kBg], qdl[2];
    Rows st;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 2 * t + r;
#pragma unroll
      for (int b = 0; b < kBg; ++b) qs[r][b] = sm.qsum[row][b], st.z[r][b] = 0.f;
      qdl[r] = sm.qdown[row] * kLog2e;
      st.m[r] = kNegInf, st.l[r] = 0.f;
    }
#pragma unroll
    for (int b = 0; b < kBg; ++b) st.vup[b] = kNoNormalizer;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) st.acc[mt][i] = 0.f;

    // The keys every row of the block sees, [all_lo, all_hi): the chunks
    // inside run the steady loop, the others (and every chunk under a
    // soft-cap) the edge's.
    int32_t all_lo = first, all_hi = p.softcap > 0.f ? first : hi;
    for (int r = 0; r < rows; ++r) {
      all_lo = sm.key_first[r] > all_lo ? sm.key_first[r] : all_lo;
      all_hi = sm.key_end[r] < all_hi ? sm.key_end[r] : all_hi;
    }

    // The warp's chunks: keys lo + 16 warp + 64 i (lo is a multiple of 16), kSub an iteration.
    constexpr int32_t kStep = kMmaTile * kSub;                  // keys from one iteration's first to the next's
    constexpr int32_t kSpan = kStep - kMmaTile + kDecodeChunk;  // an iteration's first key to past its last
    const uint32_t stages = shared_address(&sm.buf.stage[warp][0][0]);
    const int32_t start = lo + kDecodeChunk * warp;
    if (start < hi) prefetch(start, stages);
    int sidx = 0;
    const auto stage_at = [&](int i) { return stages + uint32_t(i) * uint32_t(kSub * sizeof(Stage)); };
    const auto step = [&]<bool kEdge>(int32_t c0) {
      if (c0 + kStep < hi)
        prefetch(c0 + kStep, stage_at(sidx ^ 1));
      else
        cp_async_commit();  // an empty group keeps wait<1> meaning "this iteration's group is done"
      cp_async_wait<1>();
      __syncwarp();  // every lane's copies of the iteration are visible to the warp
      chunk<kEdge>(sm.buf.stage[warp][sidx], stage_at(sidx), c0, qf, qs, qdl, st);
      __syncwarp();  // every lane is done with the stage before the next prefetch refills it
      sidx ^= 1;
    };
    for (int32_t c0 = start; c0 < hi;) {
      if (c0 >= all_lo && c0 + kSpan <= all_hi) {
        do {  // the steady loop (benchmarks/cuda_budget.py counts it)
          step.template operator()<false>(c0);
          c0 += kStep;
        } while (c0 + kSpan <= all_hi);
      } else {
        step.template operator()<true>(c0);
        c0 += kStep;
      }
    }
    cp_async_wait<0>();

    // The warp's rows: the lanes' denominators and zeros summed over g.
#pragma unroll
    for (int r = 0; r < 2; ++r)
      for (int o = 4; o < kWarp; o *= 2) {
        st.l[r] += shfl_xor(st.l[r], o);
#pragma unroll
        for (int b = 0; b < kBg; ++b) st.z[r][b] += shfl_xor(st.z[r][b], o);
      }
    if (bad_block && lane == 0) atomic_or(&sm.flag, kBadBlock);
    NKV_SYNC();  // every warp is done with its stages: the merge area overlays them
    auto& M = sm.buf.merge;
    if (g == 0)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        M.m[warp][2 * t + r] = st.m[r], M.l[warp][2 * t + r] = st.l[r];
#pragma unroll
        for (int b = 0; b < kBg; ++b) M.z[warp][2 * t + r][b] = st.z[r][b];
      }
      // acc[mt][i]: channel 16 mt + 2g + i / 2 (the loads' order), row 2t + i % 2; / the group's normalizer.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const float down = pow2_inverse(st.vup[16 * mt / kGroup]);
#pragma unroll
      for (int i = 0; i < 4; ++i) M.acc[warp][2 * t + i % 2][16 * mt + 2 * g + i / 2] = st.acc[mt][i] * down;
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
    if (threadIdx.x == 0 && poisoned) report(a.status, sm.flag);
  }
};

}  // namespace nexuskv::cuda
