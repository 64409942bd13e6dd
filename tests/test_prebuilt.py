"""Shipped compiled kernels (fusedattn/backends/prebuilt.py): keys, recording, the store's checks, and on a
GPU the launch through the CUDA driver against Triton's own launch.

Without a GPU, a child process (no interpreter: real ``@triton.jit`` kernels) compiles the launch
self-check's two probe kernels for sm_90 with Triton's compiler, records them into a store the test owns as
``fusedattn warmup --record`` does, and reports the keys and entries; the test then reads the store back.
"""
import ast
import json
import lzma
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent

CHILD = r"""
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fusedattn.backends import prebuilt, selfcheck
from fusedattn.backends.gluon.launch import Tma

out = {}
root = sys.argv[1]
prebuilt.start_recording(root, 90)
target = GPUTarget("cuda", 90, 32)

# the Triton probe: a pointer, i32, i64, fp32, bool, an int == 1 (a constant), None, a constexpr
kernel = selfcheck._probe
x = torch.zeros(64)
args = (x, x, 37, 2 ** 33 + 5, 1.5, True, 1, None)
kwargs = {"BLOCK": 64, "num_warps": 4}
sig = {"out": "*fp32", "x": "*fp32", "n": "i32", "big": "i64", "scale": "fp32", "flag": "i1",
       "one": "constexpr", "nothing": "constexpr", "BLOCK": "constexpr"}
compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs={"one": 1, "nothing": None, "BLOCK": 64}),
                          target=target, options=dict(num_warps=4, enable_fp_fusion=True))
prebuilt.record(kernel, args, kwargs, compiled)
out["probe_key"] = prebuilt.launch_key(kernel, args, kwargs, 90)

def key(*a, **kw):
    return prebuilt.launch_key(kernel, a, {**kwargs, **kw}, 90)
base = args
out["keys"] = {
    "same": key(*base),
    "n=53 (same class)": key(x, x, 53, *base[3:]),
    "n=48 (divisible by 16)": key(x, x, 48, *base[3:]),
    "n=1 (a constant)": key(x, x, 1, *base[3:]),
    "n=2**31 (64-bit)": key(x, x, 2 ** 31, *base[3:]),
    "x misaligned": key(x, x[1:], *base[2:]),
    "x float16": key(x, x.half(), *base[2:]),
    "flag False": key(*base[:5], False, *base[6:]),
    "nothing set": key(*base[:7], x),
    "BLOCK=128": key(*base, BLOCK=128),
    "num_warps=8": key(*base, num_warps=8),
    "arch 100": prebuilt.launch_key(kernel, base, kwargs, 100),
}

# the Gluon probe: TMA descriptors in and out
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
tma_kernel = selfcheck._gluon_probe()
rows, cols = 16, 64
layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float16)
src = torch.zeros(3 * rows, cols, dtype=torch.float16)
dst = torch.zeros(rows, cols, dtype=torch.float16)
descs = [Tma(t, tuple(t.shape), tuple(t.stride()), (rows, cols), layout) for t in (src, dst)]
targs = (descs[0], descs[1], 16, 2.0, rows, cols)
tsig = {"src": f"tensordesc<fp16[{rows}, {cols}],{layout!r}>", "dst": f"tensordesc<fp16[{rows}, {cols}],{layout!r}>",
        "row": "i32", "scale": "fp32", "ROWS": "constexpr", "COLS": "constexpr"}
tcompiled = triton.compile(GluonASTSource(fn=tma_kernel, signature=tsig, constexprs={"ROWS": rows, "COLS": cols}),
                           target=target, options=dict(num_warps=4, enable_fp_fusion=True))
prebuilt.record(tma_kernel, targs, {"num_warps": 4}, tcompiled)
out["tma_key"] = prebuilt.launch_key(tma_kernel, targs, {"num_warps": 4}, 90)
# a Gluon TensorDescriptor (the JIT's form of a Tma) keys the same
out["tma_key_descriptor"] = prebuilt.launch_key(tma_kernel, tuple(d.descriptor() for d in descs) + targs[2:],
                                                {"num_warps": 4}, 90)
out["store"] = prebuilt._recording["dir"]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("prebuilt")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(root / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", CHILD, str(root / "stores")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _index(recorded) -> dict:
    with open(os.path.join(recorded["store"], "index.json")) as f:
        return json.load(f)


def test_keys_follow_the_jit_specialization(recorded):
    """Equal keys only where Triton's JIT would reuse the kernel: an int's class (== 1, divisible by 16,
    64-bit), a tensor's dtype and alignment, each constexpr and launch option, and the architecture."""
    keys = recorded["keys"]
    assert keys["same"] == recorded["probe_key"]
    assert keys["n=53 (same class)"] == keys["same"]
    for name in ("n=48 (divisible by 16)", "n=1 (a constant)", "n=2**31 (64-bit)", "x misaligned", "x float16",
                 "flag False", "nothing set", "BLOCK=128", "num_warps=8", "arch 100"):
        assert keys[name] != keys["same"], name
    assert recorded["tma_key"] == recorded["tma_key_descriptor"]


