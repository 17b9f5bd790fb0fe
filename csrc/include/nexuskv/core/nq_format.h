// nexuskv NQ block-quantized format: the one place it is documented.
//
// A tensor x[..., T, D] (T tokens, D = head_dim) is viewed as N = prod(...)
// independent rows ("heads") of shape [T, D]. Every row is compressed into
// five buffers:
//
//   codes        uint8 [N, T, row_bytes(bits, D)]      one packed row per token
//   scale, zero  meta  [N, A, B]                        one pair per group
//   outlier_idx  uint8 [N, A, B, k]                     position inside the group
//   outlier_val  x     [N, A, B, k]                     exact value, input dtype
//
// Grouping (GroupAxis):
//   kTokens   ("per channel", KIVI keys):  a group is group_size consecutive
//             tokens of ONE channel.  A = ceil(T / G) token groups, B = D.
//   kChannels ("per token", values):       a group is group_size consecutive
//             channels of ONE token.      A = T, B = ceil(D / G) channel groups.
// The last group along the grouped axis may be partial; it is quantized on
// the entries it has.
//
// Quantization of one group (asymmetric, round to nearest):
//   qmax  = 2^bits - 1
//   zero  = min over the dense entries, rounded DOWN to the meta dtype
//   scale = (max - zero) / qmax, rounded UP to the meta dtype (a positive
//           value below FLT_MIN, the smallest normal float32, is raised to
//           FLT_MIN first, so that 1 / scale is finite)
//   code  = clamp(round((x - zero) / scale), 0, qmax)
//   x_hat = code * scale + zero
// Rounding zero down and scale up keeps every dense entry inside
// [zero, zero + qmax*scale], so |x - x_hat| <= scale/2 (plus float32
// rounding) holds with the STORED scale.  The meta dtype defaults to the
// input dtype: fp16 input -> fp16 meta, bf16 -> bf16 (fp16 would overflow
// past 65504), fp32 -> fp32.  A narrower meta dtype may be asked for; the
// compressor then checks that every scale and zero is finite.
//
// Fitted ranges (optional, a compressor setting: readers do not see it): the
// min/max scale and zero above are then only the first candidate; up to
// kFitSteps (csrc/core/nq_fit.h) least-squares refits of (zero, scale) on the
// previous candidate's codes follow, each rounded to nearest in the meta
// dtype, and the group keeps the candidate of least squared error over its
// dense entries.  Entries outside [zero, zero + qmax*scale] then decode to
// the nearest end level: every dense entry decodes to the nearest of the
// group's 2^bits levels (|x - x_hat| <= scale/2 only inside the range), and
// the group's squared error is at most min/max's.
//
// Outliers (dense-and-sparse): per group, the k entries whose removal shrinks
// the min/max range the most (i from the bottom, k-i from the top, best i)
// are excluded from min/max and stored exactly.  Why not "largest |x|": for
// asymmetric quantization what costs precision is range, and a channel with
// a large constant offset (common in keys) has large |x| everywhere.
// Slots are sorted by position.  A group with n <= k entries (a partial last
// group) stores all n exactly and repeats its last slot: decompression writes
// the same value twice, so storage stays static without a sentinel.
// Codes at outlier positions hold the clamped code; readers that do not
// apply outliers still get a bounded (clamped) value.
//
// Packed row layout (codes of one token, D channels), built from chunks that
// a 16-byte vector load reads without shuffles (the code that reads and
// writes it, for host and device: nq_layout.h):
//
//   bits 2, 4, 8: chunk = 16 bytes holding C = 16 * (8 / bits) channels.
//     channel i of the chunk sits in byte (i % 16) at bit offset bits*(i/16).
//     One 16-byte load, shift right by bits*j and mask -> channels
//     [16j, 16j+16) in order, one per byte lane.
//
//       4-bit, 32 channels:  byte l = [ c(l+16) : 4 | c(l) : 4 ]    l = 0..15
//       2-bit, 64 channels:  byte l = [ c(l+48) | c(l+32) | c(l+16) | c(l) ]
//       8-bit, 16 channels:  byte l = c(l)
//
//   bits 3: chunk = 24 bytes holding 64 channels, two planes:
//     bytes  0..15  the low 2 bits of each code, laid out as a 2-bit chunk;
//     bytes 16..23  bit 2 of channel i at byte 16 + (i % 8), bit (i / 8).
//
//   row_bytes = ceil(D / C) * chunk_bytes.  Channels past D in the last chunk
//   are zero padding; they are counted in the bytes (nothing is hidden).
//   D = 64 or 128 needs no padding at any bit width.
//
// DGQ (dynamic groups, keys): the kTokens grouping with data-chosen token
// groups ("segments") instead of fixed ones.  A sixth buffer
//
//   segment_starts  int32 [N, S]        first token of each segment
//
// lists S = ceil(T / group_size) segments; segment s covers
// [starts[s], starts[s+1]) (the last one ends at T).  Segments are whole
// granules of tokens (the last may be partial) no longer than max_len <= 256;
// a row that needs fewer than S segments fills the unused slots with T
// (empty segments, zero scale and zero).  scale/zero are [N, S, D] and
// outlier_idx holds the position inside the segment, so the readers of
// fixed groups work unchanged given the segment bounds.
//
// Effective bits per element (exact for the returned tensors, padding
// included):
//   8 * (N*T*row_bytes + N*A*B*(2*meta_bytes + k*(1 + x_bytes))) / (N*T*D)
// which for aligned shapes is
//   bits + (2*meta_bits + k*(8 + x_bits)) / group_size.
#pragma once

