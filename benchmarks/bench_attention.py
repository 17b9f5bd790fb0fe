"""CPU decode attention: nexuskv dgq_fused_attention on the compressed cache
against torch's scaled_dot_product_attention (SDPA) on the dense cache.

For every (model shape, batch, context) this times, side by side in one run:

  fused     nexuskv.ops.dgq_fused_attention straight from the NQ cache at 8, 4
            and 2 bits: keys per channel (axis -2), values per token (axis -1),
            group 64, no outliers, no full-precision tail (every token is in the
            compressed cache), compressed_lens = context.  Timed once with a
            float32 query and once with a bfloat16 query (on AVX512-VNNI the
            key scores carry q as 3 int8 limbs for float32, 2 for bfloat16, so
            float32 q costs a little more); the table shows both, and the
            speedup over dense SDPA uses the fused time with q in the dtype of
            the faster SDPA.
  SDPA      F.scaled_dot_product_attention on dense K/V in float32 and in
            bfloat16, in the faster of two honest formulations, both timed:
            "fold" (q [B, Hq, 1, D] viewed as [B, Hkv, Hq/Hkv, D], the query
            heads of one KV group folded into the query-length dim, against
            K/V [B, Hkv, T, D]) and "gqa" (enable_gqa=True).
  deq+SDPA  nq_decompress of K and V to bfloat16 (timed inside), then the same
            SDPA call in bfloat16 (the faster formulation found above).

q_len is 1 (decode), so no mask is needed.  Each time is the median of
repeated runs after 2 warmup runs, the repetitions chosen so that one
measurement takes about --budget seconds (min 3), with
torch.set_num_threads(--threads, default 2).  Once per config and bit width the
fused output (float32 q) is checked against dequantize-then-SDPA in float32
(relative error < 1e-3), so that the comparison is honest.

Peak extra memory of each path: the peak of bytes allocated through torch's
CPU allocator during one call (torch.profiler, profile_memory=True, its raw
allocation/free records accumulated in time order; see peak_extra_bytes for why
not the per-op cpu_memory_usage); inputs (q, dense or compressed K/V) exist
before the call and are not counted, the output is.

    python benchmarks/bench_attention.py            # full grid, ~5-8 min on 2 cores
    python benchmarks/bench_attention.py --quick    # 1K and 4K, batch 1, 4-bit, < 30 s
    python benchmarks/bench_attention.py --json out.json --png out.png
    python benchmarks/bench_attention.py --device cuda   # the GPU benchmark: benchmarks/bench_cuda.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import nexuskv
from nexuskv import profiling
from nexuskv.ops import dgq_fused_attention
from nexuskv.profiling import peak_allocated_bytes

KEY_AXIS, VALUE_AXIS = -2, -1

# name: (q_heads, kv_heads, head_dim)
SHAPES = {"llama-like": (32, 8, 128), "smollm-like": (9, 3, 64)}

MiB = float(1 << 20)


# ---- timing and memory ------------------------------------------------------------------


def median_time(fn, warmup: int, budget: float, min_reps: int, max_reps: int) -> tuple[float, int]:
    """Median seconds of fn over reps runs, reps ~ budget / (one run), in [min_reps, max_reps]."""
    t_one = float("inf")
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        t_one = min(t_one, time.perf_counter() - t0)
    reps = max(min_reps, min(max_reps, int(budget / max(t_one, 1e-9))))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), reps


peak_extra_bytes = peak_allocated_bytes  # see nexuskv.profiling


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ---- the paths ------------------------------------------------------------------------------


def sdpa_fold(q, k, v):
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    out = F.scaled_dot_product_attention(q.view(B, Hkv, Hq // Hkv, D), k, v)
    return out.view(B, Hq, 1, D)


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


SDPA = {"fold": sdpa_fold, "gqa": sdpa_gqa}


def decompress_kv(kc, vc, bits, group, head_dim, dtype):
    k = nexuskv.nq_decompress(*kc, bits, group, KEY_AXIS, head_dim, dtype)
    v = nexuskv.nq_decompress(*vc, bits, group, VALUE_AXIS, head_dim, dtype)
    return k, v


def bench_context(shape_name, batch, ctx, bits_list, group, gen, tm):
    """All paths for one (shape, batch, context); returns one row per bit width."""
    hq, hkv, d = SHAPES[shape_name]
    k32 = torch.randn(batch, hkv, ctx, d, generator=gen)
    k32[..., 3] += 4.0  # an offset key channel, as real keys have
    v32 = torch.randn(batch, hkv, ctx, d, generator=gen)
    q32 = torch.randn(batch, hq, 1, d, generator=gen)
    k16, v16, q16 = k32.bfloat16(), v32.bfloat16(), q32.bfloat16()
    lens = torch.full((batch,), ctx, dtype=torch.int64)
    base = {
        "shape": shape_name,
        "q_heads": hq,
        "kv_heads": hkv,
        "head_dim": d,
        "batch": batch,
        "context": ctx,
        "q_len": 1,
        "group_size": group,
        "dense_bf16_kv_bytes": nbytes((k16, v16)),
        "dense_fp32_kv_bytes": nbytes((k32, v32)),
    }

    # Dense SDPA: both formulations in both dtypes, keep the faster per dtype.
    sdpa = {}
    for dname, (q, k, v) in {"float32": (q32, k32, v32), "bfloat16": (q16, k16, v16)}.items():
        times = {}
        for form, fn in SDPA.items():
            times[form], _ = tm(lambda: fn(q, k, v))
        best = min(times, key=times.get)
        extra = peak_extra_bytes(lambda: SDPA[best](q, k, v))
        sdpa[dname] = {
            "ms": times[best] * 1e3,
            "form": best,
            "fold_ms": times["fold"] * 1e3,
            "gqa_ms": times["gqa"] * 1e3,
            "extra_mib": extra / MiB,
        }
    best_dtype = min(sdpa, key=lambda n: sdpa[n]["ms"])
    bf16_sdpa = SDPA[sdpa["bfloat16"]["form"]]
    fp32_sdpa = SDPA[sdpa["float32"]["form"]]

    rows = []
    for bits in bits_list:
        # The cache is compressed from the bf16 K/V (bf16 scale/zero), as a bf16 model would.
        kc16 = nexuskv.nq_compress(k16, bits, group, KEY_AXIS)
        vc16 = nexuskv.nq_compress(v16, bits, group, VALUE_AXIS)
        kf, vf = [bits, group, KEY_AXIS], [bits, group, VALUE_AXIS]

        def fused(q):
            return dgq_fused_attention(q, kc16, vc16, kf, vf, lens)

        def deq_sdpa():
            k, v = decompress_kv(kc16, vc16, bits, group, d, torch.bfloat16)
            return bf16_sdpa(q16, k, v)

        # Correctness guard: fused (float32 q) vs dequantize-to-float32-then-SDPA-float32.
        kd, vd = decompress_kv(kc16, vc16, bits, group, d, torch.float32)
        ref = fp32_sdpa(q32, kd, vd)
        del kd, vd
        err = rel_err(fused(q32), ref)
        err_bf16 = rel_err(deq_sdpa(), ref)  # informative: what bf16 dequantization costs
        del ref

        t_f32, reps_f = tm(lambda: fused(q32))
        t_f16, _ = tm(lambda: fused(q16))
        t_deq, reps_d = tm(deq_sdpa)
        mem_fused = peak_extra_bytes(lambda: fused(q16))
        mem_deq = peak_extra_bytes(deq_sdpa)
        comp = nbytes(kc16) + nbytes(vc16)
        fused_same_q = t_f32 if best_dtype == "float32" else t_f16
        row = dict(base)
        row.update(
            {
                "bits": bits,
                "compressed_kv_bytes": comp,
                "effective_bits": 8.0 * comp / (k16.numel() + v16.numel()),
                "fused_f32q_ms": t_f32 * 1e3,
                "fused_bf16q_ms": t_f16 * 1e3,
                "fused_reps": reps_f,
                "sdpa_fp32_ms": sdpa["float32"]["ms"],
                "sdpa_fp32_form": sdpa["float32"]["form"],
                "sdpa_fp32_fold_ms": sdpa["float32"]["fold_ms"],
                "sdpa_fp32_gqa_ms": sdpa["float32"]["gqa_ms"],
                "sdpa_bf16_ms": sdpa["bfloat16"]["ms"],
                "sdpa_bf16_form": sdpa["bfloat16"]["form"],
                "sdpa_bf16_fold_ms": sdpa["bfloat16"]["fold_ms"],
                "sdpa_bf16_gqa_ms": sdpa["bfloat16"]["gqa_ms"],
                "best_sdpa_dtype": best_dtype,
                "best_sdpa_ms": sdpa[best_dtype]["ms"],
                "deq_sdpa_ms": t_deq * 1e3,
                "deq_reps": reps_d,
                "speedup_vs_best_sdpa": sdpa[best_dtype]["ms"] / (fused_same_q * 1e3),
                "speedup_vs_deq_sdpa": t_deq / t_f16,
                "extra_mib_fused": mem_fused / MiB,
                "extra_mib_deq_sdpa": mem_deq / MiB,
                "extra_mib_sdpa_fp32": sdpa["float32"]["extra_mib"],
                "extra_mib_sdpa_bf16": sdpa["bfloat16"]["extra_mib"],
                "rel_err_fused_vs_deq_fp32": err,
                "rel_err_deq_bf16_vs_deq_fp32": err_bf16,
                "check_ok": err < 1e-3,
            }
        )
        rows.append(row)
    return rows


# ---- reporting ------------------------------------------------------------------------------


def load_1min() -> float | None:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


machine_info = profiling.machine_info


def ctx_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def print_table(rows, header: bool = True) -> None:
    hdr = (
        f"{'ctx':>4}{'B':>3} {'shape':<12}{'bits':>4}{'eff':>5} | {'fused':>8}{'f32 q':>7}{'sdpa f32':>10}"
        f"{'sdpa bf16':>11}"
        f"{'deq+sdpa':>10} | {'x best':>7}{'x deq':>7} | {'MiB fused':>10}{'deq+sdpa':>9}{'sdpa':>7} | "
        f"{'KV MiB: NQ':>10}{'bf16':>8} | {'err':>7}"
    )
    if header:
        print(hdr)
        print("-" * len(hdr))
    for r in rows:
        forms = f"{r['sdpa_fp32_form'][0]}{r['sdpa_bf16_form'][0]}"
        best_mib = r["extra_mib_sdpa_fp32" if r["best_sdpa_dtype"] == "float32" else "extra_mib_sdpa_bf16"]
        print(
            f"{ctx_label(r['context']):>4}{r['batch']:>3} {r['shape']:<12}{r['bits']:>4}{r['effective_bits']:5.2f} | "
            f"{r['fused_bf16q_ms']:8.2f}{r['fused_f32q_ms']:7.2f}"
            f"{r['sdpa_fp32_ms']:10.2f}{r['sdpa_bf16_ms']:8.2f} {forms}"
            f"{r['deq_sdpa_ms']:10.2f} | {r['speedup_vs_best_sdpa']:6.2f}x{r['speedup_vs_deq_sdpa']:6.2f}x | "
            f"{r['extra_mib_fused']:10.3f}{r['extra_mib_deq_sdpa']:9.1f}{best_mib:7.2f} | "
            f"{r['compressed_kv_bytes'] / MiB:10.1f}{r['dense_bf16_kv_bytes'] / MiB:8.1f} | "
            f"{r['rel_err_fused_vs_deq_fp32']:7.1e}{'' if r['check_ok'] else ' FAIL'}"
        )


def summarize(rows, target_ctx: int, target_bits: int) -> dict:
    """The issue's targets at target_bits and target_ctx, per (shape, batch), and whether the
    fused path's extra memory stays flat across contexts (does not grow from the second-smallest
    context up: within 5% + 64 KiB)."""
    out = {
        "target": f"{target_bits}-bit at {ctx_label(target_ctx)}: fused >= 2x the faster dense SDPA, "
        f">= 3x dequantize-then-SDPA, extra memory independent of context",
        "configs": [],
    }
    keys = sorted({(r["shape"], r["batch"]) for r in rows})
    for shape, batch in keys:
        sel = sorted(
            (r for r in rows if r["shape"] == shape and r["batch"] == batch and r["bits"] == target_bits),
            key=lambda r: r["context"],
        )
        if not sel:
            continue
        mems = {r["context"]: r["extra_mib_fused"] for r in sel}
        ctxs = sorted(mems)
        ref_ctx = ctxs[1] if len(ctxs) > 1 else ctxs[0]
        flat = all(mems[c] <= mems[ref_ctx] * 1.05 + 1 / 16 for c in ctxs if c >= ref_ctx)
        deq_mems = {r["context"]: r["extra_mib_deq_sdpa"] for r in sel}
        at = [r for r in sel if r["context"] == target_ctx]
        c = {
            "shape": shape,
            "batch": batch,
            "fused_extra_mib_by_context": mems,
            "deq_sdpa_extra_mib_by_context": deq_mems,
            "fused_memory_flat": flat,
        }
        if at:
            r = at[0]
            form = r["sdpa_fp32_form" if r["best_sdpa_dtype"] == "float32" else "sdpa_bf16_form"]
            c.update(
                speedup_vs_best_sdpa=r["speedup_vs_best_sdpa"],
                speedup_vs_deq_sdpa=r["speedup_vs_deq_sdpa"],
                best_sdpa=f"{r['best_sdpa_dtype']} {form}",
                met=bool(r["speedup_vs_best_sdpa"] >= 2 and r["speedup_vs_deq_sdpa"] >= 3 and flat),
            )
        out["configs"].append(c)
    return out


def plot(rows, path: Path, info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    keys = sorted({(r["shape"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(
        2, len(keys), figsize=(4.2 * len(keys), 7.5), squeeze=False, gridspec_kw={"height_ratios": [2, 1]}
    )
    styles = {8: ("tab:blue", "-"), 4: ("tab:orange", "-"), 2: ("tab:green", "-")}
    for j, (shape, batch) in enumerate(keys):
        ax, axm = axes[0][j], axes[1][j]
        sel = [r for r in rows if r["shape"] == shape and r["batch"] == batch]
        ctxs = sorted({r["context"] for r in sel})
        for bits in sorted({r["bits"] for r in sel}, reverse=True):
            rb = sorted((r for r in sel if r["bits"] == bits), key=lambda r: r["context"])
            col, ls = styles.get(bits, ("tab:gray", "-"))
            ax.plot(
                [r["context"] for r in rb],
                [r["fused_bf16q_ms"] for r in rb],
                ls,
                color=col,
                marker="o",
                label=f"fused {bits}-bit",
            )
            axm.plot(
                [r["context"] for r in rb],
                [r["extra_mib_fused"] for r in rb],
                ls,
                color=col,
                marker="o",
                label=f"fused {bits}-bit",
            )
        first = {c: next(r for r in sel if r["context"] == c) for c in ctxs}
        ax.plot(ctxs, [first[c]["sdpa_fp32_ms"] for c in ctxs], "--", color="black", marker="s", label="SDPA fp32")
        ax.plot(ctxs, [first[c]["sdpa_bf16_ms"] for c in ctxs], "--", color="tab:purple", marker="s", label="SDPA bf16")
        deq_bits = 4 if any(r["bits"] == 4 for r in sel) else sel[0]["bits"]
        rd = sorted((r for r in sel if r["bits"] == deq_bits), key=lambda r: r["context"])
        ax.plot(
            [r["context"] for r in rd],
            [r["deq_sdpa_ms"] for r in rd],
            ":",
            color="tab:red",
            marker="^",
            label=f"deq+SDPA {deq_bits}-bit (bf16)",
        )
        axm.plot(
            [r["context"] for r in rd],
            [r["extra_mib_deq_sdpa"] for r in rd],
            ":",
            color="tab:red",
            marker="^",
            label=f"deq+SDPA {deq_bits}-bit",
        )
        hq, hkv, d = SHAPES[shape]
        ax.set_title(f"{shape} (GQA {hq}/{hkv}, D={d}), batch {batch}", fontsize=10)
        for a in (ax, axm):
            a.set_xscale("log", base=2)
            a.set_yscale("log")
            a.set_xticks(ctxs)
            a.set_xticklabels([ctx_label(c) for c in ctxs])
            a.xaxis.set_minor_formatter(NullFormatter())
            a.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            a.grid(True, which="both", alpha=0.3)
        ax.set_ylabel("time per call (ms, median)")
        axm.set_ylabel("peak extra memory (MiB)")
        axm.set_xlabel("context (tokens)")
        if j == 0:
            ax.legend(fontsize=8)
            axm.legend(fontsize=8)
    fig.suptitle(
        f"decode attention (q_len 1) on CPU: {info['cpu_model']}, torch.set_num_threads({info['threads']}), "
        f"torch {info['torch']}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--device" in argv:  # --device cuda: the GPU benchmark (bench_cuda.py), its own options
        i = argv.index("--device")
        device = argv[i + 1] if i + 1 < len(argv) else ""
        rest = argv[:i] + argv[i + 2 :]
        if device == "cuda":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import bench_cuda

            return bench_cuda.main(rest)
        if device != "cpu":
            sys.exit(f"bench_attention: --device must be cpu or cuda, got {device!r}")
        argv = rest
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="contexts 1K,4K, batch 1, 4-bit only (< 30 s)")
    ap.add_argument("--json", default="results/bench_attention.json", help="where to write the results")
    ap.add_argument("--png", default="results/bench_attention.png", help="where to draw the plot")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--contexts", default=None, help="default 1024,4096,16384,32768 (1024,4096 with --quick)")
    ap.add_argument("--batches", default=None, help="default 1,8 (1 with --quick)")
    ap.add_argument("--bits", default=None, help="default 8,4,2 (4 with --quick)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="target seconds of timed runs per measurement (default 1.0, 0.5 with --quick)",
    )
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--max-reps", type=int, default=None, help="default 25 (15 with --quick)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    shapes = args.shapes.split(",")
    contexts = [int(c) for c in (args.contexts or ("1024,4096" if args.quick else "1024,4096,16384,32768")).split(",")]
    batches = [int(b) for b in (args.batches or ("1" if args.quick else "1,8")).split(",")]
    bits_list = [int(b) for b in (args.bits or ("4" if args.quick else "8,4,2")).split(",")]
    budget = args.budget if args.budget is not None else (0.5 if args.quick else 1.0)
    max_reps = args.max_reps or (15 if args.quick else 25)

    def tm(fn):
        return median_time(fn, args.warmup, budget, args.min_reps, max_reps)

    info = machine_info(args.threads)
    print(
        f"nexuskv dgq_fused_attention vs torch SDPA on {info['cpu_model']} ({info['cpu_count']} cores), "
        f"torch {info['torch']} ({info['torch_cpu_capability']}), torch.set_num_threads({args.threads})"
    )
    if (info["load_1min_at_start"] or 0) > 0.6 * args.threads / 2:
        print(
            f"WARNING: 1-minute load {info['load_1min_at_start']} at start: another process competes for the "
            f"cores, and {args.threads}-thread torch ops then wait for a descheduled thread (timings unreliable)"
        )
    print(
        f"q_len 1, NQ keys per-channel / values per-token, group {args.group_size}, no outliers, no tail; "
        f"median of >= {args.min_reps} runs (~{budget:g} s each) after {args.warmup} warmup"
    )
    print(
        "fused = bf16 q, f32 q = float32 q (x best uses the q dtype of the faster SDPA); "
        "sdpa bf16 suffix: formulation of "
        "fp32/bf16 (f = heads folded into q_len, g = enable_gqa); deq+sdpa = nq_decompress to bf16 + bf16 SDPA;\n"
        "MiB = peak extra allocation during the call (sdpa = the faster dense one); err = fused vs "
        "deq-to-fp32 + fp32 SDPA (must be < 1e-3)\n"
    )

    gen = torch.Generator().manual_seed(0)
    rows = []
    t_start = time.perf_counter()
    with torch.inference_mode():
        for shape in shapes:
            for batch in batches:
                for ctx in contexts:
                    t0 = time.perf_counter()
                    new = bench_context(shape, batch, ctx, bits_list, args.group_size, gen, tm)
                    print_table(new, header=not rows)
                    rows.extend(new)
                    print(f"{'':>4}   ({time.perf_counter() - t0:.1f} s)", flush=True)
    elapsed = time.perf_counter() - t_start

    target_ctx = 32768 if 32768 in contexts else max(contexts)
    target_bits = 4 if 4 in bits_list else bits_list[0]
    summary = summarize(rows, target_ctx, target_bits)
    print(f"\ntarget: {summary['target']}")
    for c in summary["configs"]:
        mem = ", ".join(f"{ctx_label(k)} {v:.3f}" for k, v in c["fused_extra_mib_by_context"].items())
        dmem = ", ".join(f"{ctx_label(k)} {v:.1f}" for k, v in c["deq_sdpa_extra_mib_by_context"].items())
        s = f"  {c['shape']:<12} batch {c['batch']}: "
        if "met" in c:
            s += (
                f"{c['speedup_vs_best_sdpa']:.2f}x vs best SDPA ({c['best_sdpa']}), "
                f"{c['speedup_vs_deq_sdpa']:.2f}x vs deq+SDPA; "
            )
        s += f"fused extra MiB {mem} ({'flat' if c['fused_memory_flat'] else 'GROWS'}); deq+SDPA MiB {dmem}"
        if "met" in c:
            s += f" -> {'MET' if c['met'] else 'not met'}"
        print(s)
    bad = [r for r in rows if not r["check_ok"]]
    print(f"checks: {len(rows) - len(bad)}/{len(rows)} configs agree (rel err < 1e-3); {elapsed:.0f} s")

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": {**info, "load_1min_at_end": load_1min()},
                "elapsed_s": elapsed,
                "settings": {
                    "shapes": {s: dict(zip(("q_heads", "kv_heads", "head_dim"), SHAPES[s])) for s in shapes},
                    "contexts": contexts,
                    "batches": batches,
                    "bits": bits_list,
                    "group_size": args.group_size,
                    "q_len": 1,
                    "num_outliers": 0,
                    "tail": 0,
                    "key_axis": KEY_AXIS,
                    "value_axis": VALUE_AXIS,
                    "meta_dtype": "bfloat16 (cache compressed from bf16 K/V)",
                    "warmup": args.warmup,
                    "budget_s": budget,
                    "min_reps": args.min_reps,
                    "max_reps": max_reps,
                },
                "units": "ms = median milliseconds per call; "
                "extra_mib = peak MiB allocated through torch's CPU allocator "
                "during one call, inputs excluded; *_kv_bytes = K plus V of the one attention layer timed",
                "summary": summary,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")
    try:
        plot(rows, Path(args.png), info)
        print(f"wrote {args.png}")
    except ImportError as e:  # matplotlib missing: the JSON and the table are the result
        print(f"no plot ({e})")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
