"""`python -m nexuskv calibrate`: measure a model's recipe (nexuskv.recipe) on a text.

Runs the model over `--windows` windows of `--tokens` tokens of the text (each starting
as the tokenizer starts a sequence), records every layer's post-RoPE keys and values
where attention receives them, and writes the keys' channel means per kv head as a
recipe file.  Prints, per layer, how large the mean is against the keys' spread around
it (both L2 norms, averaged over kv heads): what centering takes out of each token's
key range.

With `--bits-budget B` it also allocates a bit map (nexuskv.bit_allocation): each
layer's keys and values get one of `--bits-choices` code bits, from their sensitivity
measured on the first `--sensitivity-windows` windows, so that the cache's average
effective bits stay within B; `cache_for(model, recipe=FILE)` reads it.  One forward
pass of the window per layer, K/V and choice: SmolLM2 (30 layers, 3 choices, one window
of 1024 tokens) takes about 15 minutes on 2 cores.  Then the allocation is run from each
floor of key and value bits that fits B, and the map of least whole KL divergence on the
same windows is kept (bit_allocation.choose; the candidates are in the header).
`--group-size 128` halves what scales and zeros cost (0.25 bits instead of 0.5 with
16-bit ones), which leaves more of a budget for code bits."""

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
    p.add_argument(
        "--bits-budget",
        type=float,
        default=None,
        help="also allocate a bit map: the average effective bits (scales and zeros counted) the cache "
        "may take; cache_for(model, recipe=FILE) reads it",
    )
    p.add_argument("--bits-choices", default="2,3,4", help="code bits a layer's keys or values may get")
    p.add_argument(
        "--group-size",
        type=positive("--group-size"),
        default=64,
        help="key group (tokens) and value group (channels) the bit map is allocated for",
    )
    p.add_argument(
        "--residual",
        type=positive("--residual", 0),
        default=128,
        help="full-precision tail the bit map is allocated for",
    )
    p.add_argument(
        "--window-residual",
        type=positive("--window-residual", 0),
        default=None,
        help="full-precision tail of the sliding-window layers the bit map is allocated for (default: --residual; "
        "cache_for's byte policy keeps 0 there)",
    )
    p.add_argument(
        "--sinks",
        type=positive("--sinks", 0),
        default=4,  # nexuskv.hf.DEFAULT_SINKS, cache_for's default (tested; hf is not imported for --help)
        help="sink tokens the bit map is allocated for (cache_for's default)",
    )
    p.add_argument(
        "--fit-range",
        action="store_true",
        help="allocate for fitted key ranges (cache_for(fit_range=True)): measured with them, recorded in the header; "
        "the chosen map is also measured with the values' ranges fitted, which the recipe then asks for if that "
        "lowered its KL (cache_for takes it from the recipe)",
    )
    p.add_argument(
        "--sensitivity-from",
        default=None,
        help="a recipe file with a bit map: allocate from its measured sensitivity (same model, choices, groups, tail "
        "and sinks) instead of measuring again",
    )
    p.add_argument(
        "--sensitivity-windows",
        type=positive("--sensitivity-windows"),
        default=1,
        help="windows (of the --windows) the sensitivity and the whole maps (the candidates, the values' fit) "
        "are measured on",
    )


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
    choices = bit_choices(args.bits_choices)  # checked before loading (__main__.check)
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
    print(f"{'layer':>5} {'|key mean|':>11} {'spread':>8}")
    for i in range(recipe.key_center.shape[0]):
        m = recipe.key_center[i].norm(dim=-1).mean().item()
        print(f"{i:>5} {m:>11.3f} {spread[i].mean().item():>8.3f}")
    if args.bits_budget is not None:
        add_bit_map(recipe, model, windows[: args.sensitivity_windows], choices, args)
    recipe.save(args.out)
    print(f"wrote {args.out}: {name}, {args.windows} x {args.tokens} tokens of {source['text']}")
    return 0


def bit_choices(text: str) -> list:
    from .recipe import BIT_CHOICES

    try:
        choices = sorted({int(b) for b in text.split(",")})
    except ValueError:
        choices = []
    if not choices or any(b not in BIT_CHOICES for b in choices):
        raise ValueError(f"--bits-choices must be a comma-separated list among {list(BIT_CHOICES)}, got {text!r}")
    return choices


