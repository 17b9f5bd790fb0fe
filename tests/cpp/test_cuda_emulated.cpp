// The kernels of csrc/cuda run on the host by simt_emulated.h (one std::thread
// per CUDA thread, the warp instructions as PTX documents them): NQ compress
// and decompress against the CPU's, bit for bit; the paged write (NQ compression of every (token, head) row, rotation,
// scatter into the slots) against the CPU's, byte for byte; the attention's tensor-core kernels (paged_decode.cuh for
// decode steps, paged_mma.cuh for the rest, paged_mma_launch.cuh's plan, split and merge) and its SIMT kernel against
// the CPU kernel on the same pages; dgq_fused_attention's kernels (the decode
// kernel of contig_decode.cuh with its full-precision split, the tensor-core one
// of attention_mma.cuh and the reference attention_simple.cuh, split and merged)
// against the CPU kernel on the same compressed cache.
// The kernels' indices, fragment layouts,
// softmax and merges, checked where no GPU is; not their speed, nor the
// hardware's own rounding (a GPU run does that: tests/python/test_cuda_paged.py).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "attention_kernels.cuh"
#include "catch_compat.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/nq_kernels.h"
#include "nexuskv/core/paged.h"
#include "nq_compress.cuh"
#include "nq_decompress.cuh"
#include "paged_kernels.cuh"
#include "paged_mma_launch.cuh"

using namespace nexuskv;

// The contiguous attention's instantiations (attention_<T>.cu and attention_merge.cu on a GPU build).
namespace nexuskv::cuda {
NEXUSKV_ATTENTION_INSTANCES(, core::half_t)
NEXUSKV_ATTENTION_INSTANCES(, core::bf16_t)
template int launch_attention_merge<core::half_t>(const MergeArgs&, core::half_t*, Stream);
template int launch_attention_merge<core::bf16_t>(const MergeArgs&, core::bf16_t*, Stream);
}  // namespace nexuskv::cuda

namespace {

struct Case {
  int bits, D, group, P, kv_heads, gqa;
  std::vector<int> context;  // tokens of each request, its queries included
  std::vector<int> queries;  // the step's queries of each request (the newest tokens)
  int64_t window = 0;
  float softcap = 0.f;
  bool rotate = true;
  int tile_rows = 8;         // the row tiles the plan must choose (8: the decode kernel; 0: the SIMT kernel)
  int exact = 0;             // the format's exact window (the tensor-core kernels do not take one)
  int corrupt = -1;          // a token of request 0 whose key scale (kv head 0) is set to +inf after the write
  float q_scale = 1.f;       // the queries' scale (2^118: near the largest bf16, where normalizers must reach)
  int bad_block = -1;        // a block of request 0 whose table entry is set outside the pool after the write
  float value_growth = 4.f;  // values grow by 2^(value_growth t / T) along a context (the normalizer moves)
  int min_steady = 0;        // warp iterations the decode kernel's steady loop must complete (emulation's count)
  bool negative_value_scales = false;  // every value scale negated after the write (both kernels read them so)
  float key_offset = 0.f;              // keys + U(0, key_offset) per token: zeros far from 0 and apart
  bool singles_apart = false;          // (16-row tiles) the plan runs the one-token requests' 8-row launch
};

template <typename X>
void run_case(const Case& c) {
  using core::PagedLayout;
  PagedLayout l;
  l.head_dim = c.D, l.block_size = c.P, l.key_bits = c.bits, l.value_bits = c.bits, l.group_size = c.group;
  l.num_outliers = 0, l.x_bytes = 2, l.exact_window = c.exact;
  const int R = int(c.context.size()), H = c.kv_heads, Hq = H * c.gqa, D = c.D;
  int max_blocks = 0, total_blocks = 0;
  for (int n : c.context) max_blocks = std::max(max_blocks, (n + c.P - 1) / c.P), total_blocks += (n + c.P - 1) / c.P;
  const core::PagedPool pool{l, total_blocks + 3, H};
  std::vector<uint8_t> pages(size_t(pool.num_blocks * H * l.head_page_bytes())), pages_cuda(pages);
  std::mt19937 rng(uint32_t(c.bits * 131 + D + c.group + R));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> signs(static_cast<size_t>(D));
  for (auto& s : signs) s = rng() % 2 ? 1.f : -1.f;
  // Block tables from a shuffled pool of block ids; every token written.
  std::vector<int32_t> ids(size_t(pool.num_blocks)), table(size_t(R * max_blocks), -1);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  size_t next = 0;
  float vmax = 0.f;
  std::vector<int32_t> seq_lens(c.context.begin(), c.context.end()), qsl(size_t(R + 1), 0);
  for (int r = 0; r < R; ++r) qsl[size_t(r + 1)] = qsl[size_t(r)] + c.queries[size_t(r)];
  const int N = qsl[size_t(R)];
  std::vector<X> step_k(size_t(N * H * D)), step_v(step_k.size());  // the step's own rows (exact window)
  for (int r = 0; r < R; ++r) {
    const int T = c.context[size_t(r)];
    for (int b = 0; b < (T + c.P - 1) / c.P; ++b) table[size_t(r * max_blocks + b)] = ids[next++];
    std::vector<X> k(size_t(T * H * D)), v(k.size());
    std::uniform_real_distribution<float> offset(0.f, c.key_offset);
    float key_offset = 0.f;
    for (size_t i = 0; i < k.size(); ++i) {
      if (c.key_offset > 0.f && i % size_t(H * D) == 0) key_offset = offset(rng);  // (per token)
      k[i] = core::from_float<X>(nd(rng) + key_offset);
      // values growing along the context: the decode kernel's value normalizer moves
      v[i] = core::from_float<X>(nd(rng) * std::exp2(c.value_growth * float(i / size_t(H * D)) / float(T)));
      vmax = std::max(vmax, std::fabs(core::to_float(v[i])));
    }
    std::vector<int64_t> slots(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) slots[size_t(t)] = int64_t(table[size_t(r * max_blocks + t / c.P)]) * c.P + t % c.P;
    core::PagedWrite<X> w;
    w.pool = pool, w.pages = pages.data(), w.key = k.data(), w.value = v.data();
    w.key_stride_t = w.value_stride_t = H * D, w.slot_mapping = slots.data(), w.num_tokens = T;
    w.rotation_signs = c.rotate ? signs.data() : nullptr;
    core::CompressStatus st;
    core::paged_write_tokens(w, 0, T, &st);
    REQUIRE(!st.non_finite_input);
    // The CUDA write of the same tokens into a copy of the pages before them: the same bytes.
    std::vector<uint8_t> scratch(size_t(cuda::paged_write_scratch(l, int64_t(T) * H, c.rotate).bytes) + 256);
    w.pages = pages_cuda.data();
    uint32_t status = 0;
    cuda::launch_paged_write(w, scratch.data(), &status, nullptr);
    REQUIRE(status == 0);
    REQUIRE(pages_cuda == pages);
    // The exact window's rings: the tokens before the step's (written after their own steps'
    // attention, as a serving engine does), by the CPU and by the CUDA kernel; the step's own rows.
    const int Q = c.queries[size_t(r)];
    if (c.exact > 0) {
      w.num_tokens = T - Q;
      w.pages = pages.data();
      core::paged_write_exact(w, 0, H);
      w.pages = pages_cuda.data();
      cuda::launch_paged_exact_write(w, &status, nullptr);
      REQUIRE(status == 0);
      REQUIRE(pages_cuda == pages);
    }
    std::copy(k.end() - Q * H * D, k.end(), step_k.begin() + qsl[size_t(r)] * H * D);
    std::copy(v.end() - Q * H * D, v.end(), step_v.begin() + qsl[size_t(r)] * H * D);
  }
  if (c.negative_value_scales) {  // values -|scale| code + zero: the decode kernel's normalizer vote sees |scale|
    const core::PagedOffsets o(l);
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < (c.context[size_t(r)] + c.P - 1) / c.P; ++b)
        for (int h = 0; h < H; ++h)
          for (int s = 0; s < c.P; ++s) {
            uint8_t* head_page =
                pages.data() + (int64_t(table[size_t(r * max_blocks + b)]) * H + h) * l.head_page_bytes();
            const core::PagedSlot<X> v = core::paged_slot<X>(o, head_page, s, true);
            for (int gi = 0; gi < o.groups; ++gi) {
              v.scale[gi].bits = uint16_t(v.scale[gi].bits ^ 0x8000u);
              // (the values' new range: the tolerance's scale)
              const float bound = std::fabs(core::to_float(v.zero[gi])) +
                                  std::fabs(core::to_float(v.scale[gi])) * float((1 << c.bits) - 1);
              if (b * c.P + s < c.context[size_t(r)]) vmax = std::max(vmax, bound);
            }
          }
  }
  if (c.corrupt >= 0) {  // its scores are not finite: the rows that see it are NaN
    const int64_t slot = int64_t(table[size_t(c.corrupt / c.P)]) * c.P + c.corrupt % c.P;
    X* scale = reinterpret_cast<X*>(pages.data() + (slot / c.P * H) * l.head_page_bytes() +
                                    core::PagedOffsets(l).scale[0] + slot % c.P * l.groups() * int64_t(sizeof(X)));
    *scale = core::from_float<X>(std::numeric_limits<float>::infinity());
  }
  std::vector<X> q(size_t(N * Hq * D)), want(q.size()), got(q.size());
  for (auto& x : q) x = core::from_float<X>(nd(rng) * c.q_scale);

