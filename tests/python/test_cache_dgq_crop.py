"""crop() of a cache with DGQ (data-driven) key groups, on valid use (outside review, round 3).

A compression of n tokens writes its segments into n / G slots, cut where the data changes,
so inside one compression segments do not end on chunk boundaries: a crop must cut where every
head has a segment boundary that is also a slot boundary, and restore the rest into the tail.
And once a crop shrinks the compressed part, the capacity behind it can be far longer than a
segment: the unused slots run there without being a segment that holds tokens."""

import pytest
import torch
from test_cache import attention_f64

from nexuskv.cache import from_state_dict, make_cache

DGQ = dict(key_dynamic=True, key_group_size=32, value_group_size=32)


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def assert_attends_like_float64(cache, seed=7, q_heads=1):
    g = torch.Generator().manual_seed(seed)
    B, H = cache.lengths().numel(), cache.dense(None)[0].shape[1]
    q = torch.randn(B, q_heads * H, 1, 64, generator=g)
    K, V, lens = cache.dense(torch.float32)
    out = cache.attend(q, None, None)
    assert rel(out, attention_f64(q, K, V, lens, 0.125, window=cache.window())) < 1e-4
    return out


def test_the_reviewed_sequence_attends_and_its_state_dict_restores():
    g = torch.Generator().manual_seed(25)
    c = make_cache(residual=16, **DGQ)
    for op, n in [("a", 48), ("a", 55), ("c", 100), ("a", 46), ("a", 78), ("c", 222), ("a", 36), ("a", 55), ("c", 54)]:
        if op == "c":
            c.crop(n)
        else:
            c.append(torch.randn(1, 1, n, 64, generator=g), torch.randn(1, 1, n, 64, generator=g), None)
    assert c.lengths().tolist() == [54]
    out = assert_attends_like_float64(c)
    restored = from_state_dict(c.state_dict())
    q = torch.randn(1, 1, 1, 64, generator=torch.Generator().manual_seed(7))
    assert torch.equal(restored.attend(q, None, None), out)


def test_crop_far_below_the_capacity_leaves_a_cache_that_attends():
    # 600 tokens compressed, then cut to 40: 560+ unused tokens of capacity behind one live segment.
    g = torch.Generator().manual_seed(1)
    c = make_cache(residual=0, **DGQ)
    c.append(torch.randn(2, 2, 640, 64, generator=g), torch.randn(2, 2, 640, 64, generator=g), None)
    c.crop(40)
    assert c.lengths().tolist() == [40, 40]
    assert_attends_like_float64(c, q_heads=2)
    c.append(torch.randn(2, 2, 5, 64, generator=g), torch.randn(2, 2, 5, 64, generator=g), None)
    assert_attends_like_float64(c, q_heads=2)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("residual", [5, 16])
def test_crop_inside_the_compressed_part_keeps_every_position(seed, residual):
    # The review's case: seed 0, residual 5, 70 tokens, crop(35) raised "got -16"; 15 of 40 seeds did.
    torch.manual_seed(seed)
    c = make_cache(residual=residual, **DGQ)
    n = 70 + 13 * (seed % 7) + (0 if residual == 5 else 40)
    c.append(torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64), None)
    assert int(c.compressed_lengths()[0]) >= 64
    K0, V0, _ = c.dense(None)
    length = 1 + (seed * 37) % int(c.compressed_lengths()[0])
    c.crop(length)
    assert c.lengths().tolist() == [length]
    assert int(c.compressed_lengths()[0]) % 32 == 0 and int(c.compressed_lengths()[0]) <= length
    K, V, _ = c.dense(None)
    # float32: the survivors are the dequantized values of the positions kept, bit for bit
    assert torch.equal(K, K0[:, :, :length]) and torch.equal(V, V0[:, :, :length])
    assert_attends_like_float64(c, q_heads=2)
    for step in range(3):  # it keeps taking tokens (the restored ones are compressed again)
        c.append(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), None)
        assert_attends_like_float64(c, seed=step, q_heads=2)
    restored = from_state_dict(c.state_dict())
    q = torch.randn(1, 2, 1, 64)
    assert torch.equal(restored.attend(q, None, None), c.attend(q, None, None))


def test_crop_through_the_hugging_face_layer():
    # Assisted decoding crops through NexusKVLayer.crop: the review saw 7 of 20 seeds raise.
    from nexuskv.hf import NexusKVLayer

    failures = []
    for seed in range(20):
        torch.manual_seed(seed)
        layer = NexusKVLayer(dict(residual=5, **DGQ), fused=False)
        k, v = torch.randn(1, 2, 70, 64), torch.randn(1, 2, 70, 64)
        layer.update(k, v)
        layer.crop(20 + seed)
        K, V = layer.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
        assert K.shape[2] == 21 + seed
        # the kept positions are the originals within the quantization error (4-bit keys per channel)
        if float((K[:, :, : 20 + seed] - k[:, :, : 20 + seed]).abs().max()) > 1.0:
            failures.append(seed)
    assert not failures


def test_crop_with_a_sliding_window_and_dgq_keys():
    g = torch.Generator().manual_seed(3)
    c = make_cache(residual=8, window=96, **DGQ)
    for n in (70, 33, 90, 41):
        c.append(torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g), None)
    positions = int(c.lengths()[0] + c.evicted_lengths()[0])
    assert int(c.evicted_lengths()[0]) > 0
    c.crop(positions - 30)
    assert_attends_like_float64(c, q_heads=2)
