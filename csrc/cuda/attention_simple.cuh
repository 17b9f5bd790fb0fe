// The reference CUDA fused-attention kernel: plain SIMT, every format the
// CPU kernel takes (any grouping of K and V, NQ or DGQ, outliers, 2/3/4/8
// bits, any head_dim % 16 == 0 up to 256), written to be obviously right
// rather than fast.  The fast kernel (attention_mma.cuh) is compared with it.
//
// Per block (attention_common.cuh): its query rows in shared memory (scaled,
// rotated), then tiles of kSimpleTile key positions: each K/V element decoded
// on its own into a float tile (dequant_element; sinks and tail read from
// their rows and rotated when the cache is), scores = q . k, soft-cap,
// causal/window mask, online softmax in float32, acc += p . v, all in shared
// memory.  A NaN/Inf score among the visible ones makes its row NaN (as the
// CPU kernel does); invalid lengths, segments, outlier indices or signs make
// every row of the block NaN.
#pragma once

#include "attention_common.cuh"

namespace nexuskv::cuda {

constexpr int kSimpleTile = 32;
constexpr int kSimpleThreads = 256;

// Floats of shared memory: q, k tile, v tile, acc, scores, per-row state.
inline size_t simple_smem_bytes(int64_t D) {
  return size_t(kAttnRows * D + 2 * kSimpleTile * D + kAttnRows * D + kAttnRows * kSimpleTile + 3 * kAttnRows) *
         sizeof(float);
}

// Channel d of the key (is_k) or value at key position kp: from the sinks, the
// compressed cache or the tail.
template <typename Params>
NKV_DEVICE float kv_element(const Params& p, const BlockSetup& s, bool is_k, int64_t kp, int64_t d, uint32_t* flag) {
  if (kp >= s.sink && kp < s.sink + s.comp) return dequant_element(is_k ? p.k : p.v, s.bh, kp - s.sink, d, flag);
  const auto& f = kp < s.sink ? p.sink : p.tail;
  const int64_t t = kp < s.sink ? kp : kp - s.sink - s.comp;
  return core::to_float((is_k ? f.k : f.v).row(s.b, s.h, t)[d]);
}

template <typename Launch>
NKV_KERNEL void attention_simple_kernel(const NKV_GRID_CONSTANT Launch L) {
  NKV_DYNAMIC_SMEM(smem);
  const auto& p = L.p;
  const int64_t D = p.head_dim;
  float* q_s = reinterpret_cast<float*>(smem);  // [kAttnRows, D]
  float* k_s = q_s + kAttnRows * D;             // [kSimpleTile, D], then v_s [kSimpleTile, D]
  float* v_s = k_s + kSimpleTile * D;
  float* acc_s = v_s + kSimpleTile * D;        // [kAttnRows, D]
  float* p_s = acc_s + kAttnRows * D;          // [kAttnRows, kSimpleTile] scores, then weights
  float* m_s = p_s + kAttnRows * kSimpleTile;  // [kAttnRows] running max, sum, rescale
  float* l_s = m_s + kAttnRows;
  float* alpha_s = l_s + kAttnRows;
  __shared__ uint32_t flag;
  const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);

  const BlockSetup s = block_setup(L, kSimpleTile);
  if (threadIdx.x == 0) flag = s.bad ? kBadLengths : 0u;
  NKV_SYNC();
  check_segments(p.k.dims, s.bh, &flag);
  check_segments(p.v.dims, s.bh, &flag);
  load_queries(p, s, q_s, &flag);
  for (int64_t e = threadIdx.x; e < kAttnRows * D; e += blockDim.x) acc_s[e] = 0.f;
  for (int64_t r = threadIdx.x; r < kAttnRows; r += blockDim.x) m_s[r] = kNegInf, l_s[r] = 0.f;
  NKV_SYNC();
  // Corrupt segments: do not read through them (the rows are NaN below).
  const bool skip = (flag & kBadSegments) != 0;
  const float* signs = p.rotation_signs;

