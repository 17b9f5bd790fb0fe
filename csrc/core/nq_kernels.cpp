// The NQ compress / decompress kernels of the torch-free core (format in
// nq_format.h), compiled once per instruction set (isa.h) and chosen at run
// time by nq_dispatch.cpp.
//
// Every task works on float32 rows in a small scratch buffer: one pass
// converts the input (and checks it for NaN/Inf, rows.h), then min/max and
// the scale and zero of each group (nq_range.h; outliers first, nq_outliers.h),
// and a fused quantize + pack pass straight into the packed layout
// (nq_layout.h).  Decompression is the mirror: unpack + dequantize into a
// float row, then one conversion into the output dtype.  The loops are written
// over plain arrays, with selects rather than branches, so that the compiler
// vectorizes them.  Results are bit-identical on every ISA: no FMA
// contraction (CMakeLists.txt compiles this file with -ffp-contract=off), the
// same rounding everywhere, except for the payload bits of a NaN produced by
// fp16 output conversion, which compress never lets in.
#include <cstring>
#include <type_traits>

#include "isa.h"
#include "isa_kernels.h"
#include "nexuskv/core/nq_kernels.h"
#include "nexuskv/core/nq_layout.h"
#include "nq_fit.h"
#include "nq_outliers.h"
#include "nq_range.h"
#include "rows.h"

