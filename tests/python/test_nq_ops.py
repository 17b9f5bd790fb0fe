"""Operator hygiene of nq_compress / nq_decompress: opcheck (schema, fake
kernels, dynamic shapes), torch.compile(fullgraph=True), torch.export,
TorchScript, and exact byte accounting."""

import io

import pytest
import torch

import nexuskv
from nexuskv import NQ

compress = torch.ops.nexuskv.nq_compress.default
decompress = torch.ops.nexuskv.nq_decompress.default

CASES = [  # (shape, dtype, bits, group_size, axis, num_outliers)
    ((2, 3, 70, 64), torch.float32, 4, 32, -2, 0),
    ((1, 2, 40, 80), torch.float16, 3, 16, -1, 2),
    ((5, 128), torch.bfloat16, 2, 64, -2, 1),
    ((2, 33, 128), torch.bfloat16, 8, 128, -1, 0),
]


@pytest.mark.parametrize("shape,dtype,bits,group,axis,k", CASES)
def test_opcheck(shape, dtype, bits, group, axis, k):
    x = torch.randn(shape, dtype=dtype)
    torch.library.opcheck(compress, (x, bits, group, axis, k, None))
    parts = compress(x, bits, group, axis, k, None)
    torch.library.opcheck(decompress, (*parts, bits, group, axis, shape[-1], None))
    torch.library.opcheck(decompress, (*parts, bits, group, axis, shape[-1], torch.float32))


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    parts = torch.ops.nexuskv.nq_compress(x, 4, 32, -2, 1)
    return torch.ops.nexuskv.nq_decompress(*parts, 4, 32, -2, x.shape[-1])


def test_torch_compile_fullgraph_matches_eager():
    x = torch.randn(2, 4, 96, 64)
    compiled = torch.compile(roundtrip, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), roundtrip(x), rtol=0, atol=0)
    # Dynamic token count: the fake kernels compute shapes from SymInts.
    dyn = torch.compile(roundtrip, fullgraph=True, dynamic=True, backend="aot_eager")
    for t in (50, 77):
        y = torch.randn(2, 4, t, 64)
        torch.testing.assert_close(dyn(y), roundtrip(y), rtol=0, atol=0)


def test_torch_compile_inductor():
    x = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: roundtrip(t).float().sum(-1), fullgraph=True)
    torch.testing.assert_close(compiled(x), roundtrip(x).float().sum(-1), rtol=1e-5, atol=1e-5)


class RoundTrip(torch.nn.Module):
    def forward(self, x):
        return roundtrip(x)


def test_torch_export():
    x = torch.randn(1, 2, 64, 64)
    ep = torch.export.export(RoundTrip(), (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "nexuskv.nq_compress.default" in targets and "nexuskv.nq_decompress.default" in targets
    torch.testing.assert_close(ep.module()(x), roundtrip(x), rtol=0, atol=0)


@torch.jit.script
def scripted_roundtrip(x: torch.Tensor, bits: int) -> torch.Tensor:
    codes, scale, zero, idx, val = torch.ops.nexuskv.nq_compress(x, bits, 64, -1, 0, None)
    return torch.ops.nexuskv.nq_decompress(codes, scale, zero, idx, val, bits, 64, -1, x.size(-1), None)


def test_torchscript_function_and_save_load():
    x = torch.randn(3, 20, 128)
    expected = nexuskv.nq_decompress(*nexuskv.nq_compress(x, 2, 64, -1), 2, 64, -1, 128)
    torch.testing.assert_close(scripted_roundtrip(x, 2), expected, rtol=0, atol=0)
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(RoundTrip()), buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    torch.testing.assert_close(loaded(x), roundtrip(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "nq,dtype,bits_expected",
    [
        (NQ(4, 64, "channel"), torch.float16, 4.5),  # 4 + 2*16/64
        (NQ(2, 64, "token"), torch.float16, 2.5),
        (NQ(8, 128, "token"), torch.float16, 8.25),  # 8 + 2*16/128
        (NQ(4, 32, "token", num_outliers=1), torch.bfloat16, 4 + 32 / 32 + 24 / 32),
        (NQ(3, 64, "channel", num_outliers=2), torch.float32, 3 + 64 / 64 + 2 * 40 / 64),
        (NQ(4, 64, "channel", meta_dtype=torch.float16), torch.float32, 4.5),
    ],
)
def test_effective_bits_formula_aligned(nq, dtype, bits_expected):
    x = torch.randn(2, 4, 256, 128).to(dtype)
    c = nq.compress(x)
    assert c.effective_bits == pytest.approx(bits_expected, rel=0, abs=1e-12)
    assert c.nbytes == sum(t.numel() * t.element_size() for t in c.parts)
    assert c.bytes_ratio == pytest.approx(x.element_size() * 8 / bits_expected)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 5, 100, 80), (7, 200, 65), (2, 1, 63, 130)])
@pytest.mark.parametrize("nq", [NQ(3, 64, "channel", 2), NQ(4, 16, "token", 1), NQ(2, 128, "token")])
def test_nbytes_equals_format_formula_with_padding(shape, nq):
    if nq.num_outliers >= nq.group_size:
        pytest.skip()
    x = torch.randn(shape, dtype=torch.float16)
    c = nq.compress(x)
    assert c.nbytes == nq.expected_nbytes(x.shape, x.dtype)
    assert nexuskv.effective_bits(nq, c, x.numel()) == pytest.approx(8 * c.nbytes / x.numel())


def test_nq_is_a_kv_compressor():
    assert isinstance(NQ(), nexuskv.KVCompressor)
    with pytest.raises(ValueError, match="per must be"):
        NQ(per="head")


def test_loader_names_a_missing_library(monkeypatch, tmp_path):
    from nexuskv import _loader

    monkeypatch.setattr(_loader, "_loaded", False)
    monkeypatch.setattr(_loader, "library_path", lambda: str(tmp_path / "libnexuskv.so"))
    with pytest.raises(_loader.NativeLibraryError, match="is missing.*pip install --no-build-isolation"):
        _loader.load()


def test_loader_names_a_torch_mismatch(monkeypatch):
    from nexuskv import _build_info, _loader

    monkeypatch.setattr(_loader, "_loaded", False)
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "1.0.0")
    with pytest.raises(_loader.NativeLibraryError, match="built against torch 1.0.0"):
        _loader.load()
