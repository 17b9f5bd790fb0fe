"""The CUDA backend is compiled and linked wherever a CUDA toolchain is present (no GPU
needed: this runs in CI on a machine without one), and a CPU-only build says so."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import nexuskv  # noqa: F401  (loads the library)
from nexuskv import _build_info

OPS = ["nq_compress", "nq_decompress", "dgq_compress", "dgq_decompress", "dgq_fused_attention", "hadamard_rotate"]


def expected_architectures() -> list[str]:
    """What the build was asked for: NEXUSKV_CUDA_ARCHITECTURES when set (benchmarks/gpu_check.sh
    exports the value it passes to CMake: the GPU's own, e.g. 90-real), else the default of
    CMakeLists.txt (sm_80 and sm_90 machine code plus compute_90 PTX)."""
    asked = os.environ.get("NEXUSKV_CUDA_ARCHITECTURES")
    if asked:
        return asked.split(";")
    cmake = (Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    default = re.search(r'set\(NEXUSKV_CUDA_ARCHITECTURES "([^"]+)" CACHE', cmake)
    assert default, "CMakeLists.txt no longer sets a default NEXUSKV_CUDA_ARCHITECTURES"
    return default.group(1).split(";")


def has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"nexuskv::{op}", key)


def cuda_toolchain() -> bool:
    """A CUDA build of torch and nvcc: what CMakeLists.txt needs to compile csrc/cuda."""
    nvcc = shutil.which("nvcc") or any(
        os.path.exists(os.path.join(p, "bin", "nvcc"))
        for p in filter(None, [os.environ.get("CUDA_HOME"), "/usr/local/cuda"])
    )
    return torch.version.cuda is not None and bool(nvcc)


@pytest.mark.skipif(not cuda_toolchain(), reason="no CUDA build of torch with nvcc here: the build is CPU-only")
def test_cuda_kernels_are_compiled_and_registered():
    assert _build_info.WITH_CUDA is True, "CMake found torch's CUDA build and nvcc but did not compile csrc/cuda"
    for op in OPS:
        assert has_kernel(op, "CUDA"), f"nexuskv::{op} has no CUDA kernel"
        assert has_kernel(op, "CPU"), f"nexuskv::{op} has no CPU kernel"
    built, expected = _build_info.CUDA_ARCHITECTURES.split(";"), expected_architectures()
    assert built == expected, (
        f"nexuskv was built for CUDA architectures {built}, the build was asked for {expected} "
        "(NEXUSKV_CUDA_ARCHITECTURES, else CMakeLists.txt's default; a build directory keeps an earlier -D value)"
    )


def test_build_info_is_consistent_with_the_registrations():
    for op in OPS:
        assert has_kernel(op, "CUDA") == bool(_build_info.WITH_CUDA), op
    assert bool(_build_info.CUDA_ARCHITECTURES) == bool(_build_info.WITH_CUDA)
