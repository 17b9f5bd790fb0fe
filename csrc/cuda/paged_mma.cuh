// The paged attention on tensor cores: attention_mma.cuh's design on the
// pages of paged_format.h (vLLM's block table), for the common formats.
//
// Which bytes are read.  Per 64-key tile of one (request, kv head) the four
// 16-key chunks of the tile each lie in one head page (P % 16 == 0 and tiles
// start at multiples of 16), where their K codes, V codes and the four [16,
// Bg] meta rows (key scale, key zero, value scale, value zero) are contiguous:
// all of it goes by 16-byte cp.async into shared memory, two stages, the next
// tile's copies in flight during this tile's math.  One tile serves every
// query row of the block: up to 16 rows = (tokens of one request) x (q heads
// of the GQA group), so a decode step reads each page once per kv head.
// Decode steps whose GQA group fits 8 rows take row tiles of 8
// (core::paged_tile_rows) and run paged_decode.cuh's kernel instead, designed
// for them (each warp its own keys, the softmax in registers); this one holds
// 16 rows (kNT = 2 n-tiles of 8).  In a step with longer requests (prefill
// chunks beside decode steps) the requests of one query token run that kernel
// too, in a launch of their own (PagedRequests, paged_mma_plan).
//
// Keys are quantized per token here (unlike the contiguous cache's per-channel
// keys), so the keys' scales lie on the M side of S^T = K . Q^T: the B
// fragments are the (rotated, scaled) queries alone, normalized per row by a
// power of two and split into fp16 hi + lo once per block (not once per key
// group); each key group's k-steps accumulate apart and are scaled by the
// key's group scale on the accumulator, plus zero x (sum of q over the group).
// P . V is attention_mma.cuh's: codes of two token rows per register, the
// weights p x value scale (normalized per tile and channel group) in fp16 hi +
// lo, the values' zeros summed per row and group by the softmax pass (in
// parts per lane pair, added up once after the last tile).
//
// Work split: a pre-pass (one block) checks query_start_loc and numbers each
// request's row tiles (tile_start); block (tile, kv head x head chunk, split)
// finds its request by binary search, and each split of the key range writes
// a partial (acc, max, sum) per (token, q head) row; the merge (one block per
// token and kv head x head chunk) combines the splits, divides, un-rotates and
// writes out, zeros for padding tokens (as the reference kernel does).
//
// It takes (paged_mma_takes, paged_mma_launch.cuh): fp16 / bf16, no exact window, no outliers, the
// same 2/4/8 bits for keys and values, head_dim 64 or 128 in 1, 2 or 4 groups
// of a multiple of 16 channels per token (group_size >= head_dim: one), 16-byte
// aligned pages, a block's pages (its kv heads') under 4 GiB (the decode
// kernel's 32-bit block stride); the rest runs the SIMT kernel
// (paged_kernels.cuh), which the tests compare it with
// (tests/python/test_cuda_paged.py).  Compiles; untested
// on a GPU until a lent one runs benchmarks/gpu_check.sh (on the host,
// emulated, it matches the CPU kernel: tests/cpp/test_cuda_emulated.cpp).
#pragma once

#include <cstddef>

#include "attention_mma.cuh"
#include "nexuskv/core/paged.h"
#include "nexuskv/core/paged_split.h"
#include "nexuskv/core/split_plan.h"

namespace nexuskv::cuda {

static_assert(core::kPagedTileRows == kAttnRows && core::kPagedDecodeTileRows == 8 && core::kPagedKeyTile == kMmaTile,
              "paged_split.h's sizes");

// Which requests a launch's blocks take: all, by row tiles (tile_start); only
// those of one query token, one block each (blockIdx.x: the request; a block
// whose request has another count returns); or all but those (tile_start
// counts no tile for them).  A step with requests of several tokens runs the
// last two side by side where the GQA group fits 8 rows (paged_mma_plan): its
// decode requests on the decode kernel's 8 rows, not on half-empty 16-row tiles.
enum class PagedRequests : int { kAll, kSingleToken, kMultiToken };

// Sizes the kernels index with, computed by the host (32-bit, no division by a
// run-time size in the tile loop: benchmarks/cuda_budget.py counts it).
struct PagedMmaIndex {
  core::FastDivmod block;  // P: position -> (block-table column, slot)
  core::FastDivmod heads;  // heads per row tile: block row -> (token, q head)
  core::PagedOffsets off;  // buffer offsets of a head page
  int64_t head_page_bytes = 0;
  int64_t meta_array_bytes = 0;  // one [P, Bg] meta array of a head page
  int tokens_per_tile = 1, head_chunks = 1;
  int splits = 1;  // splits of each row tile's key range
  PagedRequests requests = PagedRequests::kAll;
};

// One launch: the problem, its index, and the scratch (paged_mma_scratch).
template <typename X>
struct PagedMmaArgs {
  core::PagedAttention<X> p;
  PagedMmaIndex ix;
  int32_t* tile_start = nullptr;  // [num_reqs + 1]: first row tile of each request, then the total
  uint32_t* bad = nullptr;        // [1]: query_start_loc invalid (every row NaN)
  float* partials = nullptr;      // [num_tokens, q_heads, splits, D + 2]
  uint32_t* status = nullptr;

