// Definitions of the public C++ API (nexuskv/ops.h): typed dispatcher calls.
#include "nexuskv/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace nexuskv {
namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> nq_compress(
    const at::Tensor& x, int64_t bits, int64_t group_size, int64_t axis, int64_t num_outliers,
    std::optional<at::ScalarType> meta_dtype) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, int64_t, int64_t, int64_t, int64_t, std::optional<at::ScalarType>);
  static const auto op = find_op<Sig>("nexuskv::nq_compress");
  return op.call(x, bits, group_size, axis, num_outliers, meta_dtype);
}

at::Tensor nq_decompress(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                         const at::Tensor& outlier_idx, const at::Tensor& outlier_val, int64_t bits,
                         int64_t group_size, int64_t axis, int64_t head_dim,
                         std::optional<at::ScalarType> out_dtype) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, int64_t, int64_t, int64_t, int64_t, std::optional<at::ScalarType>);
  static const auto op = find_op<Sig>("nexuskv::nq_decompress");
  return op.call(codes, scale, zero, outlier_idx, outlier_val, bits, group_size, axis, head_dim, out_dtype);
}

}  // namespace nexuskv
