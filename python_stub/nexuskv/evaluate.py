"""`python -m nexuskv eval`: the real model with its KV cache compressed, against
the dense cache, on the same tokens.  Three measurements per cache setting
(settings: nexuskv.eval_caches):

1. Perplexity.  Every window of text is fed in chunks (at most 64 tokens); the
   queries of a chunk attend to the compressed past plus their own chunk: through
   attn_implementation="nexuskv" (fused attention over the compressed cache) for
   nexuskv, through the model's SDPA over transformers' DynamicCache (dense) or
   QuantizedCache (optimum-quanto, which returns dequantized K/V) otherwise.
2. Greedy agreement: new tokens generated from a prompt of real text with the
   dense cache and with the compressed one; leading equal tokens and the fraction
   of equal positions.
3. Bytes: every cache filled with the model's own K/V of the same tokens, the
   model in a 16-bit dtype (so the dense reference is a 16-bit cache); every
   tensor's bytes, compressed part and full-precision tail separately."""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys
from typing import Dict, List, Optional

import torch

from . import eval_caches as ec
from .generation import agreement, greedy
from .hf_compat import cache_argument


def window_nll(model, ids: torch.Tensor, chunk: int, cache) -> torch.Tensor:
    """Negative log-likelihoods [n-1] of ids[1:] given the prefix, fed chunk by chunk."""
    nll, prev_logits = [], None
    cache_kw = {cache_argument(model): cache}
    with torch.inference_mode():
        for s in range(0, ids.shape[1], chunk):
            piece = ids[:, s:s + chunk]
            logits = model(piece, **cache_kw, use_cache=True).logits.float()
            if prev_logits is not None:  # the previous chunk's last position predicts this chunk's first token
                logits = torch.cat([prev_logits, logits], 1)
                targets = ids[:, s:s + piece.shape[1]]
            else:
                targets = piece[:, 1:]
            pred = logits[:, :targets.shape[1]]
            nll.append(torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), targets.reshape(-1),
                                                         reduction="none"))
            prev_logits = logits[:, -1:]
    return torch.cat(nll)


def perplexity(model, ids: torch.Tensor, window: int, chunk: int, make_cache) -> Dict:
    """Perplexity over windows of `window` tokens, each with a fresh cache."""
    nll = [window_nll(model, ids[:, w0:w0 + window], chunk, make_cache()) for w0 in range(0, ids.shape[1] - 1, window)]
    nll = torch.cat(nll)
    return {"ppl": math.exp(float(nll.mean())), "tokens": int(nll.numel())}


def measure_perplexity(model, ids, window: int, chunk: int, settings: List[ec.Setting],
                       progress: bool = True) -> Dict[ec.Setting, Dict]:
    from tqdm import tqdm

    out = {}
    bar = tqdm(settings, desc="perplexity", unit="row", disable=not progress)
    for s in bar:
        bar.set_postfix_str(s.name)  # the row being measured; tqdm's estimate covers the rows left
        with ec.attention_for(model, s):
            out[s] = perplexity(model, ids, window, chunk, lambda s=s: ec.make_cache(model, s))
    base = out[ec.DENSE_SETTING]["ppl"]
    for r in out.values():
        r["delta_ppl_pct"] = 100 * (r["ppl"] - base) / base
    return out


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


def measure_bytes(model, ids: torch.Tensor, settings: List[ec.Setting],
                  progress: bool = True) -> Dict[ec.Setting, Dict]:
    """Bytes each cache holds once filled with the model's own K/V of ids (the model in
    its 16-bit dtype, every layer's K/V handed to the cache in one update, as a
    prefill would); ratios against the dense cache of the same dtype and tokens."""
    from tqdm import tqdm

    from .models import capture_qkv

    if model.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"measure_bytes: the model must be 16-bit so that the dense reference is a 16-bit "
                         f"cache, got {model.dtype}")
    layers = capture_qkv(model, ids)
    out = {}
    for s in tqdm([ec.DENSE_SETTING] + [s for s in settings if s != ec.DENSE_SETTING], desc="cache bytes",
                  unit="setting", disable=not progress):
        cache = ec.make_cache(model, s, direct=True)
        with torch.inference_mode():
            for i, layer in enumerate(layers):
                cache.update(layer.k, layer.v, i)
        out[s] = ec.cache_bytes(cache)
    dense = out[ec.DENSE_SETTING]["total"]
    elements = ids.shape[1] * ec.kv_elements_per_token(model.config)
    for r in out.values():
        r["ratio_to_dense"] = r["total"] / dense
        r["bits_per_element_all"] = 8 * r["total"] / elements
        r["tokens"] = int(ids.shape[1])
        r["dtype"] = str(model.dtype).replace("torch.", "")
    return out


