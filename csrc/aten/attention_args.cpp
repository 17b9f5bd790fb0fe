#include "attention_args.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>

#include "core_dispatch.h"
#include "nq_args.h"

namespace nexuskv {
namespace {

constexpr const char* kOp = "dgq_fused_attention";

bool is_float_type(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// A compressed K or V cache [B, H, capacity, ...] as the kernel reads it.
core::CompressedView cache_view(const char* name, const char* format_name, at::TensorList cache,
                                at::IntArrayRef format, int64_t batch,
                                int64_t head_dim, std::vector<at::Tensor>& keep) {
  TORCH_CHECK(cache.size() == 5 || cache.size() == 6, kOp, ": ", name,
              " must hold 5 tensors (codes, scale, zero, outlier_idx, outlier_val) or 6 (+ segment_starts, DGQ), got ",
              cache.size());
  TORCH_CHECK(format.size() == 3, kOp, ": ", format_name, " must be [bits, group_size, axis], got ", format);
  const at::Tensor& codes = cache[0];
  TORCH_CHECK(codes.defined() && codes.dim() == 4, kOp, ": ", name,
              " codes must have shape [batch, kv_heads, tokens, row_bytes], got ",
              codes.defined() ? codes.sizes() : at::IntArrayRef{});
  TORCH_CHECK(codes.size(0) == batch, kOp, ": ", name, " holds ", codes.size(0), " sequences but q has ", batch);
  const int64_t bits = format[0], group = format[1], axis = format[2];
  core::CompressedView v;
  v.dims = cache.size() == 6
               ? dgq_decompress_dims(kOp, cache[0], cache[1], cache[2], cache[3], cache[4], cache[5], bits, group,
                                     head_dim)
               : nq_decompress_dims(kOp, cache[0], cache[1], cache[2], cache[3], cache[4], bits, group, axis,
                                    head_dim);
  TORCH_CHECK(cache.size() == 5 || axis == -2, kOp, ": ", name, " has segment_starts (DGQ), so its axis must be -2");
  v.meta_a = v.dims.meta_a();
  for (size_t i = 0; i < cache.size(); ++i) keep.push_back(cache[i].contiguous());
  const size_t first = keep.size() - cache.size();
  v.codes = keep[first].data_ptr<uint8_t>();
  v.scale = keep[first + 1].data_ptr();
  v.zero = keep[first + 2].data_ptr();
  v.outlier_idx = keep[first + 3].data_ptr<uint8_t>();
  v.outlier_val = keep[first + 4].data_ptr();
  v.segment_starts = cache.size() == 6 ? keep[first + 5].data_ptr<int32_t>() : nullptr;
  v.meta_dtype = to_core_dtype(cache[1].scalar_type());
  v.val_dtype = to_core_dtype(cache[4].scalar_type());
  return v;
}

// A [B] length tensor as int64 on the CPU, each value in [0, limit].
at::Tensor lengths(const char* name, const at::Tensor& t, int64_t batch, int64_t limit, const char* limit_what) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, kOp, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == batch, kOp, ": ", name, " must have shape [", batch,
              "] (one length per sequence), got ", t.sizes());
  at::Tensor out = t.to(at::kCPU, at::kLong).contiguous();
  const int64_t* v = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(v[b] >= 0 && v[b] <= limit, kOp, ": ", name, "[", b, "] = ", v[b], " is outside [0, ", limit,
                "] (", limit_what, ")");
  return out;
}

// Optional full-precision K/V rows [B, Hkv, capacity, D] (the tail or the
// sinks) with optional lengths [B]: checked, converted to float32, pointed to.
void full_precision_rows(const std::string& what, const std::optional<at::Tensor>& k,
                         const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& lens, int64_t B,
                         int64_t Hkv, const at::Tensor& q, std::vector<at::Tensor>& keep, const float*& k_ptr,
                         const float*& v_ptr, int64_t& capacity, const int64_t*& lens_ptr) {
  const std::string kn = "k_" + what, vn = "v_" + what, ln = what + "_lens";
  const int64_t D = q.size(3);
  TORCH_CHECK(k.has_value() == v.has_value(), kOp, ": give both ", kn, " and ", vn, ", or neither");
  TORCH_CHECK(k.has_value() || !lens.has_value(), kOp, ": ", ln, " given without ", kn, "/", vn);
  if (!k) return;
  for (const auto* t : {&*k, &*v}) {
    TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == Hkv && t->size(3) == D, kOp, ": ", kn, " and ",
                vn, " must have shape [", B, ", ", Hkv, ", ", what, "_tokens, ", D, "], got ", t->sizes());
    TORCH_CHECK(is_float_type(t->scalar_type()), kOp, ": ", kn, " and ", vn, " must be float tensors, got ",
                t->scalar_type());
    TORCH_CHECK(t->device() == q.device(), kOp, ": ", kn, " is on ", t->device(), " but q is on ", q.device());
  }
  TORCH_CHECK(k->size(2) == v->size(2), kOp, ": ", kn, " holds ", k->size(2), " tokens, ", vn, " ", v->size(2));
  capacity = k->size(2);
  keep.push_back(k->to(at::kFloat).contiguous());
  k_ptr = keep.back().data_ptr<float>();
  keep.push_back(v->to(at::kFloat).contiguous());
  v_ptr = keep.back().data_ptr<float>();
  if (lens) {
    const std::string limit = "tokens held by " + kn;
    keep.push_back(lengths(ln.c_str(), *lens, B, capacity, limit.c_str()));
    lens_ptr = keep.back().data_ptr<int64_t>();
  }
}

}  // namespace

