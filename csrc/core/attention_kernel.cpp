// The fused attention inner loop, compiled once per instruction set (the
// namespace NEXUSKV_ISA is generic, avx2 or avx512; CMake sets the flags) and
// picked at run time by attention.cpp.  Per task (batch, kv head, key split):
//   for each tile of <= kTileTokens keys that stays inside one quantization
//   group/segment of K and of V:
//     dequantize the K and V rows into float scratch (codes -> code*scale+zero,
//     then the exact outliers), scores = q . K for every query row of the GQA
//     group, causal mask, online softmax, acc += p . V.
// Layout and math of the compressed rows: nq_format.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "nexuskv/core/attention.h"
#include "nexuskv/core/half.h"

#ifndef NEXUSKV_ISA
#define NEXUSKV_ISA generic
#endif

namespace nexuskv::core::NEXUSKV_ISA {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for softmax arguments x <= 0, branch-free so that loops over it
// vectorize (std::exp does not without -ffast-math).  Cody-Waite reduction
// x = n*ln2 + r, |r| <= ln2/2, degree-6 Taylor polynomial: relative error
// < 2e-7.  Returns exactly 0 below -87 (and for -inf).
inline float exp_nonpos(float x) {
  const float xc = x > -87.f ? x : -87.f;
  const float n = (xc * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = (xc - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const float two_n = bits_float(uint32_t(int32_t(n) + 127) << 23);
  return x < -87.f ? 0.f : p * two_n;
}

inline float load_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// dst[c] = code(c) * s[c] + z[c] for one packed row, c < D (D % 16 == 0).
template <int kBits>
void dequant_row(const uint8_t* __restrict packed, int64_t D, const float* __restrict s,
                 const float* __restrict z, float* __restrict dst) {
  constexpr int kChunk = kBits == 8 ? 16 : kBits == 4 ? 32 : 64;
  constexpr int kChunkBytes = kBits == 3 ? 24 : 16;
  constexpr int kLowBits = kBits == 3 ? 2 : kBits;
  constexpr int kPlanes = 8 / kLowBits;
  constexpr uint8_t kMask = uint8_t((1u << kLowBits) - 1u);
  for (int64_t base = 0; base < D; base += kChunk, packed += kChunkBytes) {
    const int planes = int(std::min<int64_t>(kPlanes, (D - base) / 16));
    for (int j = 0; j < planes; ++j) {
      const int64_t c0 = base + 16 * j;
      for (int l = 0; l < 16; ++l) {
        uint32_t code = (packed[l] >> (kLowBits * j)) & kMask;
        if constexpr (kBits == 3) code |= ((uint32_t(packed[16 + (l & 7)]) >> (2 * j + (l >> 3))) & 1u) << 2;
        dst[c0 + l] = float(code) * s[c0 + l] + z[c0 + l];
      }
    }
  }
}

void dequant_row_bits(int bits, const uint8_t* packed, int64_t D, const float* s, const float* z, float* dst) {
  switch (bits) {
    case 2: dequant_row<2>(packed, D, s, z, dst); break;
    case 3: dequant_row<3>(packed, D, s, z, dst); break;
    case 4: dequant_row<4>(packed, D, s, z, dst); break;
    default: dequant_row<8>(packed, D, s, z, dst); break;
  }
}

// Walks the quantization groups of one (b, h) row of a compressed view along
// the tokens: which group holds token t and where it ends.
class GroupCursor {
 public:
  GroupCursor(const CompressedView& c, int64_t bh) : c_(c), bh_(bh) {}

  // Positions the cursor on the group holding token t (t only grows between calls).
  void seek(int64_t t) {
    const NQDims& d = c_.dims;
    if (d.axis == GroupAxis::kChannels) {
      group_ = -1, start_ = t, end_ = std::numeric_limits<int64_t>::max();
    } else if (!c_.segment_starts) {
      group_ = t / d.group_size, start_ = group_ * d.group_size, end_ = start_ + d.group_size;
    } else {
      const int32_t* starts = c_.segment_starts + bh_ * c_.meta_a;
      if (group_ < 0 || t < start_) group_ = 0;
      while (group_ + 1 < c_.meta_a && starts[group_ + 1] <= t) ++group_;
      start_ = starts[group_];
      end_ = group_ + 1 < c_.meta_a ? starts[group_ + 1] : d.tokens;
    }
  }
  int64_t group() const { return group_; }
  int64_t start() const { return start_; }
  int64_t end() const { return end_; }

 private:
  const CompressedView& c_;
  int64_t bh_;
  int64_t group_ = -1, start_ = 0, end_ = 0;
};

// Dequantizes tokens [t0, t1) of row bh (inside the cursor's group when the
// grouping runs along tokens) into dst [t1 - t0, D], outliers included.
void dequant_tile(const CompressedView& c, int64_t bh, const GroupCursor& cur, int64_t t0, int64_t t1,
                  float* __restrict dst, float* __restrict s_buf, float* __restrict z_buf) {
  const NQDims& d = c.dims;
  const int64_t D = d.head_dim, rb = d.packed_row_bytes(), Bm = d.meta_b(), k = d.num_outliers;
  const uint8_t* codes = c.codes + (bh * d.tokens) * rb;
  if (d.axis == GroupAxis::kTokens) {
    const int64_t g = (bh * c.meta_a + cur.group()) * Bm;  // first meta entry of the group
    for (int64_t ch = 0; ch < D; ++ch) s_buf[ch] = load_float(c.scale, c.meta_dtype, g + ch);
    for (int64_t ch = 0; ch < D; ++ch) z_buf[ch] = load_float(c.zero, c.meta_dtype, g + ch);
    for (int64_t t = t0; t < t1; ++t) dequant_row_bits(d.bits, codes + t * rb, D, s_buf, z_buf, dst + (t - t0) * D);
    for (int64_t ch = 0; k && ch < D; ++ch)
      for (int64_t slot = 0; slot < k; ++slot) {
        const int64_t e = (g + ch) * k + slot;
        const int64_t t = cur.start() + c.outlier_idx[e];
        if (t >= t0 && t < t1) dst[(t - t0) * D + ch] = load_float(c.outlier_val, c.val_dtype, e);
      }
  } else {
    const int64_t G = d.group_size;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = (bh * c.meta_a + t) * Bm;  // meta entries of token t
      for (int64_t b = 0; b < Bm; ++b) {
        const float s = load_float(c.scale, c.meta_dtype, g + b), z = load_float(c.zero, c.meta_dtype, g + b);
        const int64_t c1 = std::min(D, (b + 1) * G);
        for (int64_t ch = b * G; ch < c1; ++ch) s_buf[ch] = s, z_buf[ch] = z;
      }
      float* row = dst + (t - t0) * D;
      dequant_row_bits(d.bits, codes + t * rb, D, s_buf, z_buf, row);
      for (int64_t b = 0; k && b < Bm; ++b)
        for (int64_t slot = 0; slot < k; ++slot) {
          const int64_t e = (g + b) * k + slot, ch = b * G + c.outlier_idx[e];
          if (ch < D) row[ch] = load_float(c.outlier_val, c.val_dtype, e);
        }
    }
  }
}

// out[i] = q_i . k for four query rows against one key row (D % 16 == 0).
inline void dot4(const float* q0, const float* q1, const float* q2, const float* q3, const float* __restrict k,
                 int64_t D, float* out) {
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 kv = _mm512_loadu_ps(k + d);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + d), kv, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q1 + d), kv, a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(q2 + d), kv, a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(q3 + d), kv, a3);
  }
  out[0] = _mm512_reduce_add_ps(a0), out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2), out[3] = _mm512_reduce_add_ps(a3);
