#!/usr/bin/env bash
# Proves the CUDA backend of nexuskv on a GPU machine, in one run of under 8 minutes:
#   1. records the machine (GPU, driver, torch, nvcc) and which optional tools are there,
#   2. builds nexuskv from this checkout for the GPU that is there
#      (pip install --no-build-isolation --no-deps --no-index: no network needed; building
#      here is also what matches the library to this machine's torch), or, with
#      GPU_CHECK_WHEEL=FILE.whl, unpacks a wheel built elsewhere against this machine's torch
#      (the build minutes are the lease's scarcest); a wheel that does not load is replaced
#      by the build,
#   3. stops with a clear message if torch sees no GPU (the first CUDA call),
#   4. runs the CUDA test suites (tests/python/test_cuda_*.py, the CUDA cases of
#      test_cache_device.py, test_attention.py and test_paged.py),
#   5. runs compute-sanitizer memcheck on small cases of every kernel (the smoke script),
#   6. runs the GPU benchmark (benchmarks/bench_cuda.py) on the grid of issue 23,
#   7. runs compute-sanitizer racecheck on the same small cases,
#   8. with what is left of the budget, reads the tensor-core kernels' dynamic instruction count
#      per tile with Nsight Compute (benchmarks/cuda_dynamic.py; a measurement: never fails the run).
# A step whose time limit would pass the 8-minute budget is cut short or skipped (and
# the run then fails, saying so in summary.txt).
#
# Optional tools: each missing one (or one that fails on import) is named on a
# "skipped: ..." line and skips exactly what needs it, nothing fails for it:
#   hypothesis         test_cuda_attention.py and test_attention.py are not run
#   transformers       test_cuda_cache_hf.py is not run
#   pytest-xdist       the tests run in one process (slower: they may reach their limit)
#   pytest-timeout     no per-test limit (the step's limit still holds)
#   compute-sanitizer  memcheck and racecheck are SKIP (looked for in PATH, $CUDA_HOME,
#                      $CUDA_PATH, nvcc's toolkit, /usr/local/cuda*)
#
# Dry mode (GPU_CHECK_DRY=1, CI runs it through tests/python/test_gpu_check_dry.py): the
# same machine record, tool lines, file selection and flags, without a GPU: the build is
# skipped when the installed nexuskv already has its CUDA kernels (GPU_CHECK_BUILD=1 builds
# anyway), `loads` runs, then in place of the GPU steps: every test file the tests step
# would run must collect (same selection and skips), the smoke script must import and run
# its cases on the CPU, bench_cuda.py must parse the chosen flags; it stops before the
# first CUDA call: exit 0 when all of that passed, 1 otherwise.
#
# Everything goes to $OUT (default results/gpu_check), at most 8 files:
#   gpu_check.log (all output), summary.txt (one line per step), build.log, tests.log,
#   tests.xml (junit), sanitizer.log, bench_cuda.txt, bench_cuda.json.
# Written for an H200 with torch 2.11+cu130, Python 3.12, nvcc 13.0, scikit-build-core,
# ninja, pytest; PYTHON picks the interpreter.
#
# Knobs: GPU_CHECK_BUDGET_S (the run's seconds, 470), GPU_CHECK_BENCH_S (the bench step's, 60),
# GPU_CHECK_BENCH_EXTRA (flags added to bench_cuda.py's, e.g. "--graphs --paged"),
# GPU_CHECK_NCU_S (the ncu step's most, 40; 0 skips it).
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
#   GPU_CHECK_DRY=1 OUT=/tmp/out PYTHON=/path/to/venv/bin/python bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/results/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY:-0}
[ "$DRY" = 0 ] && DRY=
SUMMARY=$OUT/summary.txt
# A fresh set of files: several steps append to the same log.
: >"$SUMMARY"
for f in gpu_check.log build.log tests.log sanitizer.log bench_cuda.txt; do : >"$OUT/$f"; done
rm -f "$OUT/tests.xml" "$OUT/bench_cuda.json"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
START=$SECONDS
export PYTHONUNBUFFERED=1
FAILED=0

