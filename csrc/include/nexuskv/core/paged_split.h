// How the tensor-core paged attention (csrc/cuda/paged_mma.cuh) splits its
// work, host and device: torch-free, so that tests/cpp/test_paged_split.cpp
// checks on the CPU what the GPU kernel does with it (every query row in one
// row tile, every visible key in one split).
//
// Row tiles.  A block serves up to kPagedTileRows query rows of one request
// and one kv head: `tokens` consecutive query tokens x `heads` q heads of the
// GQA group (row = token * heads + head), so that one read of a page serves
// them all.  A GQA group wider than kPagedTileRows is cut into head chunks.
//
// Splits.  The keys the rows of a tile can see, [first, last query position],
// are read in tiles of 64 that start at multiples of 16 from `first` rounded
// down to 16 (a 16-key chunk then lies in one page: the page size is a
// multiple of 16).  The `splits` blocks of a row tile share that range in
// whole tiles: their number comes from the host's plan over the block table's
// width, their share from the rows' real positions, so a context shorter than
// the width still spreads over min(splits, its tiles) splits (the rest are
// empty and return at once).
#pragma once

#include <cstdint>

#include "nexuskv/core/hd.h"

namespace nexuskv::core {

constexpr int kPagedTileRows = 16;       // query rows per block at most (the kernel's two 8-wide n-tiles)
constexpr int kPagedDecodeTileRows = 8;  // ... in a decode step (one n-tile: half the accumulators)
constexpr int kPagedKeyTile = 64;        // keys per tile (4 warps x 16)

struct PagedRowTiles {
  int heads = 1;        // q heads per row tile
  int tokens = 1;       // query tokens per row tile
  int head_chunks = 1;  // row tiles side by side per token range (GQA groups wider than the tile)
};

// Rows per tile for a step of num_tokens query tokens over num_reqs requests:
// a decode step (one token a request, as the host sees it) whose GQA group
// fits 8 rows takes tiles of 8, whose kernel holds one n-tile of accumulators
// (fewer registers, more blocks per SM); every other step 16, which read each
// page once for up to 16 rows (its requests of one token, where the group fits
// 8 rows, run the 8-row kernel apart: cuda::paged_mma_plan).  Any input is
// right with either: a request's tokens go in as many tiles as they need.
NEXUSKV_HD_INLINE int paged_tile_rows(int64_t num_tokens, int64_t num_reqs, int gqa_group) {
  return num_tokens == num_reqs && gqa_group <= kPagedDecodeTileRows ? kPagedDecodeTileRows : kPagedTileRows;
}

// The row tiles of tile_rows (8 or 16) rows for a GQA group.
NEXUSKV_HD_INLINE PagedRowTiles paged_row_tiles(int gqa_group, int tile_rows = kPagedTileRows) {
  PagedRowTiles t;
  t.heads = gqa_group < tile_rows ? gqa_group : tile_rows;
  t.tokens = tile_rows / t.heads;
  t.head_chunks = (gqa_group + t.heads - 1) / t.heads;
  return t;
}

// Row tiles of a request with q_len query tokens (0 for none).
NEXUSKV_HD_INLINE int64_t paged_request_tiles(int64_t q_len, int tokens_per_tile) {
  return q_len > 0 ? (q_len + tokens_per_tile - 1) / tokens_per_tile : 0;
}

// The keys split `split` of `splits` reads, [lo, hi), for a row tile whose
// query tokens sit at positions [q_first, q_last] (0 <= q_first <= q_last)
// with a sliding window of `window` keys (0: none; at most 2^31 - 1).  `first`
// is the earliest key a row of the tile sees.  Every split's lo is a multiple
// of 16; the splits' ranges are disjoint, in order, and cover [first rounded
// down to 16, q_last + 1).
struct PagedSplitRange {
  int32_t first = 0, lo = 0, hi = 0;
};

NEXUSKV_HD_INLINE PagedSplitRange paged_split_range(int32_t q_first, int32_t q_last, int64_t window, int splits,
                                                    int split) {
  PagedSplitRange r;
  r.first = window > 0 && q_first - window + 1 > 0 ? int32_t(q_first - window + 1) : 0;
  const int32_t start = r.first & ~15;
  const int64_t per = (int64_t(q_last) + 1 - start + splits - 1) / splits;
  const int64_t span = (per + kPagedKeyTile - 1) / kPagedKeyTile * kPagedKeyTile;
  const int64_t lo = start + int64_t(split) * span, hi = lo + span < q_last + 1 ? lo + span : q_last + 1;
  r.hi = int32_t(hi);
  r.lo = lo < hi ? int32_t(lo) : r.hi;
  return r;
}

}  // namespace nexuskv::core
