// NQ compress / decompress kernels of the torch-free core (format in
// nq_format.h).
//
// Every task works on float32 rows in a small scratch buffer: one pass
// converts the input (and checks it for NaN/Inf), then min/max, the scale and
// zero of each group, and a fused quantize+pack pass straight into the packed
// layout.  Decompression is the mirror: a fused unpack+dequantize pass into a
// float row, then one conversion into the output dtype.  The loops are written
// over plain arrays, with selects rather than branches, so that the compiler
// vectorizes them; the 16-bit conversions give the same results as half.h's.
// Results are bit-identical to the straightforward per-element version.
//
// The kernels are compiled twice: for the baseline target (portable x86-64 or
// whatever the build targets) and, on x86, with AVX2 + F16C through function
// target attributes (fp16 <-> fp32 in hardware, 256-bit vectors).  The second
// is chosen at run time when the CPU has it; both give identical results (no
// FMA contraction, the same rounding everywhere), except for the payload bits
// of a NaN produced by fp16 output conversion, which compress never lets in.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "nexuskv/core/nq_kernels.h"

// NEXUSKV_CORE_PORTABLE_ONLY builds the portable kernels alone (for testing them on x86).
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(NEXUSKV_CORE_PORTABLE_ONLY)
#include <immintrin.h>
#define NEXUSKV_X86_DISPATCH 1
// No "fma": the results must not depend on the path taken.
#define NEXUSKV_TARGET_AVX2 __attribute__((target("avx2,f16c")))
#endif

#if defined(__GNUC__) || defined(__clang__)
#define NEXUSKV_INLINE inline __attribute__((always_inline))
#else
#define NEXUSKV_INLINE inline
#endif

namespace nexuskv::core {
namespace {

// Instruction-set tags the kernels are instantiated for.
struct Generic {};
struct Avx2 {};  // AVX2 + F16C; only used on x86 when the CPU has both

// ---- scalar conversions (same results as half.h) ------------------------------------------
// Selects instead of branches: the bf16 ones vectorize.  The fp16 ones stay
// scalar in the portable build (the compiler does not evaluate their
// floating-point steps ahead of a select, as they might trap); the AVX2
// build converts fp16 rows with F16C instead.

// IEEE binary16 -> float, exact.
NEXUSKV_INLINE float half_bits_to_float(uint32_t h) {
  const uint32_t o = (h & 0x7fffu) << 13, exp = o & 0x0f800000u;
  const uint32_t normal = o + ((127u - 15u) << 23);
  const uint32_t inf_nan = o + ((127u - 15u + 128u - 16u) << 23);
  // zero / subnormal: renormalize through float (exact, no denormal operands)
  const uint32_t sub = float_bits(bits_float(normal + (1u << 23)) - bits_float(113u << 23));
  const uint32_t r = exp == 0x0f800000u ? inf_nan : exp == 0 ? sub : normal;
  return bits_float(r | ((h & 0x8000u) << 16));
}

// float -> IEEE binary16, round to nearest even, overflow to Inf, NaN -> quiet NaN.
NEXUSKV_INLINE uint16_t float_to_half_bits(float f) {
  const uint32_t x = float_bits(f), sign = (x >> 16) & 0x8000u;
  const int32_t a = int32_t(x & 0x7fffffffu);
  const uint32_t nan_inf = a > 0x7f800000 ? 0x7e00u : 0x7c00u;
  const uint32_t sub = float_bits(bits_float(uint32_t(a)) + 0.5f) - 0x3f000000u;  // FPU rounds at 2^-24
  const uint32_t normal = (uint32_t(a) + 0xc8000fffu + ((uint32_t(a) >> 13) & 1u)) >> 13;
  const uint32_t r = a >= 0x7f800000 ? nan_inf : a >= 0x477ff000 ? 0x7c00u : a < 0x38800000 ? sub : normal;
  return uint16_t(sign | r);
}

// float -> bfloat16, round to nearest even; NaN stays NaN.
NEXUSKV_INLINE uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return uint16_t((x & 0x7fffffffu) > 0x7f800000u ? (x >> 16) | 0x0040u : rounded);
}

// ---- whole-row conversions ----------------------------------------------------------------

// Rows<Isa, T>::load converts n values to float32 and reports whether any is
// NaN or Inf; Rows<Isa, T>::store converts n floats back (nearest).
template <typename Isa, typename T>
struct Rows {
  static NEXUSKV_INLINE bool load(const T* src, int64_t n, float* dst) {
    uint32_t bad = 0;
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t i = 0; i < n; ++i) {
        dst[i] = src[i];
        bad |= uint32_t((float_bits(src[i]) & 0x7f800000u) == 0x7f800000u);
      }
    } else if constexpr (std::is_same_v<T, bf16_t>) {
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t h = src[i].bits;
        dst[i] = bits_float(h << 16);
        bad |= uint32_t((h & 0x7f80u) == 0x7f80u);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t h = src[i].bits;
        dst[i] = half_bits_to_float(h);
        bad |= uint32_t((h & 0x7c00u) == 0x7c00u);
      }
    }
    return bad != 0;
  }

  static NEXUSKV_INLINE void store(const float* src, int64_t n, T* dst) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst, src, size_t(n) * sizeof(float));
    } else if constexpr (std::is_same_v<T, bf16_t>) {
      for (int64_t i = 0; i < n; ++i) dst[i].bits = float_to_bf16_bits(src[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i].bits = float_to_half_bits(src[i]);
    }
  }
};

