// Reading a KVCache: fused attention (dgq_fused_attention over the buffers in
// place), attention over decompressed chunks, the dense view, lengths and
// the exact byte counts.
#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "cache_impl.h"
#include "nexuskv/core/nq_format.h"
#include "nexuskv/ops.h"

namespace nexuskv {
namespace {

constexpr const char* kCls = "KVCache";

// Causal (and windowed, soft-capped) attention of the last Lq positions of
// each sequence over its first lens[b] rows of K, V [B, H, L, D] (chunk
// storage: K/V come from decompress(), so the work is plain ATen math in float32).
at::Tensor attention_over_dense(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V,
                                const std::vector<int64_t>& lens, double scale, int64_t window, double softcap) {
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
    if (softcap > 0) s = s.div(softcap).tanh_().mul_(softcap);
    const at::Tensor key_pos = at::arange(L, s.options().dtype(at::kLong)).unsqueeze(0);
    const at::Tensor query_pos = at::arange(L - Lq, L, s.options().dtype(at::kLong)).unsqueeze(1);
    at::Tensor hidden = key_pos > query_pos;
    if (window > 0) hidden = hidden.logical_or(key_pos <= query_pos - window);
    s.masked_fill_(hidden, -std::numeric_limits<float>::infinity());
    out.select(0, b).copy_(at::matmul(at::softmax(s, -1), Vb));
  }
  return out.to(q.scalar_type());
}

core::DType core_dtype(at::ScalarType t) {
  return t == at::kHalf ? core::DType::kFloat16 : t == at::kBFloat16 ? core::DType::kBFloat16 : core::DType::kFloat32;
}

}  // namespace

at::Tensor KVCache::Impl::compressed_tokens(bool keys_part, int64_t b0, int64_t b1, int64_t lo, int64_t hi,
                                            at::ScalarType dtype) const {
  at::Tensor x;
  if (mode == StorageMode::kFused) {
    x = decompress_rows(keys_part ? k_fused : v_fused, keys_part ? keys : values, b0, b1, lo, hi, head_dim);
  } else {  // chunk storage: one sequence; decompress the objects that cover [lo, hi)
    TORCH_INTERNAL_ASSERT(b1 == b0 + 1);
    const auto& objs = (keys_part ? k_chunks : v_chunks)[size_t(b0)];
    const KVCompressor& comp = keys_part ? *k_comp : *v_comp;
    std::vector<at::Tensor> xs;
    int64_t at_token = 0;
    for (const CompressedTensor& c : objs) {
      const int64_t n = c.shape.at(c.shape.size() - 2);
      if (at_token + n > lo && at_token < hi) {
        const at::Tensor d = comp.decompress(c, at::kFloat);
        xs.push_back(d.slice(1, std::max<int64_t>(lo - at_token, 0), std::min(hi, at_token + n) - at_token));
      }
      at_token += n;
    }
    x = (xs.empty() ? at::empty({heads, 0, head_dim}, x_options.dtype(at::kFloat)) : at::cat(xs, 1)).unsqueeze(0);
  }
  if (options.rotate && x.size(2) > 0) x = hadamard_rotate(x, signs, /*inverse=*/true);
  return x.to(dtype);
}

void KVCache::Impl::check_attend(const at::Tensor& q, std::optional<double> softcap) const {
  check_started("attend()");
  check_mode("attend()", mode != StorageMode::kExternal,
             "the front end holds the compressed chunks, so attend over dense_with() with any attention code");
  TORCH_CHECK(q.defined() && q.dim() == 4 && q.size(0) == batch && q.size(3) == head_dim, kCls, ": q must have shape [",
              batch, ", q_heads, q_len, ", head_dim, "], got ", q.defined() ? q.sizes() : at::IntArrayRef{});
  TORCH_CHECK(!q.is_meta(), kCls, ": q must hold data, got a meta tensor");
  check_device("q", q);
  TORCH_CHECK(!softcap || (std::isfinite(*softcap) && *softcap > 0), kCls, ": softcap must be finite and > 0, got ",
              softcap.value_or(0));
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, kCls,
              ": q must be float32, float16 or bfloat16, got ", q.scalar_type());
}

