// DGQ, dynamic token groups for keys: segment boundaries follow the data
// instead of a fixed window.  Format: nq_format.h ("DGQ").
//
// Choice of boundaries.  The error of min/max quantization of one channel over
// a segment grows with the channel's range there (uniform rounding error has
// variance (range / qmax)^2 / 12 per element), so a segment's cost is
//   len * sum_c range_c^2.
// Starting from one segment per granule, the adjacent pair whose merge raises
// the total cost least is merged (never beyond max_len), until at most S
// segments are left.  A change in the data's scale (variance) makes merging
// across it expensive, so boundaries land on such change points; a stationary
// stretch becomes segments of similar size.  With max_len >= 2 * T / S the
// merging always reaches S (each stuck pair would hold > 2T/S tokens).
#pragma once

#include <cstdint>

#include "nexuskv/core/nq_kernels.h"

namespace nexuskv::core {

struct DGQParams {
  int64_t granule = 16;   // segment lengths are multiples of it (the last may be partial)
  int64_t max_len = 128;  // <= kMaxGroupSize
  int64_t segments = 0;   // S: at most this many segments
};

// gmin, gmax: [ng, D] per-granule, per-channel min and max of one row of T
// tokens (ng = ceil(T / granule)); both are overwritten (scratch).  Writes
// starts[0..S): first token of each segment, unused slots = T.  Returns
// false (nothing written) if more than S segments remain, which only happens
// when max_len < 2 * T / S.
bool dgq_choose_segments(float* gmin, float* gmax, int64_t T, int64_t D, const DGQParams& p, int32_t* starts);

// Chooses the segments of rows [row_begin, row_end) of x [N, T, D] (read as
// in nq_compress), writing starts [N, S].  Returns false if a row could not
// be cut into S segments (see dgq_choose_segments).
template <typename In>
bool dgq_segment_rows(const StridedRows<In>& x, int64_t T, int64_t D, const DGQParams& p, int32_t* starts,
                      int64_t row_begin, int64_t row_end);

}  // namespace nexuskv::core
