"""`python -m nexuskv eval`: the real model with its KV cache compressed, against
the dense cache transformers itself would use, on the same tokens.  Three
measurements per cache setting (settings: nexuskv.eval_caches):

1. Perplexity.  The text is cut into `repeats` disjoint segments (different text
   offsets; the rotation's random signs change with them too), each into windows;
   every window is one sequence that starts the way the tokenizer starts a sequence
   (its BOS when it adds one, models.sequence_prefix) and is fed in chunks (at most
   64 tokens); the queries of a chunk attend to the compressed past plus their own
   chunk: through attn_implementation="nexuskv" (fused attention over the compressed
   cache) for nexuskv, through the model's SDPA over transformers' DynamicCache(config)
   (dense) or QuantizedCache (optimum-quanto, which returns dequantized K/V)
   otherwise.  Each row reports the perplexity over all segments and the spread of
   its ΔPPL over the segments, so that differences below that noise are not taken
   for wins (knob_effects, equal_bit_pairs); and, on the same forwards, the KL
   divergence of its next-token distribution from the dense cache's and how often
   their most likely tokens agree: ΔPPL can favour a cache by chance on a segment,
   the KL cannot, so near-lossless caches are told apart by it (kl_verdict).
2. Greedy agreement: new tokens generated from a prompt of real text with the
   dense cache and with the compressed one; leading equal tokens and the fraction
   of equal positions.
3. Bytes: every cache filled with the model's own K/V of the same tokens (as its
   attention sees them, masks included), the model in a 16-bit dtype (so the dense
   reference is a 16-bit cache); every tensor's bytes, compressed part and
   full-precision tail separately, against transformers' own dense cache for the
   model (sliding-window layers hold their window) and, where the model has sliding
   layers, against a DynamicCache() that holds every token too."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import sys
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import eval_caches as ec
from .generation import agreement, greedy
from .hf_compat import cache_argument

Sequences = List[torch.Tensor]  # the windows of one text segment, each [1, n], prefix first


def window_scores(model, ids: torch.Tensor, chunk: int, cache, reference: Optional[torch.Tensor] = None,
                  keep: bool = False) -> Dict[str, torch.Tensor]:
    """ids[1:] scored given the prefix, fed chunk by chunk: "nll" [n-1], the negative
    log-likelihood of each token.  Against `reference` (the dense cache's logits for this
    window's next tokens [n-1, vocab], float32): "kl" [n-1] (float64), KL(reference || this
    cache's distribution) at each position, and "top1" [n-1], whether the most likely next
    token is the reference's.  With `keep`: "logits" [n-1, vocab] (float32, on the CPU), to
    be the reference of the other rows.  Per chunk, so that no more than a chunk's logits are
    held on the model's device."""
    if reference is not None and reference.shape[0] != ids.shape[1] - 1:
        raise ValueError(f"eval: the reference holds {reference.shape[0]} positions, the window "
                         f"{ids.shape[1] - 1}")
    nll, kl, top1, kept, prev_logits = [], [], [], None, None
    cache_kw = {cache_argument(model): cache}
    done = 0  # positions scored so far
    with torch.inference_mode():
        for s in range(0, ids.shape[1], chunk):
            piece = ids[:, s:s + chunk]
            logits = model(piece, **cache_kw, use_cache=True).logits.float()
            if prev_logits is not None:  # the previous chunk's last position predicts this chunk's first token
                logits = torch.cat([prev_logits, logits], 1)
                targets = ids[:, s:s + piece.shape[1]]
            else:
                targets = piece[:, 1:]
            prev_logits = logits[:, -1:]
            scored = logits[0, :targets.shape[1]]  # [m, vocab]
            nll.append(torch.nn.functional.cross_entropy(scored, targets.reshape(-1), reduction="none"))
            if reference is not None:
                ref = reference[done:done + scored.shape[0]].to(scored.device)
                # Both distributions normalized in float64 from the float32 logits: a near-lossless
                # cache's KL (~1e-6 nats) sits below float32 log_softmax's rounding.  A token the
                # reference rules out (logit -inf) adds nothing (0 log 0 = 0), not 0 x inf = NaN.
                p_ref, p = torch.log_softmax(ref.double(), -1), torch.log_softmax(scored.double(), -1)
                terms = torch.where(p_ref.isneginf(), 0.0, p_ref.exp() * (p_ref - p))
                kl.append(terms.sum(-1).cpu())
                top1.append((ref.argmax(-1) == scored.argmax(-1)).cpu())
            if keep:
                if kept is None:  # one buffer for the window: no second copy to concatenate
                    kept = torch.empty(ids.shape[1] - 1, scored.shape[1], dtype=torch.float32)
                kept[done:done + scored.shape[0]] = scored
            done += scored.shape[0]
    out = {"nll": torch.cat(nll)}
    if reference is not None:
        out.update(kl=torch.cat(kl), top1=torch.cat(top1))
    if keep:
        out["logits"] = kept
    return out


def windows(body: torch.Tensor, prefix: Sequence[int], window: int) -> Sequences:
    """body [1, n] (text tokens without special tokens) cut into sequences of at most
    `window` tokens, each `prefix` (the tokenizer's start of a sequence) + the next
    window - len(prefix) tokens of text: every window starts as a sequence does, and
    with a prefix every text token is predicted once (without one, the first of each
    window is not predicted)."""
    from .models import as_sequence

    step = window - len(prefix)
    if step < 2:
        raise ValueError(f"eval: --window must exceed the tokenizer's sequence prefix ({len(prefix)} tokens) by at "
                         f"least 2, got {window}")
    return [as_sequence(list(prefix), body[:, w0:w0 + step]) for w0 in range(0, body.shape[1], step)]


def perplexity(model, sequences: Sequences, chunk: int, make_cache: Callable,
               references: Optional[List[torch.Tensor]] = None, keep: bool = False) -> Dict:
    """Perplexity over the given sequences, each with a fresh cache (every token after the
    first of each sequence is predicted).  With `references` (per sequence, the dense
    cache's logits: window_scores) also the summed KL divergence from them ("kl_sum",
    nats) and how many positions keep the reference's most likely token ("top1_equal");
    with `keep`, "logits": this cache's, per sequence (references for the other rows)."""
    scored = [s for s in sequences if s.shape[1] > 1]
    refs = references if references is not None else [None] * len(scored)
    if len(refs) != len(scored):
        raise ValueError(f"eval: {len(refs)} references for {len(scored)} sequences")
    parts = [window_scores(model, ids, chunk, make_cache(), ref, keep) for ids, ref in zip(scored, refs)]
    nll = torch.cat([p["nll"] for p in parts])
    out = {"ppl": math.exp(float(nll.mean())), "tokens": int(nll.numel()), "nll_sum": float(nll.sum())}
    if references is not None:
        out["kl_sum"] = sum(float(p["kl"].sum()) for p in parts)
        out["top1_equal"] = sum(int(p["top1"].sum()) for p in parts)
    if keep:
        out["logits"] = [p["logits"] for p in parts]
    return out


def _summarize(per_repeat: List[Dict], dense: List[Dict]) -> Dict:
    """Pooled perplexity over all repeats, ΔPPL pooled and per repeat, and its spread; where
    measured, the KL divergence from the dense cache's next-token distribution (mean nats
    per predicted token) and the fraction of positions whose most likely token is dense's,
    pooled and per repeat."""
    tokens = sum(r["tokens"] for r in per_repeat)
    ppl = math.exp(sum(r["nll_sum"] for r in per_repeat) / tokens)
    base = math.exp(sum(r["nll_sum"] for r in dense) / sum(r["tokens"] for r in dense))
    deltas = [100 * (r["ppl"] - d["ppl"]) / d["ppl"] for r, d in zip(per_repeat, dense)]
    repeats = [{"ppl": r["ppl"], "tokens": r["tokens"], "delta_ppl_pct": d} for r, d in zip(per_repeat, deltas)]
    out = {"ppl": ppl, "tokens": tokens, "delta_ppl_pct": 100 * (ppl - base) / base, "repeats": repeats,
           "delta_ppl_pct_min": min(deltas), "delta_ppl_pct_max": max(deltas)}
    if all("kl_sum" in r for r in per_repeat):
        for rep, r in zip(repeats, per_repeat):
            rep.update(kl=r["kl_sum"] / r["tokens"], top1_equal=r["top1_equal"] / r["tokens"])
        kls = [rep["kl"] for rep in repeats]
        out.update(kl=sum(r["kl_sum"] for r in per_repeat) / tokens, kl_min=min(kls), kl_max=max(kls),
                   top1_equal=sum(r["top1_equal"] for r in per_repeat) / tokens)
    return out


def measure_perplexity(model, segments: List[Sequences], chunk: int, settings: List[ec.Setting],
                       progress: bool = True, kl: bool = True) -> Dict[ec.Setting, Dict]:
    """Per setting: perplexity on every segment (repeat r: its own text, rotation seed r).
    The dense row runs first; with `kl` its logits are held (tokens x vocab float32) and
    every other row is also scored by its KL divergence from them."""
    from tqdm import tqdm

    order = [ec.DENSE_SETTING] + [s for s in settings if s != ec.DENSE_SETTING]
    raw, references = {}, None
    bar = tqdm(order, desc="perplexity", unit="row", disable=not progress)
    for s in bar:
        bar.set_postfix_str(s.name)  # the row being measured; tqdm's estimate covers the rows left
        dense = s == ec.DENSE_SETTING
        with ec.attention_for(model, s):
            raw[s] = [perplexity(model, seqs, chunk, lambda s=s, r=r: ec.make_cache(model, s, seed=r),
                                 references[r] if references is not None else None, keep=dense and kl)
                      for r, seqs in enumerate(segments)]
        if dense and kl:
            references = [per.pop("logits") for per in raw[s]]
            for per in raw[s]:  # the reference against itself
                per.update(kl_sum=0.0, top1_equal=per["tokens"])
    return {s: _summarize(raw[s], raw[ec.DENSE_SETTING]) for s in settings}


def measure_agreement(model, prompt_ids, new_tokens: int, settings: List[ec.Setting],
                      progress: bool = True) -> Dict[ec.Setting, Dict]:
    """Greedy generations of each setting against the dense cache's."""
    from tqdm import tqdm

    out = {}
    with ec.attention_for(model, ec.DENSE_SETTING):
        reference = greedy(model, prompt_ids, ec.make_cache(model, ec.DENSE_SETTING), new_tokens).tokens
    for s in tqdm(settings, desc="greedy generation", unit="setting", disable=not progress):
        if s == ec.DENSE_SETTING:
            g = reference
        else:
            with ec.attention_for(model, s):
                g = greedy(model, prompt_ids, ec.make_cache(model, s), new_tokens).tokens
        out[s] = dict(agreement(reference, g), new_tokens=new_tokens)
    return out


def fill_as_generation(cache, layers) -> Dict[str, int]:
    """Fills `cache` with the captured K/V of `layers` (LayerQKV per layer) as generation
    does, a prefill of all tokens but the last and then the last as one decoded token, and
    returns its bytes (ec.cache_bytes).  A sliding-window layer holds the whole prefill
    while the prefill's queries attend and drops what no later query can see at the next
    append (nexuskv: whole groups) or at once (DynamicCache(config)): measured after one
    prefill alone, nexuskv's sliding layers would still hold every token."""
    with torch.inference_mode():
        for i, layer in enumerate(layers):
            cache.update(layer.k[:, :, :-1], layer.v[:, :, :-1], i)
        for i, layer in enumerate(layers):
            cache.update(layer.k[:, :, -1:], layer.v[:, :, -1:], i)
    return ec.cache_bytes(cache)


def measure_bytes(model, ids: torch.Tensor, settings: List[ec.Setting],
                  progress: bool = True) -> Dict:
    """Bytes each cache holds once filled with the model's own K/V of ids (the model in
    its 16-bit dtype; a prefill of all but the last token, then that token as one decode
    step, fill_as_generation); ratios against transformers' dense cache for the model
    (DynamicCache(config), ec.DENSE_BASELINE) of the same dtype and tokens.  Returns
    {setting: bytes} and, under "every_token", a DynamicCache() holding every token of
    every layer (differs from the baseline where the model has sliding-window layers)."""
    from tqdm import tqdm
    from transformers import DynamicCache

    from .models import capture_qkv

    if model.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"measure_bytes: the model must be 16-bit so that the dense reference is a 16-bit "
                         f"cache, got {model.dtype}")
    layers = capture_qkv(model, ids)
    out = {}
    for s in tqdm([ec.DENSE_SETTING] + [s for s in settings if s != ec.DENSE_SETTING], desc="cache bytes",
                  unit="setting", disable=not progress):
        out[s] = fill_as_generation(ec.make_cache(model, s, direct=True), layers)
    every = fill_as_generation(DynamicCache(), layers)
    dense = out[ec.DENSE_SETTING]["total"]
    elements = ids.shape[1] * ec.kv_elements_per_token(model.config)
    for r in list(out.values()) + [every]:
        r["ratio_to_dense"] = r["total"] / dense
        r["used_ratio_to_dense"] = r["used"] / dense
        r["ratio_to_every_token"] = r["total"] / every["total"]
        r["bits_per_element_all"] = 8 * r["total"] / elements
        r["tokens"] = int(ids.shape[1])
        r["dtype"] = str(model.dtype).replace("torch.", "")
    out["every_token"] = every
    return out


