// The problem of dgq_fused_attention as every backend's kernel reads it: raw
// pointers, sizes, strides and NEXUSKV_HD accessors, templated on the element
// and metadata types (as FlashInfer's decode params are), so that the CPU
// kernel (csrc/core) and the CUDA kernel (csrc/cuda) instantiate one
// definition of the problem instead of each decoding it from tensors.
//
//   out = softmax(softcap(q . K^T * scale) + causal / sliding-window mask) . V
//
// Key positions of sequence b: sinks [0, S), compressed [S, S + C), tail
// [S + C, S + C + Tt) with S = sink_len(b), C = compressed_len(b),
// Tt = tail_len(b); the q_len queries are the last q_len positions
// (query_position), causal among themselves.  Query head hq reads kv head
// hq / (q_heads / kv_heads) (GQA).
//
// Contract (the ATen glue establishes it, csrc/aten/attention_args.h):
//   - every pointer is on the kernel's device, and nothing here is read on
//     the host: the lengths are device arrays ([B], int32 or int64 as the
//     caller gave them), read by the kernel;
//   - the compressed buffers are contiguous, shaped as in nq_format.h with
//     rows = batch * kv_heads and tokens = the cache's capacity;
//   - full-precision rows (q, sinks, tail) have contiguous channels and any
//     batch / head / token strides;
//   - values the glue cannot check without reading data (lengths within
//     capacity, q_len <= seq_len, signs +-1, outlier positions inside their
//     group, ordered segment starts) are each backend kernel's to check.
//
// Types: T is the element type of q, the sinks and the tail (float, half_t or
// bf16_t of half.h, bit-compatible with c10::Half / c10::BFloat16 and with
// __half / __nv_bfloat16); Meta the type of the scales and zeros of K and V;
// Val the type of their exact outlier values (the dtype that was compressed).
// A backend instantiates only the combinations it needs its own code for and
// converts the rest (the CPU kernel converts q, sinks and tail to float and
// instantiates AttentionParams<float, Meta, Val>).
#pragma once

#include <cstdint>

#include "nexuskv/core/half.h"
#include "nexuskv/core/hd.h"
#include "nexuskv/core/nq_format.h"
#include "nexuskv/core/nq_index.h"
#include "nexuskv/core/nq_layout.h"

namespace nexuskv::core {

// head_dim: a multiple of 16 (whole 16-channel blocks, the packed planes), at most this.
constexpr int64_t kMaxHeadDim = 256;

// Per-sequence lengths [B] on the kernel's device, int32 or int64 as the caller
// gave them (no conversion kernel, no copy); both null: not given.
struct SeqLengths {
  const int32_t* i32 = nullptr;  // [B]
  const int64_t* i64 = nullptr;  // [B]

  NEXUSKV_HD_INLINE bool given() const { return i32 != nullptr || i64 != nullptr; }
  NEXUSKV_HD_INLINE int64_t at(int64_t b) const { return i64 != nullptr ? i64[b] : int64_t(i32[b]); }
};

// Rows of one full-precision tensor [B, H, T, D] with contiguous channels.
template <typename T>
struct DenseRows {
  const T* data = nullptr;                           // [B, H, T, D], channel stride 1
  int64_t stride_b = 0, stride_h = 0, stride_t = 0;  // in elements

  NEXUSKV_HD_INLINE const T* row(int64_t b, int64_t h, int64_t t) const {
    return data + b * stride_b + h * stride_h + t * stride_t;
  }
};

// Optional full-precision keys and values (the sinks or the tail):
// k, v [B, Hkv, capacity, D], of which len(b) rows are valid in sequence b.
template <typename T>
struct DenseKV {
  DenseRows<T> k, v;
  int64_t capacity = 0;  // rows per (b, h)
  SeqLengths lens;       // valid rows per sequence; not given: capacity

  NEXUSKV_HD_INLINE bool present() const { return k.data != nullptr; }
  NEXUSKV_HD_INLINE int64_t len(int64_t b) const { return !present() ? 0 : lens.given() ? lens.at(b) : capacity; }
};

// One compressed K or V cache [B, H, capacity, D] in the NQ format
// (nq_format.h), or DGQ keys when dims.segment_starts is set.
template <typename Meta, typename Val>
struct CompressedKV {
  const uint8_t* codes = nullptr;        // [B, H, capacity, row_bytes]
  const Meta* scale = nullptr;           // [B, H, A, Bm]
  const Meta* zero = nullptr;            // [B, H, A, Bm]
  const uint8_t* outlier_idx = nullptr;  // [B, H, A, Bm, k]
  const Val* outlier_val = nullptr;      // [B, H, A, Bm, k]
  // rows = B * H, tokens = capacity; segment_starts [B * H, A] (DGQ) or null.
  NQDims dims;

  NEXUSKV_HD_INLINE bool per_channel() const { return dims.axis == GroupAxis::kTokens; }
  NEXUSKV_HD_INLINE int64_t row_bytes() const { return dims.packed_row_bytes(); }
  NEXUSKV_HD_INLINE int num_outliers() const { return dims.num_outliers; }

  // Packed codes of token t of row bh = b * H + h.
  NEXUSKV_HD_INLINE const uint8_t* code_row(int64_t bh, int64_t t) const {
    return codes + (bh * dims.tokens + t) * dims.packed_row_bytes();
  }
  NEXUSKV_HD_INLINE uint32_t code(int64_t bh, int64_t t, int64_t c) const {
    return layout::code_at(code_row(bh, t), dims.bits, c);
  }

