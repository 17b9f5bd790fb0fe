// KV compressors for C++ inference code: the KVCompressor interface (the C++
// side of the Python protocol nexuskv.compressors.KVCompressor), and NQ / DGQ
// over the nexuskv operators.  A KVCache (nexuskv/cache.h) takes a pair of
// them: NQ and DGQ are stored in place and read by the fused attention
// kernel; any other compressor (a user's own class) is stored chunk by chunk
// and read back through decompress().
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace nexuskv {

// How NQ / DGQ store K or V (format: nexuskv/core/nq_format.h).
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
  // Least-squares fitted ranges instead of min/max (nq_format.h, "Fitted
  // ranges"): the same format, about half the squared error at 2 bits.
  bool fit_range = false;
  // Tokens that one compression step must cover: whole token groups.
  int64_t token_multiple() const { return axis == -2 ? group_size : 1; }
  // DGQ's longest segment: 2 * group_size rounded up to whole granules (so
  // that ceil(tokens / group_size) segments always suffice).
  int64_t dgq_max_len() const { return (2 * group_size + granule - 1) / granule * granule; }

  static QuantSpec for_keys() { return QuantSpec{}; }
  static QuantSpec for_values() {
    QuantSpec s;
    s.axis = -1;
    return s;
  }
};

// Checks every field of a spec against what nq_compress / dgq_compress
// accept; `who` names the caller and `prefix` the spec ("KVCache",
// "key_" -> "KVCache: key_group_size must be in [1, 256], got 0").
void check_quant_spec(const QuantSpec& spec, const char* who, const char* prefix);

// One compressed tensor: the compressor's buffers and what was compressed.
struct CompressedTensor {
  std::vector<at::Tensor> parts;  // every tensor the compressor keeps (codes and all metadata)
  std::vector<int64_t> shape;     // of the original tensor [..., tokens, head_dim]
  at::ScalarType dtype = at::kFloat;

  int64_t numel() const;
  int64_t nbytes() const;          // every byte of every part
  double effective_bits() const;   // 8 * nbytes / numel: every scale, zero, index and outlier included
  double bytes_ratio() const;      // bytes of the original in its own dtype / nbytes
};

class KVCompressor {
 public:
  virtual ~KVCompressor() = default;
  // x [..., tokens, head_dim], float32 / float16 / bfloat16; tokens a multiple of token_multiple().
  virtual CompressedTensor compress(const at::Tensor& x) const = 0;
  // The inverse, in dtype (default: the dtype that was compressed).
  virtual at::Tensor decompress(const CompressedTensor& c,
                                std::optional<at::ScalarType> dtype = std::nullopt) const = 0;
  // compress() needs whole groups of this many tokens.
  virtual int64_t token_multiple() const { return 1; }
  // The in-place format dgq_fused_attention reads, when there is one (NQ, DGQ).
  virtual std::optional<QuantSpec> fused_spec() const { return std::nullopt; }
  virtual std::string describe() const = 0;
};

// Block quantization with exact outliers (nq_compress / nq_decompress).
class NQCompressor final : public KVCompressor {
 public:
  explicit NQCompressor(QuantSpec spec);
  CompressedTensor compress(const at::Tensor& x) const override;
  at::Tensor decompress(const CompressedTensor& c, std::optional<at::ScalarType> dtype) const override;
  int64_t token_multiple() const override { return spec_.token_multiple(); }
  std::optional<QuantSpec> fused_spec() const override { return spec_; }
  std::string describe() const override;

 private:
  QuantSpec spec_;
};

// Per-channel quantization over data-chosen token groups (dgq_compress / dgq_decompress).
class DGQCompressor final : public KVCompressor {
 public:
  explicit DGQCompressor(QuantSpec spec);
  CompressedTensor compress(const at::Tensor& x) const override;
  at::Tensor decompress(const CompressedTensor& c, std::optional<at::ScalarType> dtype) const override;
  int64_t token_multiple() const override { return spec_.token_multiple(); }
  std::optional<QuantSpec> fused_spec() const override { return spec_; }
  std::string describe() const override;

 private:
  QuantSpec spec_;
};

// NQ, or DGQ when spec.dynamic.
std::shared_ptr<const KVCompressor> make_compressor(const QuantSpec& spec);

}  // namespace nexuskv
