// 16-bit float storage types for the torch-free core, bit-compatible with
// c10::Half and c10::BFloat16 (so ATen glue can reinterpret pointers), plus
// the directed rounding that the quantizer needs for its metadata.
//
// The scalar conversions are `static inline` (internal linkage) on purpose:
// attention_kernel.cpp is compiled once per instruction set (AVX2, AVX-512),
// and an ordinary inline function emitted there could be the copy the linker
// keeps for every caller, putting AVX instructions into the portable path.
// They are NEXUSKV_HD: the CUDA kernels use these same conversions (the
// directed rounding of scales and zeros must be bit-identical on both).
#pragma once

#include <cstdint>
#include <cstring>

#include "nexuskv/core/hd.h"

// Scalar helpers of the core shared by host and device, internal linkage.
#define NEXUSKV_HD_STATIC static inline NEXUSKV_HD

namespace nexuskv::core {

struct half_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};
static_assert(sizeof(half_t) == 2 && sizeof(bf16_t) == 2, "16-bit storage types");

NEXUSKV_HD_STATIC uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
NEXUSKV_HD_STATIC float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// IEEE binary16 -> float, exact; written without denormal float arithmetic
// (denormal operands are slow on x86).
NEXUSKV_HD_STATIC float half_to_float(uint16_t h) {
  const uint32_t shifted_exp = 0x7c00u << 13;
  uint32_t o = (uint32_t(h) & 0x7fffu) << 13;
  const uint32_t exp = o & shifted_exp;
  o += (127 - 15) << 23;
  if (exp == shifted_exp) {
    o += (128 - 16) << 23;  // Inf / NaN
  } else if (exp == 0) {    // zero / subnormal: renormalize through float
    o += 1 << 23;
    o = float_bits(bits_float(o) - bits_float(113u << 23));
  }
  return bits_float(o | ((uint32_t(h) & 0x8000u) << 16));
}

// float -> IEEE binary16, round to nearest even; overflow gives Inf.
NEXUSKV_HD_STATIC uint16_t float_to_half(float f) {
  uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return uint16_t(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (a < 0x38800000u) {  // result is subnormal: let the FPU round at 2^-24
    const uint32_t r = float_bits(bits_float(a) + 0.5f) - 0x3f000000u;
    return uint16_t(sign | r);
  }
  const uint32_t odd = (a >> 13) & 1u;
  a += 0xc8000fffu + odd;  // rebias exponent by -112 and round to nearest even
  return uint16_t(sign | (a >> 13));
}

NEXUSKV_HD_STATIC float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

// float -> bfloat16, round to nearest even; NaN stays NaN.
NEXUSKV_HD_STATIC uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x0040u);
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Next representable 16-bit float towards +Inf / -Inf (sign-magnitude
// encoding, shared by fp16 and bf16).
NEXUSKV_HD_STATIC uint16_t bits16_next_up(uint16_t h) {
  if (h == 0x8000u) return 0x0001u;
  return (h & 0x8000u) ? uint16_t(h - 1) : uint16_t(h + 1);
}
NEXUSKV_HD_STATIC uint16_t bits16_next_down(uint16_t h) {
  if (h == 0x0000u) return 0x8001u;
  return (h & 0x8000u) ? uint16_t(h + 1) : uint16_t(h - 1);
}

// Uniform access: to_float / from_float (nearest) for every storage type.
NEXUSKV_HD_STATIC float to_float(float v) { return v; }
NEXUSKV_HD_STATIC float to_float(half_t v) { return half_to_float(v.bits); }
NEXUSKV_HD_STATIC float to_float(bf16_t v) { return bf16_to_float(v.bits); }

template <typename T>
NEXUSKV_HD T from_float(float v);
template <>
NEXUSKV_HD inline float from_float<float>(float v) { return v; }
template <>
NEXUSKV_HD inline half_t from_float<half_t>(float v) { return half_t{float_to_half(v)}; }
template <>
NEXUSKV_HD inline bf16_t from_float<bf16_t>(float v) { return bf16_t{float_to_bf16(v)}; }

// Directed rounding into a storage type: the result r satisfies
// to_float(r) <= v (round_down) or >= v (round_up) for finite v.
template <typename T>
NEXUSKV_HD inline T round_down(float v) {
  if constexpr (sizeof(T) == 4) {
    return v;
  } else {
    T r = from_float<T>(v);
    if (to_float(r) > v) r.bits = bits16_next_down(r.bits);
    return r;
  }
}
template <typename T>
NEXUSKV_HD inline T round_up(float v) {
  if constexpr (sizeof(T) == 4) {
    return v;
  } else {
    T r = from_float<T>(v);
    if (to_float(r) < v) r.bits = bits16_next_up(r.bits);
    return r;
  }
}

}  // namespace nexuskv::core
