// KVCache, the public front (nexuskv/cache.h): every method takes the
// cache's mutex and forwards to its Impl (cache_impl.h), so that one cache
// shared by threads is never seen half-updated.  Every compression and
// attention goes through the public operator API (nexuskv/ops.h), so the
// cache works on any backend the operators have.
#include "nexuskv/cache.h"

#include <ATen/ATen.h>

#include "cache_impl.h"

namespace nexuskv {
namespace {

constexpr const char* kCls = "KVCache";

void check_compressed_parts(const KVCache::Impl& c, const char* method, const std::vector<at::Tensor>& k_compressed,
                            const std::vector<at::Tensor>& v_compressed) {
  TORCH_CHECK(int64_t(k_compressed.size()) == c.batch && int64_t(v_compressed.size()) == c.batch, kCls, ": ",
              method, ": k_compressed and v_compressed must hold one part per sequence (", c.batch, "), got ",
              k_compressed.size(), " and ", v_compressed.size());
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t n = c.compressed_len[size_t(b)];
    if (n == 0) continue;
    for (const auto& [name, t] : {std::pair("k_compressed", &k_compressed[size_t(b)]),
                                  std::pair("v_compressed", &v_compressed[size_t(b)])}) {
      TORCH_CHECK(t->defined() && t->dim() == 3 && t->size(0) == c.heads && t->size(1) == n &&
                      t->size(2) == c.head_dim,
                  kCls, ": ", method, ": ", name, "[", b, "] (the compressed part of sequence ", b,
                  ") must have shape [", c.heads, ", ", n, ", ", c.head_dim, "], got ",
                  t->defined() ? t->sizes() : at::IntArrayRef{});
      TORCH_CHECK(at::isFloatingType(t->scalar_type()), kCls, ": ", method, ": ", name, "[", b,
                  "] must be dequantized K/V (a floating dtype), got ", t->scalar_type());
      c.check_device((std::string(name) + "[" + std::to_string(b) + "]").c_str(), *t);
    }
  }
}

// The dtype of dense() / dense_with(): a floating dtype (an integer one would
// truncate the dequantized values).
void check_dense_dtype(const char* method, std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(!dtype || at::isFloatingType(*dtype), kCls, ": ", method,
              " dtype must be a floating dtype (float32, float16, bfloat16, float64) or None, got ", *dtype);
}

}  // namespace

using Lock = std::lock_guard<std::recursive_mutex>;

