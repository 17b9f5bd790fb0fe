#include "attention_args.h"

#include <ATen/ATen.h>

#include <cfloat>
#include <cmath>
#include <string>

#include "nq_args.h"

namespace nexuskv {
namespace {

constexpr const char* kOp = "dgq_fused_attention";

// A compressed K or V cache [B, H, capacity, ...]: its sizes, from its tensors' sizes and format.
core::NQDims cache_dims(const char* name, const char* format_name, at::TensorList cache, at::IntArrayRef format,
                        int64_t batch, int64_t head_dim, const at::Tensor& q) {
  TORCH_CHECK(cache.size() == 5 || cache.size() == 6, kOp, ": ", name,
              " must hold 5 tensors (codes, scale, zero, outlier_idx, outlier_val) or 6 (+ segment_starts, DGQ), got ",
              cache.size());
  TORCH_CHECK(format.size() == 3, kOp, ": ", format_name, " must be [bits, group_size, axis], got ", format);
  for (const at::Tensor& t : cache)
    TORCH_CHECK(!t.defined() || t.device() == q.device(), kOp, ": all tensors must be on one device, q is on ",
                q.device(), " but ", name, " is on ", t.device());
  const at::Tensor& codes = cache[0];
  TORCH_CHECK(codes.defined() && codes.dim() == 4, kOp, ": ", name,
              " codes must have shape [batch, kv_heads, tokens, row_bytes], got ",
              codes.defined() ? codes.sizes() : at::IntArrayRef{});
  TORCH_CHECK(codes.size(0) == batch, kOp, ": ", name, " holds ", codes.size(0), " sequences but q has ", batch);
  const int64_t bits = format[0], group = format[1], axis = format[2];
  TORCH_CHECK(cache.size() == 5 || axis == -2, kOp, ": ", name,
              " has segment_starts (DGQ), so its axis must be -2, got ", axis);
  return cache.size() == 6 ? dgq_decompress_dims(kOp, cache[0], cache[1], cache[2], cache[3], cache[4], cache[5], bits,
                                                 group, head_dim, name)
                           : nq_decompress_dims(kOp, cache[0], cache[1], cache[2], cache[3], cache[4], bits, group,
                                                axis, head_dim, name);
}

// A [B] length tensor: int32 or int64 on q's device.  (Its values are the kernels' to check.)
void check_lengths(const char* name, const at::Tensor& t, int64_t batch, const at::Tensor& q) {
  TORCH_CHECK(t.defined(), kOp, ": ", name, " must be a tensor");
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, kOp, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == batch, kOp, ": ", name, " must have shape [", batch,
              "] (one length per sequence), got ", t.sizes());
  TORCH_CHECK(t.device() == q.device(), kOp, ": all tensors must be on one device, q is on ", q.device(), " but ", name,
              " is on ", t.device());
}

// Optional full-precision K/V rows [B, Hkv, capacity, D] (the tail or the
// sinks) with optional lengths [B]; returns the capacity (0: absent).
int64_t check_full_precision_rows(const std::string& what, const std::optional<at::Tensor>& k,
                                  const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& lens, int64_t B,
                                  int64_t Hkv, const at::Tensor& q) {
  const std::string kn = "k_" + what, vn = "v_" + what, ln = what + "_lens";
  const int64_t D = q.size(3);
  TORCH_CHECK(k.has_value() == v.has_value(), kOp, ": give both ", kn, " and ", vn, ", or neither");
  TORCH_CHECK(k.has_value() || !lens.has_value(), kOp, ": ", ln, " given without ", kn, "/", vn);
  if (!k) return 0;
  for (const auto* t : {&*k, &*v}) {
    TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == Hkv && t->size(3) == D, kOp, ": ", kn, " and ", vn,
                " must have shape [", B, ", ", Hkv, ", ", what, "_tokens, ", D, "], got ", t->sizes());
    TORCH_CHECK(is_float_type(t->scalar_type()), kOp, ": ", kn, " and ", vn, " must be float tensors, got ",
                t->scalar_type());
    TORCH_CHECK(t->device() == q.device(), kOp, ": all tensors must be on one device, q is on ", q.device(), " but ",
                (t == &*k ? kn : vn), " is on ", t->device());
  }
  TORCH_CHECK(k->size(2) == v->size(2), kOp, ": ", kn, " holds ", k->size(2), " tokens, ", vn, " ", v->size(2));
  if (lens) check_lengths(ln.c_str(), *lens, B, q);
  return k->size(2);
}

}  // namespace

void check_rotation_signs(const char* op, const at::Tensor& signs, int64_t n, const at::Device& device,
                          const char* signs_name, const char* rotated) {
  TORCH_CHECK(n > 0 && (n & (n - 1)) == 0, op, ": the Hadamard rotation (", signs_name, ") needs ", rotated,
              "'s last dimension (head_dim) a power of two, got ", n);
  TORCH_CHECK(signs.dim() == 1 && signs.size(0) == n, op, ": ", signs_name, " must have shape [", n, "], got ",
              signs.sizes());
  TORCH_CHECK(is_float_type(signs.scalar_type()), op, ": ", signs_name, " must be a float tensor, got ",
              signs.scalar_type());
  TORCH_CHECK(signs.device() == device, op, ": all tensors must be on one device, ", rotated, " is on ", device,
              " but ", signs_name, " is on ", signs.device());
}

