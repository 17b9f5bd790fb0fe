"""benchmarks/knob_study.py measures knobs on a simulation of nexuskv's cache; these tests hold
the simulation to the cache: one forward through the study's attention gives the log-probs that
decoding token by token with the real cache gives (tiny models, full and sliding layers, sinks,
tails), its quantizer at uniform levels is nq_compress's, Lloyd-Max lowers the error it fits,
and outliers by fraction keep the count asked for."""

import argparse
import importlib.util
import pathlib
import sys

import pytest
import torch

from hf_helpers import tiny_model
from nexuskv import eval_caches as ec

SPEC = importlib.util.spec_from_file_location(
    "knob_study", pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "knob_study.py"
)
ks = importlib.util.module_from_spec(SPEC)
sys.modules["knob_study"] = ks  # dataclasses look their module up
SPEC.loader.exec_module(ks)


@pytest.mark.parametrize("axis", [-2, -1])
@pytest.mark.parametrize("bits", [2, 4])
def test_study_quantizer_at_uniform_levels_is_nqs(bits, axis):
    """min/max ranges: the same levels as nq_compress, up to where each rounds its bf16 scale
    (the study keeps the range, nq the step): within 1 % of a group's range, but for entries
    near a midpoint between two levels, which may round to the neighbour (one step off)."""
    torch.manual_seed(bits)
    x = torch.randn(2, 64, 32) * torch.linspace(0.5, 4, 32)
    g = ks._groups(x, axis, 16)
    mine = ks._ungroup(ks.quantize_levels(g, ks.uniform_levels(bits).view(1, 1, -1), fit=False), x.shape, axis, 16)
    theirs = ks.nq_roundtrip(x, bits, 16, axis, fit=False)
    span = ks._ungroup((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)).expand_as(g), x.shape, axis, 16)
    diff, step = (mine - theirs).abs(), span / (2**bits - 1)
    assert (diff <= 0.01 * span).float().mean() > 0.95 and (diff <= step + 0.01 * span).all()
    # the groups are what the names say: per channel over 16 tokens, or per token over 16 channels
    assert torch.equal(ks._ungroup(g, x.shape, axis, 16), x)
    assert torch.equal(g[0, 0], x[0, :16, 0] if axis == -2 else x[0, 0, :16])


def test_study_fit_lowers_the_squared_error():
    torch.manual_seed(0)
    g = torch.randn(1, 256, 64).pow(3)  # heavy tails: min/max wastes levels
    levels = ks.uniform_levels(2).view(1, 1, -1)
    err = {fit: (ks.quantize_levels(g, levels, fit) - g).pow(2).sum() for fit in (False, True)}
    assert err[True] < 0.8 * err[False]


def test_lloyd_fits_its_data_and_pins_the_ends():
    torch.manual_seed(0)
    u = torch.distributions.Beta(0.7, 3.0).sample((200_000,))  # skewed towards 0
    for bits in (2, 3):
        free, pinned, uniform = ks.lloyd(u, bits), ks.lloyd(u, bits, pinned=True), ks.uniform_levels(bits)

        def mse(lv):
            return (u[:, None] - lv[None]).abs().min(1).values.pow(2).mean()

        assert mse(free) < 0.7 * mse(uniform) and mse(pinned) < mse(uniform)
        assert pinned[0] == 0 and pinned[-1] == 1 and torch.all(pinned[1:] > pinned[:-1])
    two = torch.cat([torch.full((1000,), 0.25), torch.full((1000,), 0.75)])
    fitted = ks.lloyd(two, 2, bins=4096)  # two levels move onto the two masses (the others hold none)
    assert all((fitted - m).abs().min() < 1e-3 for m in (0.25, 0.75))


