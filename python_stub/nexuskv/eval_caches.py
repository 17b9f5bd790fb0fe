"""The KV caches that `python -m nexuskv eval` and `demo` compare: one Setting per
cache (dense, nexuskv, transformers' QuantizedCache with optimum-quanto), how to
build it for a model, the bytes it really holds, and the effective bits of its
compressed part from the format (every scale, zero, index and outlier counted;
the full-precision tail is reported separately, never averaged in).

The dense baseline is the cache transformers itself makes for the model in
generate(): DynamicCache(config=...), which keeps only the window in sliding-window
layers (4.57 and 5.x alike).  nexuskv caches are made by nexuskv.hf.cache_for, so
that they follow the model's layers (windows) as a user's would."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch

from . import _format, integrations

DENSE, NEXUSKV, QUANTO = "dense", "nexuskv", "quanto"
QUANTO_RESIDUAL = 128  # transformers' default residual_length for QuantizedCache
# Setting.meta: the dtype of scales and zeros.  None: each kind's own default (nexuskv:
# 16-bit, see meta_dtype_for; quanto: the model's dtype, as transformers runs it);
# META_16: 16-bit (the model's dtype if it is 16-bit, else bfloat16); META_MODEL: the
# model's dtype.  They let nexuskv and quanto be compared at equal effective bits.
META_16, META_MODEL = "16-bit", "model dtype"
DENSE_BASELINE = "DynamicCache(config=model.config)"  # what generate() makes; sliding layers keep their window


@dataclass(frozen=True)
class Setting:
    """One cache configuration.  nexuskv: keys per channel in groups of `group_size`
    tokens (DGQ data-chosen groups when `dgq`), values per token in groups of
    `value_group_size` channels; `residual` newest tokens kept in the model's dtype.
    quanto: transformers' QuantizedCache(backend="quanto") with its defaults
    (axis 0, q_group_size 64, residual_length 128).  `meta`: the dtype of scales and
    zeros (None, META_16 or META_MODEL, see above)."""

    kind: str
    bits: int = 16
    residual: int = 128
    group_size: int = 64
    value_group_size: int = 64
    key_outliers: int = 0
    value_outliers: int = 0
    rotate: bool = False
    dgq: bool = False
    sinks: int = 0  # first tokens of each sequence kept in the model's dtype
    meta: Optional[str] = None
    window_residual: Optional[int] = None  # the tail of sliding-window layers (None: `residual` there too)
    recipe: Optional[str] = None  # a recipe file with a bit map: each layer's K/V bits (`bits` is then 0)
    fit_range: bool = False  # keys' ranges fitted by least squares instead of min/max (same bytes)
    value_fit_range: bool = False  # the values' too

    @property
    def name(self) -> str:
        if self.kind == DENSE:
            return "dense"
        meta = "" if self.meta is None else (" 16-bit scales" if self.meta == META_16 else " scales in model dtype")
        if self.kind == QUANTO:
            return f"quanto {self.bits}-bit g64 tail {self.residual}{meta}"
        groups = f"K g{self.group_size}" + ("" if self.value_group_size == self.group_size
                                            else f" V g{self.value_group_size}")
        extra = "".join([f" K+{self.key_outliers}out" if self.key_outliers else "",
                         f" V+{self.value_outliers}out" if self.value_outliers else "",
                         " rot" if self.rotate else "", " DGQ" if self.dgq else "",
                         f" sinks {self.sinks}" if self.sinks else "", " K fit" if self.fit_range else "",
                         " V fit" if self.value_fit_range else "",
                         f" window tail {self.window_residual}" if self.window_residual is not None else ""])
        width = f"recipe {os.path.basename(self.recipe)}" if self.recipe else f"{self.bits}-bit"
        return f"nexuskv {width} tail {self.residual} {groups}{extra}{meta}"

    @property
    def knobs(self) -> tuple:
        """The ablation knobs (KNOBS) this nexuskv setting has switched on, in KNOBS order."""
        return tuple(k for k, on in KNOBS.items() if all(getattr(self, f) == v for f, v in on.items()))

    def as_dict(self) -> Dict:
        return dict(asdict(self), name=self.name)


def nexuskv(bits: int, residual: int = 128, **kw) -> Setting:
    return Setting(NEXUSKV, bits=bits, residual=residual, **kw)


def from_recipe(path: str) -> Setting:
    """The nexuskv row of a recipe's bit map, with the groups, tails and sinks it was
    allocated for (its `bits` header)."""
    recipe = _recipe(path)
    if recipe.bit_map is None:
        raise ValueError(f"eval: recipe {path} has no bit map (python -m nexuskv calibrate --bits-budget B makes one)")
    b = recipe.bits
    return Setting(NEXUSKV, bits=0, residual=int(b.get("residual", 128)), group_size=int(b.get("group_size", 64)),
                   value_group_size=int(b.get("value_group_size", b.get("group_size", 64))),
                   sinks=int(b.get("sinks", 0)), recipe=path, fit_range=bool(b.get("fit_range", False)),
                   value_fit_range=bool(b.get("value_fit_range", False)),
                   window_residual=None if b.get("window_residual") is None else int(b["window_residual"]))


@functools.lru_cache(maxsize=None)
def _recipe(path: str):
    from .recipe import Recipe

    return Recipe.load(path)


def quanto(bits: int, meta: Optional[str] = None) -> Setting:
    return Setting(QUANTO, bits=bits, residual=QUANTO_RESIDUAL, meta=meta)


DENSE_SETTING = Setting(DENSE)
# The knobs `eval` switches on alone and in combination (on a 128-token tail): one exact
# outlier per group in K and V, the randomized Hadamard rotation, data-chosen key groups
# (DGQ), the first 4 tokens kept exact (attention sinks), least-squares fitted ranges of the
# keys (the values' measured higher on SmolLM2: benchmarks/RESULTS.md, "Fitted ranges").
KNOBS = {"outliers": dict(key_outliers=1, value_outliers=1), "rotate": dict(rotate=True), "dgq": dict(dgq=True),
         "sinks": dict(sinks=4), "fit": dict(fit_range=True)}
COMBINATIONS = ("alone", "all", "leave-one-out")
# The 2-bit knobs (what cache_for(model, bits=2) switches on; its groups and tails are
# hf.default_policy's), on groups of 64 and a 128-token tail, where they were chosen because they hold
# on every model measured (benchmarks/RESULTS.md, SmolLM2-135M and Gemma 3 270M, the Debian manual and
# songs / poems, 3 x 1024 tokens each), by forward selection: a knob is in it only if, switched on
# together with the knobs already in, it lowered ΔPPL beyond the noise in every run. 4 sinks first
# (alone: SmolLM2 +19.6 % -> +8.2 %, Gemma 3 +13.4 % -> +7.6 % on the manual); then fitted key ranges
# on top of them (2.5 bits: e.g. Gemma 3's poems +15.4 % -> +4.8 %); the rotation helped SmolLM2 but
# made Gemma 3 far worse, so it stays a per-model choice.  tests/python/test_eval_protocol.py
# re-derives this from the committed runs (eval*.json, knobs2*.json).
RECOMMENDED_2BIT = nexuskv(2, 128, sinks=4, fit_range=True)


def default_cache(bits: int = 4, sinks: Optional[int] = None) -> Setting:
    """The row of `cache_for(model, bits=bits, sinks=sinks)` with no other settings
    (hf.default_policy): at 4 bits groups of 64, the byte policy's tails (DEFAULT_RESIDUAL
    full-precision tokens on full-attention layers, the sinks among them; none on sliding-window
    ones); at 2 bits groups of 128 and a 128-token tail on every layer besides the sinks; key
    ranges fitted when there are sinks.  tests/python/test_eval_caches.py checks it against the
    cache."""
    from . import hf

    p = hf.default_policy(bits)
    sinks = p["sinks"] if sinks is None else sinks
    if p["residual"] is None:
        return nexuskv(bits, hf.byte_policy_residual(sinks), window_residual=p["window_residual"], sinks=sinks,
                       fit_range=sinks > 0)
    window = None if p["window_residual"] == p["residual"] else p["window_residual"]
    return nexuskv(bits, p["residual"], group_size=p["group_size"], value_group_size=p["value_group_size"],
                   window_residual=window, sinks=sinks, fit_range=sinks > 0)


def with_knobs(bits: int, knobs, residual: int = 128, group_size: int = 64) -> Setting:
    """The nexuskv setting at `bits` with `knobs` switched on; keys in groups of
    `group_size` tokens and values in groups of `group_size` channels."""
    kw = {}
    for k in knobs:
        if k not in KNOBS:
            raise ValueError(f"eval: ablations must be among {sorted(KNOBS)}, got {k!r}")
        kw.update(KNOBS[k])
    return nexuskv(bits, residual, group_size=group_size, value_group_size=group_size, **kw)


def grid(bits=(8, 4, 3, 2), tails=(0, 128), ablation_bits=(4, 2),
         ablations=("outliers", "rotate", "dgq", "sinks", "fit"), combinations=COMBINATIONS, best_2bit: bool = True,
         quanto_bits=(4, 2), equal_bits: bool = True, window_tails=(), group_sizes=(64,),
         base_knobs=()) -> List[Setting]:
    """The default comparison: every bit width at each tail (and, for each of `window_tails`,
    with that tail on the sliding-window layers instead); at `ablation_bits` (128-token
    tail) each knob alone ("alone"), all of them together ("all") and all but one
    ("leave-one-out": what each knob adds to the others); RECOMMENDED_2BIT; quanto at
    `quanto_bits` as transformers runs it and, with `equal_bits`,
    quanto with 16-bit scales and nexuskv with scales in the model's dtype, so that each
    side is also measured at the other's effective bits.  The bit-width and ablation rows
    are repeated for each of `group_sizes` (key groups of that many tokens, value groups
    of that many channels): larger groups spend fewer bits on scales and zeros.  `base_knobs`
    (KNOBS names) are switched on in every bit-width row."""
    for c in combinations:
        if c not in COMBINATIONS:
            raise ValueError(f"eval: combinations must be among {list(COMBINATIONS)}, got {c!r}")
    for a in list(ablations) + list(base_knobs):
        with_knobs(4, [a])  # checks the name
    if not group_sizes or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in group_sizes):
        raise ValueError(f"eval: group sizes must be positive ints, got {list(group_sizes)}")
    rows = [DENSE_SETTING]
    for g in group_sizes:
        rows += [with_knobs(b, base_knobs, t, g) for b in bits for t in tails]
        rows += [dataclasses.replace(with_knobs(b, base_knobs, t, g), window_residual=w)
                 for b in bits for t in tails for w in window_tails if w != t]
        for b in ablation_bits:
            rows.append(with_knobs(b, (), 128, g))
            if "alone" in combinations:
                rows += [with_knobs(b, [a], 128, g) for a in ablations]
            if "all" in combinations and len(ablations) > 1:
                rows.append(with_knobs(b, ablations, 128, g))
            if "leave-one-out" in combinations and len(ablations) > 2:
                rows += [with_knobs(b, [x for x in ablations if x != a], 128, g) for a in ablations]
    if best_2bit:
        rows.append(RECOMMENDED_2BIT)
    for b in quanto_bits:
        rows.append(quanto(b))
        if equal_bits:
            rows += [quanto(b, META_16), nexuskv(b, QUANTO_RESIDUAL), nexuskv(b, QUANTO_RESIDUAL, meta=META_MODEL)]
    seen = set()
    return [r for r in rows if not (r in seen or seen.add(r))]


def meta_dtype_for(model_dtype: torch.dtype) -> torch.dtype:
    """The 16-bit scale/zero dtype nexuskv.hf.cache_for picks for a model of this dtype."""
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def setting_meta_dtype(s: Setting, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of setting `s`'s scales and zeros for a model of `model_dtype`."""
    if s.meta == META_16 or (s.meta is None and s.kind == NEXUSKV):
        return meta_dtype_for(model_dtype)
    if s.meta in (None, META_MODEL):
        return model_dtype
    raise ValueError(f"eval: Setting.meta must be None, {META_16!r} or {META_MODEL!r}, got {s.meta!r}")


