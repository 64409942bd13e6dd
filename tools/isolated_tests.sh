#!/usr/bin/env bash
# Each collected GPU test in its own pytest process, 8 at a time, one line per test (PASS / FAIL and the
# first assertion lines), sorted. Why: an illegal address kills the CUDA context of its process, so under
# xdist every later test of that worker fails too and the first fault is hard to find (bench/NOTES.md 66-67);
# here a fault stays in its own test.
#
#   bash tools/isolated_tests.sh tests/test_fp8_kernel.py tests/test_fp8_bwd_kernel.py [-k EXPR]
#
# ISO_PREFIX=DIR puts DIR first on PYTHONPATH (a packed Triton: ISO_PREFIX=/tmp/triton-3.9.0, with
# TRITON_CACHE_DIR=/tmp/triton-cache-3.9.0); ISO_JOBS (default 8) processes at once.
# Measured (session 28, H100): the FP8 kernel files' 52 GPU tests in ~60 s.
set -uo pipefail
export PYTHONPATH=${ISO_PREFIX:+$ISO_PREFIX:}$PWD
ids=$(mktemp)
python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider "$@" 2>/dev/null | grep "::" > "$ids"
echo "$(wc -l < "$ids") tests"
run_one() {
    local out rc
    out=$(timeout 300 python3 -m pytest -q -x -p no:xdist -p no:cacheprovider "$1" 2>&1); rc=$?
    if [ $rc -eq 0 ]; then echo "PASS $1"
    else echo "FAIL $1 :: $(echo "$out" | grep -E "^E  " | head -2 | tr '\n' ' ' | cut -c1-300)"; fi
}
export -f run_one
xargs -P "${ISO_JOBS:-8}" -I{} bash -c 'run_one "$@"' _ {} < "$ids" | sort
rm -f "$ids"
