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
//     fp16 integers by the magic-number trick (PRMT spreads two code bytes
//     into the halves of a register, mask, OR 0x6400 gives 1024 + code,
//     subtract 1024); B = the queries with the key group's per-channel scales
//     folded in (Q' = q * scale, once per key group), written as two fp16
//     terms hi + lo after an exact power-of-two normalization per row, so
//     that the product carries ~22 significant bits (the tests bound it);
//     the zeros fold into one bias per row and group (q . zero).  Keys are
//     the M side, so the 8-wide N side holds query rows: GQA 4 at q_len 1
//     fills half of it, and nothing is wasted on M.
//   P . V on tensor cores as O^T = V^T . W^T: A = 16 channels x 16 keys of
//     value codes (bytes of two token rows per register, by PRMT), B = the
//     softmax weights with the values' per-token scale folded in (W = p *
//     scale, normalized per tile and channel group, hi + lo in fp16); the
//     values' zeros are summed per row and channel group (sum p * zero) and
//     added once at the end, as the CPU kernel does.
//   Softmax, masks, soft-cap, outlier corrections (q * (exact - approx) for
//     key outliers, p * (exact - approx) for value outliers) and the
//     full-precision tiles run on the SIMT units in float32.
//
// It takes the common formats only (launch_attention_mma says which; else
// the caller runs the reference kernel, attention_simple.cuh, which the tests
// compare it with): keys per channel (NQ with group_size % 16 == 0, or DGQ),
// values per token with group_size % 16 == 0, the same 2/4/8 bits for both,
// head_dim 64 or 128, fp16 / bf16 queries and metadata.
#pragma once

#include "attention_common.cuh"

namespace nexuskv::cuda {

constexpr int kMmaTile = 64;         // keys per compressed tile (4 warps x 16)
constexpr int kMmaThreads = 128;     // 4 warps
constexpr int kMmaGroupsInSmem = 4;  // key groups per tile whose meta rows are copied ahead
constexpr int kFpTile = 16;          // keys per full-precision (sink / tail) tile
// Blocks per SM the register budget must allow (128 registers a thread): with
// about 40-70 KB of shared memory a block, 3-4 blocks keep enough tiles in
// flight to cover the memory latency.
constexpr int kMmaMinBlocks = 3;

// Shared memory of one block, for head_dim kD and row_bytes kRB.
template <int kD, int kRB, typename Meta>
struct alignas(16) MmaSmem {
  static constexpr int kBmMax = kD / 16;  // value channel groups per token (group_size >= 16)
  struct alignas(16) Stage {              // 16-byte aligned: the cp.async targets
    uint8_t k_codes[kMmaTile][kRB];       // packed K rows of the tile
    uint8_t v_codes[kMmaTile][kRB];       // packed V rows
    Meta k_scale[kMmaGroupsInSmem][kD], k_zero[kMmaGroupsInSmem][kD];  // meta rows of the first key groups
    float v_scale[kMmaTile][kBmMax], v_zero[kMmaTile][kBmMax];         // per token and channel group
    int32_t key_group[kMmaTile];                                       // key group of each key of the tile
    int32_t groups[kMmaTile];                                          // the distinct key groups of the tile, ascending
    int32_t n_groups;
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
  float m[kAttnRows], l[kAttnRows], alpha[kAttnRows];
  float v_shift[kBmMax];  // 2^-e of the tile's value weights per channel group
  uint32_t flag;
};

// ---- code extraction --------------------------------------------------------------------------

// Two codes as exact fp16 in one register from a 16-bit pair (byte lo, byte hi):
// plane `plane` of kBits-bit codes (nq_format.h: channel 16 j + l of a chunk in
// byte l at bit offset kBits * j).
template <int kBits>
NKV_DEVICE uint32_t codes_half2(uint32_t lo_byte, uint32_t hi_byte, int plane) {
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  const uint32_t spread = lo_byte | (hi_byte << 16);  // [b_lo, 0, b_hi, 0]
  const uint32_t codes = (spread >> (kBits * plane)) & (kMask | (kMask << 16));
  return half2_minus_1024(codes | 0x64006400u);
}

// Exponent e with 2^14 <= |x| 2^e < 2^15 for the largest |x| of a set (max
// finite, > 0), as the float 2^e; 1 for 0 or non-finite (NaN stays NaN).
NKV_DEVICE float pow2_normalizer(float max_abs) {
  const int e = int((float_bits(max_abs) >> 23) & 0xffu) - 127;  // max_abs in [2^e, 2^(e+1))
  if (!(max_abs > 0.f) || e > 127 || e < -126) return 1.f;
  int s = 14 - e;
  s = s > 100 ? 100 : (s < -100 ? -100 : s);
  return bits_float(uint32_t(s + 127) << 23);
}

// x0, x1 as two fp16 pairs hi + lo (hi the nearest fp16, lo the nearest fp16 to
// the rest): ~22 significant bits for values normalized by pow2_normalizer.
NKV_DEVICE void split_half2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack_half2(x0, x1);
  lo = pack_half2(x0 - half_bits_to_float(uint16_t(hi & 0xffffu)), x1 - half_bits_to_float(uint16_t(hi >> 16)));
}

// ---- the kernel ---------------------------------------------------------------------------------

template <typename Launch, int kBits, int kD>
struct MmaKernel {
  using Params = decltype(Launch::p);
  using T = typename Params::Element;
  using Meta = typename Params::MetaType;
  static constexpr int kC = core::layout::kChunkChannels<kBits>;
  static constexpr int kPlanes = core::layout::kPlanes<kBits>;
  static constexpr int kRB = int(core::row_bytes(kBits, kD));
  static constexpr int kKSteps = kD / 16;      // k-steps of q . K (channels)
  static constexpr int kMTiles = kD / 16 / 4;  // PV m-tiles (16 channels) per warp
  using Smem = MmaSmem<kD, kRB, Meta>;

