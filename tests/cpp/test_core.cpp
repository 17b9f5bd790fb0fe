// Unit tests of the torch-free core: the layout and conversion headers that
// production runs (nq_layout.h, half.h), packing, the quantization error bound
// and exact outliers, with plain std:: references; every NQ kernel path (ISA)
// against the others.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "nexuskv/core/cpu_isa.h"
#include "nexuskv/core/nq_kernels.h"
#include "nexuskv/core/nq_layout.h"

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
    REQUIRE(nq_scatter_outliers<In, float>(d, idx.data(), val.data(), out.data(), 0, d.rows * d.groups_per_row()));
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

// The packed row of nq_format.h, bit by bit from its text: channel i of a
// 2/4/8-bit chunk sits in byte i % 16 at bit offset bits * (i / 16); 3-bit
// chunks hold the low 2 bits as a 2-bit chunk, bit 2 of channel i at byte
// 16 + i % 8, bit i / 8.
std::vector<uint8_t> reference_pack(const std::vector<uint8_t>& codes, int bits, int64_t D) {
  const int64_t C = bits == 8 ? 16 : bits == 4 ? 32 : 64, CB = bits == 3 ? 24 : 16;
  std::vector<uint8_t> row(size_t((D + C - 1) / C * CB), 0);
  for (int64_t c = 0; c < D; ++c) {
    uint8_t* chunk = row.data() + (c / C) * CB;
    const int64_t i = c % C;
    const unsigned code = codes[size_t(c)];
    const int low_bits = bits == 3 ? 2 : bits;
    for (int bit = 0; bit < low_bits; ++bit)
      if ((code >> bit) & 1u) chunk[i % 16] = uint8_t(chunk[i % 16] | (1u << (low_bits * (i / 16) + bit)));
    if (bits == 3 && ((code >> 2) & 1u)) chunk[16 + i % 8] = uint8_t(chunk[16 + i % 8] | (1u << (i / 8)));
  }
  return row;
}

// Finite float32 values near every boundary of a 16-bit format: each
// representable 16-bit value v (as float) and the midpoints to its neighbours,
// one float32 ulp either side.
template <typename Back>
std::vector<float> boundary_floats(Back to_f) {
  std::vector<float> out;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float v = to_f(uint16_t(h)), w = to_f(uint16_t(h + 1));
    if (!std::isfinite(v) || !std::isfinite(w) || (h & 0x7fffu) == 0x7fffu) continue;
    const float mid = float((double(v) + double(w)) / 2);
    for (float f : {v, mid, std::nextafter(mid, -INFINITY), std::nextafter(mid, INFINITY)}) out.push_back(f);
  }
  return out;
}

// bfloat16 round to nearest even, from float64 arithmetic: the two bf16
// candidates around f, the nearer one, the even one on a tie.
uint16_t reference_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (!std::isfinite(f)) return uint16_t(u >> 16);
  const uint32_t lo = u >> 16, hi = lo + 1;  // towards zero, and one step away from it
  auto value = [](uint32_t b) {
    // The step past the largest finite value counts as 2^128 (it rounds to Inf).
    if ((b & 0x7fffu) == 0x7f80u) return (b & 0x8000u) ? -std::ldexp(1.0, 128) : std::ldexp(1.0, 128);
    const uint32_t w = b << 16;
    float x;
    std::memcpy(&x, &w, 4);
    return double(x);
  };
  const double dl = std::fabs(double(f) - value(lo)), dh = std::fabs(value(hi) - double(f));
  if (dl < dh) return uint16_t(lo);
  if (dh < dl) return uint16_t(hi);
  return uint16_t((lo & 1u) ? hi : lo);
}

}  // namespace

