"""Fitted ranges (nq_compress(..., fit_range=True), nq_format.h "Fitted ranges"): against a
float64 check of what the format promises (outliers chosen as min/max chooses them, every
dense entry decoded to the nearest of its group's 2^bits levels with the STORED scale and
zero, no group with more squared error than min/max's, far less on bell-shaped data), the
same bytes, through DGQ, the C++ cache (state dict, fused attention), cache_for and the
eval's settings."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import nexuskv
from nexuskv import dgq_compress, dgq_decompress, nq_compress, nq_decompress
from nexuskv.cache import from_state_dict, make_cache
from nq_reference import F64, ceil_div, from_groups, per_element

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Squared-error ratio fit / min-max that a fit must reach on normal data at groups of 64
# (measured 2 bits 0.53-0.57, 3 bits 0.80-0.81, 4 bits 0.88-0.89; min/max gives 1.0).
MOST = {2: 0.65, 3: 0.88, 4: 0.95}


def dense_mask(idx: torch.Tensor, T: int, D: int, G: int, axis: int) -> torch.Tensor:
    """[N, T, D] True where an entry is not one of its group's outliers (idx [N, A, B, k])."""
    N, A, B, k = idx.shape
    out = torch.zeros(N, A, B, G, dtype=torch.bool)
    if k:
        out.scatter_(3, idx.long(), True)
    return ~from_groups(out, T, D, axis)


def check_fitted(
    x: torch.Tensor, bits: int, G: int, axis: int, k: int, meta=None, fit_parts=None, mm_parts=None, segment_starts=None
):
    """The float64 check of one fitted compression against min/max's; returns the squared errors
    (fit, min/max) of the dense entries."""
    *lead, T, D = x.shape
    N = math.prod(lead)
    qmax = 2**bits - 1
    if fit_parts is None:
        fit_parts = nq_compress(x, bits, G, axis, k, meta, True)
        mm_parts = nq_compress(x, bits, G, axis, k, meta, False)
        y_fit = nq_decompress(*fit_parts, bits, G, axis, D, torch.float32)
        y_mm = nq_decompress(*mm_parts, bits, G, axis, D, torch.float32)
    else:
        y_fit = dgq_decompress(*fit_parts, bits, G, D, torch.float32)
        y_mm = dgq_decompress(*mm_parts, bits, G, D, torch.float32)
    # same outliers, same bytes
    assert torch.equal(fit_parts.outlier_idx, mm_parts.outlier_idx)
    assert torch.equal(fit_parts.outlier_val, mm_parts.outlier_val)
    for a, b in zip(fit_parts, mm_parts):
        assert a.shape == b.shape and a.dtype == b.dtype
    x64 = x.reshape(N, T, D).to(F64)
    y_fit, y_mm = y_fit.reshape(N, T, D).to(F64), y_mm.reshape(N, T, D).to(F64)
    if segment_starts is None:
        A, B = (ceil_div(T, G), D) if axis == -2 else (T, ceil_div(D, G))
        s = per_element(fit_parts.scale.reshape(N, A, B).to(F64), T, D, G, axis)
        z = per_element(fit_parts.zero.reshape(N, A, B).to(F64), T, D, G, axis)
        dense = dense_mask(fit_parts.outlier_idx.reshape(N, A, B, k), T, D, G, axis)
        group = per_element(torch.arange(N * A * B, dtype=F64).reshape(N, A, B), T, D, G, axis).long()
    else:  # DGQ: token segments per channel
        starts = segment_starts.reshape(N, -1).long()
        seg = torch.stack([torch.searchsorted(starts[n], torch.arange(T), right=True) - 1 for n in range(N)])
        S = starts.shape[1]
        sc, ze = fit_parts.scale.reshape(N, S, D).to(F64), fit_parts.zero.reshape(N, S, D).to(F64)
        s = torch.gather(sc, 1, seg[:, :, None].expand(N, T, D))
        z = torch.gather(ze, 1, seg[:, :, None].expand(N, T, D))
        dense = torch.ones(N, T, D, dtype=torch.bool)
        group = (torch.arange(N)[:, None, None] * S + seg[:, :, None]) * D + torch.arange(D)[None, None, :]
    assert torch.isfinite(s).all() and torch.isfinite(z).all() and (s >= 0).all()
    levels = z[..., None] + torch.arange(qmax + 1, dtype=F64) * s[..., None]
    nearest = (x64[..., None] - levels).abs().amin(-1)
    err = (x64 - y_fit).abs()
    eps = 4 * 1.2e-7 * (x64.abs() + z.abs() + qmax * s)  # float32 code and code * s + z
    bad = dense & (err > nearest + eps)
    worst = float((err - nearest)[bad].max()) if bad.any() else 0.0
    assert not bad.any(), f"{int(bad.sum())} entries not at their nearest level, worst by {worst}"
    assert torch.equal(y_fit[~dense], x64[~dense])  # outliers exact
    se_fit = torch.where(dense, (x64 - y_fit) ** 2, 0.0)
    se_mm = torch.where(dense, (x64 - y_mm) ** 2, 0.0)
    n_groups = int(group.max()) + 1
    g_fit = torch.zeros(n_groups, dtype=F64).index_add_(0, group.reshape(-1), se_fit.reshape(-1))
    g_mm = torch.zeros(n_groups, dtype=F64).index_add_(0, group.reshape(-1), se_mm.reshape(-1))
    assert (g_fit <= g_mm * (1 + 1e-5) + 1e-30).all(), "a group has more squared error than min/max's"
    return float(g_fit.sum()), float(g_mm.sum())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis", [-2, -1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [0, 2])
