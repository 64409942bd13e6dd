"""The Gluon kernels' dropout mask (fusedattn/backends/gluon/dropout.py) against the CPU path's.

A small kernel computes ``dropout.keep`` for one [64, N] wgmma accumulator tile, in both
orientations (S [rows, keys] as the forward and the dQ pass hold it, S^T [keys, rows] as the
dK/dV pass does), at tile offsets, seeds and counter offsets past 2^32 and lengths that are not
multiples of 16; every bit must equal ``backends.cpu.dropout_keep_chunk``'s. The output lives in
a NaN-free int8 buffer prefilled with 7: an unwritten element fails. GPU-only (Hopper), skipped
visibly elsewhere; the kernels that use it are tested in test_gluon_fwd.py.
"""
import pytest
import torch

from fusedattn.backends.cpu import dropout_keep_chunk, dropout_threshold

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped"),
              pytest.mark.skipif(torch.cuda.is_available() and not HAS_SM90,
                                 reason="the Gluon kernels are Hopper-only (compute capability 9.x)")]


def _kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from fusedattn.backends.gluon import dropout

    @gluon.jit
    def keep_tile(OUT, SEED, OFFSET, bh, m0, n0, S_Q, S_KV, THRESHOLD, N: gl.constexpr, KEYS_LAST: gl.constexpr):
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, N, 16])
        drop = dropout.state(SEED, OFFSET, bh, S_Q, S_KV, THRESHOLD, 1.0)
        kept = dropout.keep(drop, m0, n0, layout, N, KEYS_LAST)
        m = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        n = gl.arange(0, N, layout=gl.SliceLayout(0, layout))
        gl.store(OUT + m[:, None] * N + n[None, :], kept.to(gl.int8))

    return keep_tile


@pytest.mark.parametrize("keys_last", [True, False], ids=["S", "S_T"])
@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("seed, offset", [(0, 0), (1234, 77), (2 ** 40 + 3, 2 ** 33 + 1), (2 ** 62 + 9, 5)])
def test_gluon_keep_matches_cpu_mask(keys_last, n, seed, offset):
    kernel = _kernel()
    b, h, s_q, s_kv, p = 2, 3, 300, 250, 0.3
    bh, m0, n0 = 4, 128, 64 if keys_last else 192
    out = torch.full((64, n), 7, dtype=torch.int8, device="cuda")
    kernel[(1, )](out, seed, offset, bh, m0, n0, s_q, s_kv, dropout_threshold(p), N=n, KEYS_LAST=keys_last,
                  num_warps=4)
    torch.cuda.synchronize()
    rows = torch.arange(m0, m0 + 64) if keys_last else torch.arange(n0, n0 + n)
    cols = torch.arange(n0, n0 + n) if keys_last else torch.arange(m0, m0 + 64)
    want = dropout_keep_chunk(seed, offset, h, s_q, s_kv, p, rows, cols, b, "cpu")[bh // h, bh % h]
    if not keys_last:
        want = want.T
    got = out.cpu()
    assert (got != 7).all(), "unwritten elements"
    bad = (got.bool() != want).nonzero()
    assert bad.numel() == 0, (f"{len(bad)} keep bits differ from the CPU mask, first at tile element "
                              f"{bad[0].tolist()} (n={n} keys_last={keys_last} seed={seed} offset={offset})")
    frac = want.float().mean().item()
    assert 0.5 < frac < 0.9, f"kept fraction {frac} for p={p}"
