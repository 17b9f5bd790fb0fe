// CUDA kernel of dgq_fused_attention: ATen glue over launch_attention and
// launch_attention_merge (attention_launch.h; kernels: attention_simple.cuh for
// every format, attention_mma.cuh on tensor cores for the common ones, the
// merge in attention_common.cuh).  Design: attention_mma.cuh.
//
// No host synchronization: the shared checks (csrc/aten/attention_args.h)
// read sizes, dtypes and devices only, the lengths stay on the device (int32
// or int64 as given), the grid is sized from capacities, and what needs the
// data to be checked is checked by the kernels (cuda_glue.h).  Inputs are used
// in place where their layout allows; q, sinks and tail are converted (on the
// device) only when their dtypes differ from each other or from the outlier
// values, to float32, which is exact.
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "../aten/attention_args.h"
#include "../aten/core_dispatch.h"
#include "../aten/nq_args.h"
#include "../cpu/value_checks.h"
#include "attention_launch.h"
#include "cuda_glue.h"
#include "nexuskv/core/split_plan.h"

namespace nexuskv {
namespace {

constexpr const char* kOp = "dgq_fused_attention";

// Channels contiguous (the params' DenseRows contract), dtype t.
at::Tensor rows_in(const at::Tensor& x, at::ScalarType t) {
  at::Tensor y = x.to(t);
  return y.stride(-1) == 1 ? y : y.contiguous();
}
std::optional<at::Tensor> rows_in(const std::optional<at::Tensor>& x, at::ScalarType t) {
  return x ? std::optional(rows_in(*x, t)) : std::nullopt;
}
std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& x) {
  return x ? std::optional(x->contiguous()) : std::nullopt;
}
std::optional<at::Tensor> on_cpu(const std::optional<at::Tensor>& x) {
  return x ? std::optional(x->cpu()) : std::nullopt;
}

// The split plan (core::plan_splits) of the last call on this thread: a decode
// step asks the same for every layer.
core::SplitPlan cached_split_plan(int64_t units, int64_t slots, int64_t keys, int64_t tile) {
  struct Last {
    int64_t units = -1, slots = 0, keys = 0, tile = 0;
    core::SplitPlan plan;
  };
  static thread_local Last last;
  if (last.units != units || last.slots != slots || last.keys != keys || last.tile != tile)
    last = {units, slots, keys, tile, core::plan_splits(units, slots, keys, tile)};
  return last.plan;
}

using cuda::KernelChoice;

at::Tensor dgq_fused_attention_cuda(const at::Tensor& q_in, at::TensorList k_cache, at::TensorList v_cache,
                                    at::IntArrayRef k_format, at::IntArrayRef v_format,
                                    const at::Tensor& compressed_lens, const std::optional<at::Tensor>& k_tail,
                                    const std::optional<at::Tensor>& v_tail, const std::optional<at::Tensor>& tail_lens,
                                    const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                                    const std::optional<at::Tensor>& k_sink, const std::optional<at::Tensor>& v_sink,
                                    const std::optional<at::Tensor>& sink_lens, std::optional<int64_t> window,
                                    std::optional<double> softcap) {
  const AttentionShapes shapes =
      check_attention_args(q_in, k_cache, v_cache, k_format, v_format, compressed_lens, k_tail, v_tail, tail_lens,
                           rotation_signs, scale, k_sink, v_sink, sink_lens, window, softcap);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t B = shapes.batch, Hq = shapes.q_heads, Hkv = shapes.kv_heads, Lq = shapes.q_len, D = shapes.head_dim;

  // Working types: the element type T of q, sinks, tail and outlier values
  // (AttentionParams<T, Meta, Val = T>) and the meta type shared by K and V;
  // where they differ, float32 (exact).
  std::vector<at::ScalarType> elems{q_in.scalar_type(), k_cache[4].scalar_type(), v_cache[4].scalar_type()};
  for (const auto* t : {&k_tail, &v_tail, &k_sink, &v_sink})
    if (*t) elems.push_back((*t)->scalar_type());
  at::ScalarType elem = elems[0];
  for (at::ScalarType t : elems) elem = t == elem ? elem : at::kFloat;
  const at::ScalarType meta =
      k_cache[1].scalar_type() == v_cache[1].scalar_type() ? k_cache[1].scalar_type() : at::kFloat;
  std::vector<at::Tensor> kc, vc;
  for (auto [in, out] : {std::pair{k_cache, &kc}, std::pair{v_cache, &vc}}) {
    for (const at::Tensor& t : in) out->push_back(t.contiguous());
    (*out)[1] = (*out)[1].to(meta), (*out)[2] = (*out)[2].to(meta), (*out)[4] = (*out)[4].to(elem);
  }
  const at::Tensor q = rows_in(q_in, elem), lens = compressed_lens.contiguous();
  const auto kt = rows_in(k_tail, elem), vt = rows_in(v_tail, elem), ks = rows_in(k_sink, elem),
             vs = rows_in(v_sink, elem);
  const auto tl = contiguous(tail_lens), sl = contiguous(sink_lens);
  const std::optional<at::Tensor> signs =
      rotation_signs ? std::optional(rotation_signs->to(at::kFloat).contiguous()) : std::nullopt;

  // Work split.  Row tiles: kAttnRows query rows of one kv head per block.
  // Splits of the key range: planned from the GPU's block slots for the kernel
  // that runs (core::plan_splits, below), over the keys a row can see at most
  // (lengths are on the device: sized from the capacities and the window).
  const int64_t row_tiles = core::ceil_div((Hq / Hkv) * Lq, cuda::kAttnRows);
  const int64_t capacity = shapes.sink_capacity + std::min(shapes.k.tokens, shapes.v.tokens) + shapes.tail_capacity;
  const int64_t visible = shapes.window ? std::min(capacity, shapes.window + Lq - 1) : capacity;
  const int64_t blocks = B * Hkv * row_tiles;
  TORCH_CHECK(Hkv * row_tiles < 65536 && B < 65536, kOp, ": batch (", B, ") and kv_heads x row tiles (",
              Hkv * row_tiles, ") must each be below 65536 on CUDA");
  int64_t splits = 1;
  at::Tensor partials;
  at::Tensor out = at::empty({B, Hq, Lq, D}, q_in.options());
  const cuda::DeviceStatus status(q_in);
  const cuda::Stream stream = cuda::current_stream();

  dispatch_core_float(elem, kOp, [&](auto elem_tag) {
    using T = decltype(elem_tag);
    dispatch_core_float(meta, kOp, [&](auto meta_tag) {
      using Meta = decltype(meta_tag);
      if (cuda::value_checks_on()) {
        // NEXUSKV_CUDA_CHECKS=1 (synchronizes): the CPU kernel's value checks,
        // with its messages, on host copies, before the launch.
        std::vector<at::Tensor> kh, vh;
        for (const at::Tensor& t : kc) kh.push_back(t.cpu());
        for (const at::Tensor& t : vc) vh.push_back(t.cpu());
        const at::Tensor qh = q.cpu().to(at::kFloat);
        const auto f = [](const std::optional<at::Tensor>& t) { return rows_in(on_cpu(t), at::kFloat); };
        const auto signs_h = on_cpu(signs);
        if (signs_h) check_rotation_sign_values(kOp, *signs_h);
        check_attention_values(
            kOp, make_attention_params<float, Meta, T>(shapes, qh, kh, vh, lens.cpu(), f(kt), f(vt), on_cpu(tl), f(ks),
                                                       f(vs), on_cpu(sl), signs_h));
      }
      using Params = core::AttentionParams<T, Meta, T>;
      cuda::AttentionLaunch<Params> L;
      L.p = make_attention_params<T, Meta, T>(shapes, q, kc, vc, lens, kt, vt, tl, ks, vs, sl, signs);
      L.row_tiles = row_tiles;
      L.status = status.ptr();
      const KernelChoice choice = cuda::kernel_choice(kOp);
      const cuda::AttentionKernelInfo kernel = cuda::attention_kernel_info(L, choice);
      C10_CUDA_CHECK(cudaError_t(kernel.error));
      TORCH_CHECK(kernel.mma || choice != KernelChoice::kDecode, kOp,
                  ": NEXUSKV_CUDA_ATTENTION=decode, but the decode kernel does not take this problem (it needs "
                  "keys per channel in groups of a multiple of 64 tokens at 2 bits, 32 at 4, 16 at 8, values per "
                  "token in 1, 2 or 4 groups of a multiple of 16 channels, the same 2/4/8 bits for both, no "
                  "outliers, head_dim 64 or 128, fp16 or bf16 queries with metadata of the same dtype, "
                  "capacities a multiple of those token counts, 16-byte aligned buffers, kv_heads x row tiles of 16 "
                  "query rows x 2 below 65536 where a kv head has more than 8 query rows)");
      TORCH_CHECK(kernel.mma || choice != KernelChoice::kMma, kOp,
                  ": NEXUSKV_CUDA_ATTENTION=mma, but the tensor-core kernel does not take this problem (it needs "
                  "keys per channel with group_size % 16 == 0 or DGQ, values per token with group_size % 16 == 0, "
                  "the same 2/4/8 bits for both, head_dim 64 or 128, fp16 or bf16 queries with metadata of the same "
                  "dtype, 16-byte aligned buffers)");
      // Whole waves over the GPU's block slots (split_plan.h); a kernel that
      // reports no occupancy is planned as if one block per SM fit.
      const int64_t slots = std::max(1, kernel.blocks_per_sm) * int64_t(cuda::multiprocessor_count());
      splits =
          cached_split_plan(blocks * kernel.row_blocks, slots, visible, kernel.tile_tokens).splits + kernel.fp_splits;
      partials = at::empty({blocks * splits * cuda::kAttnRows * (D + 2)}, q.options().dtype(at::kFloat));
      L.splits = splits;
      L.partials = partials.data_ptr<float>();
      C10_CUDA_CHECK(cudaError_t(cuda::launch_attention(L, kernel, stream)));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  cuda::MergeArgs m{
      B, Hq, Hkv, Lq, D, splits, row_tiles, partials.data_ptr<float>(), signs ? signs->data_ptr<float>() : nullptr};
  dispatch_core_float(q_in.scalar_type(), kOp, [&](auto out_tag) {
    using Out = decltype(out_tag);
    C10_CUDA_CHECK(cudaError_t(cuda::launch_attention_merge<Out>(m, core_ptr<Out>(out), stream)));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  // What the kernels found (NEXUSKV_CUDA_CHECKS=1; the host checks above come
  // first, so this is the backstop).
  const uint32_t bad = status.read();
  TORCH_CHECK(!(bad & cuda::kBadLengths), kOp, ": a length is outside its capacity, or q_len (", Lq,
              ") exceeds the length of a sequence");
  TORCH_CHECK(!(bad & cuda::kBadSigns), kOp, ": rotation signs must all be +1 or -1");
  TORCH_CHECK(!(bad & cuda::kBadSegments), kOp,
              ": segment_starts must list ordered segments that begin at token 0 and stay within the capacity");
  TORCH_CHECK(!(bad & cuda::kBadOutlierIndex), kOp,
              ": outlier_idx holds a position outside its group; the compressed tensors are corrupt or were made "
              "with other parameters");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nexuskv, CUDA, m) { m.impl("dgq_fused_attention", &dgq_fused_attention_cuda); }

}  // namespace nexuskv
