// KVCache: the caching policy over the nexuskv operators (see nexuskv/cache.h).
// Every compression and attention goes through the public operator API, so
// the cache works on any backend the operators have.
#include "nexuskv/cache.h"

#include <ATen/ATen.h>

#include <numeric>

#include "../aten/nq_args.h"
#include "nexuskv/ops.h"

namespace nexuskv {
namespace {

constexpr const char* kCls = "KVCache";

void check_spec(const char* name, const QuantSpec& s) {
  TORCH_CHECK(s.axis == -2 || s.axis == -1, kCls, ": ", name, " axis must be -2 or -1, got ", s.axis);
  TORCH_CHECK(!s.dynamic || s.axis == -2, kCls, ": ", name, " with dynamic (DGQ) groups needs axis -2");
}

// Rows [b] of a [B, H, ...] tensor, dims 2.. sliced to [lo, hi) along `dim`.
at::Tensor rows(const at::Tensor& t, int64_t b, int64_t dim, int64_t lo, int64_t hi) {
  return t.select(0, b).slice(dim - 1, lo, hi);
}

}  // namespace

KVCache::KVCache(QuantSpec keys, QuantSpec values, int64_t residual, bool rotate, int64_t seed)
    : keys_(keys), values_(values), residual_(residual), rotate_(rotate), seed_(seed) {
  check_spec("keys", keys_);
  check_spec("values", values_);
  TORCH_CHECK(residual_ >= 0, kCls, ": residual must be >= 0, got ", residual_);
  chunk_ = std::lcm(keys_.token_multiple(), values_.token_multiple());
}

void KVCache::reset() {
  batch_ = heads_ = head_dim_ = capacity_ = tail_capacity_ = 0;
  k_ = Store{}, v_ = Store{};
  k_tail_ = v_tail_ = signs_ = at::Tensor();
  compressed_len_.clear(), tail_len_.clear();
}

void KVCache::ensure_capacity(int64_t tokens) {
  if (tokens <= capacity_) return;
  // Grow by a quarter at least (amortized copies), in whole chunks.
  const int64_t want = std::max(tokens, capacity_ + capacity_ / 4);
  const int64_t cap = (want + chunk_ - 1) / chunk_ * chunk_;
  auto grow = [&](Store& s, const QuantSpec& spec) {
    // Buffers of a compressed [B, H, cap, D] tensor, sized by the format (a
    // broadcast view carries the shape and dtype without allocating it).
    const at::Tensor shape = at::empty({1}, at::TensorOptions().dtype(dtype_)).expand({batch_, heads_, cap, head_dim_});
    const core::NQDims d = nq_compress_dims(shape, spec.bits, spec.group_size, spec.axis, spec.num_outliers);
    auto [codes, scale, zero, idx, val] = nq_allocate_outputs(d, shape, nq_meta_dtype(dtype_, spec.meta_dtype));
    std::vector<at::Tensor> fresh = {codes, scale, zero, idx, val};
    if (spec.dynamic) fresh.push_back(at::empty({batch_, heads_, d.meta_a()}, at::TensorOptions().dtype(at::kInt)));
    for (size_t i = 0; i < fresh.size(); ++i) {
      fresh[i].zero_();
      if (!s.parts.empty()) {
        const at::Tensor& old = s.parts[i];
        fresh[i].slice(2, 0, old.size(2)).copy_(old);
      }
    }
    s.parts = std::move(fresh);
  };
  grow(k_, keys_);
  grow(v_, values_);
  capacity_ = cap;
}

void KVCache::ensure_tail_capacity(int64_t tokens) {
  if (tokens <= tail_capacity_) return;
  const int64_t cap = std::max(tokens, residual_ + chunk_);
  auto grow = [&](at::Tensor& t) {
    at::Tensor fresh = at::zeros({batch_, heads_, cap, head_dim_}, at::TensorOptions().dtype(dtype_));
    if (t.defined()) fresh.slice(2, 0, t.size(2)).copy_(t);
    t = fresh;
  };
  grow(k_tail_);
  grow(v_tail_);
  tail_capacity_ = cap;
}

void KVCache::write_compressed(Store& s, const QuantSpec& spec, int64_t b, int64_t offset, const at::Tensor& x) {
  // x [H, n, D], n a multiple of the chunk; offset a multiple of the chunk.
  const int64_t n = x.size(1);
  std::vector<at::Tensor> parts;
  if (spec.dynamic) {
    auto t = dgq_compress(x, spec.bits, spec.group_size, spec.granule, std::nullopt, spec.num_outliers,
                          spec.meta_dtype);
    parts = {std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t), std::get<5>(t)};
    parts[5] = parts[5] + int32_t(offset);  // segment starts are absolute tokens
  } else {
    auto t = nq_compress(x, spec.bits, spec.group_size, spec.axis, spec.num_outliers, spec.meta_dtype);
    parts = {std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t)};
  }
  // codes are per token; metadata per token group (axis -2) or per token (axis -1).
  const int64_t meta_lo = spec.axis == -2 ? offset / spec.group_size : offset;
  const int64_t meta_n = spec.axis == -2 ? n / spec.group_size : n;
  rows(s.parts[0], b, 2, offset, offset + n).copy_(parts[0]);
  for (size_t i = 1; i < parts.size(); ++i) rows(s.parts[i], b, 2, meta_lo, meta_lo + meta_n).copy_(parts[i]);
  if (spec.dynamic)  // unused segment slots after the new end: empty segments there
    rows(s.parts[5], b, 2, meta_lo + meta_n, s.parts[5].size(2)).fill_(int32_t(offset + n));
}