#ifdef NEXUSKV_X86_DISPATCH
// fp16 with F16C.  Not always_inline (the intrinsics need the target): the
// compiler inlines these into the AVX2 kernels, which have the same target.
template <>
struct Rows<Avx2, half_t> {
  NEXUSKV_TARGET_AVX2 static bool load(const half_t* src, int64_t n, float* dst) {
    const __m128i exp = _mm_set1_epi16(0x7c00);
    __m128i bad = _mm_setzero_si128();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
      bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, exp), exp));
    }
    bool any = !_mm_testz_si128(bad, bad);
    for (; i < n; ++i) {
      dst[i] = half_bits_to_float(src[i].bits);
      any |= (src[i].bits & 0x7c00u) == 0x7c00u;
    }
    return any;
  }
  NEXUSKV_TARGET_AVX2 static void store(const float* src, int64_t n, half_t* dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) dst[i].bits = float_to_half_bits(src[i]);
  }
};
#endif

// Loads x[row, t, 0..D) as float32 into dst; gathers first when channels are strided.
template <typename Isa, typename In>
NEXUSKV_INLINE bool load_x_row(const StridedRows<In>& x, const In* src, int64_t D, float* dst, In* gather) {
  if (x.stride_d != 1) {
    for (int64_t d = 0; d < D; ++d) gather[d] = src[d * x.stride_d];
    src = gather;
  }
  return Rows<Isa, In>::load(src, D, dst);
}

// ---- quantization -------------------------------------------------------------------------

// code = clamp(round((v - zero) / scale), 0, qmax), rounding halves up.
NEXUSKV_INLINE uint8_t quantize(float v, float zero, float inv_scale, float qmax) {
  // v >= zero for dense entries; the clamp covers outliers and float error.
  // Written as the selects that map onto max/min instructions; NaN gives 0.
  float c = (v - zero) * inv_scale + 0.5f;
  c = c > 0.f ? c : 0.f;
  c = qmax < c ? qmax : c;
  return uint8_t(int32_t(c));
}

// Codes of n values: zero / inv_scale per value (arrays) or one pair for all.
NEXUSKV_INLINE void quantize_codes(const float* v, const float* zero, const float* inv, float qmax, int64_t n,
                                   uint8_t* codes) {
  for (int64_t i = 0; i < n; ++i) codes[i] = quantize(v[i], zero[i], inv[i], qmax);
}
NEXUSKV_INLINE void quantize_codes(const float* v, float zero, float inv, float qmax, int64_t n, uint8_t* codes) {
  for (int64_t i = 0; i < n; ++i) codes[i] = quantize(v[i], zero, inv, qmax);
}

// x_hat of n codes: scale / zero per value (arrays) or one pair for all.
NEXUSKV_INLINE void dequantize_codes(const uint8_t* codes, const float* s, const float* z, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = float(codes[i]) * s[i] + z[i];
}
NEXUSKV_INLINE void dequantize_codes(const uint8_t* codes, float s, float z, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = float(codes[i]) * s + z;
}

// x_hat = code*scale + zero can pass the output type's largest finite value by
// up to scale/2 (the scale is rounded up) although the input did not: clamp
// there instead of rounding to Inf.
template <typename Out>
NEXUSKV_INLINE void saturate(float* v, int64_t n) {
  constexpr float kMax = std::is_same_v<Out, half_t> ? 65504.f : 3.38953139e38f;
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] > kMax ? kMax : (v[i] < -kMax ? -kMax : v[i]);
}

// Channels of one packed chunk, and a row of codes rounded up to whole chunks
// (the scratch row of codes has this length; its padding stays zero).
inline int64_t padded_channels(int bits, int64_t D) { return ceil_div(D, chunk_channels(bits)) * chunk_channels(bits); }

// One plane of a 16-byte chunk: channels 16J..16J+15 <-> bits kBits*J of bytes 0..15.
// Planes are separate functions so that every shift is a constant.
template <int kBits, int J>
NEXUSKV_INLINE void pack_plane(const uint8_t* codes, uint8_t* acc) {
  for (int l = 0; l < 16; ++l) acc[l] = uint8_t(acc[l] | (codes[16 * J + l] << (kBits * J)));
}
template <int kBits, int J>
NEXUSKV_INLINE void unpack_plane(const uint8_t* in, uint8_t* codes) {
  constexpr unsigned kMask = (1u << kBits) - 1u;
  for (int l = 0; l < 16; ++l) codes[16 * J + l] = uint8_t((unsigned(in[l]) >> (kBits * J)) & kMask);
}
template <int kBits, int... J>
NEXUSKV_INLINE void pack_chunk(const uint8_t* codes, uint8_t* out, std::integer_sequence<int, J...>) {
  uint8_t acc[16] = {0};
  (pack_plane<kBits, J>(codes, acc), ...);
  std::memcpy(out, acc, 16);
}
template <int kBits, int... J>
NEXUSKV_INLINE void unpack_chunk(const uint8_t* in, uint8_t* codes, std::integer_sequence<int, J...>) {
  (unpack_plane<kBits, J>(in, codes), ...);
}

