// CUDA kernels of paged_kv_write_ / paged_exact_write_ / paged_attention: ATen
// glue over launch_paged_write / _exact_write / _attention (launch.h; kernels:
// paged_kernels.cuh).  Argument checks are the shared ones
// (csrc/aten/paged_args.h); the checks that read data run on the device
// (cuda_glue.h): an invalid slot skips its token, invalid lengths, block ids,
// signs or outlier positions make the attention's rows NaN.  With
// NEXUSKV_CUDA_CHECKS=1 the data is also checked on the host before the launch
// (slots, duplicates included, signs, query_start_loc, lengths, block ids) and
// the status word read after it, raising the CPU kernel's messages
// (csrc/cpu/paged_cpu.cpp); otherwise no host synchronization.
//
// Duplicate slots in one paged_kv_write_ call are the caller's contract on
// CUDA (the tokens race for the slot, which then holds a mix of both); the
// CPU kernel, and this one with NEXUSKV_CUDA_CHECKS=1, raise.
#include <torch/library.h>

#include <algorithm>

#include "../aten/core_dispatch.h"
#include "../aten/paged_args.h"
#include "../cpu/value_checks.h"
#include "cuda_glue.h"
#include "launch.h"

namespace nexuskv {
namespace {

using cuda::DeviceStatus;

// The CPU kernel's checks of slot_mapping, on a host copy.
void check_slots_host(const char* op, const at::Tensor& slots_device, int64_t num_slots) {
  const at::Tensor slots = slots_device.cpu().contiguous();
  check_paged_slots(op, slots.data_ptr<int64_t>(), slots.numel(), num_slots);
}

void check_signs_host(const char* op, const at::Tensor& signs_device) {
  check_rotation_sign_values(op, signs_device.to(at::kFloat).cpu().contiguous());
}

// The CPU kernel's data checks of the attention, on host copies.
void check_attention_data_host(const char* op, const PagedAttentionShapes& s, const at::Tensor& qsl_device,
                               const at::Tensor& lens_device, const at::Tensor& table_device) {
  const at::Tensor qsl = qsl_device.cpu().contiguous(), lens = lens_device.cpu().contiguous();
  const at::Tensor table = table_device.cpu().contiguous();
  check_paged_requests(op, s, qsl.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), table.data_ptr<int32_t>());
}

void paged_kv_write_cuda(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits, int64_t group_size,
                         int64_t num_outliers, const std::optional<at::Tensor>& rotation_signs, bool key_fit_range,
                         bool value_fit_range, int64_t exact_window) {
  constexpr const char* op = "paged_kv_write_";
  const PagedWriteShapes s = check_paged_write_args(op, pages, key, value, slot_mapping, key_bits, value_bits,
                                                    group_size, num_outliers, rotation_signs, exact_window);
  if (s.num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(pages.device());
  const int64_t rows = s.num_tokens * s.pool.kv_heads;
  TORCH_CHECK(rows < (int64_t(1) << 31), op, ": at most 2^31 - 1 (token, kv head) rows on CUDA, got ", rows);
  const at::Tensor slots = slot_mapping.contiguous();
  std::optional<at::Tensor> signs;
  if (rotation_signs) signs = rotation_signs->to(at::kFloat).contiguous();
  if (cuda::value_checks_on()) {  // the CPU's checks before anything is written
    check_slots_host(op, slots, s.pool.num_slots());
    if (signs) check_signs_host(op, *signs);
  }
  const at::Tensor k = paged_rows(key), v = paged_rows(value);
  const cuda::PagedWriteScratch layout = cuda::paged_write_scratch(s.pool.layout, rows, signs.has_value());
  const at::Tensor scratch = at::empty({layout.bytes}, pages.options());
  const DeviceStatus status(pages);
  dispatch_core_float(key.scalar_type(), op, [&](auto tag) {
    using X = decltype(tag);
    const core::PagedWrite<X> w = make_paged_write<X>(s, pages, k, v, slots, signs, key_fit_range, value_fit_range);
    cuda::launch_paged_write<X>(w, scratch.data_ptr<uint8_t>(), status.ptr(), cuda::current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const uint32_t bad = status.read();
  if (bad & cuda::kBadSlot) check_slots_host(op, slots, s.pool.num_slots());
  if ((bad & cuda::kBadSigns) && signs) check_signs_host(op, *signs);
  TORCH_CHECK(!(bad & (cuda::kBadSlot | cuda::kBadSigns)), op,
              ": slot_mapping or rotation_signs changed during the call (the device saw invalid values)");
  check_paged_write_status(op, key.scalar_type(), bad & cuda::kNonFiniteInput,
                           bad & (cuda::kMetaOverflow | cuda::kRangeOverflow));
}

void paged_exact_write_cuda(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits, int64_t group_size,
                            int64_t num_outliers, int64_t exact_window) {
  constexpr const char* op = "paged_exact_write_";
  const PagedWriteShapes s = check_paged_exact_write_args(pages, key, value, slot_mapping, key_bits, value_bits,
                                                          group_size, num_outliers, exact_window);
  if (s.num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(pages.device());
  const at::Tensor slots = slot_mapping.contiguous();
  if (cuda::value_checks_on()) check_slots_host(op, slots, s.pool.num_slots());
  const at::Tensor k = paged_rows(key), v = paged_rows(value);
  const DeviceStatus status(pages);
  dispatch_core_float(key.scalar_type(), op, [&](auto tag) {
    using X = decltype(tag);
    const core::PagedWrite<X> w = make_paged_write<X>(s, pages, k, v, slots, std::nullopt, false, false);
    cuda::launch_paged_exact_write<X>(w, status.ptr(), cuda::current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const uint32_t bad = status.read();
  if (bad & cuda::kBadSlot) check_slots_host(op, slots, s.pool.num_slots());
  TORCH_CHECK(!(bad & cuda::kBadSlot), op, ": slot_mapping changed during the call (the device saw invalid values)");
}

at::Tensor paged_attention_cuda(const at::Tensor& q, const at::Tensor& pages, const at::Tensor& block_table,
                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t key_bits,
                                int64_t value_bits, int64_t group_size, int64_t num_outliers,
                                const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                                std::optional<int64_t> window, std::optional<double> softcap, int64_t exact_window,
                                const std::optional<at::Tensor>& key, const std::optional<at::Tensor>& value) {
  constexpr const char* op = "paged_attention";
  const PagedAttentionShapes s =
      check_paged_attention_args(q, pages, block_table, seq_lens, query_start_loc, key_bits, value_bits, group_size,
                                 num_outliers, rotation_signs, scale, window, softcap, exact_window, key, value);
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous(), qsl = query_start_loc.contiguous();
  std::optional<at::Tensor> signs;
  if (rotation_signs) signs = rotation_signs->to(at::kFloat).contiguous();
  if (cuda::value_checks_on()) {  // the CPU's checks, in its order, before the launch
    check_attention_data_host(op, s, qsl, lens, table);
    if (signs) check_signs_host(op, *signs);
  }
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  const at::Tensor kx = key ? paged_rows(*key) : at::Tensor(), vx = value ? paged_rows(*value) : at::Tensor();
  // Every row is written by the kernel (padding rows zero).
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (s.num_tokens == 0) return out;
  const int64_t head_chunks = (s.q_heads / s.pool.kv_heads + cuda::kPagedHeadsPerBlock - 1) / cuda::kPagedHeadsPerBlock;
  TORCH_CHECK(s.num_tokens < (int64_t(1) << 31), op, ": at most 2^31 - 1 query tokens on CUDA, got ", s.num_tokens);
  TORCH_CHECK(s.pool.kv_heads * head_chunks <= 65535, op, ": at most 65535 kv heads x ceil(q_heads / kv_heads / ",
              cuda::kPagedHeadsPerBlock, ") on CUDA, got ", s.pool.kv_heads, " x ", head_chunks);
  const DeviceStatus status(q);
  const cuda::KernelChoice choice = cuda::kernel_choice(op);
  dispatch_core_float(q.scalar_type(), op, [&](auto tag) {
    using X = decltype(tag);
    const core::PagedAttention<X> p = make_paged_attention<X>(s, qc, pages, table, lens, qsl, signs, out, kx, vx);
    const cuda::PagedAttentionPlan plan =
        cuda::paged_attention_plan<X>(p, cuda::multiprocessor_count(), choice != cuda::KernelChoice::kSimple);
    TORCH_CHECK(plan.mma || (choice != cuda::KernelChoice::kMma && choice != cuda::KernelChoice::kDecode), op,
                ": NEXUSKV_CUDA_ATTENTION=mma (or decode), but the tensor-core kernel does not take this problem (it "
                "needs fp16 "
                "or bf16, the same 2/4/8 bits for keys and values, head_dim 64 or 128 in 1, 2 or 4 groups of a "
                "multiple of 16 channels, no outliers, no exact window, 16-byte aligned pages)");
    TORCH_CHECK(!plan.mma || s.pool.kv_heads * plan.head_chunks <= 65535 && plan.tiles < (int64_t(1) << 31), op,
                ": too many kv heads or query tokens for the tensor-core kernel's grid");
    const at::Tensor scratch = at::empty({std::max<int64_t>(plan.scratch_bytes, 1)}, pages.options());
    const int err =
        cuda::launch_paged_attention<X>(p, plan, scratch.data_ptr<uint8_t>(), status.ptr(), cuda::current_stream());
    TORCH_CHECK(err == 0, op, ": could not launch the kernel (its shared memory or its plan; head_dim ",
                s.pool.layout.head_dim, "): ", cudaGetErrorString(cudaError_t(err)));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const uint32_t bad = status.read();
  if (bad & (cuda::kBadLengths | cuda::kBadBlock)) check_attention_data_host(op, s, qsl, lens, table);
  if ((bad & cuda::kBadSigns) && signs) check_signs_host(op, *signs);
  TORCH_CHECK(!(bad & (cuda::kBadLengths | cuda::kBadBlock | cuda::kBadSigns)), op,
              ": query_start_loc, seq_lens, block_table or rotation_signs changed during the call (the device saw ",
              "invalid values)");
  check_paged_outliers(op, bad & cuda::kBadOutlierIndex);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nexuskv, CUDA, m) {
  m.impl("paged_kv_write_", &paged_kv_write_cuda);
  m.impl("paged_attention", &paged_attention_cuda);
  m.impl("paged_exact_write_", &paged_exact_write_cuda);
}

}  // namespace nexuskv
