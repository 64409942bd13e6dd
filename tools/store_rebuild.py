"""Rebuild a shipped kernel store (``fusedattn/prebuilt/triton-VERSION-sm90``) with no GPU.

A store entry is one launch the JIT compiled while ``python -m fusedattn warmup --record`` ran on a GPU
(``backends/prebuilt.py``). Its index keeps, per launch, every compile-time constant's value and every runtime
argument as the JIT specializes on it (``specs``). That is all Triton's compile needs: for each entry this
makes stand-in arguments with the same specialization (CPU tensors of the dtype, aligned or not; integers
equal to 1, divisible by 16 or neither; TMA descriptors of the dtype, box and layout), runs Triton's own
binder on them for an sm_90 target (the JIT's specialization code, so signature and attributes are the JIT's),
compiles with Triton's compiler and the ptxas it ships, and writes the cubin under the key the current kernel
sources give (``prebuilt.kernel_sources_digest``). A lab tool, not part of the package: it calls Triton's JIT
internals (``create_function_from_signature``, ``JITFunction._pack_args``), checked on Triton 3.6.0 to 3.9.0
by ``--check`` (bench/NOTES.md 61) and by tests/test_store_rebuild.py in CI.

    python tools/store_rebuild.py --check [STORE] [--jobs N]   # recompile, compare with the recorded cubins
    python tools/store_rebuild.py [STORE] [--jobs N]           # rebuild the store in place for the current sources
    python tools/store_rebuild.py STORE --launches-from OTHER   # ... from another Triton's store's launches
    python tools/store_rebuild.py STORE --launches-from OTHER --launches-from STORE   # ... from both

STORE defaults to this Triton's store under fusedattn/prebuilt. ``--check`` is the proof the rebuild is the
JIT's build: on the store recorded on the GPU from the same sources, every recompiled cubin should have the
recorded one's SASS (the bytes differ in the line table's file paths, the Triton install's, and nowhere else).
The rebuild covers the launches of the last GPU recording only: a
kernel variant that the new sources add (a new constexpr switch value, a new kernel) is not in the store
until the next ``warmup --record``; entries whose kernel or constants no longer exist are dropped (printed).
A recording on one Triton serves the others: ``--launches-from`` takes the launches of another store's index
(the specs do not depend on the Triton release: the same warmup specializes the same way on each; session 23
built 3.7.1, 3.8.0 and 3.9.0 from a 3.6.0 recording, bench/NOTES.md 62) and replaces this store's entries.
Not where a switch depends on the release: the fused backward's ``SEGMENTS`` (GQA, Triton 3.9+) is recorded
as the recording's Triton chose it, so a 3.9 store built from a 3.6 recording would lack its GQA launch (a
miss and a JIT compile on the first GQA backward): take 3.9's launches from a 3.9 recording (bench/NOTES.md 64),
or from the union of a 3.6 recording's and 3.9's own earlier ones (``--launches-from`` twice: the new kernels'
launches from the one, 3.9's own GQA launch from the other; a launch the sources no longer make is rebuilt too,
and never hit).
"""
import argparse
import ast
import hashlib
import importlib
import inspect
import json
import lzma
import os
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget

ARCH = 90
TARGET = GPUTarget("cuda", ARCH, 32)


def _kernel(ident):
    """The JITFunction an index entry names (``module.qualname:digest``)."""
    path = ident.split(":", 1)[0]
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _tensor(dtype, aligned, n=256):
    """n elements of ``dtype``, 16-byte aligned or one element off (not aligned)."""
    start = 0 if aligned else 1
    return torch.zeros(n + 16, dtype=dtype)[start:start + n]


def _descriptor(kernel, spec):
    """A TMA descriptor argument with ``spec``'s dtype, box, layout and padding over a CPU tensor."""
    _, dtype, block, layout, padding, _ndim, _tf32 = spec
    dtype = getattr(torch, dtype.split(".")[-1])
    shape = [2 * b for b in block]
    base = torch.zeros(shape, dtype=dtype)
    strides = list(base.stride())
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon import language as gl     # noqa: F401  (names the layout's repr uses)
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        names = {n: getattr(gl, n) for n in dir(gl)}
        return TensorDescriptor(base, shape, strides, list(block), eval(layout, names), padding=padding)
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(base, shape, strides, list(block), padding=padding)


