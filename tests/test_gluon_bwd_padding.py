"""The Gluon backward passes (bwd_dq_sm90 then bwd_dkdv_sm90) on padded problems, on an H100/H200.

Per-batch lengths seq_len_q / seq_len_kv (0, 1, full and odd ones) on q, kv or both, every causal
alignment (bottom-right from each sequence's own lengths), sliding windows and ALiBi, head dims
64-256, GQA, strided layouts. The padding rows of Q, K, V and dO are overwritten with NaN before
the passes run (in-bounds memory that TMA loads: the kernels must neither use it nor let 0 * NaN
reach a valid row); delta comes from the separate delta pass, or (``write_delta``, banded problems
as ``functional._run_gluon_backward`` launches them) from the dQ pass into a NaN-filled buffer,
so its padding rows are NaN too; its valid rows must be finite. dQ, dK, dV live in NaN-filled guarded buffers and are
checked against float64 autograd of the reference (computed on the clean inputs) by FlashAttention's
rule; their padding rows must be exactly 0. Every failure message carries a one-line repro.
GPU-only: skipped (visibly) elsewhere.
"""
import dataclasses
import random

import pytest
import torch

import fusedattn
from fusedattn.problem import make_problem
from fusedattn.reference import attention_reference
from fusedattn.testing import (MODES, PAD_SHAPES, PAD_SIDES, HopperCase, assert_error_within, guarded, pad_case,
                               poison_padding, random_hopper_case)

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped"),
              pytest.mark.skipif(torch.cuda.is_available() and not HAS_SM90,
                                 reason="the Gluon backward is Hopper-only (compute capability 9.x)")]


def reference_grads(q, k, v, do, dtype, **kw):
    """(dq, dk, dv) by autograd through the reference in ``dtype`` on the GPU; returned on the CPU."""
    qs, ks, vs = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, _ = attention_reference(qs, ks, vs, dtype=dtype, **kw)
    o.backward(do.to(dtype))
    return tuple(t.grad.cpu() for t in (qs, ks, vs))


def run_padded(case, lens, nodeid, write_delta=False):
    """Both Gluon passes on ``case`` padded with lens = (len_q list | None, len_kv list | None); delta
    by the dQ pass (``out=``) when write_delta, else by the separate delta pass."""
    from fusedattn.backends.gluon import bwd_dkdv_sm90, bwd_dq_sm90
    from fusedattn.backends.triton.bwd import launch_delta
    msg = case.repro(nodeid) + f" lens={lens} write_delta={write_delta}"
    dt = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(case.seed)
    q = guarded((case.b, case.h_q, case.s_q, case.d), dt, "cuda", case.layout, gen)
    k = guarded((case.b, case.h_kv, case.s_kv, case.d), dt, "cuda", case.layout, gen)
    v = guarded((case.b, case.h_kv, case.s_kv, case.d), dt, "cuda", case.layout, gen)
    do = guarded((case.b, case.h_q, case.s_q, case.d), dt, "cuda", case.layout, gen)
    kw = case.kwargs()
    for name, n in zip(("seq_len_q", "seq_len_kv"), lens):
        if n is not None:
            kw[name] = torch.tensor(n, dtype=torch.int32, device="cuda")
    p, extras = make_problem(q.view, k.view, v.view, **kw)
    opts = dict(slopes=extras["slopes"], seq_len_q=extras["seq_len_q"], seq_len_kv=extras["seq_len_kv"])
    out, stats = fusedattn.attention_forward(q.view, k.view, v.view, return_stats=True, backend="triton", **kw)
    lse = stats[..., 0]
    gold = reference_grads(q.view, k.view, v.view, do.view, torch.float64, **kw)
    base = reference_grads(q.view, k.view, v.view, do.view, dt, **kw)

    poison_padding(q.view, lens[0])
    poison_padding(do.view, lens[0])
    poison_padding(k.view, lens[1])
    poison_padding(v.view, lens[1])
    grads = [guarded(t.view.shape, dt, "cuda", case.layout, fill=None) for t in (q, k, v)]   # NaN-filled
    dq, dk, dv = (g.view for g in grads)
    assert bwd_dq_sm90.supports(p, q.view, k.view, v.view, do.view, dq, **opts), \
        f"the dQ pass refused a case it should run. {msg}"
    assert bwd_dkdv_sm90.supports(p, q.view, k.view, v.view, do.view, dk, dv, **opts), \
        f"the dK/dV pass refused a case it should run. {msg}"
    delta = torch.full((case.b * case.h_q, case.s_q), float("nan"), device="cuda")
    if write_delta:
        assert bwd_dq_sm90.supports(p, q.view, k.view, v.view, do.view, dq, out=out, **opts), \
            f"the dQ pass refused to compute delta. {msg}"
        bwd_dq_sm90.launch_dq_sm90(p, q.view, k.view, v.view, do.view, lse, delta, dq, out=out, **opts)
        torch.cuda.synchronize()
        rows = delta.view(case.b, case.h_q, case.s_q).cpu()
        for bi, length in enumerate(lens[0] or [case.s_q] * case.b):
            assert rows[bi, :, :max(length, 0)].isfinite().all(), \
                f"delta of batch entry {bi}: valid rows not written or not finite. {msg}"
    else:
        launch_delta(p, out, do.view, delta)
        bwd_dq_sm90.launch_dq_sm90(p, q.view, k.view, v.view, do.view, lse, delta, dq, **opts)
    bwd_dkdv_sm90.launch_dkdv_sm90(p, q.view, k.view, v.view, do.view, lse, delta, dk, dv, **opts)
    torch.cuda.synchronize()

    for name, g, gd, bs, n in zip(("dq", "dk", "dv"), grads, gold, base, (lens[0], lens[1], lens[1])):
        got = g.view.cpu()
        assert_error_within(got, gd, bs, msg=f"{name}. {msg}")
        for bi, length in enumerate(n or ()):
            assert (got[bi, :, max(length, 0):] == 0).all(), f"{name}: padding rows of batch entry {bi} not 0. {msg}"
        g.check_untouched(f"{name}. {msg}")


