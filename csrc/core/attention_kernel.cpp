// The fused attention inner loop, compiled once per instruction set (isa.h:
// namespace generic, avx2 or avx512, CMake sets the flags) and picked at run
// time by attention.cpp.  Per task (batch, kv head, key split):
//   for each tile of <= kTileTokens keys that stays inside one quantization
//   group/segment of K and of V:
//     keys: per-channel groups -> the group's scales are folded into the
//       queries (q * scale, once per group) and its zeros into a per-row
//       bias; with AVX512-VNNI and 2/4/8 bits the scores are integer dot
//       products of int8 query limbs with the packed codes
//       (attention_int_keys.h), with AVX2 of int16 limbs with the codes
//       widened to int16 (attention_int_keys_avx2.h), otherwise the codes
//       are converted to float;
//       other groupings are dequantized;
//     scores = q . K for 4 query rows x 4 keys at a time, outliers corrected;
//     causal mask, online softmax (float32); a NaN/Inf score marks its row NaN;
//     values: per-token groups -> the scales folded into the softmax weights
//       and the zeros summed per channel group; with AVX512-VNNI and 2/4/8
//       bits p . V is integer dot products of the packed codes (four tokens
//       interleaved in registers) with int8 limbs of the weights
//       (attention_int_values.h), with AVX2 two tokens with int16 limbs
//       (attention_int_values_avx2.h), otherwise the codes go through a float
//       tile; other groupings are dequantized; acc += p . V, 4 query rows
//       per value load.
// Layout and math of the compressed rows: nq_format.h; the code that reads
// them: nq_layout.h.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attention_blocks.h"
#include "attention_int_keys.h"
#include "attention_int_keys_avx2.h"
#include "attention_int_values.h"
#include "attention_int_values_avx2.h"
#include "isa.h"
#include "isa_kernels.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/half.h"
#include "nexuskv/core/nq_layout.h"
#include "rows.h"

namespace nexuskv::core::NEXUSKV_ISA {
namespace {

// Walks the quantization groups of one (b, h) row of a compressed cache along
// the tokens: which group holds token t and where it ends.
template <typename Cache>
class GroupCursor {
 public:
  GroupCursor(const Cache& c, int64_t bh) : c_(c), bh_(bh) {}

  // Positions the cursor on the group holding token t (t only grows between calls).
  void seek(int64_t t) {
    const NQDims& d = c_.dims;
    if (d.axis == GroupAxis::kChannels) {
      group_ = -1, start_ = t, end_ = kInt64Max;
    } else if (!d.segment_starts) {
      group_ = t / d.group_size, start_ = group_ * d.group_size, end_ = start_ + d.group_size;
    } else {
      const int64_t S = d.meta_a();
      const int32_t* starts = d.segment_starts + bh_ * S;
      if (group_ < 0 || t < start_) group_ = 0;
      while (group_ + 1 < S && starts[group_ + 1] <= t) ++group_;
      start_ = starts[group_];
      end_ = group_ + 1 < S ? starts[group_ + 1] : d.tokens;
    }
  }
  int64_t group() const { return group_; }
  int64_t start() const { return start_; }
  int64_t end() const { return end_; }

