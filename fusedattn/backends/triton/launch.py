"""Kernel launches with less host time: a repeat call skips Triton's JIT dispatcher.

``JITFunction.__getitem__(grid)(*args)`` binds ~80 arguments, specializes each one
(alignment, == 1, integer width), hashes the specialization and looks the kernel up on
every call: about 35 us of host time per launch on the H100 machine, against 9 us for
the compiled kernel's own launcher (bench/overhead.py, bench/NOTES.md 16). At d=64 a
whole forward kernel runs in 74 us, so eager calls were host-bound.

:class:`Launcher` keeps, per caller-given *key*, the compiled kernel the JIT chose the
first time and afterwards launches it directly: through the C launch function itself where
``compat.direct_launch`` knows this Triton's launcher and its self-check passed (Triton's Python
``CudaLauncher.__call__`` costs a few us more per launch, bench/NOTES.md 45), else through that
launcher (``compat.public_launch``). The contract: equal keys must
mean equal values for every argument that is not a tensor and equal dtypes and 16-byte
alignment for every tensor argument; then the JIT would pick the same compiled kernel.
Callers build keys from the problem (shapes, strides, scalars), so this holds by
construction; a key of None always goes through the JIT (used for per-call values such
as dropout seeds, whose integer width the JIT specializes on).

Under the interpreter, or when a launch hook is installed (profilers), every call goes
through the JIT.

Recording (:class:`recording`): inside that context, on the calling thread, every launch that takes the cached
path is also listed with the callable that made it, so ``backends.replay`` can issue the same launches again for
another call's tensors without this module's keys.

Compile ahead (:func:`compiling_ahead`): inside that context, on the calling thread, a launch does not
run; its kernel is compiled for these arguments on a pool of threads (Triton's compiler releases the GIL
for part of the work: two Gluon forward compiles on two cores took 2.6 s together against 4.2 s one after
another; Gluon's Python front end holds it), so the kernels of one call, or of a whole set of
configurations (``fusedattn.warmup``), compile side by side instead of one after another. A later real launch of a
kernel with a compile in flight waits for it instead of compiling it a second time.
"""
from __future__ import annotations

import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from triton import knobs

from ...plan import interpreting
from .. import compat, kernel_cache, prebuilt

_MAX_ENTRIES = 512     # per kernel; a full cache is cleared (keys are cheap to rebuild)
_UNASKED = object()    # a cache entry whose fast path is built on its first repeat call

# the raw current device and stream, as Triton's own launcher gets them (torch.cuda.current_stream
# builds a Python Stream object: ~8 us per launch on the H100 machine's host, bench/overhead.py)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)


def _no_launch_hooks() -> bool:
    """True when no launch hook (profilers) is installed. Triton 3.6 keeps hooks in a HookChain
    that is never None; older versions use None."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def pow2(n: int) -> int:
    """The smallest power of two >= n (host code: triton.next_power_of_2 costs ~2 us a call)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_ahead = threading.local()          # .active: this thread's launches compile ahead instead of running
_pending: dict = {}                 # kernel -> futures of its compiles in flight
_pending_lock = threading.Lock()
_pool: list = []                    # the compile threads, made on first use


def _compile_pool() -> ThreadPoolExecutor:
    with _pending_lock:
        if not _pool:
            _pool.append(ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 2) - 1)),
                                            thread_name_prefix="fusedattn-compile"))
        return _pool[0]


class compiling_ahead:
    """Context manager: launches made inside it on this thread compile their kernels on the compile
    threads and return at once (nothing runs on the GPU; outputs are not written). ``wait()`` blocks until
    every compile started inside has finished and re-raises the first error. Launches on other threads
    (PyTorch's autograd threads run the backward) are not affected: they run, after waiting for any
    compile of their kernel in flight."""

    def __enter__(self):
        self.previous = getattr(_ahead, "active", None)
        # nested inside another: share its list, so the outermost wait() covers every compile
        self.futures = _ahead.active = self.previous if self.previous is not None else []
        return self

    def __exit__(self, *exc):
        _ahead.active = self.previous
        return False

    def wait(self) -> None:
        for future in self.futures:
            future.result()