#elif defined(__AVX2__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 kv = _mm256_loadu_ps(k + d);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), kv, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d), kv, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + d), kv, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + d), kv, a3);
  }
  auto hsum = [](__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  };
  out[0] = hsum(a0), out[1] = hsum(a1), out[2] = hsum(a2), out[3] = hsum(a3);
#else
  float a[4][8] = {};
  for (int64_t d = 0; d < D; d += 8)
    for (int l = 0; l < 8; ++l) {
      const float kv = k[d + l];
      a[0][l] += q0[d + l] * kv, a[1][l] += q1[d + l] * kv, a[2][l] += q2[d + l] * kv, a[3][l] += q3[d + l] * kv;
    }
  for (int i = 0; i < 4; ++i) {
    float s = 0.f;
    for (int l = 0; l < 8; ++l) s += a[i][l];
    out[i] = s;
  }
#endif
}

// acc[0..D) += sum_j p[j] * v[j*D ..] over n rows, a 16-float slice of acc in
// registers at a time.
inline void accumulate_pv(float* __restrict acc, const float* __restrict p, const float* __restrict v, int64_t n,
                          int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
#if defined(__AVX512F__)
    __m512 a = _mm512_loadu_ps(acc + d0);
    for (int64_t j = 0; j < n; ++j) a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(v + j * D + d0), a);
    _mm512_storeu_ps(acc + d0, a);
