// The compressed KV cache of one attention layer: the single implementation of
// the caching policy (which tokens are compressed when, sink tokens, the
// full-precision tail, a sliding window, growth, byte accounting, beam
// reordering, cropping, save/load), used from C++ directly, from Python and
// TorchScript as torch.classes.nexuskv.KVCache (Python factory:
// nexuskv.cache.make_cache), and by the Hugging Face binding.
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
// Held appends: a chunk attended as token-by-token decoding attends.  Decoding
// appends a token, then attends: the query at position p sees every token the
// policy has compressed by then compressed, the rest exact.  A chunk appended at
// once would compress groups that close inside it before its earlier queries
// attend.  append(..., hold = true) compresses what a plain append of its first
// token alone would, and keeps its other tokens in the tail, in full precision,
// until settle() (or the next append) applies the policy.  Cut a chunk at
// compression_points(n) (the tokens whose own append compresses), append each
// piece held and attend its queries before the next piece: every query then sees
// what it would have seen decoding token by token, and settle() after the last
// leaves the cache as a plain append of the chunk would have.  append_and_attend()
// does all of it (the Hugging Face binding, for every forward of several tokens
// after the first).
// Between append and settle the tail holds one piece beyond the policy.
//
// Sliding window (options.window = W).  The query at position p sees the keys
// at (p - W, p].  At an append of n tokens to a sequence that then has L
// positions, positions < L - n - W + 1 are seen by no current or future query:
// whole compressed chunks below that line are dropped ("evicted"; they are
// counted by evicted_lengths() and no longer by lengths()), and chunks that
// would be dead on arrival are never compressed.  The bytes held are then
// bounded by the window, not by the tokens appended.
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
//
// Capacity.  The compressed buffers grow to the tokens they must hold plus the
// whole chunks in 1/64 of them; the full-precision tail and sink buffers follow
// their fill in steps of 16 tokens (the tail shrinks again after it hands a
// chunk over).  So nbytes() stays within ~1/64 + 16 tail tokens of
// used_nbytes(), and a growth copies at most 64 rows per appended token on
// average.  Buffers made under torch.inference_mode() are copied to normal
// tensors by the first append or crop outside it (torch refuses in-place
// writes to inference tensors there).
//
// Device and dtype.  A cache has none until its first append: it then
// allocates every buffer on the device and in the dtype of that K/V (rotation
// signs too: drawn from the seed on the CPU, moved there once), and later K/V,
// queries, masks and beam indices must match them (to() moves the cache).
//
// Input contract (checked at append, before anything is stored): K/V finite
// and, for compressed storage, within the range the meta dtype of the scales
// and zeros can represent (so that a token accepted now can always be
// compressed later: no append can fail for an earlier token); inference only
// (K/V that require grad under grad mode are rejected).  These checks read one
// flag back from the device per append; on CUDA that synchronization runs only
// with NEXUSKV_CUDA_CHECKS=1 (otherwise a non-finite K/V is kept and makes the
// attention rows that see it NaN, as in dense attention); a `valid` mask
// and, for reorder(), the beam indices are read on the host too, and so are
// DGQ segment starts when crop() or a window's eviction cuts into the
// compressed part (they cut where every head has a segment boundary).  Nothing else reads device data on the
// host: lengths live in host vectors, their
// device copies are refreshed (from pinned memory, without blocking) when
// they change.
//
// Appends are atomic: an append that raises leaves the cache exactly as it
// was (a failed first append leaves it new, shape and device unfixed).
//
// Thread safety: every method takes the cache's own (recursive) mutex, so one
// cache may be shared by threads; calls are serialized, lengths stay exact.
// The order of two concurrent appends is whichever takes the lock first.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "nexuskv/compressor.h"

namespace nexuskv {

// Every setting of a KVCache, checked by its constructor (which names the bad
// field: "KVCache: key_group_size must be in [1, 256], got 0").
struct CacheOptions {
  // Fused storage formats (keys per channel, values per token by default;
  // each QuantSpec carries its meta dtype, unset = the input dtype).
  QuantSpec keys = QuantSpec::for_keys();
  QuantSpec values = QuantSpec::for_values();
  // Any other pair of compressors (both or neither): NQ / DGQ compressors are
  // stored fused with their own specs (keys/values above are then unused),
  // others chunk by chunk through compress()/decompress().
  std::shared_ptr<const KVCompressor> key_compressor, value_compressor;
  int64_t residual = 128;  // newest tokens per sequence kept in full precision (at least)
  int64_t sinks = 0;       // first tokens per sequence kept in full precision for good
  bool rotate = false;     // store K and V in a randomized Hadamard basis drawn from seed
  int64_t seed = 0;
  std::optional<int64_t> window;  // sliding window W >= 1 (needs sinks = 0)
  int64_t external_chunk = 0;     // > 0: external storage in chunks of this many tokens

  // The largest residual, sinks, window or chunk accepted: positions and
  // segment starts must fit the int32 the kernels use for them.
  static constexpr int64_t kMaxTokens = (int64_t(1) << 31) - 1;
  // The most positions a sequence may span, evicted ones included (a sliding
  // window keeps going after kMaxTokens): every sum of lengths stays far from
  // int64 overflow.
  static constexpr int64_t kMaxPositions = int64_t(1) << 53;
};

class KVCache : public torch::CustomClassHolder {
 public:
  explicit KVCache(CacheOptions options = {});
  ~KVCache() override;
  const CacheOptions& options() const;

  // Appends k, v [B, H, n, D] (float32/16/bf16).  valid [B, n] (bool) marks
  // real tokens; false entries (left padding) are dropped.  B, H, D, the dtype
  // and the device are fixed by the first call (reset() frees them).
  // hold = true: only what a plain append of the first new token would compress
  // is; the rest waits for settle() (see "Held appends" above).
  void append(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& valid, bool hold = false);