def _fmt_bits(b: Dict) -> str:
    return f"{b['kv']:.3f}" if b["keys"] == b["values"] else f"{b['kv']:.3f} (K {b['keys']:.3f}, V {b['values']:.3f})"


def markdown(rows: List[Dict]) -> str:
    """The main table (one row per setting) and, when measured, the bytes table."""
    lines = ["| setting | eff. bits (compressed part) | perplexity | ΔPPL % | greedy: leading equal | greedy: "
             "equal positions |", "|---|---|---|---|---|---|"]
    for r in rows:
        g = r.get("greedy")
        leading = f"{g['leading']}/{g['new_tokens']}" if g else "-"
        equal = f"{100 * g['match']:.1f} %" if g else "-"
        name = f"dense {r['model_dtype']} (DynamicCache)" if r["kind"] == ec.DENSE else r["name"]
        lines.append(f"| {name} | {_fmt_bits(r['effective_bits'])} | {r['ppl']:.3f} | "
                     f"{r['delta_ppl_pct']:+.2f} | {leading} | {equal} |")
    measured = [r for r in rows if "bytes" in r]
    if measured:
        b0 = measured[0]["bytes"]
        lines += ["", f"Cache bytes holding the model's K/V of {b0['tokens']} tokens (model in {b0['dtype']}, one "
                  "update per layer as in a prefill; every tensor's bytes, allocated capacity included):", "",
                  "| setting | total bytes | compressed part | full-precision tail (+ signs) | total / dense | "
                  "bits/element, all bytes |", "|---|---|---|---|---|---|"]
        for r in measured:
            b = r["bytes"]
            name = f"dense {b['dtype']} (DynamicCache)" if r["kind"] == ec.DENSE else r["name"]
            lines.append(f"| {name} | {b['total']:,} | {b['compressed']:,} | {b['full_precision']:,} | "
                         f"{100 * b['ratio_to_dense']:.1f} % | {b['bits_per_element_all']:.2f} |")
    return "\n".join(lines)


