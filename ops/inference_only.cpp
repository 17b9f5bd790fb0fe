// nexuskv operators are inference-only: they have no derivatives.  One boxed
// Autograd kernel serves every operator: it rejects inputs that require grad
// while grad mode is on (instead of silently returning outputs detached from
// the graph), then redispatches below autograd.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace nexuskv {
namespace {

bool requires_grad(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().defined() && v.toTensor().requires_grad();
  if (v.isTensorList())
    for (const at::Tensor& t : v.toTensorVector())
      if (t.defined() && t.requires_grad()) return true;
  return false;
}

void inference_only(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  if (at::GradMode::is_enabled()) {
    const size_t first = stack->size() - args.size();
    for (size_t i = 0; i < args.size(); ++i)
      TORCH_CHECK(!requires_grad((*stack)[first + i]), op.schema().name(),
                  " is inference-only (it has no derivative), but argument '", args[i].name(),
                  "' requires grad while grad mode is on; call it under torch.no_grad() or "
                  "torch.inference_mode(), or pass a detached tensor");
  }
  c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  op.callBoxed(stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(nexuskv, Autograd, m) {
  for (const char* name :
       {"nq_compress", "nq_decompress", "dgq_compress", "dgq_decompress", "dgq_fused_attention", "hadamard_rotate",
        "static_kv_append_", "paged_kv_write_", "paged_attention", "paged_exact_write_"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&inference_only>());
}

}  // namespace nexuskv