 private:
  const Cache& c_;
  int64_t bh_;
  int64_t group_ = -1, start_ = 0, end_ = 0;
};

// Dequantizes tokens [t0, t1) of row bh (inside the cursor's group when the
// grouping runs along tokens) into dst [t1 - t0, D], outliers included.
template <typename Cache>
void dequant_tile(const Cache& c, int64_t bh, const GroupCursor<Cache>& cur, int64_t t0, int64_t t1,
                  float* __restrict dst, float* __restrict s_buf, float* __restrict z_buf) {
  using Meta = std::remove_cv_t<std::remove_pointer_t<decltype(c.scale)>>;
  const NQDims& d = c.dims;
  const int64_t D = d.head_dim, Bm = d.meta_b();
  const int k = d.num_outliers;
  if (d.axis == GroupAxis::kTokens) {
    const int64_t g = c.meta_index(bh, cur.group(), 0);  // first meta entry of the group
    Rows<Meta>::widen(c.scale + g, D, s_buf);
    Rows<Meta>::widen(c.zero + g, D, z_buf);
    for (int64_t t = t0; t < t1; ++t) dequant_row_bits(d.bits, c.code_row(bh, t), D, s_buf, z_buf, dst + (t - t0) * D);
    for (int64_t ch = 0; k && ch < D; ++ch)
      for (int slot = 0; slot < k; ++slot) {
        const int64_t t = cur.start() + c.outlier_pos(g + ch, slot);
        if (t >= t0 && t < t1) dst[(t - t0) * D + ch] = c.outlier_value(g + ch, slot);
      }
  } else {
    const int64_t G = d.group_size;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = c.meta_index(bh, t, 0);  // meta entries of token t
      for (int64_t b = 0; b < Bm; ++b) {
        const float s = c.scale_at(g + b), z = c.zero_at(g + b);
        const int64_t c1 = min_of(D, (b + 1) * G);
        for (int64_t ch = b * G; ch < c1; ++ch) s_buf[ch] = s, z_buf[ch] = z;
      }
      float* row = dst + (t - t0) * D;
      dequant_row_bits(d.bits, c.code_row(bh, t), D, s_buf, z_buf, row);
      for (int64_t b = 0; k && b < Bm; ++b)
        for (int slot = 0; slot < k; ++slot) {
          const int64_t ch = b * G + c.outlier_pos(g + b, slot);
          if (ch < D) row[ch] = c.outlier_value(g + b, slot);
        }
    }
  }
}
// Scratch floats of one task (isa.h's Buffer: no std:: containers in per-ISA code).
using FloatBuf = Buffer<float>;

// Code of channel ch in one packed row, for the few reads that need a single
// code (outlier corrections).
using layout::code_at;

// A tile of keys/values ready for attend(): float rows plus how to read them.
struct Tile {
  const float* k = nullptr;          // [n, D] keys, or raw codes when k_query is the folded one
  const float* k_query = nullptr;    // [rows, D] queries to dot with k (scaled by the key group's scales)
  const float* k_bias = nullptr;     // [rows] added to every score (q . key zeros), or null
  const float* v = nullptr;          // [n, D] values, or raw codes when v_scale is set
  const uint8_t* v_codes = nullptr;  // [n, v_row_bytes] packed value codes, read in place (instead of v), or null
  int64_t v_row_bytes = 0;
  int v_bits = 0;
  const float* v_scale = nullptr;  // [nb, kTileTokens] per-token channel-group scales of folded values, or null
  const float* v_zero = nullptr;   // [nb, kTileTokens]
  int64_t nb = 1, group = 0;       // channel groups per token and their width (folded values)
};

// Per-task state: the GQA group's query rows and their running softmax.
struct TaskState {
  int64_t rows, D;
  FloatBuf q;        // [rows, D] scaled (and rotated) queries
  FloatBuf qk;       // [rows, D] q times the current key group's scales (folded keys)
  FloatBuf kbias;    // [rows] q . the current key group's zeros
  FloatBuf acc;      // [rows, D]
  FloatBuf zacc;     // [rows, D / 16] sum of p * zero per channel group (folded values)
  FloatBuf m, l;     // [rows] running max and sum
  FloatBuf scores;   // [rows, kTileTokens]
  FloatBuf weights;  // [rows, D / 16, kTileTokens] p * value scale per channel group and token
  FloatBuf k_tile, v_tile, s_buf, z_buf, vs, vz;
  // [D] the current key group's scales and zeros (folded keys).  Kept apart from
  // s_buf / z_buf, which dequant_tile overwrites for values, because the key
  // outlier correction of every later tile of the group still reads them.
  FloatBuf ks, kz;
  FloatBuf meta_tmp;  // [2, kTileTokens, D / 16] a value tile's scales and zeros as stored
  FloatBuf spare;     // [4, D] keys of a partial block of four
  int64_t* pos;       // [rows] position of each query row
  int64_t window;     // sliding window (0: none)
  float softcap;      // logit soft-cap (0: none)
#if defined(__AVX512VNNI__)
  WeightLimbs wlimbs;  // folded value weights of four rows as int8 limbs (packed values)
#elif defined(__AVX2__)
  WeightLimbs16 wlimbs;  // the same as int16 limbs (attention_int_values_avx2.h)
#endif

