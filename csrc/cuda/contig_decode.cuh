// The contiguous KVCache's decode attention on tensor cores: the design of
// paged_decode.cuh (decode_warp.cuh: each of a block's 4 warps an attention of
// its own over its 16-key chunks, the softmax on the accumulator fragments,
// no block barrier in the loop) on the contiguous cache's compressed tokens,
// whose keys are scaled per channel over groups of tokens (KIVI's layout,
// the cache's default) where the pages scale them per token, or per token
// too (make_cache's key_axis -1: below).
//
// Keys per channel.  A score is sum_c q_c (code_c scale_c + zero_c) over the
// key group's per-channel scales and zeros: the scales go into the queries
// (q'_c = q_c scale_c), the zeros into one bias per row (q . zero).  A warp's
// iteration takes kSub consecutive chunks (16 kSub keys: 64 at 2 bits, 32 at
// 4, 16 at 8), which lie in one key group (its group_size a multiple of 16
// kSub, its first key one too), and folds that group for its 8 rows once:
// lane (g, t) takes row g's channels 16 v + 4t + j (its B fragments' own),
// q' normalized per row by a power of two times 32767 / 32768 (|q' up| <
// 32767: round to nearest, the nearest 16-bit integer, no clamp), in the two
// byte limbs of DecodeWarp::key_scores; the rows' 1 / up go to the lanes
// that hold their scores by shuffles (the biases, on fp16 / bf16 MMAs, land
// there: fold).  The scores are then the integer MMAs' hi x 256 + lo, times
// 1 / up, plus the bias: exact products, each q' rounded by at most 2^-16 of
// the row's largest |q'|.  That is coarser than attention_mma.cuh's 22-bit fold where
// keys lie far from their group's zeros in every channel at once (a score's
// rounding grows with its codes: keys offset by ~100 per token, fp16, err by
// 1.2 x the fp16 tolerance in emulation, where the 16-row kernel stays at 0.2
// x); offsets per channel, as real keys' outlier channels, go to the zeros,
// whose bias keeps 16 (bf16) or 22 (fp16) bits of q.  A scale that is not
// finite, or such a query, makes the rows' factor NaN (the fold's max keeps
// NaN: max_abs_nan), so every score of the group: the row NaN as in the CPU
// kernel; a zero that is not finite, the bias.  In steady iterations the
// integers go to attend as they are, the factor and the bias on the
// exponentials' FMA (one FMA a key), which checks them once a row.
//
// Keys per token (kTokenKeys: make_cache's key_axis=-1, scaled per token and
// group of channels, as on pages): contig_decode_token_keys_kernel, the
// scores of paged_decode.cuh (DecodeWarp::token_keys_iteration: q . code per
// group on the integer MMAs with the queries' limbs held for the block, x
// the key's group scale, + the zeros x the rows' sums of q on one MMA a
// chunk), the copies and the block of this file.
//
// Which bytes a block reads: per iteration and warp, the chunks' K and V
// code rows (one span each: kSub x 16 rows), their value scales and zeros
// ([16 kSub, Bg] each) and the key group's scale and zero rows ([D] each;
// keys per token: their scales and zeros, [16 kSub, Bg] each), all by
// cp.async into the warp's two stages.
//
// What it takes (decode_variant): fp16 / bf16 queries and meta, keys per
// channel in NQ groups (no DGQ) of a multiple of 16 kSub tokens or keys per
// token in as many groups as the values, values per token in 1, 2 or 4
// groups of a multiple of 16 channels, the same 2/4/8 bits, head_dim 64 or
// 128, no outliers, capacities a multiple of 16 kSub tokens (an iteration's
// copies stay in the buffers).  A block holds 8 query rows of
// a kv head (a decode step's GQA x q_len <= 8: one block); more rows take
// decode_row_blocks blocks per row tile of 16 (attention_common.cuh's unit,
// which the partials and the merge keep), each reading the keys and values
// again (from L2 where they run together): per row and key a fifth to a half
// of the 16-row kernel's instructions, whose 16 rows share one read.  Its
// blocks take the compressed tokens (splits [0, S)); the sinks and the tail,
// in full precision, go to one more split, S, run by attention_mma.cuh's
// kernel (AttentionLaunch::fp_split) before the merge.  Compiles; untested on
// a GPU (test_cuda_emulated.cpp runs it on the host against the CPU kernel).
#pragma once

#include <cstddef>

#include "decode_warp.cuh"

