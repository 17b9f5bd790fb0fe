// The paged operators as every backend's kernel reads them (the format:
// paged_format.h): quantize-on-write of new tokens into slots, and fused
// attention over a request's pages through its block table.
//
//   out = softmax(softcap(q . K^T * scale) + causal / sliding-window mask) . V
//
// Requests are ragged (vLLM's varlen batch): request r has seq_lens[r] tokens
// in the pool, the last q_len(r) = query_start_loc[r+1] - query_start_loc[r]
// of which are its queries (rows query_start_loc[r] .. of q), causal among
// themselves: decode (q_len 1), prefill and chunked prefill alike.  Every key
// is read from the pages, the queries' own tokens included (they were
// written first), so the output does not depend on how a prompt was cut into
// chunks.  With an exact window W (paged_format.h), the keys and values
// (p - W, p] of the query at position p are read exact instead: from the
// call's own key / value rows when they belong to the chunk attended (rows
// aligned with q's), from the page rings when older, which gives them bit
// for bit whatever the chunking.  Query head hq reads kv head
// hq / (q_heads / kv_heads) (GQA).
//
// Contract (the ATen glue establishes it, csrc/aten/paged_args.h): pointers
// on the kernel's device; q and out rows of head_dim contiguous channels;
// lengths, block ids and slots are the kernels' to check (they read data).
#pragma once

#include <cstdint>

#include "nexuskv/core/hd.h"
#include "nexuskv/core/nq_kernels.h"
#include "nexuskv/core/paged_format.h"

namespace nexuskv::core {

// One layer's pool: pages uint8 [num_blocks, kv_heads, P, C].
struct PagedPool {
  PagedLayout layout;
  int64_t num_blocks = 0;
  int kv_heads = 0;

  NEXUSKV_HD_INLINE int64_t num_slots() const { return num_blocks * layout.block_size; }
  // Byte offset of the head page of (block, kv head).
  NEXUSKV_HD_INLINE int64_t head_page(int64_t block, int h) const {
    return (block * kv_heads + h) * layout.head_page_bytes();
  }
};

// The write: tokens [num_tokens] of key / value [num_tokens, kv_heads, D]
// (token stride given, heads and channels contiguous) go to slot_mapping[t]
// (-1: skipped).  With rotation signs ([D], +-1) each row is
// hadamard_rotate'd and rounded to X first.
template <typename X>
struct PagedWrite {
  PagedPool pool;
  uint8_t* pages = nullptr;
  const X* key = nullptr;                        // [num_tokens, kv_heads, D]
  const X* value = nullptr;                      // [num_tokens, kv_heads, D]
  int64_t key_stride_t = 0, value_stride_t = 0;  // in elements
  const int64_t* slot_mapping = nullptr;         // [num_tokens]
  const float* rotation_signs = nullptr;         // [D] or null
  int64_t num_tokens = 0;
  // least-squares fitted ranges (nq_format.h) instead of min/max, of the keys / values
  bool key_fit_range = false, value_fit_range = false;
};

// The attention problem.
template <typename X>
struct PagedAttention {
  PagedPool pool;
  const uint8_t* pages = nullptr;
  const X* q = nullptr;                    // [num_tokens, q_heads, D]
  int64_t q_stride_t = 0, q_stride_h = 0;  // in elements
  X* out = nullptr;                        // [num_tokens, q_heads, D], contiguous
  int64_t num_tokens = 0;
  int q_heads = 0;
  int64_t num_reqs = 0;
  int64_t max_blocks = 0;                    // columns of block_table
  const int32_t* block_table = nullptr;      // [num_reqs, max_blocks]
  const int32_t* seq_lens = nullptr;         // [num_reqs]
  const int32_t* query_start_loc = nullptr;  // [num_reqs + 1]
  const float* rotation_signs = nullptr;     // [D] or null
  float scale = 1.f;
  int64_t window = 0;   // the query at position p sees keys (p - window, p]; 0: none
  float softcap = 0.f;  // score -> softcap * tanh(score / softcap); 0: none
  // The chunk's own keys and values as the model computed them (rows aligned
  // with q's), read for the exact window (pool.layout.exact_window > 0).
  const X* key = nullptr;                        // [num_tokens, kv_heads, D]
  const X* value = nullptr;                      // [num_tokens, kv_heads, D]
  int64_t key_stride_t = 0, value_stride_t = 0;  // in elements

