// Host side of the CUDA operators (ATen glue, compiled by the C++ compiler): device guard and
// stream, the status word of the kernels, and what the CUDA operators share.
//
// Value checks.  The shared argument checks (csrc/aten) look at shapes,
// dtypes and devices only.  Checks that need the data (NaN/Inf input, lengths
// within capacity, signs +-1, ordered segment starts, outlier positions) cost
// a device-to-host synchronization, which a decode step must not have; so the
// CUDA kernels check them on the device, never read out of bounds, and mark
// what they could not compute NaN (an output row, a group's scale).  With
// NEXUSKV_CUDA_CHECKS=1 in the environment the operators also read the kernels'
// status word after the launch and raise the CPU's errors (this synchronizes).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>
#include <cstring>

#include "attention_launch.h"
#include "launch.h"
#include "nexuskv/ops.h"
#include "status.h"

namespace nexuskv::cuda {

// NEXUSKV_CUDA_CHECKS=1: read back the kernels' status and raise (synchronizes).
inline bool value_checks_on() { return cuda_value_checks_requested(); }

// NEXUSKV_CUDA_ATTENTION=simple forces the reference kernels (dgq_fused_attention's
// and paged_attention's), =mma requires the tensor-core ones (an error if one does
// not take the problem; dgq_fused_attention's 16-row kernel, not its decode kernel),
// =decode dgq_fused_attention's decode kernel (paged_attention: as mma): the tests
// compare them and know which one ran.
inline KernelChoice kernel_choice(const char* op) {
  const char* v = std::getenv("NEXUSKV_CUDA_ATTENTION");
  if (v == nullptr || *v == 0) return KernelChoice::kAuto;
  if (std::strcmp(v, "simple") == 0) return KernelChoice::kSimple;
  if (std::strcmp(v, "mma") == 0) return KernelChoice::kMma;
  if (std::strcmp(v, "decode") == 0) return KernelChoice::kDecode;
  TORCH_CHECK(false, op, ": NEXUSKV_CUDA_ATTENTION must be simple, mma or decode, got '", v, "'");
}

// (c10's stream and guard only: ATen/cuda/CUDAContext.h pulls in cuBLAS and
// cuSPARSE headers, which a toolkit of just nvcc and the runtime lacks.)
inline Stream current_stream() { return c10::cuda::getCurrentCUDAStream(); }

// Multiprocessors of the current device (sizes the split of the key range).
inline int multiprocessor_count() {
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// The status word of one operator call: allocated (zeroed, on the stream) only
// when value checks are on; kernels get a null pointer otherwise.
class DeviceStatus {
 public:
  explicit DeviceStatus(const at::Tensor& like) {
    if (value_checks_on()) word_ = at::zeros({1}, like.options().dtype(at::kInt));
  }
  uint32_t* ptr() const { return word_.defined() ? reinterpret_cast<uint32_t*>(word_.data_ptr<int32_t>()) : nullptr; }
  // The bits the kernels reported (0 when checks are off); synchronizes.
  uint32_t read() const { return word_.defined() ? uint32_t(word_.item<int32_t>()) : 0u; }

 private:
  at::Tensor word_;
};

// x [..., T, D] as [N, T, D] without a copy when its leading dims can be
// flattened, else a contiguous copy (on the device, no synchronization).
inline at::Tensor rows_view(const at::Tensor& x, const core::NQDims& d) {
  return x.reshape({d.rows, d.tokens, d.head_dim});
}

}  // namespace nexuskv::cuda
