// Editing a KVCache as a whole: crop (assisted / prompt-lookup decoding),
// beam reorder, moving to a device, deep copies and reset.  Each checks and
// prepares everything first, then writes (an error leaves the cache as it was).
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>

#include "cache_impl.h"

namespace nexuskv {
namespace {

constexpr const char* kCls = "KVCache";

at::Tensor moved(const at::Tensor& t, const at::Device& d) { return t.defined() ? t.to(d) : t; }
at::Tensor cloned(const at::Tensor& t) { return t.defined() ? t.clone() : t; }

}  // namespace

int64_t KVCache::Impl::segment_cut(int64_t b, int64_t keep, int64_t compressed) const {
  // A compression call of n tokens at buffer token `at` writes its DGQ
  // segments into the slots [at / G, (at + n) / G), in order, and fills the
  // slots it does not need with at + n; segments follow the data, so they do
  // not end at chunk boundaries inside a call.  Token t (a whole chunk) is a
  // place to cut every head of the sequence where slot t / G begins at t:
  // then every segment before t lies in the slots before t / G, which stay,
  // and t / G is where the next compression writes.  Token 0 always is one.
  if (keep >= compressed) return keep;
  // Per dynamic part: its token group G and its starts [H, A], read on the
  // host (crop is not a decode step).
  std::vector<std::pair<int64_t, at::Tensor>> dynamic;
  for (const auto& [spec, parts] : {std::pair(&keys, &k_fused), std::pair(&values, &v_fused)})
    if (spec->dynamic) dynamic.emplace_back(spec->group_size, to_host((*parts)[5].select(0, b)));
  for (; keep > 0 && !dynamic.empty(); keep -= chunk) {
    bool cut_here = true;
    for (const auto& [G, starts] : dynamic)
      cut_here = cut_here && host_flag(starts.select(1, keep / G).eq(int32_t(keep)).all());
    if (cut_here) break;
  }
  return keep;
}

void KVCache::Impl::crop(int64_t length, const std::vector<at::Tensor>* k_compressed,
                         const std::vector<at::Tensor>* v_compressed) {
  const char* method = k_compressed ? "crop_with()" : "crop()";
  TORCH_CHECK(length >= 0, kCls, ": ", method, " length must be >= 0, got ", length);
  if (!started()) return;  // nothing cached, nothing to cut
  TORCH_CHECK(due.empty(), kCls, ": ", method, " while ", due.size(),
              " chunks wait in take_due_chunks(); take and store them first");
  thaw_outside_inference_mode();
  const int64_t W = options.window.value_or(0);
  struct Cut {
    int64_t b, sinks, compressed, tail;
    size_t objects = 0;               // chunk storage: compressed objects kept
    at::Tensor restore_k, restore_v;  // [1, H, m, D]: survivors of the cut chunk, into the tail
  };
  std::vector<Cut> cuts;
  int64_t need_tail = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const size_t i = size_t(b);
    const int64_t s = sink_len[i], e = evicted_len[i], c = compressed_len[i];
    if (length >= positions(b)) continue;
    if (W > 0)
      TORCH_CHECK(e <= std::max<int64_t>(0, length - W + 1), kCls, ": ", method, " length ", length,
                  " would need positions the window already dropped: sequence ", b, " evicted its first ", e,
                  " positions, but the next query (position ", length, ", window ", W, ") sees positions from ",
                  std::max<int64_t>(0, length - W + 1), " on; a sliding-window cache can be cut to ", e + W - 1,
                  " positions or more");
    Cut cut{b, s, c, 0};
    if (length <= s) {
      cut.sinks = length, cut.compressed = 0;
    } else if (length <= s + e + c) {
      const int64_t rel = length - s - e;  // live compressed tokens that stay
      int64_t keep = rel / chunk * chunk;
      if (mode == StorageMode::kFused) keep = segment_cut(b, keep, c);
      if (mode == StorageMode::kChunks) {  // objects cover whole appends: cut at an object start
        keep = 0;
        for (const CompressedTensor& o : k_chunks[i]) {
          const int64_t n = o.shape.at(o.shape.size() - 2);
          if (keep + n > rel) break;
          keep += n, ++cut.objects;
        }
      }
      const int64_t m = rel - keep;
      if (m > 0) {
        const at::ScalarType x = x_options.dtype().toScalarType();
        if (mode == StorageMode::kExternal) {
          TORCH_CHECK(k_compressed, kCls, ": crop(", length, ") cuts sequence ", b,
                      " inside a compressed chunk, whose tokens the front end holds; call crop_with() with the "
                      "dequantized compressed parts (as dense_with() takes them)");
          cut.restore_k = (*k_compressed)[i].slice(1, keep, rel).unsqueeze(0).to(x);
          cut.restore_v = (*v_compressed)[i].slice(1, keep, rel).unsqueeze(0).to(x);
          // These tokens go back into the tail, to be handed over again: they must be ones an
          // append could have taken (read back on the CPU only: no sync in a CUDA decode step).
          TORCH_CHECK(!cut.restore_k.device().is_cpu() ||
                          host_flag(at::isfinite(cut.restore_k).all().logical_and(at::isfinite(cut.restore_v).all())),
                      kCls, ": crop_with(): k_compressed[", b, "] or v_compressed[", b,
                      "] holds NaN or Inf in the tokens that go back into the tail; a cache only holds finite K/V");
        } else {
          // Per-channel groups dequantize whole: decode from the cut to the end of
          // the compressed part (DGQ segments may run past the next chunk), keep
          // its first m tokens.
          const int64_t hi = mode == StorageMode::kFused ? c : rel;
          cut.restore_k = compressed_tokens(true, b, b + 1, keep, hi, x).slice(2, 0, m);
          cut.restore_v = compressed_tokens(false, b, b + 1, keep, hi, x).slice(2, 0, m);
        }
      }
      cut.compressed = keep, cut.tail = m;
    } else {
      cut.tail = length - s - e - c;
    }
    need_tail = std::max(need_tail, cut.tail);
    cuts.push_back(std::move(cut));
  }
  at::Tensor kt = k_tail, vt = v_tail;
  if (need_tail > kt.size(2)) {
    kt = at::zeros({batch, heads, need_tail, head_dim}, x_options), vt = at::zeros_like(kt);
    kt.slice(2, 0, k_tail.size(2)).copy_(k_tail), vt.slice(2, 0, v_tail.size(2)).copy_(v_tail);
  }
  for (Cut& cut : cuts) {
    const size_t i = size_t(cut.b);
    if (cut.restore_k.defined()) {
      kt.slice(0, cut.b, cut.b + 1).slice(2, 0, cut.tail).copy_(cut.restore_k);
      vt.slice(0, cut.b, cut.b + 1).slice(2, 0, cut.tail).copy_(cut.restore_v);
    }
    if (mode == StorageMode::kChunks && cut.compressed < compressed_len[i]) {
      k_chunks[i].resize(cut.objects), v_chunks[i].resize(cut.objects);
    }
    if (mode == StorageMode::kFused) {
      fill_unused_segments(k_fused, keys, cut.b, cut.b + 1, cut.compressed);
      fill_unused_segments(v_fused, values, cut.b, cut.b + 1, cut.compressed);
    }
    sink_len[i] = cut.sinks, compressed_len[i] = cut.compressed, tail_len[i] = cut.tail;
  }
  k_tail = kt, v_tail = vt;
  lengths_changed();
}

