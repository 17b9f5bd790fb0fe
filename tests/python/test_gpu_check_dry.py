"""benchmarks/gpu_check.sh runs once, on a lent GPU, with no second try: its dry mode
(GPU_CHECK_DRY=1) checks here, without a GPU, what that run needs: the installed nexuskv
loads with its CUDA kernels, every test file of the tests step collects with the same
selection and skips, the sanitizers' smoke script runs its cases on the CPU, bench_cuda.py
takes the chosen flags; and the CUDA-only test files skip, not fail, without hypothesis or
transformers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_cuda_build import cuda_toolchain

from nexuskv import _build_info

ROOT = Path(__file__).resolve().parents[2]
OUT_FILES = {
    "gpu_check.log",
    "summary.txt",
    "build.log",
    "tests.log",
    "tests.xml",
    "sanitizer.log",
    "bench_cuda.txt",
    "bench_cuda.json",
}
TOOLS = ("hypothesis", "transformers", "pytest-xdist", "pytest-timeout", "compute-sanitizer")


def clean_env(**values: str) -> dict:
    """This environment without what would change the dry run's choices, plus values."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_BUILD", "NEXUSKV_CUDA_ARCHITECTURES")}
    env.update(values)
    return env


@pytest.mark.skipif(
    not (_build_info.WITH_CUDA and cuda_toolchain()),
    reason="the installed nexuskv has no CUDA kernels or nvcc is absent: the dry run would have to build them",
)
def test_the_dry_run_checks_what_the_gpu_run_needs_and_stops_before_cuda(tmp_path):
    out = tmp_path / "out"
    env = clean_env(GPU_CHECK_DRY="1", OUT=str(out), PYTHON=sys.executable)
    r = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    summary = (out / "summary.txt").read_text().splitlines()
    steps = {line.split()[0]: line.split(None, 1)[1] for line in summary}
    assert list(steps) == ["build", "loads", "collect", "smoke-cpu", "bench-flags", "dry-run"], summary
    assert steps["build"].startswith("SKIP (dry: CUDA installed)"), summary
    for name in ("loads", "collect", "smoke-cpu", "bench-flags"):
        assert steps[name].startswith("PASS"), summary
    assert steps["dry-run"].startswith("STOP (dry run, before CUDA)"), summary
    assert "no CUDA call was made, exit 0" in log
    # One line per optional tool: its version, or what its absence skips.
    for tool in TOOLS:
        assert re.search(rf"^(tool|skipped): {tool} ", log, re.M), f"no line for {tool}"
    # Every CUDA test file was collected with tests in it, or was skipped for a missing tool.
    counts = dict(re.findall(r"^(tests/python/test_\w+\.py): (\d+)$", (out / "tests.log").read_text(), re.M))
    for path in sorted(ROOT.glob("tests/python/test_cuda_*.py")):
        name = f"tests/python/{path.name}"
        skipped = re.search(rf"^skipped: .*{re.escape(name)}", log, re.M)
        assert skipped or int(counts.get(name, 0)) > 0, f"{name}: not collected ({counts})"
    assert {p.name for p in out.iterdir()} <= OUT_FILES


def test_the_cuda_files_skip_without_hypothesis_or_transformers(tmp_path):
    # Packages of those names that raise what a missing module raises stand for their
    # absence (and hypothesis' pytest plugin, which comes with it, is off).
    for name in ("hypothesis", "transformers"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ModuleNotFoundError('hidden: {name}', name='{name}')\n")
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    files = [
        "tests/python/test_cuda_attention.py",
        "tests/python/test_cuda_paged.py",
        "tests/python/test_cuda_cache_hf.py",
    ]
    flags = "--collect-only -q -rs -p no:cacheprovider -p no:hypothesispytest".split()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *files, *flags],
        cwd=ROOT,
        env=clean_env(PYTHONPATH=pythonpath),
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = r.stdout + r.stderr
    assert r.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, log[-4000:]  # 2 would be a collection error
    assert "hypothesis is not installed" in log and "transformers is not installed" in log, log[-4000:]