  NKV_HOST_DEVICE float* partial(int64_t token, int hq, int split) const {
    return partials + ((token * p.q_heads + hq) * ix.splits + split) * (p.pool.layout.head_dim + 2);
  }
};

// Byte offsets of the scratch arrays (256-byte aligned).
struct PagedMmaScratch {
  int64_t tile_start = 0, bad = 0, partials = 0, bytes = 0;
};
inline PagedMmaScratch paged_mma_scratch(int64_t num_reqs, int64_t num_tokens, int q_heads, int splits, int D) {
  auto up = [](int64_t b) { return (b + 255) / 256 * 256; };
  PagedMmaScratch s;
  s.bad = up(4 * (num_reqs + 1));
  s.partials = s.bad + 256;
  s.bytes = s.partials + up(4 * num_tokens * q_heads * splits * (D + 2));
  return s;
}

// ---- pre-pass: the row tiles of each request ---------------------------------------------------

constexpr int kPagedTilesThreads = 256;

// One block.  query_start_loc must start at 0, not decrease and end within
// num_tokens (else *bad); tile_start[r] = sum over r' < r of ceil(q_len(r') /
// tokens per tile) (0 for a request of one token under kMultiToken),
// tile_start[num_reqs] the total.
template <typename X>
NKV_KERNEL void paged_mma_tiles_kernel(const NKV_GRID_CONSTANT PagedMmaArgs<X> a) {
  __shared__ int64_t part[kPagedTilesThreads];
  __shared__ uint32_t bad;
  const int32_t* qsl = a.p.query_start_loc;
  const int64_t R = a.p.num_reqs, per = (R + kPagedTilesThreads - 1) / kPagedTilesThreads;
  const int64_t tpb = a.ix.tokens_per_tile, r0 = int64_t(threadIdx.x) * per;
  const int64_t r1 = r0 + per < R ? r0 + per : R;
  const bool multi = a.ix.requests == PagedRequests::kMultiToken;
  const auto tiles_of = [&](int64_t len) { return multi && len == 1 ? 0 : core::paged_request_tiles(len, int(tpb)); };
  if (threadIdx.x == 0) bad = qsl[0] != 0 || qsl[R] > a.p.num_tokens ? 1u : 0u;
  NKV_SYNC();
  int64_t sum = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t len = int64_t(qsl[r + 1]) - qsl[r];
    if (len < 0) atomic_or(&bad, 1u);
    sum += tiles_of(len);
  }
  part[threadIdx.x] = sum;
  NKV_SYNC();
  if (threadIdx.x == 0) {  // exclusive scan of the threads' counts (256 adds)
    int64_t run = 0;
    for (int i = 0; i < kPagedTilesThreads; ++i) {
      const int64_t c = part[i];
      part[i] = run;
      run += c;
    }
    if (run >= core::kFastDivmodLimit) bad = 1u;  // (q_end <= num_tokens < 2^31 keeps it below)
    a.tile_start[R] = int32_t(bad ? 0 : run);
    *a.bad = bad;
  }
  NKV_SYNC();
  int64_t run = part[threadIdx.x];
  for (int64_t r = r0; r < r1; ++r) {
    a.tile_start[r] = int32_t(bad ? 0 : run);
    run += tiles_of(int64_t(qsl[r + 1]) - qsl[r]);
  }
}

// ---- the block's work (both split kernels) -----------------------------------------------------

// What a block of the split kernels works on, the same on every thread: its
// request, query rows and key range (setup), where its rows' partials go, and
// its queries folded once (fold_queries).
template <typename X>
struct PagedBlockWork {
  const PagedMmaArgs<X>& a;
  const core::PagedAttention<X>& p;
  const PagedMmaIndex& ix;
  int h = 0, hq0 = 0, heads = 0;  // kv head, first q head, q heads of the row tile
  int64_t req = 0, token0 = 0;    // request, first token of the tile (a row of q)
  int rows = 0;                   // query rows (token-major: row = token * heads per tile + head)
  int32_t lo = 0, hi = 0;         // key positions of this split
  int32_t first = 0;              // the earliest visible key of the block's rows
  const int32_t* table = nullptr;