namespace nexuskv::cuda {

// The decode kernel's blocks per row tile (kAttnRows rows of a kv head): one
// per kDecodeRows of its rows (a tile's second one has none where the last
// tile holds 8 rows or fewer: it returns at once).
template <typename Params>
NKV_HOST_DEVICE int decode_row_blocks(const Params& p) {
  return p.rows_per_kv_head() > kDecodeRows ? kAttnRows / kDecodeRows : 1;
}
static_assert(kAttnRows % kDecodeRows == 0, "a row tile: whole decode blocks");

// What keys per channel keep apart from the stages (keys per token: none).
template <int kD, typename X>
struct ContigChannelKeys {
  X kmeta[kDecodeWarps][2][2][kD];  // per warp and stage: the iteration's key group's scales, zeros
  // The queries x a power of two per row (1 / it: qzdown) as the zeros' MMAs' B fragments: per
  // MMA v and lane (g, t), X {hi, hi, lo, lo} of row g's channels {c, c + 1}, {c + 4, c + 5} from
  // c = 32 (v / 2) + 8t + 2 (v % 2) (fold).
  uint4 qz[kD / 16][kWarp];
};
struct ContigTokenKeys {};

template <int kD, int kRB, typename X, int kBg, int kSub, bool kTokenKeys>
struct alignas(16) ContigDecodeSmem {
  DecodeBuffers<kD, kRB, X, kBg, kSub> buf;
  std::conditional_t<kTokenKeys, ContigTokenKeys, ContigChannelKeys<kD, X>> keys;
  float q[kDecodeRows][kD];        // the rows' queries x scale x log2 e (rotated), 0 past the rows
  float qzdown[kDecodeRows];       // 1 / the row's power of two (2^14 <= max |q| x it < 2^15)
  float qsum[kDecodeRows][kBg];    // keys per token: the row's sum of q x it over each key group
  int32_t key_first[kDecodeRows];  // the row's visible keys: [key_first, key_end) (compressed tokens)
  int32_t key_end[kDecodeRows];
  int32_t first;  // the block's earliest visible key
  uint32_t flag;
};

template <typename Launch, int kBits, int kD, int kBg, bool kTokenKeys>
struct ContigDecodeKernel
    : DecodeWarp<typename decltype(Launch::p)::Element, kBits, kD, kBg, kDecodeChunk,
                 ContigDecodeSmem<kD, int(core::row_bytes(kBits, kD)), typename decltype(Launch::p)::Element, kBg,
                                  decode_chunks_per_iteration(kBits), kTokenKeys>> {
  using X = typename decltype(Launch::p)::Element;
  using Smem =
      ContigDecodeSmem<kD, int(core::row_bytes(kBits, kD)), X, kBg, decode_chunks_per_iteration(kBits), kTokenKeys>;
  using Warp = DecodeWarp<X, kBits, kD, kBg, kDecodeChunk, Smem>;
  using typename Warp::Stage, typename Warp::Rows, typename Warp::QueryLimbs;
  using Warp::kRB, Warp::kKSteps, Warp::kSub, Warp::kRows, Warp::kStep, Warp::kLog2e, Warp::kRS;
  using Warp::sm, Warp::warp, Warp::lane, Warp::g, Warp::t, Warp::stage_row, Warp::meta_bits_float;
  static_assert(kSub * kRB == kD, "an iteration's code rows: kD 16-byte pieces a side (kSub kBits = 8)");
  // Blocks per SM the registers must allow (as paged_decode.cuh's; keys per token at 8 bits D128
  // in four groups 2, which spilled 8 bytes at 3 on sm_90: ~80 KB of copies in flight per SM).
  static constexpr int kMinBlocks = kBits == 2 ? (kD == 64 && kBg <= 2 ? 3 : 2)
                                    : kBg == 4 && kD == 128 && (kBits == 4 || kTokenKeys) ? 2
                                    : kBg == 4 || kD == 128                               ? 3
                                                                                          : 4;

  const Launch& L;
  const decltype(Launch::p)& p;
  const MmaIndex& ix;
  int32_t lo = 0, hi = 0;  // this split's compressed tokens
  float zdown[2];          // qzdown of the lane's score rows 2t, 2t + 1
  // Keys per token: the lane's limbs of q . K and its B fragment of the zeros' MMA (run).
  QueryLimbs qf;
  uint32_t zq = 0;
  // Keys per channel at 2 bits D64 in 2 or 4 value groups: the lane's queries of row g that fold
  // scales, channels 16 v + 4t + j (run), held for the block where the budget is the tightest
  // (elsewhere fold reads them from sm.q: at 4 and 8 bits the registers would spill, in one value
  // group at 2 bits D64 they would cost a block per SM, at D128 32 registers the budget does not need).
  static constexpr bool kHoldQueries = !kTokenKeys && kBits == 2 && kD == 64 && kBg >= 2;
  float qg[kHoldQueries ? kKSteps : 1][4];
  NKV_DEVICE float row_query(int v, int j) const {
    if constexpr (kHoldQueries)
      return qg[v][j];
    else
      return sm.q[g][16 * v + 4 * t + j];
  }

  NKV_DEVICE ContigDecodeKernel(const MmaLaunch<Launch>& args, Smem& smem)
      : Warp(smem), L(args.L), p(args.L.p), ix(args.ix) {}

  // ---- copies --------------------------------------------------------------------------------

  // An iteration's code rows: kSub x 16 rows a side from its first key, one
  // span of kD 16-byte pieces; lane l copies pieces l + 32 r (kD / 32 rounds),
  // row (l + 32 r) / kRowCopies, so that a round's destination lies a
  // compile-time distance from the lane's first (code_shift).  Its meta:
  // the value scales and zeros of its keys (2 kSub Bg pieces each) and the
  // key group's scale and zero rows (kD / 8 pieces each; keys per token:
  // the keys' scales and zeros, as the values'), piece l + 32 r of them lane
  // l's (copy_plan).
  static constexpr int kRowCopies = kRB / 16;
  static constexpr int kCodeRounds = kD / kWarp;
  static constexpr int kTokenArrays = kTokenKeys ? 4 : 2;  // meta arrays per token: the stage's last ones
  static constexpr int kValuePieces = 2 * kSub * kBg;      // of one such array
  static constexpr int kKeyPieces = kD / 8;                // of one key meta row (keys per channel)
  static constexpr int kMetaPieces = kTokenArrays * kValuePieces + (kTokenKeys ? 0 : 2 * kKeyPieces);
  static constexpr int kMetaRounds = (kMetaPieces + kWarp - 1) / kWarp;
  // Shared bytes from a lane's round-0 code piece to its round-r one.
  NKV_HOST_DEVICE static constexpr int code_shift(int r) {
    const int rows = kWarp / kRowCopies * r;  // rows on, even; below 16 past the last whole chunk
    return rows / kDecodeChunk * int(sizeof(Stage)) + rows % kDecodeChunk / 2 * kRS;
  }
  const uint8_t* k_src = nullptr;  // the lane's first code piece of key 0, in the keys' codes
  int64_t v_from_k = 0;            // bytes from there to the same piece in the values' codes
  int32_t code_dst = 0;            // its bytes from the first Stage's start
  // Per meta round: the source of the piece for key 0 (meta per token: the values', keys per
  // token's) or key group 0 (keys per channel's group rows), the bytes it moves per key or per
  // group, its bytes from the first Stage or the kmeta stage.
  const uint8_t* meta_src[kMetaRounds];
  uint32_t meta_step[kMetaRounds];
  int32_t meta_dst[kMetaRounds];
  bool meta_key[kMetaRounds], meta_on[kMetaRounds];

  NKV_DEVICE void copy_plan(int64_t bh) {
    const int row = lane / kRowCopies;
    k_src = p.k.codes + (bh * ix.key_tokens) * kRB + 16 * lane;
    v_from_k = (p.v.codes + bh * ix.value_tokens * kRB) - (p.k.codes + bh * ix.key_tokens * kRB);
    code_dst = int32_t(row / kDecodeChunk * sizeof(Stage) + offsetof(Stage, k_codes)) +
               stage_row(row % kDecodeChunk) * kRS + 16 * (lane % kRowCopies);
#pragma unroll
    for (int r = 0; r < kMetaRounds; ++r) {
      const int q = lane + kWarp * r;
      meta_on[r] = q < kMetaPieces;
      meta_key[r] = !kTokenKeys && q >= kTokenArrays * kValuePieces;
      if (!meta_key[r]) {  // per token: stage array 4 - kTokenArrays + arr, chunk j's [16, Bg] from its first key
        const int qt = meta_on[r] ? q : 0;  // (a round past the pieces: never issued, kept in bounds)
        const int arr = qt / kValuePieces, qq = qt % kValuePieces, j = qq / (2 * kBg);
        const int sa = 4 - kTokenArrays + arr;  // key scales (0), zeros (1), value scales (2), zeros (3)
        const X* base = sa == 0 ? p.k.scale : sa == 1 ? p.k.zero : sa == 2 ? p.v.scale : p.v.zero;
        const int64_t tokens = sa < 2 ? ix.key_tokens : ix.value_tokens;
        meta_src[r] = reinterpret_cast<const uint8_t*>(base + bh * tokens * kBg) + 16 * qq;
        meta_step[r] = uint32_t(kBg * sizeof(X));
        meta_dst[r] =
            int32_t(j * sizeof(Stage) + offsetof(Stage, meta) + sa * sizeof(Stage::meta[0])) + 16 * (qq % (2 * kBg));
      } else {  // key group scales (0), zeros (1): [D] each
        const int qk = meta_on[r] ? q - kTokenArrays * kValuePieces : 0, arr = qk / kKeyPieces;
        const int off = 16 * (qk % kKeyPieces);
        const X* base = arr == 0 ? p.k.scale : p.k.zero;
        meta_src[r] = reinterpret_cast<const uint8_t*>(base + bh * ix.key_groups * kD) + off;
        meta_step[r] = uint32_t(kD * sizeof(X));
        meta_dst[r] = int32_t(arr * kD * sizeof(X)) + off;
      }
    }
  }

  // Shared address of the warp's key meta of stage sidx.
  NKV_DEVICE uint32_t kmeta_at(int sidx) const {
    if constexpr (kTokenKeys)
      return 0u;  // (no key meta row)
    else
      return shared_address(&sm.keys.kmeta[warp][sidx][0][0]);
  }

  // Issues the copies of the iteration at key c0 (a multiple of 16 kSub, below
  // hi) into stage sidx at `stage` (one commit group).
  NKV_DEVICE void prefetch(int32_t c0, uint32_t stage, int sidx) {
    const uint8_t* src = k_src + int64_t(c0) * kRB;
    const uint32_t at = stage + uint32_t(code_dst);
    constexpr uint32_t kV = offsetof(Stage, v_codes) - offsetof(Stage, k_codes);
#pragma unroll
    for (int r = 0; r < kCodeRounds; ++r) {
      cp_async16(at + uint32_t(code_shift(r)), src + 16 * kWarp * r);
      cp_async16(at + uint32_t(code_shift(r)) + kV, src + v_from_k + 16 * kWarp * r);
    }
    const uint32_t group = kTokenKeys ? 0u : ix.key_group.div(uint32_t(c0)), km = kmeta_at(sidx);
#pragma unroll
    for (int r = 0; r < kMetaRounds; ++r)
      if (kMetaPieces % kWarp == 0 || meta_on[r])
        cp_async16((meta_key[r] ? km : stage) + uint32_t(meta_dst[r]),
                   meta_src[r] + (meta_key[r] ? group : uint32_t(c0)) * meta_step[r]);
    cp_async_commit();
  }

  // ---- the chunk -----------------------------------------------------------------------------

  // The key group's fold for the lane's row g (see the top of this file): its
  // B fragments of q . K, and for the lane's score rows 2t + r the factor
  // from the MMAs' integers to scores and the bias (q . zero).  The bias
  // runs on fp16 / bf16 MMAs (m16n8k16: A the zeros as loaded, B the rows'
  // queries in two terms, sm.keys.qz; their rows 2t, 2t + 1 land in the lane's
  // own result), in place of 2 conversions, an FFMA a channel and 4 shuffles:
  // one 16-byte load a lane per 32 channels (channels 32 w + 8t .. + 7: the
  // A registers of rows g and g + 8, k slots 2t, 2t + 1 and 2t + 8, 2t + 9)
  // feeds two MMAs, whose row g (first) and row g + 8 (second) read channels
  // 8t + {0, 1, 4, 5} and 8t + {2, 3, 6, 7} (zero_queries lays B out so); each
  // one's other row is discarded.
  NKV_DEVICE void fold(int sidx, QueryLimbs& qf, float (&down)[2], float (&bias)[2]) const {
    constexpr float kSafe = 32767.f / 32768.f;  // |q' up| < 2^15 kSafe = 32767: no rounding to 2^15
    // x + 1.5 x 2^23, rounded to float, holds x rounded to the nearest integer (ties to even) in
    // its low 22 bits for |x| < 2^22: one FFMA in place of a multiply and a conversion (F2I)
    constexpr float kRound = 12582912.f;
    const X* ks = &sm.keys.kmeta[warp][sidx][0][0];
    const X* kz = &sm.keys.kmeta[warp][sidx][1][0];
    float x[kKSteps][4], mx = 0.f, za[4] = {0.f, 0.f, 0.f, 0.f}, zb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int v = 0; v < kKSteps; ++v) {
      const uint2 sw = *reinterpret_cast<const uint2*>(ks + 16 * v + 4 * t);
      const uint32_t s[2] = {sw.x, sw.y};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        x[v][j] = row_query(v, j) * meta_bits_float(j % 2 ? s[j / 2] >> 16 : s[j / 2] & 0xffffu);
        mx = max_abs_nan(mx, x[v][j]);
      }
    }
#pragma unroll
    for (int w = 0; w < kD / 32; ++w) {
      const uint4 z = *reinterpret_cast<const uint4*>(kz + 32 * w + 8 * t);
      const uint32_t a[4] = {z.x, z.y, z.z, z.w};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint4 f = sm.keys.qz[2 * w + half][lane];
        const uint32_t bh[2] = {f.x, f.y}, bl[2] = {f.z, f.w};
        mma_16816<std::is_same_v<X, core::bf16_t>>(half ? zb : za, a, bh);
        mma_16816<std::is_same_v<X, core::bf16_t>>(half ? zb : za, a, bl);
      }
    }
    // the row's max over its 4 lanes t
