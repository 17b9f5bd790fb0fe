// The fused buffers of a KVCache: one NQ / DGQ tensor [B, H, capacity, D]
// written in place (layout: cache_impl.h).  Sizes come from the format header
// (nexuskv/core/nq_format.h, NQDims), compression and decompression from the
// public operator API (nexuskv/ops.h), so this file works on any device the
// operators support.
#include <ATen/ATen.h>

#include "cache_impl.h"
#include "nexuskv/core/nq_format.h"
#include "nexuskv/ops.h"

namespace nexuskv {
namespace {

core::NQDims dims_of(const QuantSpec& s, int64_t rows, int64_t tokens, int64_t head_dim) {
  core::NQDims d;
  d.rows = rows, d.tokens = tokens, d.head_dim = head_dim;
  d.bits = int(s.bits), d.group_size = int(s.group_size), d.num_outliers = int(s.num_outliers);
  d.axis = s.axis == -2 ? core::GroupAxis::kTokens : core::GroupAxis::kChannels;
  return d;
}

constexpr size_t kSegmentStarts = 5;

}  // namespace

int64_t meta_rows(const QuantSpec& spec, int64_t tokens) {
  return spec.axis == -2 ? core::ceil_div(tokens, spec.group_size) : tokens;
}

StoreParts allocate_store(const QuantSpec& s, int64_t B, int64_t H, int64_t capacity, int64_t D,
                          const at::TensorOptions& x) {
  const core::NQDims d = dims_of(s, B * H, capacity, D);
  const int64_t A = d.meta_a(), Bm = d.meta_b(), k = d.num_outliers;
  const at::ScalarType meta = s.meta_dtype.value_or(x.dtype().toScalarType());
  // Zeros: unused rows decode to zero and the DGQ invariant holds for empty sequences.
  StoreParts parts = {at::zeros({B, H, capacity, d.packed_row_bytes()}, x.dtype(at::kByte)),
                      at::zeros({B, H, A, Bm}, x.dtype(meta)), at::zeros({B, H, A, Bm}, x.dtype(meta)),
                      at::zeros({B, H, A, Bm, k}, x.dtype(at::kByte)), at::zeros({B, H, A, Bm, k}, x)};
  if (s.dynamic) parts.push_back(at::zeros({B, H, A}, x.dtype(at::kInt)));
  return parts;
}

int64_t store_capacity(const StoreParts& parts) { return parts.empty() ? 0 : parts[0].size(2); }

StoreParts store_rows(const StoreParts& parts, const QuantSpec& spec, int64_t b0, int64_t b1, int64_t lo,
                      int64_t hi) {
  StoreParts out;
  out.push_back(parts[0].slice(0, b0, b1).slice(2, lo, hi));
  const int64_t mlo = meta_rows(spec, lo), mhi = meta_rows(spec, hi);
  for (size_t i = 1; i < parts.size(); ++i) out.push_back(parts[i].slice(0, b0, b1).slice(2, mlo, mhi));
  return out;
}

StoreParts compress_rows(const QuantSpec& spec, const at::Tensor& x, int64_t offset) {
  if (spec.dynamic) {
    auto t = dgq_compress(x, spec.bits, spec.group_size, spec.granule, spec.dgq_max_len(), spec.num_outliers,
                          spec.meta_dtype, spec.fit_range);
    // Segment starts count tokens of the buffer, not of x.
    return {std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t),
            std::get<5>(t).add(int32_t(offset))};
  }
  auto t = nq_compress(x, spec.bits, spec.group_size, spec.axis, spec.num_outliers, spec.meta_dtype, spec.fit_range);
  return {std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t)};
}

at::Tensor decompress_rows(const StoreParts& parts, const QuantSpec& spec, int64_t b0, int64_t b1, int64_t lo,
                           int64_t hi, int64_t head_dim) {
  const StoreParts p = store_rows(parts, spec, b0, b1, lo, hi);
  if (spec.dynamic)
    return dgq_decompress(p[0], p[1], p[2], p[3], p[4], p[kSegmentStarts].sub(int32_t(lo)), spec.bits,
                          spec.group_size, head_dim, at::kFloat);
  return nq_decompress(p[0], p[1], p[2], p[3], p[4], spec.bits, spec.group_size, spec.axis, head_dim, at::kFloat);
}

void copy_parts(const StoreParts& dst, const StoreParts& src) {
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
}

void fill_unused_segments(const StoreParts& parts, const QuantSpec& spec, int64_t b0, int64_t b1, int64_t tokens) {
  if (!spec.dynamic) return;
  parts[kSegmentStarts].slice(0, b0, b1).slice(2, meta_rows(spec, tokens)).fill_(int32_t(tokens));
}

}  // namespace nexuskv
