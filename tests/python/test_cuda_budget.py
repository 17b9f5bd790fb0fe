"""benchmarks/cuda_budget.py finds the tile loop in SASS by its control-flow graph: checked on
small hand-written listings in cuobjdump's format (no CUDA needed), including the shapes ptxas
produces (blocks placed after the loop, a predicated CALL used as a branch, a self-loop, a
loop entered at its condition), and that a loop with more work counts more."""

import importlib.util
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("cuda_budget", os.path.join(ROOT, "benchmarks", "cuda_budget.py"))
cb = importlib.util.module_from_spec(spec)
sys.modules["cuda_budget"] = cb  # (its dataclasses look their module up)
spec.loader.exec_module(cb)


def listing(lines):
    """cuobjdump -sass text of one function from (opcode and operands) lines, 16 bytes apart."""
    body = "\n".join(f"        /*{16 * i:04x}*/                   {ins} ;    /* 0x0 */" for i, ins in enumerate(lines))
    return "\t\tFunction : kernel\n" + body + "\n"


def tile(extra=0):
    # prologue; loop header at 0x30 (index 3); cold block placed after the loop; exit.
    return [
        "S2R R0, SR_TID.X",
        "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]",
        "MOV R5, RZ",
        "BAR.SYNC.DEFER_BLOCKING 0x0",  # 0x30: header
        "HMMA.16816.F32.BF16 R8, R12, R16, R8",
        *["FADD R20, R20, R21"] * extra,
        "@P0 BRA 0x0c0",  # to the cold block (index 12 without extra)
        "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]",
        "HMMA.16816.F32.BF16 R8, R12, R16, R8",
        "ISETP.NE.AND P1, PT, R5, R6, PT",
        "@P1 BRA 0x030",  # back edge
        "EXIT",
        "BRA 0x0b0",  # padding self-loop
    ]


def fix_targets(lines):
    """Resolve the cold-block target to the index of the line after EXIT's padding."""
    cold = len(lines) * 16
    out = [ln.replace("0x0c0", f"0x{cold:03x}") for ln in lines]
    # the cold block: some work, then back into the loop (before the back edge)
    out += [
        "IMAD R30, R31, R32, RZ",
        f"BRA 0x{16 * (lines.index('LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]', 2)):03x}",
    ]
    return out


def analyse(lines):
    code = cb.parse_sass(listing(lines))["kernel"]
    v = cb.Variant("sm_90", "bf16", 4, 128)
    cb.analyse(v, code)
    return v


def test_finds_the_loop_with_its_cold_block_and_counts_more_work():
    base = analyse(fix_targets(tile()))
    assert base.loop_counts["HMMA"] == 2 and base.loop_counts["BAR"] == 1 and base.loop_counts["LDGSTS"] == 1
    # header..back edge (7 instructions) + the cold block (2); not the prologue, EXIT or padding
    assert base.loop_instructions == 9
    slowed = analyse(fix_targets(tile(extra=7)))
    assert slowed.loop_instructions == base.loop_instructions + 7


def test_a_predicated_call_is_a_branch_and_a_self_loop_is_not_the_whole_kernel():
    lines = [
        "S2R R0, SR_TID.X",
        "BAR.SYNC.DEFER_BLOCKING 0x0",  # 0x10: header
        "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]",
        "HMMA.16816.F32.BF16 R8, R12, R16, R8",
        "IADD3 R5, R5, 0x1, RZ",  # 0x40: a spin (self-loop)
        "@P2 BRA 0x040",
        "@P1 CALL.REL.NOINC 0x090",  # leaves the loop (ptxas's branch idiom)
        "BRA 0x010",  # back edge
        "EXIT",
        "EXIT",  # 0x90
    ]
    v = analyse(lines)
    assert v.loop_instructions == 7 and v.loop_inner_loops == 1


def test_a_warp_barrier_marks_the_decode_kernels_loop():
    # paged_decode.cuh: each warp its own chunks, __syncwarp (WARPSYNC) instead of a block barrier
    lines = [ln.replace("BAR.SYNC.DEFER_BLOCKING 0x0", "WARPSYNC.ALL") for ln in fix_targets(tile())]
    v = analyse(lines)
    assert v.loop_instructions == 9 and v.loop_counts["BAR"] == 0


