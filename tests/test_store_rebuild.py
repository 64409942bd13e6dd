"""tools/store_rebuild.py: a shipped store's kernels recompiled with no GPU are the kernels the GPU recorded.

The tool rebuilds a store after a kernel source change without device time (bench/NOTES.md 61). Its claim is
that the stand-in arguments it makes from an entry's recorded specialization drive Triton's own binder and
compiler to the JIT's build; this checks the claim on the shipped store of the Triton under test: the entries
of two kernels (a portable Triton kernel, and the Gluon dK/dV pass with its TMA descriptors) recompiled in a
child process (no interpreter: real compiles for sm_90) must have the recorded SASS. (Not every kernel: one
Gluon backward build in 58 can come out with another instruction schedule depending on what its process
compiled before, bench/NOTES.md 61; these two kernels gave the recorded SASS in every run, four Tritons.) Skipped, saying so, where this Triton has no shipped store
or its wheel has no cuobjdump.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).parent.parent
STORE = ROOT / "fusedattn" / "prebuilt" / f"triton-{triton.__version__}-sm90"
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not (STORE / "index.json").is_file(), reason=f"no shipped store for Triton {triton.__version__}")
@pytest.mark.skipif(not CUOBJDUMP.is_file(), reason="this Triton wheel ships no cuobjdump")
@pytest.mark.parametrize("name", ["_dq_convert", "_attn_bwd_dkdv_sm90"])
def test_recompiled_store_entries_have_the_recorded_sass(name, tmp_path):
    index = json.loads((STORE / "index.json").read_text())
    if not any(e["name"] == name for e in index["kernels"].values()):
        pytest.skip(f"the {triton.__version__} store has no {name} entry")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "store_rebuild.py"), "--check", "--only", name,
                          str(STORE)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "have the recorded SASS" in run.stdout and "DIFFERENT" not in run.stdout, run.stdout


def test_a_switch_added_since_the_recording_takes_its_default():
    """A compile-time parameter a kernel gains after the recording (a new switch with a default, after the
    recorded parameters) must not drop the recorded launches: they ran without it, so they rebuild with its
    default, under specs that name it as the JIT's lookup will (session 27: the FP8 backward's FP8_MMA16
    dropped all eight backward entries of every store until the tool filled defaults)."""
    import inspect
    from types import SimpleNamespace
    sys.path.insert(0, str(ROOT / "tools"))
    import store_rebuild

    def param(name, constexpr, default=inspect.Parameter.empty):
        return SimpleNamespace(name=name, is_constexpr=constexpr, default=default)

    kernel = SimpleNamespace(params=[param("X", False), param("BLOCK", True), param("NEW_SWITCH", True, False)])
    recorded = (("i", True, False, True), "64", (("num_warps", "4"),))
    args, kwargs, specs = store_rebuild.launch_of(kernel, recorded)
    assert args == [1, 64, False] and kwargs == {"num_warps": 4}
    assert specs == (("i", True, False, True), "64", "False", (("num_warps", "4"),))
    # a recording without launch options, and a new parameter without a default: refused by name
    assert store_rebuild.launch_of(kernel, recorded[:2])[2] == (("i", True, False, True), "64", "False")
    kernel.params.append(param("NO_DEFAULT", True))
    with pytest.raises(ValueError, match="NO_DEFAULT"):
        store_rebuild.launch_of(kernel, recorded)


def test_a_runtime_argument_added_since_the_recording_takes_its_default():
    """A runtime parameter a kernel gains with a default (None or 0: an FP8 switch's pointers and strides, session
    31's bwd_fused_sm90) rebuilds the recorded launches with that default, under the specs the store's lookup
    computes for a launch that does not pass it (``prebuilt._specs``: the default's runtime spec)."""
    import inspect
    from types import SimpleNamespace
    sys.path.insert(0, str(ROOT / "tools"))
    import store_rebuild
    from fusedattn.backends import prebuilt

    def param(name, constexpr, default=inspect.Parameter.empty):
        return SimpleNamespace(name=name, is_constexpr=constexpr, default=default)

    kernel = SimpleNamespace(params=[param("X", False), param("PTR", False, None), param("STRIDE", False, 0),
                                     param("ON", True, False)])
    recorded = (("i", True, False, True), (("num_warps", "4"),))
    args, kwargs, specs = store_rebuild.launch_of(kernel, recorded)
    assert args == [1, None, 0, False] and kwargs == {"num_warps": 4}
    assert specs == (("i", True, False, True), ("none", ), ("i", False, True, True), "False", (("num_warps", "4"),))
    # the store's own key of a launch that passes only X (and the launch option) names the same specs

    class Lookup:            # hashable, as the store's per-kernel cache needs
        params = kernel.params

    want = (("i", False, False, True), ("none", ), ("i", False, True, True), "False")
    assert prebuilt._specs(Lookup, (7,), {"num_warps": 4})[:4] == want


def test_launches_from_several_stores_are_their_union(tmp_path):
    """``--launches-from A --launches-from B``: every launch of A, then B's that A lacks, each once; a launch is
    (kernel, specs), whatever the store's key or the sources' digest (session 33 built 3.9.0's store from a
    3.6.0 recording, for the new kernels, and 3.9.0's own earlier one, for its GQA SEGMENTS launch)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import store_rebuild

    def store(name, entries):
        folder = tmp_path / name
        folder.mkdir()
        kernels = {f"{name}{i}": dict(name=kernel.rsplit(".", 1)[1], kernel=f"{kernel}:{digest}", specs=specs,
                                      sha256="x") for i, (kernel, digest, specs) in enumerate(entries)}
        (folder / "index.json").write_text(json.dumps({"kernels": kernels}))
        return str(folder)

    a = store("a", [("m.fwd", "new", "('64',)"), ("m.bwd", "new", "('64',)")])
    b = store("b", [("m.fwd", "old", "('64',)"), ("m.bwd", "old", "('64', 'True')"), ("m.fwd", "old", "('64',)")])
    launches = store_rebuild.launches_of([a, b])
    got = sorted((e["kernel"], e["specs"]) for e in launches.values())
    assert got == [("m.bwd:new", "('64',)"), ("m.bwd:old", "('64', 'True')"), ("m.fwd:new", "('64',)")]
    assert all(set(e) == {"name", "kernel", "specs"} for e in launches.values())
    assert len(store_rebuild.launches_of([a])) == 2
