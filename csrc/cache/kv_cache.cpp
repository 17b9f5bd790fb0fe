// KVCache: the caching policy over the nexuskv operators (see nexuskv/cache.h).
// Every compression and attention goes through the public operator API, so
// the cache works on any backend the operators have.
#include "nexuskv/cache.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
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

// Causal attention of the last q_len positions of each sequence over its
// first lens[b] rows of K, V [B, H, L, D] (chunk storage: K/V come from
// decompress(), so the work is plain ATen math in float32).
at::Tensor attention_over_dense(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V,
                                const std::vector<int64_t>& lens, double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), H = K.size(1);
  TORCH_CHECK(Hq % H == 0, kCls, ": q_heads (", Hq, ") must be a multiple of the cache's kv_heads (", H, ")");
  at::Tensor out = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = lens[size_t(b)];
    if (L == 0) continue;
    TORCH_CHECK(L >= Lq, kCls, ": q_len (", Lq, ") exceeds the length of sequence ", b, " (", L, " tokens)");
    const at::Tensor Kb = K.select(0, b).slice(1, 0, L).to(at::kFloat).repeat_interleave(Hq / H, 0);
    const at::Tensor Vb = V.select(0, b).slice(1, 0, L).to(at::kFloat).repeat_interleave(Hq / H, 0);
    at::Tensor s = at::matmul(q.select(0, b).to(at::kFloat), Kb.transpose(-1, -2)).mul_(scale);  // [Hq, Lq, L]
    const at::Tensor key_pos = at::arange(L, s.options().dtype(at::kLong)).unsqueeze(0);
    const at::Tensor query_pos = at::arange(L - Lq, L, s.options().dtype(at::kLong)).unsqueeze(1);
    s.masked_fill_(key_pos > query_pos, -std::numeric_limits<float>::infinity());
    out.select(0, b).copy_(at::matmul(at::softmax(s, -1), Vb));
  }
  return out.to(q.scalar_type());
}

}  // namespace

KVCache::KVCache(Mode mode, int64_t chunk, int64_t residual, int64_t sinks, bool rotate, int64_t seed)
    : mode_(mode), residual_(residual), sinks_(sinks), chunk_(chunk), rotate_(rotate), seed_(seed) {
  TORCH_CHECK(residual_ >= 0, kCls, ": residual must be >= 0, got ", residual_);
  TORCH_CHECK(sinks_ >= 0, kCls, ": sinks must be >= 0, got ", sinks_);
  TORCH_CHECK(chunk_ >= 1, kCls, ": chunk must be >= 1, got ", chunk_);
}

KVCache::KVCache(QuantSpec keys, QuantSpec values, int64_t residual, bool rotate, int64_t seed, int64_t sinks)
    : KVCache(Mode::kFused, 1, residual, sinks, rotate, seed) {
  keys_ = keys, values_ = values;
  check_spec("keys", keys_);
  check_spec("values", values_);
  chunk_ = std::lcm(keys_.token_multiple(), values_.token_multiple());
}

KVCache::KVCache(std::shared_ptr<const KVCompressor> keys, std::shared_ptr<const KVCompressor> values,
                 int64_t residual, int64_t sinks, bool rotate, int64_t seed)
    : KVCache(Mode::kChunks, 1, residual, sinks, rotate, seed) {
  TORCH_CHECK(keys && values, kCls, ": needs a key and a value compressor");
  TORCH_CHECK(keys->token_multiple() >= 1 && values->token_multiple() >= 1, kCls,
              ": a compressor's token_multiple() must be >= 1");
  chunk_ = std::lcm(keys->token_multiple(), values->token_multiple());
  if (keys->fused_spec() && values->fused_spec()) {  // read in place by the fused kernel
    mode_ = Mode::kFused;
    keys_ = *keys->fused_spec(), values_ = *values->fused_spec();
    check_spec("keys", keys_);
    check_spec("values", values_);
  } else {
    k_comp_ = std::move(keys), v_comp_ = std::move(values);
  }
}

