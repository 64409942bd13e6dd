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


def resolve_group(group):
    """``group`` as a ProcessGroup (or None, the default group): a 1-D ``DeviceMesh`` gives its group."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without device meshes
        DeviceMesh = ()
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            names = getattr(group, "mesh_dim_names", None)
            hint = f"mesh[{names[0]!r}]" if names else "mesh[dim_name]"
            raise InvalidArgumentError(
                f"group: a DeviceMesh must be 1-D (the context-parallel dimension), got one of shape "
                f"{tuple(group.shape)}; pass its context-parallel slice, e.g. {hint}")
        return group.get_group()
    raise InvalidArgumentError(
        f"group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None (the default group), "
        f"got {type(group).__name__}")


def group_info(group) -> GroupInfo:
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgumentError(
            "group: torch.distributed is not initialized; call torch.distributed.init_process_group "
            "(gloo for CPU tensors, nccl for CUDA ones) on every rank before context_parallel_attention")
    group = resolve_group(group)
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


class ContextParallelError(RuntimeError):
    """A rank of the group failed inside ``context_parallel_attention``; raised on every other rank
    (the failing rank raises its own error)."""


class StepGuard:
    """Keeps a rank in the ring after its own compute failed, so that no peer waits forever.

    ``keep_going=True``: the first error raised inside ``with guard.at(step):`` is recorded and
    swallowed; ``guard.ok`` turns False, the caller skips its later compute but still posts every
    exchange, and :meth:`settle` (called by every rank at the end) makes every rank raise: the failing
    one its own error, the others :class:`ContextParallelError` naming it. ``keep_going=False``: errors
    propagate at once (the peers then see the process group's own timeout or a closed connection)."""

    def __init__(self, keep_going: bool):
        self.keep_going = keep_going
        self.error: Optional[BaseException] = None
        self.step = -1

    @property
    def ok(self) -> bool:
        return self.error is None

    def at(self, step: int):
        return _Guarded(self, step)

    def settle(self, info: GroupInfo, what: str) -> None:
        """One tiny all_gather of every rank's status (a host sync); raises on every rank if any failed."""
        if not self.keep_going:
            return
        status = torch.tensor([0 if self.ok else 1, self.step], dtype=torch.int64)
        if info.world > 1:
            dev = _collective_device(info)
            rows = [r.cpu().tolist() for r in all_gather(info, status.to(dev))]
        else:
            rows = [status.tolist()]
        failed = [(r, row[1]) for r, row in enumerate(rows) if row[0]]
        if not failed:
            return
        texts = [None] * info.world
        mine = None if self.ok else f"{type(self.error).__name__}: {str(self.error)[:500]}"
        if info.world > 1:
            dist.all_gather_object(texts, mine, group=info.group)
        else:
            texts = [mine]
        if not self.ok:
            raise self.error
        who = "; ".join(f"rank {r} at ring step {s} ({texts[r]})" for r, s in failed)
        raise ContextParallelError(
            f"context_parallel_attention ({what}): {who} of the group of {info.world} failed; this rank "
            f"(rank {info.rank}) took part in the remaining exchanges and its result is void. Every rank "
            f"raises; the group stays usable")


class _Guarded:
    def __init__(self, guard: StepGuard, step: int):
        self.guard, self.step = guard, step

    def __enter__(self):
        return self.guard

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or not self.guard.keep_going or not issubclass(exc_type, Exception):
            return False
        if self.guard.error is None:
            self.guard.error, self.guard.step = exc, self.step
        return True


def _collective_device(info: GroupInfo) -> torch.device:
    """Where a small collective's tensor must live: CUDA for NCCL groups, CPU otherwise."""
    backend = dist.get_backend(info.group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