def test_recorded_entries_describe_the_compiled_signature(recorded):
    index = _index(recorded)
    import triton
    assert index["triton"] == triton.__version__ and index["arch"] == 90 and index["format"] == 1
    probe = index["kernels"][recorded["probe_key"]]
    # n is 37: i32; big is past 2^32: i64; one (== 1) and None are constants the JIT folds in
    assert probe["params"] == ["ptr", "ptr", "i32", "i64", "fp32", "i1", "constexpr", "constexpr", "constexpr"]
    assert probe["name"] == "_probe" and probe["num_warps"] == 4 and probe["descriptors"] == []
    tma = index["kernels"][recorded["tma_key"]]
    assert tma["params"] == ["desc", "desc", "i32", "fp32", "constexpr", "constexpr"]
    assert [d["block_size"] for d in tma["descriptors"]] == [[16, 64], [16, 64]]
    assert all(d["host_dtype"] == 6 and d["elem_size"] == 2 for d in tma["descriptors"])   # CU_..._FLOAT16
    for key, entry in index["kernels"].items():
        with open(os.path.join(recorded["store"], f"{key}.cubin.xz"), "rb") as f:
            import hashlib
            assert hashlib.sha256(lzma.decompress(f.read())).hexdigest() == entry["sha256"]


def test_parameter_layout_matches_the_launcher(recorded):
    """Each parameter at its natural alignment, a CUtensorMap at 64 followed by the descriptor's shape
    (i32) and strides (i64), then Triton's two scratch pointers."""
    import struct

    from fusedattn.backends import prebuilt
    store = prebuilt.Store(recorded["store"])
    probe = store.kernel(recorded["probe_key"])
    assert probe.format == "<QQi4xqfb3xQQ"     # i64 at 24 after the i32 at 16
    tma = store.kernel(recorded["tma_key"])
    offsets = [p - (tma.param_ptrs[0]) for p in tma.param_ptrs]
    # desc 0 at 0 (128 B), 2 i32 at 128, 132, 2 i64 at 136, 144; desc 1 at 192; ...; row, scale, 2 scratch
    assert offsets == [0, 128, 132, 136, 144, 192, 320, 324, 328, 336, 344, 348, 352, 360]
    assert struct.calcsize(tma.format) == 368
    assert tma.param_ptrs[0] % 64 == 0         # the CUtensorMaps' 64-byte alignment, in memory