def _compile_only(kernel, grid, args, kwargs) -> None:
    """Start compiling ``kernel`` for these arguments (and load it, so the first launch has nothing
    left to do) on the compile threads."""
    device = _current_device()

    def compile_one():
        torch.cuda.set_device(device)       # the caller's GPU: the JIT compiles and loads for the current one
        compiled = kernel.warmup(*args, grid=grid, **kwargs, **compat.COMPILE_OPTIONS)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        compat.load_compiled(compiled)
        prebuilt.record(kernel, args, kwargs, compiled)
    future = _compile_pool().submit(compile_one)
    _ahead.active.append(future)
    with _pending_lock:
        _pending.setdefault(kernel, []).append(future)
    future.add_done_callback(lambda done: _forget(kernel, done))


def _forget(kernel, future) -> None:
    """A finished compile needs no waiting: off the pending table, so launches skip the lock again."""
    with _pending_lock:
        futures = _pending.get(kernel)
        if futures is not None and future in futures:
            futures.remove(future)
            if not futures:
                del _pending[kernel]


def _wait_for_compiles(kernel) -> None:
    """Before a real launch of ``kernel``: wait for its compiles in flight (the JIT then finds them)."""
    with _pending_lock:
        futures = _pending.pop(kernel, ())
    for future in futures:
        try:
            future.result()
        except Exception:       # noqa: BLE001 -- the launch below compiles again and reports the error itself
            pass


class _Recording(threading.local):
    active = None                   # this thread's open :class:`recording`, or None


_recording = _Recording()


class recording:
    """Context manager: the launches made inside it on this thread are listed in ``launches``, each as
    ``(launcher, go, device, grid, args)``, where ``go(grid_x, grid_y, grid_z, stream, args)`` launches the
    same compiled kernel again (``backends.replay``); ``complete`` turns False when a launch inside went
    through the JIT (the first call of its key: no cached kernel to list yet)."""

    def __enter__(self):
        self.launches = []
        self.complete = True
        self.previous = _recording.active
        _recording.active = self
        return self

    def __exit__(self, *exc):
        _recording.active = self.previous
        return False


def _public_go(compiled, tail):
    """A ``go`` (see :class:`recording`) through Triton's own launcher, for a kernel without a fast path."""
    def go(grid_x, grid_y, grid_z, stream, args):
        compat.public_launch(compiled, grid_x, grid_y, grid_z, stream, args, tail)
    return go


def trailing_params(kernel, args: tuple, kwargs: dict) -> tuple:
    """The values of ``kernel``'s parameters after the positional ``args``, in signature order (launch
    options such as num_warps are not parameters)."""
    return tuple(kwargs[param.name] if param.name in kwargs else param.default
                 for param in kernel.params[len(args):])


