"""The tensor-core decode kernels' dynamic instruction count per 64-key tile, on a GPU, against
the static count of `cuda_budget.py` (what issue 20's budget is checked with).

`cuda_budget.py` counts the instructions of the tile loop's SASS once each: dead branches
(the soft-cap's tanhf without a soft-cap) count, and the loop's
inner loops (the softmax rows) count one trip. Nsight Compute counts what ran. This script
runs one decode step of each kernel (llama-like: 32 q / 8 kv heads, head_dim 128, bf16,
groups of 64, one query per sequence; contiguous cache: keys per channel, values per token;
pages: the vLLM backend's default format, 16-token blocks) at each --bits: the contiguous
cache twice, with NEXUSKV_CUDA_ATTENTION=decode (its decode kernel, contig_decode_kernel: what
a decode step runs by default) and =mma (the 16-row kernel, attention_mma_kernel, for
comparison), the pages with =mma (paged_attention_mma_kernel, its decode variant); each call
fails where the kernel asked for does not take it: 3 x len(bits) launches of interest. Under
ncu it is profiled, and --parse reads ncu's CSV:

    ncu --csv --clock-control none \\
        --kernel-name "regex:attention_mma_kernel|contig_decode_kernel" \\
        --metrics smsp__inst_executed.sum,gpu__time_duration.sum,dram__bytes_read.sum \\
        python benchmarks/cuda_dynamic.py --run > ncu.csv
    python benchmarks/cuda_dynamic.py --parse ncu.csv [--budget benchmarks/cuda_budget.json]

Per launch it prints warp instructions / (64-key tiles x 4 warps) (tiles = batch x kv heads x
context / 64: every key is in exactly one tile of one split; the merge and the pre-pass are
other kernels, not counted; the decode kernels' warps take 16-key chunks of their own, the
block's 4 warps 64 keys a round: the same unit), the static loop count of the same variant
(sm_90, the JSON's), their ratio, the launch's time and its DRAM read rate. gpu_check.sh runs
both halves when ncu is there.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_budget import CONTIG_DECODE_KERNEL, DTYPE, KERNEL, PAGED_KERNEL  # noqa: E402  (the same names the static count uses)

Q_HEADS, KV_HEADS, HEAD_DIM, GROUP, BLOCK = 32, 8, 128, 64, 16
WARPS = 4


def run(batch: int, context: int, bits_list: list[int], device: str = "cuda") -> None:
    """One decode step of each tensor-core kernel per width (the launches ncu profiles); on
    device "cpu" the same calls run the CPU kernels (a check of the calls, no GPU needed).
    NEXUSKV_CUDA_ATTENTION is set per call and restored after."""
    saved = os.environ.get("NEXUSKV_CUDA_ATTENTION")
    try:
        _run(batch, context, bits_list, device)
    finally:
        if saved is None:
            os.environ.pop("NEXUSKV_CUDA_ATTENTION", None)
        else:
            os.environ["NEXUSKV_CUDA_ATTENTION"] = saved


def _run(batch: int, context: int, bits_list: list[int], device: str) -> None:
    import torch

    import nexuskv
    import nexuskv.paged

    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    nblocks = batch * context // BLOCK
    table = torch.randperm(nblocks, device=device, generator=gen).view(batch, context // BLOCK).int()
    tok = torch.arange(context, device=device)
    slots = (table.long()[:, tok // BLOCK] * BLOCK + tok % BLOCK).view(batch, context)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    for bits in bits_list:
        kc = nexuskv.nq_compress(k, bits, GROUP, -2)
        vc = nexuskv.nq_compress(v, bits, GROUP, -1)
        for kernel in ("decode", "mma"):  # the decode kernel, then the 16-row kernel
            os.environ["NEXUSKV_CUDA_ATTENTION"] = kernel
            out = torch.ops.nexuskv.dgq_fused_attention(q, kc, vc, [bits, GROUP, -2], [bits, GROUP, -1], lens)
            assert torch.isfinite(out).all(), f"contiguous {bits}-bit ({kernel}): non-finite output"
        kc = vc = None
        fmt = nexuskv.paged.PagedFormat(key_bits=bits, value_bits=bits, group_size=GROUP)
        pages = torch.empty(
            nblocks, KV_HEADS, BLOCK, fmt.slot_bytes(HEAD_DIM, k.dtype), dtype=torch.uint8, device=device
        )
        for b in range(batch):
            nexuskv.paged.write_(
                pages, k[b].transpose(0, 1).contiguous(), v[b].transpose(0, 1).contiguous(), slots[b].contiguous(), fmt
            )
        os.environ["NEXUSKV_CUDA_ATTENTION"] = "mma"  # (pages: their tensor-core kernels)
        out = nexuskv.paged.attention(
            q.reshape(batch, Q_HEADS, HEAD_DIM), pages, table, lens, starts, fmt, fmt.signs(HEAD_DIM, device)
        )
        assert torch.isfinite(out).all(), f"paged {bits}-bit: non-finite output"
        pages = None
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"cuda_dynamic: ran batch {batch}, context {context}, bits {bits_list}", file=sys.stderr)


# The same variants demangled (ncu's default kernel names): c++filt's spelling.
PAGED_DEMANGLED = re.compile(r"paged_attention_mma_kernel<[\w:]*?(bf16_t|half_t), (\d+), (\d+), (\d+), (\d+)>")
KERNEL_DEMANGLED = re.compile(r"(?<!paged_)attention_mma_kernel<.*?(bf16_t|half_t).*?>\s*, (\d+), (\d+)>")
CONTIG_DECODE_DEMANGLED = re.compile(r"contig_decode_kernel<.*?(bf16_t|half_t).*?>\s*, (\d+), (\d+), (\d+)>")


def variant(name: str):
    """(kernel, dtype, bits, head_dim, groups, rows) of a tensor-core kernel's name, mangled (the
    regexes cuda_budget.py reads the SASS with) or demangled, as cuda_budget.json names them
    (dtype "bf16" / "fp16"; groups: value groups a token, 0 for the 16-row kernel; rows: the
    query rows a block holds, 8 kNT for the paged kernel, 8 for the contiguous cache's decode
    kernel, 16 for its 16-row kernel); None for any other kernel."""
    for paged, decode, kernel in (
        (PAGED_KERNEL, CONTIG_DECODE_KERNEL, KERNEL),
        (PAGED_DEMANGLED, CONTIG_DECODE_DEMANGLED, KERNEL_DEMANGLED),
    ):
        m = paged.search(name)
        if m:
            return "paged", DTYPE[m.group(1)], int(m.group(2)), int(m.group(3)), int(m.group(4)), 8 * int(m.group(5))
        m = decode.search(name)
        if m:
            return "contiguous", DTYPE[m.group(1)], int(m.group(2)), int(m.group(3)), int(m.group(4)), 8
        m = kernel.search(name)
        if m:
            return "contiguous", DTYPE[m.group(1)], int(m.group(2)), int(m.group(3)), 0, 16
    return None


def number(text: str) -> float:
    text = (text or "").replace(",", "").replace('"', "").strip()
    return float(text) if text else float("nan")


TIME = {"second": 1.0, "msecond": 1e-3, "usecond": 1e-6, "nsecond": 1e-9, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
METRICS = ("smsp__inst_executed.sum", "gpu__time_duration.sum", "dram__bytes_read.sum")


def launches_from_csv(text: str) -> dict:
    """{launch ID: (kernel name, {metric: (value, unit)})} from ncu --csv, either layout: the
    details page (a line per launch and metric: "Metric Name", "Metric Unit", "Metric Value")
    or the raw page (a column per metric, their units on the line under the header).  ncu's
    "==PROF==" lines and the program's own output are skipped (CSV lines start with a quote)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        return {}
    header, out = rows[0], {}
    if "Metric Name" in header:
        for rec in (dict(zip(header, r)) for r in rows[1:]):
            _, metrics = out.setdefault(rec.get("ID", ""), (rec.get("Kernel Name", ""), {}))
            metrics[rec.get("Metric Name", "")] = (number(rec.get("Metric Value")), rec.get("Metric Unit", ""))
        return out
    units = dict(zip(header, rows[1])) if len(rows) > 1 and not rows[1][0] else {}
    for r in rows[2 if units else 1 :]:
        rec = dict(zip(header, r))
        out[rec.get("ID", "")] = (
            rec.get("Kernel Name", ""),
            {m: (number(rec.get(m)), units.get(m, "")) for m in METRICS if m in rec},
        )
    return out


