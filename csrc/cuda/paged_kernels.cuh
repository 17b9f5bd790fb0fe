// The paged operators on the GPU (problem: nexuskv/core/paged.h; format:
// paged_format.h; the CPU kernels they mirror: csrc/core/paged_kernels.cpp).
//
// Write: (1) with rotation signs, each (token, kv head) row of key and value
// rotated as core::hadamard_rotate_rows does (same operations, same order,
// the prescale of rows near FLT_MAX included) and rounded to X; (2) the NQ
// compressor of nq_compress.cuh (bit-identical to the CPU's) over all rows
// into scratch; (3) one block per (token, kv head) copies the row's codes,
// scales, zeros and outliers into its slot.  So a slot holds the CPU's bytes.
// The copy also classifies what it writes: a NaN scale/zero is a group whose
// input held NaN/Inf (the compressor poisons it), an infinite one a scale or
// zero that overflows X; tokens without a slot are not looked at, as on the
// CPU.
//
// Attention: plain SIMT, written to be obviously right.  One block per
// (token, kv head, up to kPagedHeadsPerBlock q heads of the GQA group): the
// request by binary search over query_start_loc, the q rows in shared memory
// (rotated), then tiles of kPagedTile keys at absolute positions (as the CPU)
// from the window start to the token's position: dequantize K and V of the
// tile into shared float rows (code * scale + zero, then the exact outliers),
// scores * scale, soft-cap, online softmax in float32 (the CPU's rules: a
// non-finite visible score makes the row NaN), acc += p . v; then 1 / sum,
// the inverse rotation, X.  With an exact window W, the tiles read the keys
// older than the row's window, then tiles of its W newest keys and values
// exact (the chunk's own rows or the page rings, PagedAttention::exact_row)
// meet the unrotated query and go to an unrotated accumulator, added after
// the inverse rotation (as on the CPU).  The arithmetic is the CPU's, in its order and
// exactly rounded (no FMA contraction): the results differ from the CPU's
// only through expf / tanhf against std::exp / std::tanh.  Invalid lengths,
// block ids, signs or outlier positions make the block's rows NaN and set a
// status bit; nothing is read out of bounds.
#pragma once

#include "device_common.cuh"
#include "nexuskv/core/nq_layout.h"
#include "nexuskv/core/paged.h"