def reuse_sensitivity(path: str, model, allocated_for: dict):
    """(scores for allocated_for["choices"], windows they were measured on) from the recipe at
    `path`, refused unless it was measured on this model with the same groups, tail and sinks
    and holds every choice asked for (8 bits, the reference, scores 0 by construction)."""
    from .bit_allocation import REFERENCE_BITS
    from .recipe import Recipe, model_facts

    old = Recipe.load(path)
    old.check_model(model_facts(model.config), "this model")
    if old.sensitivity is None:
        raise ValueError(f"--sensitivity-from {path}: it holds no measured sensitivity (no bit map)")
    # recipes from before fitted ranges existed were measured without them
    differ = {
        k: (old.bits.get(k, False if k == "fit_range" else None), v)
        for k, v in allocated_for.items()
        if k != "choices" and old.bits.get(k, False if k == "fit_range" else None) != v
    }
    if differ:
        raise ValueError(
            f"--sensitivity-from {path}: measured with other settings: "
            + ", ".join(f"{k} {o!r} (now {n!r})" for k, (o, n) in differ.items())
        )
    measured = list(old.bits.get("choices", []))
    missing = [b for b in allocated_for["choices"] if b not in measured and b != REFERENCE_BITS]
    if missing:
        raise ValueError(f"--sensitivity-from {path}: measured at {measured} bits, not at {missing}")
    columns = [
        old.sensitivity[..., measured.index(b)] if b in measured else torch.zeros(old.sensitivity.shape[:2])
        for b in allocated_for["choices"]
    ]
    return torch.stack(columns, -1), old.bits.get("sensitivity_windows")


def add_bit_map(recipe, model, windows, choices, args) -> None:
    """Measures the sensitivity of every layer's keys and values and allocates recipe.bit_map
    under args.bits_budget (nexuskv.bit_allocation), printing both."""
    from . import bit_allocation as ba
    from .eval_caches import head_dim_of, meta_dtype_for
    from .hf_compat import text_config

    settings = dict(
        group_size=args.group_size,
        residual=args.residual,
        window_residual=args.window_residual,
        sinks=args.sinks,
        fit_range=args.fit_range,
    )
    meta = meta_dtype_for(model.dtype)

    head_dim = head_dim_of(text_config(model))
    # each choice's (key, value) effective bits, once: allocate asks for them at every step
    costs = {b: ba.tensor_bits(b, head_dim, args.group_size, args.group_size, meta, model.dtype) for b in choices}
    cost = costs.__getitem__

    allocated_for = dict(choices=choices, **settings)
    if args.sensitivity_from:
        scores, measured_on = reuse_sensitivity(args.sensitivity_from, model, allocated_for)
        print(f"sensitivity: from {args.sensitivity_from}")
    elif len(choices) == 1:  # every tensor gets the one width: no score can change the map
        scores, measured_on = torch.zeros(text_config(model).num_hidden_layers, 2, 1), 0
        print(f"sensitivity: not measured (one choice, {choices[0]} bits: the map is uniform)")
    else:
        print(
            f"sensitivity: KL (nats/token) from all-8-bit with one tensor at {choices} bits, "
            f"{len(windows)} window(s) ...",
            flush=True,
        )
        scores = ba.sensitivity(model, windows, choices, progress=lambda line: print(line, flush=True), **settings)
        measured_on = len(windows)
    print(f"candidate maps: the allocation from each floor that fits, whole KL on {len(windows)} window(s) ...")
    bit_map, candidates = ba.choose(
        model,
        windows,
        scores,
        choices,
        cost,
        args.bits_budget,
        progress=lambda line: print(line, flush=True),
        **settings,
    )
    extra = {}
    if args.fit_range:
        # The values' ranges too, if that lowers the chosen map's KL (on Gemma 3's poems they lowered
        # its 3.25-bit map's ΔPPL, on SmolLM2 they raised it: benchmarks/RESULTS.md, "Fitted ranges")
        keys_only = next(c["kl"] for c in candidates if c["bit_map"] == bit_map)
        # against the same all-8-bit reference as the candidates (made with `settings`)
        both = ba.map_divergence(
            model, windows, bit_map, reference_kwargs=settings, **dict(settings, value_fit_range=True)
        )
        extra = dict(value_fit_range=both < keys_only, value_fit_kl=both)
        print(
            f"values fitted too: KL {both:.5f} against {keys_only:.5f} with the keys alone: "
            + ("fitted" if extra["value_fit_range"] else "min/max"),
            flush=True,
        )
    reached = ba.average_bits(bit_map, cost)
    recipe.bit_map = torch.tensor(bit_map, dtype=torch.int32)
    recipe.sensitivity = scores
    recipe.bits = dict(
        allocated_for,
        budget=args.bits_budget,
        effective_bits=round(reached, 4),
        value_group_size=args.group_size,
        meta_dtype=str(meta).replace("torch.", ""),
        sensitivity_windows=measured_on,
        candidates=[dict(c, chosen=c["bit_map"] == bit_map) for c in candidates],
        **extra,
    )
    recipe.__post_init__()  # checks the bit map
    print(f"bit map ({reached:.3f} effective bits, budget {args.bits_budget}): {ba.describe(bit_map)}")
    print("layer " + " ".join(f"{i:>2}" for i in range(len(bit_map))))
    print("K     " + " ".join(f"{kb:>2}" for kb, _ in bit_map))
    print("V     " + " ".join(f"{vb:>2}" for _, vb in bit_map))
