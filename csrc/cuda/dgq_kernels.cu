// The DGQ segment choice (dgq_segments.cuh) for every input type.  Torch-free;
// the operators are registered by dgq_cuda.cpp.
#include "dgq_segments.cuh"

namespace nexuskv::cuda {

template void launch_dgq_segments<float>(const RowsView<float>&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                         unsigned char*, int32_t*, uint32_t*, Stream);
template void launch_dgq_segments<half_t>(const RowsView<half_t>&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          unsigned char*, int32_t*, uint32_t*, Stream);
template void launch_dgq_segments<bf16_t>(const RowsView<bf16_t>&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          unsigned char*, int32_t*, uint32_t*, Stream);

}  // namespace nexuskv::cuda
