"""The whole transformers Cache contract through generate(), on tiny randomly
initialized models (no downloads): crop (prompt-lookup and assisted decoding),
copy.deepcopy (prompt reuse), offload / prefetch, batch reorder / repeat / select,
reset; the one-line way in (enable), the one-time warnings, tensor-parallel shards,
and the settings cache_for refuses up front.  Nothing compressed means exact: the
results must equal transformers' own dense cache token for token."""

import copy
import warnings

import pytest
import torch

from hf_helpers import WINDOW, forward, greedy, tiny_model

N = 12  # new tokens


@pytest.fixture(scope="module", params=["llama", "mistral"])  # full attention; sliding window
def tiny(request):
    model = tiny_model(request.param)
    # A prompt that repeats itself, so that prompt lookup proposes (and rejects) drafts.
    pattern = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    ids = pattern.repeat(1, 4)
    return request.param, model, ids


def _dense(model, ids, n=N, **kw):
    model.set_attn_implementation("eager")
    try:
        return greedy(model, ids, n, **kw)
    finally:
        model.set_attn_implementation("nexuskv")


def _count_calls(monkeypatch, name):
    import nexuskv.hf as nhf

    calls = []
    original = getattr(nhf.NexusKVLayer, name)

    def spy(self, *a, **kw):
        calls.append(a)
        return original(self, *a, **kw)

    monkeypatch.setattr(nhf.NexusKVLayer, name, spy)
    return calls


@pytest.mark.parametrize("fused", [True, False])
def test_prompt_lookup_decoding_crops_the_cache(tiny, fused, monkeypatch):
    import nexuskv.hf as nhf

    name, model, ids = tiny
    model.set_attn_implementation("nexuskv")
    crops = _count_calls(monkeypatch, "crop")
    cache = nhf.cache_for(model, bits=8, group_size=8, residual=1024, fused=fused)
    ours = greedy(model, ids, N, cache, prompt_lookup_num_tokens=4)[:, :N]  # 4.57 may accept one draft more
    assert crops, "prompt lookup never cropped"
    assert ours.tolist() == _dense(model, ids).tolist(), name
    assert cache.get_seq_length() >= ids.shape[1] + N - 1


def test_assisted_decoding_with_a_compressed_cache(tiny, monkeypatch):
    """An assistant model drafts tokens; the main model's compressed cache is cropped
    after each rejection.  8-bit with a short tail: the crops cut into compressed chunks
    (their tokens return to the tail dequantized), so the result is compared with the
    same cache without an assistant."""
    import nexuskv.hf as nhf

    name, model, ids = tiny
    assistant = tiny_model("llama", seed=1)
    crops = _count_calls(monkeypatch, "crop")
    plain = greedy(model, ids, N, nhf.cache_for(model, bits=8, group_size=8, residual=8))
    cache = nhf.cache_for(model, bits=8, group_size=8, residual=8)
    ours = greedy(model, ids, N, cache, assistant_model=assistant)[:, :N]
    assert crops and int(cache.layers[0].cache.compressed_lengths()[0]) > 0
    assert (ours == plain).float().mean() >= 0.75, (ours, plain)
    assert cache.get_seq_length() >= ids.shape[1] + N - 1


def test_crop_is_exact_when_nothing_is_compressed(tiny):
    import nexuskv.hf as nhf

    name, model, ids = tiny
    for fused in (True, False):
        model.set_attn_implementation("nexuskv" if fused else "eager")
        a = nhf.cache_for(model, bits=8, residual=1024)
        b = nhf.cache_for(model, bits=8, residual=1024)
        with torch.no_grad():
            forward(model, ids, a)
            forward(model, ids[:, :40], b)
            a.crop(40 if not _crop_takes_removal() else 40 - ids.shape[1])
            assert a.get_seq_length() == b.get_seq_length() == 40
            la = forward(model, ids[:, 40:44], a).logits
            lb = forward(model, ids[:, 40:44], b).logits
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-5)
    model.set_attn_implementation("nexuskv")


def _crop_takes_removal():
    from nexuskv import hf_compat

    return hf_compat.CROP_TAKES_TOKENS_TO_REMOVE