// 3 bits: chunk of 64 channels in 24 bytes, the low 2 bits as a 2-bit chunk,
// then bit 2 of channel i at byte 16 + i%8, bit i/8.  Channel 16m + l' has
// that bit at byte 16 + l'%8, bit 2m + l'/8: gathered over 16 lanes first.
template <int M>
NEXUSKV_INLINE void pack3_plane(const uint8_t* codes, uint8_t* low, uint8_t* t) {
  for (int l = 0; l < 16; ++l) {
    const unsigned c = codes[16 * M + l];
    low[l] = uint8_t(low[l] | ((c & 3u) << (2 * M)));
    t[l] = uint8_t(t[l] | (((c >> 2) & 1u) << (2 * M)));
  }
}
template <int... M>
NEXUSKV_INLINE void pack_chunk3(const uint8_t* codes, uint8_t* out, std::integer_sequence<int, M...>) {
  uint8_t low[16] = {0}, t[16] = {0}, high[8];
  (pack3_plane<M>(codes, low, t), ...);
  for (int l = 0; l < 8; ++l) high[l] = uint8_t(t[l] | (t[l + 8] << 1));
  std::memcpy(out, low, 16);
  std::memcpy(out + 16, high, 8);
}
template <int J>
NEXUSKV_INLINE void unpack_high_plane(const uint8_t* in, uint8_t* codes) {
  for (int l = 0; l < 8; ++l) codes[8 * J + l] = uint8_t(codes[8 * J + l] | (((in[16 + l] >> J) & 1u) << 2));
}
template <int... J>
NEXUSKV_INLINE void unpack_chunk3(const uint8_t* in, uint8_t* codes, std::integer_sequence<int, J...>) {
  unpack_chunk<2>(in, codes, std::make_integer_sequence<int, 4>{});
  (unpack_high_plane<J>(in, codes), ...);
}

// Packs codes[0..padded_channels(kBits, D)) (kBits = 2, 3, 4, 8) into one row
// (layout in nq_format.h: channel 16j + l of a 16-byte chunk sits in byte l
// at bit offset kBits*j).
template <int kBits>
NEXUSKV_INLINE void pack_codes(const uint8_t* codes, int64_t D, uint8_t* out) {
  if constexpr (kBits == 8) {
    std::memcpy(out, codes, size_t(padded_channels(8, D)));
  } else if constexpr (kBits == 3) {
    for (int64_t c0 = 0; c0 < D; c0 += 64, out += 24) pack_chunk3(codes + c0, out, std::make_integer_sequence<int, 4>{});
  } else {
    constexpr int C = 16 * (8 / kBits);
    for (int64_t c0 = 0; c0 < D; c0 += C, out += 16)
      pack_chunk<kBits>(codes + c0, out, std::make_integer_sequence<int, 8 / kBits>{});
  }
}

// Inverse of pack_codes: writes codes[0..padded_channels(kBits, D)).
template <int kBits>
NEXUSKV_INLINE void unpack_codes(const uint8_t* in, int64_t D, uint8_t* codes) {
  if constexpr (kBits == 8) {
    std::memcpy(codes, in, size_t(padded_channels(8, D)));
  } else if constexpr (kBits == 3) {
    for (int64_t c0 = 0; c0 < D; c0 += 64, in += 24) unpack_chunk3(in, codes + c0, std::make_integer_sequence<int, 8>{});
  } else {
    constexpr int C = 16 * (8 / kBits);
    for (int64_t c0 = 0; c0 < D; c0 += C, in += 16)
      unpack_chunk<kBits>(in, codes + c0, std::make_integer_sequence<int, 8 / kBits>{});
  }
}

// pack_codes / unpack_codes for a bit width known at run time.
NEXUSKV_INLINE void pack_codes(int bits, const uint8_t* codes, int64_t D, uint8_t* out) {
  switch (bits) {
    case 2: pack_codes<2>(codes, D, out); break;
    case 4: pack_codes<4>(codes, D, out); break;
    case 3: pack_codes<3>(codes, D, out); break;
    default: pack_codes<8>(codes, D, out); break;
  }
}
NEXUSKV_INLINE void unpack_codes(int bits, const uint8_t* in, int64_t D, uint8_t* codes) {
  switch (bits) {
    case 2: unpack_codes<2>(in, D, codes); break;
    case 4: unpack_codes<4>(in, D, codes); break;
    case 3: unpack_codes<3>(in, D, codes); break;
    default: unpack_codes<8>(in, D, codes); break;
  }
}

// ---- scale and zero -----------------------------------------------------------------------

