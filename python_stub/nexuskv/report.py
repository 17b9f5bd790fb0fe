"""`python -m nexuskv report`: how NQ settings compress a real model's KV cache.

Captures every layer's K and V (and Q) of the model (SmolLM2-135M-Instruct by
default) on real text, as its own attention sees them (nexuskv.models.capture_qkv:
the model's masks, sliding windows included), compresses them at each setting and
measures effective bits (every byte counted), the compression ratio against the
model's dtype, the relative reconstruction error of K and V, and the relative error
of each layer's attention output computed from the reconstructed K/V (float64,
causal, within the layer's sliding window, soft-capped where the model caps, GQA)."""

from __future__ import annotations

import datetime
import json
import math
import platform
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from .compressors import DGQ, NQ
from .models import LayerQKV


@dataclass(frozen=True)
class Setting:
    keys: object  # NQ or DGQ
    values: NQ

    @property
    def name(self) -> str:
        return f"K {self.keys.describe()} | V {self.values.describe()}"


def default_settings(group_size: int = 64, num_outliers: int = 1,
                     bits: Sequence[int] = (8, 4, 3, 2)) -> List[Setting]:
    """bits x (no outliers, k outliers) x keys per channel / per token, values per token;
    then at 4 and 2 bits: DGQ keys (dynamic groups, equal group count), and the
    Hadamard-rotated variants of per-channel and per-token keys."""
    out = []
    for b in bits:
        for k in (0, num_outliers):
            for key_per in ("channel", "token"):
                out.append(Setting(NQ(b, group_size, key_per, k), NQ(b, group_size, "token", k)))
    for b in (4, 2):
        if b not in bits:
            continue
        values = NQ(b, group_size, "token")
        out.append(Setting(DGQ(b, group_size), values))
        out.append(Setting(NQ(b, group_size, "channel", rotate=True), NQ(b, group_size, "token", rotate=True)))
        out.append(Setting(NQ(b, group_size, "token", rotate=True), NQ(b, group_size, "token", rotate=True)))
    return out


def attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, num_queries: int,
                  window: Optional[int] = None, softcap: Optional[float] = None):
    """Causal softmax attention of the last num_queries queries over all T keys,
    in float64; with a sliding `window`, query i sees keys j with i - W < j <= i (as
    transformers' sliding-window masks), and scores are soft-capped (softcap·tanh(s/softcap))
    when `softcap` is given.  q [B, Hq, T, D]; k, v [B, Hkv, T, D] with Hq a multiple of Hkv."""
    T = k.shape[-2]
    q = q[..., T - num_queries:, :].double()
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scaling  # [B, Hq, nq, T]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos_q = torch.arange(T - num_queries, T).unsqueeze(1)
    pos_k = torch.arange(T).unsqueeze(0)
    hidden = pos_k > pos_q
    if window is not None:
        hidden |= pos_k <= pos_q - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def evaluate_setting(layers: List[LayerQKV], setting: Setting, num_queries: int) -> Dict:
    k_bytes = v_bytes = numel = 0
    k_num = k_den = v_num = v_den = 0.0
    attn_errs = []
    for layer in layers:
        ck, cv = setting.keys.compress(layer.k), setting.values.compress(layer.v)
        k_hat, v_hat = setting.keys.decompress(ck), setting.values.decompress(cv)
        k_bytes += setting.keys.nbytes(ck)
        v_bytes += setting.values.nbytes(cv)
        numel += layer.k.numel()
        k_num += float((k_hat.double() - layer.k.double()).norm() ** 2)
        k_den += float(layer.k.double().norm() ** 2)
        v_num += float((v_hat.double() - layer.v.double()).norm() ** 2)
        v_den += float(layer.v.double().norm() ** 2)
        window, softcap = getattr(layer, "window", None), getattr(layer, "softcap", None)
        ref = attention_f64(layer.q, layer.k, layer.v, layer.scaling, num_queries, window, softcap)
        attn_errs.append(rel_err(attention_f64(layer.q, k_hat, v_hat, layer.scaling, num_queries, window, softcap),
                                 ref))
    elem_bits = torch.finfo(layers[0].k.dtype).bits
    kv_bits = 8.0 * (k_bytes + v_bytes) / (2 * numel)
    return {
        "setting": setting.name,
        "key_bits": setting.keys.bits, "key_per": getattr(setting.keys, "per", "channel"),
        "key_dgq": isinstance(setting.keys, DGQ), "rotated": setting.values.rotate,
        "value_bits": setting.values.bits,
        "group_size": setting.keys.group_size, "num_outliers": setting.keys.num_outliers,
        "k_effective_bits": 8.0 * k_bytes / numel, "v_effective_bits": 8.0 * v_bytes / numel,
        "kv_effective_bits": kv_bits, "ratio_vs_model_dtype": elem_bits / kv_bits,
        "k_rel_err": math.sqrt(k_num / k_den), "v_rel_err": math.sqrt(v_num / v_den),
        "attn_rel_err_mean": sum(attn_errs) / len(attn_errs), "attn_rel_err_max": max(attn_errs),
        "attn_rel_err_per_layer": attn_errs,
    }


