// Fused attention of the torch-free core against a plain double-precision
// attention over the decompressed cache (ctest runs this file once per
// instruction set through NEXUSKV_CPU_ISA).
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/cpu_isa.h"
#include "nexuskv/core/nq_kernels.h"

using namespace nexuskv::core;

namespace {

// One compressed [B, H, T, D] float cache with its decompressed copy.
struct Cache {
  NQDims d;
  std::vector<uint8_t> codes, idx;
  std::vector<float> scale, zero, val, dense;

  Cache(int64_t BH, int64_t T, int64_t D, int bits, int G, GroupAxis axis, int k, std::mt19937& rng) {
    d.rows = BH, d.tokens = T, d.head_dim = D, d.bits = bits, d.group_size = G, d.axis = axis, d.num_outliers = k;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> x(size_t(BH * T * D));
    for (auto& v : x) v = nd(rng);
    const int64_t groups = BH * d.groups_per_row();
    codes.resize(size_t(BH * T * d.packed_row_bytes()));
    scale.resize(size_t(groups)), zero.resize(size_t(groups));
    idx.resize(size_t(groups * k)), val.resize(size_t(groups * k));
    std::vector<int64_t> offsets(static_cast<size_t>(BH));
    for (int64_t r = 0; r < BH; ++r) offsets[size_t(r)] = r * T * D;
    CompressStatus st;
    nq_compress_tasks<float, float>(d, {x.data(), offsets.data(), D, 1},
                                    {codes.data(), scale.data(), zero.data(), idx.data(), val.data()}, 0,
                                    nq_num_tasks(d), &st);
    dense.resize(x.size());
    nq_decompress_tasks<float, float>(d, codes.data(), scale.data(), zero.data(), dense.data(), 0, nq_num_tasks(d));
    REQUIRE(nq_scatter_outliers<float, float>(d, idx.data(), val.data(), dense.data(), 0, groups));
  }

  CompressedKV<float, float> view() const {
    CompressedKV<float, float> v;
    v.codes = codes.data(), v.scale = scale.data(), v.zero = zero.data();
    v.outlier_idx = idx.data(), v.outlier_val = val.data();
    v.dims = d;
    return v;
  }
};

using Params = CpuAttentionParams<float, float>;

// Rows [B, H, T, D] of a contiguous float tensor.
DenseRows<float> rows_of(const std::vector<float>& t, int64_t H, int64_t T, int64_t D) {
  return {t.data(), H * T * D, T * D, D};
}

// Runs the fused kernel with `splits` splits of the key range and returns its
// relative (Frobenius) error against double-precision causal attention whose
// key / value row of position t of sequence b, kv head h, is row(key, b, h, t).
template <typename RowFn>
double fused_vs_reference(const Params& p, int64_t splits, RowFn row) {
  const int64_t B = p.batch, Hq = p.q_heads, Hkv = p.kv_heads, Lq = p.q_len, D = p.head_dim;
  std::vector<float> partials(size_t(B * Hkv * splits * partial_floats(p))), out(size_t(B * Hq * Lq * D));
  attention_tasks(p, splits, partials.data(), 0, B * Hkv * splits);
  attention_merge(p, splits, partials.data(), out.data(), 0, B * Hkv);
  double num = 0, den = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hq = 0; hq < Hq; ++hq)
      for (int64_t i = 0; i < Lq; ++i) {
        const int64_t h = hq / (Hq / Hkv), P = p.seq_len(b) - Lq + i;
        const float* qr = p.q.row(b, hq, i);
        std::vector<double> w(size_t(P + 1));
        double mx = -INFINITY, sum = 0;
        for (int64_t t = 0; t <= P; ++t) {
          double s = 0;
          for (int64_t c = 0; c < D; ++c) s += double(qr[c]) * row(true, b, h, t)[c];
          w[size_t(t)] = s * p.scale, mx = std::max(mx, w[size_t(t)]);
        }
        for (auto& x : w) x = std::exp(x - mx), sum += x;
        for (int64_t c = 0; c < D; ++c) {
          double o = 0;
          for (int64_t t = 0; t <= P; ++t) o += w[size_t(t)] * row(false, b, h, t)[c];
          o /= sum;
          const double got = out[size_t(((b * Hq + hq) * Lq + i) * D + c)];
          num += (got - o) * (got - o), den += o * o;
        }
      }
  return std::sqrt(num / den);
}

}  // namespace

