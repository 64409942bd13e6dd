"""How a sequence is cut across the ranks of a context-parallel group.

Two layouts, both with chunks of equal length ``c``:

``"zigzag"`` (default): with ``W`` ranks the sequence is cut into ``2W`` chunks and rank
``i`` holds chunk ``i`` followed by chunk ``2W - 1 - i`` (local length ``2c``). Under a causal
mask every rank then has the same amount of work (a chunk near the start sees few keys, its
partner near the end sees many)::

    W = 2, sequence of 4 chunks           W = 4, sequence of 8 chunks
    | c0 | c1 | c2 | c3 |                 | c0 | c1 | c2 | c3 | c4 | c5 | c6 | c7 |
    rank 0: [c0, c3]                      rank 0: [c0, c7]   rank 2: [c2, c5]
    rank 1: [c1, c2]                      rank 1: [c1, c6]   rank 3: [c3, c4]

``"contiguous"``: the sequence is cut into ``W`` chunks and rank ``i`` holds chunk ``i``
(simple, but under a causal mask the last rank does about twice the average work and the
first almost none).

A rank's local chunks are always in increasing global order, so the local sequence is a
subsequence of the global one.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ..problem import InvalidArgumentError

LAYOUTS = ("zigzag", "contiguous")

__all__ = ["LAYOUTS", "chunk_ids", "num_chunks", "shard_sequence", "unshard_sequence", "sequence_positions"]


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_world(world_size, rank=None):
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"world_size must be a positive int, got {world_size!r}")
    if rank is not None and (not isinstance(rank, int) or not 0 <= rank < world_size):
        raise InvalidArgumentError(f"rank must be an int in [0, {world_size}), got {rank!r}")


def num_chunks(world_size: int, layout: str = "zigzag") -> int:
    """Number of equal chunks the whole sequence is cut into: ``2W`` (zigzag) or ``W`` (contiguous)."""
    check_layout(layout)
    _check_world(world_size)
    return 2 * world_size if layout == "zigzag" else world_size


def chunk_ids(world_size: int, rank: int, layout: str = "zigzag") -> Tuple[int, ...]:
    """Global chunk indices held by ``rank``, in local order: ``(rank, 2W-1-rank)`` or ``(rank,)``."""
    check_layout(layout)
    _check_world(world_size, rank)
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def _chunk_len(total: int, world_size: int, layout: str, what: str) -> int:
    n = num_chunks(world_size, layout)
    if total % n:
        raise InvalidArgumentError(
            f"{what}: a sequence of length {total} cannot be cut into {n} equal chunks (layout={layout!r}, "
            f"world_size={world_size}); the length must be a multiple of {n}")
    return total // n


def shard_sequence(x: torch.Tensor, world_size: int, rank: int, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The part of the whole-sequence tensor ``x`` that ``rank`` holds.

    x: any tensor whose ``dim`` (default 2: BHSD's sequence dim) has length ``S``, a multiple
    of ``2 * world_size`` (zigzag) or ``world_size`` (contiguous). Returns the local shard of
    length ``S / world_size`` along ``dim`` (zigzag: chunk ``rank`` then chunk ``2W-1-rank``,
    a new tensor; contiguous: a view).
    """
    if not isinstance(x, torch.Tensor):
        raise InvalidArgumentError(f"x must be a torch.Tensor, got {type(x).__name__}")
    c = _chunk_len(x.shape[dim], world_size, layout, "x")
    pieces = [x.narrow(dim, i * c, c) for i in chunk_ids(world_size, rank, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: ``shards[r]`` is rank ``r``'s shard; returns the whole sequence."""
    check_layout(layout)
    shards = list(shards)
    if not shards:
        raise InvalidArgumentError("shards must hold one tensor per rank, got none")
    world_size = len(shards)
    lengths = {t.shape[dim] for t in shards}
    if len(lengths) != 1:
        raise InvalidArgumentError(f"shards must all have the same length along dim {dim}, got {sorted(lengths)}")
    local = lengths.pop()
    per_rank = num_chunks(world_size, layout) // world_size
    if local % per_rank:
        raise InvalidArgumentError(f"shards: local length {local} is not a multiple of {per_rank} "
                                   f"(layout={layout!r} holds {per_rank} chunks per rank)")
    c = local // per_rank
    chunks: List[torch.Tensor] = [None] * num_chunks(world_size, layout)
    for r, t in enumerate(shards):
        for j, cid in enumerate(chunk_ids(world_size, r, layout)):
            chunks[cid] = t.narrow(dim, j * c, c)
    return torch.cat(chunks, dim=dim)


def sequence_positions(seq_len: int, world_size: int, rank: int, layout: str = "zigzag",
                       device=None) -> torch.Tensor:
    """Global positions (int64 ``[seq_len / world_size]``) of the local tokens of ``rank``, in local
    order: what position embeddings (learned, RoPE) must be indexed with."""
    return shard_sequence(torch.arange(seq_len, device=device), world_size, rank, layout, dim=0)
