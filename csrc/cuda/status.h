// The status word through which the CUDA kernels report invalid input without
// a host synchronization (device_common.cuh writes it, cuda_glue.h reads it).
#pragma once

#include <cstdint>

namespace nexuskv::cuda {

// Bits of the status word (uint32 on the device, zeroed by the caller).  A
// kernel ORs in what it saw; the host reads it only when value checks are on
// (cuda_glue.h), otherwise the kernels mark the affected outputs NaN.
enum StatusBit : uint32_t {
  kNonFiniteInput = 1u,   // NaN/Inf in the input of a compress
  kMetaOverflow = 2u,     // a scale or zero not finite in the meta dtype
  kRangeOverflow = 128u,  // a group's max - min not finite in float32
  kBadOutlierIndex = 4u,  // outlier_idx outside its group
  kBadSegments = 8u,      // segment_starts not ordered segments from 0 within [0, tokens]
  kBadLengths = 16u,      // a length outside [0, capacity], or q_len above a sequence's length
  kBadSigns = 32u,        // rotation signs not all +1 / -1
  kSegmentsUnmet = 64u,   // DGQ could not cut a row into its segments
  kBadSlot = 256u,        // paged: a slot_mapping entry outside [-1, num_slots) (that token is skipped)
  kBadBlock = 512u,       // paged: a block id read from block_table outside [0, num_blocks) (rows NaN)
};

}  // namespace nexuskv::cuda
