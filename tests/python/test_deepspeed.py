"""nexuskv inside a DeepSpeed v1 inference engine (deepspeed.init_inference, no
kernel injection, one process): the engine is seen through to its module, the
compressed cache generates through the engine with fused attention, and its logits
follow the dense cache as the quantization step says they must.  Tensor
parallelism is test_tensor_parallel.py."""

import pytest
import torch

from ds_helpers import (CACHE, TINY, cache_for_engine, dequantize_path_cache_for_engine, dequantized,
                        fused_attention_calls, moved_elements, requires_deepspeed, teacher_forced_logits, tiny_llama,
                        token_inputs)
from hf_helpers import greedy, requires_model


def test_anything_that_is_not_an_engine_passes_through():
    from nexuskv.integrations import deepspeed as ds

    model = tiny_llama()
    assert not ds.is_engine(model)
    assert ds.unwrap(model) is model
    assert ds.unwrap_for_cache(model) == (model, None)
    assert ds.unwrap_for_cache(model, kv_heads=1) == (model, 1)
    assert ds.tensor_parallel(model).size == 1 and ds.kv_heads_per_rank(model) is None


@pytest.fixture(scope="module")
def engine():
    import deepspeed

    return deepspeed.init_inference(tiny_llama(), dtype=torch.float32, replace_with_kernel_inject=False)


@requires_deepspeed
def test_engine_is_seen_through_to_its_module(engine):
    from nexuskv.integrations import deepspeed as ds

    assert ds.is_engine(engine)
    assert ds.unwrap(engine) is engine.module
    assert ds.unwrap_for_cache(engine) == (engine.module, None)  # one process: the config's head count
    assert ds.tensor_parallel(engine).size == 1


@requires_deepspeed
def test_cache_for_takes_the_engine(engine):
    import nexuskv.hf as nhf

    cache = nhf.cache_for(engine, **CACHE)  # failed before: 'InferenceEngine' object has no attribute 'dtype'
    assert len(cache.layers) == TINY["num_hidden_layers"]


@requires_deepspeed
def test_kernel_injected_engine_is_refused(engine, monkeypatch):
    # DeepSpeed cannot inject its kernels on CPU ("This op had not been implemented on CPU
    # backend"), so the engine is told it did: its fused layers would never call our cache.
    from nexuskv.integrations import deepspeed as ds

    monkeypatch.setattr(engine._config, "replace_with_kernel_inject", True)
    with pytest.raises(ValueError, match="replace_with_kernel_inject=True"):
        ds.unwrap(engine)


@requires_deepspeed
def test_fastgen_engine_is_refused():
    from deepspeed.inference.v2.engine_v2 import InferenceEngineV2

    from nexuskv.integrations import deepspeed as ds

    fastgen = object.__new__(InferenceEngineV2)  # FastGen needs a GPU to build; its type is what counts
    with pytest.raises(TypeError, match="docs/deepspeed.md"):
        ds.unwrap(fastgen)


@requires_deepspeed
def test_engine_decodes_through_the_compressed_cache(engine):
    """The bounds.  (1) The engine adds nothing to the forward pass: the same cache
    settings give bit-identical logits through the engine and through its module.
    (2) Fused attention inside the engine equals SDPA over dequantized K/V (nexuskv's
    dequantize path) up to float32 arithmetic: 1e-4 of the largest logit (measured
    3e-6), as long as the two runs' caches hold the same codes (a code on a rounding
    boundary may flip between them; then 5 % of the 4-bit quantization effect).
    (3) Against the dense cache the logits move by the quantization error, at most half
    a step per element, step = range / (2^bits - 1): to first order the logit error
    scales with the step, so 8-bit (a 17x smaller step than 4-bit) must give less than
    1/8 of the 4-bit error (measured 1/16.5), and 4-bit must move the logits at all
    (the compressed part is read)."""
    from transformers import DynamicCache

    prompt, forced = token_inputs()
    steps = 1 + len(forced)
    cache = cache_for_engine(engine, **CACHE)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fused = teacher_forced_logits(engine, cache, prompt, forced)
    # every decode step attends fused; the prefill over its own K/V (nexuskv.hf.nexuskv_attention)
    assert fused_attention_calls(prof) == TINY["num_hidden_layers"] * (steps - 1)
    total = prompt.shape[1] + len(forced)
    for layer in cache.layers:
        assert int(layer.cache.lengths()[0]) == total
        # 4 sinks, 16-token tail: the 100 tokens between them hold 3 whole groups of 32
        assert int(layer.cache.compressed_lengths()[0]) == (total - CACHE["sinks"] - CACHE["residual"]) // 32 * 32

    module_cache = cache_for_engine(engine.module, **CACHE)
    assert torch.equal(fused, teacher_forced_logits(engine.module, module_cache, prompt, forced))

    dense = teacher_forced_logits(engine, DynamicCache(), prompt, forced)
    err4 = float((fused - dense).abs().max())
    err8 = float((teacher_forced_logits(engine, cache_for_engine(engine, **dict(CACHE, bits=8)), prompt, forced)
                  - dense).abs().max())
    scale = float(fused.abs().max())
    assert 1e-3 * scale < err4 and err8 < err4 / 8

    unfused = dequantize_path_cache_for_engine(engine, **CACHE)
    gap = float((fused - teacher_forced_logits(engine, unfused, prompt, forced)).abs().max())
    moved, total_elements = moved_elements(dequantized(unfused), dequantized(cache))
    assert moved <= 1e-3 * total_elements
    assert gap <= (1e-4 * scale if moved == 0 else 0.05 * err4)


@requires_deepspeed
def test_engine_generate_with_the_compressed_cache(engine):
    # engine.generate is DeepSpeed's wrapper (it resets the model's own cache, refuses beams)
    import nexuskv.hf as nhf

    prompt, _ = token_inputs()
    mask = torch.ones_like(prompt)
    ours = greedy(engine, prompt, 16, cache_for_engine(engine, **CACHE), attention_mask=mask, pad_token_id=0)
    plain = greedy(engine.module, prompt, 16, nhf.cache_for(engine.module, **CACHE), attention_mask=mask,
                   pad_token_id=0)
    assert torch.equal(ours, plain)


@requires_deepspeed
@requires_model[0]
@requires_model[1]
def test_real_model_in_an_engine_agrees_with_the_dense_cache(loaded):
    """SmolLM2-135M-Instruct (float32: the shared session model, which dtype=float32
    keeps init_inference from converting in place) over a 196-token chat prompt (160
    tokens of Debian's reference manual and a question).  The engine generates 32
    tokens with the dense cache; the same engine with the 4-bit cache (groups of 64, 4
    sinks, 32-token tail) is fed that continuation and must pick the same next token at
    >= 28 of the 32 positions (measured 32 of 32; greedy generation through the 4-bit
    cache also gives the same 32 tokens).  Teacher forcing keeps one early near-tie from
    deciding the count, as it would for a free-running comparison."""
    import deepspeed

    from nexuskv import models
    from nexuskv.demo import build_prompt

    model, tok = loaded
    engine = deepspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=False)
    ids = build_prompt(tok, models.load_text(), 160, "What is this document about?")
    dense = greedy(engine, ids, 32, attention_mask=torch.ones_like(ids))
    cache = cache_for_engine(engine, bits=4, group_size=64, residual=32, sinks=4)
    logits = teacher_forced_logits(engine, cache, ids, dense[0])
    assert min(int(layer.cache.compressed_lengths()[0]) for layer in cache.layers) == 192
    assert int((logits[:-1].argmax(-1) == dense[0]).sum()) >= 28
