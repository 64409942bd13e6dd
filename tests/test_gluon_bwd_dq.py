"""The Gluon sm_90 dQ backward pass (fusedattn/backends/gluon/bwd_dq_sm90.py) on an H100/H200.

dQ against float64 autograd of the reference by FlashAttention's rule (error at most 2x PyTorch's
same-precision error plus a small floor) and against our Triton backward's dQ, on seeded cases:
head dims 64/128/224/256, fp16/bf16, causal top-left / bottom-right / none, sliding windows and
ALiBi, dropout, lengths in {1, 17, 129, 300, 1000} with s_q != s_kv both ways, GQA 1/4/MQA, BSHD
and other strided layouts.
dQ lives in a NaN-guarded buffer: an unwritten element stays NaN, a stray write outside the tensor
is caught. Plus bitwise determinism and what ``supports`` refuses. Every failure message carries a
one-line repro. GPU-only: skipped (visibly) elsewhere.
"""

import dataclasses
import random

import pytest
import torch

from fusedattn.problem import make_problem
from fusedattn.reference import attention_reference
from fusedattn.testing import (FLOOR, MODES, WINDOWS, HopperCase, assert_error_within, guarded, max_err,
                               random_hopper_case, triton_backward, window_alibi_case, backward_inputs)

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped"),
              pytest.mark.skipif(torch.cuda.is_available() and not HAS_SM90,
                                 reason="the Gluon dQ kernel is Hopper-only (compute capability 9.x)")]

LENGTHS = (1, 17, 129, 300, 1000)


def random_case(seed):
    return random_hopper_case(seed, LENGTHS)


def reference_dq(q, k, v, do, dtype, **kw):
    """dQ by autograd through the reference, in ``dtype``, on the GPU (float64 there is exact
    enough and much faster than on the CPU); returned on the CPU."""
    qs, ks, vs = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, _ = attention_reference(qs, ks, vs, dtype=dtype, **kw)
    o.backward(do.to(dtype))
    return qs.grad.cpu()


def run_gluon(case, p, extras, q, k, v, do, lse, delta, msg, out=None, **launch_kw):
    """The Gluon dQ into a NaN-filled guarded buffer. With ``out``, the kernel computes delta itself
    and writes it into a NaN-filled buffer, checked against ``delta``. launch_kw: tuning keywords of
    ``launch_dq_sm90``."""
    from fusedattn.backends.gluon.bwd_dq_sm90 import launch_dq_sm90, supports
    dq = guarded((case.b, case.h_q, case.s_q, case.d), getattr(torch, case.dtype), "cuda", case.layout,
                 fill=None)   # NaN-filled
    slopes = extras["slopes"]
    assert supports(p, q.view, k.view, v.view, do.view, dq.view, out=out, slopes=slopes), \
        f"supports() refused a case it should run. {msg}"
    d_buf = delta if out is None else torch.full_like(delta, float("nan"))
    launch_dq_sm90(p, q.view, k.view, v.view, do.view, lse, d_buf, dq.view, out=out, slopes=slopes, **launch_kw)
    torch.cuda.synchronize()
    if out is not None:
        assert torch.isfinite(d_buf).all(), f"delta not written everywhere. {msg}"
        e = (d_buf - delta).abs().max().item()
        assert e <= 1e-4 * (1 + delta.abs().max().item()), f"delta differs from rowsum(dO * O) by {e:.3e}. {msg}"
    return dq


def run_case(case, nodeid, write_delta=True):
    msg = case.repro(nodeid) + f" write_delta={write_delta}"
    dt = getattr(torch, case.dtype)
    p, extras, q, k, v, do, out, lse, delta = backward_inputs(case)
    dq = run_gluon(case, p, extras, q, k, v, do, lse, delta, msg, out=out if write_delta else None)
    got = dq.view.cpu()
    kw = case.kwargs()
    gold = reference_dq(q.view, k.view, v.view, do.view, torch.float64, **kw)
    base = reference_dq(q.view, k.view, v.view, do.view, dt, **kw)
    assert_error_within(got, gold, base, msg=msg)
    # against our Triton dQ: both within the rule of the same reference, so they differ by at
    # most the sum of the two errors
    e_tri = max_err(got, triton_backward(p, extras, q.view, k.view, v.view, out, do.view, lse)[0].cpu())
    bound = 2 * (2 * max_err(base, gold) + FLOOR[dt])
    assert e_tri <= bound, f"differs from the Triton dQ by {e_tri:.3e} > {bound:.3e}. {msg}"
    dq.check_untouched(f"dq. {msg}")
    for g, name in ((q, "q"), (k, "k"), (v, "v"), (do, "do")):
        g.check_untouched(f"{name}. {msg}")


