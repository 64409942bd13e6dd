"""Test setup: Triton's interpreter where there is no GPU, and the (device, backend) matrix.

TRITON_INTERPRET must be set before triton is imported (triton.jit reads it when a
kernel is defined), so this runs before any fusedattn import. On a CUDA machine the
real kernels run on the GPU and the interpreter cases skip, visibly.
"""
import os

# FUSEDATTN_TEST_GPUS=N on a machine of N GPUs (bench/run_device.sh sets it): each xdist worker takes one
# GPU, round robin, instead of all of them sharing card 0 (on four H100s this was no faster per test than
# one: bench/NOTES.md 58). xdist sets the worker's id before this file is imported, and CUDA reads
# CUDA_VISIBLE_DEVICES only when first used.
_GPUS = int(os.environ.get("FUSEDATTN_TEST_GPUS", "0") or 0)
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _GPUS > 1 and _WORKER.startswith("gw"):
    os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_WORKER[2:]) % _GPUS)

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# (device, backend): the CPU path, the real Triton kernels under the interpreter, the GPU kernels
TARGETS = [
    pytest.param(("cpu", "cpu"), id="cpu"),
    pytest.param(("cpu", "triton"), id="interp",
                 marks=pytest.mark.skipif(not INTERPRET, reason="Triton interpreter off (TRITON_INTERPRET unset)")),
    pytest.param(("cuda", "triton"), id="gpu",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device: GPU tests skipped")]),
]


@pytest.fixture(params=TARGETS)
def target(request):
    """(device, backend) pair a test runs on."""
    return request.param


def pytest_report_header(config):
    return (f"fusedattn tests: CUDA {'yes: ' + torch.cuda.get_device_name() if HAS_CUDA else 'no (GPU tests skip)'}; "
            f"Triton interpreter {'on' if INTERPRET else 'off'}")


def pytest_collection_modifyitems(config, items):
    """FUSEDATTN_TEST_SAMPLE=N keeps every N-th collected test of each file (at least its first), so a
    run on a second Triton (CI's newest, the GPU runs of the versions between) still launches every
    kernel file's cases within its time; the deselected ones are reported as deselected, not passed."""
    every = int(os.environ.get("FUSEDATTN_TEST_SAMPLE", "1") or 1)
    if every <= 1:
        return
    kept, dropped, seen = [], [], {}
    for item in items:
        n = seen.get(item.path, 0)
        seen[item.path] = n + 1
        (kept if n % every == 0 else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_report_collectionfinish(config, start_path, items):
    every = os.environ.get("FUSEDATTN_TEST_SAMPLE")
    if every and every != "1":
        return f"fusedattn: FUSEDATTN_TEST_SAMPLE={every}: every {every}-th test of each file"


def target_id(target) -> str:
    """The id pytest gives a (device, backend) target ("cpu", "interp", "gpu"): what a repro line's -k names."""
    return {("cpu", "cpu"): "cpu", ("cpu", "triton"): "interp", ("cuda", "triton"): "gpu"}[tuple(target)]


@pytest.fixture(autouse=True)
def _gpu_faults_stay_with_their_test():
    """A device-wide synchronize after every test on a CUDA machine: an illegal address in a kernel the test
    launched is reported at that test's teardown, not at the first CUDA call of the next test on the same
    worker (the 300-seed fuzz of session 27 lost its culprit that way: every later test of the worker failed)."""
    yield
    if HAS_CUDA and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def _no_replay_outlives_its_test():
    """Every launch replay (``fusedattn.backends.replay``) is forgotten after each test: a replay recorded under one
    test's routing switches (monkeypatched) must not run in another test of the same problem."""
    yield
    import sys
    replay = sys.modules.get("fusedattn.backends.replay")
    if replay is not None:
        replay.clear_all()


def run_compile_child(code: str) -> str:
    """Run ``code`` in a child Python at the repository root (tools/ and the root on sys.path) with Triton's
    interpreter off, and return its stdout: a test that compiles a kernel for sm_90 with no GPU (CI turns the
    interpreter on, and an interpreting Triton compiles nothing). Fails the test with the child's stderr."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    run = subprocess.run([sys.executable, "-c", "import sys; sys.path[:0] = ['tools', '.']\n" + code], cwd=root,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
