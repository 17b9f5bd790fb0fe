// NQ compress / decompress kernels of the torch-free core (format in
// nq_format.h).  Each task converts its block to float32 once, then runs
// min/max, outlier selection and quantization over contiguous float rows so
// that the inner loops vectorize.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "nexuskv/core/nq_kernels.h"

namespace nexuskv::core {
namespace {

// Loads x[t0 + t, 0..D) for t < nt into dst [nt, D] as float32 and reports
// whether any value was NaN or Inf.
template <typename In>
bool load_block(const StridedRows<In>& x, int64_t row, int64_t t0, int64_t nt, int64_t D, float* dst) {
  uint32_t non_finite = 0;
  const In* base = x.data + x.row_offset[row] + t0 * x.stride_t;
  for (int64_t t = 0; t < nt; ++t) {
    const In* src = base + t * x.stride_t;
    float* out = dst + t * D;
    if (x.stride_d == 1) {
      for (int64_t d = 0; d < D; ++d) out[d] = to_float(src[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) out[d] = to_float(src[d * x.stride_d]);
    }
    for (int64_t d = 0; d < D; ++d) non_finite |= uint32_t((float_bits(out[d]) & 0x7f800000u) == 0x7f800000u);
  }
  return non_finite != 0;
}

// Scale and zero of one group, already rounded into the meta dtype.
template <typename Meta>
struct GroupQuant {
  Meta scale_m, zero_m;
  float scale, zero, inv_scale;
};

template <typename Meta>
inline GroupQuant<Meta> make_group_quant(float mn, float mx, int qmax, bool* overflow) {
  GroupQuant<Meta> g;
  g.zero_m = round_down<Meta>(mn);
  g.zero = to_float(g.zero_m);
  g.scale_m = round_up<Meta>((mx - g.zero) / float(qmax));
  g.scale = to_float(g.scale_m);
  if (!std::isfinite(g.zero) || !std::isfinite(g.scale)) *overflow = true;
  g.inv_scale = g.scale > 0.f ? 1.f / g.scale : 0.f;
  return g;
}

inline uint8_t quantize(float v, float zero, float inv_scale, float qmax) {
  // v >= zero for dense entries; the clamp covers outliers and float error.
  float c = (v - zero) * inv_scale + 0.5f;
  c = std::min(std::max(c, 0.f), qmax);
  return uint8_t(int(c));
}

struct Ranked {
  float v;
  int pos;
};
inline bool ranked_less(const Ranked& a, const Ranked& b) { return a.v < b.v || (a.v == b.v && a.pos < b.pos); }

// Chooses the k entries of vals[0..n) (read with stride) whose removal shrinks
// max - min the most: i from the bottom and k - i from the top, best i.  The
// ranking uses (value, position) so that the bottom and top sets never share
// an entry.  Writes the sorted positions to pos[0..k) (repeating the last one
// when n <= k) and the min/max of what is left (0, 0 when nothing is).
void select_outliers(const float* vals, int64_t stride, int n, int k, uint8_t* pos, float* mn, float* mx) {
  if (n <= k) {
    for (int s = 0; s < k; ++s) pos[s] = uint8_t(std::min(s, n - 1));
    *mn = *mx = 0.f;
    return;
  }
  Ranked low[kMaxGroupSize + 1], high[kMaxGroupSize + 1];  // k+1 smallest ascending, k+1 largest descending
  int nl = 0, nh = 0;
  for (int i = 0; i < n; ++i) {
    const Ranked e{vals[i * stride], i};
    if (nl < k + 1 || ranked_less(e, low[nl - 1])) {
      int j = std::min(nl, k);
      for (; j > 0 && ranked_less(e, low[j - 1]); --j) low[j] = low[j - 1];
      low[j] = e;
      nl = std::min(nl + 1, k + 1);
    }
    if (nh < k + 1 || ranked_less(high[nh - 1], e)) {
      int j = std::min(nh, k);
      for (; j > 0 && ranked_less(high[j - 1], e); --j) high[j] = high[j - 1];
      high[j] = e;
      nh = std::min(nh + 1, k + 1);
    }
  }
  int best = 0;
  float best_range = std::numeric_limits<float>::infinity();
  for (int i = 0; i <= k; ++i) {
    const float range = high[k - i].v - low[i].v;
    if (range < best_range) best_range = range, best = i;
  }
  *mn = low[best].v;
  *mx = high[k - best].v;
  int s = 0;
  for (int i = 0; i < best; ++i) pos[s++] = uint8_t(low[i].pos);
  for (int i = 0; i < k - best; ++i) pos[s++] = uint8_t(high[i].pos);
  std::sort(pos, pos + k);
}

inline void min_max(const float* v, int64_t n, float* mn, float* mx) {
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  for (int64_t i = 0; i < n; ++i) lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
  *mn = lo, *mx = hi;
}

template <typename In, typename Meta>
void compress_token_groups(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out,
                           int64_t task_begin, int64_t task_end, CompressStatus* status) {
  const int64_t D = d.head_dim, G = d.group_size, A = d.meta_a(), rb = d.packed_row_bytes();
  const int k = d.num_outliers;
  const float qmax = float((1 << d.bits) - 1);
  std::vector<float> block(static_cast<size_t>(G * D)), mn(static_cast<size_t>(D)), mx(static_cast<size_t>(D)), zero(static_cast<size_t>(D)), inv(static_cast<size_t>(D));
  std::vector<uint8_t> codes(static_cast<size_t>(D));
  bool overflow = false;
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t n = task / A, a = task % A, t0 = a * G;
    const int64_t nt = std::min(G, d.tokens - t0);
    if (load_block(x, n, t0, nt, D, block.data())) status->non_finite_input = true;
    const int64_t g0 = (n * A + a) * D;  // first group (channel 0) of this token group
    if (k == 0) {
      std::fill(mn.begin(), mn.end(), std::numeric_limits<float>::infinity());
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < nt; ++t) {
        const float* r = block.data() + t * D;
        for (int64_t c = 0; c < D; ++c) mn[c] = std::min(mn[c], r[c]), mx[c] = std::max(mx[c], r[c]);
      }
    } else {
      const In* base = x.data + x.row_offset[n] + t0 * x.stride_t;
      for (int64_t c = 0; c < D; ++c) {
        uint8_t* pos = out.outlier_idx + (g0 + c) * k;
        In* val = out.outlier_val + (g0 + c) * k;
        select_outliers(block.data() + c, D, int(nt), k, pos, &mn[c], &mx[c]);
        for (int s = 0; s < k; ++s) val[s] = base[pos[s] * x.stride_t + c * x.stride_d];
      }
    }
    for (int64_t c = 0; c < D; ++c) {
      const GroupQuant<Meta> q = make_group_quant<Meta>(mn[c], mx[c], int(qmax), &overflow);
      out.scale[g0 + c] = q.scale_m;
      out.zero[g0 + c] = q.zero_m;
      zero[c] = q.zero;
      inv[c] = q.inv_scale;
    }
    for (int64_t t = 0; t < nt; ++t) {
      const float* r = block.data() + t * D;
      for (int64_t c = 0; c < D; ++c) codes[c] = quantize(r[c], zero[c], inv[c], qmax);
      pack_row(codes.data(), D, d.bits, out.codes + (n * d.tokens + t0 + t) * rb);
    }
  }
  if (overflow) status->meta_overflow = true;
}

template <typename In, typename Meta>
void compress_channel_groups(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out,
                             int64_t task_begin, int64_t task_end, CompressStatus* status) {
  const int64_t D = d.head_dim, G = d.group_size, B = d.meta_b(), rb = d.packed_row_bytes();
  const int k = d.num_outliers;
  const float qmax = float((1 << d.bits) - 1);
  std::vector<float> row(static_cast<size_t>(D));
  std::vector<uint8_t> codes(static_cast<size_t>(D));
  bool overflow = false;
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t n = task / d.tokens, t = task % d.tokens;
    if (load_block(x, n, t, 1, D, row.data())) status->non_finite_input = true;
    const In* src = x.data + x.row_offset[n] + t * x.stride_t;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t c0 = b * G, nc = std::min(G, D - c0), g = task * B + b;
      float mn, mx;
      if (k == 0) {
        min_max(row.data() + c0, nc, &mn, &mx);
      } else {
        uint8_t* pos = out.outlier_idx + g * k;
        In* val = out.outlier_val + g * k;
        select_outliers(row.data() + c0, 1, int(nc), k, pos, &mn, &mx);
        for (int s = 0; s < k; ++s) val[s] = src[(c0 + pos[s]) * x.stride_d];
      }
      const GroupQuant<Meta> q = make_group_quant<Meta>(mn, mx, int(qmax), &overflow);
      out.scale[g] = q.scale_m;
      out.zero[g] = q.zero_m;
      for (int64_t c = c0; c < c0 + nc; ++c) codes[c] = quantize(row[c], q.zero, q.inv_scale, qmax);
    }
    pack_row(codes.data(), D, d.bits, out.codes + task * rb);
  }
  if (overflow) status->meta_overflow = true;
}