# ---- time plan -------------------------------------------------------------------------
# The device is lent for 15 minutes, start-up included: the run gets 470 s, and the sum of
# the step limits below plus what runs outside steps fits in it (16-core H200):
#   outside steps  25 s  machine record, tool probes (imports torch, transformers), the
#                        first CUDA call (limited to 30 s; a few seconds normally)
#   build         170 s  one architecture (the GPU's, 90-real) with 16 jobs: half the nvcc
#                        work of the default three; the slowest file (attention_f16.cu) took
#                        150 s for all three on a shared 2-core machine
#   loads          20 s  import torch and nexuskv
#   tests         100 s  at least; they also get whatever the build left unused (all the
#                        time not reserved for the steps after them): about 1200 tests on
#                        8 xdist workers, 2 CPU threads each (the CPU float64 references
#                        dominate; 8 x 2 threads = the 16 cores)
#   memcheck       45 s  the smoke script only (every kernel once, small shapes)
#   bench          60 s  GQA 32/8, d128, q_len 1: batch 1 and 64 x context 4K and 32K x
#                        8/4/2 bits, fused vs dense bf16 (and fp16) SDPA, 20 reps each
#                        (the figures of issue 23; 128K and batch 16 are left out)
#   racecheck      45 s  the smoke script only
#   ncu         <= 40 s  only in what is left (GPU_CHECK_NCU_S; with a wheel, most of the build's)
#   margin         5 s   timeout's --kill-after and tee between steps
BUDGET=${GPU_CHECK_BUDGET_S:-470}
BUILD_S=${GPU_CHECK_BUILD_S:-170}
LOADS_S=20 TESTS_S=100 MEMCHECK_S=45 BENCH_S=${GPU_CHECK_BENCH_S:-60} NCU_S=${GPU_CHECK_NCU_S:-40} RACECHECK_S=45
MARGIN_S=5

summary_line() { printf '%-12s %-28s %4ds\n' "$1" "$2" "$3" | tee -a "$SUMMARY"; }

# step NAME TIMEOUT_S LOGFILE COMMAND...: runs COMMAND with a time limit, its output also to
# LOGFILE.  A step starts only if its limit still fits the budget (else it is cut to what is
# left, or skipped below 20 s, and the run fails).
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  if [ $((SECONDS - START + limit)) -gt "$BUDGET" ]; then
    limit=$((BUDGET - (SECONDS - START)))
    if [ "$limit" -lt 20 ]; then
      summary_line "$name" "SKIP (8-minute budget)" 0
      FAILED=1
      return 1
    fi
  fi
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local verdict=PASS
  [ "$rc" -eq 0 ] || verdict="FAIL (exit $rc$([ "$rc" -eq 124 ] && echo ', time limit'))"
  [ "$rc" -eq 0 ] || FAILED=1
  summary_line "$name" "$verdict" $((SECONDS - t0))
  return "$rc"
}

# skip NAME REASON: a step that cannot run here for a reason that is not a failure.
skip() {
  echo "== $1: SKIP ($2)"
  summary_line "$1" "SKIP ($2)" 0
}

echo "== machine${DRY:+ (dry run: no CUDA call)}"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
else
  echo "nvidia-smi: not found"
fi
nvcc --version 2>&1 | tail -2 || true
cmake --version 2>&1 | head -1 || true
echo "cpus: $(nproc)"

# One interpreter (imports cost seconds): torch, the optional Python tools (imported, not
# only looked up: an install that fails on import is "broken" and counts as missing) and
# the installed nexuskv.
# torch.cuda.is_available() asks the driver for a device count; it creates no CUDA context.
declare -A VERSION=() BROKEN=()
HAS_CUDA_KERNELS=
while IFS= read -r line; do
  case $line in
    "tool "*) read -r _ name version <<<"$line" && VERSION[$name]=$version ;;
    "broken "*) read -r _ name error <<<"$line" && BROKEN[$name]=$error ;;
    "installed nexuskv: with CUDA kernels"*) HAS_CUDA_KERNELS=1 && echo "$line" ;;
    *) echo "$line" ;;
  esac
