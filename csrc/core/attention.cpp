// Fused attention: the kernel of the instruction set chosen at run time
// (nexuskv/core/cpu_isa.h), key-range splits, the log-sum-exp merge of
// splits, and the Hadamard rotation.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "isa_kernels.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/cpu_isa.h"

namespace nexuskv::core {

const char* attention_isa() { return cpu_isa_name(cpu_isa()); }

namespace {
std::atomic<int> last_product{int(ValueProduct::kNone)}, last_key{int(ValueProduct::kNone)};
}  // namespace

ValueProduct last_value_product() { return ValueProduct(last_product.load(std::memory_order_relaxed)); }
void note_value_product(ValueProduct path) { last_product.store(int(path), std::memory_order_relaxed); }
ValueProduct last_key_product() { return ValueProduct(last_key.load(std::memory_order_relaxed)); }
void note_key_product(ValueProduct path) { last_key.store(int(path), std::memory_order_relaxed); }

template <typename Meta, typename Val>
int64_t attention_num_splits(const CpuAttentionParams<Meta, Val>& p, int64_t min_tasks) {
  int64_t longest = 0;
  for (int64_t b = 0; b < p.batch; ++b) longest = std::max(longest, p.seq_len(b) - p.first_visible(b));
  const int64_t pairs = p.batch * p.kv_heads;
  // A split of fewer than 16 tiles costs more in set-up and merge than it saves.
  const int64_t max_splits = std::max<int64_t>(1, longest / (16 * kTileTokens));
  return std::clamp<int64_t>(ceil_div(min_tasks, pairs), 1, max_splits);
}

template <typename Meta, typename Val>
void attention_tasks(const CpuAttentionParams<Meta, Val>& p, int64_t splits, float* partials, int64_t begin,
                     int64_t end) {
  switch (cpu_isa()) {
#if defined(NEXUSKV_HAVE_X86_ISAS)
    case CpuIsa::kAvx512: return avx512::attention_tasks<Meta, Val>(p, splits, partials, begin, end);
    case CpuIsa::kAvx2: return avx2::attention_tasks<Meta, Val>(p, splits, partials, begin, end);
#endif
    default: return generic::attention_tasks<Meta, Val>(p, splits, partials, begin, end);
  }
}

template <typename Meta, typename Val>
void attention_merge(const CpuAttentionParams<Meta, Val>& p, int64_t splits, const float* partials, float* out,
                     int64_t begin, int64_t end) {
  const int64_t D = p.head_dim, rows = p.rows_per_kv_head();
  const int64_t stride = partial_floats(p);
  std::vector<float> row(static_cast<size_t>(D));
  for (int64_t bh = begin; bh < end; ++bh) {
    const int64_t b = bh / p.kv_heads, h = bh % p.kv_heads;
    const float* part = partials + bh * splits * stride;
    for (int64_t r = 0; r < rows; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      bool nan = false;  // a split saw a NaN/Inf score (attention_tasks marks it with a NaN max or sum)
      for (int64_t s = 0; s < splits; ++s) {
        const float* pr = part + s * stride + r * (D + 2);
        m = std::max(m, pr[D]);
        nan |= std::isnan(pr[D]) || std::isnan(pr[D + 1]);
      }
      std::fill(row.begin(), row.end(), nan ? std::numeric_limits<float>::quiet_NaN() : 0.f);
      float l = 0.f;
      if (!nan && m != -std::numeric_limits<float>::infinity()) {
        for (int64_t s = 0; s < splits; ++s) {
          const float* pr = part + s * stride + r * (D + 2);
          const float w = std::exp(pr[D] - m);  // exp(-inf) = 0 for empty splits
          l += w * pr[D + 1];
          for (int64_t d = 0; d < D; ++d) row[size_t(d)] += w * pr[d];
        }
        for (int64_t d = 0; d < D; ++d) row[size_t(d)] /= l;
        if (p.rotation_signs) hadamard_rotate_rows(row.data(), row.data(), 1, D, p.rotation_signs, true);
      }
      const int64_t i = r % p.q_len;
      std::memcpy(out + ((b * p.q_heads + p.q_head(h, r)) * p.q_len + i) * D, row.data(), size_t(D) * sizeof(float));
    }
  }
}

#define NEXUSKV_INSTANTIATE_ATTENTION(Meta, Val)                                                                     \
  template int64_t attention_num_splits<Meta, Val>(const CpuAttentionParams<Meta, Val>&, int64_t);                   \
  template void attention_tasks<Meta, Val>(const CpuAttentionParams<Meta, Val>&, int64_t, float*, int64_t, int64_t); \
  template void attention_merge<Meta, Val>(const CpuAttentionParams<Meta, Val>&, int64_t, const float*, float*,      \
                                           int64_t, int64_t);
NEXUSKV_FOR_EACH_FLOAT_PAIR(NEXUSKV_INSTANTIATE_ATTENTION)

// The rotation of the instruction set chosen at run time (hadamard_kernel.cpp,
// compiled per ISA; every copy gives the same bits).
void hadamard_rotate_rows(const float* x, float* y, int64_t rows, int64_t n, const float* signs, bool inverse) {
  switch (cpu_isa()) {
#if defined(NEXUSKV_HAVE_X86_ISAS)
    case CpuIsa::kAvx512: return avx512::hadamard_rotate_rows(x, y, rows, n, signs, inverse);
    case CpuIsa::kAvx2: return avx2::hadamard_rotate_rows(x, y, rows, n, signs, inverse);
#endif
    default: return generic::hadamard_rotate_rows(x, y, rows, n, signs, inverse);
  }
}

}  // namespace nexuskv::core
