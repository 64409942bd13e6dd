"""torch.distributed plumbing shared by the ring and all-gather variants: group ranks, packed
buffers (K and V travel as one message), the ring exchange."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..problem import InvalidArgumentError

# message tags (gloo matches by tag; NCCL ignores them and matches by issue order, which is the same on
# every rank because every rank posts the same sequence of exchanges)
TAG_KV = 7001
TAG_DKV = 7002


@dataclass(frozen=True)
class GroupInfo:
    group: Optional[object]
    world: int
    rank: int
    next_peer: int      # global rank of (rank + 1) % world
    prev_peer: int      # global rank of (rank - 1) % world


def group_info(group) -> GroupInfo:
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgumentError(
            "group: torch.distributed is not initialized; call torch.distributed.init_process_group "
            "(gloo for CPU tensors, nccl for CUDA ones) on every rank before context_parallel_attention")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise InvalidArgumentError("group: this process is not a member of the given process group")

    def glob(r):
        return r if group is None else dist.get_global_rank(group, r)

    return GroupInfo(group, world, rank, glob((rank + 1) % world), glob((rank - 1) % world))


def pack(tensors: Sequence[torch.Tensor], dtype=None) -> torch.Tensor:
    """One contiguous 1-D buffer holding ``tensors`` (cast to ``dtype``), so a block travels as one message."""
    dtype = dtype or tensors[0].dtype
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def unpack(buf: torch.Tensor, shapes) -> List[torch.Tensor]:
    """Views of ``buf`` in the given shapes (inverse of :func:`pack`)."""
    views, at = [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        views.append(buf[at:at + n].view(shape))
        at += n
    return views


def ring_exchange(info: GroupInfo, send: torch.Tensor, recv: torch.Tensor, tag: int):
    """Post ``send`` to the next rank and ``recv`` from the previous one; returns the works to wait on.
    Non-blocking: the caller computes on other data meanwhile (the overlap)."""
    ops = [dist.P2POp(dist.isend, send, info.next_peer, info.group, tag),
           dist.P2POp(dist.irecv, recv, info.prev_peer, info.group, tag)]
    return dist.batch_isend_irecv(ops)


def wait_all(works) -> None:
    for w in works or ():
        w.wait()


class completing:
    """``with completing(works, ...):`` runs a step's kernels while ``works`` are in flight. On success
    it waits for them at the end when ``wait=True``; when a kernel raises it always waits for every
    list given before the error propagates: where every rank raises at the same step (a bad argument,
    out of memory everywhere) the exchanges they all posted still complete and the group stays
    usable. (A rank that fails alone leaves the others waiting at their next exchange, as with any
    collective.)"""

    def __init__(self, *work_lists, wait=True):
        self.work_lists = work_lists
        self.wait = wait

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            if self.wait:
                for works in self.work_lists:
                    wait_all(works)
            return False
        for works in self.work_lists:
            try:
                wait_all(works)
            except Exception:  # noqa: BLE001 - the kernel's error is the one to report
                pass
        return False


def all_gather(info: GroupInfo, t: torch.Tensor) -> List[torch.Tensor]:
    """Every rank's ``t`` (same shape everywhere), in group-rank order."""
    t = t.contiguous()
    bufs = [torch.empty_like(t) for _ in range(info.world)]
    dist.all_gather(bufs, t, group=info.group)
    return bufs


def reduce_scatter(info: GroupInfo, parts: List[torch.Tensor]) -> torch.Tensor:
    """``parts[r]`` summed over ranks, delivered to rank r. Falls back to all_reduce where the
    backend has no reduce_scatter (older gloo builds)."""
    parts = [p.contiguous() for p in parts]
    out = torch.empty_like(parts[info.rank])
    try:
        dist.reduce_scatter(out, parts, group=info.group)
        return out
    except (RuntimeError, NotImplementedError) as exc:
        if "support" not in str(exc) and "implement" not in str(exc):
            raise
        flat = torch.cat([p.reshape(-1) for p in parts])
        dist.all_reduce(flat, group=info.group)
        n = out.numel()
        return flat[info.rank * n:(info.rank + 1) * n].view_as(out).clone()