def parse(text: str, static: dict, batch: int, context: int) -> list[dict]:
    """Rows per profiled tensor-core launch: dynamic instructions per warp per 64-key tile
    against the static loop count of the same variant (static: {variant: loop instructions})."""
    tiles = batch * KV_HEADS * context // 64
    rows = []
    launches = launches_from_csv(text)
    for key in sorted(launches, key=lambda k: int(k) if k.isdigit() else -1):
        name, metrics = launches[key]
        var = variant(name)
        if var is None:
            continue
        inst = metrics.get("smsp__inst_executed.sum", (float("nan"), ""))[0]
        t, t_unit = metrics.get("gpu__time_duration.sum", (float("nan"), "nsecond"))
        dram, d_unit = metrics.get("dram__bytes_read.sum", (float("nan"), "byte"))
        seconds = t * TIME.get(t_unit, 1e-9)
        per_tile = inst / (tiles * WARPS)
        st = static.get(var)
        rows.append(
            dict(
                kernel=var[0],
                dtype=var[1],
                bits=var[2],
                head_dim=var[3],
                groups=var[4],
                rows=var[5],
                warp_instructions=inst,
                per_warp_per_tile=per_tile,
                static_loop=st,
                dynamic_over_static=per_tile / st if st else None,
                us=seconds * 1e6,
                dram_gbps=dram * BYTES.get(d_unit, 1.0) / seconds / 1e9 if seconds > 0 else None,
            )
        )
    return rows


