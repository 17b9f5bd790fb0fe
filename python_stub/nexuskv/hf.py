"""Hugging Face transformers binding: a Cache whose layers are nexuskv KVCache
objects (the C++ cache, csrc/include/nexuskv/cache.h), and an attention function
registered with transformers' AttentionInterface so that attention runs straight
over the compressed cache.  transformers 4.57 and 5.x.

    import nexuskv.hf
    nexuskv.hf.enable(model, bits=4)        # attention "nexuskv" + a compressed cache in every generate()
    out = model.generate(ids, max_new_tokens=64)

or, explicitly, ``model.generate(ids, past_key_values=nexuskv.hf.cache_for(model, bits=4))``
(``cache=`` in transformers 5) with ``attn_implementation="nexuskv"``.

Only public extension points are used: Cache / CacheLayerMixin, AttentionInterface
and AttentionMaskInterface.

How a layer's K/V reach the attention function (the contract between
NexusKVLayer.update and nexuskv_attention).  When the model's attention
implementation is "nexuskv", update() stores nothing yet: it records the new K/V as
*pending* under the identity of the key tensor it returns (the very tensor the
model passes on to its attention function) and returns them unchanged.
nexuskv_attention claims the pending record by that identity, reads which new
tokens are real off the model's mask (left padding is dropped), appends them to
the compressed cache and attends over it with the fused kernel, with the layer's
sliding window and the model's soft-cap.  A record nobody claims (the model ran
another attention) is a clear error at the layer's next update; K/V that no
NexusKVLayer recorded (a dense cache) are attended densely, with a one-time
warning.  With any other attention implementation update() appends at once and
returns the dequantized K/V.

Saving a prefilled cache (a prompt cache): ``pickle.dumps(cache)`` or ``torch.save(cache,
f)``, then ``pickle.loads`` / ``torch.load(f, weights_only=False)`` (the cache's classes are
not tensors); the loaded cache continues bit-exactly.  No model is saved: each loaded layer
keeps the attention path it was on when saved, and ``cache.bind(model)`` makes it follow the
model's attention implementation again."""

from __future__ import annotations

import copy
import os
import pickle
import threading
import warnings
import weakref
from typing import Any, Optional, Tuple

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import (
    hf_compat,
    hf_static,
    integrations,
    ops,  # noqa: F401  (loads the operator library, which defines torch.classes.nexuskv)
)
from .cache import from_state_dict, make_cache
from .compressors import DGQ, NQ, KVCompressor
from .hf_compat import ATTN_IMPLEMENTATION, LayerGeometry, cache_argument  # noqa: F401  (cache_argument: public)

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


class _Claims(threading.local):
    """Pending K/V by the identity of their key tensor (see the module docstring), and
    the validity of the new tokens read off the last mask (one read per forward, not
    per layer)."""

    def __init__(self):
        self.pending: dict[int, "NexusKVLayer"] = {}
        self.mask = None  # (attention_mask, q_len, valid)


_claims = _Claims()


