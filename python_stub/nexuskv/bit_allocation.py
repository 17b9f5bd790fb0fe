"""Mixed precision across layers: how many code bits each layer's keys and values get
under an average-bits budget (issue 21's "mixed precision ... allocated from a
calibration sensitivity score"), for nexuskv's own cache.

Sensitivity of a tensor (one layer's keys, or its values) at b bits: the model runs
over calibration windows with every layer's K and V at 8 bits (the reference, within
0.1 % of dense on both models measured) except that one tensor at b bits, chunk by
chunk through the compressed cache exactly as `eval` feeds it; the score is the mean
KL divergence (nats per predicted token) of its next-token distributions from the
reference's.  One forward pass per (layer, K or V, b): measured alone, so the scores
ignore how errors of different layers add up (they add up more than linearly at 2 bits:
the sum of single scores is below the all-2-bit score), which is why the allocation is
checked by `eval` on other texts, never trusted from the scores.

Allocation: every tensor starts at the fewest bits offered; then, greedily, the upgrade
(a tensor to any higher choice) with the largest drop in score per extra bit of the
cache is taken while the average effective bits (every scale and zero counted, the
same figure as eval's "eff. bits") stay within the budget.  The average is over layers
with equal weight per token written: layers hold the same K/V elements per token.
(Sliding-window layers of Gemma 3 hold only their window, so at long contexts their
bits weigh less in the bytes than in this average: the budget is per token written,
not per byte held.)

Granularity: per layer and per K/V, not per head: the fused kernel reads one bit width
per cache layer."""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Sequence, Tuple

import torch

KEYS, VALUES = 0, 1
REFERENCE_BITS = 8  # the cache every score is measured against: its own score is 0


def tensor_bits(
    bits: int, head_dim: int, group_size: int, value_group_size: int, meta_dtype: torch.dtype, model_dtype: torch.dtype
) -> Tuple[float, float]:
    """Effective bits per element of a layer's keys and values at `bits` (no outliers):
    the format's packed codes plus each group's scale and zero (eval_caches._nq_bits)."""
    from .eval_caches import _nq_bits

    return (
        _nq_bits(bits, group_size, head_dim, 0, meta_dtype, model_dtype),
        _nq_bits(bits, value_group_size, head_dim, 0, meta_dtype, model_dtype),
    )


def average_bits(bit_map: Sequence[Sequence[int]], cost: Callable[[int], Tuple[float, float]]) -> float:
    """The mean effective bits of a bit map [layers][key bits, value bits], keys and values
    of every layer weighted alike."""
    total = sum(cost(kb)[KEYS] + cost(vb)[VALUES] for kb, vb in bit_map)
    return total / (2 * len(bit_map))


def allocate(
    scores: torch.Tensor, choices: Sequence[int], cost: Callable[[int], Tuple[float, float]], budget: float
) -> List[List[int]]:
    """The bit map [layers][key bits, value bits] chosen greedily (see the module text) from
    scores [layers, 2, len(choices)] (lower is better; choices ascending) under `budget`
    average effective bits.  Raises ValueError when even the fewest bits exceed the budget."""
    layers = scores.shape[0]
    if list(choices) != sorted(set(choices)) or scores.shape != (layers, 2, len(choices)):
        raise ValueError(
            f"allocate: choices must be ascending and distinct and scores [layers, 2, "
            f"{len(choices)}], got {list(choices)} and {tuple(scores.shape)}"
        )
    level = [[0, 0] for _ in range(layers)]  # index into choices
    per_tensor = 2 * layers

    def bits_of(i, t, c):
        return cost(choices[c])[t]

    spent = sum(bits_of(i, t, 0) for i in range(layers) for t in (KEYS, VALUES))
    if spent / per_tensor > budget + 1e-9:
        raise ValueError(
            f"allocate: {choices[0]} bits everywhere take {spent / per_tensor:.3f} effective bits, "
            f"over the budget of {budget}"
        )
    while True:
        best = None  # (gain per bit, layer, tensor, choice index, extra bits)
        for i in range(layers):
            for t in (KEYS, VALUES):
                now = level[i][t]
                for c in range(now + 1, len(choices)):
                    extra = bits_of(i, t, c) - bits_of(i, t, now)
                    if (spent + extra) / per_tensor > budget + 1e-9:
                        continue
                    drop = float(scores[i, t, now] - scores[i, t, c])
                    # a wider code that costs no more (a padded row holds it anyway) is free
                    gain = drop / extra if extra > 0 else math.inf
                    if drop > 0 and (best is None or gain > best[0]):
                        best = (gain, i, t, c, extra)
        if best is None:
            return [[choices[level[i][KEYS]], choices[level[i][VALUES]]] for i in range(layers)]
        _, i, t, c, extra = best
        level[i][t] = c
        spent += extra


@torch.no_grad()
def sensitivity(
    model,
    windows,
    choices: Sequence[int],
    chunk: int = 64,
    reference_bits: int = REFERENCE_BITS,
    progress: Callable[[str], None] = lambda line: None,
    **cache_kwargs,
) -> torch.Tensor:
    """scores float32 [layers, 2, len(choices)]: the mean KL divergence (nats per predicted
    token) from the all-`reference_bits` cache's next-token distributions when only that
    layer's keys (index 0) or values (1) are at that many bits, over `windows`
    (input_ids [1, n] each), fed `chunk` tokens at a time through the fused path.
    cache_kwargs go to cache_for (group sizes, tail, sinks, ...)."""
    from .hf import ATTN_IMPLEMENTATION, cache_for
    from .hf_compat import cache_argument, text_config

    layers = text_config(model).num_hidden_layers
    name = cache_argument(model)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def log_probs(bit_map, ids):
        cache, out = cache_for(model, bit_map=bit_map, **cache_kwargs), []
        for s in range(0, ids.shape[1], chunk):
            logits = model(ids[:, s : s + chunk], **{name: cache}, use_cache=True).logits
            out.append(torch.log_softmax(logits.float(), -1))
        return torch.cat(out, 1)[0, :-1]  # the last position predicts nothing in the window

    try:
        reference_map = [[reference_bits, reference_bits] for _ in range(layers)]
        reference = [log_probs(reference_map, ids) for ids in windows]
        scores = torch.zeros(layers, 2, len(choices))
        for i in range(layers):
            for t in (KEYS, VALUES):
                for c, bits in enumerate(choices):
                    bit_map = [list(b) for b in reference_map]
                    bit_map[i][t] = bits
                    kl = [(r.exp() * (r - log_probs(bit_map, ids))).sum(-1) for r, ids in zip(reference, windows)]
                    scores[i, t, c] = torch.cat(kl).mean()
                progress(
                    f"layer {i} {'KV'[t]}: " + " ".join(f"{b}-bit {scores[i, t, c]:.5f}" for c, b in enumerate(choices))
                )
    finally:
        model.set_attn_implementation(previous)
    return scores


def describe(bit_map: Sequence[Sequence[int]]) -> Dict[str, object]:
    """What a bit map holds, for printing: how many tensors at each width, keys and values."""
    keys = [kb for kb, _ in bit_map]
    values = [vb for _, vb in bit_map]
    return {
        "keys": {b: keys.count(b) for b in sorted(set(keys))},
        "values": {b: values.count(b) for b in sorted(set(values))},
    }
