// DGQ segment choice by bottom-up merging (rationale in dgq.h).
#include <algorithm>
#include <queue>
#include <vector>

#include "nexuskv/core/dgq.h"
#include "nexuskv/core/nq_format.h"

namespace nexuskv::core {
namespace {

struct Candidate {
  double delta;  // cost increase of merging segment `left` with its right neighbour
  int64_t left;
  uint64_t version;  // of `left` when pushed; stale entries are skipped
  bool operator<(const Candidate& o) const { return delta > o.delta || (delta == o.delta && left > o.left); }
};

}  // namespace

bool dgq_choose_segments(float* gmin, float* gmax, int64_t T, int64_t D, const DGQParams& p, int32_t* starts) {
  const int64_t ng = ceil_div(T, p.granule);
  // Segment i is identified by its first granule; its channel min/max live in
  // that granule's row of gmin/gmax.
  const size_t n = static_cast<size_t>(ng);
  std::vector<int64_t> next(n), prev(n), len(n);
  std::vector<double> cost(n);
  std::vector<uint64_t> version(n, 0);
  std::vector<bool> alive(n, true);
  auto seg_cost = [&](const float* mn, const float* mx, int64_t n) {
    double s = 0;
    for (int64_t c = 0; c < D; ++c) s += double(mx[c] - mn[c]) * double(mx[c] - mn[c]);
    return s * double(n);
  };
  auto merged_cost = [&](int64_t a, int64_t b) {
    const float *amn = gmin + a * D, *amx = gmax + a * D, *bmn = gmin + b * D, *bmx = gmax + b * D;
    double s = 0;
    for (int64_t c = 0; c < D; ++c) {
      const double r = double(std::max(amx[c], bmx[c])) - double(std::min(amn[c], bmn[c]));
      s += r * r;
    }
    return s * double(len[size_t(a)] + len[size_t(b)]);
  };
  std::priority_queue<Candidate> queue;
  auto push = [&](int64_t a) {
    const int64_t b = next[size_t(a)];
    if (b < ng && len[size_t(a)] + len[size_t(b)] <= p.max_len)
      queue.push({merged_cost(a, b) - cost[size_t(a)] - cost[size_t(b)], a, version[size_t(a)]});
  };
  for (int64_t i = 0; i < ng; ++i) {
    next[size_t(i)] = i + 1, prev[size_t(i)] = i - 1;
    len[size_t(i)] = std::min(p.granule, T - i * p.granule);
    cost[size_t(i)] = seg_cost(gmin + i * D, gmax + i * D, len[size_t(i)]);
  }
  for (int64_t i = 0; i + 1 < ng; ++i) push(i);
  int64_t count = ng;
  while (count > p.segments && !queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    const int64_t a = top.left;
    // Stale: a was merged away or changed, or its right neighbour changed (then a's version moved too).
    if (!alive[size_t(a)] || top.version != version[size_t(a)]) continue;
    const int64_t b = next[size_t(a)];
    for (int64_t c = 0; c < D; ++c) {
      gmin[a * D + c] = std::min(gmin[a * D + c], gmin[b * D + c]);
      gmax[a * D + c] = std::max(gmax[a * D + c], gmax[b * D + c]);
    }
    len[size_t(a)] += len[size_t(b)];
    cost[size_t(a)] = seg_cost(gmin + a * D, gmax + a * D, len[size_t(a)]);
    alive[size_t(b)] = false;
    next[size_t(a)] = next[size_t(b)];
    if (next[size_t(a)] < ng) prev[size_t(next[size_t(a)])] = a;
    ++version[size_t(a)];
    --count;
    push(a);
    if (prev[size_t(a)] >= 0) {
      ++version[size_t(prev[size_t(a)])];
      push(prev[size_t(a)]);
    }
  }
  if (count > p.segments) return false;  // only when max_len < 2 * T / S
  int64_t s = 0;
  for (int64_t i = 0; i < ng; i = next[size_t(i)]) starts[s++] = int32_t(i * p.granule);
  for (; s < p.segments; ++s) starts[s] = int32_t(T);
  return true;
}

template <typename In>
bool dgq_segment_rows(const StridedRows<In>& x, int64_t T, int64_t D, const DGQParams& p, int32_t* starts,
                      int64_t row_begin, int64_t row_end) {
  const int64_t ng = ceil_div(T, p.granule);
  std::vector<float> gmin(static_cast<size_t>(ng * D)), gmax(static_cast<size_t>(ng * D));
  for (int64_t r = row_begin; r < row_end; ++r) {
    const In* row = x.data + x.row_offset[r];
    for (int64_t g = 0; g < ng; ++g) {
      float* mn = gmin.data() + g * D;
      float* mx = gmax.data() + g * D;
      for (int64_t t = g * p.granule; t < std::min(T, (g + 1) * p.granule); ++t) {
        const In* xt = row + t * x.stride_t;
        for (int64_t c = 0; c < D; ++c) {
          const float v = to_float(xt[c * x.stride_d]);
          const bool first = t == g * p.granule;
          mn[c] = first ? v : std::min(mn[c], v);
          mx[c] = first ? v : std::max(mx[c], v);
        }
      }
    }
    if (!dgq_choose_segments(gmin.data(), gmax.data(), T, D, p, starts + r * p.segments)) return false;
  }
  return true;
}

template bool dgq_segment_rows<float>(const StridedRows<float>&, int64_t, int64_t, const DGQParams&, int32_t*, int64_t,
                                      int64_t);
template bool dgq_segment_rows<half_t>(const StridedRows<half_t>&, int64_t, int64_t, const DGQParams&, int32_t*,
                                       int64_t, int64_t);
template bool dgq_segment_rows<bf16_t>(const StridedRows<bf16_t>&, int64_t, int64_t, const DGQParams&, int32_t*,
                                       int64_t, int64_t);

}  // namespace nexuskv::core