def test_damaged_or_foreign_store_is_never_loaded(recorded, tmp_path):
    import shutil

    from fusedattn.backends import prebuilt
    copy = tmp_path / "store"
    shutil.copytree(recorded["store"], copy)
    key = recorded["probe_key"]
    blob = lzma.decompress((copy / f"{key}.cubin.xz").read_bytes())
    (copy / f"{key}.cubin.xz").write_bytes(lzma.compress(blob[:-100] + b"\0" * 100))   # same size, other bytes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert prebuilt.Store(str(copy)).kernel(key) is None
    assert any("damaged" in str(w.message) for w in caught)
    (copy / f"{key}.cubin.xz").write_bytes(b"not xz")
    assert prebuilt.Store(str(copy)).kernel(key) is None
    # another Triton's store: no entries at all
    index = json.loads((copy / "index.json").read_text())
    index["triton"] = "0.0.1"
    (copy / "index.json").write_text(json.dumps(index))
    assert prebuilt.Store(str(copy)).entries == {}


def test_switched_off_finds_nothing(monkeypatch):
    from fusedattn.backends import prebuilt
    monkeypatch.setenv("FUSEDATTN_PREBUILT", "0")
    assert prebuilt.find(object(), (), {}, 0) is None


# --------------------------------------------------------------------------------------------------
# GPU: a recorded store launched through the driver, against the JIT
# --------------------------------------------------------------------------------------------------