done < <("$PY" - <<'EOF'
import importlib
import sys
from importlib import metadata

import torch

print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| GPU seen:", torch.cuda.is_available())
for module, dist in (("transformers", "transformers"), ("hypothesis", "hypothesis"),
                     ("xdist", "pytest-xdist"), ("pytest_timeout", "pytest-timeout")):
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            continue
        print("broken", dist, repr(e)[:200])
        continue
    except Exception as e:  # installed, but fails on import
        print("broken", dist, repr(e)[:200])
        continue
    try:
        print("tool", dist, metadata.version(dist))
    except metadata.PackageNotFoundError:
        print("tool", dist, "(version unknown)")
try:
    from nexuskv import _build_info as b

    print("installed nexuskv:", f"with CUDA kernels ({b.CUDA_ARCHITECTURES})" if b.WITH_CUDA else
          "without CUDA kernels", "| built for torch", b.TORCH_VERSION)
except Exception as e:  # none yet, or built for another torch
    print("installed nexuskv: none that imports:", repr(e)[:200])
EOF
)

# compute-sanitizer ships with the CUDA toolkit but is often not on PATH; nvcc may be a
# wrapper script elsewhere, so its own idea of the toolkit (-dryrun's TOP) is asked too.
find_sanitizer() {
  local c top=
  if command -v nvcc >/dev/null; then
    top=$(nvcc -dryrun -x cu -E /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  fi
  local nvcc_dir
  nvcc_dir=$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent/bin/nvcc)")")
  for c in "$(command -v compute-sanitizer)" \
    ${CUDA_HOME:+"$CUDA_HOME/bin/compute-sanitizer" "$CUDA_HOME/compute-sanitizer/compute-sanitizer"} \
    ${CUDA_PATH:+"$CUDA_PATH/bin/compute-sanitizer" "$CUDA_PATH/compute-sanitizer/compute-sanitizer"} \
    ${top:+"$top/bin/compute-sanitizer" "$top/compute-sanitizer/compute-sanitizer"} \
    "$nvcc_dir/compute-sanitizer" "$nvcc_dir/../compute-sanitizer/compute-sanitizer" \
    /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
    /usr/local/cuda-*/bin/compute-sanitizer /usr/local/cuda-*/compute-sanitizer/compute-sanitizer; do
    if [ -n "$c" ] && [ -x "$c" ] && "$c" --version >/dev/null 2>&1; then
      echo "$c"
      return 0
    fi
  done
  return 1
}
# Nsight Compute, for the ncu step: PATH, the toolkit, or its own install under /opt/nvidia.
NCU=$(command -v ncu || ls ${CUDA_HOME:+"$CUDA_HOME"/bin/ncu} /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu \
  2>/dev/null | head -1)
SANITIZER=$(find_sanitizer) && VERSION[compute-sanitizer]="$SANITIZER ($("$SANITIZER" --version | grep -o \
  'Version [^ ]*' | head -1))"

# The CUDA suites, plus the CUDA cases of the device-parametrized CPU suites; the same
# selection for the tests step and for the dry run's collection check.  A file that needs a
# missing tool is taken off the list (the CUDA-only files also importorskip it, for runs by
# hand; test_attention.py is not CUDA-only and imports hypothesis at module level): with
# xdist, one collection error would stop every test.
TEST_FILES=(tests/python/test_cuda_*.py tests/python/test_cache_device.py tests/python/test_attention.py
  tests/python/test_paged.py)