# -- reading the rows ----------------------------------------------------------------------------

def _find(rows: List[Dict], s: ec.Setting) -> Optional[Dict]:
    return next((r for r in rows if r["name"] == s.name), None)


def _differences(with_row: Dict, without_row: Dict, key: str) -> tuple:
    """`key` of `with_row` minus `without_row`: per repeat (same text, same seed), pooled,
    the noise (half the range of the per-repeat differences) and the verdict: "lower" /
    "higher" only when every repeat agrees on the sign and the pooled difference exceeds
    the noise, else "within noise"; one repeat gives no noise estimate: "one repeat"."""
    d = [a[key] - b[key] for a, b in zip(with_row["repeats"], without_row["repeats"])]
    pooled = with_row[key] - without_row[key]
    noise = (max(d) - min(d)) / 2
    if len(d) < 2:
        verdict = "one repeat"
    elif all(x < 0 for x in d) and -pooled > noise:
        verdict = "lower"
    elif all(x > 0 for x in d) and pooled > noise:
        verdict = "higher"
    else:
        verdict = "within noise"
    return d, pooled, noise, verdict


def paired_verdict(with_row: Dict, without_row: Dict) -> Dict:
    """ΔPPL of `with_row` minus `without_row` in points, per repeat and pooled, with the
    noise rule's verdict (_differences)."""
    d, pooled, noise, verdict = _differences(with_row, without_row, "delta_ppl_pct")
    return {"diff_pct": pooled, "diff_pct_repeats": d, "noise_pct": noise, "verdict": verdict}


