// The checks of the CPU kernels that read tensor data (the shared glue,
// csrc/aten, reads sizes and dtypes only): lengths within capacity, q_len
// within every sequence, rotation signs +-1, DGQ segment starts, and outlier
// positions inside their groups.  The same messages as the operators always
// gave; a CUDA kernel checks the same on the device.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <functional>

#include "../aten/nq_args.h"
#include "../aten/paged_args.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/nq_kernels.h"

namespace nexuskv {

// signs (CPU, float32, contiguous) are all +1 or -1.
void check_rotation_sign_values(const char* op, const at::Tensor& signs);

// starts [rows, S] (d.meta_a() = S per row): ordered segments of [0, d.tokens]
// starting at 0, each spanning at most kMaxGroupSize of the row's valid tokens
// (valid_tokens(row); all d.tokens when not given).
void check_segment_starts(const char* op, const char* what, const core::NQDims& d, const int32_t* starts,
                          const std::function<int64_t(int64_t)>& valid_tokens = nullptr);

// lens[b] in [0, limit] for every b < batch.
void check_lengths_within(const char* op, const char* name, const core::SeqLengths& lens, int64_t batch, int64_t limit,
                          const char* limit_what);

// The value checks of one compressed cache of fused attention: DGQ segment
// starts, and the outlier positions of every group holding one of the
// compressed_len(b) valid tokens of its row (the groups attention reads; the
// capacity past them may hold anything).
template <typename Meta, typename Val>
void check_cache_values(const char* op, const char* what, const core::CompressedKV<Meta, Val>& c,
                        const core::SeqLengths& compressed_lens, int64_t batch, int64_t heads) {
  if (c.dims.segment_starts)
    check_segment_starts(op, what, c.dims, c.dims.segment_starts,
                         [&](int64_t row) { return compressed_lens.at(row / heads); });
  if (c.num_outliers() == 0) return;
  const int64_t A = c.dims.meta_a(), Bm = c.dims.meta_b();
  bool ok = true;
  for (int64_t bh = 0; bh < batch * heads; ++bh) {
    const int64_t len = compressed_lens.at(bh / heads);
    const int64_t groups = len == 0 ? 0 : c.token_group(bh, len - 1) + 1;  // token groups (or tokens) read
    ok &= core::nq_outlier_positions_valid(c.dims, c.outlier_idx, bh * A * Bm, (bh * A + groups) * Bm);
  }
  nq_check_outlier_positions(op, what, ok, c.dims.group_size, c.dims.segment_starts != nullptr);
}

// Every value check of a CPU fused-attention problem.
template <typename Meta, typename Val>
void check_attention_values(const char* op, const core::CpuAttentionParams<Meta, Val>& p) {
  const int64_t capacity = std::min(p.k.dims.tokens, p.v.dims.tokens);
  check_lengths_within(op, "compressed_lens", p.compressed_lens, p.batch, capacity,
                       "tokens held by k_cache and v_cache");
  if (p.tail.lens.given())
    check_lengths_within(op, "tail_lens", p.tail.lens, p.batch, p.tail.capacity, "tokens held by k_tail");
  if (p.sink.lens.given())
    check_lengths_within(op, "sink_lens", p.sink.lens, p.batch, p.sink.capacity, "tokens held by k_sink");
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t L = p.seq_len(b);
    TORCH_CHECK(L == 0 || L >= p.q_len, op, ": q_len (", p.q_len, ") exceeds the length of sequence ", b, " (", L,
                " tokens); the queries are the last q_len positions of their sequence");
  }
  check_cache_values(op, "k_cache", p.k, p.compressed_lens, p.batch, p.kv_heads);
  check_cache_values(op, "v_cache", p.v, p.compressed_lens, p.batch, p.kv_heads);
}

// ---- paged operators (also the CUDA glue's, on host copies, in check mode) ----

// slots[0..n) are -1 (skip) or inside the pool, and none is there twice.
void check_paged_slots(const char* op, const int64_t* slots, int64_t n, int64_t num_slots);

// The errors of a write whose compressor saw NaN/Inf (non_finite) or a scale
// overflowing the dtype (overflow).
void check_paged_write_status(const char* op, at::ScalarType dtype, bool non_finite, bool overflow);

// query_start_loc runs from 0, in order, within q; each request has
// 0 <= q_len <= seq_len <= max_blocks * P; the block ids the attention reads
// (from the oldest query's window start to the last key) lie in the pool.
void check_paged_requests(const char* op, const PagedAttentionShapes& s, const int32_t* query_start_loc,
                          const int32_t* seq_lens, const int32_t* block_table);

// The error of an attention that met an outlier position outside its group.
void check_paged_outliers(const char* op, bool corrupt);

}  // namespace nexuskv
