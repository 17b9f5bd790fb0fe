// Torch-free NQ kernels over raw pointers: pack/unpack one row of codes,
// compress/decompress a range of independent tasks.  The format is defined in
// nq_format.h.  Callers parallelize by splitting [0, num_tasks) into ranges;
// every task writes a disjoint part of the outputs.
#pragma once

#include <cstdint>

#include "nexuskv/core/half.h"
#include "nexuskv/core/nq_format.h"

namespace nexuskv::core {

// Packs codes[0..head_dim) (each < 2^bits) into row_bytes(bits, head_dim)
// bytes; padding channels are zero.
void pack_row(const uint8_t* codes, int64_t head_dim, int bits, uint8_t* packed);

// Inverse of pack_row: writes codes[0..head_dim).
void unpack_row(const uint8_t* packed, int64_t head_dim, int bits, uint8_t* codes);

// A strided view of the input: element (n, t, d) of x lives at
// x + row_offset[n] + t * stride_t + d * stride_d (in elements).
template <typename In>
struct StridedRows {
  const In* data;
  const int64_t* row_offset;  // [N]
  int64_t stride_t;
  int64_t stride_d;
};

// Output buffers of nq_compress, contiguous, shapes as in nq_format.h.
template <typename In, typename Meta>
struct NQBuffers {
  uint8_t* codes;        // [N, T, row_bytes]
  Meta* scale;           // [N, A, B]
  Meta* zero;            // [N, A, B]
  uint8_t* outlier_idx;  // [N, A, B, k]
  In* outlier_val;       // [N, A, B, k]
};

// What a compress call saw that makes its output invalid; the caller turns
// it into an error.  Tasks only ever set flags, so sharing one is safe.
struct CompressStatus {
  bool non_finite_input = false;  // NaN or Inf in x
  bool range_overflow = false;    // a group's max - min overflows float32 (finite values beyond +-1.7e38)
  bool meta_overflow = false;     // a scale or zero is not finite in the meta dtype
};

// Task t covers one token group of one row (kTokens) or one token of one row
// (kChannels).
int64_t nq_num_tasks(const NQDims& d);

// The instruction set nq_compress_tasks / nq_decompress_tasks run on this
// CPU ("avx2" or "generic"; nexuskv/core/cpu_isa.h).
const char* nq_kernel_isa();

template <typename In, typename Meta>
void nq_compress_tasks(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out, int64_t task_begin,
                       int64_t task_end, CompressStatus* status);

// Dense part of decompression: x_hat = code * scale + zero into out
// (contiguous [N, T, D]).  Outliers are applied afterwards by
// nq_scatter_outliers, so that the dense kernel is not templated on a third type.
template <typename Meta, typename Out>
void nq_decompress_tasks(const NQDims& d, const uint8_t* codes, const Meta* scale, const Meta* zero, Out* out,
                         int64_t task_begin, int64_t task_end);

// Whether every outlier position of groups [group_begin, group_end) (groups
// numbered over N*A*B) lies inside its group: what nq_scatter_outliers checks,
// for readers that do not scatter (fused attention).  Needs d.segment_starts
// for DGQ.
bool nq_outlier_positions_valid(const NQDims& d, const uint8_t* outlier_idx, int64_t group_begin, int64_t group_end);

// Writes the exact outlier values of groups [group_begin, group_end) (groups
// numbered over N*A*B) into out (contiguous [N, T, D]).  Returns false if an
// index points outside its group (corrupt input); such slots are skipped.
template <typename Val, typename Out>
bool nq_scatter_outliers(const NQDims& d, const uint8_t* outlier_idx, const Val* outlier_val, Out* out,
                         int64_t group_begin, int64_t group_end);

}  // namespace nexuskv::core
