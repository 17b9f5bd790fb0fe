"""The architecture matrix: tiny randomly initialized models of the common
architectures (built locally, no downloads), with their sliding windows, hybrid layer
types and soft-caps, run through the nexuskv cache on both paths (fused: attention
"nexuskv"; dequantize: eager attention over the cache's dense K/V) against transformers'
own eager attention without a cache.

Bounds.  Nothing compressed: both paths compute exact attention in float32 over the
same K/V, so logits agree to float32 rounding, < 1e-4 of the logits' standard
deviation (measured <= 8e-6).  8-bit (groups of 8 tokens / channels, 8-token tail):
every cached element is within scale/2 = range/510 of the model's own, an error the
network then carries to the logits; measured <= 0.03 of the logits' std on every
architecture here (random weights, initializer_range 0.02; Gemma 3 the largest), bound
0.05.  The two paths compute each layer's attention over the same
compressed data to float32 rounding, but a 1e-6 difference in one layer's output can
flip a rounding of the next layer's 8-bit codes (one step, range/255, in one element):
end to end they agree within 2e-3 (measured <= 8.5e-4, Qwen3)."""

import pytest
import torch
from transformers import AttentionInterface

from hf_helpers import ARCHITECTURES, WINDOW, compressed, forward, tiny_model

PROMPT_LEN, DECODE = 64, 3  # the prompt runs past the 32-token windows


def _rel(a, ref):
    return float((a.float() - ref.float()).abs().max() / ref.float().std())


def _full_causal_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """What attention that ignores the window and the soft-cap computes (the old bug)."""
    from nexuskv.hf import dense_attention

    return dense_attention(query, key, value, None, scaling, None), None


AttentionInterface.register("test_full_causal", _full_causal_attention)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request):
    model = tiny_model(request.param)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (1, PROMPT_LEN + DECODE), generator=g)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(ids).logits
    return request.param, model, ids, ref


def _run(model, ids, cache):
    """Prefill PROMPT_LEN tokens, then DECODE single-token steps: logits of every position."""
    with torch.no_grad():
        out = [forward(model, ids[:, :PROMPT_LEN], cache).logits]
        for t in range(PROMPT_LEN, ids.shape[1]):
            out.append(forward(model, ids[:, t : t + 1], cache).logits)
    return torch.cat(out, 1)


def _paths(model):
    yield "fused", "nexuskv"
    yield "dequantize", "eager"


def test_windows_and_softcaps_matter(arch):
    """The matrix can fail: on the windowed / soft-capped configs, attention that ignores
    them is far from the reference."""
    name, model, ids, ref = arch
    if name not in ("qwen2", "mistral", "gemma2", "gemma3"):
        pytest.skip("no window or soft-cap")
    with torch.no_grad():
        model.set_attn_implementation("test_full_causal")
        wrong = model(ids).logits
    assert _rel(wrong, ref) > 0.1


def test_nothing_compressed_equals_the_dense_reference(arch):
    import nexuskv.hf as nhf

    name, model, ids, ref = arch
    for path, impl in _paths(model):
        model.set_attn_implementation(impl)
        cache = nhf.cache_for(model, bits=8, group_size=16, residual=1024)
        got = _run(model, ids, cache)
        assert compressed(cache) == 0
        assert _rel(got, ref) < 1e-4, (name, path, _rel(got, ref))


def test_8bit_within_its_bound_and_paths_agree(arch):
    import nexuskv.hf as nhf

    name, model, ids, ref = arch
    runs = {}
    for path, impl in _paths(model):
        model.set_attn_implementation(impl)
        cache = nhf.cache_for(model, bits=8, group_size=8, residual=8)
        runs[path] = _run(model, ids, cache)
        for layer in cache.layers:  # every layer holds compressed tokens; sliding ones evicted some
            assert int(layer.cache.compressed_lengths()[0]) > 0
            assert (int(layer.cache.evicted_lengths()[0]) > 0) == layer.is_sliding
        assert _rel(runs[path], ref) < 0.05, (name, path, _rel(runs[path], ref))
    assert _rel(runs["fused"], runs["dequantize"]) < 2e-3, name


def test_greedy_generation_matches_the_dense_cache(arch):
    import nexuskv.hf as nhf
    from hf_helpers import greedy

    name, model, ids, ref = arch
    prompt = ids[:, :PROMPT_LEN]
    model.set_attn_implementation("eager")
    dense = greedy(model, prompt, 6)
    for path, impl in _paths(model):
        model.set_attn_implementation(impl)
        ours = greedy(model, prompt, 6, nhf.cache_for(model, bits=8, group_size=16, residual=1024))
        assert ours.tolist() == dense.tolist(), (name, path)


def test_layer_windows_follow_the_config(arch):
    import nexuskv.hf as nhf

    name, model, _, _ = arch
    cache = nhf.cache_for(model)
    expected = {
        "qwen2": [None, WINDOW],
        "mistral": [WINDOW, WINDOW],
        "gemma2": [WINDOW, None],
        "gemma3": [WINDOW, None, WINDOW],
    }.get(name, [None] * len(cache.layers))
    assert [layer.sliding_window for layer in cache.layers] == expected
    assert cache.is_sliding == [w is not None for w in expected]


@torch.no_grad()
def test_window_residual_sets_the_tail_of_the_sliding_layers_only():
    """cache_for(window_residual=w): the sliding layers keep a w-token full-precision tail, the
    full-attention layers `residual`; given neither, 64 and 0 (the byte policy that holds Gemma 3
    and SmolLM2 at <= 30 % of their native cache, benchmarks/RESULTS.md); the output stays within
    8-bit noise of the model's own."""
    import nexuskv.hf as nhf
    from hf_helpers import tiny_model

    model = tiny_model("gemma3")
    ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(5))
    ref = forward(model, ids).logits

    def full_precision_bytes(cache):
        return [layer.cache.nbytes() - layer.cache.compressed_nbytes() for layer in cache.layers]

    plain = nhf.cache_for(model, bits=8, group_size=16, residual=32)
    short = nhf.cache_for(model, bits=8, group_size=16, residual=32, window_residual=0)
    out_plain, out_short = forward(model, ids, plain).logits, forward(model, ids, short).logits
    a, b = full_precision_bytes(plain), full_precision_bytes(short)
    assert b[1] == a[1] > 0  # the full-attention layer: the same 32-token tail
    assert b[0] < a[0] and b[2] < a[2]  # the sliding layers: less in full precision
    assert compressed(short) > compressed(plain)
    assert _rel(out_short, ref) < 0.05 and _rel(out_plain, ref) < 0.05
    # Given no tail at all: DEFAULT_RESIDUAL (64) full-precision tokens on the full-attention layer,
    # the DEFAULT_SINKS sinks among them, none on the sliding ones.
    default = nhf.cache_for(model, bits=8, group_size=16)
    forward(model, ids, default)
    policy = nhf.cache_for(
        model, bits=8, group_size=16, residual=nhf.DEFAULT_RESIDUAL - nhf.DEFAULT_SINKS, window_residual=0
    )
    forward(model, ids, policy)
    assert full_precision_bytes(default) == full_precision_bytes(policy)
    assert int(default.layers[1].cache.compressed_lengths()[0]) == 0  # 64 tokens: all in the 64-token tail
    for bad in (-1, 1.5, True, "0"):
        with pytest.raises(ValueError, match="window_residual"):
            nhf.cache_for(model, window_residual=bad)
        with pytest.raises(ValueError, match="residual"):
            nhf.cache_for(model, residual=bad)
