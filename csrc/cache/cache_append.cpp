// KVCache::append: the policy that decides where each new token goes (sinks,
// compressed part, tail), which compressed chunks the window evicts, and the
// growth of the buffers.  Atomic: a plan is built first, with every step that
// can fail (checks, compression, allocation of grown buffers); only then is
// the cache written, with copies into buffers that exist.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>

#include "cache_impl.h"
#include "nexuskv/ops.h"

namespace nexuskv {
namespace {

constexpr const char* kCls = "KVCache";

bool is_float(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The largest |x| whose group the compressor can always quantize: the zero
// (group minimum) and the scale (range / qmax, qmax >= 3) must fit the meta
// dtype, and the range (max - min, up to 2 |x|) must stay finite in the
// float32 the kernels compute it in.
double compressible_limit(const QuantSpec& spec, at::ScalarType x_dtype) {
  const at::ScalarType meta = spec.meta_dtype.value_or(x_dtype);
  const double float_range = double(FLT_MAX) / 2;
  return meta == at::kHalf ? 65504.0 : float_range;
}

const char* dtype_name(at::ScalarType t) {
  return t == at::kHalf ? "float16" : t == at::kBFloat16 ? "bfloat16" : "float32";
}

// Whether an append reads its value check back from the device: always on the
// CPU; on CUDA only with NEXUSKV_CUDA_CHECKS=1, because the read is a
// synchronization that a decode step must not have.  Unchecked, a NaN/Inf in
// K/V is kept (the CUDA compress kernel gives its group a NaN scale), so the
// attention rows that see it are NaN, as dense attention's would be.
bool checks_values_on_host(const at::Tensor& x) { return x.device().is_cpu() || cuda_value_checks_requested(); }

// Rejects NaN/Inf and values the compressed part could not hold, before
// anything is stored: every token the cache accepts can be compressed later.
void check_values(const KVCache::Impl& c, const at::Tensor& k, const at::Tensor& v) {
  if (k.numel() == 0 || !checks_values_on_host(k)) return;
  const bool compressed = c.mode == StorageMode::kFused;
  const double kl = compressed ? compressible_limit(c.keys, k.scalar_type()) : INFINITY;
  const double vl = compressed ? compressible_limit(c.values, k.scalar_type()) : INFINITY;
  const auto fits = [](const at::Tensor& x, double limit) {
    return std::isinf(limit) ? at::isfinite(x).all() : x.abs().le(limit).all();  // NaN fails both
  };
  if (host_flag(fits(k, kl).logical_and(fits(v, vl)))) return;
  for (const auto& [x, name, limit, spec] : {std::tuple(&k, "k", kl, &c.keys), std::tuple(&v, "v", vl, &c.values)}) {
    TORCH_CHECK(!host_flag(at::isnan(*x).any()), kCls, ": ", name,
                " holds NaN; a cache only takes values it can keep and compress (nothing of this append was stored)");
    TORCH_CHECK(!host_flag(at::isinf(*x).any()), kCls, ": ", name,
                " holds Inf; a cache only takes values it can keep and compress (nothing of this append was stored)");
    if (host_flag(fits(*x, limit))) continue;
    const at::ScalarType meta = spec->meta_dtype.value_or(x->scalar_type());
    TORCH_CHECK(false, kCls, ": ", name, " holds a value of magnitude ",
                to_host(x->abs().max().to(at::kDouble)).data_ptr<double>()[0], ", beyond ", limit,
                ", the largest whose group the ", name == std::string("k") ? "key" : "value", " scales/zeros (",
                dtype_name(meta), ") can always represent (nothing of this append was stored)",
                meta == at::kHalf ? "; use meta_dtype=torch.bfloat16 or torch.float32" : "");
  }
}

// What one group of sequences (equal lengths, cache_impl.h row_groups) does
// in this append.  Token counts follow the policy in nexuskv/cache.h.
struct GroupPlan {
  int64_t b0 = 0, b1 = 0;
  at::Tensor k_new, v_new;                       // [nb, H, n, D] the group's real new tokens
  int64_t sink_take = 0;                         // new tokens that go to the sinks
  int64_t n_comp = 0;                            // tokens that leave the tail (evicted ones included)
  int64_t evict_old = 0;                         // compressed tokens dropped from the front of the buffer
  int64_t skip = 0;                              // tokens leaving the tail already dead: never compressed
  int64_t tail_at = 0;                           // the tail is written from this token on (0: rebuilt)
  at::Tensor tail_k, tail_v;                     // [nb, H, *, D] written at tail_at
  StoreParts k_parts, v_parts;                   // fused: the newly compressed tokens
  StoreParts k_moved, v_moved;                   // fused: live rows after the evicted ones
  std::vector<CompressedTensor> k_objs, v_objs;  // chunk storage (nb = 1)
  int64_t sink_after = 0, evicted_after = 0, compressed_after = 0, tail_after = 0;
};

// A full-precision buffer [B, H, cap, D] holding the old one's first min(cap, old) rows (a
// shrink keeps every live row: cap is at least what the append needs, tail_at included).
at::Tensor resized_rows(const at::Tensor& old, int64_t B, int64_t H, int64_t cap, int64_t D,
                        const at::TensorOptions& x) {
  at::Tensor fresh = at::zeros({B, H, cap, D}, x);
  if (old.defined()) {
    const int64_t keep = std::min(cap, old.size(2));
    fresh.slice(2, 0, keep).copy_(old.slice(2, 0, keep));
  }
  return fresh;
}

}  // namespace

at::Tensor KVCache::Impl::check_append(const at::Tensor& k, const at::Tensor& v,
                                       const std::optional<at::Tensor>& valid) const {
  TORCH_CHECK(k.defined() && v.defined(), kCls, ": k and v must be tensors");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), kCls, ": k and v must have one shape [batch, kv_heads, ",
              "tokens, head_dim], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), kCls, ": k and v must have one dtype, got ", k.scalar_type(), " and ",
              v.scalar_type());
  TORCH_CHECK(is_float(k.scalar_type()), kCls, ": k and v must be float32, float16 or bfloat16, got ", k.scalar_type());
  TORCH_CHECK(k.layout() == at::kStrided && v.layout() == at::kStrided, kCls, ": k and v must be dense tensors");
  TORCH_CHECK(!k.is_meta() && !v.is_meta(), kCls,
              ": k and v must hold data (CPU or accelerator tensors), got a meta tensor");
  TORCH_CHECK(k.device() == v.device(), kCls, ": k and v must be on one device, got ", k.device(), " and ", v.device());
  TORCH_CHECK(!(at::GradMode::is_enabled() && (k.requires_grad() || v.requires_grad())), kCls,
              ": the cache is inference-only, but k or v requires grad while grad mode is on; append under "
              "torch.no_grad() or torch.inference_mode(), or pass detached tensors");
  const bool first = !started();
  const int64_t B = k.size(0), H = k.size(1), n = k.size(2), D = k.size(3);
  if (first) {
    TORCH_CHECK(B > 0 && H > 0 && D > 0, kCls,
                ": k and v of the first append() fix [batch, kv_heads, *, head_dim] and need them > 0, got ",
                k.sizes());
    TORCH_CHECK(!options.rotate || (D & (D - 1)) == 0, kCls,
                ": rotate=True needs head_dim a power of two (the Hadamard rotation), got ", D);
  } else {
    TORCH_CHECK(B == batch && H == heads && D == head_dim, kCls, ": this cache holds [", batch, ", ", heads, ", *, ",
                head_dim, "] but k is ", k.sizes(),
                " (a cache is built for one model and batch; call reset() to reuse it)");
    TORCH_CHECK(k.scalar_type() == x_options.dtype().toScalarType(), kCls, ": this cache holds ",
                x_options.dtype().toScalarType(), " but k is ", k.scalar_type());
    check_device("k", k);
  }
  TORCH_CHECK(n <= CacheOptions::kMaxTokens, kCls, ": an append takes at most ", CacheOptions::kMaxTokens,
              " tokens, got ", n);
  for (int64_t b = 0; b < (first ? 0 : batch); ++b)
    TORCH_CHECK(positions(b) + n <= CacheOptions::kMaxPositions, kCls, ": sequence ", b, " would span more than ",
                CacheOptions::kMaxPositions, " positions");
  // valid [B, n] bool: read on the host (the per-sequence counts decide where tokens go).
  at::Tensor keep;
  if (valid) {
    TORCH_CHECK(valid->defined() && valid->scalar_type() == at::kBool, kCls, ": valid must be a bool tensor, got ",
                valid->defined() ? c10::toString(valid->scalar_type()) : "an undefined tensor");
    TORCH_CHECK(valid->dim() == 2 && valid->size(0) == B && valid->size(1) == n, kCls, ": valid must have shape [", B,
                ", ", n, "], got ", valid->sizes());
    TORCH_CHECK(valid->device() == k.device() || valid->device().is_cpu(), kCls,
                ": valid must be on the CPU or on k's device ", k.device(), ", got ", valid->device());
    keep = to_host(*valid);
    if (host_flag(keep.all())) keep = at::Tensor();  // nothing to drop: the batch path
  }
  check_values(*this, k, v);
  return keep;
}

