// Which instruction set the CPU kernels of the core run (one choice for all
// of them; the mechanism: csrc/core/isa.h).  The kernels are compiled once per
// instruction set the build targets and the best one this CPU supports is
// used, capped by the environment variable NEXUSKV_CPU_ISA=generic|avx2|avx512
// (read at the first kernel call) or by set_cpu_isa_cap.
#pragma once

namespace nexuskv::core {

enum class CpuIsa : int {
  kGeneric = 0,  // the build's baseline target: runs on any CPU of its architecture
  kAvx2 = 1,     // AVX2 + FMA + F16C
  kAvx512 = 2,   // AVX-512 F/BW/VL/DQ + VNNI
};

const char* cpu_isa_name(CpuIsa isa);

// The ISA the kernels run: the best one compiled in and supported by this
// CPU, not above the cap.
CpuIsa cpu_isa();

// Whether `isa` is compiled into this build and supported by this CPU.
bool cpu_isa_supported(CpuIsa isa);

// Caps cpu_isa() for the whole process from now on (tests run every path in
// one process) and returns the previous cap.  Not meant to race with running
// kernels.
CpuIsa set_cpu_isa_cap(CpuIsa cap);

// The ISA of the kernel that ran last in this process: every per-ISA kernel
// notes itself when it runs, so that a test can assert the path it meant to
// test (not only the one it asked for).
CpuIsa last_kernel_isa();
void note_kernel_isa(CpuIsa isa);

// The ISA a kernel family runs when it is compiled for ISAs up to `best_built`
// only: min(cpu_isa(), best_built).  NQ is built up to AVX2 (nq_dispatch.cpp).
CpuIsa kernel_isa(CpuIsa best_built);

}  // namespace nexuskv::core