def _argument(kernel, spec):
    kind = spec[0]
    if kind == "t":
        return _tensor(getattr(torch, spec[1].split(".")[-1]), spec[2])
    if kind == "i":
        _, one, div16, is32 = spec
        if one:
            return 1
        value = 16 if div16 else 3
        return value if is32 else 2 ** 33 + value
    if kind == "f":
        return 1.5
    if kind == "b":
        return spec[1]
    if kind == "none":
        return None
    if kind == "d":
        return _descriptor(kernel, spec)
    raise ValueError(f"argument kind {kind!r}")


def _constant(text):
    """A constexpr's value from its repr in the specs."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return eval(text, {"torch": torch, "triton": triton, "tl": triton.language})


def _is_options(spec) -> bool:
    """Whether a specs item is the trailing launch options (a tuple of (name, repr) pairs), not a parameter's
    spec (a constexpr's repr string, or a runtime argument's tuple led by its kind)."""
    return isinstance(spec, tuple) and all(isinstance(x, tuple) and len(x) == 2 for x in spec)


def launch_of(kernel, specs):
    """(args, kwargs, specs as the current sources give them) with ``specs``' specialization: positional
    arguments for every parameter, then the launch options. A compile-time parameter the kernel gained
    since the recording (a new switch, after the recorded ones) takes its default: the launches recorded
    then did not pass it, so they run with the default now (bench/NOTES.md 66: the FP8 backward's FP8_MMA16
    dropped every backward entry before this)."""
    options = specs[-1] if specs and _is_options(specs[-1]) else None
    recorded = specs[:-1] if options is not None else specs
    args, current = [], list(recorded)
    for i, param in enumerate(kernel.params):
        if i < len(recorded):
            spec = recorded[i]
            args.append(_constant(spec) if param.is_constexpr else _argument(kernel, spec))
        elif param.is_constexpr and param.default is not inspect.Parameter.empty:
            args.append(param.default)
            current.append(repr(param.default))
        elif param.default is not inspect.Parameter.empty:
            # a runtime parameter the kernel gained with a default (None, 0: an FP8 switch's pointers and strides,
            # bwd_fused_sm90): launches that do not pass it run with the default, keyed as the store keys it
            from fusedattn.backends.prebuilt import _runtime_spec
            args.append(param.default)
            current.append(_runtime_spec(param.default))
        else:
            raise ValueError(f"parameter {param.name} is not in the recorded launch and has no default")
    kwargs = {k: _constant(v) for k, v in (options or ())}
    if options is not None:
        current.append(options)
    return args, kwargs, tuple(current)


def compile_launch(kernel, args, kwargs):
    """Triton's JIT path for one launch (``JITFunction.run``: binder, ``_pack_args``, compile) on an sm_90
    target, with no device."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    source_cls = triton.compiler.ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source_cls
    return triton.compile(source_cls(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def sass(cubin: bytes) -> str:
    """The cubin's SASS (cuobjdump, shipped with Triton): what a cubin executes, without its line table (whose
    file paths name the machine that compiled it)."""
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def build_group(entries):
    """``build_entry`` for each of one kernel's entries, in order, in this (fresh) process."""
    return [build_entry(entry) for entry in entries]


def build_entry(entry):
    """Compile one store entry from the current sources. Returns (cubin, its key under the current sources,
    the entry's new fields) or (None, None, why)."""
    from fusedattn.backends import prebuilt
    try:
        kernel = _kernel(entry["kernel"])
        call_args, call_kwargs, specs = launch_of(kernel, ast.literal_eval(entry["specs"]))
        compiled = compile_launch(kernel, call_args, call_kwargs)
    except Exception as exc:          # a kernel or constant the sources no longer have
        return None, None, f"not rebuilt ({type(exc).__name__}: {str(exc)[:160]})"
    if prebuilt._specs(kernel, tuple(call_args), call_kwargs) != specs:
        return None, None, "stand-in arguments specialize differently"
    cubin = compiled.asm["cubin"]
    fields = dict(kernel=f"{entry['kernel'].split(':', 1)[0]}:{prebuilt.kernel_sources_digest()}",
                  sha256=hashlib.sha256(cubin).hexdigest(), shared=compiled.metadata.shared,
                  num_warps=compiled.metadata.num_warps, params=prebuilt.expand_params(kernel, compiled),
                  descriptors=prebuilt._descriptor_entries(compiled), specs=repr(specs))
    return cubin, prebuilt.launch_key(kernel, tuple(call_args), call_kwargs, ARCH), fields


def launches_of(stores):
    """The launches recorded in ``stores``' indexes, each once: (kernel, specs) already taken from an earlier
    store is skipped (the same launch under another Triton, or under older sources' key)."""
    launches, seen = {}, set()
    for n, store in enumerate(stores):
        with open(os.path.join(store, "index.json")) as f:
            other = json.load(f)
        for key, entry in other["kernels"].items():
            launch = (entry["kernel"].split(":", 1)[0], entry["specs"])
            if launch not in seen:
                seen.add(launch)
                launches[f"from{n}-{key}"] = {field: entry[field] for field in ("name", "kernel", "specs")}
    return launches


def main():
    from concurrent.futures import ProcessPoolExecutor
    from fusedattn.backends import prebuilt
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", nargs="?", default=os.path.join(prebuilt.STORE_ROOT, prebuilt.store_name(ARCH)))
    ap.add_argument("--check", action="store_true", help="compare with the recorded cubins, write nothing")
    ap.add_argument("--only", help="--check: entries whose kernel name contains this")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    ap.add_argument("--launches-from", metavar="OTHER", action="append",
                    help="rebuild from the launches recorded in another store (e.g. another Triton's, recorded on a "
                    "GPU from the current sources) instead of this one's; given more than once, from the union of "
                    "their launches (name this store itself to keep its own)")
    args = ap.parse_args()
    if args.only and not args.check:
        raise SystemExit("--only goes with --check: a rebuild covers the whole store (one source digest)")
    if args.launches_from and args.check:
        raise SystemExit("--launches-from rebuilds; --check compares a store with its own recording")
    with open(os.path.join(args.store, "index.json")) as f:
        index = json.load(f)
    recorded = list(index["kernels"])          # this store's cubins before the rebuild
    if args.launches_from:
        index["kernels"] = launches_of(args.launches_from)
    if index["triton"] != triton.__version__:
        raise SystemExit(f"{args.store} is a store for Triton {index['triton']}, this is {triton.__version__}")
    kept, same, t0 = {}, 0, time.time()
    chosen = sorted(((key, entry) for key, entry in index["kernels"].items()
                     if not args.only or args.only in entry["name"]), key=lambda kv: kv[1]["name"])
    # one fresh process per kernel, its entries in key order: a build's schedule can depend on what its process
    # compiled before it. Measured (bench/NOTES.md 61): one fused-backward build (3.6.0, 3.7.1) and one dQ-pass
    # build (3.8.0) came out other than recorded when compiled after every other kernel in one process, and
    # also alone in a process; after their own kernel's other entries, as here, they gave the recorded SASS
    groups = {}
    for _, entry in chosen:
        groups.setdefault(entry["name"], []).append(entry)
    with ProcessPoolExecutor(args.jobs, max_tasks_per_child=1) as pool:
        builds = [b for group in pool.map(build_group, groups.values()) for b in group]
    for (key, entry), (cubin, new_key, fields) in zip(chosen, builds):
        if cubin is None:
            print(f"  {entry['name']} {key[:10]}: {fields}; dropped", flush=True)
            continue
        if args.check:
            with open(os.path.join(args.store, f"{key}.cubin.xz"), "rb") as f:
                recorded = lzma.decompress(f.read())
            ok = sass(cubin) == sass(recorded)
            same += ok
            print(f"  {entry['name']:28s} {key[:10]}: {'same SASS' if ok else 'DIFFERENT'}"
                  f"{' (bytes equal)' if fields['sha256'] == entry['sha256'] else ''}", flush=True)
            continue
        with open(os.path.join(args.store, f"{new_key}.cubin.xz"), "wb") as f:
            f.write(lzma.compress(cubin))
        kept[new_key] = dict(entry, **fields)
        print(f"  {entry['name']:28s} {key[:10]} -> {new_key[:10]}", flush=True)
    n = len(chosen)
    if args.check:
        print(f"{same} of {n} recompiled kernels have the recorded SASS ({time.time() - t0:.0f} s)")
        return 0 if same == n else 1
    for old in recorded:
        if old not in kept:
            os.remove(os.path.join(args.store, f"{old}.cubin.xz"))
    index["kernels"] = kept
    with open(os.path.join(args.store, "index.json"), "w") as f:
        json.dump(index, f, indent=0, sort_keys=True)
    print(f"{len(kept)} of {n} entries rebuilt for sources {prebuilt.kernel_sources_digest()[:12]} "
          f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
