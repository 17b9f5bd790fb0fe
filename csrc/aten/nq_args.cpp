#include "nq_args.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <string>

namespace nexuskv {
namespace {

// "<what>: " before a message when the buffers belong to a named cache (k_cache, v_cache).
std::string prefix(const char* what) { return what && *what ? std::string(what) + ": " : std::string(); }

void check_bits_group_axis(const char* op, int64_t bits, int64_t group_size, int64_t axis,
                           const std::string& fmt = "") {
  // On the int64 values as given: a narrowing first would turn 2**32 + 4 into 4.
  TORCH_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 8, op, ": ", fmt, "bits must be one of 2, 3, 4, 8, got ",
              bits);
  TORCH_CHECK(group_size >= 1 && group_size <= core::kMaxGroupSize, op, ": ", fmt, "group_size must be in [1, ",
              core::kMaxGroupSize, "], got ", group_size);
  TORCH_CHECK(axis == -2 || axis == -1, op, ": ", fmt,
              "axis must be -2 (groups of consecutive tokens, one scale per channel: keys) or -1 "
              "(groups of consecutive channels, one scale per token: values), got ",
              axis);
}

void check_num_outliers(const char* op, int64_t num_outliers, int64_t group_size) {
  TORCH_CHECK(num_outliers >= 0 && num_outliers < group_size, op, ": num_outliers must be in [0, group_size) = [0, ",
              group_size, "), got ", num_outliers);
}

core::GroupAxis to_group_axis(int64_t axis) {
  return axis == -2 ? core::GroupAxis::kTokens : core::GroupAxis::kChannels;
}

// Checks that t has sizes lead + tail.
void check_sizes(const char* op, const std::string& name, const at::Tensor& t, at::IntArrayRef lead,
                 std::initializer_list<int64_t> tail) {
  std::vector<int64_t> want(lead.begin(), lead.end());
  want.insert(want.end(), tail.begin(), tail.end());
  TORCH_CHECK(t.sizes() == at::IntArrayRef(want), op, ": ", name, " must have shape ", at::IntArrayRef(want),
              " (from codes and the format parameters), got ", t.sizes());
}

}  // namespace

bool is_float_type(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

core::DType to_core_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return core::DType::kFloat32;
    case at::kHalf: return core::DType::kFloat16;
    case at::kBFloat16: return core::DType::kBFloat16;
    default: TORCH_CHECK(false, "nexuskv: unsupported dtype ", t);
  }
}

void check_same_device(const char* op, const char* first_name, const at::Tensor& first,
                       std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  for (const auto& [name, t] : tensors)
    TORCH_CHECK(!t->defined() || t->device() == first.device(), op, ": all tensors must be on one device, ", first_name,
                " is on ", first.device(), " but ", name, " is on ", t->device());
}

core::NQDims nq_compress_dims(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t axis, int64_t num_outliers,
                              bool fit_range) {
  constexpr const char* op = "nq_compress";
  TORCH_CHECK(x.defined(), op, ": x is an undefined tensor");
  TORCH_CHECK(x.dim() >= 2, op, ": x must have shape [..., tokens, head_dim] (at least 2 dims), got shape ", x.sizes());
  TORCH_CHECK(is_float_type(x.scalar_type()), op, ": x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.numel() > 0, op, ": x must not be empty, got shape ", x.sizes());
  check_bits_group_axis(op, bits, group_size, axis);
  check_num_outliers(op, num_outliers, group_size);
  core::NQDims d;
  d.tokens = x.size(-2);
  d.head_dim = x.size(-1);
  d.rows = x.numel() / (d.tokens * d.head_dim);
  d.bits = int(bits);
  d.group_size = int(group_size);
  d.axis = to_group_axis(axis);
  d.num_outliers = int(num_outliers);
  d.fit_range = fit_range;
  return d;
}

at::ScalarType nq_meta_dtype(at::ScalarType x_dtype, std::optional<at::ScalarType> meta_dtype) {
  if (!meta_dtype) return x_dtype;
  TORCH_CHECK(is_float_type(*meta_dtype), "nq_compress: meta_dtype must be float32, float16 or bfloat16, got ",
              *meta_dtype);
  return *meta_dtype;
}

NQTensors nq_allocate_outputs(const core::NQDims& d, const at::Tensor& x, at::ScalarType meta_dtype) {
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 2);
  auto with = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> s = lead;
    s.insert(s.end(), tail.begin(), tail.end());
    return s;
  };
  const auto opts = x.options();
  const int64_t A = d.meta_a(), B = d.meta_b(), k = d.num_outliers;
  return {at::empty(with({d.tokens, d.packed_row_bytes()}), opts.dtype(at::kByte)),
          at::empty(with({A, B}), opts.dtype(meta_dtype)), at::empty(with({A, B}), opts.dtype(meta_dtype)),
          at::empty(with({A, B, k}), opts.dtype(at::kByte)), at::empty(with({A, B, k}), opts)};
}