  TaskState(int64_t rows_, int64_t D_, int64_t window_, float softcap_, int value_limbs)
      : rows(rows_), D(D_), q(rows_ * D_), qk(rows_ * D_), kbias(rows_), acc(rows_ * D_), zacc(rows_ * (D_ / 16)),
        m(rows_), l(rows_), scores(rows_ * kTileTokens), weights(rows_ * kTileTokens * (D_ / 16)),
        k_tile(kTileTokens * D_), v_tile(kTileTokens * D_), s_buf(D_), z_buf(D_), vs(kTileTokens * (D_ / 16)),
        vz(kTileTokens * (D_ / 16)), ks(D_), kz(D_), meta_tmp(2 * kTileTokens * (D_ / 16)), spare(4 * D_),
        pos(new int64_t[size_t(rows_)]), window(window_), softcap(softcap_)
#if defined(__AVX512VNNI__) || defined(__AVX2__)
        ,
        wlimbs(D_ / 16, value_limbs)
#endif
  {
    (void)value_limbs;
  }
  ~TaskState() { delete[] pos; }
  TaskState(const TaskState&) = delete;
  TaskState& operator=(const TaskState&) = delete;

  void reset() {
    fill_f(acc.p, rows * D, 0.f);
    fill_f(zacc.p, rows * (D / 16), 0.f);
    fill_f(m.p, rows, kNegInf);
    fill_f(l.p, rows, 0.f);
  }

