"""Device parametrization for the operator tests: the CPU always, CUDA when torch
sees a GPU (cleanly skipped otherwise, with the reason in the report).

    from devices import DEVICES, requires_cuda

    @pytest.mark.parametrize("device", DEVICES)
    def test_x(device): ...

    @requires_cuda
    def test_only_on_a_gpu(): ...
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
NO_CUDA_REASON = "no CUDA device (torch.cuda.is_available() is False)"

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)

CUDA = pytest.param("cuda", marks=requires_cuda, id="cuda")
DEVICES = [pytest.param("cpu", id="cpu"), CUDA]


def is_cuda(t: torch.Tensor) -> bool:
    """Whether t lives on a GPU (the CUDA tests assert where their results are)."""
    return t.device.type == "cuda"


def to(obj, device):
    """obj with every tensor in it (lists, tuples, dicts, NamedTuples) moved to device."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to(x, device) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to(v, device) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def env(**values: str | None):
    """Sets (or with None removes) environment variables for the duration of a block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def poison_cuda_cache(nbytes: int = 64 << 20) -> None:
    """Fills memory that torch's CUDA caching allocator will hand out next with NaN bytes
    (0xFF), so that an output element a kernel forgot to write reads NaN (for floats) or
    255 (for bytes) instead of a plausible zero.  Heuristic: the allocator reuses freed
    blocks of matching size; callers check every output element as well."""
    if not HAS_CUDA:
        return
    blocks = [
        torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda")
        for n in (nbytes, nbytes // 8, nbytes // 64, 1 << 16, 1 << 12)
    ]
    torch.cuda.synchronize()
    del blocks
