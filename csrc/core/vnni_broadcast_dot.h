// vpdpbusd with an embedded broadcast, for the integer p . V of the attention
// kernel (attention_int_values.h): acc += the dword-lane sums of four u8 x s8
// products, the four s8 read from memory and broadcast to every lane.  Empty
// unless the compiler targets AVX512-VNNI.
//
// Why inline assembly: written with intrinsics (_mm512_set1_epi32 of a
// load), GCC 12 emits a separate vpbroadcastd per dot product and copies the
// accumulators to other registers and back around the destructive vpdpbusd:
// about three instructions per dot product where one does (the p . V loop went
// from 60 to 39 instructions per 16 dot products; bench_cpu_decode.py counts
// the loops).  A full 64-byte memory operand needs no help: q . K uses the
// intrinsic (attention_int_keys.h).
#pragma once

#if defined(__AVX512VNNI__)

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "isa.h"

namespace nexuskv::core::NEXUSKV_ISA {

// acc += dot(u8 lanes of codes, the 4 s8 at w broadcast to every dword lane).
NEXUSKV_INLINE void dpbusd_bcast(__m512i& acc, __m512i codes, const int8_t* w) {
#if defined(__GNUC__)
  __asm__("vpdpbusd %[w]%{1to16%}, %[codes], %[acc]"
          : [acc] "+v"(acc)
          : [codes] "v"(codes), [w] "m"(*reinterpret_cast<const int32_t(*)[1]>(w)));
#else
  int32_t quad;
  std::memcpy(&quad, w, sizeof(quad));
  acc = _mm512_dpbusd_epi32(acc, codes, _mm512_set1_epi32(quad));
#endif
}

}  // namespace nexuskv::core::NEXUSKV_ISA

#endif  // __AVX512VNNI__
