// The fast CUDA fused-attention kernel: tensor cores on the packed codes.
//
// Which bytes are read.  Decode attention is memory-bound, so the kernel is
// built around reading each compressed byte once: per 64-key tile of one
// (sequence, kv head) the packed K and V codes (64 x row_bytes each, one
// contiguous span per tile, 16-byte cp.async copies into shared memory, two
// stages so that the next tile's copy overlaps this tile's math), the K
// scales/zeros of the key groups the tile touches (one [D] row each, also by
// cp.async) and the V scales/zeros of its 64 tokens (loaded a tile ahead into
// registers).  One tile serves every query row of the GQA group (all query
// heads of the kv head times all q_len positions, up to kAttnRows = 16 per
// block), so the cache is read once per kv head, not once per query head.
// Split-KV (flash-decoding, attention_common.cuh) gives every SM work when
// batch x kv_heads is small.  Sinks and tail (full precision) go through a
// SIMT path in tiles of kFpTile keys.
//
// Which units do the work, and why.
//   q . K^T on tensor cores as S^T = K . Q'^T (mma.m16n8k16, fp16 in, fp32
//     accumulate): A = 16 keys x 16 channels of raw codes, turned into exact
//     fp16 integers by the magic-number trick (one 32-bit word of a code row
//     holds a pair of codes in bytes 0 and 2 and another in bytes 1 and 3;
//     one LOP3 masks a plane's pair in place under 0x6400, giving 1024 +
//     2^shift code, one fma scales and unbiases it; the channels take the
//     order of the words' bytes, and the queries the same order:
//     b_channel); B = the queries with the key group's per-channel scales
//     folded in (Q' = q * scale, once per key group), written as two fp16
//     terms hi + lo after an exact power-of-two normalization per row, so
//     that the product carries ~22 significant bits (the tests bound it);
//     the zeros fold into one bias per row and group (q . zero).  The block
//     folds Q' once per key group into shared memory in the B fragments'
//     order (fold_queries), and every warp reads it there.  Keys are the M
//     side, so the 8-wide N side holds query rows: GQA 4 at q_len 1 fills
//     half of it, and nothing is wasted on M.
//   P . V on tensor cores as O^T = V^T . W^T: A = 16 channels x 16 keys of
//     value codes (bytes of two token rows per register, by PRMT, loaded
//     once for every plane of a chunk), B = the
//     softmax weights with the values' per-token scale folded in (W = p *
//     scale, normalized per tile and channel group, hi + lo in fp16); the
//     values' zeros are summed per row and channel group (sum p * zero, in
//     the softmax pass) and added once at the end, as the CPU kernel does.
//   Softmax, masks, soft-cap, outlier corrections (q * (exact - approx) for
//     key outliers, p * (exact - approx) for value outliers) and the
//     full-precision tiles run on the SIMT units in float32.
//
// What the tile loop may not do (benchmarks/cuda_budget.py counts its SASS
// against the tile's byte budget): divide by a run-time size (32-bit sizes
// and host-computed divisors in MmaIndex; --check-loop-division), spill
// (--check-spills), or leave one thread serially looping over the tile while
// the others wait.
//
// It takes the common formats only (mma_variant says which; else
// the caller runs the reference kernel, attention_simple.cuh, which the tests
// compare it with): keys per channel (NQ with group_size % 16 == 0, or DGQ),
// values per token with group_size % 16 == 0, the same 2/4/8 bits for both,
// head_dim 64 or 128, fp16 / bf16 queries and metadata.  As the decode
// kernel's full-precision split (fp_split >= 0: the sinks and the tail alone,
// launched only beside contig_decode.cuh's kernel, whose decode_variant took
// the compressed format) it takes any key and value layout.
#pragma once

#include "attention_common.cuh"

