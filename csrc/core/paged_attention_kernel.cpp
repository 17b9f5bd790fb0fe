// The CPU attention over pages (the problem: nexuskv/core/paged.h; the format:
// paged_format.h), compiled once per instruction set (isa.h: namespace
// generic, avx2 or avx512) and chosen at run time by paged_kernels.cpp.
// Per task (request, block of queries, kv head):
//   the GQA group's query rows in float32, rotated and scaled;
//   for each tile of kTile keys at absolute positions (multiples of kTile):
//     the tile's value codes (and keys, but on the plane path) widened to
//     float once (no scale, no zero), shared by every query row of the task,
//     and their per-(token, group) scales and zeros;
//     q . K: with AVX512-VNNI (2/4/8-bit keys in groups of whole 16-channel
//     planes) integer dot products of the queries' int8 limbs with the packed
//     codes read from the page, four keys' planes met by every block of four
//     rows (paged_int_keys.h); on AVX2, in groups of whole planes, four query
//     rows meet each key's packed planes read from the page and dequantized in
//     registers (key_plane_scores); otherwise four rows by four widened keys
//     per channel group (dot4x4, attention_blocks.h), the group's scale and
//     zero applied to the sums: score = sum_g s_g (q_g . codes_g) + z_g
//     sum(q_g); then q * (exact - dequantized) per key outlier;
//     causal / sliding-window mask, soft-cap, online softmax in float32 (a
//     NaN/Inf score marks its row NaN);
//     acc += (p * s_g) . codes_g per value group, four query rows per load, and
//     p * (exact - dequantized) per value outlier; sum(p * z_g) per row and
//     group apart (rescaled with acc), added to the group's channels at the end;
//   with an exact window W, the tiles read only the keys older than each row's
//   window, and one last pass takes the task's window keys and values exact
//   (the chunk's own rows or the page rings: PagedAttention::exact_row), not
//   rotated: they meet the unrotated query and go to an unrotated accumulator
//   added after the inverse rotation (q' . k' = q . k for an orthogonal map).
//   Why unrotated: rotating every exact row per task would cost more than the
//   window's own dot products.
// Why fold the scales: dequantizing every slot to float (code * s + z per
// channel, the scales spread over channels first) was 45 % of a decode on an
// AVX2 CPU (perf, llama-like 1 x 4096); folded, each scale and zero costs one
// multiply per (row, token, group) instead of per channel.
// A query row's arithmetic depends only on its own query and the tiles it
// meets, never on the other rows of its task, so its output is bit for bit the
// same whichever query block or chunk of a prompt computes it.  No buffer
// grows with the context.
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "attention_blocks.h"
#include "isa.h"
#include "isa_kernels.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/paged.h"
#include "paged_int_keys.h"
#include "rows.h"

