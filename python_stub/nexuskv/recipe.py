"""Calibration recipes: what a model's keys look like on average, and how many bits
each layer's keys and values need, measured once on a text (`python -m nexuskv
calibrate`) and read where the cache is built.

A recipe holds, per layer and kv head, the channel means of the keys (after RoPE, as
attention sees them), and (version 2, when calibrated with a bit budget) a bit map: the
code bits of each layer's keys and values, allocated under an average-bits budget from
each tensor's measured sensitivity (nexuskv.bit_allocation).  Version 1 files (means
only) still load.

Key means.  Subtracting them from every key before quantization
leaves attention unchanged: q . (k - m) = q . k - q . m, and q . m is one constant per
query row, which softmax removes.  Exact for every query and any m (a mean measured on
another text is as exact, only less helpful); not with logit soft-capping (tanh is not
shift-invariant), where a recipe is refused.

What it buys: a key quantized per token carries each channel's offset in every group's
range, and post-RoPE keys have large, steady channel offsets (SmolLM2: |mean| 6-18 per
head).  Centered, the range holds only what varies from token to token.  nexuskv's own
cache quantizes keys per channel, whose zero points absorb the offsets already, so the
centering is for per-token keys: the vLLM backend's pages (NEXUSKV_VLLM_RECIPE).
The bit map is for nexuskv's own cache (``cache_for(model, recipe=...)``; in C++ and
TorchScript ``nexuskv::Recipe`` / ``torch.classes.nexuskv.Recipe(path)``, csrc/include/nexuskv/
recipe.h, which reads this file with the same checks); the vLLM backend refuses a recipe that
has one (its pages are one size for every layer).
(Centering the values the same way, adding the mean back to the output, was measured
and did not help: values have small means.)

File: one .safetensors file, tensors ``key_center`` (float32 [layers, kv_heads,
head_dim]) and, in version 2, optionally ``bit_map`` (int32 [layers, 2]: key bits, value
bits) and ``sensitivity`` (float32 [layers, 2, choices]: what the allocation was made
from); as the header's metadata ``nexuskv_recipe``, a JSON object: format version, the
model facts it was measured on (checked by every reader), the text and token counts it
was measured on, and with a bit map the settings it was allocated for (``bits``: budget,
choices, group sizes, tail, sinks, the effective bits reached and, from calibrate, the
candidate maps measured whole with their KL divergence: bit_allocation.choose).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

__all__ = ["Recipe", "model_facts", "calibrate", "FORMAT", "VERSION"]

FORMAT = "nexuskv-recipe"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: key means only
BIT_CHOICES = (2, 3, 4, 8)  # the code bits a bit map may hold (the cache's)
META_DTYPES = ("bfloat16", "float16", "float32")  # what bits.meta_dtype may name
# What a recipe must match in a model's config: a recipe measured on another model would
# still be exact (see above) but would not help, so it is refused rather than used.
FACTS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
)


def model_facts(config) -> Dict[str, object]:
    """The facts a recipe is checked against, from a transformers config (a multimodal
    config's text part when it has one)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    facts = {}
    for name in FACTS:
        value = getattr(c, name, None)
        if name == "head_dim" and value is None:
            value = c.hidden_size // c.num_attention_heads
        if name == "num_key_value_heads" and value is None:
            value = c.num_attention_heads
        facts[name] = value
    return facts


@dataclass
class Recipe:
    model: Dict[str, object]  # model_facts() of the model it was measured on
    key_center: torch.Tensor  # float32 [layers, kv_heads, head_dim]
    source: Dict[str, object] = field(default_factory=dict)  # text, tokens, windows, model name
    bit_map: Optional[torch.Tensor] = None  # int32 [layers, 2]: key bits, value bits of each layer
    sensitivity: Optional[torch.Tensor] = None  # float32 [layers, 2, len(bits["choices"])]
    bits: Dict[str, object] = field(default_factory=dict)  # what the bit map was allocated for

    def __post_init__(self) -> None:
        if not isinstance(self.model, dict):
            raise ValueError(f"recipe: the header's model facts must be an object, got {self.model!r}")
        if not isinstance(self.source, dict):
            raise ValueError(f"recipe: the header's source must be an object, got {self.source!r}")
        shape = (self.model["num_hidden_layers"], self.model["num_key_value_heads"], self.model["head_dim"])
        t = self.key_center
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float32:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            want = f"float32 {list(shape)} (layers, kv heads, head_dim)"
            raise ValueError(f"recipe: key_center must be {want}, got {got}")
        if not torch.isfinite(t).all():
            raise ValueError("recipe: key_center holds NaN or Inf")
        if self.bit_map is not None:
            m = self.bit_map
            if not isinstance(m, torch.Tensor) or tuple(m.shape) != (shape[0], 2) or m.dtype != torch.int32:
                got = (tuple(m.shape), m.dtype) if isinstance(m, torch.Tensor) else type(m).__name__
                raise ValueError(
                    f"recipe: bit_map must be int32 [{shape[0]}, 2] (layers; key bits, value bits), got {got}"
                )
            bad = sorted({int(b) for b in m.flatten().tolist()} - set(BIT_CHOICES))
            if bad:
                raise ValueError(f"recipe: bit_map holds {bad}; code bits must be among {list(BIT_CHOICES)}")
        if not isinstance(self.bits, dict):
            raise ValueError(f"recipe: the header's bits must be an object, got {self.bits!r}")
        if "meta_dtype" in self.bits and self.bits["meta_dtype"] not in META_DTYPES:
            got = self.bits["meta_dtype"]
            raise ValueError(f"recipe: bits.meta_dtype must be one of {list(META_DTYPES)}, got {got!r}")
        if self.sensitivity is not None and (
            self.bit_map is None or self.sensitivity.dim() != 3 or tuple(self.sensitivity.shape[:2]) != (shape[0], 2)
        ):
            raise ValueError("recipe: sensitivity must be [layers, 2, choices] beside a bit_map")

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        header = {"format": FORMAT, "version": VERSION, "model": self.model, "source": self.source}
        tensors = {"key_center": self.key_center.contiguous()}
        if self.bit_map is not None:
            header["bits"] = self.bits
            tensors["bit_map"] = self.bit_map.contiguous()
            if self.sensitivity is not None:
                tensors["sensitivity"] = self.sensitivity.float().contiguous()
        save_file(tensors, path, metadata={"nexuskv_recipe": json.dumps(header, sort_keys=True)})

    @classmethod
    def load(cls, path: str) -> "Recipe":
        from safetensors import SafetensorError
        from safetensors.torch import safe_open

        if not os.path.isfile(path):
            raise ValueError(f"recipe {path}: no such file (make one with python -m nexuskv calibrate)")
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise ValueError(f"recipe {path}: not a safetensors file ({e})") from None
        try:
            header = json.loads(meta["nexuskv_recipe"])
        except (KeyError, json.JSONDecodeError):
            header = None
        if not isinstance(header, dict):
            raise ValueError(f"recipe {path}: no nexuskv_recipe header (not written by nexuskv calibrate)")
        if header.get("format") != FORMAT or header.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"recipe {path}: format {header.get('format')!r} version {header.get('version')!r}; this "
                f"nexuskv reads {FORMAT!r} versions {', '.join(map(str, READABLE_VERSIONS))}"
            )
        if "key_center" not in tensors:
            raise ValueError(f"recipe {path}: no key_center tensor")
        try:
            return cls(
                header["model"],
                tensors["key_center"],
                header.get("source", {}),
                tensors.get("bit_map"),
                tensors.get("sensitivity"),
                header.get("bits", {}),
            )
        except KeyError as e:
            raise ValueError(f"recipe {path}: the header's model facts lack {e}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"recipe {path}: {e}") from None

    def check_model(self, facts: Dict[str, object], where: str = "the model") -> None:
        """Raises ValueError naming every fact in which `facts` (model_facts()) differ."""
        diff = [f"{k} {facts.get(k)!r} (recipe: {v!r})" for k, v in self.model.items() if facts.get(k) != v]
        if diff:
            name = self.source.get("model", "another model")
            raise ValueError(
                f"recipe measured on {name} does not fit {where}: "
                + ", ".join(diff)
                + "; calibrate on this model (python -m nexuskv calibrate --model ...)"
            )


@torch.no_grad()
def calibrate(model, windows, source: Optional[Dict[str, object]] = None) -> Tuple[Recipe, torch.Tensor]:
    """Runs `model` (transformers, causal LM) over each window of input_ids [1, n] and
    returns the channel means of every layer's keys (after RoPE) over all tokens seen,
    and the keys' spread around them: (recipe, spread float32 [layers, kv_heads], the
    root mean square of |k - mean| per head).  The keys are read where attention
    receives them (nexuskv.models.capture_qkv: the model's own masks and windows)."""
    from .models import capture_qkv

    facts = model_facts(model.config)
    shape = (facts["num_hidden_layers"], facts["num_key_value_heads"], facts["head_dim"])
    sums = torch.zeros(shape, dtype=torch.float64)
    squares = torch.zeros(shape[:2], dtype=torch.float64)
    seen = 0  # tokens: every layer sees each window's tokens once (no cache, one forward)
    for ids in windows:
        layers = capture_qkv(model, ids)
        if len(layers) != shape[0]:
            raise ValueError(f"calibrate: {len(layers)} attention layers ran, the config says {shape[0]}")
        for i, layer in enumerate(layers):
            k = layer.k.double()  # [batch, kv_heads, tokens, head_dim]
            if k.shape[1:2] + k.shape[3:] != shape[1:] or k.shape[0] * k.shape[2] != ids.numel():
                raise ValueError(
                    f"calibrate: layer {i} keys {tuple(k.shape)} do not match the config {shape} and the "
                    f"{ids.numel()} tokens run"
                )
            sums[i] += k.sum((0, 2))
            squares[i] += k.square().sum((0, 2, 3))
        seen += ids.numel()
    if seen == 0:
        raise ValueError("calibrate: no tokens")
    means = sums / seen
    spread = (squares / seen - means.square().sum(-1)).clamp_min(0).sqrt()
    return Recipe(facts, means.float().contiguous(), dict(source or {})), spread.float()
