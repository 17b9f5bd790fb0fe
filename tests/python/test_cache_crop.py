"""KVCache.crop(length): keep the first `length` positions of every sequence (assisted and
prompt-lookup decoding cut rejected draft tokens).  Cuts in the tail, in the compressed
part (the survivors of the cut chunk come back dequantized into the tail: never dropped),
in the sinks; ragged batches; DGQ; a sliding window; external storage (crop_with)."""

import pytest
import torch

from nexuskv.cache import make_cache
from test_cache import attention_f64


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def filled(B=2, n=100, dtype=torch.float32, seed=0, pad=0, **kw):
    kw = dict(key_group_size=16, value_group_size=16, residual=8) | kw
    cache = make_cache(**kw)
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(B, n, dtype=torch.bool)
    valid[-1, :pad] = False
    cache.append(torch.randn(B, 2, n, 64, generator=g).to(dtype), torch.randn(B, 2, n, 64, generator=g).to(dtype),
                 valid)
    return cache


def still_attends(cache, seed=1, steps=5):
    """The cropped cache keeps working: appends, and attention equals float64 over its dense view."""
    g = torch.Generator().manual_seed(seed)
    B = cache.lengths().numel()
    for _ in range(steps):
        cache.append(torch.randn(B, 2, 1, 64, generator=g), torch.randn(B, 2, 1, 64, generator=g), None)
        q = torch.randn(B, 4, 1, 64, generator=g)
        K, V, lens = cache.dense(torch.float32)
        assert rel(cache.attend(q, None, None), attention_f64(q, K, V, lens, 0.125,
                                                              window=cache.window())) < 1e-4


@pytest.mark.parametrize("length, compressed, tail", [(95, 80, 15), (90, 80, 10), (85, 80, 5), (80, 80, 0),
                                                     (75, 64, 11), (64, 64, 0), (50, 48, 2), (3, 0, 3)])
@pytest.mark.parametrize("kw", [dict(), dict(key_dynamic=True, key_bits=3), dict(rotate=True, value_axis=-2)])
def test_crop_keeps_exactly_the_first_positions(length, compressed, tail, kw):
    cache = filled(**kw)  # 100 tokens: 80 compressed (chunks of 16), 20 in the tail
    assert cache.compressed_lengths().tolist() == [80, 80]
    K0, V0, _ = cache.dense(None)
    cache.crop(length)
    assert cache.lengths().tolist() == [length] * 2
    if kw.get("key_dynamic"):  # DGQ cuts where every head's segments allow it: at or before the chunk
        kept = cache.compressed_lengths().tolist()
        assert all(k <= compressed and k % 16 == 0 for k in kept)
    else:
        assert cache.compressed_lengths().tolist() == [compressed] * 2
    K, V, _ = cache.dense(None)
    # float32: the survivors of a cut chunk are its dequantized values, bit for bit
    torch.testing.assert_close(K, K0[:, :, :length], rtol=0, atol=0)
    torch.testing.assert_close(V, V0[:, :, :length], rtol=0, atol=0)
    assert cache.used_nbytes() <= cache.nbytes()
    still_attends(cache)


def test_crop_in_bf16_keeps_the_dequantized_values_rounded_to_bf16():
    cache = filled(dtype=torch.bfloat16)
    K0, _, _ = cache.dense(torch.float32)
    cache.crop(70)  # inside chunk [64, 80): 6 survivors go back to the bf16 tail
    K, _, _ = cache.dense(torch.float32)
    torch.testing.assert_close(K[:, :, :64], K0[:, :, :64], rtol=0, atol=0)
    torch.testing.assert_close(K[:, :, 64:70], K0[:, :, 64:70].bfloat16().float(), rtol=0, atol=0)


