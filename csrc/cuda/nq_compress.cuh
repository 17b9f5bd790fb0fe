// NQ compression on the GPU (format: nq_format.h), in two kernels (three with
// fitted ranges):
//
//   meta: one scale/zero (and the outliers) per group, written in the meta
//     dtype.  Without outliers one thread per group (min/max over its
//     entries; neighbouring threads take neighbouring channels or channel
//     groups, so the loads of a warp coalesce); with outliers one warp per
//     group, which ranks the group's entries by (value, position) in shared
//     memory and applies the CPU's rule (the k entries whose removal shrinks
//     the range most: i from the bottom, k - i from the top, the first best i).
//   fit (fitted ranges only): one thread per group refines its scale and zero
//     by least squares, as the CPU's nq_fit.h.
//   pack: one thread per (row, token, chunk) quantizes the chunk's channels
//     with the stored scale/zero and packs them with nq_layout.h's pack_chunk,
//     one 16-byte (3 bits: 24-byte) store.
//
// The arithmetic is the CPU kernels' (csrc/core/nq_quantize.cpp), written with
// exactly rounded operations and the same directed rounding (half.h), so
// codes, scales, zeros and outliers are bit-identical to the CPU's for finite
// input.  Non-finite input: the group's scale and zero are stored NaN (so
// everything read from it is NaN, never a silent value) and kNonFiniteInput is
// reported; a scale or zero that overflows the meta dtype reports kMetaOverflow.
#pragma once

#include "device_common.cuh"
#include "nexuskv/core/nq_layout.h"

namespace nexuskv::cuda {

// The entries of group g = meta_index(n, a, b) (nq_format.h): a token range of
// one channel (kTokens) or a channel range of one token (kChannels).
struct GroupSpan {
  int64_t n, t0, c0;  // row, first token, first channel
  int64_t len;        // entries
  bool along_tokens;  // entry i is (t0 + i, c0) or (t0, c0 + i)
};

NKV_DEVICE GroupSpan group_span(const core::NQDims& d, int64_t g) {
  const int64_t A = d.meta_a(), Bm = d.meta_b();
  const int64_t n = g / (A * Bm), a = (g / Bm) % A, b = g % Bm;
  GroupSpan s;
  s.n = n;
  s.along_tokens = d.axis == core::GroupAxis::kTokens;
  if (s.along_tokens) {
    s.t0 = d.group_start(n, a), s.c0 = b;
    const int64_t end = d.group_end(n, a);
    s.len = end > s.t0 ? end - s.t0 : 0;
  } else {
    s.t0 = a, s.c0 = b * d.group_size;
    s.len = d.head_dim - s.c0 < d.group_size ? d.head_dim - s.c0 : d.group_size;
  }
  return s;
}

template <typename In>
NKV_DEVICE const In& entry(const RowsView<In>& x, const GroupSpan& s, int64_t i) {
  return s.along_tokens ? x.at(s.n, s.t0 + i, s.c0) : x.at(s.n, s.t0, s.c0 + i);
}

// Scale and zero of a group from its min/max, as the CPU's make_meta
// (csrc/core/nq_range.h): zero = min rounded down to Meta, range = max - zero,
// scale = range / qmax clamped to at least the smallest normal float when the
// range is positive, rounded up.  Returns the status bits: kRangeOverflow when
// the range is not finite in float32 (with a finite zero), kMetaOverflow when a
// stored value is not finite.
template <typename Meta>
NKV_DEVICE uint32_t store_scale_zero(float mn, float mx, float qmax, Meta* scale, Meta* zero) {
  constexpr float kMinScale = 1.17549435e-38f;
  const Meta z = core::round_down<Meta>(mn);
  const float zf = core::to_float(z);
  const float range = sub_rn(mx, zf);
  const float si = div_rn(range, qmax);
  const Meta s = core::round_up<Meta>(range > 0.f && si < kMinScale ? kMinScale : si);
  *scale = s;
  *zero = z;
  uint32_t bits = non_finite(range) && !non_finite(zf) ? kRangeOverflow : 0u;
  if (non_finite(zf) || non_finite(core::to_float(s))) bits |= kMetaOverflow;
  return bits;
}

template <typename Meta>
NKV_DEVICE void store_poisoned(Meta* scale, Meta* zero) {
  *scale = nan_of<Meta>();
  *zero = nan_of<Meta>();
}

// code = clamp(round_half_up((v - zero) * inv_scale), 0, qmax) (nq_format.h);
// NaN gives 0, as on the CPU.
NKV_DEVICE uint8_t quantize_code(float v, float zero, float inv_scale, float qmax) {
  float c = add_rn(mul_rn(sub_rn(v, zero), inv_scale), 0.5f);
  c = c > 0.f ? c : 0.f;
  c = qmax < c ? qmax : c;
  return uint8_t(int32_t(c));
}

// 1 / scale, 0 for a constant group (scale 0) or a poisoned one.
NKV_DEVICE float inverse_scale(float s) { return s > 0.f ? div_rn(1.f, s) : 0.f; }

// ---- meta, no outliers: one thread per group ----------------------------------------------

template <typename In, typename Meta>
NKV_KERNEL void nq_meta_minmax_kernel(core::NQDims d, RowsView<In> x, float qmax, int64_t groups,
                                      Meta* __restrict__ scale,  // [N, A, B]
                                      Meta* __restrict__ zero,   // [N, A, B]
                                      uint32_t* status) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const GroupSpan s = group_span(d, g);
  float mn = 0.f, mx = 0.f;
  bool bad = false;
  for (int64_t i = 0; i < s.len; ++i) {
    const float v = core::to_float(entry(x, s, i));
    bad |= non_finite(v);
    // std::min / std::max semantics (the first of equal values stays).
    mn = i == 0 ? v : (v < mn ? v : mn);
    mx = i == 0 ? v : (mx < v ? v : mx);
  }
  if (bad) {
    store_poisoned(scale + g, zero + g);
    report(status, kNonFiniteInput);
  } else {
    report(status, store_scale_zero(mn, mx, qmax, scale + g, zero + g));
  }
}