  const Launch& L;
  const Params& p;
  Smem& sm;
  const BlockSetup& s;
  const int warp, lane, g, t;
  const int ntiles;  // n-tiles (8 query rows) with real rows: 1 or 2

  NKV_DEVICE MmaKernel(const Launch& l, Smem& smem, const BlockSetup& setup)
      : L(l), p(l.p), sm(smem), s(setup), warp(int(threadIdx.x) / kWarp), lane(int(threadIdx.x) % kWarp), g(lane / 4),
        t(lane % 4), ntiles(setup.rows > 8 ? 2 : 1) {}

  // Issues the copies of compressed tile [t0, t0 + n) into stage st: codes and
  // the first key groups' meta rows by cp.async (committed as one group), the
  // V meta into the caller's registers vm (stored by store_value_meta).
  NKV_DEVICE void prefetch(int64_t t0, int64_t n, int st, float* vm) {
    typename Smem::Stage& S = sm.buf.stage[st];
    const int tid = int(threadIdx.x);
    const int64_t bh = s.bh;
    for (int j = tid; j < kMmaTile; j += kMmaThreads)
      S.key_group[j] = int32_t(p.k.token_group(bh, t0 + (j < n ? j : n - 1)));
    const uint8_t* kc = p.k.code_row(bh, t0);
    const uint8_t* vc = p.v.code_row(bh, t0);
    for (int64_t o = int64_t(tid) * 16; o < n * kRB; o += kMmaThreads * 16) {
      cp_async16(&S.k_codes[0][0] + o, kc + o);
      cp_async16(&S.v_codes[0][0] + o, vc + o);
    }
    NKV_SYNC();  // key_group written
    if (tid == 0) {
      int c = 0;
      for (int j = 0; j < n; ++j)
        if (j == 0 || S.key_group[j] != S.key_group[j - 1]) S.groups[c++] = S.key_group[j];
      S.n_groups = c;
    }
    NKV_SYNC();
    const int ng = S.n_groups < kMmaGroupsInSmem ? S.n_groups : kMmaGroupsInSmem;
    constexpr int kPerRow = kD * int(sizeof(Meta)) / 16;  // 16-byte pieces of one meta row
    for (int e = tid; e < ng * kPerRow; e += kMmaThreads) {
      const int gi = e / kPerRow, piece = e % kPerRow;
      const int64_t m0 = p.k.meta_index(bh, S.groups[gi], 0);
      cp_async16(reinterpret_cast<uint8_t*>(&S.k_scale[gi][0]) + 16 * piece,
                 reinterpret_cast<const uint8_t*>(p.k.scale + m0) + 16 * piece);
      cp_async16(reinterpret_cast<uint8_t*>(&S.k_zero[gi][0]) + 16 * piece,
                 reinterpret_cast<const uint8_t*>(p.k.zero + m0) + 16 * piece);
    }
    cp_async_commit();
    const int64_t Bm = p.v.dims.meta_b();
#pragma unroll
    for (int i = 0; i < kVmPerThread; ++i) {
      const int e = tid + i * kMmaThreads;  // e = (j * Bm + b) over the tile's tokens
      const int64_t j = e / Bm;
      float sc = 0.f, zr = 0.f;
      if (e < kMmaTile * Bm && j < n) {
        const int64_t m = p.v.meta_index(bh, t0 + j, e % Bm);
        sc = fast_float(p.v.scale[m]), zr = fast_float(p.v.zero[m]);
      }
      vm[2 * i] = sc, vm[2 * i + 1] = zr;
    }
  }
  static constexpr int kVmPerThread = (kMmaTile * Smem::kBmMax + kMmaThreads - 1) / kMmaThreads;

