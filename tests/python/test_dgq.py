"""DGQ (dynamic token groups for keys): segments follow planted variance
changes, respect granule and max length, keep the NQ error bound per segment
(checked with the independent reference decoder), exact byte accounting, and
operator hygiene."""

import pytest
import torch

import nexuskv
from nexuskv import DGQ, NQ
from nq_reference import F64, reference_dequantize


def segments_of(starts: torch.Tensor, T: int):
    s = starts.tolist() + [T]
    return [(a, b) for a, b in zip(s[:-1], s[1:])]


def planted(T=320, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, T, D, generator=g)
    x[:, :, 96:224] *= 10  # a loud stretch between two quiet ones
    return x


def test_boundaries_land_on_planted_variance_changes():
    parts = nexuskv.dgq_compress(planted(), 4, 64, granule=16)
    for row in parts.segment_starts.reshape(-1, parts.segment_starts.shape[-1]):
        assert 96 in row.tolist() and 224 in row.tolist(), row


@pytest.mark.parametrize("T", [1, 15, 16, 33, 200, 1000])
@pytest.mark.parametrize("group,granule,max_len", [(64, 16, 128), (32, 8, 96), (64, 32, 256)])
def test_segment_lengths_respect_granule_and_max(T, group, granule, max_len):
    x = torch.randn(2, T, 16) * torch.linspace(0.5, 4, T)[:, None]
    parts = nexuskv.dgq_compress(x, 3, group, granule, max_len)
    S = -(-T // group)
    assert parts.segment_starts.shape == (2, S) and parts.scale.shape == (2, S, 16)
    for row in parts.segment_starts:
        assert row[0] == 0
        for a, b in segments_of(row, T):
            assert 0 <= b - a <= max_len
            if b < T and b > a:
                assert (b - a) % granule == 0 and a % granule == 0


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 2])
def test_error_bound_and_reference_decoder(bits, dtype, k):
    x = planted(T=200, D=48, seed=bits).to(dtype)
    parts = nexuskv.dgq_compress(x, bits, 32, 16, None, k)
    x_hat = nexuskv.dgq_decompress(*parts, bits, 32, 48)
    ref = reference_dequantize(parts[:5], bits, 32, -2, 48, segment_starts=parts.segment_starts)
    seg = (torch.arange(200)[None, None, :, None] >= parts.segment_starts[..., None, :].long()).sum(-1) - 1
    s_el = parts.scale.to(F64).gather(2, seg[..., None].expand(-1, -1, -1, 48))
    z_el = parts.zero.to(F64).gather(2, seg[..., None].expand(-1, -1, -1, 48))
    # float32 evaluation of code*scale + zero: a few ulps of the larger term (the two may cancel).
    f32 = 4 * torch.finfo(torch.float32).eps * (s_el * (2**bits) + z_el.abs() + ref.abs())
    out_round = 0 if dtype == torch.float32 else torch.finfo(dtype).eps * ref.abs()
    assert ((x_hat.to(F64) - ref).abs() <= f32 + out_round).all()
    # Every element is within half its segment's scale of x (plus that rounding), outliers exact.
    err = (x_hat.to(F64) - x.to(F64)).abs()
    bound = s_el / 2 + 2 * f32 + (0 if dtype == torch.float32 else torch.finfo(dtype).eps * x.to(F64).abs())
    assert (err <= bound).all()


def test_equal_bits_to_fixed_groups_plus_segment_table():
    x = torch.randn(2, 4, 256, 64, dtype=torch.float16)
    fixed, dyn = NQ(4, 64, "channel").compress(x), DGQ(4, 64).compress(x)
    assert dyn.nbytes == fixed.nbytes + 2 * 4 * 4 * 4  # one int32 start per segment and row
    assert dyn.nbytes == sum(t.numel() * t.element_size() for t in dyn.parts)


def test_dgq_lowers_error_on_planted_changes_at_equal_bits():
    x = planted(T=512, D=64, seed=3)
    for bits in (2, 4):
        fixed = NQ(bits, 64, "channel")
        dyn = DGQ(bits, 64)
        e_fixed = (fixed.decompress(fixed.compress(x)) - x).norm()
        e_dyn = (dyn.decompress(dyn.compress(x)) - x).norm()
        assert e_dyn < e_fixed, (bits, float(e_dyn), float(e_fixed))


def test_rotation_round_trip():
    x = torch.randn(1, 2, 100, 64)
    c = DGQ(8, 32, rotate=True, seed=5).compress(x)
    assert c.signs is not None
    torch.testing.assert_close(DGQ(8, 32, rotate=True, seed=5).decompress(c), x, rtol=0, atol=0.05)


