// The packed-code layout of nq_format.h as code: where the code of a channel
// sits in a packed row, how a chunk is packed and unpacked, and where the
// scale/zero of a group sit.  The one implementation of the layout, for the
// CPU kernels and the CUDA kernels alike (NEXUSKV_HD); the format itself is
// documented in nq_format.h.
//
// Chunks (nq_format.h):
//   2, 4, 8 bits: 16 bytes, C = 16 * (8 / bits) channels; channel i of the
//     chunk is in byte i % 16 at bit offset bits * (i / 16).  "Plane" j of a
//     chunk is channels [16 j, 16 j + 16): one 16-byte load, shift right by
//     bits * j, mask -> the plane's codes in byte lanes 0..15.
//   3 bits: 24 bytes, 64 channels: bytes 0..15 hold the low 2 bits as a
//     2-bit chunk; bit 2 of channel i is at byte 16 + i % 8, bit i / 8.
#pragma once

#include <cstdint>

#include "nexuskv/core/hd.h"
#include "nexuskv/core/nq_format.h"

namespace nexuskv::core::layout {

// Bits of the planes that the 16 low bytes of a chunk hold (3-bit codes keep
// their low 2 bits there), the planes per chunk, channels and bytes per chunk.
template <int kBits>
inline constexpr int kLowBits = kBits == 3 ? 2 : kBits;
template <int kBits>
inline constexpr int kPlanes = 8 / kLowBits<kBits>;
template <int kBits>
inline constexpr int kChunkChannels = 16 * kPlanes<kBits>;
template <int kBits>
inline constexpr int kChunkBytes = kBits == 3 ? 24 : 16;
static_assert(kChunkChannels<2> == 64 && kChunkChannels<3> == 64 && kChunkChannels<4> == 32 && kChunkChannels<8> == 16,
              "chunk widths of nq_format.h");

// Channels of a row of D codes rounded up to whole chunks (the padding codes are 0).
NEXUSKV_HD_STATIC constexpr int64_t padded_channels(int bits, int64_t D) {
  return ceil_div(D, chunk_channels(bits)) * chunk_channels(bits);
}

// Plane j of a chunk's 16 low bytes: byte lane l holds the code of channel
// 16 j + l (its low 2 bits for 3-bit codes) at bit plane_shift(j), width
// kLowBits.  A SIMD reader takes a plane from one 16-byte load with one shift
// and one mask (kPlaneMask in every byte lane).
template <int kBits>
static NEXUSKV_HD_INLINE constexpr int plane_shift(int j) {
  return kLowBits<kBits> * j;
}
template <int kBits>
inline constexpr uint32_t kPlaneMask = uint32_t(1 << kLowBits<kBits>) - 1u;

// Code of plane j, lane l from the chunk's byte l (2/4/8 bits; the low 2 bits for 3).
template <int kBits>
static NEXUSKV_HD_INLINE uint32_t plane_code(uint32_t byte, int j) {
  return (byte >> plane_shift<kBits>(j)) & kPlaneMask<kBits>;
}

// 3 bits: where bit 2 of chunk channel i (0..63) lives.
static NEXUSKV_HD_INLINE constexpr int high_bit_byte(int i) { return 16 + i % 8; }
static NEXUSKV_HD_INLINE constexpr int high_bit_shift(int i) { return i / 8; }

// Code of lane l of plane j of one chunk, i.e. of chunk channel 16 j + l.
// For 3 bits, bit 2 is at high_bit_byte(16 j + l) = 16 + l % 8, bit
// high_bit_shift(16 j + l) = 2 j + l / 8, written so that with j constant
// (an unrolled plane loop) a CPU compiler vectorizes over l.
template <int kBits>
static NEXUSKV_HD_INLINE uint32_t plane_lane_code(const uint8_t* chunk, int j, int l) {
  uint32_t code = plane_code<kBits>(chunk[l], j);
  if constexpr (kBits == 3) code |= ((uint32_t(chunk[16 + (l & 7)]) >> (2 * j + (l >> 3))) & 1u) << 2;
  return code;
}

// Code of channel i (0 <= i < kChunkChannels) of one chunk.
template <int kBits>
static NEXUSKV_HD_INLINE uint32_t chunk_code(const uint8_t* chunk, int i) {
  return plane_lane_code<kBits>(chunk, i / 16, i % 16);
}

// Packs kChunkChannels codes (each < 2^kBits) into one chunk of kChunkBytes.
// Written as 16-lane loops over constant planes, so that a CPU compiler
// vectorizes them (one 16-byte vector per plane).
template <int kBits>
static NEXUSKV_HD_INLINE void pack_chunk(const uint8_t* codes, uint8_t* out) {
  constexpr int kLow = kLowBits<kBits>;
  uint8_t acc[16] = {};
  // 3 bits: bit 2 of channel 16 j + l goes to byte 16 + l % 8, bit 2 j + l / 8
  // (high_bit_byte / high_bit_shift); gathered over 16 lanes at bit 2 j first.
  uint8_t high16[16] = {};
  NEXUSKV_UNROLL
  for (int j = 0; j < kPlanes<kBits>; ++j)
    for (int l = 0; l < 16; ++l) {
      const uint32_t c = codes[16 * j + l];
      acc[l] = uint8_t(acc[l] | ((c & kPlaneMask<kBits>) << (kLow * j)));
      if constexpr (kBits == 3) high16[l] = uint8_t(high16[l] | (((c >> 2) & 1u) << (2 * j)));
    }
  for (int l = 0; l < 16; ++l) out[l] = acc[l];
  if constexpr (kBits == 3)
    for (int l = 0; l < 8; ++l) out[16 + l] = uint8_t(high16[l] | (high16[l + 8] << 1));
}

// Inverse of pack_chunk: writes kChunkChannels codes.
template <int kBits>
static NEXUSKV_HD_INLINE void unpack_chunk(const uint8_t* in, uint8_t* codes) {
  NEXUSKV_UNROLL
  for (int j = 0; j < kPlanes<kBits>; ++j)
    for (int l = 0; l < 16; ++l) codes[16 * j + l] = uint8_t(plane_code<kBits>(in[l], j));
  if constexpr (kBits == 3) {
    NEXUSKV_UNROLL
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 8; ++l) codes[8 * j + l] = uint8_t(codes[8 * j + l] | (((in[16 + l] >> j) & 1u) << 2));
  }
}

