"""nq_compress / nq_decompress on CUDA: codes, scales, zeros and outliers bit-identical
to the CPU kernels for the same input; decompression identical to the CPU's and within
the rounding of the output dtype of the float64 reference (nq_reference.py); every run
twice (a race shows as a moving result) into poisoned memory; operator hygiene; bad input
gets the CPU's errors.  Skipped without a GPU."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from devices import env, is_cuda, poison_cuda_cache, requires_cuda

import nexuskv
from nq_reference import F64, reference_dequantize

pytestmark = requires_cuda

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def random_x(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Normal values with an offset channel, rare large values (outlier candidates),
    repeated values (ties in the outlier ranking) and a constant channel (zero scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 3 % shape[-1]] += 4.0
    spikes = torch.rand(shape, generator=g) < 0.02
    x = torch.where(spikes, x * 30, x)
    ties = torch.rand(shape, generator=g) < 0.03
    x = torch.where(ties, torch.full_like(x, 0.5), x)
    x[..., -1] = 1.25
    return x.to(dtype)


def compress_on_both(x, bits, group, axis, k, meta, fit_range=False):
    """CPU result, then the CUDA result twice (into poisoned memory); checks devices and
    that the two CUDA runs agree bit for bit; returns (cpu, cuda) parts."""
    cpu = nexuskv.nq_compress(x, bits, group, axis, k, meta, fit_range)
    runs = []
    for _ in range(2):
        poison_cuda_cache()
        runs.append(nexuskv.nq_compress(x.cuda(), bits, group, axis, k, meta, fit_range))
    for a, b in zip(*runs):
        assert is_cuda(a) and torch.equal(a, b)
    return cpu, runs[0]


def assert_parts_equal(cpu, gpu):
    for name, c, g in zip(("codes", "scale", "zero", "outlier_idx", "outlier_val"), cpu, gpu):
        assert c.shape == g.shape and c.dtype == g.dtype, name
        assert torch.equal(g.cpu(), c), f"{name} differs from the CPU kernel's"


SHAPES = [(2, 3, 70, 64), (1, 2, 40, 80), (5, 128), (2, 33, 128), (3, 1, 1, 16), (1, 2, 257, 130)]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis,group", [(-2, 32), (-2, 64), (-1, 16), (-1, 64), (-2, 24), (-1, 40)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_compress_is_bit_identical_to_the_cpu(bits, axis, group, dtype):
    for shape, k in itertools.product(SHAPES, (0, 1, 3)):
        for meta in (None, torch.float32, torch.bfloat16 if dtype != torch.bfloat16 else torch.float16):
            x = random_x(shape, dtype, seed=bits * 7 + group + len(shape))
            cpu, gpu = compress_on_both(x, bits, group, axis, k, meta)
            assert_parts_equal(cpu, gpu)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis,group", [(-2, 32), (-2, 128), (-1, 64), (-1, 40)])
def test_fitted_ranges_are_bit_identical_to_the_cpu(bits, axis, group):
    """nq_fit_kernel against the CPU's nq_fit.h: the same candidates, the same choice."""
    for shape, k, dtype in itertools.product(SHAPES, (0, 1, 3), FLOATS):
        x = random_x(shape, dtype, seed=bits * 11 + group + len(shape))
        cpu, gpu = compress_on_both(x, bits, group, axis, k, None, fit_range=True)
        assert_parts_equal(cpu, gpu)
    x = random_x((2, 3, 300, 64), torch.bfloat16, seed=9)  # DGQ segments too
    cpu = nexuskv.dgq_compress(x, 2, 64, fit_range=True)
    gpu = nexuskv.dgq_compress(x.cuda(), 2, 64, fit_range=True)
    for name, c, g in zip(("codes", "scale", "zero", "outlier_idx", "outlier_val", "segment_starts"), cpu, gpu):
        assert torch.equal(g.cpu(), c), name


def test_compress_of_strided_views_and_groups_with_fewer_entries_than_slots():
    x = random_x((3, 80, 2, 64), seed=3).transpose(1, 2)  # [3, 2, 80, 64], not contiguous
    assert not x.is_contiguous()
    for axis, group, k in [(-2, 32, 2), (-1, 16, 1), (-2, 64, 20), (-1, 48, 20)]:
        cpu, gpu = compress_on_both(x, 4, group, axis, k, None)
        assert_parts_equal(cpu, gpu)
    x = random_x((2, 64, 40), seed=4)[:, ::2, ::2]  # strided in tokens and channels
    cpu, gpu = compress_on_both(x, 3, 16, -1, 2, None)
    assert_parts_equal(cpu, gpu)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis,group,k", [(-2, 32, 0), (-2, 64, 2), (-1, 32, 1), (-1, 48, 0)])
