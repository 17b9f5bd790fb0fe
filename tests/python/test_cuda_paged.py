"""paged_attention's tensor-core kernels (csrc/cuda/paged_mma.cuh; paged_decode.cuh for decode
steps) on a GPU: against the float64 reference of test_paged.py over the formats they take
(2/4/8 bits, head_dim 64 / 128, groups of 16 to 128, GQA 1 to 32, blocks of 16 to 128 tokens,
rotation, sliding windows, soft-cap), for decode, ragged chunked prefill and contexts long enough
to split the key range; against the SIMT kernel (NEXUSKV_CUDA_ATTENTION=simple) on the same pages;
and their refusals and bad input.

NEXUSKV_CUDA_ATTENTION=mma makes the operator raise when the tensor-core kernel does not take
the problem, so every comparison below knows which kernel ran.  Skipped without a GPU."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from devices import requires_cuda

pytest.importorskip("hypothesis", reason="hypothesis is not installed")  # (test_paged imports test_attention)
from test_paged import Pool, check_close, reference  # noqa: E402

from nexuskv import paged  # noqa: E402

pytestmark = requires_cuda

HALVES = [torch.float16, torch.bfloat16]


def run(pool, reqs, table, lens, qsl, q, kernel, monkeypatch, **kw):
    monkeypatch.setenv("NEXUSKV_CUDA_ATTENTION", kernel)
    out = pool.attend(q, table, lens, qsl, **kw)
    torch.cuda.synchronize()
    assert out.device.type == "cuda"
    return out.cpu()


def serve(pool, steps, q_heads, monkeypatch, seed=0, pads=None, profile=False, **kw):
    """The steps ({request: new tokens}) through the tensor-core kernel, each step's output against
    float64 and against the SIMT kernel.  pads: padding query rows after each step's tokens
    (default 2 each).  With profile, returns the tensor-core kernels' launch names per step (None
    for a step where the profiler saw no CUDA kernel at all)."""
    g = torch.Generator().manual_seed(seed)
    ids = {}  # the steps' request names -> the pool's requests
    launched = []
    for i, named in enumerate(steps):
        for r in named:
            if r not in ids:
                ids[r] = pool.add_request()
        reqs, table, lens, qsl = pool.step({ids[r]: n for r, n in named.items()})
        n = int(qsl[-1])
        pad = 2 if pads is None else pads[i]
        q = torch.randn(n + pad, q_heads, pool.D, generator=g).to(pool.dtype)  # padding rows
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if profile else None
        with prof if profile else contextlib.nullcontext():
            got = run(pool, reqs, table, lens, qsl, q, "mma", monkeypatch, **kw)
        if profile:
            names = [e.key for e in prof.key_averages()]
            launched.append([k for k in names if "paged_attention_mma_kernel" in k] if names else None)
        simt = run(pool, reqs, table, lens, qsl, q, "simple", monkeypatch, **kw)
        assert torch.equal(got[n:], torch.zeros_like(got[n:]))
        want = reference(
            pool, reqs, table, lens, qsl, q[:n], q_heads, kw.get("scale", 0.125), kw.get("window"), kw.get("softcap")
        )
        vmax = max(float(pool.v[r].abs().max()) for r in reqs) * 1.5
        check_close(got[:n], want, pool.dtype, vmax)
        check_close(simt[:n], want, pool.dtype, vmax)
    return launched


def row_tiles(names):
    """The query rows per block (8 kNT) of the paged tensor-core kernels launched, from the
    profiler's names (paged_attention_mma_kernel<X, bits, D, groups, kNT>, demangled or not)."""
    pattern = re.compile(r"paged_attention_mma_kernel(?:<.*, (\d+)>|I\w*ELi(\d+)EEEv)")
    return {8 * int(m.group(1) or m.group(2)) for k in names for m in [pattern.search(k)] if m}


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("D,G", [(64, 64), (128, 64), (64, 16), (128, 32), (64, 128), (128, 128)])
def test_formats_against_float64(dtype, bits, D, G, monkeypatch):
    fmt = paged.PagedFormat(bits, bits, G, 0, rotate=True, seed=bits)
    pool = Pool(fmt, kv_heads=2, D=D, P=16, num_blocks=64, dtype=dtype, device="cuda", seed=D + G)
    # Prefill of two ragged requests, chunked prefill beside decode, decode.
    serve(
        pool, [{0: 70, 1: 9}, {0: 1, 1: 40, 2: 23}, {0: 1, 1: 1, 2: 1}], q_heads=8, monkeypatch=monkeypatch, scale=0.125
    )


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("bits,D,G", [(2, 128, 64), (4, 64, 64), (4, 128, 32), (8, 128, 128)])
@pytest.mark.parametrize("q_heads", [2, 8, 16, 18])  # GQA 1, 4, 8: decode steps in 8-row tiles; 9: 16 rows
def test_decode_steps_take_8_row_tiles(dtype, bits, D, G, q_heads, monkeypatch):
    """A step of one token a request and no padding (num_tokens == num_reqs, core::paged_tile_rows)
    with a GQA group of at most 8 runs the kernel of one 8-row n-tile; so does a step of as many
    tokens as requests where one request has 2 tokens and one none (its tokens take two row
    tiles).  A prefill, or padding rows, take 16-row tiles, and with a group of at most 8 the
    8-row kernel beside them for the requests of one token (PagedAttentionPlan::singles_apart:
    launched whether or not the step has one).  Every step against float64 and SIMT."""
    fmt = paged.PagedFormat(bits, bits, G, 0, rotate=True, seed=bits)
    pool = Pool(fmt, kv_heads=2, D=D, P=16, num_blocks=64, dtype=dtype, device="cuda", seed=q_heads)
    steps = [{0: 90, 1: 33, 2: 5}, {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}, {0: 2, 1: 0, 2: 1}, {0: 1, 1: 1, 2: 1}]
    launched = serve(pool, steps, q_heads, monkeypatch, pads=[0, 0, 0, 0, 2], profile=True, scale=0.125)
    if launched[0] is None:
        pytest.skip("the profiler saw no CUDA kernel: which row tiles ran is unknown (the outputs were checked)")
    decode, other = ({8}, {8, 16}) if q_heads // 2 <= 8 else ({16}, {16})
    assert [row_tiles(names) for names in launched] == [other, decode, decode, decode, other]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("window,softcap", [(None, None), (100, None), (None, 30.0)])
