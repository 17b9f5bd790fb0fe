"""`python -m nexuskv calibrate`: measure a model's recipe (nexuskv.recipe) on a text.

Runs the model over `--windows` windows of `--tokens` tokens of the text (each starting
as the tokenizer starts a sequence), records every layer's post-RoPE keys and values
where attention receives them, and writes the keys' channel means per kv head as a
recipe file.  Prints, per layer, how large the mean is against the keys' spread around
it (both L2 norms, averaged over kv heads): what centering takes out of each token's
key range."""

from __future__ import annotations

import datetime

import torch


def add_arguments(p) -> None:
    from .__main__ import positive

    p.add_argument(
        "--text",
        default=None,
        help="text file (plain or .gz); default: Debian reference manual. "
        "Calibrate on a text other than the one you evaluate on",
    )
    p.add_argument("--tokens", type=positive("--tokens", 2), default=1024, help="tokens per window")
    p.add_argument("--windows", type=positive("--windows"), default=3, help="windows of --tokens tokens")
    p.add_argument(
        "--dtype", default="float32", choices=["bfloat16", "float16", "float32"], help="model dtype while measuring"
    )
    p.add_argument("--out", required=True, help="recipe file to write (.safetensors): NEXUSKV_VLLM_RECIPE reads it")


def text_windows(tokenizer, text: str | None, n: int, length: int) -> list:
    """n windows of `length` consecutive tokens from the start of the text (a path, None: the
    Debian manual), each after the tokenizer's start of a sequence: input_ids [1, ...] each."""
    from .models import as_sequence, load_text, sequence_prefix, text_tokens

    body = text_tokens(tokenizer, load_text(text), n * length)
    prefix = sequence_prefix(tokenizer)
    return [as_sequence(prefix, body[:, i * length : (i + 1) * length]) for i in range(n)]


def main(args) -> int:
    from .models import load_model, model_name
    from .recipe import calibrate

    name = model_name(args.model)
    print(f"loading {name} ({args.dtype}) and text ...", flush=True)
    model, tokenizer = load_model(getattr(torch, args.dtype), path=args.model)
    windows = text_windows(tokenizer, args.text, args.windows, args.tokens)
    source = {
        "model": name,
        "text": args.text or "debian-reference-en",
        "tokens": args.tokens,
        "windows": args.windows,
        "dtype": args.dtype,
        "date": datetime.date.today().isoformat(),
    }
    recipe, spread = calibrate(model, windows, source)
    recipe.save(args.out)
    print(f"{'layer':>5} {'|key mean|':>11} {'spread':>8}")
    for i in range(recipe.key_center.shape[0]):
        m = recipe.key_center[i].norm(dim=-1).mean().item()
        print(f"{i:>5} {m:>11.3f} {spread[i].mean().item():>8.3f}")
    print(f"wrote {args.out}: {name}, {args.windows} x {args.tokens} tokens of {source['text']}")
    return 0
