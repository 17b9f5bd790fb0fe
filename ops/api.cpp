// Definitions of the public C++ API (nexuskv/ops.h): typed dispatcher calls, and the CUDA checks switch.
#include "nexuskv/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdlib>
#include <string_view>

namespace nexuskv {
namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> nq_compress(
    const at::Tensor& x, int64_t bits, int64_t group_size, int64_t axis, int64_t num_outliers,
    std::optional<at::ScalarType> meta_dtype, bool fit_range) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, int64_t, int64_t, int64_t, int64_t, std::optional<at::ScalarType>, bool);
  static const auto op = find_op<Sig>("nexuskv::nq_compress");
  return op.call(x, bits, group_size, axis, num_outliers, meta_dtype, fit_range);
}

at::Tensor nq_decompress(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                         const at::Tensor& outlier_idx, const at::Tensor& outlier_val, int64_t bits, int64_t group_size,
                         int64_t axis, int64_t head_dim, std::optional<at::ScalarType> out_dtype) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         int64_t, int64_t, int64_t, int64_t, std::optional<at::ScalarType>);
  static const auto op = find_op<Sig>("nexuskv::nq_decompress");
  return op.call(codes, scale, zero, outlier_idx, outlier_val, bits, group_size, axis, head_dim, out_dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dgq_compress(
    const at::Tensor& x, int64_t bits, int64_t group_size, int64_t granule, std::optional<int64_t> max_len,
    int64_t num_outliers, std::optional<at::ScalarType> meta_dtype, bool fit_range) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, int64_t, int64_t, int64_t, std::optional<int64_t>, int64_t, std::optional<at::ScalarType>,
      bool);
  static const auto op = find_op<Sig>("nexuskv::dgq_compress");
  return op.call(x, bits, group_size, granule, max_len, num_outliers, meta_dtype, fit_range);
}

at::Tensor dgq_decompress(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                          const at::Tensor& outlier_idx, const at::Tensor& outlier_val,
                          const at::Tensor& segment_starts, int64_t bits, int64_t group_size, int64_t head_dim,
                          std::optional<at::ScalarType> out_dtype) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, int64_t, int64_t, int64_t, std::optional<at::ScalarType>);
  static const auto op = find_op<Sig>("nexuskv::dgq_decompress");
  return op.call(codes, scale, zero, outlier_idx, outlier_val, segment_starts, bits, group_size, head_dim, out_dtype);
}

at::Tensor dgq_fused_attention(const at::Tensor& q, at::TensorList k_cache, at::TensorList v_cache,
                               at::IntArrayRef k_format, at::IntArrayRef v_format, const at::Tensor& compressed_lens,
                               const std::optional<at::Tensor>& k_tail, const std::optional<at::Tensor>& v_tail,
                               const std::optional<at::Tensor>& tail_lens,
                               const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                               const std::optional<at::Tensor>& k_sink, const std::optional<at::Tensor>& v_sink,
                               const std::optional<at::Tensor>& sink_lens, std::optional<int64_t> window,
                               std::optional<double> softcap) {
  using OptT = const std::optional<at::Tensor>&;
  using Sig = at::Tensor(const at::Tensor&, at::TensorList, at::TensorList, at::IntArrayRef, at::IntArrayRef,
                         const at::Tensor&, OptT, OptT, OptT, OptT, std::optional<double>, OptT, OptT, OptT,
                         std::optional<int64_t>, std::optional<double>);
  static const auto op = find_op<Sig>("nexuskv::dgq_fused_attention");
  return op.call(q, k_cache, v_cache, k_format, v_format, compressed_lens, k_tail, v_tail, tail_lens, rotation_signs,
                 scale, k_sink, v_sink, sink_lens, window, softcap);
}

bool cuda_value_checks_requested() {
  const char* v = std::getenv("NEXUSKV_CUDA_CHECKS");
  return v != nullptr && std::string_view(v) == "1";
}

at::Tensor hadamard_rotate(const at::Tensor& x, const at::Tensor& signs, bool inverse) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, bool);
  static const auto op = find_op<Sig>("nexuskv::hadamard_rotate");
  return op.call(x, signs, inverse);
}

int64_t paged_slot_bytes(int64_t head_dim, int64_t key_bits, int64_t value_bits, int64_t group_size,
                         int64_t num_outliers, at::ScalarType dtype, int64_t exact_window, int64_t block_size) {
  using Sig = int64_t(int64_t, int64_t, int64_t, int64_t, int64_t, at::ScalarType, int64_t, int64_t);
  static const auto op = find_op<Sig>("nexuskv::paged_slot_bytes");
  return op.call(head_dim, key_bits, value_bits, group_size, num_outliers, dtype, exact_window, block_size);
}

void paged_kv_write_(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits, int64_t group_size,
                     int64_t num_outliers, const std::optional<at::Tensor>& rotation_signs, bool key_fit_range,
                     bool value_fit_range, int64_t exact_window) {
  using Sig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                   int64_t, int64_t, const std::optional<at::Tensor>&, bool, bool, int64_t);
  static const auto op = find_op<Sig>("nexuskv::paged_kv_write_");
  op.call(pages, key, value, slot_mapping, key_bits, value_bits, group_size, num_outliers, rotation_signs,
          key_fit_range, value_fit_range, exact_window);
}

void paged_exact_write_(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits, int64_t group_size,
                        int64_t num_outliers, int64_t exact_window) {
  using Sig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                   int64_t, int64_t, int64_t);
  static const auto op = find_op<Sig>("nexuskv::paged_exact_write_");
  op.call(pages, key, value, slot_mapping, key_bits, value_bits, group_size, num_outliers, exact_window);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& pages, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t key_bits,
                           int64_t value_bits, int64_t group_size, int64_t num_outliers,
                           const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale,
                           std::optional<int64_t> window, std::optional<double> softcap, int64_t exact_window,
                           const std::optional<at::Tensor>& key, const std::optional<at::Tensor>& value) {
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         int64_t, int64_t, int64_t, int64_t, const std::optional<at::Tensor>&, std::optional<double>,
                         std::optional<int64_t>, std::optional<double>, int64_t, const std::optional<at::Tensor>&,
                         const std::optional<at::Tensor>&);
  static const auto op = find_op<Sig>("nexuskv::paged_attention");
  return op.call(q, pages, block_table, seq_lens, query_start_loc, key_bits, value_bits, group_size, num_outliers,
                 rotation_signs, scale, window, softcap, exact_window, key, value);
}

}  // namespace nexuskv
