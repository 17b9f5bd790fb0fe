// Packing of one row of codes (pack_row / unpack_row of nq_kernels.h) over
// the chunk functions of nq_layout.h, the one implementation of the layout.
#include <cstring>

#include "nexuskv/core/nq_kernels.h"
#include "nexuskv/core/nq_layout.h"

namespace nexuskv::core {
namespace {

// codes[0..head_dim) -> one row; a partial last chunk goes through a
// zero-padded copy (the padding codes are 0, nq_format.h).
template <int kBits>
void pack_row_bits(const uint8_t* codes, int64_t head_dim, uint8_t* packed) {
  constexpr int C = layout::kChunkChannels<kBits>, CB = layout::kChunkBytes<kBits>;
  int64_t d0 = 0;
  for (; d0 + C <= head_dim; d0 += C, packed += CB) layout::pack_chunk<kBits>(codes + d0, packed);
  if (d0 < head_dim) {
    uint8_t tail[C] = {0};
    std::memcpy(tail, codes + d0, size_t(head_dim - d0));
    layout::pack_chunk<kBits>(tail, packed);
  }
}

template <int kBits>
void unpack_row_bits(const uint8_t* packed, int64_t head_dim, uint8_t* codes) {
  constexpr int C = layout::kChunkChannels<kBits>, CB = layout::kChunkBytes<kBits>;
  int64_t d0 = 0;
  for (; d0 + C <= head_dim; d0 += C, packed += CB) layout::unpack_chunk<kBits>(packed, codes + d0);
  if (d0 < head_dim) {
    uint8_t tail[C];
    layout::unpack_chunk<kBits>(packed, tail);
    std::memcpy(codes + d0, tail, size_t(head_dim - d0));
  }
}

}  // namespace

void pack_row(const uint8_t* codes, int64_t head_dim, int bits, uint8_t* packed) {
  layout::with_bits(bits, [&]<int kBits>() { pack_row_bits<kBits>(codes, head_dim, packed); });
}

void unpack_row(const uint8_t* packed, int64_t head_dim, int bits, uint8_t* codes) {
  layout::with_bits(bits, [&]<int kBits>() { unpack_row_bits<kBits>(packed, head_dim, codes); });
}

}  // namespace nexuskv::core
