// How many splits of the key range one decode launch takes (flash-decoding:
// every split of a (batch, kv head, row tile) unit is a block of its own, and
// the merge kernel combines their partials).  Torch-free host code: the CUDA
// glue (csrc/cuda/attention_cuda.cpp) calls it with the GPU's block slots,
// tests/cpp/test_split_plan.cpp checks it on the CPU.
//
// Model.  A launch of n blocks on a GPU that holds S blocks at once (SMs x
// blocks per SM at the kernel's occupancy) runs in ceil(n / S) waves, and a
// wave lasts as long as one block: the tiles of its split plus a fixed cost
// (set-up, query folding, writing the partial; counted as kSplitOverheadTiles
// tiles).  With s splits of K visible keys:
//
//     time(s) ~ ceil(units * s / S) * (ceil(ceil(K / s) / tile) + overhead)   [tiles]
//
// and the plan is the s in [1, max_splits] of least time, the fewest splits
// among equals (every split adds a partial to merge).  The rule it replaces
// ("enough blocks for two waves", at least 1) kept a batch of 64 (512 units)
// at one split on an H200 at 3 blocks per SM: 2 waves of 396 slots, the second
// 29 % full; the plan takes 3 splits (4 waves, 97 % full, 0.67x the time in
// this model).  A model, not a measurement: the GPU proof (gpu_check.sh) is
// where it is confirmed or refuted.
#pragma once

#include <algorithm>
#include <cstdint>

#include "nq_format.h"

namespace nexuskv::core {

// A block's fixed cost in tiles of keys (an estimate; see above).
constexpr int64_t kSplitOverheadTiles = 1;
// No split shorter than this many keys (below it the merge and the fixed cost
// outweigh what the extra blocks bring).
constexpr int64_t kMinSplitKeys = 256;
// At most this many splits: the merge keeps a weight per split and row in
// shared memory next to a row of D floats per row (16 x (1024 + D) x 4 B =
// 72 KB at D 128, 80 KB at D 256: within every GPU of sm_80 on).
constexpr int64_t kMaxSplits = 1024;

struct SplitPlan {
  int64_t splits = 1;
  int64_t waves = 1;            // ceil(units * splits / slots)
  int64_t tiles_per_split = 0;  // tiles of the longest split
  int64_t cost = 0;             // waves * (tiles_per_split + kSplitOverheadTiles)
};

// units: blocks of one split (batch x kv heads x row tiles), >= 1; slots:
// blocks the GPU holds at once, >= 1 (a smaller value is taken as 1); keys:
// the most keys a row can see (capacity, or the window), >= 0; tile: keys per
// tile of the kernel that runs, >= 1.
// (Internal linkage, as every free function of these headers: csrc/README.md.)
static inline SplitPlan plan_splits(int64_t units, int64_t slots, int64_t keys, int64_t tile) {
  units = std::max<int64_t>(units, 1), slots = std::max<int64_t>(slots, 1), tile = std::max<int64_t>(tile, 1);
  keys = std::max<int64_t>(keys, 0);
  const int64_t max_splits = std::clamp<int64_t>(keys / kMinSplitKeys, 1, kMaxSplits);
  SplitPlan best;
  for (int64_t s = 1; s <= max_splits; ++s) {
    SplitPlan p;
    p.splits = s;
    p.waves = ceil_div(units * s, slots);
    p.tiles_per_split = ceil_div(ceil_div(keys, s), tile);
    p.cost = p.waves * (p.tiles_per_split + kSplitOverheadTiles);
    if (s == 1 || p.cost < best.cost) best = p;
  }
  return best;
}

}  // namespace nexuskv::core
