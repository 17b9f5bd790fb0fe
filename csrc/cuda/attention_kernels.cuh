// Definition of launch_attention (attention_launch.h): the tensor-core kernel
// where it takes the problem, else the reference kernel.  Included by the
// per-type instantiation files attention_<T>.cu only.
#pragma once

#include "attention_launch.h"
#include "attention_mma.cuh"
#include "attention_simple.cuh"

namespace nexuskv::cuda {

template <typename Params>
AttentionLaunchResult launch_attention(const AttentionLaunch<Params>& L, Stream stream, KernelChoice choice) {
  AttentionLaunchResult r;
  const Dim3 grid(unsigned(L.splits), unsigned(L.p.kv_heads * L.row_tiles), unsigned(L.p.batch));
  if (choice != KernelChoice::kSimple) r.mma = launch_attention_mma(L, grid, stream);
  if (r.mma || choice == KernelChoice::kMma) return r;
  using Kernel = AttentionLaunch<Params>;
  const size_t smem = simple_smem_bytes(L.p.head_dim);
  if (smem > kDefaultSmem) r.error = int(allow_smem(attention_simple_kernel<Kernel>, smem));
  if (r.error == 0) launch(attention_simple_kernel<Kernel>, grid, Dim3(kSimpleThreads), smem, stream, L);
  return r;
}

}  // namespace nexuskv::cuda