#pragma unroll
    for (int o = 1; o < 4; o *= 2) mx = max_abs_nan(mx, shfl_xor(mx, o));
    const float p2 = pow2_normalizer(mx), up = p2 * kSafe;             // (NaN, inf, 0: 1)
    const float dn = fmaf(mx, 0.f, pow2_inverse(p2) * (1.f / kSafe));  // NaN where the max is not finite
#pragma unroll
    for (int v = 0; v < kKSteps; ++v) {
      int32_t i[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) i[j] = int32_t(core::float_bits(fmaf(x[v][j], up, kRound)));
      this->limbs_of(i, qf.hi[v], qf.lo[v]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) down[r] = shfl(dn, 4 * (2 * t + r)), bias[r] = (za[r] + zb[2 + r]) * zdown[r];
  }

  // One iteration (DecodeWarp::loop): kSub chunks of 16 keys at c0 + 16 j
  // from stages S[j]; keys per channel: in one key group (key meta: stage
  // sidx's kmeta); keys per token: DecodeWarp::token_keys_iteration, zdown the
  // rows' 1 / normalizer.  kEdge: masked and capped (see DecodeWarp::token_keys_iteration);
  // a steady iteration returns false, having changed nothing, where a value
  // scale would move the value normalizer.
  template <bool kEdge>
  NKV_DEVICE bool chunk(const Stage (&S)[kSub], uint32_t stages, int sidx, int32_t c0, Rows& st) const {
    if constexpr (kTokenKeys)
      return this->template token_keys_iteration<kEdge>(S, stages, c0, hi, qf, zq, zdown, p.softcap, st);
    else
      return channel_keys_iteration<kEdge>(S, stages, sidx, c0, st);
  }
  template <bool kEdge>
  NKV_DEVICE bool channel_keys_iteration(const Stage (&S)[kSub], uint32_t stages, int sidx, int32_t c0,
                                         Rows& st) const {
    if constexpr (!kEdge)
      if (!this->value_normalizer_holds(S, st)) return false;
    QueryLimbs qf;
    float down[2], bias[2];
    fold(sidx, qf, down, bias);
    float s[kSub][4];
    bool bad[2] = {false, false};
    const SoftCap cap(kEdge ? p.softcap * kLog2e : 0.f);  // on base-2 scores: the cap x log2 e
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      float c[1][4];
      this->template key_scores<1>(stages + uint32_t(j * sizeof(Stage)), qf, c);
      // (steady: the integers as they are, down and bias on attend's FMA)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        s[j][i] =
            kEdge ? this->edge_score(fmaf(c[0][i], down[i % 2], bias[i % 2]), cap, c0, j, i / 2, i % 2, bad) : c[0][i];
    }
    if constexpr (kEdge) {
      constexpr float kOne[2] = {1.f, 1.f}, kZero[2] = {0.f, 0.f};
      this->template attend<true>(S, stages, c0, hi, s, bad, kOne, kZero, st);
    } else {
      this->template attend<false, true>(S, stages, c0, hi, s, bad, down, bias, st);
    }
    return true;
  }

  // sm.qzdown from sm.q: thread (row tid / 16, part tid % 16) takes the row's
  // largest |q| over its kD / 16 channels; then keys per channel sm.keys.qz
  // (the normalizer, 2^14 <= max |q| up < 2^15, keeps the terms in fp16's
  // range; bf16 holds 16 significant bits of q, fp16 22), keys per token
  // sm.qsum (x the normalizer, a power of two: exact).  Ends with a barrier.
  NKV_DEVICE void zero_queries() {
    constexpr int kParts = kMmaThreads / kRows;  // 16
    const int tid = int(threadIdx.x), r = tid / kParts, part = tid % kParts;
    float mx = 0.f;
    for (int d = part; d < kD; d += kParts) mx = fmaxf(mx, fabsf(sm.q[r][d]));
#pragma unroll
    for (int o = 1; o < kParts; o *= 2) mx = fmaxf(mx, shfl_xor(mx, o));
    if (part == 0) sm.qzdown[r] = pow2_inverse(pow2_normalizer(mx));
    NKV_SYNC();
    if constexpr (kTokenKeys) {
      row_group_sums(sm.q, sm.qzdown, kRows, sm.qsum);
    } else {
      // (B of fold's bias MMA v: lane (g, t)'s k slots 2t, 2t + 1 and 2t + 8, 2t + 9 are row
      // g's channels c, c + 1 and c + 4, c + 5 from c = 32 (v / 2) + 8t + 2 (v % 2))
      for (int e = tid; e < kKSteps * kWarp; e += kMmaThreads) {
        const int v = e / kWarp, row = e % kWarp / 4, c = 32 * (v / 2) + 8 * (e % 4) + 2 * (v % 2);
        const float up = pow2_inverse(sm.qzdown[row]);
        uint32_t hi[2], lo[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t bits[2][2];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float x = sm.q[row][c + 4 * h + i] * up;
            bits[0][i] = this->float_to_x(x);
            bits[1][i] = this->float_to_x(x - meta_bits_float(bits[0][i]));
          }
          hi[h] = bits[0][0] | bits[0][1] << 16, lo[h] = bits[1][0] | bits[1][1] << 16;
        }
        sm.keys.qz[v][e % kWarp] = make_uint4(hi[0], hi[1], lo[0], lo[1]);
      }
    }
    NKV_SYNC();
  }

  // ---- the block -----------------------------------------------------------------------------

  NKV_DEVICE void run() {
    const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);
    // blockIdx.y: (kv head x row tile) x decode_row_blocks + the block's part of the tile; its
    // rows r0 .. r0 + rows - 1 of the kv head, its partial rows those of the tile from r0 % 16.
    const int parts = decode_row_blocks(p), tile = int(blockIdx.y) / parts;
    const int64_t b = blockIdx.z, h = tile / L.row_tiles, rt = tile % L.row_tiles, bh = b * p.kv_heads + h;
    const int64_t r0 = rt * kAttnRows + int(blockIdx.y) % parts * kRows, left = p.rows_per_kv_head() - r0;
    if (left <= 0) return;  // (the last tile's second block, past its rows: the merge reads none)
    const int rows = int(left < kRows ? left : kRows);
    float* const part = L.partials + L.partial_index(b, h, rt, blockIdx.x) + (r0 % kAttnRows) * (kD + 2);
    // Lengths (as block_setup): out of range, the block's rows are NaN.
    const int64_t comp = p.compressed_len(b), sink = p.sink_len(b), tail = p.tail_len(b);
    const int64_t cap = ix.key_tokens < ix.value_tokens ? ix.key_tokens : ix.value_tokens;
    const int64_t len = sink + comp + tail;
    const bool bad_len = comp < 0 || comp > cap || sink < 0 || sink > p.sink.capacity || tail < 0 ||
                         tail > p.tail.capacity || (len > 0 && len < p.q_len);
    // This split's compressed tokens: from the first the oldest query sees
    // (rounded down to 16 kSub), whole iterations of the block's 4 warps each.
    int64_t t_first = p.window > 0 ? len - p.q_len - p.window + 1 - sink : 0;
    t_first = t_first > 0 ? t_first / (kDecodeChunk * kSub) * (kDecodeChunk * kSub) : 0;
    const int64_t n = comp > t_first ? comp - t_first : 0, splits = gridDim.x;
    const int64_t span = core::ceil_div(core::ceil_div(n, splits), int64_t(kStep)) * kStep;
    const int64_t lo64 = t_first + int64_t(blockIdx.x) * span;
    lo = int32_t(lo64 < comp ? lo64 : comp);
    hi = int32_t(lo64 + span < comp ? lo64 + span : comp);
    if (bad_len || lo >= hi) {  // NaN rows; an empty partial for a split past the keys
      for (int e = int(threadIdx.x); e < rows * (kD + 2); e += kMmaThreads)
        part[e] = bad_len ? kNaN : e % (kD + 2) == kD ? kNegInf : 0.f;
      if (bad_len && threadIdx.x == 0) report(L.status, kBadLengths);
      return;
    }
    // The rows' queries (x scale x log2 e: base-2 scores), rotated when the cache is.
    const float* signs = p.rotation_signs;
    if (threadIdx.x == 0) sm.flag = 0;
    NKV_SYNC();
    if (signs)
      for (int d = int(threadIdx.x); d < kD; d += kMmaThreads)
        if (signs[d] != 1.f && signs[d] != -1.f) atomic_or(&sm.flag, kBadSigns);
    const float scale = p.scale * kLog2e;
    for (int e = int(threadIdx.x); e < kRows * kD; e += kMmaThreads) {
      const int r = e / kD, d = e % kD;
      float v = 0.f;
      if (r < rows) v = fast_float(p.q_row(b, h, r0 + r)[d]) * (signs ? signs[d] : 1.f);
      sm.q[r][d] = v;
    }
    NKV_SYNC();
    if (signs) fwht_rows(&sm.q[0][0], kRows, kD, [](int64_t) { return false; });
    const float norm = signs ? scale / sqrtf(float(kD)) : scale;
    for (int e = int(threadIdx.x); e < kRows * kD; e += kMmaThreads) (&sm.q[0][0])[e] *= norm;
    NKV_SYNC();
    zero_queries();
    // The rows' visible keys as compressed tokens (rows past `rows`: row 0's).
    if (threadIdx.x < kRows) {
      const int64_t r = r0 + (int(threadIdx.x) < rows ? int(threadIdx.x) : 0);
      const int64_t qp = len - p.q_len + r % p.q_len - sink;  // the query's position among the compressed tokens
      sm.key_end[threadIdx.x] = int32_t(qp + 1 < hi ? qp + 1 : hi);
      const int64_t kf = p.window > 0 ? qp - p.window + 1 : lo;
      sm.key_first[threadIdx.x] = int32_t(kf > lo ? kf : lo);
    }
    NKV_SYNC();
    int32_t all_lo = lo, all_hi = p.softcap > 0.f ? lo : hi, first = hi;
    for (int r = 0; r < rows; ++r) {
      all_lo = sm.key_first[r] > all_lo ? sm.key_first[r] : all_lo;
      all_hi = sm.key_end[r] < all_hi ? sm.key_end[r] : all_hi;
      first = sm.key_first[r] < first ? sm.key_first[r] : first;
    }
    if (threadIdx.x == 0) sm.first = first;
    copy_plan(bh);
