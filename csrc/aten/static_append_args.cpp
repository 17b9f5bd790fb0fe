#include "static_append_args.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "nq_args.h"

namespace nexuskv {
namespace {

constexpr const char* kOp = "static_kv_append_";
constexpr const char* kPartNames[] = {"codes", "scale", "zero", "outlier_idx", "outlier_val", "segment_starts"};

// A tensor the op writes, and its name in messages: "k_store[0] (codes)", "k_tail".
struct Written {
  std::string name;
  const at::Tensor* t;
};

// Whether distinct indices of t can address one element.  Sufficient for "no": with the
// dims of more than one element sorted by stride, each stride exceeds the span of all
// smaller ones (every layout that slicing, permuting or allocating makes).  A stride of
// 0 over several elements (an expanded tensor) and interleaved strides are "yes".
bool may_self_overlap(const at::Tensor& t) {
  if (t.numel() <= 1) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t i = 0; i < t.dim(); ++i)
    if (t.size(i) > 1) dims.emplace_back(t.stride(i), t.size(i));
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // the largest element offset the dims so far reach
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return true;
    span += stride * (size - 1);
  }
  return false;
}

// [first, last] bytes of t within its storage (t not empty).
std::pair<int64_t, int64_t> byte_range(const at::Tensor& t) {
  int64_t last = t.storage_offset();
  for (int64_t i = 0; i < t.dim(); ++i) last += t.stride(i) * (t.size(i) - 1);
  const int64_t item = int64_t(t.element_size());
  return {t.storage_offset() * item, (last + 1) * item - 1};
}

bool share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.has_storage() || !b.has_storage()) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  const auto [a0, a1] = byte_range(a);
  const auto [b0, b1] = byte_range(b);
  return a0 <= b1 && b0 <= a1;
}

// The op writes every buffer of the cache in place after computing what it stores: a
// buffer that aliases itself or another one would take two writes in one place and
// silently corrupt the cache (or fail in copy_ half-way, after other buffers were written).
void check_no_aliasing(at::TensorList k_store, at::TensorList v_store, const at::Tensor& k_tail,
                       const at::Tensor& v_tail, const at::Tensor& lengths) {
  std::vector<Written> w;
  for (const auto& [store, name] : {std::pair{k_store, "k_store"}, std::pair{v_store, "v_store"}})
    for (size_t i = 0; i < store.size(); ++i)
      w.push_back({std::string(name) + "[" + std::to_string(i) + "] (" + kPartNames[i] + ")", &store[i]});
  w.push_back({"k_tail", &k_tail});
  w.push_back({"v_tail", &v_tail});
  w.push_back({"lengths", &lengths});
  for (const Written& x : w)
    TORCH_CHECK(!may_self_overlap(*x.t), kOp, ": ", x.name, " has elements that share memory (strides ", x.t->strides(),
                " over sizes ", x.t->sizes(),
                ", e.g. an expanded tensor); the cache writes it in place, so it must be a tensor of its own "
                "memory (clone() it)");
  for (size_t i = 0; i < w.size(); ++i)
    for (size_t j = i + 1; j < w.size(); ++j)
      TORCH_CHECK(!share_memory(*w[i].t, *w[j].t), kOp, ": ", w[j].name, " must not share memory with ", w[i].name,
                  " (the cache writes both in place)");
}

// store: 5 tensors (NQ) or, for keys, 6 (DGQ), counted by the caller; what: "k" or "v".
core::NQDims store_dims(at::TensorList store, at::IntArrayRef format, int64_t head_dim, const char* what,
                        bool allow_dgq) {
  TORCH_CHECK(format.size() == 3 || (allow_dgq && store.size() == 6 && format.size() == 4), kOp, ": ", what,
              "_format must be [bits, group_size, axis]", allow_dgq ? " (+ granule for DGQ keys)" : "", ", got ",
              format);
  const std::string name = std::string(what) + "_store";  // the messages name the argument
  if (store.size() == 6)
    return dgq_decompress_dims(kOp, store[0], store[1], store[2], store[3], store[4], store[5], format[0], format[1],
                               head_dim, name.c_str());
  return nq_decompress_dims(kOp, store[0], store[1], store[2], store[3], store[4], format[0], format[1], format[2],
                            head_dim, name.c_str());
}

}  // namespace

