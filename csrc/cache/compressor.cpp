// NQ and DGQ as KVCompressors (nexuskv/compressor.h), over the public operator API.
#include "nexuskv/compressor.h"

#include <ATen/ATen.h>

#include <sstream>

#include "nexuskv/core/nq_format.h"
#include "nexuskv/ops.h"

namespace nexuskv {

void check_quant_spec(const QuantSpec& s, const char* who, const char* prefix) {
  // Checked on the int64 (an int cast first would take 2**32 + 4 for 4).
  TORCH_CHECK(s.bits == 2 || s.bits == 3 || s.bits == 4 || s.bits == 8, who, ": ", prefix,
              "bits must be one of 2, 3, 4, 8, got ", s.bits);
  TORCH_CHECK(s.group_size >= 1 && s.group_size <= core::kMaxGroupSize, who, ": ", prefix,
              "group_size must be in [1, ", core::kMaxGroupSize, "], got ", s.group_size);
  TORCH_CHECK(s.axis == -2 || s.axis == -1, who, ": ", prefix,
              "axis must be -2 (groups of tokens per channel) or -1 (groups of channels per token), got ", s.axis);
  TORCH_CHECK(s.num_outliers >= 0 && s.num_outliers < s.group_size, who, ": ", prefix,
              "outliers must be in [0, group_size) = [0, ", s.group_size, "), got ", s.num_outliers);
  if (s.meta_dtype)
    TORCH_CHECK(*s.meta_dtype == at::kFloat || *s.meta_dtype == at::kHalf || *s.meta_dtype == at::kBFloat16, who,
                ": ", prefix, "meta_dtype must be float32, float16, bfloat16 or None, got ", *s.meta_dtype);
  if (!s.dynamic) return;
  TORCH_CHECK(s.axis == -2, who, ": ", prefix, "dynamic (DGQ) groups need axis -2, got ", s.axis);
  TORCH_CHECK(s.granule >= 1 && s.granule <= s.group_size, who, ": ", prefix,
              "granule must be in [1, group_size] = [1, ", s.group_size, "], got ", s.granule);
  TORCH_CHECK(s.dgq_max_len() <= core::kMaxGroupSize, who, ": ", prefix,
              "dynamic (DGQ) groups need 2 * group_size rounded up to whole granules <= ", core::kMaxGroupSize,
              " (the longest segment), got group_size ", s.group_size, " and granule ", s.granule, " -> ",
              s.dgq_max_len());
}

int64_t CompressedTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

int64_t CompressedTensor::nbytes() const {
  int64_t n = 0;
  for (const at::Tensor& t : parts)
    if (t.defined()) n += t.numel() * int64_t(t.element_size());
  return n;
}

double CompressedTensor::effective_bits() const {
  const int64_t n = numel();
  return n ? 8.0 * double(nbytes()) / double(n) : 0.0;
}

double CompressedTensor::bytes_ratio() const {
  const int64_t b = nbytes();
  return b ? double(numel()) * double(c10::elementSize(dtype)) / double(b) : 0.0;
}

namespace {

CompressedTensor wrap(std::vector<at::Tensor> parts, const at::Tensor& x) {
  return {std::move(parts), x.sizes().vec(), x.scalar_type()};
}

void check_parts(const char* who, const CompressedTensor& c, size_t n) {
  TORCH_CHECK(c.parts.size() == n && !c.shape.empty(), who, ": decompress needs a tensor it compressed (", n,
              " parts), got ", c.parts.size(), " parts");
}

std::string spec_text(const char* name, const QuantSpec& s) {
  std::ostringstream o;
  o << name << s.bits << " g" << s.group_size << (s.axis == -2 ? " per-channel" : " per-token");
  if (s.num_outliers) o << " k" << s.num_outliers;
  if (s.fit_range) o << " fit";
  return o.str();
}

}  // namespace

NQCompressor::NQCompressor(QuantSpec spec) : spec_(spec) {
  TORCH_CHECK(!spec_.dynamic, "NQCompressor: spec.dynamic is set; use DGQCompressor for data-chosen groups");
  check_quant_spec(spec_, "NQCompressor", "");
}

CompressedTensor NQCompressor::compress(const at::Tensor& x) const {
  auto [codes, scale, zero, idx, val] =
      nq_compress(x, spec_.bits, spec_.group_size, spec_.axis, spec_.num_outliers, spec_.meta_dtype, spec_.fit_range);
  return wrap({codes, scale, zero, idx, val}, x);
}

at::Tensor NQCompressor::decompress(const CompressedTensor& c, std::optional<at::ScalarType> dtype) const {
  check_parts("NQCompressor", c, 5);
  const auto& p = c.parts;
  return nq_decompress(p[0], p[1], p[2], p[3], p[4], spec_.bits, spec_.group_size, spec_.axis, c.shape.back(),
                       dtype.value_or(c.dtype));
}

std::string NQCompressor::describe() const { return spec_text("NQ", spec_); }

DGQCompressor::DGQCompressor(QuantSpec spec) : spec_(spec) {
  TORCH_CHECK(spec_.axis == -2, "DGQCompressor: axis must be -2 (token groups per channel), got ", spec_.axis);
  spec_.dynamic = true;
  check_quant_spec(spec_, "DGQCompressor", "");
}

CompressedTensor DGQCompressor::compress(const at::Tensor& x) const {
  auto [codes, scale, zero, idx, val, starts] =
      dgq_compress(x, spec_.bits, spec_.group_size, spec_.granule, spec_.dgq_max_len(), spec_.num_outliers,
                   spec_.meta_dtype, spec_.fit_range);
  return wrap({codes, scale, zero, idx, val, starts}, x);
}

at::Tensor DGQCompressor::decompress(const CompressedTensor& c, std::optional<at::ScalarType> dtype) const {
  check_parts("DGQCompressor", c, 6);
  const auto& p = c.parts;
  return dgq_decompress(p[0], p[1], p[2], p[3], p[4], p[5], spec_.bits, spec_.group_size, c.shape.back(),
                        dtype.value_or(c.dtype));
}

std::string DGQCompressor::describe() const { return spec_text("DGQ", spec_) + " /" + std::to_string(spec_.granule); }

std::shared_ptr<const KVCompressor> make_compressor(const QuantSpec& spec) {
  if (spec.dynamic) return std::make_shared<DGQCompressor>(spec);
  return std::make_shared<NQCompressor>(spec);
}

}  // namespace nexuskv