  NKV_DEVICE explicit PagedBlockWork(const PagedMmaArgs<X>& args) : a(args), p(args.p), ix(args.ix) {}

  NKV_DEVICE int hpt() const { return int(ix.heads.divisor); }  // q heads per row tile
  // Row r's partial (null for a row with no q head).
  NKV_DEVICE float* partial_of(int r) const {
    uint32_t tok, hd;
    ix.heads.divmod(uint32_t(r), tok, hd);
    if (r >= rows || int(hd) >= heads) return nullptr;
    return a.partial(token0 + tok, hq0 + int(hd), int(blockIdx.z));
  }
  // Row r's query position (r may be past rows: then a position the rows never read).
  NKV_DEVICE int32_t row_position(int r) const {
    const int32_t* qsl = p.query_start_loc;
    return int32_t(p.seq_lens[req] - (qsl[req + 1] - qsl[req])) + int32_t(token0 - qsl[req]) +
           int32_t(ix.heads.div(uint32_t(r)));
  }
  // The first key row r sees (its position - window + 1; 0 without a window).
  NKV_DEVICE int32_t row_first_key(int32_t qp) const { return p.window > 0 ? qp - int32_t(p.window) + 1 : 0; }

  // Finds the block's request, rows and key range; false when the block has
  // nothing to do (beyond the last tile, or query_start_loc invalid: the merge
  // makes every row NaN).  Sets `bad_len` when the request's lengths are invalid.
  NKV_DEVICE bool setup(bool& bad_len) {
    bad_len = false;
    if (*a.bad) return false;
    const int64_t R = p.num_reqs, x = blockIdx.x;
    const int32_t* qsl = p.query_start_loc;
    int64_t i0 = 0;                                    // the tile's first token in its request
    if (ix.requests == PagedRequests::kSingleToken) {  // x: the request, if it has one token
      if (x >= R || qsl[x + 1] - qsl[x] != 1) return false;
      req = x;
    } else {
      if (x >= a.tile_start[R]) return false;
      req = core::find_segment(a.tile_start, R, x);  // the last request whose tiles start at or before x
      i0 = (x - a.tile_start[req]) * ix.tokens_per_tile;
    }
    const int64_t qb = qsl[req], qlen = int64_t(qsl[req + 1]) - qb;
    const int64_t ntok = qlen - i0 < ix.tokens_per_tile ? qlen - i0 : ix.tokens_per_tile;
    const int gq = p.gqa_group(), chunk = int(blockIdx.y) % ix.head_chunks;
    h = int(blockIdx.y) / ix.head_chunks;
    const int head0 = chunk * hpt();
    heads = gq - head0 < hpt() ? gq - head0 : hpt();
    hq0 = h * gq + head0;
    token0 = qb + i0;
    rows = (int(ntok) - 1) * hpt() + heads;  // (heads < hpt only in a GQA group's last chunk: one token a tile)
    const int64_t len = p.seq_lens[req];
    bad_len = !(len >= qlen && len <= p.max_blocks * p.pool.layout.block_size);
    if (bad_len) return true;
    const int32_t qlo = int32_t(len - qlen + i0), qhi = qlo + int32_t(ntok) - 1;
    const core::PagedSplitRange range = core::paged_split_range(qlo, qhi, p.window, ix.splits, int(blockIdx.z));
    first = range.first, lo = range.lo, hi = range.hi;
    table = p.block_table + req * p.max_blocks;
    NKV_EMU_COUNT(paged_single_blocks, threadIdx.x == 0 && ix.requests == PagedRequests::kSingleToken);
    NKV_EMU_COUNT(paged_tile_blocks, threadIdx.x == 0 && ix.requests != PagedRequests::kSingleToken);
    return true;
  }