def test_crop_ragged_batch_and_sinks():
    cache = filled(B=3, pad=40, sinks=4)  # lengths 100, 100, 60
    cache.crop(70)
    assert cache.lengths().tolist() == [70, 70, 60]
    assert cache.compressed_lengths().tolist() == [64, 64, 48]  # 4 sinks + 64 + 2; the short one untouched
    still_attends(cache)
    cache.crop(2)  # into the sinks: compressed part and tail go
    assert cache.lengths().tolist() == [2, 2, 2] and cache.compressed_lengths().tolist() == [0, 0, 0]
    K, _, _ = cache.dense(None)
    still_attends(cache)  # the sinks fill up again first
    K2, _, _ = cache.dense(None)
    torch.testing.assert_close(K2[:, :, :2], K[:, :, :2], rtol=0, atol=0)
    assert cache.lengths().tolist() == [7, 7, 7]


def test_crop_of_draft_tokens_in_the_tail_is_exact():
    # Assisted decoding: 5 draft tokens are appended, 2 accepted, the rest cropped.
    a, b = filled(residual=16), filled(residual=16)
    g = torch.Generator().manual_seed(5)
    draft = torch.randn(2, 2, 5, 64, generator=g), torch.randn(2, 2, 5, 64, generator=g)
    a.append(*draft, None)
    a.crop(102)
    b.append(draft[0][:, :, :2], draft[1][:, :, :2], None)
    for x, y in zip(a.dense(None), b.dense(None)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    q = torch.randn(2, 4, 1, 64, generator=g)
    assert torch.equal(a.attend(q, None, None), b.attend(q, None, None))


def test_crop_bad_input_and_no_ops():
    cache = filled()
    with pytest.raises(RuntimeError, match="crop\\(\\) length must be >= 0, got -1"):
        cache.crop(-1)
    before = cache.state_dict()
    cache.crop(100)
    cache.crop(10 ** 9)
    after = cache.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    make_cache().crop(5)  # a new cache: nothing to cut
    cache.crop(0)
    assert cache.lengths().tolist() == [0, 0]
    still_attends(cache)


def test_crop_with_a_window():
    cache = make_cache(key_group_size=16, value_group_size=16, residual=4, window=20)
    g = torch.Generator().manual_seed(2)
    cache.append(torch.randn(1, 2, 100, 64, generator=g), torch.randn(1, 2, 100, 64, generator=g), None)
    cache.append(torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g), None)
    e = cache.evicted_lengths().item()
    assert e == 80  # positions < 100 - 20 + 1 = 81 are dead
    with pytest.raises(RuntimeError, match="would need positions the window already dropped"):
        cache.crop(e + 20 - 2)  # the next query at position 98 would see position 79
    cache.crop(e + 20 - 1)  # a query at position 99 sees positions 80.. on: all kept
    assert cache.lengths().tolist() == [19] and cache.evicted_lengths().tolist() == [80]
    still_attends(cache)


def test_crop_of_external_storage():
    cache = make_cache(external_chunk=16, residual=8)
    k, v = torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64)
    cache.append(k, v, None)
    _, _, ks, vs = cache.take_due_chunks()
    assert ks[0].shape[1] == 80
    cache.crop(96)  # in the tail: nothing of the front end's is needed
    assert cache.lengths().tolist() == [96]
    cache.crop(80)  # at a chunk boundary: no survivor to restore either
    assert cache.compressed_lengths().tolist() == [80]
    with pytest.raises(RuntimeError, match="inside a compressed chunk, whose tokens the front end holds; call "
                                           "crop_with"):
        cache.crop(70)
    with pytest.raises(RuntimeError, match="crop_with\\(\\) is not available with fused storage"):
        filled().crop_with(5, [], [])
    cache.crop_with(70, [ks[0]], [vs[0]])
    assert cache.lengths().tolist() == [70] and cache.compressed_lengths().tolist() == [64]
    kd, vd, _ = cache.dense_with([ks[0][:, :64]], [vs[0][:, :64]], None)
    torch.testing.assert_close(kd[0], k[0, :, :70], rtol=0, atol=0)
