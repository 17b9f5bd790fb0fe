// Shared by the NQ and DGQ CPU operators.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "nexuskv/core/nq_format.h"

namespace nexuskv {

// Decompresses already validated buffers of sizes d (d.segment_starts set for DGQ).
at::Tensor nq_decompress_cpu_dims(const char* op, const core::NQDims& d, const at::Tensor& codes,
                                  const at::Tensor& scale, const at::Tensor& zero, const at::Tensor& outlier_idx,
                                  const at::Tensor& outlier_val, std::optional<at::ScalarType> out_dtype);

}  // namespace nexuskv