def test_deepcopy_reuses_a_prompt_cache(tiny):
    """transformers' prompt-reuse recipe: prefill a shared prefix once, deepcopy the
    cache for each continuation; each equals a fresh run over the whole prompt."""
    import nexuskv.hf as nhf

    name, model, ids = tiny
    prefix = ids[:, :30]
    shared = nhf.cache_for(model, bits=8, group_size=8, residual=8)
    with torch.no_grad():
        forward(model, prefix, shared)
    before = shared.get_seq_length()
    for tail in (ids[:, 30:36], ids[:, 30:33]):
        prompt = torch.cat([prefix, tail], 1)
        reused = greedy(model, prompt, 6, copy.deepcopy(shared))
        fresh = greedy(model, prompt, 6, nhf.cache_for(model, bits=8, group_size=8, residual=8))
        assert reused.tolist() == fresh.tolist()
    assert shared.get_seq_length() == before  # the copies left the original alone


def test_offload_and_prefetch_between_steps(tiny):
    import nexuskv.hf as nhf

    name, model, ids = tiny
    a = nhf.cache_for(model, bits=8, group_size=8, residual=8)
    b = nhf.cache_for(model, bits=8, group_size=8, residual=8)
    with torch.no_grad():
        forward(model, ids, a)
        forward(model, ids, b)
        for i in range(len(b.layers)):
            b.layers[i].offload()
            assert b.layers[i].cache.lengths().device.type == "cpu"
            b.layers[i].prefetch()
        nxt = ids[:, -1:]
        torch.testing.assert_close(forward(model, nxt, a).logits, forward(model, nxt, b).logits, rtol=0, atol=0)


def test_beam_search_and_batch_reshaping(tiny):
    import nexuskv.hf as nhf

    name, model, ids = tiny
    cache = nhf.cache_for(model, bits=8, residual=1024)
    assert greedy(model, ids, 8, cache, num_beams=3).tolist() == _dense(model, ids, 8, num_beams=3).tolist()
    # batch_repeat_interleave / batch_select_indices (used by generation utilities) keep rows intact.
    c = nhf.cache_for(model, bits=8, group_size=8, residual=8)
    with torch.no_grad():
        forward(model, torch.cat([ids, ids.flip(1)]), c)
    k0, _, _ = c.layers[0].cache.dense(None)
    c.batch_repeat_interleave(2)
    k1, _, _ = c.layers[0].cache.dense(None)
    torch.testing.assert_close(k1, k0.repeat_interleave(2, 0), rtol=0, atol=0)
    c.batch_select_indices(torch.tensor([1, 2]))
    k2, _, _ = c.layers[0].cache.dense(None)
    torch.testing.assert_close(k2, k0, rtol=0, atol=0)


