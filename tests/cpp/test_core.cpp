// Unit tests of the torch-free core: packing, 16-bit conversions, the
// quantization error bound and exact outliers, with plain std:: references.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "nexuskv/core/nq_kernels.h"

using namespace nexuskv::core;

namespace {

std::vector<uint8_t> random_codes(int64_t n, int bits, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(0, (1 << bits) - 1);
  std::vector<uint8_t> c(static_cast<size_t>(n));
  for (auto& v : c) v = uint8_t(dist(rng));
  return c;
}

// Everything needed to compress one [N, T, D] float tensor and check it.
template <typename In, typename Meta>
struct Compressed {
  NQDims d;
  std::vector<uint8_t> codes, idx;
  std::vector<Meta> scale, zero;
  std::vector<In> val;
  CompressStatus status;

  Compressed(const NQDims& dims, const std::vector<In>& x) : d(dims) {
    const int64_t groups = d.rows * d.groups_per_row();
    codes.resize(size_t(d.rows * d.tokens * d.packed_row_bytes()));
    scale.resize(static_cast<size_t>(groups));
    zero.resize(static_cast<size_t>(groups));
    idx.resize(size_t(groups * d.num_outliers));
    val.resize(size_t(groups * d.num_outliers));
    std::vector<int64_t> offsets(size_t(d.rows));
    for (int64_t n = 0; n < d.rows; ++n) offsets[size_t(n)] = n * d.tokens * d.head_dim;
    const StridedRows<In> rows{x.data(), offsets.data(), d.head_dim, 1};
    const NQBuffers<In, Meta> buf{codes.data(), scale.data(), zero.data(), idx.data(), val.data()};
    // Two ranges, to exercise task ranges the way parallel_for splits them.
    const int64_t tasks = nq_num_tasks(d), mid = tasks / 2;
    nq_compress_tasks<In, Meta>(d, rows, buf, 0, mid, &status);
    nq_compress_tasks<In, Meta>(d, rows, buf, mid, tasks, &status);
  }

  std::vector<float> decompress() const {
    std::vector<float> out(size_t(d.rows * d.tokens * d.head_dim));
    nq_decompress_tasks<Meta, float>(d, codes.data(), scale.data(), zero.data(), out.data(), 0, nq_num_tasks(d));
    REQUIRE(nq_scatter_outliers<In, float>(d, idx.data(), val.data(), out.data(), 0,
                                           d.rows * d.groups_per_row()));
    return out;
  }

  // Group (index into scale/zero) of element (n, t, c).
  int64_t group_of(int64_t n, int64_t t, int64_t c) const {
    if (d.axis == GroupAxis::kTokens) return (n * d.meta_a() + t / d.group_size) * d.meta_b() + c;
    return (n * d.tokens + t) * d.meta_b() + c / d.group_size;
  }
  // Position of element (t, c) inside its group.
  int64_t pos_in_group(int64_t t, int64_t c) const {
    return d.axis == GroupAxis::kTokens ? t % d.group_size : c % d.group_size;
  }
};

NQDims dims(int64_t rows, int64_t tokens, int64_t head_dim, int bits, int group, GroupAxis axis, int k) {
  NQDims d;
  d.rows = rows, d.tokens = tokens, d.head_dim = head_dim;
  d.bits = bits, d.group_size = group, d.axis = axis, d.num_outliers = k;
  return d;
}

template <typename In>
std::vector<In> random_input(const NQDims& d, std::mt19937& rng, float spread = 3.f) {
  std::normal_distribution<float> nd(0.5f, spread);
  std::vector<In> x(size_t(d.rows * d.tokens * d.head_dim));
  for (auto& v : x) v = from_float<In>(nd(rng));
  return x;
}

// |x - x_hat| <= scale/2 + float32 rounding of (x - zero) / scale and of the
// fma in dequantization: a few ulps of the magnitudes involved.
template <typename In, typename Meta>
void check_error_bound(const Compressed<In, Meta>& c, const std::vector<In>& x) {
  const auto xh = c.decompress();
  const float qmax = float((1 << c.d.bits) - 1);
  for (int64_t n = 0; n < c.d.rows; ++n)
    for (int64_t t = 0; t < c.d.tokens; ++t)
      for (int64_t ch = 0; ch < c.d.head_dim; ++ch) {
        const int64_t i = (n * c.d.tokens + t) * c.d.head_dim + ch, g = c.group_of(n, t, ch);
        const float s = to_float(c.scale[size_t(g)]), z = to_float(c.zero[size_t(g)]);
        const float xv = to_float(x[size_t(i)]);
        const float eps = 4.f * 1.2e-7f * (std::fabs(xv) + std::fabs(z) + qmax * s);
        INFO("element " << i << " x=" << xv << " x_hat=" << xh[size_t(i)] << " scale=" << s);
        REQUIRE(std::fabs(xv - xh[size_t(i)]) <= s / 2 + eps);
      }
}

}  // namespace

