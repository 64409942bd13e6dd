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
# FlashAttention-4 (too big for one call: about 107 MB of wheels):
#
#   bash bench/fetch_wheels.sh fa4
#
# downloads FA4 4.0.0b36 and its CuTe DSL (the versions ANCHORS.md's run used) into .whl-fa4/ (git-ignored) and
# stages them for three device calls made back to back (the machine stays warm ~30 s between calls):
#   .whl-fa4/stage1/  the first 55 MB of the -libs-cu13 wheel
#   .whl-fa4/stage2/  its other 37 MB and every other FA4 wheel, each renamed NAME.whl.part-aa (one part)
# Call 1: copy stage1 into .whl/ and run `bash bench/run_device.sh stash` carrying .whl; call 2: the same with
# stage2; call 3: .whl/ back to the cuDNN frontend wheels (this script with no argument) and the real parts.
# run_device.sh's install_wheels joins every NAME.whl.part-* kept in /tmp/whlparts and installs them into
# /tmp/site; fusedattn.bench adds that folder as a site dir (FA4 finds its DSL through a .pth file). Each call
# carries at most 64 MiB with the working tree: drop the shipped stores the call does not need from the index
# first (bench/NOTES.md 64 has the session that did this).
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

PLATFORMS_FA4=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
               --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
if [ "${1:-}" = fa4 ]; then
    FA4=.whl-fa4
    rm -rf "$FA4" && mkdir -p "$FA4/wheels" "$FA4/stage1" "$FA4/stage2"
    # versions of the 2026-11-22 anchors run; apache-tvm-ffi comes with the cuDNN frontend wheels above
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS_FA4[@]}" --platform any -d "$FA4/wheels" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
        nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
        quack-kernels==0.6.5 torch-c-dlpack-ext==0.1.5 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 einops==0.8.2
    for w in "$FA4"/wheels/*.whl; do
        name=$(basename "$w")
        case "$name" in
            nvidia_cutlass_dsl_libs_cu13-*)
                split -b 55M "$w" "$FA4/stage1/$name.part-"
                mv "$FA4"/stage1/"$name".part-a[b-z] "$FA4/stage2/" ;;
            *) cp "$w" "$FA4/stage2/$name.part-aa" ;;
        esac
    done
    du -sh "$FA4/stage1" "$FA4/stage2"
    echo "stage1 then stage2 into .whl/, each with: bash bench/run_device.sh stash (carry .whl); then the run"
    exit 0
fi

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
