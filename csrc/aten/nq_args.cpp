#include "nq_args.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

namespace nexuskv {
namespace {

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_bits_group_axis(const char* op, int64_t bits, int64_t group_size, int64_t axis) {
  TORCH_CHECK(core::bits_supported(int(bits)), op, ": bits must be one of 2, 3, 4, 8, got ", bits);
  TORCH_CHECK(group_size >= 1 && group_size <= core::kMaxGroupSize, op, ": group_size must be in [1, ",
              core::kMaxGroupSize, "], got ", group_size);
  TORCH_CHECK(axis == -2 || axis == -1, op,
              ": axis must be -2 (groups of consecutive tokens, one scale per channel: keys) or -1 "
              "(groups of consecutive channels, one scale per token: values), got ",
              axis);
}

void check_num_outliers(const char* op, int64_t num_outliers, int64_t group_size) {
  TORCH_CHECK(num_outliers >= 0 && num_outliers < group_size, op,
              ": num_outliers must be in [0, group_size) = [0, ", group_size, "), got ", num_outliers);
}

core::GroupAxis to_group_axis(int64_t axis) {
  return axis == -2 ? core::GroupAxis::kTokens : core::GroupAxis::kChannels;
}

// Checks that t has sizes lead + tail.
void check_sizes(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef lead,
                 std::initializer_list<int64_t> tail) {
  std::vector<int64_t> want(lead.begin(), lead.end());
  want.insert(want.end(), tail.begin(), tail.end());
  TORCH_CHECK(t.sizes() == at::IntArrayRef(want), op, ": ", name, " must have shape ", at::IntArrayRef(want),
              " (from codes and the format parameters), got ", t.sizes());
}

}  // namespace

core::DType to_core_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return core::DType::kFloat32;
    case at::kHalf: return core::DType::kFloat16;
    case at::kBFloat16: return core::DType::kBFloat16;
    default: TORCH_CHECK(false, "nexuskv: unsupported dtype ", t);
  }
}