@pytest.mark.parametrize("d", (128, 224, 256))
@pytest.mark.parametrize("side", PAD_SIDES)
@pytest.mark.parametrize("mode", MODES)
def test_gluon_bwd_padding(mode, side, d, request):
    """Lengths (0, 1, full, odd) on q, kv or both, every causal alignment, GQA 4/2, BSHD memory."""
    seed = 8000 + 100 * MODES.index(mode) + 10 * PAD_SIDES.index(side) + d % 7
    s_q, s_kv = PAD_SHAPES[seed % len(PAD_SHAPES)]
    case = HopperCase(seed=seed, b=4, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=d, dtype="bfloat16", mode=mode,
                      layout="bshd")
    # delta by the dQ pass (as the package launches banded problems) on two of the three sides
    write_delta = mode != "none" and PAD_SIDES.index(side) != 1
    run_padded(case, pad_case(case, side, seed), request.node.nodeid, write_delta=write_delta)


PAD_WINDOWS = ((37, 0), (200, 0), (64, 64), (-1, 90))


@pytest.mark.parametrize("alibi", [False, True], ids=["band", "alibi"])
@pytest.mark.parametrize("window", PAD_WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("mode", MODES)
def test_gluon_bwd_padding_window_alibi(mode, window, alibi, request):
    """Padding on both sides with sliding windows and ALiBi, each alignment."""
    seed = 9000 + 100 * MODES.index(mode) + 10 * PAD_WINDOWS.index(window) + alibi
    s_q, s_kv = PAD_SHAPES[seed % len(PAD_SHAPES)]
    case = HopperCase(seed=seed, b=4, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=128, dtype="bfloat16", mode=mode,
                      layout="bshd", window=window, alibi=alibi)
    run_padded(case, pad_case(case, "both", seed), request.node.nodeid, write_delta=True)


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"case{s}")
def test_gluon_bwd_padding_random(seed, request):
    """Seeded random geometries (GQA/MQA, strided layouts, fp16/bf16, head dims 64-256, any mask,
    sometimes a window or ALiBi) padded on a random side."""
    rng = random.Random(seed)
    case = random_hopper_case(9500 + seed, (1, 17, 129, 300, 1000))
    window = rng.choice([None, None, (rng.randrange(0, 300), rng.choice([0, -1, 50]))])
    case = dataclasses.replace(case, b=4, d=(64, 128, 224, 256)[seed % 4], alibi=rng.random() < 0.3, window=window)
    run_padded(case, pad_case(case, PAD_SIDES[seed % 3], 9500 + seed), request.node.nodeid,
               write_delta=case.mode != "none" or window is not None)
