"""Kernels compiled ahead and shipped with fusedattn, so a process's first call does not compile (issue 23).

A first call with an empty Triton cache used to spend 7-13 s compiling (bench/NOTES.md 51). A store of
compiled kernels, built on a GPU machine by ``python -m fusedattn warmup --record DIR`` for the common
configurations, ships in ``fusedattn/prebuilt/triton-<version>-sm<arch>/``: ``index.json`` and one
xz-compressed cubin per kernel. On a launch that Triton has not compiled in this process, the launch layer
(``backends.triton.launch``) asks :func:`find` first; a hit is loaded and launched through the CUDA driver
(``backends.cuda_driver``), without Triton's compiler, its cache or the C modules it builds with the host's
compiler, so the first call pays a module load (milliseconds) instead of a compile. A miss goes to
Triton's JIT as before.

**What a store entry is keyed by** (:func:`launch_key`): the Triton release (exactly: ``3.9.0``), the GPU
architecture (compute capability), the kernel (module, name, and a hash of the kernels' source files,
:func:`kernel_sources_digest`), every compile-time constant's value, every launch option
(``num_warps``, ``num_stages``, fp fusion), and each runtime argument as Triton's JIT specializes on it
(a tensor's dtype and 16-byte alignment; an integer's == 1, divisibility by 16 and 32-bit range; a TMA
descriptor's dtype, box, layout and padding). Two launches with equal keys get the same compiled kernel
from the JIT, so a hit is the kernel the JIT would have built; a store built from other sources, another
Triton or another GPU generation is simply never hit. Each cubin's SHA-256 is in the index and checked
when it is read: a changed or truncated file is a miss (the JIT compiles), never loaded.

**How a hit launches**: the kernel's parameters are those of Triton's compiled signature (recorded with
the entry): constexprs dropped, each TMA descriptor expanded to its ``CUtensorMap`` and its shape and
strides, then Triton's two scratch pointers (null: entries needing scratch memory are not recorded).
Entries with clusters, cooperative launches or PDL are not recorded either. The GPU test records a store
from a few configurations (Gluon and portable forward and backward, split-KV decode) in one process and
runs them from it in another with an empty Triton cache: outputs and gradients bitwise equal, nothing
compiled (tests/test_prebuilt.py; H100, Triton 3.6). The shipped stores' cold-start call was measured
the same way (bench --cold-start, bench/NOTES.md 52).

``FUSEDATTN_PREBUILT=0`` turns the store off (every launch goes through the JIT).
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import struct
import sys
import threading
from typing import Optional

import torch
import triton

from . import compat

# where the stores ship; FUSEDATTN_PREBUILT_DIR points elsewhere (tests, a store built for this machine)
STORE_ROOT = os.environ.get("FUSEDATTN_PREBUILT_DIR") or os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "prebuilt")
FORMAT = 1
# launches found in a store, kernels loaded from one, and the kernels a store was asked for and did not
# have (their names; for bench --cold-start and tests)
stats = {"hits": 0, "loads": 0, "misses": []}

# Triton's compiled signature types -> (struct code, size) of the parameter's bytes
_SCALARS = {"i1": ("b", 1), "i8": ("b", 1), "u1": ("B", 1), "u8": ("B", 1), "i16": ("h", 2), "u16": ("H", 2),
            "i32": ("i", 4), "u32": ("I", 4), "i64": ("q", 8), "u64": ("Q", 8), "fp32": ("f", 4),
            "f32": ("f", 4)}
_INT32 = (-2 ** 31, 2 ** 31)
_UNSEEN = object()


def store_name(arch: int) -> str:
    return f"triton-{triton.__version__}-sm{arch}"


# --------------------------------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------------------------------

def _runtime_spec(a):
    """What Triton's JIT specializes on for a non-constexpr argument (finer is safe: fewer hits, never a
    wrong kernel); None for an argument kind the store does not handle."""
    kind = type(a)
    if kind is bool:
        return ("b", a)
    if kind is int:
        return ("i", a == 1, a % 16 == 0, _INT32[0] <= a < _INT32[1])
    if kind is float:
        return ("f", )
    if a is None:
        return ("none", )
    if isinstance(a, torch.Tensor):
        return ("t", str(a.dtype), a.data_ptr() % 16 == 0)
    if hasattr(a, "block_shape") and hasattr(a, "base") and hasattr(a, "layout"):  # Tma / Gluon TensorDescriptor
        return ("d", str(a.base.dtype), tuple(a.block_shape), repr(a.layout), a.padding, len(a.shape),
                bool(getattr(a, "round_f32_to_tf32", False)))
    return None


_BACKENDS = os.path.dirname(os.path.abspath(__file__))
_source_digest: list = []


def kernel_sources_digest() -> str:
    """SHA-256 of the kernels' source files: every module of ``backends/triton`` and ``backends/gluon``
    and ``backends/compat.py`` (what the kernels call and the builtins they use). Any change to them makes
    every store entry a miss until the store is rebuilt. Triton's own ``cache_key`` would be finer, but it
    was seen to differ between two processes on the same machine for one kernel (the Gluon dQ pass, on
    Triton 3.6), which made its entry never hit; a hash of bytes on disk cannot."""
    if not _source_digest:
        h = hashlib.sha256()
        files = [os.path.join(_BACKENDS, "compat.py")]
        for sub in ("triton", "gluon"):
            folder = os.path.join(_BACKENDS, sub)
            files += sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py"))
        for path in files:
            h.update(os.path.relpath(path, _BACKENDS).encode())
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        _source_digest.append(h.hexdigest())
    return _source_digest[0]


_kernel_ids: dict = {}


def _kernel_id(kernel) -> Optional[str]:
    """The kernel's module and name, and :func:`kernel_sources_digest` (once per process)."""
    ident = _kernel_ids.get(kernel)
    if ident is None:
        fn = getattr(kernel, "fn", None)
        if fn is None or not hasattr(kernel, "params"):
            return None
        ident = _kernel_ids[kernel] = f"{fn.__module__}.{fn.__qualname__}:{kernel_sources_digest()}"
    return ident


