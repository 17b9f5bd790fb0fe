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
// Returns (codes, scale, zero, outlier_idx, outlier_val).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> nq_compress(
    const at::Tensor& x, int64_t bits, int64_t group_size, int64_t axis, int64_t num_outliers = 0,
    std::optional<at::ScalarType> meta_dtype = std::nullopt);

at::Tensor nq_decompress(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                         const at::Tensor& outlier_idx, const at::Tensor& outlier_val, int64_t bits,
                         int64_t group_size, int64_t axis, int64_t head_dim,
                         std::optional<at::ScalarType> out_dtype = std::nullopt);

}  // namespace nexuskv
