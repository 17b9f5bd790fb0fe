// KVCache options: every field is checked here, before anything is built, so
// that a cache either exists with settings its append() can honour or not at
// all (no half-initialized cache, no division by a zero group, no overflow).
#include <ATen/ATen.h>

#include <numeric>

#include "cache_impl.h"

namespace nexuskv {
namespace {

constexpr const char* kCls = "KVCache";

void check_tokens(const char* name, int64_t value, int64_t lo) {
  TORCH_CHECK(value >= lo && value <= CacheOptions::kMaxTokens, kCls, ": ", name, " must be in [", lo, ", ",
              CacheOptions::kMaxTokens, "], got ", value);
}

// lcm(a, b) for a, b in [1, kMaxTokens], or an error when it exceeds kMaxTokens.
int64_t chunk_of(int64_t a, int64_t b, const char* what) {
  const int64_t g = std::gcd(a, b);
  const int64_t step = a / g;  // lcm = step * b, checked before multiplying
  TORCH_CHECK(step <= CacheOptions::kMaxTokens / b, kCls, ": the chunk (least common multiple of ", what, ": ", a,
              " and ", b, ") exceeds ", CacheOptions::kMaxTokens, " tokens");
  return step * b;
}

}  // namespace

KVCache::Impl::Impl(CacheOptions o) : options(std::move(o)) {
  const CacheOptions& op = options;
  check_tokens("residual", op.residual, 0);
  check_tokens("sinks", op.sinks, 0);
  check_tokens("external_chunk", op.external_chunk, 0);
  if (op.window) {
    check_tokens("window", *op.window, 1);
    // The kernel measures the window in positions relative to each
    // sequence's cached keys (sinks, compressed, tail).  Evicting compressed
    // chunks shifts those positions, uniformly as long as nothing is kept
    // before them; sinks would stay at positions 0.. and so would appear
    // nearer to every later query than they are (and a sliding-window layer
    // has no use for them: its queries never see the first tokens again).
    TORCH_CHECK(op.sinks == 0, kCls, ": a sliding window (window=", *op.window,
                ") needs sinks=0 (sinks are kept before the evicted positions, so the window would see them at the "
                "wrong distance), got sinks=",
                op.sinks);
  }
  TORCH_CHECK(bool(op.key_compressor) == bool(op.value_compressor), kCls,
              ": give both key_compressor and value_compressor, or neither");
  if (op.external_chunk > 0) {
    TORCH_CHECK(!op.key_compressor, kCls, ": external storage (external_chunk > 0) takes no compressors");
    TORCH_CHECK(!op.rotate, kCls, ": external storage does not rotate (the front end's compressor may)");
    mode = StorageMode::kExternal;
    chunk = op.external_chunk;
    return;
  }
  if (op.key_compressor && !(op.key_compressor->fused_spec() && op.value_compressor->fused_spec())) {
    mode = StorageMode::kChunks;
    k_comp = op.key_compressor, v_comp = op.value_compressor;
    const int64_t km = k_comp->token_multiple(), vm = v_comp->token_multiple();
    TORCH_CHECK(km >= 1 && km <= CacheOptions::kMaxTokens && vm >= 1 && vm <= CacheOptions::kMaxTokens, kCls,
                ": a compressor's token_multiple() must be in [1, ", CacheOptions::kMaxTokens, "], got ", km,
                " (keys) and ", vm, " (values)");
    chunk = chunk_of(km, vm, "the compressors' token multiples");
    return;
  }
  mode = StorageMode::kFused;
  keys = op.key_compressor ? *op.key_compressor->fused_spec() : op.keys;
  values = op.key_compressor ? *op.value_compressor->fused_spec() : op.values;
  check_quant_spec(keys, kCls, "key_");
  check_quant_spec(values, kCls, "value_");
  chunk = chunk_of(keys.token_multiple(), values.token_multiple(), "the key and value token groups");
}

int64_t KVCache::Impl::positions(int64_t b) const {
  const size_t i = size_t(b);
  return sink_len[i] + evicted_len[i] + compressed_len[i] + tail_len[i];
}

int64_t KVCache::Impl::cached(int64_t b) const {
  const size_t i = size_t(b);
  return sink_len[i] + compressed_len[i] + tail_len[i];
}

void KVCache::Impl::check_started(const char* method) const {
  TORCH_CHECK(started(), kCls, ": ", method, " before any append() (a new or reset cache holds no tokens)");
}

void KVCache::Impl::check_mode(const char* method, bool ok, const char* use) const {
  static const char* names[] = {"fused", "chunk", "external"};
  TORCH_CHECK(ok, kCls, ": ", method, " is not available with ", names[int(mode)], " storage; ", use);
}

void KVCache::Impl::check_device(const char* name, const at::Tensor& t) const {
  TORCH_CHECK(t.device() == x_options.device(), kCls, ": ", name, " is on ", t.device(), " but the cache is on ",
              x_options.device(), " (a cache follows the device of its first append; move it with to())");
}

std::vector<std::pair<int64_t, int64_t>> KVCache::Impl::row_groups() const {
  bool uniform = true;
  for (size_t b = 1; b < size_t(batch) && uniform; ++b)
    uniform = sink_len[b] == sink_len[0] && evicted_len[b] == evicted_len[0] &&
              compressed_len[b] == compressed_len[0] && tail_len[b] == tail_len[0];
  // Chunk storage keeps one list of compressed objects per sequence.
  if (uniform && mode != StorageMode::kChunks) return {{0, batch}};
  std::vector<std::pair<int64_t, int64_t>> groups;
  for (int64_t b = 0; b < batch; ++b) groups.emplace_back(b, b + 1);
  return groups;
}

at::Tensor KVCache::Impl::rotation_signs_for(int64_t D, const at::Device& device) const {
  // Drawn on the CPU from the seed (reproducible on any device), moved once.
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(uint64_t(options.seed));
  const at::Tensor s = at::randint(0, 2, {D}, gen, at::TensorOptions().dtype(at::kFloat)).mul_(2).sub_(1);
  return s.to(device);
}

at::Tensor host_lengths(const std::vector<int64_t>& v) {
  return at::tensor(at::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong));
}

at::Tensor lengths_on(const std::vector<int64_t>& v, const at::Device& device) {
  if (device.is_cpu()) return host_lengths(v);
  // From pinned memory without blocking: a pageable copy would wait for the
  // stream (torch's caching host allocator keeps the buffer until it is done).
  return host_lengths(v).pin_memory().to(device, /*non_blocking=*/true);
}

at::Tensor to_host(const at::Tensor& t) { return t.to(at::kCPU).contiguous(); }

bool host_flag(const at::Tensor& flag) { return to_host(flag.to(at::kBool)).data_ptr<bool>()[0]; }

int64_t tensor_bytes(const at::Tensor& t) { return t.defined() ? t.numel() * int64_t(t.element_size()) : 0; }

}  // namespace nexuskv
