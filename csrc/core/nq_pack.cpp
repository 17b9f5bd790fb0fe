// Bit packing of one row of codes; layout documented in nq_format.h.
// Loops run over fixed 16-byte lanes so that the compiler vectorizes them.
#include <cstring>

#include "nexuskv/core/nq_kernels.h"

namespace nexuskv::core {
namespace {

// One chunk of 2/4/8-bit codes: channel i -> byte i%16, bit offset bits*(i/16).
template <int kBits>
inline void pack_chunk(const uint8_t* codes, uint8_t* out) {
  constexpr int kPlanes = 8 / kBits;
  uint8_t acc[16] = {0};
  for (int j = 0; j < kPlanes; ++j)
    for (int l = 0; l < 16; ++l) acc[l] |= uint8_t(codes[16 * j + l] << (kBits * j));
  std::memcpy(out, acc, 16);
}

template <int kBits>
inline void unpack_chunk(const uint8_t* in, uint8_t* codes) {
  constexpr int kPlanes = 8 / kBits;
  constexpr uint8_t kMask = uint8_t((1u << kBits) - 1u);
  for (int j = 0; j < kPlanes; ++j)
    for (int l = 0; l < 16; ++l) codes[16 * j + l] = uint8_t((in[l] >> (kBits * j)) & kMask);
}

// 3-bit chunk of 64 channels: low 2 bits as a 2-bit chunk, then bit 2 of
// channel i at byte 16 + i%8, bit i/8.
inline void pack_chunk3(const uint8_t* codes, uint8_t* out) {
  uint8_t low[64];
  for (int i = 0; i < 64; ++i) low[i] = codes[i] & 3u;
  pack_chunk<2>(low, out);
  uint8_t high[8] = {0};
  for (int j = 0; j < 8; ++j)
    for (int l = 0; l < 8; ++l) high[l] |= uint8_t(((codes[8 * j + l] >> 2) & 1u) << j);
  std::memcpy(out + 16, high, 8);
}

inline void unpack_chunk3(const uint8_t* in, uint8_t* codes) {
  unpack_chunk<2>(in, codes);
  for (int j = 0; j < 8; ++j)
    for (int l = 0; l < 8; ++l) codes[8 * j + l] |= uint8_t(((in[16 + l] >> j) & 1u) << 2);
}

inline void pack_one(int bits, const uint8_t* codes, uint8_t* out) {
  switch (bits) {
    case 2: pack_chunk<2>(codes, out); break;
    case 3: pack_chunk3(codes, out); break;
    case 4: pack_chunk<4>(codes, out); break;
    default: pack_chunk<8>(codes, out); break;
  }
}

inline void unpack_one(int bits, const uint8_t* in, uint8_t* codes) {
  switch (bits) {
    case 2: unpack_chunk<2>(in, codes); break;
    case 3: unpack_chunk3(in, codes); break;
    case 4: unpack_chunk<4>(in, codes); break;
    default: unpack_chunk<8>(in, codes); break;
  }
}

}  // namespace

void pack_row(const uint8_t* codes, int64_t head_dim, int bits, uint8_t* packed) {
  const int c = chunk_channels(bits);
  const int cb = chunk_bytes(bits);
  int64_t d0 = 0;
  for (; d0 + c <= head_dim; d0 += c, packed += cb) pack_one(bits, codes + d0, packed);
  if (d0 < head_dim) {  // partial last chunk: zero-padded copy
    uint8_t tail[64] = {0};
    std::memcpy(tail, codes + d0, size_t(head_dim - d0));
    pack_one(bits, tail, packed);
  }
}

void unpack_row(const uint8_t* packed, int64_t head_dim, int bits, uint8_t* codes) {
  const int c = chunk_channels(bits);
  const int cb = chunk_bytes(bits);
  int64_t d0 = 0;
  for (; d0 + c <= head_dim; d0 += c, packed += cb) unpack_one(bits, packed, codes + d0);
  if (d0 < head_dim) {
    uint8_t tail[64];
    unpack_one(bits, packed, tail);
    std::memcpy(codes + d0, tail, size_t(head_dim - d0));
  }
}

}  // namespace nexuskv::core
