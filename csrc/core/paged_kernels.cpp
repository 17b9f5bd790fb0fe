// CPU kernels of the paged operators (the problem: nexuskv/core/paged.h; the
// format: paged_format.h).  The write runs the NQ compressor of nq_kernels.h
// on each (token, kv head) row, pointed at its slot, so a slot holds exactly
// what nq_compress gives for that token.  The attention dequantizes each key
// and value row once into float32 (shared by every query row of the GQA
// group and the query block) and keeps an online softmax in float32; no
// buffer grows with the context.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "nexuskv/core/attention.h"
#include "nexuskv/core/half.h"
#include "nexuskv/core/paged.h"

namespace nexuskv::core {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kTile = 32;  // keys dequantized at a time

template <typename X>
void load_row(const X* src, int64_t n, float* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = to_float(src[c]);
}

// Dequantizes one slot (codes * scale + zero, then the exact outliers) into
// row[D].  Returns false if an outlier position lies outside its group (a
// corrupt page; the row then holds only the dense part there).
template <typename X>
bool dequantize_slot(const PagedLayout& l, const PagedSlot<X>& s, int bits, uint8_t* codes, float* row) {
  const int D = l.head_dim, G = l.group_size, k = l.num_outliers;
  unpack_row(s.codes, D, bits, codes);
  for (int g = 0; g < l.groups(); ++g) {
    const float scale = to_float(s.scale[g]), zero = to_float(s.zero[g]);
    const int end = (g + 1) * G < D ? (g + 1) * G : D;
    for (int c = g * G; c < end; ++c) row[c] = float(codes[c]) * scale + zero;
  }
  bool ok = true;
  for (int g = 0; g < l.groups() && k > 0; ++g) {
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

}  // namespace

template <typename X>
void paged_write_tokens(const PagedWrite<X>& w, int64_t begin, int64_t end, CompressStatus* status) {
  const PagedLayout& l = w.pool.layout;
  const int D = l.head_dim;
  std::vector<float> rf(w.rotation_signs ? 2 * D : 0);
  std::vector<X> rx(w.rotation_signs ? D : 0);
  const int64_t zero_offset = 0;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = w.slot_mapping[t];
    if (slot < 0) continue;
    const int64_t block = slot / l.block_size;
    const int offset = int(slot % l.block_size);
    for (int h = 0; h < w.pool.kv_heads; ++h) {
      uint8_t* page = w.pages + w.pool.head_page(block, h);
      for (int half = 0; half < 2; ++half) {
        const X* src = (half ? w.value + t * w.value_stride_t : w.key + t * w.key_stride_t) + int64_t(h) * D;
        if (w.rotation_signs) {
          // hadamard_rotate(x, signs) in float32, rounded to X: what the op gives.
          load_row(src, D, rf.data());
          hadamard_rotate_rows(rf.data(), rf.data() + D, 1, D, w.rotation_signs, false);
          for (int c = 0; c < D; ++c) rx[c] = from_float<X>(rf[D + c]);
          src = rx.data();
        }
        const PagedSlot<X> s = paged_slot<X>(l, page, offset, half == 1);
        const NQDims d = l.token_dims(half ? l.value_bits : l.key_bits);
        const StridedRows<X> x{src, &zero_offset, 0, 1};
        const NQBuffers<X, X> out{s.codes, s.scale, s.zero, s.outlier_idx, s.outlier_val};
        nq_compress_tasks<X, X>(d, x, out, 0, 1, status);
      }
    }
  }
}

template <typename X>
bool paged_attention_task(const PagedAttention<X>& p, const PagedTask& t, int h_begin, int h_end) {
  const PagedLayout& l = p.pool.layout;
  const int D = l.head_dim, gq = p.gqa_group();
  const int64_t rows = int64_t(gq) * t.queries;  // row i: q head (i / queries) of the group, query i % queries
  std::vector<float> q(rows * D), acc(rows * D), mx(rows), sum(rows), scores(rows * kTile), tmp(2 * D);
  std::vector<float> keys(int64_t(kTile) * D), values(int64_t(kTile) * D);
  std::vector<uint8_t> codes(D);
  std::vector<char> bad(rows);
  bool corrupt = false;

  const int64_t q0 = p.q_begin(t.req) + t.first_query;
  const int64_t first_pos = p.query_position(t.req, t.first_query);
  const int64_t last_pos = first_pos + t.queries - 1;
  int64_t key_begin = 0;
  if (p.window > 0 && first_pos - p.window + 1 > 0) key_begin = first_pos - p.window + 1;
  const int64_t key_end = last_pos + 1;

  for (int h = h_begin; h < h_end; ++h) {
    for (int64_t i = 0; i < rows; ++i) {
      const X* src = p.q + (q0 + i % t.queries) * p.q_stride_t + (int64_t(h) * gq + i / t.queries) * p.q_stride_h;
      float* row = q.data() + i * D;
      load_row(src, D, row);
      if (p.rotation_signs) {
        hadamard_rotate_rows(row, tmp.data(), 1, D, p.rotation_signs, false);
        std::memcpy(row, tmp.data(), sizeof(float) * D);
      }
      mx[i] = kNegInf;
      sum[i] = 0.f;
      bad[i] = 0;
    }
    std::fill(acc.begin(), acc.end(), 0.f);

    // Tiles at absolute positions (multiples of kTile): a query row meets the
    // same tiles, in the same order, whichever query block or chunk of a
    // prompt it is computed in, so its output is bit for bit the same.
    for (int64_t k0 = key_begin / kTile * kTile; k0 < key_end; k0 += kTile) {
      const int n = int(key_end - k0 < kTile ? key_end - k0 : kTile);
      for (int j = 0; j < n; ++j) {
        if (k0 + j < key_begin) continue;  // before every window of the block: never read
        const int64_t pos = k0 + j;
        uint8_t* page = const_cast<uint8_t*>(p.pages) + p.token_page(t.req, pos, h);
        const int offset = int(pos % l.block_size);
        corrupt |= !dequantize_slot(l, paged_slot<X>(l, page, offset, false), l.key_bits, codes.data(),
                                    keys.data() + int64_t(j) * D);
        corrupt |= !dequantize_slot(l, paged_slot<X>(l, page, offset, true), l.value_bits, codes.data(),
                                    values.data() + int64_t(j) * D);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t qpos = first_pos + i % t.queries;
        const float* qr = q.data() + i * D;
        float* sr = scores.data() + i * kTile;
        float tile_max = kNegInf;
        for (int j = 0; j < n; ++j) {
          if (k0 + j < key_begin || !p.visible(qpos, k0 + j)) {
            sr[j] = kNegInf;
            continue;
          }
          const float* kr = keys.data() + int64_t(j) * D;
          float dot = 0.f;
          for (int c = 0; c < D; ++c) dot += qr[c] * kr[c];
          float s = dot * p.scale;
          if (p.softcap > 0.f) s = p.softcap * std::tanh(s / p.softcap);
          if (!std::isfinite(s)) bad[i] = 1;
          sr[j] = s;
          tile_max = s > tile_max ? s : tile_max;
        }
        if (tile_max == kNegInf || bad[i]) continue;
        const float new_max = tile_max > mx[i] ? tile_max : mx[i];
        const float correction = std::exp(mx[i] - new_max);  // exp(-inf) = 0 on the first tile
        float* ar = acc.data() + i * D;
        if (correction != 1.f) {
          for (int c = 0; c < D; ++c) ar[c] *= correction;
          sum[i] *= correction;
        }
        mx[i] = new_max;
        for (int j = 0; j < n; ++j) {
          if (sr[j] == kNegInf) continue;
          const float w = std::exp(sr[j] - new_max);
          sum[i] += w;
          const float* vr = values.data() + int64_t(j) * D;
          for (int c = 0; c < D; ++c) ar[c] += w * vr[c];
        }
      }
    }

    for (int64_t i = 0; i < rows; ++i) {
      float* ar = acc.data() + i * D;
      // Every query sees its own key, so sum > 0 unless a score was not finite.
      const float inv = bad[i] || corrupt || !(sum[i] > 0.f) ? std::numeric_limits<float>::quiet_NaN() : 1.f / sum[i];
      for (int c = 0; c < D; ++c) ar[c] *= inv;
      if (p.rotation_signs) {
        hadamard_rotate_rows(ar, tmp.data(), 1, D, p.rotation_signs, true);
        std::memcpy(ar, tmp.data(), sizeof(float) * D);
      }
      X* dst = p.out + ((q0 + i % t.queries) * p.q_heads + int64_t(h) * gq + i / t.queries) * D;
      for (int c = 0; c < D; ++c) dst[c] = from_float<X>(ar[c]);
    }
  }
  return !corrupt;
}

#define NEXUSKV_INSTANTIATE_PAGED(X)                                                            \
  template void paged_write_tokens<X>(const PagedWrite<X>&, int64_t, int64_t, CompressStatus*); \
  template bool paged_attention_task<X>(const PagedAttention<X>&, const PagedTask&, int, int);
NEXUSKV_INSTANTIATE_PAGED(float)
NEXUSKV_INSTANTIATE_PAGED(half_t)
NEXUSKV_INSTANTIATE_PAGED(bf16_t)
#undef NEXUSKV_INSTANTIATE_PAGED

}  // namespace nexuskv::core
