// Torch-free fused attention over the compressed cache (NQ / DGQ format,
// nq_format.h) plus full-precision sink tokens (the first of each sequence)
// and a full-precision tail of the newest tokens.  Key positions of sequence
// b: sinks [0, S), compressed [S, S + C), tail [S + C, S + C + T).
//
//   out = softmax(softcap(q . K^T * scale) + causal / sliding-window mask) . V
//
// computed tile by tile (kTileTokens keys at a time, dequantized into a small
// float scratch that stays in L1/L2), with an online softmax in float32.  No
// buffer the size of the cache is ever allocated.  Work is split into tasks
// (batch, kv head, split of the key range); each task writes a partial
// (acc, max, sum) per query row, and attention_merge combines the splits with
// a log-sum-exp merge.  All query heads of a GQA group share every K/V tile.
#pragma once

#include <cstdint>

#include "nexuskv/core/nq_format.h"

namespace nexuskv::core {

constexpr int64_t kTileTokens = 32;
constexpr int64_t kMaxHeadDim = 256;

// One compressed K or V cache of shape [B, H, capacity, D] as the kernel reads it.
struct CompressedView {
  const uint8_t* codes = nullptr;          // [B, H, capacity, row_bytes]
  const void* scale = nullptr;             // [B, H, A, B_meta]  meta_dtype
  const void* zero = nullptr;              // [B, H, A, B_meta]  meta_dtype
  const uint8_t* outlier_idx = nullptr;    // [B, H, A, B_meta, k]
  const void* outlier_val = nullptr;       // [B, H, A, B_meta, k]  val_dtype
  const int32_t* segment_starts = nullptr; // [B, H, A] (DGQ keys) or null: fixed groups
  DType meta_dtype = DType::kFloat32;
  DType val_dtype = DType::kFloat32;
  NQDims dims;                             // rows = B*H, tokens = capacity
  int64_t meta_a = 0;                      // A: token groups / segments / tokens
};

struct AttentionProblem {
  int64_t batch = 0, q_heads = 0, kv_heads = 0, q_len = 0, head_dim = 0;
  const float* q = nullptr;               // [B, Hq, Lq, D] float32, contiguous
  CompressedView k, v;
  const int64_t* compressed_lens = nullptr;  // [B] valid compressed tokens per sequence
  const float* k_tail = nullptr;          // [B, Hkv, tail_capacity, D] float32 or null
  const float* v_tail = nullptr;          // [B, Hkv, tail_capacity, D] float32 or null
  int64_t tail_capacity = 0;
  const int64_t* tail_lens = nullptr;     // [B] valid tail tokens per sequence, or null
  const float* k_sink = nullptr;          // [B, Hkv, sink_capacity, D] float32 or null
  const float* v_sink = nullptr;          // [B, Hkv, sink_capacity, D] float32 or null
  int64_t sink_capacity = 0;
  const int64_t* sink_lens = nullptr;     // [B] valid sink tokens per sequence, or null
  const float* rotation_signs = nullptr;  // [D] +-1: the cache is stored rotated, or null
  float scale = 1.f;
  // Sliding window: query position p sees key positions (p - window, p]
  // (0: no window).  Positions count sinks, compressed and tail tokens.
  int64_t window = 0;
  // Logit soft-capping (Gemma 2): score -> softcap * tanh(score / softcap)
  // after the scale, before the mask (0: none).
  float softcap = 0.f;
  // Significand bits of the caller's queries (8: bf16, 11: fp16, 24: fp32);
  // the integer key scores carry q to at least 8 bits more (attention_int_keys.h).
  int query_mantissa_bits = 24;

  int64_t rows_per_task() const { return (q_heads / kv_heads) * q_len; }
  int64_t tail_len(int64_t b) const { return k_tail ? (tail_lens ? tail_lens[b] : tail_capacity) : 0; }
  int64_t sink_len(int64_t b) const { return k_sink ? (sink_lens ? sink_lens[b] : sink_capacity) : 0; }
  int64_t seq_len(int64_t b) const { return sink_len(b) + compressed_lens[b] + tail_len(b); }
  // First key position any query of sequence b can see (the window's start for the oldest query).
  int64_t first_visible(int64_t b) const {
    const int64_t first = seq_len(b) - q_len - window + 1;
    return window > 0 && first > 0 ? first : 0;
  }
};

// Floats of one task's partial result: per query row, acc[D] then max, sum.
inline int64_t partial_floats(const AttentionProblem& p) { return p.rows_per_task() * (p.head_dim + 2); }

// Splits of the key range per (batch, kv head) so that about `min_tasks`
// tasks exist, never a split shorter than a few tiles.
int64_t attention_num_splits(const AttentionProblem& p, int64_t min_tasks);

// Runs tasks [begin, end) of B * Hkv * splits; task (b, h, s) writes
// partials[task * partial_floats(p) ...].
void attention_tasks(const AttentionProblem& p, int64_t splits, float* partials, int64_t begin, int64_t end);

// Combines the splits of (b, h) pairs [begin, end) and writes
// out [B, Hq, Lq, D] (float32), undoing the rotation.  A sequence of length
// 0 gives zeros; a row that met a NaN/Inf score (NaN/Inf in q or the tail) gives NaN.
void attention_merge(const AttentionProblem& p, int64_t splits, const float* partials, float* out,
                     int64_t begin, int64_t end);

// Which instruction set attention_tasks uses on this CPU ("avx512", "avx2",
// "generic"): cpu_isa() of nexuskv/core/cpu_isa.h.
const char* attention_isa();

// Randomized Hadamard rotation of rows of length n (a power of two):
// y = H (signs * x) / sqrt(n); inverse: x = signs * H y / sqrt(n).
void hadamard_rotate_rows(const float* x, float* y, int64_t rows, int64_t n, const float* signs, bool inverse);

}  // namespace nexuskv::core
