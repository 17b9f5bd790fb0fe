"""The C++ KVCache (torch.classes.nexuskv.KVCache): policy (tail, chunks,
ragged appends, padding dropped), fused attention equal to attention over its
own dense view and to float64 attention over the reconstructed K/V, byte
accounting, misuse errors, TorchScript."""

import math

import pytest
import torch

from nexuskv.cache import make_cache
from nq_reference import F64


def make(bits=4, group=32, residual=16, key_outliers=0, dynamic=False, rotate=False, seed=0):
    return make_cache(key_bits=bits, key_group_size=group, key_outliers=key_outliers, key_dynamic=dynamic,
                      value_bits=bits, value_group_size=group, residual=residual, rotate=rotate, seed=seed)


def attention_f64(q, k, v, lens, scale, window=None, softcap=None):
    """Causal attention of the last q_len positions of each sequence over its first lens[b] tokens
    (optionally: each query sees only the `window` newest keys up to itself; scores soft-capped)."""
    B, Hq, Lq, D = q.shape
    g = Hq // k.shape[1]
    out = torch.zeros(B, Hq, Lq, D, dtype=F64)
    for b in range(B):
        L = int(lens[b])
        K, V = k[b, :, :L].to(F64).repeat_interleave(g, 0), v[b, :, :L].to(F64).repeat_interleave(g, 0)
        s = (q[b].to(F64) @ K.transpose(-1, -2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        key, query = torch.arange(L)[None, :], torch.arange(L - Lq, L)[:, None]
        hidden = key > query
        if window is not None:
            hidden |= key <= query - window
        s = s.masked_fill(hidden, -math.inf)
        out[b] = torch.softmax(s, -1) @ V
    return out


@pytest.mark.parametrize("kw", [dict(), dict(bits=2, key_outliers=1), dict(dynamic=True), dict(rotate=True),
                                dict(bits=8, group=64, residual=0)])
def test_decode_loop_matches_attention_over_its_dense_view(kw):
    torch.manual_seed(0)
    cache = make(**kw)
    B, H, D = 2, 2, 64
    k0, v0 = torch.randn(B, H, 50, D), torch.randn(B, H, 50, D)
    cache.append(k0, v0, None)
    for step in range(40):
        k, v = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
        cache.append(k, v, None)
        q = torch.randn(B, 4 * H, 1, D)
        out = cache.attend(q, None)
        kd, vd, lens = cache.dense(torch.float32)
        ref = attention_f64(q, kd, vd, lens, D ** -0.5)
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-4, step
    assert cache.lengths().tolist() == [90, 90]


def test_policy_tail_and_chunks():
    cache = make(group=32, residual=16)
    cache.append(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), None)
    # 40 tokens: nothing beyond residual 16 fills a chunk of 32 -> all in the tail.
    assert cache.lengths().tolist() == [40] and cache.chunk() == 32
    assert cache.compressed_lengths().tolist() == [0]
    cache.append(torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64), None)
    # 50 tokens: 32 compressed, 18 in the tail.
    assert cache.compressed_lengths().tolist() == [32] and cache.lengths().tolist() == [50]
    kd, _, _ = cache.dense(None)
    assert kd.shape == (1, 2, 50, 64)


def test_tail_tokens_are_exact_and_compressed_tokens_bounded():
    cache = make(bits=8, group=32, residual=16)
    k, v = torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64)
    cache.append(k, v, None)
    kd, vd, _ = cache.dense(None)
    torch.testing.assert_close(kd[:, :, 64:], k[:, :, 64:], rtol=0, atol=0)  # 100 - 64 = 36 >= residual
    assert (kd - k).abs().max() < 0.05 and (vd - v).abs().max() < 0.05


def test_ragged_batch_with_padding_dropped():
    cache = make(group=16, residual=8)
    k, v = torch.randn(2, 2, 60, 64), torch.randn(2, 2, 60, 64)
    valid = torch.ones(2, 60, dtype=torch.bool)
    valid[1, :25] = False  # left padding of sequence 1
    cache.append(k, v, valid)
    assert cache.lengths().tolist() == [60, 35]
    kd, _, lens = cache.dense(None)
    assert (kd[1, :, 35:] == 0).all()
    torch.testing.assert_close(kd[1, :, 16:35], k[1, :, 41:60], rtol=0, atol=0)  # the tail is exact
    q = torch.randn(2, 4, 1, 64)
    out = cache.attend(q, None)
    ref = attention_f64(q, *cache.dense(torch.float32)[:2], lens, 64 ** -0.5)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-4


def test_nbytes_counts_every_tensor_and_compresses():
    cache = make(bits=4, group=64, residual=128)
    cache.append(torch.randn(1, 4, 4096, 128, dtype=torch.bfloat16), torch.randn(1, 4, 4096, 128,
                                                                                  dtype=torch.bfloat16), None)
    dense_bytes = 2 * 4 * 4096 * 128 * 2
    assert cache.used_nbytes() <= cache.nbytes()
    assert cache.used_nbytes() / dense_bytes < 0.33  # 4.5-bit codes + a 128-token bf16 tail


def test_misuse_is_a_clear_error():
    cache = make()
    with pytest.raises(RuntimeError, match="before any append"):
        cache.attend(torch.randn(1, 2, 1, 64), None)
    cache.append(torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64), None)
    with pytest.raises(RuntimeError, match="built for one model and batch"):
        cache.append(torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64), None)
    with pytest.raises(RuntimeError, match="holds Float but k is BFloat16"):
        cache.append(torch.randn(1, 2, 1, 64, dtype=torch.bfloat16), torch.randn(1, 2, 1, 64, dtype=torch.bfloat16),
                     None)
    cache.reset()
    cache.append(torch.randn(1, 3, 5, 64), torch.randn(1, 3, 5, 64), None)  # usable again after reset
    assert cache.lengths().tolist() == [5]


class Decoder(torch.nn.Module):
    """A single-head-group attention step over a nexuskv cache, scriptable."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.classes.nexuskv.KVCache):
        cache.append(k, v, None)
        return cache.attend(q, None)


def test_torchscript_module_with_cache_argument():
    scripted = torch.jit.script(Decoder())
    a, b = make(), make()
    for _ in range(3):
        k, v, q = torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64), torch.randn(1, 4, 20, 64)
        torch.testing.assert_close(scripted(q, k, v, a), Decoder()(q, k, v, b), rtol=0, atol=0)
