"""The heavy-first (longest-first) CTA order of the Gluon backward kernels, on the CPU.

``bwd_dq_sm90._heavy_first`` maps a linear program id to (block index, batch x head pair) for the dQ pass,
the dK/dV pass and the single-pass backward (``HEAVY_FIRST``). Gluon kernels do not run under Triton's
interpreter, so this runs the helper's own source with NumPy arrays standing in for the kernel's integers
(``gl.minimum`` -> ``np.minimum``, ``gl.num_programs(1)`` -> the grid's pairs; ``//`` and ``%`` agree with
the kernel's truncating division on these non-negative values) and checks: a permutation of the grid for
many grid sizes and chunks; inside each chunk every block index is dispatched before the next one
(longest first); chunk 1 is the grid's own order; a list-scheduling model of 132 SMs shortens the tail at
2k causal. Plus the launchers' choice of the switch and the chunk (``launch`` replaced by a recorder).
The kernels themselves (bitwise equal gradients in either order): tests/test_gluon_bwd_dq.py and
tests/test_gluon_bwd_dkdv.py on an H100.
"""
import heapq
import types

import numpy as np
import pytest
import torch

from fusedattn.backends.gluon import bwd_dkdv_sm90, bwd_dq_sm90, bwd_fused_sm90
from fusedattn.problem import make_problem

H100_SMS = 132


