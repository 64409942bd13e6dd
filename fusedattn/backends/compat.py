"""Every difference between the Triton releases fusedattn runs on (3.6 to 3.9), in one place.

Kernels and launchers import names from here and never test versions themselves. What differs:

* **Gluon's TMA copies.** 3.8 added ``tma.async_load`` / ``async_store`` / ``async_atomic_add``; 3.9
  removed the old ``async_copy_global_to_shared`` / ``async_copy_shared_to_global`` (they raise at compile
  time). :data:`tma_load`, :data:`tma_store` and :data:`tma_reduce_add` are whichever this Triton has
  (probed by name). 3.6/3.7 have the bulk reduce in their IR builder but no Gluon wrapper: ours calls
  the builder (a private API, used here only).
* **The CTA barrier.** 3.7 renamed Gluon's ``thread_barrier()`` to ``barrier()`` (same lowering, a
  cluster option added): :data:`cta_barrier`.
* **Reinterpreting shared memory.** A shared-memory descriptor's private ``_reinterpret(dtype, shape,
  layout)`` (3.6) is the public ``reinterpret`` in 3.9 (the old name gone): :data:`smem_reinterpret`
  calls whichever the descriptor has.
* **FMA contraction.** The kernels are written for ``a * b + c`` to become one FMA (the online softmax's
  ``qk * scale - m``, ALiBi's column term); 3.9 warns that 3.10 turns FP fusion off by default.
  :data:`COMPILE_OPTIONS` asks for it explicitly at every launch, so no version changes our numerics.
* **The compiled kernel's launcher.** 3.6 compiles a C launcher per signature that takes the kernel's
  arguments flat; 3.7+ has one generic C launcher that takes them as a tuple beside their type
  annotations. :func:`direct_launch` builds the repeat-call fast path for either (``backends.triton.launch``
  says why it exists), and only where (a) this Triton is one we support, (b) the launcher has the
  attributes of the layout we know, and (c) a probe kernel launched both ways gave the same results
  (:mod:`.selfcheck`, once per process, on the first fast launch). Anything else goes through Triton's
  own launcher (``CompiledKernel.run``): slower by a few microseconds, never wrong. A Triton newer than
  the newest we support says once, in a warning, which fast path it turned off. Finding the C function
  under Triton's descriptor wrapper reads the wrapper's closure (private, verified by the probe).
* **TMA descriptors and the CUDA context.** 3.7's encoder reads ``round_f32_to_tf32`` (our ``Tma`` has it)
  and encodes before its launcher makes a context current, which PyTorch's autograd threads lack:
  :func:`ensure_context`.
* **Loading a kernel compiled ahead** (``backends.triton.launch.compiling_ahead``): :func:`load_compiled`
  calls Triton's private lazy initializer where it exists; elsewhere the first launch does it.
"""
from __future__ import annotations

import inspect
import re
import threading
import warnings

import triton