  // The partials of a block that reads no key: NaN rows when the lengths are
  // invalid (the merge propagates it), empty ones (max -inf, sum 0) for a split
  // past the rows' keys (a context shorter than splits x 64).  True when so.
  NKV_DEVICE bool no_keys(bool bad_len, int D) {
    const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);
    if (bad_len) {
      for (int e = int(threadIdx.x); e < rows * (D + 2); e += kMmaThreads)
        if (float* pr = partial_of(e / (D + 2))) pr[e % (D + 2)] = kNaN;
      if (threadIdx.x == 0) report(a.status, kBadLengths);
      return true;
    }
    if (lo >= hi) {
      for (int e = int(threadIdx.x); e < rows * (D + 2); e += kMmaThreads)
        if (float* pr = partial_of(e / (D + 2))) pr[e % (D + 2)] = e % (D + 2) == D ? kNegInf : 0.f;
      return true;
    }
    return false;
  }

  // The queries of the block's rows times the scale (and `factor`: the
  // decode kernel's log2 e), rotated when the pages are, into sm.buf.q; rows
  // without a q head are 0.  Then folded once: each of the first fold_rows
  // rows normalized by a power of two (2^14 <= max |q| < 2^15) and split into
  // fp16 hi + lo in the B fragments' order (sm.qfrag), 1 / normalizer into
  // sm.qdown, the normalized sum of q over each of the kBg key groups into
  // sm.qsum (0 past fold_rows).  Ends with a barrier.
  template <int kD, int kBg, int kRows, typename Smem>
  NKV_DEVICE void fold_queries(Smem& sm, int fold_rows, float factor = 1.f) {
    constexpr int kKSteps = kD / 16;
    const float scale = p.scale * factor;
    const float* signs = p.rotation_signs;
    if (signs)
      for (int d = int(threadIdx.x); d < kD; d += kMmaThreads)
        if (signs[d] != 1.f && signs[d] != -1.f) atomic_or(&sm.flag, kBadSigns);
    for (int e = int(threadIdx.x); e < kRows * kD; e += kMmaThreads) {
      const int r = e / kD, d = e % kD;
      uint32_t tok, hd;
      ix.heads.divmod(uint32_t(r), tok, hd);
      float v = 0.f;
      if (r < rows && int(hd) < heads) {
        v = fast_float(p.q[(token0 + tok) * p.q_stride_t + int64_t(hq0 + int(hd)) * p.q_stride_h + d]) * scale;
        if (signs) v *= signs[d];
      }
      sm.buf.q[r][d] = v;
    }
    NKV_SYNC();
    if (signs) {
      fwht_rows(&sm.buf.q[0][0], kRows, kD, [](int64_t) { return false; });
      const float norm = 1.f / sqrtf(float(kD));
      for (int e = int(threadIdx.x); e < kRows * kD; e += kMmaThreads) (&sm.buf.q[0][0])[e] *= norm;
      NKV_SYNC();
    }
    // Thread (row r, part) folds 4 kKSteps / 8 fragment entries of row r, as fold_queries does.
    constexpr int kParts = 8, kItems = 4 * kKSteps / kParts;
    const int tid = int(threadIdx.x), r = tid / kParts, part = tid % kParts;
    if (r < fold_rows) {
      float x[kItems][4], mx = 0.f;
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        const int item = part + kParts * k, ks = item / 4, lt = item % 4;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          x[k][e] = sm.buf.q[r][b_channel(ks, lt, e)];
          mx = fmaxf(mx, fabsf(x[k][e]));
        }
      }
      const float up = fold_row_fragments<kKSteps>(x, mx, r, part, sm.qfrag);
      if (part == 0) sm.qdown[r] = pow2_inverse(up);
    }
    NKV_SYNC();
    // qsum[r][b] = normalizer x sum of q over key group b (a power of two: exact).
    row_group_sums(sm.buf.q, sm.qdown, fold_rows, sm.qsum);
    NKV_SYNC();  // buf.q is the stages' memory from here
  }
};

// ---- the split kernel ---------------------------------------------------------------------------

// kNT: the block's 8-row n-tiles of query rows (2; decode steps: paged_decode.cuh).
template <int kD, int kRB, typename X, int kBg, int kNT>
struct alignas(16) PagedMmaSmem {
  static constexpr int kRS = code_row_stride<kRB>();
  static constexpr int kRows = 8 * kNT;
  struct alignas(16) Stage {         // 16-byte aligned: the cp.async targets
    uint8_t k_codes[kMmaTile][kRS];  // packed K rows of the tile
    uint8_t v_codes[kMmaTile][kRS];  // packed V rows
    X meta[4][kMmaTile * kBg];       // key scale, key zero, value scale, value zero: [64, Bg] each
  };
  union {
    Stage stage[2];
    float q[kRows][kD];  // the block's queries, before they are folded (set-up only)
  } buf;
  uint4 qfrag[kNT][kD / 16][kWarp];    // normalized queries {hi, hi, lo, lo} per n-tile, k-step, lane
  float qsum[kRows][kBg];              // normalized sum of the row's q over each key group
  float qdown[kRows];                  // 1 / the row's normalizer
  float sc[kRows][kMmaTile];           // scores, then softmax weights
  float zpart[kRows][kBg][kWarp / 2];  // lane pairs' parts of sum p * value zero per value group
  float zacc[kRows][kBg];              // ... summed over the lanes (after the tile loop)
  // P . V weights {p x value scale x 2^k} as fp16 pairs hi + lo per value group and row, in
  // the B fragments' order: entry 4 kk + t holds {hi(q), hi(q + 4), lo(q), lo(q + 4)} of key
  // pairs q = 8 kk + t and q + 4, one 128-bit load a fragment (20 entries a row: the two rows a
  // quarter-warp reads lie on distinct banks).
  static constexpr int kWStride = kMmaTile / 16 * 4 + 4;
  uint4 w[kBg][kRows][kWStride];
  float vup[kBg], wdown[kBg];  // the weights' power of two per value group, and 1 / it
  float m[kRows], alpha[kRows];
  float lpart[kRows][kWarp];           // each lane's part of the row's softmax denominator (NaN: a bad score)
  int32_t qpos[kRows], kfirst[kRows];  // the row's position and first visible key
  uint32_t flag;
};

