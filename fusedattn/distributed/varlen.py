"""Packed variable-length sequences (THD, ``cu_seqlens``) split across a context-parallel group.

Every sequence of the packed batch is cut by the layout on its own (as Transformer Engine and
Megatron shard THD batches): with ``W`` ranks and zigzag, sequence ``i`` of length ``n_i`` (a multiple
of ``2W``) is cut into ``2W`` chunks of ``c_i = n_i / 2W`` and rank ``r`` holds chunks ``r`` and
``2W-1-r`` of *each* sequence, packed back to back in sequence order::

    cu_seqlens = [0, 8, 12]  (sequences A of 8, B of 4), W = 2, zigzag -> chunks of 2 and 1
    A: | a0 a1 | a2 a3 | a4 a5 | a6 a7 |     B: | b0 | b1 | b2 | b3 |
    rank 0 holds  a0 a1 a6 a7 b0 b3     (local cu_seqlens [0, 4, 6] = cu_seqlens / W)
    rank 1 holds  a2 a3 a4 a5 b1 b2

So every rank holds ``n_i / W`` tokens of sequence ``i`` and the same chunk pattern as the dense case,
scaled per sequence: the ring's calls are ``plans.block_plan``'s, computed in chunk units and applied
to every sequence at once through ``attention_varlen``'s kernels (the rows and keys of a call are
gathered when the call covers part of each sequence's local tokens).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..plan import plan
from ..problem import InvalidArgumentError, InvalidTypeError
from ..varlen import make_varlen_problem, varlen_backward, varlen_forward
from .layout import chunk_ids, num_chunks
from .plans import CAUSAL, block_plan
from .ring import acc_dtype, merge_partial

__all__ = ["shard_varlen", "unshard_varlen", "local_cu_seqlens", "varlen_positions", "check_cu_seqlens",
           "VarlenBlocks"]


def check_cu_seqlens(cu_seqlens, world: int, layout: str) -> List[int]:
    """The global ``cu_seqlens`` as a host list, checked: int32/int64 1-D, starts at 0, non-decreasing,
    every sequence length a multiple of the layout's chunk count (``2W`` zigzag, ``W`` contiguous)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) \
            or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise InvalidTypeError(f"cu_seqlens must be an int32 tensor [batch + 1] of cumulative offsets, got "
                               f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                               f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    cu = cu_seqlens.cpu().tolist()
    n = num_chunks(world, layout)
    if cu[0] != 0:
        raise InvalidArgumentError(f"cu_seqlens must start at 0, got {cu[:8]}")
    for i in range(len(cu) - 1):
        length = cu[i + 1] - cu[i]
        if length < 0:
            raise InvalidArgumentError(f"cu_seqlens must be non-decreasing, got {cu[:16]}")
        if length % n:
            raise InvalidArgumentError(
                f"cu_seqlens: sequence {i} has {length} tokens, not a multiple of {n} (layout={layout!r} cuts "
                f"every sequence into {n} equal chunks with world_size={world}); pad each sequence to a "
                f"multiple of {n}")
    return cu


def local_cu_seqlens(cu_seqlens, world: int) -> torch.Tensor:
    """A rank's local offsets: every rank holds ``n_i / W`` tokens of sequence ``i``, so ``cu_seqlens / W``."""
    return torch.div(cu_seqlens, world, rounding_mode="floor").to(torch.int32)