TEST_CASE("fused attention equals attention over the decompressed cache", "[attention]") {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t B = 2, Hkv = 2, Hq = 6, Lq = 3, T = 150, D = 64;
  for (int bits : {2, 4, 8}) {
    INFO("bits=" << bits << " isa=" << attention_isa());
    const Cache k(B * Hkv, T, D, bits, 32, GroupAxis::kTokens, 1, rng);
    const Cache v(B * Hkv, T, D, bits, 32, GroupAxis::kChannels, 1, rng);
    std::vector<float> q(size_t(B * Hq * Lq * D));
    for (auto& x : q) x = nd(rng);
    const int64_t lens[2] = {150, 41};
    Params p;
    p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = Lq, p.head_dim = D;
    p.q = rows_of(q, Hq, Lq, D), p.k = k.view(), p.v = v.view(), p.compressed_lens.i64 = lens, p.scale = 0.125f;
    auto row = [&](bool key, int64_t b, int64_t h, int64_t t) {
      return (key ? k.dense : v.dense).data() + ((b * Hkv + h) * T + t) * D;
    };
    for (int64_t splits : {int64_t(1), int64_t(3)}) REQUIRE(fused_vs_reference(p, splits, row) < 1e-5);
  }
}

TEST_CASE("Hadamard rotation is orthonormal and inverted", "[attention]") {
  std::mt19937 rng(12);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t n = 128;
  std::vector<float> x(2 * n), y(2 * n), z(2 * n), signs(n);
  for (auto& v : x) v = nd(rng);
  for (int64_t i = 0; i < n; ++i) signs[size_t(i)] = (i * 7 % 3) ? 1.f : -1.f;
  hadamard_rotate_rows(x.data(), y.data(), 2, n, signs.data(), false);
  hadamard_rotate_rows(y.data(), z.data(), 2, n, signs.data(), true);
  double nx = 0, ny = 0;
  for (int64_t i = 0; i < n; ++i) nx += x[size_t(i)] * x[size_t(i)], ny += y[size_t(i)] * y[size_t(i)];
  REQUIRE(std::fabs(nx - ny) < 1e-4 * nx);
  for (size_t i = 0; i < x.size(); ++i) REQUIRE(std::fabs(z[i] - x[i]) < 1e-5f);
}

TEST_CASE("full-precision sinks and tail sit before and after the compressed tokens", "[attention]") {
  // Positions of sequence b: sinks [0, S_b), compressed [S_b, S_b + C_b), tail after them.
  std::mt19937 rng(13);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t B = 3, Hkv = 1, Hq = 2, Lq = 4, T = 96, D = 32, S = 5, Tt = 20;
  const Cache k(B * Hkv, T, D, 4, 32, GroupAxis::kTokens, 0, rng);
  const Cache v(B * Hkv, T, D, 4, 32, GroupAxis::kChannels, 0, rng);
  std::vector<float> q(size_t(B * Hq * Lq * D)), ks(size_t(B * Hkv * S * D)), vs(ks.size()),
      kt(size_t(B * Hkv * Tt * D)), vt(kt.size());
  for (auto* buf : {&q, &ks, &vs, &kt, &vt})
    for (auto& x : *buf) x = nd(rng);
  // Ragged: all three parts; no compressed part; queries inside the sinks (nothing else).
  const int64_t comp[3] = {96, 0, 0}, sinks[3] = {5, 3, 5}, tails[3] = {7, 20, 0};
  Params p;
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = Lq, p.head_dim = D, p.scale = 0.2f;
  p.q = rows_of(q, Hq, Lq, D), p.k = k.view(), p.v = v.view(), p.compressed_lens.i64 = comp;
  p.sink.k = rows_of(ks, Hkv, S, D), p.sink.v = rows_of(vs, Hkv, S, D), p.sink.capacity = S, p.sink.lens.i64 = sinks;
  p.tail.k = rows_of(kt, Hkv, Tt, D), p.tail.v = rows_of(vt, Hkv, Tt, D), p.tail.capacity = Tt, p.tail.lens.i64 = tails;
  // Key / value row of position t of sequence b (one kv head), from whichever part holds it.
  auto row = [&](bool key, int64_t b, int64_t, int64_t t) -> const float* {
    if (t < sinks[b]) return (key ? ks : vs).data() + (b * S + t) * D;
    t -= sinks[b];
    if (t < comp[b]) return (key ? k.dense : v.dense).data() + (b * T + t) * D;
    return (key ? kt : vt).data() + (b * Tt + t - comp[b]) * D;
  };
  for (int64_t splits : {int64_t(1), int64_t(2)}) {
    INFO("splits=" << splits << " isa=" << attention_isa());
    REQUIRE(fused_vs_reference(p, splits, row) < 1e-5);
  }
}