@pytest.mark.parametrize("meta", [torch.float32, torch.float16, torch.bfloat16])
def test_decompress_is_identical_to_the_cpu_and_to_the_reference(bits, axis, group, k, meta):
    x = random_x((2, 3, 100, 80), torch.float32, seed=bits + group)
    parts = nexuskv.nq_compress(x, bits, group, axis, k, meta)
    ref = reference_dequantize(parts, bits, group, axis, 80)
    for out_dtype in FLOATS:
        cpu = nexuskv.nq_decompress(*parts, bits, group, axis, 80, out_dtype)
        runs = []
        for _ in range(2):
            poison_cuda_cache()
            runs.append(nexuskv.nq_decompress(*[p.cuda() for p in parts], bits, group, axis, 80, out_dtype))
        assert is_cuda(runs[0]) and runs[0].dtype == out_dtype
        assert torch.equal(runs[0], runs[1])
        assert torch.equal(runs[0].cpu(), cpu)
        # Every element written and within float32 arithmetic plus the output dtype's rounding
        # of the float64 value: code * s + z in float32 rounds at most twice, by 2^-24 of
        # |code * s| <= |x| + |z| and of |x| (outliers are stored exactly), then the 16-bit
        # output rounds by eps / 2 of |x| (plus half a subnormal step).
        got = runs[0].cpu().to(F64)
        assert torch.isfinite(got).all()
        zero_mag = reference_dequantize(
            (torch.zeros_like(parts[0]), parts[1], parts[2].abs(), parts[3], parts[4].abs()), bits, group, axis, 80
        )
        bound = 2.0**-24 * (2 * ref.abs() + zero_mag)
        if out_dtype != torch.float32:
            bound += torch.finfo(out_dtype).eps / 2 * ref.abs() + 2.0**-25
        assert torch.all((got - ref).abs() <= bound), float(((got - ref).abs() / bound).max())


def test_scale_bound_holds_on_cuda():
    # |x - x_hat| <= scale / 2 (plus float32 rounding) for every dense entry; outliers exact.
    x = random_x((2, 4, 128, 64), seed=9)
    for axis, group in [(-2, 64), (-1, 32)]:
        parts = nexuskv.nq_compress(x.cuda(), 4, group, axis, 2)
        xh = nexuskv.nq_decompress(*parts, 4, group, axis, 64, torch.float32).cpu().double()
        s = parts.scale.cpu().double()
        s_el = s.repeat_interleave(group, 2)[:, :, :128] if axis == -2 else s.repeat_interleave(group, 3)[..., :64]
        err = (xh - x.double()).abs()
        assert torch.all(err <= s_el / 2 + 1e-5 * x.double().abs() + 1e-6)


# ---- operator hygiene --------------------------------------------------------------------------


def test_opcheck_on_cuda():
    compress, decompress = torch.ops.nexuskv.nq_compress.default, torch.ops.nexuskv.nq_decompress.default
    for shape, dtype, bits, group, axis, k in [
        ((2, 3, 70, 64), torch.float32, 4, 32, -2, 0),
        ((1, 2, 40, 80), torch.float16, 3, 16, -1, 2),
        ((2, 33, 128), torch.bfloat16, 8, 128, -1, 0),
    ]:
        x = torch.randn(shape, dtype=dtype, device="cuda")
        torch.library.opcheck(compress, (x, bits, group, axis, k, None))
        parts = compress(x, bits, group, axis, k, None)
        torch.library.opcheck(decompress, (*parts, bits, group, axis, shape[-1], None))


def roundtrip(x):
    parts = torch.ops.nexuskv.nq_compress(x, 4, 32, -2, 1)
    return torch.ops.nexuskv.nq_decompress(*parts, 4, 32, -2, x.shape[-1])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_on_cuda(backend):
    x = torch.randn(2, 4, 96, 64, device="cuda")
    compiled = torch.compile(roundtrip, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), roundtrip(x), rtol=0, atol=0)