  NKV_DEVICE void store_value_meta(int st, const float* vm) {
    typename Smem::Stage& S = sm.buf.stage[st];
    const int64_t Bm = p.v.dims.meta_b();
#pragma unroll
    for (int i = 0; i < kVmPerThread; ++i) {
      const int e = int(threadIdx.x) + i * kMmaThreads;
      if (e < kMmaTile * Bm) S.v_scale[e / Bm][e % Bm] = vm[2 * i], S.v_zero[e / Bm][e % Bm] = vm[2 * i + 1];
    }
  }

  // Meta row of the tile's gi-th key group: from the stage, or from global memory past the first few.
  NKV_DEVICE const Meta* key_scale_row(const typename Smem::Stage& S, int gi) const {
    return gi < kMmaGroupsInSmem ? &S.k_scale[gi][0] : p.k.scale + p.k.meta_index(s.bh, S.groups[gi], 0);
  }
  NKV_DEVICE const Meta* key_zero_row(const typename Smem::Stage& S, int gi) const {
    return gi < kMmaGroupsInSmem ? &S.k_zero[gi][0] : p.k.zero + p.k.meta_index(s.bh, S.groups[gi], 0);
  }

  // A fragment of the warp's 16 keys for k-step ks (channels 16 ks ..): exact fp16 codes.
  NKV_DEVICE void key_fragment(const typename Smem::Stage& S, int ks, uint32_t (&a)[4]) const {
    const int chunk = (16 * ks) / kC, plane = ks % kPlanes;
    const uint8_t* r0 = &S.k_codes[16 * warp + g][chunk * 16];
    const uint8_t* r1 = &S.k_codes[16 * warp + g + 8][chunk * 16];
    a[0] = codes_half2<kBits>(r0[2 * t], r0[2 * t + 1], plane);
    a[1] = codes_half2<kBits>(r1[2 * t], r1[2 * t + 1], plane);
    a[2] = codes_half2<kBits>(r0[2 * t + 8], r0[2 * t + 9], plane);
    a[3] = codes_half2<kBits>(r1[2 * t + 8], r1[2 * t + 9], plane);
  }

  // Channel of element e (0..3) of this lane's B fragment at k-step ks.
  NKV_DEVICE int b_channel(int ks, int e) const { return 16 * ks + 2 * t + (e % 2) + 8 * (e / 2); }