template <typename X, int kBits, int kD, int kBg, int kNT>
struct PagedMmaKernel : PagedBlockWork<X> {
  static constexpr int kRB = int(core::row_bytes(kBits, kD));
  static_assert(kRB % 16 == 0 && (kRB & (kRB - 1)) == 0, "code rows: whole 16-byte copies, a power of two");
  static constexpr int kKSteps = kD / 16;      // k-steps of q . K
  static constexpr int kMTiles = kD / 16 / 4;  // PV m-tiles per warp
  static constexpr int kChunks = kMmaTile / 16;
  static_assert(sizeof(X) == 2, "2-byte meta: the copy plan's strides (paged_mma_takes checks x_bytes)");
  static constexpr int kGroup = kD / kBg;          // channels per key / value group (G, or D when G >= D)
  static constexpr int kGroupSteps = kGroup / 16;  // k-steps per key group
  static_assert(kGroup % 16 == 0 && kBg * kGroup == kD, "whole groups of 16-channel k-steps");
  static_assert(kBg <= kMmaThreads / kWarp, "tile_scores: a warp per value group finds its normalizer");
  using Smem = PagedMmaSmem<kD, kRB, X, kBg, kNT>;
  static constexpr int kRows = Smem::kRows;  // query rows a block holds at most
  using Stage = typename Smem::Stage;
  static_assert(kNT == 2, "decode steps' 8-row tiles run PagedDecodeKernel (paged_decode.cuh)");
  // Blocks per SM the registers must allow: one group fits 5 at D64 and 4 at
  // D128, the others 3 (<= 168 registers).
  static constexpr int kMinBlocks = kBg == 1 ? (kD == 64 ? 5 : 4) : kMmaMinBlocks;

  using Work = PagedBlockWork<X>;
  using Work::a, Work::p, Work::ix, Work::h, Work::heads, Work::rows, Work::lo, Work::hi, Work::first, Work::table;
  using Work::partial_of;
  Smem& sm;
  const int warp, lane, g, t;
  const SoftCap softcap;

  NKV_DEVICE PagedMmaKernel(const PagedMmaArgs<X>& args, Smem& smem)
      : Work(args), sm(smem), warp(int(threadIdx.x) / kWarp), lane(int(threadIdx.x) % kWarp), g(lane / 4), t(lane % 4),
        softcap(args.p.softcap) {}

  // The n-tiles holding rows.
  NKV_DEVICE int ntiles() const { return rows <= 8 ? 1 : 2; }

  // ---- loads ---------------------------------------------------------------------------------

  // The copies of one 16-key chunk: its K and V code rows (kRB 16-byte pieces
  // each) and its four [16, Bg] meta rows (2 Bg pieces each).  Thread tid owns
  // code pieces tid, tid + 128, ... and meta pieces tid, tid + 128, ... of
  // every chunk of every tile, so where each of them comes from (bytes from the
  // chunk's first code row or first meta entry in the head page) and goes to
  // (bytes from the chunk's place in the stage) is worked out once per block
  // (copy_plan); a piece's kind, and so its strides, is known at compile time.
  static constexpr int kCodePieces = 2 * kRB, kMetaPieces = 4 * 2 * kBg;
  static constexpr int kCodeCopies = (kCodePieces + kMmaThreads - 1) / kMmaThreads;
  static constexpr int kMetaCopies = (kMetaPieces + kMmaThreads - 1) / kMmaThreads;
  int32_t code_src[kCodeCopies], code_dst[kCodeCopies];  // -1: no piece
  int32_t meta_src[kMetaCopies], meta_dst[kMetaCopies];

