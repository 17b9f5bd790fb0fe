"""CPU throughput of nexuskv NQ compress / decompress against plain PyTorch.

For every (dtype, axis, bits, group_size) this times, side by side in one run:

  ours      torch.ops.nexuskv.nq_compress / nq_decompress (num_outliers=0), and
            an extra row with num_outliers=1 (dense-and-sparse);
  baseline  the same quantization written in plain, vectorized PyTorch, the way
            a user without nexuskv would: aminmax over a reshaped view, the
            codes in float32 with a few in-place tensor ops, packing with shifts
            (2 codes per byte at 4 bits, 4 at 2 bits, bytes at 8 bits); and its
            inverse (unpack with a broadcast shift, code * scale + zero in
            float32, cast back).  Scale and zero are stored in the input dtype
            like ours.  No outliers; groups must divide the axis.

Throughput is GB/s of the uncompressed tensor in its own dtype: input bytes per
second for compress, output bytes (same dtype, same size) for decompress.
Each time is the median of repeated runs after warmup, with
torch.set_num_threads(--threads, default 2).  Once per config the decompressed
values of both are checked against the input (within scale/2 plus the output
dtype's rounding) and against each other, so that the comparison is honest.

    python benchmarks/bench_compress.py            # full grid, ~1 min on an idle 2-core machine
    python benchmarks/bench_compress.py --quick    # group 64 only, ~15-30 s
    python benchmarks/bench_compress.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import nexuskv
from nexuskv import profiling

REPO = Path(__file__).resolve().parent.parent
AXES = {-2: "tok", -1: "chan"}  # -2: groups of tokens per channel (keys); -1: groups of channels per token (values)


# ---- plain-PyTorch baseline ---------------------------------------------------------------


def _group_view(x: torch.Tensor, group_size: int, axis: int):
    """x [..., T, D] viewed with the group as its own dim; returns (view, reduced dim)."""
    *lead, t, d = x.shape
    if axis == -2:
        assert t % group_size == 0, "baseline needs group_size | tokens"
        return x.view(*lead, t // group_size, group_size, d), -2
    assert d % group_size == 0, "baseline needs group_size | head_dim"
    return x.view(*lead, t, d // group_size, group_size), -1


def torch_compress(x: torch.Tensor, bits: int, group_size: int, axis: int):
    """Asymmetric min/max quantization per group, round to nearest, packed codes."""
    qmax = (1 << bits) - 1
    xg, red = _group_view(x, group_size, axis)
    mn, mx = torch.aminmax(xg, dim=red, keepdim=True)
    zero = mn  # the minimum, exact in x.dtype
    scale = ((mx.float() - mn.float()) / qmax).to(x.dtype)
    s = scale.float().clamp_min_(torch.finfo(torch.float32).tiny)  # constant groups
    q = xg.float().sub_(zero.float()).div_(s).round_().clamp_(0, qmax).to(torch.uint8)
    per = 8 // bits
    q = q.view(*x.shape[:-1], x.shape[-1] // per, per)
    packed = q[..., 0]
    for j in range(1, per):
        shifted = q[..., j] << (bits * j)
        packed = packed | shifted if j == 1 else packed.bitwise_or_(shifted)
    return packed, scale.squeeze(red), zero.squeeze(red)


def torch_decompress(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    group_size: int,
    axis: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    if bits == 8:
        q = packed
    else:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        q = (packed.unsqueeze(-1) >> shifts).bitwise_and_((1 << bits) - 1).flatten(-2)
    qg, red = _group_view(q, group_size, axis)
    out = qg.float().mul_(scale.unsqueeze(red).float()).add_(zero.unsqueeze(red).float())
    return out.to(dtype).view(q.shape)


# ---- timing and checks ------------------------------------------------------------------


def median_time(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def expand_meta(m: torch.Tensor, group_size: int, axis: int, shape) -> torch.Tensor:
    """Per-group tensor [..., A, B] -> per-element [..., T, D] (float32)."""
    m = m.float().repeat_interleave(group_size, dim=axis)
    return m[..., : shape[-2], : shape[-1]]


def check(x, ours, ours_scale, base, base_scale, group_size, axis) -> dict:
    """Max errors in units of the group's scale; ok when within scale/2 (ours),
    and ours vs baseline within one scale, each plus the output dtype's rounding."""
    xf = x.float()
    s_ours = expand_meta(ours_scale, group_size, axis, x.shape)
    rnd = torch.finfo(x.dtype).eps * xf.abs()  # one ulp of the output dtype, generous
    err_ours = (ours.float() - xf).abs()
    res = {
        "max_err_ours_over_scale": (err_ours / s_ours).max().item(),
        "ours_ok": bool((err_ours <= 0.5 * s_ours * (1 + 1e-3) + rnd).all()),
    }
    if base is not None:
        s_base = expand_meta(base_scale, group_size, axis, x.shape)
        err_base = (base.float() - xf).abs()
        diff = (ours.float() - base.float()).abs()
        res.update(
            {
                "max_err_base_over_scale": (err_base / s_base).max().item(),
                "max_diff_over_scale": (diff / torch.maximum(s_ours, s_base)).max().item(),
                "rel_rmse_ours": ((err_ours.square().mean() / xf.square().mean()).sqrt().item()),
                "rel_rmse_base": ((err_base.square().mean() / xf.square().mean()).sqrt().item()),
                # baseline rounds its stored scale to nearest, so its top codes may clamp
                # by a fraction of a step: allow one scale between the two.
                "agree": bool((diff <= torch.maximum(s_ours, s_base) * 1.01 + rnd).all()),
            }
        )
    return res