GPU_CHILD = r"""
import os, sys, torch
import fusedattn
from fusedattn.backends import prebuilt
mode, path = sys.argv[1], sys.argv[2]
if mode == "record":
    prebuilt.start_recording(os.environ["FUSEDATTN_PREBUILT_DIR"], prebuilt.device_arch(0))
# inputs from a CPU generator: the JIT-launching process also runs the launch self-check, whose probe
# draws from the CUDA generator, so CUDA draws would give the two processes other inputs
gen = torch.Generator().manual_seed(0)
randn = lambda *shape, dtype: torch.randn(*shape, generator=gen).to("cuda", dtype)
results = {}
for name, (b, h, hk, s, d, causal, dtype) in {
        "gluon d128 causal": (2, 4, 4, 384, 128, True, torch.bfloat16),
        "gqa d64 fp16": (2, 8, 2, 200, 64, False, torch.float16),
        "d96 triton": (1, 3, 3, 130, 96, True, torch.bfloat16)}.items():
    q = randn(b, h, s, d, dtype=dtype).requires_grad_()
    k = randn(b, hk, s, d, dtype=dtype).requires_grad_()
    v = randn(b, hk, s, d, dtype=dtype).requires_grad_()
    print(f"fusedattn prebuilt: --- case {name}", file=sys.stderr, flush=True)
    for rep in range(2):        # the second call takes the repeat (cached) path
        # deterministic: the bitwise comparison below needs it (the single-pass backward, d64 here, reduces
        # dQ with adds in any order)
        o = fusedattn.attention(q, k, v, causal=causal, deterministic=True)
        o.backward(torch.ones_like(o))
        results[f"{name} {rep}"] = [o.detach(), q.grad, k.grad, v.grad]
        q.grad = k.grad = v.grad = None
kc = randn(2, 4, 1024, 128, dtype=torch.bfloat16)
vc = randn(2, 4, 1024, 128, dtype=torch.bfloat16)
qd = randn(2, 16, 1, 128, dtype=torch.bfloat16)
lens = torch.tensor([700, 1000], device="cuda", dtype=torch.int32)
results["decode"] = [fusedattn.attention_with_kvcache(qd, kc, vc, seq_len_kv=lens) for _ in range(2)]
torch.cuda.synchronize()
torch.save({k: [t.cpu() for t in v] for k, v in results.items()}, path)
print("STATS", prebuilt.stats["hits"], prebuilt.stats["loads"])
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")
def test_prebuilt_launch_equals_jit_launch(tmp_path):
    """A store recorded in one process, used by another with an empty Triton cache: every output and
    gradient bitwise equal to the JIT's, with store hits and no compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FUSEDATTN_PREBUILT_DIR"] = str(tmp_path / "stores")
    env["FUSEDATTN_PREBUILT_DEBUG"] = "1"       # each hit and miss on stderr: shown with a failure
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    runs = {}
    for mode in ("record", "use"):
        env["TRITON_CACHE_DIR"] = str(tmp_path / f"cache-{mode}")
        r = subprocess.run([sys.executable, "-c", GPU_CHILD, mode, str(tmp_path / f"{mode}.pt")], env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        log = "\n".join(line for line in r.stderr.splitlines() if "prebuilt:" in line)
        runs[mode] = [int(x) for x in next(line for line in r.stdout.splitlines()
                                           if line.startswith("STATS")).split()[1:]]
    assert runs["record"] == [0, 0]
    hits, loads = runs["use"]
    assert hits > 0 and loads > 0, runs
    want, got = torch.load(tmp_path / "record.pt"), torch.load(tmp_path / "use.pt")
    assert want.keys() == got.keys()
    differ = [f"{name}: tensor {i} differs (max {(a.float() - b.float()).abs().max():.3g})"
              for name in want for i, (a, b) in enumerate(zip(want[name], got[name])) if not torch.equal(a, b)]
    assert not differ, "\n".join(differ) + "\n" + log
    # the use run compiled nothing: its Triton cache holds no kernel
    compiled = [p.name for p in (tmp_path / "cache-use").rglob("*.cubin")]
    assert compiled == [], f"{compiled}\n{log}"


SHIPPED_CHILD = r"""
import torch
from fusedattn import warmup
from fusedattn.backends import prebuilt
# two anchors (each: the inference forward, no stats written, then forward with stats and backward) and the
# cold-start call, as warmup makes them
names = ("anchors:b8-h12-s1024-d64-fp16-causal", "anchors:b4-h32-s2048-d128-bf16-causal", "first-call")
todo = [call for name, call in warmup.calls(("anchors",)) if name in names]
assert len(todo) == len(names), [name for name, _ in warmup.calls(("anchors",))]
for call in todo:
    call()
torch.cuda.synchronize()
print("STATS", prebuilt.stats["hits"], len(prebuilt.stats["misses"]), ",".join(prebuilt.stats["misses"]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")
def test_shipped_store_serves_first_calls(tmp_path):
    """The store shipped for this Triton (``fusedattn warmup --record`` on a GPU, or ``tools/store_rebuild.py``)
    serves the first calls of a fresh process with an empty Triton cache: two anchors' inference forwards
    (under no_grad) and training forward + backward, and ``bench --cold-start``'s call, with no kernel compiled
    (a miss would stall the call for seconds). tools/store_gpu_check.py runs every warmup call this way."""
    from fusedattn.backends import prebuilt
    major, minor = torch.cuda.get_device_capability()
    name = prebuilt.store_name(major * 10 + minor)
    if name not in [p.name for p in STORES]:
        pytest.skip(f"no shipped store {name} (this Triton on this GPU)")
    dropped = ("TRITON_INTERPRET", "FUSEDATTN_PREBUILT", "FUSEDATTN_PREBUILT_DIR")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["FUSEDATTN_PREBUILT_DEBUG"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", SHIPPED_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    misses_log = "\n".join(line for line in r.stderr.splitlines() if "prebuilt: miss" in line)
    _, hits, misses, names = (next(line for line in r.stdout.splitlines() if line.startswith("STATS")).split(" ")
                              + [""])[:4]
    assert int(misses) == 0, f"kernels compiled instead of loaded from the store: {names}\n{misses_log}"
    assert int(hits) > 0
    assert [p.name for p in (tmp_path / "cache").rglob("*.cubin")] == [], misses_log


def test_kernel_identity_is_the_same_in_every_process(tmp_path):
    """A store entry must be found by every later process: the kernels' identity (module, name, source
    digest) printed by three processes with different hash seeds is one string, and it changes when a
    kernel source file changes."""
    code = ("from fusedattn.backends import prebuilt; from fusedattn.backends.triton import fwd; "
            "from fusedattn.backends.gluon import bwd_dq_sm90 as dq; "
            "print(prebuilt._kernel_id(fwd._FWD.kernel), prebuilt._kernel_id(dq._attn_bwd_dq_sm90))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    seen = set()
    for seed in ("1", "2", "3"):
        r = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONHASHSEED=seed), capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        seen.add(r.stdout.strip())
    assert len(seen) == 1, seen
    fwd_id = seen.pop().split()[0]
    assert fwd_id.startswith("fusedattn.backends.triton.fwd._attn_fwd:")
    # one kernel file changed: another digest
    import shutil

    from fusedattn.backends import prebuilt
    copy = tmp_path / "backends"
    shutil.copytree(ROOT / "fusedattn" / "backends", copy)
    saved = list(prebuilt._source_digest)
    try:
        prebuilt._source_digest.clear()
        prebuilt._BACKENDS, original = str(copy), prebuilt._BACKENDS
        same = prebuilt.kernel_sources_digest()
        with open(copy / "triton" / "fwd.py", "a") as f:
            f.write("\n# changed\n")
        prebuilt._source_digest.clear()
        changed = prebuilt.kernel_sources_digest()
    finally:
        prebuilt._BACKENDS = original
        prebuilt._source_digest[:] = saved
    assert fwd_id.endswith(same) and changed != same


STORES = sorted((ROOT / "fusedattn" / "prebuilt").glob("triton-*-sm*")) if (ROOT / "fusedattn" / "prebuilt").is_dir() else []


@pytest.mark.parametrize("store", STORES, ids=[p.name for p in STORES])
def test_shipped_store_is_intact_and_current(store):
    """Each store shipped in fusedattn/prebuilt: every cubin there and matching its checksum, every entry's
    parameter layout buildable, and its kernels built from the kernel sources in this tree (a store left
    behind by a kernel change would never hit: rebuild it on a GPU with ``bash bench/run_device.sh
    prebuilt`` under that Triton, or delete it)."""
    import hashlib

    from fusedattn.backends import prebuilt
    index = json.loads((store / "index.json").read_text())
    version = store.name.split("-")[1]
    assert index["format"] == prebuilt.FORMAT and index["triton"] == version and index["kernels"]
    assert index.get("skipped") == [], index.get("skipped")
    for key, entry in index["kernels"].items():
        cubin = lzma.decompress((store / f"{key}.cubin.xz").read_bytes())
        assert hashlib.sha256(cubin).hexdigest() == entry["sha256"], entry["name"]
        assert len(entry["descriptors"]) == entry["params"].count("desc"), entry["name"]
        prebuilt.PrebuiltKernel(entry, cubin)           # the layout builds
    stale = {e["kernel"] for e in index["kernels"].values()
             if e["kernel"].rpartition(":")[2] != prebuilt.kernel_sources_digest()}
    assert not stale, (f"{store.name} was built from other kernel sources than this tree's: rebuild it "
                       f"(bash bench/run_device.sh prebuilt on a GPU, or python tools/store_rebuild.py without one, "
                       f"Triton {version}) or delete it. {sorted(stale)[:3]}")
    # the cold-start call's kernels are there (bench --cold-start loaded 3 on the H100, Triton 3.6)
    names = {e["name"] for e in index["kernels"].values()}
    assert {"_attn_fwd_sm90", "_attn_bwd_dq_sm90", "_attn_bwd_dkdv_sm90", "_decode_fwd"} <= names
    # the fused backward's SEGMENTS as this store's Triton chooses it for warmup's GQA anchor: a store built from
    # another release's recording keeps that release's choice (tools/store_rebuild.py)
    from fusedattn.backends.compat import TRITON_VERSION, _version
    from fusedattn.backends.gluon import bwd_fused_sm90

    def segments_on(release):      # bwd_fused_sm90.SEGMENTS's rule, checked against it for this Triton below
        return release >= (3, 9)

    assert bwd_fused_sm90.SEGMENTS == segments_on(TRITON_VERSION)
    at = [p.name for p in bwd_fused_sm90._attn_bwd_fused_sm90.params].index("SEGMENTS")
    segments = {ast.literal_eval(e["specs"])[at] for e in index["kernels"].values()
                if e["name"] == "_attn_bwd_fused_sm90"}
    want = "True" if segments_on(_version(version)) else "False"
    assert want in segments and segments <= {want, "False"}, (
        f"{store.name}: the fused backward's SEGMENTS values {sorted(segments)}, Triton {version} launches "
        f"the GQA anchor with {want}: record this store on a GPU or build it from a recording of a release "
        f"that chooses the same")


class _FakeDescriptor:
    """What ``values()`` reads of a launch's TMA descriptor (``backends.gluon.launch.Tma``)."""

    def __init__(self, base, rank, padding):
        self.base, self.padding = base, padding
        self.shape = tuple(3 + i for i in range(rank))
        self.strides = tuple(7 * (rank - i) for i in range(rank))


