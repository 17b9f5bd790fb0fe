// nexuskv paged KV format (version 2): the one place it is documented.  A
// serving engine (vLLM, later DeepSpeed-FastGen) owns a pool of fixed-size
// blocks and gives every request a block table; nexuskv stores K and V of
// one attention layer compressed inside those blocks.
//
// The pool of one layer is one uint8 tensor
//
//   pages  uint8 [num_blocks, kv_heads, P, C]      P = block_size tokens
//
// i.e. vLLM's per-layer cache shape with C bytes per (token, kv head) slot
// (vLLM sizes it from the backend's per-slot bytes, C below).  The bytes of
// one (block, kv head) pair, P * C of them, are a "head page": the NQ buffers
// (nq_format.h) of that head's P tokens of keys, then of values, each
// quantized PER TOKEN (GroupAxis::kChannels: groups of G consecutive channels
// of one token, Bg = ceil(D / G) groups per token), laid out structure of
// arrays:
//
//   offset                      buffer        type   shape
//   0                           key codes     uint8  [P, row_bytes(key_bits, D)]
//   + P*krb                     value codes   uint8  [P, row_bytes(value_bits, D)]
//   + P*vrb                     key scale     x      [P, Bg]
//                               key zero      x      [P, Bg]
//                               value scale   x      [P, Bg]
//                               value zero    x      [P, Bg]
//                               key outlier values    x      [P, Bg, k]
//                               value outlier values  x      [P, Bg, k]
//                               key outlier idx       uint8  [P, Bg, k]
//                               value outlier idx     uint8  [P, Bg, k]
//
//   + P*(C - E)                 key ring      x      [W, D]     (exact window, version 2)
//                               value ring    x      [W, D]
//
// where x is the dtype of the keys and values written (float32, float16 or
// bfloat16: the scales, zeros and outlier values are stored in it), k the
// exact outliers per group and W the exact window (0 <= W <= P; 0: no ring,
// the version-1 layout byte for byte).
//
// The exact window (version 2): every head page also keeps its W newest
// tokens as written, unquantized, in a ring: token `offset` of the block in
// ring row offset % W (so a full block's ring holds its last W tokens).  A
// query at position p attends over keys and values (p - W, p] exact and over
// the codes of the older ones: its newest W tokens lie in its own block and
// the previous one, and every one of them is either in the chunk being
// attended (read from the call's own key / value) or older, hence in a ring
// (a ring row is overwritten only by a token W positions later).  That is why
// the ring is written AFTER the attention of the chunk (paged_exact_write_):
// a chunk's tokens would overwrite ring rows that its own first queries still
// read.  Nothing is per request: a shared (prefix-cached) full block holds the
// same ring for every request, and the output does not depend on where a
// prompt is cut into chunks.  A token written twice at the same position
// (speculative decoding's rejected tokens) is not supported: a rejected token
// overwrites the ring row of the token W positions before it.  Slot s of the pool (vLLM's slot_mapping) is
// token s % P of block s / P.  Every buffer of a slot is a row of the NQ
// buffers above, so a token is quantized exactly as
// nq_compress(x[t], bits, G, axis=-1, num_outliers=k) quantizes it (same
// codes, scales, zeros and outliers, bit for bit), whatever the batch it was
// written in: the pages do not depend on how a prompt was split into chunks.
// With rotation signs, the rows written are hadamard_rotate(x, signs) rounded
// to x's dtype (the attention rotates q and un-rotates its output).
//
// Alignment: P must be a multiple of 16, so that every buffer starts at a
// multiple of 16 bytes from the head page (code rows are whole 16- or 24-byte
// chunks, and P * anything is a multiple of 16); torch allocates the pool
// 64-byte aligned, and head pages are P * C bytes apart.
//
// Bytes per slot:
//   C = row_bytes(key_bits, D) + row_bytes(value_bits, D) + Bg * (4 * x_bytes + 2 * k * (x_bytes + 1)) + E
//   E = ceil(2 * W * D * x_bytes / P)   (the ring's share of a slot, rounded up to a whole byte)
// e.g. 4-bit keys and values, D = 64, G = 64, bf16, k = 0: 32 + 32 + 8 = 72
// bytes per token and kv head, against 256 in bf16 (3.56x); 2-bit: 40 (6.4x);
// an exact window of 8 adds 16 bytes at P = 128 (88: 2.9x) and 128 at P = 16.
// Every byte is counted: effective bits per element = 8 * C / (2 * D).
//
// Keys quantized per channel over token groups (nq_format.h's kTokens, the
// better keys at equal bytes) need storage for a request's open group outside
// the uniform pages; they are not in this version (docs/vllm.md).
#pragma once

