// Run-time choice of the instruction set of the CPU kernels
// (nexuskv/core/cpu_isa.h): what the CPU supports, what the build compiled,
// and the NEXUSKV_CPU_ISA cap.
#include "nexuskv/core/cpu_isa.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace nexuskv::core {
namespace {

bool supported_by_cpu(CpuIsa isa) {
  if (isa == CpuIsa::kGeneric) return true;
#if defined(NEXUSKV_HAVE_X86_ISAS)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == CpuIsa::kAvx2) return avx2;
  return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

CpuIsa cap_from_environment() {
  const char* cap = std::getenv("NEXUSKV_CPU_ISA");
  if (cap == nullptr || *cap == '\0') return CpuIsa::kAvx512;
  if (std::strcmp(cap, "avx512") == 0) return CpuIsa::kAvx512;
  if (std::strcmp(cap, "avx2") == 0) return CpuIsa::kAvx2;
  return CpuIsa::kGeneric;  // "generic", or a name this build does not know: the portable path
}

std::atomic<int>& cap_value() {
  static std::atomic<int> cap{int(cap_from_environment())};
  return cap;
}

CpuIsa best_supported() {
  static const CpuIsa best = supported_by_cpu(CpuIsa::kAvx512) ? CpuIsa::kAvx512
                             : supported_by_cpu(CpuIsa::kAvx2) ? CpuIsa::kAvx2
                                                               : CpuIsa::kGeneric;
  return best;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    default: return "generic";
  }
}

bool cpu_isa_supported(CpuIsa isa) { return int(isa) <= int(best_supported()); }

CpuIsa cpu_isa() {
  const int cap = cap_value().load(std::memory_order_relaxed);
  return CpuIsa(cap < int(best_supported()) ? cap : int(best_supported()));
}

CpuIsa set_cpu_isa_cap(CpuIsa cap) { return CpuIsa(cap_value().exchange(int(cap))); }

namespace {
std::atomic<int> last_ran{-1};
}  // namespace

CpuIsa last_kernel_isa() { return CpuIsa(last_ran.load(std::memory_order_relaxed)); }
void note_kernel_isa(CpuIsa isa) { last_ran.store(int(isa), std::memory_order_relaxed); }

CpuIsa kernel_isa(CpuIsa best_built) {
  const CpuIsa isa = cpu_isa();
  return int(isa) < int(best_built) ? isa : best_built;
}

}  // namespace nexuskv::core