def decode_kernel(edge_extra=0, steady_extra=0, chunks=1, contiguous=False):
    # paged_decode.cuh's shape: an outer loop over the iterations whose edge ones run a masked copy
    # of the iteration's work, and inside it the steady loop over those every row sees whole.
    # A chunk: q . K (IMMA), the key zeros x the rows' sums of q (paged: HMMA.1688), P . V (2 HMMAs);
    # contiguous (contig_decode.cuh): the key group's q . zero once an iteration (2 HMMAs), none a chunk.
    chunk = [
        "IMMA.16832.S8.S8 R4, R12, R16, R4",
        *([] if contiguous else ["HMMA.1688.F32.BF16 R24, R12, R16, RZ"]),
        "HMMA.16816.F32.BF16 R8, R12, R16, R8",
        "HMMA.16816.F32.BF16 R8, R12, R16, R8",
    ]
    group = ["HMMA.16816.F32.BF16 R28, R12, R16, R28"] * 2 if contiguous else []
    return [
        "S2R R0, SR_TID.X",
        "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]",
        "ISETP.GE.AND P0, PT, R5, R6, PT",  # 0x20: outer header
        "@!P0 BRA 0x{edge:03x}",
        "WARPSYNC.ALL",  # 0x40: steady header
        "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]",
        *group,
        *chunk * chunks,
        *["FMUL R20, R20, R21"] * steady_extra,
        "@P1 BRA 0x040",  # steady back edge
        "BRA 0x{next:03x}",
        # edge: the same work, masked
        "WARPSYNC.ALL",
        "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]",
        *group,
        *chunk * chunks,
        *["FSEL R22, R22, -INF, P3"] * (4 + edge_extra),
        "@P2 BRA 0x020",  # next: outer back edge
        "EXIT",
    ]


def resolve(lines):
    edge = lines.index("BRA 0x{next:03x}") + 1
    nxt = len(lines) - 2
    return [ln.format(edge=16 * edge, next=16 * nxt) for ln in lines]


def test_the_decode_kernels_steady_loop_is_the_one_holding_one_chunks_mmas():
    v = cb.Variant("sm_90", "bf16", 4, 16, "paged", groups=1, rows=8)  # D 16: 2 HMMAs (P . V) + 1 per chunk
    cb.analyse(v, cb.parse_sass(listing(resolve(decode_kernel())))["kernel"])
    assert v.loop_counts["HMMA"] == 3 and v.loop_counts["IMMA"] == 1
    assert v.loop_instructions == 7  # header .. back edge of the inner loop
    # more work in the steady loop counts; more on the edge does not
    w = cb.Variant("sm_90", "bf16", 4, 16, "paged", groups=1, rows=8)
    cb.analyse(w, cb.parse_sass(listing(resolve(decode_kernel(edge_extra=9, steady_extra=5))))["kernel"])
    assert w.loop_instructions == v.loop_instructions + 5
    # a kernel without a loop of exactly one chunk's MMAs is refused, not counted
    x = cb.Variant("sm_90", "bf16", 4, 32, "paged", groups=1, rows=8)  # D 32: 5 per chunk
    with pytest.raises(ValueError, match="no innermost loop holds a multiple of 5 HMMAs"):
        cb.analyse(x, cb.parse_sass(listing(resolve(decode_kernel())))["kernel"])
    # two chunks an iteration (32 keys a warp, 128 a block): per 64-key tile, half the loop
    y = cb.Variant("sm_90", "bf16", 4, 16, "paged", groups=1, rows=8)
    cb.analyse(y, cb.parse_sass(listing(resolve(decode_kernel(chunks=2, steady_extra=1))))["kernel"])
    assert y.loop_chunks == 2 and y.loop_counts["HMMA"] == 6
    assert y.loop_instructions == 6  # (WARPSYNC, LDGSTS, 2 IMMA, 6 HMMA, FMUL, BRA) / 2
    # three chunks: a third of the loop, rounded up
    z = cb.Variant("sm_90", "bf16", 2, 16, "paged", groups=1, rows=8)
    cb.analyse(z, cb.parse_sass(listing(resolve(decode_kernel(chunks=3, steady_extra=2))))["kernel"])
    assert z.loop_chunks == 3 and z.loop_counts["HMMA"] == 9
    assert z.loop_instructions == 6  # (WARPSYNC, LDGSTS, 3 IMMA, 9 HMMA, 2 FMUL, BRA) / 3 = 17 / 3, up