// ---- meta with outliers: one warp per group -------------------------------------------------

constexpr int kOutlierWarps = 4;  // groups per block

struct OutlierScratch {  // per warp, in shared memory
  float vals[core::kMaxGroupSize];
  int16_t rank_of[core::kMaxGroupSize];  // rank of the entry at position i
  int16_t at_rank[core::kMaxGroupSize];  // position of the entry of rank r
  uint32_t bad;
};

template <typename In, typename Meta>
NKV_KERNEL void nq_meta_outlier_kernel(core::NQDims d, RowsView<In> x, float qmax, int64_t groups,
                                       Meta* __restrict__ scale,           // [N, A, B]
                                       Meta* __restrict__ zero,            // [N, A, B]
                                       uint8_t* __restrict__ outlier_idx,  // [N, A, B, k]
                                       In* __restrict__ outlier_val,       // [N, A, B, k]
                                       uint32_t* status) {
  __shared__ OutlierScratch scratch[kOutlierWarps];
  const int warp = int(threadIdx.x) / kWarp, lane = int(threadIdx.x) % kWarp;
  const int64_t g = int64_t(blockIdx.x) * kOutlierWarps + warp;
  OutlierScratch& w = scratch[warp];
  const int k = d.num_outliers;
  // Every thread reaches every barrier; warps past the last group just idle.
  GroupSpan s{};
  int n = 0;
  if (g < groups) {
    s = group_span(d, g);
    // A DGQ segment is at most kMaxGroupSize tokens; a longer one (corrupt
    // input only) is poisoned below rather than overrun.
    n = int(s.len < core::kMaxGroupSize ? s.len : core::kMaxGroupSize);
  }
  if (lane == 0) w.bad = g < groups && s.len > core::kMaxGroupSize ? kBadSegments : 0u;
  NKV_SYNC();
  for (int i = lane; i < n; i += kWarp) {
    w.vals[i] = core::to_float(entry(x, s, i));
    if (non_finite(w.vals[i])) atomic_or(&w.bad, kNonFiniteInput);
  }
  NKV_SYNC();
  // Rank by (value, position): distinct ranks 0..n-1 for finite values.
  for (int i = lane; i < n; i += kWarp) {
    const float v = w.vals[i];
    int r = 0;
    for (int j = 0; j < n; ++j) {
      const float u = w.vals[j];
      r += (u < v) | ((u == v) & (j < i));
    }
    w.rank_of[i] = int16_t(r);
    w.at_rank[r] = int16_t(i);
  }
  NKV_SYNC();
  if (lane != 0 || g >= groups) return;
  uint8_t* pos = outlier_idx + g * k;
  In* val = outlier_val + g * k;
  float mn = 0.f, mx = 0.f;
  if (n <= k) {  // every entry is an outlier; the last slot repeats (nq_format.h)
    for (int j = 0; j < k; ++j) {
      const int p = j < n ? j : n - 1;
      pos[j] = uint8_t(p < 0 ? 0 : p);
      val[j] = n > 0 ? entry(x, s, p) : In{};
    }
  } else {
    // (Only for NaN input can ranks collide; the group is poisoned then, and
    // the masks keep every index inside the arrays.)
    auto ranked = [&](int r) { return w.vals[w.at_rank[r] & (core::kMaxGroupSize - 1)]; };
    int best = 0;
    float best_range = bits_float(0x7f800000u);  // +inf
    for (int i = 0; i <= k; ++i) {
      const float range = sub_rn(ranked(n - 1 - (k - i)), ranked(i));
      if (range < best_range) best_range = range, best = i;
    }
    mn = ranked(best);
    mx = ranked(n - 1 - (k - best));
    int j = 0;
    for (int i = 0; i < n && j < k; ++i) {
      const int r = w.rank_of[i];
      if (r < best || r >= n - (k - best)) {
        pos[j] = uint8_t(i);
        val[j] = entry(x, s, i);
        ++j;
      }
    }
    for (; j < k; ++j) pos[j] = 0, val[j] = entry(x, s, 0);
  }
  if (w.bad) {
    store_poisoned(scale + g, zero + g);
    report(status, w.bad);
  } else {
    report(status, store_scale_zero(mn, mx, qmax, scale + g, zero + g));
  }
}

