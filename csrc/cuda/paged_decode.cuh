// The paged attention of decode steps on tensor cores: one row tile of up to 8
// query rows (a request's GQA group, core::paged_tile_rows) per block, each of
// the block's 4 warps an attention of its own over every fourth 16-key chunk
// of the split's keys, merged once at the end (decode_warp.cuh: what it
// shares with the contiguous cache's decode kernel, contig_decode.cuh).
// Designed from the byte budget of benchmarks/cuda_budget.py: at decode the 8
// rows make an MMA's n side, so the per-tile work that does not scale with the
// bytes (block barriers, the scores' round trip through shared memory, a
// softmax row per warp, the page lookups of every chunk by every warp) was
// most of paged_mma.cuh's tile loop.
//
// A warp's iteration takes kSub of its chunks (4 at 2 bits, 2 at 4, 1 at 8),
// c0, c0 + 64, ..., all in registers but the copies:
//  - its pages: the warp looks up its own chunks' head pages (no shuffles, no
//    block barrier), a lane the page of one chunk (lane l chunk l % kSub),
//    and copies each chunk's K, V codes and four [16, Bg] meta rows by
//    cp.async into its own two stages (from pointers it holds into the head's
//    page of block 0); the next iteration's copies are in flight during this
//    one's math;
//  - S^T = K . Q^T per key group on DecodeWarp::key_scores's integer MMAs,
//    the queries' limbs held in registers for the whole block, then x the
//    key's group scale; + the keys' zeros x the rows' sums of q over each
//    group, on one m16n8k8 fp16 / bf16 MMA a chunk (A the zeros' meta bits as
//    loaded, B each sum in two terms: DecodeWarp::zero_query_fragment);
//  - the rows' normalizers (log2 e in the queries: powers of two) go into the
//    exponentials' FMA in steady iterations; the rest is DecodeWarp's
//    (softmax, P . V, value normalizer, steady and edge iterations, merge),
//    into partials in paged_mma.cuh's format (paged_mma_merge_kernel runs
//    after).
//
// Precision: keys and values exact as codes; queries (x log2 e) rounded to
// 16-bit integers after the row's power-of-two normalization (2^14 <= max |q|
// < 2^15: at most 2^-15 of the row's largest |q|, 16 times finer than fp16 for
// the large channels; the 16-row kernel splits them in fp16 hi + lo); q . K
// exact in int32, then one rounding to float; the zeros' sums of q in two
// terms (bf16: 16 bits, fp16: 22); weights hi + lo (~22 bits;
// one fp16 term, as FlashAttention's P, would err by 2^-11 of p x (value -
// its zero) per key, coherent over a group's channels, which the output's
// un-rotation gathers: past the bf16 tolerance's margin, not only fp16's);
// fp32 accumulation.  Compiles; untested on a GPU until a lent one runs
// benchmarks/gpu_check.sh (tests/python/test_cuda_paged.py compares it with
// float64 and with the SIMT kernel); on the host, emulated,
// it matches the CPU kernel in every format it takes (test_cuda_emulated.cpp).
#pragma once

#include <cstddef>

#include "decode_warp.cuh"
#include "paged_mma.cuh"