#elif defined(__AVX2__)
    __m256 a = _mm256_loadu_ps(acc + d0), b = _mm256_loadu_ps(acc + d0 + 8);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      a = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * D + d0), a);
      b = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * D + d0 + 8), b);
    }
    _mm256_storeu_ps(acc + d0, a), _mm256_storeu_ps(acc + d0 + 8, b);
#else
    float a[16];
    std::memcpy(a, acc + d0, sizeof(a));
    for (int64_t j = 0; j < n; ++j)
      for (int l = 0; l < 16; ++l) a[l] += p[j] * v[j * D + d0 + l];
    std::memcpy(acc + d0, a, sizeof(a));
#endif
  }
}

// Scratch floats of one task: plain new[] and loops only.  This file is
// compiled once per instruction set, so it avoids std:: templates over float
// (std::vector<float>, std::fill, std::max<float>): their instantiations are
// shared symbols, and the linker could hand the AVX copy to portable code.
struct FloatBuf {
  explicit FloatBuf(int64_t n) : p(new float[size_t(n)]) {}
  ~FloatBuf() { delete[] p; }
  FloatBuf(const FloatBuf&) = delete;
  FloatBuf& operator=(const FloatBuf&) = delete;
  float* p;
};

inline float max_f(float a, float b) { return a > b ? a : b; }

inline void fill_f(float* p, int64_t n, float v) {
  for (int64_t i = 0; i < n; ++i) p[i] = v;
}

// Per-task state: the GQA group's query rows and their running softmax.
struct TaskState {
  int64_t rows, D;
  FloatBuf q;        // [rows, D] scaled (and rotated) queries
  FloatBuf acc;      // [rows, D]
  FloatBuf m, l;     // [rows] running max and sum
  FloatBuf scores;   // [rows, kTileTokens]
  FloatBuf k_tile, v_tile, s_buf, z_buf;
  int64_t* pos;      // [rows] position of each query row

  TaskState(int64_t rows_, int64_t D_)
      : rows(rows_), D(D_), q(rows_ * D_), acc(rows_ * D_), m(rows_), l(rows_), scores(rows_ * kTileTokens),
        k_tile(kTileTokens * D_), v_tile(kTileTokens * D_), s_buf(D_), z_buf(D_), pos(new int64_t[size_t(rows_)]) {}
  ~TaskState() { delete[] pos; }

  void reset() {
    fill_f(acc.p, rows * D, 0.f);
    fill_f(m.p, rows, kNegInf);
    fill_f(l.p, rows, 0.f);
  }

