// CPU kernels of the paged operators (the problem: nexuskv/core/paged.h; the
// format: paged_format.h).  The write runs the NQ compressor of nq_kernels.h
// on each (token, kv head) row, pointed at its slot, so a slot holds exactly
// what nq_compress gives for that token.  The attention dispatches to the
// per-ISA kernel of paged_attention_kernel.cpp.
#include <atomic>
#include <cstring>
#include <vector>

#include "isa_kernels.h"
#include "nexuskv/core/attention.h"
#include "nexuskv/core/cpu_isa.h"
#include "nexuskv/core/half.h"
#include "nexuskv/core/paged.h"

namespace nexuskv::core {
namespace {

std::atomic<int> last_key_path{int(PagedKeyPath::kNone)};

template <typename X>
void load_row(const X* src, int64_t n, float* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = to_float(src[c]);
}

}  // namespace

PagedKeyPath last_paged_key_path() { return PagedKeyPath(last_key_path.load(std::memory_order_relaxed)); }
void note_paged_key_path(PagedKeyPath path) { last_key_path.store(int(path), std::memory_order_relaxed); }

template <typename X>
void paged_write_tokens(const PagedWrite<X>& w, int64_t begin, int64_t end, CompressStatus* status) {
  const PagedLayout& l = w.pool.layout;
  const int D = l.head_dim;
  std::vector<float> rf(w.rotation_signs ? 2 * D : 0);
  std::vector<X> rx(w.rotation_signs ? D : 0);
  const int64_t zero_offset = 0;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = w.slot_mapping[t];
    if (slot < 0) continue;
    const int64_t block = slot / l.block_size;
    const int offset = int(slot % l.block_size);
    for (int h = 0; h < w.pool.kv_heads; ++h) {
      uint8_t* page = w.pages + w.pool.head_page(block, h);
      for (int half = 0; half < 2; ++half) {
        const X* src = (half ? w.value + t * w.value_stride_t : w.key + t * w.key_stride_t) + int64_t(h) * D;
        if (w.rotation_signs) {
          // hadamard_rotate(x, signs) in float32, rounded to X: what the op gives.
          load_row(src, D, rf.data());
          hadamard_rotate_rows(rf.data(), rf.data() + D, 1, D, w.rotation_signs, false);
          for (int c = 0; c < D; ++c) rx[c] = from_float<X>(rf[D + c]);
          src = rx.data();
        }
        const PagedSlot<X> s = paged_slot<X>(l, page, offset, half == 1);
        NQDims d = l.token_dims(half ? l.value_bits : l.key_bits);
        d.fit_range = half ? w.value_fit_range : w.key_fit_range;
        const StridedRows<X> x{src, &zero_offset, 0, 1};
        const NQBuffers<X, X> out{s.codes, s.scale, s.zero, s.outlier_idx, s.outlier_val};
        nq_compress_tasks<X, X>(d, x, out, 0, 1, status);
      }
    }
  }
}

template <typename X>
void paged_write_exact(const PagedWrite<X>& w, int h_begin, int h_end) {
  const PagedLayout& l = w.pool.layout;
  const PagedOffsets off(l);
  const int D = l.head_dim;
  for (int h = h_begin; h < h_end; ++h)
    for (int64_t t = 0; t < w.num_tokens; ++t) {  // in order: the last token of a ring row wins
      const int64_t slot = w.slot_mapping[t];
      if (slot < 0) continue;
      uint8_t* page = w.pages + w.pool.head_page(slot / l.block_size, h);
      const int offset = int(slot % l.block_size);
      std::memcpy(paged_ring_row<X>(off, page, offset, D, false), w.key + t * w.key_stride_t + int64_t(h) * D,
                  sizeof(X) * size_t(D));
      std::memcpy(paged_ring_row<X>(off, page, offset, D, true), w.value + t * w.value_stride_t + int64_t(h) * D,
                  sizeof(X) * size_t(D));
    }
}

// The attention: the kernel of the instruction set chosen at run time
// (paged_attention_kernel.cpp, compiled once per ISA).
template <typename X>
bool paged_attention_task(const PagedAttention<X>& p, const PagedTask& t, int h_begin, int h_end) {
  switch (cpu_isa()) {
#if defined(NEXUSKV_HAVE_X86_ISAS)
    case CpuIsa::kAvx512: return avx512::paged_attention_task<X>(p, t, h_begin, h_end);
    case CpuIsa::kAvx2: return avx2::paged_attention_task<X>(p, t, h_begin, h_end);
#endif
    default: return generic::paged_attention_task<X>(p, t, h_begin, h_end);
  }
}

#define NEXUSKV_INSTANTIATE_PAGED(X)                                                            \
  template void paged_write_tokens<X>(const PagedWrite<X>&, int64_t, int64_t, CompressStatus*); \
  template void paged_write_exact<X>(const PagedWrite<X>&, int, int);                           \
  template bool paged_attention_task<X>(const PagedAttention<X>&, const PagedTask&, int, int);
NEXUSKV_INSTANTIATE_PAGED(float)
NEXUSKV_INSTANTIATE_PAGED(half_t)
NEXUSKV_INSTANTIATE_PAGED(bf16_t)
#undef NEXUSKV_INSTANTIATE_PAGED

}  // namespace nexuskv::core