def plot(rows: List[Dict], path: str) -> None:
    """ΔPPL against the effective bits of the compressed part, one point per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    for i, r in enumerate(r for r in rows if r["kind"] != ec.DENSE):
        marker = "s" if r["kind"] == ec.QUANTO else ("o" if r["residual"] else "^")
        ax.scatter(r["effective_bits"]["kv"], r["delta_ppl_pct"], marker=marker, label=r["name"],
                   color=plt.cm.tab20(i % 20))
    ax.set_xlabel("effective bits per element of the compressed part (scales, zeros, outliers included)",
                  fontsize=11)
    ax.set_ylabel("ΔPPL vs dense cache (%, symlog)", fontsize=11)
    ax.set_yscale("symlog", linthresh=1)
    ax.tick_params(labelsize=10)
    ax.grid(True, which="major", lw=0.3, alpha=0.6)
    ax.axhline(0, color="gray", lw=0.5)
    ax.legend(fontsize=8, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def run(model, ids: torch.Tensor, settings: List[ec.Setting], window: int, chunk: int,
        agreement_settings: List[ec.Setting], prompt_ids: Optional[torch.Tensor], new_tokens: int,
        bytes_settings: List[ec.Setting], bytes_ids: Optional[torch.Tensor], bytes_dtype: torch.dtype,
        progress: bool = True) -> List[Dict]:
    """All three measurements; one dict per setting (in `settings` order).  The byte
    measurement runs last: it converts the model to `bytes_dtype`."""
    if ec.DENSE_SETTING not in settings:
        settings = [ec.DENSE_SETTING] + list(settings)
    head_dim = ec.head_dim_of(model.config)
    rows = {s: dict(s.as_dict(), effective_bits=ec.effective_bits(s, head_dim, model.dtype),
                    model_dtype=str(model.dtype).replace("torch.", "")) for s in settings}
    for s, r in measure_perplexity(model, ids, window, chunk, settings, progress).items():
        rows[s].update(r)
    if agreement_settings and prompt_ids is not None:
        for s, r in measure_agreement(model, prompt_ids, new_tokens, agreement_settings, progress).items():
            rows[s]["greedy"] = r
    if bytes_settings and bytes_ids is not None:
        model.to(bytes_dtype)
        for s, r in measure_bytes(model, bytes_ids, bytes_settings, progress=progress).items():
            rows[s]["bytes"] = r
            r["effective_bits"] = ec.effective_bits(s, head_dim, bytes_dtype)
    return [rows[s] for s in settings]


def targets(rows: List[Dict]) -> List[str]:
    """The issue's targets, read off the measured rows (best row of each kind)."""
    def best(pred):
        cands = [r for r in rows if pred(r)]
        return min(cands, key=lambda r: r["delta_ppl_pct"]) if cands else None

    out = []
    four = best(lambda r: r["kind"] == ec.NEXUSKV and r["bits"] == 4 and r["effective_bits"]["kv"] <= 4.6)
    if four:
        out.append(f"4-bit, <= 4.6 effective bits: best ΔPPL {four['delta_ppl_pct']:+.2f} % ({four['name']}, "
                   f"{four['effective_bits']['kv']:.3f} bits); target <= 0.5 %: "
                   f"{'met' if four['delta_ppl_pct'] <= 0.5 else 'NOT met'}")
    two = best(lambda r: r["kind"] == ec.NEXUSKV and r["bits"] == 2 and r["residual"] == 128
               and r["effective_bits"]["kv"] <= 2.6)
    if two:
        out.append(f"2-bit, 128-token tail, <= 2.6 effective bits: best ΔPPL {two['delta_ppl_pct']:+.2f} % "
                   f"({two['name']}, {two['effective_bits']['kv']:.3f} bits); target <= 5 %: "
                   f"{'met' if two['delta_ppl_pct'] <= 5 else 'NOT met'}")
    for r in rows:
        if r["kind"] != ec.QUANTO:
            continue
        ours = best(lambda x: x["kind"] == ec.NEXUSKV and x["bits"] == r["bits"] and x["residual"] == r["residual"]
                    and x["effective_bits"]["kv"] <= r["effective_bits"]["kv"])
        if ours:
            out.append(f"{r['bits']}-bit vs quanto ({r['effective_bits']['kv']:.3f} bits, ΔPPL "
                       f"{r['delta_ppl_pct']:+.2f} %): nexuskv {ours['delta_ppl_pct']:+.2f} % ({ours['name']}, "
                       f"{ours['effective_bits']['kv']:.3f} bits): "
                       f"{'lower' if ours['delta_ppl_pct'] < r['delta_ppl_pct'] else 'NOT lower'}")
    for r in rows:
        b = r.get("bytes")
        if r["kind"] == ec.NEXUSKV and r["bits"] == 4 and b:
            out.append(f"bytes at {b['tokens']} tokens, {r['name']}: {100 * b['ratio_to_dense']:.1f} % of the dense "
                       f"{b['dtype']} cache; target <= 30 %: {'met' if b['ratio_to_dense'] <= 0.30 else 'NOT met'}")
    return out


def _ints(text: str, what: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"eval: {what} must be comma-separated integers, got {text!r}") from None


def settings_from_args(args) -> List[ec.Setting]:
    if args.quick:
        return [ec.DENSE_SETTING, ec.nexuskv(4, 0)]
    return ec.grid(bits=_ints(args.bits, "--bits"), tails=_ints(args.tails, "--tails"),
                   ablation_bits=_ints(args.ablation_bits, "--ablation-bits"),
                   ablations=[a for a in args.ablations.split(",") if a],
                   best_2bit=not args.no_best_2bit, quanto_bits=() if args.no_quanto else
                   _ints(args.quanto_bits, "--quanto-bits"))