namespace nexuskv::cuda {

constexpr int kMmaTile = 64;      // keys per compressed tile (4 warps x 16)
constexpr int kMmaThreads = 128;  // 4 warps
// Key groups whose meta rows a stage holds: every group of a tile when groups
// have >= 32 tokens (NQ's 64 / 128, DGQ with a granule of 32); past them
// (groups of 16, short DGQ segments) tile_scores reloads the slots in rounds.
constexpr int kMmaGroupsInSmem = 4;
constexpr int kFpTile = 16;  // keys per full-precision (sink / tail) tile
// Blocks per SM the register budget must allow (128 registers a thread): with
// about 40-70 KB of shared memory a block, 3-4 blocks keep enough tiles in
// flight to cover the memory latency.
constexpr int kMmaMinBlocks = 3;

// Bytes between two code rows of a tile in shared memory.  The fragments read the same
// bytes of 8 rows (keys: lanes g = 0..7) or of 4 row pairs (values: lanes t = 0..3) at once;
// with rows of 32 or 64 bytes (8 or 16 banks) those rows share banks, 2-4 ways (ncu on an
// H200: 62 % of the kernel's shared-load wavefronts were conflicts at 4-bit D128).  16 more
// bytes per row (still 16-byte aligned for cp.async) put the 8 rows on distinct pairs of
// banks.  Rows of 16 bytes are conflict-free as they are; rows of 128 (8-bit D128) would be
// too with the pad, but 4 KB more per block would drop that variant from 3 to 2 blocks per SM.
template <int kRB>
constexpr int code_row_stride() {
  return kRB == 32 || kRB == 64 ? kRB + 16 : kRB;
}

// Shared memory of one block, for head_dim kD and row_bytes kRB.
template <int kD, int kRB, typename Meta>
struct alignas(16) MmaSmem {
  static constexpr int kBmMax = kD / 16;  // value channel groups per token (group_size >= 16)
  static constexpr int kRS = code_row_stride<kRB>();
  struct alignas(16) Stage {         // 16-byte aligned: the cp.async targets
    uint8_t k_codes[kMmaTile][kRS];  // packed K rows of the tile (kRB bytes used of each)
    uint8_t v_codes[kMmaTile][kRS];  // packed V rows
    Meta k_scale[kMmaGroupsInSmem][kD], k_zero[kMmaGroupsInSmem][kD];  // meta rows of the tile's key groups
    Meta v_scale[kMmaTile][kBmMax], v_zero[kMmaTile][kBmMax];          // per token and channel group
    int32_t key_group[kMmaTile];  // key group of each key of the tile (of the last key past n)
    int32_t v_max[kBmMax];        // bits of the largest value scale per channel group (>= 0 floats order as ints)
  };
  union {
    Stage stage[2];
    struct {
      float k[kFpTile][kD], v[kFpTile][kD];
    } fp;  // full-precision tiles (no compressed tile in flight then)
  } buf;
  float q[kAttnRows][kD];         // scaled (rotated) queries
  float oacc[kAttnRows][kD];      // SIMT part of the output: full-precision values, value outliers
  float zacc[kAttnRows][kBmMax];  // sum of p * value zero per channel group
  float sc[kAttnRows][kMmaTile];  // scores, then softmax weights
  uint4 qfrag[2][kD / 16]
             [kWarp];  // queries folded with a key group's scales: {hi, hi, lo, lo} per n-tile, k-step, lane
  float qdown[kAttnRows], qbias[kAttnRows];  // per row: 1 / the fold's normalizer, q . zero
  float m[kAttnRows], l[kAttnRows], alpha[kAttnRows];
  // Each lane's part of the softmax denominator of each row (the lanes of the
  // row's warp), rescaled with the row; NaN once the lane saw a non-finite
  // score; summed over the lanes once, after the last tile, into l.
  float lpart[kAttnRows][kWarp];
  int64_t qpos[kAttnRows];  // position of each query row
  uint32_t flag;
};

// ---- code extraction --------------------------------------------------------------------------

// Two codes as exact fp16 in one register: plane `plane` of the kBits-bit codes
// in bytes 0 and 2 of x (nq_format.h: channel 16 j + l of a chunk in byte l at
// bit offset kBits * j; bytes 1 and 3 of x are ignored).  The codes are masked
// in place under fp16 1024's bits (1024 + 2^(kBits plane) code, exact: < 2048),
// then scaled down and unbiased by one exact fma: two instructions a pair.
template <int kBits>
NKV_DEVICE uint32_t codes_half2(uint32_t x, int plane) {
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  const int shift = kBits * plane;
  return half2_unbias(and_or(x, (kMask | (kMask << 16)) << shift, 0x64006400u), shift);
}
// The same codes in one LOP3, as fp16 subnormals 2^(kBits plane - 24) code:
// masked in place, the exponent field zero (the codes' bits, 0 .. 7, lie in
// the significand's 10).  Exact, and a power of two per plane away from the
// codes: an MMA over one plane's codes computes 2^(kBits plane - 24) x its
// result (products and sums scale exactly; tensor cores take fp16 subnormal
// inputs as they are, the fp32 accumulators stay far above their own
// subnormals), which the caller takes out once at the end.
template <int kBits>
NKV_DEVICE uint32_t codes_subnormal_half2(uint32_t x, int plane) {
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  return x & ((kMask | (kMask << 16)) << (kBits * plane));
}
// 2^(24 - kBits plane): what undoes codes_subnormal_half2's unit.
template <int kBits>
NKV_HOST_DEVICE constexpr float subnormal_code_unit_inverse(int plane) {
  return float(1u << (24 - kBits * plane));
}

// The A fragment of q . K for the 16 keys of warp `warp` (rows 16 warp + g and
// + 8 of codes [kMmaTile][kRS], packed code rows in shared memory) at k-step ks
// (channels 16 ks ..): exact fp16 codes.  (g, t) = (lane / 4, lane % 4).  Lane t
// reads word t (bytes 4t .. 4t + 3) of its rows' chunk once for every plane: its
// k slots 2t, 2t + 1 are bytes 4t, 4t + 2 and slots 2t + 8, 2t + 9 bytes 4t + 1,
// 4t + 3 (q . k sums over the channels in any order: b_channel puts the
// queries in the same one).
template <int kBits, int kRS>
NKV_DEVICE void key_codes_fragment(const uint8_t (*codes)[kRS], int warp, int g, int t, int ks, uint32_t (&a)[4]) {
  constexpr int kC = core::layout::kChunkChannels<kBits>, kPlanes = core::layout::kPlanes<kBits>;
  static_assert(kRS % 4 == 0, "code rows hold whole words");
  const int chunk = (16 * ks) / kC, plane = ks % kPlanes;
  const uint32_t w0 = reinterpret_cast<const uint32_t*>(&codes[16 * warp + g][chunk * 16])[t];
  const uint32_t w1 = reinterpret_cast<const uint32_t*>(&codes[16 * warp + g + 8][chunk * 16])[t];
  a[0] = codes_half2<kBits>(w0, plane);
  a[1] = codes_half2<kBits>(w1, plane);
  a[2] = codes_half2<kBits>(w0 >> 8, plane);
  a[3] = codes_half2<kBits>(w1 >> 8, plane);
}

// The value codes of chunk `chunk` (16 bytes of each code row [kMmaTile][kRS])
// that lane (g, t) takes for keys 16 kk ..: bytes g and g + 8 of key pairs
// (j0, j0 + 1) and (j0 + 8, j0 + 9), j0 = 16 kk + 2t, a key in bytes 0 and 2 of
// each pair; every plane of the chunk (every m-tile it holds) extracts from
// them with codes_half2.
template <int kRS>
NKV_DEVICE void value_code_pairs(const uint8_t (*codes)[kRS], int g, int t, int chunk, int kk, uint32_t (&pairs)[4]) {
  const int j0 = 16 * kk + 2 * t;
  const uint8_t* c0 = &codes[0][chunk * 16];
  const auto pair = [&](int j, int c) { return uint32_t(c0[j * kRS + c]) | (uint32_t(c0[(j + 1) * kRS + c]) << 16); };
  pairs[0] = pair(j0, g);
  pairs[1] = pair(j0, g + 8);
  pairs[2] = pair(j0 + 8, g);
  pairs[3] = pair(j0 + 8, g + 8);
}

// The A fragments of P . V for the kMTiles m-tiles mt0 .. (channels 16 mt ..)
// and keys 16 kk .. of codes [kMmaTile][kRS]: exact fp16 codes.  m-tiles in one
// chunk (its planes) share the chunk's loads.
template <int kBits, int kMTiles, int kRS>
NKV_DEVICE void value_codes_fragments(const uint8_t (*codes)[kRS], int g, int t, int mt0, int kk,
                                      uint32_t (&av)[kMTiles][4]) {
  constexpr int kPlanes = core::layout::kPlanes<kBits>;
  uint32_t pairs[4];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
    const int mt = mt0 + mi;
    // mt0 is a multiple of kMTiles, and kMTiles and kPlanes are powers of two:
    // m-tile mi is the first of the warp's m-tiles in its chunk exactly where
    // mi % kPlanes == 0.
    if (mi % kPlanes == 0) value_code_pairs<kRS>(codes, g, t, mt / kPlanes, kk, pairs);
#pragma unroll
    for (int i = 0; i < 4; ++i) av[mi][i] = codes_half2<kBits>(pairs[i], mt % kPlanes);
  }
}

// Exponent e with 2^14 <= |x| 2^e < 2^15 for the largest |x| of a set (max
// finite, > 0), as the float 2^e; 1 for 0, subnormal or non-finite (NaN too).
// Every finite set reaches it (e >= -113: the largest floats too); sets below
// 2^-86 stop at 2^100 (their normalized values below 2^14).
NKV_DEVICE float pow2_normalizer(float max_abs) {
  // max_abs in [2^e, 2^(e+1)), e = E - 127 for its exponent field E (1..254: normal), and
  // 2^min(14 - e, 100) has the field min(268 - E, 227); a select, not a branch (the decode
  // kernels run it in their loops)
  const int E = int((float_bits(max_abs) >> 23) & 0xffu);
  const int field = 268 - E < 227 ? 268 - E : 227;
  const bool normal = max_abs >= 1.17549435e-38f && max_abs <= 3.40282347e38f;  // (not NaN, > 0)
  return normal ? bits_float(uint32_t(field) << 23) : 1.f;
}