_param_info: dict = {}


def _specs(kernel, args: tuple, kwargs: dict) -> Optional[tuple]:
    """Per parameter: a constexpr's value (repr) or a runtime argument's :func:`_runtime_spec`; then the
    launch options. Hashable; None where some argument is of a kind the store does not handle."""
    info = _param_info.get(kernel)
    if info is None:
        info = _param_info[kernel] = tuple((p.name, p.is_constexpr, p.default) for p in kernel.params)
    n = len(args)
    parts = []
    for i, (name, is_constexpr, default) in enumerate(info):
        value = args[i] if i < n else kwargs.get(name, default)
        if is_constexpr:
            parts.append(repr(value))
        else:
            spec = _runtime_spec(value)
            if spec is None:
                return None
            parts.append(spec)
    if len(kwargs) > len(info) - n or compat.COMPILE_OPTIONS:
        names = {name for name, _, _ in info}
        parts.append(tuple(sorted((k, repr(v)) for k, v in {**kwargs, **compat.COMPILE_OPTIONS}.items()
                                  if k not in names)))
    return tuple(parts)


def launch_key(kernel, args: tuple, kwargs: dict, arch: int) -> Optional[str]:
    """The store key of ``kernel[grid](*args, **kwargs)`` on a GPU of compute capability ``arch`` (see the
    module docstring), or None where some argument is of a kind the store does not handle."""
    ident = _kernel_id(kernel)
    specs = _specs(kernel, args, kwargs) if ident is not None else None
    return None if specs is None else _hash_key(ident, specs, arch)


def _hash_key(ident: str, specs: tuple, arch: int) -> str:
    return hashlib.sha256(repr((FORMAT, triton.__version__, arch, ident, specs)).encode()).hexdigest()[:40]


# --------------------------------------------------------------------------------------------------
# the store on disk
# --------------------------------------------------------------------------------------------------