def kl_verdict(with_row: Dict, without_row: Dict) -> Dict:
    """The same on the KL divergence from the dense cache (nats per token), where both rows
    have it ({} where not).  ΔPPL can favour a cache by chance (on a segment where its
    perplexity falls below the dense cache's own), the KL cannot (it is 0 only for the dense
    distribution itself): near the dense cache's quality it is what tells two caches apart."""
    if "kl" not in with_row or "kl" not in without_row:
        return {}
    d, pooled, noise, verdict = _differences(with_row, without_row, "kl")
    return {"kl_diff": pooled, "kl_diff_repeats": d, "kl_noise": noise, "kl_verdict": verdict}


def knob_effects(rows: List[Dict]) -> List[Dict]:
    """Per ablation bit width and knob: ΔPPL with the knob against without it, alone (on
    the plain setting with a 128-token tail) and in combination (all measured knobs
    against all but this one), with the bits of each side."""
    out = []
    measured = {(r["bits"], r["group_size"], tuple(r["knobs"])) for r in rows if r["kind"] == ec.NEXUSKV
                and r.get("meta") is None and not r.get("recipe") and r["residual"] == 128
                and r.get("window_residual") is None and r["value_group_size"] == r["group_size"]}
    for bits, group in sorted({(b, g) for b, g, _ in measured}, key=lambda bg: (-bg[0], bg[1])):
        combos = [k for b, g, k in measured if (b, g) == (bits, group)]
        full = max(combos, key=len)
        for knob in ec.KNOBS:
            pairs = {"alone": ((knob,), ())}
            if knob in full and len(full) > 1:
                pairs["in combination"] = (full, tuple(k for k in full if k != knob))
            for how, (on, off) in pairs.items():
                a = _find(rows, ec.with_knobs(bits, on, group_size=group))
                b = _find(rows, ec.with_knobs(bits, off, group_size=group))
                if a and b:
                    out.append(dict(paired_verdict(a, b), bits=bits, group_size=group, knob=knob, how=how,
                                    with_setting=a["name"], without_setting=b["name"],
                                    with_bits=a["effective_bits"]["kv"], without_bits=b["effective_bits"]["kv"]))
    return out


def group_effects(rows: List[Dict]) -> List[Dict]:
    """Each nexuskv row with groups other than 64 (keys and values alike) against the same
    setting with groups of 64: what fewer (or more) scale and zero bits cost (or buy) in ΔPPL."""
    same = [f.name for f in dataclasses.fields(ec.Setting) if f.name not in ("group_size", "value_group_size")]
    out = []
    for r in rows:
        if r["kind"] != ec.NEXUSKV or r.get("recipe") or r["group_size"] == 64 or \
                r["value_group_size"] != r["group_size"]:
            continue
        base = next((u for u in rows if u.get("group_size") == u.get("value_group_size") == 64
                     and all(u.get(f) == r.get(f) for f in same)), None)
        if base:
            out.append(dict(paired_verdict(r, base), setting=r["name"], bits=r["effective_bits"]["kv"],
                            g64_setting=base["name"], g64_bits=base["effective_bits"]["kv"]))
    return out