// 1 / x for x = pow2_normalizer(...) (a power of two in [2^-113, 2^100]):
// exact, without the division routine.
NKV_DEVICE float pow2_inverse(float x) { return bits_float((254u << 23) - float_bits(x)); }

// The rows' sums of q over each of kBg groups of kD / kBg channels, x the
// row's normalizer (1 / down[r], a power of two: exact), by the block's
// threads: out[r][b] for rows r < live, 0 past them (shared memory; the
// keys-per-token zeros' queries).
template <int kD, int kBg, int kRows>
NKV_DEVICE void row_group_sums(const float (&q)[kRows][kD], const float (&down)[kRows], int live,
                               float (&out)[kRows][kBg]) {
  constexpr int kGroup = kD / kBg;
  for (int e = int(threadIdx.x); e < kRows * kBg; e += kMmaThreads) {
    const int r = e / kBg, b = e % kBg;
    float s = 0.f;
    for (int c = b * kGroup; c < (b + 1) * kGroup; ++c) s += q[r][c];
    out[r][b] = r < live ? s * pow2_inverse(down[r]) : 0.f;
  }
}

// x0, x1 as two fp16 pairs hi + lo (hi the nearest fp16, lo the nearest fp16 to
// the rest): ~22 significant bits for values normalized by pow2_normalizer.
NKV_DEVICE void split_half2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack_half2(x0, x1);
  lo = pack_half2(x0 - half_bits_to_float(uint16_t(hi & 0xffffu)), x1 - half_bits_to_float(uint16_t(hi >> 16)));
}

// Channel of element e (0..3) of the B fragment of lane 4 g + lt at k-step ks:
// the k slot 2 lt + (e % 2) + 8 (e / 2) that key_codes_fragment fills from
// byte 4 lt + 2 (e % 2) + e / 2 of the chunk's plane ks % kPlanes.
NKV_DEVICE int b_channel(int ks, int lt, int e) { return 16 * ks + 4 * lt + 2 * (e % 2) + e / 2; }

// One query row's B fragments (q . K, n side) by the 8 threads of the row
// (part 0..7): x[k][e] is the row's value at channel b_channel(ks, lt, e) of
// the thread's item = part + 8 k (ks = item / 4, lt = item % 4), mx the
// thread's largest |x|.  The row's max over its 8 threads gives a power of two
// `up` (2^14 <= max |x| up < 2^15), and x up goes to qfrag[r / 8][ks][4 (r %
// 8) + lt] as fp16 {hi, hi, lo, lo}.  Returns up.
template <int kKSteps>
NKV_DEVICE float fold_row_fragments(const float (&x)[4 * kKSteps / 8][4], float mx, int r, int part,
                                    uint4 (*qfrag)[kKSteps][kWarp]) {
#pragma unroll
  for (int o = 1; o < 8; o *= 2) mx = fmaxf(mx, shfl_xor(mx, o));
  const float up = pow2_normalizer(mx);
#pragma unroll
  for (int k = 0; k < 4 * kKSteps / 8; ++k) {
    const int item = part + 8 * k, ks = item / 4, lt = item % 4;
    uint32_t hi0, hi1, lo0, lo1;
    split_half2(x[k][0] * up, x[k][1] * up, hi0, lo0);
    split_half2(x[k][2] * up, x[k][3] * up, hi1, lo1);
    qfrag[r / 8][ks][4 * (r % 8) + lt] = make_uint4(hi0, hi1, lo0, lo1);
  }
  return up;
}

// A logit soft-cap, x -> cap x tanh(x / cap) (cap 0: none), with its
// constants taken once per block.
struct SoftCap {
  float cap = 0.f, cap2 = 0.f, k = 0.f;  // cap, 2 cap, 2 log2(e) / cap
  NKV_DEVICE explicit SoftCap(float c)
      : cap(c > 0.f ? c : 0.f), cap2(c > 0.f ? 2.f * c : 0.f), k(c > 0.f ? 2.8853900817779268f / c : 0.f) {}
  // cap tanh(|y|) = cap - 2 cap / (e^(2|y|) + 1) with the sign restored: one
  // exp2 (ex2.approx), one reciprocal (rcp.approx), one fma.  Their errors
  // (~2^-22 relative) stay absolute in the tanh (~2^-22 where the subtraction
  // cancels near 0): below 1e-5 of a score for caps up to 50, far under a bf16
  // score's rounding; tanhf's exact routine took ~70 instructions of the tile
  // loop.  +-inf -> +-cap (e^(2|y|) = inf: 1 / inf = 0), NaN stays NaN.
  NKV_DEVICE float operator()(float x) const {
    const float e = fast_exp2(k * fabsf(x));
    return copysignf(fmaf(-cap2, fast_rcp(e + 1.f), cap), x);
  }
};

// One query row's step of the online softmax over a tile of kMmaTile keys, by
// one warp (lane: keys lane and lane + 32): sc the row's scores, vis the keys
// the row sees, softcap its soft-cap (0: none).  m is the row's running max (read by every
// lane, then updated by lane 0), lpart this lane's part of the row's
// denominator (rescaled; NaN once a visible score is not finite).  Returns the
// rescale exp(m_old - m_new); w the weights (0 where not visible).  The
// exponentials are __expf (ex2.approx of x log2(e): 2 + 1.17 |x| ulp, ~1e-5
// relative at x = -80, results below 2^-126 flushed to 0; exactly 1 at 0, so
// an unchanged max rescales by 1), as FlashAttention's; expf's exact routine
// cost ~10 instructions each.
NKV_DEVICE float softmax_row(const float* sc, const bool (&vis)[2], const SoftCap& softcap, float& m, float& lpart,
                             float (&w)[2]) {
  const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);
  const int lane = int(threadIdx.x) % kWarp;
  float x[2], tile_max = kNegInf;
  bool bad = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    x[h] = vis[h] ? sc[lane + kWarp * h] : kNegInf;
    if (vis[h] && softcap.cap > 0.f) x[h] = softcap(x[h]);
    if (vis[h]) {
      tile_max = x[h] > tile_max ? x[h] : tile_max;
      bad = bad || non_finite(x[h]);
    }
  }
  for (int o = 16; o > 0; o /= 2) tile_max = fmaxf(tile_max, shfl_xor(tile_max, o));
  const float m_old = m;
  const float m_new = m_old > tile_max ? m_old : tile_max;
  const float alpha = m_new == kNegInf ? 1.f : __expf(m_old - m_new);
#pragma unroll
  for (int h = 0; h < 2; ++h) w[h] = vis[h] ? __expf(x[h] - m_new) : 0.f;
  lpart = bad ? kNaN : lpart * alpha + (w[0] + w[1]);
  __syncwarp();  // every lane has read m
  if (lane == 0) m = m_new;
  return alpha;
}

