"""cuDNN frontend's own SDPA tests, run with fusedattn as ``cudnn`` and with the real cuDNN frontend.

Issue 24's measure ("every cuDNN case that cuDNN itself runs also runs and passes here, and what we
report as not supported cuDNN reports so too"): a seeded sample of the parametrized cases of NVIDIA's
own tests runs twice, in separate processes,

* with the real ``cudnn`` package (the nvidia-cudnn-frontend wheel, 1.32.0 per ANCHORS.md, that
  bench/fetch_wheels.sh puts in .whl/ and bench/run_device.sh installs), where ``import cudnn`` works;
* with fusedattn standing in for it (this file, loaded as a pytest plugin, sets
  ``sys.modules["cudnn"] = fusedattn`` before their conftest.py imports it);

and one table comes out: case | cuDNN outcome | fusedattn outcome, the totals, and the cases where the
two differ with the first lines of each failure.

    python bench/cudnn_fe_suite.py -n 40 --seed 24 --out out/cfe     # on the GPU machine
    python bench/cudnn_fe_suite.py --dry-run -n 40                   # anywhere: collect, sample, check
    python bench/cudnn_fe_suite.py --cpu-emulate -n 40 --workers 2   # no GPU: fusedattn's side on the CPU
    bash bench/run_device.sh cudnn-tests                             # the device part (CFE_N, CFE_SEED)

``--cpu-emulate`` is a preview for machines without a GPU: the fusedattn side only, their ``"cuda"``
tensors, streams and generators mapped to the CPU and an sm_90 device reported (fusedattn's CPU path has
the GPU kernels' semantics; its numbers are not the GPU's, and nothing there says what cuDNN does).

Outcomes: ``pass``; ``FAIL`` (an assertion or error in the test body); ``error`` (fixture / setup);
``unsupported`` (a skip whose reason is cuDNN's not-supported answer: their tests skip on
``cudnnGraphNotSupportedError`` from validate / check_support, "TEST WAIVED: unsupported graph");
``skip`` (any other skip: the test's own preconditions, version or compute-capability checks);
``crash`` (the process died in the case; the rest run in a fresh process); ``timeout``; ``not run``
(out of time). Disagreements are pairs whose outcomes differ, both sides having run.

Their test code is NOT in this repository. It lives, fetched byte for byte, in the git-ignored
``.cudnn_fe_tests/`` at the repository root (a device call carries it: ``carry: [".whl",
".cudnn_fe_tests"]``). The files, from the public repository NVIDIA/cudnn-frontend, ``test/python/``:

    file                          commit (read_file's answer)                 index id      chars  sha256 (first 16)
    test_mhas.py                  57dc5795e09574144767985ca78e220527710abe  57417458099   59806  76cda1f0fbd1499a
    conftest.py                   57dc5795e09574144767985ca78e220527710abe  57492660537    9881  ef83161010436a7a
    test_utils.py                 57dc5795e09574144767985ca78e220527710abe  57759633384     626  6fcac63f1462e5cf
    test_sdpa_thd.py              0c08141252f411a4c9f1ce9fd067c046a2ca2237  57804182372   39626  bb3462feeac69d4e
    test_sdpa_chunked_prefill.py  59c96e55120b7785e629dfbb11ba26dcda3eb1b5  57415365047   25162  21174849cb9c263d

(the full digests are in ``MANIFEST`` below; ``--check-files`` compares them). test_mhas.py, conftest.py
and test_utils.py are one snapshot (commit 57dc5795); the index holds the two THD files at other commits
only (find_files names 9072c4e7 for both, but read_file's default version, the one above, is newer: at
9072c4e7 test_sdpa_thd.py is another, 39487-character version). Both import only ``cudnn``, pytest, torch,
looseversion and test_utils, so they run beside the 57dc5795 conftest.

Left out: ``test_mhas_v2.py`` (the index's one version, at 034776363fea, 114885 chars) imports the
``sdpa/`` helper package (random_config, fp16, fp8, mxfp8, blocked, helpers; fp16.py alone has 65
stored versions) and ``frost_routing``, none of them stored at that commit, so no consistent snapshot can
be fetched; it also reaches ``cudnn.engines.manifest`` and ``cudnn.frost.buffers`` (FROST engine
routing of cuDNN frontend's own Python engines), which fusedattn does not have.

To fetch them again (a later session, with the search tools ``find_files`` / ``read_file``):

1. ``read_file(repo="NVIDIA/cudnn-frontend", path="test/python/<file>", commit=<commit above>)``; the
   answer carries ``text`` (16000 characters a page), ``total_chars`` and ``next_offset``; call again
   with ``offset=16000, 32000, ...`` until no ``next_offset`` comes back.
2. Concatenate the pages' ``text`` exactly (decode the JSON string; no newline added between pages)
   and write it as UTF-8, no newline translation, to ``.cudnn_fe_tests/<file>``. A safe way: paste each
   page's JSON-escaped text into a file ``<file>.<offset>`` and decode with ``json.loads('"' + s + '"')``;
   every page but the last must decode to exactly 16000 characters.
3. ``python bench/cudnn_fe_suite.py --check-files`` must print OK for each (length and sha256).
4. ``/.cudnn_fe_tests/`` is in .gitignore: never commit those files.

Also needed by their tests: ``looseversion`` (pure Python; bench/fetch_wheels.sh downloads it into .whl/
for the GPU machine, which has no network; ``pip install looseversion`` here). This file writes one file of
its own into the tests folder: ``pytest.ini`` (registers their L0/L1 marks and makes that folder pytest's
rootdir, so this repository's pytest settings stay out).

How the two runs are kept identical: test_mhas.py draws its shapes with Python's global ``random``
(unseeded there; only torch's generator is seeded, by ``torch_fork_set_rng``), so the plugin seeds
``random`` per case from ``--seed`` and the case id before each case, on both sides: the same case gets
the same shapes, and the shapes are printed in the case's "TEST CMD TO REPRODUCE" line, kept in the
results. Both sides read the backend version from ``cudnn.backend_version_string()`` (fusedattn reports
9.19.0, the cuDNN whose SDPA semantics it follows; the real one reports the machine's cuDNN), so shape
choices gated on versions >= 9.9 agree whenever the machine's cuDNN is 9.9 or later.

Sampling: by default stratified by test function (each small function whole, the rest of N split evenly
between test_sdpa and test_sdpa_backward), after leaving out the cases test_mhas.py skips before it
touches cuDNN whatever the backend (``STATIC_SKIPS``: ragged without padding or with sbh3d, paged without
padding / BSHD or with ragged, backward ALiBi without a top-left right bound); ``--keep-static-skips``
keeps them, ``--sampling uniform`` draws uniformly.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter, OrderedDict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_TESTS_DIR = REPO / ".cudnn_fe_tests"
PLUGIN = Path(__file__).stem          # this module, loaded by pytest as ``-p cudnn_fe_suite``

# name -> (commit read_file answered with, index id, characters, sha256 of the UTF-8 bytes)
MANIFEST = OrderedDict([
    ("test_mhas.py", ("57dc5795e09574144767985ca78e220527710abe", "57417458099", 59806,
                      "76cda1f0fbd1499a5c3a4b89cadf676b27999e3c80a9ff5e08192983abdf35fb")),
    ("conftest.py", ("57dc5795e09574144767985ca78e220527710abe", "57492660537", 9881,
                     "ef83161010436a7a5946168a5f444b02d37d8671f0bde530dbf4a9b201a65bae")),
    ("test_utils.py", ("57dc5795e09574144767985ca78e220527710abe", "57759633384", 626,
                       "6fcac63f1462e5cfb6049e8054ccd7ecae8bb9aa02d329ee06ec992cd0a218e4")),
    ("test_sdpa_thd.py", ("0c08141252f411a4c9f1ce9fd067c046a2ca2237", "57804182372", 39626,
                          "bb3462feeac69d4e03cf45224ab338d0119ffc499be7e7219aeae99910954d7a")),
    ("test_sdpa_chunked_prefill.py", ("59c96e55120b7785e629dfbb11ba26dcda3eb1b5", "57415365047", 25162,
                                      "21174849cb9c263da37b66e8fab7a0ced7f3bbb5da7bd7e2265e4c353788db7d")),
])
TEST_FILES = [n for n in MANIFEST if n.startswith("test_") and n != "test_utils.py"]

PYTEST_INI = """\
# written by bench/cudnn_fe_suite.py (fusedattn): this folder is pytest's rootdir for cuDNN frontend's tests
[pytest]
markers =
    L0: cuDNN frontend test level 0
    L1: cuDNN frontend test level 1
    L2: cuDNN frontend test level 2