namespace nexuskv::cuda {

constexpr int kPagedThreads = 128;
static_assert(kPagedThreads % 32 == 0, "the attention kernel dequantizes one (half, key) row per warp");
constexpr int kPagedTile = 32;         // keys per tile (the CPU's kTile)
constexpr int kPagedMaxHeadDim = 256;  // paged_layout's bound on head_dim
constexpr int kPagedScatterThreads = 64;

// ---- rotation ------------------------------------------------------------------------------

// core::hadamard_rotate_rows in place on rows y[r * stride + i] (r < nrows,
// i < n, n a power of two) in shared memory, by all threads of the block:
// max |x| per row, then (signs *) x, times the norm first when the row is
// above FLT_MAX / n, the butterflies of len 1, 2, 4, ..., and the norm (times
// the signs when inverse) last otherwise.  pre_s: [nrows] shared scratch.  The
// caller synchronizes after writing y; returns after a barrier.
NKV_DEVICE void rotate_rows_smem(float* y, int nrows, int stride, int n, const float* signs, bool inverse,
                                 float* pre_s) {
  const float norm = div_rn(1.f, sqrtf(float(n)));
  const float safe = div_rn(bits_float(0x7f7fffffu), float(n));  // std::numeric_limits<float>::max() / n
  for (int r = threadIdx.x; r < nrows; r += blockDim.x) {
    float amax = 0.f;
    for (int i = 0; i < n; ++i) {
      const float a = fabsf(y[r * stride + i]);
      amax = amax < a ? a : amax;  // std::max(amax, a): a NaN is passed over
    }
    pre_s[r] = amax > safe ? 1.f : 0.f;
  }
  NKV_SYNC();
  for (int e = threadIdx.x; e < nrows * n; e += blockDim.x) {
    const int r = e / n, i = e % n;
    float v = y[r * stride + i];
    if (!inverse) v = mul_rn(v, signs[i]);
    if (pre_s[r] != 0.f) v = mul_rn(v, norm);
    y[r * stride + i] = v;
  }
  NKV_SYNC();
  for (int len = 1; len < n; len <<= 1) {
    for (int e = threadIdx.x; e < nrows * (n / 2); e += blockDim.x) {
      const int r = e / (n / 2), pr = e % (n / 2);
      float* yr = y + r * stride;
      const int j = (pr / len) * 2 * len + pr % len;  // first of the pair (j, j + len)
      const float a = yr[j], b = yr[j + len];
      yr[j] = add_rn(a, b);
      yr[j + len] = sub_rn(a, b);
    }
    NKV_SYNC();
  }
  for (int e = threadIdx.x; e < nrows * n; e += blockDim.x) {
    const int r = e / n, i = e % n;
    const float post = pre_s[r] != 0.f ? 1.f : norm;
    y[r * stride + i] = mul_rn(y[r * stride + i], inverse ? mul_rn(post, signs[i]) : post);
  }
  NKV_SYNC();
}

// ---- write ---------------------------------------------------------------------------------

// Block `row` = t * kv_heads + h: key and value rows (t, h) rotated and rounded
// to X into rotated[0 or 1][row] ([2, rows, D]).  Signs not +-1: the rows are
// NaN (kBadSigns).
template <typename X>
NKV_KERNEL void paged_rotate_kernel(const X* __restrict__ key, const X* __restrict__ value, int64_t key_stride_t,
                                    int64_t value_stride_t, int kv_heads, int D, const float* __restrict__ signs,
                                    int64_t rows, X* __restrict__ rotated, uint32_t* status) {
  __shared__ float y[2 * kPagedMaxHeadDim];
  __shared__ float pre[2];
  __shared__ uint32_t bad;
  const int64_t row = blockIdx.x, t = row / kv_heads;
  const int h = int(row % kv_heads);
  if (threadIdx.x == 0) bad = 0;
  NKV_SYNC();
  for (int e = threadIdx.x; e < 2 * D; e += blockDim.x) {
    const int half = e / D, c = e % D;
    const X* src = half ? value + t * value_stride_t : key + t * key_stride_t;
    y[e] = core::to_float(src[int64_t(h) * D + c]);
  }
  for (int c = threadIdx.x; c < D; c += blockDim.x)
    if (signs[c] != 1.f && signs[c] != -1.f) atomic_or(&bad, kBadSigns);
  NKV_SYNC();
  rotate_rows_smem(y, 2, D, D, signs, false, pre);
  const float nan = bits_float(0x7fc00000u);
  for (int e = threadIdx.x; e < 2 * D; e += blockDim.x) {
    const int half = e / D, c = e % D;
    rotated[(half * rows + row) * D + c] = core::from_float<X>(bad ? nan : y[e]);
  }
  if (threadIdx.x == 0 && bad) report(status, bad);
}

// Block `row` = t * kv_heads + h: the NQ buffers of key and value row (t, h)
// in scratch copied into slot slot_mapping[t] (-1: none).
template <typename X>
NKV_KERNEL void paged_scatter_kernel(const NKV_GRID_CONSTANT core::PagedPool pool, uint8_t* __restrict__ pages,
                                     const int64_t* __restrict__ slot_mapping, const uint8_t* __restrict__ scratch,
                                     const NKV_GRID_CONSTANT PagedWriteScratch s, uint32_t* status) {
  const core::PagedLayout& l = pool.layout;
  const int64_t row = blockIdx.x, t = row / pool.kv_heads;
  const int h = int(row % pool.kv_heads);
  const int64_t slot = slot_mapping[t];  // the same for every thread: uniform exits
  if (slot == -1) return;
  if (slot < -1 || slot >= pool.num_slots()) {
    if (threadIdx.x == 0) report(status, kBadSlot);
    return;
  }
  uint8_t* page = pages + pool.head_page(slot / l.block_size, h);
  const int offset = int(slot % l.block_size);
  const int G = l.groups(), k = l.num_outliers;
  uint32_t bits = 0;
  for (int half = 0; half < 2; ++half) {
    const core::PagedSlot<X> dst = core::paged_slot<X>(l, page, offset, half == 1);
    const int rb = half ? l.value_row_bytes() : l.key_row_bytes();
    const uint8_t* codes = scratch + s.codes[half] + row * rb;
    for (int i = threadIdx.x; i < rb; i += blockDim.x) dst.codes[i] = codes[i];
    const X* scale = reinterpret_cast<const X*>(scratch + s.scale[half]) + row * G;
    const X* zero = reinterpret_cast<const X*>(scratch + s.zero[half]) + row * G;
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
      dst.scale[g] = scale[g];
      dst.zero[g] = zero[g];
      const float fs = core::to_float(scale[g]), fz = core::to_float(zero[g]);
      if (fs != fs || fz != fz)
        bits |= kNonFiniteInput;  // poisoned by the compressor: NaN/Inf in the group
      else if (non_finite(fs) || non_finite(fz))
        bits |= kMetaOverflow;
    }
    const uint8_t* idx = scratch + s.outlier_idx[half] + row * G * k;
    const X* val = reinterpret_cast<const X*>(scratch + s.outlier_val[half]) + row * G * k;
    for (int i = threadIdx.x; i < G * k; i += blockDim.x) {
      dst.outlier_idx[i] = idx[i];
      dst.outlier_val[i] = val[i];
    }
  }
  report(status, bits);
}

