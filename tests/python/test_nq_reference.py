"""nq_compress / nq_decompress against the independent float64 reference of
nq_reference.py (written from the format documentation alone)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nexuskv
from nexuskv import nq_compress, nq_decompress
from nq_reference import (
    F64,
    ceil_div,
    chunk_geometry,
    from_groups,
    per_element,
    reference_params,
    reference_unpack,
    to_groups,
    ulp,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = (2, 3, 4, 8)
AXES = (-2, -1)


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------


def check_against_reference(x, bits, G, axis, k, meta_dtype=None, out_dtype=None):
    meta = meta_dtype or x.dtype
    qmax = 2**bits - 1
    *lead, T, D = x.shape
    N = math.prod(lead)
    p = nq_compress(x, bits, G, axis, k, meta_dtype)
    y = nq_decompress(*p, bits, G, axis, D, out_dtype)
    out = out_dtype or x.dtype
    A, B = (ceil_div(T, G), D) if axis == -2 else (T, ceil_div(D, G))

    # Shapes and dtypes of the five buffers.
    cc, cb = chunk_geometry(bits)
    assert p.codes.shape == (*lead, T, ceil_div(D, cc) * cb) and p.codes.dtype == torch.uint8
    assert p.scale.shape == (*lead, A, B) and p.scale.dtype == meta
    assert p.zero.shape == (*lead, A, B) and p.zero.dtype == meta
    assert p.outlier_idx.shape == (*lead, A, B, k) and p.outlier_idx.dtype == torch.uint8
    assert p.outlier_val.shape == (*lead, A, B, k) and p.outlier_val.dtype == x.dtype
    assert y.shape == x.shape and y.dtype == out

    x3 = x.reshape(N, T, D)
    ref = reference_params(x3, bits, G, axis, k, meta)
    scale = p.scale.reshape(N, A, B)
    zero = p.zero.reshape(N, A, B)
    idx = p.outlier_idx.reshape(N, A, B, k).to(torch.int64)
    val = p.outlier_val.reshape(N, A, B, k)

    # (b) metadata.  zero is the dense minimum (an input value, exact in float32 and float64
    # alike) rounded down: bit-exact.  scale: the op forms (max - zero)/qmax with two float32
    # roundings before rounding up into the meta dtype; the reference does it exactly in
    # float64.  For a 16-bit meta dtype the float32 error (~2^-23 relative) can only move the
    # value across one 16-bit boundary: at most 1 ulp.  For float32 meta the directed rounding
    # is a no-op on the float32 quotient, whose two round-to-nearest steps each err by at most
    # half an ulp: at most 1 ulp of float32 either way.
    assert torch.equal(idx, ref["pos"]), "outlier positions differ from the reference choice"
    assert torch.equal(zero.to(F64), ref["zero"].to(F64)), "zero is not min rounded down to the meta dtype"
    s_op, s_ref = scale.to(F64), ref["scale"].to(F64)
    one_up = torch.nextafter(ref["scale"], torch.full_like(ref["scale"], math.inf)).to(F64)
    one_dn = torch.nextafter(ref["scale"], torch.full_like(ref["scale"], -math.inf)).to(F64)
    ok = (s_op == s_ref) | (s_op == one_up) | (s_op == one_dn)
    assert ok.all(), f"scale off by more than 1 ulp: op {s_op[~ok][:4]} ref {s_ref[~ok][:4]}"
    assert (s_op >= 0).all()

    # Outliers: values stored exactly (bitwise, input dtype) at the recorded positions.
    xg = to_groups(x3, G, axis)  # input dtype, padded with 0
    assert torch.equal(val, xg.gather(3, idx)), "outlier_val is not x at outlier_idx"

    # Per-element outlier mask and metadata.
    out_mask_g = torch.zeros(N, A, B, G, dtype=torch.bool)
    if k:
        out_mask_g.scatter_(3, idx, True)
    out_mask = from_groups(out_mask_g, T, D, axis)
    dense = ~out_mask
    s_el = per_element(scale.to(F64), T, D, G, axis)
    z_el = per_element(zero.to(F64), T, D, G, axis)
    x64 = x3.to(F64)
    y64 = y.reshape(N, T, D).to(F64)
    top = z_el + qmax * s_el

    # Range invariant: zero <= every dense entry <= zero + qmax*scale (the last up to the
    # float32 rounding of the op's quotient; 4 float32 ulps of the magnitudes involved).
    M_el = torch.maximum(torch.maximum(x64.abs(), z_el.abs()), top.abs())
    f32_ulp = ulp(M_el, torch.float32)
    assert (x64[dense] >= z_el[dense]).all()
    assert (x64[dense] <= top[dense] + 4 * f32_ulp[dense]).all()

    # (a) decompressed output.  |x - x_hat| <= scale/2 for exact arithmetic.  The op computes
    # (x - zero) * (1/scale) and code*scale + zero in float32: a handful of float32 roundings of
    # magnitude <= max(|x|, |zero|, |zero + qmax*scale|) (8 ulps allowed), then rounds x_hat to
    # the output dtype (half an ulp of the output dtype at max(|x|, |y|)).
    tol = s_el / 2 + 8 * f32_ulp + 0.5 * ulp(torch.maximum(x64.abs(), y64.abs()), out)
    err = (y64 - x64).abs()
    bad = dense & ~(err <= tol)
    assert not bad.any(), (
        f"{int(bad.sum())} dense elements out of bound; worst err "
        f"{err[bad].max().item():.6g} tol {tol[bad][err[bad].argmax()].item():.6g}"
    )
    # Outliers exact (exact whenever the output dtype holds the input dtype's value).
    assert torch.equal(y64[out_mask], x3.to(out).to(F64)[out_mask]), "outliers not exact"

    # (c) packed codes, decoded by the reference unpacker.
    codes = reference_unpack(p.codes.reshape(N * T, -1), bits, D)
    assert (codes[:, D:] == 0).all(), "padding channels past head_dim must be zero"
    codes = codes[:, :D].reshape(N, T, D).to(F64)
    assert (codes >= 0).all() and (codes <= qmax).all()
    deq = codes * s_el + z_el
    # float32 code*scale + zero: roundings of size ulp(max(|code*scale|, |zero|)), then the
    # output dtype's rounding of the result.
    terms = torch.maximum((codes * s_el).abs(), z_el.abs())
    deq_tol = 4 * ulp(terms, torch.float32) + 0.5 * ulp(torch.maximum(deq.abs(), y64.abs()), out)
    d_err = (y64 - deq).abs()
    bad = dense & ~(d_err <= deq_tol)
    assert not bad.any(), f"decoded codes do not dequantize to nq_decompress: {d_err[bad][:4]}"
    # The codes are round((x - zero)/scale) clamped to [0, qmax] -- outlier positions hold the
    # clamped code too.  Exactly at a .5 tie the op's float32 arithmetic may go either way.
    has_scale = s_el > 0
    q = torch.where(has_scale, (x64 - z_el) / torch.where(has_scale, s_el, 1.0), torch.zeros_like(x64))
    want = torch.floor(q + 0.5).clamp(0, qmax)
    # How far the op's float32 q can be from the exact one, in code units.
    q_err = 8 * f32_ulp / torch.where(has_scale, s_el, 1.0) + 1e-5 * q.abs() + 1e-6
    near_tie = (q - torch.floor(q) - 0.5).abs() <= q_err
    check = has_scale & ~near_tie
    mism = check & (codes != want)
    assert not mism.any(), f"codes differ from clamp(round((x-zero)/scale)) at {int(mism.sum())} places"
    # Zero-scale groups (constant, or nothing dense) store code 0 for dense entries.
    assert (codes[dense & ~has_scale] == 0).all()
    return p, y


# ---------------------------------------------------------------------------------------------
# Parametrized sweep: every bits x axis x dtype x num_outliers
# ---------------------------------------------------------------------------------------------


def keys_like(shape, dtype, seed):
    """Normal values with per-channel offsets/scales (as real keys have), a few heavy
    outliers, and one constant stretch."""
    g = torch.Generator().manual_seed(seed)
    *lead, T, D = shape
    x = torch.randn(shape, generator=g) * (0.5 + torch.rand(D, generator=g) * 2)
    x = x + torch.randn(D, generator=g) * 4
    spikes = torch.rand(shape, generator=g) < 0.01
    x = torch.where(spikes, x * 30, x)
    x[..., : min(T, 5), 0] = 1.25  # constant run in channel 0 (a constant group for axis=-2, G<=5)
    x[..., 0, : min(D, 7)] = -3.5  # constant run in token 0
    return x.to(dtype)


def sweep_cases():
    cases = []
    i = 0
    for bits in BITS:
        for axis in AXES:
            for dtype in DTYPES:
                for k in (0, 2):
                    D = (64, 80, 128)[i % 3]
                    if axis == -2:
                        T = (97, 50, 130)[i % 3]
                        G = 32 if k == 0 else 48  # 97 = 3*32+1, 50 = 48+2, 97 = 2*48+1: tiny last groups
                    else:
                        T = (37, 19, 23)[i % 3]
                        G = 24 if k == 0 else 63  # 64 = 63+1, 128 = 2*63+2: last group n <= k
                    cases.append(
                        pytest.param(
                            bits,
                            axis,
                            dtype,
                            k,
                            (2, 3, T, D),
                            G,
                            id=f"b{bits}-ax{axis}-{str(dtype)[6:]}-k{k}-T{T}-D{D}-G{G}",
                        )
                    )
                    i += 1
    return cases


@pytest.mark.parametrize("bits,axis,dtype,k,shape,G", sweep_cases())
def test_sweep_against_reference(bits, axis, dtype, k, shape, G):
    x = keys_like(shape, dtype, seed=bits * 1000 + (axis + 3) * 100 + k * 10 + DTYPES.index(dtype))
    check_against_reference(x, bits, G, axis, k)


# ---------------------------------------------------------------------------------------------
# Hand-checked layout
# ---------------------------------------------------------------------------------------------


def test_known_layout_2_3_4_8_bits():
    # One token, 64 channels, one group: x = zero + code exactly (scale 1 after rounding up).
    for bits in BITS:
        qmax = 2**bits - 1
        c = torch.arange(64) % (qmax + 1)
        c[-1] = qmax  # max present so that scale = 1
        c[0] = 0
        x = c.to(torch.float32).reshape(1, 64)
        p = nq_compress(x, bits, 64, -1)
        assert p.scale.item() == 1.0 and p.zero.item() == 0.0
        raw = p.codes.reshape(-1).to(torch.int64)
        if bits == 8:
            assert torch.equal(raw, c)
        elif bits == 4:
            want = torch.stack(
                [c[32 * q + lane] | (c[32 * q + 16 + lane] << 4) for q in range(2) for lane in range(16)]
            )
            assert torch.equal(raw, want)
        elif bits == 2:
            want = torch.stack(
                [c[lane] | c[lane + 16] << 2 | c[lane + 32] << 4 | c[lane + 48] << 6 for lane in range(16)]
            )
            assert torch.equal(raw, want)
        else:  # 3 bits: low plane as 2-bit chunk, then bit 2 of channel i at byte 16 + i%8, bit i//8
            lo = c & 3
            want_lo = torch.stack(
                [lo[lane] | lo[lane + 16] << 2 | lo[lane + 32] << 4 | lo[lane + 48] << 6 for lane in range(16)]
            )
            hi = (c >> 2) & 1
            want_hi = torch.tensor([sum(int(hi[8 * j + lane]) << j for j in range(8)) for lane in range(8)])
            assert torch.equal(raw, torch.cat([want_lo, want_hi]))
        assert torch.equal(nq_decompress(*p, bits, 64, -1, 64), x)


# ---------------------------------------------------------------------------------------------
# Hypothesis
# ---------------------------------------------------------------------------------------------

# Magnitudes kept where the op's documented precision holds (see the two xfail tests below for
# what happens past them): fp16 |x| <= ~3e4 (x_hat may round above 65504), float32/bf16 scale
# kept normal (>= ~1e-30 magnitudes) and |x| <= 1e30.
MAG = {torch.float16: (1e-4, 3e4), torch.bfloat16: (1e-30, 1e30), torch.float32: (1e-30, 1e30)}


@st.composite
def nq_case(draw):
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    T = draw(st.integers(1, 200))
    D = draw(st.integers(1, 160))
    bits = draw(st.sampled_from(BITS))
    axis = draw(st.sampled_from(AXES))
    dtype = draw(st.sampled_from(DTYPES))
    G = draw(st.integers(1, 256))
    k = draw(st.integers(0, min(G - 1, 6)))
    style = draw(st.sampled_from(["normal", "constant", "few_values", "heavy_outliers", "offset", "mixed"]))
    lo, hi = MAG[dtype]
    mag = draw(st.sampled_from([lo, 1.0, hi, 10.0 ** draw(st.integers(int(math.log10(lo)), int(math.log10(hi))))]))
    seed = draw(st.integers(0, 2**31 - 1))
    return lead, T, D, bits, axis, dtype, G, k, style, mag, seed


def make_values(shape, dtype, style, mag, seed):
    g = torch.Generator().manual_seed(seed)
    if style == "constant":
        x = torch.full(shape, float(torch.randn(1, generator=g)) * mag)
    elif style == "few_values":  # many ties: exercises the (value, position) ranking
        x = torch.randint(-2, 3, shape, generator=g).to(torch.float32) * mag / 2
    elif style == "heavy_outliers":
        x = torch.randn(shape, generator=g) * mag / 100
        spikes = torch.rand(shape, generator=g) < 0.02
        x = torch.where(spikes, torch.sign(torch.randn(shape, generator=g)) * mag, x)
    elif style == "offset":  # large constant offset, small spread
        x = mag + torch.randn(shape, generator=g) * mag * 1e-2
    elif style == "mixed":
        x = torch.randn(shape, generator=g) * torch.logspace(-2, 0, shape[-1]) * mag
    else:
        x = torch.randn(shape, generator=g) * mag / 3
    return x.clamp(-MAG[dtype][1], MAG[dtype][1]).to(dtype)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nq_case())
def test_hypothesis_against_reference(case):
    lead, T, D, bits, axis, dtype, G, k, style, mag, seed = case
    x = make_values((*lead, T, D), dtype, style, mag, seed)
    check_against_reference(x, bits, G, axis, k)


# ---------------------------------------------------------------------------------------------
# Non-contiguous inputs
# ---------------------------------------------------------------------------------------------


def assert_same_parts(a, b):
    for name, u, v in zip(nexuskv.NQParts._fields, a, b):
        assert u.dtype == v.dtype and u.shape == v.shape, name
        assert torch.equal(u, v), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("k", [0, 3])
def test_non_contiguous_matches_contiguous(dtype, axis, k):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(3, 2, 45, 80, generator=g).to(dtype)
    bthd = torch.randn(2, 45, 4, 64, generator=g).to(dtype)  # [B, T, H, D]
    views = {
        "transposed_leading": base.transpose(0, 1),
        "step_slice_tokens": base[:, :, ::2],
        "step_slice_channels": base[..., ::3],
        "bthd_to_bhtd": bthd.transpose(1, 2),  # [B, H, T, D] view, token stride H*D
        "token_channel_transposed": base.transpose(-1, -2),  # stride_d != 1
        "expanded": base[:1, :1].expand(3, 2, 45, 80),  # zero strides
    }
    for name, v in views.items():
        assert not v.is_contiguous(), name
        for bits in (3, 4):
            G = 16
            pv = nq_compress(v, bits, G, axis, k)
            pc = nq_compress(v.contiguous(), bits, G, axis, k)
            assert_same_parts(pv, pc)
            D = v.shape[-1]
            assert torch.equal(nq_decompress(*pv, bits, G, axis, D), nq_decompress(*pc, bits, G, axis, D))
    check_against_reference(views["bthd_to_bhtd"], 4, 16, axis, k)


def test_non_contiguous_compressed_tensors_decompress():
    x = torch.randn(2, 3, 40, 64)
    p = nq_compress(x, 4, 16, -2, 2)
    want = nq_decompress(*p, 4, 16, -2, 64)
    # Views of the parts (made by slicing a larger tensor) give the same result.
    p2 = [torch.stack([t, t], dim=0)[1] for t in p]
    p2 = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in p2]
    assert not p2[0].is_contiguous()
    assert torch.equal(nq_decompress(*p2, 4, 16, -2, 64), want)


# ---------------------------------------------------------------------------------------------
# meta_dtype and out_dtype
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis", AXES)
def test_meta_float32_for_bf16_input(bits, axis):
    x = keys_like((2, 50, 80), torch.bfloat16, seed=11 + bits)
    p, _ = check_against_reference(x, bits, 32, axis, 2, meta_dtype=torch.float32)
    assert p.scale.dtype == torch.float32 and p.outlier_val.dtype == torch.bfloat16
    # float32 meta is at least as tight as bf16 meta.
    pb = nq_compress(x, bits, 32, axis, 2)
    assert (p.scale.to(F64) <= pb.scale.to(F64)).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis", AXES)
def test_meta_float16_for_float32_input(bits, axis):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 41, 72, generator=g) * 5
    x[0, 0, :5, :5] = 1e-6  # tiny constant values: zero rounds down into fp16 subnormals
    p, _ = check_against_reference(x, bits, 16, axis, 1, meta_dtype=torch.float16)
    assert p.scale.dtype == torch.float16 and p.zero.dtype == torch.float16
    assert p.outlier_val.dtype == torch.float32
    check_against_reference(x, bits, 16, axis, 0, meta_dtype=torch.bfloat16)


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("axis", AXES)
def test_out_dtype(in_dtype, axis):
    x = keys_like((2, 33, 96), in_dtype, seed=5)
    for bits in (2, 4):
        p = nq_compress(x, bits, 16, axis, 2)
        y32 = nq_decompress(*p, bits, 16, axis, 96, torch.float32)
        assert y32.dtype == torch.float32
        assert torch.equal(nq_decompress(*p, bits, 16, axis, 96), nq_decompress(*p, bits, 16, axis, 96, in_dtype))
        for out in DTYPES:
            y = nq_decompress(*p, bits, 16, axis, 96, out)
            assert y.dtype == out and y.shape == x.shape
            # x_hat is formed in float32, then rounded once to the output dtype.
            assert torch.equal(y, y32.to(out))
            check_against_reference(x, bits, 16, axis, 2, out_dtype=out)


def test_compressor_class_matches_ops():
    x = keys_like((2, 2, 70, 64), torch.float16, seed=9)
    for nq in (nexuskv.NQ.for_keys(bits=4, group_size=32, num_outliers=2), nexuskv.NQ.for_values(bits=3)):
        c = nq.compress(x)
        assert_same_parts(c.parts, nq_compress(x, nq.bits, nq.group_size, nq.axis, nq.num_outliers))
        assert torch.equal(nq.decompress(c), nq_decompress(*c.parts, nq.bits, nq.group_size, nq.axis, 64))
        assert nq.nbytes(c) == nq.expected_nbytes(x.shape, x.dtype)


# ---------------------------------------------------------------------------------------------
# The edges of the dtype range (two bugs found here, now fixed: fp16 output overflow, subnormal scale)
# ---------------------------------------------------------------------------------------------


def test_fp16_extreme_range_decompresses_finite():
    x = torch.tensor([[65504.0, -65504.0]], dtype=torch.float16)
    p = nq_compress(x, 2, 2, -1)
    y = nq_decompress(*p, 2, 2, -1, 2)
    assert torch.isfinite(y).all(), f"scale {p.scale.item()} zero {p.zero.item()} -> {y}"


@pytest.mark.parametrize("dtype,a", [(torch.float32, 1e-36), (torch.bfloat16, 1e-37)])
@pytest.mark.parametrize("bits", [2, 8])
def test_subnormal_scale_is_clamped_as_documented(dtype, a, bits):
    # Two values one ulp apart near 1e-37: (max - zero) / qmax is subnormal, which nq_format.h
    # raises to FLT_MIN (also for bf16 metadata, which could hold the subnormal).  The reference
    # once did not: the flaky hypothesis case of issue 8, item 19.
    lo = torch.tensor(a, dtype=dtype)
    x = torch.stack([lo, torch.nextafter(lo, torch.ones_like(lo)), lo, lo]).reshape(1, 4)
    p, _ = check_against_reference(x, bits, 4, -1, 0)
    assert p.scale.dtype == dtype and p.scale.item() == torch.finfo(torch.float32).tiny


def test_subnormal_scale_keeps_error_bound():
    x = torch.linspace(0, 1e-37, 64).reshape(1, 64)
    p = nq_compress(x, 8, 64, -1)
    y = nq_decompress(*p, 8, 64, -1, 64)
    assert ((y - x).abs() <= p.scale / 2 + 2e-45).all(), f"max err {(y - x).abs().max()} scale {p.scale}"
