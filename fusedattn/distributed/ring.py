"""Ring attention: K/V blocks travel around the group; each rank merges its queries' partial
results through (out, lse). Forward and backward (dK/dV accumulators travel with the blocks).

Every step's communication is posted (isend/irecv) before the step's kernels run and waited
after them, so the transfer of the next block overlaps the attention on the current one.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..functional import attention_backward, attention_forward
from . import _comm
from .layout import chunk_ids

# (q_lo, q_hi, k_lo, k_hi, causal): local query rows [q_lo, q_hi) against rows [k_lo, k_hi) of the
# visiting block, causal = top-left causal mask within that square sub-block
Call = Tuple[int, int, int, int, bool]


def block_plan(world: int, rank: int, src: int, layout: str, causal: bool, local_len: int) -> List[Call]:
    """Kernel calls that attend ``rank``'s queries to the K/V block held by rank ``src``.

    Each (query chunk, key chunk) pair is fully visible, causal-diagonal (same chunk) or fully
    masked (never computed: it would only add rows with no key, lse -inf, weight 0 in the merge). Chunks are grouped into as
    few calls as possible: with zigzag, one call per step (own block: causal over the whole local
    block, whose chunks are in increasing global order; an earlier rank's block: all queries
    against its first chunk; a later rank's block: the second query chunk against both chunks).
    """
    if not causal:
        return [(0, local_len, 0, local_len, False)]
    if src == rank:
        # both chunk lists are the same increasing sequence of equal chunks: top-left causal on the
        # local block is exactly the global causal mask restricted to these rows and keys
        return [(0, local_len, 0, local_len, True)]
    qids, kids = chunk_ids(world, rank, layout), chunk_ids(world, src, layout)
    c = local_len // len(qids)
    # visible key chunks (local indices) of each query chunk; chunks are disjoint here (src != rank)
    seen = [tuple(j for j, kc in enumerate(kids) if kc < qc) for qc in qids]
    calls: List[Call] = []
    i = 0
    while i < len(qids):
        i_end = i + 1
        while i_end < len(qids) and seen[i_end] == seen[i]:
            i_end += 1
        keys = seen[i]
        j = 0
        while j < len(keys):           # contiguous runs of visible key chunks
            j_end = j + 1
            while j_end < len(keys) and keys[j_end] == keys[j_end - 1] + 1:
                j_end += 1
            calls.append((i * c, i_end * c, keys[j] * c, (keys[j_end - 1] + 1) * c, False))
            j = j_end
        i = i_end
    return calls


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partial(out_acc, lse_acc, out_blk, lse_blk) -> None:
    """In place: (out_acc, lse_acc) <- merge with a block's (out, lse), the numerically stable rule
    lse = logaddexp(lse_a, lse_b); out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).
    out_acc [b,h,n,d_v] and lse_acc [b,h,n] in the accumulation dtype; lse_acc starts at -inf.

    A row with no key on one side has lse -inf there (the package's convention): its weight is
    exp(-inf - lse) = 0. A row empty on both sides stays out 0, lse -inf (the exponents then use 0,
    never -inf - -inf)."""
    lse_blk = lse_blk.to(lse_acc.dtype)
    new = torch.logaddexp(lse_acc, lse_blk)
    safe = torch.where(new == float("-inf"), torch.zeros_like(new), new)
    out_acc.mul_(torch.exp(lse_acc - safe).unsqueeze(-1))
    out_acc.add_(out_blk.to(out_acc.dtype) * torch.exp(lse_blk - safe).unsqueeze(-1))
    lse_acc.copy_(new)


def ring_forward(q, k, v, info, cfg):
    """Local output [b,h_q,L,d_v] (q.dtype) and stats fp32 [b,h_q,L,1] of the local queries against
    the whole sequence. cfg: scale, causal, layout, backend."""
    b, h_q, L, _ = q.shape
    d_v = v.shape[-1]
    acc = _acc_dtype(q.dtype)
    out_acc = torch.zeros((b, h_q, L, d_v), dtype=acc, device=q.device)
    lse_acc = torch.full((b, h_q, L), float("-inf"), dtype=acc, device=q.device)
    shapes = (tuple(k.shape), tuple(v.shape))
    bufs = [_comm.pack((k, v)), None]
    if info.world > 1:
        bufs[1] = torch.empty_like(bufs[0])
    for step in range(info.world):
        src = (info.rank - step) % info.world
        cur = bufs[step % 2]
        works = None
        if step + 1 < info.world:    # the next block is in flight while this one is computed
            works = _comm.ring_exchange(info, cur, bufs[(step + 1) % 2], _comm.TAG_KV)
        with _comm.completing(works):
            k_s, v_s = (k, v) if step == 0 else _comm.unpack(cur, shapes)
            for q0, q1, k0, k1, causal in block_plan(info.world, info.rank, src, cfg.layout, cfg.causal, L):
                o, st = attention_forward(q[:, :, q0:q1], k_s[:, :, k0:k1], v_s[:, :, k0:k1], attn_scale=cfg.scale,
                                          causal=causal, return_stats=True, backend=cfg.backend)
                merge_partial(out_acc[:, :, q0:q1], lse_acc[:, :, q0:q1], o, st[..., 0])
    return out_acc.to(q.dtype), lse_acc.float().unsqueeze(-1)


def ring_backward(q, k, v, out, lse, grad_out, info, cfg):
    """dq, dk, dv of the local shards. Each block's gradient comes from ``attention_backward`` with
    the local rows' final (merged) out and lse, which makes it exact: P = exp(S - lse) is the true
    probability of each key and delta = rowsum(dO * O) the true row term. dK/dV accumulators
    travel with the blocks and come home after W exchanges."""
    L = q.shape[2]
    acc = _acc_dtype(q.dtype)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    shapes = (tuple(k.shape), tuple(v.shape))
    kv = [_comm.pack((k, v)), None]
    dkv = [torch.zeros(kv[0].numel(), dtype=acc, device=q.device), None]
    if info.world > 1:
        kv[1] = torch.empty_like(kv[0])
        dkv[1] = torch.empty_like(dkv[0])
    dkv_works = None
    for step in range(info.world):
        src = (info.rank - step) % info.world
        cur = kv[step % 2]
        kv_works = None
        if step + 1 < info.world:
            kv_works = _comm.ring_exchange(info, cur, kv[(step + 1) % 2], _comm.TAG_KV)
        k_s, v_s = (k, v) if step == 0 else _comm.unpack(cur, shapes)
        grads = []
        with _comm.completing(kv_works, dkv_works, wait=False):
            for q0, q1, k0, k1, causal in block_plan(info.world, info.rank, src, cfg.layout, cfg.causal, L):
                dq_b, dk_b, dv_b, _ = attention_backward(
                    q[:, :, q0:q1], k_s[:, :, k0:k1], v_s[:, :, k0:k1], out[:, :, q0:q1], grad_out[:, :, q0:q1],
                    lse[:, :, q0:q1], attn_scale=cfg.scale, causal=causal, deterministic=cfg.deterministic,
                    backend=cfg.backend)
                dq_acc[:, :, q0:q1] += dq_b
                grads.append((k0, k1, dk_b, dv_b))
        # the accumulator of this block arrives from the previous rank (posted after its last step)
        _comm.wait_all(dkv_works)
        dkv_cur = dkv[step % 2]
        dk_acc, dv_acc = _comm.unpack(dkv_cur, shapes)
        for k0, k1, dk_b, dv_b in grads:
            dk_acc[:, :, k0:k1] += dk_b
            dv_acc[:, :, k0:k1] += dv_b
        if info.world > 1:           # pass it on; after the last step it reaches its owner
            dkv_works = _comm.ring_exchange(info, dkv_cur, dkv[(step + 1) % 2], _comm.TAG_DKV)
        _comm.wait_all(kv_works)
    _comm.wait_all(dkv_works)
    dk, dv = _comm.unpack(dkv[info.world % 2] if info.world > 1 else dkv[0], shapes)
    return dq_acc.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
