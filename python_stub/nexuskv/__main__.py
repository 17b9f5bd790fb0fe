"""Command line: `python -m nexuskv demo|report|eval` (or the `nexuskv` console script)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexuskv", description="KV-cache compression for PyTorch")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="generate with the dense and the nexuskv cache: texts, bytes, speed")
    from .demo import add_arguments as demo_arguments

    demo_arguments(d)
    r = sub.add_parser("report", help="compress a real model's K/V at every NQ setting and report bits and errors")
    r.add_argument("--text", default=None, help="text file (plain or .gz); default: Debian reference manual")
    r.add_argument("--tokens", type=int, default=1024, help="tokens of text to run through the model")
    r.add_argument("--queries", type=int, default=32, help="last queries whose attention output is compared")
    r.add_argument("--group-size", type=int, default=64)
    r.add_argument("--outliers", type=int, default=1, help="outliers per group in the 'with outliers' rows")
    r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    r.add_argument("--json", default=None, help="also write the table as JSON to this path")
    e = sub.add_parser("eval", help="perplexity of the real model with a compressed KV cache vs the dense cache")
    from .evaluate import add_arguments

    add_arguments(e)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from . import demo

        return demo.main(args)
    if args.command == "report":
        from . import report

        return report.main(args)
    if args.command == "eval":
        from . import evaluate

        return evaluate.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