StaticAppendShapes check_static_append_args(at::TensorList k_store, at::TensorList v_store, const at::Tensor& k_tail,
                                            const at::Tensor& v_tail, const at::Tensor& lengths, const at::Tensor& k,
                                            const at::Tensor& v, at::IntArrayRef k_format, at::IntArrayRef v_format,
                                            int64_t residual) {
  StaticAppendShapes s;
  TORCH_CHECK(k_store.size() == 5 || k_store.size() == 6, kOp,
              ": k_store must hold the 5 tensors of an NQ tensor (codes, scale, zero, outlier_idx, outlier_val) or "
              "the 6 of a DGQ one (+ segment_starts), got ",
              k_store.size());
  TORCH_CHECK(v_store.size() == 5, kOp,
              ": v_store must hold the 5 tensors of an NQ tensor (codes, scale, zero, outlier_idx, outlier_val), got ",
              v_store.size());
  TORCH_CHECK(k.dim() == 4, kOp, ": k must have shape [batch, kv_heads, tokens, head_dim], got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), kOp, ": v must have k's shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(is_float_type(k.scalar_type()) && v.scalar_type() == k.scalar_type(), kOp,
              ": k and v must be float32, float16 or bfloat16 of one dtype, got ", k.scalar_type(), " and ",
              v.scalar_type());
  // The cache's dtype: that of its outlier values (the format stores them in the dtype
  // of what was compressed, and they exist, with 0 elements, without outliers).
  const at::ScalarType dtype = k_store[4].scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype, kOp, ": k and v must have the cache's dtype ", dtype,
              " (that of k_store[4], its outlier values), got ", k.scalar_type());
  s.batch = k.size(0), s.kv_heads = k.size(1), s.new_tokens = k.size(2), s.head_dim = k.size(3);
  TORCH_CHECK(s.batch > 0 && s.kv_heads > 0 && s.head_dim > 0, kOp, ": k must not be empty, got ", k.sizes());
  check_same_device(kOp, "k", k, {{"v", &v}, {"k_tail", &k_tail}, {"v_tail", &v_tail}, {"lengths", &lengths}});
  TORCH_CHECK(residual >= 0, kOp, ": residual must be >= 0, got ", residual);
  s.residual = residual;

  for (const auto& [store, name] : {std::pair{k_store, "k_store"}, std::pair{v_store, "v_store"}})
    TORCH_CHECK(store[0].dim() == 4 && store[0].size(0) == s.batch && store[0].size(1) == s.kv_heads, kOp,
                ": k and v have batch ", s.batch, " and kv_heads ", s.kv_heads, " (k has shape ", k.sizes(), "), but ",
                name, " holds codes of shape ", store[0].sizes(), " ([batch, kv_heads, capacity, row_bytes])");
  s.k = store_dims(k_store, k_format, s.head_dim, "k", true);
  s.v = store_dims(v_store, v_format, s.head_dim, "v", false);
  s.k_dgq = k_store.size() == 6;
  if (s.k_dgq) {
    TORCH_CHECK(k_format[2] == -2, kOp, ": DGQ keys are grouped along tokens (axis -2), got axis ", k_format[2]);
    if (k_format.size() == 4) s.granule = k_format[3];
    TORCH_CHECK(s.granule >= 1 && s.granule <= s.k.group_size, kOp,
                ": granule must be in [1, group_size=", s.k.group_size, "], got ", s.granule);
  }
  for (const auto& [store, name] : {std::pair{k_store, "k_store"}, std::pair{v_store, "v_store"}}) {
    check_same_device(kOp, "k", k, {{name, &store[0]}});
    TORCH_CHECK(store[4].scalar_type() == dtype, kOp, ": ", name, "[4] (outlier_val) must have the cache's dtype ",
                dtype, " (k_store[4]'s), got ", store[4].scalar_type());
  }
  TORCH_CHECK(s.k.tokens == s.v.tokens, kOp, ": k_store and v_store must have one capacity, got ", s.k.tokens, " and ",
              s.v.tokens);
  const int64_t kt = s.k.axis == core::GroupAxis::kTokens ? s.k.group_size : 1;
  const int64_t vt = s.v.axis == core::GroupAxis::kTokens ? s.v.group_size : 1;
  s.chunk = std::lcm(kt, vt);
  TORCH_CHECK(s.k.tokens % s.chunk == 0, kOp, ": the capacity (", s.k.tokens,
              ") must be a multiple of the tokens one compression covers (", s.chunk, ")");
  for (const auto& [t, name] : {std::pair{&k_tail, "k_tail"}, std::pair{&v_tail, "v_tail"}}) {
    TORCH_CHECK(t->dim() == 4 && t->size(0) == s.batch && t->size(1) == s.kv_heads && t->size(3) == s.head_dim, kOp,
                ": ", name, " must be [batch=", s.batch, ", kv_heads=", s.kv_heads,
                ", tail_capacity, head_dim=", s.head_dim, "], got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == dtype, kOp, ": ", name, " must have the cache's dtype ", dtype,
                " (k_store[4]'s, its outlier values), got ", t->scalar_type());
  }
  TORCH_CHECK(v_tail.size(2) == k_tail.size(2), kOp, ": k_tail and v_tail must have one capacity, got ", k_tail.size(2),
              " and ", v_tail.size(2));
  s.tail_capacity = k_tail.size(2);
  TORCH_CHECK(s.tail_capacity >= residual + s.chunk - 1, kOp,
              ": k_tail and v_tail must hold residual + chunk - 1 = ", residual + s.chunk - 1,
              " tokens (their dim 2), got ", s.tail_capacity);
  TORCH_CHECK(
      lengths.scalar_type() == at::kLong && lengths.dim() == 2 && lengths.size(0) == 2 && lengths.size(1) == s.batch,
      kOp, ": lengths must be int64 [2, batch=", s.batch, "] (compressed, tail), got ", lengths.scalar_type(), " ",
      lengths.sizes());
  check_no_aliasing(k_store, v_store, k_tail, v_tail, lengths);
  return s;
}

}  // namespace nexuskv