class Store:
    """One store directory: its index (key -> entry) and the cubins beside it."""

    def __init__(self, path: str):
        self.path = path
        with open(os.path.join(path, "index.json")) as f:
            index = json.load(f)
        ok = index.get("format") == FORMAT and index.get("triton") == triton.__version__
        self.entries: dict = index.get("kernels", {}) if ok else {}
        self.kernels = {entry.get("kernel") for entry in self.entries.values()}   # who has entries at all
        self.digests = {str(k).rpartition(":")[2] for k in self.kernels}
        self.loaded: dict = {}          # key -> PrebuiltKernel
        self.memo: dict = {}            # (kernel, specs) -> PrebuiltKernel or None (a miss)
        self.lock = threading.Lock()

    def kernel(self, key: str):
        """The entry's :class:`PrebuiltKernel`, or None (no entry, or its cubin fails its checksum)."""
        hit = self.loaded.get(key)
        if hit is not None or key not in self.entries:
            return hit
        with self.lock:
            if key in self.loaded:
                return self.loaded[key]
            entry = self.entries[key]
            try:
                with open(os.path.join(self.path, f"{key}.cubin.xz"), "rb") as f:
                    cubin = lzma.decompress(f.read())
            except (OSError, lzma.LZMAError):
                cubin = None
            if cubin is None or hashlib.sha256(cubin).hexdigest() != entry["sha256"]:
                compat.warn_once(f"prebuilt-{key}", f"prebuilt kernel {entry.get('name')} in {self.path} is "
                                                    "damaged (checksum): compiling it instead")
                self.entries.pop(key)
                return None
            hit = self.loaded[key] = PrebuiltKernel(entry, cubin)
            stats["loads"] += 1
            return hit


_stores: dict = {}          # arch -> Store or None
_stores_lock = threading.Lock()


def _enabled() -> bool:
    return os.environ.get("FUSEDATTN_PREBUILT", "1") != "0"


def store_for(arch: int, root: Optional[str] = None) -> Optional[Store]:
    """The store for this Triton and ``arch`` (None where none ships)."""
    root = root or STORE_ROOT
    key = (root, arch)
    if key not in _stores:
        with _stores_lock:
            if key not in _stores:
                path = os.path.join(root, store_name(arch))
                try:
                    _stores[key] = Store(path) if os.path.isfile(os.path.join(path, "index.json")) else None
                except (OSError, ValueError):
                    _stores[key] = None
    return _stores[key]


_arch_of: dict = {}


def device_arch(device: int) -> int:
    arch = _arch_of.get(device)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(device)
        arch = _arch_of[device] = major * 10 + minor
    return arch


def find(kernel, args: tuple, kwargs: dict, device: int):
    """The shipped compiled kernel for this launch on ``device``, or None (then the JIT compiles)."""
    if not _enabled() or _recording:
        return None
    arch = device_arch(device)
    store = store_for(arch)
    if store is None or not store.entries:
        return None
    ident = _kernel_id(kernel)
    if ident not in store.kernels:      # the common miss, without building a key
        if ident is not None and ident.rpartition(":")[2] not in store.digests:
            compat.warn_once("prebuilt-stale", f"the shipped kernels in {store.path} were built from other kernel "
                                               "sources: compiling instead (rebuild: bash bench/run_device.sh prebuilt)")
        _missed(kernel)
        return None
    specs = _specs(kernel, args, kwargs)
    if specs is None:
        return None
    memo = store.memo.get((kernel, specs), _UNSEEN)
    if memo is _UNSEEN:     # hashing the key costs more than a launch: once per specialization
        memo = store.memo[(kernel, specs)] = store.kernel(_hash_key(ident, specs, arch))
    if memo is not None and device not in memo.functions and not _loads(memo, device):
        memo = store.memo[(kernel, specs)] = None
    if memo is not None:
        stats["hits"] += 1
        if _DEBUG:
            print(f"fusedattn prebuilt: hit {memo.name} {specs!r}", file=sys.stderr, flush=True)
    else:
        _missed(kernel, specs)
    return memo


def _loads(shipped: "PrebuiltKernel", device: int) -> bool:
    """Load ``shipped`` onto ``device`` before its first launch. A driver without the calls we use, or one
    that refuses the cubin (too old for its PTX version, say), turns the store off for that kernel with one
    warning: the JIT compiles it instead, as without a store."""
    from .cuda_driver import CudaError
    try:
        shipped.function(device)
        return True
    except (CudaError, OSError, AttributeError) as exc:
        compat.warn_once(f"prebuilt-load-{shipped.name}", f"a shipped kernel ({shipped.name}) could not be loaded "
                                                          f"({exc}); compiling it instead")
        return False


_DEBUG = os.environ.get("FUSEDATTN_PREBUILT_DEBUG", "0") != "0"


