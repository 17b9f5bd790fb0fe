// The log-sum-exp merge of the split partials (attention_common.cuh), for each
// output type.  Torch-free; the operator is registered by attention_cuda.cpp.
#include "attention_common.cuh"

namespace nexuskv::cuda {

template int launch_attention_merge<float>(const MergeArgs&, float*, Stream);
template int launch_attention_merge<core::half_t>(const MergeArgs&, core::half_t*, Stream);
template int launch_attention_merge<core::bf16_t>(const MergeArgs&, core::bf16_t*, Stream);

}  // namespace nexuskv::cuda
