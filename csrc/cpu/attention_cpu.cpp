// CPU kernels of dgq_fused_attention and hadamard_rotate: ATen glue over the
// torch-free core (csrc/core/attention*.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../aten/attention_args.h"
#include "nexuskv/core/attention.h"

namespace nexuskv {
namespace {

// Allocates only the output and per-task partials (rows x (head_dim + 2)
// floats per task, tasks bounded by the thread count): nothing grows with the
// context length.
at::Tensor dgq_fused_attention_cpu(const at::Tensor& q, at::TensorList k_cache, at::TensorList v_cache,
                                   at::IntArrayRef k_format, at::IntArrayRef v_format,
                                   const at::Tensor& compressed_lens, const std::optional<at::Tensor>& k_tail,
                                   const std::optional<at::Tensor>& v_tail, const std::optional<at::Tensor>& tail_lens,
                                   const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                                   const std::optional<at::Tensor>& k_sink, const std::optional<at::Tensor>& v_sink,
                                   const std::optional<at::Tensor>& sink_lens, std::optional<int64_t> window,
                                   std::optional<double> softcap) {
  const AttentionInputs in = attention_inputs(q, k_cache, v_cache, k_format, v_format, compressed_lens, k_tail,
                                              v_tail, tail_lens, rotation_signs, scale, k_sink, v_sink, sink_lens,
                                              window, softcap);
  const core::AttentionProblem& p = in.problem;
  const int64_t pairs = p.batch * p.kv_heads;
  const int64_t splits = core::attention_num_splits(p, 4 * at::get_num_threads());
  at::Tensor partials = at::empty({pairs * splits * core::partial_floats(p)}, q.options().dtype(at::kFloat));
  at::parallel_for(0, pairs * splits, 1, [&](int64_t begin, int64_t end) {
    core::attention_tasks(p, splits, partials.data_ptr<float>(), begin, end);
  });
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    core::attention_merge(p, splits, partials.data_ptr<float>(), out.data_ptr<float>(), begin, end);
  });
  return out.to(q.scalar_type());
}

at::Tensor hadamard_rotate_cpu(const at::Tensor& x, const at::Tensor& signs, bool inverse) {
  TORCH_CHECK(x.dim() >= 1 && x.numel() > 0, "hadamard_rotate: x must be a non-empty tensor [..., n], got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "hadamard_rotate: x must be float32, float16 or bfloat16, got ", x.scalar_type());
  const int64_t n = x.size(-1);
  check_rotation_signs("hadamard_rotate", signs, n);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sf = signs.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(xf);
  const int64_t rows = xf.numel() / n;
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / n), [&](int64_t begin, int64_t end) {
    core::hadamard_rotate_rows(xf.data_ptr<float>() + begin * n, out.data_ptr<float>() + begin * n, end - begin, n,
                               sf.data_ptr<float>(), inverse);
  });
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(nexuskv, CPU, m) {
  m.impl("dgq_fused_attention", &dgq_fused_attention_cpu);
  m.impl("hadamard_rotate", &hadamard_rotate_cpu);
}

}  // namespace nexuskv