namespace nexuskv::core::NEXUSKV_ISA {
namespace {

NEXUSKV_INLINE void merge(MetaFlags& into, const MetaFlags& f) {
  into.meta_overflow |= f.meta_overflow;
  into.range_overflow |= f.range_overflow;
}

// ---- quantization -------------------------------------------------------------------------

// Codes of n values: zero / inv_scale per value (arrays) or one pair for all.
NEXUSKV_INLINE void quantize_codes(const float* v, const float* zero, const float* inv, float qmax, int64_t n,
                                   uint8_t* codes) {
  for (int64_t i = 0; i < n; ++i) codes[i] = quantize(v[i], zero[i], inv[i], qmax);
}
NEXUSKV_INLINE void quantize_codes(const float* v, float zero, float inv, float qmax, int64_t n, uint8_t* codes) {
  for (int64_t i = 0; i < n; ++i) codes[i] = quantize(v[i], zero, inv, qmax);
}

// x_hat of n codes: scale / zero per value (arrays) or one pair for all.
NEXUSKV_INLINE void dequantize_codes(const uint8_t* codes, const float* s, const float* z, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = float(codes[i]) * s[i] + z[i];
}
NEXUSKV_INLINE void dequantize_codes(const uint8_t* codes, float s, float z, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = float(codes[i]) * s + z;
}

// x_hat = code*scale + zero can pass the output type's largest finite value by
// up to scale/2 (the scale is rounded up) although the input did not: clamp
// there instead of rounding to Inf.
template <typename Out>
NEXUSKV_INLINE void saturate(float* v, int64_t n) {
  constexpr float kMax = std::is_same_v<Out, half_t> ? 65504.f : 3.38953139e38f;
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] > kMax ? kMax : (v[i] < -kMax ? -kMax : v[i]);
}

// The packed layout (nq_layout.h) of one row of codes[0 .. padded_channels(bits, D)),
// for a bit width known per call.
NEXUSKV_INLINE void pack_codes(int bits, const uint8_t* codes, int64_t D, uint8_t* out) {
  layout::with_bits(bits, [&]<int kBits>() { layout::pack_row<kBits>(codes, D, out); });
}
NEXUSKV_INLINE void unpack_codes(int bits, const uint8_t* in, int64_t D, uint8_t* codes) {
  layout::with_bits(bits, [&]<int kBits>() { layout::unpack_row<kBits>(in, D, codes); });
}

// ---- per-task kernels ---------------------------------------------------------------------

// Scratch of one kernel call, allocated once per call (not per task); zeroed,
// which the padding of the code rows relies on.
struct Scratch {
  Buffer<float> f;
  Buffer<uint8_t> b;
  Scratch(int64_t floats, int64_t bytes) : f(floats), b(bytes) {}
};

template <typename In, typename Meta>
NEXUSKV_INLINE void compress_token_groups(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out,
                                          int64_t task_begin, int64_t task_end, CompressStatus* status) {
  const int64_t D = d.head_dim, A = d.meta_a(), rb = d.packed_row_bytes();
  const int64_t Dp = layout::padded_channels(d.bits, D);
  const int k = d.num_outliers;
  const float qmax = float((1 << d.bits) - 1);
  // Without outliers the token group is read twice (min/max, then codes),
  // converting one row at a time: its input stays in cache and the float
  // scratch is one row.  Outlier selection and fitted ranges need the whole
  // group as floats (the fit with a 0/1 mask of its dense entries).
  const int64_t Gmax = d.max_group_tokens();  // G, or up to kMaxGroupSize with DGQ segments
  const bool whole = k > 0 || d.fit_range;
  const int64_t rows_held = whole ? Gmax : 1;
  Scratch scratch(rows_held * D + 4 * D + (d.fit_range ? Gmax * D + fit_work_floats(D) : 0),
                  Dp + D * int64_t(sizeof(In)));
  float* block = scratch.f.data();  // [G, D] (whole groups) or [1, D] float rows
  float *mn = block + rows_held * D, *mx = mn + D, *zero = mx + D, *inv = zero + D;
  float* dense = inv + D;  // [G, D] 1 / 0 per entry (fitted ranges)
  float* fit_work = dense + Gmax * D;
  uint8_t* codes = scratch.b.data();
  In* gather = reinterpret_cast<In*>(codes + Dp);
  LaneLists lanes(k == 0 ? 0 : D, k);
  MetaFlags flags;
  bool bad = false;
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t n = task / A, a = task % A, t0 = d.group_start(n, a);
    const int64_t nt = d.group_end(n, a) - t0;
    const In* base = x.data + x.row_offset[n] + t0 * x.stride_t;
    const int64_t g0 = (n * A + a) * D;  // first group (channel 0) of this token group
    if (k == 0) {
      // Fitted ranges keep every row (block + t * D); otherwise row 0 is reused.
      const int64_t held = whole ? D : 0;
      bad |= load_x_row(x, base, D, block, gather);
      std::memcpy(mn, block, size_t(D) * sizeof(float));
      std::memcpy(mx, block, size_t(D) * sizeof(float));
      for (int64_t t = 1; t < nt; ++t) {
        float* row = block + t * held;
        bad |= load_x_row(x, base + t * x.stride_t, D, row, gather);
        for (int64_t c = 0; c < D; ++c) mn[c] = min_f(mn[c], row[c]), mx[c] = max_f(mx[c], row[c]);
      }
    } else {
      for (int64_t t = 0; t < nt; ++t) bad |= load_x_row(x, base + t * x.stride_t, D, block + t * D, gather);
      uint8_t* pos = out.outlier_idx + g0 * k;
      if (nt > k) {
        select_outliers_lanes(block, D, int(nt), k, lanes, pos, mn, mx);
      } else {
        for (int64_t c = 0; c < D; ++c) select_outliers(block + c, D, int(nt), k, pos + c * k, &mn[c], &mx[c]);
      }
      for (int64_t c = 0; c < D; ++c) {
        In* val = out.outlier_val + (g0 + c) * k;
        for (int s = 0; s < k; ++s) val[s] = base[pos[c * k + s] * x.stride_t + c * x.stride_d];
      }
    }
    merge(flags, make_meta<Meta>(mn, mx, D, qmax, out.scale + g0, out.zero + g0, zero, inv));
    if (d.fit_range) {
      // A group of n <= k entries is all outliers (nothing dense).
      const float all = nt > k ? 1.f : 0.f;
      for (int64_t i = 0; i < nt * D; ++i) dense[i] = all;
      const uint8_t* pos = out.outlier_idx + g0 * k;
      for (int64_t c = 0; c < D && nt > k; ++c)
        for (int s = 0; s < k; ++s) dense[pos[c * k + s] * D + c] = 0.f;
      fit_ranges<Meta>(block, dense, nt, D, qmax, out.scale + g0, out.zero + g0, zero, inv, fit_work);
    }
    uint8_t* packed = out.codes + (n * d.tokens + t0) * rb;
    for (int64_t t = 0; t < nt; ++t) {
      const float* row = block + t * D;
      if (!whole) {
        load_x_row(x, base + t * x.stride_t, D, block, gather);
        row = block;
      }
      quantize_codes(row, zero, inv, qmax, D, codes);
      pack_codes(d.bits, codes, D, packed + t * rb);
    }
  }
  if (bad) status->non_finite_input = true;
  if (flags.meta_overflow) status->meta_overflow = true;
  if (flags.range_overflow) status->range_overflow = true;
}

// Tokens per block of the per-token kernels: their scales and zeros are
// computed together, so that that loop vectorizes too.
constexpr int64_t kTokenBlock = 16;

