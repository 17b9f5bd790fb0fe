// The work split of the tensor-core paged attention (nexuskv/core/paged_split.h)
// on the CPU: row tiles cover every query row of every request once, through
// the same tile numbering and lookup the kernels do (paged_mma.cuh: the
// pre-pass's prefix of tiles per request, find_segment over it); the splits of
// a row tile cover every key its rows see once, in 16-aligned pieces.
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "nexuskv/core/nq_index.h"
#include "nexuskv/core/paged_split.h"

using namespace nexuskv::core;

TEST_CASE("paged split: row tiles hold the GQA group's heads and as many tokens as fit in 8 or 16 rows") {
  for (const int rows : {kPagedDecodeTileRows, kPagedTileRows}) {
    for (int gq = 1; gq <= 64; ++gq) {
      const PagedRowTiles t = paged_row_tiles(gq, rows);
      CHECK(t.heads * t.tokens <= rows);
      CHECK(t.tokens >= 1);
      CHECK(t.heads * t.head_chunks >= gq);
      CHECK((t.head_chunks - 1) * t.heads < gq);
      if (gq <= rows) CHECK((t.head_chunks == 1 && t.heads == gq && t.tokens == rows / gq));
      // the kernel of 16-row tiles is picked by the rows a tile holds: more than 8 there
      if (rows == kPagedTileRows) CHECK(t.heads * t.tokens > kPagedDecodeTileRows);
    }
  }
  CHECK(paged_row_tiles(4).tokens == 4);  // 16 rows unless asked
  CHECK(paged_request_tiles(0, 4) == 0);
  CHECK(paged_request_tiles(1, 4) == 1);
  CHECK(paged_request_tiles(9, 4) == 3);
}

TEST_CASE("paged split: decode steps with GQA groups of at most 8 take 8-row tiles, every other step 16") {
  CHECK(paged_tile_rows(64, 64, 4) == kPagedDecodeTileRows);
  CHECK(paged_tile_rows(1, 1, 8) == kPagedDecodeTileRows);
  CHECK(paged_tile_rows(64, 64, 9) == kPagedTileRows);  // a group of 9 would need two chunks of pages
  CHECK(paged_tile_rows(65, 64, 4) == kPagedTileRows);  // a request with several tokens
  CHECK(paged_tile_rows(512, 1, 1) == kPagedTileRows);  // a prefill
}

TEST_CASE("paged split: every query token of a ragged batch is in exactly one row tile") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int R = 1 + int(rng() % 12), tpb = 1 + int(rng() % 16);
    std::vector<int32_t> qsl(R + 1, 0);
    for (int r = 0; r < R; ++r) qsl[r + 1] = qsl[r] + int32_t(rng() % 4 == 0 ? 0 : rng() % 40);  // some empty
    // The pre-pass: tile_start[r] = tiles of the requests before r, then the total.
    std::vector<int32_t> tile_start(R + 1, 0);
    for (int r = 0; r < R; ++r)
      tile_start[r + 1] = tile_start[r] + int32_t(paged_request_tiles(qsl[r + 1] - qsl[r], tpb));
    std::vector<int> seen(qsl[R], 0);
    for (int64_t x = 0; x < tile_start[R]; ++x) {  // the split kernel's blocks along grid.x
      const int64_t req = find_segment(tile_start.data(), int64_t(R), x);
      const int64_t qlen = qsl[req + 1] - qsl[req], i0 = (x - tile_start[req]) * tpb;
      const int64_t ntok = std::min<int64_t>(qlen - i0, tpb);
      REQUIRE(ntok >= 1);
      for (int64_t i = 0; i < ntok; ++i) ++seen[qsl[req] + i0 + i];
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  }
}

TEST_CASE("paged split: the splits cover every key the tile's rows see, once, from a multiple of 16") {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 3000; ++trial) {
    const int32_t q_first = int32_t(rng() % 3000), q_last = q_first + int32_t(rng() % 16);
    const int64_t window = rng() % 3 == 0 ? 0 : (rng() % 2 ? 1 + rng() % 300 : (int64_t(1) << 31) - 1);
    const int splits = 1 + int(rng() % 24);
    std::vector<int> covered(q_last + 1, 0);
    int32_t prev_hi = -1, first = -1;
    for (int s = 0; s < splits; ++s) {
      const PagedSplitRange r = paged_split_range(q_first, q_last, window, splits, s);
      REQUIRE(r.lo <= r.hi);
      REQUIRE(r.hi <= q_last + 1);
      first = r.first;
      if (r.lo == r.hi) continue;
      CHECK(r.lo % 16 == 0);
      if (prev_hi >= 0) CHECK(r.lo == prev_hi);
      for (int32_t k = r.lo; k < r.hi; ++k) ++covered[k];
      prev_hi = r.hi;
    }
    const int32_t want_first = window > 0 ? std::max<int64_t>(0, q_first - window + 1) : 0;
    CHECK(first == want_first);
    for (int32_t k = 0; k <= q_last; ++k) {
      const bool in_range = k >= (want_first & ~15);
      CHECK(covered[k] == (in_range ? 1 : 0));
    }
  }
}