  core::PagedAttention<X> p;
  p.pool = pool, p.pages = pages.data(), p.q = q.data(), p.q_stride_t = Hq * D, p.q_stride_h = D;
  p.num_tokens = N, p.q_heads = Hq, p.num_reqs = R, p.max_blocks = max_blocks;
  p.block_table = table.data(), p.seq_lens = seq_lens.data(), p.query_start_loc = qsl.data();
  p.rotation_signs = c.rotate ? signs.data() : nullptr;
  p.scale = 0.125f, p.window = c.window, p.softcap = c.softcap;
  if (c.exact > 0) p.key = step_k.data(), p.value = step_v.data(), p.key_stride_t = p.value_stride_t = H * D;
  // The tensor-core kernels, emulated, into `got` (none where the plan takes the SIMT kernel).
  uint32_t status = 0;
  const auto run_mma = [&] {
    p.out = got.data();
    const cuda::PagedAttentionPlan plan = cuda::paged_mma_plan(p, 4);
    REQUIRE(plan.mma == (c.tile_rows > 0));
    if (!plan.mma) return plan;
    REQUIRE(plan.tile_rows == c.tile_rows);
    REQUIRE(plan.singles_apart == c.singles_apart);
    std::vector<uint64_t> scratch(size_t(plan.scratch_bytes / 8 + 32));
    REQUIRE(cuda::launch_paged_attention_mma(p, plan, reinterpret_cast<uint8_t*>(scratch.data()), &status, nullptr) ==
            0);
    return plan;
  };
  if (c.bad_block >= 0) {
    // The tensor-core kernel reports it and poisons request 0's rows (every kv head reads that
    // block); request 1 is untouched.  (The CPU kernel refuses the table.)
    table[size_t(c.bad_block)] = int32_t(pool.num_blocks);
    REQUIRE(run_mma().mma);
    CHECK((status & cuda::kBadBlock) != 0);
    for (int n = 0; n < N; ++n)
      for (int hq = 0; hq < Hq; ++hq) {
        const float x = core::to_float(got[size_t((n * Hq + hq) * D)]);
        INFO("query row " << n << ", head " << hq);
        CHECK((n < qsl[1] ? std::isnan(x) : std::isfinite(x)));
      }
    return;
  }
  // The CPU kernel: every request's queries in tasks of up to kPagedQueryBlock.
  p.out = want.data();
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < c.queries[size_t(r)]; i += core::kPagedQueryBlock)
      REQUIRE(core::paged_attention_task(
          p, core::PagedTask{r, i, std::min<int64_t>(core::kPagedQueryBlock, c.queries[size_t(r)] - i)}, 0, H));
  // The tensor-core kernels, emulated.
  const int64_t steady = cuda::emu::counters.decode_steady, moved = cuda::emu::counters.decode_normalizer;
  const int64_t tile_blocks = cuda::emu::counters.paged_tile_blocks;
  const int64_t single_blocks = cuda::emu::counters.paged_single_blocks;
  const cuda::PagedAttentionPlan plan = run_mma();
  if (plan.mma) {
    INFO("splits " << plan.splits);
    REQUIRE(status == 0);
    // Each request's rows in the launch meant for it: with singles_apart, a block per request of
    // one token (kv head, split) in the decode kernel's launch and none of its tiles in the other.
    int64_t tiles = 0, singles = 0;
    for (int r = 0; r < R; ++r) {
      const int q = c.queries[size_t(r)];
      if (plan.singles_apart && q == 1)
        ++singles;
      else
        tiles += (q + plan.tokens_per_tile - 1) / plan.tokens_per_tile;
    }
    CHECK(cuda::emu::counters.paged_single_blocks - single_blocks == singles * H * plan.splits);
    CHECK(cuda::emu::counters.paged_tile_blocks - tile_blocks == tiles * H * plan.head_chunks * plan.splits);
    // the steady loop ran where the case needs it (a warp's first iteration always moves the normalizer)
    INFO("steady iterations " << cuda::emu::counters.decode_steady - steady << ", handed to the edge "
                              << cuda::emu::counters.decode_normalizer - moved);
    CHECK(cuda::emu::counters.decode_steady - steady >= c.min_steady);
  }
  // Both round to X at the end; the kernels' queries are fp16 hi + lo or, in the decode kernel,
  // 16-bit integers (2^-15 of the row's largest), and their sums in another order:
  // test_cuda_paged.py's tolerance (1.5 x the largest value x (X's epsilon + 1e-4)).
  const double tol = 1.5 * vmax * ((std::is_same_v<X, core::bf16_t> ? 0x1p-8 : 0x1p-11) + 1e-4);
  // Rows that see a corrupt key are NaN on both sides (and only those); the rest finite and close.
  int64_t nan_rows = 0;
  for (size_t i = 0; i < want.size(); i += size_t(D)) nan_rows += std::isnan(core::to_float(want[i]));
  CHECK(nan_rows == (c.corrupt >= 0 ? c.gqa * c.queries[0] : 0));
  const auto worst = [&](const std::vector<X>& out) {
    double w = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      const double a = core::to_float(out[i]), b = core::to_float(want[i]);
      REQUIRE(std::isnan(a) == std::isnan(b));
      REQUIRE((std::isfinite(a) || std::isnan(b)));
      if (!std::isnan(b)) w = std::max(w, std::fabs(a - b));
    }
    return w;
  };
  INFO("tolerance " << tol);
  if (plan.mma) CHECK(worst(got) <= tol);
  // The SIMT kernel on the same pages.
  p.out = got.data();
  REQUIRE(cuda::launch_paged_attention_simt(p, &status, nullptr) == 0);
  REQUIRE(status == 0);
  CHECK(worst(got) <= tol);
}

}  // namespace

