"""The compressed cache and the Hugging Face binding on a GPU (issue 11 section 3):
appends compress on the device, attention is fused, a decode step reads nothing back to
the host, and generation with a CUDA model matches the dense cache.  Skipped without a
GPU (the CPU halves of these checks are in test_cache_*.py and test_hf_*.py).

Bounds.  The CUDA compress kernels are bit-identical to the CPU's for finite input, so a
CUDA cache and a CPU cache fed the same K/V hold the same codes; their attention differs
only by float32 summation order (< 1e-4 relative to max |V| for fp32).  8-bit end to end
on tiny models: the bound of test_hf_matrix (0.05 of the logits' std), measured there
<= 0.03 on the CPU."""

import pytest
import torch
from devices import requires_cuda
from test_cache import attention_f64

# hf_helpers (through nexuskv.hf_compat) and the tiny models need it.
pytest.importorskip("transformers", reason="transformers is not installed")
from hf_helpers import compressed, forward, greedy, tiny_model
from nexuskv.cache import make_cache

pytestmark = requires_cuda
KW = dict(key_group_size=16, value_group_size=16, residual=8)


def _state_devices(cache) -> set:
    state = cache.state_dict()
    data = [t for n, t in state.items() if not n.startswith(("config.", "nexuskv.", "lengths.", "shape"))]
    assert data
    return {t.device.type for t in data}


@pytest.mark.parametrize("kw", [dict(), dict(rotate=True, sinks=3), dict(window=30), dict(key_dynamic=True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cuda_cache_holds_what_a_cpu_cache_holds(kw, dtype):
    g = torch.Generator().manual_seed(0)
    caches = {d: make_cache(**KW, **kw) for d in ("cpu", "cuda")}
    for n in [45, 1, 1, 3, 20, 1, 17, 1]:
        k, v = torch.randn(2, 2, n, 64, generator=g).to(dtype), torch.randn(2, 2, n, 64, generator=g).to(dtype)
        q = torch.randn(2, 4, 1, 64, generator=g).to(dtype)
        out = {}
        for d, c in caches.items():
            c.append(k.to(d), v.to(d), None)
            out[d] = c.attend(q.to(d), None, None)
        assert out["cuda"].is_cuda and not out["cuda"].isnan().any()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert float((out["cuda"].cpu().float() - out["cpu"].float()).abs().max()) < tol
    assert _state_devices(caches["cuda"]) == {"cuda"}
    assert caches["cuda"].compressed_lengths().min() > 0
    assert caches["cuda"].compressed_lengths().tolist() == caches["cpu"].compressed_lengths().tolist()
    s_cpu, s_cuda = caches["cpu"].state_dict(), caches["cuda"].state_dict()
    live = int(caches["cpu"].compressed_lengths().min())
    for name in ("keys.codes", "values.codes"):  # the same bytes, compressed on either device
        assert torch.equal(s_cuda[name][:, :, :live].cpu(), s_cpu[name][:, :, :live]), name
    K, V, lens = caches["cuda"].dense(torch.float32)
    ref = attention_f64(q.float(), K.cpu(), V.cpu(), lens, 0.125)
    if not kw.get("window"):
        assert float((out["cuda"].cpu().double() - ref).abs().max()) < (1e-4 if dtype == torch.float32 else 2e-2)


def test_a_decode_step_of_the_cache_never_synchronizes():
    cache = make_cache(**KW)
    cache.append(torch.randn(2, 2, 40, 64, device="cuda"), torch.randn(2, 2, 40, 64, device="cuda"), None)
    q = torch.randn(2, 4, 1, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):  # crosses a chunk boundary: a compression on the device
            cache.append(torch.randn(2, 2, 1, 64, device="cuda"), torch.randn(2, 2, 1, 64, device="cuda"), None)
            cache.attend(q, None, None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert cache.compressed_lengths().tolist() == [48, 48]


def test_non_finite_kv_on_cuda_gives_nan_rows_or_the_cpu_error_with_checks(monkeypatch):
    k = torch.randn(1, 2, 40, 64, device="cuda")
    k[0, 0, 3, 5] = float("nan")
    cache = make_cache(**KW)
    cache.append(k, torch.randn(1, 2, 40, 64, device="cuda"), None)
    out = cache.attend(torch.randn(1, 4, 1, 64, device="cuda"), None, None)
    assert out[0, :2].isnan().all() and not out[0, 2:].isnan().any()  # kv head 0 serves q heads 0, 1
    monkeypatch.setenv("NEXUSKV_CUDA_CHECKS", "1")
    with pytest.raises(RuntimeError, match="k holds NaN"):
        make_cache(**KW).append(k, torch.randn(1, 2, 40, 64, device="cuda"), None)


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma2"])
def cuda_model(request):
    model = tiny_model(request.param).to("cuda")
    ids = torch.randint(3, 256, (1, 67), generator=torch.Generator().manual_seed(1)).to("cuda")
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(ids).logits
    return request.param, model, ids, ref


def test_hf_8bit_on_cuda_within_the_cpu_bound_and_paths_agree(cuda_model):
    import nexuskv.hf as nhf

    name, model, ids, ref = cuda_model
    runs = {}
    for path, impl in (("fused", "nexuskv"), ("dequantize", "eager")):
        model.set_attn_implementation(impl)
        cache = nhf.cache_for(model, bits=8, group_size=8, residual=8)
        with torch.no_grad():
            out = [forward(model, ids[:, :64], cache).logits]
            out += [forward(model, ids[:, t : t + 1], cache).logits for t in range(64, ids.shape[1])]
        runs[path] = torch.cat(out, 1)
        assert runs[path].is_cuda and compressed(cache) > 0
        assert all(_state_devices(layer.cache) == {"cuda"} for layer in cache.layers)
        rel = float((runs[path] - ref).abs().max() / ref.std())
        assert rel < 0.05, (name, path, rel)
    assert float((runs["fused"] - runs["dequantize"]).abs().max() / ref.std()) < 2e-3, name


def test_hf_generate_on_cuda_matches_the_dense_cache(cuda_model):
    import nexuskv.hf as nhf

    name, model, ids, _ = cuda_model
    model.set_attn_implementation("eager")
    dense = greedy(model, ids[:, :64], 6)
    model.set_attn_implementation("nexuskv")
    cache = nhf.cache_for(model, bits=8, group_size=16, residual=1024)
    assert greedy(model, ids[:, :64], 6, cache).tolist() == dense.tolist(), name
    cache = nhf.cache_for(model, bits=8, group_size=8, residual=8)
    ours = greedy(model, ids[:, :64], 6, cache)
    assert ours.is_cuda and compressed(cache) > 0
    assert (ours == dense).float().mean() >= 0.5, (name, ours.tolist(), dense.tolist())
