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

Allocation: every tensor starts at a floor (the fewest bits offered, or a floor for keys
and one for values); then, greedily, the upgrade (a tensor to any higher choice) with
the largest drop in score per extra bit of the cache is taken while the average
effective bits (every scale and zero counted, the same figure as eval's "eff. bits")
stay within the budget.  The average is over layers with equal weight per token
written: layers hold the same K/V elements per token.
(Sliding-window layers of Gemma 3 hold only their window, so at long contexts their
bits weigh less in the bytes than in this average: the budget is per token written,
not per byte held.)

Choice: because the single scores do not add up, `choose` runs the allocation from every
floor that fits the budget (uniform widths included), measures each distinct map whole
on the calibration windows, and keeps the one of least KL divergence: it never returns a
map that the calibration text says is worse than another candidate of the same budget.

Granularity: per layer and per K/V, not per head: the fused kernel reads one bit width
per cache layer."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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
        _nq_bits(bits, value_group_size, head_dim, 0, meta_dtype, model_dtype, channel_groups=True),
    )


def average_bits(bit_map: Sequence[Sequence[int]], cost: Callable[[int], Tuple[float, float]]) -> float:
    """The mean effective bits of a bit map [layers][key bits, value bits], keys and values
    of every layer weighted alike."""
    total = sum(cost(kb)[KEYS] + cost(vb)[VALUES] for kb, vb in bit_map)
    return total / (2 * len(bit_map))