def test_outliers_by_fraction_keep_that_many_exact():
    torch.manual_seed(0)
    g = torch.randn(2, 40, 64)
    g[0, 3, 5] = 50.0
    mask = ks.outlier_mask(g, 0.01)
    assert mask.sum(dim=(1, 2)).tolist() == [round(0.01 * 40 * 64)] * 2 and mask[0, 3, 5]
    out = ks.quantize_levels(g, ks.uniform_levels(2).view(1, 1, -1), fit=False, exact=mask)
    assert torch.equal(out[mask], g[mask].to(torch.bfloat16).float())
    # the group's range leaves the outlier out: its other entries lose far less
    plain = ks.quantize_levels(g, ks.uniform_levels(2).view(1, 1, -1), fit=False)
    assert (out[0, 3] - g[0, 3])[~mask[0, 3]].abs().max() < 0.2 * (plain[0, 3] - g[0, 3]).abs().max()


@pytest.mark.parametrize("arch, rotate", [("llama", False), ("gemma3", False), ("llama", True)])
def test_one_study_forward_is_decoding_with_the_cache(arch, rotate):
    """Per-token log-probs of one forward through the study's attention (uniform row: nq's own
    codes) against the model decoding the same tokens one at a time through nexuskv's cache
    with the same policy (4 sinks, tail 8, key groups of 16 tokens; gemma3: sliding layers with
    no tail and no sinks): equal up to float error, and far from the exact model's.  rotate:
    the study's Hadamard rows (K and V quantized in the cache's own Hadamard basis) against the cache's
    rotate=True."""
    model = tiny_model(arch).float()
    args = argparse.Namespace(sinks=4, residual=8, window_residual=0, group=16, prerope_codebooks=False, seed=0)
    setting = ec.nexuskv(
        4, 8, group_size=16, value_group_size=16, sinks=4, fit_range=True, window_residual=0, rotate=rotate
    )
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (1, 96))
    with torch.inference_mode():
        exact = torch.log_softmax(model(ids, use_cache=False).logits.float()[0], -1)
    cache = ec.make_cache(model, setting)
    steps = []
    with ec.attention_for(model, setting), torch.inference_mode():
        for t in range(ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits.float()[0, -1])
    decoded = torch.log_softmax(torch.stack(steps), -1)
    assert int(cache.layers[0].cache.compressed_lengths()[0]) > 0
    study = ks.Study(model, args)
    restore = ks.install(study, model)
    try:
        how = "hadamard" if rotate else None
        study.row = ks.Row("4-bit uniform", 4, rotation=how, rotate_values=how)
        with torch.inference_mode():
            simulated = torch.log_softmax(model(ids, use_cache=False).logits.float()[0], -1)
        assert study.calls > 0
        study.row = None
        with torch.inference_mode():
            plain = torch.log_softmax(model(ids, use_cache=False).logits.float()[0], -1)
    finally:
        restore()
    assert (plain - exact).abs().max() < 1e-4  # the study's exact attention is the model's
    gap = (decoded - exact).abs().max()
    assert gap > 1e-4  # the cache compressed something that mattered
    assert (simulated - decoded).abs().max() < 0.01 * gap


@pytest.mark.parametrize("window", [None, 32])
@pytest.mark.parametrize("fit", [False, True])
def test_the_study_hadamard_rows_store_what_rotate_true_stores(window, fit):
    """The study's Hadamard rows quantize K and V as the cache with rotate=True stores them: fed
    the same K/V token by token (GQA heads, no tail, a sliding window or none), the cache's
    dequantized chunks equal the study's rotated quantization exactly.  (Through a model the
    comparison cannot be exact: a token's K/V computed alone and in a whole forward differ in
    the last bits, which can move a code; the unrotated model test bounds that.)"""
    from nexuskv import hf

    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, 2, 48, 16, generator=g), torch.randn(1, 2, 48, 16, generator=g)
    cache = hf._make_cache(
        hf._layer_settings(
            4, group_size=16, residual=0, rotate=True, meta_dtype=torch.bfloat16, window=window, fit_range=fit
        )
    )
    for t in range(40):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    kd, vd, _ = cache.dense()
    assert int(cache.compressed_lengths()[0]) == 32
    study = ks.Study(None, argparse.Namespace(group=16, seed=0))
    row = ks.Row("4-bit", 4, fit=fit, rotation="hadamard", rotate_values="hadamard")
    assert torch.equal(kd[0, :, :32], study.rotated_quantize(0, k[0, :, :32], "k", row, "hadamard"))
    assert torch.equal(vd[0, :, :32], study.rotated_quantize(0, v[0, :, :32], "v", row, "hadamard"))
    assert not torch.equal(kd[0, :, :32], study.rotated_quantize(0, k[0, :, :32], "k", row, None))