def bench_config(x, bits, group_size, axis, num_outliers, warmup, reps, with_baseline, fit_range=False):
    d = x.shape[-1]
    nbytes = x.numel() * x.element_size()
    row = {
        "dtype": str(x.dtype).replace("torch.", ""),
        "shape": list(x.shape),
        "axis": axis,
        "bits": bits,
        "group_size": group_size,
        "num_outliers": num_outliers,
        "bytes": nbytes,
    }

    parts = nexuskv.nq_compress(x, bits, group_size, axis, num_outliers)
    t_c = median_time(lambda: nexuskv.nq_compress(x, bits, group_size, axis, num_outliers), warmup, reps)
    t_d = median_time(lambda: nexuskv.nq_decompress(*parts, bits, group_size, axis, d), warmup, reps)
    ours = nexuskv.nq_decompress(*parts, bits, group_size, axis, d)
    row.update(
        ours_compress_s=t_c,
        ours_decompress_s=t_d,
        ours_compress_gbps=nbytes / t_c / 1e9,
        ours_decompress_gbps=nbytes / t_d / 1e9,
        ours_effective_bits=8.0 * sum(p.numel() * p.element_size() for p in parts) / x.numel(),
    )
    if fit_range:  # the same buffers, fitted ranges: what the fit costs at compress time
        t_f = median_time(
            lambda: nexuskv.nq_compress(x, bits, group_size, axis, num_outliers, None, True), warmup, reps
        )
        row.update(fit_compress_s=t_f, fit_compress_gbps=nbytes / t_f / 1e9, fit_over_minmax=t_f / t_c)

    base = base_scale = None
    if with_baseline:
        packed, scale, zero = torch_compress(x, bits, group_size, axis)
        tb_c = median_time(lambda: torch_compress(x, bits, group_size, axis), warmup, reps)
        tb_d = median_time(lambda: torch_decompress(packed, scale, zero, bits, group_size, axis, x.dtype), warmup, reps)
        base = torch_decompress(packed, scale, zero, bits, group_size, axis, x.dtype)
        base_scale = scale
        row.update(
            base_compress_s=tb_c,
            base_decompress_s=tb_d,
            base_compress_gbps=nbytes / tb_c / 1e9,
            base_decompress_gbps=nbytes / tb_d / 1e9,
            compress_speedup=tb_c / t_c,
            decompress_speedup=tb_d / t_d,
        )
    row["check"] = check(x, ours, parts.scale, base, base_scale, group_size, axis)
    return row


machine_info = profiling.machine_info