// ---- the kernel ---------------------------------------------------------------------------------

// The sizes the tile loop indexes with, as 32-bit numbers and host-computed
// divisors (launch_attention_mma), so that the loop divides by none of them:
// a GPU has no integer divider, and a 64-bit `/` or `%` is a subroutine of
// about 70 instructions (benchmarks/cuda_budget.py counts what is left).  The
// host falls back to the reference kernel when a size does not fit 31 bits.
struct MmaIndex {
  core::FastDivmod key_group;                // tokens per key group (NQ keys; unused for DGQ)
  core::FastDivmod value_group;              // channels per value group
  core::FastDivmod value_meta;               // value groups per token (Bm)
  int32_t key_groups = 0;                    // token groups of one key row (A; DGQ: segments)
  int32_t key_tokens = 0, value_tokens = 0;  // capacities of K and V (T)
};

// L's sizes as the tile loops take them (host only).
template <typename Launch>
MmaIndex mma_index(const Launch& L) {
  const auto& kd = L.p.k.dims;
  const auto& vd = L.p.v.dims;
  MmaIndex ix;
  ix.key_group = core::FastDivmod(kd.group_size);
  ix.value_group = core::FastDivmod(vd.group_size);
  ix.value_meta = core::FastDivmod(vd.meta_b());
  ix.key_groups = int32_t(kd.meta_a());
  ix.key_tokens = int32_t(kd.tokens), ix.value_tokens = int32_t(vd.tokens);
  return ix;
}

// The tensor-core kernel's argument: the launch and its index sizes.
template <typename Launch>
struct MmaLaunch {
  Launch L;
  MmaIndex ix;
};

template <typename Launch, int kBits, int kD>
struct MmaKernel {
  using Params = decltype(Launch::p);
  using T = typename Params::Element;
  using Meta = typename Params::MetaType;
  static constexpr int kRB = int(core::row_bytes(kBits, kD));
  static_assert(kRB % 16 == 0 && (kRB & (kRB - 1)) == 0, "code rows: whole 16-byte copies, a power of two");
  static constexpr int kKSteps = kD / 16;      // k-steps of q . K (channels)
  static constexpr int kMTiles = kD / 16 / 4;  // PV m-tiles (16 channels) per warp
  using Smem = MmaSmem<kD, kRB, Meta>;

  const Launch& L;
  const Params& p;
  const MmaIndex& ix;
  Smem& sm;
  const BlockSetup& s;
  const int warp, lane, g, t;
  const int ntiles;  // n-tiles (8 query rows) with real rows: 1 or 2
  const SoftCap softcap;
  const int bh;    // kv row b * Hkv + h
  const int rows;  // the block's query rows (s.rows)

  NKV_DEVICE MmaKernel(const MmaLaunch<Launch>& a, Smem& smem, const BlockSetup& setup)
      : L(a.L), p(a.L.p), ix(a.ix), sm(smem), s(setup), warp(int(threadIdx.x) / kWarp), lane(int(threadIdx.x) % kWarp),
        g(lane / 4), t(lane % 4), ntiles(setup.rows > 8 ? 2 : 1), softcap(a.L.p.softcap), bh(int(setup.bh)),
        rows(int(setup.rows)) {}

  // Row bh's part of the cache, from 32-bit positions (one wide multiply each).
  NKV_DEVICE const uint8_t* key_codes(int tk) const { return p.k.codes + (int64_t(bh) * ix.key_tokens + tk) * kRB; }
  NKV_DEVICE const uint8_t* value_codes(int tk) const { return p.v.codes + (int64_t(bh) * ix.value_tokens + tk) * kRB; }
  // Meta index of channel 0 of key group a (keys: one [D] row per group).
  NKV_DEVICE int64_t key_meta(int a) const { return (int64_t(bh) * ix.key_groups + a) * kD; }
  // Meta index of channel group 0 of value token tk.
  NKV_DEVICE int64_t value_meta(int tk) const { return (int64_t(bh) * ix.value_tokens + tk) * ix.value_meta.divisor; }
  // Key group of token tk: a multiply-shift for NQ groups, a binary search over the row's DGQ starts.
  NKV_DEVICE int key_group(int tk) const {
    const int32_t* starts = p.k.dims.segment_starts;
    if (starts == nullptr) return int(ix.key_group.div(uint32_t(tk)));
    return core::find_segment(starts + int64_t(bh) * ix.key_groups, ix.key_groups, tk);
  }
  // Tokens [begin, end) of key group a.
  NKV_DEVICE void key_group_tokens(int a, int& begin, int& end) const {
    const int32_t* starts = p.k.dims.segment_starts;
    if (starts == nullptr) {
      const int G = int(ix.key_group.divisor);
      begin = a * G, end = begin + G < ix.key_tokens ? begin + G : ix.key_tokens;
      return;
    }
    starts += int64_t(bh) * ix.key_groups;
    begin = starts[a], end = a + 1 < ix.key_groups ? starts[a + 1] : ix.key_tokens;
  }
  // The key groups a stage's tile touches: [first, first + count), ascending
  // (an empty DGQ segment among them matches no key and costs one pass).
  NKV_DEVICE static int first_group(const typename Smem::Stage& S) { return S.key_group[0]; }
  NKV_DEVICE static int group_count(const typename Smem::Stage& S, int n) {
    return S.key_group[n - 1] - S.key_group[0] + 1;
  }

  // Issues the copies of compressed tile [t0, t0 + n) into stage st: codes and
  // the first key groups' meta rows by cp.async (committed as one group), the
  // V meta into the caller's registers vm (stored by store_value_meta).
  NKV_DEVICE void prefetch(int t0, int n, int st, Meta* vm) {
    typename Smem::Stage& S = sm.buf.stage[st];
    const int tid = int(threadIdx.x);
    for (int j = tid; j < kMmaTile; j += kMmaThreads) S.key_group[j] = key_group(t0 + (j < n ? j : n - 1));
    if (tid < Smem::kBmMax) S.v_max[tid] = 0;  // (store_value_meta, after the barrier below)
    const uint8_t* kc = key_codes(t0);
    const uint8_t* vc = value_codes(t0);
    for (int o = tid * 16; o < n * kRB; o += kMmaThreads * 16) {
      const int row = o / kRB, col = o % kRB;  // (kRB: a power of two)
      cp_async16(&S.k_codes[row][col], kc + o);
      cp_async16(&S.v_codes[row][col], vc + o);
    }
    NKV_SYNC();  // key_group written
    const int g0 = first_group(S), gn = group_count(S, n);
    copy_key_meta(S, g0, gn);
    cp_async_commit();
    const int Bm = int(ix.value_meta.divisor);
#pragma unroll
    for (int i = 0; i < kVmPerThread; ++i) {
      const int e = tid + i * kMmaThreads;  // e = (j * Bm + b) over the tile's tokens
      uint32_t j, b;
      ix.value_meta.divmod(uint32_t(e), j, b);
      Meta sc{}, zr{};  // (+0)
      if (e < kMmaTile * Bm && int(j) < n) {
        const int64_t m = value_meta(t0 + int(j)) + b;
        sc = p.v.scale[m], zr = p.v.zero[m];
      }
      vm[2 * i] = sc, vm[2 * i + 1] = zr;
    }
  }
  static constexpr int kVmPerThread = (kMmaTile * Smem::kBmMax + kMmaThreads - 1) / kMmaThreads;

