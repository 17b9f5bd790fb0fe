// The compressed KV cache of one attention layer: the single implementation of
// the caching policy (which tokens are compressed when, sink tokens, the
// full-precision tail, growth, byte accounting, beam reordering), used from
// C++ directly, from Python and TorchScript as torch.classes.nexuskv.KVCache,
// and by the Hugging Face binding (python_stub/nexuskv/hf.py).
//
// Policy.  The first `sinks` tokens of each sequence stay in full precision
// for good (attention sinks).  After them, each sequence keeps its newest
// tokens in a full-precision tail.  When the tail holds more than `residual`
// tokens, the oldest whole chunks beyond the residual (a chunk = the least
// common multiple of the token groups the compressors need, e.g. 64 tokens
// for per-channel keys in groups of 64) are compressed and appended to the
// sequence's compressed part.  Sequences advance independently (ragged
// batches, left padding dropped at append).  Positions: sinks, compressed
// part, tail.
//
// Storage, one of three:
//   fused     NQ / DGQ buffers [B, H, capacity, ...] grown in place; attention
//             reads them through dgq_fused_attention (no dense copy).
//   chunks    any C++ KVCompressor: one CompressedTensor per chunk; attention
//             and dense() go through decompress().
//   external  no compression here: the chunks due for compression are handed
//             to the front end (take_due_chunks), which compresses them with
//             its own compressor (e.g. a Python class), keeps them, and gives
//             them back dequantized to dense_with().  The policy stays here.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "nexuskv/compressor.h"

namespace nexuskv {

class KVCache : public torch::CustomClassHolder {
 public:
  // Fused storage.  residual: newest tokens per sequence kept in full
  // precision (at least the chunk size is held back anyway until a chunk is
  // full).  rotate: store K and V in a randomized Hadamard basis drawn from
  // seed.  sinks: first tokens per sequence kept in full precision.
  KVCache(QuantSpec keys, QuantSpec values, int64_t residual, bool rotate = false, int64_t seed = 0,
          int64_t sinks = 0);
  // Any pair of compressors: fused storage when both have a fused_spec (NQ,
  // DGQ), chunk storage otherwise.
  KVCache(std::shared_ptr<const KVCompressor> keys, std::shared_ptr<const KVCompressor> values, int64_t residual,
          int64_t sinks = 0, bool rotate = false, int64_t seed = 0);
  // External storage with chunks of `chunk` tokens.
  static c10::intrusive_ptr<KVCache> external(int64_t chunk, int64_t residual, int64_t sinks = 0);

  // Appends k, v [B, H, n, D] (float32/16/bf16, fixed after the first call).
  // valid [B, n] (bool) marks real tokens; false entries (left padding) are
  // dropped.  B, H, D are fixed by the first call.
  void append(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& valid);

  // softmax(q K^T * scale + causal) V over each sequence's cached tokens;
  // q [B, Hq, Lq, D] holds the queries of the last Lq appended positions.
  // Fused and chunk storage.
  at::Tensor attend(const at::Tensor& q, std::optional<double> scale) const;

  // Dense K, V [B, H, max_len, D] (dequantized, zero-padded at the end of
  // shorter sequences) and lengths [B]: the path for any attention code.
  // Fused and chunk storage.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> dense(std::optional<at::ScalarType> dtype) const;

  // External storage: the chunks compressed since the last call, in order:
  // (sequence [m], offset in the sequence's compressed part [m], k, v), each
  // k/v [H, chunk tokens, D] in the input dtype.
  std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> take_due_chunks();
  // External storage: dense() with the compressed part of sequence b given
  // as k_compressed[b], v_compressed[b] [H, compressed tokens of b, D].
  std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_with(const std::vector<at::Tensor>& k_compressed,
                                                            const std::vector<at::Tensor>& v_compressed,
                                                            std::optional<at::ScalarType> dtype) const;

  // Beam search: sequence b becomes the old sequence beam_idx[b] (every
  // stored tensor, length, sink and tail).
  void reorder(const at::Tensor& beam_idx);

  at::Tensor lengths() const;            // [B] tokens cached per sequence (int64), sinks included
  at::Tensor compressed_lengths() const; // [B] tokens in the compressed part
  int64_t max_length() const;
  // Every byte held, allocated capacity included (external storage: the
  // front end adds the bytes of the chunks it keeps).
  int64_t nbytes() const;
  int64_t used_nbytes() const;  // bytes of the cached tokens only
  int64_t compressed_nbytes() const;  // bytes of the compressed K/V parts (capacity included; no sinks, tail)
  int64_t chunk() const { return chunk_; }
  int64_t sinks() const { return sinks_; }
  bool is_external() const { return mode_ == Mode::kExternal; }
  void reset();                 // drops all tokens and the batch shape

 private:
  enum class Mode { kFused, kChunks, kExternal };
  struct Store {  // one of K, V: compressed part [B, H, capacity, ...]
    std::vector<at::Tensor> parts;  // codes, scale, zero, outlier_idx, outlier_val (+ segment_starts)
  };
  struct DueChunk {
    int64_t seq, offset;
    at::Tensor k, v;  // [H, n, D]
  };
  KVCache(Mode mode, int64_t chunk, int64_t residual, int64_t sinks, bool rotate, int64_t seed);
  void check_started(const char* method) const;
  void check_mode(const char* method, bool ok, const char* use) const;
  void ensure_capacity(int64_t tokens);
  void ensure_tail_capacity(int64_t tokens);
  void store_chunk(int64_t b, int64_t offset, at::Tensor k, at::Tensor v);
  void write_compressed(Store& s, const QuantSpec& spec, int64_t b, int64_t offset, const at::Tensor& x);
  std::vector<int64_t> format(const QuantSpec& spec) const { return {spec.bits, spec.group_size, spec.axis}; }
  at::Tensor dequantize(const Store& s, const QuantSpec& spec, int64_t b, at::ScalarType dtype) const;
  at::Tensor decompress_chunks(bool keys, int64_t b, at::ScalarType dtype) const;
  template <typename CompressedPart>
  std::tuple<at::Tensor, at::Tensor, at::Tensor> assemble(at::ScalarType dtype, CompressedPart part) const;

  Mode mode_;
  QuantSpec keys_, values_;                               // fused storage
  std::shared_ptr<const KVCompressor> k_comp_, v_comp_;   // chunk storage
  int64_t residual_, sinks_, chunk_;
  bool rotate_;
  int64_t seed_;
  int64_t batch_ = 0, heads_ = 0, head_dim_ = 0, capacity_ = 0, tail_capacity_ = 0;
  at::ScalarType dtype_ = at::kFloat;
  Store k_, v_;
  std::vector<std::vector<CompressedTensor>> k_chunks_, v_chunks_;  // chunk storage, per sequence
  std::vector<DueChunk> due_;                                       // external storage
  at::Tensor k_tail_, v_tail_;        // [B, H, tail_capacity, D] in the input dtype
  at::Tensor k_sink_, v_sink_;        // [B, H, sinks, D] in the input dtype
  at::Tensor signs_;                  // [D] when rotated
  std::vector<int64_t> compressed_len_, tail_len_, sink_len_;
};

}  // namespace nexuskv