  for (int64_t t0 = s.lo; !skip && t0 < s.hi; t0 += kSimpleTile) {
    const int64_t n = s.hi - t0 < kSimpleTile ? s.hi - t0 : kSimpleTile;
    // Rows j of the k and v tiles; sinks and tail are stored in the original
    // basis, so with a rotated cache their rows are rotated here (signs,
    // butterflies, norm) and the compressed ones are used as they are.
    auto full_precision = [&](int64_t row) {  // row of [k_s; v_s]
      const int64_t j = row % kSimpleTile, kp = t0 + j;
      return j < n && (kp < s.sink || kp >= s.sink + s.comp);
    };
    for (int64_t e = threadIdx.x; e < 2 * kSimpleTile * D; e += blockDim.x) {
      const int64_t row = e / D, j = row % kSimpleTile, d = e % D;
      float v = j < n ? kv_element(p, s, row < kSimpleTile, t0 + j, d, &flag) : 0.f;
      if (signs && full_precision(row)) v *= signs[d];
      k_s[e] = v;
    }
    NKV_SYNC();
    if (signs) {
      fwht_rows(k_s, 2 * kSimpleTile, D, [&](int64_t row) { return !full_precision(row); });
      const float norm = 1.f / sqrtf(float(D));
      for (int64_t e = threadIdx.x; e < 2 * kSimpleTile * D; e += blockDim.x)
        if (full_precision(e / D)) k_s[e] *= norm;
      NKV_SYNC();
    }
    // Scores, soft-capped.
    for (int64_t e = threadIdx.x; e < kAttnRows * kSimpleTile; e += blockDim.x) {
      const int64_t r = e / kSimpleTile, j = e % kSimpleTile;
      float acc = 0.f;
      if (r < s.rows && j < n)
        for (int64_t d = 0; d < D; ++d) acc += q_s[r * D + d] * k_s[j * D + d];
      if (p.softcap > 0.f) acc = p.softcap * tanhf(acc / p.softcap);
      p_s[e] = acc;
    }
    NKV_SYNC();
    // Online softmax, one thread per row.
    for (int64_t r = threadIdx.x; r < s.rows; r += blockDim.x) {
      const int64_t qp = query_position(p, s, s.r0 + r);
      float* pr = p_s + r * kSimpleTile;
      float tile_max = kNegInf;
      bool finite = true;
      for (int64_t j = 0; j < n; ++j)
        if (p.visible(qp, t0 + j)) {
          tile_max = pr[j] > tile_max ? pr[j] : tile_max;
          finite &= !non_finite(pr[j]);
        }
      const float m_new = m_s[r] > tile_max ? m_s[r] : tile_max;
      const float alpha = m_new == kNegInf ? 1.f : expf(m_s[r] - m_new);
      float sum = 0.f;
      for (int64_t j = 0; j < kSimpleTile; ++j) {
        const float w = j < n && p.visible(qp, t0 + j) ? expf(pr[j] - m_new) : 0.f;
        pr[j] = w;
        sum += w;
      }
      // A NaN/Inf score the row sees makes the row NaN, as plain attention does.
      l_s[r] = finite ? l_s[r] * alpha + sum : kNaN;
      m_s[r] = m_new;
      alpha_s[r] = alpha;
    }
    NKV_SYNC();
    for (int64_t e = threadIdx.x; e < s.rows * D; e += blockDim.x) {
      const int64_t r = e / D, d = e % D;
      float acc = acc_s[e] * alpha_s[r];
      for (int64_t j = 0; j < n; ++j) acc += p_s[r * kSimpleTile + j] * v_s[j * D + d];
      acc_s[e] = acc;
    }
    NKV_SYNC();
  }
  float* part = L.partials + L.partial_index(s.b, s.h, s.rt, s.split);
  const bool poisoned = flag != 0;
  for (int64_t e = threadIdx.x; e < s.rows * (D + 2); e += blockDim.x) {
    const int64_t r = e / (D + 2), d = e % (D + 2);
    part[e] = d < D ? acc_s[r * D + d] : d == D ? m_s[r] : (poisoned ? kNaN : l_s[r]);
  }
  if (threadIdx.x == 0 && flag) report(L.status, flag);
}

}  // namespace nexuskv::cuda