def _make_cache(settings: dict):
    """The C++ cache of one layer (torch.classes.nexuskv.KVCache) from make_cache's keywords."""
    return make_cache(**settings)


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
        self._keep_live(cache)

    def _keep_live(self, cache) -> None:
        """Keeps the newest compressed_lengths()[b] / chunk chunks of each sequence: a
        window evicts the oldest, a crop cuts the newest (then _keep_first)."""
        live = (cache.compressed_lengths() // cache.chunk()).tolist()
        for b, n in enumerate(live):
            del self.k[b][:len(self.k[b]) - n], self.v[b][:len(self.v[b]) - n]

    def _parts(self, dtype):
        def part(compressor, chunks):
            if not chunks:
                return torch.empty(0)
            return torch.cat([compressor.decompress(c, dtype) for c in chunks], -2)

        return [part(self.keys, c) for c in self.k], [part(self.values, c) for c in self.v]

    def dense(self, cache, dtype: torch.dtype):
        return cache.dense_with(*self._parts(dtype), None)

    def crop(self, cache, length: int, dtype: torch.dtype) -> None:
        cache.crop_with(length, *self._parts(dtype))
        live = (cache.compressed_lengths() // cache.chunk()).tolist()
        self.k = [chunks[:n] for chunks, n in zip(self.k, live)]
        self.v = [chunks[:n] for chunks, n in zip(self.v, live)]

    def reorder(self, beam_idx: torch.Tensor) -> None:
        idx = beam_idx.tolist()  # beams that share a parent get their own lists (chunks are immutable)
        self.k, self.v = [list(self.k[i]) for i in idx], [list(self.v[i]) for i in idx]

    @property
    def nbytes(self) -> int:
        return sum(comp.nbytes(c) for comp, seqs in ((self.keys, self.k), (self.values, self.v))
                   for chunks in seqs for c in chunks)


class NexusKVLayer(CacheLayerMixin):
    """One layer's compressed K/V.  ``settings``: the keywords of
    nexuskv.cache.make_cache (bits, groups, tail, sinks, window ...).  ``fused``: None
    (default) follows the model's attention implementation at every update ("nexuskv":
    update() returns only the new tokens and nexuskv_attention reads the cache;
    anything else: update() returns the whole dequantized K/V); True / False force one
    path.  ``compressors=(keys, values)``: Python KVCompressor objects (e.g. a user's
    own class) that compress each chunk the C++ cache hands over; attention then runs
    over their dequantized output.  ``window``: the layer's sliding window (tokens no
    query can see any more are evicted by the C++ cache)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, settings: Optional[dict] = None, fused: Optional[bool] = None, compressors=None,
                 geometry: Optional[LayerGeometry] = None, layer_idx: Optional[int] = None, config=None,
                 learn_heads: bool = False):
        super().__init__()
        settings = dict(settings or {})
        self.sliding_window = settings.get("window")
        self.is_sliding = self.sliding_window is not None
        self.external = None
        if compressors is not None:
            self.external = _ExternalChunks(*compressors)
            fused = False
        self.cache = _make_cache(settings)
        self.fused = fused
        self.geometry = geometry  # what the model that the cache was made for has in this layer
        self.learn_heads = learn_heads  # tensor-parallel shards: the KV heads come from the first append
        self.layer_idx = layer_idx
        self._config = weakref.ref(config) if config is not None else None  # deepcopy shares weakrefs
        # A layer loaded without its config (pickle keeps no model): the path it was on when
        # saved (True fused, False dequantize), followed until bind() re-attaches a config.
        self._fused_when_saved: Optional[bool] = None
        self.pending = None  # (k, v) of the current forward, fused path
        self.seen = 0  # positions seen by the model (its masks and rotary positions count them all)

    # -- transformers' layer API ----------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: Optional[torch.Tensor] = None):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4 or value_states.shape != key_states.shape:
            raise ValueError(f"nexuskv: key and value states must have one shape [batch, kv_heads, tokens, "
                             f"head_dim], got {tuple(key_states.shape)} and {tuple(value_states.shape)}")
        g = self.geometry
        if g is not None and (key_states.shape[3] != g.key_dim or
                              (not self.learn_heads and key_states.shape[1] != g.kv_heads)):
            heads = "some" if self.learn_heads else g.kv_heads
            raise ValueError(f"nexuskv: this cache was made for a model with {heads} KV heads of head_dim "
                             f"{g.key_dim}, but gets key_states of shape {tuple(key_states.shape)}; make it with "
                             f"nexuskv.hf.cache_for(model) for the model that uses it (kv_heads=N for a "
                             f"tensor-parallel shard)")
        if key_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"nexuskv: key/value states must be float32, float16 or bfloat16, got "
                            f"{key_states.dtype}")

    def _fused_now(self) -> bool:
        if self.fused is not None:
            return self.fused
        config = self._config() if self._config is not None else None
        if config is None:
            return bool(self._fused_when_saved)
        return hf_compat.attention_implementation(config) == ATTN_IMPLEMENTATION

    # -- saving: pickle, torch.save / torch.load(weights_only=False) -------------------------
    # The C++ cache is saved as its state dict (plain tensors; from_state_dict checks every
    # entry and continues bit-exactly).  The model's config is not saved: the cache holds
    # it by a weak reference (it does not own the model), so a loaded layer keeps the path
    # it was on when saved until NexusKVCache.bind(model) re-attaches a config.

    def __getstate__(self) -> dict:
        if self.pending is not None:
            raise RuntimeError(f"nexuskv: layer {self.layer_idx} is between its update() and its attention (a "
                               f"forward is running); save the cache before or after a forward")
        if self.external is not None:
            comps = (self.external.keys, self.external.values)
            try:
                pickle.dumps(comps)
            except Exception as e:
                names = " and ".join(dict.fromkeys(type(c).__name__ for c in comps))
                raise TypeError(f"nexuskv: layer {self.layer_idx} compresses with Python compressors ({names}) that "
                                f"cannot be pickled ({type(e).__name__}: {e}), so neither can the cache that holds "
                                f"their chunks") from None
        state = dict(self.__dict__)
        state["cache"] = self.cache.state_dict()
        state["_config"] = None
        state["_fused_when_saved"] = self._fused_now()
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        state["cache"] = from_state_dict(state["cache"])
        self.__dict__.update(state)

    def __deepcopy__(self, memo) -> "NexusKVLayer":
        # Not through __getstate__: a copy shares the config (a weak reference) and needs
        # no state dict round trip (the C++ cache copies itself).
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            new.__dict__[name] = copy.deepcopy(value, memo)
        return new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._check_states(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        if self.pending is not None:
            raise RuntimeError(
                "nexuskv: the previous K/V of this layer were never attended by attn_implementation='nexuskv' "
                "(the model's attention runs another implementation, or changed the K/V tensors between the "
                "cache update and attention); use nexuskv.hf.enable(model) or make the cache with fused=False")
        self.seen += key_states.shape[-2]
        if self._fused_now():
            self.pending = (key_states, value_states)
            _claims.pending[id(key_states)] = self
            return key_states, value_states
        evicted_before = self._evicted()
        # Held: the chunk's own tokens reach the attention exact (what a plain append of the
        # first would compress is compressed), the cache is settled after the read below.
        hold = key_states.shape[-2] > 1
        self._append(key_states, value_states, None, hold)
        if self.external is not None:
            self.external.take(self.cache)
            k, v, _ = self.external.dense(self.cache, key_states.dtype)
        else:
            k, v, _ = self.cache.dense(None)
        # The mask was sized before this append (get_mask_sizes): tokens it evicted are
        # ones no query of this forward sees; zeros keep the columns where the mask has them.
        gap = self._evicted() - evicted_before
        if gap:
            pad = k.new_zeros(k.shape[0], k.shape[1], gap, k.shape[3])
            k, v = torch.cat([pad, k], -2), torch.cat([pad, v], -2)
        if hold:
            self.settle()
        return k, v

    def get_mask_sizes(self, cache_position_or_length) -> tuple[int, int]:
        q = hf_compat.query_length(cache_position_or_length)
        if self._fused_now():
            # The fused path reads only which new tokens are real off the mask (its diagonal).
            return q, self.seen
        evicted = self._evicted()
        return self.seen - evicted + q, evicted

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:  # transformers 5
        return -1

    def get_max_cache_shape(self) -> int:  # transformers 4.57
        return -1

    def reset(self) -> None:
        self.cache.reset()
        if self.external is not None:
            self.external = _ExternalChunks(self.external.keys, self.external.values)
        self._drop_pending()
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

    def batch_repeat_interleave(self, repeats: int) -> None:
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"nexuskv: batch_repeat_interleave: repeats must be an int >= 1, got {repeats!r}")
        if self.seen:
            self._select_rows(torch.arange(self.cache.lengths().numel()).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.seen:
            idx = indices.nonzero().flatten() if indices.dtype == torch.bool else indices
            self._select_rows(idx.cpu())

    _BATCH_ENTRIES = ("lengths.", "keys.", "values.", "tail.", "sinks.")

    def _select_rows(self, idx: torch.Tensor) -> None:
        """Row b becomes old row idx[b], for any number of rows: reorder() when the batch
        keeps its size, else through the cache's state dict, whose per-sequence entries
        are batch-first (csrc/cache/cache_state.cpp documents the format)."""
        if self.pending is not None:
            raise RuntimeError("nexuskv: a batch change between update() and attention")
        rows = self.cache.lengths().numel()
        if idx.is_floating_point() or idx.is_complex() or idx.dim() != 1 or idx.numel() == 0:
            raise ValueError(f"nexuskv: batch indices must be a non-empty 1-D integer (or bool mask) tensor, got "
                             f"{idx.dtype} of shape {tuple(idx.shape)}")
        if bool(((idx < 0) | (idx >= rows)).any()):
            raise IndexError(f"nexuskv: batch indices must be in [0, {rows}) (the cached sequences), got "
                             f"{idx.tolist()}")
        if idx.numel() == self.cache.lengths().numel():
            self.reorder_cache(idx)
            return
        state = self.cache.state_dict()
        if any(k.startswith(("chunks.", "due.")) for k in state):
            raise NotImplementedError("nexuskv: changing the batch size of a cache with C++ chunk compressors")
        for k, v in state.items():
            if k.startswith(self._BATCH_ENTRIES):
                state[k] = v.index_select(0, idx.to(v.device))
        state["shape"] = state["shape"].clone()
        state["shape"][0] = idx.numel()
        self.cache = from_state_dict(state)
        if self.external is not None:
            self.external.reorder(idx)

    def crop(self, length: int) -> None:
        """Assisted / prompt-lookup decoding: drop the newest tokens (the argument as the
        installed transformers defines it: see hf_compat.crop_target)."""
        target = hf_compat.crop_target(self.seen, length)
        if target >= self.seen:
            return
        if self.pending is not None:
            raise RuntimeError("nexuskv: crop() between update() and attention")
        if self.external is not None and self.external.k:
            self.external.crop(self.cache, target - self.seen + self._positions(), self.dtype)
        else:
            self.cache.crop(target - self.seen + self._positions())
        self.seen = target

    def offload(self) -> None:
        if self.is_initialized:
            self.cache.to("cpu")

    def prefetch(self) -> None:
        if self.is_initialized:
            self.cache.to(str(self.device))

    # -- nexuskv ---------------------------------------------------------------------------

    def _positions(self) -> int:
        """Positions the longest cached sequence spans (evicted ones included): crop()'s
        unit.  Left padding, never cached, makes this less than `seen` on a padded batch."""
        if self.seen == 0 or self.cache.lengths().numel() == 0:
            return 0
        return int((self.cache.lengths() + self.cache.evicted_lengths()).max())

    def _evicted(self) -> int:
        if self.sliding_window is None or self.seen == 0:
            return 0
        ev = self.cache.evicted_lengths()
        return int(ev.max()) if ev.numel() else 0

    def _drop_pending(self) -> None:
        if self.pending is not None:
            _claims.pending.pop(id(self.pending[0]), None)
            self.pending = None

    def bind_config(self, config) -> None:
        """Follows `config`'s attention implementation from now on (NexusKVCache.bind)."""
        self._config = weakref.ref(config)
        self._fused_when_saved = None

    def append_pending(self, valid: Optional[torch.Tensor]) -> None:
        k, v = self.pending
        self.pending = None
        self._append(k, v, valid)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: Optional[torch.Tensor],
                hold: bool = False) -> None:
        """The C++ cache's append, its errors said in the layer's terms (what transformers
        passed: key_states / value_states); nothing is stored when it raises.  hold: see
        KVCache.append (nexuskv/cache.h, "Held appends")."""
        try:
            self.cache.append(key_states, value_states, valid, hold)
        except RuntimeError as e:
            raise RuntimeError(f"nexuskv: layer {self.layer_idx}: key_states / value_states not stored: {e}") from e

    def settle(self) -> None:
        """Compresses what held appends left in full precision (the C++ cache's settle()),
        once the forward that appended them has attended; with Python compressors the chunks
        now due are taken at once."""
        self.cache.settle()
        if self.external is not None:
            self.external.take(self.cache)

    @property
    def nbytes(self) -> int:
        """Every byte the layer holds: the C++ cache's buffers plus, with Python
        compressors, each compressed chunk as its compressor counts it."""
        return self.cache.nbytes() + (self.external.nbytes if self.external is not None else 0)


class NexusKVCache(Cache):
    """A transformers Cache with one NexusKVLayer per decoder layer.  cache_for(model)
    builds it for a model; ``NexusKVCache(num_layers, key_bits=4, ...)`` builds
    ``num_layers`` identical full-attention layers without one (K/V fed by update())."""

    def __init__(self, layers: list[NexusKVLayer] | int, fused: Optional[bool] = None, **settings):
        if isinstance(layers, int):
            if isinstance(layers, bool) or layers < 1:
                raise ValueError(f"nexuskv: NexusKVCache(layers) needs layers >= 1 (one per decoder layer), got "
                                 f"{layers!r}")
            layers = [NexusKVLayer(_layer_settings(**settings), fused=fused, layer_idx=i) for i in range(layers)]
        elif settings or fused is not None:
            raise TypeError("nexuskv: NexusKVCache(layers) takes no settings (they are the layers')")
        super().__init__(layers=layers)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx >= len(self.layers):
            raise ValueError(f"nexuskv: this cache was made for a model with {len(self.layers)} layers, but "
                             f"layer_idx {layer_idx} uses it; make it with nexuskv.hf.cache_for(model) for the "
                             f"model that uses it")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def bind(self, model) -> "NexusKVCache":
        """Re-attaches `model` to a cache loaded with pickle or torch.load (which save no
        model, so each loaded layer keeps the path, fused or dequantize, it was on when
        saved): its layers then follow the model's attention implementation again, as
        those of cache_for(model) do.  The model must have the layers the cache was made
        for.  Returns the cache."""
        model, _ = integrations.deepspeed.unwrap_for_cache(model, None)
        geometries = hf_compat.layer_geometries(model)
        if len(geometries) != len(self.layers):
            raise ValueError(f"nexuskv: bind: this cache has {len(self.layers)} layers, the model {len(geometries)}; "
                             f"bind it to the model it was made for")
        for i, (layer, g) in enumerate(zip(self.layers, geometries)):
            made = layer.geometry
            if made is not None and (made.key_dim, made.window) != (g.key_dim, g.window):
                raise ValueError(f"nexuskv: bind: layer {i} of this cache was made for head_dim {made.key_dim} and "
                                 f"window {made.window}, the model's has {g.key_dim} and {g.window}; bind it to the "
                                 f"model it was made for")
        config = hf_compat.text_config(model)
        for layer in self.layers:
            layer.bind_config(config)
        return self

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds (compressed parts, sinks, tails, capacity included)."""
        return sum(layer.nbytes for layer in self.layers)


def _check_quant_args(**args) -> None:
    """cache_for's quantization arguments, checked under their own names (the C++ cache
    would name its key_/value_ settings, which the caller did not write)."""
    for name in ("bits", "value_bits", "group_size", "value_group_size", "outliers", "value_outliers"):
        value = args[name]
        if value is None and name.startswith("value_"):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"nexuskv: cache_for: {name} must be an int, got {type(value).__name__}")
    for name in ("bits", "value_bits"):
        if args[name] is not None and args[name] not in (2, 3, 4, 8):
            raise ValueError(f"nexuskv: cache_for: {name} must be one of 2, 3, 4, 8, got {args[name]}")
    for name in ("group_size", "value_group_size"):
        if args[name] is not None and not 1 <= args[name] <= 256:
            raise ValueError(f"nexuskv: cache_for: {name} must be in [1, 256], got {args[name]}")
    for name, group in (("outliers", "group_size"), ("value_outliers", "value_group_size")):
        limit = args[group] if args[group] is not None else args["group_size"]
        if args[name] is not None and not 0 <= args[name] < limit:
            raise ValueError(f"nexuskv: cache_for: {name} must be in [0, {group}) = [0, {limit}), got {args[name]}")
    meta = args["meta_dtype"]
    if meta is not None and meta not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"nexuskv: cache_for: meta_dtype must be torch.float32, torch.float16, torch.bfloat16 or "
                         f"None, got {meta}")


def _layer_settings(key_bits=4, value_bits=None, group_size=64, value_group_size=None, residual=128,
                    key_outliers=0, value_outliers=0, dynamic_keys=False, rotate=False, seed=0, sinks=0,
                    meta_dtype=None, window=None, fit_range=False, value_fit_range=False) -> dict:
    """make_cache keywords of one layer, from cache_for's names."""
    # None (not 0, which make_cache rejects by name) means "as the keys"
    return dict(key_bits=key_bits, key_group_size=group_size, key_axis=-2, key_outliers=key_outliers,
                key_dynamic=dynamic_keys, value_bits=key_bits if value_bits is None else value_bits,
                value_group_size=group_size if value_group_size is None else value_group_size, value_axis=-1,
                value_outliers=value_outliers,
                residual=residual, sinks=sinks, rotate=rotate, seed=seed, meta_dtype=meta_dtype, window=window,
                key_fit_range=fit_range, value_fit_range=value_fit_range)