// The exact window's rings: block h writes kv head h's ring rows of every
// token in token order; thread c always writes channel c, so the last token
// of a ring row wins without a race.
template <typename X>
NKV_KERNEL void paged_exact_write_kernel(const NKV_GRID_CONSTANT core::PagedWrite<X> w, uint32_t* status) {
  const core::PagedLayout& l = w.pool.layout;
  const core::PagedOffsets off(l);
  const int h = int(blockIdx.x), D = l.head_dim;
  for (int64_t t = 0; t < w.num_tokens; ++t) {
    const int64_t slot = w.slot_mapping[t];  // the same for every thread
    if (slot == -1) continue;
    if (slot < -1 || slot >= w.pool.num_slots()) {
      if (threadIdx.x == 0) report(status, kBadSlot);
      continue;
    }
    uint8_t* page = w.pages + w.pool.head_page(slot / l.block_size, h);
    const int offset = int(slot % l.block_size);
    X* kr = core::paged_ring_row<X>(off, page, offset, D, false);
    X* vr = core::paged_ring_row<X>(off, page, offset, D, true);
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
      kr[c] = w.key[t * w.key_stride_t + int64_t(h) * D + c];
      vr[c] = w.value[t * w.value_stride_t + int64_t(h) * D + c];
    }
  }
}

template <typename X>
void launch_paged_exact_write(const core::PagedWrite<X>& w, uint32_t* status, Stream stream) {
  if (w.num_tokens == 0) return;
  launch(paged_exact_write_kernel<X>, Dim3(unsigned(w.pool.kv_heads)), Dim3(kPagedThreads), 0, stream, w, status);
}

