// simt.cuh's constructs on the host, so that a C++ compiler runs the kernels
// of csrc/cuda where no GPU is (NKV_CUDA_EMULATION; tests/cpp/test_cuda_emulated.cpp).
// A block is blockDim.x std::threads, one per CUDA thread, blocks one after
// another; every warp collective (shuffle, mma, movmatrix, __syncwarp) and
// block barrier is a std::barrier of the warp's 32 / the block's threads, and
// the PTX instructions compute what their documentation says (mma.sync's
// fragment layouts, movmatrix's transpose, cp.async as a synchronous copy).
// What it checks: indices, fragment layouts, the arithmetic, the barriers'
// placement where a missing one changes results (not data races of copies in
// flight: cp.async completes at once); not speed, and not the hardware's own
// rounding (sums in float, exp2 / reciprocal exactly).
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "launch.h"
#include "nexuskv/core/half.h"

// ---- CUDA's names ---------------------------------------------------------------------------

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
using cudaError_t = int;
constexpr int cudaSuccess = 0, cudaErrorInvalidConfiguration = 9, cudaErrorInvalidDeviceFunction = 98;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

namespace nexuskv::cuda::emu {

struct Index {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Index thread_index, block_index;
inline dim3 block_dim, grid_dim;

// One warp's exchange: each lane's words, and the warp's barrier.
struct Warp {
  std::barrier<> bar{32};
  uint32_t word[32][6] = {};
};
struct Block {
  std::barrier<> bar;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<uint4> smem;  // dynamic shared memory, 16-byte aligned
  explicit Block(int threads, size_t bytes) : bar(threads), smem((bytes + 15) / 16 + 1) {
    for (int w = 0; w < (threads + 31) / 32; ++w) warps.push_back(std::make_unique<Warp>());
  }
};
inline Block* block = nullptr;  // the block running (one at a time)

// Paths the kernels took (NKV_EMU_COUNT), for the tests to assert that the one they mean ran.
struct Counters {
  std::atomic<int64_t> decode_steady{0};        // paged_decode.cuh: warp iterations of the steady loop
  std::atomic<int64_t> decode_normalizer{0};    // ... handed to the edge's copy: their value scales move vup
  std::atomic<int64_t> paged_tile_blocks{0};    // paged kernels' blocks with rows, by row tiles (tile_start)
  std::atomic<int64_t> paged_single_blocks{0};  // ... one a request of one token (PagedRequests::kSingleToken)
};
inline Counters counters;

inline int lane() { return int(thread_index.x) % 32; }
inline Warp& warp() { return *block->warps[size_t(thread_index.x / 32)]; }
inline unsigned char* dynamic_smem() { return reinterpret_cast<unsigned char*>(block->smem.data()); }

// Each lane puts n words, the warp meets, f reads any lane's (word[lane][i]), the warp meets again.
template <typename F>
inline void exchange(const uint32_t* mine, int n, F&& f) {
  Warp& w = warp();
  std::memcpy(w.word[lane()], mine, sizeof(uint32_t) * size_t(n));
  w.bar.arrive_and_wait();
  f(w.word);
  w.bar.arrive_and_wait();
}
template <typename T>
inline T shuffle(T v, int src) {
  static_assert(sizeof(T) == 4, "32-bit shuffles");
  uint32_t bits, out;
  std::memcpy(&bits, &v, 4);
  exchange(&bits, 1, [&](const uint32_t(*word)[6]) { out = word[src & 31][0]; });
  T r;
  std::memcpy(&r, &out, 4);
  return r;
}
// Element j (0 or 1) of a register of two fp16 values, as float.
inline float half_of(uint32_t r, int j) { return core::half_to_float(uint16_t(j ? r >> 16 : r & 0xffffu)); }

// Runs kernel(args...) over the grid, a block at a time, on blockDim.x threads
// made once per launch (each block: the pool meets at `start`, runs the
// kernel, meets at `done`).  Shared memory is not cleared between blocks, as
// on a GPU.
template <typename... Params, typename... Args>
void run(void (*kernel)(Params...), dim3 grid, dim3 threads, size_t smem, Args... args) {
  grid_dim = grid, block_dim = threads;
  const int n = int(threads.x);
  Block b(n, smem);
  block = &b;
  std::barrier<> start(n + 1), done(n + 1);
  Index current;
  bool stop = false;
  std::vector<std::thread> pool;
  for (int t = 0; t < n; ++t)
    pool.emplace_back([&, t] {
      thread_index = {unsigned(t), 0, 0};
      for (;;) {
        start.arrive_and_wait();
        if (stop) return;
        block_index = current;
        kernel(args...);
        done.arrive_and_wait();
      }
    });
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        current = {x, y, z};
        start.arrive_and_wait();
        done.arrive_and_wait();
      }
  stop = true;
  start.arrive_and_wait();
  for (auto& th : pool) th.join();
  block = nullptr;
}

}  // namespace nexuskv::cuda::emu