  NKV_DEVICE void store_value_meta(int st, const Meta* vm) {
    typename Smem::Stage& S = sm.buf.stage[st];
    const int Bm = int(ix.value_meta.divisor);
#pragma unroll
    for (int i = 0; i < kVmPerThread; ++i) {
      const int e = int(threadIdx.x) + i * kMmaThreads;
      uint32_t j, b;
      ix.value_meta.divmod(uint32_t(e), j, b);
      if (e < kMmaTile * Bm) {
        S.v_scale[j][b] = vm[2 * i], S.v_zero[j][b] = vm[2 * i + 1];
        // (negative scales and -NaN do not count)
        atomic_max(&S.v_max[b], int32_t(float_bits(fast_float(vm[2 * i]))));
      }
    }
  }

  // Copies (cp.async, uncommitted) of the meta rows of key groups [a, a + count)
  // into the stage's slots, the first kMmaGroupsInSmem of them.
  NKV_DEVICE void copy_key_meta(typename Smem::Stage& S, int a, int count) {
    count = count < kMmaGroupsInSmem ? count : kMmaGroupsInSmem;
    constexpr int kPerRow = kD * int(sizeof(Meta)) / 16;  // 16-byte pieces of one meta row
#pragma unroll 1                                          // (one pass per thread for up to 4 rows of 128 bf16 channels)
    for (int e = int(threadIdx.x); e < count * kPerRow; e += kMmaThreads) {
      const int gi = e / kPerRow, piece = e % kPerRow;
      const int64_t m0 = key_meta(a + gi);
      cp_async16(reinterpret_cast<uint8_t*>(&S.k_scale[gi][0]) + 16 * piece,
                 reinterpret_cast<const uint8_t*>(p.k.scale + m0) + 16 * piece);
      cp_async16(reinterpret_cast<uint8_t*>(&S.k_zero[gi][0]) + 16 * piece,
                 reinterpret_cast<const uint8_t*>(p.k.zero + m0) + 16 * piece);
    }
  }

  // Past the first kMmaGroupsInSmem key groups of a tile: the meta rows of
  // groups [a, a + count) into the stage's slots, once every warp is done with
  // the slots' previous rows (the caller synchronizes); waits for every copy in
  // flight (the next tile's too: a rare path) and ends with a barrier.
  NKV_DEVICE void reload_key_meta(typename Smem::Stage& S, int a, int count) {
    copy_key_meta(S, a, count);
    cp_async_commit();
    cp_async_wait<0>();
    NKV_SYNC();
  }

  NKV_DEVICE void key_fragment(const typename Smem::Stage& S, int ks, uint32_t (&a)[4]) const {
    key_codes_fragment<kBits>(S.k_codes, warp, g, t, ks, a);
  }

  // Scores of the compressed tile (n keys) into sm.sc, every key group of the
  // tile in turn: the block folds the queries with the group's scales once
  // (fold_queries), then each warp multiplies its 16 keys' codes with them (the
  // same loop on every warp: all lanes of the block take part in its barriers
  // and tensor-core instructions).
  NKV_DEVICE void tile_scores(typename Smem::Stage& S, int n) {
    const int key_a = 16 * warp + g, key_b = key_a + 8;  // the warp's keys of c0/c1 and c2/c3
    const int g0 = first_group(S), ng = group_count(S, n);
    for (int gi = 0; gi < ng; ++gi) {
      const int slot = gi % kMmaGroupsInSmem;
      if (gi > 0) {  // (ng is the same on every thread)
        NKV_SYNC();  // every warp is done with the previous group's folded queries
        if (slot == 0) reload_key_meta(S, g0 + gi, ng - gi);
      }
      fold_queries(&S.k_scale[slot][0], &S.k_zero[slot][0]);
      const int32_t grp = g0 + gi;
      float c[2][4] = {};
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t a[4];
        key_fragment(S, ks, a);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          if (nt >= ntiles) break;
          const uint4 f = sm.qfrag[nt][ks][lane];  // {hi, lo} of this lane's B fragment
          const uint32_t hi[2] = {f.x, f.y}, lo[2] = {f.z, f.w};
          mma_16816(c[nt], a, hi);
          mma_16816(c[nt], a, lo);
        }
      }
      // c[nt][i]: key (i < 2 ? key_a : key_b), row 8 nt + 2t + i % 2.
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        if (nt >= ntiles) break;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = i < 2 ? key_a : key_b, r = 8 * nt + 2 * t + i % 2;
          if (key < n && S.key_group[key] == grp && r < rows) sm.sc[r][key] = c[nt][i] * sm.qdown[r] + sm.qbias[r];
        }
      }
    }
  }

  // The queries folded with one key group's scales, once per block for all
  // warps: Q' = q * scale normalized per row by a power of two (2^14 <= max
  // |Q'| < 2^15) and split into fp16 hi + lo, written in the order of the
  // B fragments (sm.qfrag); the row's 1 / normalizer and q . zero into qdown /
  // qbias.  Thread (row r, part) folds the 4 kKSteps / 8 fragment entries of
  // row r that lanes 4 (r % 8) + t read, so the row's max reduces over the 8
  // threads of a row and no barrier separates the max from the split.  Ends
  // with a barrier.
  NKV_DEVICE void fold_queries(const Meta* ksr, const Meta* kzr) {
    constexpr int kParts = 8, kItems = 4 * kKSteps / kParts;  // threads per row, fragment entries per thread
    const int tid = int(threadIdx.x), r = tid / kParts, part = tid % kParts;
    if (r < 8 * ntiles) {  // (the same on a warp: 4 rows each)
      float x[kItems][4], mx = 0.f, bias = 0.f;
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        const int item = part + kParts * k, ks = item / 4, lt = item % 4;  // k-step and lane % 4 of the entry
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ch = b_channel(ks, lt, e);
          const float q = sm.q[r][ch];
          x[k][e] = q * fast_float(ksr[ch]);
          mx = fmaxf(mx, fabsf(x[k][e]));
          bias += q * fast_float(kzr[ch]);
        }
      }