def test_fitted_ranges_against_float64(bits, axis, dtype, k):
    g = torch.Generator().manual_seed(bits * 100 + axis * 10 + k)
    x = (0.5 + 3 * torch.randn(2, 3, 133, 80, generator=g)).to(dtype)  # partial groups on both axes
    fit, mm = check_fitted(x, bits, 64, axis, k)
    if bits in MOST:
        assert fit < MOST[bits] * mm, (fit, mm)


@pytest.mark.parametrize("meta", [torch.float32, torch.bfloat16, torch.float16])
def test_fitted_ranges_with_a_meta_dtype(meta):
    x = torch.randn(4, 256, 64) * 2
    fit, mm = check_fitted(x, 2, 64, -2, 1, meta)
    assert fit < MOST[2] * mm


def test_fitted_ranges_non_contiguous_and_constant_groups():
    x = torch.randn(2, 128, 4, 64).transpose(1, 2)  # a non-contiguous view
    check_fitted(x, 3, 32, -2, 0)
    for a, b in zip(nq_compress(x, 3, 32, -2, 0, None, True), nq_compress(x.contiguous(), 3, 32, -2, 0, None, True)):
        assert torch.equal(a, b)
    c = torch.full((1, 64, 64), -1.25)
    p = nq_compress(c, 2, 32, -1, 0, None, True)
    assert torch.equal(nq_decompress(*p, 2, 32, -1, 64), c)


def test_dgq_fitted_ranges():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, 300, 64, generator=g) * torch.linspace(0.2, 4, 300)[:, None]  # ranges that change
    fit, mm = dgq_compress(x, 2, 64, fit_range=True), dgq_compress(x, 2, 64)
    assert torch.equal(fit.segment_starts, mm.segment_starts)
    f, m = check_fitted(x, 2, 64, -2, 0, fit_parts=fit, mm_parts=mm, segment_starts=fit.segment_starts)
    assert f < MOST[2] * m


def test_fit_range_is_checked_and_traced():
    x = torch.randn(2, 64, 32)
    with pytest.raises(TypeError, match="fit_range must be a bool"):
        nq_compress(x, 4, 32, -2, 0, None, 1)
    with pytest.raises(TypeError, match="fit_range must be a bool"):
        dgq_compress(x, 4, 32, fit_range="yes")
    torch.library.opcheck(torch.ops.nexuskv.nq_compress.default, (x, 2, 32, -1, 1, torch.bfloat16, True))
    torch.library.opcheck(torch.ops.nexuskv.dgq_compress.default, (x, 2, 32, 16, None, 0, None, True))


def test_nq_compressor_objects_carry_fit_range():
    x = torch.randn(2, 64, 64)
    nq = nexuskv.NQ.for_keys(2, 32, fit_range=True)
    c = nq.compress(x)
    assert torch.equal(nq.decompress(c), nq_decompress(*nq_compress(x, 2, 32, -2, 0, None, True), 2, 32, -2, 64))
    assert "fit" in nq.describe() and "fit" not in nexuskv.NQ.for_keys(2, 32).describe()
    assert nq.nbytes(c) == nexuskv.NQ.for_keys(2, 32).nbytes(nexuskv.NQ.for_keys(2, 32).compress(x))


def two_bit_cache(fit: bool):
    """2-bit keys and values in groups of 32, a 16-token tail; both fitted or neither."""
    kw = dict(key_bits=2, key_group_size=32, value_bits=2, value_group_size=32, residual=16)
    return make_cache(**kw, key_fit_range=fit, value_fit_range=fit)


