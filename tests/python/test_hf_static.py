"""The compileable Hugging Face cache (cache_for(model, static=True)): the same logits as
the dynamic cache on the architectures with windows, soft-caps and hybrid layers; a decode
step of the model compiles with torch.compile(fullgraph=True) into one graph (no break, no
recompile across steps) with the eager logits; the step exports with torch.export; generate
runs with it; and what it does not support is a clear error."""

import pytest
import torch

from hf_helpers import forward, greedy, tiny_model
from nexuskv.hf_compat import cache_argument

PROMPT, DECODE = 64, 6


def _ids(n=PROMPT + DECODE, seed=1):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _logits(model, cache, ids, step=None, explicit_positions=False):
    step = step or model.forward
    name = cache_argument(model)
    with torch.inference_mode():
        out = [forward(model, ids[:, :PROMPT], cache).logits]
        for t in range(PROMPT, ids.shape[1]):
            kw = {}
            if explicit_positions:
                pos = torch.tensor([t])
                kw = dict(cache_position=pos, position_ids=pos[None])
            out.append(step(ids[:, t : t + 1], **{name: cache}, **kw).logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gemma3", "qwen3"])
def test_static_equals_the_dynamic_cache(arch):
    import nexuskv.hf as nhf

    model = tiny_model(arch)
    model.set_attn_implementation("nexuskv")
    ids = _ids()
    kw = dict(bits=8, group_size=8, residual=8)
    dynamic = _logits(model, nhf.cache_for(model, **kw, sinks=0), ids)  # the static cache keeps no sinks
    cache = nhf.cache_for(model, **kw, static=True, max_cache_len=128)
    static = _logits(model, cache, ids)
    assert all(int(layer.static.lengths[0, 0]) > 0 for layer in cache.layers)  # compressed tokens
    assert cache.get_seq_length() == ids.shape[1]
    # Sliding layers: the dynamic cache evicts, the static one masks: the same keys are seen.
    assert float((static - dynamic).abs().max() / dynamic.std()) < 1e-5, arch


def test_a_decode_step_compiles_with_fullgraph_into_one_graph():
    import nexuskv.hf as nhf

    model = tiny_model("gemma2")  # a window and a soft-cap
    model.set_attn_implementation("nexuskv")
    ids = _ids(PROMPT + 20)  # the decode steps compress a chunk
    kw = dict(bits=4, group_size=16, residual=16, static=True, max_cache_len=128)
    eager = _logits(model, nhf.cache_for(model, **kw), ids, explicit_positions=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cache = nhf.cache_for(model, **kw)
    compiled = _logits(model, cache, ids, torch.compile(model.forward, fullgraph=True), explicit_positions=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompilation across the steps
    assert float((compiled - eager).abs().max() / eager.std()) < 1e-4
    # the compiled steps did run the cache: 84 tokens, 64 compressed (48 after the prefill)
    assert cache.get_seq_length() == 84 and int(cache.layers[1].static.lengths[0, 0]) == 64


def test_a_decode_step_exports():
    import nexuskv.hf as nhf
    from nexuskv.hf_static import StaticDecodeStep

    model = tiny_model("llama")
    model.set_attn_implementation("nexuskv")
    ids = _ids()
    name = cache_argument(model)

    def prefilled():
        cache = nhf.cache_for(model, bits=4, group_size=16, residual=16, static=True, max_cache_len=128)
        with torch.inference_mode():
            model(ids[:, :PROMPT], **{name: cache})
        return cache

    with torch.no_grad():
        program = torch.export.export(
            StaticDecodeStep(model, prefilled()), (ids[:, PROMPT : PROMPT + 1], torch.tensor([PROMPT]))
        )
    exported, ref = program.module(), StaticDecodeStep(model, prefilled())
    with torch.no_grad():
        for t in range(PROMPT, ids.shape[1]):
            args = (ids[:, t : t + 1], torch.tensor([t]))
            torch.testing.assert_close(exported(*args), ref(*args), rtol=1e-5, atol=1e-5)


def test_generate_with_the_static_cache_matches_the_dynamic_cache():
    import nexuskv.hf as nhf

    model = tiny_model("qwen2")
    model.set_attn_implementation("nexuskv")
    prompt = _ids(PROMPT)
    kw = dict(bits=8, group_size=16, residual=16)
    ours = greedy(model, prompt, 8, nhf.cache_for(model, **kw, static=True, max_cache_len=96))
    assert ours.tolist() == greedy(model, prompt, 8, nhf.cache_for(model, **kw, sinks=0)).tolist()


def test_what_the_static_cache_does_not_take_is_a_clear_error():
    import nexuskv.hf as nhf

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs max_cache_len"):
        nhf.cache_for(model, static=True)
    with pytest.raises(ValueError, match="takes no rotate, sinks"):
        nhf.cache_for(model, static=True, max_cache_len=64, sinks=4)
    model.set_attn_implementation("eager")
    with pytest.raises(RuntimeError, match="needs attn_implementation='nexuskv'"):
        forward(model, _ids(8), nhf.cache_for(model, static=True, max_cache_len=64))
    model.set_attn_implementation("nexuskv")
    cache = nhf.cache_for(model, static=True, max_cache_len=64, group_size=16, residual=16)
    with torch.inference_mode():
        forward(model, _ids(8), cache)
        with pytest.raises(RuntimeError, match="static cache is full"):
            forward(model, _ids(100), cache)  # 108 tokens: 80 to compress, room for 64
    with pytest.raises(NotImplementedError, match="no crop"):
        cache.crop(4)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    with torch.inference_mode(), pytest.raises(NotImplementedError, match="takes no padded batches"):
        forward(model, _ids(16).view(2, 8), nhf.cache_for(model, static=True, max_cache_len=64), attention_mask=mask)


def test_the_static_cache_reads_a_recipes_bit_map(tmp_path):
    """cache_for(model, static=True, recipe=FILE): each layer's static cache takes the layer's
    key and value bits from the recipe's bit map, and its logits are the dynamic cache's with
    the same recipe (and differ from a uniform 8-bit cache's: the map is applied)."""
    import nexuskv.hf as nhf
    from nexuskv.recipe import calibrate

    model = tiny_model("llama")
    model.set_attn_implementation("nexuskv")
    ids = _ids()
    recipe, _ = calibrate(model, [ids[:, :PROMPT]])
    bit_map = [[2, 4], [8, 3]]
    assert len(bit_map) == model.config.num_hidden_layers
    recipe.bit_map = torch.tensor(bit_map, dtype=torch.int32)
    path = str(tmp_path / "recipe.safetensors")
    recipe.save(path)
    kw = dict(group_size=8, residual=8, recipe=path)
    cache = nhf.cache_for(model, **kw, static=True, max_cache_len=128)
    assert [[layer.settings["bits"], layer.settings["value_bits"]] for layer in cache.layers] == bit_map
    static = _logits(model, cache, ids)
    dynamic = _logits(model, nhf.cache_for(model, **kw, sinks=0), ids)
    assert float((static - dynamic).abs().max() / dynamic.std()) < 1e-5
    uniform = _logits(
        model, nhf.cache_for(model, bits=8, group_size=8, residual=8, static=True, max_cache_len=128), ids
    )
    assert float((static - uniform).abs().max() / uniform.std()) > 1e-3