def _missed(kernel, specs=None) -> None:
    name = getattr(getattr(kernel, "fn", None), "__name__", "?")
    if len(stats["misses"]) < 64:
        stats["misses"].append(name)
    if _DEBUG:
        print(f"fusedattn prebuilt: miss {name} {specs!r}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# launching an entry
# --------------------------------------------------------------------------------------------------

class PrebuiltKernel:
    """A compiled kernel of a store, launched through the CUDA driver (``backends.cuda_driver``)."""

    def __init__(self, entry: dict, cubin: bytes):
        self.name = entry["name"]
        self.num_warps = entry["num_warps"]
        self.shared = entry["shared"]
        self.params = entry["params"]       # per kernel parameter: "constexpr", a scalar type, "ptr", "desc"
        self.descriptors = entry["descriptors"]     # per "desc" parameter: swizzle, elem_size, host dtype, box
        self.cubin = cubin
        self.functions: dict = {}           # device -> CUfunction
        self._bound: dict = {}              # tail -> launch function (bind); () for tails of runtime values
        self._runtime_tails: dict = {}      # tail length -> whether it holds a runtime parameter
        self.lock = threading.Lock()
        self._layout()

    def _layout(self) -> None:
        """One struct format for every parameter's bytes, each at its natural alignment (descriptors at
        64), then the two scratch pointers; the launch packs the values and passes pointers into it."""
        from .cuda_driver import TENSOR_MAP_ALIGN, TENSOR_MAP_BYTES
        fmt, offsets, at = ["<"], [], 0

        def place(code: str, size: int, align: int):
            nonlocal at
            pad = -at % align
            if pad:
                fmt.append(f"{pad}x")
            at += pad
            offsets.append(at)
            fmt.append(code)
            at += size
        slot = 0
        for kind in self.params:
            if kind == "constexpr":
                continue
            if kind == "ptr":
                place("Q", 8, 8)
            elif kind == "desc":
                # the CUtensorMap, then the descriptor's shape (i32) and strides (i64), as Triton expands it
                rank = len(self.descriptors[slot]["block_size"])
                slot += 1
                place(f"{TENSOR_MAP_BYTES}s", TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN)
                for _ in range(rank):
                    place("i", 4, 4)
                for _ in range(rank):
                    place("q", 8, 8)
            else:
                code, size = _SCALARS[kind]
                place(code, size, size)
        place("Q", 8, 8)        # global scratch: none
        place("Q", 8, 8)        # profile scratch: none
        self.format = "".join(fmt)
        import ctypes
        self.buffer = ctypes.create_string_buffer(at + TENSOR_MAP_ALIGN)
        self.base = -ctypes.addressof(self.buffer) % TENSOR_MAP_ALIGN
        start = ctypes.addressof(self.buffer) + self.base
        self.param_ptrs = (ctypes.c_void_p * len(offsets))(*(start + o for o in offsets))

    def function(self, device: int) -> int:
        fn = self.functions.get(device)
        if fn is None:
            from . import cuda_driver
            with self.lock:
                fn = self.functions.get(device)
                if fn is None:
                    compat.ensure_context(device)
                    fn = self.functions[device] = cuda_driver.load_function(self.cubin, self.name, self.shared)
        return fn

    def bound(self, tail: tuple):
        """:meth:`bind`, kept per ``tail`` where the trailing parameters are compile-time constants (a call
        site's switches). A tail that holds runtime values (tensors, descriptors, numbers passed by keyword:
        the FP8 switches' scales, amax and gradient buffers, new on every call) is packed with the arguments
        by one binding with no tail: binding per such tail compiled a packer on every call (0.6 ms, the FP8
        backward at 2k causal host-bound: bench/NOTES.md 72) and kept every call's tensors alive."""
        if tail and self._runtime_tail(len(tail)):
            go_all = self._bound.get(())
            if go_all is None:
                go_all = self._bound[()] = self.bind(())

            def go(grid_x, grid_y, grid_z, stream, args):
                return go_all(grid_x, grid_y, grid_z, stream, (*args, *tail))
            return go
        try:
            go = self._bound.get(tail)
        except TypeError:           # an unhashable constant: bind anew
            return self.bind(tail)
        if go is None:
            go = self._bound[tail] = self.bind(tail)
        return go

    def _runtime_tail(self, n: int) -> bool:
        """Whether the last ``n`` parameters include one that is not a compile-time constant."""
        runtime = self._runtime_tails.get(n)
        if runtime is None:
            runtime = self._runtime_tails[n] = any(kind != "constexpr" for kind in self.params[len(self.params) - n:])
        return runtime

    def packer(self, tail: tuple):
        """``values(args)``: the flat parameter values of one launch with ``args`` and the trailing parameters
        ``tail``, in :meth:`_layout`'s order (constexprs dropped, a pointer as its address or 0 for None, a
        descriptor as its encoded ``CUtensorMap`` then its shape and strides, then the two null scratch
        pointers). Generated as one list display per (kernel, tail), since an eager d=64 call is host-bound
        (bench/NOTES.md 65): on the 2-core development machine the per-argument loop (:meth:`pack_loop`, kept
        for argument counts the code was not made for) took 4.8-6.9 us for the portable kernels' 84-91
        parameters and the generated code 1.7-2.4 us; for the Gluon kernels (34-63 parameters, 4-7
        descriptors, whose keys dominate) 3-7 us either way. ``tests/test_prebuilt.py`` checks that the two
        agree on every shipped entry."""
        encoded: dict = {}
        descriptors = self.descriptors

        def blob(a, slot):
            # ``slot`` counts descriptors from 1, as the key of the loop before this one did
            key = (a.base.data_ptr(), tuple(a.shape), tuple(a.strides), a.padding, slot)
            out = encoded.get(key)
            if out is None:
                from . import cuda_driver
                if len(encoded) >= 64:
                    encoded.clear()
                meta = descriptors[slot - 1]
                out = encoded[key] = cuda_driver.encode_tiled(
                    a.base.data_ptr(), meta["host_dtype"], meta["elem_size"], meta["swizzle"], a.shape, a.strides,
                    meta["block_size"], a.padding == "nan")
            return out

        n_args = len(self.params) - len(tail)
        items, slot = [], 0
        for i, kind in enumerate(self.params):
            if kind == "constexpr":
                continue
            if kind == "ptr":
                items.append(f"(a{i}.data_ptr() if a{i} is not None else 0)")
            elif kind == "desc":
                slot += 1
                items += [f"_blob(a{i}, {slot})", f"*a{i}.shape", f"*a{i}.strides"]
            else:
                items.append(f"a{i}")
        items += ["0", "0"]             # Triton's global and profile scratch pointers: none
        lines = ["def values(args):"]
        if n_args > 0:
            lines.append(f"    {', '.join(f'a{i}' for i in range(n_args))}, = args")
        if len(tail) > 0:
            lines.append(f"    {', '.join(f'a{n_args + j}' for j in range(len(tail)))}, = _tail")
        lines.append(f"    return [{', '.join(items)}]")
        env = {"_blob": blob, "_tail": tuple(tail)}
        exec(compile("\n".join(lines), f"<fusedattn prebuilt {self.name}>", "exec"), env)
        generated = env["values"]
        loop = self.pack_loop(tail, blob)

        def values(args):
            return generated(args) if len(args) == n_args else loop(args)
        return values

    def pack_loop(self, tail: tuple, blob):
        """:meth:`packer`'s values, one argument at a time (any argument count: ``zip`` stops at the
        signature's end); ``blob(descriptor, slot)`` encodes a descriptor."""
        kinds = self.params

        def values(args):
            out = []
            slot = 0
            for kind, a in zip(kinds, (*args, *tail)):
                if kind == "constexpr":
                    continue
                if kind == "ptr":
                    out.append(a.data_ptr() if a is not None else 0)
                elif kind == "desc":
                    slot += 1
                    out.append(blob(a, slot))
                    out.extend(a.shape)
                    out.extend(a.strides)
                else:
                    out.append(a)
            out.append(0)
            out.append(0)
            return out
        return values

    def bind(self, tail: tuple):
        """``go(grid_x, grid_y, grid_z, stream, args)`` launching with ``args`` and the trailing parameters
        ``tail`` (as ``backends.triton.launch.Launcher``'s fast path takes them); TMA descriptors are
        encoded once per (base pointer, shape, strides)."""
        from . import cuda_driver
        threads = 32 * self.num_warps
        shared = self.shared
        fmt, buffer, base, params = self.format, self.buffer, self.base, self.param_ptrs
        lock = self.lock
        values = self.packer(tail)

        def go(grid_x, grid_y, grid_z, stream, args):
            device = torch.cuda.current_device()
            function = self.functions.get(device) or self.function(device)
            packed = values(args)
            with lock:      # one parameter buffer per kernel: the driver copies it at the launch
                struct.pack_into(fmt, buffer, base, *packed)
                cuda_driver.launch(function, (grid_x, grid_y, grid_z), threads, shared, stream, params)
        return go


def expand_params(kernel, compiled) -> Optional[list]:
    """The parameter kinds of a compiled kernel, in its parameters' order: "constexpr" (not passed),
    "ptr", "desc" (a TMA descriptor; its shape and strides follow as the next parameters' values in
    :meth:`PrebuiltKernel.bind`), or a scalar type; None where some parameter is a kind the store does not
    launch (tuples, 16-bit floats, descriptors without metadata)."""
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict) or len(signature) != len(kernel.params):
        return None
    kinds = []
    for param in kernel.params:
        ty = signature.get(param.name)
        if not isinstance(ty, str):
            return None
        if ty == "constexpr":
            kinds.append("constexpr")
        elif ty.startswith("*"):
            kinds.append("ptr")
        elif ty.startswith("tensordesc"):
            kinds.append("desc")
        elif ty in _SCALARS:
            kinds.append(ty)
        else:
            return None
    return kinds


