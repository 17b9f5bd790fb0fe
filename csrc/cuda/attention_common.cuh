// What the CUDA fused-attention kernels share: the problem as the device reads
// it, the per-block set-up (lengths, the key range of a split, validity of the
// values the host did not look at), the queries of a block, the general
// element decoder of the compressed cache, and the log-sum-exp merge of splits.
//
// Work split (flash-decoding): block (split, kv head x row tile, batch) owns
// kAttnRows query rows of one GQA group (every query head of the group and
// every query position, so one read of a K/V tile serves all of them) and a
// contiguous key range; it writes a partial (acc[D], max, sum) per row, and
// attention_merge_kernel combines the splits of each row.  Lengths stay on the
// device: the host sizes the grid from capacities, and a split whose range is
// empty writes an empty partial.
#pragma once

#include "attention_launch.h"
#include "device_common.cuh"
#include "hadamard.cuh"
#include "nexuskv/core/attention_params.h"
#include "nexuskv/core/nq_layout.h"

namespace nexuskv::cuda {

// The part of the problem one block owns, computed by every thread alike.
struct BlockSetup {
  int64_t b, h, bh, rt, split;
  int64_t r0, rows;               // query rows [r0, r0 + rows) of the kv head (row = gq * q_len + i)
  int64_t sink, comp, tail, len;  // tokens per region; len = sink + comp + tail
  int64_t lo, hi;                 // key positions of this split
  bool bad;                       // a length outside its capacity, or q_len > len > 0
};

// Lengths are read on the device; out-of-range ones mark the block bad (its
// rows become NaN) and are clamped so that nothing is read out of bounds.
// Positions of a sequence: sinks [0, sink), compressed [sink, sink + comp),
// tail [sink + comp, len); the queries are the last q_len positions.  The
// split covers whole tiles of tile_tokens keys from the first position the
// oldest query's window can see (the CPU's split, attention_kernel.cpp).
template <typename Launch>
NKV_DEVICE BlockSetup block_setup(const Launch& L, int64_t tile_tokens) {
  const auto& p = L.p;
  BlockSetup s;
  s.b = blockIdx.z, s.h = blockIdx.y / L.row_tiles, s.rt = blockIdx.y % L.row_tiles, s.split = blockIdx.x;
  s.bh = s.b * p.kv_heads + s.h;
  s.r0 = s.rt * kAttnRows;
  const int64_t left = p.rows_per_kv_head() - s.r0;
  s.rows = left < kAttnRows ? left : kAttnRows;
  const int64_t cap = p.k.dims.tokens < p.v.dims.tokens ? p.k.dims.tokens : p.v.dims.tokens;
  s.comp = p.compressed_len(s.b);
  s.sink = p.sink_len(s.b);
  s.tail = p.tail_len(s.b);
  s.bad =
      s.comp < 0 || s.comp > cap || s.sink < 0 || s.sink > p.sink.capacity || s.tail < 0 || s.tail > p.tail.capacity;
  if (s.bad) s.comp = s.sink = s.tail = 0;
  s.len = s.sink + s.comp + s.tail;
  if (s.len > 0 && s.len < p.q_len) s.bad = true;
  int64_t first = p.window > 0 ? s.len - p.q_len - p.window + 1 : 0;
  first = first > 0 ? first : 0;
  if (L.fp_split >= 0) {  // a decode launch's full-precision split: the sinks and the tail of every key
    s.split = L.fp_split, s.lo = first, s.hi = s.len;
    return s;
  }
  const int64_t span = core::ceil_div(core::ceil_div(s.len - first, L.splits), tile_tokens) * tile_tokens;
  s.lo = first + s.split * span;
  s.lo = s.lo < s.len ? s.lo : s.len;
  s.hi = s.lo + span < s.len ? s.lo + span : s.len;
  return s;
}

// Position of query row r (0 <= r < rows_per_kv_head) of the block's sequence.
template <typename Params>
NKV_DEVICE int64_t query_position(const Params& p, const BlockSetup& s, int64_t r) {
  return s.len - p.q_len + r % p.q_len;
}

// Checks one DGQ segment_starts row [A] with all threads of the block; ORs
// kBadSegments into *flag (shared) when the row is not ordered segments from 0
// within [0, T].  The caller synchronizes before reading the flag.
NKV_DEVICE void check_segments(const core::NQDims& d, int64_t row, uint32_t* flag) {
  if (!d.segment_starts) return;
  const int64_t A = d.meta_a();
  const int32_t* s = d.segment_starts + row * A;
  for (int64_t i = threadIdx.x; i < A; i += blockDim.x) {
    const int64_t end = i + 1 < A ? s[i + 1] : d.tokens;
    if ((i == 0 && s[0] != 0) || s[i] > end || end > d.tokens) atomic_or(flag, kBadSegments);
  }
}

// In-place butterflies of the fast Walsh-Hadamard transform over `rows` rows
// of y [rows, D] (row stride D) by the threads of a block, stage by stage
// (the CPU's order of operations); rows for which skip(row) holds are left
// alone.  Every thread must call it; it synchronizes after each stage.
template <typename Skip>
NKV_DEVICE void fwht_rows(float* y, int64_t rows, int64_t D, Skip skip) {
  for (int64_t len = 1; len < D; len <<= 1) {
    for (int64_t e = threadIdx.x; e < rows * (D / 2); e += blockDim.x) {
      const int64_t r = e / (D / 2), pr = e % (D / 2);
      if (skip(r)) continue;
      float* yr = y + r * D;
      const int64_t j = (pr / len) * 2 * len + pr % len;
      const float a = yr[j], c = yr[j + len];
      yr[j] = add_rn(a, c), yr[j + len] = sub_rn(a, c);
    }
    NKV_SYNC();
  }
}

// Loads the block's query rows, times the softmax scale, into q_s [kAttnRows, D]
// (rows past s.rows are zero) and rotates them when the cache is rotated
// (hadamard_rotate of q, as the CPU does); checks the signs (kBadSigns into
// *flag).  Ends with a barrier.
template <typename Params>
NKV_DEVICE void load_queries(const Params& p, const BlockSetup& s, float* q_s, uint32_t* flag) {
  const int64_t D = p.head_dim;
  const float* signs = p.rotation_signs;
  if (signs)
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
      if (signs[d] != 1.f && signs[d] != -1.f) atomic_or(flag, kBadSigns);
  for (int64_t e = threadIdx.x; e < kAttnRows * D; e += blockDim.x) {
    const int64_t r = e / D, d = e % D;
    float v = 0.f;
    if (r < s.rows) {
      v = core::to_float(p.q_row(s.b, s.h, s.r0 + r)[d]) * p.scale;
      if (signs) v *= signs[d];
    }
    q_s[e] = v;
  }
  NKV_SYNC();
  if (signs) {
    fwht_rows(q_s, kAttnRows, D, [](int64_t) { return false; });
    const float norm = 1.f / sqrtf(float(D));
    for (int64_t e = threadIdx.x; e < kAttnRows * D; e += blockDim.x) q_s[e] *= norm;
    NKV_SYNC();
  }
}

// One element of a compressed K or V: x_hat of token t, channel ch of row bh,
// its exact value at outlier positions.  Any grouping, NQ or DGQ.  An outlier
// index outside its group ORs kBadOutlierIndex into *flag.
template <typename Cache>
NKV_DEVICE float dequant_element(const Cache& c, int64_t bh, int64_t t, int64_t ch, uint32_t* flag) {
  const int64_t a = c.token_group(bh, t), b = c.channel_group(ch), m = c.meta_index(bh, a, b);
  int64_t pos, len;
  if (c.per_channel()) {
    pos = t - c.group_begin(bh, a), len = c.group_end(bh, a) - c.group_begin(bh, a);
  } else {
    const int64_t G = c.dims.group_size, c0 = b * G;
    pos = ch - c0, len = c.dims.head_dim - c0 < G ? c.dims.head_dim - c0 : G;
  }
  float v = float(c.code(bh, t, ch)) * c.scale_at(m) + c.zero_at(m);
  for (int s = 0; s < c.num_outliers(); ++s) {
    const int64_t o = c.outlier_pos(m, s);
    if (o >= len)
      atomic_or(flag, kBadOutlierIndex);
    else if (o == pos)
      v = c.outlier_value(m, s);
  }
  return v;
}

// ---- merge of the splits --------------------------------------------------------------------

// The log-sum-exp merge of `splits` partials for each of `rows` rows, by the
// threads of a block: part(r, sp) points at row r's partial of split sp
// ([D + 2]: unnormalized acc, max, sum).  row_s [rows, D] receives acc / sum;
// a row whose partials carry NaN (a NaN/Inf score, or invalid input) is NaN,
// one that attended nothing (length 0) zero.  weight_s [rows, splits] is
// scratch: exp(m_s - m) / l.  Ends with a barrier.
template <typename Part>
NKV_DEVICE void merge_splits(int64_t rows, int64_t D, int64_t splits, Part part, float* row_s, float* weight_s) {
  const float kNaN = bits_float(0x7fc00000u), kNegInf = bits_float(0xff800000u);
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    float m = kNegInf;
    bool nan = false;
    for (int64_t sp = 0; sp < splits; ++sp) {
      const float* pr = part(r, sp);
      m = pr[D] > m ? pr[D] : m;
      nan |= pr[D] != pr[D] || pr[D + 1] != pr[D + 1];
    }
    float l = 0.f;
    for (int64_t sp = 0; sp < splits; ++sp) {
      const float* pr = part(r, sp);
      const float w = m == kNegInf ? 0.f : expf(pr[D] - m);  // exp(-inf) = 0 for empty splits
      weight_s[r * splits + sp] = w;
      l += w * pr[D + 1];
    }
    // NaN rows; zeros where nothing was attended (sequence of length 0).
    for (int64_t sp = 0; sp < splits; ++sp) {
      float& w = weight_s[r * splits + sp];
      w = nan ? kNaN : (m == kNegInf ? 0.f : w / l);
    }
  }
  NKV_SYNC();
  for (int64_t e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const int64_t r = e / D, d = e % D;
    float acc = 0.f;
    for (int64_t sp = 0; sp < splits; ++sp) acc += weight_s[r * splits + sp] * part(r, sp)[d];
    row_s[e] = acc;
  }
  NKV_SYNC();
}

