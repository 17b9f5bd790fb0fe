// Argument checks and output allocation of the NQ / DGQ operators, shared by
// every backend's kernel and by the meta kernels (csrc/aten/meta_kernels.cpp,
// which the Python fake kernels run), so that all of them reject bad input
// with the same messages.  They read sizes, dtypes and devices only, never
// tensor data (checks that need the data run in each backend's kernel, e.g.
// csrc/cpu/value_checks.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <optional>
#include <tuple>
#include <vector>

#include "nexuskv/core/dgq.h"
#include "nexuskv/core/nq_format.h"

namespace nexuskv {

using NQTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using DGQTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

bool is_float_type(at::ScalarType t);

// The core's DType of a float ATen dtype (byte accounting, nq_nbytes).
core::DType to_core_dtype(at::ScalarType t);

// All defined tensors of `tensors` on first's device: "op: all tensors must be
// on one device, <first_name> is on X but <name> is on Y".
void check_same_device(const char* op, const char* first_name, const at::Tensor& first,
                       std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors);

// Checks x and the parameters of nq_compress (every int on its int64 value,
// before any narrowing); returns the sizes of the result.
core::NQDims nq_compress_dims(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t axis, int64_t num_outliers,
                              bool fit_range = false);

// The meta dtype: the one asked for, else the input dtype.
at::ScalarType nq_meta_dtype(at::ScalarType x_dtype, std::optional<at::ScalarType> meta_dtype);

// Empty outputs of nq_compress on x's device: codes, scale, zero, outlier_idx, outlier_val.
NQTensors nq_allocate_outputs(const core::NQDims& d, const at::Tensor& x, at::ScalarType meta_dtype);

// dgq_compress: the NQ checks with axis -2, then granule and max_len (default:
// the smallest multiple of granule >= 2 * group_size); the segment budget is
// d.meta_a().
core::DGQParams dgq_compress_params(const core::NQDims& d, int64_t granule, std::optional<int64_t> max_len);

// Checks the five buffers of an NQ tensor against each other and the
// parameters (sizes, dtypes, devices); returns the sizes of the tensor they
// encode.  `op` names the operator in messages, and `what` the cache the
// buffers belong to ("k_cache: codes must be uint8"; "" for the decompress
// operators).  What the
// sizes cannot reveal (decompressing with another group_size or head_dim that
// gives the same sizes) is documented in nq_format.h's callers: the format
// parameters travel with the buffers (nexuskv.NQ, KVCache).
core::NQDims nq_decompress_dims(const char* op, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& zero, const at::Tensor& outlier_idx, const at::Tensor& outlier_val,
                                int64_t bits, int64_t group_size, int64_t axis, int64_t head_dim,
                                const char* what = "");

// The same for a DGQ tensor: the five NQ buffers (grouping along tokens) plus
// segment_starts int32 [..., S].  Sizes only: that the starts are ordered
// segments of [0, tokens] is checked by the kernels (they read the data).
core::NQDims dgq_decompress_dims(const char* op, const at::Tensor& codes, const at::Tensor& scale,
                                 const at::Tensor& zero, const at::Tensor& outlier_idx, const at::Tensor& outlier_val,
                                 const at::Tensor& segment_starts, int64_t bits, int64_t group_size, int64_t head_dim,
                                 const char* what = "");

// The output dtype of the decompress operators: the one asked for, else outlier_val's.
at::ScalarType nq_out_dtype(const char* op, at::ScalarType val_dtype, std::optional<at::ScalarType> out_dtype);

// Sizes of the decompressed tensor: codes' leading dims + [T, head_dim].
std::vector<int64_t> nq_decompressed_sizes(const at::Tensor& codes, int64_t head_dim);

// Offsets (in elements) of x[i..., 0, 0] for every index i of x's leading dims,
// so that kernels read any strided view without a copy (strides only, no data).
std::vector<int64_t> leading_row_offsets(const at::Tensor& x);

// Invalid-input errors that the compress kernels detect while running
// (core::CompressStatus).
void nq_check_compress_status(const char* op, bool non_finite_input, bool range_overflow, bool meta_overflow,
                              at::ScalarType meta_dtype);

// Corrupt outlier positions found by a kernel (the same message for
// decompression and fused attention).  dgq: the groups are the segments of
// segment_starts (whose made-up values show up here first).
void nq_check_outlier_positions(const char* op, const char* what, bool ok, int64_t group_size, bool dgq = false);

}  // namespace nexuskv
