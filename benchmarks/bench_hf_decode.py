"""Decode speed through the Hugging Face binding, eager vs torch.compile, and how many
graphs / graph breaks torch.compile makes of one decode step (torch._dynamo.explain).

    python benchmarks/bench_hf_decode.py                      # SmolLM2-135M (embedded), 512-token prompt
    python benchmarks/bench_hf_decode.py --model DIR --json out.json

Rows: the nexuskv caches on the fused path (attention "nexuskv": the dynamic cache, a
TorchBind object, and the static one, cache_for(..., static=True), whose state is tensors)
and transformers' dense cache, each eager and with model.forward compiled (default mode).
Every step gets cache_position / position_ids, as generate() passes them.  Prints a table and
writes JSON.  Decode tokens/s count the steps after the first (compilation happens in
the warm-up steps, which are not timed)."""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


def _positions(t: int) -> dict:
    """cache_position / position_ids of the token at position t, as generate() passes them
    (so that no step reads the cache's length on the host)."""
    pos = torch.tensor([t])
    return dict(cache_position=pos, position_ids=pos[None])


def decode_rate(model, ids, make_cache, steps: int, warmup: int, forward) -> float:
    from nexuskv.hf_compat import cache_argument

    name = cache_argument(model)
    t = ids.shape[1]
    with torch.inference_mode():
        cache = make_cache()
        logits = model(ids, **{name: cache}).logits  # the prefill runs eagerly
        nxt = logits[:, -1:].argmax(-1)
        for _ in range(warmup):
            nxt = forward(nxt, **{name: cache}, **_positions(t)).logits[:, -1:].argmax(-1)
            t += 1
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = forward(nxt, **{name: cache}, **_positions(t)).logits[:, -1:].argmax(-1)
            t += 1
        return steps / (time.perf_counter() - t0)


def graph_count(model, ids, make_cache) -> tuple[int, int]:
    from nexuskv.hf_compat import cache_argument

    name = cache_argument(model)
    torch._dynamo.reset()
    with torch.inference_mode():
        cache = make_cache()
        nxt = model(ids, **{name: cache}).logits[:, -1:].argmax(-1)
        ex = torch._dynamo.explain(lambda x: model(x, **{name: cache}, **_positions(ids.shape[1])).logits)(nxt)
    return ex.graph_count, ex.graph_break_count


def main() -> None:
    import nexuskv.hf as nhf
    from nexuskv import models

    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default=None, help="local HF directory or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens in the cache before decoding")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps (compilation happens here)")
    p.add_argument("--bits", type=int, default=4, help="nexuskv bits")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="write the rows as JSON to this path")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 256
    model, tok = models.load_model(
        getattr(torch, args.dtype), attn_implementation=nhf.ATTN_IMPLEMENTATION, path=args.model
    )
    ids = models.tokenize(tok, models.load_text(), args.prompt_tokens)
    capacity = args.prompt_tokens + args.warmup + args.steps + 1
    caches = {
        # no sinks and min/max ranges, like the static cache (cache_for's dynamic default has both)
        "nexuskv fused (dynamic cache)": lambda: nhf.cache_for(model, bits=args.bits, sinks=0, fit_range=False),
        "nexuskv fused (static cache)": lambda: nhf.cache_for(
            model, bits=args.bits, static=True, max_cache_len=capacity
        ),
        "dense (DynamicCache, sdpa)": None,
    }
    rows = []
    for label, make in caches.items():
        if make is None:
            model.set_attn_implementation("sdpa")
            from transformers import DynamicCache

            make = DynamicCache
        graphs, breaks = graph_count(model, ids, make)
        eager = decode_rate(model, ids, make, args.steps, args.warmup, model.forward)
        torch._dynamo.reset()
        compiled = decode_rate(model, ids, make, args.steps, args.warmup, torch.compile(model.forward))
        rows.append(
            {
                "cache": label,
                "graphs": graphs,
                "graph_breaks": breaks,
                "eager_tokens_per_s": eager,
                "compiled_tokens_per_s": compiled,
            }
        )
        model.set_attn_implementation(nhf.ATTN_IMPLEMENTATION)
    print("| cache | graphs / breaks of one decode step | eager tokens/s | compiled tokens/s |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['cache']} | {r['graphs']} / {r['graph_breaks']} | {r['eager_tokens_per_s']:.1f} | "
            f"{r['compiled_tokens_per_s']:.1f} |"
        )
    if args.json:
        doc = {
            "model": models.model_name(args.model),
            "dtype": args.dtype,
            "prompt_tokens": args.prompt_tokens,
            "steps": args.steps,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.platform(),
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