def recipe_effects(rows: List[Dict]) -> List[Dict]:
    """Each recipe row (a bit map) against every uniform nexuskv row of the same tail, sinks,
    groups and ranges (min/max or fitted) and no other knob: is mixed precision lower than
    one width everywhere?  And a recipe's map with fitted ranges against the same map
    without ("uniform" is then that row)."""
    out = []
    recipes = [r for r in rows if r["kind"] == ec.NEXUSKV and r.get("recipe")]
    for m in recipes:
        same = ("residual", "sinks", "group_size", "value_group_size", "window_residual", "meta", "fit_range",
                "value_fit_range")
        for u in rows:
            if u["kind"] == ec.NEXUSKV and not u.get("recipe") and all(u.get(f) == m.get(f) for f in same) and \
                    set(u["knobs"]) <= {"sinks", "fit"}:
                out.append(dict(paired_verdict(m, u), recipe=m["name"], recipe_bits=m["effective_bits"]["kv"],
                                uniform=u["name"], uniform_bits=u["effective_bits"]["kv"]))
        for u in recipes:
            if m.get("fit_range") and not u.get("fit_range") and u["recipe"] == m["recipe"]:
                out.append(dict(paired_verdict(m, u), recipe=m["name"], recipe_bits=m["effective_bits"]["kv"],
                                uniform=u["name"], uniform_bits=u["effective_bits"]["kv"]))
    return out


def equal_bit_pairs(rows: List[Dict]) -> List[Dict]:
    """Every quanto row against the nexuskv row of the same code bits and tail at the same
    effective bits (the plain setting, with the metadata dtype that matches quanto's): ΔPPL
    and, where measured, the KL divergence from the dense cache."""
    out = []
    for q in (r for r in rows if r["kind"] == ec.QUANTO):
        bits = q["effective_bits"]["kv"]
        cands = [r for r in rows if r["kind"] == ec.NEXUSKV and r["bits"] == q["bits"]
                 and r["residual"] == q["residual"] and r.get("window_residual") is None and not r["knobs"]
                 and r["group_size"] == 64
                 and abs(r["effective_bits"]["kv"] - bits) < 1e-9]
        if cands:
            n = cands[0]
            out.append(dict(paired_verdict(n, q), **kl_verdict(n, q), quanto=q["name"], quanto_bits=bits,
                            quanto_delta=q["delta_ppl_pct"], quanto_spread=[q["delta_ppl_pct_min"],
                                                                            q["delta_ppl_pct_max"]],
                            quanto_kl=q.get("kl"), nexuskv=n["name"], nexuskv_bits=n["effective_bits"]["kv"],
                            nexuskv_delta=n["delta_ppl_pct"], nexuskv_spread=[n["delta_ppl_pct_min"],
                                                                              n["delta_ppl_pct_max"]],
                            nexuskv_kl=n.get("kl")))
    return out