template <typename X>
void launch_paged_write(const core::PagedWrite<X>& w, uint8_t* scratch, uint32_t* status, Stream stream) {
  const core::PagedLayout& l = w.pool.layout;
  const int H = w.pool.kv_heads, D = l.head_dim;
  const int64_t rows = w.num_tokens * H;
  if (rows == 0) return;
  const PagedWriteScratch s = paged_write_scratch(l, rows, w.rotation_signs != nullptr);
  // x.at(n = token, t = kv head, c) of key / value.
  RowsView<X> src[2] = {{w.key, w.key_stride_t, D, 1}, {w.value, w.value_stride_t, D, 1}};
  if (w.rotation_signs) {
    X* rotated = reinterpret_cast<X*>(scratch + s.rotated);
    launch(paged_rotate_kernel<X>, Dim3(unsigned(rows)), Dim3(kPagedThreads), 0, stream, w.key, w.value, w.key_stride_t,
           w.value_stride_t, H, D, w.rotation_signs, rows, rotated, status);
    src[0] = {rotated, int64_t(H) * D, D, 1};
    src[1] = {rotated + rows * D, int64_t(H) * D, D, 1};
  }
  for (int half = 0; half < 2; ++half) {
    NQCompressArgs<X, X> a;
    a.dims = l.token_dims(half ? l.value_bits : l.key_bits);
    a.dims.rows = w.num_tokens;  // [tokens, kv heads, D], per-token groups: each (token, head) row alone
    a.dims.tokens = H;
    a.dims.fit_range = half ? w.value_fit_range : w.key_fit_range;
    a.x = src[half];
    a.codes = scratch + s.codes[half];
    a.scale = reinterpret_cast<X*>(scratch + s.scale[half]);
    a.zero = reinterpret_cast<X*>(scratch + s.zero[half]);
    a.outlier_idx = scratch + s.outlier_idx[half];
    a.outlier_val = reinterpret_cast<X*>(scratch + s.outlier_val[half]);
    a.status = nullptr;  // the scatter reports, for the rows with a slot only
    launch_nq_compress(a, stream);
  }
  launch(paged_scatter_kernel<X>, Dim3(unsigned(rows)), Dim3(kPagedScatterThreads), 0, stream, w.pool, w.pages,
         w.slot_mapping, static_cast<const uint8_t*>(scratch), s, status);
}

// ---- attention -----------------------------------------------------------------------------

// Floats of dynamic shared memory for `heads` q rows of head_dim D: q, acc
// [heads, D]; k, v tiles [kPagedTile, D + 1] (the padding column keeps the
// score loop, one key per lane, free of bank conflicts); scores
// [heads, kPagedTile]; running max, sum and rescale [heads]; with an exact
// window the unrotated q and acc [heads, D] too.
NKV_HOST_DEVICE int paged_attention_smem_floats(int D, int heads, bool exact) {
  return (exact ? 4 : 2) * heads * D + 2 * kPagedTile * (D + 1) + heads * kPagedTile + 3 * heads;
}