  // scores[r, j] = k_query_r . k_j (+ k_bias_r) for the n keys of a tile.
  void compute_scores(const Tile& t, int64_t n) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const float* qr[4];
      for (int i = 0; i < 4; ++i) qr[i] = t.k_query + min_of(r0 + i, rows - 1) * D;
      for (int64_t j0 = 0; j0 < n; j0 += 4) {
        float s[16];
        if (j0 + 4 <= n) {
          dot4x4(qr, t.k + j0 * D, D, s);
        } else {  // last partial block: repeat the last key
          const float* kr[4];
          float* kb = spare.p;
          for (int j = 0; j < 4; ++j) kr[j] = t.k + min_of(j0 + j, n - 1) * D;
          for (int j = 0; j < 4; ++j) std::memcpy(kb + j * D, kr[j], size_t(D) * sizeof(float));
          dot4x4(qr, kb, D, s);
        }
        for (int i = 0; i < 4 && r0 + i < rows; ++i)
          for (int j = 0; j < 4 && j0 + j < n; ++j)
            scores.p[(r0 + i) * kTileTokens + j0 + j] = s[4 * i + j] + (t.k_bias ? t.k_bias[r0 + i] : 0.f);
      }
    }
  }

  // Online softmax over the tile's scores (causal), then acc += p . V.
  void update(const Tile& t, int64_t n, int64_t first_pos) {
    const int64_t nb = t.v_scale ? t.nb : 1, G = t.v_scale ? t.group : D;
    int64_t visible[4];
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int R = int(min_of<int64_t>(4, rows - r0));
      float* acc_rows[4];
      const float* w_rows[4];
      int64_t vis_max = 0;
      for (int i = 0; i < R; ++i) {
        const int64_t r = r0 + i;
        float* sr = scores.p + r * kTileTokens;
        visible[i] = clamp_of<int64_t>(pos[r] - first_pos + 1, 0, n);  // causal mask: keys [0, visible)
        // Sliding window: keys [0, hidden) of the tile are older than the row's window.
        const int64_t hidden = window > 0 ? clamp_of<int64_t>(pos[r] - window + 1 - first_pos, 0, visible[i]) : 0;
        vis_max = max_of(vis_max, visible[i]);
        if (softcap > 0.f)
          for (int64_t j = 0; j < visible[i]; ++j) sr[j] = softcap * tanh_f(sr[j] / softcap);
        const float tile_max = max_range(sr + hidden, visible[i] - hidden);
        const bool finite = all_finite(sr + hidden, visible[i] - hidden);
        const float m_new = max_f(m.p[r], tile_max);
        const float alpha = m_new == kNegInf ? 1.f : exp_nonpos(m.p[r] - m_new);
        exp_shifted(sr, n, hidden, visible[i], m_new);
        const float sum = sum_f(sr, n);
        float* ar = acc.p + r * D;
        if (alpha != 1.f) {
          for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
          for (int64_t b = 0; b < D / 16; ++b) zacc.p[r * (D / 16) + b] *= alpha;
        }
        // A NaN/Inf score (NaN/Inf in q or in the tail) makes the row NaN, as
        // plain attention would, instead of a silently ignored key.
        l.p[r] = finite ? l.p[r] * alpha + sum : kQuietNaN;
        m.p[r] = m_new;
        acc_rows[i] = ar;
        if (t.v_scale) {  // fold the values' per-token scales into the weights, their zeros into zacc
          float* w = weights.p + r * kTileTokens * (D / 16);
          float* za = zacc.p + r * (D / 16);
          for (int64_t b = 0; b < nb; ++b) {
            const float* vs_b = t.v_scale + b * kTileTokens;
            float* w_b = w + b * kTileTokens;
            for (int64_t j = 0; j < n; ++j) w_b[j] = sr[j] * vs_b[j];
            za[b] += dot_f(sr, t.v_zero + b * kTileTokens, n);
          }
#if defined(__AVX512VNNI__) || defined(__AVX2__)
          if (t.v_codes) wlimbs.set(i, w, nb, visible[i]);  // (tokens past the row's visible ones: zero limbs)
#endif
          w_rows[i] = w;
        } else {
          w_rows[i] = sr;
        }
      }
      if (vis_max == 0) continue;
#if defined(__AVX512VNNI__) || defined(__AVX2__)
      if (t.v_codes) {
        pv_int_rows(R, t.v_bits, acc_rows, wlimbs, G, t.v_codes, t.v_row_bytes, vis_max, D);
        continue;
      }
#endif
      pv_rows(R, acc_rows, w_rows, t.v_scale ? kTileTokens : 0, G, t.v, vis_max, D, D);
    }
  }
};

// Folded keys: qk = q * scale and kbias = q . zero of key group g.
template <typename Cache>
void load_key_group(const Cache& c, int64_t bh, int64_t g, TaskState& st) {
  using Meta = std::remove_cv_t<std::remove_pointer_t<decltype(c.scale)>>;
  const int64_t D = st.D, e0 = c.meta_index(bh, g, 0);
  Rows<Meta>::widen(c.scale + e0, D, st.ks.p);
  Rows<Meta>::widen(c.zero + e0, D, st.kz.p);
  for (int64_t r = 0; r < st.rows; ++r) {
    const float* q = st.q.p + r * D;
    float* qk = st.qk.p + r * D;
    for (int64_t d = 0; d < D; ++d) qk[d] = q[d] * st.ks.p[d];
    st.kbias.p[r] = dot_f(q, st.kz.p, D);
  }
}

