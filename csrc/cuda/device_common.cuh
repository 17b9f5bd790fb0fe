// Device helpers shared by the kernels of csrc/cuda: float access to the three
// storage types, and the status word through which kernels report invalid
// input without a host synchronization.
#pragma once

#include <cstdint>

#include "nexuskv/core/half.h"
#include "nexuskv/core/nq_format.h"
#include "nexuskv/core/nq_index.h"
#include "simt.cuh"
#include "status.h"

namespace nexuskv::cuda {

using core::bf16_t;
using core::DType;
using core::half_t;

NKV_DEVICE void report(uint32_t* status, uint32_t bits) {
  if (status && bits) atomic_or(status, bits);
}

NKV_DEVICE bool non_finite(float v) { return (float_bits(v) & 0x7f800000u) == 0x7f800000u; }

// An element of one of the three float storage types as float, the dtype
// known at run time (uniform across a launch, so the switch costs no divergence).
NKV_DEVICE float load_as_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kFloat16: return core::half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16: return core::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// The storage types as float in the kernels' inner loops: exact, as
// core::to_float, with the hardware's fp16 converter.
NKV_DEVICE float fast_float(float v) { return v; }
NKV_DEVICE float fast_float(half_t v) { return half_bits_to_float(v.bits); }
NKV_DEVICE float fast_float(bf16_t v) { return bits_float(uint32_t(v.bits) << 16); }

// Lengths ([B] int32 or int64 on the device) read in the kernel.
NKV_DEVICE int64_t load_length(const void* p, bool is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(p)[i] : int64_t(static_cast<const int32_t*>(p)[i]);
}

// quiet NaN of a storage type (poisoned outputs).
template <typename T>
NKV_DEVICE T nan_of() {
  return core::from_float<T>(bits_float(0x7fc00000u));
}

// Segment (token group) of token t in one row of DGQ segment_starts [S]: the
// last s with starts[s] <= t (0 if none).  Works on any array: the answer is
// always in [0, S).  Defined in nq_index.h (host and device: tested on the CPU).
using core::find_segment;

}  // namespace nexuskv::cuda