def _version(text: str) -> tuple:
    """(major, minor, patch) of a version string such as '3.9.0' or '3.10.0+git1234'."""
    parts = [int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


TRITON_VERSION = _version(triton.__version__)
OLDEST, NEWEST = (3, 6), (3, 9)          # the releases CI and the GPU runs cover (bench/NOTES.md 51)
SUPPORTED = OLDEST <= TRITON_VERSION[:2] <= NEWEST

# options every launch passes (the interpreter ignores them): see "FMA contraction" above
COMPILE_OPTIONS = {"enable_fp_fusion": True}

_warned: set = set()


def warn_once(key: str, message: str) -> None:
    """One warning per process and ``key``."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"fusedattn: {message}", RuntimeWarning, stacklevel=3)


def unsupported_note() -> str:
    return (f"Triton {triton.__version__} is outside the releases fusedattn is tested on "
            f"({OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]})")


# --------------------------------------------------------------------------------------------------
# Gluon TMA copies (see the module docstring)
# --------------------------------------------------------------------------------------------------

def _gluon_tma_names():
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except ImportError:                     # a Triton without Gluon: the portable kernels run
        return None, None, None
    load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    reduce_add = getattr(tma, "async_atomic_add", None) or _private_tma_reduce_add()
    return load, store, reduce_add


def _private_tma_reduce_add():
    """``global[box at coord] += shared src`` (``cp.reduce.async.bulk.tensor .add``) for 3.6/3.7, whose
    Gluon has the op (``ttng.async_tma_reduce``) in its builder but no wrapper; completion is tracked as a
    TMA store's (``tma.store_wait``). Checked by the GPU tests of the single-pass backward, which is the
    only user."""
    try:
        from triton._C.libtriton import ir
        from triton.experimental.gluon.language._core import builtin
    except ImportError:
        return None
    if not hasattr(ir, "DESCRIPTOR_REDUCE_KIND"):
        return None

    @builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)
    return tma_reduce_add


tma_load, tma_store, tma_reduce_add = _gluon_tma_names()


def _gluon_barrier():
    try:
        from triton.experimental.gluon import language as gl
    except ImportError:
        return None
    return getattr(gl, "barrier", None) or gl.thread_barrier


cta_barrier = _gluon_barrier()


def _gluon_smem_reinterpret():
    try:
        from triton.experimental.gluon.language._core import builtin
    except ImportError:
        return None

    @builtin
    def smem_reinterpret(desc, dtype, shape, layout, _semantic=None):
        """The shared memory of ``desc`` seen as ``shape`` elements of ``dtype`` in ``layout`` (a view, no
        copy), through the descriptor's ``reinterpret`` (3.9) or ``_reinterpret`` (3.6)."""
        view = getattr(desc, "reinterpret", None) or desc._reinterpret
        return view(dtype, shape, layout, _semantic=_semantic)
    return smem_reinterpret


smem_reinterpret = _gluon_smem_reinterpret()


# --------------------------------------------------------------------------------------------------
# The launch fast path (see the module docstring and backends/triton/launch.py)
# --------------------------------------------------------------------------------------------------

last_refusal = ""      # why direct_launch last returned None (for the self-check's warning and tests)


def _launcher_layout(run) -> str | None:
    """'flat' (3.6: a C launcher compiled per signature, kernel arguments flat), 'generic' (3.7-3.9:
    ``driver.utils.launch``, the arguments as one tuple beside their annotations), or None."""
    if hasattr(run, "arg_annotations") and hasattr(run, "kernel_signature"):
        return "generic" if (3, 7) <= TRITON_VERSION[:2] <= NEWEST else None
    if hasattr(run, "launch"):
        return "flat" if TRITON_VERSION[:2] == (3, 6) else None
    return None


def _encoder():
    """``encode(descriptor, meta) -> list``: a TMA descriptor argument as the C launcher takes it
    (``CUtensorMap``, shape, strides), through this Triton's own ``make_tensordesc_arg``, whose
    arity changed in 3.8 (a third, unused argument)."""
    from triton.backends.nvidia.driver import make_tensordesc_arg
    extra = (None, ) * (len(inspect.signature(make_tensordesc_arg).parameters) - 2)
    return lambda desc, meta: make_tensordesc_arg(desc, meta, *extra)


def _c_function(run, n_descriptors: int):
    """The C launch function under ``run.launch``: ``run.launch`` itself, or, with descriptor arguments,
    the function that Triton's descriptor wrapper (``wrap_handle_tensordesc``, 3.6-3.9) holds as
    ``launcher``; None where it is anything else (a Python function is not a C launcher we know)."""
    launch = run.launch
    if n_descriptors:
        code = getattr(launch, "__code__", None)
        if code is None or not launch.__closure__:
            return None
        launch = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__))).get("launcher")
    return None if launch is None or hasattr(launch, "__code__") else launch