#pragma unroll
    for (int r = 0; r < 2; ++r) zdown[r] = sm.qzdown[2 * t + r];
    if constexpr (kTokenKeys) {  // (row g's query as 16-bit integers in two limbs; its zeros' fragment)
      this->token_query_limbs(&sm.q[g][0], pow2_inverse(sm.qzdown[g]), qf);
      zq = this->zero_query_fragment();
    } else if constexpr (kHoldQueries) {
#pragma unroll
      for (int v = 0; v < kKSteps; ++v)
#pragma unroll
        for (int j = 0; j < 4; ++j) qg[v][j] = sm.q[g][16 * v + 4 * t + j];
    }
    Rows st;
    this->init(st);
    NKV_SYNC();  // sm.first
    // The warp's iterations: keys lo + 16 kSub warp + 64 kSub i (lo is a multiple of 16 kSub).
    this->loop(*this, lo + kDecodeChunk * kSub * warp, hi, all_lo, all_hi, st);
    this->merge(st, 0u, [&](int r) { return r < rows ? part + r * (kD + 2) : nullptr; });
    if (threadIdx.x == 0 && sm.flag != 0) report(L.status, sm.flag);
  }
};

// The kernels, keys per channel and keys per token (two names: the tools that
// read the SASS and profiles, benchmarks/cuda_budget.py and cuda_dynamic.py,
// tell them apart by name).
template <typename Launch, int kBits, int kD, int kBg>
NKV_KERNEL void __launch_bounds__(kMmaThreads, (ContigDecodeKernel<Launch, kBits, kD, kBg, false>::kMinBlocks))
    contig_decode_kernel(const NKV_GRID_CONSTANT MmaLaunch<Launch> a) {
  using K = ContigDecodeKernel<Launch, kBits, kD, kBg, false>;
  NKV_DYNAMIC_SMEM(smem);
  K(a, *reinterpret_cast<typename K::Smem*>(smem)).run();
}
template <typename Launch, int kBits, int kD, int kBg>
NKV_KERNEL void __launch_bounds__(kMmaThreads, (ContigDecodeKernel<Launch, kBits, kD, kBg, true>::kMinBlocks))
    contig_decode_token_keys_kernel(const NKV_GRID_CONSTANT MmaLaunch<Launch> a) {
  using K = ContigDecodeKernel<Launch, kBits, kD, kBg, true>;
  NKV_DYNAMIC_SMEM(smem);
  K(a, *reinterpret_cast<typename K::Smem*>(smem)).run();
}