def _fused_settings(keys: KVCompressor, values: KVCompressor) -> Optional[dict]:
    """make_cache keywords for NQ / DGQ compressors the C++ cache can hold in place (and
    read with the fused kernel); None for anything else, which then runs through the
    compressors' own compress / decompress."""
    def spec(c):
        if type(c) not in (NQ, DGQ):
            return None
        return dict(bits=c.bits, group_size=c.group_size, axis=c.axis, outliers=c.num_outliers,
                    dynamic=isinstance(c, DGQ), rotate=c.rotate, seed=c.seed, meta_dtype=c.meta_dtype,
                    fit_range=c.fit_range)

    k, v = spec(keys), spec(values)
    same = ("rotate", "seed", "meta_dtype")  # one value for both in the C++ cache
    if k is None or v is None or v["dynamic"] or any(k[f] != v[f] for f in same):
        return None
    return dict(key_bits=k["bits"], key_group_size=k["group_size"], key_axis=k["axis"], key_outliers=k["outliers"],
                key_dynamic=k["dynamic"], value_bits=v["bits"], value_group_size=v["group_size"],
                value_axis=v["axis"], value_outliers=v["outliers"], rotate=k["rotate"], seed=k["seed"],
                meta_dtype=k["meta_dtype"], key_fit_range=k["fit_range"], value_fit_range=v["fit_range"])