void KVCache::Impl::append(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& valid,
                           bool hold) {
  store(k, v, check_append(k, v, valid), hold);
}

void KVCache::Impl::store(const at::Tensor& k, const at::Tensor& v, const at::Tensor& keep, bool hold) {
  const bool first = !started();
  const int64_t B = k.size(0), H = k.size(1), n = k.size(2), D = k.size(3);

  // ---- plan: everything that can fail ------------------------------------
  thaw_outside_inference_mode();  // contents unchanged: harmless if the append fails below
  const at::TensorOptions xo = k.options();
  const at::Tensor new_signs = first && options.rotate ? rotation_signs_for(D, k.device()) : signs;
  std::vector<int64_t> zeros(size_t(B), 0);
  const auto& sl = first ? zeros : sink_len;
  const auto& el = first ? zeros : evicted_len;
  const auto& cl = first ? zeros : compressed_len;
  const auto& tl = first ? zeros : tail_len;
  std::vector<std::pair<int64_t, int64_t>> groups;
  if (keep.defined() || mode == StorageMode::kChunks) {
    for (int64_t b = 0; b < B; ++b) groups.emplace_back(b, b + 1);
  } else {
    groups = first ? std::vector<std::pair<int64_t, int64_t>>{{0, B}} : row_groups();
  }
  const int64_t W = options.window.value_or(0);
  std::vector<GroupPlan> plans;
  int64_t need_cap = 0, need_tail = 0, need_sink = 0;
  for (const auto& [b0, b1] : groups) {
    GroupPlan g;
    g.b0 = b0, g.b1 = b1;
    g.k_new = k.slice(0, b0, b1), g.v_new = v.slice(0, b0, b1);
    if (keep.defined()) {
      const at::Tensor idx = keep.select(0, b0).nonzero().squeeze(1);
      if (idx.size(0) < n) {
        const at::Tensor on_device = idx.to(k.device());
        g.k_new = g.k_new.index_select(2, on_device), g.v_new = g.v_new.index_select(2, on_device);
      }
    }
    const size_t i = size_t(b0);
    const int64_t s = sl[i], e = el[i], c = cl[i], t = tl[i], m = g.k_new.size(2);
    g.sink_take = std::min(options.sinks - s, m);
    const at::Tensor rk = g.k_new.slice(2, g.sink_take), rv = g.v_new.slice(2, g.sink_take);
    const int64_t total = t + rk.size(2);
    // Held: what a plain append of the first new token alone would compress (the state
    // token-by-token decoding has when that token arrives); the other new tokens wait.
    const int64_t counted = hold ? t + std::min<int64_t>(rk.size(2), 1) : total;
    g.n_comp = std::max<int64_t>(0, counted - options.residual) / chunk * chunk;
    int64_t evict = 0;
    if (W > 0) {
      // Positions < (positions before this append) - W + 1 are seen by no
      // current or future query; drop the whole chunks below that line.
      const int64_t dead = s + e + c + t - W + 1, base = s + e;
      if (dead > base) evict = std::min((dead - base) / chunk * chunk, c + g.n_comp);
    }
    g.evict_old = std::min(evict, c);
    if (mode == StorageMode::kFused && g.evict_old > 0 && g.evict_old < c) {
      // DGQ segments do not end on chunks: evict only up to where every head
      // of every sequence of the group starts a segment (the rest stays,
      // unseen by the window, until a later eviction reaches a boundary).
      for (int64_t before = -1; before != g.evict_old;) {  // a cut for one sequence may not be one for another
        before = g.evict_old;
        for (int64_t b = b0; b < b1; ++b) g.evict_old = segment_cut(b, g.evict_old, c);
      }
      evict = g.evict_old;
    }
    g.skip = evict - g.evict_old;
    if (g.n_comp == 0) {  // the new tokens go after the tail's
      g.tail_at = t, g.tail_k = rk, g.tail_v = rv;
    } else {
      const at::Tensor jk = t ? at::cat({k_tail.slice(0, b0, b1).slice(2, 0, t), rk}, 2) : rk;
      const at::Tensor jv = t ? at::cat({v_tail.slice(0, b0, b1).slice(2, 0, t), rv}, 2) : rv;
      g.tail_at = 0, g.tail_k = jk.slice(2, g.n_comp), g.tail_v = jv.slice(2, g.n_comp);
      if (g.n_comp > g.skip) {
        at::Tensor ck = jk.slice(2, g.skip, g.n_comp), cv = jv.slice(2, g.skip, g.n_comp);
        if (options.rotate) ck = hadamard_rotate(ck, new_signs), cv = hadamard_rotate(cv, new_signs);
        // Our own copies for compressors that may keep what they are given (chunks,
        // external): never the caller's k/v.
        const bool own = mode != StorageMode::kFused;
        ck = own ? ck.clone(at::MemoryFormat::Contiguous) : ck.contiguous();
        cv = own ? cv.clone(at::MemoryFormat::Contiguous) : cv.contiguous();
        if (mode == StorageMode::kFused) {
          g.k_parts = compress_rows(keys, ck, c - g.evict_old);
          g.v_parts = compress_rows(values, cv, c - g.evict_old);
        } else if (mode == StorageMode::kChunks) {
          // With a window, one object per chunk so that eviction is exact.
          const int64_t step = W > 0 ? chunk : ck.size(2);
          for (int64_t lo = 0; lo < ck.size(2); lo += step) {
            g.k_objs.push_back(k_comp->compress(ck.select(0, 0).slice(1, lo, lo + step).contiguous()));
            g.v_objs.push_back(v_comp->compress(cv.select(0, 0).slice(1, lo, lo + step).contiguous()));
          }
        } else {
          g.k_parts = {ck}, g.v_parts = {cv};  // handed over as they are
        }
      }
    }
    if (mode == StorageMode::kFused && g.evict_old > 0 && g.evict_old < c) {
      g.k_moved = store_rows(k_fused, keys, b0, b1, g.evict_old, c);
      g.v_moved = store_rows(v_fused, values, b0, b1, g.evict_old, c);
      for (StoreParts* p : {&g.k_moved, &g.v_moved})
        for (size_t j = 0; j < p->size(); ++j) (*p)[j] = j == 5 ? (*p)[j].sub(int32_t(g.evict_old)) : (*p)[j].clone();
    }
    g.sink_after = s + g.sink_take;
    g.evicted_after = e + evict;
    g.compressed_after = c + g.n_comp - evict;
    g.tail_after = total - g.n_comp;
    need_cap = std::max(need_cap, g.compressed_after);
    need_tail = std::max(need_tail, g.tail_after);
    need_sink = std::max(need_sink, g.sink_after);
    plans.push_back(std::move(g));
  }
  // DGQ segment starts count buffer tokens in int32.
  TORCH_CHECK(need_cap <= CacheOptions::kMaxTokens, kCls, ": a sequence's compressed part would exceed ",
              CacheOptions::kMaxTokens, " tokens");

  // Buffers that must grow (or, with a window, shrink), allocated before any write.
  StoreParts k_store = k_fused, v_store = v_fused;
  bool resized = false;
  if (mode == StorageMode::kFused) {
    const int64_t cur = store_capacity(k_fused);
    int64_t cap = cur;
    // Grow to what is needed plus the whole chunks in 1/64 of it (none with a window): at most
    // 1/64 of the capacity stays unused.  A growth copies the n live rows, once per
    // max(chunk, n/64) appended tokens: at most 64 rows per token, while each decode step's
    // attention reads all n.
    if (need_cap > cur || cur == 0)
      cap = round_up(std::max(need_cap + (W > 0 ? 0 : need_cap / 64 / chunk * chunk), chunk), chunk);
    else if (W > 0 && cur > chunk && cur > 2 * round_up(need_cap, chunk))  // e.g. after a long prefill
      cap = round_up(std::max(need_cap, chunk), chunk);
    if (cap != cur) {
      k_store = allocate_store(keys, B, H, cap, D, xo), v_store = allocate_store(values, B, H, cap, D, xo);
      resized = true;
    }
  }
  // Full-precision buffers follow their need in steps of kStep tokens (at most limit): they grow
  // when it rises and shrink when it falls a step (the tail, after it hands a chunk to the
  // compressed part), so at most kStep - 1 slots per buffer stay unused.  A resize copies
  // at most limit rows, a few times per chunk of decoded tokens.
  constexpr int64_t kStep = 16;
  const auto full_precision = [&](const at::Tensor& old, int64_t need, int64_t limit) {
    const int64_t cur = old.defined() ? old.size(2) : 0;
    const int64_t cap = std::max<int64_t>(std::max(need, std::min(limit, round_up(need, kStep))), 1);
    if (old.defined() && need <= cur && cur <= cap) return old;
    return resized_rows(old, B, H, cap, D, xo);
  };
  // A tail holds at most residual + chunk - 1 tokens after a plain append (the steps' limit;
  // a held append's tail takes what it needs and shrinks back at settle()).
  const int64_t tail_limit = options.residual + chunk;
  at::Tensor kt = full_precision(k_tail, need_tail, tail_limit), vt = full_precision(v_tail, need_tail, tail_limit);
  at::Tensor ks = k_sink, vs = v_sink;
  if (options.sinks > 0)
    ks = full_precision(k_sink, need_sink, options.sinks), vs = full_precision(v_sink, need_sink, options.sinks);

  // ---- commit: copies into existing buffers only --------------------------
  if (first) {
    batch = B, heads = H, head_dim = D, x_options = xo, signs = new_signs;
    sink_len = evicted_len = compressed_len = tail_len = zeros;
    if (mode == StorageMode::kChunks) k_chunks.assign(size_t(B), {}), v_chunks.assign(size_t(B), {});
  }
  for (GroupPlan& g : plans) {
    const size_t i = size_t(g.b0);
    const int64_t s = sink_len[i], c = compressed_len[i];
    if (g.sink_take > 0) {
      ks.slice(0, g.b0, g.b1).slice(2, s, s + g.sink_take).copy_(g.k_new.slice(2, 0, g.sink_take));
      vs.slice(0, g.b0, g.b1).slice(2, s, s + g.sink_take).copy_(g.v_new.slice(2, 0, g.sink_take));
    }
    if (mode == StorageMode::kFused) {
      const int64_t kept = c - g.evict_old;  // old live rows that stay, now at [0, kept)
      if (g.evict_old > 0) {
        if (kept > 0) {
          copy_parts(store_rows(k_store, keys, g.b0, g.b1, 0, kept), g.k_moved);
          copy_parts(store_rows(v_store, values, g.b0, g.b1, 0, kept), g.v_moved);
        }
      } else if (resized && kept > 0) {
        copy_parts(store_rows(k_store, keys, g.b0, g.b1, 0, kept), store_rows(k_fused, keys, g.b0, g.b1, 0, kept));
        copy_parts(store_rows(v_store, values, g.b0, g.b1, 0, kept), store_rows(v_fused, values, g.b0, g.b1, 0, kept));
      }
      if (!g.k_parts.empty()) {
        const int64_t hi = kept + g.k_parts[0].size(2);
        copy_parts(store_rows(k_store, keys, g.b0, g.b1, kept, hi), g.k_parts);
        copy_parts(store_rows(v_store, values, g.b0, g.b1, kept, hi), g.v_parts);
      }
      if (resized || g.evict_old > 0 || !g.k_parts.empty()) {
        fill_unused_segments(k_store, keys, g.b0, g.b1, g.compressed_after);
        fill_unused_segments(v_store, values, g.b0, g.b1, g.compressed_after);
      }
    } else if (mode == StorageMode::kChunks) {
      auto& kc = k_chunks[i];
      auto& vc = v_chunks[i];
      // With a window every object is one chunk; evict_old is a whole number of them.
      const auto drop = std::ptrdiff_t(g.evict_old / chunk);
      kc.erase(kc.begin(), kc.begin() + drop), vc.erase(vc.begin(), vc.begin() + drop);
      for (size_t j = 0; j < g.k_objs.size(); ++j)
        kc.push_back(std::move(g.k_objs[j])), vc.push_back(std::move(g.v_objs[j]));
    } else if (!g.k_parts.empty()) {
      for (int64_t b = g.b0; b < g.b1; ++b)
        due.push_back({b, evicted_len[size_t(b)] + c + g.skip, g.k_parts[0].select(0, b - g.b0).contiguous(),
                       g.v_parts[0].select(0, b - g.b0).contiguous()});
    }
    const int64_t tn = g.tail_k.size(2);
    if (tn > 0) {
      kt.slice(0, g.b0, g.b1).slice(2, g.tail_at, g.tail_at + tn).copy_(g.tail_k);
      vt.slice(0, g.b0, g.b1).slice(2, g.tail_at, g.tail_at + tn).copy_(g.tail_v);
    }
    for (int64_t b = g.b0; b < g.b1; ++b) {
      const size_t j = size_t(b);
      sink_len[j] = g.sink_after, evicted_len[j] = g.evicted_after;
      compressed_len[j] = g.compressed_after, tail_len[j] = g.tail_after;
    }
  }
  if (mode == StorageMode::kFused) k_fused = std::move(k_store), v_fused = std::move(v_store);
  k_tail = kt, v_tail = vt, k_sink = ks, v_sink = vs;
  lengths_changed();
}

