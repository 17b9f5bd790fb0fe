"""dgq_fused_attention on CUDA against the float64 reference of test_attention.py and
against the CPU kernel, for every CUDA kernel: the reference SIMT kernel
(NEXUSKV_CUDA_ATTENTION=simple), the tensor-core kernel (=mma) and the decode kernel
(=decode, contig_decode.cuh; each fails the call if it does not take the case, so a
passing test proves it ran).  Every bit width,
grouping, dtype, GQA ratio, q_len in {1, 4, 17}, ragged batches, sinks, tail, rotation,
DGQ keys, windows and soft-caps; outputs into poisoned memory, every element checked,
every check run twice; no host synchronization, CUDA graph capture, opcheck,
torch.compile; bad input and mixed devices.  Skipped without a GPU."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from devices import env, is_cuda, poison_cuda_cache, requires_cuda

# test_attention.py (the cases and the reference) and the property test below need it.
pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import HealthCheck, given, settings
from test_attention import (
    BAD_SHAPES,
    BAD_VALUES,
    GRID,
    SINK_GRID,
    Case,
    attention_case,
    bad,
    on_device,
    rel_err,
    sink_case,
)

pytestmark = requires_cuda

MMA_BITS = (2, 4, 8)  # the tensor-core kernel's widths (3 bits: reference kernel)
# How far apart the two kernels' float32 results may be, in units of the size of the terms
# an output element sums (sum_j p_j rms(v_j)).  The reference kernel uses float32 FMAs; the
# tensor-core kernel multiplies fp16 hi/lo halves of the folded queries and of the weights
# (22 significant bits) by exact integer codes and accumulates in float32 over tiles of 64
# keys, so its scores carry ~2^-20 of the terms they sum and p.V ~2^-20 of sum p|v|.  Measured
# on an H200 (benchmarks/cuda_accuracy.py, 462 cases): at most 2.6e-6, about 2^-18.5.
MMA_GAP = 2.0**-14
# Two runs of the tensor-core kernel (its outlier corrections add by atomics, in any order),
# in units of the row's largest output (measured there: at most 7.8e-7).
RERUN_GAP = 2.0**-18


def on_cuda(case: Case) -> Case:
    """A copy of the (CPU-built) case with every tensor on the GPU."""
    return on_device(case, "cuda")


def run_cuda(case: Case, kernel: str, **overrides) -> torch.Tensor:
    """Runs the case on the GPU twice with the given kernel, into poisoned memory; the two
    runs must agree (a race shows as a moving result); returns the output on the CPU."""
    gpu = on_cuda(case)
    outs = []
    with env(NEXUSKV_CUDA_ATTENTION=kernel, NEXUSKV_CUDA_CHECKS="1"):
        for _ in range(2):
            poison_cuda_cache()
            outs.append(gpu.run(**overrides))
    assert is_cuda(outs[0]) and outs[0].dtype == case.q.dtype and outs[0].shape == case.q.shape
    # The reference kernel has no atomics: bit-identical; the tensor-core kernel's outlier
    # corrections add in any order.  NaN rows (non-finite input) must be the same rows.
    a, b = outs[0].float(), outs[1].float()
    assert torch.equal(a.isnan(), b.isnan())
    fin = ~a.isnan()
    if kernel == "simple":
        assert torch.equal(a[fin], b[fin])
    elif case.q.dtype == torch.float32:
        assert rel_err(a[fin], b[fin].double()) <= 1e-6
    else:
        # Another order of the same float32 additions moves a sum by a few units of 2^-23 of
        # the largest partial sum; rounded to 16 bits, an element on a rounding boundary then
        # moves by one unit in the last place.
        row = a.abs().nan_to_num().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        gap = beyond_one_ulp(a.nan_to_num(), b.nan_to_num(), case.q.dtype) / row
        assert gap.max() <= RERUN_GAP, float(gap.max())
    return outs[0].cpu()


def beyond_one_ulp(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|a - b| beyond one unit in the last place of dtype (eps x the larger magnitude)."""
    a, b = a.double(), b.double()
    return ((a - b).abs() - torch.finfo(dtype).eps * torch.maximum(a.abs(), b.abs())).clamp_min(0)


def mma_takes(case: Case) -> bool:
    bits, kg, ka = case.k_format
    vb, vg, va = case.v_format
    return (
        case.q.dtype in (torch.float16, torch.bfloat16)
        and bits == vb
        and bits in MMA_BITS
        and ka == -2
        and va == -1
        and (case.k_starts is not None or kg % 16 == 0)
        and vg % 16 == 0
        and case.q.shape[-1] in (64, 128)
        and case.k_cache[1].dtype == case.q.dtype
        and case.v_cache[1].dtype == case.q.dtype
    )