def test_cache_compresses_with_fitted_ranges_and_attends_over_them():
    from test_cache import attention_f64

    torch.manual_seed(0)
    B, H, D = 2, 2, 64
    k, v = torch.randn(B, H, 100, D), torch.randn(B, H, 100, D)
    caches = {fit: two_bit_cache(fit) for fit in (False, True)}
    err = {}
    for fit, cache in caches.items():
        cache.append(k, v, None)
        assert int(cache.compressed_lengths()[0]) > 0
        kd, vd, lens = cache.dense(torch.float32)
        err[fit] = float(((kd - k) ** 2).sum() + ((vd - v) ** 2).sum())
        q = torch.randn(B, 4, 1, D)
        ref = attention_f64(q, kd, vd, lens, D**-0.5)
        assert float((cache.attend(q, None).double() - ref).norm() / ref.norm()) < 1e-4
    assert err[True] < MOST[2] * err[False]
    # the cache's compressed keys are nq_compress(fit_range=True) of the same chunk
    n = int(caches[True].compressed_lengths()[0])
    kd = caches[True].dense(torch.float32)[0][:, :, :n]
    assert torch.equal(kd, nq_decompress(*nq_compress(k[:, :, :n], 2, 32, -2, 0, None, True), 2, 32, -2, D))


def test_state_dict_keeps_fitted_ranges_and_older_states_load():
    torch.manual_seed(1)
    k, v = torch.randn(1, 2, 70, 64), torch.randn(1, 2, 70, 64)
    more = torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 64)
    cache = two_bit_cache(True)
    cache.append(k, v, None)
    state = cache.state_dict()
    assert int(state["config.key_fit_range"]) == 1 and int(state["config.value_fit_range"]) == 1
    restored = from_state_dict(state)
    for c in (cache, restored):
        c.append(*more, None)
    for a, b in zip(cache.dense(None), restored.dense(None)):
        assert torch.equal(a, b)
    # a state written before fitted ranges existed (no entries): min/max from then on
    old = from_state_dict({key: t for key, t in state.items() if "fit_range" not in key})
    n0 = int(old.compressed_lengths()[0])
    old.append(*more, None)
    n1 = int(old.compressed_lengths()[0])
    assert n0 % 32 == 0 and n1 > n0  # whole key groups compressed after the load
    ks = torch.cat([k, more[0]], 2)[:, :, n0:n1]
    for fit in (False, True):
        want = nq_decompress(*nq_compress(ks, 2, 32, -2, 0, None, fit), 2, 32, -2, 64)
        assert torch.equal(old.dense(None)[0][:, :, n0:n1], want) != fit


def test_cache_for_and_eval_settings_take_fit_range():
    from hf_helpers import tiny_model
    from nexuskv import eval_caches as ec
    from nexuskv import hf

    def fits(layer):  # (keys, values) of the layer's C++ cache, from its saved config
        state = layer.cache.state_dict()
        return tuple(int(state.get(f"config.{t}_fit_range", torch.tensor(0))) == 1 for t in ("key", "value"))

    model = tiny_model("llama")
    cache = hf.cache_for(model, bits=2, fit_range=True, sinks=4)
    assert all(fits(layer) == (True, False) for layer in cache.layers)
    assert fits(hf.cache_for(model, bits=2, fit_range=False).layers[0]) == (False, False)
    assert fits(hf.cache_for(model, bits=2, value_fit_range=True, fit_range=False).layers[0]) == (False, True)
    # the default: fitted keys whenever the cache keeps sinks (it does by default), min/max without them
    assert fits(hf.cache_for(model, bits=2).layers[0]) == (True, False)
    assert fits(hf.cache_for(model, bits=2, sinks=0).layers[0]) == (False, False)
    assert hf.cache_for(model, static=True, max_cache_len=64) is not None  # no sinks there, no fit
    # a model whose layers all slide keeps no sinks, so no fit by default either
    sliding = tiny_model("mistral")
    assert all(g.window is not None for g in hf.hf_compat.layer_geometries(sliding))
    assert fits(hf.cache_for(sliding, bits=2).layers[0]) == (False, False)
    assert hf._default_fit_range(model, hf.hf_compat.layer_geometries(model), 4, False)
    elsewhere = tiny_model("llama").to("meta")  # not on the CPU: the fit's CUDA kernel is untested on a GPU
    assert not hf._default_fit_range(elsewhere, hf.hf_compat.layer_geometries(model), 4, False)
    with pytest.raises(TypeError, match="fit_range must be a bool"):
        hf.cache_for(model, fit_range=1)
    with pytest.raises(TypeError, match="value_fit_range must be a bool"):
        hf.cache_for(model, value_fit_range=1)
    with pytest.raises(ValueError, match="fit_range"):
        hf.cache_for(model, static=True, max_cache_len=64, fit_range=True)
    fused = hf.cache_for(
        model, compressor=nexuskv.NQ.for_keys(2, 64, fit_range=True), value_compressor=nexuskv.NQ.for_values(2, 64)
    )
    assert fits(fused.layers[0]) == (True, False)
    s = ec.with_knobs(2, ["sinks", "fit"], group_size=128)
    assert s.fit_range and s.name.endswith("sinks 4 K fit") and s.knobs == ("sinks", "fit")
    assert fits(ec.make_cache(model, s).layers[0]) == (True, False)
    both = dataclasses.replace(s, value_fit_range=True)
    assert both.name.endswith("K fit V fit") and fits(ec.make_cache(model, both).layers[0]) == (True, True)