// Neighbours of a 16-bit float towards -Inf / +Inf (half.h's bits16_next_*), as selects.
NEXUSKV_INLINE uint32_t bits16_down(uint32_t h) { return h == 0u ? 0x8001u : (h & 0x8000u) ? h + 1u : h - 1u; }
NEXUSKV_INLINE uint32_t bits16_up(uint32_t h) { return h == 0x8000u ? 0x0001u : (h & 0x8000u) ? h - 1u : h + 1u; }

// Scale and zero of n groups from their min / max (nq_format.h): zero = min
// rounded down to Meta, scale = (max - zero) / qmax rounded up, as half.h's
// round_down / round_up do it (nearest, then one step if on the wrong side).
// Writes the stored values, and the float zero and 1 / scale (0 for a
// constant group) that quantization uses.  Returns true if a stored value is
// not finite; overwrites mx.  Works in passes over the n groups so that every pass
// vectorizes and the 16-bit conversions are the row conversions of Isa.
template <typename Isa, typename Meta>
NEXUSKV_INLINE bool make_meta(const float* mn, float* mx, int64_t n, float qmax, Meta* scale_m, Meta* zero_m,
                              float* zero, float* inv) {
  float* s = inv;  // the scale in float, replaced by its inverse at the end
  // A positive scale is at least the smallest normal float, so that 1 / scale
  // stays finite (a larger scale still covers the range; the bound is scale/2).
  constexpr float kMinScale = 1.17549435e-38f;
  if constexpr (std::is_same_v<Meta, float>) {
    for (int64_t i = 0; i < n; ++i) {
      zero[i] = zero_m[i] = mn[i];
      const float si = (mx[i] - mn[i]) / qmax;
      s[i] = scale_m[i] = si > 0.f && si < kMinScale ? kMinScale : si;
    }
  } else {
    Rows<Isa, Meta>::store(mn, n, zero_m);
    Rows<Isa, Meta>::load(zero_m, n, zero);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t h = zero_m[i].bits;
      zero_m[i].bits = uint16_t(zero[i] > mn[i] ? bits16_down(h) : h);
    }
    Rows<Isa, Meta>::load(zero_m, n, zero);
    for (int64_t i = 0; i < n; ++i) {
      const float si = (mx[i] - zero[i]) / qmax;
      s[i] = si > 0.f && si < kMinScale ? kMinScale : si;
    }
    Rows<Isa, Meta>::store(s, n, scale_m);
    float* nearest = mx;  // mx is not needed any more
    Rows<Isa, Meta>::load(scale_m, n, nearest);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t h = scale_m[i].bits;
      scale_m[i].bits = uint16_t(nearest[i] < s[i] ? bits16_up(h) : h);
    }
    Rows<Isa, Meta>::load(scale_m, n, s);
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
  return bad != 0;
}

// ---- outliers -----------------------------------------------------------------------------

struct Ranked {
  float v;
  int pos;
};
inline bool ranked_less(const Ranked& a, const Ranked& b) { return a.v < b.v || (a.v == b.v && a.pos < b.pos); }

// Chooses the k entries of vals[0..n) (read with stride) whose removal shrinks
// max - min the most: i from the bottom and k - i from the top, best i.  The
// ranking uses (value, position) so that the bottom and top sets never share
// an entry.  Writes the sorted positions to pos[0..k) (repeating the last one
// when n <= k) and the min/max of what is left (0, 0 when nothing is).
void select_outliers(const float* vals, int64_t stride, int n, int k, uint8_t* pos, float* mn, float* mx) {
  if (n <= k) {
    for (int s = 0; s < k; ++s) pos[s] = uint8_t(std::min(s, n - 1));
    *mn = *mx = 0.f;
    return;
  }
  Ranked low[kMaxGroupSize + 1], high[kMaxGroupSize + 1];  // k+1 smallest ascending, k+1 largest descending
  int nl = 0, nh = 0;
  for (int i = 0; i < n; ++i) {
    const Ranked e{vals[i * stride], i};
    if (nl < k + 1 || ranked_less(e, low[nl - 1])) {
      int j = std::min(nl, k);
      for (; j > 0 && ranked_less(e, low[j - 1]); --j) low[j] = low[j - 1];
      low[j] = e;
      nl = std::min(nl + 1, k + 1);
    }
    if (nh < k + 1 || ranked_less(high[nh - 1], e)) {
      int j = std::min(nh, k);
      for (; j > 0 && ranked_less(high[j - 1], e); --j) high[j] = high[j - 1];
      high[j] = e;
      nh = std::min(nh + 1, k + 1);
    }
  }
  int best = 0;
  float best_range = std::numeric_limits<float>::infinity();
  for (int i = 0; i <= k; ++i) {
    const float range = high[k - i].v - low[i].v;
    if (range < best_range) best_range = range, best = i;
  }
  *mn = low[best].v;
  *mx = high[k - best].v;
  int s = 0;
  for (int i = 0; i < best; ++i) pos[s++] = uint8_t(low[i].pos);
  for (int i = 0; i < k - best; ++i) pos[s++] = uint8_t(high[i].pos);
  std::sort(pos, pos + k);
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
  std::vector<float> v;
  std::vector<int32_t> p;
  LaneLists(int64_t L, int k) : v(size_t((4 * k + 8) * L)), p(size_t((4 * k + 8) * L)) {}
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

NEXUSKV_INLINE void select_outliers_lanes_impl(const float* vals, int64_t L, int n, int k, LaneLists& s,
                                               uint8_t* pos, float* mn, float* mx) {
  const int64_t list = (k + 1) * L;
  float* lists_v[2] = {s.v.data(), s.v.data() + 2 * list};  // low then high
  int32_t* lists_p[2] = {s.p.data(), s.p.data() + 2 * list};
  float* carry_v = s.v.data() + 4 * list;    // [low, high] x [2 copies] x L
  int32_t* carry_p = s.p.data() + 4 * list;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < list; ++i)
    lists_v[0][i] = inf, lists_v[0][list + i] = -inf, lists_p[0][i] = lists_p[0][list + i] = 0;
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
    float best_range = inf;
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
    std::sort(pg, pg + k);
  }
}

