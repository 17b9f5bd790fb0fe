"""`python -m nexuskv demo`: the main job in one command.  Loads the embedded
default model (SmolLM2-135M-Instruct, offline, in a 16-bit dtype), gives it a
prompt of real text (a passage of Debian's reference manual and a question, or
your own), and generates greedily twice: with transformers' dense cache and with
the nexuskv compressed cache (fused attention over the compressed K/V).  Prints
both texts, how far they agree, the bytes each cache holds and the speed."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Dict, Optional

import torch

from . import eval_caches as ec
from .generation import agreement, greedy
from .models import load_text, tokenize

DEFAULT_QUESTION = "Summarize the text above in three sentences."


def build_prompt(tokenizer, text: str, context_tokens: int, question: str) -> torch.Tensor:
    """input_ids [1, n]: the first `context_tokens` tokens of `text` (none if 0), then
    `question`, in the model's chat format."""
    context = ""
    if context_tokens > 0:
        context = tokenizer.decode(tokenize(tokenizer, text, context_tokens)[0]) + "\n\n"
    messages = [{"role": "user", "content": context + question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


def run(model, tokenizer, prompt_ids: torch.Tensor, setting: ec.Setting, new_tokens: int,
        progress: bool = False) -> Dict:
    """Greedy generation with the dense cache and with `setting`'s cache; texts,
    agreement, bytes (every tensor of each cache, ec.cache_bytes) and timings."""
    out = {"prompt_tokens": int(prompt_ids.shape[1]), "new_tokens": new_tokens,
           "dtype": str(model.dtype).replace("torch.", ""), "runs": {}}
    for label, s in (("dense", ec.DENSE_SETTING), ("nexuskv", setting)):
        cache = ec.make_cache(model, s)
        with ec.attention_for(model, s):
            g = greedy(model, prompt_ids, cache, new_tokens,
                       progress=f"generating ({label} cache)" if progress else None)
        out["runs"][label] = {"setting": "transformers DynamicCache" if s.kind == ec.DENSE else s.name,
                              "tokens": g.tokens, "text": tokenizer.decode(g.tokens),
                              "bytes": ec.cache_bytes(cache), "cached_tokens": int(cache.get_seq_length()),
                              "prefill_s": g.prefill_s, "decode_tokens_per_s": g.decode_tokens_per_s,
                              "cache": cache}
    dense, nkv = out["runs"]["dense"], out["runs"]["nexuskv"]
    out["agreement"] = agreement(dense["tokens"], nkv["tokens"])
    out["ratio_to_dense"] = nkv["bytes"]["total"] / dense["bytes"]["total"]
    out["effective_bits"] = ec.effective_bits(setting, ec.head_dim_of(model.config), model.dtype)
    return out


def report(r: Dict) -> str:
    dense, nkv = r["runs"]["dense"], r["runs"]["nexuskv"]
    a = r["agreement"]
    lines = [f"prompt: {r['prompt_tokens']} tokens; {r['new_tokens']} new tokens, greedy; model in {r['dtype']}", ""]
    for label, run_ in (("dense", dense), ("nexuskv", nkv)):
        lines += [f"--- {label} ({run_['setting']}):", run_["text"].strip(), ""]
    lines += [f"agreement: the first {a['leading']} of {r['new_tokens']} tokens are equal; "
              f"{100 * a['match']:.1f} % of positions equal", "",
              f"| cache | tokens held | bytes | compressed part | full-precision tail + sinks | vs dense | prefill s | "
              f"decode tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for label, run_ in (("dense " + r["dtype"], dense), ("nexuskv", nkv)):
        b = run_["bytes"]
        lines.append(f"| {label} | {run_['cached_tokens']} | {b['total']:,} | {b['compressed']:,} | "
                     f"{b['full_precision']:,} | {100 * b['total'] / dense['bytes']['total']:.1f} % | "
                     f"{run_['prefill_s']:.2f} | {run_['decode_tokens_per_s']:.1f} |")
    bits = r["effective_bits"]
    lines.append(f"\nnexuskv compressed part: {bits['kv']:.3f} effective bits per element (keys {bits['keys']:.3f}, "
                 f"values {bits['values']:.3f}; every scale, zero and outlier counted); the tail of recent tokens "
                 f"and the sink tokens stay in {r['dtype']} (the full-precision column).")
    return "\n".join(lines)


def setting_from_args(args) -> ec.Setting:
    """The demo's nexuskv cache: cache_for(model, bits=--bits, sinks=--sinks)'s (ec.default_cache)
    with what the flags set: --group-size (keys and values), --residual (every layer's tail),
    --rotate, --min-max."""
    s = ec.default_cache(args.bits, args.sinks)
    if args.group_size is not None:
        s = dataclasses.replace(s, group_size=args.group_size, value_group_size=args.group_size)
    if args.residual is not None:
        s = dataclasses.replace(s, residual=args.residual, window_residual=None)
    return dataclasses.replace(s, rotate=args.rotate, fit_range=s.fit_range and not args.min_max)


def execute(args, model, tokenizer) -> Dict:
    """The demo for parsed `args` on a loaded model: prints the report, writes the
    JSON if asked, returns run()'s result (with the two caches)."""
    text = load_text(args.text) if args.context_tokens > 0 else ""
    prompt_ids = build_prompt(tokenizer, text, args.context_tokens, args.prompt)
    setting = setting_from_args(args)
    r = run(model, tokenizer, prompt_ids, setting, args.new_tokens,
            progress=not getattr(args, "no_progress", True))
    print(report(r))
    if args.json:
        doc = dict(r, runs={k: {f: v for f, v in run_.items() if f != "cache"} for k, run_ in r["runs"].items()})
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return r


def main(args) -> int:
    from . import hf
    from .models import load_model, model_name

    torch.manual_seed(0)
    print(f"loading {model_name(args.model)} ({args.dtype}) ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model(getattr(torch, args.dtype), attn_implementation=hf.ATTN_IMPLEMENTATION,
                                  path=args.model)
    execute(args, model, tokenizer)
    return 0


def add_arguments(p, text_default: Optional[str] = None) -> None:
    from .__main__ import positive

    p.add_argument("--prompt", default=DEFAULT_QUESTION, help="the question (after the context passage)")
    p.add_argument("--context-tokens", type=positive("--context-tokens", 0), default=1024,
                   help="tokens of --text placed before the question (0: the question alone)")
    p.add_argument("--text", default=text_default, help="context text file (plain or .gz); default: Debian "
                   "reference manual")
    p.add_argument("--new-tokens", type=positive("--new-tokens"), default=64, help="tokens generated per cache")
    p.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 8], help="bits per key/value code")
    p.add_argument("--group-size", type=positive("--group-size"), default=None,
                   help="quantization group size (keys' tokens, values' channels); None: cache_for's for --bits "
                        "(64; 128 at 2 bits)")
    p.add_argument("--residual", type=positive("--residual", 0), default=None,
                   help="newest tokens kept in full precision on every layer; None: cache_for's for --bits (4-bit: "
                        "60 besides the 4 sinks on full-attention layers, none on sliding-window ones; 2-bit: 128 "
                        "on every layer)")
    p.add_argument("--rotate", action="store_true", help="randomized Hadamard rotation before quantization")
    p.add_argument("--sinks", type=positive("--sinks", 0), default=4,
                   help="first tokens kept in full precision (attention sinks; 4 measured best, RESULTS.md)")
    p.add_argument("--min-max", action="store_true",
                   help="key ranges from min/max instead of least squares (cache_for fits them when it keeps sinks)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="model dtype")
    p.add_argument("--json", default=None, help="also write the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while generating")
