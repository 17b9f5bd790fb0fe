"""The compileable Hugging Face cache: ``nexuskv.hf.cache_for(model, static=True,
max_cache_len=N)``.  Each layer is a StaticKVCache (nexuskv.static_cache: fixed capacity,
state in tensors), so that a decode step of the model is plain tensor code plus the two
operators static_kv_append_ and dgq_fused_attention, and compiles with
``torch.compile(model.forward, fullgraph=True)`` (pass ``cache_position``, as
``generate`` does) or exports with ``torch.export``.

The contract with the attention function ("nexuskv", nexuskv.hf.nexuskv_attention):
update() appends the new K/V at once and records the layer under its ``layer_idx``;
the attention function of that layer's module claims the record and attends over the
compressed cache.  (A plain dict keyed by layer index: torch.compile traces its updates,
whereas the dynamic cache's records are keyed by tensor identity.)  The static layers
need attn_implementation="nexuskv": with any other, update() raises.

What the dynamic cache has and this one has not: sinks, rotation, eviction (a sliding
layer masks within its window, in a buffer of max_cache_len tokens), crop, beam
reordering, padded batches, CUDA (the append kernel is CPU-only for now)."""

from __future__ import annotations

import copy
import weakref
from typing import Optional

import torch
from transformers.cache_utils import CacheLayerMixin

from . import hf_compat
from .static_cache import StaticKVCache

# layer_idx -> the static layer whose update() ran last and whose attention has not yet.
_updated: dict[int, "NexusKVStaticLayer"] = {}


class NexusKVStaticLayer(CacheLayerMixin):
    """One decoder layer's StaticKVCache, allocated at the first update for that batch."""

    is_compileable = True
    is_croppable = False

    def __init__(self, settings: dict, max_cache_len: int, layer_idx: int, geometry=None, config=None):
        super().__init__()
        self.settings = dict(settings)
        self.sliding_window = settings.get("window")
        self.is_sliding = self.sliding_window is not None
        self.max_cache_len = max_cache_len
        self.layer_idx = layer_idx
        self.geometry = geometry
        self._config = weakref.ref(config) if config is not None else None
        self.static: Optional[StaticKVCache] = None

    # Saving (pickle, torch.save): the StaticKVCache module saves its buffers; the config,
    # held by a weak reference, is not saved (NexusKVCache.bind(model) re-attaches one;
    # until then update() does not check the model's attention implementation).

    def __getstate__(self) -> dict:
        if _updated.get(self.layer_idx) is self:
            raise RuntimeError(
                f"nexuskv: static layer {self.layer_idx} is between its update() and its attention (a forward is "
                f"running); save the cache before or after a forward"
            )
        return dict(self.__dict__, _config=None)

    def __deepcopy__(self, memo) -> "NexusKVStaticLayer":
        # Not through __getstate__: a copy shares the config (a weak reference).
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            new.__dict__[name] = copy.deepcopy(value, memo)
        return new

    def bind_config(self, config) -> None:
        """Checks `config`'s attention implementation from now on (NexusKVCache.bind)."""
        self._config = weakref.ref(config)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: Optional[torch.Tensor] = None):
        B, H, _, D = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.static = StaticKVCache(B, H, D, self.max_cache_len, key_states.dtype, key_states.device, **self.settings)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        config = self._config() if self._config is not None else None
        if config is not None and hf_compat.attention_implementation(config) != hf_compat.ATTN_IMPLEMENTATION:
            raise RuntimeError(
                "nexuskv: cache_for(model, static=True) needs attn_implementation='nexuskv' (the "
                "static cache is read only by the fused kernel); use nexuskv.hf.enable(model, "
                "static=True, max_cache_len=N) or model.set_attn_implementation('nexuskv')"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        self.static.append(key_states, value_states)
        _updated[self.layer_idx] = self
        return key_states, value_states

    def attend(
        self, query: torch.Tensor, scaling: Optional[float], softcap: Optional[float], sliding_window: Optional[int]
    ) -> torch.Tensor:
        """[batch, q_len, heads, head_dim] over everything the layer holds."""
        if sliding_window != self.sliding_window:
            raise ValueError(
                f"nexuskv: layer {self.layer_idx} attends with sliding_window={sliding_window}, but its "
                f"cache was made for {self.sliding_window}"
            )
        return self.static.attend(query, scaling, softcap).transpose(1, 2).contiguous()

    def get_mask_sizes(self, cache_position_or_length) -> tuple[int, int]:
        # The fused kernel masks by lengths; the model's mask only covers the new
        # tokens (a constant size, so a compiled step does not specialize on it).
        q = hf_compat.query_length(cache_position_or_length)
        return q, 0

    def get_seq_length(self):
        # A 0-d tensor, as transformers' own static layers return: a compiled or exported
        # step (transformers 5 asks for it in every mask) reads it without a host sync.
        return self.static.seq_lengths().max() if self.is_initialized else 0

    def get_max_length(self) -> int:  # transformers 5
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:  # transformers 4.57
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            self.static.reset()

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"nexuskv: the static cache has no {what}; use cache_for(model) (the dynamic cache) for it"
        )

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("beam reordering")

    def crop(self, length: int) -> None:
        self._unsupported("crop (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("batch expansion")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("batch selection")

    @property
    def nbytes(self) -> int:
        return self.static.nbytes if self.is_initialized else 0


def claim(module) -> Optional[NexusKVStaticLayer]:
    """The static layer that just updated the K/V of this attention module, if any."""
    return _updated.pop(getattr(module, "layer_idx", -1), None)


def static_settings(quant: dict, window: Optional[int]) -> dict:
    """StaticKVCache keywords from cache_for's make_cache keywords (see _layer_settings)."""
    if (
        quant.get("rotate")
        or quant.get("sinks")
        or quant.get("external_chunk")
        or quant.get("key_fit_range")
        or quant.get("value_fit_range")
    ):
        raise ValueError(
            "nexuskv: cache_for(model, static=True) takes no rotate, sinks, fit_range or Python compressor "
            "(the dynamic cache does)"
        )
    return dict(
        bits=quant["key_bits"],
        value_bits=quant["value_bits"],
        group_size=quant["key_group_size"],
        value_group_size=quant["value_group_size"],
        residual=quant["residual"],
        outliers=quant["key_outliers"],
        value_outliers=quant["value_outliers"],
        dynamic_keys=quant["key_dynamic"],
        meta_dtype=quant["meta_dtype"],
        window=window,
    )


class StaticDecodeStep(torch.nn.Module):
    """A model and its static cache as one module, the cache's tensors its buffers, for
    torch.export / AOTInductor: forward(input_ids [batch, n], cache_position [n]) -> logits
    of one step (the cache advances by n).  The cache must have seen the prefill (its
    buffers exist from the first update on).

        step = StaticDecodeStep(model, cache)
        program = torch.export.export(step, (next_ids, torch.tensor([t])))"""

    def __init__(self, model, cache):
        super().__init__()
        if not all(isinstance(layer, NexusKVStaticLayer) and layer.is_initialized for layer in cache.layers):
            raise ValueError(
                "nexuskv: StaticDecodeStep needs a cache_for(model, static=True) cache that has seen the prefill"
            )
        self.model, self.cache = model, cache
        self.cache_argument = hf_compat.cache_argument(model)
        for i, layer in enumerate(cache.layers):
            self.add_module(f"cache_{i}", layer.static)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.model(
            input_ids,
            cache_position=cache_position,
            position_ids=cache_position[None],
            **{self.cache_argument: self.cache},
        ).logits
