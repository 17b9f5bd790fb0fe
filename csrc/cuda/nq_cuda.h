// Shared by the NQ and DGQ CUDA operators (nq_cuda.cpp, dgq_cuda.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "../aten/nq_args.h"
#include "nexuskv/core/nq_format.h"

namespace nexuskv {

// Compresses x (checked; sizes d, d.segment_starts a device pointer for DGQ)
// into the allocated outputs on the current stream; raises the CPU's errors
// for invalid values when NEXUSKV_CUDA_CHECKS=1 (cuda_glue.h).
void nq_compress_cuda_into(const char* op, const core::NQDims& d, const at::Tensor& x, const NQTensors& out,
                           at::ScalarType meta);

// Decompresses already validated buffers of sizes d (d.segment_starts set for DGQ).
at::Tensor nq_decompress_cuda_dims(const char* op, const core::NQDims& d, const at::Tensor& codes,
                                   const at::Tensor& scale, const at::Tensor& zero, const at::Tensor& outlier_idx,
                                   const at::Tensor& outlier_val, std::optional<at::ScalarType> out_dtype);

}  // namespace nexuskv
