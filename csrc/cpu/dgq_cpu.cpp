// CPU kernels of dgq_compress / dgq_decompress: segments are chosen per row
// (csrc/core/dgq_segments.cpp), then the rows are quantized per channel over
// those segments by the NQ kernels, which read group bounds from
// NQDims::segment_starts.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "../aten/core_dispatch.h"
#include "../aten/nq_args.h"
#include "nexuskv/core/dgq.h"
#include "nexuskv/core/nq_kernels.h"
#include "nq_cpu.h"
#include "value_checks.h"

namespace nexuskv {
namespace {

DGQTensors dgq_compress_cpu(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t granule,
                            std::optional<int64_t> max_len_arg, int64_t num_outliers,
                            std::optional<at::ScalarType> meta_dtype, bool fit_range) {
  constexpr const char* op = "dgq_compress";
  core::NQDims d = nq_compress_dims(x, bits, group_size, -2, num_outliers, fit_range);
  const core::DGQParams params = dgq_compress_params(d, granule, max_len_arg);
  const at::ScalarType meta = nq_meta_dtype(x.scalar_type(), meta_dtype);
  NQTensors nq = nq_allocate_outputs(d, x, meta);
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 2);
  lead.push_back(d.meta_a());
  at::Tensor starts = at::empty(lead, x.options().dtype(at::kInt));
  const std::vector<int64_t> row_offset = leading_row_offsets(x);
  std::atomic<bool> non_finite{false}, range_overflow{false}, overflow{false}, unmet{false};

  dispatch_core_float(x.scalar_type(), op, [&](auto in_tag) {
    using In = decltype(in_tag);
    const core::StridedRows<In> rows{core_ptr<const In>(x), row_offset.data(), x.stride(-2), x.stride(-1)};
    at::parallel_for(0, d.rows, 1, [&](int64_t begin, int64_t end) {
      if (!core::dgq_segment_rows<In>(rows, d.tokens, d.head_dim, params, starts.data_ptr<int32_t>(), begin, end))
        unmet = true;
    });
    if (unmet) return;
    d.segment_starts = starts.data_ptr<int32_t>();
    dispatch_core_float(meta, op, [&](auto meta_tag) {
      using Meta = decltype(meta_tag);
      const core::NQBuffers<In, Meta> buffers{std::get<0>(nq).data_ptr<uint8_t>(), core_ptr<Meta>(std::get<1>(nq)),
                                              core_ptr<Meta>(std::get<2>(nq)), std::get<3>(nq).data_ptr<uint8_t>(),
                                              core_ptr<In>(std::get<4>(nq))};
      at::parallel_for(0, core::nq_num_tasks(d), 1, [&](int64_t begin, int64_t end) {
        core::CompressStatus status;
        core::nq_compress_tasks<In, Meta>(d, rows, buffers, begin, end, &status);
        if (status.non_finite_input) non_finite = true;
        if (status.range_overflow) range_overflow = true;
        if (status.meta_overflow) overflow = true;
      });
    });
  });
  TORCH_CHECK(!unmet, op, ": internal error: a row could not be cut into ", d.meta_a(), " segments");
  nq_check_compress_status(op, non_finite, range_overflow, overflow, meta);
  auto& [codes, scale, zero, idx, val] = nq;
  return {codes, scale, zero, idx, val, starts};
}

at::Tensor dgq_decompress_cpu(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                              const at::Tensor& idx, const at::Tensor& val, const at::Tensor& segment_starts,
                              int64_t bits, int64_t group_size, int64_t head_dim,
                              std::optional<at::ScalarType> out_dtype) {
  core::NQDims d =
      dgq_decompress_dims("dgq_decompress", codes, scale, zero, idx, val, segment_starts, bits, group_size, head_dim);
  const at::Tensor starts = segment_starts.contiguous();
  check_segment_starts("dgq_decompress", "", d, starts.data_ptr<int32_t>());
  d.segment_starts = starts.data_ptr<int32_t>();
  return nq_decompress_cpu_dims("dgq_decompress", d, codes, scale, zero, idx, val, out_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(nexuskv, CPU, m) {
  m.impl("dgq_compress", &dgq_compress_cpu);
  m.impl("dgq_decompress", &dgq_decompress_cpu);
}

}  // namespace nexuskv