  // Compresses what the tail holds beyond the policy (tokens of a held
  // append); nothing to do after a plain append or on a new cache.
  void settle();

  // The offsets i in (0, n) of the next n tokens whose plain append (token by
  // token) would compress a chunk, over every sequence, ascending: where to cut
  // a chunk into held pieces (see "Held appends" above).
  std::vector<int64_t> compression_points(int64_t n) const;

  // Appends k, v [B, H, n, D] and returns the attention of q [B, Hq, n, D], the
  // queries of those n positions, as decoding them token by token would: cut at
  // compression_points(n), held pieces, settle() (see "Held appends" above).
  // Everything that can reject k, v or q is checked before any piece is stored.
  at::Tensor append_and_attend(const at::Tensor& k, const at::Tensor& v, const at::Tensor& q,
                               std::optional<double> scale = std::nullopt,
                               std::optional<double> softcap = std::nullopt);

  // softmax(softcap(q K^T * scale) + causal [+ window]) V over each sequence's
  // cached tokens; q [B, Hq, Lq, D] holds the queries of the last Lq appended
  // positions.  Fused and chunk storage.
  at::Tensor attend(const at::Tensor& q, std::optional<double> scale = std::nullopt,
                    std::optional<double> softcap = std::nullopt) const;

  // Dense K, V [B, H, max_length(), D] of the cached tokens (dequantized,
  // zero-padded at the end of shorter sequences) and lengths() [B]: the path
  // for any attention code.  Evicted tokens are not included.  Fused and chunk storage.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> dense(std::optional<at::ScalarType> dtype) const;

  // External storage: the chunks compressed since the last call, in order:
  // (sequence [m], offset [m], k, v), each k/v [H, chunk tokens, D] in the
  // input dtype; offset counts the sequence's compressed tokens before the
  // chunk, evicted ones included (chunks dead on arrival are never handed over).
  std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> take_due_chunks();
  // External storage: dense() with the live compressed part of sequence b
  // (its compressed tokens from evicted_lengths()[b] on) given as
  // k_compressed[b], v_compressed[b] [H, compressed_lengths()[b], D].
  std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_with(const std::vector<at::Tensor>& k_compressed,
                                                            const std::vector<at::Tensor>& v_compressed,
                                                            std::optional<at::ScalarType> dtype) const;

  // Keeps the first `length` positions of every sequence (positions count
  // sinks, evicted and cached tokens; longer sequences are cut, shorter ones
  // kept).  A cut inside the compressed part keeps the surviving tokens of the
  // cut chunk (with DGQ keys: of every chunk back to the last place where all
  // heads' segments begin, as segments do not end on chunks): they are
  // dequantized into the full-precision tail (so they
  // carry their quantization error, as they did in the cache, and are
  // quantized again when their chunk is due).  With a window, a cut that would
  // need evicted positions is an error.  Fused and chunk storage; external
  // storage takes crop_with() when a cut falls inside a compressed part.
  void crop(int64_t length);
  // External storage: crop() with the dequantized live compressed parts (as
  // dense_with() takes them); afterwards the front end keeps only the first
  // compressed_lengths()[b] live compressed tokens of each sequence.
  void crop_with(int64_t length, const std::vector<at::Tensor>& k_compressed,
                 const std::vector<at::Tensor>& v_compressed);

  // Beam search: sequence b becomes the old sequence beam_idx[b] (every
  // stored tensor and length).  beam_idx: integer [B] on the CPU or the cache's device.
  void reorder(const at::Tensor& beam_idx);
  // Moves every tensor of the cache to `device` (offload / prefetch); later
  // inputs must be there.  A new cache has no device yet: a no-op.
  void to(const at::Device& device);
  // An independent deep copy (options shared: compressors are immutable).
  c10::intrusive_ptr<KVCache> clone() const;
  void reset();  // drops all tokens, the batch shape, dtype and device

  // Every option and every stored tensor, documented in csrc/cache/cache_state.cpp
  // (plain tensors only: torch.save / torch.load(weights_only=True) keep it).
  // from_state_dict() restores a cache that continues bit-exactly; chunk
  // storage needs its compressors again (code is not state).
  c10::Dict<std::string, at::Tensor> state_dict() const;
  static c10::intrusive_ptr<KVCache> from_state_dict(const c10::Dict<std::string, at::Tensor>& state,
                                                     std::shared_ptr<const KVCompressor> key_compressor = nullptr,
                                                     std::shared_ptr<const KVCompressor> value_compressor = nullptr);

  at::Tensor lengths() const;             // [B] cached tokens per sequence (int64, CPU): sinks + compressed + tail
  at::Tensor compressed_lengths() const;  // [B] live tokens in the compressed part
  at::Tensor evicted_lengths() const;     // [B] compressed tokens dropped by the window
  int64_t max_length() const;             // max of lengths()
  // Every byte held, allocated capacity included (external storage: the
  // front end adds the bytes of the chunks it keeps).
  int64_t nbytes() const;
  int64_t used_nbytes() const;        // bytes of the cached tokens only (the format's exact count)
  int64_t compressed_nbytes() const;  // bytes of the compressed K/V parts (capacity included; no sinks, tail)
  int64_t chunk() const;
  int64_t sinks() const;
  std::optional<int64_t> window() const;
  bool is_external() const;

  struct Impl;  // csrc/cache/cache_impl.h

 private:
  std::unique_ptr<Impl> impl_;
  mutable std::recursive_mutex mutex_;
};

}  // namespace nexuskv
