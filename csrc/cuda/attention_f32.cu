// The fused-attention kernels for float queries, sinks and tail
// (attention_launch.h): one file per element type, so that they compile in parallel.
// Torch-free; the operator is registered by attention_cuda.cu.
#include "attention_kernels.cuh"

namespace nexuskv::cuda {

NEXUSKV_ATTENTION_INSTANCES(, float)

}  // namespace nexuskv::cuda
