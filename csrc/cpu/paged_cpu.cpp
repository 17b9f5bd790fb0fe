// CPU kernels of the paged operators: the shared checks (csrc/aten/paged_args.h),
// the checks that read data (slots, query_start_loc, lengths, block ids,
// signs), then the torch-free core (csrc/core/paged_kernels.cpp) under
// at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "../aten/paged_args.h"
#include "value_checks.h"

namespace nexuskv {
namespace {

std::optional<at::Tensor> float_signs(const char* op, const std::optional<at::Tensor>& signs) {
  if (!signs) return std::nullopt;
  at::Tensor s = signs->to(at::kFloat).contiguous();
  check_rotation_sign_values(op, s);
  return s;
}

void paged_kv_write_cpu(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits, int64_t group_size,
                        int64_t num_outliers, const std::optional<at::Tensor>& rotation_signs, bool key_fit_range,
                        bool value_fit_range, int64_t exact_window) {
  constexpr const char* op = "paged_kv_write_";
  const PagedWriteShapes s = check_paged_write_args(op, pages, key, value, slot_mapping, key_bits, value_bits,
                                                    group_size, num_outliers, rotation_signs, exact_window);
  if (s.num_tokens == 0) return;
  const at::Tensor slots = slot_mapping.contiguous();
  check_paged_slots(op, slots.data_ptr<int64_t>(), slots.numel(), s.pool.num_slots());
  const std::optional<at::Tensor> signs = float_signs(op, rotation_signs);
  const at::Tensor k = paged_rows(key), v = paged_rows(value);
  core::CompressStatus status;
  std::atomic<bool> non_finite{false}, overflow{false};
  dispatch_core_float(key.scalar_type(), op, [&](auto tag) {
    using X = decltype(tag);
    const core::PagedWrite<X> w = make_paged_write<X>(s, pages, k, v, slots, signs, key_fit_range, value_fit_range);
    at::parallel_for(0, s.num_tokens, 16, [&](int64_t begin, int64_t end) {
      core::CompressStatus st;
      core::paged_write_tokens(w, begin, end, &st);
      if (st.non_finite_input) non_finite = true;
      if (st.range_overflow || st.meta_overflow) overflow = true;
    });
  });
  check_paged_write_status(op, key.scalar_type(), non_finite, overflow);
}

// The exact window's rings: every kv head's rows in token order.
void paged_exact_write_cpu(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits, int64_t group_size,
                           int64_t num_outliers, int64_t exact_window) {
  constexpr const char* op = "paged_exact_write_";
  const PagedWriteShapes s = check_paged_exact_write_args(pages, key, value, slot_mapping, key_bits, value_bits,
                                                          group_size, num_outliers, exact_window);
  if (s.num_tokens == 0) return;
  const at::Tensor slots = slot_mapping.contiguous();
  check_paged_slots(op, slots.data_ptr<int64_t>(), slots.numel(), s.pool.num_slots());
  const at::Tensor k = paged_rows(key), v = paged_rows(value);
  dispatch_core_float(key.scalar_type(), op, [&](auto tag) {
    using X = decltype(tag);
    const core::PagedWrite<X> w = make_paged_write<X>(s, pages, k, v, slots, std::nullopt, false, false);
    at::parallel_for(0, s.pool.kv_heads, 1,
                     [&](int64_t begin, int64_t end) { core::paged_write_exact(w, int(begin), int(end)); });
  });
}

// The attention's tasks (after its data checks): (request, block of queries),
// the most work first (queries x keys they see): the threads take them in that
// order (below), so that the long ones do not come last.  Why: in a causal
// prefill a block's keys grow with its position, and at::parallel_for's even
// contiguous split gave one of two threads three quarters of the work.
std::vector<core::PagedTask> paged_tasks(const char* op, const PagedAttentionShapes& s, const int32_t* qsl,
                                         const int32_t* seq_lens, const int32_t* table, int64_t window) {
  check_paged_requests(op, s, qsl, seq_lens, table);
  std::vector<core::PagedTask> tasks;
  std::vector<int64_t> work;
  for (int64_t r = 0; r < s.num_reqs; ++r) {
    const int64_t queries = int64_t(qsl[r + 1]) - qsl[r];
    for (int64_t i = 0; i < queries; i += core::kPagedQueryBlock) {
      const int64_t n = std::min<int64_t>(core::kPagedQueryBlock, queries - i);
      const int64_t first = seq_lens[r] - queries + i, key_end = first + n;  // positions (PagedAttention's)
      const int64_t key_begin = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
      tasks.push_back({r, i, n});
      work.push_back(n * (key_end - key_begin));
    }
  }
  std::vector<size_t> order(tasks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return work[a] > work[b]; });
  std::vector<core::PagedTask> sorted;
  sorted.reserve(tasks.size());
  for (size_t i : order) sorted.push_back(tasks[i]);
  return sorted;
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& pages, const at::Tensor& block_table,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t key_bits,
                               int64_t value_bits, int64_t group_size, int64_t num_outliers,
                               const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                               std::optional<int64_t> window, std::optional<double> softcap, int64_t exact_window,
                               const std::optional<at::Tensor>& key, const std::optional<at::Tensor>& value) {
  constexpr const char* op = "paged_attention";
  const PagedAttentionShapes s =
      check_paged_attention_args(q, pages, block_table, seq_lens, query_start_loc, key_bits, value_bits, group_size,
                                 num_outliers, rotation_signs, scale, window, softcap, exact_window, key, value);
  const at::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous(), qsl = query_start_loc.contiguous();
  const std::vector<core::PagedTask> tasks =
      paged_tasks(op, s, qsl.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), table.data_ptr<int32_t>(), s.window);
  const std::optional<at::Tensor> signs = float_signs(op, rotation_signs);
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  const at::Tensor kx = key ? paged_rows(*key) : at::Tensor(), vx = value ? paged_rows(*value) : at::Tensor();
  // The tasks write every row of the requests' queries; the rows past
  // query_start_loc[-1] (padding) are zeroed here.
  at::Tensor out = at::empty(q.sizes(), q.options());
  out.narrow(0, qsl.data_ptr<int32_t>()[s.num_reqs], s.num_tokens - qsl.data_ptr<int32_t>()[s.num_reqs]).zero_();
  const int64_t H = s.pool.kv_heads, n = int64_t(tasks.size()) * H;
  std::atomic<bool> corrupt{false};
  dispatch_core_float(q.scalar_type(), op, [&](auto tag) {
    using X = decltype(tag);
    const core::PagedAttention<X> p = make_paged_attention<X>(s, qc, pages, table, lens, qsl, signs, out, kx, vx);
    // Each thread takes the next (task, kv head) until none is left (at::parallel_for
    // alone would hand each thread one contiguous range, whatever its work).
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      for (int64_t i = next++; i < n; i = next++)
        if (!core::paged_attention_task(p, tasks[size_t(i / H)], int(i % H), int(i % H) + 1)) corrupt = true;
    });
  });
  check_paged_outliers(op, corrupt);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nexuskv, CPU, m) {
  m.impl("paged_kv_write_", &paged_kv_write_cpu);
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("paged_exact_write_", &paged_exact_write_cpu);
}

}  // namespace nexuskv
