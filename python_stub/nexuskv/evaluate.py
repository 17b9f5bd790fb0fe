"""`python -m nexuskv eval`: perplexity of the real model with its KV cache
compressed, against the dense cache, on the same tokens.

Every window of text is fed in chunks (at most 64 tokens); the queries of a
chunk attend to the compressed past plus their own chunk, through
attn_implementation="nexuskv" (fused attention over the compressed cache).
The dense reference runs the same chunks through transformers' DynamicCache."""

from __future__ import annotations

import datetime
import json
import math
import platform
from typing import Dict, List, Optional

import torch


def window_nll(model, ids: torch.Tensor, chunk: int, cache) -> torch.Tensor:
    """Negative log-likelihoods [n-1] of ids[1:] given the prefix, fed chunk by chunk."""
    nll, prev_logits = [], None
    with torch.inference_mode():
        for s in range(0, ids.shape[1], chunk):
            piece = ids[:, s:s + chunk]
            logits = model(piece, past_key_values=cache, use_cache=True).logits.float()
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
    nll, nbytes, cached = [], 0, 0
    for w0 in range(0, ids.shape[1] - 1, window):
        cache = make_cache()
        nll.append(window_nll(model, ids[:, w0:w0 + window], chunk, cache))
        if hasattr(cache, "nbytes"):
            nbytes = max(nbytes, cache.nbytes)
            cached = max(cached, cache.layers[0].cache.max_length())
    nll = torch.cat(nll)
    return {"ppl": math.exp(float(nll.mean())), "tokens": int(nll.numel()), "cache_bytes": nbytes,
            "cached_tokens": cached}


def settings(residuals=(0, 128)) -> List[Dict]:
    out = [{"name": "dense", "bits": 16}]
    for bits in (8, 4, 3, 2):
        for residual in residuals:
            out.append({"name": f"nexuskv {bits}-bit tail {residual}", "bits": bits, "residual": residual})
    out.append({"name": "nexuskv 2-bit tail 128 rot", "bits": 2, "residual": 128, "rotate": True})
    out.append({"name": "nexuskv 4-bit tail 128 rot", "bits": 4, "residual": 128, "rotate": True})
    return out


def run(model, ids: torch.Tensor, window: int, chunk: int, rows: List[Dict], progress: bool = True) -> List[Dict]:
    from tqdm import tqdm
    from transformers import DynamicCache

    from . import hf

    cfg = model.config
    elements_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    results = []
    for s in tqdm(rows, desc="perplexity", unit="setting", disable=not progress):
        if s["bits"] == 16:
            make = DynamicCache
        else:
            def make(s=s):
                return hf.cache_for(model, bits=s["bits"], residual=s["residual"], rotate=s.get("rotate", False))
        r = dict(s, **perplexity(model, ids, window, chunk, make))
        if r["cache_bytes"]:
            r["bits_per_element"] = 8 * r["cache_bytes"] / (r["cached_tokens"] * elements_per_token)
        results.append(r)
    base = results[0]["ppl"]
    for r in results:
        r["delta_ppl_pct"] = 100 * (r["ppl"] - base) / base
    return results


def markdown(rows: List[Dict]) -> str:
    lines = ["| setting | perplexity | ΔPPL % | cache bytes | bits/element (all held bytes) |", "|---|---|---|---|---|"]
    for r in rows:
        bits = f"{r['bits_per_element']:.2f}" if "bits_per_element" in r else "32 (fp32 dense)"
        lines.append(f"| {r['name']} | {r['ppl']:.3f} | {r['delta_ppl_pct']:+.2f} | {r['cache_bytes'] or '-'} | {bits} |")
    return "\n".join(lines)


def plot(rows: List[Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows[1:]:
        ax.scatter(r["bits_per_element"], r["delta_ppl_pct"], label=r["name"])
    ax.set_xlabel("cache bits per element (every held byte, tail included)")
    ax.set_ylabel("ΔPPL vs dense cache (%)")
    ax.axhline(0, color="gray", lw=0.5)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> int:
    from . import hf  # noqa: F401  (registers attn_implementation="nexuskv")
    from .models import load_model, load_text, tokenize

    model, tokenizer = load_model(getattr(torch, args.dtype), attn_implementation=hf.ATTN_IMPLEMENTATION)
    ids = tokenize(tokenizer, load_text(args.text), args.tokens)
    rows = settings() if not args.quick else [{"name": "dense", "bits": 16},
                                               {"name": "nexuskv 4-bit tail 0", "bits": 4, "residual": 0}]
    results = run(model, ids, args.window, args.chunk, rows)
    table = markdown(results)
    print(table)
    doc = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)", "dtype": args.dtype, "tokens": args.tokens,
           "window": args.window, "chunk": args.chunk, "date": datetime.date.today().isoformat(),
           "machine": platform.platform(), "torch": torch.__version__, "rows": results}
    for path, write in ((args.json, lambda p: json.dump(doc, open(p, "w"), indent=1)),
                        (args.markdown, lambda p: open(p, "w").write(table + "\n")),
                        (args.png, lambda p: plot(results, p))):
        if path:
            write(path)
            print(f"wrote {path}")
    return 0


def add_arguments(p, text_default: Optional[str] = None) -> None:
    p.add_argument("--text", default=text_default, help="text file (plain or .gz); default: Debian reference manual")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=64, help="tokens per forward (queries see compressed past + chunk)")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quick", action="store_true", help="dense and 4-bit with no tail only")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--png", default=None)
