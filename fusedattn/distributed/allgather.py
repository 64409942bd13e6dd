"""The all-gather variant: every rank gathers the whole K/V once (one collective instead of W - 1
ring steps), then attends its query chunks in one kernel call each (``plans.gather_plan``: a query
chunk at global chunk index g sees, under a causal mask, the keys ``[0, (g + 1) * c)`` with the
diagonal as a top-left window; without a mask every key in one call). The backward gathers K/V again
(nothing of size W * L is kept between forward and backward), computes dK/dV of the whole sequence
from the local queries and reduce-scatters them to their owners.

Cheaper than the ring where each ring step's kernel is too short to hide a step's latency (short
local sequences, many ranks); it holds the whole K/V on every rank for the duration of a call.
"""
from __future__ import annotations

import torch

from ..functional import attention_backward, attention_forward
from . import _comm
from .layout import shard_sequence, unshard_sequence
from .plans import gather_plan, mask_kwargs
from .ring import acc_dtype, apply_sink


def _gather_kv(k, v, info, layout):
    shapes = (tuple(k.shape), tuple(v.shape))
    parts = [_comm.unpack(p, shapes) for p in _comm.all_gather(info, _comm.pack((k, v)))]
    return (unshard_sequence([p[0] for p in parts], layout), unshard_sequence([p[1] for p in parts], layout))


def _calls(info, cfg, L):
    return gather_plan(info.world, info.rank, cfg.layout, cfg.causal, L, cfg.window)


def _opts(cfg, mask):
    return dict(attn_scale=cfg.scale, softcap=cfg.softcap, backend=cfg.backend, **mask_kwargs(mask))


def allgather_forward(blocks, info, cfg, sink=None):
    """(out [b, h_q, L, d_v] in q.dtype, lse fp32 [b, h_q, L]) of the local rows (DenseBlocks shards)."""
    q, k, v = blocks.q, blocks.k, blocks.v
    b, h_q, L, _ = q.shape
    K, V = _gather_kv(k, v, info, cfg.layout)
    out, lse = blocks.accumulators()             # rows no call covers (none today) stay 0 / -inf
    guard = _comm.StepGuard(keep_going=cfg.check)
    with guard.at(0):
        for q0, q1, k0, k1, mask in _calls(info, cfg, L):
            o, st = attention_forward(q[:, :, q0:q1], K[:, :, k0:k1], V[:, :, k0:k1], return_stats=True,
                                      **_opts(cfg, mask))
            out[:, :, q0:q1] = o
            lse[:, :, q0:q1] = st[..., 0]
    guard.settle(info, "forward")
    if sink is not None:
        apply_sink(out, lse, blocks.sink_view(sink))
    return out.to(q.dtype), lse.float()


def allgather_backward(blocks, out, lse, grad_out, info, cfg):
    q, k, v = blocks.q, blocks.k, blocks.v
    L = q.shape[2]
    acc = acc_dtype(q.dtype)
    K, V = _gather_kv(k, v, info, cfg.layout)
    dK = torch.zeros(K.shape, dtype=acc, device=q.device)
    dV = torch.zeros(V.shape, dtype=acc, device=q.device)
    dq = torch.zeros_like(q)
    guard = _comm.StepGuard(keep_going=cfg.check)
    with guard.at(0):
        for q0, q1, k0, k1, mask in _calls(info, cfg, L):
            dq_b, dk_b, dv_b, _ = attention_backward(
                q[:, :, q0:q1], K[:, :, k0:k1], V[:, :, k0:k1], out[:, :, q0:q1], grad_out[:, :, q0:q1],
                lse[:, :, q0:q1], deterministic=cfg.deterministic, **_opts(cfg, mask))
            dq[:, :, q0:q1] = dq_b
            dK[:, :, k0:k1] += dk_b
            dV[:, :, k0:k1] += dv_b
    # a rank whose kernel failed still takes part in the reduce-scatter (with what it has), then every
    # rank learns of the failure in settle()
    parts = [_comm.pack((shard_sequence(dK, info.world, r, cfg.layout), shard_sequence(dV, info.world, r, cfg.layout)))
             for r in range(info.world)]
    mine = _comm.reduce_scatter(info, parts)
    guard.settle(info, "backward")
    dk, dv = _comm.unpack(mine, blocks.kv_shapes)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
