// Fitted ranges of the NQ kernels (per ISA, isa.h; format: nq_format.h,
// "Fitted ranges"): the scale and zero of each group refined by least squares
// on the group's own codes, for many groups at once vectorized across groups.
//
// Why: min/max spends the 2^bits levels on the group's extremes.  For the
// bell-shaped K/V of a group of 64-128 entries that puts the levels ~2.6
// standard deviations out, where few entries are; a range that clamps the
// rare extremes to the end levels has about half the squared error at 2 bits
// (benchmarks/RESULTS.md, "Fitted ranges").  Exact outliers stay exact.
#pragma once

#include <cstring>
#include <type_traits>

#include "isa.h"
#include "nq_range.h"
#include "rows.h"

namespace nexuskv::core::NEXUSKV_ISA {

// The sums of one pass for group g (current candidate: scale s, zero z, 1 / scale
// iv): over its n entries in order, each entry's code as quantize() gives it
// (what the compressor writes), its squared error as the readers decode it
// (code * s + z), and the sums of the least-squares fit: e_out[g] and
// sums_out[5g ..] = (n, sum c, sum x, sum c^2, sum c x) over the dense entries.
// A mark of 0 adds exact zeros: its error term is selected to 0 and the entry
// replaced by 0, so that an outlier's size cannot overflow a product (NaN).
NEXUSKV_INLINE void group_sums_scalar(const float* v, const float* dense, int64_t n, int64_t L, int64_t g,
                                      const float* s, const float* z, const float* iv, float qmax, float* e_out,
                                      float* sums_out) {
  float e = 0.f, sn = 0.f, sc = 0.f, sx = 0.f, scc = 0.f, scx = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const bool on = dense[j * L + g] != 0.f;
    const float m = on ? 1.f : 0.f, xv = on ? v[j * L + g] : 0.f;
    const float c = float(quantize(v[j * L + g], z[g], iv[g], qmax));
    const float d = on ? xv - (c * s[g] + z[g]) : 0.f;
    e += d * d, sn += m, sc += m * c, sx += xv, scc += m * (c * c), scx += c * xv;
  }
  e_out[g] = e;
  float* o = sums_out + 5 * g;
  o[0] = sn, o[1] = sc, o[2] = sx, o[3] = scc, o[4] = scx;
}

#if defined(__GNUC__) || defined(__clang__)
// The same for 8 groups g0 .. g0+7 at once, their sums in registers over all n
// entries (GCC vector extensions: every lane's operations are group_sums_scalar's,
// so the bits are too).
NEXUSKV_INLINE void group_sums8(const float* v, const float* dense, int64_t n, int64_t L, int64_t g0, const float* s,
                                const float* z, const float* iv, float qmax, float* e_out, float* sums_out) {
  typedef float f8 __attribute__((vector_size(32)));
  typedef int32_t i8 __attribute__((vector_size(32)));
  const f8 zero = {}, one = zero + 1.f, half = zero + 0.5f, top = zero + qmax;
  f8 cs, cz, ci;  // memcpy: no function returns a 32-byte vector (an ABI note without AVX)
  std::memcpy(&cs, s + g0, sizeof(f8));
  std::memcpy(&cz, z + g0, sizeof(f8));
  std::memcpy(&ci, iv + g0, sizeof(f8));
  f8 e = zero, sn = zero, sc = zero, sx = zero, scc = zero, scx = zero;
  for (int64_t j = 0; j < n; ++j) {
    f8 x, w;
    std::memcpy(&x, v + j * L + g0, sizeof(f8));
    std::memcpy(&w, dense + j * L + g0, sizeof(f8));
    f8 c = (x - cz) * ci + half;  // quantize(): the selects, then truncation
    c = c > zero ? c : zero;
    c = top < c ? top : c;
    c = __builtin_convertvector(__builtin_convertvector(c, i8), f8);
    const auto on = w != zero;
    const f8 m = on ? one : zero, xv = on ? x : zero;
    const f8 d = on ? xv - (c * cs + cz) : zero;
    e += d * d, sn += m, sc += m * c, sx += xv, scc += m * (c * c), scx += c * xv;
  }
  for (int i = 0; i < 8; ++i) {
    e_out[g0 + i] = e[i];
    float* o = sums_out + 5 * (g0 + i);
    o[0] = sn[i], o[1] = sc[i], o[2] = sx[i], o[3] = scc[i], o[4] = scx[i];
  }
}
#endif

// Floats of work fit_ranges needs for L groups.
constexpr int64_t fit_work_floats(int64_t L) { return 15 * L; }

