// CUDA kernels of dgq_compress / dgq_decompress: the segments of every row
// are chosen on the device (dgq_segments.cuh, the CPU's choice), then the rows
// are quantized per channel over those segments by the NQ kernels, which read
// the group bounds from NQDims::segment_starts.
#include <torch/library.h>

#include "../aten/core_dispatch.h"
#include "../aten/nq_args.h"
#include "cuda_glue.h"
#include "launch.h"
#include "nq_cuda.h"

namespace nexuskv {
namespace {

DGQTensors dgq_compress_cuda(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t granule,
                             std::optional<int64_t> max_len_arg, int64_t num_outliers,
                             std::optional<at::ScalarType> meta_dtype, bool fit_range) {
  constexpr const char* op = "dgq_compress";
  core::NQDims d = nq_compress_dims(x, bits, group_size, -2, num_outliers, fit_range);
  const core::DGQParams params = dgq_compress_params(d, granule, max_len_arg);
  const at::ScalarType meta = nq_meta_dtype(x.scalar_type(), meta_dtype);
  const c10::cuda::CUDAGuard guard(x.device());
  NQTensors nq = nq_allocate_outputs(d, x, meta);
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 2);
  lead.push_back(d.meta_a());
  at::Tensor starts = at::empty(lead, x.options().dtype(at::kInt));
  const at::Tensor rows = cuda::rows_view(x, d);
  at::Tensor scratch = at::empty({d.rows * cuda::dgq_scratch_bytes_per_row(d.tokens, d.head_dim, params.granule)},
                                 x.options().dtype(at::kByte));
  TORCH_CHECK(d.rows < (int64_t(1) << 31), op, ": at most 2^31 - 1 rows on CUDA, got ", d.rows);
  const cuda::DeviceStatus status(x);
  dispatch_core_float(x.scalar_type(), op, [&](auto tag) {
    using In = decltype(tag);
    const cuda::RowsView<In> view{core_ptr<const In>(rows), rows.stride(0), rows.stride(1), rows.stride(2)};
    cuda::launch_dgq_segments(view, d.rows, d.tokens, d.head_dim, params.granule, params.max_len, d.meta_a(),
                              scratch.data_ptr<unsigned char>(), starts.data_ptr<int32_t>(), status.ptr(),
                              cuda::current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  TORCH_CHECK(!(status.read() & cuda::kSegmentsUnmet), op, ": internal error: a row could not be cut into ", d.meta_a(),
              " segments");
  d.segment_starts = starts.data_ptr<int32_t>();
  nq_compress_cuda_into(op, d, x, nq, meta);
  auto& [codes, scale, zero, idx, val] = nq;
  return {codes, scale, zero, idx, val, starts};
}

at::Tensor dgq_decompress_cuda(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                               const at::Tensor& idx, const at::Tensor& val, const at::Tensor& segment_starts,
                               int64_t bits, int64_t group_size, int64_t head_dim,
                               std::optional<at::ScalarType> out_dtype) {
  core::NQDims d =
      dgq_decompress_dims("dgq_decompress", codes, scale, zero, idx, val, segment_starts, bits, group_size, head_dim);
  const c10::cuda::CUDAGuard guard(codes.device());
  const at::Tensor starts = segment_starts.contiguous();
  d.segment_starts = starts.data_ptr<int32_t>();
  return nq_decompress_cuda_dims("dgq_decompress", d, codes, scale, zero, idx, val, out_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(nexuskv, CUDA, m) {
  m.impl("dgq_compress", &dgq_compress_cuda);
  m.impl("dgq_decompress", &dgq_decompress_cuda);
}

}  // namespace nexuskv