// Compiled once per instruction set (it does not depend on the tensor types).
#if defined(__GNUC__) || defined(__clang__)
__attribute__((noinline))
#endif
void select_outliers_lanes_generic(const float* vals, int64_t L, int n, int k, LaneLists& s, uint8_t* pos, float* mn,
                                   float* mx) {
  select_outliers_lanes_impl(vals, L, n, k, s, pos, mn, mx);
}
#ifdef NEXUSKV_X86_DISPATCH
NEXUSKV_TARGET_AVX2 __attribute__((noinline)) void select_outliers_lanes_avx2(const float* vals, int64_t L, int n,
                                                                               int k, LaneLists& s, uint8_t* pos,
                                                                               float* mn, float* mx) {
  select_outliers_lanes_impl(vals, L, n, k, s, pos, mn, mx);
}
#endif
template <typename Isa>
NEXUSKV_INLINE void select_outliers_lanes(const float* vals, int64_t L, int n, int k, LaneLists& s, uint8_t* pos,
                                          float* mn, float* mx) {
#ifdef NEXUSKV_X86_DISPATCH
  if constexpr (std::is_same_v<Isa, Avx2>) return select_outliers_lanes_avx2(vals, L, n, k, s, pos, mn, mx);
#endif
  select_outliers_lanes_generic(vals, L, n, k, s, pos, mn, mx);
}

// ---- min / max ----------------------------------------------------------------------------

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
      for (int j = 0; j < w; ++j) l[j] = std::min(l[j], l[j + w]), h[j] = std::max(h[j], h[j + w]);
    lo = l[0], hi = h[0];
#endif
  }
#endif
  for (; i < n; ++i) lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
  *mn = lo, *mx = hi;
}

// ---- per-task kernels ---------------------------------------------------------------------

// Scratch of one kernel call, allocated once per call (not per task); zeroed,
// which the padding of the code rows relies on.
struct Scratch {
  std::vector<float> f;
  std::vector<uint8_t> b;
  Scratch(int64_t floats, int64_t bytes) : f(size_t(floats)), b(size_t(bytes)) {}
};

template <typename Isa, typename In, typename Meta>
NEXUSKV_INLINE void compress_token_groups(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out,
                                          int64_t task_begin, int64_t task_end, CompressStatus* status) {
  const int64_t D = d.head_dim, A = d.meta_a(), rb = d.packed_row_bytes();
  const int64_t Dp = padded_channels(d.bits, D);
  const int k = d.num_outliers;
  const float qmax = float((1 << d.bits) - 1);
  // Without outliers the token group is read twice (min/max, then codes),
  // converting one row at a time: its input stays in cache and the float
  // scratch is one row.  Outlier selection needs the whole group as floats.
  const int64_t Gmax = d.max_group_tokens();  // G, or up to kMaxGroupSize with DGQ segments
  Scratch scratch((k == 0 ? 1 : Gmax) * D + 4 * D, Dp + D * int64_t(sizeof(In)));
  float* block = scratch.f.data();  // [G, D] (outliers) or [1, D] float rows
  float *mn = block + (k == 0 ? 1 : Gmax) * D, *mx = mn + D, *zero = mx + D, *inv = zero + D;
  uint8_t* codes = scratch.b.data();
  In* gather = reinterpret_cast<In*>(codes + Dp);
  LaneLists lanes(k == 0 ? 0 : D, k);
  bool overflow = false, bad = false;
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t n = task / A, a = task % A, t0 = d.group_start(n, a);
    const int64_t nt = d.group_end(n, a) - t0;
    const In* base = x.data + x.row_offset[n] + t0 * x.stride_t;
    const int64_t g0 = (n * A + a) * D;  // first group (channel 0) of this token group
    if (k == 0) {
      bad |= load_x_row<Isa>(x, base, D, mn, gather);
      std::memcpy(mx, mn, size_t(D) * sizeof(float));
      for (int64_t t = 1; t < nt; ++t) {
        bad |= load_x_row<Isa>(x, base + t * x.stride_t, D, block, gather);
        for (int64_t c = 0; c < D; ++c) mn[c] = std::min(mn[c], block[c]), mx[c] = std::max(mx[c], block[c]);
      }
    } else {
      for (int64_t t = 0; t < nt; ++t) bad |= load_x_row<Isa>(x, base + t * x.stride_t, D, block + t * D, gather);
      uint8_t* pos = out.outlier_idx + g0 * k;
      if (nt > k) {
        select_outliers_lanes<Isa>(block, D, int(nt), k, lanes, pos, mn, mx);
      } else {
        for (int64_t c = 0; c < D; ++c) select_outliers(block + c, D, int(nt), k, pos + c * k, &mn[c], &mx[c]);
      }
      for (int64_t c = 0; c < D; ++c) {
        In* val = out.outlier_val + (g0 + c) * k;
        for (int s = 0; s < k; ++s) val[s] = base[pos[c * k + s] * x.stride_t + c * x.stride_d];
      }
    }
    overflow |= make_meta<Isa, Meta>(mn, mx, D, qmax, out.scale + g0, out.zero + g0, zero, inv);
    uint8_t* packed = out.codes + (n * d.tokens + t0) * rb;
    for (int64_t t = 0; t < nt; ++t) {
      const float* row = block + t * D;
      if (k == 0) {
        load_x_row<Isa>(x, base + t * x.stride_t, D, block, gather);
        row = block;
      }
      quantize_codes(row, zero, inv, qmax, D, codes);
      pack_codes(d.bits, codes, D, packed + t * rb);
    }
  }
  if (bad) status->non_finite_input = true;
  if (overflow) status->meta_overflow = true;
}