def noise_summary(rows: List[Dict]) -> Optional[Dict]:
    """The spread (max - min over repeats) of ΔPPL: median and largest over the compressed rows."""
    spreads = sorted((r["delta_ppl_pct_max"] - r["delta_ppl_pct_min"], r["name"]) for r in rows
                     if r["kind"] != ec.DENSE and len(r["repeats"]) > 1)
    if not spreads:
        return None
    return {"median_pct": spreads[len(spreads) // 2][0], "max_pct": spreads[-1][0], "max_setting": spreads[-1][1],
            "repeats": len(rows[0]["repeats"])}


# -- output --------------------------------------------------------------------------------------

def _fmt_bits(b: Dict) -> str:
    return f"{b['kv']:.3f}" if b["keys"] == b["values"] else f"{b['kv']:.3f} (K {b['keys']:.3f}, V {b['values']:.3f})"


def _spread(r: Dict) -> str:
    if len(r["repeats"]) < 2:
        return "-"
    return f"{r['delta_ppl_pct_min']:+.2f} .. {r['delta_ppl_pct_max']:+.2f}"


def _kl_spread(r: Dict) -> str:
    if len(r["repeats"]) < 2:
        return "-"
    return f"{1e3 * r['kl_min']:.3f} .. {1e3 * r['kl_max']:.3f}"


def _dense_name(r: Dict, dtype_key: str = "model_dtype") -> str:
    return f"dense {r[dtype_key]} ({ec.DENSE_BASELINE})"


def markdown(rows: List[Dict], extra: Optional[Dict] = None) -> str:
    """The main table (one row per setting), the knob and equal-bit comparisons and, when
    measured, the bytes table."""
    has_kl = any("kl" in r for r in rows)
    kl_head = " KL from dense, 10⁻³ nats/token | KL per repeat (min .. max) | top-1 token as dense |" if has_kl else ""
    lines = ["| setting | eff. bits (compressed part) | perplexity | ΔPPL % | ΔPPL % per repeat (min .. max) |"
             f"{kl_head} greedy: leading equal | greedy: equal positions |",
             "|---|---|---|---|---|" + ("---|---|---|" if has_kl else "") + "---|---|"]
    for r in rows:
        g = r.get("greedy")
        leading = f"{g['leading']}/{g['new_tokens']}" if g else "-"
        equal = f"{100 * g['match']:.1f} %" if g else "-"
        name = _dense_name(r) if r["kind"] == ec.DENSE else r["name"]
        kl = "" if not has_kl else " - | - | - |" if "kl" not in r else \
            f" {1e3 * r['kl']:.3f} | {_kl_spread(r)} | {100 * r['top1_equal']:.1f} % |"
        lines.append(f"| {name} | {_fmt_bits(r['effective_bits'])} | {r['ppl']:.3f} | "
                     f"{r['delta_ppl_pct']:+.2f} | {_spread(r)} |{kl} {leading} | {equal} |")
    effects = knob_effects(rows)
    if effects:
        lines += ["", "Each knob with against without (ΔPPL difference in points; per repeat; verdict: lower/higher "
                  "only when every repeat agrees and the difference exceeds half their range):", "",
                  "| bits | knob | how | with (bits) | without (bits) | Δ points | per repeat | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in effects:
            per = ", ".join(f"{x:+.2f}" for x in e["diff_pct_repeats"])
            lines.append(f"| {e['bits']} | {e['knob']} | {e['how']} | {e['with_setting']} ({e['with_bits']:.3f}) | "
                         f"{e['without_setting']} ({e['without_bits']:.3f}) | {e['diff_pct']:+.2f} | {per} | "
                         f"{e['verdict']} |")
    for title, effects, a, b in (
            ("Other group sizes against groups of 64, the rest of the setting equal:", group_effects(rows),
             ("setting", "bits"), ("g64_setting", "g64_bits")),
            ("Mixed precision (a recipe's bit map) against one width everywhere, same tail, sinks and groups:",
             recipe_effects(rows), ("recipe", "recipe_bits"), ("uniform", "uniform_bits"))):
        if not effects:
            continue
        lines += ["", title, "", "| setting (bits) | against (bits) | Δ points | per repeat | verdict |",
                  "|---|---|---|---|---|"]
        for e in effects:
            per = ", ".join(f"{x:+.2f}" for x in e["diff_pct_repeats"])
            lines.append(f"| {e[a[0]]} ({e[a[1]]:.3f}) | {e[b[0]]} ({e[b[1]]:.3f}) | "
                         f"{e['diff_pct']:+.2f} | {per} | {e['verdict']} |")
    pairs = equal_bit_pairs(rows)
    if pairs:
        kl_pairs = all("kl_verdict" in p for p in pairs)
        lines += ["", "nexuskv against quanto at equal effective bits (same code bits, same 128-token tail)"
                  + (", by ΔPPL and by the KL divergence from the dense cache (10⁻³ nats/token):" if kl_pairs else ":"),
                  "", "| quanto | its bits | its ΔPPL % | nexuskv | its bits | its ΔPPL % | nexuskv − quanto (points) "
                  "| verdict |" + (" quanto KL | nexuskv KL | KL per repeat, nexuskv − quanto | KL verdict |"
                                   if kl_pairs else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|" * 4 if kl_pairs else "")]
        for p in pairs:
            kl = "" if not kl_pairs else (f" {1e3 * p['quanto_kl']:.3f} | {1e3 * p['nexuskv_kl']:.3f} | "
                                          + ", ".join(f"{1e3 * x:+.3f}" for x in p["kl_diff_repeats"])
                                          + f" | {p['kl_verdict']} |")
            lines.append(f"| {p['quanto']} | {p['quanto_bits']:.3f} | {p['quanto_delta']:+.2f} | {p['nexuskv']} | "
                         f"{p['nexuskv_bits']:.3f} | {p['nexuskv_delta']:+.2f} | {p['diff_pct']:+.2f} | "
                         f"{p['verdict']} |{kl}")
    for note in (extra or {}).get("skipped", []):
        lines += ["", f"Not measured: {note}"]
    measured = [r for r in rows if "bytes" in r]
    if measured:
        b0 = measured[0]["bytes"]
        every = (extra or {}).get("every_token")
        lines += ["", f"Cache bytes holding the model's K/V of {b0['tokens']} tokens (model in {b0['dtype']}, a "
                  "prefill of all but the last token, then that one as a decode step; every tensor's bytes, "
                  f"allocated capacity included; the dense baseline is {ec.DENSE_BASELINE}, the cache generate() "
                  "makes):", "",
                  "| setting | total bytes | compressed part | full-precision tail (+ signs) | total / dense | "
                  "total / every-token dense | bits/element, all bytes | used bytes (cached tokens only) / dense |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in measured:
            b = r["bytes"]
            name = _dense_name(b, "dtype") if r["kind"] == ec.DENSE else r["name"]
            lines.append(f"| {name} | {b['total']:,} | {b['compressed']:,} | {b['full_precision']:,} | "
                         f"{100 * b['ratio_to_dense']:.1f} % | {100 * b['ratio_to_every_token']:.1f} % | "
                         f"{b['bits_per_element_all']:.2f} | {b['used']:,} ({100 * b['used_ratio_to_dense']:.1f} %) |")
        if every:
            lines.append(f"| dense {every['dtype']}, every token of every layer (DynamicCache()) | "
                         f"{every['total']:,} | 0 | {every['total']:,} | {100 * every['ratio_to_dense']:.1f} % | "
                         f"100.0 % | {every['bits_per_element_all']:.2f} | {every['used']:,} "
                         f"({100 * every['used_ratio_to_dense']:.1f} %) |")
    return "\n".join(lines)


def plot(rows: List[Dict], path: str, title: Optional[str] = None) -> None:
    """ΔPPL against the effective bits of the compressed part, one point per setting
    (bars: the range over repeats)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 6.5))
    for i, r in enumerate(r for r in rows if r["kind"] != ec.DENSE):
        marker = "s" if r["kind"] == ec.QUANTO else ("o" if r["residual"] else "^")
        y = r["delta_ppl_pct"]
        err = [[y - r["delta_ppl_pct_min"]], [r["delta_ppl_pct_max"] - y]] if len(r["repeats"]) > 1 else None
        ax.errorbar(r["effective_bits"]["kv"], y, yerr=err, fmt=marker, label=r["name"], color=plt.cm.tab20(i % 20),
                    capsize=2, lw=0.8)
    ax.set_xlabel("effective bits per element of the compressed part (scales, zeros, outliers included)",
                  fontsize=11)
    ax.set_ylabel("ΔPPL vs dense cache (%, symlog; bars: range over repeats)", fontsize=11)
    ax.set_yscale("symlog", linthresh=1)
    if title:
        ax.set_title(title, fontsize=11)
    ax.tick_params(labelsize=10)
    ax.grid(True, which="major", lw=0.3, alpha=0.6)
    ax.axhline(0, color="gray", lw=0.5)
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def usable_settings(model, settings: List[ec.Setting]) -> tuple:
    """(settings whose cache can be made for this model, notes on the ones that cannot:
    e.g. transformers 5's QuantizedCache refuses sliding-window models)."""
    ok, skipped = [], []
    for s in settings:
        try:
            ec.make_cache(model, s)
        except (ValueError, NotImplementedError) as e:
            skipped.append(f"{s.name}: {str(e).splitlines()[0]}")
            continue
        ok.append(s)
    return ok, skipped


def run(model, segments: List[Sequences], settings: List[ec.Setting], chunk: int,
        agreement_settings: List[ec.Setting], prompt_ids: Optional[torch.Tensor], new_tokens: int,
        bytes_settings: List[ec.Setting], bytes_ids: Optional[torch.Tensor], bytes_dtype: torch.dtype,
        progress: bool = True, extra: Optional[Dict] = None, kl: bool = True) -> List[Dict]:
    """All three measurements; one dict per setting (in `settings` order).  `segments`:
    per repeat, the sequences (windows) of its text; `kl`: score the perplexity rows by
    their KL divergence from the dense cache too.  The byte measurement runs last: it
    converts the model to `bytes_dtype`.  `extra` (a dict) receives the settings that
    could not be made for this model ("skipped") and the every-token dense bytes."""
    extra = {} if extra is None else extra
    if ec.DENSE_SETTING not in settings:
        settings = [ec.DENSE_SETTING] + list(settings)
    settings, extra["skipped"] = usable_settings(model, settings)
    agreement_settings = [s for s in agreement_settings if s in settings]
    bytes_settings = [s for s in bytes_settings if s in settings]
    head_dim = ec.head_dim_of(model.config)
    rows = {s: dict(s.as_dict(), knobs=list(s.knobs) if s.kind == ec.NEXUSKV else [],
                    effective_bits=ec.effective_bits(s, head_dim, model.dtype),
                    model_dtype=str(model.dtype).replace("torch.", "")) for s in settings}
    for s, r in measure_perplexity(model, segments, chunk, settings, progress, kl).items():
        rows[s].update(r)
    if agreement_settings and prompt_ids is not None:
        for s, r in measure_agreement(model, prompt_ids, new_tokens, agreement_settings, progress).items():
            rows[s]["greedy"] = r
    if bytes_settings and bytes_ids is not None:
        model.to(bytes_dtype)
        measured = measure_bytes(model, bytes_ids, bytes_settings, progress=progress)
        extra["every_token"] = measured.pop("every_token")
        for s, r in measured.items():
            rows[s]["bytes"] = r
            r["effective_bits"] = ec.effective_bits(s, head_dim, bytes_dtype)
    return [rows[s] for s in settings]


# The quality targets of issue 21, by effective bits (every scale and zero counted): the best
# nexuskv row on a 128-token tail at or under each budget, any bit map or knob.
QUALITY_TARGETS = ((4.6, 0.5, "4-bit class"), (3.25, 0.75, "3-bit class"), (2.6, 3.0, "2-bit class"))


def _kl_clause(ours: Optional[float], theirs: Optional[float], verdict: Optional[str]) -> str:
    """"; KL from dense ... : nexuskv <verdict>" for a printed comparison, "" without a KL verdict."""
    if verdict is None:
        return ""
    return f"; KL from dense {1e3 * ours:.3f} vs {1e3 * theirs:.3f} 10⁻³ nats/token: nexuskv {verdict}"


def targets(rows: List[Dict]) -> List[str]:
    """The design's targets, read off the measured rows (best row of each kind), both
    sides' effective bits beside every comparison."""
    def best(pred):
        cands = [r for r in rows if pred(r)]
        return min(cands, key=lambda r: r["delta_ppl_pct"]) if cands else None

    def spread(r):
        return "" if len(r["repeats"]) < 2 else f" [{r['delta_ppl_pct_min']:+.2f} .. {r['delta_ppl_pct_max']:+.2f}]"

    out = []
    for budget, target, what in QUALITY_TARGETS:
        row = best(lambda r: r["kind"] == ec.NEXUSKV and r["residual"] == 128 and r.get("window_residual") is None
                   and r["effective_bits"]["kv"] <= budget + 1e-9)
        if row:
            out.append(f"{what}, 128-token tail, <= {budget} effective bits: best ΔPPL {row['delta_ppl_pct']:+.2f} %"
                       f"{spread(row)} ({row['name']}, {row['effective_bits']['kv']:.3f} bits); target <= {target} %: "
                       f"{'met' if row['delta_ppl_pct'] <= target else 'NOT met'}")
    for p in equal_bit_pairs(rows):
        out.append(f"equal bits: {p['nexuskv']} ({p['nexuskv_bits']:.3f} bits) ΔPPL {p['nexuskv_delta']:+.2f} % vs "
                   f"{p['quanto']} ({p['quanto_bits']:.3f} bits) {p['quanto_delta']:+.2f} %: nexuskv {p['verdict']}"
                   + _kl_clause(p.get("nexuskv_kl"), p.get("quanto_kl"), p.get("kl_verdict")))
    for r in rows:
        if r["kind"] != ec.QUANTO:
            continue
        ours = best(lambda x: x["kind"] == ec.NEXUSKV and x["bits"] == r["bits"] and x["residual"] == r["residual"]
                    and x.get("window_residual") is None and x["effective_bits"]["kv"] <= r["effective_bits"]["kv"])
        if ours:
            v, k = paired_verdict(ours, r)["verdict"], kl_verdict(ours, r)
            out.append(f"best nexuskv at <= quanto's bits: {ours['name']} ({ours['effective_bits']['kv']:.3f} bits) "
                       f"{ours['delta_ppl_pct']:+.2f} % vs {r['name']} ({r['effective_bits']['kv']:.3f} bits) "
                       f"{r['delta_ppl_pct']:+.2f} %: nexuskv {v}"
                       + _kl_clause(ours.get("kl"), r.get("kl"), k.get("kl_verdict")))
    for r in rows:
        b = r.get("bytes")
        if r["kind"] == ec.NEXUSKV and r["bits"] == 4 and b:
            out.append(f"bytes at {b['tokens']} tokens, {r['name']}: {100 * b['ratio_to_dense']:.1f} % of the dense "
                       f"{b['dtype']} {ec.DENSE_BASELINE} allocated, {100 * b['used_ratio_to_dense']:.1f} % used "
                       f"(cached tokens only); target <= 30 %: {'met' if b['ratio_to_dense'] <= 0.30 else 'NOT met'}")
    n = noise_summary(rows)
    if n:
        out.append(f"noise: ΔPPL spread over {n['repeats']} repeats (max - min): median {n['median_pct']:.2f} points, "
                   f"largest {n['max_pct']:.2f} ({n['max_setting']})")
    return out


def _ints(text: str, what: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"eval: {what} must be comma-separated integers, got {text!r}") from None


def default_variants(text: str) -> List[ec.Setting]:
    """--default-variants: ';'-separated variants of a default cache row, each comma-separated
    FIELD=INT of ec.Setting (bits, group_size, value_group_size, residual, window_residual, sinks,
    key_outliers, value_outliers; fit_range and value_fit_range as 0 / 1), applied to
    ec.default_cache(bits) (the row cache_for(model, bits=...) makes with nothing else given)."""
    ints = ("bits", "group_size", "value_group_size", "residual", "window_residual", "sinks", "key_outliers",
            "value_outliers")
    flags = ("fit_range", "value_fit_range")
    rows = []
    for item in (x.strip() for x in text.split(";")):
        if not item:
            continue
        fields = {}
        for pair in item.split(","):
            name, _, value = (x.strip() for x in pair.partition("="))
            if name not in ints + flags or not value.isdigit() or (name in flags and value not in ("0", "1")):
                raise SystemExit(f"eval: --default-variants: {pair.strip()!r} must be FIELD=INT with FIELD among "
                                 f"{', '.join(ints + flags)} (the last two 0 or 1)")
            fields[name] = bool(int(value)) if name in flags else int(value)
        if fields.get("bits", 4) not in (2, 3, 4, 8):
            raise SystemExit(f"eval: --default-variants: bits must be 2, 3, 4 or 8, got {fields['bits']}")
        rows.append(dataclasses.replace(ec.default_cache(fields.get("bits", 4)), **fields))
    return rows


def settings_from_args(args, sixteen_bit_model: bool = False) -> List[ec.Setting]:
    """The grid the flags ask for.  On a 16-bit model quanto's scales are 16-bit already
    and nexuskv's metadata is the model's dtype, so the equal-bit variants coincide
    with the plain rows and are left out."""
    equal = not args.no_equal_bits and not sixteen_bit_model
    recipes = [ec.from_recipe(path) for path in args.recipes.split(",") if path]
    if args.default_cache:
        recipes[:0] = [ec.default_cache(4), ec.default_cache(2)]
    recipes += default_variants(args.default_variants)
    if args.fit_recipes:  # each recipe's map with fitted key ranges too (and without, whichever it has)
        recipes += [dataclasses.replace(r, fit_range=not r.fit_range) for r in recipes]
    if args.window_tails:  # each recipe's map also with these tails on the sliding-window layers
        recipes += [dataclasses.replace(r, window_residual=w) for w in _ints(args.window_tails, "--window-tails")
                    for r in recipes if r.recipe]
    if args.quick:
        return ec.grid(bits=(4,), tails=(0,), ablation_bits=(), best_2bit=False,
                       quanto_bits=() if args.no_quanto else (4,), equal_bits=equal) + recipes
    return ec.grid(bits=_ints(args.bits, "--bits"), tails=_ints(args.tails, "--tails"),
                   window_tails=_ints(args.window_tails, "--window-tails") if args.window_tails else (),
                   base_knobs=[k for k in args.base_knobs.split(",") if k],
                   ablation_bits=_ints(args.ablation_bits, "--ablation-bits"),
                   ablations=[a for a in args.ablations.split(",") if a],
                   combinations=[c for c in args.combinations.split(",") if c],
                   group_sizes=_ints(args.group_sizes, "--group-sizes"),
                   best_2bit=not args.no_best_2bit, quanto_bits=() if args.no_quanto else
                   _ints(args.quanto_bits, "--quanto-bits"), equal_bits=equal) + recipes


def main(args) -> int:
    from . import hf
    from .models import DEFAULT_TEXT, as_sequence, load_model, load_text, model_name, sequence_prefix, text_tokens

    torch.manual_seed(0)
    load_at_start = os.getloadavg()  # the machine is shared: the load goes beside the numbers
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    print(f"loading {model_name(args.model)} ({args.dtype}) ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model(getattr(torch, args.dtype), attn_implementation=hf.ATTN_IMPLEMENTATION,
                                  path=args.model)
    settings = settings_from_args(args, model.dtype in (torch.float16, torch.bfloat16))
    agree = [] if args.no_greedy else ec.parse_settings(args.greedy_settings, settings)
    nbytes = [] if args.no_bytes else ec.parse_settings(args.bytes_settings, settings)
    prefix = sequence_prefix(tokenizer)
    text = load_text(args.text)
    # Perplexity on `repeats` consecutive segments of `tokens` text tokens; the greedy
    # prompt is the real text that follows them; the bytes use the first tokens.
    body_len = repeats * args.tokens + (args.prompt_tokens if agree else 0)
    body = text_tokens(tokenizer, text, max(body_len, args.bytes_tokens if nbytes else 0))
    segments = [windows(body[:, r * args.tokens:(r + 1) * args.tokens], prefix, args.window) for r in range(repeats)]
    prompt = as_sequence(prefix, body[:, repeats * args.tokens:repeats * args.tokens + args.prompt_tokens]) \
        if agree else None
    bytes_ids = as_sequence(prefix, body[:, :args.bytes_tokens - len(prefix)]) if nbytes else None
    extra: Dict = {}
    facts = ec.model_facts(model)
    rows = run(model, segments, settings, args.chunk, agree, prompt, args.new_tokens, nbytes, bytes_ids,
               getattr(torch, args.bytes_dtype), progress=not args.no_progress, extra=extra, kl=not args.no_kl)
    table = markdown(rows, extra)
    verdicts = targets(rows)
    header = (f"model: {model_name(args.model)} ({facts['model_type']}, {facts['layers']} layers, sliding-window "
              f"layers {facts['sliding_window_layers'] or 'none'}); dense baseline: {ec.DENSE_BASELINE}; every "
              f"window starts with the tokenizer's sequence prefix {prefix} "
              f"({tokenizer.convert_ids_to_tokens(prefix) if prefix else 'none'}); {repeats} repeat(s) of "
              f"{args.tokens} text tokens (windows of {args.window}, chunks of {args.chunk})")
    print(header)
    print(table)
    print("\n".join("- " + v for v in verdicts))
    doc = {"model": model_name(args.model), "model_path": args.model, "model_facts": facts, "dtype": args.dtype,
           "text": args.text or DEFAULT_TEXT,
           "tokens": args.tokens, "repeats": repeats, "segment_offsets": [r * args.tokens for r in range(repeats)],
           "sequence_prefix": prefix, "window": args.window, "chunk": args.chunk,
           "greedy_prompt_tokens": args.prompt_tokens, "greedy_new_tokens": args.new_tokens,
           "bytes_tokens": args.bytes_tokens, "bytes_dtype": args.bytes_dtype, "dense_baseline": ec.DENSE_BASELINE,
           "date": datetime.date.today().isoformat(), "machine": platform.platform(), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "load_average_at_start": load_at_start,
           "load_average_at_end": os.getloadavg(),
           "skipped": extra["skipped"], "every_token_dense_bytes": extra.get("every_token"),
           "knob_effects": knob_effects(rows), "group_effects": group_effects(rows),
           "recipe_effects": recipe_effects(rows),
           "equal_bits": equal_bit_pairs(rows), "noise": noise_summary(rows),
           "targets": verdicts, "rows": rows}
    for path, write in ((args.json, lambda p: json.dump(doc, open(p, "w"), indent=1)),
                        (args.markdown, lambda p: open(p, "w").write(header + "\n\n" + table + "\n\n" + "\n".join(
                            "- " + v for v in verdicts) + "\n")),
                        (args.png, lambda p: plot(rows, p, title=model_name(args.model)))):
        if path:
            write(path)
            print(f"wrote {path}")
    return 0


def add_arguments(p, text_default: Optional[str] = None) -> None:
    from .__main__ import positive

    p.add_argument("--text", default=text_default, help="text file (plain or .gz); default: Debian reference manual")
    p.add_argument("--tokens", type=positive("--tokens", 2), default=1024,
                   help="text tokens for perplexity per repeat")
    p.add_argument("--repeats", type=positive("--repeats"), default=None,
                   help="disjoint text segments of --tokens each (and rotation seeds) to measure the spread over "
                        "(None: 3, or 1 with --quick)")
    p.add_argument("--window", type=positive("--window", 2), default=1024,
                   help="perplexity window: tokens per independent sequence, the tokenizer's BOS included")
    p.add_argument("--chunk", type=positive("--chunk"), default=64,
                   help="tokens per forward after the first (each query sees what decoding token by token "
                        "shows it: nexuskv.hf, held appends; the first forward attends over its own K/V)")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"],
                   help="model dtype for perplexity and greedy agreement")
    p.add_argument("--bits", default="8,4,3,2", help="bit widths of the base nexuskv rows")
    p.add_argument("--tails", default="0,128", help="full-precision tails of the base nexuskv rows")
    p.add_argument("--window-tails", default="",
                   help="also each base row and each recipe row with these tails on the sliding-window layers "
                        "(default: none)")
    p.add_argument("--base-knobs", default="",
                   help="comma-separated knobs (as --ablations) switched on in every base row (default: none)")
    p.add_argument("--ablation-bits", default="4,2", help="bit widths at which the knobs are switched on")
    p.add_argument("--group-sizes", default="64",
                   help="group sizes of the base and ablation nexuskv rows (key groups of that many tokens, value "
                        "groups of that many channels, at most one per head_dim: fewer scale and zero bits)")
    # DGQ is not a default knob: in this chunked evaluation every append compresses one group,
    # which leaves it no boundary to choose (it measured identical to fixed groups, RESULTS.md).
    p.add_argument("--ablations", default="outliers,rotate,sinks,fit", help="knobs: outliers, rotate, dgq, sinks, fit")
    p.add_argument("--combinations", default=",".join(ec.COMBINATIONS),
                   help="knob rows: alone (each knob), all (every knob), leave-one-out (all but each)")
    p.add_argument("--default-cache", action="store_true",
                   help="also the rows of cache_for(model) and cache_for(model, bits=2) with no other settings "
                        "(4-bit: groups of 64, 4 sinks and a 60-token tail on full-attention layers, no tail on "
                        "sliding ones; 2-bit: groups of 128, 4 sinks and a 128-token tail on every layer; fitted "
                        "key ranges)")
    p.add_argument("--default-variants", default="",
                   help="';'-separated variants of the default rows, each comma-separated FIELD=INT, e.g. "
                        "'value_group_size=128,value_outliers=1;bits=3' (fields of eval_caches.Setting; the base is "
                        "the row cache_for(model, bits=B) makes, B = the variant's bits, 4 if none)")
    p.add_argument("--no-best-2bit", action="store_true",
                   help="leave out the recommended 2-bit setting (eval_caches.RECOMMENDED_2BIT)")
    p.add_argument("--recipes", default="",
                   help="comma-separated recipe files with a bit map (calibrate --bits-budget): one row each, with "
                   "the groups, tail and sinks it was allocated for")
    p.add_argument("--fit-recipes", action="store_true",
                   help="each recipe row also with fitted key ranges flipped (on for a recipe made without them)")
    p.add_argument("--no-kl", action="store_true",
                   help="no KL divergence from the dense cache (it holds the dense row's logits: "
                        "4 bytes x vocabulary x tokens x repeats)")
    p.add_argument("--quanto-bits", default="4,2", help="transformers QuantizedCache (optimum-quanto) rows")
    p.add_argument("--no-quanto", action="store_true", help="leave out the quanto rows")
    p.add_argument("--no-equal-bits", action="store_true",
                   help="leave out quanto with 16-bit scales and nexuskv with metadata in the model's dtype")
    p.add_argument("--quick", action="store_true",
                   help="dense, 4-bit with no tail, quanto 4-bit and its equal-bit partners; one repeat")
    p.add_argument("--new-tokens", type=positive("--new-tokens"), default=256,
                   help="greedy tokens generated per setting")
    p.add_argument("--prompt-tokens", type=positive("--prompt-tokens"), default=512,
                   help="tokens of real text in the greedy prompt (after the tokenizer's BOS)")
    p.add_argument("--greedy-settings", default="all",
                   help="comma-separated substrings of the setting names to run greedy generation for")
    p.add_argument("--no-greedy", action="store_true", help="no greedy agreement rows")
    p.add_argument("--bytes-tokens", type=positive("--bytes-tokens", 2), default=4096,
                   help="tokens the caches hold when bytes are measured")
    p.add_argument("--bytes-dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="model dtype for the byte measurement (the dense reference is a cache of this dtype)")
    p.add_argument("--bytes-settings", default="all", help="comma-separated substrings of the setting names")
    p.add_argument("--no-bytes", action="store_true", help="no byte measurement")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (per row, with an estimate)")
    p.add_argument("--json", default=None, help="write the rows as JSON to this path")
    p.add_argument("--markdown", default=None, help="write the table as markdown to this path")
    p.add_argument("--png", default=None, help="write the plot (ΔPPL vs effective bits) to this path")
