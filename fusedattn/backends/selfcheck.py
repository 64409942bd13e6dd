"""The launch fast path's check at first use: a probe kernel launched through Triton's public path and
through :func:`compat.direct_launch` must give the same results before any real kernel takes the fast path.

The fast path calls the C launcher the JIT would call, with arguments laid out as this Triton's launcher
lays them out (``compat``). Versions we support are checked here on every process's first fast launch, so
a Triton whose launcher changed under the same attribute names, or a layout we got wrong, turns the fast
path off (one warning) instead of making a wrong call. Two probes, one per kind of fast launch:

* ``_probe`` (Triton): a pointer, an ``i32``, an ``i64`` past 2^32, an ``fp32``, a ``bool``, an integer equal
  to 1 (which the JIT folds into a constant), ``None`` and a trailing ``constexpr``: every argument kind our
  kernels pass.
* ``_probe_tma`` (Gluon, Hopper only): a TMA descriptor in, scalars between, a TMA descriptor out.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compat

_BIG = 2 ** 33 + 5          # an int64 argument: a wrong slot width or order shows in the result
_RESULT: dict = {}          # kind ("plain" | "tma") -> bool


@triton.jit
def _probe(out, x, n, big, scale, flag, one, nothing, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    keep = offs < n
    v = tl.load(x + offs, mask=keep, other=0.0)
    r = v * scale + n + (big % 1000) + one * 7 + flag * 3
    if nothing is not None:
        r = r + 1000.0
    tl.store(out + offs, r, mask=keep)


def _probe_values(shape, dtype, device):
    """Distinct, irregular probe inputs that leave the user's random stream alone (a probe drawing from
    the CUDA generator would shift every random number the user draws after the first launch)."""
    n = 1
    for size in shape:
        n *= size
    return torch.arange(n, device=device, dtype=torch.float32).mul_(0.7).sin_().mul_(3).reshape(shape).to(dtype)


def _check_plain(device) -> str:
    """'' when the probe's two launches agree, else what went wrong."""
    x = _probe_values((64, ), torch.float32, device)
    n, scale = 37, 1.5
    outs = []
    for fast in (False, True):
        out = torch.full_like(x, float("nan"))
        args = (out, x, n, _BIG, scale, True, 1, None)
        compiled = _probe[(1, )](*args, BLOCK=64, **compat.COMPILE_OPTIONS)
        if fast:
            out.fill_(float("nan"))
            go = compat.direct_launch(compiled, (64, ), args, _checking=True)
            if go is None:
                return f"no fast path for the probe ({compat.last_refusal})"
            go(1, 1, 1, torch.cuda.current_stream(device).cuda_stream, args)
        outs.append(out)
    torch.cuda.synchronize(device)
    expected = x[:n] * scale + n + _BIG % 1000 + 7 + 3
    return _compare(outs, expected, n)


def _compare(outs, expected, n) -> str:
    public, fast = outs
    if not torch.equal(public[:n], expected.to(public.dtype)) and not torch.allclose(public[:n].float(), expected.float()):
        return f"the public launch itself differs from the expected values (max {_diff(public[:n], expected)})"
    if not torch.equal(fast[:n], public[:n]):
        return f"the fast launch wrote other values (max difference {_diff(fast[:n], public[:n])})"
    if fast[n:].numel() and not bool(fast[n:].isnan().all()):
        return "the fast launch wrote past the end"
    return ""


def _diff(a, b) -> str:
    return f"{(a.float() - b.float()).abs().nan_to_num(float('inf')).max().item():.3g}"


def _gluon_probe():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    @gluon.jit
    def _probe_tma(src, dst, row, scale, ROWS: gl.constexpr, COLS: gl.constexpr):
        smem = gl.allocate_shared_memory(src.dtype, [ROWS, COLS], src.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, ROWS * COLS * 2)
        compat.tma_load(src, [row, 0], bar, smem)
        mbarrier.wait(bar, 0)
        mbarrier.invalidate(bar)
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        v = smem.load(layout)
        smem.store((v.to(gl.float32) * scale).to(src.dtype))
        fence_async_shared()
        compat.tma_store(dst, [0, 0], smem)
        tma.store_wait(0)
    return _probe_tma


def _check_tma(device) -> str:
    from triton.experimental.gluon import language as gl

    from .gluon.launch import Tma
    rows, cols = 16, 64
    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float16)
    kernel = _gluon_probe()
    src = _probe_values((3 * rows, cols), torch.float16, device)
    row, scale = rows, 2.0
    outs = []
    for fast in (False, True):
        dst = torch.full((rows, cols), float("nan"), device=device, dtype=torch.float16)
        descs = [Tma(t, tuple(t.shape), tuple(t.stride()), (rows, cols), layout) for t in (src, dst)]
        compiled = kernel[(1, )](descs[0].descriptor(), descs[1].descriptor(), row, scale, rows, cols, num_warps=4,
                                 **compat.COMPILE_OPTIONS)
        if fast:
            dst.fill_(float("nan"))
            args = (descs[0], descs[1], row, scale)
            go = compat.direct_launch(compiled, (rows, cols), args, descriptor_positions=(0, 1), _checking=True)
            if go is None:
                return f"no fast path for the probe ({compat.last_refusal})"
            go(1, 1, 1, torch.cuda.current_stream(device).cuda_stream, args)
        outs.append(dst)
    torch.cuda.synchronize(device)
    return _compare(outs, src[row:row + rows] * 2, rows)


def fast_launch_ok(with_descriptors: bool) -> bool:
    """Whether the fast path passed its probe in this process (runs the probe on the first ask). Asked
    while a CUDA graph is being captured, it answers False without probing (a probe would launch into
    the capture) and probes on a later ask. The probe reads its result back to the host once; under
    CUDA's sync debug mode it runs with that mode off (the mode is for the caller's own syncs: this one
    is fusedattn's, once per process, and a refusal there turned the fast path off for good)."""
    kind = "tma" if with_descriptors else "plain"
    ok = _RESULT.get(kind)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        _RESULT[kind] = False           # a probe that fails half way leaves the fast path off
        try:
            device = torch.cuda.current_device()
            compat.ensure_context(device)
            debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                why = _check_tma(device) if with_descriptors else _check_plain(device)
            finally:
                torch.cuda.set_sync_debug_mode(debug_mode)
        except Exception as exc:        # any failure of the probe means: do not take the fast path
            why = f"the probe raised {type(exc).__name__}: {str(exc)[:300]}"
        ok = not why
        if not ok:
            compat.warn_once(f"fast-{kind}", f"the direct launch path ({kind}) did not pass its self-check on "
                                         f"Triton {triton.__version__} ({why}); kernels launch through Triton's "
                                         "own launcher")
        _RESULT[kind] = ok
    return ok
