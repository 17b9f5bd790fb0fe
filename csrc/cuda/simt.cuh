// The handful of CUDA constructs the kernels of csrc/cuda use, named once: the
// exactly rounded arithmetic the compress kernels need to match the CPU bit for
// bit, warp exchanges, launches, and the few PTX instructions of the
// tensor-core attention kernel (mma, cp.async, cvt, prmt), each with a comment
// on its operand layout.  Warp shuffles and block barriers are reached by every
// thread of the block.
#pragma once

#include <cstdint>

#include "launch.h"
#include "nexuskv/core/half.h"

#if defined(NKV_CUDA_EMULATION)
// The same names on the host (tests/cpp/test_cuda_emulated.cpp runs the kernels there).
#include "simt_emulated.h"
#else
#if !defined(__CUDACC__)
#error "csrc/cuda kernels are compiled by nvcc"
#endif
#include <cuda_runtime.h>

namespace nexuskv::cuda {

constexpr int kWarp = 32;
constexpr size_t kDefaultSmem = 48 << 10;  // dynamic shared memory a kernel gets without opting in
constexpr int64_t kMaxGridY = 65535;       // gridDim.y (and z) limit; gridDim.x goes to 2^31 - 1

#define NKV_KERNEL __global__
#define NKV_DEVICE __device__ __forceinline__
#define NKV_HOST_DEVICE __host__ __device__ __forceinline__
#define NKV_SYNC() __syncthreads()
// A kernel parameter whose address is taken, without a copy to local memory.
#define NKV_GRID_CONSTANT __grid_constant__
// Dynamic shared memory of a kernel, 16-byte aligned.
#define NKV_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
// Counts a kernel path taken where `cond` holds, under emulation only (simt_emulated.h: the
// tests assert that the path they mean ran); nothing on a GPU.
#define NKV_EMU_COUNT(name, cond) ((void)0)
using Dim3 = dim3;

// Exactly rounded float/double arithmetic: no FMA contraction, so that the
// compress kernels compute what the CPU kernels compute, bit for bit.
NKV_DEVICE float mul_rn(float a, float b) { return __fmul_rn(a, b); }
NKV_DEVICE float add_rn(float a, float b) { return __fadd_rn(a, b); }
NKV_DEVICE float sub_rn(float a, float b) { return __fsub_rn(a, b); }
NKV_DEVICE float div_rn(float a, float b) { return __fdiv_rn(a, b); }
NKV_DEVICE double dmul_rn(double a, double b) { return __dmul_rn(a, b); }
NKV_DEVICE double dadd_rn(double a, double b) { return __dadd_rn(a, b); }
NKV_DEVICE double dsub_rn(double a, double b) { return __dsub_rn(a, b); }

// Butterfly exchange among the 32 lanes of a warp (all lanes take part).
NKV_DEVICE float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
NKV_DEVICE uint32_t shfl_xor(uint32_t v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

NKV_DEVICE uint32_t atomic_or(uint32_t* p, uint32_t v) { return atomicOr(p, v); }
NKV_DEVICE float atomic_add(float* p, float v) { return atomicAdd(p, v); }
NKV_DEVICE int32_t atomic_max(int32_t* p, int32_t v) { return atomicMax(p, v); }

// Launches kernel<<<grid, block, smem, stream>>>(args...).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), Dim3 grid, Dim3 block, size_t smem, Stream stream, Args... args) {
  kernel<<<grid, block, smem, stream>>>(args...);
}
// Raises the dynamic shared memory limit of a kernel above the default 48 KB.
template <typename... Params>
cudaError_t allow_smem(void (*kernel)(Params...), size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

// Blocks of kernel that one SM of the current device holds at once with block
// threads and smem bytes of dynamic shared memory (its registers and shared
// memory decide); 0 on an error.  The last answer is kept per thread: a decode
// step asks the same of every layer.
template <typename... Params>
int blocks_per_sm(void (*kernel)(Params...), int block, size_t smem) {
  struct Last {
    const void* kernel = nullptr;
    int device = -1, block = 0;
    size_t smem = 0;
    int n = 0;
  };
  static thread_local Last last;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  const void* k = reinterpret_cast<const void*>(kernel);
  if (last.kernel == k && last.device == device && last.block == block && last.smem == smem) return last.n;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  last = {k, device, block, smem, n};
  return n;
}

// ---- the few instructions of the tensor-core attention kernel -----------------------------

NKV_DEVICE float shfl(float v, int src) { return __shfl_sync(0xffffffffu, v, src); }
// Whether p holds on any lane of the warp (one VOTE).
NKV_DEVICE bool any_lane(bool p) { return __any_sync(0xffffffffu, p) != 0; }

// max(a, |b|), NaN where either is NaN (FMNMX.NAN; fmaxf passes a NaN over).
NKV_DEVICE float max_abs_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(fabsf(b)));
  return r;
}
// Bytes of (hi:lo) picked by the selector's nibbles (PRMT).
NKV_DEVICE uint32_t byte_perm(uint32_t lo, uint32_t hi, uint32_t selector) { return __byte_perm(lo, hi, selector); }

