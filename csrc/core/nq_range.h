// Ranges and metadata of the NQ kernels (per ISA, isa.h): min/max of a
// group, then its zero (min rounded down to the meta dtype) and scale
// ((max - zero) / qmax rounded up), nq_format.h's "Quantization of one group".
#pragma once

#include <cstring>
#include <type_traits>

#include "isa.h"
#include "nexuskv/core/half.h"
#include "rows.h"

namespace nexuskv::core::NEXUSKV_ISA {

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define NEXUSKV_HAS_SHUFFLEVECTOR 1
#endif
#endif
#ifndef NEXUSKV_HAS_SHUFFLEVECTOR
#define NEXUSKV_HAS_SHUFFLEVECTOR 0
#endif

// Min and max of v[0..n), n >= 1 (std::min / std::max semantics).
NEXUSKV_INLINE void min_max(const float* v, int64_t n, float* mn, float* mx) {
  float lo = v[0], hi = v[0];
  int64_t i = 0;
#if defined(__GNUC__) || defined(__clang__)
  // 8 lanes as a vector (one AVX register, two SSE ones), then a short tree;
  // written explicitly because the compiler does not vectorize the reduction.
  typedef float f8 __attribute__((vector_size(32)));
  if (n >= 16) {
    f8 vlo, vhi, x;
    std::memcpy(&vlo, v, sizeof(f8));
    vhi = vlo;
    for (i = 8; i + 8 <= n; i += 8) {
      std::memcpy(&x, v + i, sizeof(f8));
      vlo = x < vlo ? x : vlo;
      vhi = vhi < x ? x : vhi;
    }
#if NEXUSKV_HAS_SHUFFLEVECTOR
    typedef float f4 __attribute__((vector_size(16)));
    f4 l = __builtin_shufflevector(vlo, vlo, 0, 1, 2, 3), h = __builtin_shufflevector(vhi, vhi, 0, 1, 2, 3);
    f4 l2 = __builtin_shufflevector(vlo, vlo, 4, 5, 6, 7), h2 = __builtin_shufflevector(vhi, vhi, 4, 5, 6, 7);
    l = l2 < l ? l2 : l, h = h < h2 ? h2 : h;
    l2 = __builtin_shufflevector(l, l, 2, 3, 2, 3), h2 = __builtin_shufflevector(h, h, 2, 3, 2, 3);
    l = l2 < l ? l2 : l, h = h < h2 ? h2 : h;
    l2 = __builtin_shufflevector(l, l, 1, 1, 1, 1), h2 = __builtin_shufflevector(h, h, 1, 1, 1, 1);
    l = l2 < l ? l2 : l, h = h < h2 ? h2 : h;
    lo = l[0], hi = h[0];
#else
    float l[8], h[8];
    std::memcpy(l, &vlo, sizeof(l));
    std::memcpy(h, &vhi, sizeof(h));
    for (int w = 4; w > 0; w /= 2)
      for (int j = 0; j < w; ++j) l[j] = min_f(l[j], l[j + w]), h[j] = max_f(h[j], h[j + w]);
    lo = l[0], hi = h[0];
#endif
  }
#endif
  for (; i < n; ++i) lo = min_f(lo, v[i]), hi = max_f(hi, v[i]);
  *mn = lo, *mx = hi;
}

// code = clamp(round((v - zero) / scale), 0, qmax), rounding halves up.
NEXUSKV_INLINE uint8_t quantize(float v, float zero, float inv_scale, float qmax) {
  // v >= zero for dense entries; the clamp covers outliers and float error.
  // Written as the selects that map onto max/min instructions; NaN gives 0.
  // (As a uint8_t result the loops vectorize; converted back to float right
  // away, GCC 12 turns the selects into branches.)
  float c = (v - zero) * inv_scale + 0.5f;
  c = c > 0.f ? c : 0.f;
  c = qmax < c ? qmax : c;
  return uint8_t(int32_t(c));
}

// What make_meta found wrong with a block of groups.
struct MetaFlags {
  bool range_overflow = false;  // max - min of a group is not finite in float32
  bool meta_overflow = false;   // a stored scale or zero is not finite in the meta dtype
};

// Scale and zero of n groups from their min / max (nq_format.h): zero = min
// rounded down to Meta, scale = (max - zero) / qmax rounded up, half.h's
// round_down / round_up done in passes over the n groups (a vectorized
// nearest conversion of the row, then round_*_bits' one step where it landed
// on the wrong side), so that every pass vectorizes.  Writes the stored
// values, and the float zero and 1 / scale (0 for a constant group) that
// quantization uses.  Overwrites mx.
template <typename Meta>
NEXUSKV_INLINE MetaFlags make_meta(const float* mn, float* mx, int64_t n, float qmax, Meta* scale_m, Meta* zero_m,
                                   float* zero, float* inv) {
  float* s = inv;  // the scale in float, replaced by its inverse at the end
  // A positive scale is at least the smallest normal float, so that 1 / scale
  // stays finite (a larger scale still covers the range; the bound is scale/2).
  // Positive means a positive range: range / qmax can underflow to 0 (a range
  // of a few subnormal ulps), which would store scale 0 and lose the range.
  constexpr float kMinScale = 1.17549435e-38f;
  uint32_t range_bad = 0;
  if constexpr (std::is_same_v<Meta, float>) {
    for (int64_t i = 0; i < n; ++i) {
      zero[i] = zero_m[i] = mn[i];
      const float range = mx[i] - mn[i];
      range_bad |= uint32_t((float_bits(range) & 0x7f800000u) == 0x7f800000u);
      const float si = range / qmax;
      s[i] = scale_m[i] = range > 0.f && si < kMinScale ? kMinScale : si;
    }
  } else {
    Rows<Meta>::store(mn, n, zero_m);
    Rows<Meta>::load(zero_m, n, zero);
    for (int64_t i = 0; i < n; ++i) zero_m[i].bits = round_down_bits(zero_m[i].bits, zero[i], mn[i]);
    Rows<Meta>::load(zero_m, n, zero);
    for (int64_t i = 0; i < n; ++i) {
      const float range = mx[i] - zero[i];
      // Only a finite zero can tell a range overflow from a zero that does not fit Meta.
      range_bad |= uint32_t((float_bits(range) & 0x7f800000u) == 0x7f800000u) &
                   uint32_t((float_bits(zero[i]) & 0x7f800000u) != 0x7f800000u);
      const float si = range / qmax;
      s[i] = range > 0.f && si < kMinScale ? kMinScale : si;
    }
    Rows<Meta>::store(s, n, scale_m);
    float* nearest = mx;  // mx is not needed any more
    Rows<Meta>::load(scale_m, n, nearest);
    for (int64_t i = 0; i < n; ++i) scale_m[i].bits = round_up_bits(scale_m[i].bits, nearest[i], s[i]);
    Rows<Meta>::load(scale_m, n, s);
  }
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float si = s[i];
    bad |= uint32_t((float_bits(zero[i]) & 0x7f800000u) == 0x7f800000u) |
           uint32_t((float_bits(si) & 0x7f800000u) == 0x7f800000u);
    // 1 / scale, 0 for a constant group: a mask rather than a select, which
    // would sink the division into a branch and keep the loop from vectorizing.
    inv[i] = bits_float(float_bits(1.f / si) & (0u - uint32_t(si > 0.f)));
  }
  MetaFlags flags;
  flags.range_overflow = range_bad != 0;
  flags.meta_overflow = bad != 0;
  return flags;
}

}  // namespace nexuskv::core::NEXUSKV_ISA