def jit_launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` with :data:`compat.COMPILE_OPTIONS`, or, inside
    :class:`compiling_ahead`, its compile on the compile threads (returns None then). A kernel shipped
    compiled (``backends.prebuilt``) is launched from the store instead, and returned (a
    ``prebuilt.PrebuiltKernel``); nothing compiles for it, ahead or not. The first compile installs the
    checked kernel cache (``backends.kernel_cache``)."""
    if interpreting():
        return kernel[grid](*args, **kwargs)
    device = _current_device()
    shipped = prebuilt.find(kernel, args, kwargs, device)
    if shipped is not None:
        if getattr(_ahead, "active", None) is None:
            compat.ensure_context(device)
            g = tuple(grid) + (1,) * (3 - len(grid))
            shipped.bound(trailing_params(kernel, args, kwargs))(g[0], g[1], g[2], _current_raw_stream(device), args)
        return shipped
    kernel_cache.install()
    if getattr(_ahead, "active", None) is not None:
        _compile_only(kernel, grid, args, kwargs)
        return None
    if _pending:
        _wait_for_compiles(kernel)
    compat.ensure_context(device)
    compiled = kernel[grid](*args, **kwargs, **compat.COMPILE_OPTIONS)
    if prebuilt.recording():
        prebuilt.record(kernel, args, kwargs, compiled)
    return compiled


_Tensor = torch.Tensor
_INT32 = (-2 ** 31, 2 ** 31)
_INT_KEYS: dict = {}      # int -> its key part (strides and sizes repeat from call to call)


def _int_key(a: int) -> tuple:
    """What the JIT specializes on for an integer argument (== 1, divisible by 16, 32-bit), remembered: a
    dict hit is a third of building the tuple (signature_key's ~45 integers of a decode launch)."""
    if len(_INT_KEYS) > 4096:
        _INT_KEYS.clear()
    lo, hi = _INT32
    k = _INT_KEYS[a] = (a == 1, a % 16 == 0, lo <= a < hi)
    return k


def signature_key(args, kwargs, other_kind=None, other_key=None, runtime_names=frozenset()) -> tuple:
    """A :class:`Launcher` key for one launch: what the JIT specializes on for each positional argument
    (a tensor's dtype and 16-byte alignment, an integer's value class: == 1, divisible by 16, width; a
    bool's value; a float as a float) and the keyword ones by name: a tensor or a descriptor (``other_kind``)
    as a positional one (the FP8 switches' scales, amaxes, gradient buffers and transposed copies: runtime
    values passed by keyword, new on every call, which :class:`Launcher` passes through instead of keeping),
    a number given for one of ``runtime_names`` (the kernel's runtime parameters with a default,
    ``Launcher.runtime_names``: a dropout seed, a stride) by its value class as a positional one, any other
    value itself (constexprs and launch options; the call site fixes their order). other_kind / other_key: one
    more argument type and its key (Gluon's TMA descriptors). One pass with the common types first: this runs
    on every launch."""
    key = []
    add = key.append
    known = _INT_KEYS.get
    for a in args:
        kind = type(a)
        if kind is int:
            add(known(a) or _int_key(a))
        elif kind is other_kind:
            add(other_key(a))
        elif kind is _Tensor:
            add((a.dtype, a.data_ptr() % 16 == 0))
        elif kind is bool:
            add(a)
        elif kind is float:
            add(float)
        else:
            raise TypeError(f"fusedattn: unexpected kernel argument type {kind}")
    named = tuple(kwargs.items())
    for name, value in named:
        kind = type(value)
        if kind is _Tensor or (kind is other_kind and kind is not None) or (runtime_names and name in runtime_names):
            named = tuple((name, _runtime_key(value, other_kind, other_key, name in runtime_names))
                          for name, value in named)
            break
    return tuple(key), named


def _runtime_key(value, other_kind, other_key, runtime=False):
    """A keyword argument's part of the key: a tensor or a descriptor by what the JIT specializes on (its
    value is passed on each call, ``Launcher._promoted``), a number for a runtime parameter (``runtime``) by
    its value class as a positional one (passed on each call too), anything else by its value."""
    kind = type(value)
    if kind is _Tensor:
        return _Tensor, value.dtype, value.data_ptr() % 16 == 0
    if kind is other_kind and kind is not None:
        return other_kind, other_key(value)
    if runtime and kind is int:
        return int, _INT_KEYS.get(value) or _int_key(value)
    if runtime and kind is float:
        return float
    return value


def direct_c(compiled, tail, args):
    """:class:`Launcher`'s default ``direct``: the compiled kernel's C launcher called with the arguments
    as given (``compat.direct_launch``; None where this Triton's launcher is not one it knows)."""
    return compat.direct_launch(compiled, tail, args)


class Launcher:
    """A @triton.jit kernel with a per-key cache of its compiled form (see the module docstring)."""

    def __init__(self, kernel, jit_arg=None, direct=direct_c, runtime_kinds=()):
        """jit_arg: maps each positional argument to what the JIT takes, on the JIT path only (the
        direct path passes arguments as given: Gluon's TMA tuples, ``backends.gluon.launch``).
        direct: ``direct(compiled, tail, args)`` -> a callable ``(grid_x, grid_y, grid_z, stream,
        args)`` that launches ``compiled`` with less host time than its ``run``, or returns None (then
        ``run`` launches); asked once per key, on its first repeat call (default :func:`direct_c`), so
        the fast path's one-time self-check (``backends.selfcheck``) stays out of a process's first call.
        runtime_kinds: argument types besides tensors that are runtime values when passed by keyword (Gluon's
        ``Tma``), passed through on each call rather than kept."""
        self.kernel = kernel
        self.runtime_kinds = tuple(runtime_kinds)
        # runtime (not constexpr) parameters with a default, which call sites may pass by keyword (the fused
        # backward's FP8 buffers and strides, its dropout seed): numbers given for them are runtime values too
        # (none under the interpreter, whose kernels have no parameter list and never take the cached path)
        self.runtime_names = frozenset(p.name for p in getattr(kernel, "params", ())
                                       if not p.is_constexpr and p.default is not inspect.Parameter.empty)
        self.jit_arg = jit_arg
        self.direct = direct
        self.names = kernel.arg_names
        self.cache: dict = {}
        self.direct_launches = 0      # calls that skipped the JIT (tests check the path is taken)

    def __call__(self, key, grid, *args, **kwargs):
        """Launch ``kernel[grid](*args, **kwargs)``; ``kwargs`` holds the trailing parameters
        (constexprs) by name plus launch options (num_warps, num_stages), and may hold runtime values (tensors,
        descriptors): a cached launch passes those, and every parameter before the last of them, after
        ``args`` in signature order (``promoted``), so the cache keeps none of a call's tensors."""
        entry = self.cache.get(key) if key is not None else None
        if entry is not None and _no_launch_hooks() and getattr(_ahead, "active", None) is None:
            compiled, tail, device, fast, promoted = entry
            if _current_device() == device:
                self.direct_launches += 1
                g = grid + (1,) * (3 - len(grid))
                compat.ensure_context(device)
                call = (*args, *[kwargs[name] if name in kwargs else default for name, default in promoted]) \
                    if promoted else args
                if fast is _UNASKED:
                    if torch.cuda.is_current_stream_capturing():
                        fast = None     # the fast path's self-check cannot run inside a capture: ask later
                    else:
                        fast = self.direct(compiled, tail, call) if self.direct is not None else None
                        self.cache[key] = (compiled, tail, device, fast, promoted)
                if fast is not None:
                    fast(g[0], g[1], g[2], _current_raw_stream(device), call)
                else:
                    compat.public_launch(compiled, g[0], g[1], g[2], _current_raw_stream(device), call, tail)
                listing = _recording.active
                if listing is not None:
                    listing.launches.append((self, fast or _public_go(compiled, tail), device, g, call))
                return
        if _recording.active is not None:
            _recording.active.complete = False
        if self.jit_arg:
            compiled = jit_launch(self.kernel, grid, *map(self.jit_arg, args),
                                  **{name: self.jit_arg(value) for name, value in kwargs.items()})
        else:
            compiled = jit_launch(self.kernel, grid, *args, **kwargs)
        if hasattr(compiled, "result"):       # an asynchronous compile's future
            compiled = compiled.result()
        shipped = isinstance(compiled, prebuilt.PrebuiltKernel)
        if key is None or interpreting() or compiled is None or not (shipped or hasattr(compiled, "packed_metadata")):
            return
        promoted = self._promoted(kwargs, len(args))
        tail = trailing_params(self.kernel, (*args, *promoted), kwargs)
        if len(self.cache) >= _MAX_ENTRIES:
            self.cache.clear()
        # a shipped kernel's launch through the driver is its fast path: no self-check to wait for
        self.cache[key] = (compiled, tail, _current_device(), compiled.bound(tail) if shipped else _UNASKED, promoted)

    def _promoted(self, kwargs, n_args: int) -> tuple:
        """((name, default), ...) of the parameters after the ``n_args`` positional ones up to the last one
        ``kwargs`` gives a runtime value (a tensor, one of ``runtime_kinds``: Gluon's descriptors, or any value
        for one of ``runtime_names``), in signature order; () where there is none."""
        runtime = {name for name, value in kwargs.items()
                   if type(value) is _Tensor or type(value) in self.runtime_kinds or name in self.runtime_names}
        if not runtime:
            return ()
        params = self.kernel.params[n_args:]
        last = max(i for i, param in enumerate(params) if param.name in runtime)
        return tuple((param.name, param.default) for param in params[:last + 1])