def test_decode_kernel_over_long_contexts(bits, window, softcap, monkeypatch):
    """Decode steps without padding (paged_decode.cuh: each warp its own 16-key chunks) over
    contexts of ~1.2K and ~0.7K tokens whose values grow 1000-fold along the context, so that the
    value normalizer moves and the warps' accumulators are rescaled by it; with a sliding window
    or a soft-cap; against float64 and SIMT."""
    fmt = paged.PagedFormat(bits, bits, 64, 0, rotate=True)
    pool = Pool(fmt, kv_heads=2, D=128, P=32, num_blocks=80, dtype=torch.float16, device="cuda", seed=bits)
    new_kv = pool.new_kv

    def growing(n, outlier_channel=None):
        k, v = new_kv(n, outlier_channel)
        return k, (v.float() * torch.logspace(-1.5, 1.5, n)[:, None, None]).to(pool.dtype)

    pool.new_kv = growing
    steps = [{0: 1200, 1: 700}, {0: 1, 1: 1}, {0: 1, 1: 1}]
    launched = serve(
        pool, steps, 8, monkeypatch, pads=[0, 0, 0], profile=True, scale=0.1, window=window, softcap=softcap
    )
    if launched[0] is not None:  # (the prefill: 16-row tiles, and the 8-row kernel's launch for one-token requests)
        assert [row_tiles(names) for names in launched] == [{8, 16}, {8}, {8}]


