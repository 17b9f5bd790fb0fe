"""The C++ KVCache's policy beyond the tail: sink tokens (first tokens kept in full
precision), external storage (chunks handed to a front end's own compressor),
beam reordering, exact byte accounting, and misuse after reset."""

import math

import pytest
import torch

from nexuskv.cache import make_cache
from nexuskv.compressors import NQ
from nq_reference import F64
from test_cache import Decoder, attention_f64


def make(bits=4, group=32, residual=16, sinks=0, rotate=False, dynamic=False, external_chunk=0):
    return make_cache(key_bits=bits, key_group_size=group, key_dynamic=dynamic, value_bits=bits,
                      value_group_size=group, residual=residual, sinks=sinks, rotate=rotate,
                      external_chunk=external_chunk)


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


# ---- sinks -------------------------------------------------------------------------------------


def test_sinks_are_the_first_tokens_exactly_and_never_compressed():
    cache = make(bits=2, group=16, residual=8, sinks=4)
    k, v = torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64)
    cache.append(k[:, :, :3], v[:, :, :3], None)  # sinks fill across appends
    cache.append(k[:, :, 3:], v[:, :, 3:], None)
    assert cache.lengths().tolist() == [100] and cache.sinks() == 4
    # 96 tokens after the sinks: 80 compressed (5 chunks of 16), 16 in the tail (>= residual 8).
    assert cache.compressed_lengths().tolist() == [80]
    kd, vd, _ = cache.dense(None)
    torch.testing.assert_close(kd[:, :, :4], k[:, :, :4], rtol=0, atol=0)
    torch.testing.assert_close(vd[:, :, :4], v[:, :, :4], rtol=0, atol=0)
    torch.testing.assert_close(kd[:, :, 84:], k[:, :, 84:], rtol=0, atol=0)  # the tail
    assert (kd[:, :, 4:84] - k[:, :, 4:84]).abs().max() > 1e-3  # 2-bit: really compressed


@pytest.mark.parametrize("kw", [dict(), dict(rotate=True), dict(dynamic=True, bits=3)])
def test_decode_with_sinks_matches_float64_attention_over_dense(kw):
    torch.manual_seed(1)
    cache = make(sinks=4, **kw)
    B, H, D = 2, 2, 64
    valid = torch.ones(B, 45, dtype=torch.bool)
    valid[1, :7] = False  # left padding: the sinks of sequence 1 are its first real tokens
    k0, v0 = torch.randn(B, H, 45, D), torch.randn(B, H, 45, D)
    cache.append(k0, v0, valid)
    kd, _, _ = cache.dense(None)
    torch.testing.assert_close(kd[1, :, :4], k0[1, :, 7:11], rtol=0, atol=0)
    for step in range(30):
        n = 3 if step % 10 == 0 else 1  # q_len > 1 now and then
        cache.append(torch.randn(B, H, n, D), torch.randn(B, H, n, D), None)
        q = torch.randn(B, 2 * H, n, D)
        out = cache.attend(q, None)
        kd, vd, lens = cache.dense(torch.float32)
        assert rel(out, attention_f64(q, kd, vd, lens, D ** -0.5)) < 1e-4, step
    assert cache.lengths().tolist() == [45 + 36, 38 + 36]


def test_sinks_shorter_sequence_than_the_sinks():
    cache = make(sinks=8)
    k, v = torch.randn(2, 1, 5, 64), torch.randn(2, 1, 5, 64)
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[0, :3] = False
    cache.append(k, v, valid)
    assert cache.lengths().tolist() == [2, 5] and cache.compressed_lengths().tolist() == [0, 0]
    q = torch.randn(2, 2, 2, 64)
    kd, vd, lens = cache.dense(torch.float32)
    assert rel(cache.attend(q, None), attention_f64(q, kd, vd, lens, 0.125)) < 1e-5


# ---- exact bytes -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_used_nbytes_is_the_format_formula(dtype):
    # Independent count: NQ's byte formula (nq_format.h) for the compressed tokens, plus the
    # live sink and tail tokens in the input dtype.
    B, H, D, n, group = 2, 2, 64, 212, 32
    cache = make(bits=4, group=group, residual=16, sinks=4)
    cache.append(torch.randn(B, H, n, D, dtype=dtype), torch.randn(B, H, n, D, dtype=dtype), None)
    c = cache.compressed_lengths().tolist()
    assert c == [192, 192]  # 208 after the sinks: 6 chunks of 32 leave the residual 16
    kq, vq = NQ(4, group, per="channel"), NQ(4, group, per="token")
    comp = sum(q.expected_nbytes(torch.Size([H, cb, D]), dtype) for q in (kq, vq) for cb in c)
    live = sum(int(x) for x in cache.lengths()) - sum(c)
    elem = torch.empty((), dtype=dtype).element_size()
    assert cache.used_nbytes() == comp + 2 * live * H * D * elem
    assert cache.used_nbytes() <= cache.nbytes()