template <typename In, typename Meta>
NEXUSKV_INLINE void compress_channel_groups(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out,
                                            int64_t task_begin, int64_t task_end, CompressStatus* status) {
  const int64_t D = d.head_dim, G = d.group_size, B = d.meta_b(), rb = d.packed_row_bytes();
  const int k = d.num_outliers;
  const float qmax = float((1 << d.bits) - 1);
  // With outliers and whole groups, a block's groups are transposed into
  // lanes ([G, R*B]) and selected together; more tokens per block then make
  // longer vector loops (so too for fitted ranges).
  const bool lanes_ok = k > 0 && D % G == 0 && G > k;
  const int64_t Dp = layout::padded_channels(d.bits, D);
  // (At most the tasks of this call, at least one: a paged write compresses one token per call.)
  const int64_t calls_tasks = task_end - task_begin > 1 ? task_end - task_begin : 1;
  const int64_t R = min_i(lanes_ok || d.fit_range ? 4 * kTokenBlock : kTokenBlock, calls_tasks);
  // Fitted ranges hold a block's groups as lanes too: [Gn, R*B] values and 0/1 dense marks,
  // a partial last group padded with unmarked zeros.
  const int64_t Gn = min_i(G, D), lanes_floats = lanes_ok || d.fit_range ? R * B * Gn : 0;
  Scratch scratch(R * D + 4 * R * B + lanes_floats + (d.fit_range ? lanes_floats + fit_work_floats(R * B) : 0),
                  Dp + D * int64_t(sizeof(In)));
  float* block = scratch.f.data();  // [R, D] float rows
  float *mn = block + R * D, *mx = mn + R * B, *zero = mx + R * B, *inv = zero + R * B;
  float* lane_vals = inv + R * B;           // [Gn, R*B] when lanes_ok or fitting
  float* dense = lane_vals + lanes_floats;  // [Gn, R*B] when fitting
  float* fit_work = dense + lanes_floats;
  uint8_t* codes = scratch.b.data();
  In* gather = reinterpret_cast<In*>(codes + Dp);
  LaneLists lanes(lanes_ok ? R * B : 0, k);
  MetaFlags flags;
  bool bad = false;
  for (int64_t task0 = task_begin; task0 < task_end; task0 += R) {  // task = n * T + t
    const int64_t nr = min_i(R, task_end - task0);
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t task = task0 + r, n = task / d.tokens, t = task % d.tokens;
      const In* src = x.data + x.row_offset[n] + t * x.stride_t;
      float* row = block + r * D;
      bad |= load_x_row(x, src, D, row, gather);
      if (lanes_ok) continue;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t c0 = b * G, nc = min_i(G, D - c0);
        if (k == 0) {
          min_max(row + c0, nc, &mn[r * B + b], &mx[r * B + b]);
        } else {
          select_outliers(row + c0, 1, int(nc), k, out.outlier_idx + (task * B + b) * k, &mn[r * B + b],
                          &mx[r * B + b]);
        }
      }
    }
    if (lanes_ok) {
      const int64_t L = nr * B;
      for (int64_t j = 0; j < G; ++j)
        for (int64_t g = 0; g < L; ++g) lane_vals[j * L + g] = block[g * G + j];  // group g = r*B + b
      select_outliers_lanes(lane_vals, L, int(G), k, lanes, out.outlier_idx + task0 * B * k, mn, mx);
    }
    if (k > 0) {
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t task = task0 + r, n = task / d.tokens, t = task % d.tokens;
        const In* src = x.data + x.row_offset[n] + t * x.stride_t;
        for (int64_t b = 0; b < B; ++b) {
          const int64_t g = task * B + b;
          const uint8_t* pos = out.outlier_idx + g * k;
          In* val = out.outlier_val + g * k;
          for (int s = 0; s < k; ++s) val[s] = src[(b * G + pos[s]) * x.stride_d];
        }
      }
    }
    merge(flags, make_meta<Meta>(mn, mx, nr * B, qmax, out.scale + task0 * B, out.zero + task0 * B, zero, inv));
    if (d.fit_range) {
      const int64_t L = nr * B;
      for (int64_t r = 0; r < nr; ++r) {
        for (int64_t b = 0; b < B; ++b) {
          const int64_t g = r * B + b, c0 = b * G, nc = min_i(G, D - c0);
          const float on = nc > k ? 1.f : 0.f;  // a group of nc <= k entries is all outliers
          for (int64_t j = 0; j < Gn; ++j) {
            lane_vals[j * L + g] = j < nc ? block[r * D + c0 + j] : 0.f;
            dense[j * L + g] = j < nc ? on : 0.f;
          }
          const uint8_t* pos = out.outlier_idx + ((task0 + r) * B + b) * k;
          for (int s = 0; s < k && nc > k; ++s) dense[pos[s] * L + g] = 0.f;
        }
      }
      fit_ranges<Meta>(lane_vals, dense, Gn, L, qmax, out.scale + task0 * B, out.zero + task0 * B, zero, inv, fit_work);
    }
    for (int64_t r = 0; r < nr; ++r) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t c0 = b * G, nc = min_i(G, D - c0);
        quantize_codes(block + r * D + c0, zero[r * B + b], inv[r * B + b], qmax, nc, codes + c0);
      }
      pack_codes(d.bits, codes, D, out.codes + (task0 + r) * rb);
    }
  }
  if (bad) status->non_finite_input = true;
  if (flags.meta_overflow) status->meta_overflow = true;
  if (flags.range_overflow) status->range_overflow = true;
}

