"""CUDA decode attention: nexuskv dgq_fused_attention straight from the compressed cache
against torch's scaled_dot_product_attention (SDPA) on the dense cache and against
decompress-then-SDPA, plus the compression cost of one decode step.

For every (batch, context) this times, side by side in one run:

  fused     dgq_fused_attention over an NQ cache at 8, 4 and 2 bits: keys per channel
            (axis -2), values per token (axis -1), group 64, no outliers, no tail;
            bf16 q, bf16 scales/zeros, compressed_lens = context on the device.  Run
            with NEXUSKV_CUDA_ATTENTION=decode, so the decode kernel (contig_decode.cuh,
            what a decode step of this format runs by default) is what is timed (the call
            fails otherwise); beside it ("16-row", JSON fused_mma_us) the same call with
            =mma, the tensor-core kernel it replaced for decode steps (attention_mma.cuh).
  SDPA      F.scaled_dot_product_attention on dense K/V in bf16 and in fp16, flash
            backend where it takes the call, in the faster of two GQA formulations, both
            timed: "fold" (the q heads of a kv head folded into the query-length dim:
            q [B, Hkv, Hq/Hkv, D] against K/V [B, Hkv, T, D], no copy of K/V) and "gqa"
            (enable_gqa=True).
  deq+SDPA  nq_decompress of K and V to bf16, then the faster bf16 SDPA above; timed together.

Shape: GQA 32/8, head_dim 128, q_len 1; batch 1, 16, 64; context 4K, 32K, 128K where the
GPU's memory allows (a config is skipped, and says so, when it would not fit).

Timing: CUDA events around each call, after warm-up, with the L2 cache flushed (a buffer
of twice the L2 size written) before every timed call; the median of --reps (>= 20).  Eager
calls by default (the host's dispatch included: what eager callers see); --graphs captures
each call once in a CUDA graph and times its replays (the GPU's time: what an engine that
replays graphs sees; a call that cannot be captured is timed eagerly and listed in the JSON's
info.not_captured).  The copy bandwidth and the compression are always timed eagerly.

--paged also times the page format of the vLLM backend (nexuskv.paged.attention: keys and
values per token in groups of 64, rotated, 16-token blocks in a shuffled block table) on the
same K/V, one decode query per request, with its tensor-core kernel (paged_mma.cuh) and with
the SIMT reference kernel side by side (JSON "paged").
Bytes: the compressed tensors the fused kernel reads (codes, scales, zeros of K and V up to
the context) plus q and the output; SDPA: dense K and V.  GB/s = bytes / median time, and
the percentage of a device-to-device copy (a 2 GiB buffer, bytes read + written) measured
in the same run.  Each config checks fused against decompress-then-SDPA (bf16 rounding).

Compression per decode step, 32 layers: values are compressed per token (one token per
step), keys per channel in groups of 64 tokens (one group per 64 steps), so a step costs
32 x value(1 token) + 32 x key(64 tokens) / 64.

    python benchmarks/bench_cuda.py --json results/bench_cuda.json
    python benchmarks/bench_cuda.py --quick        # batch 1 and 16, 4K and 32K, 4-bit
    python benchmarks/bench_cuda.py --batches 1,64 --contexts 4096,32768 --graphs --paged
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import nexuskv
import nexuskv.paged
from nexuskv.ops import dgq_fused_attention

Q_HEADS, KV_HEADS, HEAD_DIM, GROUP = 32, 8, 128, 64
GB = 1e9


@contextlib.contextmanager
def env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class Timer:
    """Median device time of a call: CUDA events, L2 flushed before each timed call.  With
    graphs, the call is captured once in a CUDA graph and its replays are timed: the GPU's
    time alone, without the host's dispatch between the events (what an engine that replays
    graphs sees); without, eager calls (what eager callers see, host overhead included)."""

    def __init__(self, reps: int, warmup: int, graphs: bool = False):
        props = torch.cuda.get_device_properties(0)
        l2 = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
        self.flush_buf = torch.empty(2 * l2 // 4 + 1, dtype=torch.int32, device="cuda")
        self.reps, self.warmup, self.graphs = reps, warmup, graphs
        self.not_captured: list[str] = []

    def __call__(self, fn) -> float:
        call = fn
        if self.graphs:  # warm-up on a side stream, as graph capture asks
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(max(self.warmup, 1)):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    fn()
                call = graph.replay
            except RuntimeError as e:  # a call that cannot be captured is timed eagerly, and said so
                self.not_captured.append(f"{getattr(fn, '__name__', fn)}: {str(e).splitlines()[0][:160]}")
                torch.cuda.synchronize()
        for _ in range(self.warmup):
            call()
        times = []
        for _ in range(self.reps):
            self.flush_buf.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(times)


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy of a 2 GiB buffer: bytes read + written per second."""
    src = torch.empty(1 << 29, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    return 2 * (1 << 31) / t


def sdpa_backends():
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION]), lambda: sdpa_kernel(
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        )
    except ImportError:  # older torch
        return contextlib.nullcontext, contextlib.nullcontext