TEST_CASE("the attention kernel of the ISA under test runs", "[attention][isa]") {
  // ctest runs this binary with NEXUSKV_CPU_ISA=generic and =avx2 too.
  const char* env = std::getenv("NEXUSKV_CPU_ISA");
  const std::string cap = env ? env : "";
  CpuIsa want = cpu_isa_supported(CpuIsa::kAvx512) ? CpuIsa::kAvx512
                : cpu_isa_supported(CpuIsa::kAvx2) ? CpuIsa::kAvx2
                                                   : CpuIsa::kGeneric;
  if (cap == "generic") want = CpuIsa::kGeneric;
  if (cap == "avx2" && want == CpuIsa::kAvx512) want = CpuIsa::kAvx2;
  std::mt19937 rng(14);
  const Cache k(1, 40, 32, 4, 32, GroupAxis::kTokens, 0, rng), v(1, 40, 32, 4, 32, GroupAxis::kChannels, 0, rng);
  std::vector<float> q(32, 0.5f);
  const int64_t lens[1] = {40};
  Params p;
  p.batch = 1, p.q_heads = 1, p.kv_heads = 1, p.q_len = 1, p.head_dim = 32;
  p.q = rows_of(q, 1, 1, 32), p.k = k.view(), p.v = v.view(), p.compressed_lens.i64 = lens;
  std::vector<float> partials(size_t(partial_floats(p)));
  attention_tasks(p, 1, partials.data(), 0, 1);
  INFO("cap=" << cap);
  REQUIRE(last_kernel_isa() == want);
  REQUIRE(std::string(attention_isa()) == cpu_isa_name(want));
}

TEST_CASE("integer p.V on packed values runs and stays within its limb bound", "[attention][isa]") {
  // attention_int_values.h: with q = 0 every score is 0, so the weights are the
  // value scales themselves (p = 1) and the output is the mean of the value rows;
  // each weight is off by at most a / (2 * radix^(L-1)), a = max over the tile / lmax,
  // so a channel's output by at most sum_tiles n * qmax * a / (2 * radix^(L-1)) / T.
  // AVX512-VNNI: int8 limbs (lmax 127, radix 254; L = 2 for bf16 queries, 3 for fp16 /
  // fp32); AVX2: int16 limbs (attention_int_values_avx2.h: lmax 32767, radix 65534;
  // L = 1 or 2).  The keys (per channel, 4-bit) take the integer scores on both.
  const bool vnni = cpu_isa() == CpuIsa::kAvx512, integer = cpu_isa() != CpuIsa::kGeneric;
  const double lmax = vnni ? 127 : 32767, radix = vnni ? 254 : 65534;
  struct Shape {
    int64_t T, D, rows;
  };
  // Whole blocks of four tokens, one row; then a partial block (102 = 3 * 32 + 6), a partial
  // last chunk (D 96 at 2 bits: 64 + 32 channels) and four query rows of one kv head.
  for (const Shape sh : {Shape{100, 64, 1}, Shape{102, 96, 4}}) {
    const int64_t T = sh.T, D = sh.D;
    std::mt19937 rng(21);
    const Cache k(1, T, D, 4, 32, GroupAxis::kTokens, 0, rng);
    std::vector<float> q(size_t(sh.rows * D), 0.f);
    const int64_t lens[1] = {T};
    for (int bits : {2, 4, 8})
      for (int mantissa : {8, 24}) {  // bf16 queries: fewer limbs than fp16 / fp32
        const Cache v(1, T, D, bits, 32, GroupAxis::kChannels, 0, rng);
        Params p;
        p.batch = 1, p.q_heads = sh.rows, p.kv_heads = 1, p.q_len = 1, p.head_dim = D;
        p.query_mantissa_bits = mantissa;
        p.q = rows_of(q, sh.rows, 1, D), p.k = k.view(), p.v = v.view(), p.compressed_lens.i64 = lens;
        std::vector<float> partials(size_t(partial_floats(p))), out(static_cast<size_t>(sh.rows * D));
        attention_tasks(p, 1, partials.data(), 0, 1);
        attention_merge(p, 1, partials.data(), out.data(), 0, 1);
        INFO("T=" << T << " D=" << D << " bits=" << bits << " mantissa=" << mantissa << " isa=" << attention_isa());
        REQUIRE(last_value_product() == (integer ? ValueProduct::kInteger : ValueProduct::kFloat));
        REQUIRE(last_key_product() == (integer ? ValueProduct::kInteger : ValueProduct::kFloat));
        const int limbs = (mantissa <= 8 ? 2 : 3) - (vnni ? 0 : 1);
        const double qmax = double((1 << bits) - 1);
        const int64_t groups = D / 32;
        double worst_excess = -1, vmax = 0;
        for (int64_t c = 0; c < D; ++c) {
          double mean = 0, bound = 0;
          for (int64_t t = 0; t < T; ++t) mean += v.dense[size_t(t * D + c)] / double(T);
          for (int64_t t0 = 0; t0 < T; t0 += kTileTokens) {
            const int64_t n = std::min<int64_t>(kTileTokens, T - t0);
            double wmax = 0;  // the tile's largest weight: the largest scale of c's group
            for (int64_t t = t0; t < t0 + n; ++t) wmax = std::max(wmax, double(v.scale[size_t(t * groups + c / 32)]));
            bound += n * qmax * (wmax / lmax) / (2 * std::pow(radix, limbs - 1)) / double(T);
          }
          for (int64_t t = 0; t < T; ++t) vmax = std::max(vmax, std::abs(double(v.dense[size_t(t * D + c)])));
          // Every query row (q = 0: all alike); float32 rounding of the sums on top of the limb bound.
          for (int64_t r = 0; r < sh.rows; ++r)
            worst_excess = std::max(worst_excess, std::abs(out[size_t(r * D + c)] - mean) - bound - 1e-6 * vmax);
          if (integer) REQUIRE(bound < (mantissa <= 8 ? 2e-4 : 1e-6) * vmax);  // the bound means something
        }
        REQUIRE(worst_excess <= 0);
      }
  }
}

