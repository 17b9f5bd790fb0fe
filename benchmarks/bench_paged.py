"""CPU paged attention (the kernel behind the vLLM backend): nexuskv.paged.attention over
compressed pages against torch's scaled_dot_product_attention (SDPA) over dense bfloat16 K/V of
the same tokens, side by side in one run.  SDPA is timed in the faster of two honest forms:
enable_gqa=True, and for decode also "fold" (the q heads of a kv group as query rows of that kv
head, no mask needed); the table names the one used.

Shapes: smollm-like (9 q / 3 kv heads, d64: SmolLM2-135M, the model of the vLLM tests) and
llama-like (32 q / 8 kv heads, d128); decode (one query per request) over a ragged-free batch,
and prefill (the whole prompt as queries, causal).  Pages of 16 tokens, blocks of a request in
a shuffled order (as a serving engine hands them out), format 4-bit keys and values, group 64,
rotation on (the vLLM backend's default); --bits 2 for 2-bit.  Each time is the median of
repeated calls (about --budget seconds each, at least 5) after 2 warmup calls, with
torch.set_num_threads(--threads).  The bytes column is what one call reads of the cache (every
scale and zero counted) against bf16.

Every run checks the paged output against SDPA over the dequantized pages in float64 (max
error < 2e-2 of the value range), so that the times compare the same attention.

With --baseline DIR the paged calls run in two worker processes, this environment's nexuskv and
the package found in DIR (a copy of an earlier install, e.g. before a kernel change), their
calls alternating one by one (benchmarks/paired.py): --reps calls each, and the speed-up is the
median of the per-pair ratios, which a shared machine's slow spells move far less than the
times themselves.

    python benchmarks/bench_paged.py                     # ~1-2 min on 2 cores
    python benchmarks/bench_paged.py --json results/bench_paged.json
    python benchmarks/bench_paged.py --baseline /tmp/old # side by side with an older install

With --instructions the script counts instead of timing (the count does not move with the
machine's load): valgrind's callgrind runs two decode cases (1 x 4096 tokens, both shapes) on one
thread, collecting only inside the kernel (`--toggle-collect` of paged_attention_task: the
task loop, its inlined and called helpers; not torch's argument checks or the thread pool),
and the table gives executed instructions per call and per (key, kv head), for this install
and, with --baseline, the older one.  Each count is one valgrind run (about two minutes,
most of it importing torch under valgrind); AVX2 and generic kernels only (Debian's valgrind
3.19 has no AVX-512).

    python benchmarks/bench_paged.py --instructions --baseline /tmp/old --json results/paged_instructions.json

With --exact-window W the same cases also run over pages with an exact window of W tokens (the
queries' newest W keys and values read unquantized: their own rows passed in, older ones from the
blocks' rings), timed beside the plain pages, and checked against float64 likewise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import nexuskv
from nexuskv import paged

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import Worker, paired_speedup, paired_times  # noqa: E402

SHAPES = {"smollm": (9, 3, 64), "llama": (32, 8, 128)}
# (shape, requests, context, queries per request)
CASES = [
    ("smollm", 1, 300, 1),
    ("smollm", 4, 300, 1),
    ("smollm", 8, 300, 1),
    ("smollm", 1, 4096, 1),
    ("smollm", 1, 256, 256),
    ("smollm", 4, 256, 256),
    ("llama", 1, 4096, 1),
    ("llama", 8, 4096, 1),
    ("llama", 1, 16384, 1),
    ("llama", 1, 512, 512),
]
BLOCK = 16  # tokens per block (--block)
# The decode cases --instructions counts (each install's count is a valgrind run of ~2 minutes).
INSTRUCTION_CASES = [("smollm", 1, 4096, 1), ("llama", 1, 4096, 1)]


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def timeit(fn, budget: float) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    reps = max(5, int(budget / once))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build(shape, reqs, ctx, qlen, fmt, gen):
    hq, hkv, d = SHAPES[shape]
    dt = torch.bfloat16
    per_req = (ctx + BLOCK - 1) // BLOCK
    blocks = torch.randperm(reqs * per_req, generator=gen).to(torch.int32).reshape(reqs, per_req)
    pages = torch.zeros(reqs * per_req, hkv, BLOCK, fmt.slot_bytes(d, dt, BLOCK), dtype=torch.uint8)
    slots = (blocks.long()[:, :, None] * BLOCK + torch.arange(BLOCK)).reshape(reqs, -1)[:, :ctx].reshape(-1)
    k = torch.randn(reqs * ctx, hkv, d, generator=gen).to(dt)
    v = torch.randn(reqs * ctx, hkv, d, generator=gen).to(dt)
    signs = fmt.signs(d)
    paged.write_(pages, k, v, slots, fmt, signs)
    q = torch.randn(reqs * qlen, hq, d, generator=gen).to(dt)
    seq = torch.full((reqs,), ctx, dtype=torch.int32)
    qsl = torch.arange(reqs + 1, dtype=torch.int32) * qlen
    b = dict(pages=pages, table=blocks, seq=seq, qsl=qsl, q=q, k=k, v=v, signs=signs, slots=slots)
    if fmt.exact_window:
        # The rings after the earlier steps (a full ring per block), the queries' own rows passed in.
        own = (torch.arange(reqs)[:, None] * ctx + torch.arange(ctx - qlen, ctx)).reshape(-1)
        older = torch.ones(reqs * ctx, dtype=torch.bool)
        older[own] = False
        paged.write_exact_(pages, k[older], v[older], slots[older], fmt)
        b.update(own_k=k[own], own_v=v[own])
    return b


def case_data(index: int, fmt):
    """The pages and queries of CASES[index] (the same in every process: seeded by the index)."""
    shape, reqs, ctx, qlen = CASES[index]
    return build(shape, reqs, ctx, qlen, fmt, torch.Generator().manual_seed(index))


def paged_call(b, fmt):
    own = dict(key=b["own_k"], value=b["own_v"]) if fmt.exact_window else {}
    return paged.attention(b["q"], b["pages"], b["table"], b["seq"], b["qsl"], fmt, b["signs"], **own)


def worker() -> int:
    """--worker: reads 'config index bits threads' or 'time' lines, answers one line each."""
    b = fmt = None
    for line in sys.stdin:
        words = line.split()
        if words[0] == "config":
            index, bits, threads = map(int, words[1:4])
            torch.set_num_threads(threads)
            fmt = paged.PagedFormat(bits, bits, 64)
            b = case_data(index, fmt)
            for _ in range(2):
                paged_call(b, fmt)
            print("ready", flush=True)
        elif words[0] == "time":
            paged_call(b, fmt)  # untimed: wakes the thread pool and the caches after the other worker's turn
            t0 = time.perf_counter()
            paged_call(b, fmt)
            print(f"{(time.perf_counter() - t0) * 1e6:.1f}", flush=True)
    return 0


def count_worker(index: int, bits: int, calls: int) -> int:
    """--count-worker: `calls` paged calls of CASES[index] on one thread (run under callgrind)."""
    torch.set_num_threads(1)
    fmt = paged.PagedFormat(bits, bits, 64)
    b = case_data(index, fmt)
    for _ in range(calls):
        paged_call(b, fmt)
    return 0


def kernel_instructions(index: int, bits: int, path: str | None, calls: int = 4) -> float:
    """Instructions executed inside paged_attention_task per call of CASES[index] (callgrind)."""
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--toggle-collect=bool nexuskv::core::paged_attention_task*",
            f"--callgrind-out-file={out}",
        ]
        cmd += [sys.executable, __file__, "--count-worker", str(index), str(bits), str(calls)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        text = Path(out).read_text()
    m = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
    if not m or int(m.group(1)) == 0:
        raise RuntimeError(f"callgrind counted nothing inside paged_attention_task for case {index}")
    return int(m.group(1)) / calls


def instructions_table(args) -> int:
    if not shutil.which("valgrind"):
        print("valgrind is not installed (apt-get install valgrind)")
        return 1
    installs = [("this", None)] + ([("baseline", args.baseline)] if args.baseline else [])
    rows = []
    print(
        f"{'shape':7} {'req':>3} {'ctx':>6} "
        + "".join(f"{n + ' instr/call':>20} {'per key-head':>13}" for n, _ in installs)
    )
    for index, (shape, reqs, ctx, qlen) in enumerate(CASES):
        if (shape, reqs, ctx, qlen) not in INSTRUCTION_CASES:
            continue
        hkv = SHAPES[shape][1]
        counts = {name: kernel_instructions(index, args.bits, path) for name, path in installs}
        row = dict(shape=shape, requests=reqs, context=ctx, bits=args.bits)
        for name, n in counts.items():
            row[f"{name}_instructions_per_call"] = n
            row[f"{name}_instructions_per_key_head"] = n / (reqs * ctx * hkv)
        rows.append(row)
        cells = "".join(f"{n:>20,.0f} {n / (reqs * ctx * hkv):>13.1f}" for n in counts.values())
        print(f"{shape:7} {reqs:>3} {ctx:>6} " + cells, flush=True)
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=cpu_model(),
        kernel="avx512" if "avx512f" in cpu_flags() else "avx2" if "avx2" in cpu_flags() else "generic",
        counter="valgrind callgrind, instructions inside paged_attention_task, 1 thread",
        baseline=args.baseline,
        bits=args.bits,
    )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def dequantized(b, reqs, ctx, hkv, d, fmt):
    """K and V [reqs, hkv, ctx, d] in float64 as the pages hold them: a slot is what
    nq_compress(row, bits, group, axis=-1) gives for the (rotated, rounded) row."""
    out = []
    for x, bits in ((b["k"], fmt.key_bits), (b["v"], fmt.value_bits)):
        rows = x.reshape(-1, d)
        if fmt.rotate:
            rows = torch.ops.nexuskv.hadamard_rotate(rows.float(), b["signs"]).to(x.dtype)
        parts = torch.ops.nexuskv.nq_compress(rows, bits, fmt.group_size, -1, 0)
        z = torch.ops.nexuskv.nq_decompress(*parts, bits, fmt.group_size, -1, d, torch.float32)
        out.append(z.double().reshape(reqs, ctx, hkv, d).transpose(1, 2))
    return out


def reference(b, reqs, ctx, qlen, shape, fmt):
    """float64 attention over what the pages hold (the newest exact_window keys of each query
    exact), in the kernel's rotated space: [reqs, hq, qlen, d]."""
    hq, hkv, d = SHAPES[shape]
    kq, vq = dequantized(b, reqs, ctx, hkv, d, fmt)
    if fmt.exact_window:
        kx, vx = (b[n].double().reshape(reqs, ctx, hkv, d).transpose(1, 2) for n in ("k", "v"))
        if fmt.rotate:
            kx, vx = (torch.ops.nexuskv.hadamard_rotate(x.float(), b["signs"]).double() for x in (kx, vx))
    qd = b["q"].reshape(reqs, qlen, hq, d).transpose(1, 2).float()
    qr = (torch.ops.nexuskv.hadamard_rotate(qd, b["signs"]) if fmt.rotate else qd).double()
    kq, vq = (x.repeat_interleave(hq // hkv, 1) for x in (kq, vq))
    s = qr @ kq.transpose(-1, -2) / d**0.5
    qpos, kpos = torch.arange(ctx - qlen, ctx)[:, None], torch.arange(ctx)[None, :]
    exact = (kpos > qpos - fmt.exact_window) & (kpos <= qpos)
    if fmt.exact_window:
        kx, vx = (x.repeat_interleave(hq // hkv, 1) for x in (kx, vx))
        s = torch.where(exact, qr @ kx.transpose(-1, -2) / d**0.5, s)
    p = torch.softmax(s.masked_fill(kpos > qpos, float("-inf")), -1)
    out = (p * ~exact) @ vq + ((p * exact) @ vx if fmt.exact_window else 0)
    return torch.ops.nexuskv.hadamard_rotate(out.float(), b["signs"], True).double() if fmt.rotate else out


def main() -> None:
    global BLOCK
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per measurement")
    ap.add_argument("--json", default="results/bench_paged.json")
    ap.add_argument("--baseline", default=None, help="directory holding an older nexuskv package to time beside")
    ap.add_argument("--reps", type=int, default=31, help="with --baseline: timed calls per case and install")
    ap.add_argument("--instructions", action="store_true", help="count the kernel's instructions (callgrind)")
    ap.add_argument("--exact-window", type=int, default=0, help="also time pages with an exact window of W tokens")
    ap.add_argument("--block", type=int, default=16, help="tokens per block (vLLM's CPU default: 128)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--count-worker", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker()
    if args.count_worker:
        return count_worker(*args.count_worker)
    if args.instructions:
        return instructions_table(args)
    torch.set_num_threads(args.threads)
    BLOCK = args.block
    fmt = paged.PagedFormat(args.bits, args.bits, 64)
    fmt_w = dataclasses.replace(fmt, exact_window=args.exact_window) if args.exact_window else None
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    rows = []
    workers = [Worker(__file__, None), Worker(__file__, args.baseline)] if args.baseline else []
    head = ("shape", "req", "ctx", "q/req", "paged us", "SDPA bf16 us", "form", "ratio", "bytes")
    if workers:
        head += ("baseline us", "speed-up")
    if fmt_w:
        head += (f"window {args.exact_window} us", "vs paged")
    print(
        "{:7} {:>3} {:>6} {:>5} {:>10} {:>13} {:>5} {:>6} {:>6}".format(*head[:9])
        + "".join(f" {h:>11}" for h in head[9:])
    )
    for index, (shape, reqs, ctx, qlen) in enumerate(CASES):
        hq, hkv, d = SHAPES[shape]
        b = case_data(index, fmt)

        def run_paged():
            return paged_call(b, fmt)

        # Dense: K/V [reqs, hkv, ctx, d] bf16, q [reqs, hq, qlen, d]; causal for prefill (q at the end).
        kd = b["k"].reshape(reqs, ctx, hkv, d).transpose(1, 2).contiguous()
        vd = b["v"].reshape(reqs, ctx, hkv, d).transpose(1, 2).contiguous()
        qd = b["q"].reshape(reqs, qlen, hq, d).transpose(1, 2).contiguous()
        causal = qlen > 1  # prefill: the queries are the whole context (qlen == ctx)

        def run_sdpa_gqa():
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=True)

        # Decode also as "fold": the q heads of a kv group as query rows of one kv head (no mask).
        qf = qd.reshape(reqs, hkv, (hq // hkv) * qlen, d)

        def run_sdpa_fold():
            return F.scaled_dot_product_attention(qf, kd, vd)

        sdpa = {"gqa": run_sdpa_gqa} if causal else {"gqa": run_sdpa_gqa, "fold": run_sdpa_fold}

        got = run_paged().double().reshape(reqs, qlen, hq, d).transpose(1, 2)
        kq, vq = dequantized(b, reqs, ctx, hkv, d, fmt)
        qr = torch.ops.nexuskv.hadamard_rotate(qd.float(), b["signs"]) if fmt.rotate else qd.float()
        want = F.scaled_dot_product_attention(qr.double(), kq, vq, is_causal=causal, enable_gqa=True)
        if fmt.rotate:
            want = torch.ops.nexuskv.hadamard_rotate(want.float(), b["signs"], True).double()
        err = float((got - want).abs().max() / vq.abs().max())
        assert err < 2e-2, (shape, reqs, ctx, qlen, err)
        window = {}
        if fmt_w:
            bw = case_data(index, fmt_w)
            got_w = paged_call(bw, fmt_w).double().reshape(reqs, qlen, hq, d).transpose(1, 2)
            err_w = float((got_w - reference(bw, reqs, ctx, qlen, shape, fmt_w)).abs().max() / vq.abs().max())
            assert err_w < 2e-2, (shape, reqs, ctx, qlen, "exact window", err_w)
            window = dict(window_us=timeit(lambda: paged_call(bw, fmt_w), args.budget) * 1e6, window_rel_error=err_w)

        paired = {}
        if workers:
            _, times = paired_times(workers, f"config {index} {args.bits} {args.threads}", args.reps)
            tp = statistics.median(times[0]) * 1e-6
            paired = dict(baseline_us=statistics.median(times[1]), speedup=paired_speedup(times), times_us=times)
        else:
            tp = timeit(run_paged, args.budget)
        sdpa_times = {name: timeit(fn, args.budget) for name, fn in sdpa.items()}
        sdpa_form, ts = min(sdpa_times.items(), key=lambda kv: kv[1])  # the faster honest formulation
        byte_ratio = fmt.slot_bytes(d, torch.bfloat16) / (4 * d)
        rows.append(
            dict(
                shape=shape,
                requests=reqs,
                context=ctx,
                queries_per_request=qlen,
                paged_us=tp * 1e6,
                sdpa_bf16_us=ts * 1e6,
                sdpa_form=sdpa_form,
                paged_over_sdpa=tp / ts,
                bytes_vs_bf16=byte_ratio,
                max_rel_error=err,
                **paired,
                **window,
            )
        )
        line = (shape, reqs, ctx, qlen, f"{tp * 1e6:.0f}", f"{ts * 1e6:.0f}", sdpa_form, f"{tp / ts:.2f}")
        tail = f" {paired['baseline_us']:>11.0f} {paired['speedup']:>10.2f}x" if paired else ""
        tail += f" {window['window_us']:>11.0f} {window['window_us'] / (tp * 1e6):>8.2f}" if window else ""
        print("{:7} {:>3} {:>6} {:>5} {:>10} {:>13} {:>5} {:>6} {:>6.3f}".format(*line, byte_ratio) + tail, flush=True)
    for w in workers:
        w.close()
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=cpu_model(),
        threads=args.threads,
        torch=torch.__version__,
        nexuskv_file=nexuskv.__file__,
        bits=args.bits,
        exact_window=args.exact_window,
        block=BLOCK,
        baseline=args.baseline,
        loadavg_before=load_before,
        loadavg_after=load_after,
    )
    print(f"load average before {' '.join(load_before)}, after {' '.join(load_after)}; {meta['date']}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
