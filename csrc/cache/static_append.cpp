// CPU kernel of static_kv_append_: the append of a fixed-capacity compressed
// cache whose whole state is tensors (nexuskv.static_cache.StaticKVCache), so
// that a decode step is two operators (this one and dgq_fused_attention) that
// torch.compile(fullgraph=True) and torch.export trace without a break.
//
// Policy, per sequence (the dynamic KVCache's, without sinks and eviction):
// the tail holds the newest tokens in full precision; once the tail and the
// new tokens hold residual + chunk tokens or more, their oldest whole chunks
// are compressed into the store at the compressed length, and the rest (at
// least residual, fewer than residual + chunk) becomes the tail.  chunk: the
// tokens one compression covers (whole token groups of K and of V).
//
// Atomic: every check and every compression runs before the first write, so
// a call that raises leaves the cache as it was.  The lengths are read on the
// host: this is a CPU kernel (a CUDA one would keep them on the device).
#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "../aten/static_append_args.h"
#include "cache_impl.h"

namespace nexuskv {
namespace {

constexpr const char* kOp = "static_kv_append_";

QuantSpec spec_of(at::TensorList store, at::IntArrayRef format, const core::NQDims& d, bool dgq, int64_t granule) {
  QuantSpec s;
  s.bits = d.bits, s.group_size = d.group_size, s.num_outliers = d.num_outliers;
  s.axis = format[2];
  s.dynamic = dgq, s.granule = granule;
  s.meta_dtype = store[1].scalar_type();
  return s;
}

// Whether every element of x (in host memory: a CPU kernel) is finite: max |x| is NaN or
// Inf exactly when an element is (max propagates NaN), and it costs a fraction of
// isfinite(x).all() on 16-bit floats (a decode step checks every stored scale with it).
bool all_finite(const at::Tensor& x) { return x.numel() == 0 || std::isfinite(x.abs().max().item<double>()); }

struct Plan {
  int64_t b0, b1, compressed, tail;  // sequences [b0, b1) share both lengths
  int64_t n_comp = 0;                // tokens this append compresses
  StoreParts k_parts, v_parts;       // their compressed form
  at::Tensor k_rest, v_rest;         // the new tail
};

// NaN or Inf in what the append reads (the tail tokens it compresses or keeps) or in what
// every attention after it reads (the scales, zeros and outlier values of the compressed
// tokens) is a corrupted buffer, poked or loaded: the op stores only finite values, so it
// refuses to continue such a cache rather than serve NaN attention from it.
void check_stored_values(const StoreParts& k_all, const QuantSpec& ks, const StoreParts& v_all, const QuantSpec& vs,
                         const at::Tensor& k_tail, const at::Tensor& v_tail, const Plan& p) {
  const auto where = [&](const char* name, const char* tokens, int64_t n) {
    return c10::str(kOp, ": ", name, " holds NaN or Inf in the ", tokens, " tokens [0, ", n, ") of sequences [", p.b0,
                    ", ", p.b1, "): a corrupted buffer (the cache stores only finite values); nothing was stored");
  };
  for (const auto& [t, name] : {std::pair{&k_tail, "k_tail"}, std::pair{&v_tail, "v_tail"}})
    TORCH_CHECK(all_finite(t->slice(0, p.b0, p.b1).slice(2, 0, p.tail)), where(name, "tail", p.tail));
  if (p.compressed == 0) return;
  for (const auto& [all, spec, store] : {std::tuple{&k_all, &ks, "k_store"}, std::tuple{&v_all, &vs, "v_store"}}) {
    const StoreParts rows = store_rows(*all, *spec, p.b0, p.b1, 0, p.compressed);
    for (const auto& [i, part] : {std::pair{1, "scale"}, std::pair{2, "zero"}, std::pair{4, "outlier_val"}})
      TORCH_CHECK(all_finite(rows[size_t(i)]),
                  where(c10::str(store, "[", i, "] (", part, ")").c_str(), "compressed", p.compressed));
  }
}

void static_kv_append_cpu(at::TensorList k_store, at::TensorList v_store, const at::Tensor& k_tail,
                          const at::Tensor& v_tail, const at::Tensor& lengths, const at::Tensor& k, const at::Tensor& v,
                          at::IntArrayRef k_format, at::IntArrayRef v_format, int64_t residual) {
  const StaticAppendShapes s =
      check_static_append_args(k_store, v_store, k_tail, v_tail, lengths, k, v, k_format, v_format, residual);
  TORCH_CHECK(lengths.is_contiguous(), kOp, ": lengths must be contiguous");
  TORCH_CHECK(all_finite(k) && all_finite(v), kOp,
              ": k and v must be finite (a cache only takes values it can compress; nothing was stored)");
  const QuantSpec ks = spec_of(k_store, k_format, s.k, s.k_dgq, s.granule);
  const QuantSpec vs = spec_of(v_store, v_format, s.v, false, 16);
  const StoreParts k_all(k_store.begin(), k_store.end()), v_all(v_store.begin(), v_store.end());
  const int64_t* len = lengths.data_ptr<int64_t>();  // [2, B]: compressed, tail
  const int64_t B = s.batch, capacity = s.k.tokens;

  // Sequences with equal lengths are appended together (one compression each).
  std::vector<Plan> plans;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = len[b], t = len[B + b];
    TORCH_CHECK(c >= 0 && c <= capacity && c % s.chunk == 0 && t >= 0 && t <= s.tail_capacity, kOp,
                ": lengths of sequence ", b, " are corrupt (compressed ", c, ", tail ", t, ")");
    if (!plans.empty() && plans.back().compressed == c && plans.back().tail == t)
      plans.back().b1 = b + 1;
    else
      plans.push_back(Plan{b, b + 1, c, t});
  }
  for (Plan& p : plans) {
    check_stored_values(k_all, ks, v_all, vs, k_tail, v_tail, p);
    const at::Tensor xk = at::cat({k_tail.slice(0, p.b0, p.b1).slice(2, 0, p.tail), k.slice(0, p.b0, p.b1)}, 2);
    const at::Tensor xv = at::cat({v_tail.slice(0, p.b0, p.b1).slice(2, 0, p.tail), v.slice(0, p.b0, p.b1)}, 2);
    const int64_t held = p.tail + s.new_tokens;
    p.n_comp = held >= residual + s.chunk ? (held - residual) / s.chunk * s.chunk : 0;
    TORCH_CHECK(p.compressed + p.n_comp <= capacity, kOp, ": the static cache is full: it holds ",
                p.compressed + p.tail, " tokens of sequence ", p.b0, ", ", s.new_tokens, " more need ",
                p.compressed + p.n_comp, " compressed slots of ", capacity,
                " (make it with a larger max_tokens); nothing was stored");
    if (p.n_comp > 0) {
      p.k_parts = compress_rows(ks, xk.slice(2, 0, p.n_comp), p.compressed);
      p.v_parts = compress_rows(vs, xv.slice(2, 0, p.n_comp), p.compressed);
    }
    p.k_rest = xk.slice(2, p.n_comp), p.v_rest = xv.slice(2, p.n_comp);
  }

  // Nothing below can fail.
  int64_t* out = lengths.data_ptr<int64_t>();
  for (const Plan& p : plans) {
    if (p.n_comp > 0) {
      const int64_t lo = p.compressed, hi = p.compressed + p.n_comp;
      copy_parts(store_rows(k_all, ks, p.b0, p.b1, lo, hi), p.k_parts);
      copy_parts(store_rows(v_all, vs, p.b0, p.b1, lo, hi), p.v_parts);
      fill_unused_segments(k_all, ks, p.b0, p.b1, hi);
    }
    const int64_t rest = p.k_rest.size(2);
    k_tail.slice(0, p.b0, p.b1).slice(2, 0, rest).copy_(p.k_rest);
    v_tail.slice(0, p.b0, p.b1).slice(2, 0, rest).copy_(p.v_rest);
    for (int64_t b = p.b0; b < p.b1; ++b) out[b] = p.compressed + p.n_comp, out[B + b] = rest;
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(nexuskv, CPU, m) { m.impl("static_kv_append_", &static_kv_append_cpu); }

}  // namespace nexuskv
