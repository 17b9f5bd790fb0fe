"""Saving a prefilled Hugging Face cache (a prompt cache) with pickle and torch.save: the
loaded cache continues exactly where the original was (the same logits to the bit, the
same greedy tokens from generate), for the dynamic cache on its fused and dequantize
paths, with sliding windows, DGQ keys and a Python compressor, and for the static cache;
a loaded cache can be re-bound to its model; what cannot be saved is a clear error."""

import copy
import io
import pickle

import pytest
import torch
from test_hf_cache import Int8PerToken  # the user-compressor stand-in, shared

import nexuskv.hf as nhf
from hf_helpers import forward, greedy, tiny_model

PROMPT, DECODE = 56, 6


class Unpicklable(Int8PerToken):
    def __init__(self):
        self.hook = lambda x: x  # a lambda: pickle cannot save it


def _ids(n=PROMPT + DECODE, seed=1):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _saved_and_loaded(cache, how):
    if how == "pickle":
        return pickle.loads(pickle.dumps(cache))
    buf = io.BytesIO()
    torch.save(cache, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)  # the cache's classes are not tensors


def _decode(model, cache, ids):
    """Logits of one forward per token of ids [1, n], after what the cache holds."""
    with torch.inference_mode():
        return torch.cat([forward(model, ids[:, t : t + 1], cache).logits for t in range(ids.shape[1])], 1)


def _compressed(cache) -> int:
    layer = cache.layers[0]
    return int(layer.static.lengths[0, 0]) if hasattr(layer, "static") else int(layer.cache.compressed_lengths()[0])


CASES = {
    "fused": ("llama", "nexuskv", dict(bits=4)),
    "dequantize": ("llama", "sdpa", dict(bits=4)),
    "dgq-keys": ("qwen3", "nexuskv", dict(bits=2, dynamic_keys=True, outliers=1)),
    "windows-fused": ("gemma3", "nexuskv", dict(bits=8)),  # sliding, full, sliding: evicted tokens
    "windows-dequantize": ("mistral", "eager", dict(bits=4)),
    "python-compressor": ("llama", "nexuskv", dict(compressor=Int8PerToken())),
    "static": ("gemma2", "nexuskv", dict(bits=4, static=True, max_cache_len=96)),
}


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_loaded_cache_continues_bit_exactly(name, how):
    arch, attn, kw = CASES[name]
    model = tiny_model(arch)
    model.set_attn_implementation(attn)
    ids = _ids()
    cache = nhf.cache_for(model, group_size=16, residual=16, **kw)
    with torch.inference_mode():
        forward(model, ids[:, :PROMPT], cache)
    assert _compressed(cache) > 0
    loaded = _saved_and_loaded(cache, how)
    assert type(loaded) is type(cache) and loaded.get_seq_length() == PROMPT
    ours = _decode(model, loaded, ids[:, PROMPT:])  # the loaded copy first: it reads nothing of the original
    assert torch.equal(ours, _decode(model, cache, ids[:, PROMPT:])), name
    assert loaded.get_seq_length() == cache.get_seq_length() == ids.shape[1]


@pytest.mark.parametrize("name", ["fused", "dequantize", "static"])
def test_generate_continues_from_a_loaded_prompt_cache(name):
    arch, attn, kw = CASES[name]
    model = tiny_model(arch)
    model.set_attn_implementation(attn)
    prompt = _ids(PROMPT)
    cache = nhf.cache_for(model, group_size=16, residual=16, **kw)
    with torch.inference_mode():
        forward(model, prompt[:, :-1], cache)  # the prompt cache: all but the last token
    loaded = _saved_and_loaded(cache, "torch.save")
    ours = greedy(model, prompt, 8, loaded)
    assert ours.tolist() == greedy(model, prompt, 8, cache).tolist()


def test_bind_makes_a_loaded_cache_follow_the_models_attention_again():
    model = tiny_model("llama")
    model.set_attn_implementation("nexuskv")
    ids = _ids()
    cache = nhf.cache_for(model, group_size=16, residual=16)
    with torch.inference_mode():
        forward(model, ids[:, :PROMPT], cache)
    loaded = _saved_and_loaded(cache, "pickle")
    assert all(layer._fused_now() for layer in loaded.layers)  # the path it was on, without a model
    model.set_attn_implementation("sdpa")
    assert loaded.bind(model) is loaded
    assert not any(layer._fused_now() for layer in loaded.layers)  # now the model's: dequantize
    ours = _decode(model, loaded, ids[:, PROMPT:])
    assert torch.equal(ours, _decode(model, cache, ids[:, PROMPT:]))  # the original follows the model too
    with pytest.raises(ValueError, match="bind: layer 0 of this cache was made for head_dim 16"):
        loaded.bind(tiny_model("phi"))  # head_dim 80
    with pytest.raises(ValueError, match="bind: this cache has 2 layers, the model 3"):
        loaded.bind(tiny_model("gemma3"))


def test_a_deep_copy_still_shares_the_models_config():
    model = tiny_model("llama")
    model.set_attn_implementation("nexuskv")
    cache = nhf.cache_for(model, group_size=16, residual=16)
    copied = copy.deepcopy(cache)
    model.set_attn_implementation("sdpa")  # a copy follows the model, as the original does
    assert not copied.layers[0]._fused_now() and copied.layers[0]._config() is model.config


def test_what_cannot_be_saved_is_a_clear_error():
    model = tiny_model("llama")
    cache = nhf.cache_for(model, group_size=16, residual=16, compressor=Unpicklable())
    with pytest.raises(TypeError, match=r"layer 0 compresses with Python compressors \(Unpicklable\) that cannot be"):
        pickle.dumps(cache)
    cache = nhf.cache_for(model, group_size=16, residual=16, fused=True)
    kv = torch.randn(1, 2, 4, 16)
    cache.update(kv, kv, 0)  # fused: pending until the attention function claims it
    try:
        with pytest.raises(RuntimeError, match="layer 0 is between its update"):
            torch.save(cache, io.BytesIO())
    finally:
        cache.layers[0]._drop_pending()
    model.set_attn_implementation("nexuskv")
    static = nhf.cache_for(model, group_size=16, residual=16, static=True, max_cache_len=64)
    static.update(kv, kv, 1)  # recorded until the attention function claims it
    try:
        with pytest.raises(RuntimeError, match="static layer 1 is between its update"):
            pickle.dumps(static)
    finally:
        nhf.hf_static._updated.clear()