def test_the_contiguous_decode_kernels_iteration_holds_one_groups_zero_mmas():
    # contig_decode.cuh: per chunk P . V (2 HMMAs at D 16) and q . K (IMMA); per iteration as many
    # HMMAs again for the key group's q . zero
    v = cb.Variant("sm_90", "bf16", 2, 16, "contiguous", groups=1, rows=8)
    cb.analyse(v, cb.parse_sass(listing(resolve(decode_kernel(chunks=3, steady_extra=2, contiguous=True))))["kernel"])
    assert v.loop_counts["HMMA"] == 8 and v.loop_counts["IMMA"] == 3 and v.loop_chunks == 3
    assert v.loop_instructions == 6  # (WARPSYNC, LDGSTS, 2 + 3 x 3 MMAs, 2 FMUL, BRA) / 3 = 16 / 3, up
    # counted as the paged kernel's (3 HMMAs a chunk), the same loop would not divide into chunks
    code = cb.parse_sass(listing(resolve(decode_kernel(chunks=3, contiguous=True))))["kernel"]
    with pytest.raises(ValueError, match="no innermost loop holds a multiple of 3 HMMAs"):
        cb.analyse(cb.Variant("sm_90", "bf16", 2, 16, "paged", groups=1, rows=8), code)


def test_refuses_a_loop_without_barrier_or_copy():
    lines = ["S2R R0, SR_TID.X", "HMMA.16816.F32.BF16 R8, R12, R16, R8", "@P0 BRA 0x010", "EXIT"]
    with pytest.raises(ValueError, match="not the tile loop"):
        analyse(lines)


def test_tile_bytes_and_budget_of_the_issue():
    assert cb.tile_bytes(4, 128) == 9216 and cb.tile_bytes(2, 128) == 5120


def test_nq_kernels_count_64_bit_division_sites(monkeypatch):
    # One decompress kernel with the inline 64-bit division routine, one pack kernel without.
    names = {
        "_ZN7nexuskv4cuda20nq_decompress_kernelIfEEvNS_4core6NQDimsE": [
            "S2R R0, SR_TID.X",
            "I2F.U64.RP R2, R4",
            "EXIT",
        ],
        "_ZN7nexuskv4cuda14nq_pack_kernelINS_4core6bf16_tELi4EEEvNS_4core6NQDimsE": [
            "IMAD.HI.U32 R1, R2, R3, RZ",
            "EXIT",
        ],
        "_ZN7nexuskv4cuda21nq_meta_minmax_kernelIffEEvNS_4core6NQDimsE": ["I2F.U64.RP R2, R4", "EXIT"],
    }
    text = "".join(listing(body).replace("kernel\n", name + "\n", 1) for name, body in names.items())
    monkeypatch.setattr(cb, "sass_functions", lambda cuobjdump, obj, arch: cb.parse_sass(text))
    rows = cb.nq_kernels("cuobjdump", "nq_kernels.cu.o", ["sm_90"])
    assert [(r["kernel"], r["type"], r["bits"], r["instructions"], r["div64"]) for r in rows] == [
        ("nq_decompress_kernel", "fp32", None, 3, 1),
        ("nq_pack_kernel", "bf16", 4, 2, 0),
    ]


def test_the_split_planner_mirror_is_in_step_with_the_header():
    """cuda_budget.plan_splits mirrors core::plan_splits (split_plan.h): the same constants, and
    the plans tests/cpp/test_split_plan.cpp asserts for an H200 at 3 blocks per SM."""
    header = open(os.path.join(ROOT, "csrc/include/nexuskv/core/split_plan.h")).read()
    consts = {m[1]: int(m[2]) for m in re.finditer(r"constexpr int64_t (\w+) = (\d+);", header)}
    assert consts == {
        "kSplitOverheadTiles": cb.SPLIT_OVERHEAD_TILES,
        "kMinSplitKeys": cb.MIN_SPLIT_KEYS,
        "kMaxSplits": cb.MAX_SPLITS,
    }
    assert cb.plan_splits(512, 396, 32768, 64) == 3  # batch 64: 4 waves 97 % full, not 2 (the second 29 %)
    assert cb.plan_splits(8, 396, 32768, 64) == 47  # batch 1: one wave of 376 blocks, 11 tiles each
    assert [cb.plan_splits(1, 396, k, 64) for k in (0, 511, 512)] == [1, 1, 2]
    assert cb.plan_splits(1, 1 << 30, 1 << 40, 64) == cb.MAX_SPLITS


