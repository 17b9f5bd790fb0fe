// NQ / DGQ decompression on the GPU (format: nq_format.h): one thread per
// output element, adjacent threads on adjacent channels (coalesced stores; the
// packed bytes and the metadata a warp reads are a few cache lines).  Blocks take
// whole tokens of one row and a thread finds its (token, channel, group) with
// 32-bit multiply-shift divisions (nq_index.h): no 64-bit `/` or `%` per element.
//
//   x_hat = code * scale + zero    exactly rounded as on the CPU, saturated
//                                  to the output type's finite range
//   outliers: each element scans the k slots of its own group and takes the
//             value of the last slot that names its position (the CPU's
//             scatter writes the slots in order), so no two threads write
//             one element.
//
// Invalid input the host did not check: an outlier index outside its group
// turns every element of that group NaN and reports kBadOutlierIndex; a DGQ
// row whose segment_starts are not ordered segments from 0 within [0, T]
// (row_ok[n] == 0, nq_validate_segments) decompresses to NaN.
#pragma once

#include "device_common.cuh"
#include "nexuskv/core/nq_index.h"
#include "nexuskv/core/nq_layout.h"

namespace nexuskv::cuda {

// Largest finite value of an output type (the CPU's saturate<Out>).
template <typename Out>
NKV_DEVICE float out_max() {
  return std::is_same_v<Out, half_t> ? 65504.f : 3.38953139e38f;
}

template <typename Out>
NKV_KERNEL void nq_decompress_kernel(core::NQDims d, core::NQIndexing ix,      // ix.tiles: [T, D]
                                     const uint8_t* __restrict__ codes,        // [N, T, row_bytes]
                                     const void* __restrict__ scale,           // [N, A, B]
                                     const void* __restrict__ zero,            // [N, A, B]
                                     const uint8_t* __restrict__ outlier_idx,  // [N, A, B, k]
                                     const void* __restrict__ outlier_val,     // [N, A, B, k]
                                     DType meta_dtype, DType val_dtype,
                                     const uint8_t* __restrict__ row_ok,  // [N] DGQ rows valid, or null
                                     Out* __restrict__ out,               // [N, T, D]
                                     uint32_t* status) {
  const int64_t D = d.head_dim, k = d.num_outliers;
  // Rows along grid.y (a loop past 65,535 rows), whole tokens along grid.x (nq_index.h).
  for (int64_t n = blockIdx.y; n < d.rows; n += gridDim.y) {
    for (uint32_t local = threadIdx.x; local < ix.tiles.local_size(); local += blockDim.x) {
      uint32_t t, c;
      if (!ix.tiles.at(blockIdx.x, local, t, c)) break;
      const int64_t nt = n * d.tokens + t, e = nt * D + c;
      if (row_ok && !row_ok[n]) {
        out[e] = nan_of<Out>();
        continue;
      }
      const core::ElementGroup grp = core::element_group(d, ix, n, t, c);
      const int64_t g = grp.g;
      const uint32_t code = core::layout::code_at(codes + nt * ix.row_bytes, d.bits, c);
      float v = add_rn(mul_rn(float(code), load_as_float(scale, meta_dtype, g)), load_as_float(zero, meta_dtype, g));
      if constexpr (!std::is_same_v<Out, float>) {
        const float m = out_max<Out>();
        v = v > m ? m : (v < -m ? -m : v);
      }
      Out r = core::from_float<Out>(v);
      for (int64_t slot = 0; slot < k; ++slot) {
        const int64_t p = outlier_idx[g * k + slot];
        if (p >= grp.len) {
          r = nan_of<Out>();
          report(status, kBadOutlierIndex);
          break;
        }
        if (p == grp.pos) r = core::from_float<Out>(load_as_float(outlier_val, val_dtype, g * k + slot));
      }
      out[e] = r;
    }
  }
}

// row_ok[n] = whether segment_starts row n [S] begins at 0 and never
// decreases, and stays within [0, T] (what the readers rely on).
NKV_KERNEL void nq_validate_segments_kernel(const int32_t* __restrict__ starts,  // [N, S]
                                            int64_t rows, int64_t S, int64_t T,
                                            uint8_t* __restrict__ row_ok,  // [N]
                                            uint32_t* status) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= rows) return;
  const int32_t* s = starts + n * S;
  bool ok = s[0] == 0;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t end = i + 1 < S ? s[i + 1] : T;
    ok &= s[i] <= end && end <= T;
  }
  row_ok[n] = ok ? 1 : 0;
  if (!ok) report(status, kBadSegments);
}

template <typename Out>
void launch_nq_decompress(const NQDecompressArgs& a, Out* out, Stream stream) {
  const core::NQDims& d = a.dims;
  constexpr int kThreads = 256;
  if (d.segment_starts)
    launch(nq_validate_segments_kernel, Dim3(unsigned(core::ceil_div(d.rows, kThreads))), Dim3(kThreads), 0, stream,
           d.segment_starts, d.rows, d.meta_a(), d.tokens, a.row_ok, a.status);
  const core::NQIndexing ix(d, d.head_dim, kThreads);
  const Dim3 grid(ix.tiles.blocks(), unsigned(d.rows < kMaxGridY ? d.rows : kMaxGridY));
  launch(nq_decompress_kernel<Out>, grid, Dim3(kThreads), 0, stream, d, ix, a.codes, a.scale, a.zero, a.outlier_idx,
         a.outlier_val, a.meta_dtype, a.val_dtype, static_cast<const uint8_t*>(d.segment_starts ? a.row_ok : nullptr),
         out, a.status);
}

}  // namespace nexuskv::cuda
