"""The compressed KV cache of one attention layer in Python: the factory of the
C++ cache (torch.classes.nexuskv.KVCache; policy and methods documented in
csrc/include/nexuskv/cache.h) and its save/load.

    import nexuskv
    cache = nexuskv.cache.make_cache(key_bits=4, value_bits=4, residual=128)
    cache.append(k, v, None)          # k, v [B, H, n, D]
    out = cache.attend(q, None, None)  # q [B, Hq, n, D]
    torch.save(cache.state_dict(), "layer0.pt")
    same = nexuskv.cache.from_state_dict(torch.load("layer0.pt", weights_only=True))

The object works in TorchScript too (a scripted module takes it as an argument).
Methods: append(k, v, valid), attend(q, scale, softcap), dense(dtype), lengths(),
compressed_lengths(), evicted_lengths(), crop(length), to(device), clone(), reset(),
reorder(beam_idx), nbytes(), used_nbytes(), compressed_nbytes(), state_dict(); external
storage also take_due_chunks(), dense_with(...), crop_with(...).  pickle, torch.save and
copy.deepcopy of the object work (they carry its state dict)."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from . import ops  # noqa: F401  (loads the operator library, which defines torch.classes.nexuskv)

__all__ = ["make_cache", "from_state_dict", "KVCache"]

KVCache = torch.classes.nexuskv.KVCache


def make_cache(key_bits: int = 4, key_group_size: int = 64, key_axis: int = -2, key_outliers: int = 0,
               key_dynamic: bool = False, value_bits: int = 4, value_group_size: int = 64, value_axis: int = -1,
               value_outliers: int = 0, residual: int = 128, sinks: int = 0, rotate: bool = False, seed: int = 0,
               meta_dtype: Optional[torch.dtype] = None, window: Optional[int] = None,
               external_chunk: int = 0, key_fit_range: bool = False,
               value_fit_range: bool = False) -> torch.ScriptObject:
    """A new compressed cache (torch.classes.nexuskv.KVCache); every argument is checked.

    Keys: ``key_bits``-bit codes (2, 3, 4, 8) over groups of ``key_group_size`` (1..256)
    along ``key_axis`` (-2: tokens per channel, KIVI's keys; -1: channels per token),
    ``key_outliers`` exact outliers per group, ``key_dynamic``: DGQ data-chosen token groups.
    Values: the same with ``value_*``.  ``residual``: newest tokens kept in full precision
    (at least); ``sinks``: first tokens kept in full precision for good; ``rotate``:
    randomized Hadamard basis drawn from ``seed`` (head_dim a power of two);
    ``meta_dtype``: dtype of scales/zeros (None: the K/V dtype); ``window``: sliding window
    (the query at position p sees keys (p - window, p]; compressed chunks no query can see
    are dropped; needs sinks=0); ``external_chunk`` > 0: no compression here, chunks of that
    many tokens are handed to the caller (take_due_chunks) with the same policy.
    ``key_fit_range`` / ``value_fit_range``: each group's scale and zero fitted by least
    squares instead of min/max (nq_format.h, "Fitted ranges": the same format, about half
    the squared error at 2 bits; entries past the fitted range decode to its end levels).

    The cache takes the device and dtype of its first append."""
    for name, value in (("key_dynamic", key_dynamic), ("rotate", rotate), ("key_fit_range", key_fit_range),
                        ("value_fit_range", value_fit_range)):
        if not isinstance(value, bool):
            raise TypeError(f"make_cache: {name} must be a bool, got {type(value).__name__}")
    for name, value in (("key_bits", key_bits), ("key_group_size", key_group_size), ("key_axis", key_axis),
                        ("key_outliers", key_outliers), ("value_bits", value_bits),
                        ("value_group_size", value_group_size), ("value_axis", value_axis),
                        ("value_outliers", value_outliers), ("residual", residual), ("sinks", sinks),
                        ("seed", seed), ("external_chunk", external_chunk), ("window", window)):
        if value is None and name == "window":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"make_cache: {name} must be an int, got {type(value).__name__}")
        if not -2 ** 63 <= value < 2 ** 63:
            raise ValueError(f"make_cache: {name} must fit in int64, got {value}")
    if meta_dtype is not None and not isinstance(meta_dtype, torch.dtype):
        raise TypeError(f"make_cache: meta_dtype must be a torch.dtype or None, got {meta_dtype!r}")
    if meta_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"make_cache: meta_dtype must be torch.float32, torch.float16, torch.bfloat16 or None, got "
                         f"{meta_dtype}")
    return KVCache(key_bits, key_group_size, key_axis, key_outliers, key_dynamic, value_bits, value_group_size,
                   value_axis, value_outliers, residual, rotate, seed, sinks, external_chunk, meta_dtype, window,
                   key_fit_range, value_fit_range)


def from_state_dict(state: Dict[str, torch.Tensor]) -> torch.ScriptObject:
    """The cache that ``cache.state_dict()`` describes (every entry is checked), continuing
    bit-exactly where the original was.  The state dict holds plain tensors only, so
    ``torch.save(cache.state_dict(), f)`` and ``torch.load(f, weights_only=True)`` keep it;
    ``map_location`` chooses the device the restored cache lives on."""
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise TypeError("from_state_dict: state must be a dict of str -> Tensor (a KVCache.state_dict())")
    return KVCache.from_state_dict(state)