def decode_takes(case: Case) -> bool:
    """Whether the decode kernel takes the case (contig_decode.cuh's decode_variant): keys
    per channel (contig_decode_kernel) or per token in as many groups as the values
    (contig_decode_token_keys_kernel)."""
    bits, kg, ka = case.k_format
    vb, vg, va = case.v_format
    D = case.q.shape[-1]
    sub = {2: 4, 4: 2, 8: 1}.get(bits, 0)  # chunks of 16 keys a warp iteration

    def token_groups(g):  # groups a token of D channels (0: not whole groups)
        return 1 if g >= D else (D // g if D % g == 0 else 0)

    groups = token_groups(vg)
    rows = case.q.shape[1] // case.k_cache[0].shape[1] * case.q.shape[2]
    keys = kg % (16 * sub) == 0 if ka == -2 else token_groups(kg) == groups
    formats = mma_takes(case) or (  # (keys per token: what mma_takes asks of the rest)
        ka == -1
        and va == -1
        and kg % 16 == 0
        and vg % 16 == 0
        and case.q.dtype in (torch.float16, torch.bfloat16)
        and bits == vb
        and case.q.shape[-1] in (64, 128)
        and case.k_cache[1].dtype == case.q.dtype
        and case.v_cache[1].dtype == case.q.dtype
    )
    return (
        formats
        and case.k_starts is None
        and sub > 0
        and keys
        and groups in (1, 2, 4)
        and (D // groups) % 16 == 0
        and case.k_cache[3].shape[-1] == 0
        and case.v_cache[3].shape[-1] == 0
        and case.k_cache[0].shape[1] * 2 * math.ceil(rows / 16) < 65536
        and case.k_cache[0].shape[2] % (16 * sub) == 0
        and case.v_cache[0].shape[2] % (16 * sub) == 0
    )


def tolerance(dtype) -> float:
    # float32 arithmetic; for 16-bit q the output is rounded to q's dtype (as on the CPU).
    return 1e-4 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps


def check_case(case: Case, **overrides):
    """Both kernels (the tensor-core one where it takes the case) within the tolerance of
    the float64 reference and of the CPU kernel; every element finite."""
    ref = case.reference() if not overrides else None
    cpu = case.run(**overrides)
    tol = tolerance(case.q.dtype)
    kernels = ["simple"] + (["mma"] if mma_takes(case) else []) + (["decode"] if decode_takes(case) else [])
    outs = {}
    for kernel in kernels:
        out = outs[kernel] = run_cuda(case, kernel, **overrides)
        assert torch.isfinite(out).all(), kernel
        if ref is not None:
            assert rel_err(out, ref) <= tol, kernel
        assert rel_err(out, cpu.double()) <= 2 * tol, kernel
    # (The decode kernel rounds its queries x key scales to 16-bit integers per row and key
    # group, coarser than the tensor-core kernel's 22 bits: it meets the tolerances above; the
    # element-by-element gap below is the tensor-core kernel's.)
    if "mma" in outs:
        # Element by element: one unit in the last place of the 16-bit output (rounding
        # boundaries) plus MMA_GAP x the size of the terms the element sums.
        mag = case.reference(value_magnitudes=True) if not overrides else outs["simple"].double().abs().amax(-1, True)
        gap = beyond_one_ulp(outs["simple"], outs["mma"], case.q.dtype) / mag.clamp_min(1e-300)
        assert gap.max() <= MMA_GAP, float(gap.max())
    return kernels


def grid_case(bits, ratio, q_len, tail, rotate, dgq, longest, dtype=torch.float32) -> Case:
    """A case of the GRID: three ragged sequences (the longest `longest` compressed tokens)."""
    return Case(
        bits=bits,
        ratio=ratio,
        q_len=q_len,
        tail=tail,
        tail_lens=[tail, 5, tail] if tail else None,
        comp_lens=(longest, 45, 20) if tail else (longest, 45, 20 + q_len),
        rotate=rotate,
        dgq=dgq,
        dtype=dtype,
        seed=bits * 100 + ratio * 10 + q_len,
    )


@pytest.mark.parametrize("bits,ratio,q_len,tail,rotate,dgq", GRID)
def test_float32_grid_matches_float64_and_cpu(bits, ratio, q_len, tail, rotate, dgq):
    check_case(grid_case(bits, ratio, q_len, tail, rotate, dgq, longest=100))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,ratio,q_len,tail,rotate,dgq", GRID)
def test_16_bit_grid_both_kernels(dtype, bits, ratio, q_len, tail, rotate, dgq):
    kernels = check_case(grid_case(bits, ratio, q_len, tail, rotate, dgq, longest=200, dtype=dtype))
    assert ("mma" in kernels) == (bits in MMA_BITS)  # the 2/4/8-bit cases do run on the tensor cores


# The decode kernel's formats: bits, head_dim, GQA ratio x q_len (a block's 8 rows; more in
# blocks of 8 rows), value group (1, 2 or 4 groups), with a tail, sinks, rotation, a window.
DECODE_GRID = [
    (2, 64, 8, 1, 64, 16, 0, True, None),
    (2, 128, 4, 1, 32, 0, 4, False, None),
    (4, 64, 1, 1, 16, 9, 0, True, 100),
    (4, 128, 2, 4, 64, 16, 3, True, None),
    (8, 64, 4, 2, 32, 0, 0, False, None),
    (8, 128, 8, 1, 128, 5, 2, True, 60),
    (4, 128, 8, 2, 64, 8, 0, True, None),  # 16 rows: two blocks a row tile
    (2, 64, 4, 5, 32, 0, 2, True, 70),  # 20 rows: two row tiles, the second's second block empty
    (8, 128, 12, 1, 64, 6, 0, False, None),  # 12 rows: the second block 4
]


# Keys per token (make_cache's key_axis -1) in groups of v_group channels, as the values:
# contig_decode_token_keys_kernel.
TOKEN_KEYS_DECODE_GRID = [
    (2, 64, 8, 1, 64, 16, 0, True, None),
    (2, 128, 4, 4, 32, 0, 4, False, None),  # 16 rows
    (4, 64, 2, 1, 16, 9, 0, True, 100),
    (4, 128, 8, 1, 64, 5, 2, False, 60),
    (8, 64, 1, 4, 32, 0, 0, True, None),
    (8, 128, 4, 1, 128, 16, 3, True, None),
]


def decode_case(bits, head_dim, ratio, q_len, v_group, tail, sinks, rotate, window, *, dtype, token_keys=False) -> Case:
    """A case of the DECODE_GRID (two sequences of 320 and 77 compressed tokens, keys per
    channel in groups of 64, no outliers: the cache's default format; token_keys: keys per
    token in groups of v_group channels)."""
    return Case(
        bits=bits,
        group=v_group if token_keys else 64,
        k_axis=-1 if token_keys else -2,
        ratio=ratio,
        q_len=q_len,
        head_dim=head_dim,
        comp_lens=(320, 77),
        tail=tail,
        tail_lens=[tail, tail // 2] if tail else None,
        sinks=sinks,
        rotate=rotate,
        k_outliers=0,
        v_outliers=0,
        v_group=v_group,
        window=window,
        dtype=dtype,
        seed=bits * 100 + head_dim + ratio,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grid", DECODE_GRID, ids=str)
def test_decode_kernel(dtype, grid):
    case = decode_case(*grid, dtype=dtype)
    assert decode_takes(case)
    assert "decode" in check_case(case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grid", TOKEN_KEYS_DECODE_GRID, ids=str)
def test_decode_kernel_token_keys(dtype, grid):
    case = decode_case(*grid, dtype=dtype, token_keys=True)
    assert decode_takes(case) and not mma_takes(case)
    assert "decode" in check_case(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,q_len,tail,rotate,dgq", SINK_GRID)
def test_sinks(dtype, bits, q_len, tail, rotate, dgq):
    check_case(sink_case(bits, q_len, tail, rotate, dgq, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windows_and_softcaps(dtype):
    for window in (1, 5, 32, 33, 70, 500):
        check_case(
            Case(
                comp_lens=(130, 45),
                tail=12,
                tail_lens=[12, 3],
                q_len=4,
                sinks=3,
                window=window,
                dtype=dtype,
                seed=window,
            )
        )
    for softcap in (1.0, 5.0, 50.0):
        check_case(
            Case(comp_lens=(70, 33), q_len=3, tail=8, softcap=softcap, key_scale=4.0, dtype=dtype, seed=int(softcap))
        )
    # Honoured, not ignored.
    case = Case(comp_lens=(130, 45), q_len=2, window=16, dtype=dtype)
    for kernel in ["simple"] + (["mma"] if mma_takes(case) else []):
        assert rel_err(run_cuda(case, kernel, window=None), case.reference()) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outlier_regressions_of_the_cpu_kernel(dtype):
    # Key outliers in groups spanning tiles (values read through other paths), partial key
    # groups shorter than their outlier slots, partial value groups.
    for dgq, (v_axis, v_group), k_group in itertools.product((False, True), [(-2, 64), (-1, 24), (-1, 32)], (64, 128)):
        check_case(
            Case(
                bits=4,
                group=k_group,
                k_outliers=2,
                dgq=dgq,
                v_axis=v_axis,
                v_group=v_group,
                v_outliers=1,
                comp_lens=(2 * k_group, k_group + 37),
                q_len=3,
                ratio=2,
                dtype=dtype,
                seed=k_group + v_group,
            )
        )
    for comp_lens, group, k, head_dim in [((66,), 64, 3, 64), ((0, 9), 8, 2, 16), ((130, 65), 64, 3, 32)]:
        check_case(
            Case(
                bits=4,
                group=group,
                k_outliers=k,
                comp_lens=comp_lens,
                head_dim=head_dim,
                q_len=1,
                ratio=1,
                kv_heads=1,
                dtype=dtype,
                seed=group,
            )
        )
    check_case(Case(bits=4, head_dim=48, v_group=32, v_outliers=20, comp_lens=(40, 17), q_len=2, dtype=dtype, seed=5))


@pytest.mark.parametrize("head_dim", [64, 128, 80, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_head_dims_and_dtypes(head_dim, dtype):
    rotate = head_dim & (head_dim - 1) == 0
    check_case(Case(head_dim=head_dim, dtype=dtype, q_len=2, tail=8, rotate=rotate, seed=head_dim))


def test_key_groups_not_aligned_to_tiles_and_long_split_contexts():
    # Groups of 16 (several per tile), 48 (tiles straddle groups), a context long enough for
    # many splits, and one with every token in the tail.
    for dtype in (torch.float32, torch.bfloat16):
        for group in (16, 48):
            check_case(
                Case(group=group, v_group=16, comp_lens=(300, 129), q_len=3, k_outliers=2, dtype=dtype, seed=group)
            )
        # A window starts the tiles off the group grid: five groups of 16 in one tile (past its
        # four meta slots the tensor-core kernel reloads them), DGQ segments of one granule.
        for kw in ({"group": 16}, {"dgq": True}):
            check_case(
                Case(**kw, v_group=16, comp_lens=(300, 129), q_len=3, window=70, k_outliers=2, dtype=dtype, seed=3)
            )
        check_case(Case(comp_lens=(5000,), kv_heads=1, ratio=4, q_len=3, sinks=5, tail=20, dtype=dtype, seed=8))
        check_case(Case(comp_lens=(0, 0), tail=40, q_len=3, dtype=dtype))


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(attention_case())
def test_hypothesis_against_float64_reference(kw):
    for dtype in (torch.float32, torch.bfloat16):
        check_case(Case(**kw, dtype=dtype))


# ---- special values -----------------------------------------------------------------------------


def test_zero_length_sequence_gives_zeros():
    case = Case(comp_lens=(64, 0), q_len=1)
    for kernel in ("simple",):
        out = run_cuda(case, kernel)
        assert torch.all(out[1] == 0) and rel_err(out[0], case.reference()[0]) <= 1e-4
    case = Case(comp_lens=(64, 0), q_len=1, dtype=torch.bfloat16)
    out = run_cuda(case, "mma")
    assert torch.all(out[1] == 0) and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_query_or_tail_gives_nan_rows(dtype, bad):
    case = Case(dtype=dtype, q_len=2, ratio=4, tail=8)
    case.q[0, 1, 0, 5] = bad
    case.k_tail[1, 0, 3, 2] = bad
    ok = torch.ones(case.q.shape[:3], dtype=torch.bool)
    ok[0, 1, 0] = False
    ok[1, :4] = False
    for kernel in ["simple"] + (["mma"] if mma_takes(case) else []):
        out = run_cuda(case, kernel)
        assert out[0, 1, 0].isnan().all() and out[1, :4].isnan().all(), kernel
        assert out[ok].isfinite().all(), kernel
        assert torch.equal(out.isnan(), case.run().isnan())


# ---- no synchronization, graphs, streams --------------------------------------------------------


@pytest.mark.parametrize("dgq", [False, True])
def test_a_decode_step_never_synchronizes(dgq):
    case = on_cuda(
        Case(
            comp_lens=(300, 129),
            tail=8,
            tail_lens=[8, 3],
            q_len=1,
            sinks=4,
            sink_lens=[4, 2],
            dgq=dgq,
            rotate=True,
            dtype=torch.bfloat16,
        )
    )
    x = torch.randn(2, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    case.run(), torch.ops.nexuskv.nq_compress(x, 4, 32, -2, 1, None)  # warm-up (module load, attributes)
    torch.cuda.synchronize()
    with env(NEXUSKV_CUDA_CHECKS=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            case.run()
            torch.ops.nexuskv.nq_compress(x, 4, 32, -2, 1, None)
            torch.ops.nexuskv.nq_compress(x, 4, 32, -1, 0, None)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_a_decode_step_captures_in_a_cuda_graph():
    case = on_cuda(Case(comp_lens=(300, 129), tail=8, tail_lens=[8, 3], q_len=1, dtype=torch.bfloat16))
    x = torch.randn(2, 2, 1, 64, device="cuda", dtype=torch.bfloat16)
    with env(NEXUSKV_CUDA_CHECKS=None):
        eager = case.run()
        torch.ops.nexuskv.nq_compress(x, 4, 32, -1, 0, None)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = case.run()
            parts = torch.ops.nexuskv.nq_compress(x, 4, 32, -1, 0, None)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(parts[0], torch.ops.nexuskv.nq_compress(x, 4, 32, -1, 0, None)[0])
    case.comp_lens[1] = 100  # lengths are read on the device at replay time
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, case.run())


def test_runs_on_the_current_stream():
    case = on_cuda(Case(comp_lens=(300, 129), q_len=2, dtype=torch.bfloat16))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = case.run()
    s.synchronize()
    assert torch.equal(out, case.run())


# ---- operator hygiene ---------------------------------------------------------------------------


# opcheck, torch.compile(fullgraph=True) and the inference-only guard on CUDA: the
# device-parametrized tests of test_attention.py.


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make,match", BAD_SHAPES)
def test_bad_input(make, match):
    case = on_cuda(Case(ratio=2, kv_heads=4))
    with pytest.raises(RuntimeError, match=match):
        make(case)()


@pytest.mark.parametrize("make,match,nan_rows", BAD_VALUES)
def test_bad_values_error_with_checks_and_nan_rows_without(make, match, nan_rows):
    # With NEXUSKV_CUDA_CHECKS=1 the CPU's messages; without, no synchronization: the
    # kernels read nothing out of bounds and the sequences they could not compute are NaN.
    case = on_cuda(Case(ratio=2, kv_heads=4))
    with env(NEXUSKV_CUDA_CHECKS="1"), pytest.raises(RuntimeError, match=match):
        make(case)()
    with env(NEXUSKV_CUDA_CHECKS=None):
        out = make(case)().cpu()
    for b in range(out.shape[0]):
        assert out[b].isnan().all() == (b in nan_rows), b
        if b not in nan_rows:
            assert out[b].isfinite().all()


def test_mixed_devices_are_a_clear_error():
    cpu = Case(ratio=2, kv_heads=4, tail=4)
    gpu = on_cuda(cpu)
    one_device = r"all tensors must be on one device, q is on cuda:\d but {} is on cpu"
    with pytest.raises(RuntimeError, match=one_device.format("k_cache")):
        bad(gpu, k_cache=cpu.k_cache)()
    with pytest.raises(RuntimeError, match=one_device.format("v_cache")):
        bad(gpu, v_cache=cpu.v_cache)()
    with pytest.raises(RuntimeError, match=one_device.format("k_tail")):
        bad(gpu, k_tail=cpu.k_tail, v_tail=cpu.v_tail)()
    # Lengths too: on the CPU they would cost a synchronizing copy every call.
    with pytest.raises(RuntimeError, match=one_device.format("compressed_lens")):
        bad(gpu, compressed_lens=cpu.comp_lens)()
    with pytest.raises(RuntimeError, match=one_device.format("rotation_signs")):
        bad(gpu, rotation_signs=torch.ones(64))()
    # The other way round: q on the CPU, the cache on the GPU.
    with pytest.raises(RuntimeError, match=r"all tensors must be on one device, q is on cpu but k_cache is on cuda"):
        bad(cpu, k_cache=gpu.k_cache)()
