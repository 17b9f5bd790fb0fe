// The randomized Hadamard rotation of rows (the contract: hadamard_rotate_rows
// in nexuskv/core/attention.h), compiled once per instruction set (isa.h) and
// chosen at run time by attention.cpp; the per-ISA attention kernels call
// their own copy.  Every element sees the same operations in the same order
// on every ISA (the sign and norm products, then the butterflies a + b, a - b
// stage by stage), so the copies agree bit for bit; the vector ones only do
// several elements at a time.  Why per ISA: compiled for the baseline, the
// rotation was 14 % of a paged prefill on an AVX2 CPU (the queries of every
// head and the outputs back), its first three butterfly stages and the row
// maximum scalar.
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "isa.h"
#include "isa_kernels.h"
#include "nexuskv/core/cpu_isa.h"

namespace nexuskv::core::NEXUSKV_ISA {
namespace {

// Stages len = 1, 2 and 4 of the transform (butterflies inside each group of
// eight), then len = 8 .. n / 2; y holds n floats.
void butterflies(float* __restrict y, int64_t n) {
  int64_t len = 1;
#if defined(__AVX2__)
  if (n % 8 == 0) {
    for (int64_t i = 0; i < n; i += 8) {
      __m256 v = _mm256_loadu_ps(y + i);
      // In each stage the lane pairs (l, l + len) become (a + b, a - b): the
      // partner's value comes from a permutation, a - b = partner - own on the
      // upper lane of a pair.
      __m256 w = _mm256_permute_ps(v, 0xB1);  // len 1: lanes 1 0 3 2 ...
      v = _mm256_blend_ps(_mm256_add_ps(v, w), _mm256_sub_ps(w, v), 0xAA);
      w = _mm256_permute_ps(v, 0x4E);  // len 2: lanes 2 3 0 1 ...
      v = _mm256_blend_ps(_mm256_add_ps(v, w), _mm256_sub_ps(w, v), 0xCC);
      w = _mm256_permute2f128_ps(v, v, 0x01);  // len 4: the two halves swapped
      v = _mm256_blend_ps(_mm256_add_ps(v, w), _mm256_sub_ps(w, v), 0xF0);
      _mm256_storeu_ps(y + i, v);
    }
    len = 8;
  }
#endif
  for (; len < n; len <<= 1)
    for (int64_t i = 0; i < n; i += 2 * len)
      for (int64_t j = i; j < i + len; ++j) {
        const float a = y[j], b = y[j + len];
        y[j] = a + b, y[j + len] = a - b;
      }
}

}  // namespace

void hadamard_rotate_rows(const float* x, float* y, int64_t rows, int64_t n, const float* signs, bool inverse) {
  note_kernel_isa(kThisIsa);
  const float norm = 1.f / sqrt_f(float(n));
  // The butterflies grow a row by up to n; below this bound they cannot
  // overflow and the norm is applied last (as always: results unchanged).
  const float safe = kFloatMax / float(n);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    // max |x| in sixteen lanes (a NaN is skipped, as max_f skips it).
    float part[16] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      for (int l = 0; l < 16; ++l) part[l] = max_f(part[l], fabs_f(xr[i + l]));
    for (; i < n; ++i) part[0] = max_f(part[0], fabs_f(xr[i]));
    float amax = 0.f;
    for (int l = 0; l < 16; ++l) amax = max_f(amax, part[l]);
    // A row near FLT_MAX is scaled first: the butterflies then grow it by at
    // most sqrt(n), which overflows only where the exact result does too.
    const bool prescale = amax > safe;
    const float pre = prescale ? norm : 1.f, post = prescale ? 1.f : norm;
    if (inverse)
      for (int64_t c = 0; c < n; ++c) yr[c] = xr[c] * pre;
    else
      for (int64_t c = 0; c < n; ++c) yr[c] = xr[c] * signs[c] * pre;
    // In-place fast Walsh-Hadamard transform (Sylvester order; H is symmetric).
    butterflies(yr, n);
    if (inverse)
      for (int64_t c = 0; c < n; ++c) yr[c] *= post * signs[c];
    else
      for (int64_t c = 0; c < n; ++c) yr[c] *= post;
  }
}

}  // namespace nexuskv::core::NEXUSKV_ISA