// ---- fitted ranges (d.fit_range): one thread per group ------------------------------------

// The CPU's fit_ranges (csrc/core/nq_fit.h) for one group, in the same order
// with exactly rounded operations: min/max's stored scale and zero, then up
// to kFitSteps least-squares refits on the previous candidate's codes rounded
// to nearest in Meta; the candidate of least squared error over the dense
// entries (not an outlier) is stored.  A poisoned group (NaN) is left as is.

template <typename In, typename Meta>
NKV_KERNEL void nq_fit_kernel(core::NQDims d, RowsView<In> x, float qmax, int64_t groups,
                              Meta* __restrict__ scale,                 // [N, A, B]
                              Meta* __restrict__ zero,                  // [N, A, B]
                              const uint8_t* __restrict__ outlier_idx)  // [N, A, B, k]
{
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  constexpr float kMinScale = 1.17549435e-38f;
  const GroupSpan sp = group_span(d, g);
  const int k = d.num_outliers;
  const uint8_t* pos = outlier_idx + g * k;
  float s = core::to_float(scale[g]), z = core::to_float(zero[g]);
  if (non_finite(s) || non_finite(z) || sp.len <= k) return;
  float iv = inverse_scale(s), bs = s, bz = z, best = 0.f;
  for (int step = 0; step <= core::kFitSteps; ++step) {
    float e = 0.f, sn = 0.f, sc = 0.f, sx = 0.f, scc = 0.f, scx = 0.f;
    for (int64_t i = 0; i < sp.len; ++i) {
      bool outlier = false;
      for (int j = 0; j < k; ++j) outlier |= pos[j] == i;
      if (outlier) continue;
      const float v = core::to_float(entry(x, sp, i));
      const float c = float(quantize_code(v, z, iv, qmax));
      const float dv = sub_rn(v, add_rn(mul_rn(c, s), z));
      e = add_rn(e, mul_rn(dv, dv));
      sn = add_rn(sn, 1.f);
      sc = add_rn(sc, c);
      sx = add_rn(sx, v);
      scc = add_rn(scc, mul_rn(c, c));
      scx = add_rn(scx, mul_rn(c, v));
    }
    if (step == 0 || e < best) best = e, bs = s, bz = z;
    if (step == core::kFitSteps) break;
    const float den = sub_rn(mul_rn(sn, scc), mul_rn(sc, sc));
    const float ns = div_rn(sub_rn(mul_rn(sn, scx), mul_rn(sc, sx)), den);
    const float nz = div_rn(sub_rn(sx, mul_rn(ns, sc)), sn);
    // A rejected candidate leaves the current one, whose next pass would repeat this one: done.
    if (!(den > 0.f && ns >= kMinScale && !non_finite(ns) && !non_finite(nz))) break;
    const float rs = core::to_float(core::from_float<Meta>(ns)), rz = core::to_float(core::from_float<Meta>(nz));
    if (!(rs >= kMinScale && !non_finite(rs) && !non_finite(rz))) break;
    s = rs, z = rz, iv = inverse_scale(s);
  }
  scale[g] = core::from_float<Meta>(bs);
  zero[g] = core::from_float<Meta>(bz);
}

// ---- codes ----------------------------------------------------------------------------------