core::DGQParams dgq_compress_params(const core::NQDims& d, int64_t granule, std::optional<int64_t> max_len) {
  constexpr const char* op = "dgq_compress";
  const int64_t G = d.group_size, lo = 2 * G, hi = core::kMaxGroupSize;
  TORCH_CHECK(granule >= 1 && granule <= G, op, ": granule must be in [1, group_size] = [1, ", G, "], got ", granule);
  // Segments of at most max_len >= 2 * group_size tokens always fit ceil(tokens / group_size) of them.
  const char* why = "(so that ceil(tokens / group_size) segments always suffice)";
  int64_t len = 0;
  if (max_len) {
    len = *max_len;
    TORCH_CHECK(len % granule == 0 && len >= lo && len <= hi, op, ": max_len must be a multiple of granule (", granule,
                ") in [2 * group_size, ", hi, "] = [", lo, ", ", hi, "] ", why, ", got ", len);
  } else {
    len = core::ceil_div(lo, granule) * granule;  // the default: the shortest such multiple
    TORCH_CHECK(len <= hi, op, ": no max_len fits granule=", granule, " and group_size=", G,
                ": the default max_len is the smallest multiple of granule >= 2 * group_size ", why, ", here ", len,
                ", above the limit ", hi, "; choose a granule with a multiple in [", lo, ", ", hi, "]");
  }
  core::DGQParams p;
  p.granule = granule, p.max_len = len, p.segments = d.meta_a();
  return p;
}

core::NQDims nq_decompress_dims(const char* op, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& zero, const at::Tensor& outlier_idx, const at::Tensor& outlier_val,
                                int64_t bits, int64_t group_size, int64_t axis, int64_t head_dim, const char* what) {
  const std::string o = prefix(what);
  for (const auto* t : {&codes, &scale, &zero, &outlier_idx, &outlier_val})
    TORCH_CHECK(t->defined(), op, ": ", o, "all five compressed tensors must be defined");
  check_bits_group_axis(op, bits, group_size, axis, o);
  TORCH_CHECK(head_dim >= 1, op, ": head_dim must be positive, got ", head_dim);
  TORCH_CHECK(codes.scalar_type() == at::kByte, op, ": ", o, "codes must be uint8, got ", codes.scalar_type());
  TORCH_CHECK(codes.dim() >= 2, op, ": ", o, "codes must have shape [..., tokens, row_bytes], got ", codes.sizes());
  TORCH_CHECK(codes.numel() > 0, op, ": ", o, "codes must not be empty, got shape ", codes.sizes());
  const int64_t rb = core::row_bytes(int(bits), head_dim);
  TORCH_CHECK(codes.size(-1) == rb, op, ": ", o, "codes has ", codes.size(-1), " bytes per token, but bits=", bits,
              " and head_dim=", head_dim, " pack into ", rb);
  check_same_device(op, "codes", codes,
                    {{"scale", &scale}, {"zero", &zero}, {"outlier_idx", &outlier_idx}, {"outlier_val", &outlier_val}});
  TORCH_CHECK(is_float_type(scale.scalar_type()), op, ": ", o, "scale must be float32, float16 or bfloat16, got ",
              scale.scalar_type());
  TORCH_CHECK(zero.scalar_type() == scale.scalar_type(), op, ": ", o, "zero must have scale's dtype ",
              scale.scalar_type(), ", got ", zero.scalar_type());
  TORCH_CHECK(outlier_idx.scalar_type() == at::kByte, op, ": ", o, "outlier_idx must be uint8, got ",
              outlier_idx.scalar_type());
  TORCH_CHECK(is_float_type(outlier_val.scalar_type()), op, ": ", o,
              "outlier_val must be float32, float16 or bfloat16, got ", outlier_val.scalar_type());
  TORCH_CHECK(outlier_idx.dim() >= 1, op, ": ", o, "outlier_idx must have shape [..., A, B, k], got ",
              outlier_idx.sizes());

  core::NQDims d;
  d.tokens = codes.size(-2);
  d.head_dim = head_dim;
  d.rows = codes.numel() / (d.tokens * rb);
  d.bits = int(bits);
  d.group_size = int(group_size);
  d.axis = to_group_axis(axis);
  check_num_outliers(op, outlier_idx.size(-1), group_size);
  d.num_outliers = int(outlier_idx.size(-1));

  const auto lead = codes.sizes().slice(0, codes.dim() - 2);
  check_sizes(op, o + "scale", scale, lead, {d.meta_a(), d.meta_b()});
  check_sizes(op, o + "zero", zero, lead, {d.meta_a(), d.meta_b()});
  check_sizes(op, o + "outlier_idx", outlier_idx, lead, {d.meta_a(), d.meta_b(), d.num_outliers});
  check_sizes(op, o + "outlier_val", outlier_val, lead, {d.meta_a(), d.meta_b(), d.num_outliers});
  return d;
}