"""

# A skip whose reason says this is cuDNN's "not supported" answer (their tests catch
# cudnnGraphNotSupportedError around validate / check_support and skip).
UNSUPPORTED_RE = re.compile(r"cudnnGraphNotSupportedError|TEST WAIVED|unsupported graph|Graph not supported")
OUTCOMES = ("pass", "FAIL", "error", "unsupported", "skip", "crash", "timeout", "not run")


# --------------------------------------------------------------------------------------------------
# The pytest plugin half (this module is loaded in each pytest process with -p cudnn_fe_suite)
# --------------------------------------------------------------------------------------------------

if os.environ.get("CFE_SIDE") == "fusedattn" and "cudnn" not in sys.modules:
    import fusedattn as _fusedattn
    sys.modules["cudnn"] = _fusedattn      # before their conftest.py's `import cudnn`


def _emulate_cuda_on_cpu():
    """--cpu-emulate (a preview without a GPU, fusedattn's CPU path): their tests ask for "cuda" tensors,
    streams and the compute capability; map those to the CPU and report an sm_90 device. Only the
    explicit "cuda" requests change; nothing of this runs in a GPU run."""
    import types

    import torch

    def dev(d):
        return "cpu" if d is not None and str(d).startswith("cuda") else d

    def wrap(fn):
        def call(*a, **k):
            if "device" in k:
                k["device"] = dev(k["device"])
            return fn(*a, **k)
        return call

    for name in ("randn", "rand", "randint", "zeros", "ones", "empty", "full", "arange", "linspace", "tensor",
                 "empty_strided", "zeros_like", "ones_like", "empty_like", "randn_like", "full_like", "as_tensor"):
        setattr(torch, name, wrap(getattr(torch, name)))
    to = torch.Tensor.to

    def tensor_to(self, *a, **k):
        if "device" in k:
            k["device"] = dev(k["device"])
        a = tuple(dev(x) if isinstance(x, (str, torch.device)) else x for x in a)
        return to(self, *a, **k)

    torch.Tensor.to = tensor_to
    torch.Tensor.cuda = lambda self, *a, **k: self
    gen = torch.Generator

    class _GenMeta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, gen)

    class Generator(metaclass=_GenMeta):
        def __new__(cls, device="cpu"):
            return gen(device=dev(device))

    torch.Generator = Generator
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "CPU (cuda emulated by bench/cudnn_fe_suite.py)"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: types.SimpleNamespace(cuda_stream=0)


_EMULATE = os.environ.get("CFE_EMULATE_CPU") == "1"
if _EMULATE:
    import pytest as _pytest

    _emulate_cuda_on_cpu()

    @_pytest.fixture(scope="session")
    def cudnn_handle():
        # their conftest's fixture (it is not loaded: its pytest_configure asserts a CUDA device)
        import cudnn
        return cudnn.create_handle()

    def pytest_addoption(parser):
        # their conftest's options (--b, --s_q, ... --implementation), which test_mhas.py reads
        import importlib.util as _ilu
        spec = _ilu.spec_from_file_location("cfe_their_conftest", os.path.join(os.getcwd(), "conftest.py"))
        mod = _ilu.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.pytest_addoption(parser)


def _write_record(rec):
    path = os.environ.get("CFE_RESULTS")
    if not path:
        return
    line = json.dumps(rec) + "\n"
    # one write per line, O_APPEND: lines from several processes never interleave
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _is_xdist_worker(config):
    return hasattr(config, "workerinput")


def pytest_configure(config):
    config._cfe_worker = _is_xdist_worker(config)
    if os.environ.get("CFE_RESULTS") and not config._cfe_worker:
        info = {"event": "session", "side": os.environ.get("CFE_SIDE", "?"), "pid": os.getpid()}
        try:
            import cudnn  # noqa: F401  (whichever it is on this side)
            info["cudnn_file"] = getattr(cudnn, "__file__", None)
            info["cudnn_version"] = getattr(cudnn, "__version__", None)
            info["backend_version"] = cudnn.backend_version()
        except Exception as exc:  # noqa: BLE001  (recorded, not raised: the run says what failed)
            info["cudnn_error"] = f"{type(exc).__name__}: {exc}"
        try:
            import torch
            info["torch"] = torch.__version__
            if torch.cuda.is_available():
                info["device"] = torch.cuda.get_device_name()
                info["torch_cudnn"] = torch.backends.cudnn.version()
        except Exception as exc:  # noqa: BLE001
            info["torch_error"] = repr(exc)
        _write_record(info)


def pytest_collection_finish(session):
    out = os.environ.get("CFE_COLLECT_OUT")
    if not out or _is_xdist_worker(session.config):
        return
    rows = []
    for item in session.items:
        cs = getattr(item, "callspec", None)
        params = {k: str(v) for k, v in cs.params.items()} if cs is not None else {}
        rows.append({"id": item.nodeid, "func": item.originalname if hasattr(item, "originalname") else item.name,
                     "file": item.nodeid.split("::", 1)[0], "params": params})
    Path(out).write_text(json.dumps(rows))


def pytest_runtest_setup(item):
    # test_mhas.py draws its shapes with Python's global random: the same case, the same draws, both sides
    random.seed(f"{os.environ.get('CFE_SEED', '0')}:{item.nodeid}")


def pytest_runtest_logstart(nodeid, location):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _write_record({"event": "start", "id": nodeid, "t": time.time()})


def pytest_runtest_logreport(report):
    # xdist: the controller sees every worker's reports (and a crashed worker's case as failed);
    # workers do not write, or each case would be written twice
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rec = {"event": "report", "id": report.nodeid, "when": report.when, "outcome": report.outcome,
           "duration": round(getattr(report, "duration", 0.0), 3)}
    if report.skipped:
        lr = report.longrepr
        rec["reason"] = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    elif report.failed:
        rec["longrepr"] = str(report.longrepr)[-6000:]
    out = getattr(report, "capstdout", "") or ""
    repro = [ln for ln in out.splitlines() if ln.startswith("pytest ")]
    if repro:
        rec["repro"] = repro[-1]
    _write_record(rec)


# --------------------------------------------------------------------------------------------------
# The runner half
# --------------------------------------------------------------------------------------------------

def check_files(tests_dir: Path, names=None) -> list[str]:
    """Problems with the fetched files (missing, wrong length or digest); [] when all match."""
    problems = []
    for name in names or MANIFEST:
        commit, _id, chars, digest = MANIFEST[name]
        p = tests_dir / name
        if not p.exists():
            problems.append(f"{name}: missing (fetch it: see this file's docstring)")
            continue
        data = p.read_bytes()
        got = hashlib.sha256(data).hexdigest()
        n = len(data.decode("utf-8"))
        if got != digest or n != chars:
            problems.append(f"{name}: {n} chars, sha256 {got[:16]}..., expected {chars} chars, {digest[:16]}... "
                            f"(commit {commit[:12]})")
    return problems


def _env(side: str, seed: int, extra=None) -> dict:
    env = dict(os.environ)
    env["CFE_SIDE"] = side
    env["CFE_SEED"] = str(seed)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    # a pytest of our own around this run (tests/test_cudnn_fe_suite.py under xdist) must not leak in
    for var in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_CURRENT_TEST",
                "CFE_RESULTS", "CFE_COLLECT_OUT"):
        env.pop(var, None)
    if extra:
        env.update(extra)
    return env


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def collect(tests_dir: Path, files, side: str, seed: int, work: Path, use_conftest: bool) -> list[dict]:
    """Collect the cases of ``files`` with ``side`` as cudnn; returns [{id, func, file, params}]."""
    out = work / f"collect-{side}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", PLUGIN, "-p", "no:cacheprovider"]
    if not use_conftest:
        # their conftest's pytest_configure asserts a CUDA device: without one, collect without it
        cmd.append("--noconftest")
    p = subprocess.run(cmd + list(files), cwd=tests_dir, env=_env(side, seed, {"CFE_COLLECT_OUT": str(out)}),
                       capture_output=True, text=True)
    tail = "\n".join((p.stdout + p.stderr).splitlines()[-40:])
    if not out.exists():
        raise SystemExit(f"collection with {side} as cudnn failed (rc {p.returncode}):\n{tail}")
    if p.returncode != 0:
        print(f"[cfe] collection with {side} as cudnn: rc {p.returncode}\n{tail}")
    rows = json.loads(out.read_text())
    return rows


def is_static_skip(row: dict) -> bool:
    """Whether test_mhas.py (57dc5795) skips this case before any cuDNN call, whatever the backend
    (cuDNN >= 9.10.2, compute capability >= 9): such cases tell nothing about either side."""
    f, p = row["func"], row["params"]
    if row["file"] != "test_mhas.py" or f not in ("test_sdpa", "test_sdpa_backward"):
        return False
    ragged = p.get("is_ragged") == "True"
    padding = p.get("is_padding") == "True"
    layout = p.get("layout")
    if ragged and (layout == "sbh3d" or not padding):
        return True
    if f == "test_sdpa":
        paged = p.get("paged_attention") in ("1", "_packed")
        if paged and (not padding or layout != "bshd_bshd_bshd" or ragged):
            return True
    else:
        # ALiBi backward runs only with a top-left right bound (that then draws 0 or s_kv//4)
        if p.get("is_alibi") == "True" and not (p.get("diagonal_alignment", "").endswith("TOP_LEFT")
                                                and p.get("is_right_bound") == "True"):
            return True
    return False


def sample(rows: list[dict], n: int, seed: int, how: str = "stratified") -> list[str]:
    """A seeded sample of ``n`` case ids: uniform, or stratified by (file, test function)."""
    rng = random.Random(seed)
    if n >= len(rows):
        return [r["id"] for r in rows]
    if how == "uniform":
        picked = set(rng.sample([r["id"] for r in rows], n))
        return [r["id"] for r in rows if r["id"] in picked]
    groups = OrderedDict()
    for r in rows:
        groups.setdefault((r["file"], r["func"]), []).append(r["id"])
    quota, left = {}, n
    pending = sorted(groups, key=lambda g: len(groups[g]))
    while pending:
        share = left / len(pending)
        g = pending[0]
        if len(groups[g]) <= share:
            quota[g] = len(groups[g])
            left -= quota[g]
            pending.pop(0)
            continue
        # the rest are all larger than the fair share: split what is left evenly (the remainder to the first)
        base, extra = divmod(left, len(pending))
        for i, g in enumerate(sorted(pending)):
            quota[g] = base + (1 if i < extra else 0)
        break
    picked = set()
    for g in sorted(groups):
        picked.update(rng.sample(groups[g], quota.get(g, 0)))
    return [r["id"] for r in rows if r["id"] in picked]


def _summarize(records: list[dict], ids: list[str]) -> dict:
    """Per case: outcome, detail (first lines / reason), repro, duration."""
    res = {}
    started = {}
    for rec in records:
        if rec.get("event") == "start":
            started[rec["id"]] = rec
        if rec.get("event") != "report":
            continue
        cur = res.setdefault(rec["id"], {"outcome": None, "detail": "", "repro": None, "duration": 0.0})
        cur["duration"] += rec.get("duration", 0.0)
        if rec.get("repro"):
            cur["repro"] = rec["repro"]
        when, oc = rec["when"], rec["outcome"]
        if oc == "skipped":
            reason = rec.get("reason", "")
            if cur["outcome"] in (None, "pass"):
                cur["outcome"] = "unsupported" if UNSUPPORTED_RE.search(reason) else "skip"
                cur["detail"] = reason
        elif oc == "failed":
            lr = rec.get("longrepr", "")
            if "crashed" in lr and "worker" in lr:
                kind = "crash"
            else:
                kind = "FAIL" if when == "call" else "error"
            if cur["outcome"] not in ("FAIL", "crash"):
                cur["outcome"] = kind
                cur["detail"] = lr
        elif oc == "passed" and when == "call" and cur["outcome"] is None:
            cur["outcome"] = "pass"
    # a case with a setup report but no outcome died inside its call: run_side calls it a crash
    res["_started"] = started
    return res


def run_side(side: str, ids: list[str], tests_dir: Path, seed: int, budget: float, workers: int,
             work: Path, log, emulate: bool = False) -> dict:
    """Run ``ids`` with ``side`` as cudnn within ``budget`` seconds; {id: {outcome, detail, repro, ...}}."""
    work.mkdir(parents=True, exist_ok=True)
    results_path = work / f"results-{side}.jsonl"
    results_path.unlink(missing_ok=True)
    deadline = time.time() + budget
    remaining = list(ids)
    final = {}
    session_info = None
    attempt = 0
    while remaining and time.time() < deadline - 5:
        attempt += 1
        cmd = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-q", "-rN",
               "--tb=short", "--no-header"]
        if workers > 0:
            cmd += ["-n", str(workers), "--max-worker-restart", "10000"]
        if emulate:
            cmd.append("--noconftest")
        cmd += remaining
        env = _env(side, seed, {"CFE_RESULTS": str(results_path), "CFE_EMULATE_CPU": "1" if emulate else "0"})
        t0 = time.time()
        log(f"[cfe] {side}: pytest on {len(remaining)} cases (try {attempt}, {deadline - t0:.0f} s left"
            f"{f', {workers} workers' if workers else ''})")
        with open(work / f"pytest-{side}.log", "a") as out:
            proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        records = [json.loads(ln) for ln in results_path.read_text().splitlines() if ln.strip()] \
            if results_path.exists() else []
        for rec in records:
            if rec.get("event") == "session" and session_info is None:
                session_info = rec
        summary = _summarize(records, remaining)
        started = summary.pop("_started")
        done = [i for i in remaining if i in summary and summary[i]["outcome"]]
        for i in done:
            final[i] = summary[i]
        unfinished = [i for i in remaining if i not in final]
        in_flight = [i for i in unfinished if i in started]
        log(f"[cfe] {side}: rc {proc.returncode}, {len(done)} finished in {time.time() - t0:.0f} s"
            f"{', timed out' if timed_out else ''}")
        if timed_out:
            for i in in_flight:
                final[i] = {"outcome": "timeout", "detail": "ran past the time budget", "repro": None}
            break
        if not unfinished:
            break
        if in_flight:
            # the process died inside these cases (segfault, os._exit from their synchronize guard ...)
            for i in in_flight:
                final[i] = {"outcome": "crash", "detail": f"pytest process ended (rc {proc.returncode}) in this case",
                            "repro": None}
            remaining = [i for i in unfinished if i not in in_flight]
            continue
        # no case started: pytest itself failed (collection, conftest): say so for every case left
        tail = (work / f"pytest-{side}.log").read_text().splitlines()[-30:]
        for i in unfinished:
            final[i] = {"outcome": "error", "detail": "pytest ended before the case started:\n" + "\n".join(tail),
                        "repro": None}
        break
    for i in ids:
        final.setdefault(i, {"outcome": "not run", "detail": "", "repro": None})
    final["_session"] = session_info
    return final


def real_cudnn_available() -> tuple[bool, str]:
    """Whether ``import cudnn`` gives the real cuDNN frontend here (a separate process)."""
    p = subprocess.run([sys.executable, "-c", "import cudnn; print(cudnn.__version__, cudnn.backend_version(), "
                        "cudnn.__file__)"], env=_env("cudnn", 0), capture_output=True, text=True)
    msg = (p.stdout.strip() or p.stderr.strip().splitlines()[-1:] or [""])
    msg = msg if isinstance(msg, str) else (msg[0] if msg else "")
    return p.returncode == 0, msg


def api_check(tests_dir: Path, names) -> list[str]:
    """Every ``cudnn.NAME[.MEMBER]`` their files reach, looked up on fusedattn: the missing ones."""
    import fusedattn
    missing, seen = [], set()
    pat = re.compile(r"(?<![\w.])cudnn\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")  # not torch.backends.cudnn
    absent = object()
    for name in names:
        p = tests_dir / name
        if not p.exists():
            continue
        for lineno, line in enumerate(p.read_text().splitlines(), 1):
            for m in pat.finditer(line):
                attr, member = m.group(1), m.group(2)
                if (attr, member) in seen:
                    continue
                seen.add((attr, member))
                obj = getattr(fusedattn, attr, absent)
                if obj is absent:
                    missing.append(f"cudnn.{attr} ({name}:{lineno})")
                elif member and not hasattr(obj, member):
                    missing.append(f"cudnn.{attr}.{member} ({name}:{lineno})")
    return missing


_SHORT = [("test_mhas.py::", ""), ("test_sdpa_thd.py::", "thd::"), ("test_sdpa_chunked_prefill.py::", "chunk::"),
          ("torch.float16", "fp16"), ("torch.bfloat16", "bf16"), ("bshd_bshd_bshd", "bshd"),
          ("diagonal_alignment_TOP_LEFT", "TL"), ("diagonal_alignment_BOTTOM_RIGHT", "BR"),
          ("multi_head", "mha"), ("group_query", "gqa"), ("multi_query", "mqa"), ("left_bound", "lb"),
          ("right_bound", "rb"), ("dropout", "drop"), ("padding", "pad")]


def short_id(case: str) -> str:
    for a, b in _SHORT:
        case = case.replace(a, b)
    return case


def _first_lines(text: str, n: int = 6) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    # pytest's short traceback: the "E   ..." lines say what failed; fall back to the last lines
    err = [ln for ln in lines if ln.lstrip().startswith("E ")]
    pick = err[:n] if err else lines[-n:]
    return "\n".join("      " + ln.strip()[:200] for ln in pick)


def report(ids, results, sides, meta, out_dir=None) -> str:
    """The table (Markdown), the totals and the disagreements."""
    lines = []
    add = lines.append
    add(f"# cuDNN frontend's SDPA tests: cuDNN vs fusedattn ({meta})")
    add("")
    for side in sides:
        s = results.get(side, {}).get("_session")
        if s:
            add(f"- {side}: cudnn = {s.get('cudnn_file')} (backend {s.get('backend_version')}), "
                f"torch {s.get('torch')}, {s.get('device', 'no GPU')}"
                + (f"; {s['cudnn_error']}" if s.get("cudnn_error") else ""))
        elif side in results:
            add(f"- {side}: no session record (pytest did not start)")
        else:
            add(f"- {side}: not run ({meta_reason(side, results)})")
    add("")
    add("| case | cuDNN | fusedattn |")
    add("|---|---|---|")
    for i in ids:
        a = results.get("cudnn", {}).get(i, {}).get("outcome", "n/a")
        b = results.get("fusedattn", {}).get(i, {}).get("outcome", "n/a")
        add(f"| {short_id(i)} | {a} | {b} |")
    add("")
    add("totals:")
    for side in ("cudnn", "fusedattn"):
        c = Counter(results.get(side, {}).get(i, {}).get("outcome", "n/a") for i in ids)
        add(f"  {side:9s} " + ", ".join(f"{c[o]} {o}" for o in OUTCOMES + ("n/a",) if c[o]))
    both = [i for i in ids if all(results.get(s, {}).get(i, {}).get("outcome", "n/a") not in ("n/a", "not run")
                                  for s in ("cudnn", "fusedattn"))]
    diff = [i for i in both if results["cudnn"][i]["outcome"] != results["fusedattn"][i]["outcome"]]
    add(f"  both ran: {len(both)}; agree: {len(both) - len(diff)}; disagree: {len(diff)}")
    fa_fail = [i for i in ids if results.get("fusedattn", {}).get(i, {}).get("outcome") in ("FAIL", "error", "crash", "timeout")]
    if not results.get("cudnn") and fa_fail:
        add(f"  (no cuDNN side: fusedattn's own failures: {len(fa_fail)})")
    add("")
    listed = diff if results.get("cudnn") else fa_fail
    if listed:
        add("disagreements:" if results.get("cudnn") else "fusedattn failures:")
        for i in listed:
            add(f"- {i}")
            for side in ("cudnn", "fusedattn"):
                r = results.get(side, {}).get(i)
                if not r:
                    continue
                add(f"    {side}: {r['outcome']}" + (f"  [{r['repro']}]" if r.get("repro") else ""))
                if r["outcome"] in ("FAIL", "error", "crash", "timeout"):
                    add(_first_lines(r.get("detail", "")))
                elif r["outcome"] in ("unsupported", "skip"):
                    add("      " + (r.get("detail") or "")[:300])
    text = "\n".join(lines)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "cudnn_fe_table.md").write_text(text + "\n")
        (out_dir / "cudnn_fe_results.json").write_text(json.dumps({"ids": ids, "results": results, "meta": meta},
                                                                   indent=1, default=str))
    return text


def meta_reason(side, results):
    return results.get("_why", {}).get(side, "not asked for")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--sample", type=int, default=40, help="cases to draw (default 40)")
    ap.add_argument("--seed", type=int, default=24, help="sampling and per-case random seed (default 24)")
    ap.add_argument("--tests-dir", type=Path, default=DEFAULT_TESTS_DIR)
    ap.add_argument("--files", nargs="*", default=None, help=f"test files (default: {' '.join(TEST_FILES)})")
    ap.add_argument("--sampling", choices=("stratified", "uniform"), default="stratified")
    ap.add_argument("--keep-static-skips", action="store_true",
                    help="also draw cases test_mhas.py skips before touching cuDNN (see is_static_skip)")
    ap.add_argument("--ids-file", type=Path, help="run these case ids (one a line) instead of sampling")
    ap.add_argument("--sides", default="cudnn,fusedattn", help="which to run, in order (default cudnn,fusedattn)")
    ap.add_argument("--budget", type=float, default=540, help="seconds for both sides together (default 540)")
    ap.add_argument("--cudnn-share", type=float, default=0.35,
                    help="the most of the budget the cuDNN side may take (default 0.35; it is the faster one)")
    ap.add_argument("--workers", type=int, default=0, help="pytest-xdist workers per side (0: one process)")
    ap.add_argument("--out", type=Path, default=None, help="write cudnn_fe_table.md and cudnn_fe_results.json here")
    ap.add_argument("--dry-run", action="store_true", help="collect, sample, check the files and the API; run nothing")
    ap.add_argument("--check-files", action="store_true", help="only compare the fetched files with MANIFEST")
    ap.add_argument("--cpu-emulate", action="store_true",
                    help="no GPU: run the fusedattn side on the CPU, their 'cuda' tensors mapped to the CPU "
                         "(a preview of fusedattn's outcomes; the cuDNN side needs the GPU)")
    args = ap.parse_args(argv)

    t_start = time.time()
    tests_dir = args.tests_dir.resolve()
    problems = check_files(tests_dir)
    if args.check_files:
        for name in MANIFEST:
            bad = [p for p in problems if p.startswith(name + ":")]
            print(f"{name}: {'OK' if not bad else bad[0]}")
        return 1 if problems else 0
    if problems:
        print("[cfe] fetched files differ from MANIFEST (results may not compare with earlier runs):",
              *problems, sep="\n  ")
        if not all((tests_dir / n).exists() for n in ("conftest.py", "test_utils.py")):
            return 2
    (tests_dir / "pytest.ini").write_text(PYTEST_INI)
    work = (args.out or Path("/tmp") / "cfe-work").resolve()
    work.mkdir(parents=True, exist_ok=True)
    files = args.files or [f for f in TEST_FILES if (tests_dir / f).exists()]
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if not files:
        print(f"[cfe] no test files in {tests_dir}: fetch them first (this file's docstring says how)")
        return 2
    if args.workers and importlib.util.find_spec("xdist") is None:
        log(f"[cfe] pytest-xdist is not installed: one process per side instead of {args.workers} workers")
        args.workers = 0

    cuda = _has_cuda()
    rows = collect(tests_dir, files, "fusedattn", args.seed, work, use_conftest=cuda)
    by_func = Counter(f"{r['file']}::{r['func']}" for r in rows)
    log(f"[cfe] collected {len(rows)} cases with fusedattn as cudnn"
        f"{'' if cuda else ' (no CUDA here: without their conftest)'}: "
        + ", ".join(f"{k} {v}" for k, v in by_func.items()))
    static = [r for r in rows if is_static_skip(r)]
    pool = rows if args.keep_static_skips else [r for r in rows if not is_static_skip(r)]
    if args.ids_file:
        ids = [ln.strip() for ln in args.ids_file.read_text().splitlines() if ln.strip()]
    else:
        ids = sample(pool, args.sample, args.seed, args.sampling)
    meta = (f"seed {args.seed}, {len(ids)} of {len(pool)} cases, {args.sampling} sampling"
            + ("" if args.keep_static_skips else f"; {len(static)} static-skip cases left out"))
    log(f"[cfe] {meta}")
    (work / "cudnn_fe_sample.txt").write_text("\n".join(ids) + "\n")

    missing = api_check(tests_dir, list(MANIFEST))
    log("[cfe] cudnn.* names their files use that fusedattn lacks: " + (", ".join(missing) if missing else "none"))

    results = {"_why": {}}
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if args.dry_run:
        for s in sides:
            results["_why"][s] = "dry run"
    else:
        for idx, side in enumerate(sides):
            if side == "cudnn":
                ok, msg = real_cudnn_available()
                if not ok:
                    results["_why"]["cudnn"] = f"import cudnn failed here: {msg[:200]}"
                    log(f"[cfe] cuDNN side skipped: {results['_why']['cudnn']}")
                    continue
                log(f"[cfe] real cuDNN frontend: {msg}")
            if args.cpu_emulate and side != "cudnn":
                results[side] = run_side(side, ids, tests_dir, args.seed, args.budget - (time.time() - t_start),
                                         args.workers, work, log, emulate=True)
                continue
            if not cuda:
                results["_why"][side] = "no CUDA device (their tests allocate on cuda)"
                log(f"[cfe] {side} side skipped: no CUDA device")
                continue
            left = args.budget - (time.time() - t_start)
            last = idx == len(sides) - 1
            share = left if last else left * (args.cudnn_share if side == "cudnn" else 0.5)
            results[side] = run_side(side, ids, tests_dir, args.seed, share, args.workers, work, log)
    text = report(ids, results, sides, meta, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