namespace nexuskv::core::NEXUSKV_ISA {
namespace {

constexpr int kTile = 32;  // keys per tile; a multiple of dot4x4's four keys

// One tile's slots as the kernel reads them: codes widened to float [kTile, D]
// (unless read from the page by the plane path) and the slots' scales and
// zeros [Bg, kTile] in float (zero for tokens the tile does not read), the
// head page and offset of every slot read, and its packed codes.
struct TileSlots {
  float *codes, *scale, *zero;
  uint8_t* page[kTile];
  int offset[kTile];
  const uint8_t* packed[kTile];
};

template <typename X>
void load_slot(const PagedOffsets& o, const PagedSlot<X>& s, int bits, int D, int j, bool widen, TileSlots& t) {
  t.packed[j] = s.codes;
  if (widen) codes_row_bits(bits, s.codes, D, t.codes + int64_t(j) * D);
  for (int g = 0; g < o.groups; ++g)
    t.scale[g * kTile + j] = to_float(s.scale[g]), t.zero[g * kTile + j] = to_float(s.zero[g]);
}

// Calls f(j, g, pos, exact - dequantized) for every exact outlier of the tile's
// slots [j0, n) (key or value half).  Returns false if an outlier position lies
// outside its group (a corrupt page; that outlier is skipped).
template <typename X, typename F>
bool for_each_outlier(const PagedLayout& l, const PagedOffsets& o, const TileSlots& t, bool value, int j0, int n,
                      F&& f) {
  const int D = l.head_dim, G = l.group_size, k = o.num_outliers;
  bool ok = true;
  for (int j = j0; j < n && k > 0; ++j) {
    const PagedSlot<X> s = paged_slot<X>(o, t.page[j], t.offset[j], value);
    for (int g = 0; g < o.groups; ++g) {
      const int begin = g * G, end = (g + 1) * G < D ? (g + 1) * G : D;
      const uint8_t* idx = s.outlier_idx + int64_t(g) * k;
      for (int m = 0; m < k; ++m) {
        const int pos = begin + idx[m];
        if (pos >= end) {
          ok = false;
          continue;
        }
        // A position listed twice (a group with fewer channels than k repeats
        // one) holds one exact value: correct it once, as its last entry.
        bool later = false;
        for (int m2 = m + 1; m2 < k; ++m2) later |= idx[m2] == idx[m];
        if (later) continue;
        const float code = float(layout::code_at(s.codes, value ? l.value_bits : l.key_bits, pos));
        const float deq = code * t.scale[g * kTile + j] + t.zero[g * kTile + j];
        f(j, g, pos, to_float(s.outlier_val[int64_t(g) * k + m]) - deq);
      }
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

#if defined(__AVX2__) && !defined(__AVX512F__)
// The plane path of q . K (AVX2; the AVX-512 build keeps dot4x4, whose 16
// accumulators fit its 32 registers): dot4x4 holds 4 x 4 accumulators and
// four keys, more than AVX2's 16 registers, so it spilled, and it read every
// code twice more (the widened store, then its load).  Here one key at a
// time: each 16-code plane is widened and dequantized in registers
// (plane_floats, then code * s_g + z_g: two FMAs shared by the four rows,
// cheaper than reducing four rows' sums at every group's end) and meets four
// query rows, two accumulators per row (lanes 0..7, 8..15) so that eight FMA
// chains run side by side; one reduction per key.  Needs groups of whole
// planes (G % 16 == 0) and D % 16 == 0.  Scores of keys outside [j0, n) are
// 0 (masked later), as with zero codes and scales.
template <int kBits>
void key_plane_scores(const float* q, int64_t r, int D, int G, const TileSlots& ks, int j0, int n, float* w) {
  constexpr int kPlanes = layout::kPlanes<kBits>, kChunkCh = layout::kChunkChannels<kBits>;
  constexpr int kChunkBytes = layout::kChunkBytes<kBits>;
  const float* qr[4] = {q + r * D, q + (r + 1) * D, q + (r + 2) * D, q + (r + 3) * D};
  for (int j = 0; j < kTile; ++j) {
    alignas(16) float out[4] = {};
    if (j >= j0 && j < n) {
      const uint8_t* key = ks.packed[j];
      __m256 a[4][2];
      for (int i = 0; i < 4; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
      int g = 0, group_end = 0;
      __m256 sc = _mm256_setzero_ps(), ze = _mm256_setzero_ps();
      for (int c0 = 0; c0 < D; c0 += kChunkCh, key += kChunkBytes) {
        NEXUSKV_UNROLL
        for (int p = 0; p < kPlanes; ++p) {
          const int c = c0 + 16 * p;
          if (c >= D) break;
          if (c == group_end) {  // the next group's scale and zero
            sc = _mm256_set1_ps(ks.scale[g * kTile + j]), ze = _mm256_set1_ps(ks.zero[g * kTile + j]);
            ++g, group_end += G;
          }
          __m256 lo, hi;
          plane_floats<kBits>(key, p, lo, hi);
          lo = _mm256_fmadd_ps(lo, sc, ze), hi = _mm256_fmadd_ps(hi, sc, ze);
          for (int i = 0; i < 4; ++i) {
            a[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[i] + c), lo, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[i] + c + 8), hi, a[i][1]);
          }
        }
      }
      const __m256 t0 = _mm256_add_ps(a[0][0], a[0][1]), t1 = _mm256_add_ps(a[1][0], a[1][1]);
      const __m256 t2 = _mm256_add_ps(a[2][0], a[2][1]), t3 = _mm256_add_ps(a[3][0], a[3][1]);
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3));
      _mm_store_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
    for (int i = 0; i < 4; ++i) w[(r + i) * kTile + j] = out[i];
  }
}

inline void key_plane_scores_bits(int bits, const float* q, int64_t r, int D, int G, const TileSlots& ks, int j0, int n,
                                  float* w) {
  switch (bits) {
    case 2: key_plane_scores<2>(q, r, D, G, ks, j0, n, w); break;
    case 3: key_plane_scores<3>(q, r, D, G, ks, j0, n, w); break;
    case 4: key_plane_scores<4>(q, r, D, G, ks, j0, n, w); break;
    default: key_plane_scores<8>(q, r, D, G, ks, j0, n, w); break;
  }
}
constexpr bool kPlanePath = true;
#else
constexpr bool kPlanePath = false;
#endif

}  // namespace

template <typename X>
bool paged_attention_task(const PagedAttention<X>& p, const PagedTask& t, int h_begin, int h_end) {
  note_kernel_isa(kThisIsa);
  const PagedLayout& l = p.pool.layout;
  const PagedOffsets off(l);
  const int D = l.head_dim, P = l.block_size, gq = p.gqa_group(), G = l.group_size, Bg = off.groups;
  const int W = l.exact_window;
  // Row i: q head (i / queries) of the group, query i % queries; padded to a
  // multiple of four rows (q = 0, nothing visible) for dot4x4 and pv_rows.
  const int64_t rows = int64_t(gq) * t.queries, rows4 = (rows + 3) / 4 * 4;
  // The plane path needs groups of whole 16-channel planes (key_plane_scores).
  const bool planes = kPlanePath && G % 16 == 0 && D % 16 == 0;
#if defined(__AVX512VNNI__)
  // Integer q . K on the packed key codes (paged_int_keys.h), the same limits.
  const bool int_k = l.key_bits != 3 && G % 16 == 0 && D % 16 == 0 && D <= kMaxHeadDim;
  TokenKeyLimbs tkl(int_k ? rows4 : 0, D, int_k ? l.key_bits : 4, G, Bg, std::is_same_v<X, bf16_t> ? 2 : 3);
  Buffer<float> qsum4_buf(int_k ? rows4 * Bg : 1), smax_buf(Bg);
  Buffer<uint8_t> three_buf(rows4 / 4);                      // per block of four rows: three key limbs in this tile
  Buffer<uint8_t> zero_key(int64_t(off.row_bytes[0]) + 64);  // the codes of keys a tile does not read
  const uint8_t* key_rows[kTile];
#else
  const bool int_k = false;
#endif
  note_paged_key_path(int_k ? PagedKeyPath::kInteger : planes ? PagedKeyPath::kPlanes : PagedKeyPath::kWidened);
  Buffer<float> q_buf(rows4 * D), qsum_buf(rows4 * Bg), acc_buf(rows4 * D), mx_buf(rows4), sum_buf(rows4);
  Buffer<float> w_buf(rows4 * kTile), wg_buf(rows4 * kTile), zacc_buf(rows4 * Bg);
  Buffer<float> kcodes_buf(int64_t(kTile) * D), vcodes_buf(int64_t(kTile) * D);
  Buffer<float> kmeta_buf(2 * int64_t(Bg) * kTile), vmeta_buf(2 * int64_t(Bg) * kTile);
  // The exact window: the rows' unrotated scaled queries and accumulators, and
  // the task's exact keys and values [W - 1 + queries, D] (W <= kMaxExactWindow).
  const int64_t exact_keys = W > 0 ? W - 1 + t.queries : 0;
  Buffer<float> qx_buf(W > 0 ? rows4 * D : 1), accx_buf(W > 0 ? rows4 * D : 1);
  Buffer<float> ek_buf(W > 0 ? exact_keys * D : 1), ev_buf(W > 0 ? exact_keys * D : 1), we_buf(exact_keys + 1);
  Buffer<int64_t> qpos_buf(rows4);
  Buffer<uint8_t> bad_buf(rows4);
  float *q = q_buf.data(), *qsum = qsum_buf.data(), *acc = acc_buf.data(), *mx = mx_buf.data(), *sum = sum_buf.data();
  float *w = w_buf.data(), *wg = wg_buf.data(), *zacc = zacc_buf.data();
  TileSlots ks{kcodes_buf.data(), kmeta_buf.data(), kmeta_buf.data() + int64_t(Bg) * kTile, {}, {}};
  TileSlots vs{vcodes_buf.data(), vmeta_buf.data(), vmeta_buf.data() + int64_t(Bg) * kTile, {}, {}};
  int64_t* qpos = qpos_buf.data();
  uint8_t* bad = bad_buf.data();
  // Row i's running accumulators times `correction` (a new running max).
  const auto rescale = [&](int64_t i, float correction) {
    if (correction == 1.f) return;
    for (int c = 0; c < D; ++c) acc[i * D + c] *= correction;
    for (int g = 0; g < Bg; ++g) zacc[i * Bg + g] *= correction;
    sum[i] *= correction;
  };
  bool corrupt = false;

  const int64_t q0 = p.q_begin(t.req) + t.first_query;
  const int64_t first_pos = p.query_position(t.req, t.first_query);
  const int64_t key_end = first_pos + t.queries;  // one past the last query's position
  int64_t key_begin = 0;
  if (p.window > 0 && first_pos - p.window + 1 > 0) key_begin = first_pos - p.window + 1;
  for (int64_t i = 0; i < rows4; ++i) qpos[i] = i < rows ? first_pos + i % t.queries : -1;
  fill_f(q, rows4 * D, 0.f);

  for (int h = h_begin; h < h_end; ++h) {
    for (int64_t i = 0; i < rows; ++i) {
      float* row = q + i * D;
      Rows<X>::widen(p.q + (q0 + i % t.queries) * p.q_stride_t + (int64_t(h) * gq + i / t.queries) * p.q_stride_h, D,
                     row);
      if (W > 0)
        for (int c = 0; c < D; ++c) qx_buf.p[i * D + c] = row[c] * p.scale;
      if (p.rotation_signs) hadamard_rotate_rows(row, row, 1, D, p.rotation_signs, false);
      for (int c = 0; c < D; ++c) row[c] *= p.scale;
    }
    // sum(q_g) per row and key group: the zeros' share of a score.
    for (int64_t i = 0; i < rows4; ++i)
      for (int g = 0; g < Bg; ++g) {
        const int b = g * G, e = b + G < D ? b + G : D;
        qsum[i * Bg + g] = sum_f(q + i * D + b, e - b);
      }
#if defined(__AVX512VNNI__)
    if (int_k) {
      tkl.set(q);
      for (int64_t i = 0; i < rows4; ++i)  // [rows4 / 4, Bg, 4]
        for (int g = 0; g < Bg; ++g) qsum4_buf.p[((i / 4) * Bg + g) * 4 + i % 4] = qsum[i * Bg + g];
    }
#endif
    fill_f(mx, rows4, kNegInf);
    fill_f(sum, rows4, 0.f);
    fill_f(acc, rows4 * D, 0.f);
    fill_f(zacc, rows4 * Bg, 0.f);
    std::memset(bad, 0, size_t(rows4));

    // The tiles read the coded keys [key_begin, coded_end): no row sees a newer one.
    const int64_t coded_end = key_end - W;
    for (int64_t k0 = key_begin / kTile * kTile; k0 < coded_end; k0 += kTile) {
      // Tokens [j0, n) of the tile are read; the others are zero codes, scales and zeros (finite: p = 0 meets them).
      const int j0 = int(key_begin > k0 ? key_begin - k0 : 0);
      const int n = int(coded_end - k0 < kTile ? coded_end - k0 : kTile);
      for (const TileSlots* ts : {&ks, &vs}) {
        // (plane and integer paths: keys not widened, their scores are 0 outside [j0, n))
        if (ts != &ks || (!planes && !int_k)) {
          fill_f(ts->codes, int64_t(j0) * D, 0.f);
          fill_f(ts->codes + int64_t(n) * D, int64_t(kTile - n) * D, 0.f);
        }
        if (j0 > 0 || n < kTile) fill_f(ts->scale, 2 * int64_t(Bg) * kTile, 0.f);  // scale and zero
      }
      uint8_t* page = const_cast<uint8_t*>(p.pages) + p.token_page(t.req, k0 + j0, h);
      int offset = int((k0 + j0) % P);
      for (int j = j0; j < n; ++j) {
        ks.page[j] = vs.page[j] = page, ks.offset[j] = vs.offset[j] = offset;
        load_slot(off, paged_slot<X>(off, page, offset, false), l.key_bits, D, j, !planes && !int_k, ks);
        load_slot(off, paged_slot<X>(off, page, offset, true), l.value_bits, D, j, true, vs);
        if (++offset == P && j + 1 < n) {  // the next token starts the next block
          offset = 0;
          page = const_cast<uint8_t*>(p.pages) + p.token_page(t.req, k0 + j + 1, h);
        }
      }

      // Scores into w: from the packed planes, or four rows x four widened keys at a time, group by group.
#if defined(__AVX2__) && !defined(__AVX512F__)
      for (int64_t r = 0; r < rows4 && planes; r += 4) key_plane_scores_bits(l.key_bits, q, r, D, G, ks, j0, n, w);
#endif
#if defined(__AVX512VNNI__)
      if (int_k) {
        for (int j = 0; j < kTile; ++j) key_rows[j] = j >= j0 && j < n ? ks.packed[j] : zero_key.p;
        for (int g = 0; g < Bg; ++g) smax_buf.p[g] = max_range(ks.scale + g * kTile + j0, n - j0);
        tkl.choose(smax_buf.p, three_buf.p);
        token_key_scores_bits<kTile>(l.key_bits, tkl, rows4 / 4, three_buf.p, key_rows, ks.scale, ks.zero, qsum4_buf.p,
                                     w);
      }
#endif
      for (int64_t r = 0; r < rows4 && !planes && !int_k; r += 4) {
        for (int j = 0; j < kTile; j += 4) {
          float s16[16] = {}, part[16];
          for (int g = 0; g < Bg; ++g) {
            const int b = g * G, e = b + G < D ? b + G : D;
            const float* qr[4] = {q + r * D + b, q + (r + 1) * D + b, q + (r + 2) * D + b, q + (r + 3) * D + b};
            dot4x4(qr, ks.codes + int64_t(j) * D + b, e - b, D, part);
            const float *sc = ks.scale + g * kTile + j, *ze = ks.zero + g * kTile + j;
            for (int a = 0; a < 4; ++a)
              for (int c = 0; c < 4; ++c) s16[4 * a + c] += sc[c] * part[4 * a + c] + ze[c] * qsum[(r + a) * Bg + g];
          }
          for (int a = 0; a < 4; ++a)
            for (int c = 0; c < 4; ++c) w[(r + a) * kTile + j + c] = s16[4 * a + c];
        }
      }
      corrupt |= !for_each_outlier<X>(l, off, ks, false, j0, n, [&](int j, int, int pos, float delta) {
        for (int64_t i = 0; i < rows4; ++i) w[i * kTile + j] += q[i * D + pos] * delta;
      });

      // Mask, soft-cap, online softmax: w becomes the tile's weights exp(s - max).
      for (int64_t i = 0; i < rows4; ++i) {
        float* wr = w + i * kTile;
        // A tile the row sees whole (the common case) needs no mask; whether it
        // does depends on the row and the tile only, not on the task.
        const bool whole = p.visible_coded(qpos[i], k0) && p.visible_coded(qpos[i], k0 + kTile - 1);
        if (whole && !(p.softcap > 0.f)) {
          if (!all_finite(wr, kTile)) bad[i] = 1;
        } else {
          float check = 0.f;  // NaN once a seen score is NaN or Inf
          for (int j = 0; j < kTile; ++j) {
            float s = wr[j];
            if (!whole && (j < j0 || j >= n || !p.visible_coded(qpos[i], k0 + j))) {
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
        rescale(i, exp_nonpos(mx[i] - new_max));  // by 0 on the first tile (mx = -inf)
        mx[i] = new_max;
        exp_shifted(wr, kTile, 0, kTile, new_max);  // masked: exp(-inf) = 0
        sum[i] += sum_f(wr, kTile);
      }

      // acc += (p * s_g) . codes_g; zacc_g += sum(p * z_g), added to group g's channels at the end.
      for (int g = 0; g < Bg; ++g) {
        const int b = g * G, e = b + G < D ? b + G : D;
        const float *sc = vs.scale + g * kTile, *ze = vs.zero + g * kTile;
        for (int64_t i = 0; i < rows4; ++i) {
          const float* wr = w + i * kTile;
          float* wgr = wg + i * kTile;
          float part[8] = {};  // sum(p * z_g) in eight lanes (kTile % 8 == 0)
          for (int j = 0; j < kTile; j += 8)
            for (int c = 0; c < 8; ++c) wgr[j + c] = wr[j + c] * sc[j + c], part[c] += wr[j + c] * ze[j + c];
          zacc[i * Bg + g] += ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
        }
        for (int64_t r = 0; r < rows4; r += 4) {
          float* ar[4] = {acc + r * D + b, acc + (r + 1) * D + b, acc + (r + 2) * D + b, acc + (r + 3) * D + b};
          const float* wr[4] = {wg + r * kTile, wg + (r + 1) * kTile, wg + (r + 2) * kTile, wg + (r + 3) * kTile};
          pv_rows(4, ar, wr, 0, e - b, vs.codes + b, kTile, e - b, D);
        }
      }
      corrupt |= !for_each_outlier<X>(l, off, vs, true, j0, n, [&](int j, int, int pos, float delta) {
        for (int64_t i = 0; i < rows4; ++i) acc[i * D + pos] += w[i * kTile + j] * delta;
      });
    }

    // The exact window: keys [e0, key_end) exact, one pass (the last update of every row).
    if (W > 0) {
      const int64_t e0 = std::max(key_begin, first_pos - W + 1);
      const int ne = int(key_end - e0);
      float *ek = ek_buf.p, *ev = ev_buf.p, *we = we_buf.p, *accx = accx_buf.p;
      for (int j = 0; j < ne; ++j) {
        Rows<X>::widen(p.exact_row(off, t.req, e0 + j, h, false), D, ek + int64_t(j) * D);
        Rows<X>::widen(p.exact_row(off, t.req, e0 + j, h, true), D, ev + int64_t(j) * D);
      }
      fill_f(accx, rows4 * D, 0.f);
      // Row i reads keys [lo, hi) of them, in order, one at a time: its sums must not depend on
      // where the task's keys start (a vector sum over the task's range would group them by it).
      for (int64_t i = 0; i < rows; ++i) {
        int64_t lo = qpos[i] - W + 1 > e0 ? qpos[i] - W + 1 - e0 : 0;
        while (lo < ne && !p.visible_exact(qpos[i], e0 + lo)) ++lo;  // the sliding window's start
        const int64_t hi = qpos[i] + 1 - e0;
        float check = 0.f, tile_max = kNegInf;  // check: NaN once a seen score is NaN or Inf
        for (int64_t j = lo; j < hi; ++j) {
          float sc = dot_f(qx_buf.p + i * D, ek + j * D, D);
          if (p.softcap > 0.f) sc = p.softcap * tanh_f(sc / p.softcap);
          we[j] = sc;
          check += sc * 0.f;
          tile_max = max_f(tile_max, sc);
        }
        if (!(check == 0.f)) bad[i] = 1;
        if (lo >= hi || bad[i]) continue;
        const float new_max = max_f(tile_max, mx[i]);
        rescale(i, exp_nonpos(mx[i] - new_max));
        mx[i] = new_max;
        float* xr = accx + i * D;
        for (int64_t j = lo; j < hi; ++j) {
          const float pj = exp_nonpos(we[j] - new_max), *vr = ev + j * D;
          sum[i] += pj;
          for (int c = 0; c < D; ++c) xr[c] += pj * vr[c];
        }
      }
    }

    for (int64_t i = 0; i < rows; ++i) {
      float* ar = acc + i * D;
      for (int g = 0; g < Bg; ++g) {
        const int b = g * G, e = b + G < D ? b + G : D;
        for (int c = b; c < e; ++c) ar[c] += zacc[i * Bg + g];
      }
      // Every query sees its own key, so sum > 0 unless a score was not finite.
      const float inv = bad[i] || corrupt || !(sum[i] > 0.f) ? kQuietNaN : 1.f / sum[i];
      for (int c = 0; c < D; ++c) ar[c] *= inv;
      if (p.rotation_signs) hadamard_rotate_rows(ar, ar, 1, D, p.rotation_signs, true);
      if (W > 0)
        for (int c = 0; c < D; ++c) ar[c] += accx_buf.p[i * D + c] * inv;
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