def test_opcheck_and_compile():
    x = torch.randn(2, 3, 70, 64)
    torch.library.opcheck(torch.ops.nexuskv.dgq_compress.default, (x, 4, 32, 16, None, 1, None))
    parts = nexuskv.dgq_compress(x, 4, 32, 16, None, 1)
    torch.library.opcheck(torch.ops.nexuskv.dgq_decompress.default, (*parts, 4, 32, 64, None))

    def roundtrip(t):
        return nexuskv.dgq_decompress(*nexuskv.dgq_compress(t, 4, 32), 4, 32, t.shape[-1])

    torch.testing.assert_close(
        torch.compile(roundtrip, fullgraph=True, backend="aot_eager")(x), roundtrip(x), rtol=0, atol=0
    )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(granule=0), r"granule must be in \[1, group_size\]"),
        (dict(granule=64), r"granule must be in \[1, group_size\]"),
        (dict(max_len=48), "max_len must be a multiple of granule"),
        (dict(max_len=300), "max_len must be a multiple of granule"),
        (dict(max_len=72), "max_len must be a multiple of granule"),
    ],
)
def test_bad_parameters(kw, match):
    with pytest.raises(RuntimeError, match=match):
        nexuskv.dgq_compress(torch.randn(1, 100, 16), 4, 32, **kw)


def test_bad_segment_starts_rejected():
    parts = list(nexuskv.dgq_compress(torch.randn(1, 100, 16), 4, 32))
    starts = parts[5].clone()
    starts[0, 1], starts[0, 2] = starts[0, 2], starts[0, 1] - 1
    with pytest.raises(RuntimeError, match="must be non-decreasing"):
        nexuskv.dgq_decompress(*parts[:5], starts, 4, 32, 16)
    starts = parts[5].clone()
    starts[0, 0] = 3
    with pytest.raises(RuntimeError, match="must begin at token 0"):
        nexuskv.dgq_decompress(*parts[:5], starts, 4, 32, 16)


def test_segment_longer_than_256_tokens_rejected():
    # outlier_idx holds a position inside its segment in one byte: a segment of 300 tokens is
    # corrupt (once reported only as an outlier position outside its group, or not at all).
    parts = list(nexuskv.dgq_compress(torch.randn(1, 300, 16), 4, 128, num_outliers=0))
    starts = parts[5].clone()
    starts[0, 1:] = 300
    with pytest.raises(RuntimeError, match=r"segment 0 is \[0, 300\), longer than the 256 tokens"):
        nexuskv.dgq_decompress(*parts[:5], starts, 4, 128, 16)


@pytest.mark.parametrize("group,granule,want", [(20, 16, 48), (24, 16, 48), (40, 32, 96), (100, 48, 240)])
def test_default_max_len_rounds_up_to_the_granule(group, granule, want):
    # 2 * group_size is no multiple of the granule here: once an error about max_len, which the
    # caller never passed.  The default is now the smallest multiple of granule >= 2 * group_size.
    x = torch.randn(2, 300, 16) * torch.linspace(0.5, 4, 300)[:, None]
    parts = nexuskv.dgq_compress(x, 4, group, granule)
    assert parts.segment_starts.shape == (2, -(-300 // group))
    for row in parts.segment_starts:
        lengths = [b - a for a, b in segments_of(row, 300)]
        assert max(lengths) <= want
        assert all(n % granule == 0 for n, (a, b) in zip(lengths, segments_of(row, 300)) if b < 300)
    torch.testing.assert_close(parts, nexuskv.dgq_compress(x, 4, group, granule, want), rtol=0, atol=0)


def test_default_max_len_that_cannot_exist_names_the_default():
    with pytest.raises(
        RuntimeError,
        match=r"dgq_compress: no max_len fits granule=100 and group_size=128: the "
        r"default max_len is the smallest multiple of granule",
    ):
        nexuskv.dgq_compress(torch.randn(1, 300, 16), 4, 128, 100)


def test_meta_segment_starts_among_cpu_tensors():
    parts = list(nexuskv.dgq_compress(torch.randn(1, 100, 16), 4, 32))
    parts[5] = parts[5].to("meta")
    with pytest.raises(
        RuntimeError,
        match=r"dgq_decompress: all tensors must be on one device, codes is on cpu but "
        r"segment_starts is on meta",
    ):
        nexuskv.dgq_decompress(*parts, 4, 32, 16)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(granule=0), "granule must be in"),
        (dict(max_len=72), "max_len must be"),
        (dict(granule=100, group_size=128), "no max_len fits"),
    ],
)
def test_fake_kernel_rejects_what_the_kernel_rejects(kw, match):
    args = dict(bits=4, group_size=32) | kw
    x = torch.randn(1, 100, 16)
    with pytest.raises(RuntimeError, match=match) as real:
        nexuskv.dgq_compress(x, **args)
    with pytest.raises(RuntimeError) as meta:
        nexuskv.dgq_compress(x.to("meta"), **args)
    assert str(meta.value).splitlines()[0] == str(real.value).splitlines()[0]