def static_counts(budget_json: str, arch: str = "sm_90") -> dict:
    """{(kernel, dtype, bits, head_dim, groups, rows): the tile loop's static count} of cuda_budget.json."""
    if not budget_json or not Path(budget_json).exists():
        return {}
    return {
        (r["kernel"], r["dtype"], r["bits"], r["head_dim"], r["groups"], r.get("rows", 16)): r["loop_instructions"]
        for r in json.load(open(budget_json))["variants"]
        if r["arch"] == arch
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="run the launches (under ncu)")
    ap.add_argument("--parse", metavar="CSV", help="ncu --csv output of a --run")
    ap.add_argument("--budget", default=str(Path(__file__).resolve().parent / "cuda_budget.json"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--bits", default="4,2")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: the same calls on the CPU kernels (a check, no ncu)")
    args = ap.parse_args(argv)
    bits = [int(b) for b in args.bits.split(",")]
    if args.context % 64:
        ap.error("--context: a multiple of 64 (whole tiles)")
    if args.run:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            print("cuda_dynamic: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
            return 2
        run(args.batch, args.context, bits, args.device)
    if args.parse:
        rows = parse(Path(args.parse).read_text(errors="replace"), static_counts(args.budget), args.batch, args.context)
        print(
            f"{'kernel':>10} {'bits':>4} {'D':>4} {'groups':>6} {'rows':>4} {'instr/warp/tile':>15} {'static':>7} "
            f"{'dyn/static':>10} {'us':>9} {'DRAM GB/s':>9}"
        )
        for r in rows:
            print(
                f"{r['kernel']:>10} {r['bits']:>4} {r['head_dim']:>4} {r['groups']:>6} {r['rows']:>4} "
                f"{r['per_warp_per_tile']:>15.0f} {r['static_loop'] or 0:>7} "
                f"{(r['dynamic_over_static'] or float('nan')):>10.2f} {r['us']:>9.1f} "
                f"{(r['dram_gbps'] or float('nan')):>9.0f}"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(dict(batch=args.batch, context=args.context, rows=rows), indent=1))
        if not rows:
            print("cuda_dynamic: no tensor-core launch in the CSV (the raw ncu output is above it in the log)")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