  // One tile of n keys at positions first_pos.. (k, v: [n, D] float).
  void attend(const float* k, const float* v, int64_t n, int64_t first_pos) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const float* qr[4];
      for (int i = 0; i < 4; ++i) qr[i] = q.p + std::min(r0 + i, rows - 1) * D;
      for (int64_t j = 0; j < n; ++j) {
        float s[4];
        dot4(qr[0], qr[1], qr[2], qr[3], k + j * D, D, s);
        for (int i = 0; i < 4 && r0 + i < rows; ++i) scores.p[(r0 + i) * kTileTokens + j] = s[i];
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = scores.p + r * kTileTokens;
      const int64_t visible = std::clamp<int64_t>(pos[r] - first_pos + 1, 0, n);  // causal mask
      if (visible == 0) continue;
      float tile_max = kNegInf;
      for (int64_t j = 0; j < visible; ++j) tile_max = max_f(tile_max, sr[j]);
      const float m_new = max_f(m.p[r], tile_max);
      const float alpha = exp_nonpos(m.p[r] - m_new);
      float sum = 0.f;
      for (int64_t j = 0; j < visible; ++j) sr[j] = exp_nonpos(sr[j] - m_new);
      for (int64_t j = 0; j < visible; ++j) sum += sr[j];
      float* ar = acc.p + r * D;
      if (alpha != 1.f)
        for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
      accumulate_pv(ar, sr, v, visible, D);
      l.p[r] = l.p[r] * alpha + sum;
      m.p[r] = m_new;
    }
  }
};

}  // namespace

void attention_tasks_impl(const AttentionProblem& p, int64_t splits, float* partials, int64_t begin, int64_t end) {
  const int64_t D = p.head_dim, group = p.q_heads / p.kv_heads, rows = p.rows_per_task();
  TaskState st(rows, D);
  FloatBuf rotated(2 * kTileTokens * D);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t s = task % splits, bh = task / splits, b = bh / p.kv_heads, h = bh % p.kv_heads;
    const int64_t L = p.seq_len(b), comp = p.compressed_lens[b];
    // Split s covers key positions [lo, hi), whole tiles.
    const int64_t span = ceil_div(ceil_div(L, splits), kTileTokens) * kTileTokens;
    const int64_t lo = std::min(L, s * span), hi = std::min(L, lo + span);
    st.reset();
    for (int64_t gq = 0; gq < group; ++gq)
      for (int64_t i = 0; i < p.q_len; ++i) {
        const int64_t r = gq * p.q_len + i;
        const float* src = p.q + ((b * p.q_heads + h * group + gq) * p.q_len + i) * D;
        float* dst = st.q.p + r * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.scale;
        if (p.rotation_signs) hadamard_rotate_rows(dst, dst, 1, D, p.rotation_signs, false);
        st.pos[r] = L - p.q_len + i;
      }
    // Compressed keys [lo, min(hi, comp)), in tiles that never straddle a group.
    GroupCursor kc(p.k, bh), vc(p.v, bh);
    for (int64_t t = lo; t < std::min(hi, comp);) {
      kc.seek(t), vc.seek(t);
      const int64_t te = std::min({t + kTileTokens, std::min(hi, comp), kc.end(), vc.end()});
      dequant_tile(p.k, bh, kc, t, te, st.k_tile.p, st.s_buf.p, st.z_buf.p);
      dequant_tile(p.v, bh, vc, t, te, st.v_tile.p, st.s_buf.p, st.z_buf.p);
      st.attend(st.k_tile.p, st.v_tile.p, te - t, t);
      t = te;
    }
    // Full-precision tail: positions comp + j, rotated on the fly when the cache is.
    for (int64_t t = std::max(lo, comp); t < hi; t += kTileTokens) {
      const int64_t n = std::min(kTileTokens, hi - t);
      const int64_t off = (bh * p.tail_capacity + (t - comp)) * D;
      const float* k = p.k_tail + off;
      const float* v = p.v_tail + off;
      if (p.rotation_signs) {
        hadamard_rotate_rows(k, rotated.p, n, D, p.rotation_signs, false);
        hadamard_rotate_rows(v, rotated.p + kTileTokens * D, n, D, p.rotation_signs, false);
        k = rotated.p, v = rotated.p + kTileTokens * D;
      }
      st.attend(k, v, n, t);
    }
    float* out = partials + task * partial_floats(p);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(out + r * (D + 2), st.acc.p + r * D, size_t(D) * sizeof(float));
      out[r * (D + 2) + D] = st.m.p[r];
      out[r * (D + 2) + D + 1] = st.l.p[r];
    }
  }
}

}  // namespace nexuskv::core::NEXUSKV_ISA