void check_rotation_signs(const char* op, const at::Tensor& signs, int64_t n) {
  TORCH_CHECK(n > 0 && (n & (n - 1)) == 0, op, ": the Hadamard rotation needs head_dim a power of two, got ", n);
  TORCH_CHECK(signs.dim() == 1 && signs.size(0) == n, op, ": rotation signs must have shape [", n, "], got ",
              signs.sizes());
  TORCH_CHECK(is_float_type(signs.scalar_type()), op, ": rotation signs must be a float tensor, got ",
              signs.scalar_type());
  TORCH_CHECK(signs.abs().eq(1).all().item<bool>(), op, ": rotation signs must all be +1 or -1");
}

AttentionInputs attention_inputs(const at::Tensor& q, at::TensorList k_cache, at::TensorList v_cache,
                                 at::IntArrayRef k_format, at::IntArrayRef v_format,
                                 const at::Tensor& compressed_lens, const std::optional<at::Tensor>& k_tail,
                                 const std::optional<at::Tensor>& v_tail, const std::optional<at::Tensor>& tail_lens,
                                 const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                                 const std::optional<at::Tensor>& k_sink, const std::optional<at::Tensor>& v_sink,
                                 const std::optional<at::Tensor>& sink_lens, std::optional<int64_t> window,
                                 std::optional<double> softcap) {
  TORCH_CHECK(q.dim() == 4, kOp, ": q must have shape [batch, q_heads, q_len, head_dim], got ", q.sizes());
  TORCH_CHECK(is_float_type(q.scalar_type()), kOp, ": q must be float32, float16 or bfloat16, got ",
              q.scalar_type());
  TORCH_CHECK(q.numel() > 0, kOp, ": q must not be empty, got shape ", q.sizes());
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), D = q.size(3);
  TORCH_CHECK(D % 16 == 0 && D <= core::kMaxHeadDim, kOp, ": head_dim must be a multiple of 16 and at most ",
              core::kMaxHeadDim, ", got ", D);

  AttentionInputs in;
  auto& keep = in.keep_alive;
  core::AttentionProblem& p = in.problem;
  p.query_mantissa_bits = q.scalar_type() == at::kFloat ? 24 : q.scalar_type() == at::kHalf ? 11 : 8;
  p.k = cache_view("k_cache", "k_format", k_cache, k_format, B, D, keep);
  p.v = cache_view("v_cache", "v_format", v_cache, v_format, B, D, keep);
  const int64_t Hkv = k_cache[0].size(1);
  TORCH_CHECK(v_cache[0].size(1) == Hkv, kOp, ": k_cache has ", Hkv, " kv heads but v_cache has ",
              v_cache[0].size(1));
  TORCH_CHECK(Hq % Hkv == 0, kOp, ": q_heads (", Hq, ") must be a multiple of kv_heads (", Hkv, ")");
  for (const at::Tensor& t : k_cache)
    TORCH_CHECK(t.device() == q.device(), kOp, ": k_cache is on ", t.device(), " but q is on ", q.device());
  for (const at::Tensor& t : v_cache)
    TORCH_CHECK(t.device() == q.device(), kOp, ": v_cache is on ", t.device(), " but q is on ", q.device());

  const int64_t capacity = std::min(p.k.dims.tokens, p.v.dims.tokens);
  keep.push_back(lengths("compressed_lens", compressed_lens, B, capacity, "tokens held by k_cache and v_cache"));
  p.compressed_lens = keep.back().data_ptr<int64_t>();

  full_precision_rows("tail", k_tail, v_tail, tail_lens, B, Hkv, q, keep, p.k_tail, p.v_tail, p.tail_capacity,
                      p.tail_lens);
  full_precision_rows("sink", k_sink, v_sink, sink_lens, B, Hkv, q, keep, p.k_sink, p.v_sink, p.sink_capacity,
                      p.sink_lens);
  if (rotation_signs) {
    check_rotation_signs(kOp, *rotation_signs, D);
    keep.push_back(rotation_signs->to(at::kCPU, at::kFloat).contiguous());
    p.rotation_signs = keep.back().data_ptr<float>();
  }
  keep.push_back(q.to(at::kFloat).contiguous());
  p.q = keep.back().data_ptr<float>();
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = Lq, p.head_dim = D;
  p.scale = float(scale.value_or(1.0 / std::sqrt(double(D))));
  TORCH_CHECK(std::isfinite(p.scale), kOp, ": scale must be finite, got ", p.scale);
  TORCH_CHECK(!window || *window >= 1, kOp, ": window must be >= 1 (tokens a query sees, itself included), got ",
              window.value_or(0));
  p.window = window.value_or(0);
  TORCH_CHECK(!softcap || (std::isfinite(*softcap) && *softcap > 0), kOp, ": softcap must be finite and > 0, got ",
              softcap.value_or(0));
  p.softcap = float(softcap.value_or(0));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = p.seq_len(b);
    TORCH_CHECK(L == 0 || L >= Lq, kOp, ": q_len (", Lq, ") exceeds the length of sequence ", b, " (", L,
                " tokens); the queries are the last q_len positions of their sequence");
  }
  return in;
}

}  // namespace nexuskv
