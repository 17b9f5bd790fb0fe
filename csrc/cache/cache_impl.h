// The inside of a KVCache (nexuskv/cache.h): its configuration, its stored
// tensors and the per-sequence lengths, with the policy as methods that do
// not lock (the public KVCache methods take the lock and forward here).
//
// Files: kv_cache.cpp (the locking front), cache_options.cpp (checks of
// every option), cache_store.cpp (the fused buffers, sized from
// nexuskv/core/nq_format.h), cache_append.cpp (append: plan, then commit),
// cache_read.cpp (attend, dense, bytes), cache_edit.cpp (crop, reorder, to,
// clone), cache_state.cpp (state_dict / from_state_dict).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>
#include <vector>

#include "nexuskv/cache.h"

namespace nexuskv {

enum class StorageMode { kFused, kChunks, kExternal };

// ---- the fused buffers of K or V (cache_store.cpp) ---------------------------
//
// One compressed tensor [B, H, capacity, D] in the NQ / DGQ format of
// nq_format.h, written in place chunk by chunk:
//   parts[0] codes          uint8 [B, H, capacity, row_bytes(bits, D)]
//   parts[1] scale, [2] zero meta [B, H, A, Bm]     A, Bm: NQDims::meta_a/meta_b
//   parts[3] outlier_idx    uint8 [B, H, A, Bm, k]
//   parts[4] outlier_val    x     [B, H, A, Bm, k]
//   parts[5] segment_starts int32 [B, H, A]  (DGQ only; tokens of the buffer)
// Invariant: the unused DGQ segment slots of sequence b (past its compressed
// tokens) hold its compressed length, so that every row lists ordered
// segments within [0, capacity] (what the readers check).
using StoreParts = std::vector<at::Tensor>;

// Meta rows (dim 2 of parts[1..]) that the tokens [0, tokens) use.
int64_t meta_rows(const QuantSpec& spec, int64_t tokens);
StoreParts allocate_store(const QuantSpec& spec, int64_t batch, int64_t heads, int64_t capacity, int64_t head_dim,
                          const at::TensorOptions& x_options);
int64_t store_capacity(const StoreParts& parts);
// Views of sequences [b0, b1), tokens [lo, hi) of every part (lo, hi on group
// boundaries for per-channel groups).
StoreParts store_rows(const StoreParts& parts, const QuantSpec& spec, int64_t b0, int64_t b1, int64_t lo, int64_t hi);
// Compresses x [nb, H, n, D] into parts laid out to land at token `offset`
// of the buffer (DGQ segment starts shifted by it).
StoreParts compress_rows(const QuantSpec& spec, const at::Tensor& x, int64_t offset);
// Dequantizes sequences [b0, b1), tokens [lo, hi) to float32 [nb, H, hi - lo, D].
at::Tensor decompress_rows(const StoreParts& parts, const QuantSpec& spec, int64_t b0, int64_t b1, int64_t lo,
                           int64_t hi, int64_t head_dim);
// Writes `src` (views of the same shapes) into `dst`.
void copy_parts(const StoreParts& dst, const StoreParts& src);
// Re-establishes the DGQ invariant for sequences [b0, b1) holding `tokens`.
void fill_unused_segments(const StoreParts& parts, const QuantSpec& spec, int64_t b0, int64_t b1, int64_t tokens);

// ---- the cache --------------------------------------------------------------

// A chunk handed to the front end (external storage): k, v [H, n, D].
struct DueChunk {
  int64_t seq, offset;
  at::Tensor k, v;
};

struct KVCache::Impl {
  // Configuration, fixed and checked at construction (cache_options.cpp).
  CacheOptions options;
  StorageMode mode = StorageMode::kFused;
  int64_t chunk = 1;
  QuantSpec keys, values;                              // fused storage
  std::shared_ptr<const KVCompressor> k_comp, v_comp;  // chunk storage

  // Fixed by the first append: shape, dtype and device of K/V.
  int64_t batch = 0, heads = 0, head_dim = 0;
  at::TensorOptions x_options;

  // Stored tokens.
  StoreParts k_fused, v_fused;                                    // fused
  std::vector<std::vector<CompressedTensor>> k_chunks, v_chunks;  // chunk storage, per sequence
  std::vector<DueChunk> due;                                      // external storage
  at::Tensor k_tail, v_tail;                                      // [B, H, tail capacity, D] x dtype
  at::Tensor k_sink, v_sink;                                      // [B, H, sink capacity, D] x dtype (sinks > 0)
  at::Tensor signs;                                               // [D] float32, when rotated
  // Per sequence: sinks, compressed tokens dropped by the window, live
  // compressed tokens, tail tokens.  Positions: sink, evicted, compressed, tail.
  std::vector<int64_t> sink_len, evicted_len, compressed_len, tail_len;