std::vector<int64_t> KVCache::Impl::compression_points(int64_t n) const {
  TORCH_CHECK(n >= 0, kCls, ": compression_points needs n >= 0, got ", n);
  std::vector<int64_t> points;
  for (int64_t b = 0; b < (started() ? batch : 1); ++b) {
    // Sequence b's sink count and tail as its tokens arrive one by one (plain appends).
    int64_t s = started() ? sink_len[size_t(b)] : 0, t = started() ? tail_len[size_t(b)] : 0;
    for (int64_t i = 0; i < n; ++i) {
      if (s < options.sinks) {
        ++s;
        continue;
      }
      if (++t - options.residual >= chunk) {  // token i's append compresses
        t -= (t - options.residual) / chunk * chunk;
        if (i > 0) points.push_back(i);
      }
    }
  }
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  return points;
}

at::Tensor KVCache::Impl::append_and_attend(const at::Tensor& k, const at::Tensor& v, const at::Tensor& q,
                                            std::optional<double> scale, std::optional<double> softcap) {
  // Whatever can reject the chunk or its queries, before any piece is stored.
  check_append(k, v, std::nullopt);
  TORCH_CHECK(q.defined() && q.dim() == 4 && q.size(2) == k.size(2), kCls,
              ": append_and_attend needs q [batch, q_heads, n, head_dim] for the n tokens of k, got q ",
              q.defined() ? q.sizes() : at::IntArrayRef{}, " and k ", k.sizes());
  if (!started()) store(k.slice(2, 0, 0), v.slice(2, 0, 0), {}, false);  // fixes what q is checked against
  check_attend(q, softcap);
  const int64_t n = k.size(2);
  std::vector<int64_t> cuts = compression_points(n);
  cuts.insert(cuts.begin(), 0);
  cuts.push_back(n);
  std::vector<at::Tensor> outs;
  for (size_t j = 0; j + 1 < cuts.size(); ++j) {
    const int64_t a = cuts[j], b = cuts[j + 1];
    store(k.slice(2, a, b), v.slice(2, a, b), {}, true);  // checked above, as a whole
    outs.push_back(attend(q.slice(2, a, b), scale, softcap));
  }
  settle();
  return outs.size() == 1 ? outs[0] : at::cat(outs, 2);
}

// What a plain append of the held tokens would have compressed: an append of no tokens
// applies the policy to the tail as it is (and a window's eviction to the positions now
// held).  Only when some tail is past residual + chunk - 1, so that a cache that holds
// nothing back is left untouched (no buffer is resized).
void KVCache::Impl::settle() {
  if (!started()) return;
  const int64_t limit = options.residual + chunk;
  if (std::none_of(tail_len.begin(), tail_len.end(), [&](int64_t t) { return t >= limit; })) return;
  const at::Tensor none = at::empty({batch, heads, 0, head_dim}, x_options);
  store(none, none, {}, false);
}

}  // namespace nexuskv
