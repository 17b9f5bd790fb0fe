// Fused attention of the torch-free core against a plain double-precision
// attention over the decompressed cache (ctest runs this file once per
// instruction set through NEXUSKV_CPU_ISA).
#include <cmath>
#include <random>
#include <vector>

#include "catch_compat.h"
#include "nexuskv/core/attention.h"
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

  CompressedView view() const {
    CompressedView v;
    v.codes = codes.data(), v.scale = scale.data(), v.zero = zero.data();
    v.outlier_idx = idx.data(), v.outlier_val = val.data();
    v.dims = d, v.meta_a = d.meta_a();
    return v;
  }
};

// Runs the fused kernel with `splits` splits of the key range and returns its
// relative (Frobenius) error against double-precision causal attention whose
// key / value row of position t of sequence b, kv head h, is row(key, b, h, t).
template <typename RowFn>
double fused_vs_reference(const AttentionProblem& p, int64_t splits, RowFn row) {
  const int64_t B = p.batch, Hq = p.q_heads, Hkv = p.kv_heads, Lq = p.q_len, D = p.head_dim;
  std::vector<float> partials(size_t(B * Hkv * splits * partial_floats(p))), out(size_t(B * Hq * Lq * D));
  attention_tasks(p, splits, partials.data(), 0, B * Hkv * splits);
  attention_merge(p, splits, partials.data(), out.data(), 0, B * Hkv);
  double num = 0, den = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hq = 0; hq < Hq; ++hq)
      for (int64_t i = 0; i < Lq; ++i) {
        const int64_t h = hq / (Hq / Hkv), P = p.seq_len(b) - Lq + i;
        const float* qr = p.q + ((b * Hq + hq) * Lq + i) * D;
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
    AttentionProblem p;
    p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = Lq, p.head_dim = D;
    p.q = q.data(), p.k = k.view(), p.v = v.view(), p.compressed_lens = lens, p.scale = 0.125f;
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
  AttentionProblem p;
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = Lq, p.head_dim = D, p.scale = 0.2f;
  p.q = q.data(), p.k = k.view(), p.v = v.view(), p.compressed_lens = comp;
  p.k_sink = ks.data(), p.v_sink = vs.data(), p.sink_capacity = S, p.sink_lens = sinks;
  p.k_tail = kt.data(), p.v_tail = vt.data(), p.tail_capacity = Tt, p.tail_lens = tails;
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
