// Randomized Hadamard rotation of rows of length n (a power of two) on the GPU:
// y = H (signs * x) / sqrt(n), inverse x = signs * H y / sqrt(n), with the
// CPU's operations in the CPU's order (core::hadamard_rotate_rows: signs,
// butterflies a + b / a - b for len = 1, 2, 4, ..., then the norm), so the
// result is bit-identical to the CPU's.
//
// One block per row, the row in shared memory, one barrier per butterfly
// stage.  Rows longer than kHadamardSmemMax use the same kernel on global
// scratch (the output buffer itself).
#pragma once

#include "device_common.cuh"

namespace nexuskv::cuda {

// In-place fast Walsh-Hadamard transform of y[0..n) by the threads of a block;
// the caller synchronizes before (y written) and the function after each stage.
NKV_DEVICE void fwht_block(float* y, int64_t n) {
  for (int64_t len = 1; len < n; len <<= 1) {
    for (int64_t p = threadIdx.x; p < n / 2; p += blockDim.x) {
      const int64_t j = (p / len) * 2 * len + p % len;  // first of the pair (j, j + len)
      const float a = y[j], b = y[j + len];
      y[j] = add_rn(a, b);
      y[j + len] = sub_rn(a, b);
    }
    NKV_SYNC();
  }
}

template <typename In, typename Out>
NKV_KERNEL void hadamard_kernel(const In* __restrict__ x,                           // [rows, n] contiguous
                                const void* __restrict__ signs, DType signs_dtype,  // [n]
                                int64_t n, bool inverse, bool in_smem,
                                Out* __restrict__ y,          // [rows, n]
                                float* __restrict__ scratch,  // [rows, n] when !in_smem
                                uint32_t* status) {
  NKV_DYNAMIC_SMEM(smem);
  const int64_t row = blockIdx.x;
  float* buf = in_smem ? reinterpret_cast<float*>(smem) : scratch + row * n;
  const In* xr = x + row * n;
  __shared__ uint32_t bad;
  if (threadIdx.x == 0) bad = 0;
  NKV_SYNC();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float s = load_as_float(signs, signs_dtype, i);
    if (s != 1.f && s != -1.f) atomic_or(&bad, 1u);
    const float v = core::to_float(xr[i]);
    buf[i] = inverse ? v : mul_rn(v, s);
  }
  NKV_SYNC();
  fwht_block(buf, n);
  const float norm = div_rn(1.f, sqrtf(float(n)));
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float f = inverse ? mul_rn(norm, load_as_float(signs, signs_dtype, i)) : norm;
    // Signs other than +-1 (no host check): the row is NaN, never a silent value.
    y[row * n + i] = core::from_float<Out>(bad ? bits_float(0x7fc00000u) : mul_rn(buf[i], f));
  }
  if (bad && threadIdx.x == 0) report(status, kBadSigns);
}

template <typename T>
void launch_hadamard(const T* x, int64_t rows, int64_t n, const void* signs, DType signs_dtype, bool inverse, T* y,
                     float* scratch, uint32_t* status, Stream stream) {
  const bool in_smem = n <= kHadamardSmemMax;
  const int threads = n >= 256 ? 256 : (n >= 32 ? int(n) : 32);
  launch(hadamard_kernel<T, T>, Dim3(unsigned(rows)), Dim3(unsigned(threads)), in_smem ? size_t(n) * sizeof(float) : 0,
         stream, x, signs, signs_dtype, n, inverse, in_smem, y, scratch, status);
}

}  // namespace nexuskv::cuda
