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
from .compressors import DGQ, NQ, KVCompressor

ATTN_IMPLEMENTATION = "nexuskv"


class _ExternalChunks:
    """The compressed chunks of a layer whose compressors are Python objects (any
    KVCompressor): the C++ cache keeps the policy (sinks, tail, chunking, lengths) and
    hands over each chunk due for compression; this keeps the compressed objects of
    each sequence in order and dequantizes them for the dense path."""

    def __init__(self, keys: KVCompressor, values: KVCompressor):
        self.keys, self.values = keys, values
        self.k: list[list[Any]] = []
        self.v: list[list[Any]] = []

    def take(self, cache) -> None:
        seq, _, ks, vs = cache.take_due_chunks()
        if not self.k:
            n = cache.lengths().numel()
            self.k, self.v = [[] for _ in range(n)], [[] for _ in range(n)]
        for b, k, v in zip(seq.tolist(), ks, vs):
            self.k[b].append(self.keys.compress(k))
            self.v[b].append(self.values.compress(v))

    def dense(self, cache, dtype: torch.dtype):
        def part(compressor, chunks):
            if not chunks:
                return torch.empty(0)
            return torch.cat([compressor.decompress(c, dtype) for c in chunks], -2)

        return cache.dense_with([part(self.keys, c) for c in self.k], [part(self.values, c) for c in self.v], None)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        idx = beam_idx.tolist()  # beams that share a parent get their own lists (chunks are immutable)
        self.k, self.v = [list(self.k[i]) for i in idx], [list(self.v[i]) for i in idx]

    @property
    def nbytes(self) -> int:
        return sum(comp.nbytes(c) for comp, seqs in ((self.keys, self.k), (self.values, self.v))
                   for chunks in seqs for c in chunks)


class NexusKVLayer(CacheLayerMixin):
    """One layer's compressed K/V.  With ``fused=True`` update() returns only the new
    tokens and nexuskv_attention reads the cache; otherwise update() returns the whole
    dequantized K/V (transient) for any attention implementation.  ``sinks``: first
    tokens of each sequence kept in full precision.  ``compressors=(keys, values)``:
    Python KVCompressor objects (e.g. a user's own class) that compress each chunk the
    C++ cache hands over, in chunks of ``group_size`` tokens; attention then runs over
    their dequantized output (the dequantize path)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, key_bits=4, value_bits=4, group_size=64, residual=128, key_outliers=0, value_outliers=0,
                 dynamic_keys=False, rotate=False, seed=0, fused=True, sinks=0, compressors=None, key_axis=-2,
                 value_axis=-1, expected_shape=None, value_group_size=None, meta_dtype=None):
        super().__init__()
        self.external = None
        if compressors is None:
            self.cache = torch.classes.nexuskv.KVCache(key_bits, group_size, key_axis, key_outliers, dynamic_keys,
                                                       value_bits, value_group_size or group_size, value_axis,
                                                       value_outliers, residual, rotate, seed, sinks, 0, meta_dtype)
        else:
            self.cache = torch.classes.nexuskv.KVCache(0, 1, -2, 0, False, 0, 1, -1, 0, residual, False, 0, sinks,
                                                       group_size)
            self.external = _ExternalChunks(*compressors)
            fused = False
        self.fused = fused
        self.expected_shape = expected_shape  # (kv_heads, head_dim) of the model the cache was made for
        self.pending = None  # (k, v) of the current forward, fused mode
        self.seen = 0  # positions seen by the model (its mask and rotary positions count them all)

    def lazy_initialization(self, key_states: torch.Tensor):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4 or value_states.shape != key_states.shape:
            raise ValueError(f"nexuskv: key and value states must have one shape [batch, kv_heads, tokens, "
                             f"head_dim], got {tuple(key_states.shape)} and {tuple(value_states.shape)}")
        if self.expected_shape is not None and tuple(key_states.shape[i] for i in (1, 3)) != self.expected_shape:
            heads, dim = self.expected_shape
            raise ValueError(f"nexuskv: this cache was made for a model with {heads} KV heads of head_dim {dim}, "
                             f"but gets K/V of shape {tuple(key_states.shape)}; make it with "
                             f"nexuskv.hf.cache_for(model) for the model that uses it")
        if key_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"nexuskv: key/value states must be float32, float16 or bfloat16, got "
                            f"{key_states.dtype}")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: Optional[dict[str, Any]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_states(key_states, value_states)
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
        if self.external is not None:
            self.external.take(self.cache)
            k, v, _ = self.external.dense(self.cache, key_states.dtype)
        else:
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
        if self.external is not None:
            self.external = _ExternalChunks(self.external.keys, self.external.values)
        self.pending = None
        self.seen = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b becomes the old row beam_idx[b] (the C++ cache reorders every
        stored tensor, length, sink and tail; Python-held chunks follow)."""
        if self.pending is not None:
            raise RuntimeError("nexuskv: reorder_cache() between update() and attention")
        if self.seen == 0:
            return
        self.cache.reorder(beam_idx)
        if self.external is not None:
            self.external.reorder(beam_idx)

    @property
    def nbytes(self) -> int:
        """Every byte the layer holds: the C++ cache's buffers plus, with Python
        compressors, each compressed chunk as its compressor counts it."""
        return self.cache.nbytes() + (self.external.nbytes if self.external is not None else 0)


