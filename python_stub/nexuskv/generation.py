"""Greedy generation through a given KV cache, timed, and the agreement of two
generations: shared by `python -m nexuskv eval` and `python -m nexuskv demo`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from .hf_compat import cache_argument


@dataclass
class Generation:
    tokens: List[int]  # the new tokens only
    prefill_s: float  # the prompt's forward pass
    decode_s: float  # every later token

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else float("nan")


def greedy(model, prompt_ids: torch.Tensor, cache, new_tokens: int, progress: Optional[str] = None) -> Generation:
    """Feeds the prompt [1, n] through the model into `cache`, then appends
    `new_tokens` argmax tokens one at a time (end-of-text does not stop it, so that
    every cache generates the same count).  progress: a label for a progress bar
    (stderr) over the new tokens."""
    from tqdm import tqdm

    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"greedy: prompt_ids must have shape [1, n], got {tuple(prompt_ids.shape)}")
    if new_tokens < 1:
        raise ValueError(f"greedy: new_tokens must be >= 1, got {new_tokens}")
    out: List[int] = []
    cache_kw = {cache_argument(model): cache}
    bar = tqdm(total=new_tokens, desc=progress, unit="token", disable=progress is None, leave=False)
    with torch.inference_mode(), bar:
        t0 = time.perf_counter()
        logits = model(prompt_ids, **cache_kw, use_cache=True).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        out.append(int(nxt))
        bar.update()
        for _ in range(new_tokens - 1):
            logits = model(nxt, **cache_kw, use_cache=True).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(nxt))
            bar.update()
        t2 = time.perf_counter()
    return Generation(out, t1 - t0, t2 - t1)


def agreement(reference: List[int], other: List[int]) -> dict:
    """{"leading": tokens equal before the first difference, "match": fraction of
    equal positions}, over the common length."""
    n = min(len(reference), len(other))
    if n == 0:
        raise ValueError("agreement: both generations must be non-empty")
    same = [a == b for a, b in zip(reference[:n], other[:n])]
    leading = same.index(False) if False in same else n
    return {"leading": leading, "match": sum(same) / n}