// Tokens per block of the per-token kernels: their scales and zeros are
// computed together, so that that loop vectorizes too.
constexpr int64_t kTokenBlock = 16;

template <typename Isa, typename In, typename Meta>
NEXUSKV_INLINE void compress_channel_groups(const NQDims& d, const StridedRows<In>& x,
                                            const NQBuffers<In, Meta>& out, int64_t task_begin, int64_t task_end,
                                            CompressStatus* status) {
  const int64_t D = d.head_dim, G = d.group_size, B = d.meta_b(), rb = d.packed_row_bytes();
  const int k = d.num_outliers;
  const float qmax = float((1 << d.bits) - 1);
  // With outliers and whole groups, a block's groups are transposed into
  // lanes ([G, R*B]) and selected together; more tokens per block then make
  // longer vector loops.
  const bool lanes_ok = k > 0 && D % G == 0 && G > k;
  const int64_t Dp = padded_channels(d.bits, D), R = lanes_ok ? 4 * kTokenBlock : kTokenBlock;
  Scratch scratch(R * D * (lanes_ok ? 2 : 1) + 4 * R * B, Dp + D * int64_t(sizeof(In)));
  float* block = scratch.f.data();  // [R, D] float rows
  float *mn = block + R * D, *mx = mn + R * B, *zero = mx + R * B, *inv = zero + R * B;
  float* lane_vals = inv + R * B;  // [G, R*B] when lanes_ok
  uint8_t* codes = scratch.b.data();
  In* gather = reinterpret_cast<In*>(codes + Dp);
  LaneLists lanes(lanes_ok ? R * B : 0, k);
  bool overflow = false, bad = false;
  for (int64_t task0 = task_begin; task0 < task_end; task0 += R) {  // task = n * T + t
    const int64_t nr = std::min(R, task_end - task0);
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t task = task0 + r, n = task / d.tokens, t = task % d.tokens;
      const In* src = x.data + x.row_offset[n] + t * x.stride_t;
      float* row = block + r * D;
      bad |= load_x_row<Isa>(x, src, D, row, gather);
      if (lanes_ok) continue;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t c0 = b * G, nc = std::min(G, D - c0);
        if (k == 0) {
          min_max(row + c0, nc, &mn[r * B + b], &mx[r * B + b]);
        } else {
          select_outliers(row + c0, 1, int(nc), k, out.outlier_idx + (task * B + b) * k, &mn[r * B + b],
                          &mx[r * B + b]);
        }
      }
    }
    if (lanes_ok) {
      const int64_t L = nr * B;
      for (int64_t j = 0; j < G; ++j)
        for (int64_t g = 0; g < L; ++g) lane_vals[j * L + g] = block[g * G + j];  // group g = r*B + b
      select_outliers_lanes<Isa>(lane_vals, L, int(G), k, lanes, out.outlier_idx + task0 * B * k, mn, mx);
    }
    if (k > 0) {
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t task = task0 + r, n = task / d.tokens, t = task % d.tokens;
        const In* src = x.data + x.row_offset[n] + t * x.stride_t;
        for (int64_t b = 0; b < B; ++b) {
          const int64_t g = task * B + b;
          const uint8_t* pos = out.outlier_idx + g * k;
          In* val = out.outlier_val + g * k;
          for (int s = 0; s < k; ++s) val[s] = src[(b * G + pos[s]) * x.stride_d];
        }
      }
    }
    overflow |= make_meta<Isa, Meta>(mn, mx, nr * B, qmax, out.scale + task0 * B, out.zero + task0 * B, zero, inv);
    for (int64_t r = 0; r < nr; ++r) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t c0 = b * G, nc = std::min(G, D - c0);
        quantize_codes(block + r * D + c0, zero[r * B + b], inv[r * B + b], qmax, nc, codes + c0);
      }
      pack_codes(d.bits, codes, D, out.codes + (task0 + r) * rb);
    }
  }
  if (bad) status->non_finite_input = true;
  if (overflow) status->meta_overflow = true;
}

