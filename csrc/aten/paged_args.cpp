#include "paged_args.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "attention_args.h"
#include "nq_args.h"

namespace nexuskv {
namespace {

void check_int_tensor(const char* op, const char* name, const at::Tensor& t, at::ScalarType want, int64_t dim,
                      const char* shape) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", want, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

// pages: uint8 [num_blocks, kv_heads, P, C], contiguous (the kernels address
// head pages by the format, not by strides).
core::PagedPool check_pages(const char* op, const at::Tensor& pages, int64_t head_dim, int64_t key_bits,
                            int64_t value_bits, int64_t group_size, int64_t num_outliers, at::ScalarType dtype,
                            const char* dtype_from, int64_t exact_window) {
  TORCH_CHECK(pages.defined(), op, ": pages is an undefined tensor");
  TORCH_CHECK(pages.scalar_type() == at::kByte, op, ": pages must be uint8, got ", pages.scalar_type());
  TORCH_CHECK(pages.dim() == 4, op, ": pages must have shape [num_blocks, kv_heads, block_size, slot_bytes], got ",
              pages.sizes());
  TORCH_CHECK(pages.is_contiguous(), op, ": pages must be contiguous (head pages are addressed by the format, ",
              "nexuskv/core/paged_format.h), got strides ", pages.strides());
  TORCH_CHECK(pages.size(1) >= 1, op, ": pages must have at least one kv head, got shape ", pages.sizes());
  core::PagedPool pool;
  pool.layout =
      paged_layout(op, head_dim, pages.size(2), key_bits, value_bits, group_size, num_outliers, dtype, exact_window);
  TORCH_CHECK(pages.size(3) == pool.layout.slot_bytes(), op, ": pages has ", pages.size(3),
              " bytes per slot (its last dimension), but head_dim=", head_dim, ", key_bits=", key_bits,
              ", value_bits=", value_bits, ", group_size=", group_size, ", num_outliers=", num_outliers,
              ", exact_window=", exact_window, ", block_size=", pages.size(2), " and ", dtype, " (", dtype_from,
              ") take ", pool.layout.slot_bytes(), " (paged_slot_bytes)");
  pool.num_blocks = pages.size(0);
  pool.kv_heads = int(pages.size(1));
  return pool;
}

}  // namespace

core::PagedLayout paged_layout(const char* op, int64_t head_dim, int64_t block_size, int64_t key_bits,
                               int64_t value_bits, int64_t group_size, int64_t num_outliers, at::ScalarType dtype,
                               int64_t exact_window) {
  TORCH_CHECK(core::bits_supported(int(key_bits)) && key_bits == int(key_bits), op,
              ": key_bits must be one of 2, 3, 4, 8, got ", key_bits);
  TORCH_CHECK(core::bits_supported(int(value_bits)) && value_bits == int(value_bits), op,
              ": value_bits must be one of 2, 3, 4, 8, got ", value_bits);
  TORCH_CHECK(group_size >= 1 && group_size <= core::kMaxGroupSize, op, ": group_size must be in [1, ",
              core::kMaxGroupSize, "], got ", group_size);
  TORCH_CHECK(num_outliers >= 0 && num_outliers < group_size, op, ": num_outliers must be in [0, group_size) = [0, ",
              group_size, "), got ", num_outliers);
  TORCH_CHECK(head_dim >= 16 && head_dim % 16 == 0 && head_dim <= core::kMaxHeadDim, op,
              ": head_dim must be a multiple of 16 in [16, ", core::kMaxHeadDim, "], got ", head_dim);
  TORCH_CHECK(block_size >= core::kPageTokenMultiple && block_size % core::kPageTokenMultiple == 0 &&
                  block_size <= (int64_t(1) << 16),
              op, ": block_size (pages' dimension 2) must be a positive multiple of ", core::kPageTokenMultiple,
              " (every buffer of a page 16-byte aligned) and at most 65536, got ", block_size);
  TORCH_CHECK(is_float_type(dtype), op, ": the stored dtype must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(exact_window >= 0 && exact_window <= std::min<int64_t>(block_size, core::kMaxExactWindow), op,
              ": exact_window must be in [0, min(block_size, ", core::kMaxExactWindow, ")] = [0, ",
              std::min<int64_t>(block_size, core::kMaxExactWindow), "] (a query's exact tokens lie in its block and ",
              "the previous one), got ", exact_window);
  core::PagedLayout l;
  l.head_dim = int(head_dim);
  l.block_size = int(block_size);
  l.key_bits = int(key_bits);
  l.value_bits = int(value_bits);
  l.group_size = int(group_size);
  l.num_outliers = int(num_outliers);
  l.x_bytes = int(c10::elementSize(dtype));
  l.exact_window = int(exact_window);
  return l;
}

int64_t paged_slot_bytes_kernel(int64_t head_dim, int64_t key_bits, int64_t value_bits, int64_t group_size,
                                int64_t num_outliers, at::ScalarType dtype, int64_t exact_window, int64_t block_size) {
  constexpr const char* op = "paged_slot_bytes";
  TORCH_CHECK(block_size > 0 || exact_window == 0, op, ": an exact window's bytes per slot depend on the block ",
              "size: give block_size (tokens per block), got exact_window=", exact_window,
              " and block_size=", block_size);
  TORCH_CHECK(block_size >= 0, op, ": block_size must be positive (or 0 without an exact window), got ", block_size);
  return paged_layout(op, head_dim, block_size > 0 ? block_size : core::kPageTokenMultiple, key_bits, value_bits,
                      group_size, num_outliers, dtype, exact_window)
      .slot_bytes();
}

PagedWriteShapes check_paged_write_args(const char* op, const at::Tensor& pages, const at::Tensor& key,
                                        const at::Tensor& value, const at::Tensor& slot_mapping, int64_t key_bits,
                                        int64_t value_bits, int64_t group_size, int64_t num_outliers,
                                        const std::optional<at::Tensor>& rotation_signs, int64_t exact_window) {
  for (auto [name, t] : {std::pair{"key", &key}, std::pair{"value", &value}}) {
    TORCH_CHECK(t->defined(), op, ": ", name, " is an undefined tensor");
    TORCH_CHECK(t->dim() == 3, op, ": ", name, " must have shape [num_tokens, kv_heads, head_dim], got ", t->sizes());
    TORCH_CHECK(is_float_type(t->scalar_type()), op, ": ", name, " must be float32, float16 or bfloat16, got ",
                t->scalar_type());
  }
  TORCH_CHECK(value.sizes() == key.sizes(), op, ": value must have key's shape ", key.sizes(), ", got ", value.sizes());
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), op, ": value must have key's dtype ", key.scalar_type(),
              ", got ", value.scalar_type());
  check_int_tensor(op, "slot_mapping", slot_mapping, at::kLong, 1, "[num_tokens]");
  TORCH_CHECK(slot_mapping.size(0) == key.size(0), op, ": slot_mapping must have one slot per token of key (",
              key.size(0), "), got shape ", slot_mapping.sizes());
  check_same_device(op, "pages", pages, {{"key", &key}, {"value", &value}, {"slot_mapping", &slot_mapping}});
  PagedWriteShapes s;
  s.pool = check_pages(op, pages, key.size(2), key_bits, value_bits, group_size, num_outliers, key.scalar_type(),
                       "key's dtype", exact_window);
  TORCH_CHECK(key.size(1) == s.pool.kv_heads, op, ": key has ", key.size(1), " kv heads (dimension 1) but pages has ",
              s.pool.kv_heads, " (dimension 1)");
  if (rotation_signs) check_rotation_signs(op, *rotation_signs, key.size(2), key.device(), "rotation_signs", "key");
  s.num_tokens = key.size(0);
  return s;
}

