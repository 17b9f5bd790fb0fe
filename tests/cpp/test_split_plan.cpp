// The split-KV planner of the CUDA decode launch (nexuskv/core/split_plan.h),
// on the CPU: the GPU glue passes it the GPU's block slots, the rest is here.
#include <algorithm>
#include <cstdint>

#include "catch_compat.h"
#include "nexuskv/core/split_plan.h"

using namespace nexuskv::core;

namespace {

// The time model of split_plan.h for s splits, written out again.
int64_t model_cost(int64_t units, int64_t slots, int64_t keys, int64_t tile, int64_t s) {
  const int64_t waves = (units * s + slots - 1) / slots;
  const int64_t per_split = (keys + s - 1) / s;
  return waves * ((per_split + tile - 1) / tile + kSplitOverheadTiles);
}

// The rule the planner replaced: enough blocks for two waves of one block per SM.
int64_t two_wave_rule(int64_t units, int64_t sms, int64_t keys) {
  return std::clamp<int64_t>((2 * sms + units - 1) / units, 1, std::max<int64_t>(1, keys / kMinSplitKeys));
}

// Splits of the device's block_setup (attention_common.cuh) at full length that hold keys.
int64_t non_empty_splits(int64_t keys, int64_t tile, int64_t s) {
  const int64_t span = ((keys + s - 1) / s + tile - 1) / tile * tile;
  int64_t n = 0;
  for (int64_t i = 0; i < s; ++i) n += std::min(keys, i * span) < std::min(keys, i * span + span);
  return n;
}

}  // namespace

TEST_CASE("split plan: an H200 (132 SMs, 3 blocks each) at batch 64 and batch 1, llama-like, 32K keys") {
  const int64_t slots = 132 * 3, keys = 32768, tile = 64;
  // Batch 64 x 8 kv heads x 1 row tile: one split is 2 waves, the second 29 % full.
  const SplitPlan b64 = plan_splits(512, slots, keys, tile);
  CHECK(b64.splits == 3);
  CHECK(b64.waves == 4);
  CHECK(512 * b64.splits * 100 / (b64.waves * slots) >= 95);  // the waves are >= 95 % full
  CHECK(b64.cost * 100 <= 70 * model_cost(512, slots, keys, tile, two_wave_rule(512, 132, keys)));
  // Batch 1: 8 units; one wave, nearly every slot busy, each split as short as that allows.
  const SplitPlan b1 = plan_splits(8, slots, keys, tile);
  CHECK(b1.splits == 47);
  CHECK(b1.waves == 1);
  CHECK(8 * b1.splits * 100 / slots >= 90);
  CHECK(b1.tiles_per_split == 11);
  CHECK(b1.cost < model_cost(8, slots, keys, tile, two_wave_rule(8, 132, keys)));
}

TEST_CASE("split plan: short or empty key ranges take one split; no split below kMinSplitKeys") {
  for (int64_t keys : {int64_t(0), int64_t(1), int64_t(64), kMinSplitKeys, 2 * kMinSplitKeys - 1})
    CHECK(plan_splits(1, 396, keys, 64).splits == 1);
  CHECK(plan_splits(1, 396, 2 * kMinSplitKeys, 64).splits == 2);
  // Degenerate arguments are clamped, never a division by zero or zero splits.
  CHECK(plan_splits(0, 0, 100000, 0).splits >= 1);
  CHECK(plan_splits(1, 1 << 30, int64_t(1) << 40, 64).splits == kMaxSplits);
}

TEST_CASE("split plan: the least time of the model over every split count, fewest among equals, no empty split") {
  int64_t cases = 0;
  for (int64_t units : {1, 3, 8, 24, 64, 131, 512, 2048, 40000})
    for (int64_t slots : {1, 108 * 2, 132 * 3, 132 * 4})
      for (int64_t keys : {0, 255, 300, 1000, 4096, 4097, 32768, 131072})
        for (int64_t tile : {16, 64, 128}) {
          const SplitPlan p = plan_splits(units, slots, keys, tile);
          const int64_t max_splits = std::clamp<int64_t>(keys / kMinSplitKeys, 1, kMaxSplits);
          REQUIRE(p.splits >= 1);
          REQUIRE(p.splits <= max_splits);
          REQUIRE(p.cost == model_cost(units, slots, keys, tile, p.splits));
          for (int64_t s = 1; s <= max_splits; ++s) {
            const int64_t c = model_cost(units, slots, keys, tile, s);
            REQUIRE(c >= p.cost);
            if (s < p.splits) REQUIRE(c > p.cost);
          }
          // Every block the plan launches reads keys when the sequence is at its capacity.
          if (keys > 0) REQUIRE(non_empty_splits(keys, tile, p.splits) == p.splits);
          ++cases;
        }
  CHECK(cases == 9 * 4 * 8 * 3);
}
