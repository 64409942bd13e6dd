"""Which kernel calls cover the global mask: per ring step (:func:`block_plan`) and for the all-gather
variant (:func:`gather_plan`). Pure functions of the group geometry, no communication.

A call is ``(q0, q1, k0, k1, mask)``: local query rows ``[q0, q1)`` against rows ``[k0, k1)`` of a key
block, with ``mask`` either ``None`` (every key kept) or a band ``(left, right)`` read *top-left inside
the call*: row ``a`` keeps key ``b`` iff ``a - left <= b <= a + right`` (``None`` = unbounded side).
``(None, 0)`` is top-left causal. Every band of the global mask becomes such a call after trimming the
rows and keys that the band leaves empty, so the kernels' own window arguments (bounds >= 0) express it.

The global mask is one band over global positions ``(left, right)`` (:func:`global_band`): causal is
``(None, 0)``, a window ``(left, right)`` with causal caps ``right`` at 0.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from ..problem import parse_window
from .layout import chunk_ids

Band = Optional[Tuple[Optional[int], Optional[int]]]
Call = Tuple[int, int, int, int, Band]
CAUSAL: Band = (None, 0)


def global_band(causal: bool, window) -> Band:
    """The global mask as one band ``(left, right)`` (None sides unbounded), or None for no mask."""
    if window is None:
        return CAUSAL if causal else None
    left, right = parse_window(window)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None
    return (left, right)


def mask_kwargs(mask: Band) -> dict:
    """The ``fusedattn.attention_forward`` arguments of a call's mask (top-left alignment)."""
    if mask is None:
        return dict(causal=False, window=None)
    if mask == CAUSAL:
        return dict(causal=True, window=None)
    left, right = mask
    return dict(causal=False, window=(-1 if left is None else left, -1 if right is None else right))


def band_call(rows: Tuple[int, int], keys: Tuple[int, int], delta: int, band: Band) -> Optional[Call]:
    """One call for local rows ``rows`` and keys ``keys`` of a block whose first key sits ``delta``
    positions before the first row (global row position - global key position = a - b + delta), under
    the global ``band``; None when the band keeps nothing there.

    The rectangle is trimmed to the rows and keys the band can reach, so that in the call's own
    coordinates the diagonal offset D = delta + a0 - b0 lies in [-right, left]: the band then becomes a
    top-left window with bounds >= 0 (left - D, right + D)."""
    (r0, r1), (c0, c1) = rows, keys
    n, m = r1 - r0, c1 - c0
    if band is None:
        return (r0, r1, c0, c1, None) if n > 0 and m > 0 else None
    left, right = band
    a0, a1, b0, b1 = 0, n, 0, m
    if left is not None:
        b0 = max(b0, delta - left)              # keys before row 0's lowest kept key
        a1 = min(a1, m - delta + left)          # rows whose lowest kept key is past the block
    if right is not None:
        a0 = max(a0, -delta - right)            # rows before the first row that reaches key 0
        b1 = min(b1, a1 + delta + right)        # keys past the last row's highest kept key
    if a0 >= a1 or b0 >= b1:
        return None
    d = delta + a0 - b0
    left_c = None if left is None else left - d
    right_c = None if right is None else right + d
    # a side that covers the whole rectangle is no bound at all (fewer masked tiles in the kernel)
    if left_c is not None and left_c >= a1 - a0 - 1:
        left_c = None
    if right_c is not None and right_c >= b1 - b0 - 1:
        right_c = None
    mask = None if left_c is None and right_c is None else (left_c, right_c)
    return (r0 + a0, r0 + a1, c0 + b0, c0 + b1, mask)


def block_plan(world: int, rank: int, src: int, layout: str, causal: bool, local_len: int,
               window=None) -> List[Call]:
    """Kernel calls that attend ``rank``'s queries to the K/V block held by rank ``src``.

    Causal, no window: each (query chunk, key chunk) pair is fully visible, causal-diagonal (same
    chunk) or fully masked (never computed), grouped into as few calls as possible: with zigzag, one
    call per step (own block: causal over the whole local block, whose chunks are in increasing global
    order; an earlier rank's block: all queries against its first chunk; a later rank's block: the
    second query chunk against both chunks). With a window: one call per (query chunk, key chunk)
    pair the band reaches, trimmed (:func:`band_call`).
    """
    band = global_band(causal, window)
    if band is None:
        return [(0, local_len, 0, local_len, None)]
    qids, kids = chunk_ids(world, rank, layout), chunk_ids(world, src, layout)
    c = local_len // len(qids)
    if band == CAUSAL:
        return _causal_plan(qids, kids, c, src == rank, local_len)
    calls = []
    for i, gq in enumerate(qids):
        for j, gk in enumerate(kids):
            call = band_call((i * c, (i + 1) * c), (j * c, (j + 1) * c), (gq - gk) * c, band)
            if call is not None:
                calls.append(call)
    return calls


def _causal_plan(qids, kids, c, own, local_len) -> List[Call]:
    if own:
        # both chunk lists are the same increasing sequence of equal chunks: top-left causal on the
        # local block is exactly the global causal mask restricted to these rows and keys
        return [(0, local_len, 0, local_len, CAUSAL)]
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
            calls.append((i * c, i_end * c, keys[j] * c, (keys[j_end - 1] + 1) * c, None))
            j = j_end
        i = i_end
    return calls


def gather_plan(world: int, rank: int, layout: str, causal: bool, local_len: int, window=None) -> List[Call]:
    """Calls of the all-gather variant: local query rows against keys ``[k0, k1)`` of the *whole*
    gathered sequence. No mask: one call. Otherwise one call per local query chunk, its keys cut to
    the band's reach (causal: keys ``[0, chunk end)``, the diagonal offset as a top-left window)."""
    band = global_band(causal, window)
    total = local_len * world
    if band is None:
        return [(0, local_len, 0, total, None)]
    ids = chunk_ids(world, rank, layout)
    c = local_len // len(ids)
    calls = []
    for j, g in enumerate(ids):
        call = band_call((j * c, (j + 1) * c), (0, total), g * c, band)
        if call is not None:
            calls.append(call)
    return calls
