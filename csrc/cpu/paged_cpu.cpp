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

// Every slot is -1 (skip) or inside the pool, and no slot is written twice
// (two tokens of one call racing for one slot would leave a mix of both).
void check_slots(const char* op, const at::Tensor& slots, int64_t num_slots) {
  const int64_t* s = slots.data_ptr<int64_t>();
  std::vector<int64_t> used;
  used.reserve(size_t(slots.numel()));
  for (int64_t t = 0; t < slots.numel(); ++t) {
    TORCH_CHECK(s[t] >= -1 && s[t] < num_slots, op, ": slot_mapping[", t, "] is ", s[t],
                ", outside the pool's slots [0, num_blocks * block_size) = [0, ", num_slots, ") (-1: skip the token)");
    if (s[t] >= 0) used.push_back(s[t]);
  }
  std::sort(used.begin(), used.end());
  const auto dup = std::adjacent_find(used.begin(), used.end());
  TORCH_CHECK(dup == used.end(), op, ": slot_mapping holds slot ", dup == used.end() ? 0 : *dup,
              " twice; each slot can take one token per call");
}

void paged_kv_write_cpu(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits, int64_t group_size,
                        int64_t num_outliers, const std::optional<at::Tensor>& rotation_signs) {
  constexpr const char* op = "paged_kv_write_";
  const PagedWriteShapes s = check_paged_write_args(pages, key, value, slot_mapping, key_bits, value_bits, group_size,
                                                    num_outliers, rotation_signs);
  if (s.num_tokens == 0) return;
  const at::Tensor slots = slot_mapping.contiguous();
  check_slots(op, slots, s.pool.num_slots());
  const std::optional<at::Tensor> signs = float_signs(op, rotation_signs);
  const at::Tensor k = paged_rows(key), v = paged_rows(value);
  core::CompressStatus status;
  std::atomic<bool> non_finite{false}, overflow{false};
  dispatch_core_float(key.scalar_type(), op, [&](auto tag) {
    using X = decltype(tag);
    const core::PagedWrite<X> w = make_paged_write<X>(s, pages, k, v, slots, signs);
    at::parallel_for(0, s.num_tokens, 16, [&](int64_t begin, int64_t end) {
      core::CompressStatus st;
      core::paged_write_tokens(w, begin, end, &st);
      if (st.non_finite_input) non_finite = true;
      if (st.range_overflow || st.meta_overflow) overflow = true;
    });
  });
  TORCH_CHECK(!non_finite, op, ": key or value holds NaN or Inf (in a token with a slot); the slots of such tokens ",
              "now hold garbage: write them again with finite values before attending over them");
  TORCH_CHECK(!overflow, op, ": a group of key or value spans more than ", key.scalar_type(),
              " can hold as a scale (finite values beyond +-1.7e38 in float32, or beyond +-65504 in float16); the ",
              "slots of such tokens now hold garbage");
}

// The data checks of the attention: query_start_loc runs from 0, in order,
// within q; each request has 0 <= q_len <= seq_len <= max_blocks * P; the
// block ids the kernel will read lie in the pool.  Returns the tasks.
std::vector<core::PagedTask> paged_tasks(const char* op, const PagedAttentionShapes& s, const int32_t* qsl,
                                         const int32_t* seq_lens, const int32_t* table) {
  const int64_t P = s.pool.layout.block_size;
  TORCH_CHECK(qsl[0] == 0, op, ": query_start_loc[0] must be 0, got ", qsl[0]);
  std::vector<core::PagedTask> tasks;
  for (int64_t r = 0; r < s.num_reqs; ++r) {
    const int64_t q_len = int64_t(qsl[r + 1]) - qsl[r];
    TORCH_CHECK(q_len >= 0 && qsl[r + 1] <= s.num_tokens, op, ": query_start_loc must be non-decreasing and at most ",
                "q's tokens (", s.num_tokens, "), got query_start_loc[", r, "] = ", qsl[r], ", [", r + 1,
                "] = ", qsl[r + 1]);
    const int64_t len = seq_lens[r];
    TORCH_CHECK(len >= q_len && len <= s.max_blocks * P, op, ": seq_lens[", r, "] = ", len, " must be at least ",
                "the request's queries (", q_len, ") and at most block_table's blocks times block_size (", s.max_blocks,
                " x ", P, ")");
    if (q_len == 0) continue;
    // The blocks read: from the oldest query's window start to the last key.
    int64_t first = 0;
    if (s.window > 0 && len - q_len - s.window + 1 > 0) first = len - q_len - s.window + 1;
    for (int64_t b = first / P; b < (len + P - 1) / P; ++b) {
      const int32_t id = table[r * s.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < s.pool.num_blocks, op, ": block_table[", r, ", ", b, "] = ", id,
                  " is not a block of pages (", s.pool.num_blocks, " blocks), and request ", r, " reads it");
    }
    for (int64_t i = 0; i < q_len; i += core::kPagedQueryBlock)
      tasks.push_back({r, i, std::min<int64_t>(core::kPagedQueryBlock, q_len - i)});
  }
  return tasks;
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& pages, const at::Tensor& block_table,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t key_bits,
                               int64_t value_bits, int64_t group_size, int64_t num_outliers,
                               const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                               std::optional<int64_t> window, std::optional<double> softcap) {
  constexpr const char* op = "paged_attention";
  const PagedAttentionShapes s =
      check_paged_attention_args(q, pages, block_table, seq_lens, query_start_loc, key_bits, value_bits, group_size,
                                 num_outliers, rotation_signs, scale, window, softcap);
  const at::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous(), qsl = query_start_loc.contiguous();
  const std::vector<core::PagedTask> tasks =
      paged_tasks(op, s, qsl.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), table.data_ptr<int32_t>());
  const std::optional<at::Tensor> signs = float_signs(op, rotation_signs);
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  // Zeros: the rows past query_start_loc[-1] (padding) stay zero.
  at::Tensor out = at::zeros(q.sizes(), q.options());
  const int64_t H = s.pool.kv_heads, n = int64_t(tasks.size()) * H;
  std::atomic<bool> corrupt{false};
  dispatch_core_float(q.scalar_type(), op, [&](auto tag) {
    using X = decltype(tag);
    const core::PagedAttention<X> p = make_paged_attention<X>(s, qc, pages, table, lens, qsl, signs, out);
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        if (!core::paged_attention_task(p, tasks[size_t(i / H)], int(i % H), int(i % H) + 1)) corrupt = true;
    });
  });
  TORCH_CHECK(!corrupt, op, ": pages hold an outlier position outside its group: they were not written by ",
              "paged_kv_write_ with this format (key_bits, value_bits, group_size, num_outliers, dtype)");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nexuskv, CPU, m) {
  m.impl("paged_kv_write_", &paged_kv_write_cpu);
  m.impl("paged_attention", &paged_attention_cpu);
}

}  // namespace nexuskv