// L groups held as lanes: v[j * L + g] is entry j < n of group g; dense[j * L + g]
// is 1 for an entry that the codes represent, 0 for an exact outlier or padding.
// In: each group's min/max scale and zero as stored (scale_m, zero_m) and in
// float (zero, inv = 1 / scale, 0 for a constant group).  Candidates: those,
// then up to kFitSteps times the least-squares (scale, zero) of the entries on
// the previous candidate's codes, rounded to nearest in Meta; a candidate that
// is not finite and positive is replaced by the previous one.  Out: the
// candidate of least squared error over the dense entries (the first of equal
// ones), stored and in float.  Every step is elementwise in float with a
// fixed order per group, so that every ISA gives the same bits.
template <typename Meta>
NEXUSKV_INLINE void fit_ranges(const float* v, const float* dense, int64_t n, int64_t L, float qmax, Meta* scale_m,
                               Meta* zero_m, float* zero, float* inv, float* work) {
  float *s = work, *z = s + L, *iv = z + L, *e = iv + L, *best = e + L;  // current candidate, its error, best error
  float* sums = best + L;                           // [L, 5]: n, sum c, sum x, sum c^2, sum c x per group
  float *ns = sums + 5 * L, *nz = ns + L;           // the next candidate
  float *bs = nz + L, *bz = bs + L;                 // best scale and zero
  Meta* rounded = reinterpret_cast<Meta*>(bz + L);  // L Meta values (sizeof(Meta) <= sizeof(float))
  Rows<Meta>::load(scale_m, L, s);
  for (int64_t g = 0; g < L; ++g) z[g] = zero[g], iv[g] = inv[g];
  constexpr float kMinScale = 1.17549435e-38f;  // as make_meta: 1 / scale stays finite
  for (int step = 0; step <= kFitSteps; ++step) {
    int64_t first = 0;  // groups summed so far: 8 at a time, then one at a time
#if defined(__GNUC__) || defined(__clang__)
    for (; first + 8 <= L; first += 8) group_sums8(v, dense, n, L, first, s, z, iv, qmax, e, sums);
#endif
    for (; first < L; ++first) group_sums_scalar(v, dense, n, L, first, s, z, iv, qmax, e, sums);
    for (int64_t g = 0; g < L; ++g) {
      const bool better = step == 0 || e[g] < best[g];
      best[g] = better ? e[g] : best[g];
      bs[g] = better ? s[g] : bs[g];
      bz[g] = better ? z[g] : bz[g];
    }
    if (step == kFitSteps) break;
    // The next candidate: least squares x ~ zero + scale * code over the dense entries.
    for (int64_t g = 0; g < L; ++g) {
      const float *o = sums + 5 * g, sn = o[0], sc = o[1], sx = o[2], scc = o[3], scx = o[4];
      const float den = sn * scc - sc * sc;
      const float cs = (sn * scx - sc * sx) / den;
      const float cz = (sx - cs * sc) / sn;
      const bool ok = den > 0.f && cs >= kMinScale && (float_bits(cs) & 0x7f800000u) != 0x7f800000u &&
                      (float_bits(cz) & 0x7f800000u) != 0x7f800000u;
      ns[g] = ok ? cs : s[g];
      nz[g] = ok ? cz : z[g];
    }
    Rows<Meta>::store(ns, L, rounded);
    Rows<Meta>::load(rounded, L, ns);
    Rows<Meta>::store(nz, L, rounded);
    Rows<Meta>::load(rounded, L, nz);
    uint32_t moved = 0;
    for (int64_t g = 0; g < L; ++g) {
      // Rounding can leave the candidate non-finite or below kMinScale: keep the current one then.
      const bool ok = ns[g] >= kMinScale && (float_bits(ns[g]) & 0x7f800000u) != 0x7f800000u &&
                      (float_bits(nz[g]) & 0x7f800000u) != 0x7f800000u;
      const float cs = ok ? ns[g] : s[g], cz = ok ? nz[g] : z[g];
      moved |= (float_bits(cs) ^ float_bits(s[g])) | (float_bits(cz) ^ float_bits(z[g]));
      s[g] = cs, z[g] = cz;
      iv[g] = bits_float(float_bits(1.f / s[g]) & (0u - uint32_t(s[g] > 0.f)));
    }
    if (!moved) break;  // every candidate as before: the next passes would repeat this one
  }
  Rows<Meta>::store(bs, L, scale_m);
  Rows<Meta>::store(bz, L, zero_m);
  for (int64_t g = 0; g < L; ++g) {
    zero[g] = bz[g];
    inv[g] = bits_float(float_bits(1.f / bs[g]) & (0u - uint32_t(bs[g] > 0.f)));
  }
}

}  // namespace nexuskv::core::NEXUSKV_ISA
