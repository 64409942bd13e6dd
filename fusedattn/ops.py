"""``torch.library`` custom ops, for ``torch.compile`` and CUDA graphs.

``fusedattn::attn_fwd`` and ``fusedattn::attn_bwd`` wrap the same
``attention_forward`` / ``attention_backward`` the eager path calls; fake
implementations give ``torch.compile`` shapes and strides (the same layout
rule as eager), and ``register_autograd`` connects the two, so a compiled
model that calls :func:`fusedattn.attention` traces with no graph break.
Eager calls do not go through here (dispatch costs tens of microseconds).

A learnable sink (``sink``, float [h_q]) is the last, optional argument of both ops; the backward's
fifth output is its gradient, dsink fp32 [h_q] (empty [0] without a sink, as dbias without a bias:
an op's outputs are fixed by its schema).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .functional import _like_layout, attention_backward, attention_forward
from .problem import alibi_slopes


def _window(lo: int, hi: int):
    if lo < 0 and hi < 0:
        return None
    return (lo, hi)


@torch.library.custom_op("fusedattn::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, seq_len_q: Optional[Tensor], seq_len_kv: Optional[Tensor],
             attn_bias: Optional[Tensor], slopes: Optional[Tensor], attn_scale: float, causal: bool,
             causal_alignment: str, win_left: int, win_right: int, softcap: float, dropout_p: float,
             dropout_seed: int, dropout_offset: int, backend: str,
             deterministic: Optional[bool], validate: bool = True,
             sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Forward as an op: returns (out [b,h_q,s_q,d_v], stats fp32 [b,h_q,s_q,1]). deterministic is
    the backward's (kept for it by the autograd context); validate checks the lengths' values; sink:
    float [h_q] or None (the stats then include it)."""
    out, stats = attention_forward(
        q, k, v, attn_scale=attn_scale, causal=causal, causal_alignment=causal_alignment,
        window=_window(win_left, win_right), seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, attn_bias=attn_bias,
        alibi=slopes if slopes is not None else False, softcap=softcap, dropout_p=dropout_p,
        dropout_seed=dropout_seed, dropout_offset=dropout_offset, return_stats=True, validate=validate,
        backend=backend, sink=sink)
    return out, stats


@attn_fwd.register_fake
def _(q, k, v, seq_len_q, seq_len_kv, attn_bias, slopes, attn_scale, causal, causal_alignment,
      win_left, win_right, softcap, dropout_p, dropout_seed, dropout_offset, backend, deterministic, validate=True,
      sink=None):
    b, h_q, s_q, _ = q.shape
    out = _like_layout(q, (b, h_q, s_q, v.shape[-1]), q.dtype)
    return out, q.new_empty((b, h_q, s_q, 1), dtype=torch.float32)