PagedWriteShapes check_paged_exact_write_args(const at::Tensor& pages, const at::Tensor& key, const at::Tensor& value,
                                              const at::Tensor& slot_mapping, int64_t key_bits, int64_t value_bits,
                                              int64_t group_size, int64_t num_outliers, int64_t exact_window) {
  constexpr const char* op = "paged_exact_write_";
  const PagedWriteShapes s = check_paged_write_args(op, pages, key, value, slot_mapping, key_bits, value_bits,
                                                    group_size, num_outliers, std::nullopt, exact_window);
  TORCH_CHECK(exact_window > 0, op, ": pages without an exact window (exact_window=0) have no ring to write");
  return s;
}

PagedAttentionShapes check_paged_attention_args(
    const at::Tensor& q, const at::Tensor& pages, const at::Tensor& block_table, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, int64_t key_bits, int64_t value_bits, int64_t group_size, int64_t num_outliers,
    const std::optional<at::Tensor>& rotation_signs, std::optional<double> scale, std::optional<int64_t> window,
    std::optional<double> softcap, int64_t exact_window, const std::optional<at::Tensor>& key,
    const std::optional<at::Tensor>& value) {
  constexpr const char* op = "paged_attention";
  TORCH_CHECK(q.defined(), op, ": q is an undefined tensor");
  TORCH_CHECK(q.dim() == 3, op, ": q must have shape [num_tokens, q_heads, head_dim], got ", q.sizes());
  TORCH_CHECK(is_float_type(q.scalar_type()), op, ": q must be float32, float16 or bfloat16, got ", q.scalar_type());
  check_int_tensor(op, "block_table", block_table, at::kInt, 2, "[num_reqs, max_blocks]");
  check_int_tensor(op, "seq_lens", seq_lens, at::kInt, 1, "[num_reqs]");
  check_int_tensor(op, "query_start_loc", query_start_loc, at::kInt, 1, "[num_reqs + 1]");
  const int64_t R = seq_lens.size(0);
  TORCH_CHECK(block_table.size(0) == R, op, ": block_table must have one row per request (seq_lens has ", R,
              "), got shape ", block_table.sizes());
  TORCH_CHECK(query_start_loc.size(0) == R + 1, op, ": query_start_loc must have num_reqs + 1 = ", R + 1,
              " entries, got shape ", query_start_loc.sizes());
  check_same_device(op, "q", q,
                    {{"pages", &pages},
                     {"block_table", &block_table},
                     {"seq_lens", &seq_lens},
                     {"query_start_loc", &query_start_loc}});
  PagedAttentionShapes s;
  s.pool = check_pages(op, pages, q.size(2), key_bits, value_bits, group_size, num_outliers, q.scalar_type(),
                       "q's dtype, the dtype the keys and values were written in", exact_window);
  // The chunk's own keys and values: read for the exact window, and only then.
  TORCH_CHECK(key.has_value() == value.has_value(), op, ": key and value go together (the exact window reads both)");
  TORCH_CHECK(key.has_value() == (exact_window > 0), op,
              exact_window > 0 ? ": key and value (the queries' own keys and values, [num_tokens, kv_heads, head_dim]) "
                                 "are required with exact_window > 0"
                               : ": key and value are read only with an exact window (exact_window > 0), got "
                                 "exact_window=0");
  for (auto [name, t] : {std::pair{"key", &key}, std::pair{"value", &value}}) {
    if (!t->has_value()) continue;
    const at::Tensor& x = **t;
    TORCH_CHECK(x.defined(), op, ": ", name, " is an undefined tensor");
    TORCH_CHECK(x.dim() == 3 && x.size(0) == q.size(0) && x.size(1) == s.pool.kv_heads && x.size(2) == q.size(2), op,
                ": ", name, " must have shape [num_tokens, kv_heads, head_dim] = [", q.size(0), ", ", s.pool.kv_heads,
                ", ", q.size(2), "] (q's tokens, pages' kv heads), got ", x.sizes());
    TORCH_CHECK(x.scalar_type() == q.scalar_type(), op, ": ", name, " must have q's dtype ", q.scalar_type(), ", got ",
                x.scalar_type());
    TORCH_CHECK(x.device() == q.device(), op, ": ", name, " must be on q's device ", q.device(), ", got ", x.device());
  }
  TORCH_CHECK(q.size(1) >= 1 && q.size(1) % s.pool.kv_heads == 0, op, ": q's heads (", q.size(1),
              ", dimension 1) must be a positive multiple of pages' kv heads (", s.pool.kv_heads, ")");
  if (rotation_signs) check_rotation_signs(op, *rotation_signs, q.size(2), q.device(), "rotation_signs", "q");
  s.num_tokens = q.size(0);
  s.q_heads = q.size(1);
  s.num_reqs = R;
  s.max_blocks = block_table.size(1);
  s.scale = float(scale ? *scale : 1.0 / std::sqrt(double(q.size(2))));
  TORCH_CHECK(std::isfinite(s.scale), op, ": scale must be finite, got ", s.scale);
  TORCH_CHECK(!window || *window >= 1, op, ": window must be at least 1 (or None), got ", *window);
  s.window = window ? *window : 0;
  TORCH_CHECK(!softcap || (*softcap > 0 && std::isfinite(*softcap)), op,
              ": softcap must be positive and finite (or None), got ", *softcap);
  s.softcap = float(softcap ? *softcap : 0.0);
  return s;
}

at::Tensor paged_rows(const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous(); }

// No tensor argument, so no backend: the kernel that every dispatch (the
// Undefined key included) reaches.
TORCH_LIBRARY_IMPL(nexuskv, CompositeImplicitAutograd, m) { m.impl("paged_slot_bytes", &paged_slot_bytes_kernel); }

}  // namespace nexuskv
