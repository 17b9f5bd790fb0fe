// The NQ entry points of nq_kernels.h: the compress / decompress kernels of
// the ISA chosen at run time (nexuskv/core/cpu_isa.h), and the scatter of
// exact outliers (memory-bound, one portable version).
#include <algorithm>

#include "isa_kernels.h"
#include "nexuskv/core/cpu_isa.h"
#include "nexuskv/core/nq_kernels.h"

namespace nexuskv::core {
namespace {

// NQ is compiled up to AVX2 (CMakeLists.txt), so an AVX-512 CPU runs its AVX2 build.
CpuIsa nq_isa() { return kernel_isa(CpuIsa::kAvx2); }

}  // namespace

const char* nq_kernel_isa() { return cpu_isa_name(nq_isa()); }

int64_t nq_num_tasks(const NQDims& d) { return d.axis == GroupAxis::kTokens ? d.rows * d.meta_a() : d.rows * d.tokens; }

template <typename In, typename Meta>
void nq_compress_tasks(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out, int64_t task_begin,
                       int64_t task_end, CompressStatus* status) {
  if (task_begin >= task_end) return;
#if defined(NEXUSKV_HAVE_X86_ISAS)
  if (nq_isa() != CpuIsa::kGeneric) return avx2::nq_compress_tasks<In, Meta>(d, x, out, task_begin, task_end, status);
#endif
  generic::nq_compress_tasks<In, Meta>(d, x, out, task_begin, task_end, status);
}

template <typename Meta, typename Out>
void nq_decompress_tasks(const NQDims& d, const uint8_t* codes, const Meta* scale, const Meta* zero, Out* out,
                         int64_t task_begin, int64_t task_end) {
  if (task_begin >= task_end) return;
#if defined(NEXUSKV_HAVE_X86_ISAS)
  if (nq_isa() != CpuIsa::kGeneric)
    return avx2::nq_decompress_tasks<Meta, Out>(d, codes, scale, zero, out, task_begin, task_end);
#endif
  generic::nq_decompress_tasks<Meta, Out>(d, codes, scale, zero, out, task_begin, task_end);
}

namespace {

// Calls f(g, t0, c0, len, step) for groups g in [group_begin, group_end)
// (numbered over N*A*B): the group's origin (token t0, channel c0) in its row,
// its extent and the step between its positions in a contiguous [N, T, D]
// tensor.  The indices are stepped, not divided, per group.
template <typename F>
void for_each_group(const NQDims& d, int64_t group_begin, int64_t group_end, F&& f) {
  const int64_t A = d.meta_a(), B = d.meta_b(), D = d.head_dim, G = d.group_size;
  int64_t n = group_begin / (A * B), a = (group_begin / B) % A, b = group_begin % B;
  for (int64_t g = group_begin; g < group_end; ++g) {
    if (d.axis == GroupAxis::kTokens) {
      const int64_t t0 = d.group_start(n, a);
      f(g, n, t0, b, d.group_end(n, a) - t0, D);
    } else {
      f(g, n, a, b * G, std::min(G, D - b * G), int64_t(1));
    }
    if (++b == B) {
      b = 0;
      if (++a == A) a = 0, ++n;
    }
  }
}

}  // namespace

bool nq_outlier_positions_valid(const NQDims& d, const uint8_t* outlier_idx, int64_t group_begin, int64_t group_end) {
  const int k = d.num_outliers;
  if (k == 0) return true;
  bool ok = true;
  for_each_group(d, group_begin, group_end, [&](int64_t g, int64_t, int64_t, int64_t, int64_t len, int64_t) {
    for (int s = 0; s < k; ++s) ok &= outlier_idx[g * k + s] < len;
  });
  return ok;
}

template <typename Val, typename Out>
bool nq_scatter_outliers(const NQDims& d, const uint8_t* outlier_idx, const Val* outlier_val, Out* out,
                         int64_t group_begin, int64_t group_end) {
  const int k = d.num_outliers;
  if (k == 0 || group_begin >= group_end) return true;
  bool ok = true;
  for_each_group(d, group_begin, group_end,
                 [&](int64_t g, int64_t n, int64_t t0, int64_t c0, int64_t len, int64_t step) {
                   Out* origin = out + (n * d.tokens + t0) * d.head_dim + c0;
                   for (int s = 0; s < k; ++s) {
                     const int64_t p = outlier_idx[g * k + s];
                     if (p >= len) {  // corrupt input: reported, never written out of bounds
                       ok = false;
                       continue;
                     }
                     origin[p * step] = from_float<Out>(to_float(outlier_val[g * k + s]));
                   }
                 });
  return ok;
}

#define NEXUSKV_INSTANTIATE_COMPRESS(In, Meta)                                                                 \
  template void nq_compress_tasks<In, Meta>(const NQDims&, const StridedRows<In>&, const NQBuffers<In, Meta>&, \
                                            int64_t, int64_t, CompressStatus*);
#define NEXUSKV_INSTANTIATE_DECOMPRESS(Meta, Out)                                                                      \
  template void nq_decompress_tasks<Meta, Out>(const NQDims&, const uint8_t*, const Meta*, const Meta*, Out*, int64_t, \
                                               int64_t);
#define NEXUSKV_INSTANTIATE_SCATTER(Val, Out) \
  template bool nq_scatter_outliers<Val, Out>(const NQDims&, const uint8_t*, const Val*, Out*, int64_t, int64_t);
NEXUSKV_FOR_EACH_FLOAT_PAIR(NEXUSKV_INSTANTIATE_COMPRESS)
NEXUSKV_FOR_EACH_FLOAT_PAIR(NEXUSKV_INSTANTIATE_DECOMPRESS)
NEXUSKV_FOR_EACH_FLOAT_PAIR(NEXUSKV_INSTANTIATE_SCATTER)

}  // namespace nexuskv::core