namespace nexuskv::cuda {

template <int kD, int kRB, typename X, int kBg, int kSub>
struct alignas(16) PagedDecodeSmem {
  DecodeBuffers<kD, kRB, X, kBg, kSub> buf;
  uint4 qfrag[1][kD / 16][kWarp];  // fold_queries's fp16 fragments (unused: the integer limbs come from buf.q)
  float qsum[kDecodeRows][kBg];    // normalized sum of the row's q over each key group
  float qdown[kDecodeRows];        // 1 / the row's normalizer
  int32_t key_first[kDecodeRows];  // the row's visible keys: [key_first, key_end)
  int32_t key_end[kDecodeRows];
  int32_t first;  // the block's earliest visible key (PagedBlockWork::first; fewer registers)
  uint32_t flag;
};

template <typename X, int kBits, int kD, int kBg>
struct PagedDecodeKernel
    : PagedBlockWork<X>,
      DecodeWarp<X, kBits, kD, kBg, kMmaTile,
                 PagedDecodeSmem<kD, int(core::row_bytes(kBits, kD)), X, kBg, decode_chunks_per_iteration(kBits)>> {
  using Smem = PagedDecodeSmem<kD, int(core::row_bytes(kBits, kD)), X, kBg, decode_chunks_per_iteration(kBits)>;
  using Warp = DecodeWarp<X, kBits, kD, kBg, kMmaTile, Smem>;
  using typename Warp::Stage, typename Warp::Rows, typename Warp::QueryLimbs;
  using Warp::kRB, Warp::kKSteps, Warp::kSub, Warp::kRows, Warp::kGroup, Warp::kStep, Warp::kLog2e;
  using Warp::sm, Warp::warp, Warp::lane, Warp::g, Warp::t, Warp::stage_row, Warp::meta_bits_float, Warp::float_to_x;
  // Blocks per SM the registers must allow: 4 (<= 128 registers); 3 (<= 168)
  // at four groups and at D128 (rows of 128 bytes at 8 bits), which spilled
  // 4-16 bytes at 128 (3 blocks keep ~55 KB in flight at 4 bits D128, ~110
  // KB at 8 bits); 2 (<= 255) at 4 bits D128 in four groups (8 bytes spilled
  // at 168 on sm_80) and at 2 bits but D64 in one or two groups (3), whose
  // four chunks an iteration spilled 8-40 bytes at the caps above (D64 in one
  // group 8 at 128 on sm_90): an iteration's copies in flight keep 32-48 KB
  // per SM with 2 blocks, 31-36 KB with 3 at D64.  (2 bits D128's stages,
  // 53-68 KB a block, allow 2 blocks on an A100, 3 on an H100/H200, 1 on
  // sm_86/89's 100 KB.)
  static constexpr int kMinBlocks = kBits == 2                            ? (kD == 64 && kBg <= 2 ? 3 : 2)
                                    : kBg == 4 && kD == 128 && kBits == 4 ? 2
                                    : kBg == 4 || kD == 128               ? 3
                                                                          : 4;

  using Work = PagedBlockWork<X>;
  using Work::a, Work::p, Work::ix, Work::h, Work::rows, Work::lo, Work::hi, Work::first, Work::table;
  using Work::partial_of;

  NKV_DEVICE PagedDecodeKernel(const PagedMmaArgs<X>& args, Smem& smem) : Work(args), Warp(smem) {}

  // ---- copies --------------------------------------------------------------------------------

  // The copies of an iteration: each chunk's K and V code rows (16 rows of
  // kRB bytes each, contiguous in the head page from the chunk's first slot:
  // 16 kRowCopies 16-byte pieces a side, piece q at byte 16 q) and its four
  // [16, Bg] meta rows (2 Bg pieces each).  Lane l copies for chunk j = l %
  // kSub alone, and looks its page up itself (one division and one table load
  // a lane an iteration, where every lane once looked up every chunk): pieces
  // i0 + L r of each side, i0 = l / kSub, L = 32 / kSub lanes a chunk, and
  // meta pieces i0 + L r; so that a round's piece lies a compile-time
  // distance from the lane's first on both sides (sources as pointers into
  // the head's page of block 0, worked out once per block).
  static constexpr int kRowCopies = kRB / 16, kMetaPieces = 4 * 2 * kBg;
  static constexpr int kLanes = kWarp / kSub;                             // L: the lanes of a chunk
  static constexpr int kCodeRounds = kDecodeChunk * kRowCopies / kLanes;  // a side's pieces per lane
  static constexpr int kMetaRounds = (kMetaPieces + kLanes - 1) / kLanes;
  static_assert(kWarp % kSub == 0 && kDecodeChunk * kRowCopies % kLanes == 0, "whole rounds of code pieces");
  static_assert(kLanes % kRowCopies == 0 && kLanes / kRowCopies % 2 == 0, "a round: an even number of rows on");
  static_assert(kLanes % (2 * kBg) == 0, "a round of meta pieces: whole meta arrays on");
  const uint8_t* code_src = nullptr;   // the lane's first K piece in block 0's head page, at slot 0
  const uint8_t* meta_src = nullptr;   // its first meta piece there
  int32_t code_dst = 0, meta_dst = 0;  // their bytes from the first Stage's start
  int32_t copy_key = 0;                // the lane's chunk's first key from the iteration's: 64 (l % kSub)
  uint32_t block_bytes = 0;            // bytes between a head's pages of two blocks (< 2^32: paged_mma_takes)
  bool bad_block = false;              // the lane met a block id outside the pool (the block is poisoned)

  NKV_DEVICE void copy_plan() {
    const uint8_t* head_pages = p.pages + int64_t(h) * ix.head_page_bytes;  // kv head h's page of block 0
    const int j = lane % kSub, i0 = lane / kSub;
    copy_key = kMmaTile * j;
    code_src = head_pages + ix.off.codes[0] + 16 * i0;
    code_dst = int32_t(j * sizeof(Stage) + offsetof(Stage, k_codes) + stage_row(i0 / kRowCopies) * Warp::kRS) +
               16 * (i0 % kRowCopies);
    block_bytes = uint32_t(int64_t(p.pool.kv_heads) * ix.head_page_bytes);
    const int arr = i0 / (2 * kBg), mp = i0 % (2 * kBg);  // (lanes past the meta pieces: never used)
    meta_src = head_pages + ix.off.scale[0] + arr * ix.meta_array_bytes + 16 * mp;
    meta_dst = int32_t(j * sizeof(Stage) + offsetof(Stage, meta) + arr * sizeof(Stage::meta[0])) + 16 * mp;
  }

  // Issues the copies of the iteration at key c0 into `stage` (one commit
  // group): chunk j at c0 + 64 j (none past the split's keys) into the j-th
  // Stage.  A block id outside the pool copies nothing and poisons the block
  // (every chunk from the aligned first key on holds a visible key).
  NKV_DEVICE void prefetch(int32_t c0, uint32_t stage, int /*sidx*/) {
    const int32_t key = c0 + copy_key;
    if (key < hi) {
      uint32_t col, slot;
      ix.block.divmod(uint32_t(key), col, slot);
      const uint32_t id = uint32_t(table[col]);
      if (id < uint32_t(p.pool.num_blocks)) {                           // (a negative id: above every count)
        const uint64_t page = uint64_t(id) * block_bytes;               // block id's head page from block 0's
        const uint8_t* k_src = code_src + page + slot * uint32_t(kRB);  // (< 2^31 bytes into the page)
        const uint8_t* v_src = k_src + (ix.off.codes[1] - ix.off.codes[0]);
        const uint32_t at = stage + uint32_t(code_dst);
        constexpr int kRowsOn = kLanes / kRowCopies / 2;  // stage rows from one round's piece to the next
        constexpr uint32_t kV = offsetof(Stage, v_codes) - offsetof(Stage, k_codes);
#pragma unroll
        for (int r = 0; r < kCodeRounds; ++r) {
          const uint32_t dst = at + uint32_t(r * kRowsOn * Warp::kRS);
          cp_async16(dst, k_src + 16 * kLanes * r);
          cp_async16(dst + kV, v_src + 16 * kLanes * r);
        }
        const uint8_t* m_src = meta_src + page + slot * uint32_t(2 * kBg);
        constexpr int kArraysOn = kLanes / (2 * kBg);  // meta arrays from one round's piece to the next
#pragma unroll
        for (int r = 0; r < kMetaRounds; ++r)
          if (kMetaPieces % kLanes == 0 || lane / kSub + kLanes * r < kMetaPieces)
            cp_async16(stage + uint32_t(meta_dst + r * kArraysOn * int(sizeof(Stage::meta[0]))),
                       m_src + int64_t(r * kArraysOn) * ix.meta_array_bytes);
      } else {
        bad_block = true;  // (reported once after the loop: no atomic in it)
      }
    }
    cp_async_commit();
  }

  // ---- the chunk -----------------------------------------------------------------------------

  // One iteration of the warp (DecodeWarp::loop): kSub chunks of 16 keys, at
  // c0 + 64 j, from stages S[j] (DecodeWarp::token_keys_iteration).
  template <bool kEdge>
  NKV_DEVICE bool chunk(const Stage (&S)[kSub], uint32_t stages, int /*sidx*/, int32_t c0, Rows& st) const {
    return this->template token_keys_iteration<kEdge>(S, stages, c0, hi, qf, zq, qdl, p.softcap, st);
  }

  // ---- the block -----------------------------------------------------------------------------

  // The lane's B fragments of q . K, its B fragment of the zeros' MMA, its rows' normalizers.
  QueryLimbs qf;
  uint32_t zq = 0;
  float qdl[2];

  NKV_DEVICE void run() {
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
    // (log2 e in the queries: base-2 scores, the rows' normalizers powers of two; ends with a barrier)
    this->template fold_queries<kD, kBg, kRows>(sm, kRows, kLog2e);
    copy_plan();
    // The lane's B fragments of q . K: row g's normalized query as a 16-bit
    // integer (2^14 <= max |q| < 2^15: round to nearest, at most 2^-15 of the
    // largest; the clamp only meets +-inf, whose row the group sums make
    // NaN), in two byte limbs, hi (s8) and lo (u8), channels 16 v + 4t + j in
    // byte j of unit v; then its rows' group sums and normalizers (x log2 e).
    this->token_query_limbs(&sm.buf.q[g][0], pow2_inverse(sm.qdown[g]), qf);
    NKV_SYNC();  // every warp has read sm.buf.q before the stages overlay it
    zq = this->zero_query_fragment();
#pragma unroll
    for (int r = 0; r < 2; ++r) qdl[r] = sm.qdown[2 * t + r];
    Rows st;
    this->init(st);

    // The keys every row of the block sees, [all_lo, all_hi): the chunks
    // inside run the steady loop, the others (and every chunk under a
    // soft-cap) the edge's.
    int32_t all_lo = first, all_hi = p.softcap > 0.f ? first : hi;
    for (int r = 0; r < rows; ++r) {
      all_lo = sm.key_first[r] > all_lo ? sm.key_first[r] : all_lo;
      all_hi = sm.key_end[r] < all_hi ? sm.key_end[r] : all_hi;
    }
    // The warp's chunks: keys lo + 16 warp + 64 i (lo is a multiple of 16), kSub an iteration.
    this->loop(*this, lo + kDecodeChunk * warp, hi, all_lo, all_hi, st);
    // (bad_block: by each lane that met one: a lane looks up its own chunks' blocks)
    this->merge(st, bad_block ? kBadBlock : 0u, [&](int r) { return partial_of(r); });
    if (threadIdx.x == 0 && sm.flag != 0) report(a.status, sm.flag);
  }
};

}  // namespace nexuskv::cuda