void KVCache::append(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& valid) {
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), kCls, ": k and v must have one shape [batch, kv_heads, ",
              "tokens, head_dim], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), kCls, ": k and v must have one dtype");
  if (batch_ == 0) {
    batch_ = k.size(0), heads_ = k.size(1), head_dim_ = k.size(3), dtype_ = k.scalar_type();
    compressed_len_.assign(size_t(batch_), 0);
    tail_len_.assign(size_t(batch_), 0);
    if (rotate_) {
      const auto gen = at::make_generator<at::CPUGeneratorImpl>(uint64_t(seed_));
      signs_ = at::randint(0, 2, {head_dim_}, gen, at::TensorOptions().dtype(at::kFloat)).mul_(2).sub_(1);
    }
    ensure_capacity(chunk_);
    ensure_tail_capacity(residual_ + chunk_);
  }
  TORCH_CHECK(k.size(0) == batch_ && k.size(1) == heads_ && k.size(3) == head_dim_, kCls,
              ": this cache holds [", batch_, ", ", heads_, ", *, ", head_dim_, "] but k is ", k.sizes(),
              " (a cache is built for one model and batch; call reset() to reuse it)");
  TORCH_CHECK(k.scalar_type() == dtype_, kCls, ": this cache holds ", dtype_, " but k is ", k.scalar_type());
  at::Tensor keep;
  if (valid) {
    TORCH_CHECK(valid->dim() == 2 && valid->size(0) == batch_ && valid->size(1) == k.size(2), kCls,
                ": valid must have shape [", batch_, ", ", k.size(2), "], got ", valid->sizes());
    keep = valid->to(at::kBool).cpu();
  }
  for (int64_t b = 0; b < batch_; ++b) {
    at::Tensor kb = k.select(0, b), vb = v.select(0, b);  // [H, n, D]
    if (keep.defined()) {
      const at::Tensor idx = keep.select(0, b).nonzero().squeeze(1).to(k.device());
      kb = kb.index_select(1, idx), vb = vb.index_select(1, idx);
    }
    const int64_t tl = tail_len_[size_t(b)];
    const at::Tensor rk = at::cat({rows(k_tail_, b, 2, 0, tl), kb}, 1);  // [H, tail + new, D]
    const at::Tensor rv = at::cat({rows(v_tail_, b, 2, 0, tl), vb}, 1);
    const int64_t total = rk.size(1);
    const int64_t n_comp = std::max<int64_t>(0, total - residual_) / chunk_ * chunk_;
    if (n_comp > 0) {
      const int64_t off = compressed_len_[size_t(b)];
      ensure_capacity(off + n_comp);
      at::Tensor ck = rk.slice(1, 0, n_comp), cv = rv.slice(1, 0, n_comp);
      if (rotate_) ck = hadamard_rotate(ck, signs_), cv = hadamard_rotate(cv, signs_);
      write_compressed(k_, keys_, b, off, ck.contiguous());
      write_compressed(v_, values_, b, off, cv.contiguous());
      compressed_len_[size_t(b)] = off + n_comp;
    }
    const int64_t rest = total - n_comp;
    ensure_tail_capacity(rest);
    rows(k_tail_, b, 2, 0, rest).copy_(rk.slice(1, n_comp, total));
    rows(v_tail_, b, 2, 0, rest).copy_(rv.slice(1, n_comp, total));
    tail_len_[size_t(b)] = rest;
  }
}

