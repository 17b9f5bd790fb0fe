"""Hugging Face transformers binding: a Cache whose layers are nexuskv
KVCache objects (the C++ cache, csrc/include/nexuskv/cache.h), and an
attention function registered with transformers' AttentionInterface so that
decoding attends straight over the compressed cache.

    import nexuskv.hf
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="nexuskv")
    out = model.generate(ids, past_key_values=nexuskv.hf.cache_for(model, bits=4))

Only public extension points are used: Cache / CacheLayerMixin, AttentionInterface
and AttentionMaskInterface."""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import ops  # noqa: F401  (loads the operator library, which defines torch.classes.nexuskv)

ATTN_IMPLEMENTATION = "nexuskv"


class NexusKVLayer(CacheLayerMixin):
    """One layer's compressed K/V.  With ``fused=True`` update() returns only the new
    tokens and nexuskv_attention reads the cache; otherwise update() returns the whole
    dequantized K/V (transient) for any attention implementation."""

    is_sliding = False
    is_compileable = False

    def __init__(self, key_bits=4, value_bits=4, group_size=64, residual=128, key_outliers=0, value_outliers=0,
                 dynamic_keys=False, rotate=False, seed=0, fused=True, value_group_size=None, meta_dtype=None):
        super().__init__()
        self.cache = torch.classes.nexuskv.KVCache(key_bits, group_size, -2, key_outliers, dynamic_keys, value_bits,
                                                   value_group_size or group_size, -1, value_outliers, residual,
                                                   rotate, seed, meta_dtype)
        self.fused = fused
        self.pending = None  # (k, v) of the current forward, fused mode
        self.seen = 0  # positions seen by the model (its mask and rotary positions count them all)

    def lazy_initialization(self, key_states: torch.Tensor):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: Optional[dict[str, Any]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        self.seen += key_states.shape[-2]
        if self.fused:
            if self.pending is not None:
                raise RuntimeError(
                    "nexuskv: this cache was made for attn_implementation='nexuskv', but the model's attention "
                    "did not consume the previous K/V (it runs another implementation); make the cache with "
                    "nexuskv.hf.cache_for(model) after choosing the model's attention implementation")
            # Appended by nexuskv_attention, which sees the mask and drops left padding.  It gets
            # these very tensors; the tag leads it back to this layer.
            self.pending = (key_states, value_states)
            key_states._nexuskv_layer = self
            return key_states, value_states
        self.cache.append(key_states, value_states, None)
        k, v, _ = self.cache.dense(None)
        return k, v

    def append_pending(self, valid: Optional[torch.Tensor]) -> None:
        k, v = self.pending
        self.pending = None
        self.cache.append(k, v, valid)

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.seen + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self.cache.reset()
        self.pending = None
        self.seen = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("nexuskv: beam search over a compressed cache is not supported yet")

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes()


class NexusKVCache(Cache):
    """A transformers Cache with one NexusKVLayer per decoder layer."""

    def __init__(self, num_layers: int, **layer_kwargs):
        super().__init__(layers=[NexusKVLayer(**layer_kwargs) for _ in range(num_layers)])

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds (compressed parts, tails, capacity included)."""
        return sum(layer.nbytes for layer in self.layers)


def cache_for(model, bits: int = 4, value_bits: Optional[int] = None, group_size: int = 64, residual: int = 128,
              outliers: int = 0, dynamic_keys: bool = False, rotate: bool = False, seed: int = 0,
              value_group_size: Optional[int] = None, value_outliers: Optional[int] = None,
              meta_dtype: Optional[torch.dtype] = None) -> NexusKVCache:
    """A compressed cache sized for `model`: keys per channel (groups of `group_size`
    tokens), values per token (groups of `value_group_size` channels, default
    `group_size`), `residual` newest tokens in full precision.  Scales and zeros are
    16-bit by default (the model's dtype if it is 16-bit, else bfloat16), so that an
    fp32 model's cache costs the same bits as a 16-bit one's.  Attention runs fused when
    the model uses attn_implementation="nexuskv", otherwise over transiently
    dequantized K/V."""
    register()
    fused = model.config._attn_implementation == ATTN_IMPLEMENTATION
    if meta_dtype is None:
        meta_dtype = model.dtype if model.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    return NexusKVCache(model.config.num_hidden_layers, key_bits=bits, value_bits=value_bits or bits,
                        group_size=group_size, residual=residual, key_outliers=outliers,
                        value_outliers=outliers if value_outliers is None else value_outliers,
                        dynamic_keys=dynamic_keys, rotate=rotate, seed=seed, fused=fused,
                        value_group_size=value_group_size, meta_dtype=meta_dtype)


def _new_token_validity(attention_mask: Optional[torch.Tensor], q_len: int) -> Optional[torch.Tensor]:
    """[B, q_len] True for the new tokens that are real (not padding), read off the
    newest query's row of the 4-D mask; None when nothing is masked."""
    if attention_mask is None:
        return None
    last = attention_mask[:, 0, -1, -q_len:]
    visible = last if last.dtype == torch.bool else last == 0
    return None if bool(visible.all()) else visible


def nexuskv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface function: appends the layer's new K/V (left padding dropped)
    and attends over the compressed cache with dgq_fused_attention.  A padded prefill,
    whose queries include pad positions, attends over its own new K/V with the mask
    instead (exact; nothing older exists).  Returns ([batch, q_len, heads, head_dim], None)."""
    layer = getattr(key, "_nexuskv_layer", None)
    if layer is None:  # K/V do not come from a fused nexuskv cache: plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    q_len = query.shape[-2]
    first_call = layer.seen == q_len
    layer.append_pending(_new_token_validity(attention_mask, q_len))
    if bool((layer.cache.lengths() < q_len).any()):
        if not first_call:
            raise NotImplementedError("nexuskv: a padded chunk after the prefill is not supported")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = layer.cache.attend(query, scaling)  # [B, Hq, Lq, D]
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register() -> None:
    """Registers attn_implementation="nexuskv" (attention function and its mask builder)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_IMPLEMENTATION, nexuskv_attention)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _registered = True


register()
