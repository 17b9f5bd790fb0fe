// The launch functions of the CUDA kernels: plain declarations over raw
// pointers, so that the ATen glue (*_cuda.cpp, a C++ compiler) does not
// compile the kernels and the kernels (*.cu, nvcc) do not parse torch.  Each
// is defined beside its kernel and instantiated in a .cu file of csrc/cuda.
#pragma once

#include <cstddef>
#include <cstdint>

#include "nexuskv/core/half.h"
#include "nexuskv/core/hd.h"
#include "nexuskv/core/nq_format.h"
#include "nexuskv/core/paged.h"

#if defined(NKV_CUDA_EMULATION)  // (simt_emulated.h: the kernels on the host, no CUDA runtime)
namespace nexuskv::cuda {
using Stream = void*;
}
#else
#include <cuda_runtime_api.h>

namespace nexuskv::cuda {
using Stream = cudaStream_t;
}
#endif

namespace nexuskv::cuda {

using core::DType;

// x viewed as [N, T, D]: element (n, t, c) at data[n * stride_n + t * stride_t + c * stride_d].
template <typename In>
struct RowsView {
  const In* data;
  int64_t stride_n, stride_t, stride_d;
  NEXUSKV_HD const In& at(int64_t n, int64_t t, int64_t c) const {
    return data[n * stride_n + t * stride_t + c * stride_d];
  }
};

// ---- NQ (nq_compress.cuh, nq_decompress.cuh; nq_kernels.cu) ------------------------------------

template <typename In, typename Meta>
struct NQCompressArgs {
  core::NQDims dims;  // segment_starts: device pointer for DGQ, else null
  RowsView<In> x;
  uint8_t* codes;        // [N, T, row_bytes]
  Meta* scale;           // [N, A, B]
  Meta* zero;            // [N, A, B]
  uint8_t* outlier_idx;  // [N, A, B, k]
  In* outlier_val;       // [N, A, B, k]
  uint32_t* status;      // device status word (status.h) or null
};
template <typename In, typename Meta>
void launch_nq_compress(const NQCompressArgs<In, Meta>& a, Stream stream);

struct NQDecompressArgs {
  core::NQDims dims;           // segment_starts: device pointer for DGQ, else null
  const uint8_t* codes;        // [N, T, row_bytes]
  const void* scale;           // [N, A, B]     meta_dtype
  const void* zero;            // [N, A, B]
  const uint8_t* outlier_idx;  // [N, A, B, k]
  const void* outlier_val;     // [N, A, B, k]  val_dtype
  DType meta_dtype, val_dtype;
  uint8_t* row_ok;  // [N] scratch for DGQ, else null
  uint32_t* status;
};
template <typename Out>
void launch_nq_decompress(const NQDecompressArgs& a, Out* out, Stream stream);  // out [N, T, D]

// ---- DGQ segments (dgq_segments.cuh; dgq_kernels.cu) -------------------------------------------

// Bytes of scratch per row, and the offsets of its arrays.
struct SegmentScratchLayout {
  int64_t ng = 0, D = 0;
  NEXUSKV_HD int64_t gmin() const { return 0; }
  NEXUSKV_HD int64_t gmax() const { return gmin() + ng * D * 4; }
  NEXUSKV_HD int64_t cost() const { return gmax() + ng * D * 4; }  // 8-byte aligned: ng * D * 8 bytes before
  NEXUSKV_HD int64_t delta() const { return cost() + ng * 8; }
  NEXUSKV_HD int64_t next() const { return delta() + ng * 8; }
  NEXUSKV_HD int64_t prev() const { return next() + ng * 4; }
  NEXUSKV_HD int64_t len() const { return prev() + ng * 4; }
  NEXUSKV_HD int64_t mergeable() const { return len() + ng * 4; }
  NEXUSKV_HD int64_t bytes() const { return (mergeable() + ng + 15) / 16 * 16; }
};

// Bytes of scratch per row the segment choice needs.
inline int64_t dgq_scratch_bytes_per_row(int64_t T, int64_t D, int64_t granule) {
  SegmentScratchLayout lay;
  lay.ng = core::ceil_div(T, granule), lay.D = D;
  return lay.bytes();
}
template <typename In>
void launch_dgq_segments(const RowsView<In>& x, int64_t rows, int64_t T, int64_t D, int64_t granule, int64_t max_len,
                         int64_t S,
                         unsigned char* scratch,  // [rows, dgq_scratch_bytes_per_row]
                         int32_t* starts,         // [rows, S]
                         uint32_t* status, Stream stream);

// ---- Hadamard rotation (hadamard.cuh; hadamard_kernels.cu) -------------------------------------

constexpr int64_t kHadamardSmemMax = 8192;  // floats of one row in shared memory (32 KB)
template <typename T>
void launch_hadamard(const T* x,  // [rows, n] contiguous
                     int64_t rows, int64_t n,
                     const void* signs,  // [n] signs_dtype
                     DType signs_dtype, bool inverse,
                     T* y,            // [rows, n]
                     float* scratch,  // [rows, n] when n > kHadamardSmemMax, else unused
                     uint32_t* status, Stream stream);

}  // namespace nexuskv::cuda

