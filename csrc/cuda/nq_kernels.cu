// The NQ compress / decompress kernels (nq_compress.cuh, nq_decompress.cuh)
// for every type pair the glue dispatches to.  Torch-free; the operators are
// registered by nq_cuda.cpp.
#include "nq_compress.cuh"
#include "nq_decompress.cuh"

namespace nexuskv::cuda {

#define NEXUSKV_NQ_COMPRESS(In, Meta) \
  template void launch_nq_compress<In, Meta>(const NQCompressArgs<In, Meta>&, Stream);
NEXUSKV_NQ_COMPRESS(float, float)
NEXUSKV_NQ_COMPRESS(float, half_t)
NEXUSKV_NQ_COMPRESS(float, bf16_t)
NEXUSKV_NQ_COMPRESS(half_t, float)
NEXUSKV_NQ_COMPRESS(half_t, half_t)
NEXUSKV_NQ_COMPRESS(half_t, bf16_t)
NEXUSKV_NQ_COMPRESS(bf16_t, float)
NEXUSKV_NQ_COMPRESS(bf16_t, half_t)
NEXUSKV_NQ_COMPRESS(bf16_t, bf16_t)
#undef NEXUSKV_NQ_COMPRESS

template void launch_nq_decompress<float>(const NQDecompressArgs&, float*, Stream);
template void launch_nq_decompress<half_t>(const NQDecompressArgs&, half_t*, Stream);
template void launch_nq_decompress<bf16_t>(const NQDecompressArgs&, bf16_t*, Stream);

}  // namespace nexuskv::cuda