// Row level, bits known at compile time: codes[0 .. padded_channels(kBits, D))
// <-> one packed row of row_bytes(kBits, D) bytes.
template <int kBits>
static NEXUSKV_HD_INLINE void pack_row(const uint8_t* codes, int64_t D, uint8_t* row) {
  for (int64_t c0 = 0; c0 < D; c0 += kChunkChannels<kBits>, row += kChunkBytes<kBits>)
    pack_chunk<kBits>(codes + c0, row);
}
template <int kBits>
static NEXUSKV_HD_INLINE void unpack_row(const uint8_t* row, int64_t D, uint8_t* codes) {
  for (int64_t c0 = 0; c0 < D; c0 += kChunkChannels<kBits>, row += kChunkBytes<kBits>)
    unpack_chunk<kBits>(row, codes + c0);
}

// Code of channel ch of a packed row, bits known at compile time / at run time.
template <int kBits>
static NEXUSKV_HD_INLINE uint32_t code_at(const uint8_t* row, int64_t ch) {
  return chunk_code<kBits>(row + kChunkBytes<kBits> * (ch / kChunkChannels<kBits>), int(ch % kChunkChannels<kBits>));
}
static NEXUSKV_HD_INLINE uint32_t code_at(const uint8_t* row, int bits, int64_t ch) {
  switch (bits) {
    case 2: return code_at<2>(row, ch);
    case 3: return code_at<3>(row, ch);
    case 4: return code_at<4>(row, ch);
    default: return code_at<8>(row, ch);
  }
}

// Calls f with the bit width as a compile-time constant:
// with_bits(bits, f) -> f.template operator()<kBits>().  In CUDA device code
// pass a `[&] __host__ __device__ <int kBits>() {...}` lambda (nvcc
// --extended-lambda) or build with --expt-relaxed-constexpr.
template <typename F>
static NEXUSKV_HD_INLINE decltype(auto) with_bits(int bits, F&& f) {
  switch (bits) {
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    case 4: return f.template operator()<4>();
    default: return f.template operator()<8>();
  }
}

// Index of the scale/zero (and the first outlier slot / k) of group (a, b) of
// row n in the [N, A, B] metadata (nq_format.h: A token groups x B channels
// for per-channel groups, A tokens x B channel groups for per-token groups).
static NEXUSKV_HD_INLINE int64_t meta_index(const NQDims& d, int64_t n, int64_t a, int64_t b) {
  return (n * d.meta_a() + a) * d.meta_b() + b;
}

// Group of element (token t, channel c) of a row with fixed groups:
// (a, b) = (t / G, c) per channel, (t, c / G) per token.  DGQ segments are
// looked up with NQDims::group_start / group_end instead.
static NEXUSKV_HD_INLINE int64_t group_a(const NQDims& d, int64_t t) {
  return d.axis == GroupAxis::kTokens ? t / d.group_size : t;
}
static NEXUSKV_HD_INLINE int64_t group_b(const NQDims& d, int64_t c) {
  return d.axis == GroupAxis::kTokens ? c : c / d.group_size;
}

}  // namespace nexuskv::core::layout