@torch.library.custom_op("fusedattn::attn_bwd", mutates_args=())
def attn_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, grad_out: Tensor, stats: Tensor,
             seq_len_q: Optional[Tensor], seq_len_kv: Optional[Tensor], attn_bias: Optional[Tensor],
             slopes: Optional[Tensor], attn_scale: float, causal: bool, causal_alignment: str, win_left: int,
             win_right: int, softcap: float, dropout_p: float, dropout_seed: int, dropout_offset: int,
             backend: str, deterministic: Optional[bool], need_dbias: bool,
             validate: bool = True, sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward as an op: (dq, dk, dv, dbias, dsink); dbias is empty unless ``need_dbias``, dsink (fp32
    [h_q]) empty [0] without ``sink``. The autograd backward passes validate=False: the forward op
    checked the same lengths."""
    grads = attention_backward(
        q, k, v, out, grad_out.contiguous() if grad_out.stride(-1) != 1 else grad_out, stats,
        attn_scale=attn_scale, causal=causal, causal_alignment=causal_alignment,
        window=_window(win_left, win_right), seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, attn_bias=attn_bias,
        alibi=slopes if slopes is not None else False, softcap=softcap, dropout_p=dropout_p,
        dropout_seed=dropout_seed, dropout_offset=dropout_offset, backend=backend, need_dbias=need_dbias,
        deterministic=deterministic, validate=validate, sink=sink)
    dq, dk, dv, dbias = grads[:4]
    dsink = grads[4] if sink is not None else q.new_empty((0,), dtype=torch.float32)
    if dbias is None:
        dbias = q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dbias, dsink


@attn_bwd.register_fake
def _(q, k, v, out, grad_out, stats, seq_len_q, seq_len_kv, attn_bias, slopes, attn_scale, causal,
      causal_alignment, win_left, win_right, softcap, dropout_p, dropout_seed, dropout_offset, backend, deterministic,
      need_dbias, validate=True, sink=None):
    dbias = (attn_bias.new_empty(attn_bias.shape, dtype=torch.float32) if need_dbias and attn_bias is not None
             else q.new_empty((0,), dtype=torch.float32))
    dsink = q.new_empty((q.shape[1] if sink is not None else 0,), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias, dsink     # as _run_backward


_FWD_INPUTS = ("q", "k", "v", "seq_len_q", "seq_len_kv", "attn_bias", "slopes", "attn_scale", "causal",
               "causal_alignment", "win_left", "win_right", "softcap", "dropout_p", "dropout_seed",
               "dropout_offset", "backend", "deterministic", "validate", "sink")
_SINK = _FWD_INPUTS.index("sink")


def _setup_context(ctx, inputs, output):
    named = dict(zip(_FWD_INPUTS, inputs))
    out, stats = output
    ctx.save_for_backward(named["q"], named["k"], named["v"], out, stats, named["seq_len_q"],
                          named["seq_len_kv"], named["attn_bias"], named["slopes"], named["sink"])
    ctx.scalars = tuple(named[n] for n in _FWD_INPUTS[7:-2])      # attn_scale .. deterministic (not validate)
    ctx.mark_non_differentiable(stats)      # as in eager: the log-sum-exp carries no gradient
    ctx.bias_float = named["attn_bias"] is not None and named["attn_bias"].is_floating_point()


def _backward(ctx, grad_out, _grad_stats):
    q, k, v, out, stats, seq_len_q, seq_len_kv, attn_bias, slopes, sink = ctx.saved_tensors
    need_dbias = ctx.bias_float and ctx.needs_input_grad[5]
    dq, dk, dv, dbias, dsink = torch.ops.fusedattn.attn_bwd(
        q, k, v, out, grad_out, stats, seq_len_q, seq_len_kv, attn_bias, slopes, *ctx.scalars, need_dbias,
        False, sink)        # validate=False: the forward op checked these lengths
    dbias = dbias.to(attn_bias.dtype) if need_dbias else None
    # the sink's gradient in its own dtype, as eager's _Attention returns it
    dsink = dsink.to(sink.dtype) if sink is not None and ctx.needs_input_grad[_SINK] else None
    return (dq, dk, dv, None, None, dbias) + (None,) * (_SINK - 6) + (dsink,)


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_op(q, k, v, attn_bias, opts, deterministic=None, sink=None):
    """Call the forward op with the functional door's options (used under torch.compile); sink: float
    [h_q] or None."""
    window = opts["window"]
    left, right = (-1, -1) if window is None else (
        -1 if window[0] is None else window[0], -1 if window[1] is None else window[1])
    alibi = opts["alibi"]
    slopes = alibi if isinstance(alibi, torch.Tensor) else (alibi_slopes(q.shape[1], q.device) if alibi else None)
    scale = opts["attn_scale"] if opts["attn_scale"] is not None else q.shape[-1] ** -0.5
    return torch.ops.fusedattn.attn_fwd(
        q, k, v, opts["seq_len_q"], opts["seq_len_kv"], attn_bias, slopes, float(scale), bool(opts["causal"]),
        opts["causal_alignment"], int(left), int(right), float(opts["softcap"]), float(opts["dropout_p"]),
        int(opts["dropout_seed"]), int(opts["dropout_offset"]), opts["backend"],
        None if deterministic is None else bool(deterministic), bool(opts["validate"]), sink)