// Folded keys: scores saw code*scale+zero at outlier positions; add q * (exact - that).
template <typename Cache>
void correct_key_outliers(const Cache& c, int64_t bh, const GroupCursor<Cache>& cur, int64_t t0, int64_t t1,
                          TaskState& st) {
  const int k = c.num_outliers();
  const int64_t D = st.D;
  if (k == 0) return;
  const int64_t g = c.meta_index(bh, cur.group(), 0);
  for (int64_t ch = 0; ch < D; ++ch)
    for (int slot = 0; slot < k; ++slot) {
      const int64_t t = cur.start() + c.outlier_pos(g + ch, slot);
      // A group with fewer entries than slots repeats its last slot (nq_format.h):
      // correct each position once.
      if (t < t0 || t >= t1 || c.repeated_slot(g + ch, slot)) continue;
      const float approx = float(c.code(bh, t, ch)) * st.ks.p[ch] + st.kz.p[ch];
      const float delta = c.outlier_value(g + ch, slot) - approx;
      for (int64_t r = 0; r < st.rows; ++r) st.scores.p[r * kTileTokens + (t - t0)] += st.q.p[r * D + ch] * delta;
    }
}

// Folded values: the per-group scales and zeros of tokens [t0, t1) into vs / vz,
// and their codes as floats into v_tile unless the kernel reads them packed.
template <typename Cache>
void load_value_rows(const Cache& c, int64_t bh, int64_t t0, int64_t t1, bool packed, TaskState& st) {
  using Meta = std::remove_cv_t<std::remove_pointer_t<decltype(c.scale)>>;
  const NQDims& d = c.dims;
  const int64_t D = st.D, nb = d.meta_b();
  for (int64_t t = t0; !packed && t < t1; ++t) codes_row_bits(d.bits, c.code_row(bh, t), D, st.v_tile.p + (t - t0) * D);
  // The tile's scales and zeros, [t0, t1) x nb in memory, into [nb, kTileTokens]
  // (converted in one vectorized pass each, then transposed).
  const int64_t e0 = c.meta_index(bh, t0, 0), n = t1 - t0;
  Rows<Meta>::widen(c.scale + e0, n * nb, st.meta_tmp.p);
  Rows<Meta>::widen(c.zero + e0, n * nb, st.meta_tmp.p + n * nb);
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t j = 0; j < n; ++j) {
      st.vs.p[b * kTileTokens + j] = st.meta_tmp.p[j * nb + b];
      st.vz.p[b * kTileTokens + j] = st.meta_tmp.p[n * nb + j * nb + b];
    }
}

// Folded values: acc saw code*scale+zero at outlier positions; add p * (exact - that).
template <typename Cache>
void correct_value_outliers(const Cache& c, int64_t bh, int64_t t0, int64_t t1, TaskState& st) {
  const NQDims& d = c.dims;
  const int k = d.num_outliers;
  const int64_t D = st.D, nb = d.meta_b(), G = d.group_size;
  if (k == 0) return;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = 0; b < nb; ++b)
      for (int slot = 0; slot < k; ++slot) {
        const int64_t m = c.meta_index(bh, t, b), ch = b * G + c.outlier_pos(m, slot);
        if (ch >= D || c.repeated_slot(m, slot)) continue;  // past the row, or a repeated slot
        const int64_t j = t - t0;
        const float approx = float(c.code(bh, t, ch)) * st.vs.p[b * kTileTokens + j] + st.vz.p[b * kTileTokens + j];
        const float delta = c.outlier_value(m, slot) - approx;
        for (int64_t r = 0; r < st.rows; ++r) st.acc.p[r * D + ch] += st.scores.p[r * kTileTokens + j] * delta;
      }
}

}  // namespace