TEST_CASE("nq_layout.h reads and writes the layout nq_format.h documents") {
  std::mt19937 rng(21);
  for (int bits : {2, 3, 4, 8})
    for (int64_t D : {16, 48, 64, 96, 128, 200, 256}) {
      INFO("bits=" << bits << " D=" << D);
      const int64_t Dp = layout::padded_channels(bits, D);
      REQUIRE(Dp % chunk_channels(bits) == 0);
      REQUIRE(Dp >= D);
      REQUIRE(Dp < D + chunk_channels(bits));
      std::vector<uint8_t> codes = random_codes(Dp, bits, rng);
      std::fill(codes.begin() + D, codes.end(), 0);  // the padding codes are 0
      const std::vector<uint8_t> want = reference_pack(codes, bits, D);
      REQUIRE(int64_t(want.size()) == row_bytes(bits, D));
      std::vector<uint8_t> row(want.size(), 0xAB), back(size_t(Dp), 0xCD);
      layout::with_bits(bits, [&]<int kBits>() {
        layout::pack_row<kBits>(codes.data(), D, row.data());
        layout::unpack_row<kBits>(row.data(), D, back.data());
        for (int64_t c = 0; c < D; ++c) {
          REQUIRE(layout::code_at<kBits>(row.data(), c) == codes[size_t(c)]);
          const uint8_t* chunk = row.data() + layout::kChunkBytes<kBits> * (c / layout::kChunkChannels<kBits>);
          const int i = int(c % layout::kChunkChannels<kBits>);
          REQUIRE(layout::plane_lane_code<kBits>(chunk, i / 16, i % 16) == codes[size_t(c)]);
          if constexpr (kBits != 3)  // a SIMD reader's plane: shift + mask of the chunk's byte lane
            REQUIRE(((uint32_t(chunk[i % 16]) >> layout::plane_shift<kBits>(i / 16)) & layout::kPlaneMask<kBits>) ==
                    codes[size_t(c)]);
        }
      });
      REQUIRE(row == want);
      REQUIRE(back == codes);
      for (int64_t c = 0; c < D; ++c) REQUIRE(layout::code_at(row.data(), bits, c) == codes[size_t(c)]);
    }
}

TEST_CASE("nq_layout.h metadata index and groups") {
  NQDims d;
  d.rows = 3, d.tokens = 70, d.head_dim = 48, d.group_size = 32, d.axis = GroupAxis::kTokens;
  REQUIRE(d.meta_a() == 3);
  REQUIRE(layout::meta_index(d, 2, 1, 5) == (2 * 3 + 1) * 48 + 5);
  REQUIRE(layout::group_a(d, 69) == 2);
  REQUIRE(layout::group_b(d, 47) == 47);
  d.axis = GroupAxis::kChannels;
  REQUIRE(d.meta_b() == 2);
  REQUIRE(layout::meta_index(d, 1, 69, 1) == (70 + 69) * 2 + 1);
  REQUIRE(layout::group_a(d, 69) == 69);
  REQUIRE(layout::group_b(d, 40) == 1);
}