#include <cstdint>

#include "nexuskv/core/hd.h"
#include "nexuskv/core/nq_format.h"

namespace nexuskv::core {

constexpr int kPagedFormatVersion = 2;
constexpr int64_t kPageTokenMultiple = 16;  // P % 16 == 0: every buffer of a page 16-byte aligned
constexpr int64_t kMaxExactWindow = 256;    // W <= min(P, 256): a task's exact rows stay small

// The format parameters of a paged pool and the offsets of every buffer of a
// head page.  32-bit sizes: a head page is far below 2^31 bytes (P * C with
// C < 2^12 at D = 256), so per-token offsets need no 64-bit arithmetic.
struct PagedLayout {
  int head_dim = 0;    // D
  int block_size = 0;  // P
  int key_bits = 4, value_bits = 4;
  int group_size = 64;   // G: channels per group (per token)
  int num_outliers = 0;  // k
  int x_bytes = 2;       // bytes of the stored dtype (scales, zeros, outlier values)
  int exact_window = 0;  // W: newest tokens of a page kept exact in its ring (<= block_size)

  NEXUSKV_HD_INLINE int groups() const { return int(ceil_div(head_dim, group_size)); }  // Bg
  NEXUSKV_HD_INLINE int key_row_bytes() const { return int(row_bytes(key_bits, head_dim)); }
  NEXUSKV_HD_INLINE int value_row_bytes() const { return int(row_bytes(value_bits, head_dim)); }
  // C - E: the codes, scales, zeros and outliers of a slot.
  NEXUSKV_HD_INLINE int code_slot_bytes() const {
    return key_row_bytes() + value_row_bytes() + groups() * (4 * x_bytes + 2 * num_outliers * (x_bytes + 1));
  }
  // Bytes of one ring (keys or values) of a head page: [W, D] of x.
  NEXUSKV_HD_INLINE int ring_bytes() const { return exact_window * head_dim * x_bytes; }
  // C: bytes of one (token, kv head) slot.
  NEXUSKV_HD_INLINE int slot_bytes() const {
    return code_slot_bytes() + (exact_window > 0 ? int(ceil_div(2 * ring_bytes(), block_size)) : 0);
  }
  NEXUSKV_HD_INLINE int64_t head_page_bytes() const { return int64_t(block_size) * slot_bytes(); }

  // Offsets (bytes from the head page) of the ten buffers, in the order above.
  NEXUSKV_HD_INLINE int64_t key_codes() const { return 0; }
  NEXUSKV_HD_INLINE int64_t value_codes() const { return int64_t(block_size) * key_row_bytes(); }
  NEXUSKV_HD_INLINE int64_t meta_bytes() const { return int64_t(block_size) * groups() * x_bytes; }  // one [P, Bg]
  NEXUSKV_HD_INLINE int64_t key_scale() const { return value_codes() + int64_t(block_size) * value_row_bytes(); }
  NEXUSKV_HD_INLINE int64_t key_zero() const { return key_scale() + meta_bytes(); }
  NEXUSKV_HD_INLINE int64_t value_scale() const { return key_zero() + meta_bytes(); }
  NEXUSKV_HD_INLINE int64_t value_zero() const { return value_scale() + meta_bytes(); }
  NEXUSKV_HD_INLINE int64_t key_outlier_val() const { return value_zero() + meta_bytes(); }
  NEXUSKV_HD_INLINE int64_t value_outlier_val() const { return key_outlier_val() + meta_bytes() * num_outliers; }
  NEXUSKV_HD_INLINE int64_t key_outlier_idx() const { return value_outlier_val() + meta_bytes() * num_outliers; }
  NEXUSKV_HD_INLINE int64_t value_outlier_idx() const {
    return key_outlier_idx() + int64_t(block_size) * groups() * num_outliers;
  }
  // The rings follow the P code slots (a multiple of 16 bytes from the head page).
  NEXUSKV_HD_INLINE int64_t key_ring() const { return int64_t(block_size) * code_slot_bytes(); }
  NEXUSKV_HD_INLINE int64_t value_ring() const { return key_ring() + ring_bytes(); }