KVCache::KVCache(CacheOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
KVCache::~KVCache() = default;

const CacheOptions& KVCache::options() const { return impl_->options; }  // immutable: no lock

void KVCache::append(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& valid, bool hold) {
  Lock lock(mutex_);
  impl_->append(k, v, valid, hold);
}

void KVCache::settle() {
  Lock lock(mutex_);
  impl_->settle();
}

std::vector<int64_t> KVCache::compression_points(int64_t n) const {
  Lock lock(mutex_);
  return impl_->compression_points(n);
}

at::Tensor KVCache::append_and_attend(const at::Tensor& k, const at::Tensor& v, const at::Tensor& q,
                                      std::optional<double> scale, std::optional<double> softcap) {
  Lock lock(mutex_);
  return impl_->append_and_attend(k, v, q, scale, softcap);
}

at::Tensor KVCache::attend(const at::Tensor& q, std::optional<double> scale, std::optional<double> softcap) const {
  Lock lock(mutex_);
  return impl_->attend(q, scale, softcap);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> KVCache::dense(std::optional<at::ScalarType> dtype) const {
  Lock lock(mutex_);
  impl_->check_started("dense()");
  impl_->check_mode("dense()", impl_->mode != StorageMode::kExternal,
                    "the front end holds the compressed chunks: call dense_with() with them dequantized");
  check_dense_dtype("dense()", dtype);
  return impl_->assemble(dtype.value_or(impl_->x_options.dtype().toScalarType()), nullptr, nullptr);
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> KVCache::take_due_chunks() {
  Lock lock(mutex_);
  impl_->check_mode("take_due_chunks()", impl_->mode == StorageMode::kExternal,
                    "this cache compresses its chunks itself");
  std::vector<int64_t> seq, offset;
  std::vector<at::Tensor> ks, vs;
  for (DueChunk& d : impl_->due) {
    seq.push_back(d.seq), offset.push_back(d.offset);
    ks.push_back(std::move(d.k)), vs.push_back(std::move(d.v));
  }
  impl_->due.clear();
  return {host_lengths(seq), host_lengths(offset), ks, vs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> KVCache::dense_with(const std::vector<at::Tensor>& k_compressed,
                                                                   const std::vector<at::Tensor>& v_compressed,
                                                                   std::optional<at::ScalarType> dtype) const {
  Lock lock(mutex_);
  impl_->check_started("dense_with()");
  impl_->check_mode("dense_with()", impl_->mode == StorageMode::kExternal, "call dense()");
  TORCH_CHECK(impl_->due.empty(), kCls, ": dense_with() while ", impl_->due.size(),
              " chunks wait in take_due_chunks(); take and store them first");
  check_compressed_parts(*impl_, "dense_with()", k_compressed, v_compressed);
  check_dense_dtype("dense_with()", dtype);
  return impl_->assemble(dtype.value_or(impl_->x_options.dtype().toScalarType()), &k_compressed, &v_compressed);
}

void KVCache::crop(int64_t length) {
  Lock lock(mutex_);
  impl_->crop(length, nullptr, nullptr);
}

void KVCache::crop_with(int64_t length, const std::vector<at::Tensor>& k_compressed,
                        const std::vector<at::Tensor>& v_compressed) {
  Lock lock(mutex_);
  impl_->check_mode("crop_with()", impl_->mode == StorageMode::kExternal, "call crop()");
  if (impl_->started()) check_compressed_parts(*impl_, "crop_with()", k_compressed, v_compressed);
  impl_->crop(length, &k_compressed, &v_compressed);
}

void KVCache::reorder(const at::Tensor& beam_idx) {
  Lock lock(mutex_);
  impl_->reorder(beam_idx);
}

void KVCache::to(const at::Device& device) {
  Lock lock(mutex_);
  impl_->to(device);
}

c10::intrusive_ptr<KVCache> KVCache::clone() const {
  Lock lock(mutex_);
  auto copy = c10::make_intrusive<KVCache>(impl_->options);
  copy->impl_ = impl_->deep_copy();
  return copy;
}

void KVCache::reset() {
  Lock lock(mutex_);
  impl_->reset();
}

c10::Dict<std::string, at::Tensor> KVCache::state_dict() const {
  Lock lock(mutex_);
  return impl_->state_dict();
}

c10::intrusive_ptr<KVCache> KVCache::from_state_dict(const c10::Dict<std::string, at::Tensor>& state,
                                                     std::shared_ptr<const KVCompressor> key_compressor,
                                                     std::shared_ptr<const KVCompressor> value_compressor) {
  CacheOptions options = options_from_state(state);
  options.key_compressor = std::move(key_compressor), options.value_compressor = std::move(value_compressor);
  auto cache = c10::make_intrusive<KVCache>(std::move(options));
  cache->impl_->load_state(state);
  return cache;
}

at::Tensor KVCache::lengths() const {
  Lock lock(mutex_);
  return impl_->lengths();
}

at::Tensor KVCache::compressed_lengths() const {
  Lock lock(mutex_);
  return host_lengths(impl_->compressed_len);
}

at::Tensor KVCache::evicted_lengths() const {
  Lock lock(mutex_);
  return host_lengths(impl_->evicted_len);
}

int64_t KVCache::max_length() const {
  Lock lock(mutex_);
  int64_t m = 0;
  for (int64_t b = 0; b < impl_->batch; ++b) m = std::max(m, impl_->cached(b));
  return m;
}

int64_t KVCache::nbytes() const {
  Lock lock(mutex_);
  return impl_->nbytes();
}

int64_t KVCache::used_nbytes() const {
  Lock lock(mutex_);
  return impl_->used_nbytes();
}

int64_t KVCache::compressed_nbytes() const {
  Lock lock(mutex_);
  return impl_->compressed_nbytes();
}

int64_t KVCache::chunk() const { return impl_->chunk; }  // fixed at construction
int64_t KVCache::sinks() const { return impl_->options.sinks; }
std::optional<int64_t> KVCache::window() const { return impl_->options.window; }
bool KVCache::is_external() const { return impl_->mode == StorageMode::kExternal; }

}  // namespace nexuskv
