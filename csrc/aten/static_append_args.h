// Argument checks of static_kv_append_ (the append of a fixed-capacity
// compressed cache whose state is tensors: nexuskv.static_cache), shared by
// its CPU kernel and its meta kernel: sizes, dtypes, devices and aliasing (no
// values; the Python fake kernel gives the meta kernel copies that share
// storage where the arguments do).
#pragma once

#include <ATen/core/Tensor.h>

#include "nexuskv/core/nq_format.h"

namespace nexuskv {

struct StaticAppendShapes {
  int64_t batch = 0, kv_heads = 0, new_tokens = 0, head_dim = 0;
  core::NQDims k, v;     // tokens = the compressed capacity
  bool k_dgq = false;    // keys: DGQ (a sixth tensor, segment_starts)
  int64_t granule = 16;  // DGQ segment granule (k_format[3], default 16)
  int64_t chunk = 1;     // tokens one compression covers: whole token groups of K and V
  int64_t residual = 0;  // full-precision tokens kept after a compression
  int64_t tail_capacity = 0;
};

// k_store / v_store: the NQ (5) or, for keys, DGQ (6) tensors of the compressed
// part, [B, H, capacity, ...], outlier values in the cache's dtype;
// k_tail / v_tail [B, H, tail_capacity, D] in the cache's dtype,
// tail_capacity >= residual + chunk - 1; lengths int64 [2, B] (compressed,
// tail); k / v [B, H, n, D] in the cache's dtype; k_format / v_format [bits,
// group_size, axis] (+ granule for DGQ keys).  Every tensor the op writes (the
// stores, tails and lengths) must own its memory: none may overlap itself or
// another.
StaticAppendShapes check_static_append_args(at::TensorList k_store, at::TensorList v_store, const at::Tensor& k_tail,
                                            const at::Tensor& v_tail, const at::Tensor& lengths, const at::Tensor& k,
                                            const at::Tensor& v, at::IntArrayRef k_format, at::IntArrayRef v_format,
                                            int64_t residual);

}  // namespace nexuskv
