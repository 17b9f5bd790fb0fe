"""The CUDA backend is compiled and linked wherever a CUDA toolchain is present (no GPU
needed: this runs in CI on a machine without one), and a CPU-only build says so."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import nexuskv  # noqa: F401  (loads the library)
from nexuskv import _build_info

OPS = ["nq_compress", "nq_decompress", "dgq_compress", "dgq_decompress", "dgq_fused_attention", "hadamard_rotate"]


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
    archs = _build_info.CUDA_ARCHITECTURES.split(";")
    assert "80-real" in archs and "90-real" in archs, archs  # A100 and H100/H200 machine code


def test_build_info_is_consistent_with_the_registrations():
    for op in OPS:
        assert has_kernel(op, "CUDA") == bool(_build_info.WITH_CUDA), op
    assert bool(_build_info.CUDA_ARCHITECTURES) == bool(_build_info.WITH_CUDA)
