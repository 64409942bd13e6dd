"""Packed variable-length batches (THD): ``attention_varlen``.

Sequences of different lengths are stored back to back, ``q [total_q, h_q, d]``,
``k [total_kv, h_kv, d]``, ``v [total_kv, h_kv, d_v]``, sequence ``i`` being rows
``cu_seqlens_q[i] : cu_seqlens_q[i + 1]`` (FlashAttention's ``flash_attn_varlen_func``
layout; cuDNN's ragged offsets are the same offsets times the row stride).

The Triton kernels read the offsets (``VARLEN`` switch of the forward and backward
kernels) so nothing is padded in memory; on Hopper the forward runs on the Gluon kernel's packed mode
where its plan takes the problem (``backends/gluon/fwd_sm90.py`` [Note] packed queries). The result equals attention on the same
sequences padded to ``max_seqlen_q`` / ``max_seqlen_kv`` with ``seq_len_q`` /
``seq_len_kv`` masks, dropout mask included; the CPU path computes exactly that.
"""
from __future__ import annotations

import dataclasses

import torch

from . import functional
from .plan import plan
from .problem import (InvalidArgumentError, InvalidTypeError, NotSupportedError, alibi_slopes_2d, check_device_type,
                      make_problem)

__all__ = ["attention_varlen"]