#pragma unroll
      for (int o = 1; o < kParts; o *= 2) bias += shfl_xor(bias, o);
      const float up = fold_row_fragments<kKSteps>(x, mx, r, part, sm.qfrag);
      if (part == 0) sm.qdown[r] = pow2_inverse(up), sm.qbias[r] = bias;
    }
    NKV_SYNC();
  }

  // Key outliers: scores saw code * scale + zero; add q * (exact - that).
  NKV_DEVICE void key_outliers(const typename Smem::Stage& S, int t0, int n) {
    const int k = p.k.num_outliers();
    if (k == 0) return;
    const int g0 = first_group(S), ng = group_count(S, n);
    for (int gi = 0; gi < ng; ++gi) {
      int gb, ge;
      key_group_tokens(g0 + gi, gb, ge);
      if (gb == ge) continue;  // an empty DGQ segment: no key of it is read (the reference does not check it)
      const int64_t meta0 = key_meta(g0 + gi);
      for (int e = int(threadIdx.x); e < kD * k; e += kMmaThreads) {
        const int ch = e / k, slot = e - ch * k;  // 32-bit: k is small
        const int64_t m = meta0 + ch;
        const int64_t pos = p.k.outlier_pos(m, slot);
        if (pos >= ge - gb) {
          atomic_or(&sm.flag, kBadOutlierIndex);
          continue;
        }
        const int tk = gb + int(pos);
        if (tk < t0 || tk >= t0 + n || p.k.repeated_slot(m, slot)) continue;
        const float approx = float(core::layout::code_at<kBits>(key_codes(tk), ch)) * p.k.scale_at(m) + p.k.zero_at(m);
        const float delta = p.k.outlier_value(m, slot) - approx;
        for (int r = 0; r < rows; ++r) atomic_add(&sm.sc[r][tk - t0], sm.q[r][ch] * delta);
      }
    }
  }

  // Soft-cap, mask and online softmax of sm.sc [rows, n] at positions pos0..;
  // leaves the weights in sm.sc (0 where masked or past n) and the rescale in
  // sm.alpha; the denominators stay in parts per lane (sm.lpart).
  // With the stage of a compressed tile, it also adds sum p * value zero per
  // row and channel group to zacc (rescaled with the row); without, zacc is
  // only rescaled (full-precision tiles).
  template <bool kCompressed>  // S is a compressed tile's stage (else null: a full-precision tile)
  NKV_DEVICE void softmax(int64_t pos0, int n, const typename Smem::Stage* S) {
    const int Bm = int(ix.value_meta.divisor);
    // Warp w: rows w, w + 4, ... below rows (a row past them has no weight, no denominator
    // and no value-zero sum to update: at decode with 4 q heads a kv head, one row a warp).
#pragma unroll 1
    for (int r = warp; r < rows; r += 4) {  // (the same on the warp)
      const int64_t qp = sm.qpos[r];
      bool vis[2];
      for (int h = 0; h < 2; ++h) vis[h] = lane + kWarp * h < n && p.visible(qp, pos0 + lane + kWarp * h);
      float w[2];
      const float alpha = softmax_row(sm.sc[r], vis, softcap, sm.m[r], sm.lpart[r][lane], w);
      for (int h = 0; h < 2; ++h) sm.sc[r][lane + kWarp * h] = w[h];
      if (lane == 0) sm.alpha[r] = alpha;
#pragma unroll 1
      for (int b = 0; b < Bm; ++b) {
        float z = 0.f;
        if constexpr (kCompressed) {
          z = w[0] * fast_float(S->v_zero[lane][b]) + w[1] * fast_float(S->v_zero[lane + kWarp][b]);
          for (int o = 16; o > 0; o /= 2) z += shfl_xor(z, o);
        }
        if (lane == 0) sm.zacc[r][b] = sm.zacc[r][b] * alpha + z;
      }
    }
    NKV_SYNC();
    // The SIMT accumulator follows the rescale; it is empty during compressed
    // tiles (merge_simt), so only full-precision tiles rescale it.
    if constexpr (!kCompressed)
      for (int e = int(threadIdx.x); e < rows * kD; e += kMmaThreads) sm.oacc[e / kD][e % kD] *= sm.alpha[e / kD];
  }

  // acc += the SIMT accumulator (sinks, value outliers so far), which is
  // cleared: each lane moves the elements of its own fragments.  Between
  // barriers.
  NKV_DEVICE void merge_simt(float (&acc)[kMTiles][2][4]) {
    for_fragments(acc, [&](float& a, int r, int ch) {
      a += sm.oacc[r][ch];
      sm.oacc[r][ch] = 0.f;
    });
  }

  // f(element, query row, channel) for each element of this lane's P . V
  // accumulator fragments (acc[mi][nt][i]: m-tile mi of the warp, n-tile nt).
  template <typename F>
  NKV_DEVICE void for_fragments(float (&acc)[kMTiles][2][4], F f) const {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          f(acc[mi][nt][i], 8 * nt + 2 * t + i % 2, 16 * (warp * kMTiles + mi) + g + 8 * (i / 2));
  }

  // B fragment of P . V for query row `row` and keys 16 kk ..: the weights
  // p * (value scale of channel group b) * up as fp16 hi + lo.
  NKV_DEVICE void value_weights(const typename Smem::Stage& S, int row, int kk, int b, float up, uint32_t (&hi)[2],
                                uint32_t (&lo)[2]) const {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int k0 = 16 * kk + 2 * t + 8 * j;
      const float w0 = row < rows ? sm.sc[row][k0] * fast_float(S.v_scale[k0][b]) * up : 0.f;
      const float w1 = row < rows ? sm.sc[row][k0 + 1] * fast_float(S.v_scale[k0 + 1][b]) * up : 0.f;
      split_half2(w0, w1, hi[j], lo[j]);
    }
  }

  // acc (tensor-core fragments) = acc * alpha + W' . V for the compressed tile; value zeros and outliers.
  NKV_DEVICE void tile_values(const typename Smem::Stage& S, int t0, int n, float (&acc)[kMTiles][2][4]) {
    const int Bm = int(ix.value_meta.divisor);  // (the zeros were summed by softmax)
    // Per m-tile: its channel group, and the normalizer of p * scale (p <= 1)
    // over the tile's tokens in that group (NaN scales: NaN weights).
    int bm[kMTiles];
    float up[kMTiles];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      bm[mi] = int(ix.value_group.div(uint32_t(16 * (warp * kMTiles + mi))));
      up[mi] = pow2_normalizer(bits_float(uint32_t(S.v_max[bm[mi]])));
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      if (nt >= ntiles) break;
      float c[kMTiles][4] = {};
#pragma unroll
      for (int kk = 0; kk < kMmaTile / 16; ++kk) {
        uint32_t hi[2], lo[2], av[kMTiles][4];
        value_codes_fragments<kBits, kMTiles>(S.v_codes, g, t, warp * kMTiles, kk, av);
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
          // The weights' B fragment, shared by the warp's m-tiles of one channel group.
          if (mi == 0 || bm[mi] != bm[mi - 1]) value_weights(S, 8 * nt + g, kk, bm[mi], up[mi], hi, lo);
          mma_16816(c[mi], av[mi], hi);
          mma_16816(c[mi], av[mi], lo);
        }
      }
      // c[mi][i]: channel 16 (warp kMTiles + mi) + g + 8 (i / 2), row 8 nt + 2t + i % 2.
      float a_r[2];  // the rescale of rows 8 nt + 2t and + 1 (1 past rows)