def key_grouping_verdict(rows: List[Dict], bits: int) -> Optional[Dict]:
    """Per-channel vs per-token keys at `bits`, no outliers: which gives the lower
    mean attention-output error."""
    pick = {r["key_per"]: r for r in rows
            if r["key_bits"] == bits and r["num_outliers"] == 0 and not r["key_dgq"] and not r["rotated"]}
    if set(pick) != {"channel", "token"}:
        return None
    errs = {per: pick[per]["attn_rel_err_mean"] for per in pick}
    return {"bits": bits, "attn_rel_err_mean": errs, "better": min(errs, key=errs.get)}


def variant_verdicts(rows: List[Dict], bits: int) -> Dict:
    """At `bits`, no outliers: DGQ keys vs fixed per-channel groups, and rotation vs none
    (for per-channel and per-token keys), by mean attention-output error and bits."""
    def find(**want):
        for r in rows:
            if r["key_bits"] == bits and r["num_outliers"] == 0 and all(r[k] == v for k, v in want.items()):
                return r
        return None

    out = {"bits": bits}
    fixed = find(key_per="channel", key_dgq=False, rotated=False)
    pairs = {"dgq_vs_fixed_keys": (find(key_dgq=True, rotated=False), fixed),
             "rotation_per_channel_keys": (find(key_per="channel", key_dgq=False, rotated=True), fixed),
             "rotation_per_token_keys": (find(key_per="token", key_dgq=False, rotated=True),
                                         find(key_per="token", key_dgq=False, rotated=False))}
    for name, (a, b) in pairs.items():
        if a and b:
            out[name] = {"with": {"attn": a["attn_rel_err_mean"], "k": a["k_rel_err"], "bits": a["kv_effective_bits"]},
                         "without": {"attn": b["attn_rel_err_mean"], "k": b["k_rel_err"],
                                     "bits": b["kv_effective_bits"]}}
    return out


def format_table(rows: List[Dict], dtype_name: str) -> str:
    head = (f"{'setting':<56} {'K bits':>7} {'V bits':>7} {'KV bits':>8} {'x vs ' + dtype_name:>11} "
            f"{'K relerr':>9} {'V relerr':>9} {'attn mean':>10} {'attn max':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['setting']:<56} {r['k_effective_bits']:>7.3f} {r['v_effective_bits']:>7.3f} "
                     f"{r['kv_effective_bits']:>8.3f} {r['ratio_vs_model_dtype']:>10.2f}x "
                     f"{r['k_rel_err']:>9.4f} {r['v_rel_err']:>9.4f} {r['attn_rel_err_mean']:>10.4f} "
                     f"{r['attn_rel_err_max']:>9.4f}")
    return "\n".join(lines)


def run(layers: List[LayerQKV], settings: List[Setting], num_queries: int, progress: bool = True) -> List[Dict]:
    from tqdm import tqdm

    rows = []
    with torch.inference_mode():
        for s in tqdm(settings, desc="compressing", unit="setting", disable=not progress):
            rows.append(evaluate_setting(layers, s, num_queries))
    return rows


def main(args) -> int:
    from .models import capture_qkv, load_model, load_text, model_name, tokenize

    dtype = getattr(torch, args.dtype)
    print(f"loading {model_name(args.model)} ({args.dtype}) and text ...", flush=True)
    model, tokenizer = load_model(dtype, path=args.model)
    ids = tokenize(tokenizer, load_text(args.text), args.tokens)  # BOS first where the tokenizer adds one
    layers = capture_qkv(model, ids)
    k0 = layers[0].k
    print(f"captured {len(layers)} layers, K/V [batch, kv_heads, tokens, head_dim] = {list(k0.shape)}, "
          f"{model.config.num_attention_heads} query heads", flush=True)
    rows = run(layers, default_settings(args.group_size, args.outliers), args.queries)
    print()
    print(format_table(rows, args.dtype))
    print(f"\nerrors: relative Frobenius error over all layers (K, V); attention = relative error of each "
          f"layer's output for the last {args.queries} queries (float64, causal), mean / max over layers")
    verdicts = [v for v in (key_grouping_verdict(rows, b) for b in (4, 2)) if v]
    for v in verdicts:
        e = v["attn_rel_err_mean"]
        print(f"keys at {v['bits']}-bit: per-channel {e['channel']:.4f} vs per-token {e['token']:.4f} "
              f"attention error -> per-{v['better']} is better")
    variants = [variant_verdicts(rows, b) for b in (4, 2)]
    labels = {"dgq_vs_fixed_keys": "DGQ keys vs fixed per-channel groups",
              "rotation_per_channel_keys": "Hadamard rotation, per-channel keys",
              "rotation_per_token_keys": "Hadamard rotation, per-token keys"}
    for v in variants:
        for name, label in labels.items():
            if name in v:
                w, wo = v[name]["with"], v[name]["without"]
                print(f"{v['bits']}-bit {label}: attention error {w['attn']:.4f} ({w['bits']:.3f} bits) with vs "
                      f"{wo['attn']:.4f} ({wo['bits']:.3f} bits) without")
    if args.json:
        from .eval_caches import model_facts

        doc = {"model": model_name(args.model), "model_facts": model_facts(model), "dtype": args.dtype,
               "text": args.text or "debian-reference-en", "tokens": args.tokens, "queries": args.queries,
               "date": datetime.date.today().isoformat(), "machine": platform.platform(),
               "torch": torch.__version__, "rows": rows, "key_grouping": verdicts, "variants": variants}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0
