"""Fused attention over compressed K/V objects (NQTensor from NQ or DGQ)."""

from __future__ import annotations

from typing import Optional

import torch

from .compressors import NQTensor
from .ops import dgq_fused_attention


def fused_attention(q: torch.Tensor, k: NQTensor, v: NQTensor, compressed_lens: torch.Tensor,
                    k_tail: Optional[torch.Tensor] = None, v_tail: Optional[torch.Tensor] = None,
                    tail_lens: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                    k_sink: Optional[torch.Tensor] = None, v_sink: Optional[torch.Tensor] = None,
                    sink_lens: Optional[torch.Tensor] = None, window: Optional[int] = None,
                    softcap: Optional[float] = None) -> torch.Tensor:
    """softmax(q . K^T * scale + causal) . V with K and V read compressed, plus optional
    full-precision sink tokens before them and a tail after them, an optional sliding
    window and logit soft-cap (see
    nexuskv.ops.dgq_fused_attention for shapes).  K and V must share one basis:
    both unrotated, or rotated with the same signs."""
    if (k.signs is None) != (v.signs is None) or (k.signs is not None and not torch.equal(k.signs, v.signs)):
        raise ValueError("fused_attention: K and V must both be unrotated or rotated with the same signs")
    return dgq_fused_attention(q, k.parts, v.parts, k.format, v.format, compressed_lens, k_tail, v_tail,
                               tail_lens, k.signs, scale, k_sink, v_sink, sink_lens, window, softcap)