class NexusKVCache(Cache):
    """A transformers Cache with one NexusKVLayer per decoder layer."""

    def __init__(self, num_layers: int, **layer_kwargs):
        super().__init__(layers=[NexusKVLayer(**layer_kwargs) for _ in range(num_layers)])

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        if layer_idx >= len(self.layers):
            raise ValueError(f"nexuskv: this cache was made for a model with {len(self.layers)} layers, but "
                             f"layer {layer_idx} uses it; make it with nexuskv.hf.cache_for(model) for the "
                             f"model that uses it")
        return super().update(key_states, value_states, layer_idx, cache_kwargs)

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds (compressed parts, sinks, tails, capacity included)."""
        return sum(layer.nbytes for layer in self.layers)


def _fused_kwargs(keys: KVCompressor, values: KVCompressor) -> Optional[dict]:
    """The C++ cache's own storage for NQ / DGQ compressors it can hold in place (and
    read with the fused kernel); None for anything else, which then runs through the
    compressors' own compress / decompress."""
    def spec(c):
        if type(c) not in (NQ, DGQ):
            return None
        return dict(bits=c.bits, group_size=c.group_size, axis=c.axis, outliers=c.num_outliers,
                    dynamic=isinstance(c, DGQ), rotate=c.rotate, seed=c.seed, meta_dtype=c.meta_dtype)

    k, v = spec(keys), spec(values)
    same = ("group_size", "rotate", "seed", "meta_dtype")  # one value for both in the C++ cache
    if k is None or v is None or v["dynamic"] or any(k[f] != v[f] for f in same):
        return None
    return dict(key_bits=k["bits"], value_bits=v["bits"], group_size=k["group_size"], key_axis=k["axis"],
                value_axis=v["axis"], key_outliers=k["outliers"], value_outliers=v["outliers"],
                dynamic_keys=k["dynamic"], rotate=k["rotate"], seed=k["seed"], meta_dtype=k["meta_dtype"])


def cache_for(model, bits: int = 4, value_bits: Optional[int] = None, group_size: int = 64, residual: int = 128,
              outliers: int = 0, dynamic_keys: bool = False, rotate: bool = False, seed: int = 0, sinks: int = 0,
              compressor: Optional[KVCompressor] = None, value_compressor: Optional[KVCompressor] = None,
              value_group_size: Optional[int] = None, value_outliers: Optional[int] = None,
              meta_dtype: Optional[torch.dtype] = None) -> NexusKVCache:
    """A compressed cache sized for `model`: keys per channel (groups of `group_size`
    tokens), values per token (groups of `value_group_size` channels, default
    `group_size`), `residual` newest tokens and the first `sinks` tokens of each
    sequence in full precision.  Scales and zeros are 16-bit by default (the model's
    dtype if it is 16-bit, else bfloat16), so that an fp32 model's cache costs the same
    bits as a 16-bit one's.  Attention runs fused when the model uses
    attn_implementation="nexuskv", otherwise over transiently dequantized K/V.

    ``compressor`` (keys, and values unless ``value_compressor`` is given) replaces the
    bits/group_size/outliers/dynamic_keys/rotate/meta_dtype arguments: NQ and DGQ are
    held by the C++ cache itself (fused attention); any other KVCompressor (a user's own
    class) compresses chunks of ``group_size`` tokens and attention runs over its
    dequantized output, whatever the attention implementation."""
    register()
    fused = model.config._attn_implementation == ATTN_IMPLEMENTATION
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    common = dict(residual=residual, sinks=sinks, fused=fused, expected_shape=(heads, head_dim))
    if compressor is not None or value_compressor is not None:
        if compressor is None or not isinstance(compressor, KVCompressor) or \
                (value_compressor is not None and not isinstance(value_compressor, KVCompressor)):
            raise TypeError("nexuskv: compressor (and value_compressor) must implement the KVCompressor protocol "
                            "(compress, decompress, nbytes)")
        values = value_compressor or compressor
        kw = _fused_kwargs(compressor, values)
        if kw is None:
            return NexusKVCache(cfg.num_hidden_layers, group_size=group_size, compressors=(compressor, values),
                                **common)
        return NexusKVCache(cfg.num_hidden_layers, **kw, **common)
    if meta_dtype is None:
        meta_dtype = model.dtype if model.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    return NexusKVCache(cfg.num_hidden_layers, key_bits=bits, value_bits=value_bits or bits,
                        group_size=group_size, key_outliers=outliers,
                        value_outliers=outliers if value_outliers is None else value_outliers,
                        dynamic_keys=dynamic_keys, rotate=rotate, seed=seed, value_group_size=value_group_size,
                        meta_dtype=meta_dtype, **common)


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
