"""Static byte budget of the CUDA decode kernels (no GPU needed): for every variant of the
tensor-core attention kernels (attention_mma_kernel<Launch, kBits, kD> in
csrc/cuda/attention_mma.cuh, the contiguous cache's 16-row kernel, and its decode kernel
contig_decode_kernel<Launch, kBits, kD, kBg> in csrc/cuda/contig_decode.cuh: the "contiguous/Bg
g/8r" rows, Bg value groups a token; its keys per token, contig_decode_token_keys_kernel: the
"contiguous-token-keys" rows, keys in as many groups as the values, whose tile is the paged
one's bytes: paged_tile_bytes; paged_attention_mma_kernel<X, kBits, kD> in
csrc/cuda/paged_mma.cuh, vLLM's pages: the "paged" rows, whose tile is 64 keys of the paged
format, keys and values per token: paged_tile_bytes) it reads, from the objects a CUDA build already compiled
(build/py by default; nothing is compiled here):

  registers, stack and local memory (spills), static shared memory   cuobjdump --dump-resource-usage
  the SASS of the kernel                                              cuobjdump -sass -arch sm_XX

and prints, per architecture, bits, head_dim and dtype: the resources, the resident blocks per SM
the registers allow, and the static instruction count of the steady-state tile loop (one 64-key
tile per iteration, counted per warp) against the tile's byte budget.

The budget.  One 64-key tile of one (batch, kv head) reads

    bytes = 2 * 64 * row_bytes(bits, D)            key and value codes
          + 2 * D * 2                              key scale and zero per channel (one 64-token
                                                   group, 2-byte meta)
          + 64 * ceil(D / 64) * 2 * 2              value scale and zero per token and 64-channel group

(4-bit, D 128: 9,216 bytes; 2-bit: 5,120).  At a fraction f (0.75) of the HBM bandwidth B
(H200: 4.8 TB/s) shared by N SMs (132) at clock F (1.98 GHz), an SM must finish a tile every

    cycles = bytes / (f * B / N) * F                (4-bit D 128: ~670 cycles)

and its 4 schedulers issue at most one instruction per cycle each, so the 4 warps of a block may
spend at most `cycles` instructions each per tile (more resident blocks share the bandwidth and
the issue slots alike: the per-warp budget does not change).  The table shows
instructions / budget; above 1.0 the kernel is bound by instructions, not bytes.

How the loop is found, so that the count cannot silently measure something else: the SASS is cut
into basic blocks; every backward edge u -> h closes a natural loop (the blocks that reach u
without passing h; the compiler places blocks out of order, so a loop is a set of blocks, not an
address range); the tile loop is the smallest loop that contains every HMMA (tensor-core MMA)
instruction of the kernel, since q . K and P . V both run once per tile.  The script checks
that this loop also holds a barrier (BAR.SYNC; WARPSYNC in the paged decode kernel, whose warps
each take their own 16-key chunks) and an asynchronous copy (LDGSTS, the next tile's prefetch)
and fails otherwise.  In the decode kernels (paged_decode.cuh and contig_decode.cuh, the "8r"
rows; decode_warp.cuh) a warp's
chunk is 16 keys and the block's 4 warps take 64 together, so its loop count per warp and chunk
is the same unit as the others': instructions per warp per 64-key tile of the block.  Its
kernel holds an iteration's work twice: the steady loop over the chunks every query row sees
whole (no mask, no soft-cap), nested in the loop over all chunks, whose other branch runs a
masked, capped copy for the edge chunks (a split's first and last, a window's start, the causal
end: a few per warp and split, whatever the context; every chunk under a soft-cap).  Its row
counts the steady loop: the innermost loop whose HMMAs are a whole number of chunks' (2 D / 16
+ 1 each on pages: P . V in hi + lo and the key zeros' MMA; 2 D / 16 in the contiguous cache,
whose iteration adds as many for its key group's q . zero; q . K runs on integer MMAs, IMMA,
listed apart), which the smallest loop holding every HMMA (the outer one, both copies) would
count twice.  Below 8 bits its warp
takes several chunks an iteration (2 at 4 bits, 4 at 2 bits; the block 64 keys a chunk
round): the row gives the loop's count per 64-key tile, the iteration's / its chunks
(loop_chunks in the JSON).  The count is static: every instruction
of the loop's blocks once, so inner loops the compiler did not unroll count once (the table lists
how many) and rarely taken paths count fully; it is an estimate of the per-tile work, not a
trace.

From the counts it predicts one decode step of today's kernel on an H200 (32 q / 8 kv heads,
D 128, batch 1 and 64, 4K and 32K; and 4 query tokens a request at batch 64, 32K: 16 rows a kv
head, the contiguous cache's decode kernel in two blocks of 8 against its 16-row kernel;
predict()): the larger of an issue bound (4 warp-instructions per SM-cycle; the busiest SM's
blocks x tiles x tile-loop instructions) and the bytes at the budget's fraction of HBM (read
once per block of a kv head's rows), against dense bf16 K/V read at the same fraction: the
figures a GPU run will confirm or refute.

The NQ element kernels (nq_decompress_kernel, nq_pack_kernel of csrc/cuda/nq_kernels.cu: one
thread per element / per packed chunk) are listed too, with the number of 64-bit integer
division routines in their SASS.  A GPU has no integer divider: `/` or `%` on 64-bit operands
compiles to an inline routine that starts by converting the divisor to a float and taking its
reciprocal (I2F.U64.RP then MUFU.RCP), so each I2F.U64.RP is one such division site.  The
kernels take their indices from nq_index.h (32-bit multiply-shift divisions by host-computed
constants) and must show none: --check-nq-division fails otherwise.  In the decode kernel the
routine is a subroutine, so the table counts the tile loop's CALLs whose target starts it
(div64; --check-loop-division fails on any): the loop takes its sizes from MmaIndex
(attention_mma.cuh), 32-bit with host-computed divisors.

    python benchmarks/cuda_budget.py                        # build/py, sm_90 and sm_80
    python benchmarks/cuda_budget.py --check-spills         # exit 1 on any spill (stack or local)
    python benchmarks/cuda_budget.py --check-loop-division  # exit 1 on a 64-bit division call in a tile loop
    python benchmarks/cuda_budget.py --check-nq-division    # exit 1 on a 64-bit division per NQ element
    python benchmarks/cuda_budget.py --check-budget         # exit 1 on a decode kernel over its budget
                                                            # (sm_90; but BUDGET_EXEMPT's)
    python benchmarks/cuda_budget.py --json results/cuda_budget.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field

KERNEL = re.compile(r"(?<!paged_)attention_mma_kernel.*?(bf16_t|half_t).*?ELi(\d+)ELi(\d+)EEEv")
# The paged tensor-core kernel (paged_attention_mma_kernel<X, kBits, kD, kBg, kNT>, csrc/cuda/paged_mma_launch.cuh;
# kNT: 8-row n-tiles of query rows, 1 for decode steps (paged_decode.cuh), 2 otherwise (paged_mma.cuh)).
PAGED_KERNEL = re.compile(r"paged_attention_mma_kernelIN\w*?(bf16_t|half_t)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)EEEv")
# The contiguous cache's decode kernel (contig_decode_kernel<Launch, kBits, kD, kBg>, csrc/cuda/contig_decode.cuh:
# 8 query rows, kBg value groups per token; keys per channel).
CONTIG_DECODE_KERNEL = re.compile(r"contig_decode_kernelI\w*?(bf16_t|half_t)\w*?Li(\d+)ELi(\d+)ELi(\d+)EEEv")
# ... and its keys per token (contig_decode_token_keys_kernel<Launch, kBits, kD, kBg>: kBg groups a token, keys
# and values).
CONTIG_TOKEN_KEYS_KERNEL = re.compile(
    r"contig_decode_token_keys_kernelI\w*?(bf16_t|half_t)\w*?Li(\d+)ELi(\d+)ELi(\d+)EEEv"
)
DTYPE = {"bf16_t": "bf16", "half_t": "fp16"}  # the kernels' element type -> the JSON's dtype
NQ_KERNEL = re.compile(r"(nq_decompress_kernel|nq_pack_kernel)I(\w+?)(?:Li(\d+)E)?EEv")
DIV64 = "I2F.U64.RP"  # first instruction of the inline 64-bit integer division routine
INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
TILE = 64  # keys per tile of attention_mma.cuh (kMmaTile)
WARPS = 4  # warps per block (kMmaThreads / 32)


def row_bytes(bits: int, d: int) -> int:
    """Bytes of a packed row of d codes (nq_format.h: 16-byte chunks, 24 for 3 bits)."""
    chunk_channels = {2: 64, 3: 64, 4: 32, 8: 16}[bits]
    chunk_bytes = 24 if bits == 3 else 16
    return -(-d // chunk_channels) * chunk_bytes


def tile_bytes(bits: int, d: int, meta_bytes: int = 2, value_groups: int | None = None) -> int:
    codes = 2 * TILE * row_bytes(bits, d)
    key_meta = 2 * d * meta_bytes  # scale + zero per channel, one 64-token group
    groups = -(-d // 64) if value_groups is None else value_groups  # (default: 64-channel value groups)
    value_meta = TILE * groups * 2 * meta_bytes  # scale + zero per token and value group
    return codes + key_meta + value_meta


def paged_tile_bytes(bits: int, d: int, group: int = 64, meta_bytes: int = 2) -> int:
    """One 64-key tile of the paged format (paged_format.h, keys and values per token): codes, and
    per token and group key scale, key zero, value scale and value zero."""
    return 2 * TILE * row_bytes(bits, d) + TILE * -(-d // group) * 4 * meta_bytes


def find_cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    candidates = glob.glob("/usr/local/cuda*/bin/cuobjdump")
    try:  # triton ships the CUDA binary utilities
        import triton

        candidates += glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))
    except ImportError:
        pass
    if not candidates:
        sys.exit("cuda_budget: cuobjdump not found (PATH, /usr/local/cuda*/bin, or triton's bundled copy)")
    return candidates[0]


@dataclass
class Variant:
    arch: str
    dtype: str
    bits: int
    head_dim: int
    kernel: str = "contiguous"  # or "paged" (vLLM's pages, paged_mma.cuh)
    groups: int = 0  # paged: key / value groups per token (the kernel's kBg)
    rows: int = 16  # query rows a block holds (paged: 8 in decode steps, 16 otherwise; the kernel's 8 kNT)
    registers: int = 0
    stack: int = 0
    local: int = 0
    shared: int = 0
    blocks_per_sm: int = 0
    sass_instructions: int = 0
    loop_instructions: int = 0  # per warp per 64-key tile
    loop_chunks: int = 1  # decode kernel: 16-key chunks per warp iteration (the loop's count / this)
    loop_inner_loops: int = 0
    loop_counts: dict = field(default_factory=dict)
    tile_bytes: int = 0
    budget: float = 0.0

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.local > 0


def resources(cuobjdump: str, obj: str) -> dict:
    """{(arch, function): {REG, STACK, SHARED, LOCAL}} from --dump-resource-usage."""
    out = subprocess.run([cuobjdump, "--dump-resource-usage", obj], capture_output=True, text=True, check=True).stdout
    res, arch, fn = {}, None, None
    for line in out.splitlines():
        m = re.match(r"\s*arch = (sm_\d+)", line)
        if m:
            arch = m.group(1)
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            fn = m.group(1)
            continue
        if fn and "REG:" in line:
            res[(arch, fn)] = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
            fn = None
    return res


def sass_functions(cuobjdump: str, obj: str, arch: str) -> dict:
    """{function: [(address, opcode, operands, predicated)]} of one architecture's SASS."""
    out = subprocess.run([cuobjdump, "-sass", "-arch", arch, obj], capture_output=True, text=True, check=True).stdout
    return parse_sass(out)