// ---- Paged KV (paged_kernels.cuh; paged_kernels.cu) --------------------------------------------

namespace nexuskv::cuda {

// The paged write quantizes every (token, kv head) row of key and value with
// the NQ compressor of launch_nq_compress (rows = tokens, tokens = kv heads,
// axis kChannels: one group set per (token, head), the bytes of nq_compress
// on that token) into one scratch buffer, then copies each row with a slot
// into its slot.  Byte offsets of the scratch's buffers (256-byte aligned);
// index 0: keys, 1: values.
struct PagedWriteScratch {
  int64_t rotated = 0;                                 // X [2, rows, D] when rotating (keys, then values)
  int64_t codes[2] = {}, scale[2] = {}, zero[2] = {};  // uint8 [rows, row_bytes], X [rows, Bg], X [rows, Bg]
  int64_t outlier_idx[2] = {}, outlier_val[2] = {};    // uint8 [rows, Bg, k], X [rows, Bg, k]
  int64_t bytes = 0;
};
inline PagedWriteScratch paged_write_scratch(const core::PagedLayout& l, int64_t rows, bool rotate) {
  PagedWriteScratch s;
  int64_t at = 0;
  auto take = [&](int64_t n) {
    const int64_t offset = at;
    at += (n + 255) / 256 * 256;
    return offset;
  };
  const int64_t x = l.x_bytes, g = rows * l.groups();
  s.rotated = take(rotate ? 2 * rows * l.head_dim * x : 0);
  for (int half = 0; half < 2; ++half) {
    s.codes[half] = take(rows * (half ? l.value_row_bytes() : l.key_row_bytes()));
    s.scale[half] = take(g * x);
    s.zero[half] = take(g * x);
    s.outlier_idx[half] = take(g * l.num_outliers);
    s.outlier_val[half] = take(g * l.num_outliers * x);
  }
  s.bytes = at;
  return s;
}

// Writes w.num_tokens tokens (w.num_tokens * kv_heads < 2^31) through
// `scratch` (device, paged_write_scratch(...).bytes, 256-byte aligned).
// Device-side checks: a slot outside [-1, num_slots) skips its token
// (kBadSlot); signs not +-1 (kBadSigns) make the rotated rows NaN; a written
// group whose input held NaN/Inf (kNonFiniteInput) or whose scale or zero
// overflows X (kMetaOverflow) is stored with that NaN/Inf scale and zero.
// Duplicate slots are the caller's contract on CUDA (the tokens race; the CPU
// raises): no check without NEXUSKV_CUDA_CHECKS=1.
template <typename X>
void launch_paged_write(const core::PagedWrite<X>& w, uint8_t* scratch, uint32_t* status, Stream stream);

// The exact window's rings of w.num_tokens tokens, one block per kv head, in
// token order; a slot outside [-1, num_slots) skips its token (kBadSlot).
template <typename X>
void launch_paged_exact_write(const core::PagedWrite<X>& w, uint32_t* status, Stream stream);

// The paged attention.  Two kernels: the tensor-core one
// (paged_mma_launch.cuh: paged_decode.cuh for decode steps, paged_mma.cuh
// otherwise) for the common formats, the SIMT reference (paged_kernels.cuh:
// one block per token, kv head and up to kPagedHeadsPerBlock q heads) for the
// rest; the plan says which runs and what scratch it needs.  p.out is written
// in full (padding rows zero).  Device-side checks (rows NaN, status bits):
// query_start_loc / seq_lens inconsistent (kBadLengths), a block id outside
// the pool (kBadBlock), signs not +-1 (kBadSigns), an outlier position outside
// its group (kBadOutlierIndex).  Needs p.num_tokens < 2^31 and kv_heads x
// ceil(gqa_group / kPagedHeadsPerBlock) <= 65535.
constexpr int kPagedHeadsPerBlock = 8;
struct PagedAttentionPlan {
  bool mma = false;                                              // the tensor-core kernel (else the SIMT one)
  int heads_per_tile = 1, tokens_per_tile = 1, head_chunks = 1;  // a row tile: tokens x q heads
  int tile_rows = 16;          // query rows a block holds at most: 8 (decode) or 16 (core::paged_tile_rows)
  bool singles_apart = false;  // (16-row tiles) the requests of one query token run the 8-row kernel apart
  int64_t tiles = 0;           // row tiles the grid holds (at least the request's tiles)
  int64_t splits = 1;          // splits of each row tile's key range
  int64_t scratch_bytes = 0;   // device scratch the launch needs (uint8)
};
// Host only (the shared-memory opt-in, no device work): the tensor-core plan
// when allow_mma and it takes p, else the SIMT one; multiprocessors sizes the
// split of the key range (core::plan_splits).
template <typename X>
PagedAttentionPlan paged_attention_plan(const core::PagedAttention<X>& p, int multiprocessors, bool allow_mma);
// Returns the cudaError_t of a shared-memory opt-in (0: launched).
template <typename X>
int launch_paged_attention(const core::PagedAttention<X>& p, const PagedAttentionPlan& plan, uint8_t* scratch,
                           uint32_t* status, Stream stream);

}  // namespace nexuskv::cuda