@pytest.mark.parametrize("prefill", [1, 1000])
def test_allocated_bytes_stay_within_5_percent_of_used(prefill):
    # A prefill, then token-by-token decode to 4096 (4-bit, groups of 64, a 128-token bf16 tail):
    # the compressed buffers grow by 1/64 of their need in whole chunks, the tail's in steps of 16
    # tokens, so what is allocated stays within 5 % of what the cached tokens use.
    H, D = 2, 64
    cache = make(bits=4, group=64, residual=128)
    g = torch.Generator().manual_seed(0)

    def kv(n):
        return [torch.randn(1, H, n, D, generator=g).bfloat16() for _ in range(2)]

    cache.append(*kv(prefill), None)
    grown = set()
    for t in range(prefill, 4096):
        cache.append(*kv(1), None)
        if t + 1 >= 1024:
            assert cache.nbytes() <= 1.05 * cache.used_nbytes(), (t + 1, cache.nbytes(), cache.used_nbytes())
        grown.add(cache.nbytes())
    assert int(cache.lengths()) == 4096 and int(cache.compressed_lengths()) > 0
    # Growth is in steps, not per token: far fewer distinct sizes than appended tokens.
    assert len(grown) < (4096 - prefill) / 8


def test_a_cache_filled_under_inference_mode_continues_outside_it():
    # Its buffers are inference tensors with room left; append and crop outside inference_mode
    # write into them in place, which torch refuses: the cache copies them to normal tensors.
    H, D = 2, 32
    k, v = torch.randn(1, H, 150, D), torch.randn(1, H, 150, D)
    ref = make(bits=4, group=32, residual=16)
    ref.append(k[:, :, :100], v[:, :, :100], None)
    cache = make(bits=4, group=32, residual=16)
    with torch.inference_mode():
        cache.append(k[:, :, :100], v[:, :, :100], None)
    for c in (cache, ref):
        c.append(k[:, :, 100:101], v[:, :, 100:101], None)
        c.crop(90)
        c.append(k[:, :, 90:150], v[:, :, 90:150], None)
    q = torch.randn(1, H, 1, D)
    assert torch.equal(cache.attend(q, None, None), ref.attend(q, None, None))
    assert int(cache.lengths()) == 150 and int(cache.compressed_lengths()) > 0


# ---- external storage: a front end's own compressor -------------------------------------------


class Int8PerToken:
    """A user's compressor: int8 codes with one float32 absmax scale per token row."""

    def compress(self, x):
        scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
        return (torch.round(x.float() / scale).to(torch.int8), scale, x.dtype)

    def decompress(self, c, dtype=None):
        codes, scale, orig = c
        return (codes.float() * scale).to(dtype or orig)

    def nbytes(self, c):
        return c[0].numel() * c[0].element_size() + c[1].numel() * c[1].element_size()


def test_external_storage_hands_over_chunks_and_keeps_the_policy():
    cache = make(external_chunk=16, residual=8, sinks=2)
    assert cache.is_external() and cache.chunk() == 16
    k, v = torch.randn(2, 2, 50, 64), torch.randn(2, 2, 50, 64)
    valid = torch.ones(2, 50, dtype=torch.bool)
    valid[1, :10] = False
    cache.append(k, v, valid)
    seq, off, ks, vs = cache.take_due_chunks()
    # Sequence 0: 48 after the sinks -> 32 compressed (2 chunks of 16 at once); sequence 1: 38 -> 16.
    assert seq.tolist() == [0, 1] and off.tolist() == [0, 0]
    assert ks[0].shape == (2, 32, 64) and ks[1].shape == (2, 16, 64)
    torch.testing.assert_close(ks[0], k[0, :, 2:34], rtol=0, atol=0)
    torch.testing.assert_close(vs[1], v[1, :, 12:28], rtol=0, atol=0)
    assert cache.take_due_chunks()[0].numel() == 0  # handed over once
    comp = Int8PerToken()
    kc = [comp.decompress(comp.compress(ks[0])), comp.decompress(comp.compress(ks[1]))]
    vc = [comp.decompress(comp.compress(vs[0])), comp.decompress(comp.compress(vs[1]))]
    kd, vd, lens = cache.dense_with(kc, vc, None)
    assert lens.tolist() == [50, 40]
    torch.testing.assert_close(kd[0, :, 2:34], kc[0], rtol=0, atol=0)
    torch.testing.assert_close(kd[0, :, :2], k[0, :, :2], rtol=0, atol=0)
    torch.testing.assert_close(kd[1, :, 28:40], k[1, :, 38:50], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="not available with external storage"):
        cache.attend(torch.randn(2, 2, 1, 64), None)
    with pytest.raises(RuntimeError, match="not available with external storage"):
        cache.dense(None)
    with pytest.raises(RuntimeError, match=r"compressed part of sequence 1\) must have shape \[2, 16, 64\]"):
        cache.dense_with(kc, [vc[0], vc[1][:, :3]], None)
    cache.append(torch.randn(2, 2, 20, 64), torch.randn(2, 2, 20, 64), None)
    with pytest.raises(RuntimeError, match="chunks wait in take_due_chunks"):
        cache.dense_with(kc, vc, None)