@pytest.mark.parametrize("store", STORES, ids=[p.name for p in STORES])
def test_generated_parameter_packing_equals_the_loop(store):
    """``PrebuiltKernel.packer`` (one generated list display per kernel and tail) gives the per-argument loop's
    values (``pack_loop``) for every shipped entry: pointers (None as 0), scalars, each descriptor as its
    encoded bytes (once per base / shape / strides / padding / slot) then its shape and strides, constexprs
    dropped, the tail's parameters included, then the two scratch zeros; an argument count the code was not
    generated for takes the loop."""
    from fusedattn.backends import prebuilt
    index = json.loads((store / "index.json").read_text())
    encoded = []

    def fake_encode(base, host_dtype, elem_size, swizzle, shape, strides, box, nan):
        encoded.append(1)
        return repr((base, host_dtype, elem_size, swizzle, list(shape), list(strides), list(box), nan)).encode()

    from fusedattn.backends import cuda_driver
    real = cuda_driver.encode_tiled
    cuda_driver.encode_tiled = fake_encode
    try:
        tensors = [torch.empty(8) for _ in range(3)]
        for n, (key, entry) in enumerate(index["kernels"].items()):
            kernel = prebuilt.PrebuiltKernel(entry, b"")
            args, slot = [], 0
            for i, kind in enumerate(kernel.params):
                if kind == "constexpr":
                    args.append(("constexpr", i))        # never read
                elif kind == "ptr":
                    args.append(None if (i + n) % 5 == 0 else tensors[i % 3])
                elif kind == "desc":
                    rank = len(kernel.descriptors[slot]["block_size"])
                    slot += 1
                    args.append(_FakeDescriptor(tensors[i % 3], rank, "nan" if i % 2 else "zero"))
                else:
                    args.append(1.25 * i if kind.startswith("fp") else 1000 + i)
            for cut in sorted({0, min(3, len(args))}):
                head, tail = args[:len(args) - cut], tuple(args[len(args) - cut:])
                blobs = {}

                def blob(a, s):
                    k = (a.base.data_ptr(), a.shape, a.strides, a.padding, s)
                    if k not in blobs:
                        meta = kernel.descriptors[s - 1]
                        blobs[k] = fake_encode(a.base.data_ptr(), meta["host_dtype"], meta["elem_size"],
                                               meta["swizzle"], a.shape, a.strides, meta["block_size"],
                                               a.padding == "nan")
                    return blobs[k]
                expected = kernel.pack_loop(tail, blob)(head)
                values = kernel.packer(tail)
                assert values(head) == expected, (store.name, entry["name"], cut)
                assert values(head) == expected            # the second call from the encoded descriptors
                # as many values as the parameter layout has slots
                assert len(expected) == len(kernel.param_ptrs), entry["name"]
                # an argument count the code was not generated for: the loop (zip stops at the signature). With
                # no tail, where the extra argument falls past the signature's end (with a tail it would shift
                # the tail onto other kinds of parameter: a descriptor's slot given an int, the FP8 backward's)
                if not tail:
                    assert values(head + [0]) == kernel.pack_loop(tail, blob)(head + [0])
        assert encoded, "no descriptor was encoded: the Gluon entries are missing"
    finally:
        cuda_driver.encode_tiled = real