TEST_CASE("AttentionParams accessors: lengths as given, DGQ segments, positions", "[attention]") {
  const int32_t lens32[2] = {7, 0};
  SeqLengths l;
  REQUIRE_FALSE(l.given());
  l.i32 = lens32;
  REQUIRE((l.given() && l.at(0) == 7 && l.at(1) == 0));
  // Two rows of DGQ segments over 100 tokens: [0, 32) [32, 48) [48, 100) and [0, 16) [16, 100) [100, 100).
  const int32_t starts[6] = {0, 32, 48, 0, 16, 100};
  CompressedKV<float, float> c;
  c.dims.rows = 2, c.dims.tokens = 100, c.dims.head_dim = 16, c.dims.group_size = 40, c.dims.axis = GroupAxis::kTokens;
  c.dims.segment_starts = starts;
  REQUIRE(c.dims.meta_a() == 3);
  for (int64_t t : {0, 31, 32, 47, 48, 99}) REQUIRE(c.token_group(0, t) == (t < 32 ? 0 : t < 48 ? 1 : 2));
  for (int64_t t : {0, 15, 16, 99}) REQUIRE(c.token_group(1, t) == (t < 16 ? 0 : 1));
  REQUIRE((c.group_begin(0, 1) == 32 && c.group_end(0, 1) == 48 && c.group_end(0, 2) == 100));
  c.dims.segment_starts = nullptr;
  REQUIRE((c.token_group(0, 79) == 1 && c.group_end(0, 2) == 100));
  CpuAttentionParams<float, float> p;
  p.batch = 2, p.q_heads = 6, p.kv_heads = 2, p.q_len = 3, p.head_dim = 16, p.window = 4;
  const int64_t comp[2] = {10, 0}, sink[2] = {2, 2};
  p.compressed_lens.i64 = comp;
  std::vector<float> ks(2 * 2 * 2 * 16);
  p.sink.k = rows_of(ks, 2, 2, 16), p.sink.v = p.sink.k, p.sink.capacity = 2, p.sink.lens.i64 = sink;
  REQUIRE((p.seq_len(0) == 12 && p.seq_len(1) == 2 && p.tail_len(0) == 0));
  REQUIRE((p.rows_per_kv_head() == 9 && p.q_head(1, 4) == 4 && p.query_position(0, 2) == 11));
  REQUIRE(p.first_visible(0) == 12 - 3 - 4 + 1);
  REQUIRE((p.visible(11, 8) && !p.visible(11, 7) && !p.visible(10, 11)));
}

