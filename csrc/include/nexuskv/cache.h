// The compressed KV cache of one attention layer: the single implementation of
// the caching policy (which tokens are compressed when, the full-precision
// tail, growth, byte accounting), used from C++ directly, from Python and
// TorchScript as torch.classes.nexuskv.KVCache, and by the Hugging Face
// binding (python_stub/nexuskv/hf.py).
//
// Policy.  Each sequence of the batch keeps its newest tokens in a
// full-precision tail.  When the tail holds more than `residual` tokens, the
// oldest whole chunks beyond the residual (a chunk = the least common multiple
// of the token groups that quantization needs, e.g. 64 tokens for per-channel
// keys in groups of 64) are compressed and appended to the sequence's
// compressed part.  Sequences advance independently (ragged batches, left
// padding dropped at append).  Attention reads the compressed part and the
// tail in place through dgq_fused_attention; no dense copy of the cache is made.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <optional>
#include <tuple>
#include <vector>

namespace nexuskv {

// How K or V is stored (format: nexuskv/core/nq_format.h).
struct QuantSpec {
  int64_t bits = 4;
  int64_t group_size = 64;
  int64_t axis = -2;          // -2: groups of tokens per channel; -1: groups of channels per token
  int64_t num_outliers = 0;
  bool dynamic = false;       // DGQ token groups (axis -2 only)
  int64_t granule = 16;       // DGQ segment granule
  // dtype of scale/zero; unset: the input dtype.  A 16-bit meta keeps an fp32
  // model's cache at bits + 32/group_size effective bits instead of + 64.
  std::optional<at::ScalarType> meta_dtype;
  // Tokens that one compression step must cover: whole token groups.
  int64_t token_multiple() const { return axis == -2 ? group_size : 1; }
};

class KVCache : public torch::CustomClassHolder {
 public:
  // residual: newest tokens per sequence kept in full precision (at least the
  // chunk size is held back anyway until a chunk is full).  rotate: store K and
  // V in a randomized Hadamard basis drawn from seed.
  KVCache(QuantSpec keys, QuantSpec values, int64_t residual, bool rotate = false, int64_t seed = 0);

  // Appends k, v [B, H, n, D] (any float dtype, fixed after the first call).
  // valid [B, n] (bool) marks real tokens; false entries (left padding) are
  // dropped.  B, H, D are fixed by the first call.
  void append(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& valid);

  // softmax(q K^T * scale + causal) V over each sequence's cached tokens;
  // q [B, Hq, Lq, D] holds the queries of the last Lq appended positions.
  at::Tensor attend(const at::Tensor& q, std::optional<double> scale) const;

  // Dense K, V [B, H, max_len, D] (dequantized, zero-padded at the end of
  // shorter sequences) and lengths [B]: the path for any attention code.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> dense(std::optional<at::ScalarType> dtype) const;

  at::Tensor lengths() const;  // [B] tokens cached per sequence (int64)
  int64_t max_length() const;
  int64_t nbytes() const;       // every byte held, allocated capacity included
  int64_t used_nbytes() const;  // bytes of the cached tokens only
  int64_t compressed_nbytes() const;  // bytes of the compressed K/V parts (capacity included; no tail)
  int64_t chunk() const { return chunk_; }
  void reset();                 // drops all tokens and the batch shape

 private:
  struct Store {  // one of K, V: compressed part [B, H, capacity, ...]
    std::vector<at::Tensor> parts;  // codes, scale, zero, outlier_idx, outlier_val (+ segment_starts)
  };
  void ensure_capacity(int64_t tokens);
  void ensure_tail_capacity(int64_t tokens);
  void write_compressed(Store& s, const QuantSpec& spec, int64_t b, int64_t offset, const at::Tensor& x);
  std::vector<int64_t> format(const QuantSpec& spec) const { return {spec.bits, spec.group_size, spec.axis}; }
  at::Tensor dequantize(const Store& s, const QuantSpec& spec, int64_t b, at::ScalarType dtype) const;

  QuantSpec keys_, values_;
  int64_t residual_, chunk_;
  bool rotate_;
  int64_t seed_;
  int64_t batch_ = 0, heads_ = 0, head_dim_ = 0, capacity_ = 0, tail_capacity_ = 0;
  at::ScalarType dtype_ = at::kFloat;
  Store k_, v_;
  at::Tensor k_tail_, v_tail_;        // [B, H, tail_capacity, D] in the input dtype
  at::Tensor signs_;                  // [D] when rotated
  std::vector<int64_t> compressed_len_, tail_len_;
};

}  // namespace nexuskv
