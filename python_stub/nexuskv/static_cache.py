"""A compressed KV cache of fixed capacity whose whole state is tensors, so that a decode
step compiles: torch.compile(fullgraph=True) and torch.export trace it without a graph
break, because a step is two operators with fake kernels —
``static_kv_append_`` (mutates the cache's buffers in place) and ``dgq_fused_attention`` —
and a few tensor operations that check the lengths (an asynchronous assert).

    cache = StaticKVCache(batch=1, kv_heads=8, head_dim=128, max_tokens=8192, dtype=torch.bfloat16)
    out = cache(q, k, v)          # append k/v [B, H, n, D], then attend with q [B, Hq, n, D]

It holds what the dynamic ``nexuskv.cache.make_cache`` holds for the same settings (the
same compressed format, the same tail policy: the ``residual`` newest tokens stay in
full precision, older ones are compressed a chunk at a time), preallocated for
``max_tokens`` tokens (the compressed part has room for max_tokens rounded up to whole
chunks, the tail for up to residual + chunk - 1 more), but no sinks, no rotation and no
eviction (a sliding ``window`` masks; the memory is allocated for max_tokens anyway).  An
append that needs more compressed room raises and stores nothing.
The buffers are registered as module buffers (``state_dict`` saves the cache); a buffer
replaced by one of another dtype or shape, aliased with another, or holding what no append
stores (NaN/Inf scales or tail tokens, lengths past the capacity or short of a whole chunk)
is a clear error at the next append or attend.  CPU
only for now (the append kernel reads the lengths on the host); the dynamic cache serves
CUDA."""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import _format, ops

__all__ = ["StaticKVCache"]

_K = ("k_codes", "k_scale", "k_zero", "k_outlier_idx", "k_outlier_val", "k_segment_starts")
_V = ("v_codes", "v_scale", "v_zero", "v_outlier_idx", "v_outlier_val")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INT32_MAX = 2**31 - 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_granule(granule, group_size: int) -> None:
    """DGQ keys: segments of granule multiples, at most max_len = the smallest multiple of
    granule >= 2 * group_size tokens, and max_len <= MAX_GROUP_SIZE (dgq_compress's rule)."""
    if not _is_int(granule) or not 1 <= granule <= group_size:
        raise ValueError(
            f"StaticKVCache: granule must be an int in [1, group_size] = [1, {group_size}], got {granule!r}"
        )
    max_len = _format.ceil_div(2 * group_size, granule) * granule
    if max_len > _format.MAX_GROUP_SIZE:
        raise ValueError(
            f"StaticKVCache: dynamic_keys=True needs segments of up to the smallest multiple of granule >= "
            f"2 * group_size tokens, at most {_format.MAX_GROUP_SIZE}; granule={granule} and "
            f"group_size={group_size} give {max_len} (use group_size <= {_format.MAX_GROUP_SIZE // 2} and a "
            f"granule that divides 2 * group_size)"
        )


def _store_bytes(rows, tokens, head_dim, bits, group_size, axis, outliers, dtype, meta) -> int:
    """Bytes of the NQ buffers of `rows` rows of `tokens` tokens (the layout of _format /
    nq_format.h), in Python ints: no int64 overflow for any max_tokens."""
    a, b = _format.meta_shape(tokens, head_dim, group_size, axis)
    meta_entry = 2 * meta.itemsize + outliers * (1 + dtype.itemsize)  # scale, zero, outlier_idx, outlier_val
    return rows * (tokens * _format.row_bytes(bits, head_dim) + a * b * meta_entry)


def _memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _check_allocatable(needed: int, max_tokens, residual, batch, kv_heads, head_dim) -> None:
    """A cache larger than the machine's memory is a mistaken argument, not an allocation to try."""
    memory = _memory_bytes()
    if memory is not None and needed > memory:
        raise ValueError(
            f"StaticKVCache: max_tokens={max_tokens} and residual={residual} (batch={batch}, kv_heads={kv_heads}, "
            f"head_dim={head_dim}) need {needed} bytes ({needed / 2**30:.1f} GiB) of preallocated buffers, more than "
            f"this machine's {memory} bytes ({memory / 2**30:.1f} GiB) of memory; lower max_tokens, residual or batch"
        )