template <typename Isa, typename Meta, typename Out>
NEXUSKV_INLINE void decompress_token_groups(const NQDims& d, const uint8_t* packed, const Meta* scale,
                                            const Meta* zero, Out* out, int64_t task_begin, int64_t task_end) {
  const int64_t D = d.head_dim, A = d.meta_a(), rb = d.packed_row_bytes();
  const int64_t Dp = padded_channels(d.bits, D);
  Scratch scratch(3 * D, Dp);
  float *s = scratch.f.data(), *z = s + D, *row = z + D;
  uint8_t* codes = scratch.b.data();
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t n = task / A, a = task % A, t0 = d.group_start(n, a), nt = d.group_end(n, a) - t0;
    Rows<Isa, Meta>::load(scale + task * D, D, s);
    Rows<Isa, Meta>::load(zero + task * D, D, z);
    for (int64_t t = t0; t < t0 + nt; ++t) {
      unpack_codes(d.bits, packed + (n * d.tokens + t) * rb, D, codes);
      Out* o = out + (n * d.tokens + t) * D;
      if constexpr (std::is_same_v<Out, float>) {
        dequantize_codes(codes, s, z, D, o);
      } else {
        dequantize_codes(codes, s, z, D, row);
        saturate<Out>(row, D);
        Rows<Isa, Out>::store(row, D, o);
      }
    }
  }
}

template <typename Isa, typename Meta, typename Out>
NEXUSKV_INLINE void decompress_channel_groups(const NQDims& d, const uint8_t* packed, const Meta* scale,
                                              const Meta* zero, Out* out, int64_t task_begin, int64_t task_end) {
  const int64_t D = d.head_dim, G = d.group_size, B = d.meta_b(), rb = d.packed_row_bytes();
  const int64_t Dp = padded_channels(d.bits, D), R = kTokenBlock;
  Scratch scratch(D + 2 * R * B, Dp);
  float *row = scratch.f.data(), *s = row + D, *z = s + R * B;
  uint8_t* codes = scratch.b.data();
  for (int64_t task0 = task_begin; task0 < task_end; task0 += R) {  // task = n * T + t
    const int64_t nr = std::min(R, task_end - task0);
    Rows<Isa, Meta>::load(scale + task0 * B, nr * B, s);
    Rows<Isa, Meta>::load(zero + task0 * B, nr * B, z);
    for (int64_t r = 0; r < nr; ++r) {
      unpack_codes(d.bits, packed + (task0 + r) * rb, D, codes);
      Out* o = out + (task0 + r) * D;
      float* dst = std::is_same_v<Out, float> ? reinterpret_cast<float*>(o) : row;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t c0 = b * G, nc = std::min(G, D - c0);
        dequantize_codes(codes + c0, s[r * B + b], z[r * B + b], nc, dst + c0);
      }
      if constexpr (!std::is_same_v<Out, float>) {
        saturate<Out>(row, D);
        Rows<Isa, Out>::store(row, D, o);
      }
    }
  }
}

// One instantiation per instruction set and type pair; the bit width is a
// switch per row, around the inlined packing of each width.
template <typename Isa, typename In, typename Meta>
NEXUSKV_INLINE void compress_impl(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out,
                                  int64_t begin, int64_t end, CompressStatus* status) {
  if (d.axis == GroupAxis::kTokens)
    compress_token_groups<Isa>(d, x, out, begin, end, status);
  else
    compress_channel_groups<Isa>(d, x, out, begin, end, status);
}

template <typename Isa, typename Meta, typename Out>
NEXUSKV_INLINE void decompress_impl(const NQDims& d, const uint8_t* codes, const Meta* scale, const Meta* zero,
                                    Out* out, int64_t begin, int64_t end) {
  if (d.axis == GroupAxis::kTokens)
    decompress_token_groups<Isa>(d, codes, scale, zero, out, begin, end);
  else
    decompress_channel_groups<Isa>(d, codes, scale, zero, out, begin, end);
}

template <typename In, typename Meta>
void compress_generic(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out, int64_t begin,
                      int64_t end, CompressStatus* status) {
  compress_impl<Generic>(d, x, out, begin, end, status);
}
template <typename Meta, typename Out>
void decompress_generic(const NQDims& d, const uint8_t* codes, const Meta* scale, const Meta* zero, Out* out,
                        int64_t begin, int64_t end) {
  decompress_impl<Generic>(d, codes, scale, zero, out, begin, end);
}