void KVCache::Impl::reorder(const at::Tensor& beam_idx) {
  check_started("reorder()");
  TORCH_CHECK(due.empty(), kCls, ": reorder() while chunks wait in take_due_chunks(); take them first");
  TORCH_CHECK(beam_idx.defined() && !beam_idx.is_meta(), kCls, ": beam_idx must be an integer tensor with data, got ",
              beam_idx.defined() ? "a meta tensor" : "None");
  TORCH_CHECK(beam_idx.dim() == 1 && beam_idx.size(0) == batch &&
                  at::isIntegralType(beam_idx.scalar_type(), /*includeBool=*/false),
              kCls, ": beam_idx must be an integer tensor of shape [", batch, "], got ", beam_idx.scalar_type(), " ",
              beam_idx.sizes());
  TORCH_CHECK(beam_idx.device().is_cpu() || beam_idx.device() == x_options.device(), kCls,
              ": beam_idx must be on the CPU or on the cache's device ", x_options.device(), ", got ",
              beam_idx.device());
  // Read on the host: the per-sequence lengths follow the beams.
  const at::Tensor idx = to_host(beam_idx.to(at::kLong));
  const int64_t* ix = idx.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(ix[b] >= 0 && ix[b] < batch, kCls, ": beam_idx[", b, "] = ", ix[b], " is outside [0, ", batch, ")");
  const at::Tensor on_device = idx.to(x_options.device());
  const auto pick = [&](const at::Tensor& t) { return t.defined() ? t.index_select(0, on_device) : t; };
  StoreParts kf, vf;
  for (const at::Tensor& t : k_fused) kf.push_back(pick(t));
  for (const at::Tensor& t : v_fused) vf.push_back(pick(t));
  at::Tensor kt = pick(k_tail), vt = pick(v_tail), ks = pick(k_sink), vs = pick(v_sink);
  const auto permute = [&](auto& per_seq) {
    auto old = per_seq;
    for (int64_t b = 0; b < batch; ++b) per_seq[size_t(b)] = old[size_t(ix[b])];
  };
  k_fused = std::move(kf), v_fused = std::move(vf);
  k_tail = kt, v_tail = vt, k_sink = ks, v_sink = vs;
  permute(sink_len), permute(evicted_len), permute(compressed_len), permute(tail_len);
  if (mode == StorageMode::kChunks) permute(k_chunks), permute(v_chunks);
  lengths_changed();
}

