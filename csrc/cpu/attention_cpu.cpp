// CPU kernels of dgq_fused_attention and hadamard_rotate: the shared checks
// (csrc/aten/attention_args.h), the CPU's conversions and value checks, then
// the torch-free core (csrc/core/attention*.cpp) under at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../aten/attention_args.h"
#include "../aten/core_dispatch.h"
#include "nexuskv/core/attention.h"
#include "value_checks.h"

namespace nexuskv {
namespace {

constexpr const char* kOp = "dgq_fused_attention";

std::optional<at::Tensor> to_float_rows(const std::optional<at::Tensor>& t) {
  if (!t) return std::nullopt;
  return t->to(at::kFloat).contiguous();
}

// The compressed buffers contiguous, with K's and V's metadata in one dtype
// and their outlier values in one dtype (the kernel is instantiated per
// (meta, value) pair): where K and V differ, both are widened to float32,
// which is exact, so the results are those of the buffers as given.
void contiguous_caches(at::TensorList k_in, at::TensorList v_in, std::vector<at::Tensor>& k,
                       std::vector<at::Tensor>& v) {
  for (const at::Tensor& t : k_in) k.push_back(t.contiguous());
  for (const at::Tensor& t : v_in) v.push_back(t.contiguous());
  if (k[1].scalar_type() != v[1].scalar_type())
    for (auto* c : {&k, &v}) (*c)[1] = (*c)[1].to(at::kFloat), (*c)[2] = (*c)[2].to(at::kFloat);
  if (k[4].scalar_type() != v[4].scalar_type())
    for (auto* c : {&k, &v}) (*c)[4] = (*c)[4].to(at::kFloat);
}

template <typename Meta, typename Val>
at::Tensor run_attention(const core::CpuAttentionParams<Meta, Val>& p, const at::TensorOptions& float_opts) {
  const int64_t pairs = p.batch * p.kv_heads;
  // Only the output and per-task partials (rows x (head_dim + 2) floats per
  // task, tasks bounded by the thread count) are allocated: nothing grows with
  // the context length.
  const int64_t splits = core::attention_num_splits(p, 4 * at::get_num_threads());
  at::Tensor partials = at::empty({pairs * splits * core::partial_floats(p)}, float_opts);
  at::parallel_for(0, pairs * splits, 1, [&](int64_t begin, int64_t end) {
    core::attention_tasks(p, splits, partials.data_ptr<float>(), begin, end);
  });
  at::Tensor out = at::empty({p.batch, p.q_heads, p.q_len, p.head_dim}, float_opts);
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    core::attention_merge(p, splits, partials.data_ptr<float>(), out.data_ptr<float>(), begin, end);
  });
  return out;
}

at::Tensor dgq_fused_attention_cpu(const at::Tensor& q, at::TensorList k_cache, at::TensorList v_cache,
                                   at::IntArrayRef k_format, at::IntArrayRef v_format,
                                   const at::Tensor& compressed_lens, const std::optional<at::Tensor>& k_tail,
                                   const std::optional<at::Tensor>& v_tail, const std::optional<at::Tensor>& tail_lens,
                                   const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                                   const std::optional<at::Tensor>& k_sink, const std::optional<at::Tensor>& v_sink,
                                   const std::optional<at::Tensor>& sink_lens, std::optional<int64_t> window,
                                   std::optional<double> softcap) {
  const AttentionShapes s =
      check_attention_args(q, k_cache, v_cache, k_format, v_format, compressed_lens, k_tail, v_tail, tail_lens,
                           rotation_signs, scale, k_sink, v_sink, sink_lens, window, softcap);
  // What the CPU kernel reads: q, sinks and tail as float32 rows, contiguous
  // buffers and lengths, float32 signs (checked to be +-1).
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const std::optional<at::Tensor> kt = to_float_rows(k_tail), vt = to_float_rows(v_tail);
  const std::optional<at::Tensor> ks = to_float_rows(k_sink), vs = to_float_rows(v_sink);
  const at::Tensor lens = compressed_lens.contiguous();
  const std::optional<at::Tensor> tl = tail_lens ? std::optional(tail_lens->contiguous()) : std::nullopt;
  const std::optional<at::Tensor> sl = sink_lens ? std::optional(sink_lens->contiguous()) : std::nullopt;
  std::optional<at::Tensor> signs;
  if (rotation_signs) {
    signs = rotation_signs->to(at::kFloat).contiguous();
    check_rotation_sign_values(kOp, *signs);
  }
  std::vector<at::Tensor> kc, vc;
  contiguous_caches(k_cache, v_cache, kc, vc);
  at::Tensor out;
  dispatch_core_float(kc[1].scalar_type(), kOp, [&](auto meta_tag) {
    dispatch_core_float(kc[4].scalar_type(), kOp, [&](auto val_tag) {
      using Meta = decltype(meta_tag);
      using Val = decltype(val_tag);
      const auto p = make_attention_params<float, Meta, Val>(s, qf, kc, vc, lens, kt, vt, tl, ks, vs, sl, signs);
      check_attention_values(kOp, p);
      out = run_attention(p, qf.options());
    });
  });
  return out.to(q.scalar_type());
}

at::Tensor hadamard_rotate_cpu(const at::Tensor& x, const at::Tensor& signs, bool inverse) {
  check_hadamard_args(x, signs);
  const int64_t n = x.size(-1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sf = signs.to(at::kFloat).contiguous();
  check_rotation_sign_values("hadamard_rotate", sf);
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