  // Scores of the compressed tile (n keys) into sm.sc, every key group of the
  // tile in turn (the same loop on every warp: all lanes of the block take
  // part in its shuffles and tensor-core instructions).
  NKV_DEVICE void tile_scores(const typename Smem::Stage& S, int64_t n) {
    const int key_a = 16 * warp + g, key_b = key_a + 8;  // the warp's keys of c0/c1 and c2/c3
    for (int gi = 0; gi < S.n_groups; ++gi) {
      const Meta* ksr = key_scale_row(S, gi);
      const Meta* kzr = key_zero_row(S, gi);
      const int32_t grp = S.groups[gi];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        if (nt >= ntiles) break;
        const int row = 8 * nt + g;  // B column of this lane
        // First pass: the row's max |q * scale| (its normalizer) and q . zero.
        float mx = 0.f, bias = 0.f;
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int ch = b_channel(ks, e);
            const float q = sm.q[row][ch];
            mx = fmaxf(mx, fabsf(q * fast_float(ksr[ch])));
            bias += q * fast_float(kzr[ch]);
          }
        mx = fmaxf(mx, shfl_xor(mx, 1)), mx = fmaxf(mx, shfl_xor(mx, 2));
        bias += shfl_xor(bias, 1), bias += shfl_xor(bias, 2);
        const float up = pow2_normalizer(mx), down = 1.f / up;
        // Second pass: Q' = q * scale * 2^e as fp16 hi + lo, against the codes.
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          uint32_t a[4], hi[2], lo[2];
          key_fragment(S, ks, a);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int c0 = b_channel(ks, 2 * j), c1 = c0 + 1;
            const float x0 = sm.q[row][c0] * fast_float(ksr[c0]) * up;
            const float x1 = sm.q[row][c1] * fast_float(ksr[c1]) * up;
            split_half2(x0, x1, hi[j], lo[j]);
          }
          mma_16816(c, a, hi);
          mma_16816(c, a, lo);
        }
        // c[i]: key (i < 2 ? key_a : key_b), row 8 nt + 2t + i % 2; that row's
        // normalizer and bias live in lanes 4 (2t + i % 2).
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int crow = 2 * t + i % 2, src = 4 * crow;
          const float d_i = shfl(down, src), b_i = shfl(bias, src);
          const int key = i < 2 ? key_a : key_b, r = 8 * nt + crow;
          if (key < n && S.key_group[key] == grp && r < s.rows) sm.sc[r][key] = c[i] * d_i + b_i;
        }
      }
    }
  }

  // Key outliers: scores saw code * scale + zero; add q * (exact - that).
  NKV_DEVICE void key_outliers(const typename Smem::Stage& S, int64_t t0, int64_t n) {
    const int k = p.k.num_outliers();
    if (k == 0) return;
    for (int gi = 0; gi < S.n_groups; ++gi) {
      const int32_t grp = S.groups[gi];
      const int64_t gb = p.k.group_begin(s.bh, grp);
      for (int e = int(threadIdx.x); e < kD * k; e += kMmaThreads) {
        const int ch = e / k, slot = e % k;
        const int64_t m = p.k.meta_index(s.bh, grp, ch);
        const int64_t tk = gb + p.k.outlier_pos(m, slot);
        if (p.k.outlier_pos(m, slot) >= p.k.group_end(s.bh, grp) - gb) {
          atomic_or(&sm.flag, kBadOutlierIndex);
          continue;
        }
        if (tk < t0 || tk >= t0 + n || p.k.repeated_slot(m, slot)) continue;
        const float approx = float(p.k.code(s.bh, tk, ch)) * p.k.scale_at(m) + p.k.zero_at(m);
        const float delta = p.k.outlier_value(m, slot) - approx;
        for (int r = 0; r < s.rows; ++r) atomic_add(&sm.sc[r][tk - t0], sm.q[r][ch] * delta);
      }
    }
  }

  // Soft-cap, mask and online softmax of sm.sc [rows, n] at positions pos0..;
  // leaves the weights in sm.sc (0 where masked or past n) and the rescale in sm.alpha.
  NKV_DEVICE void softmax(int64_t pos0, int64_t n) {
    const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);
    for (int rr = 0; rr < kAttnRows / 4; ++rr) {  // warp w: rows 4w .. 4w + 3
      const int r = 4 * warp + rr;
      const bool real = r < s.rows;
      const int64_t qp = real ? query_position(p, s, s.r0 + r) : 0;
      float x[2], tile_max = kNegInf, bad = 0.f;
      bool vis[2];
      for (int h = 0; h < 2; ++h) {
        const int j = lane + kWarp * h;
        vis[h] = real && j < n && p.visible(qp, pos0 + j);
        x[h] = vis[h] ? sm.sc[r][j] : kNegInf;
        if (vis[h] && p.softcap > 0.f) x[h] = p.softcap * tanhf(x[h] / p.softcap);
        if (vis[h]) {
          tile_max = x[h] > tile_max ? x[h] : tile_max;
          bad += non_finite(x[h]) ? 1.f : 0.f;
        }
      }
      for (int o = 16; o > 0; o /= 2) tile_max = fmaxf(tile_max, shfl_xor(tile_max, o)), bad += shfl_xor(bad, o);
      const float m_old = real ? sm.m[r] : kNegInf;
      const float m_new = m_old > tile_max ? m_old : tile_max;
      const float alpha = m_new == kNegInf ? 1.f : expf(m_old - m_new);
      float sum = 0.f;
      for (int h = 0; h < 2; ++h) {
        const float w = vis[h] ? expf(x[h] - m_new) : 0.f;
        sum += w;
        if (real) sm.sc[r][lane + kWarp * h] = w;
      }
      for (int o = 16; o > 0; o /= 2) sum += shfl_xor(sum, o);
      if (real && lane == 0) {
        sm.l[r] = bad == 0.f ? sm.l[r] * alpha + sum : kNaN;
        sm.m[r] = m_new;
        sm.alpha[r] = alpha;
      }
    }
    NKV_SYNC();
    // The SIMT accumulators follow the rescale.
    for (int e = int(threadIdx.x); e < s.rows * kD; e += kMmaThreads) sm.oacc[e / kD][e % kD] *= sm.alpha[e / kD];
    for (int e = int(threadIdx.x); e < s.rows * Smem::kBmMax; e += kMmaThreads)
      sm.zacc[e / Smem::kBmMax][e % Smem::kBmMax] *= sm.alpha[e / Smem::kBmMax];
  }

  // acc (tensor-core fragments) = acc * alpha + W' . V for the compressed tile; value zeros and outliers.
  NKV_DEVICE void tile_values(const typename Smem::Stage& S, int64_t t0, int64_t n, float (&acc)[kMTiles][2][4]) {
    const int64_t G = p.v.dims.group_size, Bm = p.v.dims.meta_b();
    // Per channel group: the normalizer of p * scale (p <= 1), and sum p * zero per row.
    for (int b = int(threadIdx.x); b < Bm; b += kMmaThreads) {
      float mx = 0.f;
      for (int j = 0; j < n; ++j) mx = S.v_scale[j][b] > mx ? S.v_scale[j][b] : mx;  // (NaN scales: NaN weights)
      sm.v_shift[b] = pow2_normalizer(mx);
    }
    for (int e = int(threadIdx.x); e < s.rows * Bm; e += kMmaThreads) {
      const int r = int(e / Bm), b = int(e % Bm);
      float z = 0.f;
      for (int j = 0; j < n; ++j) z += sm.sc[r][j] * S.v_zero[j][b];
      sm.zacc[r][b] += z;
    }
    NKV_SYNC();
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
      const int mt = warp * kMTiles + mi, ch0 = 16 * mt;  // channels ch0 .. ch0 + 15
      const int b = int(ch0 / G);
      const int chunk = ch0 / kC, plane = mt % kPlanes;
      const float up = sm.v_shift[b], down = 1.f / up;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        if (nt >= ntiles) break;
        const int row = 8 * nt + g;  // B column of this lane
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int kk = 0; kk < kMmaTile / 16; ++kk) {
          const int j0 = 16 * kk + 2 * t;  // keys j0, j0 + 1, j0 + 8, j0 + 9
          uint32_t av[4];
          const uint8_t* c0 = &S.v_codes[0][chunk * 16];
          av[0] = codes_half2<kBits>(c0[j0 * kRB + g], c0[(j0 + 1) * kRB + g], plane);
          av[1] = codes_half2<kBits>(c0[j0 * kRB + g + 8], c0[(j0 + 1) * kRB + g + 8], plane);
          av[2] = codes_half2<kBits>(c0[(j0 + 8) * kRB + g], c0[(j0 + 9) * kRB + g], plane);
          av[3] = codes_half2<kBits>(c0[(j0 + 8) * kRB + g + 8], c0[(j0 + 9) * kRB + g + 8], plane);
          uint32_t hi[2], lo[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int k0 = j0 + 8 * j;
            const float w0 = row < s.rows ? sm.sc[row][k0] * S.v_scale[k0][b] * up : 0.f;
            const float w1 = row < s.rows ? sm.sc[row][k0 + 1] * S.v_scale[k0 + 1][b] * up : 0.f;
            split_half2(w0, w1, hi[j], lo[j]);
          }
          mma_16816(c, av, hi);
          mma_16816(c, av, lo);
        }
        // c[i]: channel ch0 + g + 8 (i / 2), row 8 nt + 2t + i % 2.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = 8 * nt + 2 * t + i % 2;
          const float a_r = r < s.rows ? sm.alpha[r] : 1.f;
          acc[mi][nt][i] = acc[mi][nt][i] * a_r + c[i] * down;
        }
      }
    }
    // Value outliers: acc saw code * scale + zero; add p * (exact - that).
    const int k = p.v.num_outliers();
    for (int e = int(threadIdx.x); k > 0 && e < n * Bm * k; e += kMmaThreads) {
      const int64_t j = e / (Bm * k), b = (e / k) % Bm;
      const int slot = e % k;
      const int64_t m = p.v.meta_index(s.bh, t0 + j, b), pos = p.v.outlier_pos(m, slot), ch = b * G + pos;
      if (pos >= (kD - b * G < G ? kD - b * G : G)) {
        atomic_or(&sm.flag, kBadOutlierIndex);
        continue;
      }
      if (p.v.repeated_slot(m, slot)) continue;
      const float approx = float(p.v.code(s.bh, t0 + j, ch)) * S.v_scale[j][b] + S.v_zero[j][b];
      const float delta = p.v.outlier_value(m, slot) - approx;
      for (int r = 0; r < s.rows; ++r) atomic_add(&sm.oacc[r][ch], sm.sc[r][j] * delta);
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
      for (int e = int(threadIdx.x); e < s.rows * kFpTile; e += kMmaThreads) {
        const int r = e / kFpTile, j = e % kFpTile;
        float dot = 0.f;
        for (int d = 0; d < kD; ++d) dot += sm.q[r][d] * sm.buf.fp.k[j][d];
        sm.sc[r][j] = dot;
      }
      NKV_SYNC();
      softmax(t0, n);
      rescale(acc);
      NKV_SYNC();
      for (int e = int(threadIdx.x); e < s.rows * kD; e += kMmaThreads) {
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
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = 8 * nt + 2 * t + i % 2;
          acc[mi][nt][i] *= r < s.rows ? sm.alpha[r] : 1.f;
        }
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
    for (int r = int(threadIdx.x); r < kAttnRows; r += kMmaThreads) sm.m[r] = kNegInf, sm.l[r] = 0.f, sm.alpha[r] = 1.f;
    NKV_SYNC();
    const bool skip = (sm.flag & kBadSegments) != 0;  // corrupt DGQ starts: read nothing (rows NaN below)

    if (!skip) full_precision(p.sink, 0, s.lo, s.hi < s.sink ? s.hi : s.sink, acc);
    // Compressed tokens [c_lo, c_hi), in tiles of kMmaTile, two stages.
    const int64_t c_lo = s.lo - s.sink > 0 ? s.lo - s.sink : 0;
    const int64_t c_hi = skip ? c_lo : (s.hi - s.sink < s.comp ? s.hi - s.sink : s.comp);
    float vm[2 * kVmPerThread];
    if (c_lo < c_hi) prefetch(c_lo, c_hi - c_lo < kMmaTile ? c_hi - c_lo : kMmaTile, 0, vm);
    int st = 0;
    for (int64_t t0 = c_lo; t0 < c_hi; t0 += kMmaTile, st ^= 1) {
      const int64_t n = c_hi - t0 < kMmaTile ? c_hi - t0 : kMmaTile;
      store_value_meta(st, vm);
      const int64_t t1 = t0 + kMmaTile;
      if (t1 < c_hi)
        prefetch(t1, c_hi - t1 < kMmaTile ? c_hi - t1 : kMmaTile, st ^ 1, vm);
      else
        cp_async_commit();  // an empty group keeps wait<1> meaning "this tile's group is done"
      cp_async_wait<1>();
      NKV_SYNC();
      const typename Smem::Stage& S = sm.buf.stage[st];
      tile_scores(S, n);
      NKV_SYNC();
      key_outliers(S, t0, n);
      NKV_SYNC();
      softmax(s.sink + t0, n);
      NKV_SYNC();
      tile_values(S, t0, n, acc);
      NKV_SYNC();
    }
    cp_async_wait<0>();
    NKV_SYNC();
    if (!skip) {
      const int64_t tail0 = s.sink + s.comp;
      full_precision(p.tail, tail0, s.lo > tail0 ? s.lo : tail0, s.hi, acc);
    }
    // Output: tensor-core part + SIMT part + value zeros per channel group.
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = 8 * nt + 2 * t + i % 2, ch = 16 * (warp * kMTiles + mi) + g + 8 * (i / 2);
          if (r < s.rows) sm.oacc[r][ch] += acc[mi][nt][i];
        }
    NKV_SYNC();
    float* part = L.partials + L.partial_index(s.b, s.h, s.rt, s.split);
    const bool poisoned = sm.flag != 0;
    const int64_t G = p.v.dims.group_size;
    for (int e = int(threadIdx.x); e < s.rows * (kD + 2); e += kMmaThreads) {
      const int r = e / (kD + 2), d = e % (kD + 2);
      part[e] = d < kD ? sm.oacc[r][d] + sm.zacc[r][d / G] : d == kD ? sm.m[r] : (poisoned ? kNaN : sm.l[r]);
    }
    if (threadIdx.x == 0 && sm.flag) report(L.status, sm.flag);
  }
};