def _cu(name, t, device):
    """Offsets as the kernels read them: int32 [batch + 1]. This door also takes int64 (PyTorch's default
    integer, e.g. ``torch.cumsum`` of lengths) and converts; FlashAttention's door requires int32, as
    FlashAttention does. The values are checked before the conversion (``_check_offsets``, under validate),
    so an offset past int32 is named rather than wrapped."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 1 or t.numel() < 2:
        raise InvalidTypeError(f"{name} must be an int32 (or int64) tensor [batch + 1] of cumulative offsets, got "
                               f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device} but q is on {device}")
    return t.to(torch.int32).contiguous()


def _check_offsets(name, cu, total, max_len):
    """Host check (one sync): starts at 0, non-decreasing, ends within the tensor, lengths <= max."""
    c = cu.cpu().long()
    lens = c[1:] - c[:-1]
    if c[0] != 0 or (lens < 0).any():
        raise InvalidArgumentError(f"{name} must start at 0 and be non-decreasing, got {c.tolist()[:16]}")
    if c[-1] > total:
        raise InvalidArgumentError(f"{name}[-1] = {int(c[-1])} exceeds the {total} rows of the packed tensor")
    if lens.max() > max_len:
        raise InvalidArgumentError(f"a sequence of {int(lens.max())} rows exceeds max_seqlen = {max_len} ({name})")


def make_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, validate=True, **opts):
    """Validate packed inputs; returns (problem, extras, q4, k4, v4): 4-D [1, h, total, d] views for the kernels."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise InvalidArgumentError(f"{name} must be 3-D packed [total, heads, head_dim], got "
                                       f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    check_device_type(q.device)
    for name in ("attn_bias", "seq_len_q", "seq_len_kv"):
        if opts.get(name) is not None:
            raise NotSupportedError(f"{name} with packed variable-length batches is not supported")
    cu_q = _cu("cu_seqlens_q", cu_seqlens_q, q.device)
    cu_kv = _cu("cu_seqlens_kv", cu_seqlens_kv, q.device)
    if cu_q.numel() != cu_kv.numel():
        raise InvalidArgumentError(f"cu_seqlens_q has {cu_q.numel()} entries but cu_seqlens_kv has {cu_kv.numel()}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise InvalidArgumentError(f"{name} must be an int >= 0, got {m!r}")
    if validate:
        # the caller's values (int64 ones before their conversion): within the tensors, hence within int32
        _check_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        _check_offsets("cu_seqlens_kv", cu_seqlens_kv, k.shape[0], max_seqlen_kv)
    q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
    nseq = cu_q.numel() - 1
    slopes = None
    if isinstance(opts.get("alibi"), torch.Tensor):
        # [h_q] or [nseq, h_q]: checked against the sequence count (make_problem sees a batch of 1)
        slopes = alibi_slopes_2d(opts["alibi"], nseq, q.shape[1], q.device)
        opts = dict(opts, alibi=slopes[0] if nseq else slopes.new_zeros(q.shape[1]))
    p, extras = make_problem(q4, k4, v4, **opts)
    p = dataclasses.replace(p, b=nseq, s_q=max_seqlen_q, s_kv=max_seqlen_kv, varlen=True)
    if extras["slopes"] is not None:
        # per sequence: the kernels read slopes[sequence, head]
        extras["slopes"] = slopes if slopes is not None else extras["slopes"][0].expand(nseq, p.h_q)
    extras.update(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    return p, extras, q4, k4, v4


def _spans(cu, total, s):
    """(start, length) of each sequence, clamped as the kernels clamp them (``validate=False`` offsets that
    decrease or run past the tensor): the start into [0, total], the length into [0, min(s, total - start)]."""
    c = cu.cpu().tolist()
    spans = []
    for i in range(len(c) - 1):
        start = min(max(c[i], 0), total)
        spans.append((start, max(0, min(c[i + 1] - c[i], s, total - start))))
    return spans


def _pad(x, cu, b, s):
    """[total, h, d] -> [b, h, s, d] zero-padded, and the lengths."""
    spans = _spans(cu, x.shape[0], s)
    out = x.new_zeros((b, s) + tuple(x.shape[1:]))
    for i, (start, n) in enumerate(spans):
        out[i, :n] = x[start:start + n]
    lens = torch.tensor([n for _, n in spans], dtype=torch.int32, device=x.device)
    return out.transpose(1, 2), lens


def _unpad(x, cu, total):
    """[b, h, s, ...] -> [total, h, ...]."""
    out = x.new_zeros((total, x.shape[1]) + tuple(x.shape[3:]))
    for i, (start, n) in enumerate(_spans(cu, total, x.shape[2])):
        out[start:start + n] = x[i, :, :n].transpose(0, 1)
    return out


def varlen_forward(p, extras, pl, q, k, v, q4, k4, v4):
    """out [total_q, h_q, d_v], stats fp32 [h_q, total_q]."""
    out = q.new_empty((q.shape[0], p.h_q, p.d_v))
    stats = torch.empty((p.h_q, q.shape[0]), dtype=torch.float32, device=q.device)
    if pl.backend == "cpu":
        qp, lq = _pad(q, extras["cu_seqlens_q"], p.b, p.s_q)
        kp, lkv = _pad(k, extras["cu_seqlens_kv"], p.b, p.s_kv)
        vp, _ = _pad(v, extras["cu_seqlens_kv"], p.b, p.s_kv)
        # lq / lkv come from the offsets (checked by make_varlen_problem unless validate=False): no second sync
        o, st = functional.attention_forward(qp, kp, vp, seq_len_q=lq, seq_len_kv=lkv, return_stats=True,
                                             backend="cpu", validate=False, **_opts_of(p, extras))
        out.copy_(_unpad(o, extras["cu_seqlens_q"], q.shape[0]))
        stats.copy_(_unpad(st[..., 0].unsqueeze(-1), extras["cu_seqlens_q"], q.shape[0])[..., 0].T)
    else:
        o4, lse4 = out.unsqueeze(0).transpose(1, 2), stats.unsqueeze(0)     # [1, h, total, d_v], [1, h, total]
        if not _gluon_packed_forward(p, extras, q4, k4, v4, o4, lse4):
            from .backends.triton.fwd import launch_fwd
            launch_fwd(p, pl.fwd, q4, k4, v4, o4, lse4, extras)
    return out, stats


def _gluon_packed_forward(p, extras, q4, k4, v4, o4, lse4) -> bool:
    """The forward on the Gluon sm_90 kernel's packed mode (``fwd_sm90`` [Note] packed queries, packed keys
    too) where it takes the call: Hopper, a head dim and features of its plan (no dropout, no softcap); each
    sequence read and written in place by its offsets, as the Triton kernel's VARLEN switch. False (nothing
    done) elsewhere. q4 / k4 / v4 / o4: [1, h, total, d] views, lse4 fp32 [1, h_q, total_q]."""
    if not q4.is_cuda or p.has_dropout:
        return False
    # the padded batch the packed one stands for: per-sequence lengths from the offsets
    padded = dataclasses.replace(p, varlen=False, has_seq_len_q=True, has_seq_len_kv=True)
    return functional._run_packed_gluon(padded, q4, k4, v4, o4, lse4, extras["cu_seqlens_q"],
                                        extras["cu_seqlens_kv"], slopes=extras["slopes"], sink=extras["sink"])


def varlen_backward(p, extras, pl, q, k, v, out, grad_out, stats):
    """(dq, dk, dv) like q, k, v, and dsink fp32 [h_q] (None without a sink)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dsink = None
    if pl.backend == "cpu":
        cq, ckv = extras["cu_seqlens_q"], extras["cu_seqlens_kv"]
        qp, lq = _pad(q, cq, p.b, p.s_q)
        kp, lkv = _pad(k, ckv, p.b, p.s_kv)
        vp, _ = _pad(v, ckv, p.b, p.s_kv)
        op, _ = _pad(out, cq, p.b, p.s_q)
        gp, _ = _pad(grad_out, cq, p.b, p.s_q)
        sp, _ = _pad(stats.T.unsqueeze(-1), cq, p.b, p.s_q)      # [b, h, s, 1]
        g = functional.attention_backward(qp, kp, vp, op, gp, sp.contiguous(), seq_len_q=lq, seq_len_kv=lkv,
                                          backend="cpu", validate=False, **_opts_of(p, extras))
        dq.copy_(_unpad(g[0], cq, q.shape[0]))
        dk.copy_(_unpad(g[1], ckv, k.shape[0]))
        dv.copy_(_unpad(g[2], ckv, v.shape[0]))
        if p.has_sink:
            dsink = g[4]
    else:
        from .backends.triton.bwd import launch_bwd
        v4 = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731  [total, h, d] -> [1, h, total, d]
        launch_bwd(p, pl, v4(q), v4(k), v4(v), v4(out), v4(grad_out), stats.unsqueeze(0), extras,
                   v4(dq), v4(dk), v4(dv), False)
        if p.has_sink:
            dsink = _packed_sink_grad(extras, out, grad_out, stats)
    return dq, dk, dv, dsink


def _packed_sink_grad(extras, out, grad_out, stats):
    """dsink fp32 [h_q] of a packed batch: delta = rowsum(dO * O) per packed row [total, h_q] (the kernels'
    delta is laid out per sequence and max length, not per packed row); rows past cu_seqlens_q[-1] were
    never written and count 0."""
    from .backends.cpu import sink_grad
    delta = (grad_out.float() * out.float()).sum(-1)                                  # [total, h_q]
    rows = torch.arange(out.shape[0], device=out.device)
    delta = torch.where((rows < extras["cu_seqlens_q"][-1]).view(-1, 1), delta, 0.0)
    lse = torch.where(torch.isnan(stats), float("-inf"), stats)                      # unwritten rows
    return sink_grad(extras["sink"], lse.unsqueeze(0), delta.T.unsqueeze(0))


def _opts_of(p, extras):
    band = p.band
    window = None if band is None else (-1 if band.left is None else band.left, -1 if band.right is None else band.right)
    return dict(attn_scale=p.scale, window=window, causal_alignment=band.alignment if band else "top_left",
                alibi=extras["slopes"] if extras["slopes"] is not None else False, softcap=p.softcap,
                dropout_p=p.dropout_p, dropout_seed=p.dropout_seed, dropout_offset=p.dropout_offset,
                sink=extras.get("sink"))


class _AttentionVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p, extras, pl, sink=None):
        out, stats = varlen_forward(p, extras, pl, q, k, v, *(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)))
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.problem = (p, extras, pl)
        ctx.sink_dtype = sink.dtype if sink is not None else None
        ctx.mark_non_differentiable(stats)
        return out, stats

    @staticmethod
    def backward(ctx, grad_out, _):
        q, k, v, out, stats = ctx.saved_tensors
        p, extras, pl = ctx.problem
        dq, dk, dv, dsink = varlen_backward(p, extras, pl, q, k, v, out, grad_out.contiguous(), stats)
        if dsink is not None and ctx.needs_input_grad[6]:
            dsink = dsink.to(ctx.sink_dtype)
        else:
            dsink = None
        return dq, dk, dv, None, None, None, dsink


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, *, attn_scale=None,
                     causal=False, causal_alignment="top_left", window=None, alibi=False, softcap=0.0,
                     dropout_p=0.0, dropout_seed=None, dropout_offset=0, return_stats=False, validate=True,
                     backend="auto", sink=None):
    """Attention over packed variable-length sequences, forward and backward (autograd).

    Args:
        q: ``[total_q, h_q, d]``; k: ``[total_kv, h_kv, d]``; v: ``[total_kv, h_kv, d_v]``; any strides
            with a row stride per token (e.g. slices of a fused QKV projection).
        cu_seqlens_q, cu_seqlens_kv: int32 ``[b + 1]``, cumulative offsets starting at 0: sequence ``i``
            is rows ``cu[i] : cu[i + 1]``. int64 is accepted and converted to int32 (one small copy; its
            values are checked first when ``validate``); FlashAttention's door
            (:func:`fusedattn.flash_attn.flash_attn_varlen_func`) requires int32, as FlashAttention does.
        max_seqlen_q, max_seqlen_kv: ints >= the longest sequence (size the grid, key the dropout counters).
        causal / causal_alignment / window / alibi / softcap / dropout_*: as :func:`fusedattn.attention`,
            applied per sequence (bottom-right alignment uses each sequence's own lengths).
        validate: check the offsets on the host (one device sync); the kernels clamp lengths either way.
        sink: float ``[h_q]`` learnable sink logits, as :func:`fusedattn.attention` (in the stats; gets its
            gradient).
    Returns:
        out ``[total_q, h_q, d_v]``, and with ``return_stats`` the log-sum-exp fp32 ``[h_q, total_q]``.
    """
    if dropout_p and dropout_seed is None:
        dropout_seed = int(torch.randint(0, 2 ** 62, (1,)).item())
    p, extras, q4, k4, v4 = make_varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, validate=validate,
        attn_scale=attn_scale, causal=causal, causal_alignment=causal_alignment, window=window, alibi=alibi,
        softcap=softcap, dropout_p=dropout_p, dropout_seed=dropout_seed or 0, dropout_offset=dropout_offset,
        sink=sink)
    pl = plan(p, backend)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sink)):
        out, stats = _AttentionVarlen.apply(q, k, v, p, extras, pl, sink)
    else:
        out, stats = varlen_forward(p, extras, pl, q, k, v, q4, k4, v4)
    return (out, stats) if return_stats else out
