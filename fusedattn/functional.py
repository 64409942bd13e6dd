"""The functional door: ``attention`` (autograd), ``attention_forward`` / ``attention_backward``.

Every call builds one :class:`~fusedattn.problem.AttentionProblem`, asks
:func:`~fusedattn.plan.plan` for a backend and tiles, and runs it. The Graph
door calls ``attention_forward`` / ``attention_backward`` too.

PyTorch integration: in eager mode ``attention`` uses a plain
``torch.autograd.Function`` that calls the launchers directly (a
``torch.library`` op costs tens of microseconds of dispatch per call). Under
``torch.compile`` it calls the registered custom ops ``fusedattn::attn_fwd`` /
``fusedattn::attn_bwd`` (with fake implementations and autograd), so a model
compiles with ``fullgraph=True``.
"""
from __future__ import annotations

import functools
import importlib

import torch

from .backends import compat
from .backends import cpu as cpu_backend
from .backends import replay as _replay
from . import fp8 as _fp8
from .plan import GLUON_BWD_FUSED_MIN_WORK, plan
from .problem import InvalidArgumentError, InvalidTypeError, check_deterministic, make_problem

__all__ = ["attention", "attention_forward", "attention_backward"]


def _like_layout(t: torch.Tensor, shape, dtype) -> torch.Tensor:
    """Empty [b, h, s, d] tensor in t's physical layout: BSHD memory stays BSHD (no later copies)."""
    b, h, s, d = shape
    if t.stride(1) < t.stride(2) and h > 1 and s > 1:
        return torch.empty((b, s, h, d), dtype=dtype, device=t.device).transpose(1, 2)
    return torch.empty((b, h, s, d), dtype=dtype, device=t.device)


def _check_out(name, t, shape, dtype, device, reads=()):
    """A caller's output buffer: a tensor of this shape, dtype and device, one memory location per element,
    and sharing no memory with the ``reads`` ((name, tensor) pairs the call reads while it writes ``t``)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise InvalidArgumentError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise InvalidTypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device}, expected {device}")
    if _overlaps(t):
        raise InvalidArgumentError(
            f"{name} has overlapping memory (strides {tuple(t.stride())} for shape {list(t.shape)}, e.g. an "
            f".expand()ed tensor): an output needs one element per memory location; pass a fresh tensor")
    if reads:
        # tensors of different storages share no memory (the common case: one storage lookup each); in one
        # storage, their address spans decide
        storage = t.untyped_storage().data_ptr()
        for read_name, read in reads:
            if read is not None and read.untyped_storage().data_ptr() == storage and _meets(_span(t), read):
                raise InvalidArgumentError(
                    f"{name} shares memory with {read_name}: the kernels read {read_name} while they write {name} "
                    f"(other rows' reads would see written values); pass a separate buffer for {name}")


def _span(t: torch.Tensor):
    """(first, last) byte address of ``t``'s elements; None when it has none."""
    if t.numel() == 0:
        return None
    first = t.data_ptr()
    last = 0
    for size, stride in zip(t.shape, t.stride()):
        last += (size - 1) * stride
    return first, first + (last + 1) * t.element_size() - 1


def _meets(span, b: torch.Tensor) -> bool:
    """Whether ``b``'s address span meets ``span`` (views of one storage): without that they share no
    memory. (Views that interleave in one buffer, e.g. the q and out slots of one [b, s, 4, h, d] tensor, meet
    without sharing an element and count as sharing: the check stays a few integer operations.)"""
    other = _span(b)
    return span is not None and other is not None and span[0] <= other[1] and other[0] <= span[1]