  NKV_DEVICE void copy_plan() {
#pragma unroll
    for (int i = 0; i < kCodeCopies; ++i) {
      const int e = int(threadIdx.x) + i * kMmaThreads;
      const int half = e / kRB, piece = e % kRB, row = 16 * piece / kRB, col = 16 * piece % kRB;
      code_src[i] = code_dst[i] = -1;
      if (e < kCodePieces) {
        code_src[i] = int32_t(ix.off.codes[half]) + 16 * piece;  // (a head page is < 2^31 bytes)
        code_dst[i] = int32_t((half ? offsetof(Stage, v_codes) : offsetof(Stage, k_codes)) + row * Smem::kRS + col);
      }
    }
#pragma unroll
    for (int i = 0; i < kMetaCopies; ++i) {
      const int m = int(threadIdx.x) + i * kMmaThreads, arr = m / (2 * kBg), piece = m % (2 * kBg);
      meta_src[i] = meta_dst[i] = -1;
      if (m < kMetaPieces) {
        meta_src[i] = int32_t(ix.off.scale[0] + arr * ix.meta_array_bytes) + 16 * piece;
        meta_dst[i] = int32_t(offsetof(Stage, meta) + arr * sizeof(Stage::meta[0])) + 16 * piece;
      }
    }
  }

  // Issues the copies of tile [t0, t0 + kMmaTile) into stage st (one commit
  // group): the chunks that start before hi.  Lane c of each warp finds chunk
  // c's head page (none when its block id is outside the pool: kBadBlock, since
  // every chunk from the aligned first key on holds a visible key) and slot;
  // the other lanes take them by shuffle.
  NKV_DEVICE void prefetch(int32_t t0, int st) {
    const uint32_t stage = shared_address(&sm.buf.stage[st]);
    uint64_t my_page = 0;  // the head page's address; 0: no copies
    uint32_t col = 0, my_slot = 0;
    if (lane < kChunks) {
      const int32_t c0 = t0 + 16 * lane;
      ix.block.divmod(uint32_t(c0), col, my_slot);
      if (c0 < hi) {
        const int32_t id = table[col];
        if (id >= 0 && id < p.pool.num_blocks)
          my_page = reinterpret_cast<uint64_t>(p.pages + (int64_t(id) * p.pool.kv_heads + h) * ix.head_page_bytes);
        else
          atomic_or(&sm.flag, kBadBlock);
      }
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint32_t lo32 = __shfl_sync(0xffffffffu, uint32_t(my_page), c);
      const uint32_t hi32 = __shfl_sync(0xffffffffu, uint32_t(my_page >> 32), c);
      const int32_t slot = __shfl_sync(0xffffffffu, int32_t(my_slot), c);
      if ((lo32 | hi32) == 0) continue;  // (the same on every lane)
      const uint8_t* page = reinterpret_cast<const uint8_t*>((uint64_t(hi32) << 32) | lo32);
      const uint8_t* codes = page + slot * kRB;       // the chunk's first code row
      const uint8_t* meta = page + slot * (2 * kBg);  // its first meta entry (2-byte meta)
#pragma unroll
      for (int i = 0; i < kCodeCopies; ++i)
        if (code_src[i] >= 0) cp_async16(stage + code_dst[i] + c * (16 * Smem::kRS), codes + code_src[i]);
#pragma unroll
      for (int i = 0; i < kMetaCopies; ++i)
        if (meta_src[i] >= 0) cp_async16(stage + meta_dst[i] + c * (32 * kBg), meta + meta_src[i]);
    }
    cp_async_commit();
  }

  // ---- the tile ------------------------------------------------------------------------------

  NKV_DEVICE float meta_at(const Stage& S, int arr, int key, int b) const {
    return fast_float(S.meta[arr][key * kBg + b]);
  }

