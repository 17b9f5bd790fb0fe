"""A compressed KV cache of fixed capacity whose whole state is tensors, so that a decode
step compiles: torch.compile(fullgraph=True) and torch.export trace it without a graph
break, because a step is two operators with fake kernels and nothing else —
``static_kv_append_`` (mutates the cache's buffers in place) and ``dgq_fused_attention``.

    cache = StaticKVCache(batch=1, kv_heads=8, head_dim=128, max_tokens=8192, dtype=torch.bfloat16)
    out = cache(q, k, v)          # append k/v [B, H, n, D], then attend with q [B, Hq, n, D]

It holds what the dynamic ``nexuskv.cache.make_cache`` holds for the same settings (the
same compressed format, the same tail policy: the ``residual`` newest tokens stay in
full precision, older ones are compressed a chunk at a time), preallocated for
``max_tokens`` tokens (the compressed part has room for max_tokens rounded up to whole
chunks, the tail for up to residual + chunk - 1 more), but no sinks, no rotation and no
eviction (a sliding ``window`` masks; the memory is allocated for max_tokens anyway).  An
append that needs more compressed room raises and stores nothing.
The buffers are registered as module buffers (``state_dict`` saves the cache).  CPU
only for now (the append kernel reads the lengths on the host); the dynamic cache serves
CUDA."""

from __future__ import annotations

from typing import Optional

import torch

from . import ops

__all__ = ["StaticKVCache"]

_K = ("k_codes", "k_scale", "k_zero", "k_outlier_idx", "k_outlier_val", "k_segment_starts")
_V = ("v_codes", "v_scale", "v_zero", "v_outlier_idx", "v_outlier_val")


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
            ("group_size", group_size),
        ):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"StaticKVCache: {name} must be a positive int, got {val!r}")
        if not isinstance(residual, int) or residual < 0:
            raise ValueError(f"StaticKVCache: residual must be an int >= 0, got {residual!r}")
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"StaticKVCache: the static cache runs on the CPU only for now, got device {device!r} "
                f"(on CUDA use the dynamic cache, nexuskv.cache.make_cache / nexuskv.hf.cache_for)"
            )
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"StaticKVCache: window must be a positive int or None, got {window!r}")
        value_bits = bits if value_bits is None else value_bits
        value_group_size = group_size if value_group_size is None else value_group_size
        value_outliers = outliers if value_outliers is None else value_outliers
        self.k_format = [bits, group_size, -2] + ([granule] if dynamic_keys else [])
        self.v_format = [value_bits, value_group_size, -1]
        self.residual, self.window, self.max_tokens = residual, window, max_tokens
        self.chunk = group_size  # values are grouped per token: any token count compresses
        capacity = -(-max_tokens // self.chunk) * self.chunk
        # Buffers of the operators' own sizes: compress on the meta device (the fake
        # kernels' shapes), allocate zeros of those (unused rows decode to zero).
        meta = torch.empty(batch, kv_heads, capacity, head_dim, dtype=dtype, device="meta")
        if dynamic_keys:
            k_parts = ops.dgq_compress(meta, bits, group_size, granule, None, outliers, meta_dtype or dtype)
        else:
            k_parts = ops.nq_compress(meta, bits, group_size, -2, outliers, meta_dtype or dtype)
        v_parts = ops.nq_compress(meta, value_bits, value_group_size, -1, value_outliers, meta_dtype or dtype)
        for name, t in zip(_K, k_parts):
            self.register_buffer(name, torch.zeros(t.shape, dtype=t.dtype, device=device))
        if dynamic_keys:  # unused segments start at the capacity (the DGQ invariant)
            self.k_segment_starts.fill_(capacity)
        for name, t in zip(_V, v_parts):
            self.register_buffer(name, torch.zeros(t.shape, dtype=t.dtype, device=device))
        tail = (batch, kv_heads, max(1, residual + self.chunk - 1), head_dim)
        self.register_buffer("k_tail", torch.zeros(tail, dtype=dtype, device=device))
        self.register_buffer("v_tail", torch.zeros(tail, dtype=dtype, device=device))
        self.register_buffer("lengths", torch.zeros(2, batch, dtype=torch.long, device=device))  # compressed, tail
        self._dynamic = dynamic_keys

    def _k_store(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in (_K if self._dynamic else _K[:5])]

    def _v_store(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in _V]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Appends k, v [batch, kv_heads, n, head_dim] (the cache's dtype)."""
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
        self.lengths.zero_()

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds: its whole preallocated capacity."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (
            f"k_format={self.k_format}, v_format={self.v_format}, residual={self.residual}, "
            f"capacity={self.k_codes.shape[2]}, window={self.window}"
        )