#ifdef NEXUSKV_X86_DISPATCH
template <typename In, typename Meta>
NEXUSKV_TARGET_AVX2 void compress_avx2(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out,
                                       int64_t begin, int64_t end, CompressStatus* status) {
  compress_impl<Avx2>(d, x, out, begin, end, status);
}
template <typename Meta, typename Out>
NEXUSKV_TARGET_AVX2 void decompress_avx2(const NQDims& d, const uint8_t* codes, const Meta* scale,
                                         const Meta* zero, Out* out, int64_t begin, int64_t end) {
  decompress_impl<Avx2>(d, codes, scale, zero, out, begin, end);
}

bool cpu_has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return has;
}
#endif

}  // namespace

int64_t nq_num_tasks(const NQDims& d) {
  return d.axis == GroupAxis::kTokens ? d.rows * d.meta_a() : d.rows * d.tokens;
}

template <typename In, typename Meta>
void nq_compress_tasks(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out,
                       int64_t task_begin, int64_t task_end, CompressStatus* status) {
  if (task_begin >= task_end) return;
#ifdef NEXUSKV_X86_DISPATCH
  if (cpu_has_avx2()) return compress_avx2(d, x, out, task_begin, task_end, status);
#endif
  compress_generic(d, x, out, task_begin, task_end, status);
}

template <typename Meta, typename Out>
void nq_decompress_tasks(const NQDims& d, const uint8_t* codes, const Meta* scale, const Meta* zero,
                         Out* out, int64_t task_begin, int64_t task_end) {
  if (task_begin >= task_end) return;
#ifdef NEXUSKV_X86_DISPATCH
  if (cpu_has_avx2()) return decompress_avx2(d, codes, scale, zero, out, task_begin, task_end);
#endif
  decompress_generic(d, codes, scale, zero, out, task_begin, task_end);
}

template <typename Val, typename Out>
bool nq_scatter_outliers(const NQDims& d, const uint8_t* outlier_idx, const Val* outlier_val, Out* out,
                         int64_t group_begin, int64_t group_end) {
  const int k = d.num_outliers;
  const int64_t A = d.meta_a(), B = d.meta_b(), D = d.head_dim, G = d.group_size;
  if (k == 0 || group_begin >= group_end) return true;
  bool ok = true;
  // Group g = (n * A + a) * B + b; the indices are stepped, not divided, per group.
  int64_t n = group_begin / (A * B), a = (group_begin / B) % A, b = group_begin % B;
  for (int64_t g = group_begin; g < group_end; ++g) {
    // Group origin and extent in (token, channel) and the step of a position.
    int64_t t0, c0, len, step;
    if (d.axis == GroupAxis::kTokens)
      t0 = d.group_start(n, a), c0 = b, len = d.group_end(n, a) - t0, step = D;
    else
      t0 = a, c0 = b * G, len = std::min(G, D - c0), step = 1;
    Out* origin = out + (n * d.tokens + t0) * D + c0;
    for (int s = 0; s < k; ++s) {
      const int64_t p = outlier_idx[g * k + s];
      if (p >= len) {
        ok = false;
        continue;
      }
      origin[p * step] = from_float<Out>(to_float(outlier_val[g * k + s]));
    }
    if (++b == B) {
      b = 0;
      if (++a == A) a = 0, ++n;
    }
  }
  return ok;
}

// Every (input, meta) and (meta, output) pairing of the three float types.
#define NEXUSKV_FOR_EACH_PAIR(M, A) \
  M(A, float, float) M(A, float, half_t) M(A, float, bf16_t)    \
  M(A, half_t, float) M(A, half_t, half_t) M(A, half_t, bf16_t) \
  M(A, bf16_t, float) M(A, bf16_t, half_t) M(A, bf16_t, bf16_t)

#define NEXUSKV_INSTANTIATE_COMPRESS(_, In, Meta)                                                  \
  template void nq_compress_tasks<In, Meta>(const NQDims&, const StridedRows<In>&,                \
                                            const NQBuffers<In, Meta>&, int64_t, int64_t, CompressStatus*);
#define NEXUSKV_INSTANTIATE_DECOMPRESS(_, Meta, Out)                                                  \
  template void nq_decompress_tasks<Meta, Out>(const NQDims&, const uint8_t*, const Meta*, const Meta*, \
                                               Out*, int64_t, int64_t);
#define NEXUSKV_INSTANTIATE_SCATTER(_, Val, Out) \
  template bool nq_scatter_outliers<Val, Out>(const NQDims&, const uint8_t*, const Val*, Out*, int64_t, int64_t);

NEXUSKV_FOR_EACH_PAIR(NEXUSKV_INSTANTIATE_COMPRESS, _)
NEXUSKV_FOR_EACH_PAIR(NEXUSKV_INSTANTIATE_DECOMPRESS, _)
NEXUSKV_FOR_EACH_PAIR(NEXUSKV_INSTANTIATE_SCATTER, _)

}  // namespace nexuskv::core