// fp16 bits -> float by the hardware converter (exact, as core::half_to_float).
NKV_DEVICE float half_bits_to_float(uint16_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
}

// Two fp16 values (lo in bits 0..15) from two floats, round to nearest.
NKV_DEVICE uint32_t pack_half2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// (a & b) | c in one LOP3 (the compiler splits the C expression in two when b
// and c are both immediates).
NKV_DEVICE uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
// Two fp16 values 1024 + 2^shift c (shift 0..8) -> c, exact: one fma by 2^-shift
// and -2^(10 - shift), both fp16 (exponent field e + 15 for 2^e).
NKV_DEVICE uint32_t half2_unbias(uint32_t h, int shift) {
  const uint32_t down = uint32_t(15 - shift) << 10, bias = 0x8000u | (uint32_t(25 - shift) << 10);
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(h), "r"(down | (down << 16)), "r"(bias | (bias << 16)));
  return r;
}
// Elementwise max (kMax) or min of two pairs of 16-bit floats (bf16 if kBf16,
// else fp16; the lower in bits 0..15), sm_80 and later: a NaN gives the other
// value, as fmaxf / fminf.  (Chains of them issue as 3-input VHMNMX on sm_90.)
#define NKV_PAIR_PICK(OP) asm(OP " %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b))
template <bool kBf16, bool kMax>
NKV_DEVICE uint32_t pair_pick(uint32_t a, uint32_t b) {
  uint32_t r;
  if constexpr (kBf16 && kMax)
    NKV_PAIR_PICK("max.bf16x2");
  else if constexpr (kBf16)
    NKV_PAIR_PICK("min.bf16x2");
  else if constexpr (kMax)
    NKV_PAIR_PICK("max.f16x2");
  else
    NKV_PAIR_PICK("min.f16x2");
  return r;
}
#undef NKV_PAIR_PICK
// |x| of a pair of 16-bit floats (the sign bits cleared; fused into a
// following pair_pick (max) as VHMNMX's operand modifier on sm_90 for fp16).
template <bool kBf16>
NKV_DEVICE uint32_t pair_abs(uint32_t a) {
  uint32_t r;
  if constexpr (kBf16)
    asm("abs.bf16x2 %0, %1;\n" : "=r"(r) : "r"(a));
  else
    asm("abs.f16x2 %0, %1;\n" : "=r"(r) : "r"(a));
  return r;
}
// D = A . B + D for one m16n8k16 tile: A fp16 16x16 row-major, B fp16 16x8
// column-major, D float 16x8, in the PTX fragment layout (g = lane / 4,
// t = lane % 4): a[i] holds A[g + 8 (i % 2)][2t + 8 (i / 2) + {0, 1}];
// b[j] holds B[2t + 8 j + {0, 1}][g]; d[i] holds D[g + 8 (i / 2)][2t + i % 2].
// All 32 lanes call it together.
#define NKV_MMA_16816(TYPE)                                                             \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                   \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
// (A and B bf16 if kBf16: sm_80 and later)
template <bool kBf16>
NKV_DEVICE void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  if constexpr (kBf16)
    NKV_MMA_16816("bf16");
  else
    NKV_MMA_16816("f16");
}
#undef NKV_MMA_16816
NKV_DEVICE void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) { mma_16816<false>(d, a, b); }
// The same for one m16n8k8 tile (a[i] holds A[g + 8 i][2t + {0, 1}], b holds
// B[2t + {0, 1}][g]), A and B fp16, or bf16 if kBf16 (sm_80 and later).
#define NKV_MMA_1688(TYPE)                                                  \
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32." TYPE "." TYPE        \
               ".f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])             \
               : "r"(a[0]), "r"(a[1]), "r"(b))
template <bool kBf16>
NKV_DEVICE void mma_1688(float d[4], const uint32_t a[2], uint32_t b) {
  if constexpr (kBf16)
    NKV_MMA_1688("bf16");
  else
    NKV_MMA_1688("f16");
}
#undef NKV_MMA_1688

// D = A . B + D for one m16n8k32 tile of 8-bit integers: A u8 16x32
// row-major, B 32x8 column-major (s8 if kSignedB, else u8), D int32 (exact),
// in the PTX fragment layout: a[i] holds A[g + 8 (i % 2)][4t + 16 (i / 2) + j]
// in byte j; b[i] holds B[4t + 16 i + j][g] in byte j; d as mma_16816's.
// All 32 lanes call it together.
// (B's type, "s8" or "u8", spliced into the instruction: asm takes literals only)
#define NKV_MMA_16832_U8(BTYPE)                                                         \
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8." BTYPE                        \
               ".s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