template <typename Meta, typename Out>
void decompress_token_groups(const NQDims& d, const uint8_t* packed, const Meta* scale, const Meta* zero,
                             Out* out, int64_t task_begin, int64_t task_end) {
  const int64_t D = d.head_dim, G = d.group_size, A = d.meta_a(), rb = d.packed_row_bytes();
  std::vector<float> s(static_cast<size_t>(D)), z(static_cast<size_t>(D));
  std::vector<uint8_t> codes(static_cast<size_t>(D));
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t n = task / A, a = task % A, t0 = a * G, nt = std::min(G, d.tokens - t0);
    for (int64_t c = 0; c < D; ++c) s[c] = to_float(scale[task * D + c]), z[c] = to_float(zero[task * D + c]);
    for (int64_t t = t0; t < t0 + nt; ++t) {
      unpack_row(packed + (n * d.tokens + t) * rb, D, d.bits, codes.data());
      Out* o = out + (n * d.tokens + t) * D;
      for (int64_t c = 0; c < D; ++c) o[c] = from_float<Out>(float(codes[c]) * s[c] + z[c]);
    }
  }
}

template <typename Meta, typename Out>
void decompress_channel_groups(const NQDims& d, const uint8_t* packed, const Meta* scale, const Meta* zero,
                               Out* out, int64_t task_begin, int64_t task_end) {
  const int64_t D = d.head_dim, G = d.group_size, B = d.meta_b(), rb = d.packed_row_bytes();
  std::vector<uint8_t> codes(static_cast<size_t>(D));
  for (int64_t task = task_begin; task < task_end; ++task) {  // task = n * T + t
    unpack_row(packed + task * rb, D, d.bits, codes.data());
    Out* o = out + task * D;
    for (int64_t b = 0; b < B; ++b) {
      const float s = to_float(scale[task * B + b]), z = to_float(zero[task * B + b]);
      const int64_t c1 = std::min(D, (b + 1) * G);
      for (int64_t c = b * G; c < c1; ++c) o[c] = from_float<Out>(float(codes[c]) * s + z);
    }
  }
}

}  // namespace