core::NQDims dgq_decompress_dims(const char* op, const at::Tensor& codes, const at::Tensor& scale,
                                 const at::Tensor& zero, const at::Tensor& outlier_idx, const at::Tensor& outlier_val,
                                 const at::Tensor& segment_starts, int64_t bits, int64_t group_size, int64_t head_dim,
                                 const char* what) {
  const core::NQDims d =
      nq_decompress_dims(op, codes, scale, zero, outlier_idx, outlier_val, bits, group_size, -2, head_dim, what);
  const std::string o = prefix(what);
  TORCH_CHECK(segment_starts.defined() && segment_starts.scalar_type() == at::kInt, op, ": ", o,
              "segment_starts must be int32, got ",
              segment_starts.defined() ? c10::toString(segment_starts.scalar_type()) : "None");
  check_same_device(op, "codes", codes, {{"segment_starts", &segment_starts}});
  check_sizes(op, o + "segment_starts", segment_starts, codes.sizes().slice(0, codes.dim() - 2), {d.meta_a()});
  return d;
}

at::ScalarType nq_out_dtype(const char* op, at::ScalarType val_dtype, std::optional<at::ScalarType> out_dtype) {
  const at::ScalarType t = out_dtype.value_or(val_dtype);
  TORCH_CHECK(is_float_type(t), op, ": out_dtype must be float32, float16 or bfloat16, got ", t);
  return t;
}

std::vector<int64_t> nq_decompressed_sizes(const at::Tensor& codes, int64_t head_dim) {
  std::vector<int64_t> s(codes.sizes().begin(), codes.sizes().end() - 1);
  s.push_back(head_dim);
  return s;
}

std::vector<int64_t> leading_row_offsets(const at::Tensor& x) {
  const int64_t lead_dims = x.dim() - 2;
  int64_t rows = 1;
  for (const auto i : c10::irange(lead_dims)) rows *= x.size(i);
  std::vector<int64_t> offsets(size_t(rows), 0);
  std::vector<int64_t> index(size_t(lead_dims), 0);
  int64_t offset = 0;
  for (int64_t r = 0; r < rows; ++r) {
    offsets[size_t(r)] = offset;
    // Odometer increment over the leading dims, last dim fastest.
    for (int64_t i = lead_dims - 1; i >= 0; --i) {
      offset += x.stride(i);
      if (++index[size_t(i)] < x.size(i)) break;
      offset -= x.stride(i) * x.size(i);
      index[size_t(i)] = 0;
    }
  }
  return offsets;
}

void nq_check_compress_status(const char* op, bool non_finite_input, bool range_overflow, bool meta_overflow,
                              at::ScalarType meta_dtype) {
  TORCH_CHECK(!non_finite_input, op,
              ": x contains NaN or Inf; min/max quantization of such a group is undefined, so "
              "non-finite input is rejected (clean or clamp x first)");
  TORCH_CHECK(!range_overflow, op,
              ": a group's range max - min overflows float32 (its finite values span more than 3.4e38), and "
              "the quantizer works in float32 arithmetic; scale x down first");
  // (A float32 scale and zero of a finite range always fit: that case is range_overflow.)
  TORCH_CHECK(!meta_overflow, op, ": a group's scale or zero does not fit in meta_dtype ", meta_dtype,
              " (the values exceed its range); use ",
              meta_dtype == at::kHalf ? "meta_dtype=float32 or bfloat16" : "meta_dtype=float32");
}

void nq_check_outlier_positions(const char* op, const char* what, bool ok, int64_t group_size, bool dgq) {
  TORCH_CHECK(ok, op, ": ", prefix(what), "outlier_idx holds a position outside its group (group_size ", group_size,
              dgq ? ", segments from segment_starts" : "",
              "); the compressed tensors are corrupt or were made with other parameters");
}

}  // namespace nexuskv