def parse_sass(text: str) -> dict:
    """parse_sass(cuobjdump -sass output) -> {function: [(address, opcode, operands, predicated)]}."""
    funcs, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = INSTR.search(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(3), m.group(4), m.group(2) is not None))
    return funcs


def natural_loops(code):
    """The loops of the kernel's control-flow graph: {header block: set of blocks}, and the
    blocks as (first, last) instruction indices.  A back edge u -> h (h dominates u) closes a
    loop whose body is every block that reaches u without passing h.  (The compiler
    places blocks out of order, so a loop is a set of blocks, not an address range.)"""
    addr = {a: i for i, (a, *_rest) in enumerate(code)}

    def target(op, rest):
        # BRA's target; and CALL's: besides subroutines (which return), ptxas uses a predicated
        # CALL.REL.NOINC to a nearby address as a branch (seen on sm_80), so both are edges.
        m = re.search(r"0x([0-9a-f]+)", rest) if op.split(".")[0] in ("BRA", "CALL") else None
        return addr.get(int(m.group(1), 16)) if m else None

    def ends_block(op):  # control may leave the instruction other than by falling through
        return op.split(".")[0] in ("BRA", "CALL", "EXIT", "RET", "BRX", "JMP", "JMX")

    def falls_through(op, rest, pred):
        # Unpredicated BRA / EXIT / RET do not; a predicate on the instruction (@P0) or a
        # BRA's own condition operand (BRA P1, 0x...) or a divergent BRA.DIV makes them fall through.
        base = op.split(".")[0]
        if base not in ("BRA", "EXIT", "RET", "BRX", "JMP", "JMX"):
            return True
        return pred or op.startswith("BRA.DIV") or bool(re.match(r"\s*!?U?P[T0-9]+\s*,", rest))

    leaders = {0}
    for i, (a, op, rest, pred) in enumerate(code):
        if ends_block(op):
            leaders.add(i + 1)
            t = target(op, rest)
            if t is not None:
                leaders.add(t)
    starts = sorted(x for x in leaders if x < len(code))
    blocks = [(s0, (starts[k + 1] if k + 1 < len(starts) else len(code)) - 1) for k, s0 in enumerate(starts)]
    block_of = {s0: k for k, (s0, _) in enumerate(blocks)}
    succ = {k: [] for k in range(len(blocks))}
    for k, (_, last) in enumerate(blocks):
        a, op, rest, pred = code[last]
        t = target(op, rest)
        if t is not None:
            succ[k].append(block_of[t])
        if falls_through(op, rest, pred) and k + 1 < len(blocks):
            succ[k].append(k + 1)
    # Only what the entry reaches (called subroutines, e.g. the 64-bit division, and padding are
    # not part of the kernel's own loops; their CALLs count as instructions of the caller).
    reach, stack = {0}, [0]
    while stack:
        for x in succ[stack.pop()]:
            if x not in reach:
                reach.add(x)
                stack.append(x)
    succ = {k: (v if k in reach else []) for k, v in succ.items()}
    pred_of = {k: [] for k in range(len(blocks))}
    for k, ss in succ.items():
        for x in ss:
            pred_of[x].append(k)
    # Dominators (iterative, bit sets): a loop's header dominates its back edge's source.
    n = len(blocks)
    full = (1 << n) - 1
    dom = [full] * n
    dom[0] = 1
    changed = True
    while changed:
        changed = False
        for k in range(1, n):
            if k not in reach:
                continue
            d = full
            for p_ in pred_of[k]:
                d &= dom[p_]
            d = (d if pred_of[k] else 0) | (1 << k)
            if d != dom[k]:
                dom[k], changed = d, True
    loops = {}
    for u, ss in succ.items():
        for h in ss:
            if dom[u] >> h & 1:  # back edge u -> h: h dominates u
                body, stack = {h, u}, ([u] if u != h else [])
                while stack:
                    x = stack.pop()
                    for p_ in pred_of[x]:
                        if p_ not in body:
                            body.add(p_)
                            stack.append(p_)
                loops.setdefault(h, set()).update(body)
    return loops, blocks