TEST_CASE("paged decode kernel (emulated) against the CPU kernel", "[cuda_emulated]") {
  // vLLM's default pages (4 bits, D128, groups of 64), GQA 4, contexts long enough to split
  run_case<core::bf16_t>({4, 128, 64, 16, 2, 4, {700, 70, 33}, {1, 1, 1}});
  // 2 bits, D64 in four groups of 16, blocks of 32, GQA 8, a sliding window and a soft-cap
  run_case<core::half_t>({2, 64, 16, 32, 1, 8, {300, 5}, {1, 1}, 40, 30.f});
  // 2 bits, D128 in two groups (four chunks a warp iteration, a lane's page lookup each), GQA 4: steady
  // iterations (values growing along the context: some move the value normalizer) and edges
  run_case<core::bf16_t>({2, 128, 64, 16, 2, 4, {900, 260, 33}, {1, 1, 1}});
  // 2 bits in fp16, one group, GQA 8, blocks of 48 tokens (a chunk's first slot not 0)
  run_case<core::half_t>({2, 128, 128, 48, 1, 8, {1000, 64}, {1, 1}});
  // 2 bits, D128 in four groups: four chunks an iteration
  run_case<core::bf16_t>({2, 128, 32, 16, 2, 4, {1300, 300}, {1, 1}});
  // 8 bits, D128 in one group, GQA 1, no rotation; a request of 2 tokens beside one of none
  run_case<core::half_t>({8, 128, 128, 16, 2, 1, {90, 200, 17}, {1, 2, 0}, 0, 0.f, false});
  // a key whose scale is +inf, in a chunk every row sees (the steady loop's) and in the newest (the edge's)
  run_case<core::bf16_t>({4, 128, 64, 16, 2, 4, {300, 70}, {1, 1}, 0, 0.f, true, 8, 0, 150});
  run_case<core::half_t>({2, 64, 32, 16, 2, 8, {300, 70}, {1, 1}, 0, 0.f, true, 8, 0, 299});
  // queries near the largest bf16 (2^118 x N(0, 1)): the softmax one-hot, the queries' normalizer 2^-103
  run_case<core::bf16_t>({4, 128, 64, 16, 2, 4, {300, 70}, {1, 1}, 0, 0.f, true, 8, 0, -1, 0x1p118f});
}

TEST_CASE("paged decode kernel (emulated): steady iterations that keep the value normalizer", "[cuda_emulated]") {
  // Values of one size along the context (growing ones move the normalizer in most iterations,
  // and a warp's first always moves it): the steady loop's own iterations run, counted.
  // 2 bits D64 in one group, GQA 8, a long request beside a short one
  run_case<core::bf16_t>({2, 64, 64, 16, 2, 8, {3000, 70}, {1, 1}, 0, 0.f, true, 8, 0, -1, 1.f, -1, 0.f, 16});
  // 2 bits D128 in two groups, fp16, blocks of 48
  run_case<core::half_t>({2, 128, 64, 48, 2, 4, {4000, 2000}, {1, 1}, 0, 0.f, true, 8, 0, -1, 1.f, -1, 0.f, 16});
  // queries near the largest bf16: scores ~2^120, where the largest one's exponential must be exactly 1
  run_case<core::bf16_t>({4, 128, 64, 16, 2, 4, {3000, 70}, {1, 1}, 0, 0.f, true, 8, 0, -1, 0x1p118f, -1, 0.f, 16});
  // a key scale of +inf mid-context (token 1700 of 3000): its rows NaN through the steady loop's x * 0
  run_case<core::half_t>({2, 64, 32, 16, 2, 8, {3000, 70}, {1, 1}, 0, 0.f, true, 8, 0, 1700, 1.f, -1, 0.f, 16});
}