TEST_CASE("half.h conversions against independent references") {
  SECTION("fp16 -> float is exact: every one of the 65536 values") {
    for (uint32_t h = 0; h < 0x10000u; ++h) {
      const float f = half_to_float(uint16_t(h));
      const bool inf_nan = (h & 0x7c00u) == 0x7c00u;
      if (inf_nan && (h & 0x3ffu)) {
        REQUIRE(std::isnan(f));
        continue;
      }
      // value = (-1)^s * 2^(e-15) * (1 + m/1024), subnormal 2^-14 * m/1024
      const int e = int((h >> 10) & 31u), m = int(h & 0x3ffu);
      const double mag = inf_nan ? INFINITY : e == 0 ? std::ldexp(double(m), -24) : std::ldexp(1024.0 + m, e - 25);
      REQUIRE(double(f) == ((h & 0x8000u) ? -mag : mag));
    }
  }
#if defined(__FLT16_MAX__)
  SECTION("float -> fp16 rounds to nearest even as the compiler's _Float16 does") {
    std::vector<float> floats = boundary_floats([](uint16_t h) { return half_to_float(h); });
    std::mt19937 rng(22);
    for (int i = 0; i < 200000; ++i) {
      uint32_t u = rng();
      float f;
      std::memcpy(&f, &u, 4);
      floats.push_back(f);
    }
    for (float f : {0.f, -0.f, 65504.f, 65519.99f, 65520.f, 1e9f, INFINITY, -INFINITY, 5.96046448e-8f, 2.98023224e-8f,
                    2.98023254e-8f, 1e-30f})
      floats.push_back(f);
    for (float f : floats) {
      if (std::isnan(f)) continue;
      const _Float16 want = static_cast<_Float16>(f);
      uint16_t want_bits;
      std::memcpy(&want_bits, &want, 2);
      INFO("f=" << f);
      REQUIRE(float_to_half(f) == want_bits);
    }
    REQUIRE((float_to_half(NAN) & 0x7e00u) == 0x7e00u);
  }
#endif
  SECTION("float -> bf16 rounds to nearest even (float64 reference)") {
    std::vector<float> floats = boundary_floats([](uint16_t b) { return bf16_to_float(b); });
    std::mt19937 rng(23);
    for (int i = 0; i < 200000; ++i) {
      uint32_t u = rng();
      float f;
      std::memcpy(&f, &u, 4);
      if (!std::isnan(f)) floats.push_back(f);
    }
    for (float f : floats) {
      INFO("f=" << f);
      REQUIRE(float_to_bf16(f) == reference_bf16(f));
    }
    REQUIRE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  }
}

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
  SECTION("directed rounding brackets the value with adjacent neighbours") {
    std::mt19937 rng(2);
    std::uniform_real_distribution<float> u(-3e4f, 3e4f);
    for (int i = 0; i < 100000; ++i) {
      const float v = u(rng) * (i % 3 == 0 ? 1e-6f : 1.f);
      const half_t hd = round_down<half_t>(v), hu = round_up<half_t>(v);
      const bf16_t bd = round_down<bf16_t>(v), bu = round_up<bf16_t>(v);
      REQUIRE(to_float(hd) <= v);
      REQUIRE(to_float(hu) >= v);
      REQUIRE(to_float(bd) <= v);
      REQUIRE(to_float(bu) >= v);
      // The tightest such values: equal, or one step apart.
      REQUIRE((hd.bits == hu.bits || to_float(half_t{bits16_next_up(hd.bits)}) == to_float(hu)));
      REQUIRE((bd.bits == bu.bits || to_float(bf16_t{bits16_next_up(bd.bits)}) == to_float(bu)));
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

// Fitted ranges (nq_format.h): against a double reference of what the format
// promises: outliers as min/max chooses them, every dense entry decoded to the
// nearest of its group's 2^bits levels (z + c*s, c = 0..qmax, with the STORED
// scale and zero), no group with more squared error than min/max's; and the
// point of it: far less error than min/max on bell-shaped data.  Returns the
// squared error of the dense entries (fit, min/max).
template <typename In, typename Meta>
std::pair<double, double> check_fitted_ranges(NQDims d, const std::vector<In>& x) {
  d.fit_range = false;
  const Compressed<In, Meta> mm(d, x);
  d.fit_range = true;
  const Compressed<In, Meta> fit(d, x);
  REQUIRE(fit.idx == mm.idx);
  // (k = 0: no outliers, and memcmp must not be given the empty vectors' null pointers)
  REQUIRE((fit.val.empty() || std::memcmp(fit.val.data(), mm.val.data(), fit.val.size() * sizeof(In)) == 0));
  const auto xf = fit.decompress(), xm = mm.decompress();
  const int64_t groups = d.rows * d.groups_per_row(), k = d.num_outliers;
  std::vector<double> sse_fit(size_t(groups), 0.0), sse_mm(size_t(groups), 0.0);
  const int qmax = (1 << d.bits) - 1;
  for (int64_t n = 0; n < d.rows; ++n)
    for (int64_t t = 0; t < d.tokens; ++t)
      for (int64_t c = 0; c < d.head_dim; ++c) {
        const int64_t i = (n * d.tokens + t) * d.head_dim + c, g = fit.group_of(n, t, c);
        const int64_t pos = fit.pos_in_group(t, c);
        bool outlier = false;
        for (int64_t j = 0; j < k; ++j) outlier |= fit.idx[size_t(g * k + j)] == pos;
        const double xv = to_float(x[size_t(i)]);
        if (outlier) {
          REQUIRE(xf[size_t(i)] == float(xv));
          continue;
        }
        const double s = to_float(fit.scale[size_t(g)]), z = to_float(fit.zero[size_t(g)]);
        REQUIRE(std::isfinite(s));
        REQUIRE(std::isfinite(z));
        REQUIRE(s >= 0.0);
        double nearest = INFINITY;
        for (int code = 0; code <= qmax; ++code) nearest = std::min(nearest, std::fabs(xv - (z + code * s)));
        // float32 arithmetic of the code and of code * s + z: a few ulps of the magnitudes
        const double eps = 4 * 1.2e-7 * (std::fabs(xv) + std::fabs(z) + qmax * s);
        INFO("element " << i << " x=" << xv << " x_hat=" << xf[size_t(i)] << " scale=" << s << " zero=" << z);
        REQUIRE(std::fabs(xv - xf[size_t(i)]) <= nearest + eps);
        sse_fit[size_t(g)] += (xv - xf[size_t(i)]) * (xv - xf[size_t(i)]);
        sse_mm[size_t(g)] += (xv - xm[size_t(i)]) * (xv - xm[size_t(i)]);
      }
  double total_fit = 0, total_mm = 0;
  for (int64_t g = 0; g < groups; ++g) {
    INFO("group " << g);
    // the kernel compares float32 sums; the double ones may differ by their rounding
    REQUIRE(sse_fit[size_t(g)] <= sse_mm[size_t(g)] * (1 + 1e-5) + 1e-30);
    total_fit += sse_fit[size_t(g)], total_mm += sse_mm[size_t(g)];
  }
  return {total_fit, total_mm};
}

TEST_CASE("fitted ranges: nearest levels, never more error than min/max, far less on bell-shaped data") {
  std::mt19937 rng(11);
  // squared-error ratio fit / min-max on normal data that a fit must reach (measured:
  // 2 bits 0.53-0.57, 3 bits 0.80-0.81, 4 bits 0.88-0.89 at groups of 64)
  const double most[] = {0, 0, 0.65, 0.88, 0.95};
  for (int bits : {2, 3, 4, 8})
    for (GroupAxis axis : {GroupAxis::kTokens, GroupAxis::kChannels})
      for (int k : {0, 2}) {
        INFO("bits=" << bits << " axis=" << int(axis) << " k=" << k);
        const NQDims d = dims(3, 133, 80, bits, 64, axis, k);  // partial groups on both axes
        const auto xf = random_input<float>(d, rng);
        const auto [fit, mm] = check_fitted_ranges<float, bf16_t>(d, xf);
        check_fitted_ranges<float, float>(d, xf);
        check_fitted_ranges<half_t, half_t>(d, random_input<half_t>(d, rng));
        check_fitted_ranges<bf16_t, bf16_t>(d, random_input<bf16_t>(d, rng));
        INFO("fit " << fit << " min/max " << mm);
        if (bits <= 4) REQUIRE(fit < most[bits] * mm);
      }
}

TEST_CASE("fitted ranges: constant groups, groups of k entries or fewer, outliers") {
  {  // constant groups stay exact
    NQDims d = dims(1, 16, 32, 2, 16, GroupAxis::kTokens, 0);
    d.fit_range = true;
    const std::vector<float> x(16 * 32, -1.25f);
    const Compressed<float, bf16_t> c(d, x);
    for (float v : c.decompress()) REQUIRE(v == -1.25f);
  }
  {  // 5 tokens, groups of 4, k = 2: the last token group is all outliers (exact)
    NQDims d = dims(1, 5, 16, 2, 4, GroupAxis::kTokens, 2);
    d.fit_range = true;
    std::mt19937 rng(12);
    const auto x = random_input<float>(d, rng);
    const Compressed<float, float> c(d, x);
    const auto xh = c.decompress();
    for (int64_t ch = 0; ch < 16; ++ch) REQUIRE(xh[size_t(4 * 16 + ch)] == x[size_t(4 * 16 + ch)]);
    check_fitted_ranges<float, float>(d, x);
  }
  {  // a planted outlier per group keeps its exact value; the rest is still fitted
    std::mt19937 rng(13);
    for (GroupAxis axis : {GroupAxis::kTokens, GroupAxis::kChannels}) {
      const NQDims d = dims(2, 64, 64, 2, 32, axis, 1);
      auto x = random_input<float>(d, rng, 1.f);
      for (size_t i = 0; i < x.size(); i += 97) x[i] = 1000.f + float(i);
      check_fitted_ranges<float, bf16_t>(d, x);
    }
  }
}

TEST_CASE("fitted ranges: the same bits whatever the task split (vector and scalar passes)") {
  // Channel groups are fitted a block of tokens at a time, 8 groups per vector pass and the
  // rest one by one: one task per call puts every group on the scalar pass, all tasks in one
  // call most of them on the vector one.
  std::mt19937 rng(14);
  for (int k : {0, 2}) {
    NQDims d = dims(1, 37, 80, 2, 24, GroupAxis::kChannels, k);  // 4 groups a token, the last of 8
    d.fit_range = true;
    const auto x = random_input<float>(d, rng);
    const Compressed<float, bf16_t> whole(d, x);  // two calls of many tasks
    Compressed<float, bf16_t> single(d, x);
    std::vector<int64_t> offsets(1, 0);
    const StridedRows<float> rows{x.data(), offsets.data(), d.head_dim, 1};
    const NQBuffers<float, bf16_t> buf{single.codes.data(), single.scale.data(), single.zero.data(), single.idx.data(),
                                       single.val.data()};
    for (int64_t t = 0; t < nq_num_tasks(d); ++t)
      nq_compress_tasks<float, bf16_t>(d, rows, buf, t, t + 1, &single.status);
    INFO("k=" << k);
    REQUIRE(single.codes == whole.codes);
    REQUIRE(std::memcmp(single.scale.data(), whole.scale.data(), whole.scale.size() * sizeof(bf16_t)) == 0);
    REQUIRE(std::memcmp(single.zero.data(), whole.zero.data(), whole.zero.size() * sizeof(bf16_t)) == 0);
  }
}

TEST_CASE("the kernels of the ISA under test run", "[isa]") {
  // ctest runs this binary with NEXUSKV_CPU_ISA=generic and =avx2 too: the
  // kernels that ran must be that path (NQ is built up to AVX2), not merely
  // the one asked for.
  const char* env = std::getenv("NEXUSKV_CPU_ISA");
  const std::string cap = env ? env : "";
  CpuIsa want = cpu_isa_supported(CpuIsa::kAvx512) ? CpuIsa::kAvx512
                : cpu_isa_supported(CpuIsa::kAvx2) ? CpuIsa::kAvx2
                                                   : CpuIsa::kGeneric;
  if (cap == "generic") want = CpuIsa::kGeneric;
  if (cap == "avx2" && want == CpuIsa::kAvx512) want = CpuIsa::kAvx2;
  REQUIRE(cpu_isa() == want);
  const NQDims d = dims(1, 16, 32, 4, 16, GroupAxis::kTokens, 0);
  std::mt19937 rng(8);
  const auto x = random_input<float>(d, rng);
  const Compressed<float, float> c(d, x);
  const CpuIsa nq_want = int(want) < int(CpuIsa::kAvx2) ? want : CpuIsa::kAvx2;
  INFO("cap=" << cap << " want=" << cpu_isa_name(nq_want));
  REQUIRE(last_kernel_isa() == nq_want);
  REQUIRE(std::string(nq_kernel_isa()) == cpu_isa_name(nq_want));
}

TEST_CASE("NQ kernels give identical bits on every ISA") {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (cpu_isa_supported(isa)) isas.push_back(isa);
  INFO("ISAs on this CPU: " << isas.size());
  const CpuIsa saved = set_cpu_isa_cap(CpuIsa::kAvx512);
  std::mt19937 rng(9);
  for (int bits : {2, 3, 4, 8})
    for (GroupAxis axis : {GroupAxis::kTokens, GroupAxis::kChannels})
      for (int k : {0, 2})
        for (bool fit : {false, true}) {
          NQDims d = dims(2, 45, 80, bits, fit ? 24 : 16, axis, k);  // groups of 24: partial channel groups
          d.fit_range = fit;
          const auto xh = random_input<half_t>(d, rng);
          const auto xf = random_input<float>(d, rng);
          std::vector<std::vector<uint8_t>> seen_h, seen_f;
          std::vector<std::vector<float>> back;
          for (CpuIsa isa : isas) {
            set_cpu_isa_cap(isa);
            const Compressed<half_t, half_t> ch(d, xh);  // fp16: F16C on AVX2, half.h on the portable path
            const Compressed<float, bf16_t> cf(d, xf);
            REQUIRE(last_kernel_isa() == (int(isa) < int(CpuIsa::kAvx2) ? isa : CpuIsa::kAvx2));
            auto bytes = [](const auto&... v) {
              std::vector<uint8_t> all;
              (all.insert(all.end(), reinterpret_cast<const uint8_t*>(v.data()),
                          reinterpret_cast<const uint8_t*>(v.data()) + v.size() * sizeof(v[0])),
               ...);
              return all;
            };
            seen_h.push_back(bytes(ch.codes, ch.scale, ch.zero, ch.idx, ch.val));
            seen_f.push_back(bytes(cf.codes, cf.scale, cf.zero, cf.idx, cf.val));
            back.push_back(ch.decompress());
          }
          for (size_t i = 1; i < isas.size(); ++i) {
            INFO("bits=" << bits << " axis=" << int(axis) << " k=" << k << " fit=" << fit
                         << " isa=" << cpu_isa_name(isas[i]));
            REQUIRE(seen_h[i] == seen_h[0]);
            REQUIRE(seen_f[i] == seen_f[0]);
            REQUIRE(std::memcmp(back[i].data(), back[0].data(), back[0].size() * sizeof(float)) == 0);
          }
        }
  set_cpu_isa_cap(saved);
}

TEST_CASE("byte accounting formula") {
  const NQDims d = dims(4, 128, 128, 4, 64, GroupAxis::kTokens, 0);
  // 4-bit codes + fp16 scale and zero per 64 elements = 4.5 bits.
  REQUIRE(double(nq_nbytes(d, DType::kFloat16, DType::kFloat16)) * 8 / double(4 * 128 * 128) == 4.5);
  const NQDims v = dims(4, 128, 128, 2, 64, GroupAxis::kChannels, 1);
  // 2 + 32/64 + (8 + 16)/64 = 2.875 bits.
  REQUIRE(double(nq_nbytes(v, DType::kFloat16, DType::kFloat16)) * 8 / double(4 * 128 * 128) == 2.875);
}