#define NKV_MMA_16816_U8(BTYPE)                                  \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.u8." BTYPE \
               ".s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "         \
               "{%0, %1, %2, %3};\n"                             \
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])  \
               : "r"(a[0]), "r"(a[1]), "r"(b))
template <bool kSignedB>
NKV_DEVICE void mma_16832_u8(int32_t d[4], const uint32_t a[4], const uint32_t b[2]) {
  if constexpr (kSignedB)
    NKV_MMA_16832_U8("s8");
  else
    NKV_MMA_16832_U8("u8");
}
// The same for one m16n8k16 tile: a[i] holds A[g + 8 i][4t + j], b holds B[4t + j][g].
template <bool kSignedB>
NKV_DEVICE void mma_16816_u8(int32_t d[4], const uint32_t a[2], uint32_t b) {
  if constexpr (kSignedB)
    NKV_MMA_16816_U8("s8");
  else
    NKV_MMA_16816_U8("u8");
}
#undef NKV_MMA_16832_U8
#undef NKV_MMA_16816_U8

// kN (2 or 4) 8x8 matrices of 16-bit values from shared memory (ldmatrix):
// lane 8 i + r gives the shared address of matrix i's row r (16 bytes,
// 16-byte aligned; lanes past the matrices give any); m[i] of lane (g, t)
// gets matrix i's row g, elements 2t and 2t + 1 (the first in bits 0..15),
// or with kTrans its elements g of rows 2t and 2t + 1 (the transpose's row
// g).  All 32 lanes call it together.
#define NKV_LDMATRIX_X4(TRANS)                                                               \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4" TRANS ".shared.b16 {%0, %1, %2, %3}, [%4];\n" \
               : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])                              \
               : "r"(row))
#define NKV_LDMATRIX_X2(TRANS)                                                       \
  asm volatile("ldmatrix.sync.aligned.m8n8.x2" TRANS ".shared.b16 {%0, %1}, [%2];\n" \
               : "=r"(m[0]), "=r"(m[1])                                              \
               : "r"(row))
template <bool kTrans, int kN>
NKV_DEVICE void ldmatrix(uint32_t (&m)[kN], uint32_t row) {
  static_assert(kN == 2 || kN == 4, "ldmatrix takes 1, 2 or 4 matrices (1: not needed here)");
  if constexpr (kN == 4 && kTrans)
    NKV_LDMATRIX_X4(".trans");
  else if constexpr (kN == 4)
    NKV_LDMATRIX_X4("");
  else if constexpr (kTrans)
    NKV_LDMATRIX_X2(".trans");
  else
    NKV_LDMATRIX_X2("");
}
#undef NKV_LDMATRIX_X4
#undef NKV_LDMATRIX_X2

// The transpose of an 8x8 matrix of 16-bit values held by the warp in the
// fragment layout (lane 4 r + c holds row r, columns 2c and 2c + 1, the lower
// column in bits 0..15): lane 4 r + c gets rows 2c and 2c + 1 of column r
// (movmatrix, sm_75 and later).  All 32 lanes call it together.
NKV_DEVICE uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}
// 2^x in one MUFU.EX2 (ex2.approx.ftz: 2 ulp; a result below 2^-126 is 0;
// exactly 1 at 0, 0 at -inf, NaN for NaN), as FlashAttention's softmax.
NKV_DEVICE float fast_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// 1 / x in one MUFU.RCP (rcp.approx.ftz: 1 ulp; 1 / inf = 0).
NKV_DEVICE float fast_rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// The shared-window address of a pointer into shared memory (cp.async's
// operand).  The conversion costs ~5 instructions (S2R, LEA, ...) that the
// compiler does not hoist out of a tile's copies: loops take it once.
NKV_DEVICE uint32_t shared_address(const void* smem) { return uint32_t(__cvta_generic_to_shared(smem)); }

// Asynchronous 16-byte copy global -> shared, and its groups (cp.async).
NKV_DEVICE void cp_async16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}
NKV_DEVICE void cp_async16(void* smem, const void* gmem) { cp_async16(shared_address(smem), gmem); }
NKV_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `pending` committed groups of this thread are in flight.
template <int kPending>
NKV_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace nexuskv::cuda
#endif  // NKV_CUDA_EMULATION

namespace nexuskv::cuda {

// Bits of a float and back (the kernels' magic-number conversions): half.h's.
using core::bits_float;
using core::float_bits;

}  // namespace nexuskv::cuda
