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
static_assert(kChunkChannels<2> == 64 && kChunkChannels<3> == 64 && kChunkChannels<4> == 32 &&
              kChunkChannels<8> == 16, "chunk widths of nq_format.h");

// Channels of a row of D codes rounded up to whole chunks (the padding codes are 0).
NEXUSKV_HD inline constexpr int64_t padded_channels(int bits, int64_t D) {
  return ceil_div(D, chunk_channels(bits)) * chunk_channels(bits);
}

// Code of plane j, lane l from the chunk's byte l (2/4/8 bits; the low 2 bits for 3).
template <int kBits>
NEXUSKV_HD_INLINE uint32_t plane_code(uint32_t byte, int j) {
  return (byte >> (kLowBits<kBits> * j)) & ((1u << kLowBits<kBits>) - 1u);
}

// 3 bits: where bit 2 of chunk channel i (0..63) lives.
NEXUSKV_HD_INLINE constexpr int high_bit_byte(int i) { return 16 + i % 8; }
NEXUSKV_HD_INLINE constexpr int high_bit_shift(int i) { return i / 8; }

// Code of channel i (0 <= i < kChunkChannels) of one chunk.
template <int kBits>
NEXUSKV_HD_INLINE uint32_t chunk_code(const uint8_t* chunk, int i) {
  uint32_t code = plane_code<kBits>(chunk[i % 16], i / 16);
  if constexpr (kBits == 3) code |= ((uint32_t(chunk[high_bit_byte(i)]) >> high_bit_shift(i)) & 1u) << 2;
  return code;
}

// Packs kChunkChannels codes (each < 2^kBits) into one chunk of kChunkBytes.
// Written as lane loops over constant planes, so that a CPU compiler
// vectorizes them.
template <int kBits>
NEXUSKV_HD_INLINE void pack_chunk(const uint8_t* codes, uint8_t* out) {
  constexpr int kLow = kLowBits<kBits>;
  uint8_t acc[16] = {};
NEXUSKV_UNROLL
  for (int j = 0; j < kPlanes<kBits>; ++j)
    for (int l = 0; l < 16; ++l)
      acc[l] = uint8_t(acc[l] | ((uint32_t(codes[16 * j + l]) & ((1u << kLow) - 1u)) << (kLow * j)));
  for (int l = 0; l < 16; ++l) out[l] = acc[l];
  if constexpr (kBits == 3) {
    uint8_t high[8] = {};
NEXUSKV_UNROLL
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 8; ++l) high[l] = uint8_t(high[l] | (((uint32_t(codes[8 * j + l]) >> 2) & 1u) << j));
    for (int l = 0; l < 8; ++l) out[16 + l] = high[l];
  }
}

// Inverse of pack_chunk: writes kChunkChannels codes.
template <int kBits>
NEXUSKV_HD_INLINE void unpack_chunk(const uint8_t* in, uint8_t* codes) {
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
NEXUSKV_HD_INLINE void pack_row(const uint8_t* codes, int64_t D, uint8_t* row) {
  for (int64_t c0 = 0; c0 < D; c0 += kChunkChannels<kBits>, row += kChunkBytes<kBits>)
    pack_chunk<kBits>(codes + c0, row);
}
template <int kBits>
NEXUSKV_HD_INLINE void unpack_row(const uint8_t* row, int64_t D, uint8_t* codes) {
  for (int64_t c0 = 0; c0 < D; c0 += kChunkChannels<kBits>, row += kChunkBytes<kBits>)
    unpack_chunk<kBits>(row, codes + c0);
}

// Code of channel ch of a packed row, bits known at compile time / at run time.
template <int kBits>
NEXUSKV_HD_INLINE uint32_t code_at(const uint8_t* row, int64_t ch) {
  return chunk_code<kBits>(row + (ch / kChunkChannels<kBits>) * kChunkBytes<kBits>,
                           int(ch % kChunkChannels<kBits>));
}
NEXUSKV_HD_INLINE uint32_t code_at(const uint8_t* row, int bits, int64_t ch) {
  switch (bits) {
    case 2: return code_at<2>(row, ch);
    case 3: return code_at<3>(row, ch);
    case 4: return code_at<4>(row, ch);
    default: return code_at<8>(row, ch);
  }
}

// Calls f(std::integral_constant-like tag) with the bit width as a compile-time
// constant: dispatch<F>(bits, f) -> f.template operator()<kBits>().
template <typename F>
NEXUSKV_HD_INLINE decltype(auto) with_bits(int bits, F&& f) {
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
NEXUSKV_HD_INLINE int64_t meta_index(const NQDims& d, int64_t n, int64_t a, int64_t b) {
  return (n * d.meta_a() + a) * d.meta_b() + b;
}

// Group of element (token t, channel c) of a row with fixed groups:
// (a, b) = (t / G, c) per channel, (t, c / G) per token.  DGQ segments are
// looked up with NQDims::group_start / group_end instead.
NEXUSKV_HD_INLINE int64_t group_a(const NQDims& d, int64_t t) {
  return d.axis == GroupAxis::kTokens ? t / d.group_size : t;
}
NEXUSKV_HD_INLINE int64_t group_b(const NQDims& d, int64_t c) {
  return d.axis == GroupAxis::kTokens ? c : c / d.group_size;
}

}  // namespace nexuskv::core::layout
