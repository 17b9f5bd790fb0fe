#!/usr/bin/env bash
# Proves the CUDA backend of nexuskv on a GPU machine, in one run of under 8 minutes:
#   1. records the machine (GPU, driver, torch, nvcc),
#   2. builds nexuskv from this checkout for the GPU that is there
#      (pip install --no-build-isolation --no-deps --no-index: no network needed; building
#      here is also what matches the library to this machine's torch),
#   3. stops with a clear message if torch sees no GPU (the first CUDA call),
#   4. runs the CUDA test suites (tests/python/test_cuda_*.py),
#   5. runs compute-sanitizer memcheck on small cases of every kernel,
#   6. runs the GPU benchmark (benchmarks/bench_cuda.py),
#   7. runs compute-sanitizer racecheck on the same small cases.
# A step whose time limit would pass the 8-minute budget is cut short or skipped (and
# the run then fails, saying so in summary.txt).
# Everything goes to $OUT (default results/gpu_check), at most 8 files:
#   gpu_check.log (all output), summary.txt (one line per step), build.log, tests.log,
#   tests.xml (junit), sanitizer.log, bench_cuda.txt, bench_cuda.json.
# Written for an H200 with torch 2.11+cu130, Python 3.12, nvcc 13.0, scikit-build-core,
# ninja, pytest (+ pytest-xdist, pytest-timeout, hypothesis); PYTHON picks the interpreter.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/results/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
START=$SECONDS
export PYTHONUNBUFFERED=1
FAILED=0

# The whole run stays under 8 minutes: a step starts only if its time limit still fits.
BUDGET=${GPU_CHECK_BUDGET_S:-470}  # GPU_CHECK_BUILD_S (default 300): the build step's limit

# step NAME TIMEOUT_S LOGFILE COMMAND...: runs COMMAND with a time limit, its output also to LOGFILE.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  if [ $((SECONDS - START + limit)) -gt "$BUDGET" ]; then
    limit=$((BUDGET - (SECONDS - START)))
    if [ "$limit" -lt 20 ]; then
      printf '%-12s %-28s %4ds\n' "$name" "SKIP (8-minute budget)" 0 | tee -a "$SUMMARY"
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
  printf '%-12s %-28s %4ds\n' "$name" "$verdict" $((SECONDS - t0)) | tee -a "$SUMMARY"
  return "$rc"
}

echo "== machine"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
$PY -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda)"
nvcc --version 2>&1 | tail -2 || true
cmake --version 2>&1 | head -1 || true
echo "cpus: $(nproc)"

# Machine code for the GPU that is here (sm_90 on an H200): half the compile time of the
# default 80-real;90-real;90-virtual.
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
ARCHS=${NEXUSKV_CUDA_ARCHITECTURES:-${CAP:+${CAP}-real}}
ARCH_FLAG=()
[ -n "$ARCHS" ] && ARCH_FLAG=(-Ccmake.define.NEXUSKV_CUDA_ARCHITECTURES="$ARCHS")
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
step build "${GPU_CHECK_BUILD_S:-300}" "$OUT/build.log" $PY -m pip install -v --no-build-isolation --no-deps --no-index \
  -Cbuild-dir=build/gpu_check "${ARCH_FLAG[@]}" . || { echo "gpu_check: the build failed (see build.log)"; exit 1; }
step loads 60 "$OUT/build.log" $PY -c "
import torch, nexuskv
from nexuskv import _build_info as b
assert b.WITH_CUDA, 'nexuskv was built without its CUDA kernels (CMake did not find nvcc or a CUDA torch)'
assert torch._C._dispatch_has_kernel_for_dispatch_key('nexuskv::dgq_fused_attention', 'CUDA')
print('nexuskv built for torch', b.TORCH_VERSION, 'CUDA architectures', b.CUDA_ARCHITECTURES)
" || exit 1

# The first CUDA call.
if ! $PY -c "
import sys, torch
if not torch.cuda.is_available():
    sys.exit('gpu_check: torch sees no CUDA device (torch.cuda.is_available() is False): the build works, '
             'the GPU steps cannot run on this machine')
torch.zeros(1, device='cuda')
p = torch.cuda.get_device_properties(0)
print('device:', p.name, '| SMs', p.multi_processor_count, '| memory', round(p.total_memory / 2**30), 'GiB')
"; then
  echo "no-gpu       STOP (torch sees no CUDA device)" | tee -a "$SUMMARY"
  exit 2
fi

XDIST=()
$PY -c "import xdist" 2>/dev/null && XDIST=(-n 8)
TIMEOUT=()
$PY -c "import pytest_timeout" 2>/dev/null && TIMEOUT=(--timeout 150)
# The CUDA suites, plus the CUDA cases of the device-parametrized CPU suites.
step tests 200 "$OUT/tests.log" $PY -m pytest tests/python/test_cuda_*.py tests/python/test_cache_device.py \
  tests/python/test_attention.py -k cuda -q -rs -p no:cacheprovider \
  "${XDIST[@]}" "${TIMEOUT[@]}" --junitxml="$OUT/tests.xml"

# Small cases of every kernel under the sanitizer (no caching allocator, so that an
# out-of-bounds access inside a cached block is seen).
SMOKE=$(mktemp /tmp/nexuskv_smoke.XXXXXX.py)
cat >"$SMOKE" <<'EOF'
import os, sys, torch
sys.path.insert(0, "tests/python")
import nexuskv
from test_attention import Case
from test_cuda_attention import on_cuda
x = torch.randn(2, 2, 40, 64, device="cuda")
for bits in (2, 3, 4, 8):
    for axis, k in ((-2, 0), (-2, 2), (-1, 0), (-1, 1)):
        p = nexuskv.nq_compress(x, bits, 16, axis, k)
        nexuskv.nq_decompress(*p, bits, 16, axis, 64, torch.bfloat16)
d = torch.ops.nexuskv.dgq_compress(x, 4, 16, 16, None, 1, None)
torch.ops.nexuskv.dgq_decompress(*d, 4, 16, 64, None)
s = torch.ones(64, device="cuda")
nexuskv.hadamard_rotate(x, s), nexuskv.hadamard_rotate(x, s, True)
for kernel in ("simple", "mma"):
    os.environ["NEXUSKV_CUDA_ATTENTION"] = kernel
    for kw in (dict(), dict(q_len=5, tail=6, sinks=3, rotate=True), dict(dgq=True, q_len=2, ratio=3),
               dict(group=16, v_group=16, comp_lens=(70, 0), window=9, softcap=5.0)):
        on_cuda(Case(dtype=torch.bfloat16, **kw)).run()
torch.cuda.synchronize()
print("smoke: every kernel ran")
EOF
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
SAN=(compute-sanitizer --error-exitcode 1 --print-limit 20)
step memcheck 90 "$OUT/sanitizer.log" "${SAN[@]}" --tool memcheck $PY "$SMOKE"
unset PYTORCH_NO_CUDA_MEMORY_CACHING
step bench 150 "$OUT/bench_cuda.txt" $PY benchmarks/bench_cuda.py --json "$OUT/bench_cuda.json"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
step racecheck 120 "$OUT/sanitizer.log" "${SAN[@]}" --tool racecheck --racecheck-report hazard $PY "$SMOKE"
unset PYTORCH_NO_CUDA_MEMORY_CACHING
rm -f "$SMOKE"

echo "== summary ($((SECONDS - START)) s in all)"
cat "$SUMMARY"
exit $FAILED