// Block (kv head x row tile, batch): for each of its query rows, the merge of
// the splits' partials (merge_splits), the inverse rotation, and the store
// into out [B, Hq, Lq, D] (q's dtype).
template <typename Out>
NKV_KERNEL void attention_merge_kernel(MergeArgs a, Out* __restrict__ out) {  // out [B, Hq, Lq, D]
  NKV_DYNAMIC_SMEM(smem);
  const int64_t D = a.head_dim, b = blockIdx.y, h = blockIdx.x / a.row_tiles, rt = blockIdx.x % a.row_tiles;
  const int64_t group = a.q_heads / a.kv_heads, r0 = rt * kAttnRows;
  const int64_t left = group * a.q_len - r0, rows = left < kAttnRows ? left : kAttnRows;
  float* row_s = reinterpret_cast<float*>(smem);  // [kAttnRows, D]
  float* weight_s = row_s + kAttnRows * D;        // [kAttnRows, splits]
  merge_splits(
      rows, D, a.splits,
      [&](int64_t r, int64_t sp) { return a.partials + a.partial_index(b, h, rt, sp) + r * (D + 2); }, row_s, weight_s);
  const float* signs = a.rotation_signs;
  if (signs) fwht_rows(row_s, rows, D, [](int64_t) { return false; });  // inverse: butterflies, then norm * signs
  const float norm = 1.f / sqrtf(float(D));
  for (int64_t e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const int64_t r = e / D, d = e % D, row = r0 + r, gq = row / a.q_len, i = row % a.q_len;
    const float v = signs ? row_s[e] * (norm * signs[d]) : row_s[e];
    out[((b * a.q_heads + h * group + gq) * a.q_len + i) * D + d] = core::from_float<Out>(v);
  }
}

template <typename Out>
int launch_attention_merge(const MergeArgs& a, Out* out, Stream stream) {
  const size_t smem = merge_smem_bytes(a);
  if (smem > kDefaultSmem) {
    const int err = int(allow_smem(attention_merge_kernel<Out>, smem));
    if (err != 0) return err;
  }
  launch(attention_merge_kernel<Out>, Dim3(unsigned(a.kv_heads * a.row_tiles), unsigned(a.batch)), Dim3(256), smem,
         stream, a, out);
  return 0;
}

}  // namespace nexuskv::cuda