template <typename Meta, typename Out>
NEXUSKV_INLINE void decompress_token_groups(const NQDims& d, const uint8_t* packed, const Meta* scale, const Meta* zero,
                                            Out* out, int64_t task_begin, int64_t task_end) {
  const int64_t D = d.head_dim, A = d.meta_a(), rb = d.packed_row_bytes();
  const int64_t Dp = layout::padded_channels(d.bits, D);
  Scratch scratch(3 * D, Dp);
  float *s = scratch.f.data(), *z = s + D, *row = z + D;
  uint8_t* codes = scratch.b.data();
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t n = task / A, a = task % A, t0 = d.group_start(n, a), nt = d.group_end(n, a) - t0;
    Rows<Meta>::load(scale + task * D, D, s);
    Rows<Meta>::load(zero + task * D, D, z);
    for (int64_t t = t0; t < t0 + nt; ++t) {
      unpack_codes(d.bits, packed + (n * d.tokens + t) * rb, D, codes);
      Out* o = out + (n * d.tokens + t) * D;
      if constexpr (std::is_same_v<Out, float>) {
        dequantize_codes(codes, s, z, D, o);
      } else {
        dequantize_codes(codes, s, z, D, row);
        saturate<Out>(row, D);
        Rows<Out>::store(row, D, o);
      }
    }
  }
}

template <typename Meta, typename Out>
NEXUSKV_INLINE void decompress_channel_groups(const NQDims& d, const uint8_t* packed, const Meta* scale,
                                              const Meta* zero, Out* out, int64_t task_begin, int64_t task_end) {
  const int64_t D = d.head_dim, G = d.group_size, B = d.meta_b(), rb = d.packed_row_bytes();
  const int64_t Dp = layout::padded_channels(d.bits, D), R = kTokenBlock;
  Scratch scratch(D + 2 * R * B, Dp);
  float *row = scratch.f.data(), *s = row + D, *z = s + R * B;
  uint8_t* codes = scratch.b.data();
  for (int64_t task0 = task_begin; task0 < task_end; task0 += R) {  // task = n * T + t
    const int64_t nr = min_i(R, task_end - task0);
    Rows<Meta>::load(scale + task0 * B, nr * B, s);
    Rows<Meta>::load(zero + task0 * B, nr * B, z);
    for (int64_t r = 0; r < nr; ++r) {
      unpack_codes(d.bits, packed + (task0 + r) * rb, D, codes);
      Out* o = out + (task0 + r) * D;
      float* dst = std::is_same_v<Out, float> ? reinterpret_cast<float*>(o) : row;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t c0 = b * G, nc = min_i(G, D - c0);
        dequantize_codes(codes + c0, s[r * B + b], z[r * B + b], nc, dst + c0);
      }
      if constexpr (!std::is_same_v<Out, float>) {
        saturate<Out>(row, D);
        Rows<Out>::store(row, D, o);
      }
    }
  }
}

}  // namespace

template <typename In, typename Meta>
void nq_compress_tasks(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out, int64_t begin,
                       int64_t end, CompressStatus* status) {
  note_kernel_isa(kThisIsa);
  if (d.axis == GroupAxis::kTokens)
    compress_token_groups(d, x, out, begin, end, status);
  else
    compress_channel_groups(d, x, out, begin, end, status);
}

template <typename Meta, typename Out>
void nq_decompress_tasks(const NQDims& d, const uint8_t* codes, const Meta* scale, const Meta* zero, Out* out,
                         int64_t begin, int64_t end) {
  note_kernel_isa(kThisIsa);
  if (d.axis == GroupAxis::kTokens)
    decompress_token_groups(d, codes, scale, zero, out, begin, end);
  else
    decompress_channel_groups(d, codes, scale, zero, out, begin, end);
}

#define NEXUSKV_INSTANTIATE_COMPRESS(In, Meta)                                                                 \
  template void nq_compress_tasks<In, Meta>(const NQDims&, const StridedRows<In>&, const NQBuffers<In, Meta>&, \
                                            int64_t, int64_t, CompressStatus*);
#define NEXUSKV_INSTANTIATE_DECOMPRESS(Meta, Out)                                                                      \
  template void nq_decompress_tasks<Meta, Out>(const NQDims&, const uint8_t*, const Meta*, const Meta*, Out*, int64_t, \
                                               int64_t);
NEXUSKV_FOR_EACH_FLOAT_PAIR(NEXUSKV_INSTANTIATE_COMPRESS)
NEXUSKV_FOR_EACH_FLOAT_PAIR(NEXUSKV_INSTANTIATE_DECOMPRESS)

}  // namespace nexuskv::core::NEXUSKV_ISA