int64_t nq_num_tasks(const NQDims& d) {
  return d.axis == GroupAxis::kTokens ? d.rows * d.meta_a() : d.rows * d.tokens;
}

template <typename In, typename Meta>
void nq_compress_tasks(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out,
                       int64_t task_begin, int64_t task_end, CompressStatus* status) {
  if (d.axis == GroupAxis::kTokens)
    compress_token_groups(d, x, out, task_begin, task_end, status);
  else
    compress_channel_groups(d, x, out, task_begin, task_end, status);
}

template <typename Meta, typename Out>
void nq_decompress_tasks(const NQDims& d, const uint8_t* codes, const Meta* scale, const Meta* zero,
                         Out* out, int64_t task_begin, int64_t task_end) {
  if (d.axis == GroupAxis::kTokens)
    decompress_token_groups(d, codes, scale, zero, out, task_begin, task_end);
  else
    decompress_channel_groups(d, codes, scale, zero, out, task_begin, task_end);
}

template <typename Val, typename Out>
bool nq_scatter_outliers(const NQDims& d, const uint8_t* outlier_idx, const Val* outlier_val, Out* out,
                         int64_t group_begin, int64_t group_end) {
  const int k = d.num_outliers;
  const int64_t A = d.meta_a(), B = d.meta_b(), D = d.head_dim, G = d.group_size;
  bool ok = true;
  for (int64_t g = group_begin; g < group_end; ++g) {
    const int64_t n = g / (A * B), a = (g / B) % A, b = g % B;
    // Group origin and extent in (token, channel) and the step of a position.
    int64_t t0, c0, len, step;
    if (d.axis == GroupAxis::kTokens)
      t0 = a * G, c0 = b, len = std::min(G, d.tokens - t0), step = D;
    else
      t0 = a, c0 = b * G, len = std::min(G, D - c0), step = 1;
    Out* origin = out + (n * d.tokens + t0) * D + c0;
    for (int s = 0; s < k; ++s) {
      const int64_t p = outlier_idx[g * k + s];
      if (p >= len) {
        ok = false;
        continue;
      }
      origin[p * step] = from_float<Out>(to_float(outlier_val[g * k + s]));
    }
  }
  return ok;
}

// Every (input, meta) and (meta, output) pairing of the three float types.
#define NEXUSKV_FOR_EACH_PAIR(M, A) \
  M(A, float, float) M(A, float, half_t) M(A, float, bf16_t)    \
  M(A, half_t, float) M(A, half_t, half_t) M(A, half_t, bf16_t) \
  M(A, bf16_t, float) M(A, bf16_t, half_t) M(A, bf16_t, bf16_t)

#define NEXUSKV_INSTANTIATE_COMPRESS(_, In, Meta)                                                  \
  template void nq_compress_tasks<In, Meta>(const NQDims&, const StridedRows<In>&,                \
                                            const NQBuffers<In, Meta>&, int64_t, int64_t, CompressStatus*);
#define NEXUSKV_INSTANTIATE_DECOMPRESS(_, Meta, Out)                                                  \
  template void nq_decompress_tasks<Meta, Out>(const NQDims&, const uint8_t*, const Meta*, const Meta*, \
                                               Out*, int64_t, int64_t);
#define NEXUSKV_INSTANTIATE_SCATTER(_, Val, Out) \
  template bool nq_scatter_outliers<Val, Out>(const NQDims&, const uint8_t*, const Val*, Out*, int64_t, int64_t);

NEXUSKV_FOR_EACH_PAIR(NEXUSKV_INSTANTIATE_COMPRESS, _)
NEXUSKV_FOR_EACH_PAIR(NEXUSKV_INSTANTIATE_DECOMPRESS, _)
NEXUSKV_FOR_EACH_PAIR(NEXUSKV_INSTANTIATE_SCATTER, _)

}  // namespace nexuskv::core