TEST_CASE("pack_row / unpack_row round trip every width and odd lengths") {
  std::mt19937 rng(1);
  for (int bits : {2, 3, 4, 8})
    for (int64_t D : {1, 5, 16, 17, 31, 63, 64, 65, 80, 100, 128, 130}) {
      INFO("bits=" << bits << " D=" << D);
      const auto codes = random_codes(D, bits, rng);
      std::vector<uint8_t> packed(size_t(row_bytes(bits, D)), 0xAB);
      pack_row(codes.data(), D, bits, packed.data());
      std::vector<uint8_t> back(static_cast<size_t>(D));
      unpack_row(packed.data(), D, bits, back.data());
      REQUIRE(back == codes);
      REQUIRE(int64_t(packed.size()) * 8 >= D * bits);
    }
}

TEST_CASE("packed layout is the documented one") {
  std::vector<uint8_t> codes(64);
  std::iota(codes.begin(), codes.end(), 0);
  std::vector<uint8_t> p4(16), p2(16), p3(24), c3(64);
  for (auto& c : codes) c &= 15;
  pack_row(codes.data(), 32, 4, p4.data());
  for (int l = 0; l < 16; ++l) REQUIRE(p4[size_t(l)] == uint8_t(codes[size_t(l)] | (codes[size_t(l + 16)] << 4)));
  for (int i = 0; i < 64; ++i) c3[size_t(i)] = uint8_t((i * 5) & 7);
  pack_row(c3.data(), 64, 3, p3.data());
  for (int i = 0; i < 64; ++i) {
    REQUIRE(((p3[size_t(i % 16)] >> (2 * (i / 16))) & 3) == (c3[size_t(i)] & 3));
    REQUIRE(((p3[size_t(16 + i % 8)] >> (i / 8)) & 1) == (c3[size_t(i)] >> 2));
  }
  for (auto& c : codes) c &= 3;
  pack_row(codes.data(), 64, 2, p2.data());
  for (int i = 0; i < 64; ++i) REQUIRE(((p2[size_t(i % 16)] >> (2 * (i / 16))) & 3) == codes[size_t(i)]);
}

TEST_CASE("fp16 and bf16 conversions") {
  SECTION("every finite half survives half -> float -> half") {
    for (uint32_t h = 0; h < 0x10000u; ++h) {
      if ((h & 0x7c00u) == 0x7c00u) continue;  // Inf / NaN
      REQUIRE(float_to_half(half_to_float(uint16_t(h))) == h);
    }
  }
  SECTION("nearest rounding and overflow") {
    REQUIRE(half_to_float(float_to_half(1.f + 1.f / 4096)) == 1.f);  // tie to even
    REQUIRE(half_to_float(float_to_half(65504.f)) == 65504.f);
    REQUIRE(std::isinf(half_to_float(float_to_half(65520.f))));
    REQUIRE(half_to_float(float_to_half(5.96046448e-8f)) == 5.96046448e-8f);  // smallest subnormal
    REQUIRE(bf16_to_float(float_to_bf16(1.f + 1.f / 256)) == 1.f);
    REQUIRE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  }
  SECTION("directed rounding brackets the value") {
    std::mt19937 rng(2);
    std::uniform_real_distribution<float> u(-3e4f, 3e4f);
    for (int i = 0; i < 100000; ++i) {
      const float v = u(rng) * (i % 3 == 0 ? 1e-6f : 1.f);
      REQUIRE(to_float(round_down<half_t>(v)) <= v);
      REQUIRE(to_float(round_up<half_t>(v)) >= v);
      REQUIRE(to_float(round_down<bf16_t>(v)) <= v);
      REQUIRE(to_float(round_up<bf16_t>(v)) >= v);
    }
  }
}

TEST_CASE("quantization error <= scale/2 for every width, axis and meta type") {
  std::mt19937 rng(3);
  for (int bits : {2, 3, 4, 8})
    for (GroupAxis axis : {GroupAxis::kTokens, GroupAxis::kChannels})
      for (int group : {16, 32, 64}) {
        INFO("bits=" << bits << " axis=" << int(axis) << " group=" << group);
        const NQDims d = dims(3, 77, 80, bits, group, axis, 0);  // partial groups on both axes
        const auto xf = random_input<float>(d, rng);
        check_error_bound(Compressed<float, float>(d, xf), xf);
        check_error_bound(Compressed<float, half_t>(d, xf), xf);
        const auto xh = random_input<half_t>(d, rng);
        check_error_bound(Compressed<half_t, half_t>(d, xh), xh);
        const auto xb = random_input<bf16_t>(d, rng);
        check_error_bound(Compressed<bf16_t, bf16_t>(d, xb), xb);
      }
}

