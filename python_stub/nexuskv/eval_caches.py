"""The KV caches that `python -m nexuskv eval` and `demo` compare: one Setting per
cache (dense, nexuskv, transformers' QuantizedCache with optimum-quanto), how to
build it for a model, the bytes it really holds, and the effective bits of its
compressed part from the format (every scale, zero, index and outlier counted;
the full-precision tail is reported separately, never averaged in)."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch

from . import _format, integrations

DENSE, NEXUSKV, QUANTO = "dense", "nexuskv", "quanto"
QUANTO_RESIDUAL = 128  # transformers' default residual_length for QuantizedCache


@dataclass(frozen=True)
class Setting:
    """One cache configuration.  nexuskv: keys per channel in groups of `group_size`
    tokens (DGQ data-chosen groups when `dgq`), values per token in groups of
    `value_group_size` channels; `residual` newest tokens kept in the model's dtype.
    quanto: transformers' QuantizedCache(backend="quanto") with its defaults
    (axis 0, q_group_size 64, residual_length 128)."""

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

    @property
    def name(self) -> str:
        if self.kind == DENSE:
            return "dense"
        if self.kind == QUANTO:
            return f"quanto {self.bits}-bit g64 tail {self.residual}"
        groups = f"K g{self.group_size}" + ("" if self.value_group_size == self.group_size
                                            else f" V g{self.value_group_size}")
        extra = "".join([f" K+{self.key_outliers}out" if self.key_outliers else "",
                         f" V+{self.value_outliers}out" if self.value_outliers else "",
                         " rot" if self.rotate else "", " DGQ" if self.dgq else "",
                         f" sinks {self.sinks}" if self.sinks else ""])
        return f"nexuskv {self.bits}-bit tail {self.residual} {groups}{extra}"

    def as_dict(self) -> Dict:
        return dict(asdict(self), name=self.name)


def nexuskv(bits: int, residual: int = 128, **kw) -> Setting:
    return Setting(NEXUSKV, bits=bits, residual=residual, **kw)


def quanto(bits: int) -> Setting:
    return Setting(QUANTO, bits=bits, residual=QUANTO_RESIDUAL)


DENSE_SETTING = Setting(DENSE)
# The best 2-bit setting at <= 2.6 effective bits found on SmolLM2 (benchmarks/RESULTS.md):
# the Hadamard rotation, groups of 64, and the first 4 tokens kept exact (attention
# sinks: on 2048 tokens +10.3 % -> +3.0 %; 2, 8, 16, 64 sinks gave +4.0, +3.8, +3.9,
# +3.7 %).  Keys in groups of 128 with an exact outlier per group (2.53 bits with an fp32
# model) measured worse; outliers in groups of 64 help but cost more than the 2.6-bit budget.
BEST_2BIT = nexuskv(2, 128, rotate=True, sinks=4)


def grid(bits=(8, 4, 3, 2), tails=(0, 128), ablation_bits=(4, 2),
         ablations=("outliers", "rotate", "dgq", "sinks"), best_2bit: bool = True, quanto_bits=(4, 2)) -> List[Setting]:
    """The default comparison: every bit width at each tail, then one knob at a time
    (outliers on, rotation on, DGQ instead of fixed groups, 4 sink tokens) at `ablation_bits` with a
    128-token tail, the best 2-bit setting, and quanto at `quanto_bits`."""
    rows = [DENSE_SETTING] + [nexuskv(b, t) for b in bits for t in tails]
    knob = {"outliers": dict(key_outliers=1, value_outliers=1), "rotate": dict(rotate=True), "dgq": dict(dgq=True),
            "sinks": dict(sinks=4)}
    for a in ablations:
        if a not in knob:
            raise ValueError(f"eval: ablations must be among {sorted(knob)}, got {a!r}")
    rows += [nexuskv(b, 128, **knob[a]) for b in ablation_bits for a in ablations]
    if best_2bit:
        rows.append(BEST_2BIT)
    rows += [quanto(b) for b in quanto_bits]
    seen = set()
    return [r for r in rows if not (r in seen or seen.add(r))]


def meta_dtype_for(model_dtype: torch.dtype) -> torch.dtype:
    """The 16-bit scale/zero dtype nexuskv.hf.cache_for picks for a model of this dtype."""
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


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


def make_cache(model, s: Setting, direct: bool = False):
    """A fresh cache of setting `s` for `model`.  direct=True: a nexuskv cache that is
    filled by calling its update() (the model's attention is not involved)."""
    model = integrations.deepspeed.unwrap(model)
    if s.kind == DENSE:
        from transformers import DynamicCache

        return DynamicCache()
    if s.kind == QUANTO:
        from transformers import QuantizedCache

        return QuantizedCache(backend="quanto", config=model.config, nbits=s.bits, residual_length=s.residual)
    from . import hf

    kw = dict(key_bits=s.bits, value_bits=s.bits, group_size=s.group_size, value_group_size=s.value_group_size,
              residual=s.residual, key_outliers=s.key_outliers, value_outliers=s.value_outliers, dynamic_keys=s.dgq,
              rotate=s.rotate, sinks=s.sinks, meta_dtype=meta_dtype_for(model.dtype))
    if direct:
        return hf.NexusKVCache(model.config.num_hidden_layers, fused=False, **kw)
    return hf.cache_for(model, bits=s.bits, group_size=s.group_size, value_group_size=s.value_group_size,
                        residual=s.residual, outliers=s.key_outliers, value_outliers=s.value_outliers,
                        dynamic_keys=s.dgq, rotate=s.rotate, sinks=s.sinks, meta_dtype=meta_dtype_for(model.dtype))


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nq_bits(bits: int, group_size: int, head_dim: int, outliers: int, meta_dtype, x_dtype) -> float:
    """Bits per element of one NQ tensor, from the format (nq_format.h, mirrored in _format):
    packed codes + per group two meta values and `outliers` (index byte + value)."""
    code_bits = 8 * _format.row_bytes(bits, head_dim) / head_dim
    meta_bits = 8 * (2 * _element_bytes(meta_dtype) + outliers * (1 + _element_bytes(x_dtype)))
    return code_bits + meta_bits / group_size


def effective_bits(s: Setting, head_dim: int, model_dtype: torch.dtype) -> Dict[str, float]:
    """{"keys", "values", "kv"}: effective bits per element of the compressed part
    (the mean of keys and values for "kv"); the dense cache gives its dtype's bits."""
    if s.kind == DENSE:
        b = 8 * _element_bytes(model_dtype)
        return {"keys": b, "values": b, "kv": b}
    if s.kind == QUANTO:
        # quanto packs nbits codes and keeps a scale and a shift per group of 64, both
        # in the input dtype (measured against its tensors by cache_bytes below).
        b = s.bits + 2 * 8 * _element_bytes(model_dtype) / 64
        return {"keys": b, "values": b, "kv": b}
    meta = meta_dtype_for(model_dtype)
    k = _nq_bits(s.bits, s.group_size, head_dim, s.key_outliers, meta, model_dtype)
    if s.dgq:  # + segment_starts: one int32 per token group and row of head_dim channels
        k += 32 / (s.group_size * head_dim)
    v = _nq_bits(s.bits, s.value_group_size, head_dim, s.value_outliers, meta, model_dtype)
    return {"keys": k, "values": v, "kv": (k + v) / 2}


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def _quanto_bytes(q) -> int:
    """Bytes of an optimum-quanto WeightQBitsTensor: packed codes, scale, shift."""
    return _tensor_bytes(q._data._data) + _tensor_bytes(q._scale) + _tensor_bytes(q._shift)


def cache_bytes(cache) -> Dict[str, int]:
    """{"total", "compressed", "full_precision"}: bytes of the tensors the cache holds
    (allocated capacity included).  "full_precision" is the dense tail (and for
    nexuskv the sink tokens and the rotation signs); for a dense cache everything is full precision."""
    from transformers import DynamicCache, QuantizedCache

    from . import hf

    if isinstance(cache, hf.NexusKVCache):
        total = cache.nbytes
        comp = sum(layer.cache.compressed_nbytes() for layer in cache.layers)
        return {"total": total, "compressed": comp, "full_precision": total - comp}
    if isinstance(cache, QuantizedCache):
        comp = sum(_quanto_bytes(layer._quantized_keys) + _quanto_bytes(layer._quantized_values)
                   for layer in cache.layers if layer.is_initialized)
        tail = sum(_tensor_bytes(layer.keys) + _tensor_bytes(layer.values)
                   for layer in cache.layers if layer.is_initialized)
        return {"total": comp + tail, "compressed": comp, "full_precision": tail}
    if isinstance(cache, DynamicCache):
        total = sum(_tensor_bytes(layer.keys) + _tensor_bytes(layer.values)
                    for layer in cache.layers if layer.is_initialized)
        return {"total": total, "compressed": 0, "full_precision": total}
    raise TypeError(f"cache_bytes: expected a DynamicCache, QuantizedCache or nexuskv.hf.NexusKVCache, "
                    f"got {type(cache).__name__}")


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
