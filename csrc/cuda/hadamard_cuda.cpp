// CUDA kernel of hadamard_rotate: ATen glue over launch_hadamard (launch.h; kernel: hadamard.cuh).
#include <torch/library.h>

#include "../aten/attention_args.h"
#include "../aten/core_dispatch.h"
#include "../aten/nq_args.h"
#include "../cpu/value_checks.h"
#include "cuda_glue.h"
#include "launch.h"

namespace nexuskv {
namespace {

at::Tensor hadamard_rotate_cuda(const at::Tensor& x, const at::Tensor& signs, bool inverse) {
  constexpr const char* op = "hadamard_rotate";
  check_hadamard_args(x, signs);
  const int64_t n = x.size(-1);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), sc = signs.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  const int64_t rows = xc.numel() / n;
  TORCH_CHECK(rows < (int64_t(1) << 31), op, ": at most 2^31 - 1 rows on CUDA, got ", rows);
  at::Tensor scratch;
  if (n > cuda::kHadamardSmemMax) scratch = at::empty({rows, n}, xc.options().dtype(at::kFloat));
  const cuda::DeviceStatus status(x);
  dispatch_core_float(xc.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    cuda::launch_hadamard<T>(core_ptr<const T>(xc), rows, n, sc.data_ptr(), to_core_dtype(sc.scalar_type()), inverse,
                             core_ptr<T>(out), scratch.defined() ? scratch.data_ptr<float>() : nullptr, status.ptr(),
                             cuda::current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (status.read() & cuda::kBadSigns) check_rotation_sign_values(op, signs.to(at::kFloat).cpu().contiguous());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nexuskv, CUDA, m) { m.impl("hadamard_rotate", &hadamard_rotate_cuda); }

}  // namespace nexuskv