template <typename X>
NKV_KERNEL void paged_attention_kernel(const NKV_GRID_CONSTANT core::PagedAttention<X> p, int heads_per_block,
                                       int head_chunks, uint32_t* status) {
  NKV_DYNAMIC_SMEM(smem);
  const core::PagedLayout& l = p.pool.layout;
  const int D = l.head_dim, P = l.block_size, KS = D + 1, T = kPagedTile;
  const int gq = p.gqa_group(), h = int(blockIdx.y) / head_chunks;
  const int head0 = (int(blockIdx.y) % head_chunks) * heads_per_block;  // first q head of the group in this block
  const int R = gq - head0 < heads_per_block ? gq - head0 : heads_per_block;
  const int64_t token = blockIdx.x;
  X* const out = p.out + (token * p.q_heads + int64_t(h) * gq + head0) * D;  // R rows of D, contiguous
  float* q_s = reinterpret_cast<float*>(smem);                               // [R, D]
  float* acc_s = q_s + heads_per_block * D;                                  // [R, D]
  float* k_s = acc_s + heads_per_block * D;                                  // [T, KS]
  float* v_s = k_s + T * KS;                                                 // [T, KS]
  float* p_s = v_s + T * KS;                                                 // [R, T] scores, then weights
  float* m_s = p_s + heads_per_block * T;                                    // [R] running max
  float* l_s = m_s + heads_per_block;                                        // [R] running sum
  float* alpha_s = l_s + heads_per_block;      // [R] rescale of the tile; NaN: row not updated
  float* qx_s = alpha_s + heads_per_block;     // [R, D] unrotated q (exact window only)
  float* accx_s = qx_s + heads_per_block * D;  // [R, D] unrotated acc of the exact keys (exact window only)
  const int W = l.exact_window;
  __shared__ int64_t page_s[kPagedTile];      // head page of each key of the tile, -1: not read
  __shared__ int slot_s[kPagedTile];          // the key's slot in its page: position % block size
  __shared__ int bad_s[kPagedHeadsPerBlock];  // a visible score was not finite
  __shared__ float pre_s[kPagedHeadsPerBlock];
  __shared__ uint32_t flag;
  const float kNegInf = bits_float(0xff800000u), kNaN = bits_float(0x7fc00000u);

  // query_start_loc from 0, non-decreasing, within q (every block checks all
  // of it: then the binary search below finds the one request of the row).
  const int32_t* qsl = p.query_start_loc;
  if (threadIdx.x == 0) flag = 0;
  NKV_SYNC();
  for (int64_t r = threadIdx.x; r < p.num_reqs; r += blockDim.x)
    if (qsl[r + 1] < qsl[r]) atomic_or(&flag, kBadLengths);
  NKV_SYNC();
  // The row's request (the same in every thread: uniform exits).  Padding
  // rows (token >= query_start_loc[num_reqs]) are zero, as on the CPU.
  const int64_t q_end = qsl[p.num_reqs];
  bool bad = flag != 0 || qsl[0] != 0 || q_end > p.num_tokens;
  NKV_SYNC();  // every thread has read flag before it is written again
  if (!bad && token >= q_end) {
    for (int e = threadIdx.x; e < R * D; e += blockDim.x) out[e] = core::from_float<X>(0.f);
    return;
  }
  int64_t req = 0, qpos = 0;
  if (!bad) {                                    // q_end > token >= 0 = qsl[0]: num_reqs >= 1
    req = find_segment(qsl, p.num_reqs, token);  // the request of the row: qsl[req] <= token < qsl[req + 1]
    const int64_t b = qsl[req], e = qsl[req + 1], len = p.seq_lens[req];
    bad = !(b <= token && token < e && len >= e - b && len <= p.max_blocks * P);
    qpos = len - (e - b) + (token - b);  // in [0, len)
  }
  if (bad) {
    for (int e = threadIdx.x; e < R * D; e += blockDim.x) out[e] = core::from_float<X>(kNaN);
    if (threadIdx.x == 0) report(status, kBadLengths);
    return;
  }
  const int64_t key_begin = p.window > 0 && qpos - p.window + 1 > 0 ? qpos - p.window + 1 : 0;
  const int64_t key_end = qpos + 1;  // <= seq_len <= max_blocks * P: block-table columns in range
  const int32_t* table = p.block_table + req * p.max_blocks;
  const float* signs = p.rotation_signs;

  if (signs)
    for (int c = threadIdx.x; c < D; c += blockDim.x)
      if (signs[c] != 1.f && signs[c] != -1.f) atomic_or(&flag, kBadSigns);
  for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
    const int i = e / D, c = e % D;
    q_s[e] = core::to_float(p.q[token * p.q_stride_t + (int64_t(h) * gq + head0 + i) * p.q_stride_h + c]);
    acc_s[e] = 0.f;
    if (W > 0) qx_s[e] = q_s[e], accx_s[e] = 0.f;
  }
  for (int i = threadIdx.x; i < R; i += blockDim.x) m_s[i] = kNegInf, l_s[i] = 0.f, bad_s[i] = 0;
  NKV_SYNC();
  if (signs) rotate_rows_smem(q_s, R, D, D, signs, false, pre_s);

  // The page's buffer offsets once per block: PagedLayout's accessors divide (64-bit), and
  // evaluated per element they made the tile loop ~100x slower than its arithmetic.
  const core::PagedOffsets off(l);
  const int G = off.groups, k = off.num_outliers;
  // Phase 0: the coded keys [key_begin, coded_end); phase 1: the exact window [exact_begin, key_end).
  const int64_t coded_end = key_end - W, exact_begin = coded_end > key_begin ? coded_end : key_begin;
  const int64_t chunk_start = p.seq_lens[req] - (qsl[req + 1] - qsl[req]);  // the call's own rows from here
  for (int phase = 0; phase < (W > 0 ? 2 : 1); ++phase) {
    const int64_t phase_begin = phase ? exact_begin : key_begin, phase_end = phase ? key_end : coded_end;
    for (int64_t k0 = phase ? phase_begin : phase_begin / T * T; k0 < phase_end; k0 += T) {
      const int n = int(phase_end - k0 < T ? phase_end - k0 : T);
      // Head pages of the tile's keys; positions before the window are not read.
      for (int j = threadIdx.x; j < T; j += blockDim.x) {
        int64_t page = -1;
        if (j < n && k0 + j >= key_begin) {
          if (phase && k0 + j >= chunk_start) {
            page = 0;  // read from the call's own key / value
          } else {
            const int32_t id = table[(k0 + j) / P];
            if (id >= 0 && id < p.pool.num_blocks)
              page = p.pool.head_page(id, h);
            else
              atomic_or(&flag, kBadBlock);
          }
        }
        page_s[j] = page;
        slot_s[j] = int((k0 + j) % P);
      }
      NKV_SYNC();
      if (phase) {
        // Exact rows, as written (not rotated).
        for (int e = threadIdx.x; e < 2 * T * D; e += blockDim.x) {
          const int half = e / (T * D), j = (e / D) % T, c = e % D;
          float* dst = (half ? v_s : k_s) + j * KS;
          dst[c] = page_s[j] < 0 ? 0.f : core::to_float(p.exact_row(off, req, k0 + j, h, half == 1)[c]);
        }
        NKV_SYNC();
      } else {
        // Dense part: code * scale + zero; rows not read are 0.  One warp per (half, key) row,
        // its lanes over the channels: the slot's pointers once per row, no division per element.
        for (int row = int(threadIdx.x) / 32; row < 2 * T; row += int(blockDim.x) / 32) {
          const int half = row >= T ? 1 : 0, j = row - half * T;
          float* dst = (half ? v_s : k_s) + j * KS;
          if (page_s[j] < 0) {
            for (int c = int(threadIdx.x) % 32; c < D; c += 32) dst[c] = 0.f;
            continue;
          }
          const core::PagedSlot<X> s =
              core::paged_slot<X>(off, const_cast<uint8_t*>(p.pages) + page_s[j], slot_s[j], half == 1);
          const int bits = half ? l.value_bits : l.key_bits;
          for (int c = int(threadIdx.x) % 32; c < D; c += 32) {
            const int g = c / l.group_size;
            const uint32_t code = core::layout::code_at(s.codes, bits, c);
            dst[c] = add_rn(mul_rn(float(code), core::to_float(s.scale[g])), core::to_float(s.zero[g]));
          }
        }
        NKV_SYNC();
        // Exact outliers: one thread per (half, key, group), its k in order (the
        // last of repeated positions wins, as on the CPU).
        if (k > 0) {
          for (int e = threadIdx.x; e < 2 * T * G; e += blockDim.x) {
            const int half = e / (T * G), j = (e / G) % T, g = e % G;
            if (page_s[j] < 0) continue;
            const core::PagedSlot<X> s =
                core::paged_slot<X>(off, const_cast<uint8_t*>(p.pages) + page_s[j], slot_s[j], half == 1);
            const int begin = g * l.group_size, end = begin + l.group_size < D ? begin + l.group_size : D;
            float* row = (half ? v_s : k_s) + j * KS;
            for (int m = 0; m < k; ++m) {
              const int pos = begin + s.outlier_idx[g * k + m];
              if (pos >= end) {
                atomic_or(&flag, kBadOutlierIndex);
                continue;
              }
              row[pos] = core::to_float(s.outlier_val[g * k + m]);
            }
          }
          NKV_SYNC();
        }
      }  // phase 0's dequantization
      // Scores: one thread per (row, key), the keys of a warp consecutive.
      for (int e = threadIdx.x; e < R * T; e += blockDim.x) {
        const int i = e / T, j = e % T;
        float score = kNegInf;
        if (j < n && page_s[j] >= 0 && (phase ? p.visible_exact(qpos, k0 + j) : p.visible_coded(qpos, k0 + j))) {
          const float* qr = (phase ? qx_s : q_s) + i * D;
          const float* kr = k_s + j * KS;
          float dot = 0.f;
          for (int c = 0; c < D; ++c) dot = add_rn(dot, mul_rn(qr[c], kr[c]));
          score = mul_rn(dot, p.scale);
          if (p.softcap > 0.f) score = mul_rn(p.softcap, tanhf(div_rn(score, p.softcap)));
          if (non_finite(score)) bad_s[i] = 1;
        }
        p_s[e] = score;
      }
      NKV_SYNC();
      // Online softmax, one thread per row (the CPU's steps).
      for (int i = threadIdx.x; i < R; i += blockDim.x) {
        float* pr = p_s + i * T;
        float tile_max = kNegInf;
        for (int j = 0; j < n; ++j) tile_max = pr[j] > tile_max ? pr[j] : tile_max;
        if (tile_max == kNegInf || bad_s[i]) {
          alpha_s[i] = kNaN;  // no update
          continue;
        }
        const float new_max = tile_max > m_s[i] ? tile_max : m_s[i];
        const float correction = expf(m_s[i] - new_max);  // exp(-inf) = 0 on the first tile
        float sum = mul_rn(l_s[i], correction);
        for (int j = 0; j < n; ++j) {
          const float w = pr[j] == kNegInf ? 0.f : expf(pr[j] - new_max);
          pr[j] = w;
          sum = add_rn(sum, w);
        }
        l_s[i] = sum;
        m_s[i] = new_max;
        alpha_s[i] = correction;
      }
      NKV_SYNC();
      for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
        const int i = e / D, c = e % D;
        const float alpha = alpha_s[i];
        if (alpha != alpha) continue;
        // The exact tiles come last: through the coded ones the exact accumulator is still 0.
        float* target = phase ? accx_s : acc_s;
        if (phase) acc_s[e] = mul_rn(acc_s[e], alpha);
        float a = mul_rn(target[e], alpha);
        const float* pr = p_s + i * T;
        for (int j = 0; j < n; ++j)
          if (page_s[j] >= 0) a = add_rn(a, mul_rn(pr[j], v_s[j * KS + c]));  // the keys the row sees
        target[e] = a;
      }
      NKV_SYNC();
    }
  }  // phases

  // Every query sees its own key, so sum > 0 unless a score was not finite.
  const bool poisoned = flag != 0;
  for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
    const int i = e / D;
    const float inv = poisoned || bad_s[i] || !(l_s[i] > 0.f) ? kNaN : div_rn(1.f, l_s[i]);
    acc_s[e] = mul_rn(acc_s[e], inv);
  }
  NKV_SYNC();
  if (signs) rotate_rows_smem(acc_s, R, D, D, signs, true, pre_s);
  for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
    float o = acc_s[e];
    if (W > 0) {
      const int i = e / D;
      const float inv = poisoned || bad_s[i] || !(l_s[i] > 0.f) ? kNaN : div_rn(1.f, l_s[i]);
      o = add_rn(o, mul_rn(accx_s[e], inv));
    }
    out[e] = core::from_float<X>(o);
  }
  if (threadIdx.x == 0 && poisoned) report(status, flag);
}

template <typename X>
int launch_paged_attention_simt(const core::PagedAttention<X>& p, uint32_t* status, Stream stream) {
  if (p.num_tokens == 0) return 0;
  const int gq = p.gqa_group();
  const int heads = gq < kPagedHeadsPerBlock ? gq : kPagedHeadsPerBlock;
  const int chunks = int(core::ceil_div(gq, kPagedHeadsPerBlock));
  const size_t smem =
      size_t(paged_attention_smem_floats(p.pool.layout.head_dim, heads, p.pool.layout.exact_window > 0)) *
      sizeof(float);
  // Opt in above the default (with room for the kernel's static shared memory).
  if (smem + 1024 > kDefaultSmem) {
    const int err = int(allow_smem(paged_attention_kernel<X>, smem));
    if (err != 0) return err;
  }
  launch(paged_attention_kernel<X>, Dim3(unsigned(p.num_tokens), unsigned(p.pool.kv_heads * chunks)),
         Dim3(kPagedThreads), smem, stream, p, heads, chunks, status);
  return 0;
}

}  // namespace nexuskv::cuda
