// The meta kernels of the nexuskv operators: the shared checks of the real
// kernels (nq_args.h, attention_args.h), then outputs of the real kernels'
// sizes and dtypes, allocated on the input's (meta) device.  They are the
// operators of the nexuskv_meta library (ops/registration.cpp: the same
// schemas as nexuskv's), which the Python fake kernels (nexuskv/ops.py) call
// with meta copies of their inputs whenever the sizes are concrete, so that
// torch.compile / torch.export reject exactly what the kernels reject.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "attention_args.h"
#include "nq_args.h"
#include "paged_args.h"
#include "static_append_args.h"

namespace nexuskv {
namespace {

NQTensors nq_compress_meta(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t axis, int64_t num_outliers,
                           std::optional<at::ScalarType> meta_dtype, bool /*fit_range*/) {
  const core::NQDims d = nq_compress_dims(x, bits, group_size, axis, num_outliers);
  return nq_allocate_outputs(d, x, nq_meta_dtype(x.scalar_type(), meta_dtype));
}

at::Tensor nq_decompress_meta(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                              const at::Tensor& idx, const at::Tensor& val, int64_t bits, int64_t group_size,
                              int64_t axis, int64_t head_dim, std::optional<at::ScalarType> out_dtype) {
  constexpr const char* op = "nq_decompress";
  const core::NQDims d = nq_decompress_dims(op, codes, scale, zero, idx, val, bits, group_size, axis, head_dim);
  return at::empty(nq_decompressed_sizes(codes, d.head_dim),
                   codes.options().dtype(nq_out_dtype(op, val.scalar_type(), out_dtype)));
}

DGQTensors dgq_compress_meta(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t granule,
                             std::optional<int64_t> max_len, int64_t num_outliers,
                             std::optional<at::ScalarType> meta_dtype, bool /*fit_range*/) {
  const core::NQDims d = nq_compress_dims(x, bits, group_size, -2, num_outliers);
  dgq_compress_params(d, granule, max_len);
  auto [codes, scale, zero, idx, val] = nq_allocate_outputs(d, x, nq_meta_dtype(x.scalar_type(), meta_dtype));
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 2);
  lead.push_back(d.meta_a());
  return {codes, scale, zero, idx, val, at::empty(lead, x.options().dtype(at::kInt))};
}

at::Tensor dgq_decompress_meta(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                               const at::Tensor& idx, const at::Tensor& val, const at::Tensor& segment_starts,
                               int64_t bits, int64_t group_size, int64_t head_dim,
                               std::optional<at::ScalarType> out_dtype) {
  constexpr const char* op = "dgq_decompress";
  const core::NQDims d =
      dgq_decompress_dims(op, codes, scale, zero, idx, val, segment_starts, bits, group_size, head_dim);
  return at::empty(nq_decompressed_sizes(codes, d.head_dim),
                   codes.options().dtype(nq_out_dtype(op, val.scalar_type(), out_dtype)));
}

at::Tensor dgq_fused_attention_meta(const at::Tensor& q, at::TensorList k_cache, at::TensorList v_cache,
                                    at::IntArrayRef k_format, at::IntArrayRef v_format,
                                    const at::Tensor& compressed_lens, const std::optional<at::Tensor>& k_tail,
                                    const std::optional<at::Tensor>& v_tail, const std::optional<at::Tensor>& tail_lens,
                                    const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                                    const std::optional<at::Tensor>& k_sink, const std::optional<at::Tensor>& v_sink,
                                    const std::optional<at::Tensor>& sink_lens, std::optional<int64_t> window,
                                    std::optional<double> softcap) {
  check_attention_args(q, k_cache, v_cache, k_format, v_format, compressed_lens, k_tail, v_tail, tail_lens,
                       rotation_signs, scale, k_sink, v_sink, sink_lens, window, softcap);
  return at::empty(q.sizes(), q.options());
}

at::Tensor hadamard_rotate_meta(const at::Tensor& x, const at::Tensor& signs, bool /*inverse*/) {
  check_hadamard_args(x, signs);
  return at::empty(x.sizes(), x.options());
}

void static_kv_append_meta(at::TensorList k_store, at::TensorList v_store, const at::Tensor& k_tail,
                           const at::Tensor& v_tail, const at::Tensor& lengths, const at::Tensor& k,
                           const at::Tensor& v, at::IntArrayRef k_format, at::IntArrayRef v_format, int64_t residual) {
  check_static_append_args(k_store, v_store, k_tail, v_tail, lengths, k, v, k_format, v_format, residual);
}

void paged_kv_write_meta(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits, int64_t group_size,
                         int64_t num_outliers, const std::optional<at::Tensor>& rotation_signs, bool /*key_fit_range*/,
                         bool /*value_fit_range*/, int64_t exact_window) {
  check_paged_write_args("paged_kv_write_", pages, key, value, slot_mapping, key_bits, value_bits, group_size,
                         num_outliers, rotation_signs, exact_window);
}

void paged_exact_write_meta(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits, int64_t group_size,
                            int64_t num_outliers, int64_t exact_window) {
  check_paged_exact_write_args(pages, key, value, slot_mapping, key_bits, value_bits, group_size, num_outliers,
                               exact_window);
}

at::Tensor paged_attention_meta(const at::Tensor& q, const at::Tensor& pages, const at::Tensor& block_table,
                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t key_bits,
                                int64_t value_bits, int64_t group_size, int64_t num_outliers,
                                const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                                std::optional<int64_t> window, std::optional<double> softcap, int64_t exact_window,
                                const std::optional<at::Tensor>& key, const std::optional<at::Tensor>& value) {
  check_paged_attention_args(q, pages, block_table, seq_lens, query_start_loc, key_bits, value_bits, group_size,
                             num_outliers, rotation_signs, scale, window, softcap, exact_window, key, value);
  return at::empty(q.sizes(), q.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(nexuskv_meta, Meta, m) {
  m.impl("nq_compress", &nq_compress_meta);
  m.impl("nq_decompress", &nq_decompress_meta);
  m.impl("dgq_compress", &dgq_compress_meta);
  m.impl("dgq_decompress", &dgq_decompress_meta);
  m.impl("dgq_fused_attention", &dgq_fused_attention_meta);
  m.impl("hadamard_rotate", &hadamard_rotate_meta);
  m.impl("static_kv_append_", &static_kv_append_meta);
  m.impl("paged_kv_write_", &paged_kv_write_meta);
  m.impl("paged_attention", &paged_attention_meta);
  m.impl("paged_exact_write_", &paged_exact_write_meta);
}

}  // namespace nexuskv