TEST_CASE("outliers are removed from the range and reproduced exactly") {
  std::mt19937 rng(4);
  for (int bits : {2, 4})
    for (GroupAxis axis : {GroupAxis::kTokens, GroupAxis::kChannels})
      for (int k : {1, 3}) {
        INFO("bits=" << bits << " axis=" << int(axis) << " k=" << k);
        const NQDims d = dims(2, 70, 64, bits, 32, axis, k);
        auto x = random_input<float>(d, rng, 1.f);
        // Plant one huge value per 97 elements; each group holds at most a few.
        for (size_t i = 0; i < x.size(); i += 97) x[i] = (i % 2 ? 1000.f : -1000.f) + float(i);
        const Compressed<float, float> c(d, x);
        check_error_bound(c, x);
        const auto xh = c.decompress();
        for (size_t i = 0; i < x.size(); i += 97) REQUIRE(xh[i] == x[i]);
        // Every stored outlier is exact, and a group's range excludes its outliers.
        for (int64_t g = 0; g < d.rows * d.groups_per_row(); ++g)
          REQUIRE(to_float(c.scale[size_t(g)]) * float((1 << bits) - 1) < 100.f);
      }
}

TEST_CASE("outlier choice minimizes the remaining range") {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int trial = 0; trial < 200; ++trial) {
    const int k = 1 + trial % 4, G = 8 + trial % 9;
    const NQDims d = dims(1, 1, G, 8, G, GroupAxis::kChannels, k);
    std::vector<float> x(static_cast<size_t>(G));
    for (auto& v : x) v = nd(rng) * (trial % 5 == 0 ? 10.f : 1.f);
    const Compressed<float, float> c(d, x);
    std::vector<float> s = x;
    std::sort(s.begin(), s.end());
    float best = INFINITY;
    for (int i = 0; i <= k; ++i) best = std::min(best, s[size_t(G - 1 - (k - i))] - s[size_t(i)]);
    const float range = to_float(c.scale[0]) * 255.f;
    REQUIRE(std::fabs(range - best) <= 1e-5f * (1.f + best));
    std::vector<uint8_t> pos(c.idx.begin(), c.idx.end());
    REQUIRE(std::is_sorted(pos.begin(), pos.end()));
    REQUIRE(std::adjacent_find(pos.begin(), pos.end()) == pos.end());  // k distinct entries
  }
}

TEST_CASE("a partial group smaller than k is stored exactly") {
  // 5 tokens, group 4 -> last token group has one entry, k = 2.
  const NQDims d = dims(1, 5, 16, 2, 4, GroupAxis::kTokens, 2);
  std::mt19937 rng(6);
  const auto x = random_input<float>(d, rng);
  const Compressed<float, float> c(d, x);
  const auto xh = c.decompress();
  for (int64_t ch = 0; ch < 16; ++ch) REQUIRE(xh[size_t(4 * 16 + ch)] == x[size_t(4 * 16 + ch)]);
}

TEST_CASE("constant groups and non-finite input") {
  const NQDims d = dims(1, 16, 32, 4, 16, GroupAxis::kTokens, 0);
  std::vector<float> x(16 * 32, 2.5f);
  {
    const Compressed<float, half_t> c(d, x);
    for (float v : c.decompress()) REQUIRE(v == 2.5f);
  }
  x[7] = NAN;
  REQUIRE(Compressed<float, float>(d, x).status.non_finite_input);
  x[7] = -INFINITY;
  REQUIRE(Compressed<float, float>(d, x).status.non_finite_input);
  x[7] = 1e6f;  // fine in fp32 meta, overflows fp16 meta
  REQUIRE_FALSE(Compressed<float, float>(d, x).status.meta_overflow);
  REQUIRE(Compressed<float, half_t>(d, x).status.meta_overflow);
}

TEST_CASE("corrupt outlier indices are reported, not written out of bounds") {
  const NQDims d = dims(1, 16, 16, 4, 16, GroupAxis::kChannels, 1);
  std::mt19937 rng(7);
  const auto x = random_input<float>(d, rng);
  Compressed<float, float> c(d, x);
  c.idx[3] = 200;
  std::vector<float> out(16 * 16);
  REQUIRE_FALSE(nq_scatter_outliers<float, float>(d, c.idx.data(), c.val.data(), out.data(), 0, 16));
}

TEST_CASE("byte accounting formula") {
  const NQDims d = dims(4, 128, 128, 4, 64, GroupAxis::kTokens, 0);
  // 4-bit codes + fp16 scale and zero per 64 elements = 4.5 bits.
  REQUIRE(double(nq_nbytes(d, DType::kFloat16, DType::kFloat16)) * 8 / double(4 * 128 * 128) == 4.5);
  const NQDims v = dims(4, 128, 128, 2, 64, GroupAxis::kChannels, 1);
  // 2 + 32/64 + (8 + 16)/64 = 2.875 bits.
  REQUIRE(double(nq_nbytes(v, DType::kFloat16, DType::kFloat16)) * 8 / double(4 * 128 * 128) == 2.875);
}
