// DGQ segment choice on the GPU: the CPU's bottom-up merging
// (csrc/core/dgq_segments.cpp, rationale in dgq.h) with the same decisions, so
// that the boundaries are identical.
//
// The CPU keeps a priority queue of (delta, left) with lazy deletion; its top
// is always the smallest (delta, left) among the current mergeable pairs,
// because every merge re-pushes exactly the two pairs whose delta changed.
// Here one block per row keeps delta[left] for every current pair and takes
// that minimum with a block-wide reduction per merge; the costs are computed
// with the CPU's double arithmetic in the CPU's order (channel by channel,
// exactly rounded), so every delta, and hence every choice, is the same.
//
// State per row lives in a global scratch (a row can hold many granules):
//   gmin/gmax [ng, D] float   per granule, then per segment (left granule's row)
//   next/prev/len [ng] int32, cost/delta [ng] double, mergeable [ng] uint8
#pragma once

#include "device_common.cuh"
#include "nq_compress.cuh"

namespace nexuskv::cuda {

constexpr int kSegmentThreads = 256;

// len * sum_c (max_c - min_c)^2 of one segment: the CPU's seg_cost (float differences, double squares).
NKV_DEVICE double segment_cost(const float* mn, const float* mx, int64_t D, int64_t len) {
  double s = 0;
  for (int64_t c = 0; c < D; ++c) {
    const double r = double(sub_rn(mx[c], mn[c]));
    s = dadd_rn(s, dmul_rn(r, r));
  }
  return dmul_rn(s, double(len));
}

// Cost of segments a and b merged: the CPU's merged_cost (double differences).
NKV_DEVICE double merged_cost(const float* amn, const float* amx, const float* bmn, const float* bmx, int64_t D,
                              int64_t len) {
  double s = 0;
  for (int64_t c = 0; c < D; ++c) {
    const float hi = amx[c] < bmx[c] ? bmx[c] : amx[c];  // std::max
    const float lo = bmn[c] < amn[c] ? bmn[c] : amn[c];  // std::min
    const double r = dsub_rn(double(hi), double(lo));
    s = dadd_rn(s, dmul_rn(r, r));
  }
  return dmul_rn(s, double(len));
}

template <typename In>
NKV_KERNEL void dgq_segments_kernel(RowsView<In> x, int64_t T, int64_t D, int64_t granule, int64_t max_len, int64_t S,
                                    unsigned char* __restrict__ scratch,  // [N, layout.bytes()]
                                    int32_t* __restrict__ starts,         // [N, S]
                                    uint32_t* status) {
  const int64_t n = blockIdx.x, ng = core::ceil_div(T, granule);
  SegmentScratchLayout lay;
  lay.ng = ng, lay.D = D;
  unsigned char* base = scratch + n * lay.bytes();
  float* gmin = reinterpret_cast<float*>(base + lay.gmin());
  float* gmax = reinterpret_cast<float*>(base + lay.gmax());
  double* cost = reinterpret_cast<double*>(base + lay.cost());
  double* delta = reinterpret_cast<double*>(base + lay.delta());
  int32_t* next = reinterpret_cast<int32_t*>(base + lay.next());
  int32_t* prev = reinterpret_cast<int32_t*>(base + lay.prev());
  int32_t* len = reinterpret_cast<int32_t*>(base + lay.len());
  uint8_t* mergeable = reinterpret_cast<uint8_t*>(base + lay.mergeable());
  const int tid = int(threadIdx.x);

  // Per granule and channel min/max (min/max do not depend on the order).
  for (int64_t i = tid; i < ng * D; i += kSegmentThreads) {
    const int64_t g = i / D, c = i % D, t1 = (g + 1) * granule < T ? (g + 1) * granule : T;
    float mn = 0.f, mx = 0.f;
    for (int64_t t = g * granule; t < t1; ++t) {
      const float v = core::to_float(x.at(n, t, c));
      mn = t == g * granule ? v : (v < mn ? v : mn);
      mx = t == g * granule ? v : (mx < v ? v : mx);
    }
    gmin[i] = mn, gmax[i] = mx;
  }
  NKV_SYNC();
  for (int64_t i = tid; i < ng; i += kSegmentThreads) {
    next[i] = int32_t(i + 1), prev[i] = int32_t(i - 1);
    len[i] = int32_t(granule < T - i * granule ? granule : T - i * granule);
    cost[i] = segment_cost(gmin + i * D, gmax + i * D, D, len[i]);
  }
  NKV_SYNC();
  auto set_pair = [&](int64_t a) {  // delta and mergeability of the pair (a, next[a])
    const int64_t b = next[a];
    const bool ok = b < ng && len[a] + len[b] <= max_len;
    mergeable[a] = ok;
    if (ok)
      delta[a] = dsub_rn(
          dsub_rn(merged_cost(gmin + a * D, gmax + a * D, gmin + b * D, gmax + b * D, D, len[a] + len[b]), cost[a]),
          cost[b]);
  };
  for (int64_t i = tid; i < ng; i += kSegmentThreads) set_pair(i);
  NKV_SYNC();

  __shared__ double red_delta[kSegmentThreads];
  __shared__ int32_t red_left[kSegmentThreads];
  bool unmet = false;
  for (int64_t count = ng; count > S; --count) {
    // The smallest (delta, left) over the mergeable pairs; -1: none.
    double bd = 0;
    int32_t bl = -1;
    for (int64_t i = tid; i < ng; i += kSegmentThreads)
      if (mergeable[i] && (bl < 0 || delta[i] < bd))
        bd = delta[i], bl = int32_t(i);  // i ascending: ties keep the first
    red_delta[tid] = bd, red_left[tid] = bl;
    NKV_SYNC();
    for (int w = kSegmentThreads / 2; w > 0; w /= 2) {
      if (tid < w) {
        const int32_t ol = red_left[tid + w];
        const double od = red_delta[tid + w];
        const int32_t ml = red_left[tid];
        if (ol >= 0 && (ml < 0 || od < red_delta[tid] || (od == red_delta[tid] && ol < ml)))
          red_delta[tid] = od, red_left[tid] = ol;
      }
      NKV_SYNC();
    }
    const int64_t a = red_left[0];
    NKV_SYNC();   // everyone has read the winner before the next round overwrites it
    if (a < 0) {  // only when max_len < 2 * T / S (the caller rules that out)
      unmet = true;
      break;
    }
    const int64_t b = next[a];
    for (int64_t c = tid; c < D; c += kSegmentThreads) {
      gmin[a * D + c] = gmin[b * D + c] < gmin[a * D + c] ? gmin[b * D + c] : gmin[a * D + c];
      gmax[a * D + c] = gmax[a * D + c] < gmax[b * D + c] ? gmax[b * D + c] : gmax[a * D + c];
    }
    NKV_SYNC();
    if (tid == 0) {
      len[a] += len[b];
      cost[a] = segment_cost(gmin + a * D, gmax + a * D, D, len[a]);
      mergeable[b] = 0;
      next[a] = next[b];
      if (next[a] < ng) prev[next[a]] = int32_t(a);
    }
    NKV_SYNC();
    // The two pairs whose delta changed: (a, next[a]) and (prev[a], a).
    if (tid == 0) set_pair(a);
    if (tid == kWarp && prev[a] >= 0) set_pair(prev[a]);
    NKV_SYNC();
  }
  if (tid != 0) return;
  int64_t s = 0, i = 0;
  for (; i < ng && s < S; i = next[i]) starts[n * S + s++] = int32_t(i * granule);
  for (; s < S; ++s) starts[n * S + s] = int32_t(T);
  if (unmet || i < ng) report(status, kSegmentsUnmet);
}

template <typename In>
void launch_dgq_segments(const RowsView<In>& x, int64_t rows, int64_t T, int64_t D, int64_t granule, int64_t max_len,
                         int64_t S, unsigned char* scratch, int32_t* starts, uint32_t* status, Stream stream) {
  launch(dgq_segments_kernel<In>, Dim3(unsigned(rows)), Dim3(kSegmentThreads), 0, stream, x, T, D, granule, max_len, S,
         scratch, starts, status);
}

}  // namespace nexuskv::cuda