at::Tensor KVCache::Impl::attend(const at::Tensor& q, std::optional<double> scale,
                                 std::optional<double> softcap) const {
  check_attend(q, softcap);
  if (mode == StorageMode::kChunks) {
    auto [K, V, lens] = assemble(at::kFloat, nullptr, nullptr);
    std::vector<int64_t> cached_lens;
    for (int64_t b = 0; b < batch; ++b) cached_lens.push_back(cached(b));
    return attention_over_dense(q, K, V, cached_lens, scale.value_or(1.0 / std::sqrt(double(head_dim))),
                                options.window.value_or(0), softcap.value_or(0));
  }
  if (device_lengths.empty() || device_lengths[0].device() != q.device()) {
    std::vector<int64_t> all(compressed_len);
    all.insert(all.end(), tail_len.begin(), tail_len.end());
    all.insert(all.end(), sink_len.begin(), sink_len.end());
    const at::Tensor d = lengths_on(all, q.device()).view({3, batch});
    device_lengths = {d[0], d[1], d[2]};
  }
  std::optional<at::Tensor> k_sink_arg, v_sink_arg, sink_lens;
  if (options.sinks > 0) k_sink_arg = k_sink, v_sink_arg = v_sink, sink_lens = device_lengths[2];
  const std::vector<int64_t> kf = {keys.bits, keys.group_size, keys.axis};
  const std::vector<int64_t> vf = {values.bits, values.group_size, values.axis};
  return dgq_fused_attention(q, k_fused, v_fused, kf, vf, device_lengths[0], k_tail, v_tail, device_lengths[1],
                             options.rotate ? std::optional<at::Tensor>(signs) : std::nullopt, scale, k_sink_arg,
                             v_sink_arg, sink_lens, options.window, softcap);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> KVCache::Impl::assemble(
    at::ScalarType out, const std::vector<at::Tensor>* k_compressed,
    const std::vector<at::Tensor>* v_compressed) const {
  // Positions of sequence b: sinks, live compressed part, tail; zeros after its end.
  int64_t L = 0;
  for (int64_t b = 0; b < batch; ++b) L = std::max(L, cached(b));
  at::Tensor K = at::zeros({batch, heads, L, head_dim}, x_options.dtype(out));
  at::Tensor V = at::zeros_like(K);
  std::vector<std::pair<int64_t, int64_t>> groups = row_groups();
  if (k_compressed) {  // external storage: the front end's parts come per sequence
    groups.clear();
    for (int64_t b = 0; b < batch; ++b) groups.emplace_back(b, b + 1);
  }
  for (const auto& [b0, b1] : groups) {
    const size_t i = size_t(b0);
    const int64_t s = sink_len[i], c = compressed_len[i], t = tail_len[i];
    const auto rows = [&](const at::Tensor& x, int64_t lo, int64_t hi) { return x.slice(0, b0, b1).slice(2, lo, hi); };
    if (s) rows(K, 0, s).copy_(rows(k_sink, 0, s)), rows(V, 0, s).copy_(rows(v_sink, 0, s));
    if (c) {
      if (k_compressed) {
        rows(K, s, s + c).copy_((*k_compressed)[i].unsqueeze(0));
        rows(V, s, s + c).copy_((*v_compressed)[i].unsqueeze(0));
      } else {
        rows(K, s, s + c).copy_(compressed_tokens(true, b0, b1, 0, c, out));
        rows(V, s, s + c).copy_(compressed_tokens(false, b0, b1, 0, c, out));
      }
    }
    if (t) rows(K, s + c, s + c + t).copy_(rows(k_tail, 0, t)), rows(V, s + c, s + c + t).copy_(rows(v_tail, 0, t));
  }
  return {K, V, lengths()};
}

at::Tensor KVCache::Impl::lengths() const {
  std::vector<int64_t> l;
  for (int64_t b = 0; b < batch; ++b) l.push_back(cached(b));
  return host_lengths(l);
}

int64_t KVCache::Impl::compressed_nbytes() const {
  int64_t n = 0;
  for (const StoreParts* s : {&k_fused, &v_fused})
    for (const at::Tensor& t : *s) n += tensor_bytes(t);
  for (const auto* chunks : {&k_chunks, &v_chunks})
    for (const auto& seq : *chunks)
      for (const CompressedTensor& c : seq) n += c.nbytes();
  return n;
}

int64_t KVCache::Impl::nbytes() const {
  int64_t n = compressed_nbytes();
  for (const at::Tensor* t : {&k_tail, &v_tail, &k_sink, &v_sink, &signs}) n += tensor_bytes(*t);
  for (const DueChunk& d : due) n += tensor_bytes(d.k) + tensor_bytes(d.v);
  return n;
}

int64_t KVCache::Impl::used_nbytes() const {
  if (!started()) return 0;
  const at::ScalarType x = x_options.dtype().toScalarType();
  // Fused: the format's count (nq_format.h) for each sequence's live
  // compressed tokens.  Chunks: their exact bytes.  Sinks and tail: their
  // live tokens in the input dtype.
  int64_t n = tensor_bytes(signs);
  for (int64_t b = 0; b < batch; ++b) {
    const size_t i = size_t(b);
    if (mode == StorageMode::kFused && compressed_len[i] > 0)
      for (const QuantSpec* s : {&keys, &values}) {
        core::NQDims d;
        d.rows = heads, d.tokens = compressed_len[i], d.head_dim = head_dim;
        d.bits = int(s->bits), d.group_size = int(s->group_size), d.num_outliers = int(s->num_outliers);
        d.axis = s->axis == -2 ? core::GroupAxis::kTokens : core::GroupAxis::kChannels;
        n += core::nq_nbytes(d, core_dtype(x), core_dtype(s->meta_dtype.value_or(x)));
        if (s->dynamic) n += heads * d.meta_a() * int64_t(sizeof(int32_t));
      }
    n += 2 * (sink_len[i] + tail_len[i]) * heads * head_dim * int64_t(c10::elementSize(x));
  }
  for (const auto* chunks : {&k_chunks, &v_chunks})
    for (const auto& seq : *chunks)
      for (const CompressedTensor& c : seq) n += c.nbytes();
  return n;
}

}  // namespace nexuskv
