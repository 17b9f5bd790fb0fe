// Division by a run-time constant without a divide instruction: one high multiply,
// one add and one shift.  GPUs have no integer divider: `/` and `%` on int64_t
// compile to a ~70-instruction subroutine call each (what the NQ kernels did per
// element, benchmarks/cuda_budget.py counts them), on int32 to ~20 instructions.
//
// Method (Granlund & Montgomery, "Division by invariant integers using
// multiplication", PLDI 1994, the round-up variant): for a divisor 1 <= d < 2^31
// let l = ceil(log2 d) and m = floor(2^32 * (2^l - d) / d) + 1 (< 2^32); then for
// every 0 <= n < 2^31, n / d = (mulhi(n, m) + n) >> l, and the sum cannot
// overflow 32 bits because mulhi(n, m) <= n.  Torch-free, host and device
// (tests/cpp/test_nq_index.cpp checks it against `/` and `%`).
#pragma once

#include <cstdint>

#include "hd.h"

namespace nexuskv::core {

struct FastDivmod {
  uint32_t divisor = 1, multiplier = 1, shift = 0;

  // Host and device; d must be in [1, 2^31) (callers check their sizes).
  NEXUSKV_HD FastDivmod() = default;
  NEXUSKV_HD explicit FastDivmod(int64_t d) : divisor(uint32_t(d)) {
    while ((uint64_t(1) << shift) < uint64_t(d)) ++shift;
    multiplier = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - uint64_t(d))) / uint64_t(d) + 1);
  }

  // n / divisor for 0 <= n < 2^31.
  NEXUSKV_HD_INLINE uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(n, multiplier);
#else
    const uint32_t hi = uint32_t((uint64_t(n) * multiplier) >> 32);
#endif
    return (hi + n) >> shift;
  }
  // q = n / divisor, r = n % divisor for 0 <= n < 2^31.
  NEXUSKV_HD_INLINE void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = div(n);
    r = n - q * divisor;
  }
};

// Largest dividend FastDivmod takes.
constexpr int64_t kFastDivmodLimit = (int64_t(1) << 31) - 1;

}  // namespace nexuskv::core