TEST_CASE("paged decode kernel (emulated): keys far from zero", "[cuda_emulated]") {
  // Keys U(0, 100) + N(0, 1), the offset drawn per token, not rotated: the zeros' part of a score,
  // zero x the row's sum of q over the group (the decode kernel's zeros MMA), is most of it and
  // differs from key to key; values of one size; four, two and one groups a head.  (A wrong zeros
  // term fails here; the sums' second term, 2^-9 -> 2^-17 of the zeros' part in bf16, is finer than
  // this tolerance sees.)
  run_case<core::bf16_t>(
      {2, 64, 16, 16, 2, 8, {700, 70}, {1, 1}, 0, 0.f, false, 8, 0, -1, 1.f, -1, 0.f, 0, false, 100.f});
  run_case<core::half_t>(
      {4, 128, 64, 16, 2, 4, {700, 70}, {1, 1}, 0, 0.f, false, 8, 0, -1, 1.f, -1, 0.f, 0, false, 100.f});
  run_case<core::bf16_t>(
      {8, 64, 64, 16, 2, 1, {700, 70}, {1, 1}, 0, 0.f, false, 8, 0, -1, 1.f, -1, 0.f, 0, false, 100.f});
}

TEST_CASE("paged decode kernel (emulated): value scales all negative", "[cuda_emulated]") {
  // Values growing along the context: the vote must see |scale| grow (bf16 by its running min, fp16 by
  // |.| in its max), or the weights overflow fp16; 2 bits D64 in four, one and two groups a head.
  run_case<core::bf16_t>({2, 64, 16, 16, 2, 8, {2000, 70}, {1, 1}, 0, 0.f, true, 8, 0, -1, 1.f, -1, 2.f, 4, true});
  run_case<core::half_t>({2, 64, 64, 16, 2, 8, {2000, 70}, {1, 1}, 0, 0.f, true, 8, 0, -1, 1.f, -1, 2.f, 4, true});
  run_case<core::bf16_t>({2, 64, 32, 16, 2, 4, {2000, 70}, {1, 1}, 0, 0.f, true, 8, 0, -1, 1.f, -1, 2.f, 4, true});
}

TEST_CASE("paged decode kernel (emulated): a block id outside the pool poisons its request", "[cuda_emulated]") {
  // Blocks of 16 keys, one chunk each: block b is chunk b / 4 of warp b % 4 (from the split's first
  // key), looked up by lane (b / 4) % kSub of that warp alone (kSub 4 at 2 bits, 2 at 4, 1 at 8):
  // blocks 5, 9 and 14 are chunks lane 0 does not look up at 2 bits, nor 5 and 14 at 4 bits.
  for (int bits : {2, 4, 8})
    for (int b : {5, 9, 14}) {
      INFO("bits " << bits << ", block " << b);
      run_case<core::bf16_t>({bits, 64, 64, 16, 2, 4, {300, 70}, {1, 1}, 0, 0.f, true, 8, 0, -1, 1.f, b});
    }
}

TEST_CASE("paged decode kernel (emulated): every format it takes", "[cuda_emulated]") {
  // 2/4/8 bits x head_dim 64 / 128 in 1, 2 or 4 groups, GQA 1, 4 and 8 in turn, fp16 and bf16
  const int formats[][2] = {{64, 64}, {128, 64}, {64, 16}, {128, 32}, {128, 128}};
  int i = 0;
  for (int bits : {2, 4, 8})
    for (auto [D, group] : formats) {
      const int gqa = i % 3 == 0 ? 1 : (i % 3 == 1 ? 4 : 8);
      INFO("bits " << bits << ", D " << D << ", group " << group << ", GQA " << gqa);
      const Case c{bits, D, group, 16, 2, gqa, {77, 140}, {1, 1}, i % 2 ? 50 : 0, i % 4 == 1 ? 20.f : 0.f};
      if (i++ % 2)
        run_case<core::half_t>(c);
      else
        run_case<core::bf16_t>(c);
    }
}

TEST_CASE("paged tensor-core kernels take blocks whose pages span less than 4 GiB", "[cuda_emulated]") {
  // (the decode kernel's page strides are 32-bit: a block's kv_heads pages past it go to the SIMT kernel)
  core::PagedLayout l;
  l.head_dim = 128, l.block_size = 4096, l.key_bits = 4, l.value_bits = 4, l.group_size = 64;
  l.num_outliers = 0, l.x_bytes = 2;
  alignas(16) static uint8_t pages[16];
  core::PagedAttention<core::bf16_t> p;
  p.pool = core::PagedPool{l, 1, 8}, p.pages = pages, p.max_blocks = 1;
  CHECK(cuda::paged_mma_takes(p));
  const int heads = int(((int64_t(1) << 32) + l.head_page_bytes() - 1) / l.head_page_bytes());  // 4 GiB a block
  p.pool.kv_heads = heads - 1;
  CHECK(cuda::paged_mma_takes(p));
  p.pool.kv_heads = heads;
  CHECK_FALSE(cuda::paged_mma_takes(p));
}

TEST_CASE("paged SIMT kernel with an exact window (emulated) against the CPU kernel", "[cuda_emulated]") {
  // the rings written by paged_exact_write (CPU and CUDA: the same bytes), read by each query's newest keys
  run_case<core::bf16_t>({4, 64, 32, 16, 2, 4, {90, 41}, {1, 1}, 0, 0.f, true, 0, 7});
  run_case<core::half_t>({2, 128, 64, 32, 1, 8, {70, 30}, {5, 2}, 24, 0.f, false, 0, 16});
}