def heavy_first_order(n_blocks, n_bh, chunk):
    """(block index, pair) of every linear program id 0 .. n_blocks * n_bh - 1, by the kernel helper's source."""
    fn = bwd_dq_sm90._heavy_first.fn
    gl = types.SimpleNamespace(minimum=np.minimum, num_programs=lambda axis: (n_blocks, n_bh)[axis])
    run = types.FunctionType(fn.__code__, {**fn.__globals__, "gl": gl}, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    lin = np.arange(n_blocks * n_bh, dtype=np.int64)
    blk, bh = run(lin, n_blocks, chunk)
    return np.broadcast_to(blk, lin.shape), np.broadcast_to(bh, lin.shape)


def host_chunk(grid, sms=H100_SMS):
    return max(1, min(sms // grid[0], grid[1]))


GRIDS = [(16, 128), (16, 1), (1, 5), (7, 3), (16, 8), (33, 10), (128, 4), (3, 100), (64, 32), (5, 67)]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_heavy_first_is_a_permutation_and_longest_first(grid):
    n_blocks, n_bh = grid
    for chunk in sorted({1, 2, 5, host_chunk(grid), n_bh, n_bh + 3}):
        blk, bh = heavy_first_order(n_blocks, n_bh, chunk)
        what = f"grid {grid} chunk {chunk}"
        assert blk.min() >= 0 and blk.max() < n_blocks and bh.min() >= 0 and bh.max() < n_bh, what
        pairs = blk * n_bh + bh
        assert np.array_equal(np.sort(pairs), np.arange(n_blocks * n_bh)), f"not a permutation: {what}"
        # chunk g: pairs [g * chunk, min(n_bh, (g + 1) * chunk)), one contiguous run of program ids; inside it
        # the block index never decreases (block 0, the longest CTA, of every pair first) and the pair cycles
        start = 0
        for c0 in range(0, n_bh, chunk):
            cnt = min(chunk, n_bh - c0)
            sl = slice(start, start + cnt * n_blocks)
            assert np.array_equal(np.sort(np.unique(bh[sl])), np.arange(c0, c0 + cnt)), what
            assert np.all(np.diff(blk[sl]) >= 0), f"a shorter CTA before a longer one: {what}"
            assert np.array_equal(bh[sl], c0 + np.arange(cnt * n_blocks) % cnt), what
            start += cnt * n_blocks


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_chunk_one_is_the_grids_own_order(grid):
    n_blocks, n_bh = grid
    blk, bh = heavy_first_order(n_blocks, n_bh, 1)
    lin = np.arange(n_blocks * n_bh)
    assert np.array_equal(blk, lin % n_blocks) and np.array_equal(bh, lin // n_blocks)


def _tail(works, sms=H100_SMS):
    """Makespan / mean load of list scheduling (each CTA to the first free SM, in launch order)."""
    free = [0.0] * sms
    for w in works:
        heapq.heappush(free, heapq.heappop(free) + w)
    return max(free) / (sum(works) / sms)


@pytest.mark.parametrize("which", ["dq", "dkdv"])
def test_heavy_first_shortens_the_causal_tail(which):
    """b4 h32 s2048 causal (issue 28's 2k config): 16 blocks of 128 per head, a CTA's time ~ its 64-row /
    64-key tiles. dQ maps block index i to query block 15 - i (REVERSE_M), dK/dV to key block i. The grid's
    own order (what the kernels did before) leaves ~6.5% of the SMs' time idle at the end, heavy first ~1.6%."""
    n_blocks, n_bh = 16, 128
    work = (lambda m: 2 * (m + 1)) if which == "dq" else (lambda n: 2 * (n_blocks - n))
    to_block = (lambda i: n_blocks - 1 - i) if which == "dq" else (lambda i: i)
    tails = {}
    for name, chunk in (("grid", 1), ("heavy", host_chunk((n_blocks, n_bh)))):
        blk, _ = heavy_first_order(n_blocks, n_bh, chunk)
        tails[name] = _tail([work(to_block(int(b))) for b in blk])
    assert tails["grid"] > 1.06 and tails["heavy"] < 1.02, tails


def _problem(causal=False, **kw):
    mk = lambda h, s: torch.zeros(4, h, s, 128, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = mk(32, 2048), mk(8, 2048), mk(8, 2048)
    p, extras = make_problem(q, k, v, causal=causal, **kw)
    return p, q, k, v


@pytest.fixture
def recorded(monkeypatch):
    """The two launchers with ``launch`` recording (kernel, grid, args, kwargs) instead of launching, TMA
    descriptors stubbed and 132 SMs."""
    calls = []
    monkeypatch.setattr(bwd_dq_sm90, "_sm_count", lambda index: H100_SMS)
    for mod in (bwd_dq_sm90, bwd_dkdv_sm90):
        monkeypatch.setattr(mod, "launch", lambda kernel, grid, *a, **kw: calls.append((kernel, grid, a, kw)))
        monkeypatch.setattr(mod, "_tma", lambda t, rows: ("tma", rows))
    return calls


@pytest.mark.parametrize("mask", ["none", "top_left", "bottom_right", "window", "window_right"])
@pytest.mark.parametrize("heavy_first", [None, False, True])
def test_launchers_choose_heavy_first_for_causal_like_bands(mask, heavy_first, recorded):
    kw = {"none": {}, "top_left": dict(causal=True), "bottom_right": dict(causal=True,
                                                                          causal_alignment="bottom_right"),
          "window": dict(window=(100, 0)), "window_right": dict(window=(-1, 64))}[mask]
    try:
        p, q, k, v = _problem(**kw)
    except Exception as e:      # a band this version does not take
        pytest.skip(f"{mask}: {e}")
    band = p.band
    causal_like = band is not None and band.right is not None and band.left is None
    lse = torch.zeros(p.b, p.h_q, p.s_q)
    delta = torch.zeros(p.b * p.h_q, p.s_q)
    bwd_dq_sm90.launch_dq_sm90(p, q, k, v, q, lse, delta, q, heavy_first=heavy_first)
    bwd_dkdv_sm90.launch_dkdv_sm90(p, q, k, v, q, lse, delta, k, v, heavy_first=heavy_first)
    want = causal_like if heavy_first is None else heavy_first
    (kdq, gdq, adq, kwdq), (kdk, gdk, adk, kwdk) = recorded
    assert kdq is bwd_dq_sm90._attn_bwd_dq_sm90 and kdk is bwd_dkdv_sm90._attn_bwd_dkdv_sm90
    assert gdq == (16, 128) and gdk == (16, 32)
    assert kwdq["HEAVY_FIRST"] is want and kwdk["HEAVY_FIRST"] is want, mask
    assert kwdq["REVERSE_M"] is causal_like
    # CHUNK: the last positional argument; 1 (the JIT's constant: the non-causal kernels are unchanged) when off
    assert adq[-1] == (132 // 16 if want else 1) and adk[-1] == (min(132 // 16, 32) if want else 1), mask


def test_fused_kernel_shares_the_chunk():
    assert bwd_fused_sm90._chunk is bwd_dq_sm90._chunk and bwd_fused_sm90._heavy_first is bwd_dq_sm90._heavy_first
    assert bwd_dkdv_sm90._heavy_first is bwd_dq_sm90._heavy_first