#pragma unroll
      for (int i = 0; i < 2; ++i) a_r[i] = 8 * nt + 2 * t + i < rows ? sm.alpha[8 * nt + 2 * t + i] : 1.f;
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        const float down = pow2_inverse(up[mi]);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mi][nt][i] = acc[mi][nt][i] * a_r[i % 2] + c[mi][i] * down;
      }
    }
    // Value outliers: acc saw code * scale + zero; add p * (exact - that).
    const int k = p.v.num_outliers(), G = int(ix.value_group.divisor);
    for (int e = int(threadIdx.x); k > 0 && e < n * Bm * k; e += kMmaThreads) {
      const int jb = e / k, slot = e - jb * k;  // 32-bit: k is small
      uint32_t j, b;
      ix.value_meta.divmod(uint32_t(jb), j, b);
      const int64_t m = value_meta(t0 + int(j)) + b, pos = p.v.outlier_pos(m, slot);
      if (pos >= (kD - int(b) * G < G ? kD - int(b) * G : G)) {
        atomic_or(&sm.flag, kBadOutlierIndex);
        continue;
      }
      if (p.v.repeated_slot(m, slot)) continue;
      const int ch = int(b) * G + int(pos);
      const float approx =
          float(core::layout::code_at<kBits>(value_codes(t0 + int(j)), ch)) * fast_float(S.v_scale[j][b]) +
          fast_float(S.v_zero[j][b]);
      const float delta = p.v.outlier_value(m, slot) - approx;
      for (int r = 0; r < rows; ++r) atomic_add(&sm.oacc[r][ch], sm.sc[r][j] * delta);
    }
  }

  // Full-precision keys/values at positions [from, to) (sinks or tail rows,
  // row 0 at position `first`), in tiles of kFpTile, SIMT; rotated on the fly
  // when the cache is.  acc is rescaled with the rows.
  NKV_DEVICE void full_precision(const core::DenseKV<T>& f, int64_t first, int64_t from, int64_t to,
                                 float (&acc)[kMTiles][2][4]) {
    const float* signs = p.rotation_signs;
    for (int64_t t0 = from; t0 < to; t0 += kFpTile) {
      const int64_t n = to - t0 < kFpTile ? to - t0 : kFpTile;
      for (int e = int(threadIdx.x); e < 2 * kFpTile * kD; e += kMmaThreads) {
        const int row = e / kD, j = row % kFpTile, d = e % kD;
        const bool is_k = row < kFpTile;
        float v = 0.f;
        if (j < n) v = fast_float((is_k ? f.k : f.v).row(s.b, s.h, t0 + j - first)[d]);
        if (signs) v *= signs[d];
        (is_k ? sm.buf.fp.k : sm.buf.fp.v)[j][d] = v;
      }
      NKV_SYNC();
      if (signs) {
        fwht_rows(&sm.buf.fp.k[0][0], 2 * kFpTile, kD, [](int64_t) { return false; });
        const float norm = 1.f / sqrtf(float(kD));
        for (int e = int(threadIdx.x); e < 2 * kFpTile * kD; e += kMmaThreads) (&sm.buf.fp.k[0][0])[e] *= norm;
        NKV_SYNC();
      }
      for (int e = int(threadIdx.x); e < rows * kFpTile; e += kMmaThreads) {
        const int r = e / kFpTile, j = e % kFpTile;
        float dot = 0.f;
        for (int d = 0; d < kD; ++d) dot += sm.q[r][d] * sm.buf.fp.k[j][d];
        sm.sc[r][j] = dot;
      }
      NKV_SYNC();
      softmax<false>(t0, int(n), nullptr);
      rescale(acc);
      NKV_SYNC();
      for (int e = int(threadIdx.x); e < rows * kD; e += kMmaThreads) {
        const int r = e / kD, d = e % kD;
        float o = 0.f;
        for (int j = 0; j < n; ++j) o += sm.sc[r][j] * sm.buf.fp.v[j][d];
        sm.oacc[r][d] += o;
      }
      NKV_SYNC();
    }
  }

  // acc *= alpha of its rows (tiles without tensor-core values).
  NKV_DEVICE void rescale(float (&acc)[kMTiles][2][4]) {
    for_fragments(acc, [&](float& a, int r, int) { a *= r < rows ? sm.alpha[r] : 1.f; });
  }

  NKV_DEVICE void run() {
    const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);
    float acc[kMTiles][2][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mi][nt][i] = 0.f;
    if (threadIdx.x == 0) sm.flag = s.bad ? kBadLengths : 0u;
    NKV_SYNC();
    check_segments(p.k.dims, s.bh, &sm.flag);
    load_queries(p, s, &sm.q[0][0], &sm.flag);
    for (int e = int(threadIdx.x); e < kAttnRows * kD; e += kMmaThreads) (&sm.oacc[0][0])[e] = 0.f;
    for (int e = int(threadIdx.x); e < kAttnRows * Smem::kBmMax; e += kMmaThreads) (&sm.zacc[0][0])[e] = 0.f;
    for (int r = int(threadIdx.x); r < kAttnRows; r += kMmaThreads) {
      sm.m[r] = kNegInf, sm.alpha[r] = 1.f;  // (l: summed from lpart after the last tile)
      for (int i = 0; i < kWarp; ++i) sm.lpart[r][i] = 0.f;
      sm.qpos[r] = r < rows ? query_position(p, s, s.r0 + r) : 0;
    }
    NKV_SYNC();
    const bool skip = (sm.flag & kBadSegments) != 0;  // corrupt DGQ starts: read nothing (rows NaN below)

    if (!skip) full_precision(p.sink, 0, s.lo, s.hi < s.sink ? s.hi : s.sink, acc);
    merge_simt(acc);  // (after full_precision's last barrier, or the one above)
    // Compressed tokens [c_lo, c_hi), in tiles of kMmaTile, two stages; 32-bit
    // positions (the host checks that every capacity fits: mma_variant).
    const int64_t lo64 = s.lo - s.sink > 0 ? s.lo - s.sink : 0, hi64 = s.hi - s.sink < s.comp ? s.hi - s.sink : s.comp;
    const int c_lo = int(lo64 < s.comp ? lo64 : s.comp);  // (clamped in 64 bits: sinks and tail may be long)
    const int c_hi = skip || hi64 < c_lo || L.fp_split >= 0 ? c_lo : int(hi64);  // (the fp split: none)
    Meta vm[2 * kVmPerThread];
    if (c_lo < c_hi) prefetch(c_lo, c_hi - c_lo < kMmaTile ? c_hi - c_lo : kMmaTile, 0, vm);
    int st = 0;
    for (int t0 = c_lo; t0 < c_hi; t0 += kMmaTile, st ^= 1) {
      const int n = c_hi - t0 < kMmaTile ? c_hi - t0 : kMmaTile;
      store_value_meta(st, vm);
      const int t1 = t0 + kMmaTile;
      if (t1 < c_hi)
        prefetch(t1, c_hi - t1 < kMmaTile ? c_hi - t1 : kMmaTile, st ^ 1, vm);
      else
        cp_async_commit();  // an empty group keeps wait<1> meaning "this tile's group is done"
      cp_async_wait<1>();
      NKV_SYNC();
      typename Smem::Stage& S = sm.buf.stage[st];
      tile_scores(S, n);
      NKV_SYNC();
      key_outliers(S, t0, n);
      NKV_SYNC();
      softmax<true>(s.sink + t0, n, &S);
      NKV_SYNC();
      tile_values(S, t0, n, acc);
      NKV_SYNC();
      if (p.v.num_outliers() > 0) merge_simt(acc);  // the outliers' corrections, before the next rescale
    }
    cp_async_wait<0>();
    NKV_SYNC();
    if (!skip) {
      const int64_t tail0 = s.sink + s.comp;
      full_precision(p.tail, tail0, s.lo > tail0 ? s.lo : tail0, s.hi, acc);
    }
    // The softmax denominators: the sum over the lanes of their parts.
    for (int rr = 0; rr < kAttnRows / 4; ++rr) {
      float l = sm.lpart[4 * warp + rr][lane];
      for (int o = 16; o > 0; o /= 2) l += shfl_xor(l, o);
      if (lane == 0) sm.l[4 * warp + rr] = l;
    }
    // Output: tensor-core part + SIMT part + value zeros per channel group.
    for_fragments(acc, [&](float& a, int r, int ch) {
      if (r < rows) sm.oacc[r][ch] += a;
    });
    NKV_SYNC();
    float* part = L.partials + L.partial_index(s.b, s.h, s.rt, s.split);
    const bool poisoned = sm.flag != 0;
    for (int e = int(threadIdx.x); e < rows * (kD + 2); e += kMmaThreads) {
      const int r = e / (kD + 2), d = e % (kD + 2);
      part[e] = d < kD    ? sm.oacc[r][d] + sm.zacc[r][ix.value_group.div(uint32_t(d))]
                : d == kD ? sm.m[r]
                          : (poisoned ? kNaN : sm.l[r]);
    }
    if (threadIdx.x == 0 && sm.flag) report(L.status, sm.flag);
  }
};