#define threadIdx (::nexuskv::cuda::emu::thread_index)
#define blockIdx (::nexuskv::cuda::emu::block_index)
#define blockDim (::nexuskv::cuda::emu::block_dim)
#define gridDim (::nexuskv::cuda::emu::grid_dim)
#define __shared__ static
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __expf(x) std::exp(x)
inline void __syncwarp() { ::nexuskv::cuda::emu::warp().bar.arrive_and_wait(); }
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
  return ::nexuskv::cuda::emu::shuffle(v, src);
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  return ::nexuskv::cuda::emu::shuffle(v, ::nexuskv::cuda::emu::lane() ^ mask);
}

namespace nexuskv::cuda {

constexpr int kWarp = 32;
constexpr size_t kDefaultSmem = 48 << 10;
constexpr int64_t kMaxGridY = 65535;

#define NKV_KERNEL
#define NKV_DEVICE inline
#define NKV_HOST_DEVICE inline
#define NKV_SYNC() ::nexuskv::cuda::emu::block->bar.arrive_and_wait()
#define NKV_GRID_CONSTANT
#define NKV_DYNAMIC_SMEM(name) unsigned char* const name = ::nexuskv::cuda::emu::dynamic_smem()
#define NKV_EMU_COUNT(name, cond) ((cond) ? void(::nexuskv::cuda::emu::counters.name.fetch_add(1)) : void())
using Dim3 = dim3;

// (the host compiler is asked for no contraction: -ffp-contract=off)
inline float mul_rn(float a, float b) { return a * b; }
inline float add_rn(float a, float b) { return a + b; }
inline float sub_rn(float a, float b) { return a - b; }
inline float div_rn(float a, float b) { return a / b; }
inline double dmul_rn(double a, double b) { return a * b; }
inline double dadd_rn(double a, double b) { return a + b; }
inline double dsub_rn(double a, double b) { return a - b; }

inline float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
inline uint32_t shfl_xor(uint32_t v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
inline float shfl(float v, int src) { return __shfl_sync(0xffffffffu, v, src); }
inline bool any_lane(bool p) {
  const uint32_t mine = p ? 1u : 0u;
  bool any = false;
  emu::exchange(&mine, 1, [&](const uint32_t(*word)[6]) {
    for (int l = 0; l < 32; ++l) any = any || word[l][0] != 0;
  });
  return any;
}

inline uint32_t atomic_or(uint32_t* p, uint32_t v) { return std::atomic_ref<uint32_t>(*p).fetch_or(v); }
inline float atomic_add(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline int32_t atomic_max(int32_t* p, int32_t v) {
  std::atomic_ref<int32_t> a(*p);
  int32_t old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {}
  return old;
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), Dim3 grid, Dim3 block, size_t smem, Stream, Args... args) {
  emu::run(kernel, grid, block, smem, Params(args)...);
}
template <typename... Params>
cudaError_t allow_smem(void (*)(Params...), size_t) {
  return cudaSuccess;
}
// (an H100's answer for the kernels' usual size; the plan only sizes its splits with it)
template <typename... Params>
int blocks_per_sm(void (*)(Params...), int, size_t) {
  return 4;
}

inline float max_abs_nan(float a, float b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<float>::quiet_NaN() : std::fmax(a, std::fabs(b));
}
inline uint32_t byte_perm(uint32_t lo, uint32_t hi, uint32_t selector) {
  const uint64_t x = (uint64_t(hi) << 32) | lo;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((x >> (8 * ((selector >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
}
inline float half_bits_to_float(uint16_t h) { return core::half_to_float(h); }
inline uint32_t pack_half2(float lo, float hi) {
  return uint32_t(core::float_to_half(lo)) | (uint32_t(core::float_to_half(hi)) << 16);
}
inline uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) { return (a & b) | c; }
inline uint32_t half2_unbias(uint32_t h, int shift) {
  const float down = std::ldexp(1.f, -shift), bias = -std::ldexp(1.f, 10 - shift);
  return pack_half2(std::fma(emu::half_of(h, 0), down, bias), std::fma(emu::half_of(h, 1), down, bias));
}
// Elementwise max (kMax) or min of two pairs of 16-bit floats (simt.cuh's): a
// NaN gives the other value; the bits of the operand chosen.
template <bool kBf16, bool kMax>
inline uint32_t pair_pick(uint32_t a, uint32_t b) {
  uint32_t r = 0;
  for (int j = 0; j < 2; ++j) {
    const uint16_t x = uint16_t(a >> (16 * j)), y = uint16_t(b >> (16 * j));
    const float fx = kBf16 ? core::bf16_to_float(x) : core::half_to_float(x);
    const float fy = kBf16 ? core::bf16_to_float(y) : core::half_to_float(y);
    const bool take_y = std::isnan(fx) || (!std::isnan(fy) && (kMax ? fy > fx : fy < fx));
    r |= uint32_t(take_y ? y : x) << (16 * j);
  }
  return r;
}
template <bool kBf16>
inline uint32_t pair_abs(uint32_t a) {
  return a & 0x7fff7fffu;
}
// d[i] += sum_k A[g + 8 (i / 2)][k] B[k][2t + i % 2] (simt.cuh's layout), in
// float, k < kK (16 or 8); A and B fp16 (kBf16: bf16).
namespace emu {
template <bool kBf16, int kK = 16>
inline void mma_16bit(float d[4], const uint32_t* a, const uint32_t* b) {
  constexpr int kA = kK / 4, kB = kK / 8;  // registers of A and B
  uint32_t mine[6] = {};
  for (int i = 0; i < kA; ++i) mine[i] = a[i];
  for (int i = 0; i < kB; ++i) mine[kA + i] = b[i];
  const int g = lane() / 4, t = lane() % 4;
  const auto value = [](uint32_t w, int j) {
    return kBf16 ? core::bf16_to_float(uint16_t(j ? w >> 16 : w & 0xffffu)) : half_of(w, j);
  };
  float out[4];
  exchange(mine, kA + kB, [&](const uint32_t(*word)[6]) {
    for (int i = 0; i < 4; ++i) {
      const int r = g + 8 * (i / 2), n = 2 * t + i % 2;
      float s = d[i];
      for (int k = 0; k < kK; ++k) {
        const float av = value(word[4 * (r % 8) + (k % 8) / 2][r / 8 + 2 * (k / 8)], k % 2);
        const float bv = value(word[4 * n + (k % 8) / 2][kA + k / 8], k % 2);
        s += av * bv;
      }
      out[i] = s;
    }
  });
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
}  // namespace emu
inline void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) { emu::mma_16bit<false>(d, a, b); }
template <bool kBf16>
inline void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  emu::mma_16bit<kBf16>(d, a, b);
}
template <bool kBf16>
inline void mma_1688(float d[4], const uint32_t a[2], uint32_t b) {
  emu::mma_16bit<kBf16, 8>(d, a, &b);
}
// The integer MMAs (simt.cuh's layouts): d[i] += sum_k A[g + 8 (i / 2)][k] B[k][2t + i % 2], exact.
namespace emu {
template <bool kSignedB, int kK>
inline void mma_u8(int32_t d[4], const uint32_t* a, const uint32_t* b) {
  constexpr int kA = kK / 8, kB = kK / 16;  // registers of A and B
  uint32_t mine[6] = {};
  for (int i = 0; i < kA; ++i) mine[i] = a[i];
  for (int i = 0; i < kB; ++i) mine[kA + i] = b[i];
  const int g = lane() / 4, t = lane() % 4;
  int32_t out[4];
  exchange(mine, kA + kB, [&](const uint32_t(*word)[6]) {
    const auto byte = [](uint32_t w, int j) { return (w >> (8 * j)) & 0xffu; };
    for (int i = 0; i < 4; ++i) {
      const int r = g + 8 * (i / 2), n = 2 * t + i % 2;
      int64_t s = d[i];
      for (int k = 0; k < kK; ++k) {
        const int av = int(byte(word[4 * (r % 8) + (k % 16) / 4][r / 8 + 2 * (k / 16)], k % 4));
        const uint32_t bb = byte(word[4 * n + (k % 16) / 4][kA + k / 16], k % 4);
        const int bv = kSignedB ? int(int8_t(uint8_t(bb))) : int(bb);
        s += int64_t(av) * bv;
      }
      out[i] = int32_t(uint32_t(uint64_t(s)));  // (the hardware wraps; the kernels stay in range)
    }
  });
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}
}  // namespace emu
template <bool kSignedB>
inline void mma_16832_u8(int32_t d[4], const uint32_t a[4], const uint32_t b[2]) {
  emu::mma_u8<kSignedB, 32>(d, a, b);
}
template <bool kSignedB>
inline void mma_16816_u8(int32_t d[4], const uint32_t a[2], uint32_t b) {
  emu::mma_u8<kSignedB, 16>(d, a, &b);
}
template <bool kTrans, int kN>
inline void ldmatrix(uint32_t (&m)[kN], uint32_t row) {
  const int g = emu::lane() / 4, t = emu::lane() % 4;
  emu::exchange(&row, 1, [&](const uint32_t(*word)[6]) {
    for (int i = 0; i < kN; ++i) {
      const auto elem = [&](int r, int c) {  // matrix i's row r, element c
        uint16_t v;
        std::memcpy(&v, emu::dynamic_smem() + word[8 * i + r][0] + 2 * c, 2);
        return uint32_t(v);
      };
      m[i] = kTrans ? elem(2 * t, g) | elem(2 * t + 1, g) << 16 : elem(g, 2 * t) | elem(g, 2 * t + 1) << 16;
    }
  });
}
inline uint32_t movmatrix_trans(uint32_t x) {
  const int g = emu::lane() / 4, t = emu::lane() % 4;
  uint32_t r = 0;
  emu::exchange(&x, 1, [&](const uint32_t(*word)[6]) {
    // M[i][j] is half j % 2 of lane 4 i + j / 2's word; lane (g, t) gets M[2t][g], M[2t + 1][g].
    const auto m = [&](int i, int j) { return (word[4 * i + j / 2][0] >> (16 * (j % 2))) & 0xffffu; };
    r = m(2 * t, g) | (m(2 * t + 1, g) << 16);
  });
  return r;
}
inline float fast_exp2(float x) { return std::exp2(x); }
inline float fast_rcp(float x) { return 1.f / x; }

inline uint32_t shared_address(const void* smem) {
  return uint32_t(static_cast<const unsigned char*>(smem) - emu::dynamic_smem());
}
inline void cp_async16(uint32_t smem, const void* gmem) { std::memcpy(emu::dynamic_smem() + smem, gmem, 16); }
inline void cp_async16(void* smem, const void* gmem) { std::memcpy(smem, gmem, 16); }
inline void cp_async_commit() {}
template <int kPending>
inline void cp_async_wait() {}

}  // namespace nexuskv::cuda