def tile_loop(code, mma_per_chunk=None):
    """(loop's blocks, blocks, inner loops) of the smallest loop that holds every HMMA; or, given
    mma_per_chunk, the smallest innermost loop (no loop with an HMMA inside it) whose HMMAs are a
    whole number of chunks' (paged_decode.cuh's steady loop: its iterations take 1 to 4
    16-key chunks a warp, and its kernel holds a second, masked copy of the iteration for the
    edge outside it)."""
    loops, blocks = natural_loops(code)

    def hmmas(k):
        return sum(code[i][1].startswith("HMMA") for i in range(blocks[k][0], blocks[k][1] + 1))

    hmma = {k for k in range(len(blocks)) if hmmas(k)}
    if not hmma:
        raise ValueError("no HMMA in the kernel")

    def size(body):
        return sum(blocks[k][1] - blocks[k][0] + 1 for k in body)

    if mma_per_chunk is None:
        holding = [(h, body) for h, body in loops.items() if hmma <= body]
    else:  # (innermost: no loop inside it holds an HMMA, so it cannot be two iterations' copies)

        def innermost(h, body):
            return not any(b < body and b & hmma for h2, b in loops.items() if h2 != h)

        holding = [
            (h, body)
            for h, body in loops.items()
            if sum(hmmas(k) for k in body) % mma_per_chunk == 0 and body & hmma and innermost(h, body)
        ]
    if not holding:
        raise ValueError(
            "no loop holds every HMMA"
            if mma_per_chunk is None
            else f"no innermost loop holds a multiple of {mma_per_chunk} HMMAs"
        )
    header, body = min(holding, key=lambda hb: size(hb[1]))
    inner = sum(1 for h, b in loops.items() if h != header and b < body)
    return body, blocks, inner


