"""What the DeepSpeed and tensor-parallel tests share: the skip mark, a tiny
randomly initialized Llama-style model, teacher-forced logits through a cache, and
the rank-aware cache for an engine."""

import importlib.util

import pytest
import torch

requires_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                        reason="needs pip install nexuskv[deepspeed] (DS_BUILD_OPS=0)")

# 2 layers, 4 query heads over 2 KV heads (GQA 2:1) of head_dim 64: the KV heads split
# evenly over 2 tensor-parallel ranks.  initializer_range 0.05 (not 0.02) so that the
# random model's attention is far from uniform and its logits far from flat: a wrong
# head, position or scale then shows in the logits.
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, initializer_range=0.05,
            rms_norm_eps=1e-5, tie_word_embeddings=False)
# Cache settings: groups of 32 (keys: 32 tokens per channel, values: 32 channels per
# token), a 16-token full-precision tail and 4 sinks, so that a 96-token prompt plus
# a few decode steps leaves most of the context compressed.
CACHE = dict(bits=4, group_size=32, residual=16, sinks=4)


def tiny_llama(attn_implementation: str = "nexuskv", seed: int = 0, **overrides):
    import nexuskv.hf  # noqa: F401  (registers attn_implementation="nexuskv")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides}, attn_implementation=attn_implementation)
    return LlamaForCausalLM(config).eval()


def token_inputs(prompt_len: int = 96, decode_steps: int = 24, seed: int = 1):
    """A prompt [1, prompt_len] and the tokens fed one by one after it [decode_steps]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (1, prompt_len + decode_steps), generator=g)
    return ids[:, :prompt_len], ids[0, prompt_len:]


def teacher_forced_logits(model, cache, prompt, forced) -> torch.Tensor:
    """[1 + len(forced), vocab] float32: the next-token logits after the prompt and after
    each forced token, decoding one token at a time through `cache` (so that every step
    after the prefill attends over what the cache holds)."""
    rows = []
    with torch.inference_mode():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        rows.append(out.logits[0, -1].float())
        for token in forced.tolist():
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def cache_for_engine(engine, **kwargs):
    """nexuskv.hf.cache_for for a DeepSpeed engine on this rank (the engine's module,
    with the KV heads this rank holds)."""
    import nexuskv.hf as nhf

    return nhf.cache_for(engine, **kwargs)


def dequantize_path_cache_for_engine(engine, **kwargs):
    """The same cache, but attention runs over its dequantized K/V (SDPA) instead of fused."""
    return cache_for_engine(engine, fused=False, **kwargs)


def fused_attention_calls(profile) -> int:
    """How many times nexuskv::dgq_fused_attention ran inside a torch.profiler profile."""
    return sum(e.count for e in profile.key_averages() if e.key == "nexuskv::dgq_fused_attention")


def dequantized(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (K, V) [batch, kv_heads, tokens, head_dim] as the cache holds them
    (compressed part dequantized, sinks and tail as stored)."""
    return [tuple(layer.cache.dense(None)[:2]) for layer in cache.layers]


def moved_elements(kv, reference_kv) -> tuple[int, int]:
    """(elements of `kv` that differ from `reference_kv` by more than 1e-4 of the layer's
    largest |K| or |V|, elements in all).

    Two runs that differ only in float32 summation order feed the cache K/V that differ
    by ~1e-7 relative, and the cache then stores the same codes except for an element
    that sits on a rounding boundary: that code flips, and moves its element by a whole
    quantization step (range / 15 at 4 bits, > 1e-2 of the largest).  Such a flip is
    legitimate, but it changes what every later layer sees (in a 30-layer model the
    flips cascade), so tests that compare two arithmetically different paths through
    compressed K/V count the flips first."""
    moved = total = 0
    for mine, ref in zip(kv, reference_kv):
        for a, b in zip(mine, ref):
            moved += int(((a - b).abs() > 1e-4 * b.abs().max()).sum())
            total += b.numel()
    return moved, total