def _local_index(cu: Sequence[int], world: int, rank: int, layout: str) -> torch.Tensor:
    """Packed global row of each local token of ``rank``, int64 [cu[-1] / W], in local order."""
    n = num_chunks(world, layout)
    parts = []
    for i in range(len(cu) - 1):
        c = (cu[i + 1] - cu[i]) // n
        for g in chunk_ids(world, rank, layout):
            parts.append(torch.arange(cu[i] + g * c, cu[i] + (g + 1) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def shard_varlen(x: torch.Tensor, cu_seqlens, world_size: int, rank: int, layout: str = "zigzag",
                 dim: int = 0) -> torch.Tensor:
    """The local shard of a packed tensor ``x`` (``dim`` of length ``cu_seqlens[-1]``): each sequence
    cut by the layout, the rank's chunks of every sequence back to back (see the module docstring)."""
    cu = check_cu_seqlens(cu_seqlens, world_size, layout)
    return x.index_select(dim, _local_index(cu, world_size, rank, layout).to(x.device))


def unshard_varlen(shards: Sequence[torch.Tensor], cu_seqlens, layout: str = "zigzag", dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`shard_varlen`: ``shards[r]`` is rank ``r``'s shard; returns the packed batch."""
    world = len(shards)
    cu = check_cu_seqlens(cu_seqlens, world, layout)
    first = shards[0]
    shape = list(first.shape)
    shape[dim] = cu[-1]
    out = first.new_empty(shape)
    for r, t in enumerate(shards):
        out.index_copy_(dim, _local_index(cu, world, r, layout).to(t.device), t)
    return out


def varlen_positions(cu_seqlens, world_size: int, rank: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Position of each local token inside its own sequence (int64): what RoPE / position embeddings
    of a packed batch are indexed with."""
    cu = check_cu_seqlens(cu_seqlens, world_size, layout)
    pos = torch.cat([torch.arange(cu[i + 1] - cu[i]) for i in range(len(cu) - 1)])
    return pos[_local_index(cu, world_size, rank, layout)].to(device)


class _Call:
    """One ring call applied to every sequence: local rows / keys (None = all, no gather), the call's
    own cu_seqlens and longest sequence, and whether it is causal-diagonal."""

    def __init__(self, rows, keys, cu_q, cu_k, max_q, max_k, causal):
        self.rows, self.keys, self.cu_q, self.cu_k = rows, keys, cu_q, cu_k
        self.max_q, self.max_k, self.causal = max_q, max_k, causal


class VarlenBlocks:
    """Packed local shards: q [T, h_q, d], k [T, h_kv, d], v [T, h_kv, d_v] (T = cu_seqlens[-1] / W).
    Accumulators: out [h_q, T, d_v], lse [h_q, T] (attention_varlen's stats layout)."""

    head_dim = 0

    def __init__(self, q, k, v, cu: List[int], info, cfg):
        self.q, self.k, self.v, self.info, self.cfg = q, k, v, info, cfg
        self.kv_shapes = (tuple(k.shape), tuple(v.shape))
        self.per_rank = num_chunks(info.world, cfg.layout) // info.world
        n = num_chunks(info.world, cfg.layout)
        self.local_starts = [x // info.world for x in cu[:-1]]
        self.chunk = [(cu[i + 1] - cu[i]) // n for i in range(len(cu) - 1)]
        self._cache: Dict[Tuple, _Call] = {}

    def accumulators(self):
        T, h_q, _ = self.q.shape
        acc = acc_dtype(self.q.dtype)
        out = torch.zeros((h_q, T, self.v.shape[-1]), dtype=acc, device=self.q.device)
        lse = torch.full((h_q, T), float("-inf"), dtype=acc, device=self.q.device)
        return out, lse

    def sink_view(self, sink):
        return sink.view(-1, 1)

    def _span(self, lo, hi):
        """(index of the local tokens of chunk units [lo, hi) of every sequence or None for all,
        the call's cu_seqlens int32, its longest sequence)."""
        lens = [(hi - lo) * c for c in self.chunk]
        cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(self.q.device)
        if (lo, hi) == (0, self.per_rank):
            return None, cu, max(lens)
        idx = torch.cat([torch.arange(s + lo * c, s + hi * c) for s, c in zip(self.local_starts, self.chunk)])
        return idx.to(self.q.device), cu, max(lens)

    def _calls(self, src) -> List[_Call]:
        info, cfg = self.info, self.cfg
        calls = []
        for q0, q1, k0, k1, mask in block_plan(info.world, info.rank, src, cfg.layout, cfg.causal, self.per_rank):
            key = (q0, q1, k0, k1, mask)
            if key not in self._cache:
                rows, cu_q, max_q = self._span(q0, q1)
                keys, cu_k, max_k = self._span(k0, k1)
                self._cache[key] = _Call(rows, keys, cu_q, cu_k, max_q, max_k, mask == CAUSAL)
            call = self._cache[key]
            if call.max_q > 0 and call.max_k > 0:
                calls.append(call)
        return calls

    def _problem(self, call, q, k, v):
        cfg = self.cfg
        p, extras, q4, k4, v4 = make_varlen_problem(
            q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, validate=False, attn_scale=cfg.scale,
            causal=call.causal, softcap=cfg.softcap)
        return p, extras, plan(p, cfg.backend), q4, k4, v4

    @staticmethod
    def _take(t, idx, dim=0):
        return t if idx is None else t.index_select(dim, idx)

    def forward_step(self, src, k_s, v_s, out_acc, lse_acc) -> None:
        for call in self._calls(src):
            q, k, v = self._take(self.q, call.rows), self._take(k_s, call.keys), self._take(v_s, call.keys)
            p, extras, pl, q4, k4, v4 = self._problem(call, q, k, v)
            o, st = varlen_forward(p, extras, pl, q, k, v, q4, k4, v4)          # [n, h_q, d_v], [h_q, n]
            if call.rows is None:
                merge_partial(out_acc, lse_acc, o.transpose(0, 1), st)
            else:
                sub_o, sub_l = out_acc[:, call.rows], lse_acc[:, call.rows]
                merge_partial(sub_o, sub_l, o.transpose(0, 1), st)
                out_acc[:, call.rows] = sub_o
                lse_acc[:, call.rows] = sub_l

    def backward_step(self, src, k_s, v_s, out, grad_out, lse, dq_acc):
        """out / grad_out [h_q, T, d_v] (the final output and its gradient, the accumulators' layout),
        lse fp32 [h_q, T]."""
        out, grad_out = out.transpose(0, 1), grad_out.transpose(0, 1)          # [T, h_q, d_v] views
        grads = []
        for call in self._calls(src):
            q, k, v = self._take(self.q, call.rows), self._take(k_s, call.keys), self._take(v_s, call.keys)
            o, g = self._take(out, call.rows).contiguous(), self._take(grad_out, call.rows).contiguous()
            st = self._take(lse, call.rows, dim=1).contiguous()
            p, extras, pl, *_ = self._problem(call, q, k, v)
            dq, dk, dv, _ = varlen_backward(p, extras, pl, q, k, v, o, g, st)
            if call.rows is None:
                dq_acc += dq
            else:
                dq_acc.index_add_(0, call.rows, dq.to(dq_acc.dtype))
            grads.append((call.keys, dk, dv))
        return grads

    @staticmethod
    def add_grads(dk_acc, dv_acc, grads) -> None:
        for keys, dk_b, dv_b in grads:
            if keys is None:
                dk_acc += dk_b
                dv_acc += dv_b
            else:
                dk_acc.index_add_(0, keys, dk_b.to(dk_acc.dtype))
                dv_acc.index_add_(0, keys, dv_b.to(dv_acc.dtype))