def decode_steady_mmas(variant) -> tuple[int, int] | None:
    """(HMMAs of one steady chunk, HMMAs of an iteration besides its chunks') of the decode
    kernels (the 8-row variants; q . K runs on integer MMAs, IMMA, counted apart); None for the
    others.  A chunk: P . V per 16 channels in hi + lo, and on pages (paged_decode.cuh) and the
    contiguous cache's keys per token one for the key zeros x the rows' sums of q.  The
    contiguous cache's keys per channel (contig_decode.cuh) have their zeros as one bias per row
    and key group, its iteration's (one group), on fp16 / bf16 MMAs per 16 channels in hi + lo:
    as many as a chunk's P . V."""
    if variant.rows != 8:
        return None
    pv = 2 * variant.head_dim // 16
    return (pv, pv) if variant.kernel == "contiguous" else (pv + 1, 0)  # (keys per token: as on pages)


# The decode kernels' variants (kernel, bits, head_dim, groups) that --check-budget does not hold
# to the budget, and why.  The target (issue 20): every common format of the decode kernels (the
# 8-row variants: the contiguous cache's keys per channel and per token, vLLM's pages) on sm_90,
# 2/4/8 bits, D 64/128, bf16/fp16, within its budget.
BUDGET_EXEMPT = {
    ("contiguous", 2, 64, 4): "keys per channel, 2 bits, values in groups of 16 channels (as many value meta "
    "bytes as code bytes): a value group costs a 16-key chunk ~30 instructions (its weights in fp16 hi + lo, "
    "their transposes, its zeros) and its bytes buy ~19",
}