  // Token group a holding token t: per-channel groups of group_size tokens or
  // DGQ segments (binary search over the row's starts); per-token groups: t.
  NEXUSKV_HD_INLINE int64_t token_group(int64_t bh, int64_t t) const {
    if (!per_channel()) return t;
    if (dims.segment_starts == nullptr) return t / dims.group_size;
    return find_segment(dims.segment_starts + bh * dims.meta_a(), dims.meta_a(), t);
  }
  // Tokens [group_begin, group_end) of token group a of row bh.
  NEXUSKV_HD_INLINE int64_t group_begin(int64_t bh, int64_t a) const {
    return per_channel() ? dims.group_start(bh, a) : a;
  }
  NEXUSKV_HD_INLINE int64_t group_end(int64_t bh, int64_t a) const {
    return per_channel() ? dims.group_end(bh, a) : a + 1;
  }
  // Channel group of channel c: c for per-channel groups, c / group_size per token.
  NEXUSKV_HD_INLINE int64_t channel_group(int64_t c) const { return layout::group_b(dims, c); }

  // Index of the scale / zero (and of the outlier slots / k) of group (a, b) of row bh.
  NEXUSKV_HD_INLINE int64_t meta_index(int64_t bh, int64_t a, int64_t b) const {
    return layout::meta_index(dims, bh, a, b);
  }
  NEXUSKV_HD_INLINE float scale_at(int64_t m) const { return to_float(scale[m]); }
  NEXUSKV_HD_INLINE float zero_at(int64_t m) const { return to_float(zero[m]); }

  // Outlier slot s of group m: its position inside the group (token offset
  // from group_begin per channel, channel offset from b * group_size per
  // token) and its exact value.  A group with fewer entries than slots
  // repeats its last slot (nq_format.h): apply a correction once per position.
  NEXUSKV_HD_INLINE int64_t outlier_pos(int64_t m, int s) const { return outlier_idx[m * dims.num_outliers + s]; }
  NEXUSKV_HD_INLINE float outlier_value(int64_t m, int s) const {
    return to_float(outlier_val[m * dims.num_outliers + s]);
  }
  NEXUSKV_HD_INLINE bool repeated_slot(int64_t m, int s) const {
    return s > 0 && outlier_pos(m, s) == outlier_pos(m, s - 1);
  }
};

template <typename T, typename Meta, typename Val = T>
struct AttentionParams {
  using Element = T;
  using MetaType = Meta;
  using ValueType = Val;

  int64_t batch = 0, q_heads = 0, kv_heads = 0, q_len = 0, head_dim = 0;
  DenseRows<T> q;                // [B, Hq, Lq, D]
  CompressedKV<Meta, Val> k, v;  // [B, Hkv, capacity, D] each (capacities may differ)
  SeqLengths compressed_lens;    // [B] valid compressed tokens per sequence (always given)
  DenseKV<T> sink;               // optional [B, Hkv, sink_capacity, D]: positions before the compressed ones
  DenseKV<T> tail;               // optional [B, Hkv, tail_capacity, D]: positions after them
  const float* rotation_signs =
      nullptr;        // [D] +-1: K and V are stored hadamard_rotate'd (sinks, tail are not), or null
  float scale = 1.f;  // applied to q . k before the soft-cap
  // Sliding window: the query at position p sees keys (p - window, p] (0: no window).
  int64_t window = 0;
  // Logit soft-capping (Gemma 2): score -> softcap * tanh(score / softcap)
  // after the scale, before the mask (0: none).
  float softcap = 0.f;
  // Significand bits of the caller's queries (8 bf16, 11 fp16, 24 fp32), kept
  // when a backend converts q: the CPU integer key path sizes its limbs by it.
  int query_mantissa_bits = 24;

  NEXUSKV_HD_INLINE int64_t gqa_group() const { return q_heads / kv_heads; }
  // Query rows that share one kv head: (q head in the group, query) = (r / q_len, r % q_len).
  NEXUSKV_HD_INLINE int64_t rows_per_kv_head() const { return gqa_group() * q_len; }
  NEXUSKV_HD_INLINE int64_t q_head(int64_t h, int64_t r) const { return h * gqa_group() + r / q_len; }
  NEXUSKV_HD_INLINE const T* q_row(int64_t b, int64_t h, int64_t r) const { return q.row(b, q_head(h, r), r % q_len); }

  NEXUSKV_HD_INLINE int64_t sink_len(int64_t b) const { return sink.len(b); }
  NEXUSKV_HD_INLINE int64_t compressed_len(int64_t b) const { return compressed_lens.at(b); }
  NEXUSKV_HD_INLINE int64_t tail_len(int64_t b) const { return tail.len(b); }
  NEXUSKV_HD_INLINE int64_t seq_len(int64_t b) const { return sink_len(b) + compressed_len(b) + tail_len(b); }
  // Position of query i (0 <= i < q_len) of sequence b.
  NEXUSKV_HD_INLINE int64_t query_position(int64_t b, int64_t i) const { return seq_len(b) - q_len + i; }
  // First key position any query of sequence b sees (the oldest query's window start).
  NEXUSKV_HD_INLINE int64_t first_visible(int64_t b) const {
    const int64_t first = seq_len(b) - q_len - window + 1;
    return window > 0 && first > 0 ? first : 0;
  }
  // Whether the query at position qpos sees the key at position kpos.
  NEXUSKV_HD_INLINE bool visible(int64_t qpos, int64_t kpos) const {
    return kpos <= qpos && (window <= 0 || kpos > qpos - window);
  }
};

}  // namespace nexuskv::core
