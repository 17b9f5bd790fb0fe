"""Paged KV for serving engines: a layer's K/V compressed inside an engine's block pool.

The format (csrc/include/nexuskv/core/paged_format.h): ``pages`` is one uint8 tensor
``[num_blocks, kv_heads, block_size, slot_bytes]`` per layer (vLLM's per-layer cache shape);
each (block, kv head) holds the NQ buffers of its ``block_size`` tokens, keys and values
quantized per token over groups of ``group_size`` channels, scales in the model's dtype.
A token is stored exactly as :func:`nexuskv.ops.nq_compress` ``(x, bits, group_size, axis=-1)``
stores it, whatever batch it came in, so outputs do not depend on how a prompt was chunked.

The operators (``torch.ops.nexuskv.paged_*``; CPU kernels, CUDA kernels that compile):

- :func:`slot_bytes` — bytes per (token, kv head): what the engine sizes its blocks by;
- :func:`write_` — quantize-on-write of new tokens into slots (``slot = block * block_size + offset``);
- :func:`attention` — fused attention over each request's pages through its block table,
  for ragged batches (``query_start_loc``), decode and (chunked) prefill alike;
- :func:`write_exact_` — with an exact window (``PagedFormat.exact_window`` W > 0), the new
  tokens' unquantized rows into their blocks' rings, *after* the attention over them.

A step with an exact window is therefore ``write_`` (codes), ``attention(..., key=, value=)`` (each
query reads its W newest keys and values exact: the step's own rows from ``key`` / ``value``, older
ones from the rings), then ``write_exact_``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import _loader  # noqa: F401  (loads the operator library)
from .compressors import rotation_signs as _rotation_signs

__all__ = ["PagedFormat", "slot_bytes", "write_", "write_exact_", "attention"]


@dataclass(frozen=True)
class PagedFormat:
    """The parameters of a paged pool; every argument of the three operators but the tensors.

    rotate: keys and values are stored Hadamard-rotated (signs from ``seed``), which spreads
    outlier channels over the group and makes per-token 4-bit and 2-bit keys far better.
    key_fit_range / value_fit_range: each key / value group's scale and zero fitted by least
    squares (nexuskv.ops.nq_compress's fit_range) when written; the same slots and attention.
    exact_window: W >= 0 newest tokens of every query read exact (a ring of W unquantized tokens
    per block: ``ceil(2 W head_dim itemsize / block_size)`` more bytes per slot; W <= block_size).
    """

    key_bits: int = 4
    value_bits: int = 4
    group_size: int = 64
    num_outliers: int = 0
    rotate: bool = True
    seed: int = 0
    key_fit_range: bool = False
    value_fit_range: bool = False
    exact_window: int = 0

    def signs(self, head_dim: int, device=None) -> Optional[torch.Tensor]:
        if not self.rotate:
            return None
        return _rotation_signs(head_dim, self.seed).to(device=device)

    def slot_bytes(self, head_dim: int, dtype: torch.dtype, block_size: int = 0) -> int:
        """block_size: tokens per block, needed with an exact window (its ring's share of a slot)."""
        return slot_bytes(
            head_dim,
            dtype,
            self.key_bits,
            self.value_bits,
            self.group_size,
            self.num_outliers,
            self.exact_window,
            block_size,
        )

    def bits_per_element(self, head_dim: int, dtype: torch.dtype, block_size: int = 0) -> float:
        """Effective bits per stored K or V element, every scale, zero, outlier and ring byte counted."""
        return 8 * self.slot_bytes(head_dim, dtype, block_size) / (2 * head_dim)


def slot_bytes(
    head_dim: int,
    dtype: torch.dtype,
    key_bits: int = 4,
    value_bits: int = 4,
    group_size: int = 64,
    num_outliers: int = 0,
    exact_window: int = 0,
    block_size: int = 0,
) -> int:
    """Bytes of one (token, kv head) slot: the last dimension of ``pages`` (block_size: needed
    with an exact window)."""
    return torch.ops.nexuskv.paged_slot_bytes(
        head_dim, key_bits, value_bits, group_size, num_outliers, dtype, exact_window, block_size
    )


def write_(
    pages: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: PagedFormat,
    signs: Optional[torch.Tensor] = None,
) -> None:
    """Quantizes key / value ``[num_tokens, kv_heads, head_dim]`` into ``slot_mapping[t]`` (int64;
    -1 skips the token).  signs: ``fmt.signs(head_dim)``, given when fmt.rotate (pass them once
    per layer rather than rebuilding them per call)."""
    if fmt.rotate and signs is None:
        signs = fmt.signs(key.shape[-1], key.device)
    torch.ops.nexuskv.paged_kv_write_(
        pages,
        key,
        value,
        slot_mapping,
        fmt.key_bits,
        fmt.value_bits,
        fmt.group_size,
        fmt.num_outliers,
        signs if fmt.rotate else None,
        fmt.key_fit_range,
        fmt.value_fit_range,
        fmt.exact_window,
    )


def write_exact_(
    pages: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: PagedFormat,
) -> None:
    """The exact window's rings (fmt.exact_window > 0): key / value ``[num_tokens, kv_heads,
    head_dim]`` as given, unquantized and not rotated, into the rings of ``slot_mapping[t]``, in
    token order.  Call it after :func:`attention` over the same tokens."""
    torch.ops.nexuskv.paged_exact_write_(
        pages,
        key,
        value,
        slot_mapping,
        fmt.key_bits,
        fmt.value_bits,
        fmt.group_size,
        fmt.num_outliers,
        fmt.exact_window,
    )


def attention(
    q: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    fmt: PagedFormat,
    signs: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    key: Optional[torch.Tensor] = None,
    value: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """softmax(q . K^T * scale) . V over each request's pages; q ``[num_tokens, q_heads, head_dim]``
    in the dtype K and V were written in; block_table int32 ``[num_reqs, max_blocks]``, seq_lens
    int32 ``[num_reqs]`` (tokens in the pool, the queries' own included), query_start_loc int32
    ``[num_reqs + 1]``.  key / value ``[num_tokens, kv_heads, head_dim]``: the queries' own keys
    and values as written, required with an exact window (and only then).  Returns
    ``[num_tokens, q_heads, head_dim]`` (zeros past ``query_start_loc[-1]``)."""
    if fmt.rotate and signs is None:
        signs = fmt.signs(q.shape[-1], q.device)
    return torch.ops.nexuskv.paged_attention(
        q,
        pages,
        block_table,
        seq_lens,
        query_start_loc,
        fmt.key_bits,
        fmt.value_bits,
        fmt.group_size,
        fmt.num_outliers,
        signs if fmt.rotate else None,
        scale,
        window,
        softcap,
        fmt.exact_window,
        key,
        value,
    )