void check_hadamard_args(const at::Tensor& x, const at::Tensor& signs) {
  constexpr const char* op = "hadamard_rotate";
  TORCH_CHECK(x.dim() >= 1 && x.numel() > 0, op, ": x must be a non-empty tensor [..., n], got ", x.sizes());
  TORCH_CHECK(is_float_type(x.scalar_type()), op, ": x must be float32, float16 or bfloat16, got ", x.scalar_type());
  check_rotation_signs(op, signs, x.size(-1), x.device(), "signs", "x");
}

AttentionShapes check_attention_args(const at::Tensor& q, at::TensorList k_cache, at::TensorList v_cache,
                                     at::IntArrayRef k_format, at::IntArrayRef v_format,
                                     const at::Tensor& compressed_lens, const std::optional<at::Tensor>& k_tail,
                                     const std::optional<at::Tensor>& v_tail,
                                     const std::optional<at::Tensor>& tail_lens,
                                     const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                                     const std::optional<at::Tensor>& k_sink, const std::optional<at::Tensor>& v_sink,
                                     const std::optional<at::Tensor>& sink_lens, std::optional<int64_t> window,
                                     std::optional<double> softcap) {
  TORCH_CHECK(q.defined() && q.dim() == 4, kOp, ": q must have shape [batch, q_heads, q_len, head_dim], got ",
              q.defined() ? q.sizes() : at::IntArrayRef{});
  TORCH_CHECK(is_float_type(q.scalar_type()), kOp, ": q must be float32, float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(q.numel() > 0, kOp, ": q must not be empty, got shape ", q.sizes());
  AttentionShapes s;
  s.batch = q.size(0), s.q_heads = q.size(1), s.q_len = q.size(2), s.head_dim = q.size(3);
  const int64_t B = s.batch, D = s.head_dim;
  TORCH_CHECK(D % 16 == 0 && D <= core::kMaxHeadDim, kOp,
              ": q's head_dim (its last dimension) must be a multiple "
              "of 16 and at most ",
              core::kMaxHeadDim, ", got ", D);
  s.query_mantissa_bits = q.scalar_type() == at::kFloat ? 24 : q.scalar_type() == at::kHalf ? 11 : 8;
  s.k = cache_dims("k_cache", "k_format", k_cache, k_format, B, D, q);
  s.v = cache_dims("v_cache", "v_format", v_cache, v_format, B, D, q);
  s.k_dgq = k_cache.size() == 6, s.v_dgq = v_cache.size() == 6;
  s.kv_heads = k_cache[0].size(1);
  TORCH_CHECK(v_cache[0].size(1) == s.kv_heads, kOp, ": k_cache has ", s.kv_heads, " kv heads but v_cache has ",
              v_cache[0].size(1));
  TORCH_CHECK(s.q_heads % s.kv_heads == 0, kOp, ": q_heads (", s.q_heads, ") must be a multiple of kv_heads (",
              s.kv_heads, ")");
  check_lengths("compressed_lens", compressed_lens, B, q);
  s.tail_capacity = check_full_precision_rows("tail", k_tail, v_tail, tail_lens, B, s.kv_heads, q);
  s.sink_capacity = check_full_precision_rows("sink", k_sink, v_sink, sink_lens, B, s.kv_heads, q);
  s.has_tail = k_tail.has_value(), s.has_sink = k_sink.has_value();
  if (rotation_signs) check_rotation_signs(kOp, *rotation_signs, D, q.device(), "rotation_signs", "q");
  // Scalars: checked on their double / int64 values, before narrowing to float.
  const double sc = scale.value_or(1.0 / std::sqrt(double(D)));
  TORCH_CHECK(std::isfinite(sc) && std::fabs(sc) <= FLT_MAX, kOp, ": scale must be finite in float32, got ", sc);
  s.scale = float(sc);
  TORCH_CHECK(!window || *window >= 1, kOp, ": window must be >= 1 (tokens a query sees, itself included), got ",
              window.value_or(0));
  s.window = window.value_or(0);
  TORCH_CHECK(!softcap || (std::isfinite(*softcap) && *softcap > 0 && *softcap <= FLT_MAX), kOp,
              ": softcap must be finite and > 0, got ", softcap.value_or(0));
  s.softcap = float(softcap.value_or(0));
  return s;
}

namespace detail {
core::SeqLengths seq_lengths(const at::Tensor& lens) {
  TORCH_INTERNAL_ASSERT(lens.is_contiguous(), "lengths must be contiguous");
  core::SeqLengths l;
  if (lens.scalar_type() == at::kLong)
    l.i64 = lens.data_ptr<int64_t>();
  else
    l.i32 = lens.data_ptr<int32_t>();
  return l;
}
}  // namespace detail

}  // namespace nexuskv
