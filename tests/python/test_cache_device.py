"""The cache follows its data (issue 10 section 3): it allocates on the device and in the
dtype of its first append (rotation signs too), refuses K/V, queries and masks of another
device or dtype, appends an equal-length batch with one compression per K and V (not a
loop over sequences) and gives the same result as caches of one sequence each.  CUDA
cases run where a GPU is present."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from nexuskv.cache import make_cache
from test_cache import attention_f64

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
KW = dict(key_group_size=16, value_group_size=16, residual=8)


def compress_calls(fn) -> int:
    """How often a compression operator (nq_compress, dgq_compress) ran inside fn()."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name in ("nexuskv::nq_compress", "nexuskv::dgq_compress") for e in prof.events())


@pytest.mark.parametrize("dynamic", [False, True])
def test_an_equal_length_batch_is_compressed_in_one_call(dynamic):
    B = 6
    cache = make_cache(key_dynamic=dynamic, **KW)
    k, v = torch.randn(B, 2, 100, 64), torch.randn(B, 2, 100, 64)
    assert compress_calls(lambda: cache.append(k, v, None)) == 2  # one for K, one for V
    assert cache.compressed_lengths().tolist() == [80] * B
    steps = 0
    for _ in range(32):  # decode steps: two chunks close, each compressed once for the batch
        steps += compress_calls(lambda: cache.append(torch.randn(B, 2, 1, 64), torch.randn(B, 2, 1, 64), None))
    assert steps == 4 and cache.compressed_lengths().tolist() == [112] * B
    # A ragged batch (left padding) is correct, one sequence at a time.
    ragged = make_cache(key_dynamic=dynamic, **KW)
    valid = torch.ones(B, 100, dtype=torch.bool)
    valid[2, :30] = False
    assert compress_calls(lambda: ragged.append(k, v, valid)) == 2 * B
    assert ragged.lengths().tolist() == [100, 100, 70, 100, 100, 100]


@pytest.mark.parametrize("kw", [dict(), dict(rotate=True, sinks=3), dict(window=30), dict(key_dynamic=True)])
def test_the_batch_path_equals_one_cache_per_sequence(kw):
    B, g = 4, torch.Generator().manual_seed(0)
    batch = make_cache(**KW, **kw)
    singles = [make_cache(**KW, **kw) for _ in range(B)]
    for n in [45, 1, 1, 3, 20, 1, 1, 1, 16, 1]:
        k, v = torch.randn(B, 2, n, 64, generator=g), torch.randn(B, 2, n, 64, generator=g)
        q = torch.randn(B, 4, n, 64, generator=g)
        batch.append(k, v, None)
        out = batch.attend(q, None, None)
        for b, single in enumerate(singles):
            single.append(k[b:b + 1], v[b:b + 1], None)
            torch.testing.assert_close(out[b:b + 1], single.attend(q[b:b + 1], None, None), rtol=1e-6, atol=1e-6)
    K, V, lens = batch.dense(None)
    for b, single in enumerate(singles):
        Ks, Vs, ls = single.dense(None)
        assert lens[b] == ls[0]
        torch.testing.assert_close(K[b:b + 1], Ks, rtol=0, atol=0)
        torch.testing.assert_close(V[b:b + 1], Vs, rtol=0, atol=0)
    assert batch.compressed_lengths().min() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_lives_where_its_first_append_was(device, dtype):
    cache = make_cache(rotate=True, sinks=2, **KW)
    k, v = torch.randn(2, 2, 60, 64, device=device, dtype=dtype), torch.randn(2, 2, 60, 64, device=device,
                                                                              dtype=dtype)
    cache.append(k, v, None)
    state = cache.state_dict()
    data = {name: t for name, t in state.items() if not name.startswith(("config.", "nexuskv.", "lengths.", "shape"))}
    assert data and all(t.device.type == device for t in data.values()), {n: t.device for n, t in data.items()}
    assert state["tail.k"].dtype == dtype and state["keys.scale"].dtype == dtype  # meta follows the K/V dtype
    q = torch.randn(2, 4, 1, 64, device=device, dtype=dtype)
    out = cache.attend(q, None, None)
    assert out.device.type == device and out.dtype == dtype
    K, V, lens = cache.dense(torch.float32)
    ref = attention_f64(q.cpu(), K.cpu(), V.cpu(), lens, 0.125)
    assert float((out.cpu().double() - ref).abs().max()) < (1e-4 if dtype == torch.float32 else 2e-2)
    with pytest.raises(RuntimeError, match=f"this cache holds {'Float' if dtype == torch.float32 else 'BFloat16'}"):
        other = torch.float16
        cache.append(k.to(other), v.to(other), None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixed_devices_are_a_clear_error():
    cache = make_cache(**KW)
    cache.append(torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64), None)  # CPU
    with pytest.raises(RuntimeError, match="k is on cuda:0 but the cache is on cpu"):
        cache.append(torch.randn(1, 2, 1, 64, device="cuda"), torch.randn(1, 2, 1, 64, device="cuda"), None)
    with pytest.raises(RuntimeError, match="q is on cuda:0 but the cache is on cpu"):
        cache.attend(torch.randn(1, 2, 1, 64, device="cuda"), None, None)
    with pytest.raises(RuntimeError, match="k and v must be on one device"):
        cache.append(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64, device="cuda"), None)
    cache.to("cuda")  # offload / prefetch
    cache.append(torch.randn(1, 2, 1, 64, device="cuda"), torch.randn(1, 2, 1, 64, device="cuda"), None)
    assert cache.attend(torch.randn(1, 2, 1, 64, device="cuda"), None, None).is_cuda


def test_k_and_v_of_one_shape_dtype_and_device():
    cache = make_cache(**KW)
    with pytest.raises(RuntimeError, match="k and v must have one shape"):
        cache.append(torch.randn(1, 2, 5, 64), torch.randn(1, 2, 6, 64), None)
    cache.append(torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64), None)
    with pytest.raises(RuntimeError, match="q must have shape \\[1, q_heads, q_len, 64\\]"):
        cache.attend(torch.randn(2, 2, 1, 64), None, None)
    noncontig = torch.randn(1, 64, 2, 5).permute(0, 2, 3, 1)  # a strided view is fine
    cache.append(noncontig, noncontig, None)
    K, _, _ = cache.dense(None)
    assert torch.equal(K[:, :, 5:10], noncontig)