def _probe(settings: dict, g: LayerGeometry, dtype: torch.dtype, fused: bool, what: str) -> None:
    """Runs the cache once on a few zero tokens of this layer's shape (one head), so that
    settings the C++ cache or the fused kernel cannot take fail here, naming the layer,
    and not half-way through generate()."""
    def first_line(e):
        return str(e).strip().splitlines()[0]

    where = f"nexuskv: {what} ({g.kv_heads} KV heads, head_dim {g.key_dim})"
    try:
        cache = _make_cache(settings)
        n = settings.get("residual", 0) + settings.get("sinks", 0) + 2 * max(
            settings.get("key_group_size", 1), settings.get("value_group_size", 1), settings.get("external_chunk", 1))
        kv = torch.zeros(1, 1, n, g.key_dim, dtype=dtype)
        cache.append(kv, kv, None)
        if settings.get("external_chunk"):
            cache.take_due_chunks()
            return
        cache.dense(None)
    except RuntimeError as e:
        raise ValueError(f"{where}: these cache settings do not fit: {first_line(e)}") from None
    if fused:
        try:
            cache.attend(torch.zeros(1, 1, 1, g.key_dim, dtype=dtype), None, None)
        except RuntimeError as e:
            raise ValueError(f"{where}: the fused attention kernel cannot take this layer: {first_line(e)}; "
                             f"cache_for(..., fused=False) runs the dequantize path with any other attention "
                             f"implementation") from None


def _check_kv_heads(kv_heads) -> None:
    if kv_heads is None or kv_heads == "auto":
        return
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        raise ValueError(f"nexuskv: kv_heads must be a positive int (the KV heads this process holds), \"auto\" or "
                         f"None, got {kv_heads!r}")


DEFAULT_RESIDUAL = 64  # the full-precision tail of full-attention layers when cache_for is given none
# The first tokens of each sequence kept in full precision when cache_for is given no `sinks`
# (the dynamic cache; the static one keeps none), and with them fitted key ranges
# (fit_range=None: on when there are sinks).  Below 4 bits the two are what makes the cache
# usable (2.5 bits: +19.6 / +34.6 / +13.5 / +32.2 % plain, +2.3 / +2.1 / +4.1 / +4.8 % with both,
# SmolLM2 and Gemma 3 on two texts); at 4 bits the default with them is within noise of the one
# without (+0.41 / +0.70 / +0.03 / +1.17 against +0.43 / +0.76 / -0.01 / +1.64 %): benchmarks/
# RESULTS.md, "Defaults at 4 bits".  They take 4 of the byte policy's 64 full-precision tokens.
DEFAULT_SINKS = 4
# At 2 bits cache_for's defaults change: keys in groups of 128 tokens (values of 128 channels, or
# the whole head if narrower), so scales and zeros cost 0.25 bits instead of 0.5, and a 128-token
# tail on every layer, sliding-window ones too (+ the sinks).  Measured (benchmarks/RESULTS.md,
# "2 bits at the recipes' policy"; SmolLM2 and Gemma 3, the manual / songs and poems): +1.63 /
# +2.11 / +1.92 / +2.42 % at 2.375 / 2.25 bits, against +3.0 / +3.5 / +7.8 / +8.8 % at 2.5 bits
# with 4-bit's groups of 64 and byte-policy tails.  3 bits keep 4-bit's policy (this one was within
# noise on three runs, higher on SmolLM2's poems, and took Gemma 3 to 31 % of its native bytes:
# "Defaults by width").  The mixed-precision maps of `calibrate` are allocated for this policy too.
LOW_BITS = 2
LOW_BITS_GROUP_SIZE = 128
LOW_BITS_RESIDUAL = 128