def direct_launch(compiled, tail: tuple, args: tuple, descriptor_positions=(), encode_cache_size: int = 64,
                  _checking: bool = False):
    """A callable ``(grid_x, grid_y, grid_z, stream, args)`` that launches ``compiled`` with ``args``
    (laid out as ``args`` here: descriptors at ``descriptor_positions``, each with ``base``, ``shape``,
    ``strides``, ``padding`` and ``round_f32_to_tf32``) and the trailing parameters ``tail``, skipping
    Triton's Python launcher; each descriptor is encoded once per (base pointer, shape, strides). None
    where the fast path does not apply (then the caller launches through ``compiled.run``). ``_checking``:
    called by the self-check itself (which must not wait on its own result)."""
    global last_refusal
    run = getattr(compiled, "run", None)
    layout = _launcher_layout(run) if run is not None else None
    if layout is None:
        if not SUPPORTED:
            warn_once("launch", f"{unsupported_note()}: the direct launch path is off, kernels launch through "
                                "Triton's own launcher (a few microseconds more per call)")
        last_refusal = f"launcher {type(run).__name__} not laid out as known for Triton {triton.__version__}"
        return None
    if (getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or getattr(run, "gsan_enabled", False)):
        last_refusal = (f"scratch memory to set up per launch (global {getattr(run, 'global_scratch_size', '?')}, "
                        f"profile {getattr(run, 'profile_scratch_size', '?')})")
        return None
    metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or ())
    positions = tuple(descriptor_positions)
    if len(metas) != len(positions) or any(m is None for m in metas):
        last_refusal = f"{len(metas)} descriptor metadata entries for {len(positions)} descriptor arguments"
        return None
    if not _checking:
        from . import selfcheck
        if not selfcheck.fast_launch_ok(bool(positions)):
            last_refusal = "the self-check did not pass"
            return None
    encode = _encoder() if positions else None
    encoded: dict = {}
    slot_of = {p: i for i, p in enumerate(positions)}

    def expand(args):
        if not positions:
            return args
        final = []
        for i, a in enumerate(args):
            slot = slot_of.get(i)
            if slot is None:
                final.append(a)
                continue
            # the CUtensorMap holds the base address: a repeat (pointer, shape, strides) encodes the same
            key = (a.base.data_ptr(), a.shape, a.strides, a.padding, slot)
            hit = encoded.get(key)
            if hit is None:
                if len(encoded) >= encode_cache_size:
                    encoded.clear()
                hit = encoded[key] = encode(a, metas[slot])
            final.extend(hit)
        return final

    c_function = _c_function(run, len(positions))
    if c_function is None:
        last_refusal = f"no C launch function under {type(run.launch).__name__} {getattr(run.launch, '__name__', '')}"
        return None
    function, packed = compiled.function, compiled.packed_metadata
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    if layout == "flat":
        head = (function, coop, pdl, None, None, packed, None, None, None)

        def go(grid_x, grid_y, grid_z, stream, args):
            c_function(grid_x, grid_y, grid_z, stream, *head, *expand(args), *tail)
        return go

    annotations, signature = run.arg_annotations, run.kernel_signature

    def go(grid_x, grid_y, grid_z, stream, args):
        c_function(grid_x, grid_y, grid_z, stream, function, coop, pdl, packed, None, None, None, None, None,
                   annotations, signature, (*expand(args), *tail))
    return go


_with_context = threading.local()


def ensure_context(device: int) -> None:
    """Make the device's primary CUDA context current on this thread, once per thread. Triton 3.7+
    encodes TMA descriptors (``cuTensorMapEncodeTiled``) before its launcher makes a context current,
    and PyTorch's autograd threads start with none ("invalid device context" on the backward's first
    Gluon launch); a runtime call on the device's stream makes the primary context current, as every
    PyTorch kernel launch does."""
    done = getattr(_with_context, "devices", None)
    if done is None:
        done = _with_context.devices = set()
    if device not in done:
        import torch
        torch.cuda.current_stream(device).query()
        done.add(device)


def load_compiled(compiled) -> None:
    """Load a compiled kernel onto the current device and build its launcher now (Triton does it at the
    first launch: a module load, and on 3.6 a C compile of the launcher), so a kernel compiled ahead on a
    worker thread leaves its first launch nothing to do. Best effort: ``_init_handles`` is Triton's
    private lazy initializer (3.6-3.9); where it is missing the first launch does the work as usual."""
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()


def public_launch(compiled, grid_x: int, grid_y: int, grid_z: int, stream: int, args: tuple, tail: tuple) -> None:
    """Launch ``compiled`` through Triton's own launcher (``CompiledKernel.run``, as the JIT does; the
    same call on 3.6 to 3.9), descriptors as Gluon ``TensorDescriptor`` objects or anything with
    their fields."""
    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *tail)
