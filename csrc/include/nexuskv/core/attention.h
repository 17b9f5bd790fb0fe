// The CPU kernel of fused attention over the compressed cache (the problem:
// attention_params.h; the format: nq_format.h).
//
//   out = softmax(softcap(q . K^T * scale) + causal / sliding-window mask) . V
//
// computed tile by tile (kTileTokens keys at a time, dequantized into a small
// float scratch that stays in L1/L2), with an online softmax in float32.  No
// buffer the size of the cache is ever allocated.  Work is split into tasks
// (batch, kv head, split of the key range); each task writes a partial
// (acc, max, sum) per query row, and attention_merge combines the splits with
// a log-sum-exp merge.  All query heads of a GQA group share every K/V tile.
//
// The CPU kernel reads q, the sinks and the tail as float32 (csrc/cpu converts
// them) with rows of head_dim consecutive floats (stride_t == head_dim), and
// is instantiated for every (Meta, Val) pair of the three float types.
#pragma once

#include <cstdint>

#include "nexuskv/core/attention_params.h"

namespace nexuskv::core {

constexpr int64_t kTileTokens = 32;

template <typename Meta, typename Val>
using CpuAttentionParams = AttentionParams<float, Meta, Val>;

// Floats of one task's partial result: per query row, acc[D] then max, sum.
template <typename Meta, typename Val>
static inline int64_t partial_floats(const CpuAttentionParams<Meta, Val>& p) {
  return p.rows_per_kv_head() * (p.head_dim + 2);
}

// Splits of the key range per (batch, kv head) so that about `min_tasks`
// tasks exist, never a split shorter than a few tiles.
template <typename Meta, typename Val>
int64_t attention_num_splits(const CpuAttentionParams<Meta, Val>& p, int64_t min_tasks);

// Runs tasks [begin, end) of B * Hkv * splits; task (b, h, s) writes
// partials[task * partial_floats(p) ...].  The kernel of the ISA chosen at run
// time (nexuskv/core/cpu_isa.h).
template <typename Meta, typename Val>
void attention_tasks(const CpuAttentionParams<Meta, Val>& p, int64_t splits, float* partials, int64_t begin,
                     int64_t end);

// Combines the splits of (b, h) pairs [begin, end) and writes
// out [B, Hq, Lq, D] (float32, contiguous), undoing the rotation.  A sequence
// of length 0 gives zeros; a row that met a NaN/Inf score (NaN/Inf in q or the
// tail) gives NaN.
template <typename Meta, typename Val>
void attention_merge(const CpuAttentionParams<Meta, Val>& p, int64_t splits, const float* partials, float* out,
                     int64_t begin, int64_t end);

// Which instruction set attention_tasks uses on this CPU ("avx512", "avx2",
// "generic"): cpu_isa() of nexuskv/core/cpu_isa.h.
const char* attention_isa();

// How the last attention task multiplied the softmax weights by values grouped
// per token (their scales folded into the weights): integer dot products on
// the packed codes (AVX512-VNNI, 2/4/8 bits: attention_int_values.h) or float
// FMAs on codes widened to float.  kNone: the values were grouped otherwise.
// Likewise the queries by keys grouped per channel (their scales folded into
// the queries): integer dot products with int8 (AVX512-VNNI:
// attention_int_keys.h) or int16 limbs (AVX2: attention_int_keys_avx2.h), or
// float FMAs.  Noted by every task, so that a test can assert the path it
// meant to test.
enum class ValueProduct : int { kNone = 0, kFloat = 1, kInteger = 2 };
ValueProduct last_value_product();
void note_value_product(ValueProduct path);
ValueProduct last_key_product();
void note_key_product(ValueProduct path);

// Randomized Hadamard rotation of rows of length n (a power of two):
// y = H (signs * x) / sqrt(n); inverse: x = signs * H y / sqrt(n).  Finite
// whenever sqrt(n) * max|x| is (a row near FLT_MAX is scaled before the
// butterflies instead of after).
void hadamard_rotate_rows(const float* x, float* y, int64_t rows, int64_t n, const float* signs, bool inverse);

}  // namespace nexuskv::core
