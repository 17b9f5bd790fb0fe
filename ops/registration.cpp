// The nexuskv operator surface: every schema, in one block.  Kernels register
// beside their code (csrc/cpu, csrc/cuda) with TORCH_LIBRARY_IMPL; the
// inference-only guard lives in ops/inference_only.cpp.
#include <torch/library.h>

TORCH_LIBRARY(nexuskv, m) {
  // NQ block quantization; the compressed format is documented in
  // csrc/include/nexuskv/core/nq_format.h.  axis = -2: groups of group_size
  // tokens per channel (keys); axis = -1: groups of group_size channels per
  // token (values).  Allocates its outputs.
  m.def(
      "nq_compress(Tensor x, int bits, int group_size, int axis, int num_outliers=0, "
      "ScalarType? meta_dtype=None) -> "
      "(Tensor codes, Tensor scale, Tensor zero, Tensor outlier_idx, Tensor outlier_val)",
      {at::Tag::pt2_compliant_tag});
  // Inverse of nq_compress: x_hat [..., tokens, head_dim] in out_dtype
  // (default: outlier_val's dtype, i.e. the dtype that was compressed).
  m.def(
      "nq_decompress(Tensor codes, Tensor scale, Tensor zero, Tensor outlier_idx, Tensor outlier_val, "
      "int bits, int group_size, int axis, int head_dim, ScalarType? out_dtype=None) -> Tensor",
      {at::Tag::pt2_compliant_tag});
}
