// DGQ segment choice on the torch-free core: planted change points, length
// limits, the segment budget.
#include <algorithm>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "nexuskv/core/dgq.h"
#include "nexuskv/core/nq_format.h"

using namespace nexuskv::core;

namespace {

// Per-granule channel min/max of a [T, D] row, as DGQ compress computes them.
void granule_ranges(const std::vector<float>& x, int64_t T, int64_t D, int64_t g, std::vector<float>& mn,
                    std::vector<float>& mx) {
  const int64_t ng = ceil_div(T, g);
  mn.assign(static_cast<size_t>(ng * D), 1e30f);
  mx.assign(static_cast<size_t>(ng * D), -1e30f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < D; ++c) {
      const size_t i = size_t((t / g) * D + c);
      mn[i] = std::min(mn[i], x[size_t(t * D + c)]);
      mx[i] = std::max(mx[i], x[size_t(t * D + c)]);
    }
}

std::vector<int32_t> segments(const std::vector<float>& x, int64_t T, int64_t D, DGQParams p) {
  std::vector<float> mn, mx;
  granule_ranges(x, T, D, p.granule, mn, mx);
  std::vector<int32_t> starts(size_t(p.segments));
  REQUIRE(dgq_choose_segments(mn.data(), mx.data(), T, D, p, starts.data()));
  return starts;
}

}  // namespace

TEST_CASE("DGQ boundaries land on planted variance changes") {
  const int64_t T = 320, D = 32;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(size_t(T * D));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < D; ++c) x[size_t(t * D + c)] = nd(rng) * (t >= 96 && t < 224 ? 10.f : 1.f);
  DGQParams p;
  p.granule = 16, p.max_len = 128, p.segments = 5;  // fixed groups of 64 would need 5
  const auto starts = segments(x, T, D, p);
  REQUIRE(std::find(starts.begin(), starts.end(), 96) != starts.end());
  REQUIRE(std::find(starts.begin(), starts.end(), 224) != starts.end());
}

TEST_CASE("DGQ segments respect granule, max length and budget") {
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int64_t T : {1, 15, 16, 17, 100, 257, 1000, 4096})
    for (int64_t G : {16, 32, 64}) {
      const int64_t D = 16;
      std::vector<float> x(size_t(T * D));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < D; ++c) x[size_t(t * D + c)] = nd(rng) * (1.f + float((t / 50) % 4));
      DGQParams p;
      p.granule = 16, p.max_len = 2 * G, p.segments = ceil_div(T, G);
      INFO("T=" << T << " G=" << G);
      const auto s = segments(x, T, D, p);
      REQUIRE(s[0] == 0);
      for (size_t i = 0; i < s.size(); ++i) {
        const int64_t end = i + 1 < s.size() ? s[i + 1] : T;
        REQUIRE(end >= s[i]);
        REQUIRE(end - s[i] <= p.max_len);
        if (end > s[i] && end < T) REQUIRE((end - s[i]) % p.granule == 0);
        if (s[i] < T) REQUIRE(s[i] % p.granule == 0);
      }
    }
}

TEST_CASE("DGQ reports a budget it cannot meet") {
  const int64_t T = 256, D = 4;
  std::vector<float> x(size_t(T * D), 1.f), mn, mx;
  granule_ranges(x, T, D, 16, mn, mx);
  DGQParams p;
  p.granule = 16, p.max_len = 32, p.segments = 4;  // 4 segments of <= 32 tokens cannot hold 256
  std::vector<int32_t> starts(4);
  REQUIRE_FALSE(dgq_choose_segments(mn.data(), mx.data(), T, D, p, starts.data()));
}
