"""What differs between the transformers lines nexuskv supports (4.57 and 5.x), and
what nexuskv reads off a model's config, in one place.  Everything here uses public
names; where transformers changed a meaning between lines (crop's argument, the
name of the cache argument), the line is told apart by the public signature, not
by a version number."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import transformers
from transformers.cache_utils import DynamicLayer

TRANSFORMERS_VERSION = transformers.__version__

ATTN_IMPLEMENTATION = "nexuskv"  # the attention function nexuskv.hf registers

# crop(): 4.57 takes the length to keep (negative: tokens to remove); 5.x takes the
# (negative) number of tokens to remove and rejects positive values.
CROP_TAKES_TOKENS_TO_REMOVE = "tokens_to_remove" in inspect.signature(DynamicLayer.crop).parameters


def crop_target(seen: int, arg: int) -> int:
    """The sequence length a crop(arg) call asks for, in this transformers line's terms."""
    if CROP_TAKES_TOKENS_TO_REMOVE:
        if arg > 0:
            raise ValueError(f"nexuskv: crop() takes the (negative) number of tokens to remove, got {arg}")
        return seen + arg
    return seen + arg if arg < 0 else min(arg, seen)


def query_length(arg) -> int:
    """get_mask_sizes() gets cache_position (a tensor, 4.57) or the query length (an int, 5.x)."""
    return int(arg) if isinstance(arg, int) else int(arg.shape[0])


def cache_argument(model) -> str:
    """The keyword under which model.forward / generate take the cache: "cache" in
    5.x (where "past_key_values" is a deprecated alias), "past_key_values" before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(outputs):
    """The cache a model output carries (outputs.cache in 5.x, past_key_values before)."""
    return outputs["cache"] if "cache" in outputs else outputs["past_key_values"]


def attention_implementation(config) -> Optional[str]:
    """The attention implementation a config selects.  transformers exposes it as the
    `_attn_implementation` property in both lines (set through the public
    `model.set_attn_implementation`); this is the one place nexuskv reads it."""
    return getattr(config, "_attn_implementation", None)


def text_config(model):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


@dataclass(frozen=True)
class LayerGeometry:
    """What one decoder layer's cache must hold: K/V heads, head dims, and the sliding
    window (None: the layer attends to the whole history)."""

    kv_heads: int
    key_dim: int
    value_dim: int
    window: Optional[int]
    layer_type: str


_FULL, _SLIDING = "full_attention", "sliding_attention"


def layer_geometries(model) -> list[LayerGeometry]:
    """Per decoder layer: heads, head dims and window, as the model's own config says
    (config.layer_types where the model has them, else one sliding_window for every
    layer, as Mistral / Phi-3 apply it)."""
    cfg = text_config(model)
    n = cfg.num_hidden_layers
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    key_dim = getattr(cfg, "qk_head_dim", None) or head_dim
    value_dim = getattr(cfg, "v_head_dim", None) or head_dim
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = None
    types = list(getattr(cfg, "layer_types", None) or [_SLIDING if window else _FULL] * n)
    if len(types) != n:
        raise ValueError(f"nexuskv: config.layer_types has {len(types)} entries for {n} layers")
    unknown = sorted({t for t in types if t not in (_FULL, _SLIDING)})
    if unknown:
        raise NotImplementedError(
            f"nexuskv: layer types {unknown} are not supported (full_attention and sliding_attention are)"
        )
    if _SLIDING in types and not window:
        raise ValueError("nexuskv: the config has sliding_attention layers but no sliding_window")
    return [LayerGeometry(heads, key_dim, value_dim, window if t == _SLIDING else None, t) for t in types]