@contextlib.contextmanager
def attention_for(model, s: Setting):
    """Runs the block with the attention implementation setting `s` is measured with:
    "nexuskv" (fused over the compressed cache) for nexuskv caches, "sdpa" for
    transformers' own caches (which attention "nexuskv" would run densely, with a warning)."""
    from . import hf
    from .hf_compat import attention_implementation

    previous = attention_implementation(model.config)
    model.set_attn_implementation(hf.ATTN_IMPLEMENTATION if s.kind == NEXUSKV else "sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def dense_cache(model):
    """The dense cache transformers makes for `model` in generate() (4.57 and 5.x):
    DynamicCache(config=...) holds only the last window of a sliding-window layer."""
    from transformers import DynamicCache

    from .hf_compat import text_config

    return DynamicCache(config=text_config(integrations.deepspeed.unwrap(model)))


def _quanto_16bit_scales_layer():
    """A QuantoQuantizedLayer whose scales and shifts are 16-bit for any model dtype:
    it quantizes a 16-bit copy of what it gets (quanto keeps scale and shift in the
    input's dtype) and hands the dequantized K/V back in the model's dtype.  Overrides
    only the layer's _quantize / _dequantize, the hooks QuantizedLayer subclasses implement."""
    from transformers.cache_utils import QuantoQuantizedLayer

    class Quanto16BitScalesLayer(QuantoQuantizedLayer):
        def _quantize(self, tensor, axis):
            self.model_dtype = tensor.dtype
            return super()._quantize(tensor.to(meta_dtype_for(tensor.dtype)), axis)

        def _dequantize(self, qtensor):
            return super()._dequantize(qtensor).to(self.model_dtype)

    return Quanto16BitScalesLayer


def quanto_cache(model, s: Setting):
    """transformers' QuantizedCache(backend="quanto") for setting `s` (its 16-bit-scales
    variant when s.meta == META_16).  transformers 5 refuses models with sliding-window
    layers (a ValueError, passed on); 4.57 takes them with every layer a full one."""
    from transformers import QuantizedCache

    model = integrations.deepspeed.unwrap(model)
    cache = QuantizedCache(backend="quanto", config=model.config, nbits=s.bits, residual_length=s.residual)
    if s.meta == META_16:
        layer = _quanto_16bit_scales_layer()
        cache.layers = [layer(nbits=s.bits, residual_length=s.residual) for _ in cache.layers]
    elif s.meta not in (None, META_MODEL):
        setting_meta_dtype(s, model.dtype)  # raises
    return cache


def make_cache(model, s: Setting, direct: bool = False, seed: int = 0):
    """A fresh cache of setting `s` for `model`.  direct=True: a nexuskv cache that is
    filled by calling its update() (the model's attention is not involved: the
    dequantize path).  `seed`: the rotation's random signs."""
    model = integrations.deepspeed.unwrap(model)
    if s.kind == DENSE:
        return dense_cache(model)
    if s.kind == QUANTO:
        return quanto_cache(model, s)
    from . import hf

    # a recipe's bit map replaces `bits` (0 in its Setting) layer by layer
    return hf.cache_for(model, bits=s.bits if not s.recipe else 4, group_size=s.group_size,
                        value_group_size=s.value_group_size,
                        residual=s.residual, outliers=s.key_outliers, value_outliers=s.value_outliers,
                        dynamic_keys=s.dgq, rotate=s.rotate, seed=seed, sinks=s.sinks,
                        meta_dtype=setting_meta_dtype(s, model.dtype), fused=False if direct else None,
                        window_residual=s.window_residual, recipe=_recipe(s.recipe) if s.recipe else None,
                        fit_range=s.fit_range, value_fit_range=s.value_fit_range)


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nq_bits(bits: int, group_size: int, head_dim: int, outliers: int, meta_dtype, x_dtype,
             channel_groups: bool = False) -> float:
    """Bits per element of one NQ tensor, from the format (nq_format.h, mirrored in _format):
    packed codes + per group two meta values and `outliers` (index byte + value).  Key
    groups run over tokens (one group per `group_size` tokens of a channel); value groups
    (`channel_groups`) over the head_dim channels of one token, ceil(head_dim / group_size)
    of them: a group longer than head_dim still costs one per token (SmolLM2's 64 channels
    in "groups of 128" pay for groups of 64)."""
    code_bits = 8 * _format.row_bytes(bits, head_dim) / head_dim
    meta_bits = 8 * (2 * _element_bytes(meta_dtype) + outliers * (1 + _element_bytes(x_dtype)))
    per_element = _format.ceil_div(head_dim, group_size) / head_dim if channel_groups else 1 / group_size
    return code_bits + meta_bits * per_element


def effective_bits(s: Setting, head_dim: int, model_dtype: torch.dtype) -> Dict[str, float]:
    """{"keys", "values", "kv"}: effective bits per element of the compressed part
    (the mean of keys and values for "kv"); the dense cache gives its dtype's bits."""
    if s.kind == DENSE:
        b = 8 * _element_bytes(model_dtype)
        return {"keys": b, "values": b, "kv": b}
    meta = setting_meta_dtype(s, model_dtype)
    if s.kind == QUANTO:
        # quanto packs nbits codes and keeps a scale and a shift per group of 64, both
        # in the input dtype (measured against its tensors by cache_bytes below).
        b = s.bits + 2 * 8 * _element_bytes(meta) / 64
        return {"keys": b, "values": b, "kv": b}
    # a recipe: each layer's bits, every layer's K/V weighted alike (per token written)
    bit_map = _recipe(s.recipe).bit_map.tolist() if s.recipe else [[s.bits, s.bits]]
    k = sum(_nq_bits(kb, s.group_size, head_dim, s.key_outliers, meta, model_dtype) for kb, _ in bit_map)
    v = sum(_nq_bits(vb, s.value_group_size, head_dim, s.value_outliers, meta, model_dtype, channel_groups=True)
            for _, vb in bit_map)
    k, v = k / len(bit_map), v / len(bit_map)
    if s.dgq:  # + segment_starts: one int32 per token group and row of head_dim channels
        k += 32 / (s.group_size * head_dim)
    return {"keys": k, "values": v, "kv": (k + v) / 2}


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def _quanto_bytes(q) -> int:
    """Bytes of an optimum-quanto WeightQBitsTensor: packed codes, scale, shift."""
    return _tensor_bytes(q._data._data) + _tensor_bytes(q._scale) + _tensor_bytes(q._shift)


def cache_bytes(cache) -> Dict[str, int]:
    """{"total", "compressed", "full_precision", "used"}: bytes of the tensors the cache
    holds (allocated capacity included).  "full_precision" is the dense tail (and for
    nexuskv the sink tokens and the rotation signs); for a dense cache everything is full
    precision.  "used": the bytes of the cached tokens only (nexuskv: used_nbytes(), the
    format's exact count without the growth capacity; the others allocate exactly)."""
    from transformers import DynamicCache, QuantizedCache

    from . import hf

    if isinstance(cache, hf.NexusKVCache):
        total = cache.nbytes
        comp = sum(layer.cache.compressed_nbytes() for layer in cache.layers)
        used = sum(layer.nbytes if layer.external is not None else layer.cache.used_nbytes() for layer in cache.layers)
        return {"total": total, "compressed": comp, "full_precision": total - comp, "used": used}
    if isinstance(cache, QuantizedCache):
        comp = sum(_quanto_bytes(layer._quantized_keys) + _quanto_bytes(layer._quantized_values)
                   for layer in cache.layers if layer.is_initialized)
        tail = sum(_tensor_bytes(layer.keys) + _tensor_bytes(layer.values)
                   for layer in cache.layers if layer.is_initialized)
        return {"total": comp + tail, "compressed": comp, "full_precision": tail, "used": comp + tail}
    if isinstance(cache, DynamicCache):
        total = sum(_tensor_bytes(layer.keys) + _tensor_bytes(layer.values)
                    for layer in cache.layers if layer.is_initialized)
        return {"total": total, "compressed": 0, "full_precision": total, "used": total}
    raise TypeError(f"cache_bytes: expected a DynamicCache, QuantizedCache or nexuskv.hf.NexusKVCache, "
                    f"got {type(cache).__name__}")


def model_facts(model) -> Dict:
    """What the JSON records about the model that was actually run: its class and
    architecture, size, layers and their windows, and the dense baseline."""
    from .hf_compat import layer_geometries, text_config

    model = integrations.deepspeed.unwrap(model)
    cfg = text_config(model)
    geometries = layer_geometries(model)
    return {"class": type(model).__name__, "model_type": getattr(cfg, "model_type", None),
            "name_or_path": getattr(model.config, "name_or_path", None) or getattr(model, "name_or_path", None),
            "parameters": sum(p.numel() for p in model.parameters()), "layers": cfg.num_hidden_layers,
            "kv_heads": geometries[0].kv_heads, "head_dim": geometries[0].key_dim,
            "sliding_window_layers": [i for i, g in enumerate(geometries) if g.window],
            "sliding_window": next((g.window for g in geometries if g.window), None),
            "dense_baseline": DENSE_BASELINE,
            "generation_cache_implementation": getattr(getattr(model, "generation_config", None),
                                                       "cache_implementation", None)}


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_elements_per_token(config) -> int:
    """K and V elements one token adds to the cache over all layers."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim_of(config)


def parse_settings(names: Optional[str], available: List[Setting]) -> List[Setting]:
    """The settings among `available` whose names contain one of the comma-separated
    substrings of `names` ("all" or None: all of them)."""
    if names is None or names == "all":
        return list(available)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    chosen = [s for s in available if any(w in s.name for w in wanted)]
    if not chosen:
        raise ValueError(f"eval: no setting matches {names!r}; settings are: "
                         + "; ".join(s.name for s in available))
    return chosen