def test_requires_grad_rejected_on_cuda():
    x = torch.randn(1, 8, 64, device="cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        nexuskv.nq_compress(x, 4, 32, -2)


def test_runs_on_the_current_stream_and_device_of_its_input():
    x = torch.randn(2, 4, 64, 64, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        parts = nexuskv.nq_compress(x, 4, 32, -2)
        out = nexuskv.nq_decompress(*parts, 4, 32, -2, 64)
    s.synchronize()
    assert torch.equal(out.cpu(), nexuskv.nq_decompress(*nexuskv.nq_compress(x.cpu(), 4, 32, -2), 4, 32, -2, 64))


# ---- bad input: the CPU's messages -------------------------------------------------------------


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x: nexuskv.nq_compress(x.long(), 4, 8, -1), r"nq_compress: x must be float32, float16 or bfloat16"),
        (lambda x: nexuskv.nq_compress(x, 5, 8, -1), r"nq_compress: bits must be one of 2, 3, 4, 8, got 5"),
        (lambda x: nexuskv.nq_compress(x, 4, 257, -2), r"nq_compress: group_size must be in \[1, 256\], got 257"),
        (lambda x: nexuskv.nq_compress(x, 4, 8, -1, 8), r"nq_compress: num_outliers must be in \[0, group_size\)"),
        (lambda x: nexuskv.nq_compress(x, 4, 8, 0), r"nq_compress: axis must be -2 .* or -1 .*, got 0"),
        (lambda x: nexuskv.nq_compress(x[:, :0], 4, 8, -1), r"nq_compress: x must not be empty"),
        (
            lambda x: nexuskv.nq_compress(x[0, 0, 0], 4, 8, -1),
            r"nq_compress: x must have shape \[\.\.\., tokens, head_dim\]",
        ),
        (lambda x: nexuskv.nq_compress(x, 4, 8, -1, 0, torch.int32), r"nq_compress: meta_dtype must be float32"),
    ],
)
def test_bad_compress_arguments(call, match):
    x = random_x((2, 3, 20, 64)).cuda()
    with pytest.raises(RuntimeError, match=match):
        call(x)


def test_bad_decompress_arguments_and_mixed_devices():
    parts = list(nexuskv.nq_compress(random_x((2, 3, 20, 64)).cuda(), 4, 8, -2, 2))
    with pytest.raises(RuntimeError, match="nq_decompress: codes must be uint8"):
        nexuskv.nq_decompress(parts[0].float(), *parts[1:], 4, 8, -2, 64)
    with pytest.raises(RuntimeError, match="scale must have shape"):
        nexuskv.nq_decompress(*parts, 4, 16, -2, 64)
    with pytest.raises(RuntimeError, match="nq_decompress: all tensors must be on one device, codes is on cuda"):
        nexuskv.nq_decompress(parts[0], parts[1].cpu(), *parts[2:], 4, 8, -2, 64)
    with pytest.raises(RuntimeError, match="out_dtype must be float32, float16 or bfloat16"):
        nexuskv.nq_decompress(*parts, 4, 8, -2, 64, torch.float64)


@pytest.mark.parametrize("axis", [-2, -1])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_input_error_with_checks_and_nan_scale_without(axis, bad):
    x = random_x((2, 3, 20, 64))
    x[1, 2, 17, 63] = bad
    with env(NEXUSKV_CUDA_CHECKS="1"), pytest.raises(RuntimeError, match=r"nq_compress: x contains NaN or Inf"):
        nexuskv.nq_compress(x.cuda(), 4, 8, axis)
    with env(NEXUSKV_CUDA_CHECKS=None):
        parts = nexuskv.nq_compress(x.cuda(), 4, 8, axis)  # no synchronization: the group is marked
        scale = parts.scale.cpu()
        g = (1, 2, 17 // 8, 63) if axis == -2 else (1, 2, 17, 63 // 8)
        assert torch.isnan(scale[g]) and torch.isnan(parts.zero.cpu()[g])
        assert torch.isnan(scale).sum() == 1
        out = nexuskv.nq_decompress(*parts, 4, 8, axis, 64).cpu()
        assert torch.isnan(out[1, 2, 17, 63]) and torch.isnan(out).any(-1).sum() >= 1
        assert torch.isfinite(out[0]).all()


def test_meta_overflow_error_with_checks():
    x = random_x((2, 3, 20, 64))
    x[0, 0, 0, 0] = 1e6
    with env(NEXUSKV_CUDA_CHECKS="1"), pytest.raises(RuntimeError, match=r"does not fit in meta_dtype Half"):
        nexuskv.nq_compress(x.cuda(), 4, 8, -2, 0, torch.float16)
    parts = nexuskv.nq_compress(x.cuda(), 4, 8, -2, 0, torch.float16)
    assert torch.isinf(parts.scale.cpu()[0, 0, 0, 0])


def test_corrupt_outlier_index_error_with_checks_and_nan_group_without():
    parts = list(nexuskv.nq_compress(random_x((1, 2, 32, 64)).cuda(), 4, 8, -1, 2))
    parts[3] = parts[3].clone()
    parts[3][0, 1, 5, 2, 0] = 9  # position 9 of a group of 8 channels
    with env(NEXUSKV_CUDA_CHECKS="1"), pytest.raises(RuntimeError, match="outlier_idx holds a position outside"):
        nexuskv.nq_decompress(*parts, 4, 8, -1, 64)
    out = nexuskv.nq_decompress(*parts, 4, 8, -1, 64).cpu()
    assert torch.isnan(out[0, 1, 5, 16:24]).all()
    assert torch.isfinite(out[0, 1, 5, :16]).all() and torch.isfinite(out[0, 0]).all()
