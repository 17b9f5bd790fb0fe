// CUDA kernels of nq_compress / nq_decompress: ATen glue over the launch
// functions of launch.h (kernels: nq_compress.cuh, nq_decompress.cuh).  Argument checks are the shared ones
// (csrc/aten/nq_args.h); value checks: cuda_glue.h.
#include <torch/library.h>

#include "../aten/core_dispatch.h"
#include "../aten/nq_args.h"
#include "../cpu/value_checks.h"
#include "cuda_glue.h"
#include "launch.h"
#include "nq_cuda.h"

namespace nexuskv {
namespace {

using cuda::DeviceStatus;

NQTensors nq_compress_cuda(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t axis, int64_t num_outliers,
                           std::optional<at::ScalarType> meta_dtype, bool fit_range) {
  core::NQDims d = nq_compress_dims(x, bits, group_size, axis, num_outliers, fit_range);
  const at::ScalarType meta = nq_meta_dtype(x.scalar_type(), meta_dtype);
  const c10::cuda::CUDAGuard guard(x.device());
  NQTensors out = nq_allocate_outputs(d, x, meta);
  nq_compress_cuda_into("nq_compress", d, x, out, meta);
  return out;
}

at::Tensor nq_decompress_cuda(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                              const at::Tensor& idx, const at::Tensor& val, int64_t bits, int64_t group_size,
                              int64_t axis, int64_t head_dim, std::optional<at::ScalarType> out_dtype) {
  const core::NQDims d =
      nq_decompress_dims("nq_decompress", codes, scale, zero, idx, val, bits, group_size, axis, head_dim);
  const c10::cuda::CUDAGuard guard(codes.device());
  return nq_decompress_cuda_dims("nq_decompress", d, codes, scale, zero, idx, val, out_dtype);
}

}  // namespace

void nq_compress_cuda_into(const char* op, const core::NQDims& d, const at::Tensor& x, const NQTensors& out,
                           at::ScalarType meta) {
  const at::Tensor rows = cuda::rows_view(x, d);
  const DeviceStatus status(x);
  dispatch_core_float(x.scalar_type(), op, [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_core_float(meta, op, [&](auto meta_tag) {
      using Meta = decltype(meta_tag);
      cuda::NQCompressArgs<In, Meta> a;
      a.dims = d;
      a.x = {core_ptr<const In>(rows), rows.stride(0), rows.stride(1), rows.stride(2)};
      a.codes = std::get<0>(out).data_ptr<uint8_t>();
      a.scale = core_ptr<Meta>(std::get<1>(out));
      a.zero = core_ptr<Meta>(std::get<2>(out));
      a.outlier_idx = std::get<3>(out).data_ptr<uint8_t>();
      a.outlier_val = core_ptr<In>(std::get<4>(out));
      a.status = status.ptr();
      cuda::launch_nq_compress(a, cuda::current_stream());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  const uint32_t bad = status.read();
  nq_check_compress_status(op, bad & cuda::kNonFiniteInput, bad & cuda::kRangeOverflow, bad & cuda::kMetaOverflow,
                           meta);
}

at::Tensor nq_decompress_cuda_dims(const char* op, const core::NQDims& d, const at::Tensor& codes_in,
                                   const at::Tensor& scale_in, const at::Tensor& zero_in, const at::Tensor& idx_in,
                                   const at::Tensor& val_in, std::optional<at::ScalarType> out_dtype) {
  const at::Tensor codes = codes_in.contiguous(), scale = scale_in.contiguous(), zero = zero_in.contiguous();
  const at::Tensor idx = idx_in.contiguous(), val = val_in.contiguous();
  const at::ScalarType out_type = nq_out_dtype(op, val.scalar_type(), out_dtype);
  at::Tensor out = at::empty(nq_decompressed_sizes(codes, d.head_dim), codes.options().dtype(out_type));
  const DeviceStatus status(codes);
  at::Tensor row_ok;
  if (d.segment_starts) row_ok = at::empty({d.rows}, codes.options().dtype(at::kByte));
  cuda::NQDecompressArgs a;
  a.dims = d;
  a.codes = codes.data_ptr<uint8_t>();
  a.scale = scale.data_ptr();
  a.zero = zero.data_ptr();
  a.outlier_idx = idx.data_ptr<uint8_t>();
  a.outlier_val = val.data_ptr();
  a.meta_dtype = to_core_dtype(scale.scalar_type());
  a.val_dtype = to_core_dtype(val.scalar_type());
  a.row_ok = d.segment_starts ? row_ok.data_ptr<uint8_t>() : nullptr;
  a.status = status.ptr();
  dispatch_core_float(out_type, op, [&](auto out_tag) {
    using Out = decltype(out_tag);
    cuda::launch_nq_decompress(a, core_ptr<Out>(out), cuda::current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const uint32_t bad = status.read();
  if (bad & cuda::kBadSegments) {  // NEXUSKV_CUDA_CHECKS=1: the CPU's message for the first bad row
    const at::Tensor starts =
        at::from_blob(const_cast<int32_t*>(d.segment_starts), {d.rows * d.meta_a()}, codes.options().dtype(at::kInt))
            .cpu();
    check_segment_starts(op, "", d, starts.data_ptr<int32_t>());
  }
  nq_check_outlier_positions(op, "", !(bad & cuda::kBadOutlierIndex), d.group_size, d.segment_starts != nullptr);
  return out;
}

TORCH_LIBRARY_IMPL(nexuskv, CUDA, m) {
  m.impl("nq_compress", &nq_compress_cuda);
  m.impl("nq_decompress", &nq_decompress_cuda);
}

}  // namespace nexuskv