@pytest.mark.parametrize("s_kv", LENGTHS)
@pytest.mark.parametrize("s_q", LENGTHS)
@pytest.mark.parametrize("mode", MODES)
def test_gluon_dq_lengths(mode, s_q, s_kv, request):
    """Every (s_q, s_kv) pair and mask, d=128 bf16, GQA 4/2, BSHD memory."""
    seed = 100 * MODES.index(mode) + 10 * LENGTHS.index(s_q) + LENGTHS.index(s_kv)
    case = HopperCase(seed=seed, b=2, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=128, dtype="bfloat16", mode=mode,
                  layout="bshd")
    run_case(case, request.node.nodeid)


@pytest.mark.parametrize("seed", range(24), ids=lambda s: f"case{s}")
def test_gluon_dq_random(seed, request):
    """Seeded random geometries: head dim 64/128, dtype, mask, lengths, GQA/MQA, layout; delta
    computed by the kernel (even seeds) or given (odd)."""
    run_case(random_case(seed), request.node.nodeid, write_delta=seed % 2 == 0)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gluon_dq_gqa8(d, dtype, request):
    """GQA 8/2 and MQA 8/1 over several tiles, causal bottom-right (s_q < s_kv) and top-left."""
    for i, (h_kv, mode, s_q, s_kv) in enumerate(((2, "bottom_right", 700, 1000), (1, "top_left", 1000, 700))):
        case = HopperCase(seed=7 + i, b=1, h_q=8, h_kv=h_kv, s_q=s_q, s_kv=s_kv, d=d, dtype=dtype, mode=mode,
                      layout="bshd")
        run_case(case, request.node.nodeid, write_delta=i == 0)


@pytest.mark.parametrize("d", [224, 256])
@pytest.mark.parametrize("s_kv", (17, 300, 1000))
@pytest.mark.parametrize("s_q", (1, 129, 1000))
@pytest.mark.parametrize("mode", MODES)
def test_gluon_dq_wide_lengths(mode, s_q, s_kv, d, request):
    """d=224/256 (32-key tiles, 256-wide boxes: columns 224..255 zero-filled on loads, clipped on the
    store): lengths and masks, bf16, GQA 4/2, BSHD memory; delta computed by the kernel."""
    seed = 500 + 100 * MODES.index(mode) + 10 * (s_q % 7) + s_kv % 7 + d
    case = HopperCase(seed=seed, b=2, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=d, dtype="bfloat16", mode=mode,
                      layout="bshd")
    run_case(case, request.node.nodeid)


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"case{s}")
def test_gluon_dq_wide_random(seed, request):
    """Seeded random geometries at d=224/256 (the gapped layouts catch a 256-wide box reading or
    writing past column 224; delta from the kernel on even seeds reads O with a column mask)."""
    case = dataclasses.replace(random_case(600 + seed), d=(224, 256)[seed % 2])
    run_case(case, request.node.nodeid, write_delta=seed % 4 < 2)


@pytest.mark.parametrize("alibi", [False, True], ids=["band", "alibi"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("mode", MODES)
def test_gluon_dq_window_alibi(mode, window, alibi, request):
    """Sliding windows (masked left edge, mask-free middle, masked right edge: a CTA's first key tile
    is not tile 0), each alignment, with and without ALiBi; partial tiles, s_q != s_kv."""
    case = window_alibi_case(3000, mode, window, alibi)
    run_case(case, request.node.nodeid, write_delta=case.seed % 3 != 0)


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"case{s}")
def test_gluon_dq_alibi_random(seed, request):
    """ALiBi (the paper's slopes, odd head counts too) with or without a window, random geometry,
    every head dim of the kernel."""
    rng = random.Random(seed)
    window = rng.choice([None, None, (rng.randrange(0, 300), rng.choice([0, -1, 50]))])
    case = dataclasses.replace(random_case(4000 + seed), d=(64, 128, 224, 256)[seed % 4], alibi=seed % 4 != 3,
                               window=window)
    run_case(case, request.node.nodeid, write_delta=seed % 2 == 0)


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"case{s}")
def test_gluon_dq_dropout_random(seed, request):
    """Dropout (``_drop_dp``: dP masked with the forward's mask and rescaled) on random geometry,
    every head dim, any mask, sometimes a window or ALiBi; seeds and counter offsets past 2^32 on
    odd cases (HopperCase)."""
    rng = random.Random(seed)
    window = rng.choice([None, None, (rng.randrange(0, 300), rng.choice([0, -1, 50]))])
    case = random_case(8000 + seed)
    # no single-key case: its exact gradient cancels to 0, which a delta taken from the 16-bit
    # output misses by O's rounding (test_gluon_bwd_dkdv.py's dropout test says more)
    case = dataclasses.replace(case, s_kv=max(case.s_kv, 17), d=(64, 128, 224, 256)[seed % 4],
                               alibi=rng.random() < 0.3, window=window, dropout=rng.choice([0.1, 0.3, 0.5]))
    run_case(case, request.node.nodeid, write_delta=seed % 2 == 0)