FLASH_ONLY, ANY_BACKEND = sdpa_backends()


def sdpa_fold(q, k, v):
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    return F.scaled_dot_product_attention(q.view(B, Hkv, Hq // Hkv, D), k, v).view(B, Hq, 1, D)


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def best_sdpa(timer: Timer, q, k, v):
    """(seconds, formulation, backend) of the faster GQA formulation, flash first."""
    best = None
    for name, fn in (("fold", sdpa_fold), ("gqa", sdpa_gqa)):
        for backend, ctx in (("flash", FLASH_ONLY), ("auto", ANY_BACKEND)):
            try:
                with ctx():
                    fn(q, k, v)
                    t = timer(lambda: fn(q, k, v))
            except RuntimeError:
                continue
            if best is None or t < best[0]:
                best = (t, name, backend, fn, ctx)
            break  # flash took it: no need for the fallback
    return best


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def fits(batch: int, ctx: int, free: int) -> bool:
    dense = 2 * batch * KV_HEADS * ctx * HEAD_DIM * 2  # bf16 K + V
    # dense bf16, its fp16 copy or the decompressed pair, the 8-bit cache, slack
    return 2 * dense + dense // 2 + (2 << 30) < free


def bench_config(timer, batch, ctx, bits_list, bw, gen, paged_rows=None):
    rows = []
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k[..., 3] += 4.0
    dense_bytes = nbytes([k, v])
    sdpa = {}
    for dtype in (torch.bfloat16, torch.float16):
        qd, kd, vd = (q, k, v) if dtype == torch.bfloat16 else (q.half(), k.half(), v.half())
        t, form, backend, fn, ctx_mgr = best_sdpa(timer, qd, kd, vd)
        sdpa[dtype] = dict(us=t * 1e6, form=form, backend=backend, fn=fn, ctx=ctx_mgr)
        del qd, kd, vd
    torch.cuda.empty_cache()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    for bits in bits_list:
        kc = nexuskv.nq_compress(k, bits, GROUP, -2)
        vc = nexuskv.nq_compress(v, bits, GROUP, -1)
        fmt_k, fmt_v = [bits, GROUP, -2], [bits, GROUP, -1]

        def fused():
            return dgq_fused_attention(q, kc, vc, fmt_k, fmt_v, lens)

        with env("NEXUSKV_CUDA_ATTENTION", "decode"):
            out = fused()
            t_fused = timer(fused)
        with env("NEXUSKV_CUDA_ATTENTION", "mma"):
            out_mma = fused()
            t_mma = timer(fused)
        s16 = sdpa[torch.bfloat16]

        def deq_sdpa():
            kd = nexuskv.nq_decompress(*kc, bits, GROUP, -2, HEAD_DIM, torch.bfloat16)
            vd = nexuskv.nq_decompress(*vc, bits, GROUP, -1, HEAD_DIM, torch.bfloat16)
            with s16["ctx"]():
                return s16["fn"](q, kd, vd)

        ref = deq_sdpa()
        t_deq = timer(deq_sdpa)
        err, err_mma = (float((o.float() - ref.float()).norm() / ref.float().norm()) for o in (out, out_mma))
        comp_bytes = nbytes(kc) + nbytes(vc) + 2 * nbytes([q])
        rows.append(
            dict(
                batch=batch,
                context=ctx,
                bits=bits,
                fused_us=t_fused * 1e6,
                fused_mma_us=t_mma * 1e6,
                deq_sdpa_us=t_deq * 1e6,
                sdpa_bf16_us=sdpa[torch.bfloat16]["us"],
                sdpa_fp16_us=sdpa[torch.float16]["us"],
                sdpa_bf16_form=f"{sdpa[torch.bfloat16]['form']}/{sdpa[torch.bfloat16]['backend']}",
                sdpa_fp16_form=f"{sdpa[torch.float16]['form']}/{sdpa[torch.float16]['backend']}",
                compressed_bytes=comp_bytes,
                dense_bytes=dense_bytes,
                fused_gbps=comp_bytes / t_fused / GB,
                fused_pct_copy=100 * comp_bytes / t_fused / bw,
                sdpa_bf16_gbps=dense_bytes / (sdpa[torch.bfloat16]["us"] * 1e-6) / GB,
                speedup_vs_sdpa_bf16=sdpa[torch.bfloat16]["us"] / (t_fused * 1e6),
                speedup_vs_sdpa_fp16=sdpa[torch.float16]["us"] / (t_fused * 1e6),
                speedup_vs_deq_sdpa=t_deq / t_fused,
                rel_err_vs_deq_sdpa=err,
                rel_err_mma_vs_deq_sdpa=err_mma,
            )
        )
        kc = vc = out = out_mma = ref = None  # free the cache before the next width
        torch.cuda.empty_cache()
    if paged_rows is not None:
        paged_rows += bench_paged(timer, q, k, v, bits_list, sdpa, bw, gen)
    q = k = v = None
    torch.cuda.empty_cache()
    return rows


def bench_paged(timer, q, k, v, bits_list, sdpa, bw, gen, block_size=16):
    """The paged format of the vLLM backend (keys and values per token in groups of 64,
    Hadamard-rotated: PagedFormat's defaults; blocks of 16 tokens in a shuffled block table)
    through paged.attention, one decode query per request; error against dense bf16 SDPA
    (quantization included)."""
    B, Hkv, T, D = k.shape
    nblocks = B * T // block_size
    table = torch.randperm(nblocks, device="cuda", generator=gen).view(B, T // block_size).int()
    tok = torch.arange(T, device="cuda")
    slots = (table.long()[:, tok // block_size] * block_size + tok % block_size).reshape(-1)
    seq_lens = torch.full((B,), T, dtype=torch.int32, device="cuda")
    starts = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    qp = q.reshape(B, Q_HEADS, D)
    s16 = sdpa[torch.bfloat16]
    with s16["ctx"]():
        dense = s16["fn"](q, k, v).reshape(B, Q_HEADS, D).float()
    rows = []
    for bits in bits_list:
        fmt = nexuskv.paged.PagedFormat(key_bits=bits, value_bits=bits, group_size=GROUP)
        pages = torch.empty(nblocks, Hkv, block_size, fmt.slot_bytes(D, k.dtype), dtype=torch.uint8, device="cuda")
        for b in range(B):  # one request at a time: no [B x T] copy of K and V
            kb, vb = k[b].transpose(0, 1).contiguous(), v[b].transpose(0, 1).contiguous()
            nexuskv.paged.write_(pages, kb, vb, slots.view(B, T)[b].contiguous(), fmt)

        signs = fmt.signs(D, "cuda")  # once: built per call, they would be a host copy that no graph can hold

        def paged_call():
            return nexuskv.paged.attention(qp, pages, table, seq_lens, starts, fmt, signs)

        # The tensor-core kernel (paged_mma.cuh; the call fails if it does not take the format),
        # then the SIMT reference on the same pages.
        with env("NEXUSKV_CUDA_ATTENTION", "mma"):
            out = paged_call().float()
            t = timer(paged_call)
        with env("NEXUSKV_CUDA_ATTENTION", "simple"):
            simt = paged_call().float()
            t_simt = timer(paged_call)
        rows.append(
            dict(
                kind="paged",
                batch=B,
                context=T,
                bits=bits,
                block_size=block_size,
                paged_us=t * 1e6,
                paged_simt_us=t_simt * 1e6,
                mma_vs_simt=t_simt / t,
                rel_err_mma_vs_simt=float((out - simt).norm() / simt.norm()),
                page_bytes=nbytes([pages]),
                paged_gbps=nbytes([pages]) / t / GB,
                paged_pct_copy=100 * nbytes([pages]) / t / bw,
                sdpa_bf16_us=s16["us"],
                speedup_vs_sdpa_bf16=s16["us"] / (t * 1e6),
                rel_err_vs_dense_sdpa=float((out - dense).norm() / dense.norm()),
            )
        )
        print(
            f"paged batch {B} context {T} {bits}-bit: {t * 1e6:.0f} us, SIMT {t_simt * 1e6:.0f} us "
            f"({rows[-1]['speedup_vs_sdpa_bf16']:.2f}x SDPA "
            f"bf16, {rows[-1]['paged_gbps']:.0f} GB/s, err vs dense {rows[-1]['rel_err_vs_dense_sdpa']:.1e})",
            flush=True,
        )
        pages = out = simt = None
        torch.cuda.empty_cache()
    return rows


def compress_per_step(timer, batch, bits_list, gen, layers=32):
    """Microseconds of the compression one decode step costs for `layers` layers."""
    rows = []
    v1 = torch.randn(batch, KV_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k64 = torch.randn(batch, KV_HEADS, GROUP, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    for bits in bits_list:
        t_v = timer(lambda: [nexuskv.nq_compress(v1, bits, GROUP, -1) for _ in range(layers)])
        t_k = timer(lambda: [nexuskv.nq_compress(k64, bits, GROUP, -2) for _ in range(layers)])
        rows.append(
            dict(
                batch=batch,
                bits=bits,
                layers=layers,
                values_1_token_us=t_v * 1e6,
                keys_64_tokens_us=t_k * 1e6,
                per_step_us=(t_v + t_k / GROUP) * 1e6,
                key_group_gbps=layers * nbytes([k64]) / t_k / GB,
            )
        )
    return rows


def print_table(rows, bw):
    print(f"\ncopy bandwidth (D2D, read + write): {bw / GB:.0f} GB/s")
    hdr = (
        f"{'batch':>5} {'ctx':>6} {'bits':>4} {'fused us':>9} {'GB/s':>7} {'%copy':>6} {'16-row us':>9} "
        f"{'SDPA bf16':>10} {'SDPA fp16':>10} {'deq+SDPA':>9} {'x bf16':>7} {'x fp16':>7} {'x deq':>6} {'err':>8}"
    )
    print(hdr)
    for r in rows:
        print(
            f"{r['batch']:>5} {r['context'] // 1024:>5}K {r['bits']:>4} {r['fused_us']:>9.1f} {r['fused_gbps']:>7.0f} "
            f"{r['fused_pct_copy']:>5.1f}% {r['fused_mma_us']:>9.1f} {r['sdpa_bf16_us']:>10.1f} "
            f"{r['sdpa_fp16_us']:>10.1f} {r['deq_sdpa_us']:>9.1f} {r['speedup_vs_sdpa_bf16']:>6.2f}x "
            f"{r['speedup_vs_sdpa_fp16']:>6.2f}x {r['speedup_vs_deq_sdpa']:>5.2f}x {r['rel_err_vs_deq_sdpa']:>8.1e}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="results/bench_cuda.json")
    ap.add_argument("--batches", default=None, help="default 1,16,64 (1,16 with --quick)")
    ap.add_argument("--contexts", default=None, help="default 4096,32768,131072 (4096,32768 with --quick)")
    ap.add_argument("--bits", default=None, help="default 8,4,2 (4 with --quick)")
    ap.add_argument("--reps", type=int, default=20, help="timed runs per measurement (median; >= 20)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (GPU time, no host dispatch)")
    ap.add_argument("--paged", action="store_true", help="also time the paged format (nexuskv.paged.attention)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    batches = [int(x) for x in (args.batches or ("1,16" if args.quick else "1,16,64")).split(",")]
    contexts = [int(x) for x in (args.contexts or ("4096,32768" if args.quick else "4096,32768,131072")).split(",")]
    bits_list = [int(x) for x in (args.bits or ("4" if args.quick else "8,4,2")).split(",")]
    timer = Timer(max(args.reps, 1), args.warmup, args.graphs)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    # Eager always: a copy captured in a graph becomes a memcpy node on the copy engines (~2.8 TB/s
    # on an H200 against ~4.2 TB/s for the copy kernel), not the bandwidth the kernels can reach.
    eager = Timer(max(args.reps, 1), args.warmup) if args.graphs else timer
    bw = copy_bandwidth(eager)
    rows, skipped = [], []
    paged_rows = [] if args.paged else None
    for batch in batches:
        for ctx in contexts:
            free, _ = torch.cuda.mem_get_info()
            if not fits(batch, ctx, free):
                skipped.append(dict(batch=batch, context=ctx, reason=f"needs more than the {free / GB:.0f} GB free"))
                print(f"skip batch {batch} context {ctx}: {skipped[-1]['reason']}")
                continue
            rows += bench_config(timer, batch, ctx, bits_list, bw, gen, paged_rows)
            print(
                f"batch {batch} context {ctx}: "
                + ", ".join(
                    f"{r['bits']}-bit {r['fused_us']:.0f} us ({r['speedup_vs_sdpa_bf16']:.2f}x SDPA bf16)"
                    for r in rows[-len(bits_list) :]
                ),
                flush=True,
            )
    compress = [r for b in batches for r in compress_per_step(eager, b, bits_list, gen)]  # eager calls, always
    print_table(rows, bw)
    print(f"\n{'batch':>5} {'bits':>4} {'V 1 tok x32 us':>15} {'K 64 tok x32 us':>16} {'per step us':>12}")
    for r in compress:
        print(
            f"{r['batch']:>5} {r['bits']:>4} {r['values_1_token_us']:>15.1f} {r['keys_64_tokens_us']:>16.1f} "
            f"{r['per_step_us']:>12.1f}"
        )
    if paged_rows:
        hdr = (
            f"{'batch':>5} {'ctx':>6} {'bits':>4} {'paged us':>9} {'SIMT us':>9} {'GB/s':>7} {'%copy':>6} "
            f"{'x bf16':>7} {'err':>8}"
        )
        print("\n" + hdr)
        for r in paged_rows:
            print(
                f"{r['batch']:>5} {r['context'] // 1024:>5}K {r['bits']:>4} {r['paged_us']:>9.1f} "
                f"{r['paged_simt_us']:>9.1f} "
                f"{r['paged_gbps']:>7.0f} {r['paged_pct_copy']:>5.1f}% {r['speedup_vs_sdpa_bf16']:>6.2f}x "
                f"{r['rel_err_vs_dense_sdpa']:>8.1e}"
            )
    info = dict(
        device=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        date=time.strftime("%Y-%m-%d"),
        copy_gbps=bw / GB,
        reps=args.reps,
        warmup=args.warmup,
        timing="cuda graph replays" if args.graphs else "eager calls",
        not_captured=timer.not_captured,
        seconds=time.time() - t0,
        q_heads=Q_HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        group=GROUP,
    )
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    result = dict(info=info, attention=rows, paged=paged_rows or [], skipped=skipped, compress=compress)
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path} ({time.time() - t0:.0f} s)")
    bad = [r for r in rows if not (r["rel_err_vs_deq_sdpa"] <= 2e-2 and r["rel_err_mma_vs_deq_sdpa"] <= 2e-2)]
    if bad:
        print(
            f"bench_cuda: fused (decode or 16-row) differs from decompress-then-SDPA in {len(bad)} configs",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
