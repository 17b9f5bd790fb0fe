// Definitions of attention_kernel_info and launch_attention (attention_launch.h):
// the tensor-core kernel where it takes the problem, else the reference kernel.
// Included by the per-type instantiation files attention_<T>.cu only.
#pragma once

#include "attention_launch.h"
#include "attention_mma.cuh"
#include "attention_simple.cuh"
#include "contig_decode.cuh"

namespace nexuskv::cuda {

// The reference kernel for L, opted in to its shared memory (error: the opt-in's cudaError_t).
template <typename Params>
struct SimpleVariant {
  void (*kernel)(AttentionLaunch<Params>) = attention_simple_kernel<AttentionLaunch<Params>>;
  size_t smem = 0;
  int error = 0;
  explicit SimpleVariant(const AttentionLaunch<Params>& L) : smem(simple_smem_bytes(L.p.head_dim)) {
    if (smem > kDefaultSmem) error = int(allow_smem(kernel, smem));
  }
};

template <typename Params>
AttentionKernelInfo attention_kernel_info(const AttentionLaunch<Params>& L, KernelChoice choice) {
  AttentionKernelInfo k;
  if (choice == KernelChoice::kAuto || choice == KernelChoice::kDecode) {
    // The decode kernel takes the compressed tokens, the tensor-core kernel one split of the sinks and tail.
    AttentionLaunch<Params> fp = L;
    fp.fp_split = 0;  // (what the full-precision split's kernel takes)
    const MmaVariant<AttentionLaunch<Params>> v = decode_variant(L);
    if (v.kernel != nullptr && mma_variant(fp).kernel != nullptr) {
      k.mma = k.decode = true, k.tile_tokens = kMmaTile * decode_chunks_per_iteration(int(L.p.k.dims.bits));
      k.blocks_per_sm = blocks_per_sm(v.kernel, kMmaThreads, v.smem);
      k.fp_splits = L.p.sink.present() || L.p.tail.present() ? 1 : 0;
      k.row_blocks = decode_row_blocks(L.p);
      return k;
    }
    if (choice == KernelChoice::kDecode) return k;  // (mma false: the caller reports it)
  }
  if (choice != KernelChoice::kSimple) {
    const MmaVariant<AttentionLaunch<Params>> v = mma_variant(L);
    if (v.kernel != nullptr || choice == KernelChoice::kMma) {
      k.mma = v.kernel != nullptr, k.tile_tokens = kMmaTile;
      k.blocks_per_sm = k.mma ? blocks_per_sm(v.kernel, kMmaThreads, v.smem) : 0;
      return k;
    }
  }
  const SimpleVariant<Params> v(L);
  k.error = v.error, k.tile_tokens = kSimpleTile;
  k.blocks_per_sm = v.error == 0 ? blocks_per_sm(v.kernel, kSimpleThreads, v.smem) : 0;
  return k;
}

template <typename Params>
int launch_attention(const AttentionLaunch<Params>& L, const AttentionKernelInfo& kernel, Stream stream) {
  if (kernel.decode) {
    const int64_t compressed = L.splits - kernel.fp_splits;
    int err = launch_contig_decode(L, compressed, stream);
    if (err == 0 && kernel.fp_splits > 0) {
      AttentionLaunch<Params> fp = L;
      fp.fp_split = compressed;
      err = launch_attention_mma(fp, Dim3(1, unsigned(L.p.kv_heads * L.row_tiles), unsigned(L.p.batch)), stream);
    }
    return err;
  }
  const Dim3 grid(unsigned(L.splits), unsigned(L.p.kv_heads * L.row_tiles), unsigned(L.p.batch));
  if (kernel.mma) return launch_attention_mma(L, grid, stream);
  const SimpleVariant<Params> v(L);
  if (v.error == 0) launch(v.kernel, grid, Dim3(kSimpleThreads), v.smem, stream, L);
  return v.error;
}

}  // namespace nexuskv::cuda