def main(args) -> int:
    from . import hf
    from .models import load_model, load_text, model_name, tokenize

    torch.manual_seed(0)
    settings = settings_from_args(args)
    agree = [] if args.no_greedy else ec.parse_settings(args.greedy_settings, settings)
    nbytes = [] if args.no_bytes else ec.parse_settings(args.bytes_settings, settings)
    print(f"loading {model_name(args.model)} ({args.dtype}) ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model(getattr(torch, args.dtype), attn_implementation=hf.ATTN_IMPLEMENTATION,
                                  path=args.model)
    text = load_text(args.text)
    # Perplexity on the first tokens; the greedy prompt is the real text that follows them.
    ids = tokenize(tokenizer, text, max(args.tokens + (args.prompt_tokens if agree else 0),
                                        args.bytes_tokens if nbytes else 0))
    prompt = ids[:, args.tokens:args.tokens + args.prompt_tokens] if agree else None
    rows = run(model, ids[:, :args.tokens], settings, args.window, args.chunk, agree, prompt, args.new_tokens, nbytes,
               ids[:, :args.bytes_tokens] if nbytes else None, getattr(torch, args.bytes_dtype),
               progress=not args.no_progress)
    table = markdown(rows)
    verdicts = targets(rows)
    print(table)
    print("\n".join("- " + v for v in verdicts))
    doc = {"model": model_name(args.model), "dtype": args.dtype, "tokens": args.tokens,
           "window": args.window, "chunk": args.chunk, "greedy_prompt_tokens": args.prompt_tokens,
           "greedy_new_tokens": args.new_tokens, "bytes_tokens": args.bytes_tokens, "bytes_dtype": args.bytes_dtype,
           "date": datetime.date.today().isoformat(), "machine": platform.platform(), "torch": torch.__version__,
           "targets": verdicts, "rows": rows}
    for path, write in ((args.json, lambda p: json.dump(doc, open(p, "w"), indent=1)),
                        (args.markdown, lambda p: open(p, "w").write(table + "\n\n" + "\n".join(
                            "- " + v for v in verdicts) + "\n")),
                        (args.png, lambda p: plot(rows, p))):
        if path:
            write(path)
            print(f"wrote {path}")
    return 0


def add_arguments(p, text_default: Optional[str] = None) -> None:
    from .__main__ import positive

    p.add_argument("--text", default=text_default, help="text file (plain or .gz); default: Debian reference manual")
    p.add_argument("--tokens", type=positive("--tokens", 2), default=4096, help="tokens of text for perplexity")
    p.add_argument("--window", type=positive("--window", 2), default=1024,
                   help="perplexity window: tokens per independent sequence")
    p.add_argument("--chunk", type=positive("--chunk"), default=64,
                   help="tokens per forward (queries see compressed past + chunk)")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"],
                   help="model dtype for perplexity and greedy agreement")
    p.add_argument("--bits", default="8,4,3,2", help="bit widths of the base nexuskv rows")
    p.add_argument("--tails", default="0,128", help="full-precision tails of the base nexuskv rows")
    p.add_argument("--ablation-bits", default="4,2", help="bit widths at which each knob is switched on alone")
    p.add_argument("--ablations", default="outliers,rotate,dgq,sinks", help="knobs: outliers, rotate, dgq, sinks")
    p.add_argument("--no-best-2bit", action="store_true", help="leave out the best 2-bit setting")
    p.add_argument("--quanto-bits", default="4,2", help="transformers QuantizedCache (optimum-quanto) rows")
    p.add_argument("--no-quanto", action="store_true", help="leave out the quanto rows")
    p.add_argument("--quick", action="store_true", help="dense and 4-bit with no tail only")
    p.add_argument("--new-tokens", type=positive("--new-tokens"), default=256,
                   help="greedy tokens generated per setting")
    p.add_argument("--prompt-tokens", type=positive("--prompt-tokens"), default=512,
                   help="tokens of real text in the greedy prompt")
    p.add_argument("--greedy-settings", default="all",
                   help="comma-separated substrings of the setting names to run greedy generation for")
    p.add_argument("--no-greedy", action="store_true", help="no greedy agreement rows")
    p.add_argument("--bytes-tokens", type=positive("--bytes-tokens"), default=4096,
                   help="tokens the caches hold when bytes are measured")
    p.add_argument("--bytes-dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="model dtype for the byte measurement (the dense reference is a cache of this dtype)")
    p.add_argument("--bytes-settings", default="all", help="comma-separated substrings of the setting names")
    p.add_argument("--no-bytes", action="store_true", help="no byte measurement")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (per row, with an estimate)")
    p.add_argument("--json", default=None, help="write the rows as JSON to this path")
    p.add_argument("--markdown", default=None, help="write the table as markdown to this path")
    p.add_argument("--png", default=None, help="write the plot (ΔPPL vs effective bits) to this path")