@pytest.mark.parametrize("q_heads", [2, 4, 8, 24, 48, 64])  # GQA 1, 2, 4, 12, 24 (chunks of 16 + 8), 32
@pytest.mark.parametrize("P", [16, 32, 128])
def test_gqa_groups_and_block_sizes(q_heads, P, monkeypatch):
    fmt = paged.PagedFormat(4, 4, 64, 0, rotate=True)
    pool = Pool(fmt, kv_heads=2, D=128, P=P, num_blocks=24, dtype=torch.bfloat16, device="cuda", seed=P)
    serve(pool, [{0: 37, 1: 5}, {0: 17, 1: 1}, {0: 1, 1: 1}], q_heads=q_heads, monkeypatch=monkeypatch, scale=0.1)


@pytest.mark.parametrize("window,softcap", [(19, None), (None, 30.0), (70, 20.0), (2**40, None)])  # 2^40: no key hidden
def test_sliding_window_and_softcap(window, softcap, monkeypatch):
    fmt = paged.PagedFormat(4, 4, 64, 0, rotate=False)
    pool = Pool(fmt, kv_heads=1, D=64, P=16, num_blocks=32, dtype=torch.float16, device="cuda", seed=3)
    serve(
        pool,
        [{0: 150, 1: 33}, {0: 1, 1: 60}, {0: 1, 1: 1}],
        q_heads=4,
        monkeypatch=monkeypatch,
        scale=0.125,
        window=window,
        softcap=softcap,
    )


@pytest.mark.parametrize("bits", [2, 4])
def test_long_contexts_split_the_key_range(bits, monkeypatch):
    """2K-token contexts, decoded at batch 1 and 2 (a block table of 128 columns at units of 2
    blocks: 8 splits of 256 keys, the merge combines them), and prefilled beside decode."""
    fmt = paged.PagedFormat(bits, bits, 64, 0, rotate=True)
    pool = Pool(fmt, kv_heads=2, D=128, P=16, num_blocks=260, dtype=torch.bfloat16, device="cuda", seed=9)
    serve(pool, [{0: 2000}, {0: 1}, {0: 1, 1: 1500}, {0: 1, 1: 1}], q_heads=8, monkeypatch=monkeypatch, scale=0.09)


def test_refuses_formats_it_does_not_take(monkeypatch):
    for fmt, dtype in [
        (paged.PagedFormat(4, 4, 64, 1), torch.bfloat16),  # outliers
        (paged.PagedFormat(8, 4, 64, 0), torch.bfloat16),  # different bits
        (paged.PagedFormat(4, 4, 64, 0, exact_window=8), torch.bfloat16),
        (paged.PagedFormat(4, 4, 64, 0), torch.float32),
        (paged.PagedFormat(4, 4, 48, 0), torch.bfloat16),  # groups of 48 do not divide 64 channels
    ]:
        pool = Pool(fmt, kv_heads=1, D=64, P=16, num_blocks=8, dtype=dtype, device="cuda")
        reqs, table, lens, qsl = pool.step({pool.add_request(): 5})
        q = torch.randn(5, 2, 64).to(dtype)
        with pytest.raises(RuntimeError, match="tensor-core kernel does not take this problem"):
            run(pool, reqs, table, lens, qsl, q, "mma", monkeypatch)
        assert torch.isfinite(run(pool, reqs, table, lens, qsl, q, "simple", monkeypatch)).all()


def test_invalid_lengths_make_rows_nan(monkeypatch):
    fmt = paged.PagedFormat(4, 4, 64, 0)
    pool = Pool(fmt, kv_heads=1, D=64, P=16, num_blocks=8, dtype=torch.float16, device="cuda")
    reqs, table, lens, qsl = pool.step({pool.add_request(): 5, pool.add_request(): 3})
    q = torch.randn(8, 2, 64).half()
    bad_len = lens.clone()
    bad_len[1] = 2  # shorter than its 3 queries
    out = run(pool, reqs, table, bad_len, qsl, q, "mma", monkeypatch)
    assert torch.isfinite(out[:5]).all() and torch.isnan(out[5:8]).all()
    bad_qsl = torch.tensor([0, 6, 5], dtype=torch.int32)  # decreasing
    assert torch.isnan(run(pool, reqs, table, lens, bad_qsl, q, "mma", monkeypatch)).all()