def test_the_prediction_follows_the_grid_and_the_counts():
    """The falsifiable prediction of RESULTS.md: the grid of attention_cuda.cpp (splits planned
    over the variant's block slots, of at least 256 keys), an issue bound linear in the loop's
    instructions, the bytes of every tile at the budget's fraction of HBM, and dense bf16 K/V
    at the same fraction."""
    assert cb.grid(1, 32, 8, 4096, 132, 3) == (128, 4)  # 16 splits of 256 keys (no more: 256 at least)
    assert cb.grid(1, 32, 8, 32768, 132, 3) == (376, 11)  # 47 splits: one wave
    assert cb.grid(64, 32, 8, 32768, 132, 3) == (1536, 171)  # 3 splits: 4 waves of 3 blocks per SM

    class Args:
        sms, clock_ghz, fraction, hbm_tbps = 132, 1.98, 0.75, 4.8

    v = cb.Variant("sm_90", "bf16", 4, 128, loop_instructions=1000, tile_bytes=cb.tile_bytes(4, 128))
    v.blocks_per_sm = 3
    p = cb.predict(v, 64, 32, 8, 32768, Args)
    # ceil(1536 / 132) blocks of 171 tiles on the busiest SM
    assert p["issue_us"] == pytest.approx(12 * 171 * 1000 / 1.98e9 * 1e6)
    assert p["bytes_us"] == pytest.approx(64 * 8 * 512 * 9216 / (0.75 * 4.8e12) * 1e6)
    assert p["dense_bf16_us"] == pytest.approx(64 * 8 * 32768 * 128 * 4 / (0.75 * 4.8e12) * 1e6 + cb.LAUNCH_US)
    assert p["predicted_us"] == pytest.approx(max(p["issue_us"], p["bytes_us"]) + cb.LAUNCH_US)
    v.loop_instructions = 2000
    assert cb.predict(v, 64, 32, 8, 32768, Args)["issue_us"] == pytest.approx(2 * p["issue_us"])
    # More query rows: a block of each row tile of 16 (the 16-row kernels), the contiguous decode
    # kernel two blocks of 8 where a kv head has more than 8; each block reads the cache.
    assert [cb.row_blocks(32, 8, q, 16) for q in (1, 4, 5)] == [1, 1, 2]
    assert [cb.row_blocks(32, 8, q, 8) for q in (1, 2, 4, 5)] == [1, 1, 2, 4]
    v.loop_instructions, v.rows = 1000, 8
    p4 = cb.predict(v, 64, 32, 8, 32768, Args, q_len=4)
    assert p4["blocks"] == cb.grid(64, 32, 8, 32768, 132, 3, 4, 8)[0] and p4["rows"] == 8
    assert cb.grid(64, 32, 8, 32768, 132, 3, 4, 8) == (5120, 103)  # 1024 blocks of 8 rows a split, 5 splits
    assert p4["bytes_us"] == pytest.approx(2 * p["bytes_us"])  # (no L2 reuse: the bound)
    v.rows = 16
    assert cb.predict(v, 64, 32, 8, 32768, Args, q_len=4)["bytes_us"] == pytest.approx(p["bytes_us"])


def test_counts_the_loops_calls_into_the_64_bit_division_routine():
    """div64 (and --check-loop-division): a CALL of the tile loop whose target starts the 64-bit
    division routine counts; a CALL to another subroutine (float division's slow path) does not,
    nor does one outside the loop."""
    lines = [
        "S2R R0, SR_TID.X",
        "CALL.REL.NOINC 0x0a0",  # before the loop: not counted
        "BAR.SYNC.DEFER_BLOCKING 0x0",  # 0x20: header
        "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]",
        "HMMA.16816.F32.BF16 R8, R12, R16, R8",
        "CALL.REL.NOINC 0x0a0",  # 64-bit division
        "CALL.REL.NOINC 0x0e0",  # reciprocal slow path
        "@P1 BRA 0x020",  # back edge
        "EXIT",
        "BRA 0x090",  # padding
        "IADD3 R28, P3, RZ, -R77, RZ",  # 0xa0: the division routine
        "I2F.U64.RP R98, R28",
        "MUFU.RCP R98, R98",
        "RET.REL.NODEC R20 0x0",
        "IMAD.SHL.U32 R48, R62, 0x2, RZ",  # 0xe0: another routine
        "RET.REL.NODEC R20 0x0",
        "I2F.U64.RP R98, R28",  # past its return: not part of it
    ]
    v = analyse(lines)
    assert v.loop_counts["CALL"] == 2 and v.loop_counts["DIV64"] == 1


