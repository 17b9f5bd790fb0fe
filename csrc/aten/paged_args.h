// Argument checks of the paged operators (paged_kv_write_, paged_attention),
// shared by every backend and the meta kernels: sizes, dtypes and devices
// only, no tensor data (the format: nexuskv/core/paged_format.h).  What needs
// the data (slots in range and distinct, query_start_loc ordered, lengths
// within the block table, block ids in the pool, signs +-1) is each backend
// kernel's to check.  make_paged_* then point the core problem structs into
// the tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "core_dispatch.h"
#include "nexuskv/core/paged.h"

namespace nexuskv {

// The format of a pool of head_dim D, block_size P and dtype x: checks every
// parameter on its int64 value.
core::PagedLayout paged_layout(const char* op, int64_t head_dim, int64_t block_size, int64_t key_bits,
                               int64_t value_bits, int64_t group_size, int64_t num_outliers, at::ScalarType dtype,
                               int64_t exact_window);

// The kernel of the operator paged_slot_bytes: C of paged_format.h (block_size
// matters only with an exact window; 0: none given).
int64_t paged_slot_bytes_kernel(int64_t head_dim, int64_t key_bits, int64_t value_bits, int64_t group_size,
                                int64_t num_outliers, at::ScalarType dtype, int64_t exact_window, int64_t block_size);

struct PagedWriteShapes {
  core::PagedPool pool;
  int64_t num_tokens = 0;
};
// op: paged_kv_write_ or paged_exact_write_ (which takes no rotation_signs).
PagedWriteShapes check_paged_write_args(const char* op, const at::Tensor& pages, const at::Tensor& key,
                                        const at::Tensor& value, const at::Tensor& slot_mapping, int64_t key_bits,
                                        int64_t value_bits, int64_t group_size, int64_t num_outliers,
                                        const std::optional<at::Tensor>& rotation_signs, int64_t exact_window);
// paged_exact_write_'s: the write's checks (no rotation_signs) and pages with rings (exact_window > 0).
PagedWriteShapes check_paged_exact_write_args(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                                              const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits,
                                              int64_t group_size, int64_t num_outliers, int64_t exact_window);

struct PagedAttentionShapes {
  core::PagedPool pool;
  int64_t num_tokens = 0, q_heads = 0, num_reqs = 0, max_blocks = 0;
  float scale = 1.f;
  int64_t window = 0;
  float softcap = 0.f;
};
PagedAttentionShapes check_paged_attention_args(
    const at::Tensor& q, const at::Tensor& pages, const at::Tensor& block_table, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, int64_t key_bits, int64_t value_bits, int64_t group_size, int64_t num_outliers,
    const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale, std::optional<int64_t> window,
    std::optional<double> softcap, int64_t exact_window, const std::optional<at::Tensor>& key,
    const std::optional<at::Tensor>& value);

// key / value as the write reads them: heads and channels contiguous (a copy
// only when they are not), any token stride.
at::Tensor paged_rows(const at::Tensor& t);

template <typename X>
core::PagedWrite<X> make_paged_write(const PagedWriteShapes& s, const at::Tensor& pages, const at::Tensor& key,
                                     const at::Tensor& value, const at::Tensor& slot_mapping,
                                     const std::optional<at::Tensor>& signs, bool key_fit_range, bool value_fit_range) {
  core::PagedWrite<X> w;
  w.pool = s.pool;
  w.pages = pages.data_ptr<uint8_t>();
  w.key = core_ptr<const X>(key);
  w.value = core_ptr<const X>(value);
  w.key_stride_t = key.stride(0);
  w.value_stride_t = value.stride(0);
  w.slot_mapping = slot_mapping.data_ptr<int64_t>();
  w.rotation_signs = signs ? signs->data_ptr<float>() : nullptr;
  w.num_tokens = s.num_tokens;
  w.key_fit_range = key_fit_range, w.value_fit_range = value_fit_range;
  return w;
}

// key / value: paged_rows of the call's key and value (exact window), or undefined.
template <typename X>
core::PagedAttention<X> make_paged_attention(const PagedAttentionShapes& s, const at::Tensor& q,
                                             const at::Tensor& pages, const at::Tensor& block_table,
                                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                             const std::optional<at::Tensor>& signs, const at::Tensor& out,
                                             const at::Tensor& key = {}, const at::Tensor& value = {}) {
  core::PagedAttention<X> p;
  p.pool = s.pool;
  p.pages = pages.data_ptr<uint8_t>();
  p.q = core_ptr<const X>(q);
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.out = core_ptr<X>(out);
  p.num_tokens = s.num_tokens;
  p.q_heads = int(s.q_heads);
  p.num_reqs = s.num_reqs;
  p.max_blocks = s.max_blocks;
  p.block_table = block_table.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.rotation_signs = signs ? signs->data_ptr<float>() : nullptr;
  p.scale = s.scale;
  p.window = s.window;
  p.softcap = s.softcap;
  if (key.defined()) {
    p.key = core_ptr<const X>(key);
    p.value = core_ptr<const X>(value);
    p.key_stride_t = key.stride(0);
    p.value_stride_t = value.stride(0);
  }
  return p;
}

}  // namespace nexuskv