def test_fused_storage_refuses_external_calls():
    cache = make()
    cache.append(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), None)
    with pytest.raises(RuntimeError, match="take_due_chunks\\(\\) is not available with fused storage"):
        cache.take_due_chunks()
    with pytest.raises(RuntimeError, match="dense_with\\(\\) is not available with fused storage"):
        cache.dense_with([], [], None)


# ---- beam reordering ---------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(rotate=True, sinks=3), dict(external_chunk=16, sinks=2)])
def test_reorder_permutes_every_sequence(kw):
    torch.manual_seed(2)
    cache = make(residual=8, **kw)
    B, H, D = 3, 2, 64
    valid = torch.ones(B, 70, dtype=torch.bool)
    valid[2, :30] = False  # ragged: sequence 2 is shorter
    cache.append(torch.randn(B, H, 70, D), torch.randn(B, H, 70, D), valid)
    idx = torch.tensor([2, 2, 0])
    before_parts = after_parts = None
    if cache.is_external():  # the front end's chunks (one per sequence here) follow the beams itself
        seq, _, ks, vs = cache.take_due_chunks()
        assert seq.tolist() == [0, 1, 2]
        before_parts = (ks, vs)
        after_parts = ([ks[i] for i in idx], [vs[i] for i in idx])

    def dense(parts):
        return cache.dense(None) if parts is None else cache.dense_with(*parts, None)

    kd0, vd0, lens0 = dense(before_parts)
    cache.reorder(idx)
    kd, vd, lens = dense(after_parts)
    assert lens.tolist() == lens0[idx].tolist() == [40, 40, 70]
    torch.testing.assert_close(kd, kd0[idx], rtol=0, atol=0)
    torch.testing.assert_close(vd, vd0[idx], rtol=0, atol=0)
    # The reordered cache keeps working: append, attend over its rows.
    cache.append(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), None)
    if not cache.is_external():
        q = torch.randn(B, 2 * H, 1, D)
        kd, vd, lens = cache.dense(torch.float32)
        assert rel(cache.attend(q, None), attention_f64(q, kd, vd, lens, D ** -0.5)) < 1e-4


def test_reorder_bad_input():
    cache = make()
    with pytest.raises(RuntimeError, match="reorder\\(\\) before any append"):
        cache.reorder(torch.tensor([0]))
    cache.append(torch.randn(2, 2, 5, 64), torch.randn(2, 2, 5, 64), None)
    with pytest.raises(RuntimeError, match=r"beam_idx must be an integer tensor of shape \[2\]"):
        cache.reorder(torch.tensor([0, 1, 1]))
    with pytest.raises(RuntimeError, match=r"beam_idx must be an integer tensor"):
        cache.reorder(torch.tensor([0.0, 1.0]))
    with pytest.raises(RuntimeError, match=r"beam_idx\[1\] = 2 is outside \[0, 2\)"):
        cache.reorder(torch.tensor([0, 2]))


# ---- misuse ------------------------------------------------------------------------------------


def test_misuse_after_reset_and_bad_input():
    cache = make(sinks=2)
    cache.append(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), None)
    cache.reset()
    assert cache.lengths().tolist() == [] and cache.nbytes() == 0 and cache.used_nbytes() == 0
    for call, name in [(lambda: cache.attend(torch.randn(1, 2, 1, 64), None), "attend"),
                       (lambda: cache.dense(None), "dense"), (lambda: cache.reorder(torch.tensor([0])), "reorder")]:
        with pytest.raises(RuntimeError, match=f"{name}\\(\\) before any append\\(\\) \\(a new or reset cache"):
            call()
    with pytest.raises(RuntimeError, match="must be float32, float16 or bfloat16, got Long"):
        cache.append(torch.ones(1, 2, 3, 64, dtype=torch.long), torch.ones(1, 2, 3, 64, dtype=torch.long), None)
    with pytest.raises(RuntimeError, match="k and v must have one dtype, got Float and Half"):
        cache.append(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64).half(), None)
    with pytest.raises(RuntimeError, match=r"sinks must be in \[0, 2147483647\], got -1"):
        make(sinks=-1)
    cache.append(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64), None)
    with pytest.raises(RuntimeError, match=r"q must have shape \[1, q_heads, q_len, 64\]"):
        cache.attend(torch.randn(1, 2, 1, 32), None)
    with pytest.raises(RuntimeError, match="q must be float32, float16 or bfloat16"):
        cache.attend(torch.ones(1, 2, 1, 64, dtype=torch.long), None)


def test_torchscript_with_sinks():
    scripted = torch.jit.script(Decoder())
    a, b = make(sinks=3), make(sinks=3)
    for _ in range(3):
        k, v, q = torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64), torch.randn(1, 4, 20, 64)
        torch.testing.assert_close(scripted(q, k, v, a), Decoder()(q, k, v, b), rtol=0, atol=0)