def test_reset_makes_the_cache_reusable(tiny):
    import nexuskv.hf as nhf

    name, model, ids = tiny
    cache = nhf.cache_for(model, bits=8, group_size=8, residual=8)
    first = greedy(model, ids, 6, cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.layers[0].cache.lengths().numel() == 0
    assert greedy(model, ids, 6, cache).tolist() == first.tolist()


def test_enable_is_the_one_line_way_in(tiny):
    import nexuskv.hf as nhf
    from nexuskv import hf_compat

    name, model, ids = tiny
    model = copy.deepcopy(model)
    model.set_attn_implementation("eager")
    nhf.enable(model, bits=8, residual=1024)
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    cache = hf_compat.output_cache(out)
    assert isinstance(cache, nhf.NexusKVCache) and cache.layers[0]._fused_now()
    assert out.sequences[:, ids.shape[1] :].tolist() == _dense(model, ids, 6).tolist()
    with pytest.raises(ValueError, match="cache_for: group_size must be in"):  # checked at enable()
        nhf.enable(model, bits=4, group_size=512)


def test_nexuskv_attention_over_a_dense_cache_warns_once(tiny):
    import nexuskv.hf as nhf

    name, model, ids = tiny
    nhf._warned.discard("dense")
    model.set_attn_implementation("nexuskv")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = greedy(model, ids, 4)  # transformers' own DynamicCache
    assert sum("do not come from a fused nexuskv cache" in str(w.message) for w in caught) == 1
    assert ours.tolist() == _dense(model, ids, 4).tolist()


def test_tensor_parallel_shards_give_their_kv_heads(tiny):
    import nexuskv.hf as nhf

    name, model, ids = tiny
    g = nhf.hf_compat.layer_geometries(model)[0]
    H, D = g.kv_heads, g.key_dim
    shard = torch.randn(1, H // 2, 5, D), torch.randn(1, H // 2, 5, D)
    for cache in (
        nhf.cache_for(model, kv_heads=H // 2, fused=False),
        nhf.cache_for(model, kv_heads="auto", fused=False),
    ):
        k, _ = cache.update(*shard, 0)
        assert k.shape == (1, H // 2, 5, D)
    with pytest.raises(ValueError, match=f"made for a model with {H} KV heads"):
        nhf.cache_for(model, fused=False).update(*shard, 0)


def test_sliding_layers_hold_bytes_bounded_by_the_window():
    """The issue's measurement, in small: a sliding layer's bytes stop growing with the
    tokens appended (whole compressed chunks out of the window are evicted)."""
    import nexuskv.hf as nhf

    model = tiny_model("mistral")
    cache = nhf.cache_for(model, bits=4, group_size=8, residual=8, fused=False)
    g = torch.Generator().manual_seed(0)
    used = []
    for _ in range(8):
        k = torch.randn(1, 2, 32, 16, generator=g)
        cache.update(k, k.clone(), 0)
        used.append(cache.layers[0].cache.used_nbytes())
    live = cache.layers[0].cache.lengths() + 0
    assert int(cache.layers[0].cache.evicted_lengths()[0]) > 0
    assert int(live[0]) <= WINDOW + 32 + 8 + 8  # window + the newest append + tail + one chunk
    assert used[-1] == used[-2] == used[-3]


def test_unsupported_settings_fail_in_cache_for():
    import nexuskv.hf as nhf

    model = tiny_model("llama")
    model.config.v_head_dim = 8  # an MLA-style model: K and V of different head dims
    with pytest.raises(ValueError, match="different head dims"):
        nhf.cache_for(model)
    del model.config.v_head_dim
    odd = tiny_model("phi")  # head_dim 80: no Hadamard rotation (a power of two is needed)
    with pytest.raises(ValueError, match="layer 0 .*head_dim 80.*power of two"):
        nhf.cache_for(odd, rotate=True, group_size=16, value_group_size=16)
    # head_dim 40: not a multiple of 16, so not for the fused kernel; the dequantize path takes it.
    model = tiny_model("llama")
    model.config.update(dict(hidden_size=80, num_attention_heads=2, num_key_value_heads=2, head_dim=40))
    with pytest.raises(ValueError, match="head_dim 40.*fused attention kernel cannot take.*fused=False"):
        nhf.cache_for(model, group_size=8, value_group_size=8)
    nhf.cache_for(model, group_size=8, value_group_size=8, fused=False)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(value_group_size=0), "value_group_size must be in"),  # once silently taken as group_size
        (dict(value_bits=0), "value_bits must be one of"),  # once silently taken as bits
        (dict(kv_heads=0), "kv_heads must be a positive int"),  # once accepted: a cache for 0 heads
        (dict(kv_heads=-1), "kv_heads must be a positive int"),
        (dict(kv_heads="some"), "kv_heads must be a positive int"),  # once "invalid literal for int()"
    ],
)
def test_bad_cache_for_arguments_are_clear_errors(kw, message):
    import nexuskv.hf as nhf

    with pytest.raises((ValueError, RuntimeError), match=message):
        nhf.cache_for(tiny_model("llama"), **kw)


def test_cache_for_something_that_is_not_a_model():
    import nexuskv.hf as nhf

    with pytest.raises(TypeError, match="cache_for needs a transformers model"):
        nhf.cache_for("llama")


def filled_layer():
    import nexuskv.hf as nhf

    layer = nhf.NexusKVLayer(dict(key_group_size=16, value_group_size=16, residual=16), fused=False)
    layer.update(torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64))
    return layer


@pytest.mark.parametrize(
    "indices, error",
    [
        (torch.tensor([5]), IndexError),  # once "index out of range in self"
        (torch.tensor([-1]), IndexError),
        (torch.tensor([0.5]), ValueError),  # once truncated to row 0 silently
        (torch.tensor([[0]]), ValueError),
    ],
)
def test_bad_batch_indices_are_clear_errors(indices, error):
    layer = filled_layer()
    with pytest.raises(error, match="nexuskv: batch indices must"):
        layer.batch_select_indices(indices)
    assert layer.cache.lengths().tolist() == [40, 40]


@pytest.mark.parametrize("repeats", [0, -1, 1.5])
def test_bad_repeats_are_clear_errors(repeats):
    # 0 once failed inside from_state_dict ("shape must be positive"), 1.5 inside torch.
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        filled_layer().batch_repeat_interleave(repeats)


@pytest.mark.parametrize("layers", [0, -1])
def test_nexuskv_cache_needs_a_layer(layers):
    import nexuskv.hf as nhf

    with pytest.raises(ValueError, match="needs layers >= 1"):  # -1 once gave a cache of no layers
        nhf.NexusKVCache(layers)
