// Public C++ API of nexuskv: the registered operators, called through the
// PyTorch dispatcher (so the CPU/CUDA kernel and the inference-only check
// apply exactly as from Python).  Link the application against libnexuskv so
// that the operators are registered before the first call.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace nexuskv {

// NQ block quantization, format in nexuskv/core/nq_format.h.
// axis: -2 = groups of tokens per channel (keys), -1 = groups of channels per token (values).
// fit_range: least-squares fitted ranges (nq_format.h, "Fitted ranges").
// Returns (codes, scale, zero, outlier_idx, outlier_val).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> nq_compress(
    const at::Tensor& x, int64_t bits, int64_t group_size, int64_t axis, int64_t num_outliers = 0,
    std::optional<at::ScalarType> meta_dtype = std::nullopt, bool fit_range = false);

at::Tensor nq_decompress(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                         const at::Tensor& outlier_idx, const at::Tensor& outlier_val, int64_t bits, int64_t group_size,
                         int64_t axis, int64_t head_dim, std::optional<at::ScalarType> out_dtype = std::nullopt);

// DGQ: per-channel quantization over data-chosen token groups.  Returns
// (codes, scale, zero, outlier_idx, outlier_val, segment_starts).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dgq_compress(
    const at::Tensor& x, int64_t bits, int64_t group_size, int64_t granule = 16,
    std::optional<int64_t> max_len = std::nullopt, int64_t num_outliers = 0,
    std::optional<at::ScalarType> meta_dtype = std::nullopt, bool fit_range = false);

at::Tensor dgq_decompress(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                          const at::Tensor& outlier_idx, const at::Tensor& outlier_val,
                          const at::Tensor& segment_starts, int64_t bits, int64_t group_size, int64_t head_dim,
                          std::optional<at::ScalarType> out_dtype = std::nullopt);

// softmax(q K^T * scale + causal) V read straight from the compressed cache,
// with optional full-precision sinks (first tokens) and tail (newest tokens),
// an optional sliding window and logit soft-cap
// (see the schema comment in ops/registration.cpp).
at::Tensor dgq_fused_attention(
    const at::Tensor& q, at::TensorList k_cache, at::TensorList v_cache, at::IntArrayRef k_format,
    at::IntArrayRef v_format, const at::Tensor& compressed_lens, const std::optional<at::Tensor>& k_tail = std::nullopt,
    const std::optional<at::Tensor>& v_tail = std::nullopt, const std::optional<at::Tensor>& tail_lens = std::nullopt,
    const std::optional<at::Tensor>& rotation_signs = std::nullopt, std::optional<double> scale = std::nullopt,
    const std::optional<at::Tensor>& k_sink = std::nullopt, const std::optional<at::Tensor>& v_sink = std::nullopt,
    const std::optional<at::Tensor>& sink_lens = std::nullopt, std::optional<int64_t> window = std::nullopt,
    std::optional<double> softcap = std::nullopt);

// Randomized Hadamard rotation of the last dim (a power of two).
at::Tensor hadamard_rotate(const at::Tensor& x, const at::Tensor& signs, bool inverse = false);

// Paged KV for serving engines (the format: nexuskv/core/paged_format.h; the
// schemas' comments in ops/registration.cpp).
int64_t paged_slot_bytes(int64_t head_dim, int64_t key_bits, int64_t value_bits, int64_t group_size,
                         int64_t num_outliers, at::ScalarType dtype, int64_t exact_window = 0, int64_t block_size = 0);
void paged_kv_write_(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits, int64_t group_size,
                     int64_t num_outliers = 0, const std::optional<at::Tensor>& rotation_signs = std::nullopt,
                     bool key_fit_range = false, bool value_fit_range = false, int64_t exact_window = 0);
void paged_exact_write_(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits, int64_t group_size,
                        int64_t num_outliers, int64_t exact_window);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& pages, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t key_bits,
                           int64_t value_bits, int64_t group_size, int64_t num_outliers = 0,
                           const std::optional<at::Tensor>& rotation_signs = std::nullopt,
                           std::optional<double> scale = std::nullopt, std::optional<int64_t> window = std::nullopt,
                           std::optional<double> softcap = std::nullopt, int64_t exact_window = 0,
                           const std::optional<at::Tensor>& key = std::nullopt,
                           const std::optional<at::Tensor>& value = std::nullopt);

// Whether NEXUSKV_CUDA_CHECKS=1 is set: the CUDA operators and the cache then
// read their value checks back from the device and raise the CPU's errors
// (this synchronizes; without it a decode step never does).
bool cuda_value_checks_requested();

}  // namespace nexuskv
