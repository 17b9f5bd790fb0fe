"""dgq_compress / dgq_decompress and hadamard_rotate on CUDA: segment boundaries and all
compressed tensors identical to the CPU kernels', decompression and rotation identical
to the CPU's, every run twice into poisoned memory, bad input.  Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from devices import env, is_cuda, poison_cuda_cache, requires_cuda
from test_cuda_nq import random_x

import nexuskv

pytestmark = requires_cuda

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def planted(shape, dtype, seed):
    """random_x with the scale changing at a third and at two thirds of the tokens."""
    x = random_x(shape, torch.float32, seed)
    T = shape[-2]
    x[..., T // 3 :, :] *= 8
    x[..., 2 * T // 3 :, :] /= 20
    return x.to(dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "tokens,group,granule", [(16, 16, 16), (100, 32, 16), (256, 64, 16), (1000, 64, 16), (130, 32, 4), (77, 24, 8)]
)
@pytest.mark.parametrize("bits,k", [(4, 0), (2, 1), (8, 2), (3, 0)])
def test_dgq_compress_is_identical_to_the_cpu(dtype, tokens, group, granule, bits, k):
    x = planted((2, 3, tokens, 64), dtype, seed=tokens + group)
    cpu = torch.ops.nexuskv.dgq_compress(x, bits, group, granule, None, k, None)
    runs = []
    for _ in range(2):
        poison_cuda_cache()
        runs.append(torch.ops.nexuskv.dgq_compress(x.cuda(), bits, group, granule, None, k, None))
    for name, c, a, b in zip(("codes", "scale", "zero", "outlier_idx", "outlier_val", "segment_starts"), cpu, *runs):
        assert is_cuda(a) and torch.equal(a, b), name
        assert torch.equal(a.cpu(), c), f"{name} differs from the CPU kernel's"
    starts = runs[0][5].cpu()
    assert starts.shape[-1] == -(-tokens // group) and torch.all(starts[..., 0] == 0)
    # Decompression, on both, for every output dtype.
    for out in FLOATS:
        ref = torch.ops.nexuskv.dgq_decompress(*cpu, bits, group, 64, out)
        got = torch.ops.nexuskv.dgq_decompress(*runs[0], bits, group, 64, out)
        assert torch.equal(got.cpu(), ref)


def test_dgq_boundaries_follow_a_planted_change():
    x = planted((1, 2, 384, 64), torch.float32, seed=1)
    starts = torch.ops.nexuskv.dgq_compress(x.cuda(), 4, 64, 16, None, 0, None)[5].cpu()
    assert (starts == 128).any() and (starts == 256).any(), starts


def test_dgq_bad_arguments_and_corrupt_segments():
    x = planted((1, 2, 100, 64), torch.float32, seed=2).cuda()
    with pytest.raises(RuntimeError, match=r"dgq_compress: granule must be in \[1, group_size\]"):
        torch.ops.nexuskv.dgq_compress(x, 4, 32, 64, None, 0, None)
    with pytest.raises(RuntimeError, match=r"dgq_compress: max_len must be a multiple of granule"):
        torch.ops.nexuskv.dgq_compress(x, 4, 32, 16, 40, 0, None)
    parts = list(torch.ops.nexuskv.dgq_compress(x, 4, 32, 16, None, 1, None))
    bad = parts[5].clone()
    bad[0, 1, 1] = 90  # segments of row 1 no longer ordered (90 > the next start)
    bad[0, 1, 2] = 48
    with env(NEXUSKV_CUDA_CHECKS="1"), pytest.raises(RuntimeError, match="segment_starts"):
        torch.ops.nexuskv.dgq_decompress(*parts[:5], bad, 4, 32, 64, None)
    # Without checks the CUDA kernels never read through such segments: the row is NaN.
    out = torch.ops.nexuskv.dgq_decompress(*parts[:5], bad, 4, 32, 64, None).cpu()
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, 0]).all()


# ---- hadamard_rotate ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [16, 64, 128, 256, 16384])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("inverse", [False, True])
def test_hadamard_rotate_is_identical_to_the_cpu(n, dtype, inverse):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, 5, n, generator=g).to(dtype)
    signs = (torch.randint(0, 2, (n,), generator=g) * 2 - 1).float()
    cpu = nexuskv.hadamard_rotate(x, signs, inverse)
    runs = []
    for _ in range(2):
        poison_cuda_cache()
        runs.append(nexuskv.hadamard_rotate(x.cuda(), signs.cuda(), inverse))
    assert runs[0].dtype == dtype and torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0].cpu(), cpu)


def test_hadamard_rotate_bad_input_on_cuda():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(RuntimeError, match=r"signs must have shape \[64\]"):
        nexuskv.hadamard_rotate(x, torch.ones(32, device="cuda"))
    with pytest.raises(RuntimeError, match=r"x's last dimension \(head_dim\) a power of two, got 48"):
        nexuskv.hadamard_rotate(torch.randn(4, 48, device="cuda"), torch.ones(48, device="cuda"))
    with pytest.raises(RuntimeError, match=r"all tensors must be on one device, x is on cuda:\d but signs is on cpu"):
        nexuskv.hadamard_rotate(x, torch.ones(64))
    half = torch.full((64,), 0.5, device="cuda")
    with env(NEXUSKV_CUDA_CHECKS="1"), pytest.raises(RuntimeError, match=r"must all be \+1 or -1"):
        nexuskv.hadamard_rotate(x, half)
    assert torch.isnan(nexuskv.hadamard_rotate(x, half)).all()
    torch.library.opcheck(torch.ops.nexuskv.hadamard_rotate.default, (x, torch.ones(64, device="cuda"), True))