TEST_CASE("Hadamard rotation near FLT_MAX stays finite where the exact result is", "[attention]") {
  const int64_t n = 4;
  const float big = 3e38f;
  std::vector<float> x = {big, big, 0.f, 0.f}, y(4), signs = {1.f, 1.f, 1.f, 1.f}, z(4);
  // Exact: H x / 2 = (3e38, 0, 3e38, 0); summing first would overflow.
  hadamard_rotate_rows(x.data(), y.data(), 1, n, signs.data(), false);
  for (int i = 0; i < 4; ++i) REQUIRE(std::isfinite(y[size_t(i)]));
  REQUIRE(std::fabs(y[0] - big) <= 1e-6f * big);
  REQUIRE((y[1] == 0.f && y[3] == 0.f && std::fabs(y[2] - big) <= 1e-6f * big));
  hadamard_rotate_rows(y.data(), z.data(), 1, n, signs.data(), true);
  for (int i = 0; i < 4; ++i) REQUIRE(std::fabs(z[size_t(i)] - x[size_t(i)]) <= 1e-6f * big);
  // Rows whose result is finite but large keep the old order of operations (bit-identical).
  std::vector<float> small = {1.f, 2.f, 3.f, 4.f}, a(4);
  hadamard_rotate_rows(small.data(), a.data(), 1, n, signs.data(), false);
  REQUIRE((a[0] == 5.f && a[1] == -1.f && a[2] == -2.f && a[3] == 0.f));
}

TEST_CASE("Hadamard rotation: every ISA's copy gives the generic bits, and H (signs x) / sqrt(n)", "[attention]") {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int64_t n : {1, 2, 4, 8, 16, 64, 128, 256}) {
    const int64_t rows = 3;
    std::vector<float> x(static_cast<size_t>(rows * n)), signs(static_cast<size_t>(n));
    for (auto& e : x) e = nd(rng);
    for (auto& e : signs) e = nd(rng) < 0.f ? -1.f : 1.f;
    x[size_t(n)] = 3e38f;                   // row 1 near FLT_MAX: scaled before the butterflies
    if (n > 1) x[size_t(2 * n + 1)] = NAN;  // row 2: a NaN is carried, not skipped
    for (bool inverse : {false, true}) {
      std::vector<float> want(x.size());
      const CpuIsa previous = set_cpu_isa_cap(CpuIsa::kGeneric);
      hadamard_rotate_rows(x.data(), want.data(), rows, n, signs.data(), inverse);
      REQUIRE(last_kernel_isa() == CpuIsa::kGeneric);
      set_cpu_isa_cap(previous);
      // Row 0 against float64: y = H (s x) / sqrt(n), x = s H y / sqrt(n).
      for (int64_t i = 0; i < n; ++i) {
        double exact = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double h = __builtin_popcountll(uint64_t(i & j)) % 2 ? -1.0 : 1.0;
          exact += h * (inverse ? double(x[size_t(j)]) : double(signs[size_t(j)]) * x[size_t(j)]);
        }
        exact /= std::sqrt(double(n));
        if (inverse) exact *= signs[size_t(i)];
        CHECK(std::fabs(want[size_t(i)] - exact) <= 1e-5 * std::sqrt(double(n)));
      }
      for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
        if (!cpu_isa_supported(isa)) continue;
        INFO("n " << n << ", inverse " << inverse << ", " << cpu_isa_name(isa));
        const CpuIsa prev = set_cpu_isa_cap(isa);
        std::vector<float> got(x.size()), in_place = x;
        hadamard_rotate_rows(x.data(), got.data(), rows, n, signs.data(), inverse);
        REQUIRE(last_kernel_isa() == isa);
        hadamard_rotate_rows(in_place.data(), in_place.data(), rows, n, signs.data(), inverse);
        set_cpu_isa_cap(prev);
        // Bit for bit (NaN where the generic copy has NaN).
        for (size_t i = 0; i < x.size(); ++i) {
          CHECK(std::isnan(got[i]) == std::isnan(want[i]));
          if (!std::isnan(want[i])) CHECK(got[i] == want[i]);
          if (!std::isnan(want[i])) CHECK(in_place[i] == want[i]);
        }
      }
    }
  }
}
