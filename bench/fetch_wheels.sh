#!/usr/bin/env bash
# Download here (where PyPI is reachable) the wheels the GPU machine lacks, into .whl/
# at the repository root. The GPU machine has no network: the lead names `.whl` in the
# device call's `carry`, and bench/run_device.sh installs whatever .whl/ holds.
#
#   bash bench/fetch_wheels.sh            # cuDNN frontend (ANCHORS.md: 1.32.0) + apache-tvm-ffi + pytest + looseversion
#
# Wheels are for the GPU machine, not for here: CPython 3.12, manylinux x86_64, --no-deps
# (each dependency it really needs is named). nvidia-cudnn-frontend's metadata also asks
# for nvidia-cutlass-dsl[cu13]; `import cudnn` and its pygraph SDPA work without it against
# the machine's own cuDNN (ANCHORS.md), so it is left out: it is over 100 MB.
#
# FlashAttention-4 (too big for one call; NOT fetched here). Recipe, from ANCHORS.md:
#   1. download, with the same pip line as below, into .whl-fa4/ (also git-ignored):
#        flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base
#        nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu13 quack-kernels apache-tvm-ffi
#        torch-c-dlpack-ext cuda-bindings cuda-pathfinder einops        (about 120 MB in all)
#      (versions: those the ANCHORS.md run used; check each wheel's Requires-Dist with
#       `unzip -p X.whl '*/METADATA' | grep ^Requires-Dist`, keep one version of each)
#   2. split the 92 MB -libs-cu13 wheel: `split -b 46M NAME.whl .whl/NAME.whl.part-`
#      and put the first half alone in .whl/ for a first device call that runs
#      `bash bench/run_device.sh stash` (copies the parts to /tmp/whlparts on the machine);
#   3. right after (the machine stays warm only ~30 s), a second call carries the other
#      half plus the remaining wheels; run_device.sh joins `*.whl.part-*` from /tmp/whlparts
#      and .whl/ with cat, installs everything with --target /tmp/site and adds that folder
#      with site.addsitedir (FA4 finds its DSL through a .pth file).
#   Each call carries at most 64 MiB in all (the working tree counts too).
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
DEST=.whl
PYTHON=${PYTHON:-python3}

# .whl/ must never be committed; /.whl/ is in .gitignore today, the exclude line keeps it so.
if ! git check-ignore -q "$DEST/x.whl"; then
    mkdir -p .git/info
    echo "/$DEST/" >> .git/info/exclude
fi
mkdir -p "$DEST"

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
WHEELS=(
    nvidia-cudnn-frontend==1.32.0     # ANCHORS.md's version
    apache-tvm-ffi==0.1.15.post2      # cudnn-frontend 1.32.0 asks for >=0.1.11; newest today
    # pytest for `run_device.sh tests`, in case the machine's image lacks it (pure Python, ~2 MB;
    # packaging>=24, its fourth need, is in the image through torch's and lightning's own needs)
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0
    # cuDNN frontend's own SDPA tests (run_device.sh cudnn-tests) import looseversion (pure Python, 9 kB)
    looseversion==1.3.0
)

"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"

echo "in $DEST/ (carry it: the device call's carry must name .whl):"
ls -l "$DEST"/*.whl | awk '{printf "  %6.1f MB  %s\n", $5 / 1e6, $NF}'
du -sh "$DEST" | awk '{print "  total " $1 " (a call carries at most 64 MiB with the working tree)"}'
