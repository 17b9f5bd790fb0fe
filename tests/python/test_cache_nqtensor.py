"""Compressed tensors carry their format (issue 8 items 15-17): an NQTensor knows its
bits, group size, axis, head_dim, meta dtype, DGQ or not and rotation, checks them
against its buffers, cannot be changed, and NQ / DGQ refuse to read one they did not make
(instead of garbage or an unrelated TypeError)."""

import dataclasses

import pytest
import torch

from nexuskv.compressors import DGQ, NQ, NQTensor


@pytest.fixture
def x():
    return torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(0))


def test_the_tensor_carries_its_format(x):
    c = NQ(bits=3, group_size=16, per="channel", num_outliers=1, meta_dtype=torch.bfloat16).compress(x)
    assert (c.bits, c.group_size, c.axis, c.head_dim, c.num_outliers, c.meta_dtype, c.dynamic) == \
        (3, 16, -2, 64, 1, torch.bfloat16, False)
    d = DGQ(bits=4, group_size=32, rotate=True).compress(x)
    assert d.dynamic and d.meta_dtype == torch.float32 and d.signs.shape == (64,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.bits = 2


def test_nq_refuses_a_dgq_tensor_and_back(x):
    d = DGQ(bits=4, group_size=32).compress(x)
    with pytest.raises(TypeError, match="NQ.decompress: this tensor was compressed by DGQ .*decompress it with DGQ"):
        NQ(bits=4, group_size=32, per="channel").decompress(d)
    n = NQ(bits=4, group_size=32, per="channel").compress(x)
    with pytest.raises(TypeError, match="DGQ.decompress: this tensor was compressed by NQ"):
        DGQ(bits=4, group_size=32).decompress(n)
    with pytest.raises(TypeError, match="NQ.decompress: expected the NQTensor that NQ.compress returns, got tuple"):
        NQ().decompress(tuple(n.parts))


@pytest.mark.parametrize("other, wrong", [
    (dict(bits=2), "bits=4 \\(this NQ has 2\\)"),
    (dict(group_size=17), "group_size=16 \\(this NQ has 17\\)"),
    (dict(per="token"), "axis=-2 \\(this NQ has -1\\)"),
    (dict(num_outliers=2), "num_outliers=0 \\(this NQ has 2\\)"),
    (dict(meta_dtype=torch.float16), "meta_dtype=torch.float32 \\(this NQ has torch.float16\\)"),
    (dict(rotate=True), "rotate=False \\(this NQ has True\\)"),
])
def test_nq_refuses_a_tensor_of_another_format(x, other, wrong):
    made = dict(bits=4, group_size=16, per="channel")
    c = NQ(**made).compress(x)
    with pytest.raises(ValueError, match="NQ.decompress: this tensor was compressed with " + wrong):
        NQ(**(made | other)).decompress(c)
    torch.testing.assert_close(NQ(**made).decompress(c), NQ(**made).decompress(c), rtol=0, atol=0)


def test_inconsistent_tensors_cannot_be_made(x):
    c = NQ(bits=4, group_size=16).compress(x)
    with pytest.raises(ValueError, match="a DGQ tensor has 6 parts, got 5"):
        NQTensor(c.parts, 4, 16, -1, c.shape, c.dtype, dynamic=True)
    with pytest.raises(ValueError, match="do not hold a \\(2, 64, 64\\) tensor at 8 bits"):
        NQTensor(c.parts, 8, 16, -1, c.shape, c.dtype)  # decompressing 4-bit codes as 8-bit
    with pytest.raises(ValueError, match="do not hold a \\(2, 64, 96\\) tensor at 4 bits"):
        NQTensor(c.parts, 4, 16, -1, torch.Size([2, 64, 96]), c.dtype)
    with pytest.raises(ValueError, match="meta_dtype torch.float16 but the scales are torch.float32"):
        NQTensor(c.parts, 4, 16, -1, c.shape, c.dtype, meta_dtype=torch.float16)