def over_budget(variants, arch: str = "sm_90") -> tuple[list, list]:
    """(over, exempt): the decode kernels' variants on arch whose loop is above their budget, apart
    from those BUDGET_EXEMPT lists, and the exempt ones above it."""
    over, exempt = [], []
    for v in variants:
        if v.arch == arch and v.rows == 8 and v.loop_instructions > v.budget:
            (exempt if (v.kernel, v.bits, v.head_dim, v.groups) in BUDGET_EXEMPT else over).append(v)
    return over, exempt


def division_calls(code, body, blocks) -> int:
    """CALLs of the loop into a 64-bit integer division routine: the routine's first
    instructions (before any branch or return) hold the I2F.U64.RP that starts it."""
    addr = {a: i for i, (a, *_rest) in enumerate(code)}
    found = 0
    for k in body:
        for i in range(blocks[k][0], blocks[k][1] + 1):
            _, op, rest, _ = code[i]
            m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("CALL") else None
            j = addr.get(int(m.group(1), 16)) if m else None
            for jj in range(j, min(j + 16, len(code))) if j is not None else ():
                if code[jj][1] == DIV64:
                    found += 1
                    break
                if code[jj][1].split(".")[0] in ("BRA", "RET", "EXIT", "CALL"):
                    break
    return found