declare -A NEEDS=(
  [hypothesis]="tests/python/test_cuda_attention.py tests/python/test_attention.py tests/python/test_paged.py tests/python/test_cuda_paged.py"
  [transformers]="tests/python/test_cuda_cache_hf.py"
)
PYTEST_SEL=(-k cuda -p no:cacheprovider)
XDIST=()
TIMEOUT=()
echo "== optional tools"
for tool in hypothesis transformers pytest-xdist pytest-timeout compute-sanitizer; do
  if [ -n "${VERSION[$tool]:-}" ]; then
    echo "tool: $tool ${VERSION[$tool]}"
    continue
  fi
  why="not installed"
  [ -n "${BROKEN[$tool]:-}" ] && why="fails to import (${BROKEN[$tool]})"
  case $tool in
    hypothesis | transformers)
      read -ra drop <<<"${NEEDS[$tool]}"
      kept=()
      for f in "${TEST_FILES[@]}"; do [[ " ${drop[*]} " == *" $f "* ]] || kept+=("$f"); done
      TEST_FILES=("${kept[@]}")
      echo "skipped: $tool $why: not run: ${drop[*]}" ;;
    pytest-xdist)
      echo "skipped: pytest-xdist $why: the tests run in one process, not 8 (they may reach their time limit)" ;;
    pytest-timeout)
      echo "skipped: pytest-timeout $why: no per-test time limit (the tests step's limit holds)" ;;
    compute-sanitizer)
      echo "skipped: compute-sanitizer not found (PATH, \$CUDA_HOME, \$CUDA_PATH, nvcc's toolkit," \
        "/usr/local/cuda*): memcheck and racecheck are SKIP" ;;
  esac
done
if [ -n "$NCU" ]; then echo "tool: ncu $NCU"; else echo "skipped: ncu not found: the ncu step is SKIP"; fi
# 8 workers x 2 threads on 16 cores (torch would give every worker all 16 threads);
# 90 s per test: a hung kernel is named instead of eating the step (the slowest test, a
# cold inductor compile, takes well under a minute).
[ -n "${VERSION[pytest-xdist]:-}" ] && XDIST=(-n 8)
[ -n "${VERSION[pytest-timeout]:-}" ] && TIMEOUT=(--timeout 90)

# The smoke script: small cases of every kernel, under the sanitizers.  --dry builds the
# attention cases and runs them on the CPU, then stops before the first CUDA call.
SMOKE=$(mktemp /tmp/nexuskv_smoke.XXXXXX.py)
trap 'rm -f "$SMOKE"' EXIT
cat >"$SMOKE" <<'EOF'
import os, sys, torch
sys.path.insert(0, "tests/python")
try:
    import hypothesis  # noqa: F401
except Exception:  # missing or broken: test_attention imports it for its property tests, the smoke needs only Case
    from unittest import mock
    sys.modules["hypothesis"] = sys.modules["hypothesis.strategies"] = mock.MagicMock()
import nexuskv
from nexuskv import paged
from test_attention import Case
from test_cuda_attention import DECODE_GRID, TOKEN_KEYS_DECODE_GRID, decode_case, decode_takes, on_cuda
CASES = [Case(dtype=torch.bfloat16, **kw) for kw in (
    dict(), dict(q_len=5, tail=6, sinks=3, rotate=True), dict(dgq=True, q_len=2, ratio=3),
    dict(group=16, v_group=16, comp_lens=(70, 0), window=9, softcap=5.0))]
# The decode kernel's (contig_decode.cuh): 2 bits D64 GQA 8 with a tail, and 4 bits D128 with
# sinks and a tail (its full-precision split), GQA 2 x 4 query tokens, values in 2 groups.
DECODE = [decode_case(*DECODE_GRID[i], dtype=torch.bfloat16) for i in (0, 3)]
# Its keys per token (contig_decode_token_keys_kernel; the tensor-core kernel takes none): 4 bits
# D128 GQA 8 in two groups, sinks, a tail and a window.
TOKEN_KEYS = [decode_case(*TOKEN_KEYS_DECODE_GRID[3], dtype=torch.bfloat16, token_keys=True)]
assert all(decode_takes(c) for c in DECODE + TOKEN_KEYS), "the smoke's decode cases are not the decode kernel's"


