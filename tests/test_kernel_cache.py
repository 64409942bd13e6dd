"""The on-disk kernel cache (fusedattn/backends/kernel_cache.py), with real compiles and real processes.

Each child process compiles the self-check's probe kernel for sm_90 with Triton's compiler (no GPU
needed: Triton ships ptxas) into a cache folder the test owns, with fusedattn's checked cache manager
installed, and prints the digest of the cubin it got back.
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import hashlib, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fusedattn.backends import kernel_cache, selfcheck
kernel_cache.install()
sig = {"out": "*fp32", "x": "*fp32", "n": "i32", "big": "i64", "scale": "fp32", "flag": "i1",
       "one": "constexpr", "nothing": "constexpr", "BLOCK": "constexpr"}
src = ASTSource(fn=selfcheck._probe, signature=sig, constexprs={"one": 1, "nothing": None, "BLOCK": 64})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print("CUBIN", hashlib.sha256(kernel.asm["cubin"]).hexdigest(), flush=True)
"""


def _env(cache: Path, manager: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_MANAGER")}
    env["TRITON_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    if manager:
        env["TRITON_CACHE_MANAGER"] = manager
    return env


def _start(cache: Path, manager: str = "") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD], env=_env(cache, manager), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _cubin_digest(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return next(line.split()[1] for line in out.splitlines() if line.startswith("CUBIN "))


def _cached_cubins(cache: Path):
    return sorted(cache.rglob("*.cubin"))


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """Two processes compiling the same kernel into one empty cache at the same time."""
    cache = tmp_path_factory.mktemp("triton-cache")
    procs = [_start(cache), _start(cache)]
    digests = [_cubin_digest(p) for p in procs]
    return cache, digests


def test_processes_sharing_the_cache_get_the_same_valid_entry(shared_cache):
    cache, digests = shared_cache
    assert digests[0] == digests[1]
    cubins = _cached_cubins(cache)
    assert len(cubins) == 1, cubins                  # one key, one entry: the second write replaced the first
    assert hashlib.sha256(cubins[0].read_bytes()).hexdigest() == digests[0]
    assert not list(cache.rglob("tmp.pid_*")), "a temporary file was left behind"
    group = json.loads(next(cubins[0].parent.glob("__grp__*.json")).read_text())
    for name, path in group["child_paths"].items():   # every file listed with the digest it has on disk
        assert group["fusedattn_sha256"][name] == hashlib.sha256(Path(path).read_bytes()).hexdigest(), name
    assert _cubin_digest(_start(cache)) == digests[0]  # a third process reads the entry back


def test_a_corrupted_entry_is_compiled_again_not_run(shared_cache, tmp_path):
    _, digests = shared_cache
    cache = tmp_path / "cache"                      # a cache of its own (groups hold absolute paths)
    assert _cubin_digest(_start(cache)) == digests[0]
    cubin = _cached_cubins(cache)[0]
    good = cubin.read_bytes()
    broken = good[: len(good) // 2]                 # cut short, as a crash or a full disk would leave it
    cubin.write_bytes(broken)
    # plain Triton serves the broken file (so this test can fail); a manager the user chose is respected
    served = _cubin_digest(_start(cache, "triton.runtime.cache:FileCacheManager"))
    assert served == hashlib.sha256(broken).hexdigest()
    # fusedattn's manager sees the digest differ, compiles again and rewrites the entry
    assert _cubin_digest(_start(cache)) == digests[0]
    assert cubin.read_bytes() == good
