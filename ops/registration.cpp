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

  // Fused attention straight over the compressed cache:
  //   out = softmax(q . K^T * scale + causal) . V        [batch, q_heads, q_len, head_dim]
  // k_cache / v_cache: [codes, scale, zero, outlier_idx, outlier_val] (NQ) or
  // the same + segment_starts (DGQ), each [batch, kv_heads, ...];
  // k_format / v_format: [bits, group_size, axis].  Keys of sequence b are its
  // compressed_lens[b] compressed tokens, then tail_lens[b] tokens of the full
  // precision k_tail/v_tail [batch, kv_heads, tail_tokens, head_dim]; the q_len
  // queries are the last q_len positions (causal among themselves).  With
  // rotation_signs the cache holds hadamard_rotate(K), hadamard_rotate(V) and the
  // output is in the original basis.  scale defaults to head_dim^-0.5.
  // Allocates its output.
  m.def(
      "dgq_fused_attention(Tensor q, Tensor[] k_cache, Tensor[] v_cache, int[] k_format, int[] v_format, "
      "Tensor compressed_lens, Tensor? k_tail=None, Tensor? v_tail=None, Tensor? tail_lens=None, "
      "Tensor? rotation_signs=None, float? scale=None) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  // Randomized Hadamard rotation of the last dim (a power of two):
  // y = H (signs * x) / sqrt(n); inverse=True undoes it.  Allocates its output.
  m.def("hadamard_rotate(Tensor x, Tensor signs, bool inverse=False) -> Tensor", {at::Tag::pt2_compliant_tag});
}