# --------------------------------------------------------------------------------------------------
# building a store (``python -m fusedattn warmup --record DIR`` on a GPU machine)
# --------------------------------------------------------------------------------------------------

_recording: dict = {}       # "dir" -> the store directory being written; "index" -> its entries
_record_lock = threading.Lock()


def start_recording(root: str, arch: int) -> str:
    """From now on every kernel the JIT compiles in this process is written to a store under ``root``
    (and :func:`find` finds nothing, so everything compiles). Returns the store's directory."""
    path = os.path.join(root, store_name(arch))
    os.makedirs(path, exist_ok=True)
    index_path = os.path.join(path, "index.json")
    entries = {}
    if os.path.isfile(index_path):
        with open(index_path) as f:
            entries = json.load(f).get("kernels", {})
    _recording.update(dir=path, arch=arch, index=entries, skipped=[])
    return path


def stop_recording() -> None:
    _recording.clear()


def recording() -> bool:
    return bool(_recording)


def _descriptor_entries(compiled) -> Optional[list]:
    metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or ())
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST as to_host
    except ImportError:
        to_host = {}
    out = []
    for meta in metas:
        if meta is None or meta.get("fp4_padded") or meta.get("is_im2col"):
            return None
        out.append({"swizzle": meta["swizzle"], "elem_size": meta["elem_size"],
                    "host_dtype": to_host.get(meta["elem_type"], meta["elem_type"]),
                    "block_size": list(meta["block_size"])})
    return out