at::Tensor KVCache::attend(const at::Tensor& q, std::optional<double> scale) const {
  TORCH_CHECK(batch_ > 0, kCls, ": attend() before any append()");
  TORCH_CHECK(q.dim() == 4 && q.size(0) == batch_ && q.size(3) == head_dim_, kCls, ": q must have shape [", batch_,
              ", q_heads, q_len, ", head_dim_, "], got ", q.sizes());
  const auto lens = [&](const std::vector<int64_t>& v) {
    return at::tensor(at::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong)).to(q.device());
  };
  return dgq_fused_attention(q, k_.parts, v_.parts, format(keys_), format(values_), lens(compressed_len_), k_tail_,
                             v_tail_, lens(tail_len_), rotate_ ? std::optional<at::Tensor>(signs_) : std::nullopt,
                             scale);
}

at::Tensor KVCache::dequantize(const Store& s, const QuantSpec& spec, int64_t b, at::ScalarType dtype) const {
  const int64_t n = compressed_len_[size_t(b)];
  if (n == 0) return at::empty({heads_, 0, head_dim_}, at::TensorOptions().dtype(dtype));
  const int64_t meta_n = spec.axis == -2 ? n / spec.group_size : n;
  std::vector<at::Tensor> p;
  p.push_back(rows(s.parts[0], b, 2, 0, n));
  for (size_t i = 1; i < s.parts.size(); ++i) p.push_back(rows(s.parts[i], b, 2, 0, meta_n));
  at::Tensor x = spec.dynamic
                     ? dgq_decompress(p[0], p[1], p[2], p[3], p[4], p[5], spec.bits, spec.group_size, head_dim_,
                                      at::kFloat)
                     : nq_decompress(p[0], p[1], p[2], p[3], p[4], spec.bits, spec.group_size, spec.axis, head_dim_,
                                     at::kFloat);
  if (rotate_) x = hadamard_rotate(x, signs_, /*inverse=*/true);
  return x.to(dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> KVCache::dense(std::optional<at::ScalarType> dtype) const {
  TORCH_CHECK(batch_ > 0, kCls, ": dense() before any append()");
  const at::ScalarType out = dtype.value_or(dtype_);  // the tail converts on copy
  const int64_t L = max_length();
  at::Tensor K = at::zeros({batch_, heads_, L, head_dim_}, at::TensorOptions().dtype(out));
  at::Tensor V = at::zeros_like(K);
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t c = compressed_len_[size_t(b)], t = tail_len_[size_t(b)];
    rows(K, b, 2, 0, c).copy_(dequantize(k_, keys_, b, out));
    rows(V, b, 2, 0, c).copy_(dequantize(v_, values_, b, out));
    rows(K, b, 2, c, c + t).copy_(rows(k_tail_, b, 2, 0, t));
    rows(V, b, 2, c, c + t).copy_(rows(v_tail_, b, 2, 0, t));
  }
  return {K, V, lengths()};
}

at::Tensor KVCache::lengths() const {
  std::vector<int64_t> l(static_cast<size_t>(batch_));
  for (int64_t b = 0; b < batch_; ++b) l[size_t(b)] = compressed_len_[size_t(b)] + tail_len_[size_t(b)];
  return at::tensor(at::ArrayRef<int64_t>(l), at::TensorOptions().dtype(at::kLong));
}

int64_t KVCache::max_length() const {
  int64_t m = 0;
  for (int64_t b = 0; b < batch_; ++b) m = std::max(m, compressed_len_[size_t(b)] + tail_len_[size_t(b)]);
  return m;
}

int64_t KVCache::nbytes() const {
  int64_t n = compressed_nbytes();
  for (const at::Tensor* t : {&k_tail_, &v_tail_, &signs_})
    if (t->defined()) n += t->numel() * t->element_size();
  return n;
}

int64_t KVCache::compressed_nbytes() const {
  int64_t n = 0;
  for (const Store* s : {&k_, &v_})
    for (const at::Tensor& t : s->parts) n += t.numel() * t.element_size();
  return n;
}

int64_t KVCache::used_nbytes() const {
  if (batch_ == 0) return 0;
  // Compressed bytes scale with the used fraction of the capacity; the tail counts its live tokens.
  int64_t used = 0, tail = 0;
  for (int64_t b = 0; b < batch_; ++b) used += compressed_len_[size_t(b)], tail += tail_len_[size_t(b)];
  const int64_t comp = compressed_nbytes();
  const int64_t comp_used = capacity_ ? comp * used / (capacity_ * batch_) : 0;
  const int64_t elem = k_tail_.defined() ? k_tail_.element_size() : 0;
  return comp_used + 2 * tail * heads_ * head_dim_ * elem + (signs_.defined() ? signs_.numel() * 4 : 0);
}

}  // namespace nexuskv