TEST_CASE("paged 16-row kernel (emulated) against the CPU kernel", "[cuda_emulated]") {
  // a prefill chunk beside a decode step: 16-row tiles (paged_mma.cuh) for the chunk, the decode
  // step apart on the decode kernel (paged_decode.cuh)
  run_case<core::half_t>(
      {4, 128, 32, 16, 2, 4, {50, 30}, {20, 1}, 0, 0.f, true, 16, 0, -1, 1.f, -1, 4.f, 0, false, 0.f, true});
  run_case<core::bf16_t>({2, 64, 64, 16, 1, 16, {64, 9}, {1, 1}, 24, 0.f, true, 16});  // GQA 16: all 16-row
  // decode steps with long contexts beside two chunks (one of them at a window), values of one
  // size: the decode kernel's steady loop runs (the 16-row kernel has none), and requests of no
  // token and of two tokens stay with the 16-row kernel
  run_case<core::bf16_t>(
      {2,  128, 64, 16,    2,   4,   {3000, 2000, 40, 700, 90, 60}, {1, 1, 24, 0, 9, 2}, 0, 0.f, true, 16, 0, -1, 1.f,
       -1, 0.f, 16, false, 0.f, true});
  run_case<core::half_t>(
      {8, 64, 32, 16, 2, 8, {1500, 64, 33}, {1, 5, 1}, 300, 0.f, false, 16, 0, -1, 1.f, -1, 0.f, 4, false, 0.f, true});
}

namespace {

// One compressed [B, H, T, D] cache in X with X meta (keys per channel over groups of tokens,
// values per token over groups of channels), as nq_compress writes it.
template <typename X>
struct XCache {
  core::NQDims d;
  std::vector<uint8_t> codes, idx;
  std::vector<X> scale, zero, val;
  // (channel 5 x gain: a channel of larger keys; + U(0, offset) per channel and 64 tokens: channels far
  // from 0, as the outlier channels of real keys, which per-channel groups of 64 put in their zeros)
  XCache(int64_t BH, int64_t T, int64_t D, int bits, int G, core::GroupAxis axis, float gain, std::mt19937& rng,
         float offset = 0.f) {
    d.rows = BH, d.tokens = T, d.head_dim = D, d.bits = bits, d.group_size = G, d.axis = axis, d.num_outliers = 0;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_real_distribution<float> ud(0.f, offset);
    std::vector<float> off(static_cast<size_t>(D), 0.f);
    std::vector<X> x(size_t(BH * T * D));
    for (size_t i = 0; i < x.size(); ++i) {
      if (offset > 0.f && i % (64 * D) == 0)
        for (auto& o : off) o = ud(rng);
      x[i] = core::from_float<X>(nd(rng) * (i % D == 5 ? gain : 1.f) + off[i % D]);
    }
    const int64_t groups = BH * d.groups_per_row();
    codes.resize(size_t(BH * T * d.packed_row_bytes()));
    scale.resize(size_t(groups)), zero.resize(size_t(groups));
    std::vector<int64_t> offsets(static_cast<size_t>(BH));
    for (int64_t r = 0; r < BH; ++r) offsets[size_t(r)] = r * T * D;
    core::CompressStatus st;
    core::nq_compress_tasks<X, X>(d, {x.data(), offsets.data(), D, 1},
                                  {codes.data(), scale.data(), zero.data(), idx.data(), val.data()}, 0,
                                  core::nq_num_tasks(d), &st);
    REQUIRE(!st.non_finite_input);
  }
  core::CompressedKV<X, X> view() const {
    core::CompressedKV<X, X> v;
    v.codes = codes.data(), v.scale = scale.data(), v.zero = zero.data();
    v.outlier_idx = idx.data(), v.outlier_val = val.data();
    v.dims = d;
    return v;
  }
};

struct AttnCase {
  int bits, D, gqa, q_len;
  std::vector<int64_t> lens;  // compressed tokens of each sequence
  int64_t window = 0;
  float softcap = 0.f;
  bool rotate = true;
  int64_t splits = 1;           // (the decode kernel: splits of the compressed tokens, one more for sinks and tail)
  int64_t capacity = 0;         // the compressed buffers' tokens (0: the largest length)
  int64_t sinks = 0, tail = 0;  // full-precision tokens before and after the compressed ones (every sequence)
  int value_group = 64;         // channels per value group
  int min_steady = 0;           // warp iterations the decode kernel's steady loop must complete
  int64_t corrupt_group = -1;   // a key group of (batch 0, kv head 0) whose channel 3 scale is +inf (rows NaN;
                                // keys per token: key corrupt_group's first group)
  float key_offset = 0.f;       // keys + U(0, key_offset) per channel and 64 tokens (the zeros' part of a score large)
  bool token_keys = false;      // keys per token in groups of value_group channels (make_cache's key_axis -1)
  bool corrupt_zero = false;    // the corrupt group's channel 3 zero -inf in place of its scale +inf (keys per
                                // channel: scores of +-inf by the query's sign, no NaN product on the way)
};

template <typename X>
void run_attention_case(const AttnCase& c, cuda::KernelChoice choice) {
  const int64_t B = int64_t(c.lens.size()), Hkv = 2, Hq = Hkv * c.gqa, Lq = c.q_len, D = c.D;
  const int64_t T = c.capacity > 0 ? c.capacity : *std::max_element(c.lens.begin(), c.lens.end());
  std::mt19937 rng(uint32_t(c.bits * 17 + D + c.gqa + Lq));
  XCache<X> k(B * Hkv, T, D, c.bits, c.token_keys ? c.value_group : 64,
              c.token_keys ? core::GroupAxis::kChannels : core::GroupAxis::kTokens, 9.f, rng, c.key_offset);
  const XCache<X> v(B * Hkv, T, D, c.bits, c.value_group, core::GroupAxis::kChannels, 1.f, rng);
  if (c.corrupt_group >= 0) {
    const size_t at = size_t(c.corrupt_group * k.d.meta_b() + (c.token_keys ? 0 : 3));
    if (c.corrupt_zero)
      k.zero[at] = core::from_float<X>(-INFINITY);
    else
      k.scale[at] = core::from_float<X>(INFINITY);
  }
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<X> q(size_t(B * Hq * Lq * D));
  std::vector<float> qf(q.size()), want(q.size()), signs(static_cast<size_t>(D));
  for (size_t i = 0; i < q.size(); ++i) q[i] = core::from_float<X>(nd(rng)), qf[i] = core::to_float(q[i]);
  for (auto& s : signs) s = rng() % 2 ? 1.f : -1.f;
  // Full-precision sinks and tail [B, Hkv, n, D] (keys with the compressed keys' large channel 5), X and float.
  struct Dense {
    std::vector<X> k, v;
    std::vector<float> kf, vf;
  };
  const auto dense = [&](int64_t n) {
    Dense d;
    for (int64_t i = 0; i < B * Hkv * n * D; ++i) {
      d.k.push_back(core::from_float<X>(nd(rng) * (i % D == 5 ? 9.f : 1.f))),
          d.kf.push_back(core::to_float(d.k.back()));
      d.v.push_back(core::from_float<X>(nd(rng))), d.vf.push_back(core::to_float(d.v.back()));
    }
    return d;
  };
  const Dense sink = dense(c.sinks), tail = dense(c.tail);
  const auto rows = [&]<typename E>(const E* data, int64_t n) {
    return core::DenseRows<E>{data, Hkv * n * D, n * D, D};
  };
  const float vmax = 5.f;  // (values ~N(0, 1): |v| < 5)
  // The CPU kernel, float queries.
  core::CpuAttentionParams<X, X> cp;
  cp.batch = B, cp.q_heads = Hq, cp.kv_heads = Hkv, cp.q_len = Lq, cp.head_dim = D;
  cp.q = {qf.data(), Hq * Lq * D, Lq * D, D};
  cp.k = k.view(), cp.v = v.view(), cp.compressed_lens.i64 = c.lens.data(), cp.scale = 0.125f;
  cp.window = c.window, cp.softcap = c.softcap, cp.rotation_signs = c.rotate ? signs.data() : nullptr;
  if (c.sinks > 0) cp.sink = {rows(sink.kf.data(), c.sinks), rows(sink.vf.data(), c.sinks), c.sinks, {}};
  if (c.tail > 0) cp.tail = {rows(tail.kf.data(), c.tail), rows(tail.vf.data(), c.tail), c.tail, {}};
  std::vector<float> cpu_partials(size_t(B * Hkv * core::partial_floats(cp)));
  core::attention_tasks(cp, 1, cpu_partials.data(), 0, B * Hkv);
  core::attention_merge(cp, 1, cpu_partials.data(), want.data(), 0, B * Hkv);
  // The CUDA kernels.
  using Params = core::AttentionParams<X, X, X>;
  cuda::AttentionLaunch<Params> L;
  L.p.batch = B, L.p.q_heads = Hq, L.p.kv_heads = Hkv, L.p.q_len = Lq, L.p.head_dim = D;
  L.p.q = {q.data(), Hq * Lq * D, Lq * D, D};
  L.p.k = k.view(), L.p.v = v.view(), L.p.compressed_lens.i64 = c.lens.data(), L.p.scale = 0.125f;
  L.p.window = c.window, L.p.softcap = c.softcap, L.p.rotation_signs = cp.rotation_signs;
  if (c.sinks > 0) L.p.sink = {rows(sink.k.data(), c.sinks), rows(sink.v.data(), c.sinks), c.sinks, {}};
  if (c.tail > 0) L.p.tail = {rows(tail.k.data(), c.tail), rows(tail.v.data(), c.tail), c.tail, {}};
  L.row_tiles = (c.gqa * Lq + cuda::kAttnRows - 1) / cuda::kAttnRows;
  uint32_t status = 0;
  L.status = &status;
  const cuda::AttentionKernelInfo kernel = cuda::attention_kernel_info(L, choice);
  REQUIRE(kernel.error == 0);
  REQUIRE(kernel.mma == (choice != cuda::KernelChoice::kSimple));
  REQUIRE(kernel.decode == (choice == cuda::KernelChoice::kDecode));
  REQUIRE(kernel.fp_splits == (kernel.decode && c.sinks + c.tail > 0 ? 1 : 0));
  L.splits = c.splits + kernel.fp_splits;
  std::vector<float> partials(size_t(B * Hkv * L.row_tiles * L.splits * cuda::kAttnRows * (D + 2)));
  L.partials = partials.data();
  const int64_t steady = cuda::emu::counters.decode_steady;
  REQUIRE(cuda::launch_attention(L, kernel, nullptr) == 0);
  INFO("steady iterations " << cuda::emu::counters.decode_steady - steady);
  CHECK(cuda::emu::counters.decode_steady - steady >= (kernel.decode ? c.min_steady : 0));
  std::vector<X> got(q.size());
  const cuda::MergeArgs m{B, Hq, Hkv, Lq, D, L.splits, L.row_tiles, partials.data(), L.p.rotation_signs};
  REQUIRE(cuda::launch_attention_merge<X>(m, got.data(), nullptr) == 0);
  REQUIRE(status == 0);
  const double tol = 1.5 * vmax * ((std::is_same_v<X, core::bf16_t> ? 0x1p-8 : 0x1p-11) + 1e-4);
  double worst = 0;
  int64_t nan_rows = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double a = core::to_float(got[i]);
    if (std::isnan(want[i])) {  // (a corrupt key group: its rows NaN, as the CPU kernel's)
      nan_rows += std::isnan(a);
      continue;
    }
    REQUIRE(std::isfinite(a));
    worst = std::max(worst, std::fabs(a - double(want[i])));
  }
  const auto want_nan = std::count_if(want.begin(), want.end(), [](float x) { return std::isnan(x); });
  CHECK(nan_rows == want_nan);
  CHECK((want_nan > 0) == (c.corrupt_group >= 0));
  INFO("worst " << worst << ", tolerance " << tol);
  CHECK(worst <= tol);
}

}  // namespace