  // Scores of the tile's keys (n of them) into sm.sc: per key group, the
  // group's k-steps on tensor cores, then x the key's group scale + its zero x
  // the group's sum of q; x 1 / the row's normalizer.  Warp w also finds
  // value group w % kBg's power of two for the P . V weights (softmax): 2^14 <=
  // the tile's largest |value scale| x it < 2^15 (keys before the block's
  // first visible one may be pages never written: not counted); warps below
  // kBg store it.  (Every warp runs the same code: shuffles under a branch on
  // the warp would be compiled as divergent, with a WARPSYNC each.)
  NKV_DEVICE void tile_scores(const Stage& S, int32_t t0, int n) {
    {
      const int b = warp % kBg, j0 = first - t0 > 0 ? first - t0 : 0;
      float mx = 0.f;
      if (lane < n && lane >= j0) mx = fabsf(meta_at(S, 2, lane, b));
      if (lane + kWarp < n && lane + kWarp >= j0) mx = fmaxf(mx, fabsf(meta_at(S, 2, lane + kWarp, b)));
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, shfl_xor(mx, o));
      const float up = pow2_normalizer(mx);
      if (warp < kBg && lane == 0) sm.vup[b] = up, sm.wdown[b] = pow2_inverse(up);
    }
    const int key_a = 16 * warp + g, key_b = key_a + 8;
    float sacc[kNT][4] = {};
#pragma unroll
    for (int b = 0; b < kBg; ++b) {
      float c[kNT][4] = {};
#pragma unroll
      for (int ks = b * kGroupSteps; ks < (b + 1) * kGroupSteps; ++ks) {
        uint32_t af[4];
        key_codes_fragment<kBits>(S.k_codes, warp, g, t, ks, af);
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          if (nt >= ntiles()) break;
          const uint4 f = sm.qfrag[nt][ks][lane];
          const uint32_t fh[2] = {f.x, f.y}, fl[2] = {f.z, f.w};
          mma_16816(c[nt], af, fh);
          mma_16816(c[nt], af, fl);
        }
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        if (nt >= ntiles()) break;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = i < 2 ? key_a : key_b, r = 8 * nt + 2 * t + i % 2;
          sacc[nt][i] += c[nt][i] * meta_at(S, 0, key, b) + meta_at(S, 1, key, b) * sm.qsum[r][b];
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      if (nt >= ntiles()) break;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = i < 2 ? key_a : key_b, r = 8 * nt + 2 * t + i % 2;
        if (key < n && r < rows) sm.sc[r][key] = sacc[nt][i] * sm.qdown[r];
      }
    }
  }

  // Soft-cap, mask and online softmax of sm.sc [rows, n] at positions t0..;
  // the rescale into sm.alpha, the denominators and the sums p x value zero
  // per row and group in parts per lane (lpart, zpart: summed once, after the
  // tile loop); and the P . V weights of every row, once for all warps: p x
  // value scale x the group's power of two (sm.vup, tile_scores), fp16 hi +
  // lo in the B fragments' pairs of keys (w; 0 where masked, past n, or for
  // rows past rows: never written).  Warp w: rows w, w + 4, ... below
  // rows (at decode with 4 q heads a kv head, one row a warp, not four).
  NKV_DEVICE void softmax(const Stage& S, int32_t t0, int n) {
    float vup[kBg];
#pragma unroll
    for (int b = 0; b < kBg; ++b) vup[b] = sm.vup[b];
#pragma unroll 1
    for (int r = warp; r < rows; r += 4) {  // (the same on the warp; the weights of rows past rows stay 0)
      const int32_t qp = sm.qpos[r], kf = sm.kfirst[r];
      bool vis[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int j = lane + kWarp * hh;
        vis[hh] = j < n && t0 + j <= qp && t0 + j >= kf;
      }
      float w[2];
      const float alpha = softmax_row(sm.sc[r], vis, softcap, sm.m[r], sm.lpart[r][lane], w);
      if (lane == 0) sm.alpha[r] = alpha;
#pragma unroll
      for (int b = 0; b < kBg; ++b) {
        // (a weight of 0 skips its key: meta past the tile's keys is whatever the stage held)
        float z = (w[0] != 0.f ? w[0] * meta_at(S, 3, lane, b) : 0.f) +
                  (w[1] != 0.f ? w[1] * meta_at(S, 3, lane + kWarp, b) : 0.f);
        z += shfl_xor(z, kWarp / 2);  // (one step: half the parts, half the shared memory)
        if (lane < kWarp / 2) sm.zpart[r][b][lane] = sm.zpart[r][b][lane] * alpha + z;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int j = lane + kWarp * hh;
          const float wj = w[hh] != 0.f ? w[hh] * meta_at(S, 2, j, b) * vup[b] : 0.f;
          const float wn = shfl_xor(wj, 1);  // key j ^ 1's
          if ((lane & 1) == 0) {             // key pair j / 2 = 8 kk + 4 half + t
            const int pair = j / 2, half = pair % 8 / 4;
            uint32_t* e = reinterpret_cast<uint32_t*>(&sm.w[b][r][pair / 8 * 4 + pair % 4]);
            split_half2(wj, wn, e[half], e[2 + half]);
          }
        }
      }
    }
  }

  // acc = acc x alpha + W' . V for the tile: the value codes of each m-tile
  // extracted once and multiplied with every n-tile's weights (softmax).
  NKV_DEVICE void tile_values(const Stage& S, float (&acc)[kMTiles][kNT][4]) {
    float c[kNT][kMTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < kMmaTile / 16; ++kk) {
      uint32_t av[kMTiles][4];
      value_codes_fragments<kBits, kMTiles>(S.v_codes, g, t, warp * kMTiles, kk, av);
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        const int b = 16 * (warp * kMTiles + mi) / kGroup;  // the m-tile's value group
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          if (nt >= ntiles()) break;
          const uint4 f = sm.w[b][8 * nt + g][4 * kk + t];  // B fragment: key pairs 8 kk + t and + 4
          const uint32_t whi[2] = {f.x, f.y}, wlo[2] = {f.z, f.w};
          mma_16816(c[nt][mi], av[mi], whi);
          mma_16816(c[nt][mi], av[mi], wlo);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      if (nt >= ntiles()) break;
      float a_r[2];  // the rescale of rows 8 nt + 2t and + 1 (1 past rows)
#pragma unroll
      for (int i = 0; i < 2; ++i) a_r[i] = 8 * nt + 2 * t + i < rows ? sm.alpha[8 * nt + 2 * t + i] : 1.f;
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        const float down = sm.wdown[16 * (warp * kMTiles + mi) / kGroup];
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mi][nt][i] = acc[mi][nt][i] * a_r[i % 2] + c[nt][mi][i] * down;
      }
    }
  }

  // ---- the block -----------------------------------------------------------------------------

  NKV_DEVICE void run() {
    const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);
    bool bad_len;
    if (!this->setup(bad_len) || this->no_keys(bad_len, kD)) return;
    const int D = kD;
    if (threadIdx.x == 0) sm.flag = 0;
    for (int r = int(threadIdx.x); r < kRows; r += kMmaThreads) {
      const int32_t qp = this->row_position(r);
      sm.qpos[r] = qp;
      sm.kfirst[r] = this->row_first_key(qp);
      sm.m[r] = kNegInf, sm.alpha[r] = 1.f;
      for (int i = 0; i < kWarp; ++i) sm.lpart[r][i] = 0.f;
      for (int b = 0; b < kBg; ++b)
        for (int i = 0; i < kWarp / 2; ++i) sm.zpart[r][b][i] = 0.f;
    }
    // The weights of rows past rows stay 0 (softmax skips those rows).
    for (int e = int(threadIdx.x); e < int(sizeof(sm.w) / sizeof(uint4)); e += kMmaThreads)
      (&sm.w[0][0][0])[e] = make_uint4(0u, 0u, 0u, 0u);
    NKV_SYNC();
    copy_plan();
    this->template fold_queries<kD, kBg, kRows>(sm, 8 * ntiles());
    float acc[kMTiles][kNT][4] = {};

    if (lo < hi) prefetch(lo, 0);
    int st = 0;
    for (int32_t t0 = lo; t0 < hi; t0 += kMmaTile, st ^= 1) {
      const int n = hi - t0 < kMmaTile ? hi - t0 : kMmaTile;
      if (t0 + kMmaTile < hi)
        prefetch(t0 + kMmaTile, st ^ 1);
      else
        cp_async_commit();  // an empty group keeps wait<1> meaning "this tile's group is done"
      cp_async_wait<1>();
      NKV_SYNC();
      const Stage& S = sm.buf.stage[st];
      tile_scores(S, t0, n);
      NKV_SYNC();
      softmax(S, t0, n);
      NKV_SYNC();
      tile_values(S, acc);
      NKV_SYNC();  // every warp is done with the stage before it is refilled
    }
    cp_async_wait<0>();
    // The partials: acc + value zeros per group; max and the lanes' summed denominators.
    const bool poisoned = sm.flag != 0;
    for (int rr = 0; rr < kRows / 4; ++rr) {
      const int r = kRows / 4 * warp + rr;
      float l = sm.lpart[r][lane];
      for (int o = 16; o > 0; o /= 2) l += shfl_xor(l, o);
      if (lane == 0)
        if (float* pr = partial_of(r)) pr[D] = sm.m[r], pr[D + 1] = poisoned ? kNaN : l;
      for (int b = 0; b < kBg; ++b) {
        float z = lane < kWarp / 2 ? sm.zpart[r][b][lane] : 0.f;
        for (int o = kWarp / 4; o > 0; o /= 2) z += shfl_xor(z, o);
        if (lane == 0) sm.zacc[r][b] = z;
      }
    }
    NKV_SYNC();  // zacc of every row
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = 8 * nt + 2 * t + i % 2, ch = 16 * (warp * kMTiles + mi) + g + 8 * (i / 2);
          if (float* pr = partial_of(r)) pr[ch] = acc[mi][nt][i] + sm.zacc[r][ch / kGroup];
        }
    if (threadIdx.x == 0 && poisoned) report(a.status, sm.flag);
  }
};

}  // namespace nexuskv::cuda