class StaticKVCache(torch.nn.Module):
    """One attention layer's compressed K/V for ``batch`` sequences of up to ``max_tokens``
    tokens.  bits / group_size / outliers: keys per channel over token groups (DGQ with
    ``dynamic_keys``), values per token over channel groups (``value_*``, default the
    keys'); meta_dtype: dtype of scales and zeros (default ``dtype``)."""

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        bits: int = 4,
        value_bits: Optional[int] = None,
        group_size: int = 64,
        value_group_size: Optional[int] = None,
        residual: int = 128,
        outliers: int = 0,
        value_outliers: Optional[int] = None,
        dynamic_keys: bool = False,
        granule: int = 16,
        meta_dtype: Optional[torch.dtype] = None,
        window: Optional[int] = None,
    ):
        super().__init__()
        for name, val in (
            ("batch", batch),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
            ("max_tokens", max_tokens),
        ):
            if not _is_int(val) or val < 1:
                raise ValueError(f"StaticKVCache: {name} must be a positive int, got {val!r}")
        if not _is_int(residual) or residual < 0:
            raise ValueError(f"StaticKVCache: residual must be an int >= 0, got {residual!r}")
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"StaticKVCache: the static cache runs on the CPU only for now, got device {device!r} "
                f"(on CUDA use the dynamic cache, nexuskv.cache.make_cache / nexuskv.hf.cache_for)"
            )
        if window is not None and (not _is_int(window) or window < 1):
            raise ValueError(f"StaticKVCache: window must be a positive int or None, got {window!r}")
        if not isinstance(dynamic_keys, bool):
            raise ValueError(f"StaticKVCache: dynamic_keys must be a bool, got {dynamic_keys!r}")
        value_bits = bits if value_bits is None else value_bits
        value_group_size = group_size if value_group_size is None else value_group_size
        value_outliers = outliers if value_outliers is None else value_outliers
        # Checked here, naming the constructor's arguments: the operators would name their own.
        for name, val in (("bits", bits), ("value_bits", value_bits)):
            if not _is_int(val) or val not in _format.SUPPORTED_BITS:
                raise ValueError(f"StaticKVCache: {name} must be one of 2, 3, 4, 8, got {val!r}")
        for name, val in (("group_size", group_size), ("value_group_size", value_group_size)):
            if not _is_int(val) or not 1 <= val <= _format.MAX_GROUP_SIZE:
                raise ValueError(f"StaticKVCache: {name} must be an int in [1, {_format.MAX_GROUP_SIZE}], got {val!r}")
        for name, val, group in (
            ("outliers", outliers, "group_size"),
            ("value_outliers", value_outliers, "value_group_size"),
        ):
            size = group_size if group == "group_size" else value_group_size
            if not _is_int(val) or not 0 <= val < size:
                raise ValueError(
                    f"StaticKVCache: {name} (the num_outliers kept exactly per group) must be an int in [0, {group}) = "
                    f"[0, {size}), got {val!r}"
                )
        if dtype not in _FLOATS:
            raise ValueError(
                f"StaticKVCache: dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}"
            )
        if meta_dtype is not None and meta_dtype not in _FLOATS:
            raise ValueError(
                f"StaticKVCache: meta_dtype (of scales and zeros) must be None (the dtype), torch.float32, "
                f"torch.float16 or torch.bfloat16, got {meta_dtype!r}"
            )
        if dynamic_keys:
            _check_granule(granule, group_size)
        self.k_format = [bits, group_size, -2] + ([granule] if dynamic_keys else [])
        self.v_format = [value_bits, value_group_size, -1]
        self.residual, self.window, self.max_tokens = residual, window, max_tokens
        self.chunk = group_size  # values are grouped per token: any token count compresses
        capacity = -(-max_tokens // self.chunk) * self.chunk
        if dynamic_keys and capacity > _INT32_MAX:
            raise ValueError(
                f"StaticKVCache: with dynamic_keys=True max_tokens must be at most "
                f"{_INT32_MAX // self.chunk * self.chunk} (DGQ segment starts are int32 token positions: max_tokens "
                f"rounded up to whole chunks of {self.chunk} must stay <= 2**31 - 1), got {max_tokens}"
            )
        tail_tokens = max(1, residual + self.chunk - 1)
        meta = meta_dtype or dtype
        needed = (
            _store_bytes(batch * kv_heads, capacity, head_dim, bits, group_size, -2, outliers, dtype, meta)
            + _store_bytes(
                batch * kv_heads, capacity, head_dim, value_bits, value_group_size, -1, value_outliers, dtype, meta
            )
            + (batch * kv_heads * _format.ceil_div(capacity, group_size) * 4 if dynamic_keys else 0)  # segment starts
            + 2 * batch * kv_heads * tail_tokens * head_dim * dtype.itemsize  # k_tail, v_tail
            + 2 * batch * 8  # lengths
        )
        _check_allocatable(needed, max_tokens, residual, batch, kv_heads, head_dim)
        try:
            # Buffers of the operators' own sizes: compress on the meta device (the fake
            # kernels' shapes), allocate zeros of those (unused rows decode to zero, and
            # zero segment starts are the DGQ invariant of an empty cache: the unused
            # segment slots of a sequence hold its compressed length).
            x = torch.empty(batch, kv_heads, capacity, head_dim, dtype=dtype, device="meta")
            if dynamic_keys:
                k_parts = ops.dgq_compress(x, bits, group_size, granule, None, outliers, meta)
            else:
                k_parts = ops.nq_compress(x, bits, group_size, -2, outliers, meta)
            v_parts = ops.nq_compress(x, value_bits, value_group_size, -1, value_outliers, meta)
            for name, t in zip(_K, k_parts):
                self.register_buffer(name, torch.zeros(t.shape, dtype=t.dtype, device=device))
            for name, t in zip(_V, v_parts):
                self.register_buffer(name, torch.zeros(t.shape, dtype=t.dtype, device=device))
            tail = (batch, kv_heads, tail_tokens, head_dim)
            self.register_buffer("k_tail", torch.zeros(tail, dtype=dtype, device=device))
            self.register_buffer("v_tail", torch.zeros(tail, dtype=dtype, device=device))
            # compressed, tail
            self.register_buffer("lengths", torch.zeros(2, batch, dtype=torch.long, device=device))
        except RuntimeError as e:  # the allocator's own message names no argument
            raise RuntimeError(
                f"StaticKVCache: allocating the {needed} bytes ({needed / 2**30:.2f} GiB) of buffers that "
                f"max_tokens={max_tokens}, residual={residual}, batch={batch}, kv_heads={kv_heads} and "
                f"head_dim={head_dim} need failed: {str(e).strip().splitlines()[0]}"
            ) from None
        self._dynamic = dynamic_keys
        # What append and attend check the buffers against: a buffer replaced by one of
        # another dtype or shape (cache.k_tail = ...) is an error naming it, not a result
        # of another precision.
        self._made = {n: (b.dtype, tuple(b.shape)) for n, b in self.named_buffers()}

    def _k_store(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in (_K if self._dynamic else _K[:5])]

    def _v_store(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in _V]

    def _check_buffers(self, what: str) -> None:
        """Each buffer has the dtype and shape the constructor made.  Metadata only: under
        torch.compile these are trace-time checks (guards), not graph operations."""
        for name, (dtype, shape) in self._made.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise RuntimeError(
                    f"StaticKVCache.{what}: buffer {name} must be {dtype} {list(shape)}, as the constructor made it, "
                    f"got {got}"
                )

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Appends k, v [batch, kv_heads, n, head_dim] (the cache's dtype)."""
        self._check_buffers("append")
        torch.ops.nexuskv.static_kv_append_(
            self._k_store(),
            self._v_store(),
            self.k_tail,
            self.v_tail,
            self.lengths,
            k,
            v,
            self.k_format,
            self.v_format,
            self.residual,
        )

    def attend(self, q: torch.Tensor, scale: Optional[float] = None, softcap: Optional[float] = None) -> torch.Tensor:
        """softmax(q K^T scale) V over every cached token, q [batch, q_heads, q_len, head_dim] the
        last q_len positions (causal among themselves); [batch, q_heads, q_len, head_dim]."""
        self._check_buffers("attend")
        # The append kernel checks the lengths it reads; attention checks only that they fit
        # the buffers, so a compressed length short of a whole chunk (a state no append makes)
        # would read half-written groups.  An asynchronous assert: no host read, no graph
        # break under torch.compile(fullgraph=True) / torch.export.
        compressed, tail = self.lengths.unbind()
        torch._assert_async(
            ((compressed.remainder(self.chunk) == 0) & (compressed >= 0) & (compressed <= self.k_codes.shape[2]))
            .logical_and_((tail >= 0) & (tail <= self.k_tail.shape[2]))
            .all(),
            f"StaticKVCache.attend: the lengths buffer is corrupt: compressed lengths (row 0) must be whole chunks "
            f"of {self.chunk} tokens in [0, {self.k_codes.shape[2]}] and tail lengths (row 1) in "
            f"[0, {self.k_tail.shape[2]}]",
        )
        return torch.ops.nexuskv.dgq_fused_attention(
            q,
            self._k_store(),
            self._v_store(),
            self.k_format[:3],
            self.v_format,
            self.lengths[0],
            self.k_tail,
            self.v_tail,
            self.lengths[1],
            None,
            scale,
            None,
            None,
            None,
            self.window,
            softcap,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        """One step: append k, v, then attend with q."""
        self.append(k, v)
        return self.attend(q, scale, softcap)

    def seq_lengths(self) -> torch.Tensor:
        """[batch] tokens held per sequence (compressed + tail)."""
        return self.lengths.sum(0)

    def reset(self) -> None:
        """Empties every sequence (the buffers' contents past the lengths are not read)."""
        self.lengths.zero_()
        if self._dynamic:  # the DGQ invariant: unused segment slots hold the compressed length
            self.k_segment_starts.zero_()

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds: its whole preallocated capacity."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (
            f"k_format={self.k_format}, v_format={self.v_format}, residual={self.residual}, "
            f"capacity={self.k_codes.shape[2]}, window={self.window}"
        )