template <typename Meta, typename Val>
void attention_tasks(const CpuAttentionParams<Meta, Val>& p, int64_t splits, float* partials, int64_t begin,
                     int64_t end) {
  using Cache = CompressedKV<Meta, Val>;
  note_kernel_isa(kThisIsa);
  const int64_t D = p.head_dim, rows = p.rows_per_kv_head();
  // Limbs of the value weights: int8 (AVX512-VNNI, attention_int_values.h) two for bf16
  // queries, three for fp16 / fp32; int16 (AVX2, attention_int_values_avx2.h) one or two.
  const int value_limbs = (p.query_mantissa_bits <= 8 ? 2 : 3) - (kThisIsa == CpuIsa::kAvx2 ? 1 : 0);
  TaskState st(rows, D, p.window, p.softcap, value_limbs);
  FloatBuf rotated(2 * kTileTokens * D);
  // Scales folded out of the inner loops: per-channel key scales into the
  // queries (once per group), per-token value scales into the weights.
  const bool fold_k = p.k.dims.axis == GroupAxis::kTokens;
#if defined(__AVX512VNNI__)
  // Per-channel keys of 2, 4 or 8 bits: integer scores on the packed codes.
  const bool int_k = fold_k && p.k.dims.bits != 3;
  QueryLimbs limbs(int_k ? rows : 0, D, p.k.dims.bits, p.query_mantissa_bits <= 8 ? 2 : 3);  // (a minimum)
#elif defined(__AVX2__)
  // The same with int16 limbs for vpmaddwd (attention_int_keys_avx2.h).
  const bool int_k = fold_k && p.k.dims.bits != 3;
  QueryLimbs16 limbs(int_k ? rows : 0, D, p.k.dims.bits, p.query_mantissa_bits <= 8 ? 1 : 2);  // (a minimum)
#else
  const bool int_k = false;
#endif
  const bool fold_v = p.v.dims.axis == GroupAxis::kChannels && p.v.dims.group_size % 16 == 0;
  const int64_t k_rb = p.k.dims.packed_row_bytes(), v_rb = p.v.dims.packed_row_bytes();
#if defined(__AVX512VNNI__) || defined(__AVX2__)
  // Per-token value groups of 2, 4 or 8 bits: integer p . V on the packed codes.
  const bool packed_v = fold_v && p.v.dims.bits != 3;
#else
  const bool packed_v = false;
#endif
  note_value_product(packed_v ? ValueProduct::kInteger : fold_v ? ValueProduct::kFloat : ValueProduct::kNone);
  note_key_product(int_k ? ValueProduct::kInteger : fold_k ? ValueProduct::kFloat : ValueProduct::kNone);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t s = task % splits, bh = task / splits, b = bh / p.kv_heads, h = bh % p.kv_heads;
    const int64_t L = p.seq_len(b), comp = p.compressed_len(b), sink = p.sink_len(b);
    // Split s covers key positions [lo, hi), whole tiles from the first position
    // any query sees (keys before a sliding window are never read).
    const int64_t first = p.first_visible(b);
    const int64_t span = ceil_div(ceil_div(L - first, splits), kTileTokens) * kTileTokens;
    const int64_t lo = min_of(L, first + s * span), hi = min_of(L, lo + span);
    st.reset();
    const uint8_t* k_codes = p.k.code_row(bh, 0);
    const uint8_t* v_codes = p.v.code_row(bh, 0);
    for (int64_t r = 0; r < rows; ++r) {  // row r: query r % q_len of query head q_head(h, r)
      const float* src = p.q_row(b, h, r);
      float* dst = st.q.p + r * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.scale;
      if (p.rotation_signs) hadamard_rotate_rows(dst, dst, 1, D, p.rotation_signs, false);
      st.pos[r] = p.query_position(b, r % p.q_len);
    }
    // Full-precision keys/values (sinks, tail) at positions [from, to): rows
    // [B, Hkv, capacity, D] whose row 0 is position `first` (consecutive rows:
    // the CPU glue makes them contiguous), rotated on the fly when the cache is.
    auto attend_full_precision = [&](const DenseKV<float>& rows_kv, int64_t first, int64_t from, int64_t to) {
      for (int64_t t = from; t < to; t += kTileTokens) {
        const int64_t n = min_of(kTileTokens, to - t);
        const float* k = rows_kv.k.row(b, h, t - first);
        const float* v = rows_kv.v.row(b, h, t - first);
        if (p.rotation_signs) {
          hadamard_rotate_rows(k, rotated.p, n, D, p.rotation_signs, false);
          hadamard_rotate_rows(v, rotated.p + kTileTokens * D, n, D, p.rotation_signs, false);
          k = rotated.p, v = rotated.p + kTileTokens * D;
        }
        Tile tile;
        tile.k = k, tile.k_query = st.q.p, tile.v = v;
        st.compute_scores(tile, n);
        st.update(tile, n, t);
      }
    };
    attend_full_precision(p.sink, 0, lo, min_of(hi, sink));
    // Compressed tokens [c_lo, c_hi) at positions sink + t, in tiles that never straddle a group.
    const int64_t c_lo = max_of<int64_t>(lo - sink, 0), c_hi = min_of(hi - sink, comp);
    GroupCursor<Cache> kc(p.k, bh), vc(p.v, bh);
    int64_t k_group_loaded = -1;
    for (int64_t t = c_lo; t < c_hi;) {
      kc.seek(t), vc.seek(t);
      const int64_t te = min_of_list(t + kTileTokens, c_hi, kc.end(), vc.end());
      const int64_t n = te - t;
      Tile tile;
      if (fold_k) {
        if (kc.group() != k_group_loaded) {
          load_key_group(p.k, bh, kc.group(), st);
#if defined(__AVX512VNNI__) || defined(__AVX2__)
          if (int_k) limbs.set(st.qk.p, D);
#endif
          k_group_loaded = kc.group();
        }
        if (int_k) {
#if defined(__AVX512VNNI__) || defined(__AVX2__)
          int_scores(limbs, p.k.dims.bits, k_codes + t * k_rb, k_rb, n, st.kbias.p, st.scores.p);
#endif
        } else {
          for (int64_t j = 0; j < n; ++j)
            codes_row_bits(p.k.dims.bits, k_codes + (t + j) * k_rb, D, st.k_tile.p + j * D);
          tile.k = st.k_tile.p, tile.k_query = st.qk.p, tile.k_bias = st.kbias.p;
          st.compute_scores(tile, n);
        }
        correct_key_outliers(p.k, bh, kc, t, te, st);
      } else {
        dequant_tile(p.k, bh, kc, t, te, st.k_tile.p, st.s_buf.p, st.z_buf.p);
        tile.k = st.k_tile.p, tile.k_query = st.q.p;
        st.compute_scores(tile, n);
      }
      if (fold_v) {
        load_value_rows(p.v, bh, t, te, packed_v, st);
        tile.v = st.v_tile.p, tile.v_scale = st.vs.p, tile.v_zero = st.vz.p;
        if (packed_v) tile.v_codes = v_codes + t * v_rb, tile.v_row_bytes = v_rb, tile.v_bits = p.v.dims.bits;
        tile.nb = p.v.dims.meta_b(), tile.group = p.v.dims.group_size;
        st.update(tile, n, sink + t);
        correct_value_outliers(p.v, bh, t, te, st);
      } else {
        dequant_tile(p.v, bh, vc, t, te, st.v_tile.p, st.s_buf.p, st.z_buf.p);
        tile.v = st.v_tile.p;
        st.update(tile, n, sink + t);
      }
      t = te;
    }
    attend_full_precision(p.tail, sink + comp, max_of(lo, sink + comp), hi);
    float* out = partials + task * partial_floats(p);
    for (int64_t r = 0; r < rows; ++r) {
      if (fold_v)  // the values' zeros, summed per channel group
        for (int64_t d = 0; d < D; ++d) st.acc.p[r * D + d] += st.zacc.p[r * (D / 16) + d / p.v.dims.group_size];
      std::memcpy(out + r * (D + 2), st.acc.p + r * D, size_t(D) * sizeof(float));
      out[r * (D + 2) + D] = st.m.p[r];
      out[r * (D + 2) + D + 1] = st.l.p[r];
    }
  }
}

#define NEXUSKV_INSTANTIATE_ATTENTION(Meta, Val) \
  template void attention_tasks<Meta, Val>(const CpuAttentionParams<Meta, Val>&, int64_t, float*, int64_t, int64_t);
NEXUSKV_FOR_EACH_FLOAT_PAIR(NEXUSKV_INSTANTIATE_ATTENTION)

}  // namespace nexuskv::core::NEXUSKV_ISA