@pytest.mark.parametrize("mode", ["none", "top_left"])
def test_gluon_dq_deterministic(mode, request):
    """Two launches on the same inputs give bitwise equal dQ (one writer per element, no atomics)."""
    case = HopperCase(seed=3, b=2, h_q=8, h_kv=2, s_q=1000, s_kv=1000, d=128, dtype="bfloat16", mode=mode, layout="bshd")
    msg = case.repro(request.node.nodeid)
    p, extras, q, k, v, do, out, lse, delta = backward_inputs(case)
    first = run_gluon(case, p, extras, q, k, v, do, lse, delta, msg).view.clone()
    for _ in range(3):
        again = run_gluon(case, p, extras, q, k, v, do, lse, delta, msg).view
        assert torch.equal(first, again), f"dQ is not bitwise reproducible. {msg}"


@pytest.mark.parametrize("sms", [132, 20, 7])
@pytest.mark.parametrize("mode", ["top_left", "bottom_right", "alibi_dropout"])
def test_gluon_dq_heavy_first_is_bitwise_neutral(mode, sms, request, monkeypatch):
    """The heavy-first CTA order (``HEAVY_FIRST``, on by default under a causal mask) gives bitwise the dQ
    (and delta) of the grid's own order: a permutation of the CTAs, one writer per element. ``sms`` sets
    the chunk (``_chunk``: 16, 2, 1 pairs of this 8 x 24 grid; 16 leaves a partial last chunk)."""
    from fusedattn.backends.gluon import bwd_dq_sm90
    monkeypatch.setattr(bwd_dq_sm90, "_sm_count", lambda index: sms)
    case = HopperCase(seed=11, b=3, h_q=8, h_kv=2, s_q=1000, s_kv=700, d=128, dtype="bfloat16",
                      mode="top_left" if mode == "alibi_dropout" else mode, layout="bshd")
    if mode == "alibi_dropout":
        case = dataclasses.replace(case, alibi=True, dropout=0.2)
    msg = case.repro(request.node.nodeid) + f" sms={sms}"
    p, extras, q, k, v, do, out, lse, delta = backward_inputs(case)
    grid_order = run_gluon(case, p, extras, q, k, v, do, lse, delta, msg, out=out, heavy_first=False).view.clone()
    heavy = run_gluon(case, p, extras, q, k, v, do, lse, delta, msg, out=out, heavy_first=True).view
    assert torch.equal(grid_order, heavy), f"dQ differs between the CTA orders. {msg}"


def test_gluon_dq_supports():
    """What the kernel takes (windows, ALiBi, dropout, d 224/256) and refuses (padding, bias, softcap,
    other head dims, fp32, misaligned bases, d != d_v)."""
    from fusedattn.backends.gluon.bwd_dq_sm90 import supports

    def check(expect, what, q, k, v, **kw):
        p, extras = make_problem(q, k, v, **kw)
        do = torch.empty(q.shape[:-1] + (v.shape[-1],), device=q.device, dtype=q.dtype)
        assert supports(p, q, k, v, do, torch.empty_like(q), slopes=extras["slopes"]) == expect, what

    mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dt)  # noqa: E731
    check(True, "plain bf16 d128", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128))
    check(True, "plain fp16 d64 causal", *(mk(1, 2, 64, 64, dt=torch.float16) for _ in range(3)), causal=True)
    check(True, "BSHD view", *(mk(1, 64, 2, 128).transpose(1, 2) for _ in range(3)))
    check(True, "window", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), window=(8, 0))
    check(True, "ALiBi", mk(1, 3, 64, 128), mk(1, 3, 64, 128), mk(1, 3, 64, 128), alibi=True, causal=True)
    check(True, "d=224", mk(1, 2, 64, 224), mk(1, 2, 64, 224), mk(1, 2, 64, 224))
    check(False, "d=96", mk(1, 2, 64, 96), mk(1, 2, 64, 96), mk(1, 2, 64, 96))
    check(False, "padding", mk(2, 2, 64, 128), mk(2, 2, 64, 128), mk(2, 2, 64, 128),
          seq_len_kv=torch.tensor([30, 64], device="cuda", dtype=torch.int32))
    check(False, "bias", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), attn_bias=mk(1, 2, 64, 64))
    check(False, "softcap", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), softcap=30.0)
    check(True, "dropout", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), dropout_p=0.1)
    check(False, "fp32", *(mk(1, 2, 64, 64, dt=torch.float32) for _ in range(3)))
    check(False, "d_v != d", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 64))
    base = torch.randn(2 * 64 * 128 + 3, device="cuda", dtype=torch.bfloat16)
    odd = base[3:].view(1, 2, 64, 128)            # base pointer 6 bytes off 16-byte alignment
    check(False, "misaligned base", odd, mk(1, 2, 64, 128), mk(1, 2, 64, 128))
