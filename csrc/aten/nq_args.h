// Argument validation and output allocation for the NQ operators, shared by
// every backend so that all of them reject bad input with the same messages.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

#include "nexuskv/core/nq_format.h"

namespace nexuskv {

using NQTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

core::DType to_core_dtype(at::ScalarType t);

// Checks x and the parameters of nq_compress; returns the sizes of the result.
core::NQDims nq_compress_dims(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t axis,
                              int64_t num_outliers);

// The meta dtype: the one asked for, else the input dtype.
at::ScalarType nq_meta_dtype(at::ScalarType x_dtype, std::optional<at::ScalarType> meta_dtype);

// Empty outputs of nq_compress on x's device: codes, scale, zero, outlier_idx, outlier_val.
NQTensors nq_allocate_outputs(const core::NQDims& d, const at::Tensor& x, at::ScalarType meta_dtype);

// Checks the five buffers of an NQ tensor against each other and the
// parameters; returns the sizes of the tensor they encode.  `op` names the
// operator in error messages.
core::NQDims nq_decompress_dims(const char* op, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                                const at::Tensor& outlier_idx, const at::Tensor& outlier_val, int64_t bits,
                                int64_t group_size, int64_t axis, int64_t head_dim);

// The same for a DGQ tensor: the five NQ buffers (grouping along tokens) plus
// segment_starts int32 [..., S], checked to be ordered segments starting at 0
// within [0, tokens] (the readers rely on it).
core::NQDims dgq_decompress_dims(const char* op, const at::Tensor& codes, const at::Tensor& scale,
                                 const at::Tensor& zero, const at::Tensor& outlier_idx,
                                 const at::Tensor& outlier_val, const at::Tensor& segment_starts, int64_t bits,
                                 int64_t group_size, int64_t head_dim);

// Sizes of the decompressed tensor: codes' leading dims + [T, head_dim].
std::vector<int64_t> nq_decompressed_sizes(const at::Tensor& codes, int64_t head_dim);

// Offsets (in elements) of x[i..., 0, 0] for every index i of x's leading dims,
// so that kernels read any strided view without a copy.
std::vector<int64_t> leading_row_offsets(const at::Tensor& x);

// Invalid-input errors that the kernels detect while running.
void nq_check_compress_status(bool non_finite_input, bool meta_overflow, at::ScalarType meta_dtype);

}  // namespace nexuskv
