// Index arithmetic of the GPU's NQ element kernels (csrc/cuda/nq_decompress.cuh,
// nq_compress.cuh's pack kernel) without per-element 64-bit division: sizes are
// divided once on the host (FastDivmod), each block takes whole tokens, and a
// thread splits only a small block-local index.  Torch-free, host and device, so
// that tests/cpp/test_nq_index.cpp checks every index against the plain formulas of
// nq_format.h on the CPU.
#pragma once

#include <cstdint>
#include <type_traits>

#include "fast_divmod.h"
#include "hd.h"
#include "nq_format.h"

namespace nexuskv::core {

// Segment (token group) of token t in one row of DGQ segment starts [S]: the
// last s with starts[s] <= t (0 if none).  Works on any array: the answer is
// always in [0, S).  I: the index type, S's (32-bit in the CUDA attention
// tile loop, which must not divide in 64 bits).
template <typename I>
NEXUSKV_HD_INLINE I find_segment(const int32_t* starts, I S, std::type_identity_t<I> t) {
  I lo = 0, hi = S;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const I mid = lo + ((hi - lo) >> 1);  // (no overflow of a 32-bit I)
    if (starts[mid] <= t)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// An [outer, width] index space (a row's [T, D] elements, or [T, chunks] pack
// tasks) cut into blocks of per_block whole outer indices: a block of `threads`
// threads walks local indices [0, per_block * width), and (outer, inner) of a
// local index is one FastDivmod by width.  outer < 2^31 (tokens of a row).
struct BlockTiling {
  uint32_t outer = 0, width = 1, per_block = 1;
  FastDivmod by_width;

  NEXUSKV_HD BlockTiling() = default;
  NEXUSKV_HD BlockTiling(int64_t outer_, int64_t width_, int threads)
      : outer(uint32_t(outer_)), width(uint32_t(width_)),
        per_block(width_ >= threads ? 1u : uint32_t(threads / width_)), by_width(width_) {}

  NEXUSKV_HD_INLINE uint32_t blocks() const { return (outer + per_block - 1) / per_block; }
  NEXUSKV_HD_INLINE uint32_t local_size() const { return per_block * width; }
  // (o, w) of local index `local` (< local_size()) of block `block`; false past
  // the last outer index (and for every later local index of that block).
  NEXUSKV_HD_INLINE bool at(uint32_t block, uint32_t local, uint32_t& o, uint32_t& w) const {
    uint32_t q;
    by_width.divmod(local, q, w);
    o = block * per_block + q;
    return o < outer;
  }
};

// What an NQ element kernel needs besides NQDims, computed once on the host.
struct NQIndexing {
  int64_t A = 0, B = 0;   // NQDims::meta_a(), meta_b()
  int64_t row_bytes = 0;  // NQDims::packed_row_bytes()
  FastDivmod by_group;    // group_size
  BlockTiling tiles;      // [tokens, head_dim] (decompress) or [tokens, chunks] (pack)

  NQIndexing() = default;
  NQIndexing(const NQDims& d, int64_t width, int threads)
      : A(d.meta_a()), B(d.meta_b()), row_bytes(d.packed_row_bytes()), by_group(d.group_size),
        tiles(d.tokens, width, threads) {}
};

// Group of element (row n, token t, channel c): its meta index g (nq_format.h
// meta_index), the element's position in the group and the group's entries.
struct ElementGroup {
  int64_t g;
  int64_t pos, len;
};

NEXUSKV_HD_INLINE ElementGroup element_group(const NQDims& d, const NQIndexing& ix, int64_t n, uint32_t t, uint32_t c) {
  ElementGroup r;
  if (d.axis == GroupAxis::kTokens) {
    int64_t a, t0, end;
    if (d.segment_starts) {
      const int32_t* starts = d.segment_starts + n * ix.A;
      a = find_segment(starts, ix.A, t);
      t0 = starts[a], end = a + 1 < ix.A ? starts[a + 1] : d.tokens;
    } else {
      a = ix.by_group.div(t);
      t0 = a * d.group_size, end = t0 + d.group_size < d.tokens ? t0 + d.group_size : d.tokens;
    }
    r.g = (n * ix.A + a) * ix.B + c, r.pos = t - t0, r.len = end - t0;
  } else {
    uint32_t b, pos;
    ix.by_group.divmod(c, b, pos);
    const int64_t c0 = int64_t(b) * d.group_size;
    r.g = (n * ix.A + t) * ix.B + b, r.pos = pos;
    r.len = d.head_dim - c0 < d.group_size ? d.head_dim - c0 : d.group_size;
  }
  return r;
}

}  // namespace nexuskv::core
