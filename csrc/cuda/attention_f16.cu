// The fused-attention kernels for half_t queries, sinks and tail
// (attention_launch.h): one file per element type, so that they compile in parallel.
// Torch-free; the operator is registered by attention_cuda.cu.
#include "attention_kernels.cuh"

namespace nexuskv::cuda {

NEXUSKV_ATTENTION_INSTANCES(, core::half_t)

}  // namespace nexuskv::cuda
