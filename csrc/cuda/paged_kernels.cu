// The paged kernels (paged_kernels.cuh) for every stored dtype.  Torch-free;
// the operators are registered by paged_cuda.cpp.
#include "paged_kernels.cuh"

namespace nexuskv::cuda {

#define NEXUSKV_PAGED(X)                                                                        \
  template void launch_paged_write<X>(const core::PagedWrite<X>&, uint8_t*, uint32_t*, Stream); \
  template int launch_paged_attention<X>(const core::PagedAttention<X>&, uint32_t*, Stream);    \
  template void launch_paged_exact_write<X>(const core::PagedWrite<X>&, uint32_t*, Stream);
NEXUSKV_PAGED(float)
NEXUSKV_PAGED(half_t)
NEXUSKV_PAGED(bf16_t)
#undef NEXUSKV_PAGED

}  // namespace nexuskv::cuda