def analyse(variant: Variant, code) -> None:
    per_chunk, per_iteration = decode_steady_mmas(variant) or (None, 0)
    body, blocks, inner = tile_loop(code, per_chunk)
    ops = [code[i][1] for k in sorted(body) for i in range(blocks[k][0], blocks[k][1] + 1)]
    counts = {
        "HMMA": sum(op.startswith("HMMA") for op in ops),
        "IMMA": sum(op.startswith("IMMA") for op in ops),
        "BAR": sum(op.startswith("BAR") for op in ops),
        "LDGSTS": sum(op.startswith("LDGSTS") for op in ops),
        "LDS": sum(op.startswith("LDS") for op in ops),
        "SHFL": sum(op.startswith("SHFL") for op in ops),
        "CALL": sum(op.startswith("CALL") for op in ops),  # subroutines: float division's slow path, ...
        "DIV64": division_calls(code, body, blocks),  # ... or the 64-bit integer division (must be 0)
        "IMAD": sum(op.startswith("IMAD") for op in ops),
    }
    barriers = counts["BAR"] + sum(op.startswith("WARPSYNC") for op in ops)
    if barriers == 0 or counts["LDGSTS"] == 0:
        raise ValueError(f"the loop found ({len(ops)} instructions) has no barrier or no cp.async: not the tile loop")
    variant.sass_instructions = len(code)
    # The decode kernel's warp takes loop_chunks 16-key chunks an iteration (its block 64 x as
    # many keys): per 64-key tile, the loop's instructions / loop_chunks (rounded up).
    variant.loop_chunks = (counts["HMMA"] - per_iteration) // per_chunk if per_chunk else 1
    if variant.loop_chunks < 1:
        raise ValueError(f"the loop found holds {counts['HMMA']} HMMAs: not one iteration of whole chunks")
    variant.loop_instructions = -(-len(ops) // variant.loop_chunks)
    variant.loop_inner_loops = inner
    variant.loop_counts = counts


def nq_kernels(cuobjdump: str, obj: str, archs) -> list:
    """[{arch, kernel, type, bits, instructions, div64}] of the NQ element kernels in obj."""
    rows = []
    for arch in archs:
        for fn, code in sass_functions(cuobjdump, obj, arch).items():
            m = NQ_KERNEL.search(fn)
            if m:
                rows.append(
                    {
                        "arch": arch,
                        "kernel": m.group(1),
                        "type": {"f": "fp32", "NS_4core6bf16_tE": "bf16", "NS_4core6half_tE": "fp16"}.get(
                            m.group(2), m.group(2)
                        ),
                        "bits": int(m.group(3)) if m.group(3) else None,
                        "instructions": len(code),
                        "div64": sum(op == DIV64 for _, op, _, _ in code),
                    }
                )
    return sorted(rows, key=lambda r: (r["arch"], r["kernel"], r["type"], r["bits"] or 0))


# The grid of attention_cuda.cpp (kept in step with it): one block per (batch, kv head, row
# tile of kAttnRows query rows) and split of the key range, the splits planned by
# core::plan_splits (csrc/include/nexuskv/core/split_plan.h; plan_splits below is its mirror,
# tests/python/test_cuda_budget.py checks the two agree on its test's cases).
ATTN_ROWS = 16
MIN_SPLIT_KEYS, MAX_SPLITS, SPLIT_OVERHEAD_TILES = 256, 1024, 1
LAUNCH_US = 5.0  # the split kernel plus the merge kernel: two launches


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_splits(units: int, slots: int, keys: int, tile: int) -> int:
    """Splits of least ceil(units * s / slots) * (tiles per split + overhead), fewest among equals."""
    units, slots, tile, keys = max(units, 1), max(slots, 1), max(tile, 1), max(keys, 0)
    best, best_cost = 1, None
    for s in range(1, min(max(keys // MIN_SPLIT_KEYS, 1), MAX_SPLITS) + 1):
        cost = cdiv(units * s, slots) * (cdiv(cdiv(keys, s), tile) + SPLIT_OVERHEAD_TILES)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def row_blocks(q_heads: int, kv_heads: int, q_len: int, block_rows: int) -> int:
    """Blocks of a split per (batch, kv head): one per row tile of ATTN_ROWS query rows, and in
    the contiguous cache's decode kernel (block_rows 8) two per tile where a kv head has more
    than 8 rows (decode_row_blocks, csrc/cuda/contig_decode.cuh); each reads the keys and values."""
    rows = q_heads // kv_heads * q_len
    return cdiv(rows, ATTN_ROWS) * (ATTN_ROWS // block_rows if rows > block_rows else 1)


def grid(
    batch: int, q_heads: int, kv_heads: int, ctx: int, sms: int, blocks_per_sm: int, q_len: int = 1, block_rows=16
) -> tuple[int, int]:
    """(blocks, tiles per block) of one decode step (q_len query tokens a request; block_rows:
    the variant's rows).  blocks_per_sm: the variant's, from its registers alone here; the glue
    asks the CUDA occupancy API, which counts shared memory too (the paged decode kernel's
    stages fit at least what its registers allow on an H200: 2 blocks at 2 bits but D64 in one
    or two groups, and at 4 bits D128 in four groups)."""
    units = batch * kv_heads * row_blocks(q_heads, kv_heads, q_len, block_rows)
    splits = plan_splits(units, max(blocks_per_sm, 1) * sms, ctx, TILE)
    return units * splits, cdiv(cdiv(ctx, splits), TILE)


def predict(variant: Variant, batch: int, q_heads: int, kv_heads: int, ctx: int, args, q_len: int = 1) -> dict:
    """Microseconds of one decode step (one layer; q_len query tokens a request) of `variant`
    and of dense bf16 attention.

    Issue bound: an SM issues at most 4 warp-instructions per cycle, so a block (4 warps of
    loop_instructions per tile) costs at least loop_instructions cycles per tile of the SM's
    issue, and the busiest SM holds ceil(blocks / SMs) blocks; bytes bound: every tile's bytes
    at the budget's fraction of HBM, once per block of a (batch, kv head) and split (reads:
    the blocks of its rows, row_blocks; none from L2, a bound).  Predicted = the larger + two
    launches.  Dense = the bf16 K and V at the same fraction + two launches (FlashAttention /
    SDPA decode reads them once).
    """
    paged = variant.kernel == "paged"  # its splits start at the first key rounded down to 16 (paged_mma.cuh)
    blocks, tiles = grid(
        batch, q_heads, kv_heads, ctx + (15 if paged else 0), args.sms, variant.blocks_per_sm, q_len, variant.rows
    )
    reads = row_blocks(q_heads, kv_heads, q_len, variant.rows)
    # three launches, not two: paged (tiles, split kernel, merge); the contiguous decode kernel
    # (its splits, the full-precision split of the sinks and tail, merge)
    launches = LAUNCH_US * (1.5 if variant.rows == 8 else 1.0)
    hz = args.clock_ghz * 1e9
    issue_us = cdiv(blocks, args.sms) * tiles * variant.loop_instructions / hz * 1e6
    bandwidth = args.fraction * args.hbm_tbps * 1e12
    bytes_us = reads * batch * kv_heads * cdiv(ctx, TILE) * variant.tile_bytes / bandwidth * 1e6
    dense_us = batch * kv_heads * ctx * variant.head_dim * 2 * 2 / bandwidth * 1e6 + LAUNCH_US
    predicted = max(issue_us, bytes_us) + launches
    return {
        "kernel": variant.kernel,
        "batch": batch,
        "context": ctx,
        "bits": variant.bits,
        "q_len": q_len,
        "rows": variant.rows,
        "blocks": blocks,
        "tiles_per_block": tiles,
        "issue_us": issue_us,
        "bytes_us": bytes_us,
        "predicted_us": predicted,
        "dense_bf16_us": dense_us,
        "speedup_vs_dense": dense_us / predicted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build/py", help="a CUDA build of nexuskv (its CMake binary dir)")
    ap.add_argument("--arch", default="sm_90,sm_80")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth, TB/s (H200)")
    ap.add_argument("--fraction", type=float, default=0.75, help="fraction of it to budget for")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--clock-ghz", type=float, default=1.98)
    ap.add_argument("--check-spills", action="store_true", help="exit 1 if any decode kernel spills")
    ap.add_argument(
        "--check-loop-division",
        action="store_true",
        help="exit 1 if a decode kernel's tile loop calls the 64-bit division routine",
    )
    ap.add_argument(
        "--check-nq-division", action="store_true", help="exit 1 if an NQ element kernel divides in 64 bits"
    )
    ap.add_argument(
        "--check-budget",
        action="store_true",
        help="exit 1 if a decode kernel variant on sm_90 (8 rows) is over its budget, but for BUDGET_EXEMPT's",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    objs = sorted(glob.glob(os.path.join(args.build, "CMakeFiles/nexuskv.dir/csrc/cuda/attention_*16.cu.o")))
    objs += glob.glob(os.path.join(args.build, "CMakeFiles/nexuskv.dir/csrc/cuda/paged_kernels.cu.o"))
    if not objs:
        sys.exit(f"cuda_budget: no CUDA attention objects under {args.build} (build with NEXUSKV_WITH_CUDA=ON first)")
    cuobjdump = find_cuobjdump()
    per_sm_bytes_per_cycle = args.fraction * args.hbm_tbps * 1e12 / args.sms / (args.clock_ghz * 1e9)
    variants = []
    for obj in objs:
        res = resources(cuobjdump, obj)
        for arch in args.arch.split(","):
            for fn, code in sass_functions(cuobjdump, obj, arch).items():
                m, kernel = PAGED_KERNEL.search(fn), "paged"
                if not m:
                    m, kernel = CONTIG_DECODE_KERNEL.search(fn), "contiguous-decode"
                if not m:
                    m, kernel = CONTIG_TOKEN_KEYS_KERNEL.search(fn), "contiguous-token-keys"
                if not m:
                    m, kernel = KERNEL.search(fn), "contiguous"
                if not m:
                    continue
                dtype, bits, d = DTYPE[m.group(1)], int(m.group(2)), int(m.group(3))
                r = res.get((arch, fn), {})
                v = Variant(
                    arch,
                    dtype,
                    bits,
                    d,
                    kernel,
                    registers=r.get("REG", 0),
                    stack=r.get("STACK", 0),
                    local=r.get("LOCAL", 0),
                    shared=r.get("SHARED", 0),
                )
                v.blocks_per_sm = 65536 // (max(v.registers, 1) * 32 * WARPS) if v.registers else 0
                if kernel == "paged":
                    v.groups, v.rows = int(m.group(4)), 8 * int(m.group(5))
                    v.tile_bytes = paged_tile_bytes(bits, d, d // v.groups)
                elif kernel == "contiguous-decode":
                    v.kernel, v.groups, v.rows = "contiguous", int(m.group(4)), 8
                    v.tile_bytes = tile_bytes(bits, d, value_groups=v.groups)
                elif kernel == "contiguous-token-keys":
                    v.groups, v.rows = int(m.group(4)), 8
                    v.tile_bytes = paged_tile_bytes(bits, d, d // v.groups)
                else:
                    v.tile_bytes = tile_bytes(bits, d)
                v.budget = v.tile_bytes / per_sm_bytes_per_cycle
                try:
                    analyse(v, code)
                except ValueError as e:
                    sys.exit(f"cuda_budget: {os.path.basename(obj)} {arch} {dtype} {bits}-bit D{d}: {e}")
                variants.append(v)
    variants.sort(key=lambda v: (v.kernel, v.arch, v.dtype, v.bits, v.head_dim, v.groups, v.rows))
    print(
        f"budget: tile bytes / ({args.fraction} * {args.hbm_tbps} TB/s / {args.sms} SMs) * {args.clock_ghz} GHz "
        f"= bytes / {per_sm_bytes_per_cycle:.2f} B per SM-cycle; instructions per warp per 64-key tile"
    )
    head = (
        "kernel",
        "arch",
        "dtype",
        "bits",
        "D",
        "regs",
        "spill",
        "blk/SM",
        "tile B",
        "budget",
        "loop instr",
        "ratio",
        "inner",
        "HMMA",
        "BAR",
        "SHFL",
        "CALL",
        "div64",
    )
    fmt = "{:27} {:6} {:5} {:>4} {:>4} {:>5} {:>5} {:>6} {:>6} {:>7} {:>10} {:>6} {:>5} {:>5} {:>4} {:>5} {:>4} {:>5}"
    print(fmt.format(*head))
    for v in variants:
        c = v.loop_counts
        print(
            fmt.format(
                v.kernel + (f"/{v.groups}g/{v.rows}r" if v.groups else ""),
                v.arch,
                v.dtype,
                v.bits,
                v.head_dim,
                v.registers,
                v.stack + v.local,
                v.blocks_per_sm,
                v.tile_bytes,
                f"{v.budget:.0f}",
                v.loop_instructions,
                f"{v.loop_instructions / v.budget:.2f}",
                v.loop_inner_loops,
                c["HMMA"],
                c["BAR"],
                c["SHFL"],
                c["CALL"],
                c["DIV64"],
            )
        )
    nq_obj = os.path.join(args.build, "CMakeFiles/nexuskv.dir/csrc/cuda/nq_kernels.cu.o")
    nq = nq_kernels(cuobjdump, nq_obj, args.arch.split(",")) if os.path.exists(nq_obj) else []
    print("\nNQ element kernels (one thread per element / packed chunk): static instructions, 64-bit divisions")
    for r in nq:
        name = r["kernel"] + (f"<{r['bits']}-bit>" if r["bits"] else "")
        print(f"{r['arch']:6} {name:26} {r['type']:5} {r['instructions']:6} instr  {r['div64']} div64")
    # The prediction the GPU run will confirm or refute: llama-like decode (32 q / 8 kv heads, D 128).
    predictions = []
    for v in variants:
        # the decode kernels (8 rows: one token a request, GQA 4) of the contiguous cache (values in
        # groups of 64 channels: two per head) and of vLLM's pages in groups of 64
        if v.arch == "sm_90" and v.dtype == "bf16" and v.head_dim == 128 and v.groups == 2 and v.rows == 8:
            for batch in (1, 64):
                for ctx in (4096, 32768):
                    predictions.append(predict(v, batch, 32, 8, ctx, args))
        # a step of 4 query tokens a request (speculative decoding: 16 rows a kv head): the
        # contiguous cache's decode kernel (two blocks of 8 rows) against its 16-row kernel
        if v.arch == "sm_90" and v.dtype == "bf16" and v.head_dim == 128 and v.kernel == "contiguous":
            if v.groups in (0, 2):
                predictions.append(predict(v, 64, 32, 8, 32768, args, q_len=4))
    if predictions:
        print(
            "\nPrediction, sm_90 bf16, 32 q / 8 kv heads, D 128, one decode step of one layer (us): "
            f"max(issue bound, bytes at {args.fraction} x {args.hbm_tbps} TB/s) + {LAUNCH_US:.0f} launch"
        )
        print(
            f"{'kernel':>21} {'rows':>4} {'batch':>5} {'q_len':>5} {'ctx':>6} {'bits':>4} {'blocks':>6} {'tiles':>5} "
            f"{'issue':>8} {'bytes':>7} {'predicted':>9} {'dense':>7} {'speed-up':>8}"
        )
        for p in predictions:
            print(
                f"{p['kernel']:>21} {p['rows']:>4} {p['batch']:>5} {p['q_len']:>5} {p['context']:>6} {p['bits']:>4} "
                f"{p['blocks']:>6} "
                f"{p['tiles_per_block']:>5} "
                f"{p['issue_us']:>8.1f} {p['bytes_us']:>7.1f} {p['predicted_us']:>9.1f} {p['dense_bf16_us']:>7.1f} "
                f"{p['speedup_vs_dense']:>7.2f}x"
            )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            out = {"args": vars(args), "variants": [asdict(v) for v in variants], "nq": nq, "prediction": predictions}
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    dividing = [r for r in nq if r["div64"]]
    if args.check_nq_division and (dividing or not nq):
        sys.exit(
            "cuda_budget: "
            + (
                "64-bit divisions in " + ", ".join(f"{r['arch']} {r['kernel']} {r['type']}" for r in dividing)
                if dividing
                else f"no NQ element kernels found in {nq_obj}"
            )
        )
    spilling = [v for v in variants if v.spills]
    if args.check_spills and spilling:
        sys.exit(
            "cuda_budget: spills in "
            + ", ".join(f"{v.kernel} {v.arch} {v.dtype} {v.bits}-bit D{v.head_dim}" for v in spilling)
        )
    looping = [v for v in variants if v.loop_counts["DIV64"]]
    if args.check_loop_division and looping:
        sys.exit(
            "cuda_budget: 64-bit division calls in the tile loop of "
            + ", ".join(f"{v.kernel} {v.arch} {v.dtype} {v.bits}-bit D{v.head_dim}" for v in looping)
        )

    def label(v):
        return f"{v.kernel}/{v.groups}g {v.dtype} {v.bits}-bit D{v.head_dim} ({v.loop_instructions / v.budget:.3f})"

    over, exempt = over_budget(variants)
    decode = [v for v in variants if v.arch == "sm_90" and v.rows == 8]
    # (an exemption whose variants all came within the budget is listed, so that it can go)
    stale = [k for k in BUDGET_EXEMPT if not any((v.kernel, v.bits, v.head_dim, v.groups) == k for v in exempt)]
    print(
        f"\ndecode kernels on sm_90 within their budget: {len(decode) - len(over) - len(exempt)} of {len(decode)}"
        + "".join(f"\n  exempt: {label(v)}: {BUDGET_EXEMPT[(v.kernel, v.bits, v.head_dim, v.groups)]}" for v in exempt)
        + "".join(f"\n  OVER: {label(v)}" for v in over)
        + "".join(f"\n  exemption no longer needed (within the budget): {k}" for k in stale)
    )
    if args.check_budget and (over or not decode):
        sys.exit(
            "cuda_budget: "
            + ("over the budget: " + ", ".join(label(v) for v in over) if over else "no decode kernel found")
        )


if __name__ == "__main__":
    main()