void KVCache::Impl::thaw_outside_inference_mode() {
  if (c10::InferenceMode::is_enabled()) return;
  const auto thawed = [](const at::Tensor& t) { return t.defined() && t.is_inference() ? t.clone() : t; };
  for (StoreParts* parts : {&k_fused, &v_fused})
    for (at::Tensor& t : *parts) t = thawed(t);
  k_tail = thawed(k_tail), v_tail = thawed(v_tail), k_sink = thawed(k_sink), v_sink = thawed(v_sink);
}

void KVCache::Impl::to(const at::Device& device) {
  TORCH_CHECK(!device.is_meta(), kCls,
              ": to(): the cache must stay on a device with data (CPU or an "
              "accelerator), got ",
              device);
  if (!started()) return;  // a new cache takes the device of its first append
  const auto move_all = [&](const StoreParts& parts) {
    StoreParts out;
    for (const at::Tensor& t : parts) out.push_back(moved(t, device));
    return out;
  };
  StoreParts kf = move_all(k_fused), vf = move_all(v_fused);
  auto kc = k_chunks, vc = v_chunks;
  for (auto* chunks : {&kc, &vc})
    for (auto& seq : *chunks)
      for (CompressedTensor& c : seq)
        for (at::Tensor& t : c.parts) t = moved(t, device);
  auto d = due;
  for (DueChunk& c : d) c.k = moved(c.k, device), c.v = moved(c.v, device);
  at::Tensor kt = moved(k_tail, device), vt = moved(v_tail, device), ks = moved(k_sink, device),
             vs = moved(v_sink, device), sg = moved(signs, device);
  k_fused = std::move(kf), v_fused = std::move(vf), k_chunks = std::move(kc), v_chunks = std::move(vc);
  due = std::move(d);
  k_tail = kt, v_tail = vt, k_sink = ks, v_sink = vs, signs = sg;
  x_options = x_options.device(device);
  lengths_changed();
}

std::unique_ptr<KVCache::Impl> KVCache::Impl::deep_copy() const {
  auto c = std::make_unique<Impl>(*this);
  for (auto* parts : {&c->k_fused, &c->v_fused})
    for (at::Tensor& t : *parts) t = cloned(t);
  for (auto* chunks : {&c->k_chunks, &c->v_chunks})
    for (auto& seq : *chunks)
      for (CompressedTensor& ct : seq)
        for (at::Tensor& t : ct.parts) t = cloned(t);
  for (DueChunk& d : c->due) d.k = cloned(d.k), d.v = cloned(d.v);
  for (at::Tensor* t : {&c->k_tail, &c->v_tail, &c->k_sink, &c->v_sink, &c->signs}) *t = cloned(*t);
  c->device_lengths.clear();
  return c;
}

void KVCache::Impl::reset() {
  batch = heads = head_dim = 0;
  x_options = at::TensorOptions();
  k_fused.clear(), v_fused.clear(), k_chunks.clear(), v_chunks.clear(), due.clear();
  k_tail = v_tail = k_sink = v_sink = signs = at::Tensor();
  sink_len.clear(), evicted_len.clear(), compressed_len.clear(), tail_len.clear();
  lengths_changed();
}

}  // namespace nexuskv