def default_policy(bits=4, value_bits=None, recipe_bits: Optional[dict] = None) -> dict:
    """The groups, tails and sinks cache_for takes for those it is not given: a recipe's
    (``recipe_bits``: its header, what its bit map was allocated for), else by width: keys and
    values of at most LOW_BITS bits get LOW_BITS_GROUP_SIZE and a LOW_BITS_RESIDUAL tail on every
    layer; wider ones groups of 64 and the byte policy (``residual`` None: DEFAULT_RESIDUAL
    tokens minus the sinks on full-attention layers, none on sliding-window ones)."""
    if recipe_bits and "group_size" in recipe_bits:
        def field(name, default, least):
            v = recipe_bits.get(name)
            v = default if v is None else v  # absent or null: the default
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"nexuskv: the recipe's bits.{name} must be an int >= {least}, got {v!r}")
            return v

        group, residual = field("group_size", None, 1), field("residual", 128, 0)
        return dict(group_size=group, value_group_size=field("value_group_size", group, 1), residual=residual,
                    window_residual=field("window_residual", residual, 0), sinks=field("sinks", 0, 0))
    widths = (bits, bits if value_bits is None else value_bits)
    if all(isinstance(b, int) and not isinstance(b, bool) and b <= LOW_BITS for b in widths):
        return dict(group_size=LOW_BITS_GROUP_SIZE, value_group_size=LOW_BITS_GROUP_SIZE, residual=LOW_BITS_RESIDUAL,
                    window_residual=LOW_BITS_RESIDUAL, sinks=DEFAULT_SINKS)
    return dict(group_size=64, value_group_size=64, residual=None, window_residual=0, sinks=DEFAULT_SINKS)


def byte_policy_residual(sinks) -> int:
    """The tail of full-attention layers under the byte policy: DEFAULT_RESIDUAL full-precision
    tokens, the sinks among them."""
    return max(DEFAULT_RESIDUAL - (sinks if isinstance(sinks, int) else 0), 0)


