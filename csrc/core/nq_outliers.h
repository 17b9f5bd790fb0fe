// Outlier selection of the NQ kernels (per ISA, isa.h; format: nq_format.h,
// "Outliers"): per group, the k entries whose removal shrinks the min/max
// range the most, for one group at a time or for many groups at once
// vectorized across groups.
#pragma once

#include <cstring>

#include "isa.h"
#include "nexuskv/core/nq_format.h"

namespace nexuskv::core::NEXUSKV_ISA {

constexpr float kInf = __builtin_inff();

struct Ranked {
  float v;
  int pos;
};
NEXUSKV_INLINE bool ranked_less(const Ranked& a, const Ranked& b) { return a.v < b.v || (a.v == b.v && a.pos < b.pos); }

// Chooses the k entries of vals[0..n) (read with stride) whose removal shrinks
// max - min the most: i from the bottom and k - i from the top, best i.  The
// ranking uses (value, position) so that the bottom and top sets never share
// an entry.  Writes the sorted positions to pos[0..k) (repeating the last one
// when n <= k) and the min/max of what is left (0, 0 when nothing is).
inline void select_outliers(const float* vals, int64_t stride, int n, int k, uint8_t* pos, float* mn, float* mx) {
  if (n <= k) {
    for (int s = 0; s < k; ++s) pos[s] = uint8_t(s < n - 1 ? s : n - 1);
    *mn = *mx = 0.f;
    return;
  }
  Ranked low[kMaxGroupSize + 1], high[kMaxGroupSize + 1];  // k+1 smallest ascending, k+1 largest descending
  int nl = 0, nh = 0;
  for (int i = 0; i < n; ++i) {
    const Ranked e{vals[i * stride], i};
    if (nl < k + 1 || ranked_less(e, low[nl - 1])) {
      int j = nl < k ? nl : k;
      for (; j > 0 && ranked_less(e, low[j - 1]); --j) low[j] = low[j - 1];
      low[j] = e;
      nl = nl < k ? nl + 1 : k + 1;
    }
    if (nh < k + 1 || ranked_less(high[nh - 1], e)) {
      int j = nh < k ? nh : k;
      for (; j > 0 && ranked_less(high[j - 1], e); --j) high[j] = high[j - 1];
      high[j] = e;
      nh = nh < k ? nh + 1 : k + 1;
    }
  }
  int best = 0;
  float best_range = kInf;
  for (int i = 0; i <= k; ++i) {
    const float range = high[k - i].v - low[i].v;
    if (range < best_range) best_range = range, best = i;
  }
  *mn = low[best].v;
  *mx = high[k - best].v;
  int s = 0;
  for (int i = 0; i < best; ++i) pos[s++] = uint8_t(low[i].pos);
  for (int i = 0; i < k - best; ++i) pos[s++] = uint8_t(high[i].pos);
  sort_bytes(pos, k);
}

// select_outliers for L groups at once, vectorized across groups: group g
// reads vals[j * L + g] for positions j = 0..n-1, n > k.  Each group keeps
// its k+1 lowest (ascending) and k+1 highest (descending) entries, ranked by
// (value, position) as select_outliers does, by passing every new entry down
// a compare-exchange chain.  The choice and outputs are then
// select_outliers' own: pos [L, k], mn / mx [L].
struct LaneLists {
  // Two copies (read one, write the other) of: low [k+1][L], high [k+1][L],
  // then carries low / high [2][L]; values and positions.  Never updating an
  // entry in place keeps the compiler from turning the selects into masked
  // stores, which are slow.
  Buffer<float> v;
  Buffer<int32_t> p;
  LaneLists(int64_t L, int k) : v((4 * k + 8) * L), p((4 * k + 8) * L) {}
};

// One step of the chains for L lanes: entry (cin, cinp) against slot (a, ap);
// the winner goes to (na, nap), the other one on to (cout, coutp).
template <bool kHigh>
NEXUSKV_INLINE void chain_step(const float* __restrict cin, const int32_t* __restrict cinp, const float* __restrict a,
                               const int32_t* __restrict ap, float* __restrict na, int32_t* __restrict nap,
                               float* __restrict cout, int32_t* __restrict coutp, int64_t L) {
  for (int64_t g = 0; g < L; ++g) {
    const float v = cin[g], x = a[g];
    const int32_t vp = cinp[g], xp = ap[g];
    // Ranked by (value, position), as select_outliers does: the low list
    // takes the entry if it ranks below the slot's, the high list if above.
    // (Bitwise, not short-circuit operators: no branches in the loop.)
    const bool sw = kHigh ? ((x < v) | ((x == v) & (xp < vp))) : ((v < x) | ((v == x) & (vp < xp)));
    na[g] = sw ? v : x, nap[g] = sw ? vp : xp;
    cout[g] = sw ? x : v, coutp[g] = sw ? xp : vp;
  }
}

// Not inlined into the kernels: one copy per ISA, whatever the tensor types.
inline NEXUSKV_NOINLINE void select_outliers_lanes(const float* vals, int64_t L, int n, int k, LaneLists& s,
                                                   uint8_t* pos, float* mn, float* mx) {
  const int64_t list = (k + 1) * L;
  float* lists_v[2] = {s.v.data(), s.v.data() + 2 * list};  // low then high
  int32_t* lists_p[2] = {s.p.data(), s.p.data() + 2 * list};
  float* carry_v = s.v.data() + 4 * list;  // [low, high] x [2 copies] x L
  int32_t* carry_p = s.p.data() + 4 * list;
  for (int64_t i = 0; i < list; ++i)
    lists_v[0][i] = kInf, lists_v[0][list + i] = -kInf, lists_p[0][i] = lists_p[0][list + i] = 0;
  for (int j = 0; j < n; ++j) {
    const float* sv = lists_v[j & 1];
    const int32_t* sp = lists_p[j & 1];
    float* dv = lists_v[(j + 1) & 1];
    int32_t* dp = lists_p[(j + 1) & 1];
    for (int side = 0; side < 2; ++side) {  // 0: low list, ascending; 1: high list, descending
      float* cv[2] = {carry_v + (2 * side) * L, carry_v + (2 * side + 1) * L};
      int32_t* cp[2] = {carry_p + (2 * side) * L, carry_p + (2 * side + 1) * L};
      std::memcpy(cv[0], vals + j * L, size_t(L) * sizeof(float));
      for (int64_t g = 0; g < L; ++g) cp[0][g] = j;
      for (int i = 0; i <= k; ++i) {
        const int64_t o = side * list + i * L;
        if (side == 0)
          chain_step<false>(cv[i & 1], cp[i & 1], sv + o, sp + o, dv + o, dp + o, cv[(i + 1) & 1], cp[(i + 1) & 1], L);
        else
          chain_step<true>(cv[i & 1], cp[i & 1], sv + o, sp + o, dv + o, dp + o, cv[(i + 1) & 1], cp[(i + 1) & 1], L);
      }
    }
  }
  const float* lv = lists_v[n & 1];
  const float* hv = lv + list;
  const int32_t* lp = lists_p[n & 1];
  const int32_t* hp = lp + list;
  for (int64_t g = 0; g < L; ++g) {
    int best = 0;
    float best_range = kInf;
    for (int i = 0; i <= k; ++i) {
      const float range = hv[(k - i) * L + g] - lv[i * L + g];
      if (range < best_range) best_range = range, best = i;
    }
    mn[g] = lv[best * L + g];
    mx[g] = hv[(k - best) * L + g];
    uint8_t* pg = pos + g * k;
    int c = 0;
    for (int i = 0; i < best; ++i) pg[c++] = uint8_t(lp[i * L + g]);
    for (int i = 0; i < k - best; ++i) pg[c++] = uint8_t(hp[i * L + g]);
    sort_bytes(pg, k);
  }
}

}  // namespace nexuskv::core::NEXUSKV_ISA
