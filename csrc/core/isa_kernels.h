// What every per-ISA compilation of the kernel sources defines (isa.h), for
// the dispatchers that choose one at run time (nq_dispatch.cpp,
// attention.cpp, paged_kernels.cpp).  NEXUSKV_DECLARE_ISA_KERNELS(isa) declares the kernels of
// namespace nexuskv::core::isa.
#pragma once

#include <cstdint>

#include "nexuskv/core/attention.h"
#include "nexuskv/core/nq_kernels.h"
#include "nexuskv/core/paged.h"

// Every (input, meta) and (meta, output) pairing of the three float types.
// clang-format off
#define NEXUSKV_FOR_EACH_FLOAT_PAIR(M)                  \
  M(float, float)  M(float, half_t)  M(float, bf16_t)  \
  M(half_t, float) M(half_t, half_t) M(half_t, bf16_t) \
  M(bf16_t, float) M(bf16_t, half_t) M(bf16_t, bf16_t)
// clang-format on

#define NEXUSKV_DECLARE_ISA_KERNELS(isa)                                                                           \
  namespace nexuskv::core::isa {                                                                                   \
  /* nq_kernels.cpp: as nq_compress_tasks / nq_decompress_tasks of nq_kernels.h */                                 \
  template <typename In, typename Meta>                                                                            \
  void nq_compress_tasks(const NQDims& d, const StridedRows<In>& x, const NQBuffers<In, Meta>& out, int64_t begin, \
                         int64_t end, CompressStatus* status);                                                     \
  template <typename Meta, typename Out>                                                                           \
  void nq_decompress_tasks(const NQDims& d, const uint8_t* codes, const Meta* scale, const Meta* zero, Out* out,   \
                           int64_t begin, int64_t end);                                                            \
  /* attention_kernel.cpp: as attention_tasks of attention.h */                                                    \
  template <typename Meta, typename Val>                                                                           \
  void attention_tasks(const CpuAttentionParams<Meta, Val>& p, int64_t splits, float* partials, int64_t begin,     \
                       int64_t end);                                                                               \
  /* paged_attention_kernel.cpp: as paged_attention_task of paged.h */                                             \
  template <typename X>                                                                                            \
  bool paged_attention_task(const PagedAttention<X>& p, const PagedTask& t, int h_begin, int h_end);               \
  /* hadamard_kernel.cpp: as hadamard_rotate_rows of attention.h */                                                \
  void hadamard_rotate_rows(const float* x, float* y, int64_t rows, int64_t n, const float* signs, bool inverse);  \
  }

NEXUSKV_DECLARE_ISA_KERNELS(generic)
#if defined(NEXUSKV_HAVE_X86_ISAS)
NEXUSKV_DECLARE_ISA_KERNELS(avx2)
NEXUSKV_DECLARE_ISA_KERNELS(avx512)
#endif
