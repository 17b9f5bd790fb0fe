// The paged attention's tensor-core kernels launched: the split kernel of a
// row tile (paged_decode.cuh for decode steps' 8-row tiles, paged_mma.cuh's
// for 16 rows), the merge of the splits, and the host's choice and plan.
#pragma once

#include "paged_decode.cuh"
#include "paged_mma.cuh"

namespace nexuskv::cuda {

// The split kernel of kNT 8-row n-tiles: decode steps (1, core::paged_tile_rows)
// take PagedDecodeKernel, the rest PagedMmaKernel's 16 rows.
template <typename X, int kBits, int kD, int kBg, int kNT>
struct PagedSplitKernel {
  using type = PagedMmaKernel<X, kBits, kD, kBg, kNT>;
};
template <typename X, int kBits, int kD, int kBg>
struct PagedSplitKernel<X, kBits, kD, kBg, 1> {
  using type = PagedDecodeKernel<X, kBits, kD, kBg>;
};

template <typename X, int kBits, int kD, int kBg, int kNT>
NKV_KERNEL void __launch_bounds__(kMmaThreads, (PagedSplitKernel<X, kBits, kD, kBg, kNT>::type::kMinBlocks))
    paged_attention_mma_kernel(const NKV_GRID_CONSTANT PagedMmaArgs<X> a) {
  using K = typename PagedSplitKernel<X, kBits, kD, kBg, kNT>::type;
  NKV_DYNAMIC_SMEM(smem);
  K(a, *reinterpret_cast<typename K::Smem*>(smem)).run();
}

// ---- merge --------------------------------------------------------------------------------------

// Block (token, kv head x head chunk): the merge of its rows' splits, the
// inverse rotation, out.  Padding tokens (past query_start_loc[num_reqs]) are
// zero; every row is NaN when query_start_loc was invalid.
template <typename X>
NKV_KERNEL void paged_mma_merge_kernel(const NKV_GRID_CONSTANT PagedMmaArgs<X> a) {
  NKV_DYNAMIC_SMEM(smem);
  const core::PagedAttention<X>& p = a.p;
  const int64_t token = blockIdx.x, D = p.pool.layout.head_dim, splits = a.ix.splits;
  const int gq = p.gqa_group(), hpt = int(a.ix.heads.divisor);
  const int h = int(blockIdx.y) / a.ix.head_chunks, head0 = (int(blockIdx.y) % a.ix.head_chunks) * hpt;
  const int rows = gq - head0 < hpt ? gq - head0 : hpt, hq0 = h * gq + head0;
  X* const out = p.out + (token * p.q_heads + hq0) * D;  // rows x D, contiguous
  const bool bad = *a.bad != 0;
  if (bad || token >= p.query_start_loc[p.num_reqs]) {
    const float v = bad ? bits_float(0x7fc00000u) : 0.f;
    for (int64_t e = threadIdx.x; e < rows * D; e += blockDim.x) out[e] = core::from_float<X>(v);
    if (bad && threadIdx.x == 0) report(a.status, kBadLengths);
    return;
  }
  float* row_s = reinterpret_cast<float*>(smem);  // [kAttnRows, D]
  float* weight_s = row_s + kAttnRows * D;        // [kAttnRows, splits]
  merge_splits(
      rows, D, splits, [&](int64_t r, int64_t sp) { return a.partial(token, hq0 + int(r), int(sp)); }, row_s, weight_s);
  const float* signs = p.rotation_signs;
  if (signs) fwht_rows(row_s, rows, D, [](int64_t) { return false; });
  const float norm = 1.f / sqrtf(float(D));
  for (int64_t e = threadIdx.x; e < rows * D; e += blockDim.x)
    out[e] = core::from_float<X>(signs ? row_s[e] * (norm * signs[e % D]) : row_s[e]);
}

// ---- host -------------------------------------------------------------------------------------

// Key / value groups per token of the kernel's variants (1, 2 or 4 whole groups
// of a multiple of 16 channels; a group_size >= head_dim is one group), 0 if none.
inline int paged_mma_groups(const core::PagedLayout& l) {
  const int bg = l.group_size >= l.head_dim ? 1 : l.head_dim / l.group_size;
  const bool whole = l.group_size >= l.head_dim || l.head_dim % l.group_size == 0;
  return whole && (bg == 1 || bg == 2 || bg == 4) && (l.head_dim / bg) % 16 == 0 ? bg : 0;
}

// p with a window no shorter than the block table's width dropped: it hides no
// key (every position is below the width), and the kernel's 32-bit positions
// could not hold it.
template <typename X>
core::PagedAttention<X> paged_mma_problem(core::PagedAttention<X> p) {
  if (p.window >= p.max_blocks * p.pool.layout.block_size) p.window = 0;
  return p;
}

// Whether the tensor-core kernel takes p (see the top of this file).
template <typename X>
bool paged_mma_takes(const core::PagedAttention<X>& p) {
  const core::PagedLayout& l = p.pool.layout;
  constexpr bool kTypes = std::is_same_v<X, core::bf16_t> || std::is_same_v<X, core::half_t>;
  return kTypes && l.x_bytes == int(sizeof(X)) && l.exact_window == 0 && l.num_outliers == 0 &&
         l.key_bits == l.value_bits && (l.key_bits == 2 || l.key_bits == 4 || l.key_bits == 8) &&
         (l.head_dim == 64 || l.head_dim == 128) && paged_mma_groups(l) > 0 &&
         (reinterpret_cast<uintptr_t>(p.pages) & 15u) == 0 &&
         p.max_blocks * l.block_size + 4 * kMmaTile < core::kFastDivmodLimit &&  // (decode: keys up to 256 on)
         l.head_page_bytes() * p.pool.kv_heads < (int64_t(1) << 32);             // a block's pages: 32-bit strides
}

// The kernel of p's variant (p must be taken) for row tiles of tile_rows (8
// or 16: core::paged_tile_rows) and its shared memory.
template <typename X>
void (*paged_mma_kernel_of(const core::PagedAttention<X>& p, int tile_rows, size_t& smem))(PagedMmaArgs<X>) {
  void (*kernel)(PagedMmaArgs<X>) = nullptr;
  if constexpr (std::is_same_v<X, core::bf16_t> || std::is_same_v<X, core::half_t>) {
    const core::PagedLayout& l = p.pool.layout;
    core::layout::with_bits(l.key_bits, [&]<int kBits>() {
      if constexpr (kBits != 3) {
        with_head_dim(l.head_dim, [&]<int kD>() {
          with_groups(paged_mma_groups(l), [&]<int kBg>() {
            auto tiles = [&]<int kNT>() {
              smem = sizeof(typename PagedSplitKernel<X, kBits, kD, kBg, kNT>::type::Smem);
              kernel = paged_attention_mma_kernel<X, kBits, kD, kBg, kNT>;
            };
            if (tile_rows <= core::kPagedDecodeTileRows)
              tiles.template operator()<1>();
            else
              tiles.template operator()<2>();
          });
        });
      }
    });
  }
  return kernel;
}

template <typename X>
PagedAttentionPlan paged_mma_plan(const core::PagedAttention<X>& problem, int multiprocessors) {
  const core::PagedAttention<X> p = paged_mma_problem(problem);
  PagedAttentionPlan plan;
  if (!paged_mma_takes(p)) return plan;
  const core::PagedLayout& l = p.pool.layout;
  const int tile_rows = core::paged_tile_rows(p.num_tokens, p.num_reqs, p.gqa_group());
  size_t smem = 0;
  auto kernel = paged_mma_kernel_of(p, tile_rows, smem);
  if (kernel == nullptr) return plan;
  if (!smem_fits(kernel, smem)) return plan;  // this GPU has less shared memory: the SIMT kernel runs
  const core::PagedRowTiles rt = core::paged_row_tiles(p.gqa_group(), tile_rows);
  plan.mma = true;
  plan.tile_rows = tile_rows;
  plan.heads_per_tile = rt.heads;
  plan.tokens_per_tile = rt.tokens;
  plan.head_chunks = rt.head_chunks;
  plan.tiles = (p.num_tokens + plan.tokens_per_tile - 1) / plan.tokens_per_tile + p.num_reqs;
  // A step with requests of several tokens (16-row tiles) whose GQA group fits 8 rows: its
  // requests of one token (decode steps beside prefill chunks) run the decode kernel apart, one
  // block each, where the 16-row kernel would give each a half-empty tile at 3-5x the decode
  // kernel's instructions (benchmarks/cuda_budget.py); the longer ones keep 16-row tiles, which
  // read each page once for 16 rows.  (The two launches run one after the other on the stream;
  // the splits are planned for their blocks together.)
  size_t smem_single = 0;
  if (tile_rows == core::kPagedTileRows && p.gqa_group() <= core::kPagedDecodeTileRows) {
    auto single = paged_mma_kernel_of(p, core::kPagedDecodeTileRows, smem_single);
    plan.singles_apart = single != nullptr && smem_fits(single, smem_single);
  }
  // The most keys one tile's rows see: the block table's width (or the window
  // and the tile's tokens), and 15 before the first for the 16-key alignment.
  const int64_t width = p.max_blocks * l.block_size;
  const int64_t keys =
      (p.window > 0 && p.window + plan.tokens_per_tile - 1 < width ? p.window + plan.tokens_per_tile - 1 : width) + 15;
  // Decode (one token per request) has one tile per request.
  const int64_t tiles = p.num_tokens == p.num_reqs ? p.num_reqs : plan.tiles;
  const int64_t units = (tiles * plan.head_chunks + (plan.singles_apart ? p.num_reqs : 0)) * p.pool.kv_heads;
  const int per_sm = blocks_per_sm(kernel, kMmaThreads, smem);
  const int64_t slots = int64_t(per_sm > 0 ? per_sm : 1) * (multiprocessors > 0 ? multiprocessors : 1);
  plan.splits = core::plan_splits(units, slots, keys, kMmaTile).splits;
  plan.scratch_bytes = paged_mma_scratch(p.num_reqs, p.num_tokens, p.q_heads, int(plan.splits), l.head_dim).bytes;
  return plan;
}

template <typename X>
int launch_paged_attention_mma(const core::PagedAttention<X>& p, const PagedAttentionPlan& plan, uint8_t* scratch,
                               uint32_t* status, Stream stream) {
  size_t smem = 0;
  auto kernel = paged_mma_kernel_of(p, plan.tile_rows, smem);
  if (kernel == nullptr) return int(cudaErrorInvalidDeviceFunction);
  // The kernel's shared rows hold plan.tile_rows query rows: a plan made for another problem
  // (or by hand) must not put more in a tile.
  if (plan.heads_per_tile * plan.tokens_per_tile > plan.tile_rows || plan.tile_rows > kAttnRows)
    return int(cudaErrorInvalidConfiguration);
  const core::PagedLayout& l = p.pool.layout;
  const PagedMmaScratch s = paged_mma_scratch(p.num_reqs, p.num_tokens, p.q_heads, int(plan.splits), l.head_dim);
  PagedMmaArgs<X> a;
  a.p = paged_mma_problem(p);
  a.ix.block = core::FastDivmod(l.block_size);
  a.ix.heads = core::FastDivmod(plan.heads_per_tile);
  a.ix.off = core::PagedOffsets(l);
  a.ix.head_page_bytes = l.head_page_bytes();
  a.ix.meta_array_bytes = l.meta_bytes();
  a.ix.tokens_per_tile = plan.tokens_per_tile;
  a.ix.head_chunks = plan.head_chunks;
  a.ix.splits = int(plan.splits);
  a.ix.requests = plan.singles_apart ? PagedRequests::kMultiToken : PagedRequests::kAll;
  a.tile_start = reinterpret_cast<int32_t*>(scratch + s.tile_start);
  a.bad = reinterpret_cast<uint32_t*>(scratch + s.bad);
  a.partials = reinterpret_cast<float*>(scratch + s.partials);
  a.status = status;
  launch(paged_mma_tiles_kernel<X>, Dim3(1), Dim3(kPagedTilesThreads), 0, stream, a);
  if (plan.singles_apart) {  // the requests of one token: 8-row tiles, a block each (after the pre-pass: *bad)
    const core::PagedRowTiles rt = core::paged_row_tiles(p.gqa_group(), core::kPagedDecodeTileRows);
    size_t smem_single = 0;
    auto single = paged_mma_kernel_of(p, core::kPagedDecodeTileRows, smem_single);
    if (single == nullptr) return int(cudaErrorInvalidDeviceFunction);
    PagedMmaArgs<X> d = a;
    d.ix.heads = core::FastDivmod(rt.heads);
    d.ix.tokens_per_tile = rt.tokens, d.ix.head_chunks = rt.head_chunks;  // (one chunk: the group fits)
    d.ix.requests = PagedRequests::kSingleToken;
    launch(single, Dim3(unsigned(p.num_reqs), unsigned(p.pool.kv_heads * rt.head_chunks), unsigned(plan.splits)),
           Dim3(kMmaThreads), smem_single, stream, d);
  }
  launch(kernel, Dim3(unsigned(plan.tiles), unsigned(p.pool.kv_heads * plan.head_chunks), unsigned(plan.splits)),
         Dim3(kMmaThreads), smem, stream, a);
  const size_t merge_smem = size_t(kAttnRows * l.head_dim + kAttnRows * plan.splits) * sizeof(float);
  if (merge_smem > kDefaultSmem) {
    const int err = int(allow_smem(paged_mma_merge_kernel<X>, merge_smem));
    if (err != 0) return err;
  }
  launch(paged_mma_merge_kernel<X>, Dim3(unsigned(p.num_tokens), unsigned(p.pool.kv_heads * plan.head_chunks)),
         Dim3(kMmaThreads), merge_smem, stream, a);
  return 0;
}

}  // namespace nexuskv::cuda
