// The Hadamard rotation kernel (hadamard.cuh) for every element type.
// Torch-free; the operator is registered by hadamard_cuda.cpp.
#include "hadamard.cuh"

namespace nexuskv::cuda {

template void launch_hadamard<float>(const float*, int64_t, int64_t, const void*, DType, bool, float*, float*,
                                     uint32_t*, Stream);
template void launch_hadamard<half_t>(const half_t*, int64_t, int64_t, const void*, DType, bool, half_t*, float*,
                                      uint32_t*, Stream);
template void launch_hadamard<bf16_t>(const bf16_t*, int64_t, int64_t, const void*, DType, bool, bf16_t*, float*,
                                      uint32_t*, Stream);

}  // namespace nexuskv::cuda
