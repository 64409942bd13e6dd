#!/usr/bin/env bash
# The one script run on the GPU machine (device tool), from the repository root:
#
#   bash bench/run_device.sh [PART ...] [-- EXTRA BENCH ARGS]
#
# PARTS, run in the order given (default: tests demo bench-quick):
#   tests          python3 -m pytest -q tests -m gpu           (the GPU tests; TEST_PATHS and TEST_K narrow them)
#   tests-gluon | tests-rest   the Gluon kernels' GPU tests / all the others (~770 s together)
#   tests-gluon-fwd | tests-gluon-bwd   the two halves of tests-gluon (it no longer fits one call)
#   overhead       bench/overhead.py: host vs GPU time per layer of a small (d=64) call
#   thread-probe   bench/autograd_thread_probe.py (and --causal): the d=64 autograd backward's host time on the
#                  engine's device thread, against the same call on the main thread (issue 28)
#   decode-sweep   bench/decode_sweep.py: decode tiles x splits, TB/s (DECODE_SWEEP_ARGS=--fp8: e4m3 caches)
#   decode-overhead  bench/decode_overhead.py: host vs GPU time of one decode call (sdpa, ours, the HF door)
#   flush-probe    bench/flush_probe.py --anchors: copies, decode rows and four ANCHORS forwards after a zeroing
#                  and after a reading L2 flush (bench.do_bench_cold's; bench/NOTES.md 77)
#   fp8-heads      bench/fp8_head_scales_probe.py: the FP8 forward with per-tensor and per-head descales (NOTES 77)
#   probe          bench/padding_probe.py --profile: the padded config pass by pass, host time and profile
#   split          bench/padding_probe.py --split: the padded config against its sequences run one by one
#   fwd-ab         bench/fwd_ab.py: the Gluon forward against fusedattn/backends/gluon/fwd_base.py where
#                  present (the command puts the commit to compare against there), else alone
#                  (FWD_AB_ARGS: extra arguments, e.g. "--configs window-b2-s8k-d128")
#   ncu-fwd-ab     the same builds under Nsight Compute, one call each: elapsed cycles and base / new (FWD_AB_ARGS)
#   ncu-fused      Nsight Compute on the single-pass backward at 16k causal (bench/profile_fused.py)
#   ncu-bwd        Nsight Compute on ONE backward of each d=64 / d=128 anchor of issue 28, ours and FA4's (where
#                  flash_attn.cute imports: carry .whl), bench/profile_bwd.py; the report in $OUT/ncu-bwd/ (bwd.ncu-rep,
#                  details.txt, raw.csv). NCU_BWD_CONFIGS narrows it (e.g. d64,2kc), NCU_BWD_ARGS adds arguments,
#                  NCU_BWD_SOURCE=0 drops the SourceCounters section (per-instruction stalls; the slowest one)
#   fused-ab       bench/fused_ab.py --graphs $FUSED_AB_ARGS: variants of the single-pass backward timed in one process
#   ncu-fused-ab   the same variants, one backward each under Nsight Compute: elapsed cycles per variant (steadier than
#                  the timings on a GPU whose clock moves, bench/NOTES.md 78); $OUT/ncu-fused-ab/ (issue 28)
#   ncu-fp8        Nsight Compute on one Gluon FP8 forward and one bf16 forward of the same d=128 problem
#                  (bench/profile_fp8_fwd.py; NCU_FP8_ARGS=--causal: the 16k causal config): $OUT/ncu-fp8/ (issue 27)
#   ncu-paged      Nsight Compute on one paged-prefill forward per cache (bench/profile_paged.py; NCU_PAGED_ARGS, e.g.
#                  "--pages 0,16 --varlen"): $OUT/ncu-paged-$TRITON_PACK/ (report, details, raw, per-SASS-line source
#                  counters): run once per Triton (TRITON_PACK=native, then 3.9.0) to compare the releases (issue 25)
#   ncu-paged-ab   the same forwards under Nsight Compute, SpeedOfLight only, the paged caches with the V warp off and on
#                  (NCU_PAGED_AB_ARGS, default "--pages 0,16,32,64 --varlen --v-warp 0,1"): elapsed cycles per run and
#                  its ratio to the contiguous cache's, $OUT/ncu-paged-ab-$TRITON_PACK/ (issue 25)
#   ptxas-ab       (with TRITON_PACK=3.9.0) ncu-paged-ab, ncu-fwd-ab and ncu-fused-ab (the paged prefill, three anchors'
#                  forwards, two single-pass backwards), once compiled by Triton 3.9's own sm_90 ptxas (CUDA 13), once by a
#                  CUDA 12 one: elapsed cycles of each (bench/NOTES.md 80; ~4-5 min with the compiles)
#   route-probe    bench/prefill_route_probe.py: the packed prefill's route, GPU and host time per call (issue 25)
#   fp8-host       bench/fp8_bwd_host_probe.py --cprofile: the FP8 backward's host time per call beside its GPU time,
#                  timed as bench and as the A/B script time it (issue 27, bench/NOTES.md 72)
#   paged-tiles    bench/paged_tiles.py $PAGED_TILES_ARGS: the paged forward's variants A/B in one process (issue 25)
#   prefill-host   bench/prefill_host_probe.py --profile: each prefill row eager (as bench), under CUDA graphs and
#                  back to back, with the call's host time and a cProfile (issue 25)
#   odd-dims       bench/odd_dims_probe.py $ODD_DIMS_ARGS: the portable kernels at head dims padding to different tile
#                  widths (d 24 / d_v 8 ...) under each feature, fp16 and bf16 (Triton 3.6's miscompile, NOTES 66)
#   d64-fused      bench/d64_fused.py --stages 2 $D64_FUSED_ARGS: the d=64 single pass against the Triton pair and as routed,
#                  CUDA graphs and eager (plan.GLUON_BWD_FUSED_MIN_WORK, issue 28)
#   d64-tiles      bench/d64_dkdv_tiles.py: the d=64 dK/dV pass's candidate tiles and register caps, timed (issue 28)
#   fp8-bwd-tiles  bench/fp8_bwd_tiles.py $FP8_BWD_TILES_ARGS: the FP8 backward's tile pairs, timed and case-checked
#   bwd-time       bench/profile_bwd.py --time 20 --fa4: the same backwards timed, ours beside FA4 in one process
#   fused-sweep    bench/gluon_fused_sweep.py: single-pass vs two-pass backward at d=128
#                  (FUSED_SWEEP_ARGS: extra arguments, e.g. "--variants=rot")
#   demo           python3 -m fusedattn demo
#   bench          the whole benchmark (anchors, masked, decode; fwd, bwd, fwd+bwd)
#   bench-quick    the same with --quick (fewer repetitions)
#   bench-anchors | bench-masked | bench-decode | bench-prefill | bench-fp8   one group of configs (quick reps;
#                  bench-fp8: the FP8 forward beside our bf16 and cuDNN frontend's sdpa_fp8: carry .whl)
#   bench-anchors-a | bench-anchors-b                the first / last four anchors
#   bench-graphs   the two small d=64 anchors under --cuda-graphs (launch-bound sizes)
#   stash          copy .whl/*.whl.part-* to /tmp/whlparts and stop (first half of a split
#                  wheel; the next call, while the machine is warm, carries the rest)
#   warmup         python3 -m fusedattn warmup (compile the common configurations' kernels, timed)
#   prebuilt       python3 -m fusedattn warmup --record: the shipped-kernel store for this Triton, copied into
#                  fusedattn/prebuilt/ for the later parts and returned as $OUT/prebuilt-VERSION.tar
#   store-check    tools/store_gpu_check.py: the shipped store of this Triton run for real, every warmup call, against
#                  the JIT in another process (every launch from the store, the same outputs); STORE_CHECK_ONLY narrows
#   tests-prebuilt the store's GPU test (a recorded store launched through the driver against the JIT)
#   sweep          tests/test_gpu_sweep.py: every head dim 8..256 (step 8, d_v != d too) with rotating masks,
#                  s_q 1 / odd / > s_kv, forward and backward against float64 (issue 24 item 4), and
#                  tests/test_empty_rows.py's GPU variants (log-sum-exp -inf on rows with no key)
#   coldstart      python3 -m fusedattn bench --cold-start (first call of a fresh process, empty and warm
#                  cache, beside torch's cuDNN and FlexAttention)
#   tests-sample   the whole GPU suite, every FUSEDATTN_TEST_SAMPLE-th test of each file (default 4)
#   tests-gluon-sample   the Gluon kernels' and the launch path's GPU tests, every 16th (FUSEDATTN_TEST_SAMPLE)
#   sdpa           tests/test_torch_sdpa.py whole (fusedattn under F.scaled_dot_product_attention: CPU and GPU tests)
#   models         python3 -m fusedattn bench --models (a Llama-shaped model's train step and generate(), fusedattn
#                  beside sdpa, tokens/s; prints "skipped" without transformers: carry its wheels in .whl)
#   hf-example     python3 examples/hf_llama.py (needs transformers too)
#   cudnn-tests    cuDNN frontend's own SDPA tests (test_mhas.py, test_sdpa_thd.py, test_sdpa_chunked_prefill.py,
#                  fetched into the git-ignored .cudnn_fe_tests/: bench/cudnn_fe_suite.py's docstring says how) on
#                  a seeded sample, with the real cuDNN frontend (the .whl wheel) and with fusedattn as `cudnn`,
#                  in separate processes; one table, case | cuDNN | fusedattn, in $OUT/cudnn-tests/. Carry
#                  .whl and .cudnn_fe_tests. CFE_N cases (default 40), CFE_SEED (24), CFE_WORKERS (8, xdist)
#
# Another Triton: carry .triton/triton-VERSION-slim.tar.xz (../shared/tools/pack-triton.sh VERSION .triton)
# and every part runs on it (unpacked into /tmp, first on PYTHONPATH, with a cache of its own); set
# TRITON_PACK=VERSION to choose among packs a warm machine still holds (TRITON_PACK=native: the machine's own). FUSEDATTN_TEST_SAMPLE=N with the
# tests parts runs every N-th test of each file. The pack is on PYTHONPATH for this script's parts only: a
# command after it in the same shell imports the machine's Triton (session 41 lost a test call that way), so
# run chosen tests as a part: TEST_PATHS="tests/a.py tests/b.py" [TEST_K=...] bash bench/run_device.sh tests
# Extra args after `--` go to every bench part (e.g. `-- --only b4-h32kv8 --pass fwd`).
#
# Wheels carried in .whl/ (bench/fetch_wheels.sh; name `.whl` in the call's carry) are
# installed into /tmp/site first; split wheels are joined from /tmp/whlparts and .whl/.
# Everything is teed into $OUT/run.log; each bench part also writes $OUT/bench-PART.csv
# (row by row, so a part cut short still returns what it measured) and, where matplotlib
# is present, $OUT/bench-PART.png. Parts get a share of the time left before DEADLINE
# seconds (default 570, under the device call's 600 s limit); the bench stops starting new
# configs BENCH_SLACK seconds (default 120) before that.
set -uo pipefail          # not -e: a failing part must not stop the next one

cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG="$OUT/run.log"
DEADLINE=${DEADLINE:-570}
BENCH_SLACK=${BENCH_SLACK:-120}
export PYTHONUNBUFFERED=1
START=$SECONDS

PARTS=()
BENCH_ARGS=()
while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; BENCH_ARGS=("$@"); break; fi
    PARTS+=("$1"); shift
done
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tests demo bench-quick)

say() { echo "== $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE - (SECONDS - START))); }

stash_parts() {
    mkdir -p /tmp/whlparts
    cp -v .whl/*.whl.part-* /tmp/whlparts/ 2>&1 | tee -a "$LOG"
    ls -l /tmp/whlparts | tee -a "$LOG"
}

use_packed_triton() {
    # A Triton packed by ../shared/tools/pack-triton.sh and carried in .triton/ replaces the machine's.
    # TRITON_PACK=VERSION picks one where a warm machine kept an earlier call's pack too
    local pack
    # TRITON_PACK=native: the machine's own Triton even where a pack was carried (without it, the newest
    # carried pack is taken: a call carrying 3.7.1 ran its "native" part on 3.7.1, bench/NOTES.md 55)
    [ "${TRITON_PACK:-}" = native ] && return 0
    if [ -n "${TRITON_PACK:-}" ]; then pack=.triton/triton-$TRITON_PACK-slim.tar.xz; [ -f "$pack" ] || {
        say "TRITON_PACK=$TRITON_PACK but $pack was not carried"; exit 1; }
    else
        # one pack carried: that one. Several (a warm machine keeps the packs of earlier calls): refuse to
        # guess; by modification time a call carrying 3.9.0 ran on an earlier call's 3.8.0 (NOTES 58)
        local packs=(.triton/triton-*-slim.tar.xz)
        [ -f "${packs[0]}" ] || return 0
        if [ ${#packs[@]} -gt 1 ]; then
            say "several Triton packs here (${packs[*]}): set TRITON_PACK=VERSION or TRITON_PACK=native"; exit 1
        fi
        pack=${packs[0]}
    fi
    local ver
    ver=$(basename "$pack" | sed 's/^triton-//; s/-slim.tar.xz$//')
    mkdir -p "/tmp/triton-$ver"
    [ -d "/tmp/triton-$ver/triton" ] || tar -xJf "$pack" -C "/tmp/triton-$ver"
    export TRITON_SITE="/tmp/triton-$ver"
    export TRITON_CACHE_DIR="/tmp/triton-cache-$ver"
    say "using the carried Triton $ver ($pack)"
}

install_wheels() {
    # Joins split wheels (NAME.whl.part-aa, -ab ...) kept by an earlier `stash` and carried now.
    local joined=/tmp/whljoined wheels=()
    mkdir -p "$joined"
    local names
    names=$(ls /tmp/whlparts/*.whl.part-* .whl/*.whl.part-* 2>/dev/null | sed 's#.*/##; s#\.part-.*##' | sort -u)
    for name in $names; do
        # parts sort by file name (part-aa, part-ab ...) whichever folder holds them
        cat $(for f in /tmp/whlparts/"$name".part-* .whl/"$name".part-*; do
                  [ -f "$f" ] && echo "$(basename "$f") $f"; done | sort | cut -d' ' -f2) > "$joined/$name"
        say "joined $name ($(stat -c %s "$joined/$name") bytes)"
    done
    wheels=(.whl/*.whl "$joined"/*.whl)
    local present=()
    for w in "${wheels[@]}"; do [ -f "$w" ] && present+=("$w"); done
    export PYTHONPATH="${TRITON_SITE:+$TRITON_SITE:}$PWD"
    if [ ${#present[@]} -gt 0 ]; then
        say "installing ${#present[@]} carried wheels into /tmp/site"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "${present[@]}" 2>&1 | tee -a "$LOG"
        export PYTHONPATH="${TRITON_SITE:+$TRITON_SITE:}/tmp/site:$PWD"
        # PYTHONPATH skips .pth files; fusedattn.bench adds this folder as a site dir (FA4 needs it).
        export FUSEDATTN_EXTRA_SITE=/tmp/site
    fi
}

report_env() {
    say "environment"
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm,power.limit \
            --format=csv 2>&1
        python3 - <<'EOF'
import importlib, sys
import torch, triton
print(f"python {sys.version.split()[0]}; torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}); triton {triton.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
          f"L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB")
for mod in ("cudnn", "flash_attn.cute", "pytest", "matplotlib", "fusedattn"):
    try:
        m = importlib.import_module(mod)
        print(f"import {mod}: ok {getattr(m, '__version__', '')}")
    except Exception as exc:
        print(f"import {mod}: no ({type(exc).__name__}: {str(exc)[:120]})")
EOF
    } 2>&1 | tee -a "$LOG"
}

declare -A STATUS
run_part() {   # run_part NAME COMMAND...: bounded by the time left, teed into the log
    local name=$1; shift
    local limit=$(( $(left) - 10 ))
    if [ "$limit" -lt 30 ]; then
        say "$name: skipped, only $(left) s left"; STATUS[$name]=skipped; return
    fi
    say "$name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    STATUS[$name]="rc=$rc, $((SECONDS - t0)) s"
    say "$name: ${STATUS[$name]}"
}

bench_part() {   # bench_part PART ARGS...: the bench with a CSV and plot of its own
    local part=$1; shift
    local budget=$(( $(left) - BENCH_SLACK ))
    [ "$budget" -lt 30 ] && budget=30
    run_part "$part" python3 -m fusedattn bench --csv "$OUT/$part.csv" --plot "$OUT/$part.png" \
        --budget "$budget" "$@" "${BENCH_ARGS[@]}"
}

# Test workers: all cores but two by default (14 on the one-GPU machine). On a machine of several GPUs
# each worker takes one card, round robin (tests/conftest.py, FUSEDATTN_TEST_GPUS). Measured once (bench/NOTES.md
# 58): 62 workers on four H100s ran no faster per test than 14 on one, so the one-GPU machine stays the way.
WORKERS=$(( $(nproc) - 2 ))
NGPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$NGPUS" -gt 1 ] && export FUSEDATTN_TEST_GPUS=$NGPUS

say "parts: ${PARTS[*]}; bench args: ${BENCH_ARGS[*]:-none}; deadline ${DEADLINE} s"
if [ "${PARTS[0]}" = "stash" ]; then stash_parts; exit 0; fi
use_packed_triton
install_wheels
report_env

for part in "${PARTS[@]}"; do
    case "$part" in
        tests)         run_part tests python3 -m pytest -q -rfEs ${TEST_PATHS:-tests} -m gpu -n "${TEST_WORKERS:-$WORKERS}" \
                           ${TEST_K:+-k "$TEST_K"} ;;
        sweep)         run_part sweep python3 -m pytest -q -rfEs tests/test_gpu_sweep.py tests/test_empty_rows.py -m gpu \
                           -n "${TEST_WORKERS:-8}" ${TEST_K:+-k "$TEST_K"} ;;
        # the full GPU suite no longer fits one 600 s call: the Gluon tests alone took 572 s for 904 of 914
        # with 16 workers (session 5); the Gluon forward's (530) and backward passes' (384) halves fit one each
        tests-gluon)   run_part tests-gluon python3 -m pytest -q -rfEs tests/test_gluon_fwd.py tests/test_gluon_bwd_dq.py \
                           tests/test_gluon_bwd_dkdv.py -m gpu -n "${TEST_WORKERS:-$WORKERS}" ;;
        tests-gluon-sample) FUSEDATTN_TEST_SAMPLE=${FUSEDATTN_TEST_SAMPLE:-16} run_part tests-gluon-sample python3 -m \
                           pytest -q -rfEs tests/test_gluon_fwd.py tests/test_gluon_bwd_dq.py tests/test_gluon_bwd_dkdv.py \
                           tests/test_gluon_bwd_fused.py tests/test_launch.py -m gpu -n "${TEST_WORKERS:-$WORKERS}" ;;
        tests-gluon-fwd) run_part tests-gluon-fwd python3 -m pytest -q -rfEs tests/test_gluon_fwd.py -m gpu \
                           -n "${TEST_WORKERS:-$WORKERS}" ;;
        tests-gluon-bwd) run_part tests-gluon-bwd python3 -m pytest -q -rfEs tests/test_gluon_bwd_dq.py \
                           tests/test_gluon_bwd_dkdv.py -m gpu -n "${TEST_WORKERS:-$WORKERS}" ;;
        tests-rest)    run_part tests-rest python3 -m pytest -q -rfEs tests -m gpu -n "${TEST_WORKERS:-$WORKERS}" \
                           --ignore=tests/test_gluon_fwd.py --ignore=tests/test_gluon_bwd_dq.py \
                           --ignore=tests/test_gluon_bwd_dkdv.py ;;
        overhead)      run_part overhead python3 bench/overhead.py ;;
        thread-probe)  run_part thread-probe python3 bench/autograd_thread_probe.py
                       run_part thread-probe-causal python3 bench/autograd_thread_probe.py --causal ;;
        decode-sweep)  run_part decode-sweep python3 bench/decode_sweep.py ${DECODE_SWEEP_ARGS:-} ;;
        decode-overhead) run_part decode-overhead python3 bench/decode_overhead.py ;;
        flush-probe)   run_part flush-probe python3 bench/flush_probe.py --anchors ;;
        fp8-heads)     run_part fp8-heads python3 bench/fp8_head_scales_probe.py ;;
        probe)         run_part probe python3 bench/padding_probe.py --profile ;;
        split)         run_part split python3 bench/padding_probe.py --split ;;
        fwd-ab)        if [ -f fusedattn/backends/gluon/fwd_base.py ]; then
                           run_part fwd-ab python3 bench/fwd_ab.py --baseline fwd_base ${FWD_AB_ARGS:-}
                       else run_part fwd-ab python3 bench/fwd_ab.py ${FWD_AB_ARGS:-}; fi ;;
        ncu-fwd-ab)    mkdir -p "$OUT/ncu-fwd-ab"; base_arg=""
                       [ -f fusedattn/backends/gluon/fwd_base.py ] && base_arg="--baseline fwd_base"
                       run_part ncu-fwd-ab ncu --profile-from-start off --clock-control none --kernel-name regex:_attn_fwd_sm90 \
                           --section SpeedOfLight -f -o "$OUT/ncu-fwd-ab/ab" python3 bench/fwd_ab.py --profile $base_arg ${FWD_AB_ARGS:-}
                       if [ -f "$OUT/ncu-fwd-ab/ab.ncu-rep" ]; then
                           ncu --import "$OUT/ncu-fwd-ab/ab.ncu-rep" --page raw --csv > "$OUT/ncu-fwd-ab/raw.csv" 2>&1
                           python3 bench/fwd_ab.py --cycles "$OUT/ncu-fwd-ab/raw.csv" $base_arg ${FWD_AB_ARGS:-} 2>&1 | tee -a "$LOG"
                       fi ;;
        ncu-fused)     run_part ncu-fused ncu --clock-control none --kernel-name regex:_attn_bwd_fused --launch-skip 1 \
                           --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
                           --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
                           python3 bench/profile_fused.py ;;
        ncu-bwd)       mkdir -p "$OUT/ncu-bwd"
                       run_part ncu-bwd ncu --profile-from-start off --clock-control none --section SpeedOfLight \
                           --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
                           --section MemoryWorkloadAnalysis_Tables --section InstructionStats --section WarpStateStats \
                           --section SchedulerStats --section Occupancy --section LaunchStats \
                           $([ "${NCU_BWD_SOURCE:-1}" = 1 ] && echo --section SourceCounters) -f -o "$OUT/ncu-bwd/bwd" python3 bench/profile_bwd.py --fa4 \
                           ${NCU_BWD_CONFIGS:+--configs "$NCU_BWD_CONFIGS"} ${NCU_BWD_ARGS:-}
                       if [ -f "$OUT/ncu-bwd/bwd.ncu-rep" ]; then
                           ncu --import "$OUT/ncu-bwd/bwd.ncu-rep" --page details > "$OUT/ncu-bwd/details.txt" 2>&1
                           ncu --import "$OUT/ncu-bwd/bwd.ncu-rep" --page raw --csv > "$OUT/ncu-bwd/raw.csv" 2>&1
                           [ "${NCU_BWD_SOURCE:-1}" = 1 ] && ncu --import "$OUT/ncu-bwd/bwd.ncu-rep" --page source --csv \
                               --print-source sass > "$OUT/ncu-bwd/source.csv" 2>&1
                           grep -E "^  [_a-zA-Z].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible" \
                               "$OUT/ncu-bwd/details.txt" | tee -a "$LOG"
                       fi ;;
        fused-ab)      run_part fused-ab python3 bench/fused_ab.py --graphs ${FUSED_AB_ARGS:-} ;;
        ncu-fused-ab)  mkdir -p "$OUT/ncu-fused-ab"
                       run_part ncu-fused-ab ncu --profile-from-start off --clock-control none \
                           --kernel-name regex:_attn_bwd_fused --section SpeedOfLight --section ComputeWorkloadAnalysis \
                           --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum \
                           -f -o "$OUT/ncu-fused-ab/ab" python3 bench/fused_ab.py --profile ${FUSED_AB_ARGS:-}
                       if [ -f "$OUT/ncu-fused-ab/ab.ncu-rep" ]; then
                           ncu --import "$OUT/ncu-fused-ab/ab.ncu-rep" --page raw --csv > "$OUT/ncu-fused-ab/raw.csv" 2>&1
                           python3 bench/fused_ab.py --cycles "$OUT/ncu-fused-ab/raw.csv" ${FUSED_AB_ARGS:-} 2>&1 | tee -a "$LOG"
                       fi ;;
        ncu-fp8)       mkdir -p "$OUT/ncu-fp8"
                       run_part ncu-fp8 ncu --profile-from-start off --clock-control none --kernel-name regex:_attn_fwd_sm90 \
                           --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
                           --section WarpStateStats --section SchedulerStats --section SourceCounters \
                           -f -o "$OUT/ncu-fp8/fwd" python3 bench/profile_fp8_fwd.py ${NCU_FP8_ARGS:-}
                       if [ -f "$OUT/ncu-fp8/fwd.ncu-rep" ]; then
                           ncu --import "$OUT/ncu-fp8/fwd.ncu-rep" --page details > "$OUT/ncu-fp8/details.txt" 2>&1
                           ncu --import "$OUT/ncu-fp8/fwd.ncu-rep" --page raw --csv > "$OUT/ncu-fp8/raw.csv" 2>&1
                           ncu --import "$OUT/ncu-fp8/fwd.ncu-rep" --page source --csv --print-source sass \
                               > "$OUT/ncu-fp8/source.csv" 2>&1
                           grep -E "^  [_a-zA-Z].*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Pipe" \
                               "$OUT/ncu-fp8/details.txt" | tee -a "$LOG"
                       fi ;;
        ncu-paged)     ncu_dir="$OUT/ncu-paged-${TRITON_PACK:-default}"; mkdir -p "$ncu_dir"
                       run_part ncu-paged ncu --profile-from-start off --clock-control none --section SpeedOfLight \
                           --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
                           --section SourceCounters -f -o "$ncu_dir/paged" python3 bench/profile_paged.py ${NCU_PAGED_ARGS:-}
                       if [ -f "$ncu_dir/paged.ncu-rep" ]; then
                           ncu --import "$ncu_dir/paged.ncu-rep" --page details > "$ncu_dir/details.txt" 2>&1
                           ncu --import "$ncu_dir/paged.ncu-rep" --page raw --csv > "$ncu_dir/raw.csv" 2>&1
                           ncu --import "$ncu_dir/paged.ncu-rep" --page source --csv --print-source sass > "$ncu_dir/source.csv" 2>&1
                           grep -E "^  [_a-zA-Z].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|No Eligible" \
                               "$ncu_dir/details.txt" | tee -a "$LOG"
                       fi ;;
        ncu-paged-ab)  ncu_dir="$OUT/ncu-paged-ab-${TRITON_PACK:-default}"; mkdir -p "$ncu_dir"
                       ab_args=${NCU_PAGED_AB_ARGS:---pages 0,16,32,64 --varlen --v-warp 0,1}
                       run_part ncu-paged-ab ncu --profile-from-start off --clock-control none --kernel-name regex:_attn_fwd_sm90 \
                           --section SpeedOfLight -f -o "$ncu_dir/ab" python3 bench/profile_paged.py $ab_args
                       if [ -f "$ncu_dir/ab.ncu-rep" ]; then
                           ncu --import "$ncu_dir/ab.ncu-rep" --page raw --csv > "$ncu_dir/raw.csv" 2>&1
                           python3 bench/profile_paged.py --cycles "$ncu_dir/raw.csv" $ab_args 2>&1 | tee -a "$LOG"
                       fi ;;
        ptxas-ab)      # Triton 3.9 assembles sm_90 with its CUDA 13 ptxas ("ptxas-blackwell"); the same PTX through a CUDA 12
                       # ptxas (here the machine's own Triton's, 12.8: the pack leaves 3.9's bin/ptxas out) drops the forward
                       # loop's A-operand moves (bench/NOTES.md 80). The ncu A/B parts once per assembler, every build
                       # compiled fresh (FUSEDATTN_PREBUILT=0), each in its own $OUT/ptxas-TAG/.
                       legacy=$(find / -path "*site-packages/triton/backends/nvidia/bin/ptxas" -not -path "/tmp/*" 2>/dev/null | head -1)
                       say "legacy ptxas: ${legacy:-none} ($([ -n "$legacy" ] && "$legacy" --version | tail -1))"
                       for tag in default legacy; do
                           [ "$tag" = legacy ] && [ -z "$legacy" ] && continue
                           ( [ "$tag" = legacy ] && export TRITON_PTXAS_BLACKWELL_PATH=$legacy
                             export FUSEDATTN_PREBUILT=0 TRITON_CACHE_DIR=/tmp/triton-cache-ptxas-$tag
                             export NCU_PAGED_AB_ARGS="--pages 0,16,64 --varlen"
                             export FWD_AB_ARGS=${PTXAS_AB_FWD:---configs b2-s8k-d128,b4-s2k-d128-c,b8-s1k-d64-fp16}
                             export FUSED_AB_ARGS="--configs 8k,2kc --variants default"
                             share=$(left); [ "$tag" = default ] && share=$(( share / 2 ))
                             OUT="$OUT/ptxas-$tag" DEADLINE=$(( share - 5 )) \
                                 bash "$0" ncu-paged-ab ncu-fwd-ab ncu-fused-ab 2>&1 | grep -E "cycles|rc=|skipped" \
                                 | sed "s/^/$tag: /" | tee -a "$LOG" )
                       done ;;
        route-probe)   run_part route-probe python3 bench/prefill_route_probe.py ;;
        fp8-host)      run_part fp8-host python3 bench/fp8_bwd_host_probe.py --cprofile ;;
        paged-tiles)   run_part paged-tiles python3 bench/paged_tiles.py ${PAGED_TILES_ARGS:-} ;;
        prefill-host)  run_part prefill-host python3 bench/prefill_host_probe.py --profile ;;
        odd-dims)      run_part odd-dims python3 bench/odd_dims_probe.py ${ODD_DIMS_ARGS:-} ;;
        d64-fused)     run_part d64-fused python3 bench/d64_fused.py --stages 2 ${D64_FUSED_ARGS:-} ;;
        d64-tiles)     run_part d64-tiles python3 bench/d64_dkdv_tiles.py ;;
        fp8-bwd-tiles) run_part fp8-bwd-tiles python3 bench/fp8_bwd_tiles.py ${FP8_BWD_TILES_ARGS:-} ;;
        bwd-time)      run_part bwd-time python3 bench/profile_bwd.py --time 20 --fa4 \
                           ${NCU_BWD_CONFIGS:+--configs "$NCU_BWD_CONFIGS"} ;;
        fused-sweep)   run_part fused-sweep python3 bench/gluon_fused_sweep.py ${FUSED_SWEEP_ARGS:-} ;;
        demo)          run_part demo python3 -m fusedattn demo ;;
        bench)         bench_part bench ;;
        bench-quick)   bench_part bench-quick --quick ;;
        bench-anchors) bench_part bench-anchors --quick --configs anchors ;;
        # the anchors in two halves: with every alternative compiling per config, all eight
        # may not fit one 10-minute call
        bench-anchors-a) bench_part bench-anchors-a --quick --configs anchors \
                             --only b8-h12-s1024,b4-h32-s2048,b32-h32-s2048 ;;
        bench-anchors-b) bench_part bench-anchors-b --quick --configs anchors \
                             --only b1-h32-s16384,b4-h32kv8,b2-h16-s8192,b4-h16-s4096 ;;
        bench-masked)  bench_part bench-masked --quick --configs masked ;;
        bench-decode)  bench_part bench-decode --quick --configs decode ;;
        bench-prefill) bench_part bench-prefill --quick --configs prefill ;;
        bench-fp8)     bench_part bench-fp8 --quick --configs fp8 ;;
        bench-graphs)  bench_part bench-graphs --cuda-graphs --configs anchors --only b8-h12-s1024 ;;
        stash)         stash_parts ;;
        warmup)        run_part warmup python3 -m fusedattn warmup ;;
        prebuilt)      # build the shipped-kernel store for this Triton (fusedattn/backends/prebuilt.py), put it in
                       # this tree's fusedattn/prebuilt/ for the parts after it, and return it as one tar
                       rm -rf /tmp/prebuilt-store
                       run_part prebuilt python3 -m fusedattn warmup --record /tmp/prebuilt-store
                       mkdir -p fusedattn/prebuilt && cp -r /tmp/prebuilt-store/triton-* fusedattn/prebuilt/
                       tar -C /tmp/prebuilt-store -cf "$OUT/prebuilt-$(python3 -c 'import triton; print(triton.__version__)').tar" .
                       du -sh /tmp/prebuilt-store/* | tee -a "$LOG" ;;
        store-check)   run_part store-check python3 tools/store_gpu_check.py ${STORE_CHECK_ONLY:+--only "$STORE_CHECK_ONLY"} ;;
        tests-prebuilt) run_part tests-prebuilt python3 -m pytest -q -rfEs tests/test_prebuilt.py -m gpu ;;
        coldstart)     run_part coldstart python3 -m fusedattn bench --cold-start ${COLD_ONLY:+--only "$COLD_ONLY"} ;;
        sdpa)          run_part sdpa python3 -m pytest -q -rfEs tests/test_torch_sdpa.py -n "${TEST_WORKERS:-4}" ;;
        models)        run_part models python3 -m fusedattn bench --models ;;
        hf-example)    run_part hf-example python3 examples/hf_llama.py ;;
        cudnn-tests)   if [ -f .cudnn_fe_tests/test_mhas.py ]; then
                           run_part cudnn-tests python3 bench/cudnn_fe_suite.py -n "${CFE_N:-40}" --seed "${CFE_SEED:-24}" \
                               --workers "${CFE_WORKERS:-8}" --budget $(( $(left) - 30 )) --out "$OUT/cudnn-tests"
                       else say "cudnn-tests: .cudnn_fe_tests/ was not carried (fetch it: bench/cudnn_fe_suite.py)"
                            STATUS[cudnn-tests]=skipped; fi ;;
        tests-sample)  FUSEDATTN_TEST_SAMPLE=${FUSEDATTN_TEST_SAMPLE:-4} run_part tests-sample python3 -m pytest -q \
                           -rfEs tests -m gpu -n "${TEST_WORKERS:-$WORKERS}" ${TEST_K:+-k "$TEST_K"} ;;
        *)             say "unknown part '$part' (see the header of bench/run_device.sh)"; STATUS[$part]=unknown ;;
    esac
done

say "summary ($((SECONDS - START)) s)"
failed=0
for part in "${PARTS[@]}"; do
    echo "  $part: ${STATUS[$part]:-done}" | tee -a "$LOG"
    case "${STATUS[$part]:-}" in rc=0,*|"") ;; *) failed=1 ;; esac
done
exit $failed