TEST_CASE("dgq_fused_attention's kernels (emulated) against the CPU kernel", "[cuda_emulated]") {
  for (auto choice : {cuda::KernelChoice::kDecode, cuda::KernelChoice::kMma, cuda::KernelChoice::kSimple}) {
    INFO("kernel choice " << int(choice));
    // decode, GQA 4; a tail (the decode kernel's full-precision split)
    run_attention_case<core::bf16_t>({4, 128, 4, 1, {200, 77}, 0, 0.f, true, 1, 256, 0, 37}, choice);
    // 3 queries, a window, splits, sinks and a tail
    run_attention_case<core::half_t>({2, 64, 2, 3, {130, 64}, 40, 0.f, true, 3, 192, 4, 20}, choice);
    // soft-cap, no rotation
    run_attention_case<core::half_t>({8, 128, 1, 5, {96, 70}, 0, 25.f, false}, choice);
  }
}

TEST_CASE("dgq_fused_attention's decode kernel (emulated) in every format it takes", "[cuda_emulated]") {
  constexpr auto kDecode = cuda::KernelChoice::kDecode;
  // 2 bits, D64 in one value group, GQA 8, long enough for the steady loop (and splits)
  run_attention_case<core::bf16_t>({2, 64, 8, 1, {1500, 300}, 0, 0.f, true, 2, 1536, 0, 0, 64, 4}, kDecode);
  // 2 bits, D128 in four value groups (of 32), GQA 4, fp16, a tail
  run_attention_case<core::half_t>({2, 128, 4, 1, {1024, 640}, 0, 0.f, true, 1, 1024, 0, 16, 32, 4}, kDecode);
  // 4 bits, D64 in four value groups (of 16), GQA 1, a window
  run_attention_case<core::bf16_t>({4, 64, 1, 1, {700, 300}, 200, 0.f, true, 1, 704, 0, 5, 16, 2}, kDecode);
  // 4 bits, D128 in two value groups, GQA 8, no rotation, sinks
  run_attention_case<core::half_t>({4, 128, 8, 1, {600, 64}, 0, 0.f, false, 1, 640, 3, 0, 64, 2}, kDecode);
  // 8 bits, D64 in two value groups, GQA 2 x 4 queries, a soft-cap (every iteration the edge's)
  run_attention_case<core::bf16_t>({8, 64, 2, 4, {400, 33}, 0, 30.f, true, 2, 400, 0, 9, 32}, kDecode);
  // 8 bits, D128 in one group, GQA 4
  run_attention_case<core::half_t>({8, 128, 4, 1, {500, 200}, 0, 0.f, true, 1, 512, 0, 0, 128, 4}, kDecode);
  // more than 8 rows a kv head: blocks of 8 rows, two a row tile of 16 (decode_row_blocks):
  // GQA 8 x 2 queries (16 rows), splits and a tail; GQA 4 x 5 queries (20 rows: a second row
  // tile whose second block has none), a window and sinks; GQA 12 (12 rows: the second block 4)
  run_attention_case<core::bf16_t>({4, 128, 8, 2, {600, 200}, 0, 0.f, true, 2, 640, 0, 8, 64, 2}, kDecode);
  run_attention_case<core::half_t>({2, 64, 4, 5, {700, 300}, 70, 0.f, true, 1, 704, 2, 0, 32}, kDecode);
  run_attention_case<core::bf16_t>({8, 128, 12, 1, {300, 100}, 0, 0.f, false, 1, 320, 0, 6, 64, 2}, kDecode);
  // 2 bits, D64 in two and four value groups (of 32, 16: the queries held in registers), steady loops
  run_attention_case<core::bf16_t>({2, 64, 8, 1, {1500, 300}, 0, 0.f, true, 2, 1536, 0, 0, 32, 4}, kDecode);
  run_attention_case<core::half_t>({2, 64, 4, 1, {1100, 300}, 0, 0.f, false, 1, 1152, 0, 7, 16, 4}, kDecode);
  // a key scale of +inf in group 9 of 24 (a steady iteration's) and in group 0 (an edge's): those rows NaN
  run_attention_case<core::bf16_t>({2, 64, 8, 1, {1500, 300}, 0, 0.f, true, 1, 1536, 0, 0, 64, 4, 9}, kDecode);
  run_attention_case<core::half_t>({4, 128, 4, 1, {300, 300}, 0, 0.f, true, 1, 320, 0, 0, 64, 0, 0}, kDecode);
  // a key zero of -inf in group 9 (a steady iteration after finite ones): the bias -inf in the rows
  // whose query is positive there, every weight of the iteration 0 but for attend's check a row
  run_attention_case<core::bf16_t>({2, 64, 8, 1, {1500, 300}, 0, 0.f, true, 1, 1536, 0, 0, 32, 4, 9, 0.f, false, true},
                                   kDecode);
  // keys N(0, 1) + U(0, 100) per channel and key group, not rotated: q . zero (the zeros' MMA, in two
  // terms) most of each score, and different in each group
  run_attention_case<core::bf16_t>({2, 64, 8, 1, {700, 300}, 0, 0.f, false, 1, 704, 0, 0, 64, 0, -1, 100.f}, kDecode);
  run_attention_case<core::half_t>({4, 128, 4, 1, {700, 300}, 0, 0.f, false, 1, 704, 0, 0, 64, 0, -1, 100.f}, kDecode);
}