def cache_for(model, bits: int = 4, value_bits: Optional[int] = None, group_size: Optional[int] = None,
              residual: Optional[int] = None,
              outliers: int = 0, dynamic_keys: bool = False, rotate: bool = False, seed: int = 0,
              sinks: Optional[int] = None,
              compressor: Optional[KVCompressor] = None, value_compressor: Optional[KVCompressor] = None,
              value_group_size: Optional[int] = None, value_outliers: Optional[int] = None,
              meta_dtype: Optional[torch.dtype] = None, kv_heads: Optional[int | str] = None,
              fused: Optional[bool] = None, static: bool = False,
              max_cache_len: Optional[int] = None, window_residual: Optional[int] = None,
              bit_map: Optional[list] = None, recipe=None, fit_range: Optional[bool] = None,
              value_fit_range: Optional[bool] = None) -> NexusKVCache:
    """A compressed cache sized for `model`, one layer per decoder layer: keys per
    channel (groups of `group_size` tokens), values per token (groups of
    `value_group_size` channels, default `group_size`), the `residual` newest tokens
    and the first `sinks` tokens of each sequence in full precision (default
    DEFAULT_SINKS = 4; 0 with static=True).  Sliding-window
    layers (the model's config.layer_types / sliding_window) attend within their window
    and evict what no query can see; they keep no sinks.  Scales and zeros are 16-bit by
    default (the model's dtype if it is 16-bit, else bfloat16), so that an fp32 model's
    cache costs the same bits as a 16-bit one's.  Attention runs fused whenever the
    model's attention implementation is "nexuskv", otherwise over transiently
    dequantized K/V (``fused=True/False`` forces one).

    ``compressor`` (keys, and values unless ``value_compressor`` is given) replaces the
    bits/group_size/outliers/dynamic_keys/rotate/meta_dtype arguments: NQ and DGQ are
    held by the C++ cache itself (fused attention); any other KVCompressor (a user's own
    class) compresses chunks of ``group_size`` tokens and attention runs over its
    dequantized output, whatever the attention implementation.

    ``kv_heads``: the KV heads this process holds of each layer when the model is
    sharded for tensor parallelism (default: the config's count); "auto" takes them
    from the first append.  Settings the cache or the fused kernel cannot take for this
    model (e.g. a head_dim the kernel does not support, K and V of different head dims)
    raise a ValueError here.  A DeepSpeed v1 InferenceEngine is taken as its module, with
    the KV heads its tensor-parallel rank holds (nexuskv.integrations.deepspeed).

    Groups, tails and sinks not given follow a recipe's header when there is one (the policy
    its map was allocated and measured with), else the width (default_policy): at 2 bits groups
    of 128 and a 128-token tail on every layer (LOW_BITS_*: measured lower than 4-bit's policy
    on both models and texts), wider ones groups of 64 and the byte policy below.

    The tails: ``residual`` on full-attention layers, ``window_residual`` on sliding-window
    layers (default: ``residual`` when that is given).  Given neither, at 3 bits and up the byte
    policy of benchmarks/RESULTS.md ("The tail against the 30 % byte target"): 64 full-precision
    tokens (DEFAULT_RESIDUAL) on full-attention layers, the sinks included (a 60-token tail
    with the 4 default sinks: the same tokens held as 64 without sinks, at every length), and none
    on sliding-window ones.  A sliding
    layer's native cache holds only its window (512 tokens on Gemma 3), so a 128-token tail
    there is a quarter of it in full precision; without it Gemma 3's 4-bit cache holds
    28.9 % of its native size at 4096 tokens (36.4 % with 128 everywhere; 29.0 % allocated with the
    4 default sinks), SmolLM2's 29.2 %
    (30.4 %), perplexity within the noise of the longer tails on both.

    ``static=True, max_cache_len=N``: the compileable cache (nexuskv.hf_static): fixed
    capacity, state in tensors, a decode step that torch.compile(fullgraph=True) and
    torch.export trace; no sinks, rotation, eviction, crop or beam search, CPU only, and
    attn_implementation="nexuskv" required.

    ``fit_range=True``: each key group's scale and zero fitted by least squares on its own
    codes instead of min/max (nexuskv.ops.nq_compress): the same format, bytes and fused
    kernels, about half the squared error at 2 bits; with ``sinks`` it lowered ΔPPL at 2 bits
    on both models measured (benchmarks/RESULTS.md, "Fitted ranges"), without sinks it
    clamps the first token's extreme keys and raised it.  Default (None): on whenever the
    cache keeps sinks (so by default; off with sinks=0, with static=True, on a model whose
    layers all slide, and for now on a GPU model: _default_fit_range).  A recipe's map gets
    it too (with the fit the maps calibrated without it measured lower, RESULTS.md).
    A recipe calibrated without the fit (its header's ``fit_range`` false) keeps min/max ranges.
    ``value_fit_range=True`` fits the values' groups too (measured higher on SmolLM2, lower on
    Gemma 3); default (None): what the recipe asks for (calibrate --fit-range measures it on
    the recipe's map), min/max without a recipe.  Not with static=True.

    Mixed precision: ``bit_map`` = [[key bits, value bits] per layer] replaces ``bits`` and
    ``value_bits`` layer by layer; ``recipe`` (a nexuskv.recipe.Recipe or its file, from
    ``python -m nexuskv calibrate --bits-budget B``) gives the bit map it allocated for this
    model under that budget (it is refused for another model, or without a bit map); the
    group sizes, tails and sinks it was allocated with (its ``bits`` header) are the defaults
    then, so that the cache is the one it measured."""
    register()
    _check_kv_heads(kv_heads)
    bit_map, recipe_bits = _bit_map(model, bit_map, recipe)
    if value_fit_range is None:  # the recipe's choice (calibrate --fit-range), min/max without one; CPU only
        value_fit_range = bool(recipe_bits.get("value_fit_range", False)) and not static and _on_cpu(model)
    for name, tail in (("residual", residual), ("window_residual", window_residual)):
        if tail is not None and (isinstance(tail, bool) or not isinstance(tail, int) or tail < 0):
            raise ValueError(f"nexuskv: {name} must be None or an int >= 0, got {tail!r}")
    policy = default_policy(bits, value_bits, recipe_bits)
    if value_group_size is None:  # the policy's with its key groups, else as the keys
        value_group_size = policy["value_group_size"] if group_size is None else group_size
    if group_size is None:
        group_size = policy["group_size"]
    if window_residual is None:
        window_residual = policy["window_residual"] if residual is None else residual
    if sinks is None:
        sinks = 0 if static else policy["sinks"]
    if residual is None:
        residual = byte_policy_residual(sinks) if policy["residual"] is None else policy["residual"]
    model, kv_heads = integrations.deepspeed.unwrap_for_cache(model, kv_heads)
    if not hasattr(model, "config"):
        raise TypeError(f"nexuskv: cache_for needs a transformers model (with a .config) or a DeepSpeed engine, "
                        f"got {type(model).__name__}")
    geometries = hf_compat.layer_geometries(model)
    if fit_range is None:
        # a recipe allocated for min/max ranges (calibrate without --fit-range) keeps them
        fit_range = _default_fit_range(model, geometries, sinks, static) and bool(recipe_bits.get("fit_range", True))
    if kv_heads is not None and kv_heads != "auto":
        geometries = [LayerGeometry(int(kv_heads), g.key_dim, g.value_dim, g.window, g.layer_type)
                      for g in geometries]
    for g in geometries:
        if g.key_dim != g.value_dim:
            raise ValueError(f"nexuskv: keys and values of different head dims ({g.key_dim} and {g.value_dim}) "
                             f"are not supported")
    compressors = None
    if compressor is not None or value_compressor is not None:
        if compressor is None or not isinstance(compressor, KVCompressor) or \
                (value_compressor is not None and not isinstance(value_compressor, KVCompressor)):
            raise TypeError("nexuskv: compressor (and value_compressor) must implement the KVCompressor protocol "
                            "(compress, decompress, nbytes)")
        values = value_compressor or compressor
        quant = _fused_settings(compressor, values)
        if quant is None:
            quant = dict(external_chunk=group_size)
            compressors = (compressor, values)
    else:
        _check_quant_args(bits=bits, value_bits=value_bits, group_size=group_size, value_group_size=value_group_size,
                          outliers=outliers, value_outliers=value_outliers, meta_dtype=meta_dtype)
        for name, flag in (("fit_range", fit_range), ("value_fit_range", value_fit_range)):
            if not isinstance(flag, bool):
                raise TypeError(f"nexuskv: cache_for: {name} must be a bool, got {type(flag).__name__}")
        if meta_dtype is None:
            meta_dtype = model.dtype if model.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        quant = _layer_settings(bits, value_bits, group_size, value_group_size, residual, outliers,
                                outliers if value_outliers is None else value_outliers, dynamic_keys, rotate, seed,
                                sinks, meta_dtype, fit_range=fit_range, value_fit_range=value_fit_range)
    config = hf_compat.text_config(model)

    def tail(g: LayerGeometry) -> int:
        return residual if g.window is None else window_residual

    if bit_map is not None:
        if compressors is not None or compressor is not None:
            raise ValueError("nexuskv: bit_map / recipe set the bits of NQ layers; they do not combine with "
                             "compressor= / value_compressor=")
        if len(bit_map) != len(geometries):
            raise ValueError(f"nexuskv: bit_map has {len(bit_map)} layers, the model {len(geometries)}")

    def layer_quant(i: int) -> dict:
        if bit_map is None:
            return quant
        return dict(quant, key_bits=bit_map[i][0], value_bits=bit_map[i][1])

    if static:
        if not isinstance(max_cache_len, int) or max_cache_len < 1 or compressors is not None or fused is False:
            raise ValueError("nexuskv: cache_for(model, static=True) needs max_cache_len=N (a positive int: the "
                             "tokens each sequence may reach) and the fused path (no fused=False, no Python "
                             f"compressor), got max_cache_len={max_cache_len!r}")
        return NexusKVCache([hf_static.NexusKVStaticLayer(
            hf_static.static_settings(dict(layer_quant(i), residual=tail(g)), g.window), max_cache_len, i, g, config)
            for i, g in enumerate(geometries)])
    layers, probed = [], set()
    for i, g in enumerate(geometries):
        settings = dict(layer_quant(i), residual=tail(g), sinks=0 if g.window else sinks, window=g.window)
        key = (g.key_dim, g.window, settings.get("key_bits"), settings.get("value_bits"))
        if key not in probed:
            probed.add(key)
            can_fuse = compressors is None and fused is not False
            _probe(settings, g, model.dtype, can_fuse, f"layer {i} ({g.layer_type})")
        layers.append(NexusKVLayer(settings, fused=fused, compressors=compressors, geometry=g, layer_idx=i,
                                   config=config, learn_heads=kv_heads == "auto"))
    return NexusKVCache(layers)