@pytest.mark.skipif(not STORES, reason="no shipped store in this tree")
def test_a_tail_of_runtime_values_is_packed_with_the_arguments(monkeypatch):
    """Trailing parameters passed by keyword are a call site's constants (switches), bound once per tail; but
    the FP8 switches pass tensors and descriptors by keyword too (the fused backward's scales, amax, gradient
    buffers, transposed copies: new on every call). Such a tail is packed with the arguments by the one binding
    of the empty tail: before, each call bound (and compiled a packer for) its own tail, 0.6 ms a call on the
    H200, and ``_bound`` kept every call's tensors alive (bench/NOTES.md 72). Checked on every store's fused
    backward entry of the FP8 MMAs (descriptors among its last parameters) and on a tail of constexprs."""
    import gc
    import weakref

    from fusedattn.backends import prebuilt
    from fusedattn.backends.gluon import bwd_fused_sm90
    # the FP8 MMAs' transposed copies (QT_DESC, DOT_DESC, KT_DESC: the last descriptors; the dropout switch's
    # numbers come after them)
    kt = [p.name for p in bwd_fused_sm90._attn_bwd_fused_sm90.params].index("KT_DESC")
    for store in STORES:
        index = json.loads((store / "index.json").read_text())
        entries = [prebuilt.PrebuiltKernel(e, b"") for e in index["kernels"].values()]
        fp8 = [k for k in entries if k.name == "_attn_bwd_fused_sm90" and k.params[kt] == "desc"]
        assert fp8, f"{store.name}: no FP8-MMA backward entry (the warmup's fp8 group records one)"
        kernel = fp8[0]
        binds = []

        def bind(tail):
            binds.append(tail)
            return lambda gx, gy, gz, stream, args: calls.append(args)
        monkeypatch.setattr(kernel, "bind", bind)
        calls = []
        tails = [tuple(torch.empty(4) for _ in range(3)) for _ in range(4)]
        watched = weakref.ref(tails[0][0])
        for tail in tails:
            kernel.bound(tail)(1, 1, 1, 0, ("arg",))
        assert binds == [()], binds                       # one binding, of no tail
        assert len(calls) == len(tails)
        for args, tail in zip(calls, tails):
            assert args[0] == "arg" and all(a is t for a, t in zip(args[1:], tail)) and len(args) == 4
        del tails, calls[:]
        gc.collect()
        assert watched() is None, "a call's tail tensor is still referenced after the launch"
        # a tail of compile-time constants keeps its own binding, reused
        const = next(k for k in entries if k.params[-1] == "constexpr")
        binds_const = []
        monkeypatch.setattr(const, "bind", lambda tail: binds_const.append(tail) or (lambda *a: None))
        assert const.bound((64,)) is const.bound((64,)) and binds_const == [(64,)]


def test_a_kernel_the_driver_refuses_falls_back_to_the_jit(recorded, monkeypatch):
    """A cubin the driver will not load (an old driver, say) is not launched: ``_loads`` warns once and
    says no, and ``find`` then answers None (the JIT compiles the kernel, as without a store)."""
    from fusedattn.backends import cuda_driver, prebuilt
    store = prebuilt.Store(recorded["store"])
    shipped = store.kernel(recorded["probe_key"])

    def refuse(device):
        raise cuda_driver.CudaError("fusedattn: loading kernel _probe failed: CUDA error 222 (unsupported PTX)")
    monkeypatch.setattr(shipped, "function", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert prebuilt._loads(shipped, 0) is False
    assert any("could not be loaded" in str(w.message) and "_probe" in str(w.message) for w in caught)
