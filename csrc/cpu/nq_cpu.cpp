// CPU kernels of nq_compress / nq_decompress: ATen glue over the torch-free
// core (csrc/core), parallelized with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "../aten/core_dispatch.h"
#include "../aten/nq_args.h"
#include "nexuskv/core/nq_kernels.h"
#include "nq_cpu.h"

namespace nexuskv {
namespace {

// Elements handled per parallel chunk: enough to amortize a task switch.
constexpr int64_t kElementsPerChunk = 1 << 15;

int64_t grain_for(int64_t elements_per_task) {
  return std::max<int64_t>(1, kElementsPerChunk / std::max<int64_t>(1, elements_per_task));
}

NQTensors nq_compress_cpu(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t axis, int64_t num_outliers,
                          std::optional<at::ScalarType> meta_dtype, bool fit_range) {
  const core::NQDims d = nq_compress_dims(x, bits, group_size, axis, num_outliers, fit_range);
  const at::ScalarType meta = nq_meta_dtype(x.scalar_type(), meta_dtype);
  NQTensors out = nq_allocate_outputs(d, x, meta);
  const std::vector<int64_t> row_offset = leading_row_offsets(x);
  const int64_t tasks = core::nq_num_tasks(d);
  const int64_t per_task = d.axis == core::GroupAxis::kTokens ? int64_t(d.group_size) * d.head_dim : d.head_dim;
  std::atomic<bool> non_finite{false}, range_overflow{false}, overflow{false};

  dispatch_core_float(x.scalar_type(), "nq_compress", [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_core_float(meta, "nq_compress", [&](auto meta_tag) {
      using Meta = decltype(meta_tag);
      const core::StridedRows<In> rows{core_ptr<const In>(x), row_offset.data(), x.stride(-2), x.stride(-1)};
      const core::NQBuffers<In, Meta> buffers{std::get<0>(out).data_ptr<uint8_t>(), core_ptr<Meta>(std::get<1>(out)),
                                              core_ptr<Meta>(std::get<2>(out)), std::get<3>(out).data_ptr<uint8_t>(),
                                              core_ptr<In>(std::get<4>(out))};
      at::parallel_for(0, tasks, grain_for(per_task), [&](int64_t begin, int64_t end) {
        core::CompressStatus status;
        core::nq_compress_tasks<In, Meta>(d, rows, buffers, begin, end, &status);
        if (status.non_finite_input) non_finite = true;
        if (status.range_overflow) range_overflow = true;
        if (status.meta_overflow) overflow = true;
      });
    });
  });
  nq_check_compress_status("nq_compress", non_finite, range_overflow, overflow, meta);
  return out;
}

at::Tensor nq_decompress_cpu(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                             const at::Tensor& idx, const at::Tensor& val, int64_t bits, int64_t group_size,
                             int64_t axis, int64_t head_dim, std::optional<at::ScalarType> out_dtype) {
  const core::NQDims d =
      nq_decompress_dims("nq_decompress", codes, scale, zero, idx, val, bits, group_size, axis, head_dim);
  return nq_decompress_cpu_dims("nq_decompress", d, codes, scale, zero, idx, val, out_dtype);
}

}  // namespace

at::Tensor nq_decompress_cpu_dims(const char* op, const core::NQDims& d, const at::Tensor& codes_in,
                                  const at::Tensor& scale_in, const at::Tensor& zero_in, const at::Tensor& idx_in,
                                  const at::Tensor& val_in, std::optional<at::ScalarType> out_dtype) {
  // The compressed tensors are ours and contiguous; views of them are copied.
  const at::Tensor codes = codes_in.contiguous(), scale = scale_in.contiguous(), zero = zero_in.contiguous();
  const at::Tensor idx = idx_in.contiguous(), val = val_in.contiguous();
  const at::ScalarType out_type = nq_out_dtype(op, val.scalar_type(), out_dtype);
  at::Tensor out = at::empty(nq_decompressed_sizes(codes, d.head_dim), codes.options().dtype(out_type));
  const int64_t tasks = core::nq_num_tasks(d);
  const int64_t per_task = d.axis == core::GroupAxis::kTokens ? int64_t(d.group_size) * d.head_dim : d.head_dim;
  std::atomic<bool> bad_index{false};

  dispatch_core_float(out_type, op, [&](auto out_tag) {
    using Out = decltype(out_tag);
    dispatch_core_float(scale.scalar_type(), op, [&](auto meta_tag) {
      using Meta = decltype(meta_tag);
      at::parallel_for(0, tasks, grain_for(per_task), [&](int64_t begin, int64_t end) {
        core::nq_decompress_tasks<Meta, Out>(d, codes.data_ptr<uint8_t>(), core_ptr<const Meta>(scale),
                                             core_ptr<const Meta>(zero), core_ptr<Out>(out), begin, end);
      });
    });
    if (d.num_outliers == 0) return;
    dispatch_core_float(val.scalar_type(), op, [&](auto val_tag) {
      using Val = decltype(val_tag);
      const int64_t groups = d.rows * d.groups_per_row();
      at::parallel_for(0, groups, grain_for(d.num_outliers), [&](int64_t begin, int64_t end) {
        if (!core::nq_scatter_outliers<Val, Out>(d, idx.data_ptr<uint8_t>(), core_ptr<const Val>(val),
                                                 core_ptr<Out>(out), begin, end))
          bad_index = true;
      });
    });
  });
  nq_check_outlier_positions(op, "", !bad_index, d.group_size, d.segment_starts != nullptr);
  return out;
}

TORCH_LIBRARY_IMPL(nexuskv, CPU, m) {
  m.impl("nq_compress", &nq_compress_cpu);
  m.impl("nq_decompress", &nq_decompress_cpu);
}

}  // namespace nexuskv