  // NQDims of one token of one head (a single [1, D] row), what nq_compress /
  // the NQ readers see for a slot.
  NEXUSKV_HD_INLINE NQDims token_dims(int bits) const {
    NQDims d;
    d.rows = 1;
    d.tokens = 1;
    d.head_dim = head_dim;
    d.bits = bits;
    d.group_size = group_size;
    d.axis = GroupAxis::kChannels;
    d.num_outliers = num_outliers;
    return d;
  }
};

// Pointers to the buffers of one slot (token `offset` of a head page).
template <typename X>
struct PagedSlot {
  uint8_t* codes;
  X* scale;
  X* zero;
  X* outlier_val;
  uint8_t* outlier_idx;
};

// A head page's buffer offsets and row sizes evaluated once: PagedLayout's
// accessors divide (ceil_div, row_bytes), which a kernel should not do per slot.
struct PagedOffsets {
  int groups = 0, num_outliers = 0;  // Bg, k
  int exact_window = 0;              // W
  int row_bytes[2] = {};             // key, value
  int64_t codes[2] = {}, scale[2] = {}, zero[2] = {}, outlier_val[2] = {}, outlier_idx[2] = {}, ring[2] = {};

  PagedOffsets() = default;
  NEXUSKV_HD_INLINE explicit PagedOffsets(const PagedLayout& l)
      : groups(l.groups()), num_outliers(l.num_outliers),
        exact_window(l.exact_window), row_bytes{l.key_row_bytes(), l.value_row_bytes()}, codes{l.key_codes(),
                                                                                               l.value_codes()},
        scale{l.key_scale(), l.value_scale()}, zero{l.key_zero(), l.value_zero()}, outlier_val{l.key_outlier_val(),
                                                                                               l.value_outlier_val()},
        outlier_idx{l.key_outlier_idx(), l.value_outlier_idx()}, ring{l.key_ring(), l.value_ring()} {}
};

// Slot `offset` (0 <= offset < P) of the key (value = false) or value half of
// the head page starting at `head_page`.
template <typename X>
NEXUSKV_HD_STATIC PagedSlot<X> paged_slot(const PagedOffsets& o, uint8_t* head_page, int offset, bool value) {
  const int v = value ? 1 : 0, g = o.groups, k = o.num_outliers;
  PagedSlot<X> s;
  s.codes = head_page + o.codes[v] + int64_t(offset) * o.row_bytes[v];
  s.scale = reinterpret_cast<X*>(head_page + o.scale[v]) + offset * g;
  s.zero = reinterpret_cast<X*>(head_page + o.zero[v]) + offset * g;
  s.outlier_val = reinterpret_cast<X*>(head_page + o.outlier_val[v]) + int64_t(offset) * g * k;
  s.outlier_idx = head_page + o.outlier_idx[v] + int64_t(offset) * g * k;
  return s;
}
template <typename X>
NEXUSKV_HD_STATIC PagedSlot<X> paged_slot(const PagedLayout& l, uint8_t* head_page, int offset, bool value) {
  return paged_slot<X>(PagedOffsets(l), head_page, offset, value);
}

// The ring row of the exact window that holds token `offset` (0 <= offset < P)
// of the head page at `head_page`, key (value = false) or value: [D] of X.
// Only for a layout with W > 0.
template <typename X>
NEXUSKV_HD_STATIC X* paged_ring_row(const PagedOffsets& o, uint8_t* head_page, int offset, int head_dim, bool value) {
  return reinterpret_cast<X*>(head_page + o.ring[value ? 1 : 0]) + (offset % o.exact_window) * head_dim;
}

}  // namespace nexuskv::core
