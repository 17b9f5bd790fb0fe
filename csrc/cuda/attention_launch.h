// The split kernels of dgq_fused_attention behind one function per problem
// type, so that the glue (attention_cuda.cpp) compiles without the kernels and
// the kernels (attention_<T>.cu, one file per element type, torch-free)
// compile in parallel.
#pragma once

#include <cstddef>

#include "launch.h"
#include "nexuskv/core/attention_params.h"

namespace nexuskv::cuda {

constexpr int kAttnRows = 16;  // query rows per block

// A launch of the split kernels: the problem (core::AttentionParams, one
// instantiation per element / meta / outlier type) plus the work split and
// where the partials go.
template <typename Params>
struct AttentionLaunch {
  Params p;
  int64_t splits = 1, row_tiles = 1;
  // >= 0: a launch of the full-precision split of the decode kernel
  // (contig_decode.cuh): its one split of every (kv head, batch) takes the
  // sinks and the tail alone, into partial fp_split.
  int64_t fp_split = -1;
  float* partials = nullptr;  // [B, Hkv, row_tiles, splits, kAttnRows, D + 2]
  uint32_t* status = nullptr;

  NEXUSKV_HD int64_t partial_index(int64_t b, int64_t h, int64_t rt, int64_t split) const {
    return (((b * p.kv_heads + h) * row_tiles + rt) * splits + split) * kAttnRows * (p.head_dim + 2);
  }
};

// The merge of the splits (attention_merge_kernel): one block per (kv head x
// row tile, batch); writes out [B, Hq, Lq, D] in q's dtype.
struct MergeArgs {
  int64_t batch, q_heads, kv_heads, q_len, head_dim, splits, row_tiles;
  const float* partials;        // [B, Hkv, row_tiles, splits, kAttnRows, D + 2]
  const float* rotation_signs;  // [D] or null

  NEXUSKV_HD int64_t partial_index(int64_t b, int64_t h, int64_t rt, int64_t split) const {
    return (((b * kv_heads + h) * row_tiles + rt) * splits + split) * kAttnRows * (head_dim + 2);
  }
};

inline size_t merge_smem_bytes(const MergeArgs& a) {
  return size_t(kAttnRows * a.head_dim + kAttnRows * a.splits) * sizeof(float);
}
// Returns a cudaError_t of the set-up, 0 if none (attention_merge.cu).
template <typename Out>
int launch_attention_merge(const MergeArgs& a, Out* out, Stream stream);

// kAuto: the decode kernel where it takes the problem, else the tensor-core
// kernel where it does, else the reference kernel; kSimple, kMma, kDecode: that one.
enum class KernelChoice { kAuto, kSimple, kMma, kDecode };

// The kernel that runs L under choice (the one place that decides: see
// KernelChoice; under kMma or kDecode, mma is false where that kernel does not
// take the problem), and what sizes its split of the key range
// (core::plan_splits): how many of its blocks one SM holds (0 when none fits)
// and its keys per tile, and its blocks per row tile and split (the plan counts
// them all).  The decode kernel's splits take the compressed
// tokens; fp_splits more (one where the problem has sinks or a tail) take the
// full-precision ones: L.splits counts both.  Host only (no device work, no
// synchronization); L.splits and L.partials are not read.
struct AttentionKernelInfo {
  bool mma = false;     // a tensor-core kernel (else the reference kernel)
  bool decode = false;  // the decode kernel (contig_decode.cuh)
  int fp_splits = 0;    // splits beyond the planned ones (the decode kernel's full-precision split)
  int row_blocks = 1;   // blocks per row tile and split (the decode kernel's: one per 8 rows)
  int blocks_per_sm = 0;
  int tile_tokens = 1;
  int error = 0;  // a cudaError_t of the set-up (the shared-memory opt-in), 0 if none
};
template <typename Params>
AttentionKernelInfo attention_kernel_info(const AttentionLaunch<Params>& L, KernelChoice choice);

// Launches the split kernel of L that attention_kernel_info chose (kernel.mma,
// kernel.decode) over the grid (splits, kv heads x row tiles, batch) on
// stream; returns a cudaError_t of the set-up, 0 if none.
template <typename Params>
int launch_attention(const AttentionLaunch<Params>& L, const AttentionKernelInfo& kernel, Stream stream);

// Every instantiation the glue dispatches to: declared extern by the glue
// (PREFIX extern), defined once each in attention_<T>.cu (PREFIX empty).
#define NEXUSKV_ATTENTION_INSTANCES(PREFIX, T)                                                                \
  PREFIX template AttentionKernelInfo attention_kernel_info<core::AttentionParams<T, float, T>>(              \
      const AttentionLaunch<core::AttentionParams<T, float, T>>&, KernelChoice);                              \
  PREFIX template AttentionKernelInfo attention_kernel_info<core::AttentionParams<T, core::half_t, T>>(       \
      const AttentionLaunch<core::AttentionParams<T, core::half_t, T>>&, KernelChoice);                       \
  PREFIX template AttentionKernelInfo attention_kernel_info<core::AttentionParams<T, core::bf16_t, T>>(       \
      const AttentionLaunch<core::AttentionParams<T, core::bf16_t, T>>&, KernelChoice);                       \
  PREFIX template int launch_attention<core::AttentionParams<T, float, T>>(                                   \
      const AttentionLaunch<core::AttentionParams<T, float, T>>&, const AttentionKernelInfo&, Stream);        \
  PREFIX template int launch_attention<core::AttentionParams<T, core::half_t, T>>(                            \
      const AttentionLaunch<core::AttentionParams<T, core::half_t, T>>&, const AttentionKernelInfo&, Stream); \
  PREFIX template int launch_attention<core::AttentionParams<T, core::bf16_t, T>>(                            \
      const AttentionLaunch<core::AttentionParams<T, core::bf16_t, T>>&, const AttentionKernelInfo&, Stream);

extern template int launch_attention_merge<float>(const MergeArgs&, float*, Stream);
extern template int launch_attention_merge<core::half_t>(const MergeArgs&, core::half_t*, Stream);
extern template int launch_attention_merge<core::bf16_t>(const MergeArgs&, core::bf16_t*, Stream);
NEXUSKV_ATTENTION_INSTANCES(extern, float)
NEXUSKV_ATTENTION_INSTANCES(extern, core::half_t)
NEXUSKV_ATTENTION_INSTANCES(extern, core::bf16_t)

}  // namespace nexuskv::cuda
