"""benchmarks/cuda_dynamic.py's reading of Nsight Compute's CSV (no GPU needed): both layouts,
the kernel variants from their mangled names, the per-tile arithmetic."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cuda_dynamic as cd  # noqa: E402

PAGED = "_ZN7nexuskv4cuda26paged_attention_mma_kernelINS_4core6bf16_tELi4ELi128ELi2ELi1EEEvNS0_12PagedMmaArgsIT_EE"
CONTIG = (
    "_ZN7nexuskv4cuda20attention_mma_kernelINS0_15AttentionLaunchINS_4core15AttentionParamsINS3_6bf16_tES5_S5_"
    "EEEELi2ELi128EEEvNS0_9MmaLaunchIT_EE"
)
DECODE = (
    "_ZN7nexuskv4cuda20contig_decode_kernelINS0_15AttentionLaunchINS_4core15AttentionParamsINS3_6bf16_tES5_S5_"
    "EEEELi2ELi128ELi4EEEvNS0_9MmaLaunchIT_EE"
)
MERGE = "_ZN7nexuskv4cuda22paged_mma_merge_kernelINS_4core6bf16_tEEEvNS0_12PagedMmaArgsIT_EE"
HEAD = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
    '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
)


def details(launch, name, metric, unit, value):
    where = '"1","python","h"'
    return f'"{launch}",{where},"{name}","1","7","(128, 1, 1)","(8, 64, 4)","0","9.0","s","{metric}","{unit}","{value}"'


def test_variants_from_mangled_names():
    assert cd.variant(PAGED) == ("paged", "bf16", 4, 128, 2, 8)
    assert cd.variant(CONTIG) == ("contiguous", "bf16", 2, 128, 0, 16)
    assert cd.variant(DECODE) == ("contiguous", "bf16", 2, 128, 4, 8)  # the contiguous cache's decode kernel
    assert cd.variant(MERGE) is None  # the merge and the pre-pass are not the tile loop
    # ncu's default names are demangled (c++filt's spelling of the two above)
    paged = "void nexuskv::cuda::paged_attention_mma_kernel<nexuskv::core::bf16_t, 4, 128, 2, 1>(PagedMmaArgs<T1>)"
    params = "nexuskv::core::AttentionParams<nexuskv::core::half_t, nexuskv::core::half_t, nexuskv::core::half_t>"
    contig = f"void nexuskv::cuda::attention_mma_kernel<nexuskv::cuda::AttentionLaunch<{params} >, 8, 64>(...)"
    assert cd.variant(paged) == ("paged", "bf16", 4, 128, 2, 8)
    assert cd.variant(contig) == ("contiguous", "fp16", 8, 64, 0, 16)
    decode = f"void nexuskv::cuda::contig_decode_kernel<nexuskv::cuda::AttentionLaunch<{params} >, 4, 128, 2>(...)"
    assert cd.variant(decode) == ("contiguous", "fp16", 4, 128, 2, 8)
    assert cd.variant("void nexuskv::cuda::paged_mma_merge_kernel<nexuskv::core::bf16_t>(...)") is None


def test_details_layout_per_tile_and_ratio():
    # batch 2, context 128: 2 x 8 kv heads x 2 tiles = 32 tiles, x 4 warps = 128 warp-tiles
    text = "\n".join(
        [
            "==PROF== Connected to process 1",
            HEAD,
            details(0, PAGED, "smsp__inst_executed.sum", "inst", "128,000"),
            details(0, PAGED, "gpu__time_duration.sum", "usecond", "2.00"),
            details(0, PAGED, "dram__bytes_read.sum", "Mbyte", "1.00"),
            details(1, MERGE, "smsp__inst_executed.sum", "inst", "5"),
            details(2, CONTIG, "smsp__inst_executed.sum", "inst", "256,000"),
            details(2, CONTIG, "gpu__time_duration.sum", "nsecond", "4,000"),
        ]
    )
    static = {("paged", "bf16", 4, 128, 2, 8): 500, ("contiguous", "bf16", 2, 128, 0, 16): 4000}
    rows = cd.parse(text, static, batch=2, context=128)
    assert [r["kernel"] for r in rows] == ["paged", "contiguous"]
    assert rows[0]["per_warp_per_tile"] == pytest.approx(1000.0)
    assert rows[0]["dynamic_over_static"] == pytest.approx(2.0)
    assert rows[0]["us"] == pytest.approx(2.0)
    assert rows[0]["dram_gbps"] == pytest.approx(500.0)  # 1 MB in 2 us
    assert rows[1]["per_warp_per_tile"] == pytest.approx(2000.0)
    assert rows[1]["dynamic_over_static"] == pytest.approx(0.5)
    assert rows[1]["us"] == pytest.approx(4.0)


def test_raw_layout():
    head = (
        HEAD.split(',"Section Name"')[0] + ',"dram__bytes_read.sum","gpu__time_duration.sum","smsp__inst_executed.sum"'
    )
    units = '"","","","","","","","","","","","byte","second","inst"'
    launch = f'"0","1","python","h","{PAGED}","1","7","(128, 1, 1)","(8, 64, 4)","0","9.0"'
    row = launch + ',"1,000,000","2.0e-06","128,000"'
    rows = cd.parse("\n".join([head, units, row]), {}, batch=2, context=128)
    assert len(rows) == 1 and rows[0]["per_warp_per_tile"] == pytest.approx(1000.0)
    assert rows[0]["us"] == pytest.approx(2.0) and rows[0]["dram_gbps"] == pytest.approx(500.0)
    assert rows[0]["static_loop"] is None


def test_the_static_counts_are_the_budget_json():
    counts = cd.static_counts(str(Path(cd.__file__).with_name("cuda_budget.json")))
    assert counts[("paged", "bf16", 4, 128, 2, 8)] > 0 and counts[("contiguous", "bf16", 4, 128, 0, 16)] > 0
    # the decode kernel's variant of the profiled call (values in groups of 64: 2 a token at D 128)
    assert counts[("contiguous", "bf16", 2, 128, 2, 8)] > 0
    # a launch's row finds its variant's static count there (the names from both sides agree)
    text = "\n".join([HEAD, details(0, PAGED, "smsp__inst_executed.sum", "inst", "128,000")])
    (row,) = cd.parse(text, counts, batch=2, context=128)
    assert row["static_loop"] == counts[("paged", "bf16", 4, 128, 2, 8)]
    assert row["dynamic_over_static"] == pytest.approx(1000.0 / row["static_loop"])


def test_the_profiled_calls_run_on_the_cpu(monkeypatch):
    # The calls ncu profiles on a GPU (both caches, every width), here on the CPU kernels:
    # catches a wrong argument before a lent GPU's minutes do.
    # The kernel choice it sets per call does not outlive it.
    monkeypatch.setenv("NEXUSKV_CUDA_ATTENTION", "simple")
    cd.run(batch=2, context=128, bits_list=[2, 4, 8], device="cpu")
    assert os.environ["NEXUSKV_CUDA_ATTENTION"] == "simple"
    monkeypatch.delenv("NEXUSKV_CUDA_ATTENTION")
    cd.run(batch=1, context=64, bits_list=[4], device="cpu")
    assert "NEXUSKV_CUDA_ATTENTION" not in os.environ