def allocate(
    scores: torch.Tensor,
    choices: Sequence[int],
    cost: Callable[[int], Tuple[float, float]],
    budget: float,
    floor: Tuple[int, int] | None = None,
) -> List[List[int]]:
    """The bit map [layers][key bits, value bits] chosen greedily (see the module text) from
    scores [layers, 2, len(choices)] (lower is better; choices ascending) under `budget`
    average effective bits, starting from `floor` (key bits, value bits: the fewest each
    keys and values may get; default the fewest choice).  Raises ValueError when the floor
    alone exceeds the budget."""
    layers = scores.shape[0]
    if list(choices) != sorted(set(choices)) or scores.shape != (layers, 2, len(choices)):
        raise ValueError(
            f"allocate: choices must be ascending and distinct and scores [layers, 2, "
            f"{len(choices)}], got {list(choices)} and {tuple(scores.shape)}"
        )
    floor = (choices[0], choices[0]) if floor is None else tuple(floor)
    if any(b not in choices for b in floor):
        raise ValueError(f"allocate: floor {floor} must be among the choices {list(choices)}")
    start = [choices.index(floor[KEYS]), choices.index(floor[VALUES])]
    level = [list(start) for _ in range(layers)]  # index into choices
    per_tensor = 2 * layers

    def bits_of(i, t, c):
        return cost(choices[c])[t]

    spent = sum(bits_of(i, t, start[t]) for i in range(layers) for t in (KEYS, VALUES))
    if spent / per_tensor > budget + 1e-9:
        raise ValueError(
            f"allocate: keys at {floor[KEYS]} and values at {floor[VALUES]} bits everywhere take "
            f"{spent / per_tensor:.3f} effective bits, over the budget of {budget}"
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


@contextlib.contextmanager
def _divergence(
    model, windows, chunk: int, reference_bits: int, cache_kwargs: dict, reference_kwargs: Optional[dict] = None
):
    """Yields kl(bit_map) -> the mean KL divergence (nats per predicted token) of the model's
    next-token distributions over `windows` with that bit map from the all-`reference_bits`
    cache's (made with `reference_kwargs`, default `cache_kwargs`), each window fed `chunk`
    tokens at a time through the fused path (as eval does)."""
    from .hf import ATTN_IMPLEMENTATION, cache_for
    from .hf_compat import cache_argument, text_config

    layers = text_config(model).num_hidden_layers
    name = cache_argument(model)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def log_probs(bit_map, ids, kwargs=cache_kwargs):
        cache, out = cache_for(model, bit_map=bit_map, **kwargs), []
        for s in range(0, ids.shape[1], chunk):
            logits = model(ids[:, s : s + chunk], **{name: cache}, use_cache=True).logits
            out.append(torch.log_softmax(logits.float(), -1))
        return torch.cat(out, 1)[0, :-1]  # the last position predicts nothing in the window

    @torch.no_grad()
    def kl(bit_map) -> float:
        per_token = [(r.exp() * (r - log_probs(bit_map, ids))).sum(-1) for r, ids in zip(reference, windows)]
        return float(torch.cat(per_token).mean())

    try:
        with torch.no_grad():
            ref_map = [[reference_bits] * 2 for _ in range(layers)]
            ref_kwargs = cache_kwargs if reference_kwargs is None else reference_kwargs
            reference = [log_probs(ref_map, ids, ref_kwargs) for ids in windows]
        yield kl
    finally:
        model.set_attn_implementation(previous)


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
    from .hf_compat import text_config

    layers = text_config(model).num_hidden_layers
    scores = torch.zeros(layers, 2, len(choices))
    with _divergence(model, windows, chunk, reference_bits, cache_kwargs) as kl:
        for i in range(layers):
            for t in (KEYS, VALUES):
                for c, bits in enumerate(choices):
                    bit_map = [[reference_bits] * 2 for _ in range(layers)]
                    bit_map[i][t] = bits
                    scores[i, t, c] = kl(bit_map)
                progress(
                    f"layer {i} {'KV'[t]}: " + " ".join(f"{b}-bit {scores[i, t, c]:.5f}" for c, b in enumerate(choices))
                )
    return scores


def choose(
    model,
    windows,
    scores: torch.Tensor,
    choices: Sequence[int],
    cost: Callable[[int], Tuple[float, float]],
    budget: float,
    chunk: int = 64,
    reference_bits: int = REFERENCE_BITS,
    progress: Callable[[str], None] = lambda line: None,
    **cache_kwargs,
) -> Tuple[List[List[int]], List[Dict[str, object]]]:
    """(bit map, candidates): the single-tensor scores add up less well than the greedy
    allocation assumes (on Gemma 3 at 3.25 bits it paid for 4-bit keys with 2-bit values
    and lost to 3 bits everywhere), so the greedy allocation is run from every floor
    (fewest key bits, fewest value bits) whose cost fits the budget -- uniform widths
    included -- and each distinct map is measured whole on the calibration windows; the
    map of least KL divergence from the reference is returned.  candidates: one dict per
    distinct map (floor, bit_map, effective_bits, kl), in the order measured."""
    maps = []
    for kf in choices:
        for vf in choices:
            try:
                m = allocate(scores, choices, cost, budget, floor=(kf, vf))
            except ValueError:
                continue  # this floor alone is over the budget
            if all(m != c["bit_map"] for c in maps):
                maps.append({"floor": [kf, vf], "bit_map": m, "effective_bits": round(average_bits(m, cost), 4)})
    if not maps:
        raise ValueError(f"choose: {choices[0]} bits everywhere are over the budget of {budget}")
    with _divergence(model, windows, chunk, reference_bits, cache_kwargs) as kl:
        for c in maps:
            c["kl"] = kl(c["bit_map"])
            progress(f"floor K {c['floor'][0]} V {c['floor'][1]}: {c['effective_bits']:.3f} bits, KL {c['kl']:.5f}")
    return min(maps, key=lambda c: c["kl"])["bit_map"], maps


def map_divergence(
    model,
    windows,
    bit_map,
    chunk: int = 64,
    reference_bits: int = REFERENCE_BITS,
    reference_kwargs: Optional[dict] = None,
    **cache_kwargs,
) -> float:
    """The KL divergence (nats per predicted token) of one whole bit map with these cache
    settings from the all-`reference_bits` cache made with `reference_kwargs` (default: the
    same settings), over `windows`: pass choose's settings there to compare with its KL."""
    with _divergence(model, windows, chunk, reference_bits, cache_kwargs, reference_kwargs) as kl:
        return kl(bit_map)


def describe(bit_map: Sequence[Sequence[int]]) -> Dict[str, object]:
    """What a bit map holds, for printing: how many tensors at each width, keys and values."""
    keys = [kb for kb, _ in bit_map]
    values = [vb for _, vb in bit_map]
    return {
        "keys": {b: keys.count(b) for b in sorted(set(keys))},
        "values": {b: values.count(b) for b in sorted(set(values))},
    }
