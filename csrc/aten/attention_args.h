// Argument checks of dgq_fused_attention and hadamard_rotate, shared by every
// backend's kernel and by the meta kernels: sizes, dtypes and devices only
// (no tensor data is read, so nothing here synchronizes with a device).  The
// checks that need the data (lengths within capacity, q_len within each
// sequence, signs +-1, outlier positions, segment starts) are each backend
// kernel's (csrc/cpu/value_checks.h on the CPU).  make_attention_params then
// points core::AttentionParams into the tensors a backend hands it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "core_dispatch.h"
#include "nexuskv/core/attention_params.h"

namespace nexuskv {

// What check_attention_args found: the problem's sizes and scalars.
struct AttentionShapes {
  int64_t batch = 0, q_heads = 0, kv_heads = 0, q_len = 0, head_dim = 0;
  core::NQDims k, v;  // rows = batch * kv_heads, tokens = each cache's capacity (no segment_starts pointer)
  bool k_dgq = false, v_dgq = false;             // segment_starts given (the sixth tensor)
  int64_t sink_capacity = 0, tail_capacity = 0;  // 0 when absent
  bool has_sink = false, has_tail = false;
  float scale = 1.f;
  int64_t window = 0;
  float softcap = 0.f;
  int query_mantissa_bits = 24;
};

AttentionShapes check_attention_args(const at::Tensor& q, at::TensorList k_cache, at::TensorList v_cache,
                                     at::IntArrayRef k_format, at::IntArrayRef v_format,
                                     const at::Tensor& compressed_lens, const std::optional<at::Tensor>& k_tail,
                                     const std::optional<at::Tensor>& v_tail,
                                     const std::optional<at::Tensor>& tail_lens,
                                     const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                                     const std::optional<at::Tensor>& k_sink, const std::optional<at::Tensor>& v_sink,
                                     const std::optional<at::Tensor>& sink_lens, std::optional<int64_t> window,
                                     std::optional<double> softcap);

// Checks signs [n] for a randomized Hadamard rotation of rows of length n
// (a power of two) on `device`: shape, dtype and device.  That they are +-1 is
// the kernels' check (check_rotation_sign_values on the CPU).
// signs_name, rotated: the argument names in the messages.
void check_rotation_signs(const char* op, const at::Tensor& signs, int64_t n, const at::Device& device,
                          const char* signs_name, const char* rotated);

// Checks x for hadamard_rotate (and its signs, as above).
void check_hadamard_args(const at::Tensor& x, const at::Tensor& signs);

namespace detail {
core::SeqLengths seq_lengths(const at::Tensor& lens);
template <typename T>
core::DenseRows<T> dense_rows(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.dim() == 4 && t.stride(3) == 1, "dense rows need contiguous channels");
  return {core_ptr<const T>(t), t.stride(0), t.stride(1), t.stride(2)};
}
template <typename Meta, typename Val>
core::CompressedKV<Meta, Val> compressed(const core::NQDims& dims, at::TensorList cache) {
  for (const at::Tensor& t : cache) TORCH_INTERNAL_ASSERT(t.is_contiguous(), "compressed buffers must be contiguous");
  core::CompressedKV<Meta, Val> c;
  c.codes = cache[0].data_ptr<uint8_t>();
  c.scale = core_ptr<const Meta>(cache[1]);
  c.zero = core_ptr<const Meta>(cache[2]);
  c.outlier_idx = cache[3].data_ptr<uint8_t>();
  c.outlier_val = core_ptr<const Val>(cache[4]);
  c.dims = dims;
  c.dims.segment_starts = cache.size() == 6 ? cache[5].data_ptr<int32_t>() : nullptr;
  return c;
}
}  // namespace detail

// Points core::AttentionParams<T, Meta, Val> into tensors that a backend has
// put in its kernel's types: q, sinks and tail of dtype T with contiguous
// channels, the five (six) compressed buffers of each cache contiguous with
// scale/zero of dtype Meta and outlier_val of dtype Val, lengths contiguous
// int32/int64, rotation signs contiguous float32.  Reads no data.
template <typename T, typename Meta, typename Val>
core::AttentionParams<T, Meta, Val> make_attention_params(
    const AttentionShapes& s, const at::Tensor& q, at::TensorList k_cache, at::TensorList v_cache,
    const at::Tensor& compressed_lens, const std::optional<at::Tensor>& k_tail, const std::optional<at::Tensor>& v_tail,
    const std::optional<at::Tensor>& tail_lens, const std::optional<at::Tensor>& k_sink,
    const std::optional<at::Tensor>& v_sink, const std::optional<at::Tensor>& sink_lens,
    const std::optional<at::Tensor>& rotation_signs) {
  core::AttentionParams<T, Meta, Val> p;
  p.batch = s.batch, p.q_heads = s.q_heads, p.kv_heads = s.kv_heads, p.q_len = s.q_len, p.head_dim = s.head_dim;
  p.q = detail::dense_rows<T>(q);
  p.k = detail::compressed<Meta, Val>(s.k, k_cache);
  p.v = detail::compressed<Meta, Val>(s.v, v_cache);
  p.compressed_lens = detail::seq_lengths(compressed_lens);
  if (s.has_tail) {
    p.tail.k = detail::dense_rows<T>(*k_tail), p.tail.v = detail::dense_rows<T>(*v_tail);
    p.tail.capacity = s.tail_capacity;
    if (tail_lens) p.tail.lens = detail::seq_lengths(*tail_lens);
  }
  if (s.has_sink) {
    p.sink.k = detail::dense_rows<T>(*k_sink), p.sink.v = detail::dense_rows<T>(*v_sink);
    p.sink.capacity = s.sink_capacity;
    if (sink_lens) p.sink.lens = detail::seq_lengths(*sink_lens);
  }
  if (rotation_signs) {
    TORCH_INTERNAL_ASSERT(rotation_signs->scalar_type() == at::kFloat && rotation_signs->is_contiguous());
    p.rotation_signs = rotation_signs->data_ptr<float>();
  }
  p.scale = s.scale, p.window = s.window, p.softcap = s.softcap, p.query_mantissa_bits = s.query_mantissa_bits;
  return p;
}

}  // namespace nexuskv