c10::intrusive_ptr<KVCache> KVCache::external(int64_t chunk, int64_t residual, int64_t sinks) {
  return c10::make_intrusive<KVCache>(KVCache(Mode::kExternal, chunk, residual, sinks, false, 0));
}

void KVCache::check_started(const char* method) const {
  TORCH_CHECK(batch_ > 0, kCls, ": ", method, " before any append() (a new or reset cache holds no tokens)");
}

void KVCache::check_mode(const char* method, bool ok, const char* use) const {
  static const char* names[] = {"fused", "chunk", "external"};
  TORCH_CHECK(ok, kCls, ": ", method, " is not available with ", names[int(mode_)], " storage; ", use);
}

void KVCache::reset() {
  batch_ = heads_ = head_dim_ = capacity_ = tail_capacity_ = 0;
  k_ = Store{}, v_ = Store{};
  k_tail_ = v_tail_ = k_sink_ = v_sink_ = signs_ = at::Tensor();
  k_chunks_.clear(), v_chunks_.clear(), due_.clear();
  compressed_len_.clear(), tail_len_.clear(), sink_len_.clear();
}

void KVCache::ensure_capacity(int64_t tokens) {
  if (mode_ != Mode::kFused || tokens <= capacity_) return;
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

void KVCache::store_chunk(int64_t b, int64_t offset, at::Tensor k, at::Tensor v) {
  // k, v [H, n, D]: the sequence's next compressed tokens, from `offset` on.
  if (mode_ == Mode::kExternal) {
    due_.push_back({b, offset, k.contiguous(), v.contiguous()});
    return;
  }
  if (rotate_) k = hadamard_rotate(k, signs_), v = hadamard_rotate(v, signs_);
  if (mode_ == Mode::kFused) {
    ensure_capacity(offset + k.size(1));
    write_compressed(k_, keys_, b, offset, k.contiguous());
    write_compressed(v_, values_, b, offset, v.contiguous());
  } else {
    k_chunks_[size_t(b)].push_back(k_comp_->compress(k.contiguous()));
    v_chunks_[size_t(b)].push_back(v_comp_->compress(v.contiguous()));
  }
}

void KVCache::append(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& valid) {
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), kCls, ": k and v must have one shape [batch, kv_heads, ",
              "tokens, head_dim], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), kCls, ": k and v must have one dtype, got ", k.scalar_type(),
              " and ", v.scalar_type());
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kHalf || k.scalar_type() == at::kBFloat16,
              kCls, ": k and v must be float32, float16 or bfloat16, got ", k.scalar_type());
  if (batch_ == 0) {
    TORCH_CHECK(k.size(0) > 0 && k.size(1) > 0 && k.size(3) > 0, kCls,
                ": the first append() fixes [batch, kv_heads, *, head_dim] and needs them > 0, got ", k.sizes());
    batch_ = k.size(0), heads_ = k.size(1), head_dim_ = k.size(3), dtype_ = k.scalar_type();
    compressed_len_.assign(size_t(batch_), 0);
    tail_len_.assign(size_t(batch_), 0);
    sink_len_.assign(size_t(batch_), 0);
    if (mode_ == Mode::kChunks) k_chunks_.assign(size_t(batch_), {}), v_chunks_.assign(size_t(batch_), {});
    if (rotate_) {
      const auto gen = at::make_generator<at::CPUGeneratorImpl>(uint64_t(seed_));
      signs_ = at::randint(0, 2, {head_dim_}, gen, at::TensorOptions().dtype(at::kFloat)).mul_(2).sub_(1);
    }
    if (sinks_ > 0) {
      k_sink_ = at::zeros({batch_, heads_, sinks_, head_dim_}, at::TensorOptions().dtype(dtype_));
      v_sink_ = at::zeros_like(k_sink_);
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
    // The sequence's first tokens fill its sinks; they never move again.
    const int64_t sl = sink_len_[size_t(b)], take = std::min(sinks_ - sl, kb.size(1));
    if (take > 0) {
      rows(k_sink_, b, 2, sl, sl + take).copy_(kb.slice(1, 0, take));
      rows(v_sink_, b, 2, sl, sl + take).copy_(vb.slice(1, 0, take));
      sink_len_[size_t(b)] = sl + take;
      kb = kb.slice(1, take), vb = vb.slice(1, take);
    }
    const int64_t tl = tail_len_[size_t(b)];
    const at::Tensor rk = at::cat({rows(k_tail_, b, 2, 0, tl), kb}, 1);  // [H, tail + new, D]
    const at::Tensor rv = at::cat({rows(v_tail_, b, 2, 0, tl), vb}, 1);
    const int64_t total = rk.size(1);
    const int64_t n_comp = std::max<int64_t>(0, total - residual_) / chunk_ * chunk_;
    if (n_comp > 0) {
      const int64_t off = compressed_len_[size_t(b)];
      store_chunk(b, off, rk.slice(1, 0, n_comp), rv.slice(1, 0, n_comp));
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
  check_started("attend()");
  check_mode("attend()", mode_ != Mode::kExternal,
             "the front end holds the compressed chunks, so attend over dense_with() with any attention code");
  TORCH_CHECK(q.dim() == 4 && q.size(0) == batch_ && q.size(3) == head_dim_, kCls, ": q must have shape [", batch_,
              ", q_heads, q_len, ", head_dim_, "], got ", q.sizes());
  if (mode_ == Mode::kChunks) {
    auto [K, V, lens] = dense(at::kFloat);
    const at::Tensor l = lens.contiguous();
    return attention_over_dense(q, K, V, std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + batch_),
                                scale.value_or(1.0 / std::sqrt(double(head_dim_))));
  }
  const auto lens = [&](const std::vector<int64_t>& v) {
    return at::tensor(at::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong)).to(q.device());
  };
  std::optional<at::Tensor> k_sink, v_sink, sink_lens;
  if (sinks_ > 0) k_sink = k_sink_, v_sink = v_sink_, sink_lens = lens(sink_len_);
  return dgq_fused_attention(q, k_.parts, v_.parts, format(keys_), format(values_), lens(compressed_len_), k_tail_,
                             v_tail_, lens(tail_len_), rotate_ ? std::optional<at::Tensor>(signs_) : std::nullopt,
                             scale, k_sink, v_sink, sink_lens);
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

at::Tensor KVCache::decompress_chunks(bool keys, int64_t b, at::ScalarType dtype) const {
  const auto& chunks = (keys ? k_chunks_ : v_chunks_)[size_t(b)];
  const KVCompressor& comp = keys ? *k_comp_ : *v_comp_;
  std::vector<at::Tensor> xs;
  for (const CompressedTensor& c : chunks) xs.push_back(comp.decompress(c, at::kFloat));
  if (xs.empty()) return at::empty({heads_, 0, head_dim_}, at::TensorOptions().dtype(dtype));
  at::Tensor x = at::cat(xs, 1);
  if (rotate_) x = hadamard_rotate(x, signs_, /*inverse=*/true);
  return x.to(dtype);
}

template <typename CompressedPart>
std::tuple<at::Tensor, at::Tensor, at::Tensor> KVCache::assemble(at::ScalarType out, CompressedPart part) const {
  // Positions of sequence b: sinks, compressed part, tail; zeros after its end.
  const int64_t L = max_length();
  at::Tensor K = at::zeros({batch_, heads_, L, head_dim_}, at::TensorOptions().dtype(out));
  at::Tensor V = at::zeros_like(K);
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t s = sink_len_[size_t(b)], c = compressed_len_[size_t(b)], t = tail_len_[size_t(b)];
    if (s) {
      rows(K, b, 2, 0, s).copy_(rows(k_sink_, b, 2, 0, s));
      rows(V, b, 2, 0, s).copy_(rows(v_sink_, b, 2, 0, s));
    }
    if (c) {
      auto [kc, vc] = part(b);
      rows(K, b, 2, s, s + c).copy_(kc);
      rows(V, b, 2, s, s + c).copy_(vc);
    }
    rows(K, b, 2, s + c, s + c + t).copy_(rows(k_tail_, b, 2, 0, t));
    rows(V, b, 2, s + c, s + c + t).copy_(rows(v_tail_, b, 2, 0, t));
  }
  return {K, V, lengths()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> KVCache::dense(std::optional<at::ScalarType> dtype) const {
  check_started("dense()");
  check_mode("dense()", mode_ != Mode::kExternal,
             "the front end holds the compressed chunks: call dense_with() with them dequantized");
  const at::ScalarType out = dtype.value_or(dtype_);  // sinks and tail convert on copy
  return assemble(out, [&](int64_t b) {
    if (mode_ == Mode::kFused) return std::pair(dequantize(k_, keys_, b, out), dequantize(v_, values_, b, out));
    return std::pair(decompress_chunks(true, b, out), decompress_chunks(false, b, out));
  });
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> KVCache::take_due_chunks() {
  check_mode("take_due_chunks()", mode_ == Mode::kExternal, "this cache compresses its chunks itself");
  std::vector<int64_t> seq, offset;
  std::vector<at::Tensor> ks, vs;
  for (DueChunk& d : due_) {
    seq.push_back(d.seq), offset.push_back(d.offset);
    ks.push_back(std::move(d.k)), vs.push_back(std::move(d.v));
  }
  due_.clear();
  const auto as_tensor = [](const std::vector<int64_t>& v) {
    return at::tensor(at::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong));
  };
  return {as_tensor(seq), as_tensor(offset), ks, vs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> KVCache::dense_with(const std::vector<at::Tensor>& k_compressed,
                                                                   const std::vector<at::Tensor>& v_compressed,
                                                                   std::optional<at::ScalarType> dtype) const {
  check_started("dense_with()");
  check_mode("dense_with()", mode_ == Mode::kExternal, "call dense()");
  TORCH_CHECK(due_.empty(), kCls, ": dense_with() while ", due_.size(),
              " chunks wait in take_due_chunks(); take and store them first");
  TORCH_CHECK(int64_t(k_compressed.size()) == batch_ && int64_t(v_compressed.size()) == batch_, kCls,
              ": dense_with() needs one compressed part per sequence (", batch_, "), got ", k_compressed.size(),
              " and ", v_compressed.size());
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t c = compressed_len_[size_t(b)];
    if (c == 0) continue;
    for (const at::Tensor* t : {&k_compressed[size_t(b)], &v_compressed[size_t(b)]})
      TORCH_CHECK(t->dim() == 3 && t->size(0) == heads_ && t->size(1) == c && t->size(2) == head_dim_, kCls,
                  ": dense_with(): the compressed part of sequence ", b, " must have shape [", heads_, ", ", c, ", ",
                  head_dim_, "], got ", t->sizes());
  }
  return assemble(dtype.value_or(dtype_),
                  [&](int64_t b) { return std::pair(k_compressed[size_t(b)], v_compressed[size_t(b)]); });
}

void KVCache::reorder(const at::Tensor& beam_idx) {
  check_started("reorder()");
  TORCH_CHECK(due_.empty(), kCls, ": reorder() while chunks wait in take_due_chunks(); take them first");
  TORCH_CHECK(beam_idx.dim() == 1 && beam_idx.size(0) == batch_ && !at::isFloatingType(beam_idx.scalar_type()),
              kCls, ": beam_idx must be an integer tensor of shape [", batch_, "], got ", beam_idx.scalar_type(), " ",
              beam_idx.sizes());
  const at::Tensor idx = beam_idx.to(at::kCPU, at::kLong).contiguous();
  const int64_t* ix = idx.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch_; ++b)
    TORCH_CHECK(ix[b] >= 0 && ix[b] < batch_, kCls, ": beam_idx[", b, "] = ", ix[b], " is outside [0, ", batch_, ")");
  const auto pick = [&](at::Tensor& t) {
    if (t.defined()) t = t.index_select(0, idx.to(t.device()));
  };
  for (Store* s : {&k_, &v_})
    for (at::Tensor& t : s->parts) pick(t);
  for (at::Tensor* t : {&k_tail_, &v_tail_, &k_sink_, &v_sink_}) pick(*t);
  const auto permute = [&](auto& per_seq) {
    auto old = per_seq;
    for (int64_t b = 0; b < batch_; ++b) per_seq[size_t(b)] = old[size_t(ix[b])];
  };
  permute(compressed_len_), permute(tail_len_), permute(sink_len_);
  if (mode_ == Mode::kChunks) permute(k_chunks_), permute(v_chunks_);
}

at::Tensor KVCache::lengths() const {
  std::vector<int64_t> l(static_cast<size_t>(batch_));
  for (int64_t b = 0; b < batch_; ++b)
    l[size_t(b)] = sink_len_[size_t(b)] + compressed_len_[size_t(b)] + tail_len_[size_t(b)];
  return at::tensor(at::ArrayRef<int64_t>(l), at::TensorOptions().dtype(at::kLong));
}

at::Tensor KVCache::compressed_lengths() const {
  return at::tensor(at::ArrayRef<int64_t>(compressed_len_), at::TensorOptions().dtype(at::kLong));
}

int64_t KVCache::max_length() const {
  int64_t m = 0;
  for (int64_t b = 0; b < batch_; ++b)
    m = std::max(m, sink_len_[size_t(b)] + compressed_len_[size_t(b)] + tail_len_[size_t(b)]);
  return m;
}

namespace {
int64_t bytes_of(const at::Tensor& t) { return t.defined() ? t.numel() * int64_t(t.element_size()) : 0; }
}  // namespace

int64_t KVCache::nbytes() const {
  int64_t n = compressed_nbytes();
  for (const at::Tensor* t : {&k_tail_, &v_tail_, &k_sink_, &v_sink_, &signs_}) n += bytes_of(*t);
  return n;
}

int64_t KVCache::compressed_nbytes() const {
  int64_t n = 0;
  for (const Store* s : {&k_, &v_})
    for (const at::Tensor& t : s->parts) n += bytes_of(t);
  for (const auto* chunks : {&k_chunks_, &v_chunks_})
    for (const auto& seq : *chunks)
      for (const CompressedTensor& c : seq) n += c.nbytes();
  return n;
}

int64_t KVCache::used_nbytes() const {
  if (batch_ == 0) return 0;
  // Fused: compressed bytes scale with the used fraction of the capacity.  Chunks:
  // their exact bytes.  Sinks and tail: their live tokens.
  int64_t comp = 0, used = 0, live = 0;
  for (int64_t b = 0; b < batch_; ++b)
    used += compressed_len_[size_t(b)], live += tail_len_[size_t(b)] + sink_len_[size_t(b)];
  for (const Store* s : {&k_, &v_})
    for (const at::Tensor& t : s->parts) comp += bytes_of(t);
  int64_t comp_used = capacity_ ? comp * used / (capacity_ * batch_) : 0;
  for (const auto* chunks : {&k_chunks_, &v_chunks_})
    for (const auto& seq : *chunks)
      for (const CompressedTensor& c : seq) comp_used += c.nbytes();
  return comp_used + 2 * live * heads_ * head_dim_ * int64_t(c10::elementSize(dtype_)) + bytes_of(signs_);
}

}  // namespace nexuskv