#include <cstdint>

#include "nexuskv/core/hd.h"

namespace nexuskv::core {

enum class GroupAxis : int {
  kTokens = 0,    // per channel, groups of consecutive tokens (keys)
  kChannels = 1,  // per token, groups of consecutive channels (values)
};

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

NEXUSKV_HD_STATIC constexpr int dtype_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

constexpr int kMaxGroupSize = 256;  // outlier_idx is one byte

// Fitted ranges ("Fitted ranges" above): least-squares refits tried per group after
// min/max, on the CPU (csrc/core/nq_fit.h) and CUDA (nq_compress.cuh) alike.
constexpr int kFitSteps = 4;

NEXUSKV_HD_STATIC constexpr bool bits_supported(int bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 8; }

// Channels held by one packed chunk.
NEXUSKV_HD_STATIC constexpr int chunk_channels(int bits) { return bits == 8 ? 16 : bits == 4 ? 32 : 64; }

// Bytes of one packed chunk.
NEXUSKV_HD_STATIC constexpr int chunk_bytes(int bits) { return bits == 3 ? 24 : 16; }

NEXUSKV_HD_STATIC constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

NEXUSKV_HD_STATIC constexpr int64_t row_bytes(int bits, int64_t head_dim) {
  return ceil_div(head_dim, chunk_channels(bits)) * chunk_bytes(bits);
}

// Sizes of one compressed tensor, derived from the parameters alone.
struct NQDims {
  int64_t rows = 0;      // N: product of the leading dims
  int64_t tokens = 0;    // T
  int64_t head_dim = 0;  // D
  int bits = 4;
  int group_size = 64;  // G
  GroupAxis axis = GroupAxis::kTokens;
  int num_outliers = 0;    // k
  bool fit_range = false;  // compress only: least-squares fitted ranges ("Fitted ranges" above)

  NEXUSKV_HD_INLINE int64_t packed_row_bytes() const { return row_bytes(bits, head_dim); }
  // A: groups (or tokens) along the first meta dim of one row.
  NEXUSKV_HD_INLINE int64_t meta_a() const {
    return axis == GroupAxis::kTokens ? ceil_div(tokens, group_size) : tokens;
  }
  // B: channels (or channel groups) along the second meta dim.
  NEXUSKV_HD_INLINE int64_t meta_b() const {
    return axis == GroupAxis::kTokens ? head_dim : ceil_div(head_dim, group_size);
  }
  NEXUSKV_HD_INLINE int64_t groups_per_row() const { return meta_a() * meta_b(); }

  // DGQ: [rows, meta_a()] first token of each token group, or null for fixed
  // groups of group_size.  Only with axis kTokens.
  const int32_t* segment_starts = nullptr;
  // Token group a of row n (kTokens) covers [group_start, group_end).
  NEXUSKV_HD_INLINE int64_t group_start(int64_t n, int64_t a) const {
    return segment_starts ? segment_starts[n * meta_a() + a] : a * group_size;
  }
  NEXUSKV_HD_INLINE int64_t group_end(int64_t n, int64_t a) const {
    if (!segment_starts) return (a + 1) * group_size < tokens ? (a + 1) * group_size : tokens;
    return a + 1 < meta_a() ? segment_starts[n * meta_a() + a + 1] : tokens;
  }
  // Longest token group: what per-group scratch must hold.
  NEXUSKV_HD_INLINE int64_t max_group_tokens() const { return segment_starts ? kMaxGroupSize : group_size; }
};

// Total bytes of the five buffers; effective bits = 8 * bytes / (N*T*D).
NEXUSKV_HD_STATIC int64_t nq_nbytes(const NQDims& d, DType x_dtype, DType meta_dtype) {
  const int64_t groups = d.rows * d.groups_per_row();
  return d.rows * d.tokens * d.packed_row_bytes() +
         groups * (2 * dtype_bytes(meta_dtype) + d.num_outliers * (1 + dtype_bytes(x_dtype)));
}

}  // namespace nexuskv::core
