// The paged kernels (paged_kernels.cuh, paged_mma_launch.cuh) for every stored dtype,
// and the choice between the two attention kernels.  Torch-free; the operators
// are registered by paged_cuda.cpp.
#include "paged_kernels.cuh"
#include "paged_mma_launch.cuh"

namespace nexuskv::cuda {

template <typename X>
PagedAttentionPlan paged_attention_plan(const core::PagedAttention<X>& p, int multiprocessors, bool allow_mma) {
  return allow_mma ? paged_mma_plan(p, multiprocessors) : PagedAttentionPlan{};
}

template <typename X>
int launch_paged_attention(const core::PagedAttention<X>& p, const PagedAttentionPlan& plan, uint8_t* scratch,
                           uint32_t* status, Stream stream) {
  if (p.num_tokens == 0) return 0;
  return plan.mma ? launch_paged_attention_mma(p, plan, scratch, status, stream)
                  : launch_paged_attention_simt(p, status, stream);
}

#define NEXUSKV_PAGED(X)                                                                                      \
  template void launch_paged_write<X>(const core::PagedWrite<X>&, uint8_t*, uint32_t*, Stream);               \
  template PagedAttentionPlan paged_attention_plan<X>(const core::PagedAttention<X>&, int, bool);             \
  template int launch_paged_attention<X>(const core::PagedAttention<X>&, const PagedAttentionPlan&, uint8_t*, \
                                         uint32_t*, Stream);                                                  \
  template void launch_paged_exact_write<X>(const core::PagedWrite<X>&, uint32_t*, Stream);
NEXUSKV_PAGED(float)
NEXUSKV_PAGED(half_t)
NEXUSKV_PAGED(bf16_t)
#undef NEXUSKV_PAGED

}  // namespace nexuskv::cuda