def record(kernel, args: tuple, kwargs: dict, compiled) -> None:
    """Write ``compiled`` (the JIT's kernel for this launch) into the store being recorded, where the
    store can launch it (see the module docstring); a kernel it cannot is listed in the index's
    ``skipped`` with the reason."""
    if not _recording or compiled is None:
        return
    meta = compiled.metadata
    key = launch_key(kernel, args, kwargs, _recording["arch"])
    kinds = expand_params(kernel, compiled)
    descriptors = _descriptor_entries(compiled)
    reason = None
    if key is None or kinds is None:
        reason = "argument kinds"
    elif descriptors is None or len(descriptors) != kinds.count("desc"):
        reason = "descriptor metadata"
    elif (getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False)
          or getattr(meta, "launch_pdl", False) or getattr(meta, "global_scratch_size", 0)
          or getattr(meta, "profile_scratch_size", 0)):
        reason = "launch needs clusters, scratch, cooperative or PDL"
    with _record_lock:
        if reason is not None:
            _recording["skipped"].append(f"{meta.name}: {reason}")
            return
        cubin = compiled.asm["cubin"]
        with open(os.path.join(_recording["dir"], f"{key}.cubin.xz"), "wb") as f:
            f.write(lzma.compress(cubin))
        _recording["index"][key] = {"kernel": _kernel_id(kernel), "name": meta.name,
                                    "specs": repr(_specs(kernel, args, kwargs)), "num_warps": meta.num_warps, "shared": meta.shared,
                                    "params": kinds, "descriptors": descriptors,
                                    "sha256": hashlib.sha256(cubin).hexdigest()}
        _write_index()


def _write_index() -> None:
    path = os.path.join(_recording["dir"], "index.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "triton": triton.__version__, "arch": _recording["arch"],
                   "kernels": _recording["index"], "skipped": _recording["skipped"]}, f, indent=0, sort_keys=True)
    os.replace(tmp, path)
