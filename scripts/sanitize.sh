#!/usr/bin/env bash
# The sanitizer job: nexuskv built with AddressSanitizer + UndefinedBehaviorSanitizer
# (gcc, CPU-only, RelWithDebInfo) in its own build folder (build/asan) and virtual
# environment (build/venv-asan), never the installed package, then
#   1. ctest over that build: every Catch2 suite, and isa_symbols in a non-Release build;
#   2. scripts/bad_input_sweep.py against the sanitized operator library;
#   3. a fuzz subset: the hypothesis tests of the format, of fused attention and of the
#      cache (randomized valid cases with round trips against float64 references).
# A sanitizer finding fails the job, three ways: UBSan does not recover
# (-fno-sanitize-recover=all) and ASan stops at its first error, so the process fails;
# ASan's reports are also written under build/asan/reports/, which must stay empty; and
# each step's output (build/asan/logs/) must hold no UBSan "runtime error:" line.  (A
# finding inside a forked sweep case is otherwise only a "crash" line; gcc's UBSan
# runtime ignores log_path next to ASan, so its reports go to stderr, which pytest
# must not capture: -s.)
# tests/run.sh calls it after the main tests; NEXUSKV_SKIP_SANITIZE=1 skips it there.
# NEXUSKV_SANITIZE_STEPS="ctest sweep fuzz" (the default) chooses the steps after the build.
# About 14 minutes on 2 cores from a cold build (8 of them the build), 2.5 warm (docs/sanitizers.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=build/asan
VENV=build/venv-asan
REPORTS=$PWD/$BUILD/reports
# -fno-omit-frame-pointer: whole stacks in the reports.  -fno-sanitize-recover=all: a
# UBSan finding aborts (by default UBSan prints and goes on, and nothing would fail).
SAN_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"

start=$SECONDS
echo "== sanitizer build ($BUILD, ASan + UBSan, RelWithDebInfo, CPU-only)"
# A venv on top of this environment (torch, pytest, hypothesis, transformers) into which
# the sanitized build is installed, so that `import nexuskv` there loads it.
[ -x "$VENV/bin/python" ] || $PY -m venv --system-site-packages "$VENV"
# RelWithDebInfo at -O1 (the isa_symbols ctest then checks a non-Release build too, one that
# keeps more helpers out of line than -O2; the level ASan's authors advise; under these flags
# half the compile time of -O2, docs/sanitizers.md), with
# -g1 (line tables: file:line in every stack, a third less compile time than -g).
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps . \
  -Cbuild-dir=$BUILD -Ccmake.build-type=RelWithDebInfo \
  "-Ccmake.define.CMAKE_CXX_FLAGS=$SAN_FLAGS" "-Ccmake.define.CMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
  -Ccmake.define.NEXUSKV_WITH_CUDA=OFF -Ccmake.define.NEXUSKV_BUILD_TESTS=ON
build_s=$((SECONDS - start))
# (Found without importing nexuskv: that would load the library without the runtimes.)
LIB=$("$VENV/bin/python" -c "import importlib.util as u, pathlib; \
print(pathlib.Path(u.find_spec('nexuskv').origin).parent / 'libnexuskv.so')")
# Not the package of the global environment: the sanitized build must be the one loaded.
ldd "$LIB" | grep libasan >/dev/null || { echo "sanitize.sh: $LIB is not the sanitized build" >&2; exit 1; }

# The sanitizer runtimes of the compiler that built it.  A Python process must load them
# first (LD_PRELOAD; python itself is not instrumented); the Catch2 executables link them.
CXX_COMPILER=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' $BUILD/CMakeCache.txt)
ASAN_LIB=$("$CXX_COMPILER" -print-file-name=libasan.so)
UBSAN_LIB=$("$CXX_COMPILER" -print-file-name=libubsan.so)
for lib in "$ASAN_LIB" "$UBSAN_LIB"; do
  [ -f "$lib" ] || { echo "sanitize.sh: $CXX_COMPILER has no $lib (gcc's runtimes are expected)" >&2; exit 1; }
done

LOGS=$BUILD/logs
rm -rf "$REPORTS" "$LOGS" && mkdir -p "$REPORTS" "$LOGS"
# detect_leaks=0 for Python (it never frees some objects by design; torch's registries
# neither); the Catch2 suites keep leak checking (below).  log_path: every ASan report
# lands in $REPORTS as well.  print_stacktrace: UBSan reports with their stack.
export ASAN_OPTIONS="detect_leaks=0:log_path=$REPORTS/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

# Prints the reports of step $1 (a failed step's first: that is why it failed) and
# fails if there are any, if the step itself failed (status $2) or if its output holds
# a UBSan report.
check_reports() {
  local found=0
  if grep -q "runtime error:" "$LOGS/$1.log"; then
    found=1
    echo "---- UBSan reports of $1 (in $LOGS/$1.log):" >&2
    grep -A12 "runtime error:" "$LOGS/$1.log" | head -60 >&2
  fi
  for f in "$REPORTS"/*; do
    [ -e "$f" ] || continue
    found=$((found + 1))
    # (The first few: a bug hit by every sweep case would print hundreds of the same.)
    [ "$found" -le 3 ] || continue
    echo "---- sanitizer report of $1: $f" >&2
    cat "$f" >&2
  done
  if [ "$found" != 0 ] || [ "$2" != 0 ]; then
    echo "sanitize.sh: $1 failed (exit status $2, $found sanitizer reports in $REPORTS)" >&2
    exit 1
  fi
}

run_py() {
  LD_PRELOAD="$ASAN_LIB $UBSAN_LIB" "$VENV/bin/python" "$@"
}

run_step() {
  case $1 in
    ctest)
      echo "== ctest over the sanitized build"
      # (LeakSanitizer stays on here: these are our own processes.)
      ASAN_OPTIONS="detect_leaks=1:log_path=$REPORTS/asan" ctest --test-dir $BUILD --output-on-failure
      ;;
    sweep)
      echo "== bad-input sweep against the sanitized library"
      # Each case is a forked process: a finding aborts it, the sweep counts a crash and exits 1.
      run_py scripts/bad_input_sweep.py --json $BUILD/bad_input_sweep.json
      ;;
    fuzz)
      echo "== fuzz subset under the sanitizers"
      # 150 random NQ tensors against the float64 reference of the format, 120 random
      # fused-attention problems against float64 attention, 60 random cache sessions,
      # 600 damaged recipe files through the C++ reader (JSON and safetensors parsing).
      run_py -m pytest -q -s -p no:cacheprovider \
        tests/python/test_nq_reference.py::test_hypothesis_against_reference \
        tests/python/test_attention.py::test_hypothesis_against_float64_reference \
        tests/python/test_cache_fuzz.py \
        tests/python/test_recipe.py::test_damaged_bytes_never_crash_the_cpp_reader
      ;;
    *)
      echo "sanitize.sh: unknown step '$1' in NEXUSKV_SANITIZE_STEPS (ctest, sweep, fuzz)" >&2
      return 2
      ;;
  esac
}

times="build ${build_s} s"
for step in ${NEXUSKV_SANITIZE_STEPS:-ctest sweep fuzz}; do
  t=$SECONDS
  status=0
  run_step "$step" 2>&1 | tee "$LOGS/$step.log" || status=$?
  check_reports "$step" "$status"
  times+=", $step $((SECONDS - t)) s"
done
echo "sanitize.sh: no finding ($times; $((SECONDS - start)) s in all)"