// One thread per (row, token, chunk of C channels): rows along grid.y (a loop past
// 65,535), whole tokens along grid.x, (token, chunk) from a block-local index by a
// 32-bit multiply-shift division (nq_index.h): no 64-bit `/` or `%` per task.
template <typename In, int kBits>
NKV_KERNEL void nq_pack_kernel(core::NQDims d, core::NQIndexing ix,             // ix.tiles: [T, chunks]
                               RowsView<In> x, const void* __restrict__ scale,  // [N, A, B]
                               const void* __restrict__ zero,                   // [N, A, B]
                               DType meta_dtype, float qmax,
                               uint8_t* __restrict__ codes) {  // [N, T, row_bytes]
  constexpr int C = core::layout::kChunkChannels<kBits>, CB = core::layout::kChunkBytes<kBits>;
  const int64_t D = d.head_dim;
  for (int64_t n = blockIdx.y; n < d.rows; n += gridDim.y) {
    for (uint32_t local = threadIdx.x; local < ix.tiles.local_size(); local += blockDim.x) {
      uint32_t t, chunk;
      if (!ix.tiles.at(blockIdx.x, local, t, chunk)) break;
      // Meta index of channel 0's group (one DGQ segment lookup per task); channel c's is
      // c further on (per-channel groups) or c / G (per-token groups).
      const int64_t g0 = core::element_group(d, ix, n, t, 0).g;
      uint8_t q[C];
      for (int i = 0; i < C; ++i) {
        const uint32_t c = chunk * C + i;
        q[i] = 0;  // padding channels are 0 (nq_format.h)
        if (c < D) {
          const int64_t m = g0 + (d.axis == core::GroupAxis::kTokens ? c : ix.by_group.div(c));
          const float z = load_as_float(zero, meta_dtype, m), s = load_as_float(scale, meta_dtype, m);
          q[i] = quantize_code(core::to_float(x.at(n, t, c)), z, inverse_scale(s), qmax);
        }
      }
      uint8_t packed[CB];
      core::layout::pack_chunk<kBits>(q, packed);
      uint8_t* out = codes + (n * d.tokens + t) * ix.row_bytes + chunk * CB;
      // Rows are whole chunks of 16 (24) bytes from a 16-byte aligned base: vector stores.
      if constexpr (CB == 16) {
        uint4 v;
        __builtin_memcpy(&v, packed, 16);
        *reinterpret_cast<uint4*>(out) = v;
      } else {
        uint2 v[3];
        __builtin_memcpy(v, packed, 24);
        for (int i = 0; i < 3; ++i) reinterpret_cast<uint2*>(out)[i] = v[i];
      }
    }
  }
}

// ---- launcher -------------------------------------------------------------------------------

template <typename In, typename Meta>
void launch_nq_compress(const NQCompressArgs<In, Meta>& a, Stream stream) {
  const core::NQDims& d = a.dims;
  const float qmax = float((1 << d.bits) - 1);
  const int64_t groups = d.rows * d.groups_per_row();
  if (d.num_outliers == 0) {
    constexpr int kThreads = 128;
    launch(nq_meta_minmax_kernel<In, Meta>, Dim3(unsigned(core::ceil_div(groups, kThreads))), Dim3(kThreads), 0, stream,
           d, a.x, qmax, groups, a.scale, a.zero, a.status);
  } else {
    launch(nq_meta_outlier_kernel<In, Meta>, Dim3(unsigned(core::ceil_div(groups, kOutlierWarps))),
           Dim3(kOutlierWarps * kWarp), 0, stream, d, a.x, qmax, groups, a.scale, a.zero, a.outlier_idx, a.outlier_val,
           a.status);
  }
  if (d.fit_range) {
    constexpr int kThreads = 128;
    launch(nq_fit_kernel<In, Meta>, Dim3(unsigned(core::ceil_div(groups, kThreads))), Dim3(kThreads), 0, stream, d, a.x,
           qmax, groups, a.scale, a.zero, static_cast<const uint8_t*>(a.outlier_idx));
  }
  const DType meta = sizeof(Meta) == 4              ? DType::kFloat32
                     : std::is_same_v<Meta, half_t> ? DType::kFloat16
                                                    : DType::kBFloat16;
  constexpr int kThreads = 128;
  const core::NQIndexing ix(d, core::ceil_div(d.head_dim, core::chunk_channels(d.bits)), kThreads);
  const Dim3 grid(ix.tiles.blocks(), unsigned(d.rows < kMaxGridY ? d.rows : kMaxGridY));
  core::layout::with_bits(d.bits, [&]<int kBits>() {
    launch(nq_pack_kernel<In, kBits>, grid, Dim3(kThreads), 0, stream, d, ix, a.x, static_cast<const void*>(a.scale),
           static_cast<const void*>(a.zero), meta, qmax, a.codes);
  });
}

}  // namespace nexuskv::cuda