def paged_case(device):
    """The vLLM backend's format on two requests: 600 tokens decoding one, 37 prefilling 5 (GQA 4)."""
    g = torch.Generator().manual_seed(0)
    fmt = paged.PagedFormat(4, 4, 64, 0, rotate=True)
    P, H, D, lens, qlens = 16, 2, 64, (600, 37), (1, 5)
    pages = torch.zeros(96, H, P, fmt.slot_bytes(D, torch.bfloat16, P), dtype=torch.uint8, device=device)
    table = torch.randperm(96, generator=g)[:80].view(2, 40).to(torch.int32)
    signs = fmt.signs(D, device)
    for r, L in enumerate(lens):
        t = torch.arange(L)
        slots = table[r, t // P].long() * P + t % P
        k, v = (torch.randn(L, H, D, generator=g).to(torch.bfloat16) for _ in range(2))
        paged.write_(pages, k.to(device), v.to(device), slots.to(device), fmt, signs)
    q = torch.randn(sum(qlens), 4 * H, D, generator=g).to(torch.bfloat16).to(device)
    qsl = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return paged.attention(q, pages, table.to(device), lens_t, qsl, fmt, signs)


if sys.argv[1:] == ["--dry"]:
    for case in CASES + DECODE + TOKEN_KEYS:
        case.run()
    assert torch.isfinite(paged_case("cpu")).all()
    print(f"smoke (dry): imports resolve, {len(CASES + DECODE + TOKEN_KEYS)} attention cases and a paged one run on "
          "the CPU; "
          "no CUDA call made")
    sys.exit(0)
x = torch.randn(2, 2, 40, 64, device="cuda")
for bits in (2, 3, 4, 8):
    for axis, k in ((-2, 0), (-2, 2), (-1, 0), (-1, 1)):
        p = nexuskv.nq_compress(x, bits, 16, axis, k)
        nexuskv.nq_decompress(*p, bits, 16, axis, 64, torch.bfloat16)
d = torch.ops.nexuskv.dgq_compress(x, 4, 16, 16, None, 1, None)
torch.ops.nexuskv.dgq_decompress(*d, 4, 16, 64, None)
s = torch.ones(64, device="cuda")
nexuskv.hadamard_rotate(x, s), nexuskv.hadamard_rotate(x, s, True)
for kernel in ("simple", "mma"):  # (the paged tensor-core kernel, paged_mma.cuh, with "mma")
    os.environ["NEXUSKV_CUDA_ATTENTION"] = kernel
    for case in CASES + DECODE + (TOKEN_KEYS if kernel == "simple" else []):
        on_cuda(case).run()
    assert torch.isfinite(paged_case("cuda")).all()
os.environ["NEXUSKV_CUDA_ATTENTION"] = "decode"  # (raises where the decode kernel does not take a case)
for case in DECODE + TOKEN_KEYS:
    on_cuda(case).run()
torch.cuda.synchronize()
print("smoke: every kernel ran")
EOF

# shellcheck disable=SC2054  # the commas are inside flag values (bench_cuda.py's lists)
BENCH_FLAGS=(--batches 1,64 --contexts 4096,32768 --bits 8,4,2 --reps 20 --warmup 3 --json "$OUT/bench_cuda.json")
# GPU_CHECK_BENCH_EXTRA adds flags (e.g. "--graphs --paged": graph replays, and the vLLM pages with
# both CUDA kernels); give the step the time they need with GPU_CHECK_BENCH_S (~150 s for those two).
read -ra BENCH_EXTRA <<<"${GPU_CHECK_BENCH_EXTRA:-}"
BENCH_FLAGS+=("${BENCH_EXTRA[@]}")

# ---- build -----------------------------------------------------------------------------
# Machine code for the GPU that is here (sm_90 on an H200): half the compile time of the
# default 80-real;90-real;90-virtual.  Exported so that test_cuda_build.py expects what
# was built.
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
ARCHS=${NEXUSKV_CUDA_ARCHITECTURES:-${CAP:+${CAP}-real}}
ARCH_FLAG=()
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
build() {
  [ -n "$ARCHS" ] && ARCH_FLAG=(-Ccmake.define.NEXUSKV_CUDA_ARCHITECTURES="$ARCHS") && \
    export NEXUSKV_CUDA_ARCHITECTURES="$ARCHS"
  step build "$BUILD_S" "$OUT/build.log" "$PY" -m pip install -v --no-build-isolation --no-deps --no-index \
    -Cbuild-dir=build/gpu_check "${ARCH_FLAG[@]}" . || { echo "gpu_check: the build failed (see build.log)"; exit 1; }
}
# A wheel built elsewhere (e.g. against torch 2.11.0+cu130 with NEXUSKV_CUDA_ARCHITECTURES=90-real
# on a machine without a GPU): unpacked, not installed (its tag names another Python; the
# library inside has no Python ABI), and put first on PYTHONPATH for every step.
WHEEL=${GPU_CHECK_WHEEL:-}
WHEEL_SITE=/tmp/nexuskv_wheel_site
if [ -z "$DRY" ] && [ -n "$WHEEL" ]; then
  [ -n "$ARCHS" ] && export NEXUSKV_CUDA_ARCHITECTURES="$ARCHS"
  if step wheel 30 "$OUT/build.log" "$PY" -c "
import shutil, sys, zipfile
shutil.rmtree('$WHEEL_SITE', ignore_errors=True)
zipfile.ZipFile('$WHEEL').extractall('$WHEEL_SITE')
sys.path.insert(0, '$WHEEL_SITE')
from nexuskv import _build_info as b
print('unpacked $WHEEL: built for torch', b.TORCH_VERSION, '| CUDA architectures', b.CUDA_ARCHITECTURES)
"; then
    export PYTHONPATH="$WHEEL_SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    WHEEL=
    build
  fi
elif [ -z "$DRY" ] || [ "${GPU_CHECK_BUILD:-0}" = 1 ]; then
  build
elif [ -n "$HAS_CUDA_KERNELS" ]; then
  skip build "dry: CUDA installed"
else
  skip build "dry: no CUDA kernels"
fi
loads() {
  step loads "$LOADS_S" "$OUT/build.log" "$PY" -c "
import torch, nexuskv
from nexuskv import _build_info as b
assert b.WITH_CUDA, 'nexuskv was built without its CUDA kernels (CMake did not find nvcc or a CUDA torch)'
assert torch._C._dispatch_has_kernel_for_dispatch_key('nexuskv::dgq_fused_attention', 'CUDA')
print('nexuskv built for torch', b.TORCH_VERSION, 'CUDA architectures', b.CUDA_ARCHITECTURES, 'from', nexuskv.__file__)
"
}
if ! loads; then
  [ -n "$DRY" ] && echo "gpu_check: GPU_CHECK_BUILD=1 builds nexuskv in the dry run" && exit 1
  [ -z "$WHEEL" ] && exit 1
  echo "gpu_check: the wheel $WHEEL does not load here: building instead"
  export PYTHONPATH=${PYTHONPATH#"$WHEEL_SITE"} && export PYTHONPATH=${PYTHONPATH#:}
  WHEEL=
  build
  loads || exit 1
  FAILED=0  # the wheel's failed load is on its summary line; the build replaced it
fi

# ---- dry run: what the GPU steps need, checked without a GPU ---------------------------
if [ -n "$DRY" ]; then
  step collect 120 "$OUT/tests.log" "$PY" -m pytest "${TEST_FILES[@]}" "${PYTEST_SEL[@]}" "${TIMEOUT[@]}" \
    --collect-only -qq
  step smoke-cpu 60 "$OUT/sanitizer.log" "$PY" "$SMOKE" --dry
  # bench_cuda.py has no parse-only switch: its main() parses the flags, then returns 2
  # when torch sees no GPU, so torch is told there is none; argparse raises SystemExit on a
  # bad flag, and the lists it converts after the GPU check are converted here.
  step bench-flags 60 "$OUT/bench_cuda.txt" "$PY" -c "
import argparse, sys, torch
sys.path.insert(0, 'benchmarks')
import bench_cuda
seen = []
parse = argparse.ArgumentParser.parse_args
argparse.ArgumentParser.parse_args = lambda self, *a, **k: seen.append(parse(self, *a, **k)) or seen[-1]
torch.cuda.is_available = lambda: False
try:
    rc = bench_cuda.main(sys.argv[1:])
except SystemExit as e:
    sys.exit(f'bench_cuda.py refuses the flags {sys.argv[1:]} (exit {e.code})')
assert rc == 2 and seen, 'bench_cuda.main did not stop at its GPU check'
a = seen[0]
grid = {n: [int(x) for x in getattr(a, n).split(',')] for n in ('batches', 'contexts', 'bits')}
assert a.reps >= 20, 'bench_cuda.py asks for >= 20 reps'
print('bench_cuda.py flags parse:', grid, 'reps', a.reps, 'warmup', a.warmup, '->', a.json)
" "${BENCH_FLAGS[@]}"
  summary_line dry-run "STOP (dry run, before CUDA)" $((SECONDS - START))
  echo "== summary ($((SECONDS - START)) s in all; dry run: no CUDA call was made, exit $FAILED)"
  cat "$SUMMARY"
  exit $FAILED
fi

# ---- the first CUDA call ---------------------------------------------------------------
timeout --kill-after=5 30 "$PY" -c "
import sys, torch
if not torch.cuda.is_available():
    sys.exit('gpu_check: torch sees no CUDA device (torch.cuda.is_available() is False): the build works, '
             'the GPU steps cannot run on this machine')
torch.zeros(1, device='cuda')
p = torch.cuda.get_device_properties(0)
print('device:', p.name, '| SMs', p.multi_processor_count, '| memory', round(p.total_memory / 2**30), 'GiB')
"
rc=$?
if [ "$rc" -ne 0 ]; then
  summary_line no-gpu "STOP ($([ "$rc" -eq 124 ] && echo 'CUDA init: 30-s limit' || echo 'no usable CUDA device'))" \
    $((SECONDS - START))
  exit 2
fi

# ---- GPU steps -------------------------------------------------------------------------
# The tests get every second not reserved for the steps after them (at least TESTS_S).
AFTER_TESTS=$((MEMCHECK_S + BENCH_S + RACECHECK_S + MARGIN_S))
LIMIT=$((BUDGET - (SECONDS - START) - AFTER_TESTS))
[ "$LIMIT" -lt "$TESTS_S" ] && LIMIT=$TESTS_S
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} step tests "$LIMIT" "$OUT/tests.log" "$PY" -m pytest "${TEST_FILES[@]}" \
  "${PYTEST_SEL[@]}" -q -rs "${XDIST[@]}" "${TIMEOUT[@]}" --junitxml="$OUT/tests.xml"

# The sanitizers run without torch's caching allocator, so that an out-of-bounds access
# inside a cached block is seen.
SAN=("$SANITIZER" --error-exitcode 1 --print-limit 20)
if [ -n "$SANITIZER" ]; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck "$MEMCHECK_S" "$OUT/sanitizer.log" \
    "${SAN[@]}" --tool memcheck "$PY" "$SMOKE"
else
  skip memcheck "no compute-sanitizer"
fi
step bench "$BENCH_S" "$OUT/bench_cuda.txt" "$PY" benchmarks/bench_cuda.py "${BENCH_FLAGS[@]}"
if [ -n "$SANITIZER" ]; then
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 step racecheck "$RACECHECK_S" "$OUT/sanitizer.log" \
    "${SAN[@]}" --tool racecheck --racecheck-report hazard "$PY" "$SMOKE"
else
  skip racecheck "no compute-sanitizer"
fi

# The tile loops' dynamic instruction counts (benchmarks/cuda_dynamic.py under Nsight Compute):
# a measurement, not a check: it runs last, in what is left of the budget (up to NCU_S), its
# verdict is on its summary line, and it does not fail the run.
if [ -n "$NCU" ] && [ "$NCU_S" -gt 0 ]; then
  saved=$FAILED
  step ncu "$NCU_S" "$OUT/bench_cuda.txt" bash -c '"$1" --csv --clock-control none \
    --kernel-name "regex:attention_mma_kernel|contig_decode_kernel" \
    --metrics smsp__inst_executed.sum,gpu__time_duration.sum,dram__bytes_read.sum \
    "$2" benchmarks/cuda_dynamic.py --run >/tmp/nexuskv_ncu.csv; rc=$?; cat /tmp/nexuskv_ncu.csv
    [ $rc -eq 0 ] && "$2" benchmarks/cuda_dynamic.py --parse /tmp/nexuskv_ncu.csv' _ "$NCU" "$PY"
  FAILED=$saved
else
  skip ncu "no Nsight Compute (ncu) or GPU_CHECK_NCU_S=0"
fi

echo "== summary ($((SECONDS - START)) s in all)"
cat "$SUMMARY"
exit $FAILED