def _overlaps(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` may share memory (a stride 0 from ``expand``, ``as_strided``): with
    the dims sorted by stride, each stride must step past everything the smaller ones reach. Dense
    tensors in any dim order (BSHD memory) and slices pass."""
    if t.is_contiguous() or t.numel() <= 1:
        return False
    reach = 0
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _stats_view(stats, p, device, name="stats", reads=()):
    """Accept stats as [b,h_q,s_q,1] or [b,h_q,s_q] fp32; return the [b,h_q,s_q] view (``reads``: as
    ``_check_out``'s, for a stats buffer the call writes)."""
    if not isinstance(stats, torch.Tensor):
        raise InvalidTypeError(f"{name} must be a float32 torch.Tensor [b, h_q, s_q, 1], got {type(stats).__name__}")
    if stats.dim() == 4 and stats.shape[-1] == 1:
        stats = stats[..., 0]
    _check_out(name, stats, (p.b, p.h_q, p.s_q), torch.float32, device, reads)
    return stats


@functools.lru_cache(maxsize=None)
def _gluon_kernels(what: str, *names: str):
    """The Gluon sm_90 modules ``backends.gluon.<name>`` (a tuple). On a Triton we do not support, None
    where they fail to import (the portable Triton kernels then run ``what``, with one warning); on a
    supported one the failure is raised, never hidden."""
    if what in _gluon_off:
        return None
    try:
        return tuple(importlib.import_module(f"{__package__}.backends.gluon.{name}") for name in names)
    except Exception as exc:  # noqa: BLE001 - an experimental dialect may be missing or changed
        if compat.SUPPORTED:
            raise
        _turn_gluon_off(what, exc)
        return None


_gluon_off: set = set()      # passes ("forward", "backward") whose Gluon kernels failed on an unsupported Triton


def _turn_gluon_off(what: str, exc: BaseException) -> None:
    _gluon_off.add(what)
    _replay.clear_all()         # a replay would launch the Gluon kernels again
    compat.warn_once(f"gluon-{what}", f"the Gluon {what} kernels failed on {compat.unsupported_note()} "
                                      f"({type(exc).__name__}: {str(exc)[:200]}); the portable Triton "
                                      "kernels run it from now on")


def _gluon_ran(what: str, launch) -> bool:
    """``launch()`` (which returns whether a Gluon kernel took the call). On a supported Triton its
    errors propagate (a test failure, never hidden); on another, a compile or launch error turns the
    Gluon kernels of ``what`` off for the process (one warning) and returns False, so the caller runs
    the portable kernels, which overwrite whatever the failed launch left."""
    if what in _gluon_off:
        return False
    if compat.SUPPORTED:
        return launch()
    try:
        return launch()
    except Exception as exc:  # noqa: BLE001
        _turn_gluon_off(what, exc)
        return False


# keys from which a causal backward takes the single-pass kernel (above: 4k and 16k gained, 2k lost)
_FUSED_CAUSAL_MIN_KEYS = 4096


def _run_gluon_backward(p, extras, pl, q, k, v, out, grad_out, lse, dq, dk, dv, deterministic=None,
                        dsink=None, replay_key=None) -> bool:
    """The Hopper backward when the Gluon dQ pass accepts the call: delta = rowsum(dO * O) (by the dQ
    pass under a band and no padding, by a separate pass otherwise), dQ, then dK/dV on the Gluon pass where it
    accepts the call, else on the Triton one (which reads this delta). False (nothing launched) when
    the Gluon dQ pass refuses. deterministic=False, no mask, d=128 (or d=64 from plan.GLUON_BWD_FUSED_MIN_WORK
    on, causal too): the single-pass backward (dQ reduced
    with TMA adds into fp32, so not bitwise reproducible) where it accepts the call; deterministic=None
    means torch.are_deterministic_algorithms_enabled(). A sink changes nothing in dQ, dK, dV (the lse
    includes it); its gradient (into ``dsink``) needs delta: the two passes share theirs, and beside the
    single-pass kernel (which keeps its delta to itself) the separate delta pass computes it once more
    (one read of O and dO: ~25 us against ~1.6 ms of backward at b2 h16 8k d128, so a sink keeps the
    single pass, bench/NOTES.md 54). deterministic=False: the kernel that computes delta also adds the
    sink's gradient into dsink with atomics (``_sink_acc``), no launch of its own; deterministic:
    ``cpu.sink_grad`` from delta (a few torch kernels, bitwise reproducible). replay_key: the single pass, when it
    runs with no sink, is recorded for a replay under this key (:func:`_replay_key`)."""
    min_work = GLUON_BWD_FUSED_MIN_WORK.get(p.d)
    fused_only = min_work is not None
    # d=64: the single pass from that much work on, causal or not; otherwise the Triton pair (the Gluon two passes
    # lose to it there, plan._GLUON_BWD_DIMS). Checked first: the small calls are the host-bound ones
    if fused_only and p.b * p.h_q * p.s_q * p.s_kv // (2 if p.band is not None else 1) < min_work:
        return False
    mods = _gluon_kernels("backward", "bwd_dq_sm90", "bwd_dkdv_sm90", "bwd_fused_sm90")
    if mods is None:
        return False
    dq_pass, dkdv_pass, fused = mods
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    take = fused_only or p.band is None or p.s_kv >= _FUSED_CAUSAL_MIN_KEYS
    if not deterministic and take and fused.supports(p, q, k, v, grad_out, dq, dk, dv):
        # H100 (bench/gluon_fused_sweep.py, bench/GLUON_NOTES.md "Fused backward"): 1.15-1.25x the two
        # passes with no mask; under a causal mask 1.00 / 1.07x at 16k and 1.04 / 1.02x at GQA 4k (two
        # runs), 0.92 / 0.97x at 2k (which keeps the two passes); delta comes from the kernel that also
        # zeroes its fp32 dQ accumulator (out=). fused.supports refuses every band but causal.
        from .backends.triton.args import aligned
        out = aligned(out)
        if replay_key is not None and dsink is None and replay_key not in _backward_replays:
            _record_backward(replay_key, (q, k, v, out, grad_out, lse, dq, dk, dv), lambda: fused.scratch(p, q.device),
                             lambda dq_acc, delta: fused.launch_bwd_fused_sm90(p, q, k, v, grad_out, lse, delta, dq,
                                                                               dk, dv, out=out, dq_acc=dq_acc))
        else:
            fused.launch_bwd_fused_sm90(p, q, k, v, grad_out, lse, None, dq, dk, dv, out=out)
        if dsink is not None:
            # deterministic is False here: the delta pass adds the sink's gradient itself
            from .backends.triton.bwd import launch_delta
            delta = torch.empty((p.b * p.h_q, p.s_q), dtype=torch.float32, device=q.device)
            acc = _sink_acc(dsink)
            launch_delta(p, out, grad_out, delta, lse=lse, sink=extras["sink"], dsink=acc)
            if acc is not dsink:
                dsink.copy_(acc)
        return True
    if fused_only:
        return False
    opts = dict(slopes=extras["slopes"], seq_len_q=extras["seq_len_q"], seq_len_kv=extras["seq_len_kv"])
    # out is read with plain loads that assume a 16-byte aligned base (the others are TMA-checked)
    from .backends.triton.args import aligned
    out = aligned(out)
    # delta = rowsum(dO * O) by the dQ pass (WRITE_DELTA) only under a band: with no band every dQ
    # program has the same long loop, and computing delta in its prologue cost 3-9% of the pass (H100,
    # bench/gluon_dq_sweep.py --variants: 8k 624 -> 685 TFLOP/s reading it), so a separate
    # bandwidth-bound kernel is cheaper there; padded or not, a band takes WRITE_DELTA
    write_delta = p.band is not None and dq_pass.supports(p, q, k, v, grad_out, dq, out=out, **opts)
    if not (write_delta or dq_pass.supports(p, q, k, v, grad_out, dq, **opts)):
        return False
    delta = torch.empty((p.b * p.h_q, p.s_q), dtype=torch.float32, device=q.device)
    # the sink's gradient from the kernel that computes delta (atomics), unless deterministic
    acc = _sink_acc(dsink) if dsink is not None and not deterministic else None
    if not write_delta:
        from .backends.triton.bwd import launch_delta
        launch_delta(p, out, grad_out, delta, lse=lse, sink=extras["sink"], dsink=acc)
    dq_pass.launch_dq_sm90(p, q, k, v, grad_out, lse, delta, dq, out=out if write_delta else None,
                           sink=extras["sink"], dsink=acc if write_delta else None, **opts)
    if dkdv_pass.supports(p, q, k, v, grad_out, dk, dv, **opts):
        dkdv_pass.launch_dkdv_sm90(p, q, k, v, grad_out, lse, delta, dk, dv, **opts)
    else:
        from .backends.triton.bwd import launch_bwd
        launch_bwd(p, pl, q, k, v, out, grad_out, lse, extras, dq, dk, dv, False, delta=delta)
    if acc is not None:
        if acc is not dsink:
            dsink.copy_(acc)
    elif dsink is not None:
        dsink.copy_(cpu_backend.sink_grad(extras["sink"], lse, delta))
    return True


# the single-pass backward's launches by _replay_key (backends.replay): a repeat eager backward of one problem and
# tensor layout issues them again with its own tensors, skipping the routing, checks, descriptors and launch keys
_backward_replays = _replay.Cache()


def _replay_key(p, pl, deterministic, q, k, v, out, grad_out, stats):
    """The key of an autograd backward's replay: what its route and every launch argument besides the tensors'
    addresses depend on (the problem, its plan, the deterministic flag, the device, each tensor's strides; the
    dtypes are the problem's and the stats' fp32, grad_out's is out's under autograd), or None when a tensor is not
    16-byte aligned (the launch keys tell alignment per tensor, this key does not)."""
    if (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | grad_out.data_ptr() | stats.data_ptr()) % 16:
        return None
    return (p, pl, deterministic, q.device.index, q.stride(), k.stride(), v.stride(), out.stride(), grad_out.stride(),
            stats.stride())


def _record_backward(key, roles, scratch, run) -> None:
    """A backward route's launches, ``run(*scratch())`` (launches only: nothing else on the GPU), kept as a replay for
    ``key`` once they all took the launch caches' cached path (a key's first call compiles or looks its kernels up
    through the JIT: it is recorded on a later call). roles: (q, k, v, out, grad_out, lse, dq, dk, dv) as
    :func:`_run_backward` has them; its callers pass the stats in lse's role (the same address). The replay makes
    dq, dk, dv as :func:`_run_backward` does and the scratch with ``scratch()``."""
    from .backends.triton.launch import recording
    made = scratch()
    with recording() as recorded:
        run(*made)
    if recorded.complete:
        def make(q, k, v, _out, _grad_out, _stats):
            return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)) + scratch()
        _backward_replays.keep(key, _replay.build(recorded, roles + made, make))


def _sink_acc(dsink):
    """The buffer the kernels add the sink's gradient into with atomics (fp32 contiguous [h_q], zeroed
    here): ``dsink`` itself when contiguous (autograd's, the Graph door's), else a fresh one the caller
    copies into dsink afterwards. One memset in place of ``cpu.sink_grad``'s ~7 small kernels (~20-30 us
    beside a ~0.86 ms backward at b4 h32 2k d128 causal on the H100, issue 26)."""
    if dsink.is_contiguous():
        return dsink.zero_()
    return torch.zeros(dsink.shape, dtype=torch.float32, device=dsink.device)


def _run_packed_gluon(p, q4, k4, v4, o4, lse4, cu_seqlens_q, cu_seqlens_kv=None, **lens) -> bool:
    """The Gluon sm_90 forward's packed mode (``fwd_sm90`` [Note] packed queries) where it takes the call, for
    the packed doors (kvcache's packed queries, varlen's packed queries and keys): p is the padded problem the
    packed batch stands for (per-sequence lengths, p.s_q / p.s_kv the longest); q4 / o4 packed [1, h_q,
    total_q, d] views, k4 / v4 the cache or packed [1, h_kv, total_k, d] keys, lse4 fp32 [1, h_q, total_q] or
    None; lens: ``fwd_sm90.supports_packed``'s (slopes, sink, seq_len_kv, page tables). False (nothing done)
    where its plan or ``supports_packed`` refuses (not Hopper, softcap, dropout, strides TMA cannot read ...)."""
    if not q4.is_cuda or not plan(p, "triton").fwd_gluon:
        return False
    gluon = _gluon_kernels("forward", "fwd_sm90")
    if gluon is None:
        return False
    fwd_sm90 = gluon[0]
    if not fwd_sm90.supports_packed(p, q4, k4, v4, o4, cu_seqlens_q, cu_seqlens_kv, **lens):
        return False
    return _gluon_ran("forward", lambda: fwd_sm90.launch_fwd_sm90(
        p, q4, k4, v4, o4, lse4, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, **lens) is not None)


def _run_forward(p, extras, pl, q, k, v, out, lse):
    if pl.backend == "cpu":
        cpu_backend.forward(p, q, k, v, extras, out, lse)
        return
    from .backends.triton import decode
    if decode.decode_supports(p) and decode.decode_rows_fit(p.s_q, p.group):
        # few query rows per kv head (decode): the split-KV kernel packs a GQA group into one tile
        decode.launch_decode_problem(p, extras, q, k, v, out, lse)
        return
    if pl.fwd_gluon:
        # Hopper: the warp-specialized Gluon kernel when the tensors suit TMA (else the portable one)
        gluon = _gluon_kernels("forward", "fwd_sm90")
        fwd_sm90 = gluon[0] if gluon is not None else None
        lens = dict(slopes=extras["slopes"], seq_len_q=extras["seq_len_q"], seq_len_kv=extras["seq_len_kv"],
                    sink=extras["sink"], page_table_k=extras["page_table_k"], page_table_v=extras["page_table_v"])
        if fwd_sm90 is not None and fwd_sm90.supports(p, q, k, v, out, **lens) and _gluon_ran(
                "forward", lambda: fwd_sm90.launch_fwd_sm90(p, q, k, v, out, lse, **lens) or True):
            return
    from .backends.triton.fwd import launch_fwd
    launch_fwd(p, pl.fwd, q, k, v, out, lse, extras)


def attention_forward(q, k, v, *, attn_scale=None, causal=False, causal_alignment="top_left", window=None,
                      seq_len_q=None, seq_len_kv=None, attn_bias=None, alibi=False, softcap=0.0,
                      dropout_p=0.0, dropout_seed=0, dropout_offset=0, page_table_k=None, page_table_v=None,
                      return_stats=False, validate=True, backend="auto", out=None, stats_out=None, sink=None,
                      _keep_problem=None, _before_run=None):
    """Forward only, no autograd. Arguments as :func:`attention` (``validate`` and ``sink`` included).

    Returns ``(out, stats)``: out [b,h_q,s_q,d_v] in q.dtype (written into ``out`` when
    given), stats fp32 [b,h_q,s_q,1] natural-log log-sum-exp (None unless
    ``return_stats`` or ``stats_out``). ``out`` / ``stats_out`` must not share memory with q, k or v
    (refused by name: every row reads K and V while rows of the output are written).
    """
    forward_key = None
    if (seq_len_q is None and seq_len_kv is None and attn_bias is None and alibi is False
            and type(dropout_p) in _PLAIN_OPTION and not dropout_p
            and page_table_k is None and page_table_v is None and out is None and stats_out is None and sink is None
            and _replay.ENABLED and type(q) is torch.Tensor and q.is_cuda):
        # a repeat of a replayed plain call (every training step, every layer): its launches, nothing else
        forward_key = _forward_key(q, k, v, attn_scale, causal, causal_alignment, window, softcap, return_stats,
                                   validate, backend)
        kept = _forward_replays.get(forward_key)
        if kept is not None:
            replay, (p, extras, pl) = kept
            made = replay(q, k, v)
            if made is not None:
                if _keep_problem is not None:
                    _keep_problem.extend((p, dict(extras), pl))     # an unshared extras, as make_problem's memo
                return made[0], (made[1] if return_stats else None)
    p, extras = make_problem(q, k, v, attn_scale=attn_scale, causal=causal, causal_alignment=causal_alignment,
                             window=window, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, attn_bias=attn_bias,
                             alibi=alibi, softcap=softcap, dropout_p=dropout_p, dropout_seed=dropout_seed,
                             dropout_offset=dropout_offset, page_table_k=page_table_k, page_table_v=page_table_v,
                             sink=sink, validate=validate)
    pl = plan(p, backend)
    if _keep_problem is not None:
        _keep_problem.extend((p, extras, pl))
    if _before_run is not None:
        _before_run(p, extras, pl)
    shape_o = (p.b, p.h_q, p.s_q, p.d_v)
    if out is None:
        out = _like_layout(q, shape_o, q.dtype)
    else:
        _check_out("out", out, shape_o, q.dtype, q.device, reads=(("q", q), ("k", k), ("v", v)))
    if stats_out is not None:
        lse = _stats_view(stats_out, p, q.device, "stats_out", reads=(("q", q), ("k", k), ("v", v), ("out", out)))
        stats = stats_out
    elif return_stats:
        stats = torch.empty((p.b, p.h_q, p.s_q, 1), dtype=torch.float32, device=q.device)
        lse = stats[..., 0]
    else:
        stats = lse = None
    if p.b > 0 and p.s_q > 0:       # an empty output has nothing to launch (no kernel takes an empty grid)
        if p.s_kv == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))     # every row saw no key: the log of an empty sum
                if p.has_sink:               # ... but for the sink's term (rows past seq_len_q excepted)
                    _fill_sink_lse(lse, extras)
        elif forward_key is not None and forward_key not in _forward_replays:
            _record_forward(forward_key, (p, extras, pl), q, k, v, out, stats)
        else:
            _run_forward(p, extras, pl, q, k, v, out, lse)
    return out, stats


_forward_replays = _replay.Cache()


def _forward_key(q, k, v, attn_scale, causal, causal_alignment, window, softcap, return_stats, validate, backend):
    """The key of a plain forward's replay (no lengths, bias, ALiBi, dropout, pages, sink or caller's buffers):
    what make_problem, the plan and every launch argument besides the tensors' addresses depend on (shapes,
    strides, dtypes and devices of q, k, v; the scalar options), or None where a replay must not be kept: a
    tensor not 16-byte aligned (the launch keys tell alignment per tensor, this key does not), an option that is
    not a plain scalar (a tensor's hash is its identity, not its value)."""
    if (type(k) is not torch.Tensor or type(v) is not torch.Tensor or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16
            or type(attn_scale) not in _PLAIN_OPTION or type(softcap) not in _PLAIN_OPTION
            or type(causal) is not bool or not (window is None or type(window) is tuple)):
        return None
    # the options' types too: True == 1 == 1.0 as keys, but validation may take one and refuse another
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.get_device(), k.get_device(), v.get_device(), attn_scale, type(attn_scale), causal, causal_alignment,
           window, None if window is None else tuple(map(type, window)), softcap, type(softcap), bool(return_stats),
           validate, type(validate), backend)
    try:
        hash(key)
    except TypeError:               # an unhashable window entry: the ordinary path validates (and rejects) it
        return None
    return key


_PLAIN_OPTION = (type(None), bool, int, float)


def _record_forward(key, problem, q, k, v, out, stats) -> None:
    """The forward's launches (``_run_forward`` of problem = (p, extras, pl)), kept as a replay for ``key`` with
    the problem (autograd's context takes it from there) once they all took the launch caches' cached path, outside
    CUDA-graph captures. Roles: q, k, v, out, the stats when asked for, and the Gluon forward's tile counter of the
    current stream (a persistent buffer: ``make`` asks for the calling stream's)."""
    from .backends.triton.launch import recording
    p, extras, pl = problem
    lse = stats[..., 0] if stats is not None else None
    if torch.cuda.is_current_stream_capturing():
        # a capture's first launch on a stream with no tile counter takes another grid (fwd_sm90._tile_counter):
        # recorded here, that grid would stay with every later eager call of the key
        _run_forward(p, extras, pl, q, k, v, out, lse)
        return
    gluon = _gluon_kernels("forward", "fwd_sm90") if pl.fwd_gluon else None
    tile_counter = gluon[0]._tile_counter if gluon is not None else None    # of the current stream, or None
    counter = tile_counter(q.device) if tile_counter is not None else None
    with recording() as recorded:
        _run_forward(p, extras, pl, q, k, v, out, lse)
    if recorded.complete:
        shape_o, shape_stats = tuple(out.shape), None if stats is None else tuple(stats.shape)
        dtype, device = out.dtype, out.device

        def make(q, _k, _v):
            counter_now = tile_counter(device) if counter is not None else None
            if (counter_now is None) != (counter is None):
                return None          # capturing a CUDA graph on a stream with no counter yet: the ordinary path
            made = (_like_layout(q, shape_o, dtype),)
            if shape_stats is not None:
                made += (torch.empty(shape_stats, dtype=torch.float32, device=device),)
            return made + ((counter_now,) if counter_now is not None else ())
        roles = (q, k, v, out) + ((stats,) if stats is not None else ()) + ((counter,) if counter is not None else ())
        replay = _replay.build(recorded, roles, make)
        _forward_replays.keep(key, None if replay is None else (replay, problem))


def _fill_sink_lse(lse, extras):
    """lse [b, h_q, s_q] of rows that see no key at all (s_kv = 0) with a sink: the sink's logit (rows
    past seq_len_q keep -inf)."""
    b, h_q, s_q = lse.shape
    sink = extras["sink"].view(1, h_q, 1).expand(b, h_q, s_q)
    lens = extras["seq_len_q"]
    if lens is not None:
        rows = torch.arange(s_q, device=lse.device).view(1, 1, s_q)
        sink = torch.where(rows < lens.clamp(0, s_q).view(b, 1, 1), sink, float("-inf"))
    lse.copy_(sink)


def attention_backward(q, k, v, out, grad_out, stats, *, attn_scale=None, causal=False,
                       causal_alignment="top_left", window=None, seq_len_q=None, seq_len_kv=None,
                       attn_bias=None, alibi=False, softcap=0.0, dropout_p=0.0, dropout_seed=0,
                       dropout_offset=0, deterministic=None, validate=True, backend="auto", dq=None, dk=None,
                       dv=None, need_dbias=False, sink=None, dsink=None):
    """Gradients of attention from the forward's output and stats, no autograd.

    q, k, v, out as in :func:`attention`; grad_out like out; stats fp32
    [b,h_q,s_q,1] (the forward's). Returns ``(dq, dk, dv, dbias)``: dq/dk/dv in
    the layout of q/k/v (written into dq/dk/dv when given); dbias fp32 in the
    shape of ``attn_bias`` (summed over its broadcast dims) when ``need_dbias``,
    else None. deterministic, validate: as in :func:`attention`.

    With ``sink`` (float [h_q], the forward's; its stats include the sink) the result has a fifth
    element, dsink fp32 [h_q] (written into ``dsink`` when given): ``-sum_rows exp(sink - lse) * delta``.
    """
    check_deterministic(deterministic)
    p, extras = make_problem(q, k, v, attn_scale=attn_scale, causal=causal, causal_alignment=causal_alignment,
                             window=window, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, attn_bias=attn_bias,
                             alibi=alibi, softcap=softcap, dropout_p=dropout_p, dropout_seed=dropout_seed,
                             dropout_offset=dropout_offset, sink=sink, validate=validate)
    pl = plan(p, backend)
    if need_dbias and p.bias != "float":
        raise InvalidArgumentError(
            "need_dbias=True needs a float attn_bias (its gradient); got "
            + ("no attn_bias" if p.bias is None else "a bool attn_bias (a mask has no gradient)"))
    shape_o = (p.b, p.h_q, p.s_q, p.d_v)
    _check_out("out", out, shape_o, q.dtype, q.device)
    _check_out("grad_out", grad_out, shape_o, q.dtype, q.device)
    lse = _stats_view(stats, p, q.device)
    reads = (("q", q), ("k", k), ("v", v), ("out", out), ("grad_out", grad_out), ("stats", lse),
             ("attn_bias", attn_bias if isinstance(attn_bias, torch.Tensor) else None))
    for name, given, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if given is not None:
            _check_out(name, given, like.shape, like.dtype, like.device, reads)
    if not p.has_sink:
        return _run_backward(p, extras, pl, q, k, v, out, grad_out, lse, dq, dk, dv, need_dbias, deterministic)
    if dsink is None:
        dsink = torch.empty((p.h_q,), dtype=torch.float32, device=q.device)
    else:
        _check_out("dsink", dsink, (p.h_q,), torch.float32, q.device, reads)
    return _run_backward(p, extras, pl, q, k, v, out, grad_out, lse, dq, dk, dv, need_dbias, deterministic,
                         dsink) + (dsink,)


def _run_backward(p, extras, pl, q, k, v, out, grad_out, lse, dq=None, dk=None, dv=None, need_dbias=False,
                  deterministic=None, dsink=None, replay_key=None):
    """The backward once inputs are validated (autograd calls this directly with the forward's problem).
    dsink: fp32 [h_q] written with the sink's gradient (problems with a sink; None skips it). replay_key: see
    :func:`_run_gluon_backward`."""
    # gradients in the layout of their inputs (empty_like keeps the strides of a dense tensor, e.g.
    # BSHD memory, in one call: eager backward at d=64 is host-bound)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    grads = (dq, dk, dv)
    need_dbias = need_dbias and p.bias == "float"
    dbias_full = None
    if p.b == 0 or p.s_q == 0 or p.s_kv == 0:
        # no score at all: every gradient is 0 (empty tensors when b == 0), as SDPA gives
        for t in grads:
            t.zero_()
        if dsink is not None:
            # s_kv = 0 with a sink: p_sink = 1 on every row but delta = rowsum(dO * 0) = 0
            dsink.zero_()
        if need_dbias:
            dbias_full = torch.zeros((p.b, p.h_q, p.s_q, p.s_kv), dtype=torch.float32, device=q.device)
    elif pl.backend == "cpu":
        dbias_full = cpu_backend.backward(p, q, k, v, out, grad_out, lse, extras, dq, dk, dv, need_dbias, dsink)
    elif not (pl.bwd_gluon and not need_dbias
                   and _gluon_ran("backward", lambda: _run_gluon_backward(p, extras, pl, q, k, v, out, grad_out,
                                                                          lse, dq, dk, dv, deterministic, dsink,
                                                                          replay_key))):
        from .backends.triton.bwd import launch_bwd
        delta = None
        if dsink is not None:
            # the dQ pass writes delta = rowsum(dO * O) here; the sink's gradient reads it
            delta = torch.empty((p.b * p.h_q, p.s_q), dtype=torch.float32, device=q.device)
        if replay_key is not None and dsink is None and not need_dbias and replay_key not in _backward_replays:
            # the portable pair (small d=64 calls, the most host-bound): its delta is the replay's scratch
            _record_backward(replay_key, (q, k, v, out, grad_out, lse, dq, dk, dv),
                             lambda: (torch.empty((p.b * p.h_q, p.s_q), dtype=torch.float32, device=q.device),),
                             lambda scratch_delta: launch_bwd(p, pl, q, k, v, out, grad_out, lse, extras, dq, dk, dv,
                                                              False, delta_out=scratch_delta))
        else:
            dbias_full = launch_bwd(p, pl, q, k, v, out, grad_out, lse, extras, dq, dk, dv, need_dbias,
                                    delta_out=delta)
        if dsink is not None:
            dsink.copy_(cpu_backend.sink_grad(extras["sink"], lse, delta))
    dbias = _reduce_to_shape(dbias_full, p.bias_shape) if need_dbias else None
    return dq, dk, dv, dbias


def _reduce_to_shape(full: torch.Tensor, shape) -> torch.Tensor:
    """Sum a [b,h,s_q,s_kv] gradient over the dims the bias was broadcast along."""
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    dims = [i for i, (n, m) in enumerate(zip(shape4, full.shape)) if n == 1 and m != 1]
    if dims:
        full = full.sum(dim=dims, keepdim=True)
    return full.reshape(shape)


_compiled_ahead: set = set()     # problems whose backward kernels were compiled ahead in this process


def _compile_backward_ahead(p, extras, pl, q, k, v, deterministic) -> None:
    """The first forward of a problem under autograd starts compiling its backward's kernels on the compile
    threads (``backends.triton.launch.compiling_ahead``) before its own kernel compiles, so a process's
    first training step compiles its kernels side by side, not one after another. The backward runs on
    placeholders inside ``compiling_ahead``: nothing is launched, nothing written. One try per problem
    geometry; later calls pay one set lookup."""
    if pl.backend != "triton" or not q.is_cuda or p.bias == "float":
        return       # the CPU path and the interpreter compile nothing; a float bias's gradient is a big buffer
    key = (p.static_key(), p.b, p.h_q, p.h_kv, p.s_q, p.s_kv, q.stride(1) < q.stride(2), deterministic)
    if key in _compiled_ahead:
        return
    if len(_compiled_ahead) > 4096:
        _compiled_ahead.clear()
    _compiled_ahead.add(key)
    if torch.cuda.is_current_stream_capturing():
        return       # the placeholders' allocations and fills would join the user's graph
    # the placeholders (out, dO, dQ, dK, dV) cost about twice the inputs for a moment: only where that is
    # a small part of the free memory, so a model sized to the card does not run out on its first step
    placeholder_bytes = 2 * sum(t.numel() * t.element_size() for t in (q, k, v))
    if placeholder_bytes > torch.cuda.mem_get_info(q.device)[0] // 4:
        return
    from .backends.triton.launch import compiling_ahead
    out = _like_layout(q, (p.b, p.h_q, p.s_q, p.d_v), q.dtype)
    lse = torch.empty((p.b, p.h_q, p.s_q), dtype=torch.float32, device=q.device)
    # with a sink, a dsink too: the backward's kernels then are its HAS_SINK variants (they fold dsink in)
    dsink = torch.empty((p.h_q,), dtype=torch.float32, device=q.device) if p.has_sink else None
    with compiling_ahead():
        _run_backward(p, extras, pl, q, k, v, out, torch.empty_like(out), lse, deterministic=deterministic,
                      dsink=dsink)


class _Attention(torch.autograd.Function):
    """Eager autograd: saves out and stats, never recomputes the forward."""

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, opts, deterministic=None, sink=None):
        kept = []
        ahead = None
        if any(ctx.needs_input_grad[:4]) or (sink is not None and ctx.needs_input_grad[6]):
            ahead = functools.partial(_compile_backward_ahead, q=q, k=k, v=v, deterministic=deterministic)
        out, stats = attention_forward(q, k, v, attn_bias=attn_bias, return_stats=True, _keep_problem=kept,
                                       _before_run=ahead, sink=sink, **opts)
        ctx.save_for_backward(q, k, v, out, stats, attn_bias, sink)
        ctx.problem = tuple(kept)        # validated once: the backward skips make_problem
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(stats)
        # no zero-filled gradient for the stats output on every backward (a kernel launch and an
        # allocation per step); an unused output then arrives as None
        ctx.set_materialize_grads(False)
        return out, stats

    @staticmethod
    def backward(ctx, grad_out, _grad_stats):
        q, k, v, out, stats, attn_bias, sink = ctx.saved_tensors
        if grad_out is None:         # the output took no part in the loss
            return None, None, None, None, None, None, None
        p, extras, pl = ctx.problem
        need_dbias = attn_bias is not None and ctx.needs_input_grad[3]
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        deterministic = ctx.deterministic
        replay_key = None
        if attn_bias is None and sink is None and not p.has_dropout and q.is_cuda and _replay.ENABLED:
            # a repeat of a replayed problem and layout: its launches again, nothing else (_fused_backward_recorded);
            # stats in the role of lse, its [..., 0] view: the same address, and launches take addresses
            if deterministic is None:
                deterministic = torch.are_deterministic_algorithms_enabled()
            replay_key = _replay_key(p, pl, deterministic, q, k, v, out, grad_out, stats)
            replay = _backward_replays.get(replay_key)
            if replay is not None:
                made = replay(q, k, v, out, grad_out, stats)
                if made is not None:
                    return made[0], made[1], made[2], None, None, None, None
        lse = stats[..., 0]
        dsink = None
        if sink is not None:
            dsink = torch.empty((p.h_q,), dtype=torch.float32, device=q.device)
        dq, dk, dv, dbias = _run_backward(p, extras, pl, q, k, v, out, grad_out, lse, need_dbias=need_dbias,
                                          deterministic=deterministic, dsink=dsink, replay_key=replay_key)
        if dbias is not None:
            dbias = dbias.to(attn_bias.dtype)
        if dsink is not None:
            dsink = dsink.to(sink.dtype) if ctx.needs_input_grad[6] else None
        return dq, dk, dv, dbias, None, None, dsink


def attention(q, k, v, *, attn_scale=None, causal=False, causal_alignment="top_left", window=None,
              seq_len_q=None, seq_len_kv=None, attn_bias=None, alibi=False, softcap=0.0, dropout_p=0.0,
              dropout_seed=None, dropout_offset=0, deterministic=None, return_stats=False,
              validate=True, backend="auto", out=None, sink=None, descale_q=None, descale_k=None, descale_v=None,
              scale_s=None, scale_o=None, out_dtype=None):
    r"""Fused scaled-dot-product attention: ``softmax(scale * q @ k^T + bias [+ ALiBi], masked) @ v``.

    O(s) memory (the FlashAttention algorithm), forward and backward, fp16 / bf16 /
    fp32 (fp64 on the CPU path). Differentiable in q, k, v, a float ``attn_bias`` and ``sink``.

    Args:
        q: ``[b, h_q, s_q, d]``; any strides (BSHD memory as ``x.transpose(1, 2)`` works
            without a copy).
        k: ``[b, h_kv, s_kv, d]``. ``h_q`` must be a multiple of ``h_kv``: query head ``i``
            reads key/value head ``i // (h_q // h_kv)`` (GQA; h_kv = 1 is MQA). With 6 query
            and 2 kv heads, query heads 0, 1, 2 read kv head 0 and 3, 4, 5 read kv head 1.
        v: ``[b, h_kv, s_kv, d_v]``; any ``d`` and ``d_v`` from 1 to 256 run the kernels, 257 to 1024
            the PyTorch path (one warning on a GPU; ``backend='triton'`` refuses them).
        attn_scale: multiplies ``q @ k^T``; default ``1 / sqrt(d)``.
        causal: keep key ``j`` for query ``i`` only when ``j <= i + off``.
        causal_alignment: ``"top_left"`` (off = 0, PyTorch's ``is_causal``, cuDNN's
            ``use_causal_mask``) or ``"bottom_right"`` (off = s_kv - s_q, FlashAttention's and
            cuDNN's ``use_causal_mask_bottom_right``). For s_q = 2, s_kv = 5 (1 = kept)::

                top_left      bottom_right
                1 0 0 0 0     1 1 1 1 0
                1 1 0 0 0     1 1 1 1 1

            The alignment applies to ``window`` too, and uses each sequence's own lengths
            when ``seq_len_q`` / ``seq_len_kv`` are given.
        window: ``(left, right)``: keep key ``j`` iff ``i + off - left <= j <= i + off + right``
            (inclusive); -1 or None is unbounded. ``causal=True`` caps ``right`` at 0.
        seq_len_q, seq_len_kv: int32 ``[b]`` or ``[b, 1, 1, 1]``: valid lengths per batch entry
            (padding masks). Rows past ``seq_len_q`` give output 0, stats -inf, gradient 0.
        attn_bias: added to the scaled scores; any shape broadcastable to ``[b, h_q, s_q, s_kv]``
            (strides 0 allowed). A bool tensor is a mask (True = keep), as in PyTorch's SDPA.
            A float bias with ``requires_grad`` gets its gradient (summed over broadcast dims).
        alibi: True for the ALiBi paper's slopes for ``h_q`` heads, or a float ``[h_q]`` tensor;
            adds ``slope_h * (j - i)`` (computed in the kernel, no bias tensor in memory).
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (Gemma 2), before bias.
        dropout_p: probability of dropping an attention probability (kept ones are scaled by
            ``1 / (1 - p)``). The mask is Philox keyed by (dropout_seed, dropout_offset, batch,
            head, row, col): reproducible and independent of tile sizes.
        dropout_seed: int; None draws one from torch's default generator per call.
        dropout_offset: int added to the Philox counter.
        deterministic: True: the backward is bitwise reproducible (no atomics). False allows the
            faster single-pass Hopper backward where it applies (no mask, d=128), whose dQ is
            reduced with atomic adds, and a sink's gradient summed with atomic adds by the Hopper
            backward's delta kernel (FlashAttention's and cuDNN's meaning of the flag; both
            default to False). None (default): ``torch.are_deterministic_algorithms_enabled()``,
            read when the backward runs.
        return_stats: also return the log-sum-exp of the scaled scores, fp32 ``[b, h_q, s_q, 1]``
            (natural log). A row that sees no key (past ``seq_len_q``, every key masked by the band,
            ``seq_len_kv = 0``, an all-False bool bias) has stats ``-inf``, the log of its empty sum,
            and output 0, as cuDNN (9.14 and later) writes. So (out, stats) pairs of split work
            merge exactly, an empty part weighing ``exp(-inf) = 0``; s_q = 4, s_kv = 2, bottom-right
            causal, keys split in halves A = [0], B = [1] (``x`` kept, ``.`` masked)::

                        whole     A     B      lse_A   lse_B   lse = logaddexp(lse_A, lse_B)
                row 0   . .       .     .      -inf    -inf    -inf    out 0
                row 1   . .       .     .      -inf    -inf    -inf    out 0
                row 2   x .       x     .      s20     -inf    s20     out = out_A
                row 3   x x       x     x      s30     s31     log(e^s30 + e^s31)
                out = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B   (0 where lse = -inf)

            The backward reads such rows' -inf as "no probability": their gradients are 0.
        validate: check that every ``seq_len_q`` entry is in ``[0, s_q]`` and every ``seq_len_kv``
            entry in ``[0, s_kv]``, raising a clear error. Cost on a GPU: a device-to-host sync per
            call (a few microseconds plus the wait for queued work); once per call, the backward
            reuses the forward's check. It is skipped while a CUDA graph is being captured. With
            ``validate=False`` nothing is checked on the device, and still nothing is read or
            written out of bounds: lengths are clamped into ``[0, s_q]`` / ``[0, s_kv]`` (use it to
            capture trusted metadata in a CUDA graph, or to avoid the sync).
        backend: ``"auto"`` (Triton on CUDA, the CPU path on CPU tensors), ``"triton"`` (on CPU
            tensors: Triton's interpreter, needs ``TRITON_INTERPRET=1``), ``"cpu"``.
        out: optional preallocated output ``[b, h_q, s_q, d_v]`` (not with autograd).
        sink: a learnable per-head sink logit, float ``[h_q]`` (gpt-oss's ``sinks``, FlashAttention-4's
            ``learnable_sink``, cuDNN's ``sink_token``), in the units of the scaled scores: every row
            of head h gets one more softmax term ``exp(sink_h)`` with no value row, so
            ``out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij))``. The stats include it
            (``lse = log(exp(sink_h) + sum_j exp(s_ij))``, as FlashAttention-4 and cuDNN return), so a
            row whose keys are all masked has output 0 and stats ``sink_h`` (rows past ``seq_len_q``
            keep -inf). Gets its gradient, ``dsink_h = -sum_rows exp(sink_h - lse) * rowsum(dO * O)``,
            eagerly and under ``torch.compile`` (the custom ops take it).
        descale_q, descale_k, descale_v, scale_s, scale_o, out_dtype: FP8 attention (cuDNN's ``sdpa_fp8``
            semantics) for ``torch.float8_e4m3fn`` / ``float8_e5m2`` q, k, v: the real values are
            ``q.float() * descale_q`` ... (per tensor, or per head); P is quantized with ``scale_s``; the
            output is ``O * scale_o`` in ``out_dtype`` (default bf16; a float8 type for FP8 output). Masks,
            GQA and stats as above; see :func:`fusedattn.fp8.attention_fp8` (forward only for FP8 tensors;
            its bf16 entry trains).

    Returns:
        ``out`` ``[b, h_q, s_q, d_v]`` in q's dtype and physical layout, or ``(out, stats)``.
        A row with no key to attend to gives output 0 (stats -inf), never NaN. Empty inputs are valid,
        as in SDPA: b = 0 or s_q = 0 gives an empty output, s_kv = 0 an output of zeros (stats -inf,
        gradients 0).

    Raises:
        ValueError / TypeError (``fusedattn.FusedAttnError``) naming the argument, what was
        given and what is allowed; ``fusedattn.NotSupportedError`` for a valid request this
        build cannot run.

    Example::

        >>> import torch, fusedattn
        >>> q = torch.randn(2, 8, 128, 64)
        >>> k = v = torch.randn(2, 2, 128, 64)
        >>> fusedattn.attention(q, k, v, causal=True).shape
        torch.Size([2, 8, 128, 64])
    """
    if _fp8.is_fp8(q) or _fp8.is_fp8(k) or _fp8.is_fp8(v) or any(
            x is not None for x in (descale_q, descale_k, descale_v)):
        _fp8._unsupported("attention", attn_bias=attn_bias, alibi=alibi, softcap=softcap, dropout_p=dropout_p,
                          sink=sink, out=out)
        return _fp8.attention_fp8(q, k, v, descale_q=descale_q, descale_k=descale_k, descale_v=descale_v,
                                  attn_scale=attn_scale, causal=causal, causal_alignment=causal_alignment,
                                  window=window, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, scale_s=scale_s,
                                  scale_o=scale_o, out_dtype=out_dtype, return_stats=return_stats, backend=backend)
    if scale_s is not None or scale_o is not None or out_dtype is not None:
        raise InvalidArgumentError("scale_s / scale_o / out_dtype are FP8 options; they need float8 q, k, v with "
                                   "descale_q / descale_k / descale_v")
    check_deterministic(deterministic)
    if dropout_p and dropout_seed is None:
        dropout_seed = int(torch.randint(0, 2 ** 62, (1,)).item())
    opts = dict(attn_scale=attn_scale, causal=causal, causal_alignment=causal_alignment, window=window,
                seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, alibi=alibi, softcap=softcap,
                dropout_p=dropout_p, dropout_seed=dropout_seed or 0, dropout_offset=dropout_offset,
                validate=validate, backend=backend)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, attn_bias, sink))
    if torch.compiler.is_compiling():
        from .ops import attention_op
        out_t, stats = attention_op(q, k, v, attn_bias, opts, deterministic, sink)
        if out is not None:
            out.copy_(out_t)
            out_t = out
    elif needs_grad:
        if out is not None:
            raise InvalidArgumentError("out= cannot be used with autograd (inputs require grad)")
        out_t, stats = _Attention.apply(q, k, v, attn_bias, opts,
                                        None if deterministic is None else bool(deterministic), sink)
    else:
        out_t, stats = attention_forward(q, k, v, attn_bias=attn_bias, return_stats=return_stats, out=out,
                                         sink=sink, **opts)
    return (out_t, stats) if return_stats else out_t