TEST_CASE("dgq_fused_attention's decode kernel (emulated) on keys per token", "[cuda_emulated]") {
  // contig_decode_token_keys_kernel: keys scaled per token and group of channels (as the values)
  constexpr auto kDecode = cuda::KernelChoice::kDecode;
  const auto tokens = [](AttnCase c) {
    c.token_keys = true;
    return c;
  };
  // 2 bits, D64 in one group, GQA 8, long enough for the steady loop, splits and a tail
  run_attention_case<core::bf16_t>(tokens({2, 64, 8, 1, {1500, 300}, 0, 0.f, true, 2, 1536, 0, 20, 64, 4}), kDecode);
  // 2 bits, D128 in four groups (of 32), GQA 8 x 2 queries (16 rows: two blocks a row tile), fp16
  run_attention_case<core::half_t>(tokens({2, 128, 8, 2, {1024, 640}, 0, 0.f, true, 1, 1024, 0, 0, 32, 4}), kDecode);
  // 4 bits, D128 in two groups, GQA 4, not rotated, sinks, a tail and a window (the full-precision split)
  run_attention_case<core::half_t>(tokens({4, 128, 4, 1, {700, 300}, 200, 0.f, false, 1, 704, 3, 9, 64, 2}), kDecode);
  // 4 bits, D64 in four groups (of 16), GQA 1
  run_attention_case<core::bf16_t>(tokens({4, 64, 1, 1, {600, 64}, 0, 0.f, true, 1, 640, 0, 0, 16, 2}), kDecode);
  // 8 bits, D64 in two groups, GQA 2 x 4 queries, a soft-cap (every iteration the edge's)
  run_attention_case<core::bf16_t>(tokens({8, 64, 2, 4, {400, 33}, 0, 30.f, true, 2, 400, 0, 9, 32}), kDecode);
  // 8 bits, D128 in one group, GQA 4, keys far from zero (the zeros' MMA most of each score)
  run_attention_case<core::half_t>(tokens({8, 128, 4, 1, {500, 200}, 0, 0.f, false, 1, 512, 0, 0, 128, 4, -1, 100.f}),
                                   kDecode);
  // a key scale of +inf (key 700 of a steady iteration, key 3 of an edge one): those rows NaN
  for (int64_t key : {700, 3}) {
    run_attention_case<core::bf16_t>(tokens({2, 64, 8, 1, {1500, 300}, 0, 0.f, true, 1, 1536, 0, 0, 64, 0, key}),
                                     kDecode);
  }
  // one of them on the reference kernel (the 16-row kernel takes no keys per token)
  run_attention_case<core::half_t>(tokens({4, 128, 4, 1, {700, 300}, 200, 0.f, false, 1, 704, 3, 9, 64}),
                                   cuda::KernelChoice::kSimple);
}