def _default_fit_range(model, geometries, sinks, static: bool) -> bool:
    """cache_for's fit_range when given none: fitted key ranges where the cache keeps sinks --
    some full-attention layer (sliding-window layers keep none) and sinks > 0 -- since with
    sinks the fit lowered ΔPPL at 2-3 bits on both models measured and without them it raised
    it (benchmarks/RESULTS.md, "Fitted ranges"); and only for a model on the CPU: the CUDA
    kernel of the fit compiles but has not run on a GPU yet (test_cuda_nq.py), so a GPU model
    keeps the min/max ranges the H200 run tested unless fit_range=True is asked for."""
    if static or not isinstance(sinks, int) or isinstance(sinks, bool) or sinks <= 0:
        return False
    if all(g.window is not None for g in geometries):
        return False
    return _on_cpu(model)


def _on_cpu(model) -> bool:
    """Whether the model's weights are on the CPU (the fit's default is for the CPU only)."""
    params = getattr(model, "parameters", None)
    device = next((p.device for p in params()), torch.device("cpu")) if callable(params) else torch.device("cpu")
    return device.type == "cpu"


def _bit_map(model, bit_map, recipe) -> Tuple[Optional[list], dict]:
    """cache_for's bit map: the one given, or the recipe's (checked against the model), as
    [[key bits, value bits], ...] of ints; None for neither.  And the recipe's ``bits``
    header (what its map was allocated for: groups, tails, sinks, fitted ranges), {} without one."""
    header: dict = {}
    if recipe is not None:
        from .recipe import Recipe, model_facts

        if bit_map is not None:
            raise ValueError("nexuskv: give cache_for a bit_map or a recipe, not both")
        if isinstance(recipe, (str, os.PathLike)):
            recipe = Recipe.load(os.fspath(recipe))
        if not isinstance(recipe, Recipe):
            raise TypeError(f"nexuskv: recipe must be a nexuskv.recipe.Recipe or a path to one, got "
                            f"{type(recipe).__name__}")
        module, _ = integrations.deepspeed.unwrap_for_cache(model, None)
        recipe.check_model(model_facts(module.config), "this model")
        if recipe.bit_map is None:
            raise ValueError("nexuskv: this recipe has no bit map (it holds key means for the vLLM backend); make "
                             "one with python -m nexuskv calibrate --bits-budget B")
        bit_map = recipe.bit_map.tolist()
        header = dict(recipe.bits)
    if bit_map is None:
        return None, header
    try:
        rows = [[int(b) for b in row] for row in bit_map]
        ok = all(len(row) == 2 for row in rows) and all(not isinstance(b, bool) and int(b) == b
                                                        for row in bit_map for b in row)
    except (TypeError, ValueError):
        ok = False
    if not ok or not rows:
        raise ValueError(f"nexuskv: bit_map must be [[key bits, value bits], ...] with one pair per layer, got "
                         f"{bit_map!r}")
    for i, row in enumerate(rows):
        if any(b not in (2, 3, 4, 8) for b in row):
            raise ValueError(f"nexuskv: bit_map[{i}] = {row}: key and value bits must be among 2, 3, 4, 8")
    return rows, header


def enable(model, **cache_kwargs):
    """The one-line way in: switches `model` to attn_implementation="nexuskv" and makes
    every model.generate() call that is given no cache use a new compressed cache,
    ``cache_for(model, **cache_kwargs)``.  (transformers has no registry for
    generate(cache_implementation=...) in 4.57 or 5.x, so the model's generate is
    wrapped on this instance, as transformers itself does for custom_generate.)
    Returns the model."""
    register()
    cache_for(model, **cache_kwargs)  # validates the settings now, not in the first generate()
    module = integrations.deepspeed.unwrap(model)  # a DeepSpeed engine keeps its own generate wrapper
    module.set_attn_implementation(ATTN_IMPLEMENTATION)
    generate = getattr(model, "nexuskv_plain_generate", model.generate)
    name = hf_compat.cache_argument(module)

    def generate_with_nexuskv(*args, **kwargs):
        if kwargs.get(name) is None and kwargs.get("past_key_values") is None and kwargs.get("use_cache", True):
            kwargs[name] = cache_for(model, **cache_kwargs)
        return generate(*args, **kwargs)

    model.nexuskv_plain_generate = generate
    model.generate = generate_with_nexuskv
    return model


# -- attention --------------------------------------------------------------------------------

