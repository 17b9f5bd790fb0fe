"""A KVCache with a sliding window (window=W: the query at position p sees keys
(p - W, p]): attention equal to float64 windowed attention over the whole history,
whole compressed chunks dropped once no current or future query can see them, bytes
bounded by the window (not by the tokens appended), logit soft-capping."""

import pytest
import torch

from nexuskv.cache import make_cache
from test_cache import attention_f64


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def feed_both(windowed, full, steps, B=2, H=2, D=64, seed=0, prefill=50, pad=20):
    """The same tokens into a windowed cache and into a cache without window (which keeps the
    whole history, quantized the same way); yields (q, windowed output, full dense view)."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(B, prefill, dtype=torch.bool)
    valid[-1, :pad] = False
    k, v = torch.randn(B, H, prefill, D, generator=g), torch.randn(B, H, prefill, D, generator=g)
    for c in (windowed, full):
        c.append(k, v, valid)
    for step in range(steps):
        n = 3 if step % 7 == 0 else 1
        k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
        q = torch.randn(B, 2 * H, n, D, generator=g)
        for c in (windowed, full):
            c.append(k, v, None)
        yield q, n, windowed.attend(q, None, None), full.dense(torch.float32)


@pytest.mark.parametrize("kw", [dict(), dict(key_dynamic=True, key_bits=3), dict(rotate=True, value_axis=-2),
                                dict(residual=0), dict(residual=40)])
def test_windowed_attention_equals_float64_over_the_whole_history(kw):
    W = 24
    base = dict(key_group_size=16, value_group_size=16, residual=4) | kw
    windowed, full = make_cache(window=W, **base), make_cache(**base)
    for q, n, out, (K, V, lens) in feed_both(windowed, full, 60):
        assert rel(out, attention_f64(q, K, V, lens, 64 ** -0.5, window=W)) < 1e-4
        # What the window dropped is whole chunks no query of this append could see.
        before = windowed.lengths() + windowed.evicted_lengths() - n
        assert (windowed.evicted_lengths() % 16 == 0).all()
        assert (windowed.evicted_lengths() <= (before - W + 1).clamp(min=0)).all()
        assert (windowed.lengths() >= W - 1 + n).all() or (windowed.evicted_lengths() == 0).all()
    assert (windowed.lengths() + windowed.evicted_lengths() == full.lengths()).all()
    assert windowed.evicted_lengths().min() > 0 and full.evicted_lengths().max() == 0
    if base["residual"] < W:
        assert windowed.compressed_lengths().min() > 0  # the compressed path took part


def test_dense_of_a_windowed_cache_is_the_newest_cached_tokens():
    windowed, full = make_cache(window=20, key_group_size=16, value_group_size=16, residual=4), \
        make_cache(key_group_size=16, value_group_size=16, residual=4)
    for _ in feed_both(windowed, full, 30):
        pass
    Kw, Vw, lw = windowed.dense(None)
    Kf, Vf, lf = full.dense(None)
    e = windowed.evicted_lengths()
    for b in range(2):
        torch.testing.assert_close(Kw[b, :, :lw[b]], Kf[b, :, e[b]:lf[b]], rtol=0, atol=0)
        torch.testing.assert_close(Vw[b, :, :lw[b]], Vf[b, :, e[b]:lf[b]], rtol=0, atol=0)


def test_bytes_are_bounded_by_the_window_not_the_tokens():
    # 4096 tokens of bf16 K/V, window 256, 4-bit: the dense window cache of transformers
    # (DynamicSlidingWindowLayer) holds the newest W - 1 tokens in bf16.
    H, D, W = 2, 128, 256
    dense_window = 2 * H * (W - 1) * D * 2
    g = torch.Generator().manual_seed(0)

    def kv(n):
        return (torch.randn(1, H, n, D, generator=g).bfloat16(), torch.randn(1, H, n, D, generator=g).bfloat16())

    for prefill in (1, 1024):  # token by token, and a long prefill first (its buffers must shrink again)
        cache = make_cache(key_group_size=32, value_group_size=32, residual=0, window=W)
        cache.append(*kv(prefill), None)
        sizes = {}
        for t in range(prefill, 4096):
            cache.append(*kv(1), None)
            if t + 1 in (2048, 3000, 4096):
                sizes[t + 1] = cache.nbytes()
        # Steady state: nothing grows with the tokens.  The bf16 tail's buffer follows its fill
        # (0..31 tokens: residual 0, chunks of 32), so sizes at the same point of the chunk
        # cycle are equal and the others differ by at most 32 tokens of K and V.
        assert sizes[2048] == sizes[4096], sizes
        assert max(sizes.values()) - min(sizes.values()) <= 2 * H * 32 * D * 2, sizes
        assert cache.lengths().item() + cache.evicted_lengths().item() == 4096
        assert cache.nbytes() < 0.5 * dense_window, (cache.nbytes(), dense_window)
        assert cache.used_nbytes() <= cache.nbytes()


def test_window_with_sinks_is_rejected():
    with pytest.raises(RuntimeError, match="a sliding window \\(window=8\\) needs sinks=0"):
        make_cache(window=8, sinks=4)
    for bad in (0, -3, 2 ** 31):
        with pytest.raises(RuntimeError, match="window must be in \\[1, 2147483647\\]"):
            make_cache(window=bad)


@pytest.mark.parametrize("window", [None, 12])
def test_softcap_is_passed_to_the_kernel(window):
    cache = make_cache(key_group_size=16, value_group_size=16, residual=4, window=window)
    g = torch.Generator().manual_seed(3)
    cache.append(torch.randn(2, 2, 40, 64, generator=g), torch.randn(2, 2, 40, 64, generator=g), None)
    q = 4 * torch.randn(2, 4, 2, 64, generator=g)  # large scores: the cap matters
    K, V, lens = cache.dense(torch.float32)
    capped = cache.attend(q, None, 5.0)
    assert rel(capped, attention_f64(q, K, V, lens, 0.125, window=window, softcap=5.0)) < 1e-4
    assert rel(cache.attend(q, None, None), attention_f64(q, K, V, lens, 0.125, window=window)) < 1e-4
    assert rel(capped, attention_f64(q, K, V, lens, 0.125, window=window)) > 1e-2
    with pytest.raises(RuntimeError, match="softcap must be finite and > 0"):
        cache.attend(q, None, 0.0)


def test_external_storage_never_hands_over_dead_chunks():
    cache = make_cache(external_chunk=8, residual=2, window=10)
    k, v = torch.randn(1, 1, 100, 64), torch.randn(1, 1, 100, 64)
    cache.append(k[:, :, :60], v[:, :, :60], None)  # a prefill: its own queries see everything
    seq, off, ks, _ = cache.take_due_chunks()
    assert off.tolist() == [0] and ks[0].shape[1] == 56
    cache.append(k[:, :, 60:61], v[:, :, 60:61], None)
    # Positions < 60 - 10 + 1 = 51 are dead: chunks [0, 48) dropped; nothing new is due.
    assert cache.evicted_lengths().tolist() == [48] and cache.compressed_lengths().tolist() == [8]
    cache.append(k[:, :, 61:90], v[:, :, 61:90], None)
    seq, off, ks, _ = cache.take_due_chunks()
    # Tail 5 + 29 new: [56, 88) leaves it; 61 positions before, so only < 52 is dead.
    assert off.tolist() == [56] and ks[0].shape[1] == 32
    torch.testing.assert_close(ks[0], k[0, :, 56:88], rtol=0, atol=0)
    assert cache.evicted_lengths().tolist() == [48]


def test_chunks_dead_on_arrival_are_never_compressed():
    # A tail longer than the window: tokens leave it already out of every query's sight.
    cache = make_cache(external_chunk=8, residual=30, window=10)
    k, v = torch.randn(1, 1, 81, 64), torch.randn(1, 1, 81, 64)
    cache.append(k[:, :, :60], v[:, :, :60], None)
    assert cache.take_due_chunks()[1].tolist() == [0]  # [0, 24): the prefill's queries see them
    cache.append(k[:, :, 60:61], v[:, :, 60:61], None)
    assert cache.evicted_lengths().tolist() == [24] and cache.compressed_lengths().tolist() == [0]
    cache.append(k[:, :, 61:81], v[:, :, 61:81], None)
    # [24, 48) leaves the tail, but positions < 61 - 10 + 1 = 52 are dead: dropped, not handed over.
    assert cache.take_due_chunks()[0].numel() == 0
    assert cache.evicted_lengths().tolist() == [48] and cache.lengths().tolist() == [33]
    kd, _, _ = cache.dense_with([torch.empty(1, 0, 64)], [torch.empty(1, 0, 64)], None)
    torch.testing.assert_close(kd[0], k[0, :, 48:], rtol=0, atol=0)
