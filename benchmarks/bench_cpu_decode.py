"""CPU decode attention against its memory floor, and the instructions of its inner loops.

For each (shape, batch, context, bits) this times nexuskv's dgq_fused_attention on the
compressed cache (q_len 1, bf16 query, keys per channel and values per token in groups
of 64, no tail, no outliers), and sets it against the memory floor: the compressed bytes
the call must read (codes, scales, zeros) divided by the read bandwidth this machine
reaches in the same run (a float32 sum over a 512 MiB buffer with the same threads).

Timing on shared cores is noisy, so the script also reads what does not depend on the
machine's load: the instructions of the two inner loops of the integer kernels (AVX-512:
attention_int_keys.h / attention_int_values.h; AVX2: their *_avx2.h twins), counted in the
disassembly (objdump) of the libnexuskv.so the run imported.  valgrind (callgrind) would
count executed instructions, but Debian's valgrind 3.19 has no AVX-512, and this machine's
perf has no hardware counters (a virtual machine), so the loops are counted statically: for
each kernel variant (ISA x bits x query rows x limbs) the smallest natural loop of the
function holding every dot product (vpdpbusd, vpmaddwd), its instruction count, and from it
instructions per (token, kv head) at head_dim 128 (loop_counts() says what one iteration
covers), the code around the loop (limb set-up, the per-tile float conversion, softmax)
not included.

Each configuration runs in a worker process; with --baseline DIR a second worker imports
the nexuskv package found in DIR (a copy of an earlier install, e.g. before a kernel
change) and the two workers' calls alternate one by one, so that a slow spell of the
shared machine falls on both alike: the speed-up is the median of the per-pair ratios.

    python benchmarks/bench_cpu_decode.py                      # llama-like and smollm-like, 4K / 32K
    python benchmarks/bench_cpu_decode.py --quick              # 4K, batch 1, < 1 min
    python benchmarks/bench_cpu_decode.py --baseline /tmp/old  # side by side with an older install
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import nexuskv
from nexuskv import profiling
from nexuskv.ops import dgq_fused_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test loads this file by path
from paired import Worker, paired_speedup, paired_times  # noqa: E402

SHAPES = {"llama-like": (32, 8, 128), "smollm-like": (9, 3, 64)}
GROUP = 64


def read_bandwidth(threads: int) -> float:
    """Bytes per second of a float32 sum over 512 MiB (the best of 5)."""
    torch.set_num_threads(threads)
    x = torch.ones(128 << 20, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


class Config:
    """One fused decode call on a compressed cache (the same seed in every process)."""

    def __init__(self, shape: str, batch: int, ctx: int, bits: int, threads: int):
        torch.set_num_threads(threads)
        hq, hkv, d = SHAPES[shape]
        gen = torch.Generator().manual_seed(1000 * ctx + 10 * bits + batch)
        k = torch.randn(batch, hkv, ctx, d, generator=gen)
        k[..., 3] += 4.0  # an offset key channel, as real keys have
        v = torch.randn(batch, hkv, ctx, d, generator=gen)
        self.q = torch.randn(batch, hq, 1, d, generator=gen).bfloat16()
        self.kc = nexuskv.nq_compress(k.bfloat16(), bits, GROUP, -2)
        self.vc = nexuskv.nq_compress(v.bfloat16(), bits, GROUP, -1)
        self.bits = bits
        self.lens = torch.full((batch,), ctx, dtype=torch.int64)
        # What a call must read: codes, scales and zeros of K and V.
        self.bytes_read = sum(t.numel() * t.element_size() for t in list(self.kc[:3]) + list(self.vc[:3]))
        for _ in range(2):
            self.call()

    def call(self):
        b = self.bits
        return dgq_fused_attention(self.q, self.kc, self.vc, [b, GROUP, -2], [b, GROUP, -1], self.lens)

    def time_us(self) -> float:
        """One timed call after an untimed one (which wakes the thread pool and warms the caches
        after the other worker's turn)."""
        self.call()
        t0 = time.perf_counter()
        self.call()
        return (time.perf_counter() - t0) * 1e6


def worker() -> int:
    """--worker: reads 'config shape batch ctx bits threads' or 'time' lines, answers one line each."""
    cfg = None
    for line in sys.stdin:
        words = line.split()
        if words[0] == "config":
            cfg = Config(words[1], *map(int, words[2:6]))
            print(cfg.bytes_read, flush=True)
        elif words[0] == "time":
            print(f"{cfg.time_us():.1f}", flush=True)
    return 0


# ---- static loop counts ---------------------------------------------------------------------


def library_path() -> Path:
    return Path(nexuskv.__file__).parent / "libnexuskv.so"


# The integer kernels whose loops are counted: (function name part, ISA, dot-product instruction).
KERNELS = (
    ("avx512::pv_int_block<", "avx512", "vpdpbusd"),
    ("avx512::int_scores_block<", "avx512", "vpdpbusd"),
    ("avx2::pv_int16_block<", "avx2", "vpmaddwd"),
    ("avx2::int16_scores_keys<", "avx2", "vpmaddwd"),
)


def disassemble(lib: Path) -> dict[str, list[tuple[int, str]]]:
    """{demangled function name: [(address, instruction text)]} of the integer p.V / q.K kernels."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return {}
    text = subprocess.run(
        [objdump, "-d", "-C", "--no-show-raw-insn", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    funcs: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            name = head.group(1)
            keep = any(part in name for part, _, _ in KERNELS)
            current = name if keep and not name.endswith("@plt") else None
            if current:
                funcs[current] = []
            continue
        ins = re.match(r"^\s+([0-9a-f]+):\s+(\S.*)$", line)
        if current and ins:
            funcs[current].append((int(ins.group(1), 16), ins.group(2)))
    return funcs


def token_loop(body: list[tuple[int, str]], dot: str = "vpdpbusd", every: bool = True) -> tuple[int, int] | None:
    """Instructions of the smallest natural loop (a backward jump's range) holding every `dot`
    instruction, and their number; with every=False the smallest loop holding any (the
    innermost of several alike loops: the AVX2 p.V kernel has one token loop per plane, all
    inlined into one function), and the dot products in it."""
    dots = [a for a, t in body if t.startswith(dot)]
    if not dots:
        return None
    best = None
    for addr, text in body:
        m = re.match(r"j\w+\s+([0-9a-f]+)", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        inside = [a for a in dots if target <= a <= addr]
        if target < addr and (len(inside) == len(dots) if every else inside):
            n = sum(1 for a, _ in body if target <= a <= addr)
            if best is None or n < best[0]:
                best = (n, len(inside))
    return best


def loop_counts(lib: Path) -> list[dict]:
    """Per kernel variant: its loop's instructions, dot products, and instructions per (token,
    kv head) at head_dim 128 from what one pass of the loop covers:
      AVX-512 q.K: 4 keys x one chunk (every plane); p.V: 4 tokens x one chunk x the planes of
        one pass (dots / (rows x limbs) of the chunk's 8 / bits planes);
      AVX2 q.K: one key x one chunk (every plane); p.V: 2 tokens x one 16-channel plane (the
        innermost loop: one per plane, alike but for a shift)."""
    rows = []
    for name, body in sorted(disassemble(lib).items()):
        m = re.search(
            r"(avx512|avx2)::(pv_int_block|int_scores_block|pv_int16_block|int16_scores_keys)"
            r"<(\d+), (\d+), (\d+)>",
            name,
        )
        if not m:
            continue
        isa, kind, (a, b, c) = m.group(1), m.group(2), map(int, m.group(3, 4, 5))
        values = kind.startswith("pv_")
        bits, rows_, limbs = (b, a, c) if values else (a, b, c)
        dot = "vpdpbusd" if isa == "avx512" else "vpmaddwd"
        loop = token_loop(body, dot, every=not (values and isa == "avx2"))
        if loop is None:
            continue
        count, dots = loop
        chunks = 128 * bits // 128
        if isa == "avx512":
            passes = (8 // bits) // (dots // (rows_ * limbs)) if values else 1
            per_token = count * chunks * passes / 4
        else:
            passes = 1
            per_token = count * (128 // 16) / 2 if values else count * chunks
        rows.append(
            {
                "isa": isa,
                "loop": "p.V (values)" if values else "q.K (keys)",
                "bits": bits,
                "query_rows": rows_,
                "limbs": limbs,
                "loop_instructions": count,
                "dot_instruction": dot,
                "dots": dots,
                "passes_per_chunk": passes,
                "per_token_d128": per_token,
            }
        )
    return rows


# ---- main -------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4K, batch 1, llama-like only")
    ap.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES) + " (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=31, help="timed calls per configuration and worker")
    ap.add_argument("--bits", default="8,4,2")
    ap.add_argument("--baseline", default=None, help="directory holding an older nexuskv package to time beside")
    ap.add_argument("--json", default="results/bench_cpu_decode.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker()

    configs = (
        [("llama-like", 1, 4096)]
        if args.quick
        else [
            ("llama-like", 1, 4096),
            ("llama-like", 1, 32768),
            ("llama-like", 8, 4096),
            ("llama-like", 8, 32768),
            ("smollm-like", 1, 32768),
        ]
    )
    if args.shapes:
        configs = [c for c in configs if c[0] in args.shapes.split(",")]
    bits_list = [int(b) for b in args.bits.split(",")]
    info = profiling.machine_info(args.threads)
    info["load_before"] = os.getloadavg()[0]
    bandwidth = read_bandwidth(args.threads)
    print(
        f"# {info.get('cpu_model', '?')}, {args.threads} threads, load {info['load_before']:.2f}, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s (float32 sum, 512 MiB)"
    )
    head = "| shape | batch | context | bits | MB read | floor us | fused us | % of floor |"
    if args.baseline:
        head += " baseline us | speed-up |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    results = []
    workers = [Worker(__file__, None)] + ([Worker(__file__, args.baseline)] if args.baseline else [])
    for shape, batch, ctx in configs:
        for bits in bits_list:
            answer, times = paired_times(workers, f"config {shape} {batch} {ctx} {bits} {args.threads}", args.reps)
            nbytes = int(answer)
            us = statistics.median(times[0])
            floor = nbytes / bandwidth * 1e6
            row = {
                "shape": shape,
                "batch": batch,
                "context": ctx,
                "bits": bits,
                "bytes_read": nbytes,
                "floor_us": floor,
                "us": us,
                "times_us": times[0],
            }
            line = (
                f"| {shape} | {batch} | {ctx // 1024}K | {bits} | {nbytes / 1e6:.1f} | {floor:.0f} | "
                f"{us:.0f} | {100 * floor / us:.0f} % |"
            )
            if args.baseline:
                # The median of the paired ratios: each pair ran back to back.
                ratio = paired_speedup(times)
                row.update(baseline_us=statistics.median(times[1]), baseline_times_us=times[1], speedup=ratio)
                line += f" {row['baseline_us']:.0f} | {ratio:.2f}x |"
            print(line, flush=True)
            results.append(row)
    for w in workers:
        w.close()
    counts = loop_counts(library_path())
    if counts:
        print(
            "\n| ISA | loop | bits | query rows | limbs | loop instructions | of them dot products "
            "| per (token, kv head), d128 |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for c in counts:
            if c["query_rows"] == 4 or (c["isa"] == "avx2" and c["loop"].startswith("p.V") and c["limbs"] == 2):
                print(
                    f"| {c['isa']} | {c['loop']} | {c['bits']} | {c['query_rows']} | {c['limbs']} | "
                    f"{c['loop_instructions']} | {c['dots']} {c['dot_instruction']} | {c['per_token_d128']:.0f} |"
                )
    info["load_after"] = os.getloadavg()[0]
    out = {
        "machine": info,
        "threads": args.threads,
        "read_bandwidth": bandwidth,
        "results": results,
        "loop_counts": counts,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\nload {info['load_before']:.2f} -> {info['load_after']:.2f}; wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
