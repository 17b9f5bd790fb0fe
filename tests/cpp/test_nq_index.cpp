// The GPU NQ kernels' index arithmetic (nq_index.h, fast_divmod.h), checked on
// the CPU against plain `/` and `%` and the formulas of nq_format.h: the kernels
// themselves only run on a GPU, their indices are these functions.
#include <cstdint>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "catch_compat.h"
#include "nexuskv/core/fast_divmod.h"
#include "nexuskv/core/nq_index.h"
#include "nexuskv/core/nq_layout.h"

using namespace nexuskv::core;

TEST_CASE("FastDivmod equals / and % for every divisor and dividend class below 2^31") {
  std::mt19937_64 rng(7);
  std::vector<int64_t> divisors;
  for (int64_t d = 1; d <= 1100; ++d) divisors.push_back(d);
  for (int s = 11; s <= 30; ++s)
    for (int64_t e : {-1, 0, 1}) divisors.push_back((int64_t(1) << s) + e);
  for (int i = 0; i < 300; ++i) divisors.push_back(1 + int64_t(rng() % uint64_t(kFastDivmodLimit)));
  divisors.push_back(kFastDivmodLimit);
  int64_t checked = 0;
  for (int64_t d : divisors) {
    const FastDivmod f(d);
    std::vector<int64_t> ns = {0, 1, d - 1, d, d + 1, kFastDivmodLimit, kFastDivmodLimit - 1};
    // Around multiples of d near the top of the range (where the rounding error is largest).
    const int64_t top = kFastDivmodLimit / d * d;
    for (int64_t m : {top, top - d, top / 2 / d * d})
      for (int64_t e : {-1, 0, 1}) ns.push_back(m + e);
    for (int i = 0; i < 200; ++i) ns.push_back(int64_t(rng() % uint64_t(kFastDivmodLimit + 1)));
    for (int64_t n : ns) {
      if (n < 0 || n > kFastDivmodLimit) continue;
      uint32_t q, r;
      f.divmod(uint32_t(n), q, r);
      if (int64_t(q) != n / d || int64_t(r) != n % d)
        FAIL("FastDivmod(" << d << ") of " << n << ": " << q << ", " << r);
      ++checked;
    }
  }
  CHECK(checked > 300000);
  // Every dividend for a few small divisors.
  for (int64_t d : {1, 3, 7, 64, 80, 96, 255}) {
    const FastDivmod f(d);
    for (uint32_t n = 0; n < (1u << 20); ++n)
      if (f.div(n) != n / uint32_t(d)) FAIL("FastDivmod(" << d << ").div(" << n << ")");
  }
}

TEST_CASE("BlockTiling visits every (outer, inner) exactly once, whole outer indices per block") {
  for (auto [outer, width, threads] : std::vector<std::tuple<int64_t, int64_t, int>>{{1, 1, 128},
                                                                                     {5, 64, 256},
                                                                                     {7, 80, 256},
                                                                                     {300, 96, 256},
                                                                                     {33, 128, 256},
                                                                                     {4, 256, 256},
                                                                                     {9, 1000, 256},
                                                                                     {70, 4, 128},
                                                                                     {3, 3, 128}}) {
    const BlockTiling tiles(outer, width, threads);
    REQUIRE(tiles.local_size() <= uint32_t(width > threads ? width : threads));
    std::set<std::pair<uint32_t, uint32_t>> seen;
    for (uint32_t b = 0; b < tiles.blocks(); ++b) {
      std::set<uint32_t> outers;
      bool ended = false;
      for (uint32_t local = 0; local < tiles.local_size(); ++local) {
        uint32_t o, w;
        const bool in = tiles.at(b, local, o, w);
        REQUIRE(!(ended && in));  // past the end stays past the end: the kernels break there
        ended |= !in;
        if (!in) continue;
        REQUIRE(w < width);
        REQUIRE(seen.insert({o, w}).second);
        outers.insert(o);
      }
      REQUIRE(outers.size() <= tiles.per_block);
    }
    CHECK(int64_t(seen.size()) == outer * width);
  }
}

TEST_CASE("element_group: the meta index, position and length nq_format.h gives each element") {
  std::mt19937 rng(3);
  for (GroupAxis axis : {GroupAxis::kTokens, GroupAxis::kChannels})
    for (bool dgq : {false, true}) {
      if (dgq && axis == GroupAxis::kChannels) continue;
      NQDims d;
      d.rows = 3, d.tokens = 150, d.head_dim = 80, d.group_size = 32, d.axis = axis;
      std::vector<int32_t> starts;
      if (dgq) {
        // Segments of random lengths 1..40 from 0, as many as meta_a() says.
        const int64_t A = d.meta_a();
        for (int64_t n = 0; n < d.rows; ++n) {
          int32_t s = 0;
          for (int64_t a = 0; a < A; ++a) {
            starts.push_back(s);
            s = std::min<int32_t>(int32_t(d.tokens), s + 1 + int32_t(rng() % 40));
          }
        }
        d.segment_starts = starts.data();
      }
      const NQIndexing ix(d, d.head_dim, 256);
      CHECK(ix.A == d.meta_a());
      CHECK(ix.B == d.meta_b());
      CHECK(ix.row_bytes == d.packed_row_bytes());
      for (int64_t n = 0; n < d.rows; ++n)
        for (int64_t t = 0; t < d.tokens; ++t)
          for (int64_t c = 0; c < d.head_dim; ++c) {
            // The plain formulas (nq_format.h / nq_layout.h), 64-bit division and all.
            int64_t a, b, t0, end, pos, len;
            if (axis == GroupAxis::kTokens) {
              a = 0;
              if (dgq) {
                while (a + 1 < d.meta_a() && d.group_start(n, a + 1) <= t) ++a;
              } else {
                a = t / d.group_size;
              }
              b = c, t0 = d.group_start(n, a), end = d.group_end(n, a);
              pos = t - t0, len = end - t0;
            } else {
              a = t, b = c / d.group_size;
              pos = c % d.group_size, len = std::min<int64_t>(d.group_size, d.head_dim - b * d.group_size);
            }
            const ElementGroup e = element_group(d, ix, n, uint32_t(t), uint32_t(c));
            if (e.g != layout::meta_index(d, n, a, b) || e.pos != pos || e.len != len)
              FAIL("element_group n=" << n << " t=" << t << " c=" << c << " dgq=" << dgq);
          }
    }
}
