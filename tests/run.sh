#!/usr/bin/env bash
# Every test of nexuskv: installs and builds first (scripts/install.sh), then the
# Catch2 suites through ctest and the pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
echo "== Catch2 tests (ctest)"
ctest --test-dir build/py --output-on-failure
echo "== Python tests (pytest)"
$PY -m pytest tests/python -q "$@"