TEST_CASE("dgq_fused_attention's decode kernel takes keys per token in as many groups as the values only",
          "[cuda_emulated]") {
  using Params = core::AttentionParams<core::bf16_t, core::bf16_t, core::bf16_t>;
  std::mt19937 rng(3);
  const auto info = [&](int key_group, int value_group, cuda::KernelChoice choice) {
    XCache<core::bf16_t> k(2, 128, 64, 4, key_group, core::GroupAxis::kChannels, 1.f, rng);
    XCache<core::bf16_t> v(2, 128, 64, 4, value_group, core::GroupAxis::kChannels, 1.f, rng);
    std::vector<core::bf16_t> q(size_t(2 * 64));
    std::vector<int64_t> lens = {128};
    cuda::AttentionLaunch<Params> L;
    L.p.batch = 1, L.p.q_heads = 2, L.p.kv_heads = 2, L.p.q_len = 1, L.p.head_dim = 64;
    L.p.q = {q.data(), 64, 64, 64};
    L.p.k = k.view(), L.p.v = v.view(), L.p.compressed_lens.i64 = lens.data(), L.p.scale = 0.125f;
    return cuda::attention_kernel_info(L, choice);
  };
  CHECK(info(32, 32, cuda::KernelChoice::kDecode).decode);
  CHECK(info(32, 32, cuda::KernelChoice::kAuto).decode);
  CHECK(!info(32, 64, cuda::KernelChoice::kDecode).mma);  // (2 key groups, 1 value group: none)
  const cuda::AttentionKernelInfo other = info(16, 32, cuda::KernelChoice::kAuto);
  CHECK((!other.decode && !other.mma));  // the reference kernel
}

TEST_CASE("nq_compress / nq_decompress kernels (emulated) against the CPU's, bit for bit", "[cuda_emulated]") {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t N = 3, T = 150, D = 64;
  std::vector<core::half_t> x(size_t(N * T * D));
  for (size_t i = 0; i < x.size(); ++i) x[i] = core::from_float<core::half_t>(nd(rng) * (i % 7 == 3 ? 6.f : 1.f));
  std::vector<int64_t> offsets(static_cast<size_t>(N));
  for (int64_t r = 0; r < N; ++r) offsets[size_t(r)] = r * T * D;
  for (int bits : {2, 3, 4, 8})
    for (auto axis : {core::GroupAxis::kTokens, core::GroupAxis::kChannels})
      for (int k : {0, 2})
        for (bool fit : {false, true}) {
          INFO("bits " << bits << ", per channel " << (axis == core::GroupAxis::kTokens) << ", outliers " << k
                       << ", fitted " << fit);
          core::NQDims d;
          d.rows = N, d.tokens = T, d.head_dim = D, d.bits = bits, d.group_size = 32, d.axis = axis;
          d.num_outliers = k, d.fit_range = fit;
          const int64_t groups = N * d.groups_per_row();
          struct Out {
            std::vector<uint8_t> codes, idx;
            std::vector<core::half_t> scale, zero, val, dense;
          } cpu, gpu;
          for (Out* o : {&cpu, &gpu}) {
            o->codes.assign(size_t(N * T * d.packed_row_bytes()), 0);
            o->idx.assign(size_t(groups * k), 0);
            o->scale.resize(size_t(groups)), o->zero.resize(size_t(groups)), o->val.resize(size_t(groups * k));
            o->dense.resize(x.size());
          }
          core::CompressStatus st;
          core::nq_compress_tasks<core::half_t, core::half_t>(
              d, {x.data(), offsets.data(), D, 1},
              {cpu.codes.data(), cpu.scale.data(), cpu.zero.data(), cpu.idx.data(), cpu.val.data()}, 0,
              core::nq_num_tasks(d), &st);
          core::nq_decompress_tasks<core::half_t, core::half_t>(d, cpu.codes.data(), cpu.scale.data(), cpu.zero.data(),
                                                                cpu.dense.data(), 0, core::nq_num_tasks(d));
          REQUIRE(core::nq_scatter_outliers<core::half_t, core::half_t>(d, cpu.idx.data(), cpu.val.data(),
                                                                        cpu.dense.data(), 0, groups));
          uint32_t status = 0;
          cuda::NQCompressArgs<core::half_t, core::half_t> a{d,
                                                             {x.data(), T * D, D, 1},
                                                             gpu.codes.data(),
                                                             gpu.scale.data(),
                                                             gpu.zero.data(),
                                                             gpu.idx.data(),
                                                             gpu.val.data(),
                                                             &status};
          cuda::launch_nq_compress(a, nullptr);
          REQUIRE(status == 0);
          CHECK(gpu.codes == cpu.codes);
          CHECK(gpu.idx == cpu.idx);
          const auto bits_of = [](const std::vector<core::half_t>& v) {
            std::vector<uint16_t> b(v.size());
            for (size_t i = 0; i < v.size(); ++i) b[i] = v[i].bits;
            return b;
          };
          CHECK(bits_of(gpu.scale) == bits_of(cpu.scale));
          CHECK(bits_of(gpu.zero) == bits_of(cpu.zero));
          CHECK(bits_of(gpu.val) == bits_of(cpu.val));
          const cuda::NQDecompressArgs da{d,
                                          gpu.codes.data(),
                                          gpu.scale.data(),
                                          gpu.zero.data(),
                                          gpu.idx.data(),
                                          gpu.val.data(),
                                          core::DType::kFloat16,
                                          core::DType::kFloat16,
                                          nullptr,
                                          &status};
          cuda::launch_nq_decompress(da, gpu.dense.data(), nullptr);
          REQUIRE(status == 0);
          CHECK(bits_of(gpu.dense) == bits_of(cpu.dense));
        }
}