core::NQDims nq_compress_dims(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t axis,
                              int64_t num_outliers) {
  constexpr const char* op = "nq_compress";
  TORCH_CHECK(x.defined(), op, ": x is an undefined tensor");
  TORCH_CHECK(x.dim() >= 2, op, ": x must have shape [..., tokens, head_dim] (at least 2 dims), got shape ",
              x.sizes());
  TORCH_CHECK(is_float_type(x.scalar_type()), op, ": x must be float32, float16 or bfloat16, got ",
              x.scalar_type());
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

core::NQDims nq_decompress_dims(const char* op, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& zero, const at::Tensor& outlier_idx, const at::Tensor& outlier_val,
                                int64_t bits, int64_t group_size, int64_t axis, int64_t head_dim) {
  for (const auto* t : {&codes, &scale, &zero, &outlier_idx, &outlier_val})
    TORCH_CHECK(t->defined(), op, ": all five compressed tensors must be defined");
  check_bits_group_axis(op, bits, group_size, axis);
  TORCH_CHECK(head_dim >= 1, op, ": head_dim must be positive, got ", head_dim);
  TORCH_CHECK(codes.scalar_type() == at::kByte, op, ": codes must be uint8, got ", codes.scalar_type());
  TORCH_CHECK(codes.dim() >= 2, op, ": codes must have shape [..., tokens, row_bytes], got ", codes.sizes());
  TORCH_CHECK(codes.numel() > 0, op, ": codes must not be empty, got shape ", codes.sizes());
  const int64_t rb = core::row_bytes(int(bits), head_dim);
  TORCH_CHECK(codes.size(-1) == rb, op, ": codes has ", codes.size(-1), " bytes per token, but bits=", bits,
              " and head_dim=", head_dim, " pack into ", rb);
  for (const auto* t : {&scale, &zero, &outlier_idx, &outlier_val})
    TORCH_CHECK(t->device() == codes.device(), op, ": all tensors must be on one device, codes is on ",
                codes.device(), " but got a tensor on ", t->device());
  TORCH_CHECK(is_float_type(scale.scalar_type()), op, ": scale must be float32, float16 or bfloat16, got ",
              scale.scalar_type());
  TORCH_CHECK(zero.scalar_type() == scale.scalar_type(), op, ": zero must have scale's dtype ",
              scale.scalar_type(), ", got ", zero.scalar_type());
  TORCH_CHECK(outlier_idx.scalar_type() == at::kByte, op, ": outlier_idx must be uint8, got ",
              outlier_idx.scalar_type());
  TORCH_CHECK(is_float_type(outlier_val.scalar_type()), op,
              ": outlier_val must be float32, float16 or bfloat16, got ", outlier_val.scalar_type());
  TORCH_CHECK(outlier_idx.dim() >= 1, op, ": outlier_idx must have shape [..., A, B, k], got ",
              outlier_idx.sizes());

  core::NQDims d;
  d.tokens = codes.size(-2);
  d.head_dim = head_dim;
  d.rows = codes.numel() / (d.tokens * rb);
  d.bits = int(bits);
  d.group_size = int(group_size);
  d.axis = to_group_axis(axis);
  d.num_outliers = int(outlier_idx.size(-1));
  check_num_outliers(op, d.num_outliers, group_size);

  const auto lead = codes.sizes().slice(0, codes.dim() - 2);
  check_sizes(op, "scale", scale, lead, {d.meta_a(), d.meta_b()});
  check_sizes(op, "zero", zero, lead, {d.meta_a(), d.meta_b()});
  check_sizes(op, "outlier_idx", outlier_idx, lead, {d.meta_a(), d.meta_b(), d.num_outliers});
  check_sizes(op, "outlier_val", outlier_val, lead, {d.meta_a(), d.meta_b(), d.num_outliers});
  return d;
}

core::NQDims dgq_decompress_dims(const char* op, const at::Tensor& codes, const at::Tensor& scale,
                                 const at::Tensor& zero, const at::Tensor& outlier_idx,
                                 const at::Tensor& outlier_val, const at::Tensor& segment_starts, int64_t bits,
                                 int64_t group_size, int64_t head_dim) {
  const core::NQDims d =
      nq_decompress_dims(op, codes, scale, zero, outlier_idx, outlier_val, bits, group_size, -2, head_dim);
  TORCH_CHECK(segment_starts.defined() && segment_starts.scalar_type() == at::kInt, op,
              ": segment_starts must be int32");
  TORCH_CHECK(segment_starts.device() == codes.device(), op, ": segment_starts must be on ", codes.device());
  check_sizes(op, "segment_starts", segment_starts, codes.sizes().slice(0, codes.dim() - 2), {d.meta_a()});
  const at::Tensor starts = segment_starts.to(at::kCPU).contiguous();
  const int32_t* s = starts.data_ptr<int32_t>();
  const int64_t S = d.meta_a();
  for (int64_t r = 0; r < d.rows; ++r, s += S) {
    TORCH_CHECK(s[0] == 0, op, ": segment_starts of row ", r, " must begin at token 0, got ", s[0]);
    for (int64_t i = 0; i < S; ++i) {
      const int64_t end = i + 1 < S ? s[i + 1] : d.tokens;
      TORCH_CHECK(s[i] <= end && end <= d.tokens, op, ": segment_starts of row ", r,
                  " must be non-decreasing within [0, ", d.tokens, "]; segment ", i, " is [", s[i], ", ", end, ")");
    }
  }
  return d;
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

void nq_check_compress_status(bool non_finite_input, bool meta_overflow, at::ScalarType meta_dtype) {
  TORCH_CHECK(!non_finite_input,
              "nq_compress: x contains NaN or Inf; min/max quantization of such a group is undefined, so "
              "non-finite input is rejected (clean or clamp x first)");
  TORCH_CHECK(!meta_overflow, "nq_compress: a group's scale or zero does not fit in meta_dtype ", meta_dtype,
              " (the values exceed its range); use meta_dtype=float32 or bfloat16");
}

}  // namespace nexuskv