  NEXUSKV_HD_INLINE int gqa_group() const { return q_heads / pool.kv_heads; }
  NEXUSKV_HD_INLINE int64_t q_begin(int64_t r) const { return query_start_loc[r]; }
  NEXUSKV_HD_INLINE int64_t q_len(int64_t r) const { return query_start_loc[r + 1] - query_start_loc[r]; }
  // Position of query i of request r.
  NEXUSKV_HD_INLINE int64_t query_position(int64_t r, int64_t i) const { return seq_lens[r] - q_len(r) + i; }
  NEXUSKV_HD_INLINE bool visible(int64_t qpos, int64_t kpos) const {
    return kpos <= qpos && (window <= 0 || kpos > qpos - window);
  }
  // Visible and read from the codes: older than the exact window.
  NEXUSKV_HD_INLINE bool visible_coded(int64_t qpos, int64_t kpos) const {
    return visible(qpos, kpos) && kpos <= qpos - pool.layout.exact_window;
  }
  // Visible and read exact: within the exact window.
  NEXUSKV_HD_INLINE bool visible_exact(int64_t qpos, int64_t kpos) const {
    return visible(qpos, kpos) && kpos > qpos - pool.layout.exact_window;
  }
  // Head page of token t of request r (kv head h), as a byte offset into pages.
  NEXUSKV_HD_INLINE int64_t token_page(int64_t r, int64_t t, int h) const {
    return pool.head_page(block_table[r * max_blocks + t / pool.layout.block_size], h);
  }
  // The exact key (value = false) or value row [D] of token t of request r,
  // kv head h, for a token of its queries' exact windows: the call's own row
  // when t is one of the request's queries, else its page's ring row.
  NEXUSKV_HD_INLINE const X* exact_row(const PagedOffsets& o, int64_t r, int64_t t, int h, bool of_value) const {
    const int64_t chunk_start = seq_lens[r] - q_len(r), D = pool.layout.head_dim;
    if (t >= chunk_start) {
      const int64_t row = q_begin(r) + t - chunk_start;
      return (of_value ? value + row * value_stride_t : key + row * key_stride_t) + h * D;
    }
    uint8_t* page = const_cast<uint8_t*>(pages) + token_page(r, t, h);
    return paged_ring_row<X>(o, page, int(t % pool.layout.block_size), int(D), of_value);
  }
};

// ---- CPU kernels (csrc/core/paged_kernels.cpp, paged_attention_kernel.cpp) --

// Writes tokens [begin, end).  Sets status flags on NaN/Inf input or a scale
// that overflows X (the token's slot then holds garbage: the caller raises).
template <typename X>
void paged_write_tokens(const PagedWrite<X>& w, int64_t begin, int64_t end, CompressStatus* status);

// The exact window's write (after the attention of the same tokens): the
// rows of every token of w.key / w.value, as given (w's rotation and fits
// are the codes', not used here), into the rings of their slots for kv heads
// [h_begin, h_end), tokens in order (a later token of the same ring row
// wins).  Slots are the caller's to check.
template <typename X>
void paged_write_exact(const PagedWrite<X>& w, int h_begin, int h_end);

// Queries per attention task: a task is (request, kv head, block of up to
// kPagedQueryBlock queries), so that a long prefill spreads over threads and
// its scratch stays small.
constexpr int64_t kPagedQueryBlock = 16;

// One task of the CPU attention.
struct PagedTask {
  int64_t req;
  int64_t first_query;  // index inside the request
  int64_t queries;      // <= kPagedQueryBlock
};

// Runs task `t` for every kv head in [h_begin, h_end): writes the out rows of
// its queries and the GQA group's q heads (NaN where a score was not finite).
// Returns false if a page held an outlier position outside its group (a
// corrupt page: its rows are NaN; the caller raises).
template <typename X>
bool paged_attention_task(const PagedAttention<X>& p, const PagedTask& t, int h_begin, int h_end);

// How the last attention task multiplied queries by keys: from each key's
// packed 16-code planes widened in registers (the AVX2 kernel, groups of whole
// planes), as integer dot products of int8 query limbs with the packed codes
// (kInteger: the AVX512-VNNI kernel, 2/4/8-bit keys in groups of whole planes:
// paged_int_keys.h) or from the tile's keys widened to float first (every
// other case).
// Noted by every task, so that a test can assert the path it meant to test.
enum class PagedKeyPath : int { kNone = 0, kWidened = 1, kPlanes = 2, kInteger = 3 };
PagedKeyPath last_paged_key_path();
void note_paged_key_path(PagedKeyPath path);

}  // namespace nexuskv::core
