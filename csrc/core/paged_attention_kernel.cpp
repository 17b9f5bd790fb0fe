// The CPU attention over pages (the problem: nexuskv/core/paged.h; the format:
// paged_format.h), compiled once per instruction set (isa.h: namespace
// generic, avx2 or avx512) and chosen at run time by paged_kernels.cpp.
// Per task (request, block of queries, kv head):
//   the GQA group's query rows in float32, rotated and scaled;
//   for each tile of kTile keys at absolute positions (multiples of kTile):
//     the tile's key and value slots dequantized once into float rows, shared
//     by every query row of the task;
//     q . K four query rows by four keys (attention_blocks.h), causal /
//     sliding-window mask, soft-cap, online softmax in float32 (a NaN/Inf
//     score marks its row NaN);
//     acc += p . V, four query rows per value load.
// A query row's arithmetic depends only on its own query and the tiles it
// meets, never on the other rows of its task, so its output is bit for bit the
// same whichever query block or chunk of a prompt computes it.  No buffer
// grows with the context.
#include <cstring>

#include "attention_blocks.h"
#include "isa.h"
#include "isa_kernels.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/paged.h"
#include "rows.h"

namespace nexuskv::core::NEXUSKV_ISA {
namespace {

constexpr int kTile = 32;  // keys per tile; a multiple of dot4x4's four keys

// row[D] = codes * scale + zero of one slot (per channel group), then its
// exact outliers.  s_buf, z_buf: [D] scratch.  Returns false if an outlier
// position lies outside its group (a corrupt page; that outlier is skipped).
template <typename X>
bool dequantize_slot(const PagedLayout& l, const PagedOffsets& o, const PagedSlot<X>& s, int bits,
                     float* __restrict s_buf, float* __restrict z_buf, float* __restrict row) {
  const int D = l.head_dim, G = l.group_size, k = o.num_outliers, groups = o.groups;
  for (int g = 0; g < groups; ++g) {
    const float scale = to_float(s.scale[g]), zero = to_float(s.zero[g]);
    const int end = (g + 1) * G < D ? (g + 1) * G : D;
    for (int c = g * G; c < end; ++c) s_buf[c] = scale, z_buf[c] = zero;
  }
  dequant_row_bits(bits, s.codes, D, s_buf, z_buf, row);
  bool ok = true;
  for (int g = 0; g < groups && k > 0; ++g) {
    const int begin = g * G, end = (g + 1) * G < D ? (g + 1) * G : D;
    for (int j = 0; j < k; ++j) {
      const int64_t m = int64_t(g) * k + j;
      const int pos = begin + s.outlier_idx[m];
      if (pos >= end) {
        ok = false;
        continue;
      }
      row[pos] = to_float(s.outlier_val[m]);  // a repeated slot writes the same value again
    }
  }
  return ok;
}

// The largest of a row's kTile scores (-inf if all are masked), sixteen lanes
// at a time so that it vectorizes.
inline float max_of_tile(const float* __restrict s) {
  float part[16];
  for (int l = 0; l < 16; ++l) part[l] = s[l];
  for (int j = 16; j < kTile; j += 16)
    for (int l = 0; l < 16; ++l) part[l] = max_f(part[l], s[j + l]);
  float m = part[0];
  for (int l = 1; l < 16; ++l) m = max_f(m, part[l]);
  return m;
}

}  // namespace

template <typename X>
bool paged_attention_task(const PagedAttention<X>& p, const PagedTask& t, int h_begin, int h_end) {
  note_kernel_isa(kThisIsa);
  const PagedLayout& l = p.pool.layout;
  const PagedOffsets off(l);
  const int D = l.head_dim, P = l.block_size, gq = p.gqa_group();
  // Row i: q head (i / queries) of the group, query i % queries; padded to a
  // multiple of four rows (q = 0, nothing visible) for dot4x4 and pv_rows.
  const int64_t rows = int64_t(gq) * t.queries, rows4 = (rows + 3) / 4 * 4;
  Buffer<float> q_buf(rows4 * D), acc_buf(rows4 * D), mx_buf(rows4), sum_buf(rows4), w_buf(rows4 * kTile);
  Buffer<float> keys_buf(int64_t(kTile) * D), values_buf(int64_t(kTile) * D), s_buf(D), z_buf(D);
  Buffer<int64_t> qpos_buf(rows4);
  Buffer<uint8_t> bad_buf(rows4);
  float *q = q_buf.data(), *acc = acc_buf.data(), *mx = mx_buf.data(), *sum = sum_buf.data(), *w = w_buf.data();
  float *keys = keys_buf.data(), *values = values_buf.data();
  int64_t* qpos = qpos_buf.data();
  uint8_t* bad = bad_buf.data();
  bool corrupt = false;

  const int64_t q0 = p.q_begin(t.req) + t.first_query;
  const int64_t first_pos = p.query_position(t.req, t.first_query);
  const int64_t key_end = first_pos + t.queries;  // one past the last query's position
  int64_t key_begin = 0;
  if (p.window > 0 && first_pos - p.window + 1 > 0) key_begin = first_pos - p.window + 1;
  for (int64_t i = 0; i < rows4; ++i) qpos[i] = i < rows ? first_pos + i % t.queries : -1;

  for (int h = h_begin; h < h_end; ++h) {
    for (int64_t i = 0; i < rows; ++i) {
      float* row = q + i * D;
      Rows<X>::widen(p.q + (q0 + i % t.queries) * p.q_stride_t + (int64_t(h) * gq + i / t.queries) * p.q_stride_h, D,
                     row);
      if (p.rotation_signs) hadamard_rotate_rows(row, row, 1, D, p.rotation_signs, false);
      for (int c = 0; c < D; ++c) row[c] *= p.scale;
    }
    fill_f(mx, rows4, kNegInf);
    fill_f(sum, rows4, 0.f);
    fill_f(acc, rows4 * D, 0.f);
    std::memset(bad, 0, size_t(rows4));

    for (int64_t k0 = key_begin / kTile * kTile; k0 < key_end; k0 += kTile) {
      // Tokens [j0, n) of the tile are read; the other rows are zero (finite: p = 0 meets them).
      const int j0 = int(key_begin > k0 ? key_begin - k0 : 0);
      const int n = int(key_end - k0 < kTile ? key_end - k0 : kTile);
      fill_f(keys, int64_t(j0) * D, 0.f);
      fill_f(values, int64_t(j0) * D, 0.f);
      fill_f(keys + int64_t(n) * D, int64_t(kTile - n) * D, 0.f);
      fill_f(values + int64_t(n) * D, int64_t(kTile - n) * D, 0.f);
      uint8_t* page = const_cast<uint8_t*>(p.pages) + p.token_page(t.req, k0 + j0, h);
      int offset = int((k0 + j0) % P);
      for (int j = j0; j < n; ++j) {
        corrupt |= !dequantize_slot(l, off, paged_slot<X>(off, page, offset, false), l.key_bits, s_buf.data(),
                                    z_buf.data(), keys + int64_t(j) * D);
        corrupt |= !dequantize_slot(l, off, paged_slot<X>(off, page, offset, true), l.value_bits, s_buf.data(),
                                    z_buf.data(), values + int64_t(j) * D);
        if (++offset == P && j + 1 < n) {  // the next token starts the next block
          offset = 0;
          page = const_cast<uint8_t*>(p.pages) + p.token_page(t.req, k0 + j + 1, h);
        }
      }

      // Scores of four rows x four keys at a time, into w.
      for (int64_t r = 0; r < rows4; r += 4) {
        const float* qr[4] = {q + r * D, q + (r + 1) * D, q + (r + 2) * D, q + (r + 3) * D};
        for (int j = 0; j < kTile; j += 4) {
          float s16[16];
          dot4x4(qr, keys + int64_t(j) * D, D, s16);
          for (int a = 0; a < 4; ++a)
            for (int b = 0; b < 4; ++b) w[(r + a) * kTile + j + b] = s16[4 * a + b];
        }
      }

      // Mask, soft-cap, online softmax: w becomes the tile's weights exp(s - max).
      for (int64_t i = 0; i < rows4; ++i) {
        float* wr = w + i * kTile;
        // A tile the row sees whole (the common case) needs no mask; whether it
        // does depends on the row and the tile only, not on the task.
        const bool whole = p.visible(qpos[i], k0) && p.visible(qpos[i], k0 + kTile - 1);
        if (whole && !(p.softcap > 0.f)) {
          if (!all_finite(wr, kTile)) bad[i] = 1;
        } else {
          float check = 0.f;  // NaN once a seen score is NaN or Inf
          for (int j = 0; j < kTile; ++j) {
            float s = wr[j];
            if (!whole && (j < j0 || j >= n || !p.visible(qpos[i], k0 + j))) {
              wr[j] = kNegInf;
              continue;
            }
            if (p.softcap > 0.f) s = p.softcap * tanh_f(s / p.softcap);
            wr[j] = s;
            check += s * 0.f;
          }
          if (!(check == 0.f)) bad[i] = 1;
        }
        const float tile_max = max_of_tile(wr);

        if (tile_max == kNegInf || bad[i]) {
          fill_f(wr, kTile, 0.f);
          continue;
        }
        const float new_max = max_f(tile_max, mx[i]);
        const float correction = exp_nonpos(mx[i] - new_max);  // 0 on the first tile (mx = -inf)
        if (correction != 1.f) {
          float* ar = acc + i * D;
          for (int c = 0; c < D; ++c) ar[c] *= correction;
          sum[i] *= correction;
        }
        mx[i] = new_max;
        for (int j = 0; j < kTile; ++j) wr[j] = exp_nonpos(wr[j] - new_max);  // masked: exp(-inf) = 0
        sum[i] += sum_f(wr, kTile);
      }

      for (int64_t r = 0; r < rows4; r += 4) {
        float* ar[4] = {acc + r * D, acc + (r + 1) * D, acc + (r + 2) * D, acc + (r + 3) * D};
        const float* wr[4] = {w + r * kTile, w + (r + 1) * kTile, w + (r + 2) * kTile, w + (r + 3) * kTile};
        pv_rows(4, ar, wr, 0, D, values, kTile, D);
      }
    }

    for (int64_t i = 0; i < rows; ++i) {
      float* ar = acc + i * D;
      // Every query sees its own key, so sum > 0 unless a score was not finite.
      const float inv = bad[i] || corrupt || !(sum[i] > 0.f) ? kQuietNaN : 1.f / sum[i];
      for (int c = 0; c < D; ++c) ar[c] *= inv;
      if (p.rotation_signs) hadamard_rotate_rows(ar, ar, 1, D, p.rotation_signs, true);
      Rows<X>::store(ar, D, p.out + ((q0 + i % t.queries) * p.q_heads + int64_t(h) * gq + i / t.queries) * D);
    }
  }
  return !corrupt;
}

#define NEXUSKV_INSTANTIATE_PAGED_ATTENTION(X) \
  template bool paged_attention_task<X>(const PagedAttention<X>&, const PagedTask&, int, int);
NEXUSKV_INSTANTIATE_PAGED_ATTENTION(float)
NEXUSKV_INSTANTIATE_PAGED_ATTENTION(half_t)
NEXUSKV_INSTANTIATE_PAGED_ATTENTION(bf16_t)
#undef NEXUSKV_INSTANTIATE_PAGED_ATTENTION

}  // namespace nexuskv::core::NEXUSKV_ISA