def _diagonal_validity(attention_mask: Optional[torch.Tensor], q_len: int) -> Optional[torch.Tensor]:
    """[B, q_len] True for the new tokens that are real (not padding): a real token
    always sees itself, so the diagonal of the new tokens' block of the 4-D mask says it
    (sliding windows and other masking leave the diagonal alone).  None without a mask.
    Reads nothing on the host."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    diag = torch.diagonal(attention_mask[:, 0, -q_len:, -q_len:], dim1=-2, dim2=-1)
    return diag if diag.dtype == torch.bool else diag == 0


def _new_token_validity(attention_mask: Optional[torch.Tensor], q_len: int) -> Optional[torch.Tensor]:
    """_diagonal_validity, or None when every new token is real.  Reads the answer on the
    host, once per forward (all layers of a type get one mask object)."""
    memo = _claims.mask
    if memo is not None and memo[0] is attention_mask and memo[1] == q_len:
        return memo[2]
    visible = _diagonal_validity(attention_mask, q_len)
    valid = None if visible is None or bool(visible.all()) else visible
    _claims.mask = (attention_mask, q_len, valid)
    return valid


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def dense_attention(query, key, value, attention_mask, scaling=None, softcap=None):
    """Exact attention over dense K/V in float32 with the model's 4-D mask (bool: True
    is visible; float: added) or, without one, causal over the last q_len positions;
    scores soft-capped when softcap is given (what sdpa cannot do).  Fully masked rows
    (padding queries) give zeros.  Returns [B, q_len, heads, head_dim]."""
    B, Hq, Lq, D = query.shape
    Lk = key.shape[-2]
    groups = Hq // key.shape[1]
    scale = scaling if scaling is not None else D ** -0.5
    s = torch.matmul(query.float(), _repeat_heads(key, groups).float().transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if attention_mask is None:
        keep = torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).tril(Lk - Lq)
        s = s.masked_fill(~keep, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        s = s.masked_fill(~attention_mask[..., -Lk:], float("-inf"))
    else:
        s = s + attention_mask[..., -Lk:].float()
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = torch.matmul(p, _repeat_heads(value, groups).float()).to(query.dtype)
    return out.transpose(1, 2).contiguous()


def _plain_attention(module, query, key, value, attention_mask, scaling, dropout, softcap, kwargs):
    if softcap is None and dropout == 0.0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return dense_attention(query, key, value, attention_mask, scaling, softcap), None


def nexuskv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      softcap=None, **kwargs):
    """AttentionInterface function ("nexuskv"): claims the layer's pending new K/V (see
    the module docstring), appends them (left padding dropped) and attends over the
    compressed cache with dgq_fused_attention, within the layer's sliding window and
    with the model's logit soft-cap.  Which K/V a forward's queries see exact:
    - the first forward (a prefill: nothing older is cached) attends over its own new K/V
      as the model computed them (SDPA; with padding, the mask), which the cache then
      compresses (HF's QuantizedCache, too, attends over the new tokens unquantized);
    - a later forward (a prefill chunk, a decode step) sees what token-by-token decoding
      sees: each query every token the cache's policy had compressed by its position
      compressed, the rest exact (_attend_as_decoding), whatever the chunking.
    Returns ([batch, q_len, heads, head_dim], None).  A static cache's layer (cache_for(...,
    static=True): nexuskv.hf_static) appended in update() already: its first forward
    attends over its own K/V too, a later chunk over the chunk appended (its buffers have
    fixed shapes)."""
    q_len = query.shape[-2]
    static = hf_static.claim(module)
    if static is not None:
        # Padding comes in the prefill (the static layers' masks cover the new tokens
        # at positions from 0: right for the first forward only).
        first = not torch.compiler.is_compiling() and bool(static.get_seq_length() == q_len)
        if first and _new_token_validity(attention_mask, q_len) is not None:
            raise NotImplementedError("nexuskv: the static cache takes no padded batches (cache_for(model) does)")
        if first and q_len > 1:
            return _plain_attention(module, query, key, value, attention_mask, scaling, dropout, softcap, kwargs)
        return static.attend(query, scaling, softcap, sliding_window), None
    layer = _claims.pending.pop(id(key), None)
    if layer is None or layer.pending is None or layer.pending[0] is not key:
        _warn_once("dense", "nexuskv: attn_implementation='nexuskv' is attending over K/V that do not come from a "
                            "fused nexuskv cache (transformers' own cache such as DynamicCache, or cache_for(..., "
                            "fused=False) / a Python compressor): this is plain dense attention over the K/V given; "
                            "pass nexuskv.hf.cache_for(model) or use nexuskv.hf.enable(model) for the fused path")
        return _plain_attention(module, query, key, value, attention_mask, scaling, dropout, softcap, kwargs)
    if sliding_window != layer.sliding_window:
        layer._drop_pending()
        raise ValueError(f"nexuskv: layer {getattr(module, 'layer_idx', '?')} attends with sliding_window="
                         f"{sliding_window}, but its cache was made for {layer.sliding_window}; make the cache with "
                         f"nexuskv.hf.cache_for(model) for the model that uses it")
    if torch.compiler.is_compiling():
        # A compiled step has no data-dependent branch: generate() feeds only real tokens
        # after the prefill (left padding comes in the prefill, which runs eagerly).
        layer.append_pending(None)
    else:
        valid = _new_token_validity(attention_mask, q_len)
        first = layer.seen == q_len  # seen counts this forward's tokens already (update())
        if not first and q_len > 1 and valid is None:
            return _attend_as_decoding(layer, query, scaling, softcap), None
        layer.append_pending(valid)
        if valid is not None and not first:
            raise NotImplementedError("nexuskv: padding inside a chunk after the prefill is not supported")
        if valid is not None:
            return dense_attention(query, key, value, attention_mask, scaling, softcap), None
        if first and q_len > 1:
            return _plain_attention(module, query, key, value, attention_mask, scaling, dropout, softcap, kwargs)
    # The C++ cache is a TorchBind object without a fake class: torch.compile breaks the
    # graph at its append and attend (see benchmarks/bench_hf_decode.py for the count).
    out = layer.cache.attend(query, scaling, softcap)  # [B, Hq, Lq, D]
    return out.transpose(1, 2).contiguous(), None


def _attend_as_decoding(layer, query, scaling, softcap) -> torch.Tensor:
    """The pending chunk appended and attended as decoding it token by token would
    (KVCache.append_and_attend: cut where a token's append would compress a group, each
    piece appended held, its queries attending before the next piece, then settled): the
    same output whatever the chunking, and the cache afterwards that of a plain append;
    nothing is stored when the chunk is rejected.  Returns [B, q_len, Hq, D]."""
    k, v = layer.pending
    layer.pending = None
    try:
        out = layer.cache.append_and_attend(k, v, query, scaling, softcap)
    except RuntimeError as e:
        raise RuntimeError(f"nexuskv: layer {layer.layer_idx}: key_states / value_states not stored: {e}") from e
    return out.transpose(1, 2).contiguous()


_registered = False


def register() -> None:
    """Registers attn_implementation="nexuskv" (attention function and its mask builder)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_IMPLEMENTATION, nexuskv_attention)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _registered = True


register()