def test_the_contiguous_decode_kernel_of_keys_per_token_counts_as_the_paged_one():
    # contig_decode_token_keys_kernel: per chunk P . V (2 HMMAs at D 16), the key zeros' MMA and
    # q . K (IMMA), as paged_decode.cuh (DecodeWarp::token_keys_iteration); none an iteration
    v = cb.Variant("sm_90", "bf16", 4, 16, "contiguous-token-keys", groups=1, rows=8)
    cb.analyse(v, cb.parse_sass(listing(resolve(decode_kernel(chunks=2, steady_extra=1))))["kernel"])
    assert v.loop_chunks == 2 and v.loop_counts["HMMA"] == 6 and v.loop_instructions == 6
    code = cb.parse_sass(listing(resolve(decode_kernel(chunks=3, contiguous=True))))["kernel"]
    with pytest.raises(ValueError, match="no innermost loop holds a multiple of 3 HMMAs"):
        cb.analyse(cb.Variant("sm_90", "bf16", 2, 16, "contiguous-token-keys", groups=1, rows=8), code)


def test_the_contiguous_decode_kernel_patterns_tell_the_key_layouts_apart():
    args = "INS0_15AttentionLaunchINS_4core15AttentionParamsINS3_6bf16_tES5_S5_EEEELi2ELi64ELi4EEEvNS0_9MmaLaunchIT_EE"
    channel = "_ZN7nexuskv4cuda20contig_decode_kernel" + args
    token = "_ZN7nexuskv4cuda31contig_decode_token_keys_kernel" + args
    assert cb.CONTIG_DECODE_KERNEL.search(channel).groups() == ("bf16_t", "2", "64", "4")
    assert cb.CONTIG_TOKEN_KEYS_KERNEL.search(token).groups() == ("bf16_t", "2", "64", "4")
    assert cb.CONTIG_DECODE_KERNEL.search(token) is None and cb.CONTIG_TOKEN_KEYS_KERNEL.search(channel) is None
    assert cb.KERNEL.search(token) is None and cb.PAGED_KERNEL.search(token) is None


def test_the_kernel_name_pattern_reads_bits_and_head_dim():
    name = (
        "_ZN7nexuskv4cuda20attention_mma_kernelINS0_15AttentionLaunchINS_4core15AttentionParamsINS3_6bf16_tES5_S5_"
        "EEEELi4ELi128EEEvNS0_9MmaLaunchIT_EE"
    )
    assert cb.KERNEL.search(name).groups() == ("bf16_t", "4", "128")


def test_the_paged_kernel_pattern_reads_bits_head_dim_and_groups():
    name = "_ZN7nexuskv4cuda26paged_attention_mma_kernelINS_4core6bf16_tELi4ELi128ELi2ELi1EEEvNS0_12PagedMmaArgsIT_EE"
    assert cb.PAGED_KERNEL.search(name).groups() == ("bf16_t", "4", "128", "2", "1")
    assert cb.KERNEL.search(name) is None  # not counted twice, as a contiguous variant
    assert cb.paged_tile_bytes(4, 128, 64) == 2 * 64 * 64 + 64 * 2 * 4 * 2  # codes + 4 meta per token and group


def test_the_budget_gate_holds_every_decode_variant_on_sm_90_but_the_exempt():
    def variant(kernel, bits, d, groups, loop, rows=8, arch="sm_90"):
        v = cb.Variant(arch, "bf16", bits, d, kernel, groups=groups, rows=rows, loop_instructions=loop)
        v.budget = 200.0
        return v

    within = variant("contiguous", 2, 64, 2, 199)
    exempt = variant("contiguous", 2, 64, 4, 260)
    assert ("contiguous", 2, 64, 4) in cb.BUDGET_EXEMPT
    over_paged = variant("paged", 2, 64, 4, 201)
    others = [
        variant("contiguous", 2, 64, 0, 2000, rows=16),  # the 16-row kernel: a report, not held
        variant("contiguous", 2, 64, 2, 300, arch="sm_80"),  # sm_80: a report
    ]
    over, ex = cb.over_budget([within, exempt, over_paged, *others])
    assert over == [over_paged] and ex == [exempt]
    # exactly at the budget is within it
    assert cb.over_budget([variant("contiguous-token-keys", 4, 128, 2, 200)]) == ([], [])