  // Device copies of compressed/tail/sink lengths for the fused kernel,
  // rebuilt when the lengths change (not per attend call).
  mutable std::vector<at::Tensor> device_lengths;

  explicit Impl(CacheOptions options);  // cache_options.cpp
  Impl(const Impl&) = default;          // shallow: tensors shared (clone() deep-copies them)

  bool started() const { return batch > 0; }
  int64_t positions(int64_t b) const;  // sink + evicted + compressed + tail
  int64_t cached(int64_t b) const;     // sink + compressed + tail
  void check_started(const char* method) const;
  void check_mode(const char* method, bool ok, const char* use) const;
  void check_device(const char* name, const at::Tensor& t) const;
  void lengths_changed() { device_lengths.clear(); }
  // Sequences grouped by equal lengths: one group [0, B) when all are equal
  // (the common case, handled as a batch), else one group per sequence.
  std::vector<std::pair<int64_t, int64_t>> row_groups() const;
  // Dequantized (and un-rotated) live compressed tokens [lo, hi) of
  // sequences [b0, b1) in dtype: fused or chunk storage.
  at::Tensor compressed_tokens(bool keys, int64_t b0, int64_t b1, int64_t lo, int64_t hi, at::ScalarType dtype) const;
  at::Tensor rotation_signs_for(int64_t head_dim, const at::Device& device) const;

  // cache_append.cpp.  check_append: every check of an append (none stores anything),
  // returning the host copy of `valid` where it drops tokens.
  at::Tensor check_append(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& valid) const;
  void append(const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& valid, bool hold);
  // The append after its checks (keep: check_append's; undefined: every token is real).
  void store(const at::Tensor& k, const at::Tensor& v, const at::Tensor& keep, bool hold);
  void settle();
  std::vector<int64_t> compression_points(int64_t n) const;
  at::Tensor append_and_attend(const at::Tensor& k, const at::Tensor& v, const at::Tensor& q,
                               std::optional<double> scale, std::optional<double> softcap);
  // Append and crop write into the fused, tail and sink buffers in place, which torch refuses
  // for tensors made under torch.inference_mode() once outside it (a prompt cache filled under
  // inference_mode, then generate): those buffers are replaced by normal copies first, once.
  void thaw_outside_inference_mode();  // cache_edit.cpp
  void check_attend(const at::Tensor& q, std::optional<double> softcap) const;  // cache_read.cpp
  at::Tensor attend(const at::Tensor& q, std::optional<double> scale, std::optional<double> softcap) const;
  std::tuple<at::Tensor, at::Tensor, at::Tensor> assemble(
      at::ScalarType dtype, const std::vector<at::Tensor>* k_compressed,
      const std::vector<at::Tensor>* v_compressed) const;  // cache_read.cpp
  void crop(int64_t length, const std::vector<at::Tensor>* k_compressed,
            const std::vector<at::Tensor>* v_compressed);  // cache_edit.cpp
  // The largest whole-chunk token <= keep at which sequence b's DGQ segments
  // can be cut (keep itself without DGQ parts, or when nothing is cut): where
  // crop() and a window's eviction cut the compressed part.
  int64_t segment_cut(int64_t b, int64_t keep, int64_t compressed) const;
  void reorder(const at::Tensor& beam_idx);
  void to(const at::Device& device);
  std::unique_ptr<Impl> deep_copy() const;
  void reset();
  at::Tensor lengths() const;
  int64_t nbytes() const;
  int64_t used_nbytes() const;
  int64_t compressed_nbytes() const;
  c10::Dict<std::string, at::Tensor> state_dict() const;  // cache_state.cpp
  void load_state(const c10::Dict<std::string, at::Tensor>& state);
  void check_loaded_values() const;  // cache_state.cpp, after load_state
};

// Options recovered from a state dict (cache_state.cpp), for from_state_dict.
CacheOptions options_from_state(const c10::Dict<std::string, at::Tensor>& state);

at::Tensor host_lengths(const std::vector<int64_t>& v);  // [n] int64 CPU
// [n] int64 on `device`, copied without a host synchronization.
at::Tensor lengths_on(const std::vector<int64_t>& v, const at::Device& device);

// The only reads of tensor data on the host (nexuskv/cache.h says why): the
// value check of an append (one flag), a valid mask, beam indices, the DGQ
// segment starts a crop cuts, and a state dict being loaded.  Nothing on the
// attend path.
at::Tensor to_host(const at::Tensor& t);  // a contiguous CPU copy (or t itself on the CPU)
bool host_flag(const at::Tensor& flag);   // one bool, read back
int64_t tensor_bytes(const at::Tensor& t);

}  // namespace nexuskv
