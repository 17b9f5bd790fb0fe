// 16-bit float storage types for the torch-free core, bit-compatible with
// c10::Half and c10::BFloat16 (so ATen glue can reinterpret pointers), their
// conversions to and from float, and the directed rounding that the quantizer
// needs for its metadata: the one definition for every kernel, CPU and CUDA.
//
// The conversions are `static inline` (internal linkage, NEXUSKV_HD_STATIC)
// on purpose, as every function of the core headers: hd.h says why.
// They are NEXUSKV_HD: the CUDA kernels use these same conversions (the
// directed rounding of scales and zeros must be bit-identical on both).
#pragma once

#include <cstdint>
#include <cstring>

#include "nexuskv/core/hd.h"

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

// The conversions are written with selects instead of branches (every case
// is computed, one is kept), so that a CPU compiler vectorizes the loops that
// call them, and a GPU runs them without divergence.  They need IEEE
// subnormals (no flush-to-zero, no fast-math on either side).

// IEEE binary16 -> float, exact; written without denormal float arithmetic
// (denormal operands are slow on x86): a subnormal half is renormalized
// through one exact float subtraction of normal numbers.
NEXUSKV_HD_STATIC float half_to_float(uint16_t h) {
  const uint32_t o = (uint32_t(h) & 0x7fffu) << 13, exp = o & 0x0f800000u;
  const uint32_t normal = o + ((127u - 15u) << 23);
  const uint32_t inf_nan = o + ((127u - 15u + 128u - 16u) << 23);
  const uint32_t sub = float_bits(bits_float(normal + (1u << 23)) - bits_float(113u << 23));
  const uint32_t r = exp == 0x0f800000u ? inf_nan : exp == 0 ? sub : normal;
  return bits_float(r | ((uint32_t(h) & 0x8000u) << 16));
}

// float -> IEEE binary16, round to nearest even; overflow gives Inf, NaN a quiet NaN.
NEXUSKV_HD_STATIC uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f), sign = (x >> 16) & 0x8000u;
  const int32_t a = int32_t(x & 0x7fffffffu);
  const uint32_t nan_inf = a > 0x7f800000 ? 0x7e00u : 0x7c00u;
  // A subnormal result: let the FPU round at 2^-24 (adding 0.5 puts the half's
  // subnormal bits at the bottom of the float's significand).
  const uint32_t sub = float_bits(bits_float(uint32_t(a)) + 0.5f) - 0x3f000000u;
  // A normal one: rebias the exponent by -112 and round to nearest even.
  const uint32_t normal = (uint32_t(a) + 0xc8000fffu + ((uint32_t(a) >> 13) & 1u)) >> 13;
  const uint32_t r = a >= 0x7f800000 ? nan_inf : a >= 0x477ff000 ? 0x7c00u : a < 0x38800000 ? sub : normal;
  return uint16_t(sign | r);
}

NEXUSKV_HD_STATIC float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

// float -> bfloat16, round to nearest even; NaN stays NaN (quieted).
NEXUSKV_HD_STATIC uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return uint16_t((x & 0x7fffffffu) > 0x7f800000u ? (x >> 16) | 0x0040u : rounded);
}

// Next representable 16-bit float towards +Inf / -Inf (sign-magnitude
// encoding, shared by fp16 and bf16).
NEXUSKV_HD_STATIC uint16_t bits16_next_up(uint16_t h) {
  return h == 0x8000u ? uint16_t(0x0001u) : (h & 0x8000u) ? uint16_t(h - 1u) : uint16_t(h + 1u);
}
NEXUSKV_HD_STATIC uint16_t bits16_next_down(uint16_t h) {
  return h == 0x0000u ? uint16_t(0x8001u) : (h & 0x8000u) ? uint16_t(h + 1u) : uint16_t(h - 1u);
}

// Directed rounding from the nearest 16-bit value: given the nearest
// conversion r of v (its bits, and its value as float), the neighbour of v
// below (round_down_bits) or above (round_up_bits) it.  A nearest conversion
// is one of v's two neighbours, so at most one step fixes the side.  Row
// kernels call these after a vectorized nearest conversion of a whole row.
NEXUSKV_HD_STATIC uint16_t round_down_bits(uint16_t r, float r_value, float v) {
  return r_value > v ? bits16_next_down(r) : r;
}
NEXUSKV_HD_STATIC uint16_t round_up_bits(uint16_t r, float r_value, float v) {
  return r_value < v ? bits16_next_up(r) : r;
}

// Uniform access: to_float / from_float (nearest) for every storage type.
NEXUSKV_HD_STATIC float to_float(float v) { return v; }
NEXUSKV_HD_STATIC float to_float(half_t v) { return half_to_float(v.bits); }
NEXUSKV_HD_STATIC float to_float(bf16_t v) { return bf16_to_float(v.bits); }

template <typename T>
NEXUSKV_HD_STATIC T from_float(float v);
template <>
NEXUSKV_HD inline float from_float<float>(float v) {
  return v;
}
template <>
NEXUSKV_HD inline half_t from_float<half_t>(float v) {
  return half_t{float_to_half(v)};
}
template <>
NEXUSKV_HD inline bf16_t from_float<bf16_t>(float v) {
  return bf16_t{float_to_bf16(v)};
}

// Directed rounding into a storage type: the result r satisfies
// to_float(r) <= v (round_down) or >= v (round_up) for finite v.
template <typename T>
NEXUSKV_HD_STATIC T round_down(float v) {
  if constexpr (sizeof(T) == 4) {
    return v;
  } else {
    const T r = from_float<T>(v);
    return T{round_down_bits(r.bits, to_float(r), v)};
  }
}
template <typename T>
NEXUSKV_HD_STATIC T round_up(float v) {
  if constexpr (sizeof(T) == 4) {
    return v;
  } else {
    const T r = from_float<T>(v);
    return T{round_up_bits(r.bits, to_float(r), v)};
  }
}

}  // namespace nexuskv::core
