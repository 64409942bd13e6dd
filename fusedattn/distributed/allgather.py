"""The all-gather variant: every rank gathers the whole K/V once (one collective instead of W - 1
ring steps), then attends its query chunks in one kernel call each: a query chunk at global
chunk index g sees the keys ``[0, (g + 1) * c)`` under a bottom-right causal mask (or every key
without a mask). The backward gathers K/V again (nothing of size W * L is kept between forward and
backward), computes dK/dV of the whole sequence from the local queries and reduce-scatters them
to their owners.

Cheaper than the ring where each ring step's kernel is too short to hide a step's latency (short
local sequences, many ranks); it holds the whole K/V on every rank for the duration of a call.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..functional import attention_backward, attention_forward
from . import _comm
from .layout import chunk_ids, shard_sequence, unshard_sequence

# (q_lo, q_hi, k_end, causal): local rows [q_lo, q_hi) against global keys [0, k_end), causal
# bottom-right aligned (the last query row sees key k_end - 1)
GatherCall = Tuple[int, int, int, bool]


def gather_plan(world: int, rank: int, layout: str, causal: bool, local_len: int) -> List[GatherCall]:
    total = local_len * world
    if not causal:
        return [(0, local_len, total, False)]
    ids = chunk_ids(world, rank, layout)
    c = local_len // len(ids)
    return [(j * c, (j + 1) * c, (g + 1) * c, True) for j, g in enumerate(ids)]


def _gather_kv(k, v, info, layout):
    shapes = (tuple(k.shape), tuple(v.shape))
    parts = [_comm.unpack(p, shapes) for p in _comm.all_gather(info, _comm.pack((k, v)))]
    return (unshard_sequence([p[0] for p in parts], layout), unshard_sequence([p[1] for p in parts], layout))


def allgather_forward(q, k, v, info, cfg):
    b, h_q, L, _ = q.shape
    K, V = _gather_kv(k, v, info, cfg.layout)
    out = torch.empty((b, h_q, L, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h_q, L, 1), dtype=torch.float32, device=q.device)
    for q0, q1, k_end, causal in gather_plan(info.world, info.rank, cfg.layout, cfg.causal, L):
        o, st = attention_forward(q[:, :, q0:q1], K[:, :, :k_end], V[:, :, :k_end], attn_scale=cfg.scale,
                                  causal=causal, causal_alignment="bottom_right", return_stats=True,
                                  backend=cfg.backend)
        out[:, :, q0:q1] = o
        lse[:, :, q0:q1] = st
    return out, lse


def allgather_backward(q, k, v, out, lse, grad_out, info, cfg):
    L = q.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    K, V = _gather_kv(k, v, info, cfg.layout)
    dK = torch.zeros(K.shape, dtype=acc, device=q.device)
    dV = torch.zeros(V.shape, dtype=acc, device=q.device)
    dq = torch.empty_like(q)
    for q0, q1, k_end, causal in gather_plan(info.world, info.rank, cfg.layout, cfg.causal, L):
        dq_b, dk_b, dv_b, _ = attention_backward(
            q[:, :, q0:q1], K[:, :, :k_end], V[:, :, :k_end], out[:, :, q0:q1], grad_out[:, :, q0:q1],
            lse[:, :, q0:q1], attn_scale=cfg.scale, causal=causal, causal_alignment="bottom_right",
            deterministic=cfg.deterministic, backend=cfg.backend)
        dq[:, :, q0:q1] = dq_b
        dK[:, :, :k_end] += dk_b
        dV[:, :, :k_end] += dv_b
    parts = [_comm.pack((shard_sequence(dK, info.world, r, cfg.layout), shard_sequence(dV, info.world, r, cfg.layout)))
             for r in range(info.world)]
    mine = _comm.reduce_scatter(info, parts)
    dk, dv = _comm.unpack(mine, (tuple(k.shape), tuple(v.shape)))
    return dq, dk.to(k.dtype), dv.to(v.dtype)