template <typename Launch, int kBits, int kD>
NKV_KERNEL void __launch_bounds__(kMmaThreads, kMmaMinBlocks) attention_mma_kernel(const NKV_GRID_CONSTANT Launch L) {
  using K = MmaKernel<Launch, kBits, kD>;
  NKV_DYNAMIC_SMEM(smem);
  typename K::Smem& sm = *reinterpret_cast<typename K::Smem*>(smem);
  const BlockSetup s = block_setup(L, kMmaTile);
  K(L, sm, s).run();
}

// Launches the tensor-core kernel when it takes the problem (see the top of
// this file) and returns true; false: the caller runs the reference kernel.
template <typename Launch>
bool launch_attention_mma(const Launch& L, Dim3 grid, Stream stream) {
  using Params = decltype(Launch::p);
  using T = typename Params::Element;
  using Meta = typename Params::MetaType;
  constexpr bool kTypes = (std::is_same_v<T, core::bf16_t> || std::is_same_v<T, core::half_t>)&&std::is_same_v<Meta, T>;
  if constexpr (!kTypes) {
    return false;
  } else {
    const Params& p = L.p;
    const auto& kd = p.k.dims;
    const auto& vd = p.v.dims;
    const int64_t D = p.head_dim;
    auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; };
    const bool ok = kd.axis == core::GroupAxis::kTokens && (kd.segment_starts || kd.group_size % 16 == 0) &&
                    vd.axis == core::GroupAxis::kChannels && !vd.segment_starts && vd.group_size % 16 == 0 &&
                    kd.bits == vd.bits && kd.bits != 3 && (D == 64 || D == 128) && aligned(p.k.codes) &&
                    aligned(p.v.codes) && aligned(p.k.scale) && aligned(p.k.zero);
    if (!ok) return false;
    bool launched = false;
    core::layout::with_bits(kd.bits, [&]<int kBits>() {
      if constexpr (kBits != 3) {
        auto go = [&]<int kD>() {
          using K = MmaKernel<Launch, kBits, kD>;
          const size_t smem = sizeof(typename K::Smem);
          if (smem > kDefaultSmem && allow_smem(attention_mma_kernel<Launch, kBits, kD>, smem) != 0) {
            // This GPU has less shared memory: the reference kernel runs instead,
            // and the failed opt-in must not be reported as its launch error.
            (void)cudaGetLastError();
            return;
          }
          launch(attention_mma_kernel<Launch, kBits, kD>, grid, Dim3(kMmaThreads), smem, stream, L);
          launched = true;
        };
        if (D == 64)
          go.template operator()<64>();
        else
          go.template operator()<128>();
      }
    });
    return launched;
  }
}

}  // namespace nexuskv::cuda