template <typename Launch, int kBits, int kD>
NKV_KERNEL void __launch_bounds__(kMmaThreads, kMmaMinBlocks)
    attention_mma_kernel(const NKV_GRID_CONSTANT MmaLaunch<Launch> a) {
  using K = MmaKernel<Launch, kBits, kD>;
  NKV_DYNAMIC_SMEM(smem);
  typename K::Smem& sm = *reinterpret_cast<typename K::Smem*>(smem);
  const BlockSetup s = block_setup(a.L, kMmaTile);
  K(a, sm, s).run();
}

// The tensor-core kernel variant that takes L (see the top of this file),
// opted in to its shared memory; kernel == nullptr where none takes it (the
// caller runs the reference kernel).  Host only, no device work.
template <typename Launch>
struct MmaVariant {
  void (*kernel)(MmaLaunch<Launch>) = nullptr;
  size_t smem = 0;
};

// Whether `kernel` may run with `smem` bytes of shared memory (opted in past
// the default); on a GPU with less, false, the failed opt-in cleared so that it
// is not reported as the launch error of the kernel that runs instead.  Host only.
template <typename Kernel>
bool smem_fits(Kernel kernel, size_t smem) {
  if (smem > kDefaultSmem && allow_smem(kernel, smem) != 0) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}
// f.template operator()<kD>() for head_dim D (64 or 128), f<kBg>() for 1, 2 or 4 groups.
template <typename F>
void with_head_dim(int64_t D, F&& f) {
  if (D == 64)
    f.template operator()<64>();
  else
    f.template operator()<128>();
}
template <typename F>
void with_groups(int64_t bg, F&& f) {
  if (bg == 1)
    f.template operator()<1>();
  else if (bg == 2)
    f.template operator()<2>();
  else
    f.template operator()<4>();
}

template <typename Launch>
MmaVariant<Launch> mma_variant(const Launch& L) {
  using Params = decltype(Launch::p);
  using T = typename Params::Element;
  using Meta = typename Params::MetaType;
  constexpr bool kTypes = (std::is_same_v<T, core::bf16_t> || std::is_same_v<T, core::half_t>)&&std::is_same_v<Meta, T>;
  MmaVariant<Launch> v;
  if constexpr (kTypes) {
    const Params& p = L.p;
    const auto& kd = p.k.dims;
    const auto& vd = p.v.dims;
    const int64_t D = p.head_dim;
    auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; };
    // (the decode kernel's full-precision split, fp_split >= 0, reads no compressed token: it runs
    // beside every format the decode kernel takes, keys per token included)
    const bool formats =
        L.fp_split >= 0 || (kd.axis == core::GroupAxis::kTokens && (kd.segment_starts || kd.group_size % 16 == 0) &&
                            vd.axis == core::GroupAxis::kChannels && !vd.segment_starts && vd.group_size % 16 == 0);
    const bool ok = formats && kd.bits == vd.bits && kd.bits != 3 && (D == 64 || D == 128) && aligned(p.k.codes) &&
                    aligned(p.v.codes) && aligned(p.k.scale) && aligned(p.k.zero);
    // The tile loop's positions and sizes are 32-bit (MmaIndex); far larger caches take the reference kernel.
    constexpr int64_t kMax = core::kFastDivmodLimit - 2 * kMmaTile;
    const bool fits = kd.tokens + kd.group_size < kMax && vd.tokens < kMax && p.batch * p.kv_heads < kMax;
    if (!ok || !fits) return v;
    core::layout::with_bits(kd.bits, [&]<int kBits>() {
      if constexpr (kBits != 3) {
        with_head_dim(D, [&]<int kD>() {
          const size_t smem = sizeof(typename MmaKernel<Launch, kBits, kD>::Smem);
          // (this GPU has less shared memory: the reference kernel runs instead)
          if (smem_fits(attention_mma_kernel<Launch, kBits, kD>, smem))
            v.kernel = attention_mma_kernel<Launch, kBits, kD>, v.smem = smem;
        });
      }
    });
  }
  return v;
}

// Launches the tensor-core kernel, which mma_variant(L) found to take the
// problem; returns a cudaError_t of the set-up, 0 if none.
template <typename Launch>
int launch_attention_mma(const Launch& L, Dim3 grid, Stream stream) {
  const MmaVariant<Launch> v = mma_variant(L);
  if (v.kernel == nullptr) return int(cudaErrorInvalidDeviceFunction);
  launch(v.kernel, grid, Dim3(kMmaThreads), v.smem, stream, MmaLaunch<Launch>{L, mma_index(L)});
  return 0;
}

}  // namespace nexuskv::cuda
