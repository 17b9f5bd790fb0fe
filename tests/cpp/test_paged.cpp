// The paged kernels of the torch-free core: tokens written to shuffled slots
// hold the NQ buffers of nq_compress (byte for byte), and attention over a
// request's pages matches a double-precision attention over the decompressed
// rows, causal, with GQA, a sliding window and an exact window (each query's
// newest tokens read exact: its own step's rows and the rings of older ones).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "catch_compat.h"
#include "nexuskv/core/cpu_isa.h"
#include "nexuskv/core/paged.h"

using namespace nexuskv::core;

TEST_CASE("paged write and attention against nq_compress and double attention", "[paged]") {
  const int D = 64, P = 16, H = 2, Hq = 4, T = 40, Q = 5, blocks = 6;
  // Channel groups of 32 (one outlier); of 24, whose widths are not a multiple of
  // the vector (the kernel's scalar tails) and the last group 16 channels; of 48
  // with 20 outliers, more than the last group's 16 channels (positions repeat:
  // each corrected once).  Every key width: AVX2 multiplies queries by the packed
  // planes of keys in groups of whole 16-channel planes (2 bits: one 64-channel
  // chunk of four planes; 3 bits in groups of 16: a new scale at each plane of a
  // chunk; 8 bits: one plane per chunk), and by widened keys otherwise.
  struct Config {
    int group_size, outliers, key_bits, value_bits;
  };
  const Config configs[] = {{32, 1, 4, 2}, {24, 2, 4, 2}, {48, 20, 4, 2}, {64, 0, 2, 4}, {16, 1, 3, 3}, {64, 2, 8, 8}};
  for (auto [group_size, outliers, key_bits, value_bits] : configs)
    for (auto [window, exact] : {std::pair{0, 0}, std::pair{9, 0}, std::pair{0, 7}, std::pair{4, 7}}) {
      INFO("group " << group_size << ", outliers " << outliers << ", bits " << key_bits << "/" << value_bits
                    << ", exact window " << exact);
      PagedLayout l;
      l.head_dim = D, l.block_size = P, l.key_bits = key_bits, l.value_bits = value_bits, l.group_size = group_size;
      l.num_outliers = outliers;
      l.x_bytes = 4;
      l.exact_window = exact;
      PagedPool pool{l, blocks, H};
      std::vector<uint8_t> pages(size_t(blocks * H * l.head_page_bytes()));
      std::mt19937 rng(3);
      std::normal_distribution<float> nd(0.f, 1.f);
      std::vector<float> k(size_t(T * H * D)), v(k.size()), q(size_t(Q * Hq * D)), out(q.size());
      for (auto* x : {&k, &v, &q})
        for (auto& e : *x) e = nd(rng);
      // Blocks 4, 1, 3 in that order; tokens written in a shuffled order.
      const std::vector<int32_t> table = {4, 1, 3};
      std::vector<int64_t> slots(T), order(T);
      for (int t = 0; t < T; ++t) slots[size_t(t)] = int64_t(table[size_t(t / P)]) * P + t % P, order[size_t(t)] = t;
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<float> ks(k.size()), vs(v.size());
      std::vector<int64_t> ss(slots.size());
      for (int i = 0; i < T; ++i) {
        const int t = int(order[size_t(i)]);
        std::memcpy(&ks[size_t(i * H * D)], &k[size_t(t * H * D)], sizeof(float) * H * D);
        std::memcpy(&vs[size_t(i * H * D)], &v[size_t(t * H * D)], sizeof(float) * H * D);
        ss[size_t(i)] = slots[size_t(t)];
      }
      PagedWrite<float> w;
      w.pool = pool, w.pages = pages.data(), w.key = ks.data(), w.value = vs.data();
      w.key_stride_t = w.value_stride_t = H * D, w.slot_mapping = ss.data(), w.num_tokens = T;
      CompressStatus st;
      paged_write_tokens(w, 0, T, &st);
      REQUIRE(!st.non_finite_input);

      // Each head's rows through nq_compress / nq_decompress: the bytes and values the pages must hold.
      std::vector<std::vector<double>> dense(size_t(2 * H));
      for (int h = 0; h < H; ++h)
        for (int half = 0; half < 2; ++half) {
          NQDims d = l.token_dims(half ? l.value_bits : l.key_bits);
          d.tokens = T;
          const int64_t rb = d.packed_row_bytes(), groups = d.groups_per_row(), kk = d.num_outliers;
          std::vector<uint8_t> codes(static_cast<size_t>(T * rb)), idx(static_cast<size_t>(groups * kk));
          std::vector<float> scale(static_cast<size_t>(groups)), zero(static_cast<size_t>(groups)),
              val(static_cast<size_t>(groups * kk)), x(static_cast<size_t>(T * D));
          const std::vector<float>& src = half ? v : k;
          const int64_t offset = int64_t(h) * D;
          nq_compress_tasks<float, float>(d, {src.data(), &offset, H * D, 1},
                                          {codes.data(), scale.data(), zero.data(), idx.data(), val.data()}, 0,
                                          nq_num_tasks(d), &st);
          nq_decompress_tasks<float, float>(d, codes.data(), scale.data(), zero.data(), x.data(), 0, nq_num_tasks(d));
          REQUIRE(nq_scatter_outliers<float, float>(d, idx.data(), val.data(), x.data(), 0, groups));
          dense[size_t(2 * h + half)].assign(x.begin(), x.end());
          const int G = int(d.meta_b());
          for (int t = 0; t < T; ++t) {
            const PagedSlot<float> s =
                paged_slot<float>(l, pages.data() + pool.head_page(table[size_t(t / P)], h), t % P, half == 1);
            CHECK(std::memcmp(s.codes, &codes[size_t(t * rb)], size_t(rb)) == 0);
            CHECK(std::memcmp(s.scale, &scale[size_t(t * G)], sizeof(float) * G) == 0);
            CHECK(std::memcmp(s.zero, &zero[size_t(t * G)], sizeof(float) * G) == 0);
            if (kk > 0) {  // (no outliers: idx and val are empty, and memcmp wants valid pointers)
              CHECK(std::memcmp(s.outlier_idx, &idx[size_t(t * G * kk)], size_t(G * kk)) == 0);
              CHECK(std::memcmp(s.outlier_val, &val[size_t(t * G * kk)], sizeof(float) * G * kk) == 0);
            }
          }
        }

      // The last Q tokens are the queries; the rings hold the older ones (written after their
      // own steps' attention, in token order), the queries' own rows come with the call.
      if (exact > 0) {
        PagedWrite<float> x;
        x.pool = pool, x.pages = pages.data(), x.key = k.data(), x.value = v.data();
        x.key_stride_t = x.value_stride_t = H * D, x.slot_mapping = slots.data(), x.num_tokens = T - Q;
        paged_write_exact(x, 0, H);
        for (int t = T - Q - exact; t < T - Q; ++t)  // the ring rows by the format's offsets
          for (int h = 0; h < H; ++h) {
            uint8_t* page = pages.data() + pool.head_page(table[size_t(t / P)], h);
            const float* ring = reinterpret_cast<const float*>(page + int64_t(P) * l.code_slot_bytes());
            CHECK(std::memcmp(ring + (t % P % exact) * D, &k[size_t((t * H + h) * D)], sizeof(float) * D) == 0);
          }
      }
      const int32_t seq_len = T, qsl[2] = {0, Q};
      PagedAttention<float> p;
      p.pool = pool, p.pages = pages.data(), p.q = q.data(), p.q_stride_t = Hq * D, p.q_stride_h = D;
      p.out = out.data(), p.num_tokens = Q, p.q_heads = Hq, p.num_reqs = 1, p.max_blocks = 3;
      p.block_table = table.data(), p.seq_lens = &seq_len, p.query_start_loc = qsl, p.scale = 0.125f;
      p.window = window;
      p.key = &k[size_t((T - Q) * H * D)], p.value = &v[size_t((T - Q) * H * D)], p.key_stride_t = H * D;
      p.value_stride_t = H * D;
      // Every instruction set this build and CPU have (paged_attention_kernel.cpp is compiled per ISA).
      for (CpuIsa isa : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
        if (!cpu_isa_supported(isa)) continue;
        const CpuIsa previous = set_cpu_isa_cap(isa);
        std::fill(out.begin(), out.end(), NAN);
        for (int h = 0; h < H; ++h) REQUIRE(paged_attention_task(p, PagedTask{0, 0, Q}, h, h + 1));
        set_cpu_isa_cap(previous);
        REQUIRE(last_kernel_isa() == isa);
        // AVX2: keys from their packed planes; AVX512-VNNI: integer q . K on the packed codes
        // (2/4/8 bits); both in groups of whole 16-channel planes.
        const bool whole = group_size % 16 == 0;
        REQUIRE(last_paged_key_path() == (isa == CpuIsa::kAvx512 && whole && key_bits != 3 ? PagedKeyPath::kInteger
                                          : isa == CpuIsa::kAvx2 && whole                  ? PagedKeyPath::kPlanes
                                                                                           : PagedKeyPath::kWidened));
        double worst = 0;
        for (int i = 0; i < Q; ++i)
          for (int hq = 0; hq < Hq; ++hq) {
            const int h = hq / (Hq / H), pos = T - Q + i;
            const std::vector<double>&kd = dense[size_t(2 * h)], &vd = dense[size_t(2 * h + 1)];
            std::vector<double> s(size_t(pos + 1), -INFINITY);
            double mx = -INFINITY, sum = 0;
            // Key / value channel c of token t: exact within the exact window, else decompressed.
            const auto kv = [&](const std::vector<double>& dec, const std::vector<float>& x, int t, int c) {
              return t > pos - exact ? double(x[size_t((t * H + h) * D + c)]) : dec[size_t(t * D + c)];
            };
            for (int t = 0; t <= pos; ++t) {
              if (window > 0 && t <= pos - window) continue;
              double dot = 0;
              for (int c = 0; c < D; ++c) dot += double(q[size_t((i * Hq + hq) * D + c)]) * kv(kd, k, t, c);
              s[size_t(t)] = dot * 0.125;
              mx = std::max(mx, s[size_t(t)]);
            }
            std::vector<double> o(D, 0.0);
            for (int t = 0; t <= pos; ++t) {
              if (s[size_t(t)] == -INFINITY) continue;
              const double e = std::exp(s[size_t(t)] - mx);
              sum += e;
              for (int c = 0; c < D; ++c) o[size_t(c)] += e * kv(vd, v, t, c);
            }
            for (int c = 0; c < D; ++c)
              worst = std::max(worst, std::abs(o[size_t(c)] / sum - out[size_t((i * Hq + hq) * D + c)]));
          }
        INFO("window " << window << ", " << cpu_isa_name(isa) << ": max error " << worst);
        CHECK(worst < 1e-5);
      }
    }
}