// The decode kernel variant that takes L (see the top of this file), opted in
// to its shared memory; kernel == nullptr where none takes it.  Host only.
template <typename Launch>
MmaVariant<Launch> decode_variant(const Launch& L) {
  using Params = decltype(Launch::p);
  using T = typename Params::Element;
  constexpr bool kTypes = (std::is_same_v<T, core::bf16_t> ||
                           std::is_same_v<T, core::half_t>)&&std::is_same_v<typename Params::MetaType, T>;
  MmaVariant<Launch> v;
  if constexpr (kTypes) {
    const Params& p = L.p;
    const auto& kd = p.k.dims;
    const auto& vd = p.v.dims;
    const int64_t D = p.head_dim, bg = vd.meta_b();
    if (!(kd.bits == 2 || kd.bits == 4 || kd.bits == 8) || vd.bits != kd.bits || !(D == 64 || D == 128)) return v;
    const int64_t align = kDecodeChunk * decode_chunks_per_iteration(kd.bits);  // an iteration's keys
    auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; };
    // per token (values; keys with key_axis -1): 1, 2 or 4 groups of a multiple of 16 channels
    // (group sizes a multiple of 16 even where one group holds every channel: what the
    // full-precision split's kernel, attention_mma.cuh's, has always been run with)
    const auto token_groups = [&](const core::NQDims& d) {
      return d.axis == core::GroupAxis::kChannels && d.segment_starts == nullptr && d.num_outliers == 0 &&
             d.group_size % 16 == 0 && (bg == 1 || bg == 2 || bg == 4) && D % (16 * bg) == 0 &&
             (bg == 1 ? d.group_size >= D : d.group_size * bg == D) && d.tokens % align == 0;
    };
    const bool token_keys = kd.axis == core::GroupAxis::kChannels;  // (as many groups as the values)
    const bool keys = token_keys ? token_groups(kd) && kd.meta_b() == bg
                                 : kd.axis == core::GroupAxis::kTokens && kd.segment_starts == nullptr &&
                                       kd.group_size % align == 0 && kd.num_outliers == 0 && kd.tokens % align == 0;
    const bool values = token_groups(vd);
    const bool buffers = aligned(p.k.codes) && aligned(p.v.codes) && aligned(p.k.scale) && aligned(p.k.zero) &&
                         aligned(p.v.scale) && aligned(p.v.zero);
    // 32-bit key positions (MmaIndex; an iteration's next first key, up to 256 on, included) and
    // 32-bit byte offsets into a (batch, head)'s meta rows (prefetch); the fp split runs
    // attention_mma.cuh's kernel, whose own limits (mma_variant) these imply
    constexpr int64_t kMax = core::kFastDivmodLimit - 4 * kMmaTile, k4G = int64_t(1) << 32;
    const bool fits = kd.tokens + kd.group_size < kMax && vd.tokens < kMax && p.batch * p.kv_heads < kMax &&
                      vd.tokens * bg * int64_t(sizeof(T)) < k4G && kd.groups_per_row() * int64_t(sizeof(T)) < k4G;
    // (grid.y: kv heads x row tiles x decode_row_blocks, below 2^16)
    const bool grid = p.kv_heads * L.row_tiles * decode_row_blocks(p) < 65536;
    if (!keys || !values || !buffers || !fits || !grid) return v;
    core::layout::with_bits(kd.bits, [&]<int kBits>() {
      if constexpr (kBits != 3) {
        with_head_dim(D, [&]<int kD>() {
          with_groups(bg, [&]<int kBg>() {
            const auto pick = [&]<bool kTokenKeys>(auto kernel) {
              const size_t smem = sizeof(typename ContigDecodeKernel<Launch, kBits, kD, kBg, kTokenKeys>::Smem);
              // (this GPU has less shared memory: another kernel runs)
              if (smem_fits(kernel, smem)) v.kernel = kernel, v.smem = smem;
            };
            if (token_keys)
              pick.template operator()<true>(contig_decode_token_keys_kernel<Launch, kBits, kD, kBg>);
            else
              pick.template operator()<false>(contig_decode_kernel<Launch, kBits, kD, kBg>);
          });
        });
      }
    });
  }
  return v;
}

// Launches the decode kernel, which decode_variant(L) found to take the
// problem, over `splits` splits of the compressed tokens (partials 0 ..
// splits - 1); returns a cudaError_t of the set-up, 0 if none.
template <typename Launch>
int launch_contig_decode(const Launch& L, int64_t splits, Stream stream) {
  const MmaVariant<Launch> v = decode_variant(L);
  if (v.kernel == nullptr) return int(cudaErrorInvalidDeviceFunction);
  const Dim3 grid(unsigned(splits), unsigned(L.p.kv_heads * L.row_tiles * decode_row_blocks(L.p)), unsigned(L.p.batch));
  launch(v.kernel, grid, Dim3(kMmaThreads), v.smem, stream, MmaLaunch<Launch>{L, mma_index(L)});
  return 0;
}

}  // namespace nexuskv::cuda