def print_table(rows) -> None:
    hdr = (
        f"{'dtype':<9}{'axis':<6}{'bits':>4}{'G':>5}{'k':>3} | {'compress GB/s: ours':>19}{'torch':>7}{'x':>7}"
        f" | {'decompress GB/s: ours':>21}{'torch':>7}{'x':>7} | {'err/scale':>9} ok"
    )
    print(hdr)
    print("-" * len(hdr))
    base_of = {}
    for r in rows:
        key = (r["dtype"], r["axis"], r["bits"], r["group_size"])
        if "base_compress_gbps" in r:
            base_of[key] = r
        b = base_of.get(key)
        bc = (
            f"{b['base_compress_gbps']:7.2f}{r['ours_compress_gbps'] / b['base_compress_gbps']:6.1f}x"
            if b
            else " " * 14
        )
        bd = (
            f"{b['base_decompress_gbps']:7.2f}{r['ours_decompress_gbps'] / b['base_decompress_gbps']:6.1f}x"
            if b
            else " " * 14
        )
        c = r["check"]
        ok = c["ours_ok"] and c.get("agree", True)
        print(
            f"{r['dtype']:<9}{AXES[r['axis']]:<6}{r['bits']:>4}{r['group_size']:>5}{r['num_outliers']:>3} | "
            f"{r['ours_compress_gbps']:19.2f}{bc} | {r['ours_decompress_gbps']:21.2f}{bd} | "
            f"{c['max_err_ours_over_scale']:9.3f} {'yes' if ok else 'NO'}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="group size 64 only, fewer repetitions (~30 s)")
    ap.add_argument(
        "--json",
        default=str(REPO / "results" / "bench_compress.json"),
        help="where to write the results (default: results/bench_compress.json in the repository)",
    )
    ap.add_argument("--shape", default="1,8,8192,128", help="batch,kv_heads,tokens,head_dim")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--bits", default="2,4,8")
    ap.add_argument("--group-sizes", default=None, help="default 32,64,128 (64 with --quick)")
    ap.add_argument("--axes", default="-2,-1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="timed runs per measurement (default 7, 5 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 2, 1 with --quick)")
    ap.add_argument("--fit-range", action="store_true", help="also time compression with fitted ranges (fit_range)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    dtypes = [getattr(torch, s) for s in args.dtypes.split(",")]
    bits_list = [int(b) for b in args.bits.split(",")]
    groups = [int(g) for g in (args.group_sizes or ("64" if args.quick else "32,64,128")).split(",")]
    axes = [int(a) for a in args.axes.split(",")]
    reps = args.reps or (5 if args.quick else 7)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)

    info = machine_info(args.threads)
    print(
        f"nexuskv NQ vs plain PyTorch on {info['cpu_model']} ({info['cpu_count']} cores), "
        f"torch {info['torch']} ({info['torch_cpu_capability']}), torch.set_num_threads({args.threads})"
    )
    if info["load_1min_at_start"] > 1.0:
        # Other processes on the cores slow the OpenMP baseline far more than they slow a
        # single-threaded kernel (threads wait at barriers for a descheduled peer).
        print(
            f"WARNING: load average {info['load_1min_at_start']:.2f} before the run: other processes "
            "share the cores and the timings (the multi-threaded baseline most) are not reliable"
        )
    print(
        f"shape {list(shape)}, GB/s of the uncompressed tensor in its dtype, median of {reps} runs "
        f"after {warmup} warmup; k = num_outliers (torch baseline has none, so k=1 rows compare "
        f"against the k=0 baseline)\n"
    )

    gen = torch.Generator().manual_seed(0)
    rows = []
    t_start = time.perf_counter()
    with torch.inference_mode():
        for dtype in dtypes:
            x = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
            for axis in axes:
                for bits in bits_list:
                    for g in groups:
                        for k in (0, 1):
                            rows.append(
                                bench_config(x, bits, g, axis, k, warmup, reps, (k == 0), fit_range=args.fit_range)
                            )
    elapsed = time.perf_counter() - t_start
    print_table(rows)
    if args.fit_range:
        print("\ncompress with fitted ranges (nq_compress(..., fit_range=True)) against min/max:\n")
        print("| dtype | axis | bits | group | k | min/max ms | fitted ms | fitted / min/max |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['dtype']} | {r['axis']} | {r['bits']} | {r['group_size']} | {r['num_outliers']} | "
                f"{r['ours_compress_s'] * 1e3:.3f} | {r['fit_compress_s'] * 1e3:.3f} | {r['fit_over_minmax']:.2f}x |"
            )

    four = [r for r in rows if r["bits"] == 4 and "compress_speedup" in r]
    summary = {}
    if four:
        summary = {
            "min_compress_speedup_4bit": min(r["compress_speedup"] for r in four),
            "min_decompress_speedup_4bit": min(r["decompress_speedup"] for r in four),
            "median_compress_speedup_4bit": statistics.median(r["compress_speedup"] for r in four),
            "median_decompress_speedup_4bit": statistics.median(r["decompress_speedup"] for r in four),
        }
        print(
            "\n4-bit speedup over plain PyTorch: compress min {min_compress_speedup_4bit:.1f}x "
            "(median {median_compress_speedup_4bit:.1f}x), decompress min {min_decompress_speedup_4bit:.1f}x "
            "(median {median_decompress_speedup_4bit:.1f}x)".format(**summary)
        )
    bad = [r for r in rows if not (r["check"]["ours_ok"] and r["check"].get("agree", True))]
    print(f"checks: {len(rows) - len(bad)}/{len(rows)} configs agree; {elapsed:.0f} s")

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    info["load_1min_at_end"] = os.getloadavg()[0]
    out.write_text(
        json.dumps(
            {
                "machine": info,
                "shape": list(shape),
                "reps": reps,
                "warmup": warmup,
                "units": "GB/s = 1e9 bytes of the uncompressed tensor (input dtype) per second",
                "summary": summary,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