def test_the_fitted_rotation_is_the_covariance_eigenbasis():
    """fit_rotations: per layer, K / V and kv head an orthogonal [D, D] whose columns are the
    calibration data's principal axes (largest variance first); quantizing in the rotated basis
    and rotating back keeps the codes' precision."""
    args = argparse.Namespace(sinks=0, residual=0, window_residual=0, group=16, prerope_codebooks=False, seed=0)
    study = ks.Study(None, args)
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(16, 16, generator=g))[0]
    scales = torch.logspace(1, -1, 16)
    k = (torch.randn(2, 256, 16, generator=g) * scales) @ basis.T  # variance along basis' columns
    v = torch.randn(2, 256, 16, generator=g)
    ks.fit_rotations(study, {0: [(k, v, None, None)]})
    r = study.rotations[(0, "k", "klt")]
    assert r.shape == (2, 16, 16)
    assert torch.allclose(r.transpose(-1, -2) @ r, torch.eye(16).expand(2, 16, 16), atol=1e-5)
    assert (r[0, :, 0] @ basis[:, 0]).abs() > 0.99  # the first axis is the largest-variance one
    # quantized in the rotated basis and rotated back: 8-bit codes keep x to 8-bit precision, and
    # the codes are per channel of the rotated keys (the KLT's first channel spans the widest range)
    x = k[:, :32]
    back = study.rotated_quantize(0, x, "k", ks.Row("8-bit", 8, fit=False), "klt")
    assert (back - x).abs().max() < 2 * float((x @ r).abs().amax()) / 255
    coarse = study.rotated_quantize(0, x, "k", ks.Row("2-bit", 2, fit=False), "klt")
    assert (coarse - x).abs().max() > 10 * (back - x).abs().max()


@pytest.mark.parametrize("fit", [False, True])
def test_key_smoothing_is_a_no_op_for_per_channel_keys(fit):
    """Issue 21's per-channel key smoothing (keys' channel c divided by s_c, queries' multiplied:
    q.k exact) changes nothing in nexuskv's format: keys are quantized per channel, so a channel's
    scale and zero scale with it and its codes stay (min/max or fitted ranges alike).  With
    power-of-two factors (exact in bf16 scales and zeros) the dequantized keys are exactly s_c
    times the plain ones, hence every score the same."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 128, 64, generator=g) * torch.linspace(0.1, 8, 64)
    s = 2.0 ** torch.randint(-3, 4, (64,), generator=g).float()
    plain = ks.nq_roundtrip(k, 2, 64, -2, fit)
    smoothed = ks.nq_roundtrip(k * s, 2, 64, -2, fit)
    assert torch.equal(smoothed, plain * s)
    q = torch.randn(2, 5, 64, generator=g)
    torch.testing.assert_close((q / s) @ smoothed.transpose(1, 2), q @ plain.transpose(1, 2), rtol=1e-6, atol=1e-5)


def test_the_policy_rule_is_the_caches():
    for pol in (ks.Policy(4, 60, 64), ks.Policy(0, 0, 16), ks.Policy(4, 8, 16)):
        ks.check_policy(pol, pol.chunk, upto=200)  # exits on a mismatch

    class OneLate(ks.Policy):  # a rule one token off is caught
        def compressed(self, length: int) -> int:
            return super().compressed(length - 1)

    with pytest.raises(SystemExit, match="the policy rule says"):
        ks.check_policy(OneLate(4, 8, 16), 16, upto=200)
