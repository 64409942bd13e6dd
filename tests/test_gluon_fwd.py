"""The Gluon sm_90 forward kernel (fusedattn/backends/gluon/fwd_sm90.py) on an H100/H200.

Against a float64 reference by FlashAttention's rule (error at most 2x PyTorch's same-precision
error plus a small floor) and against our Triton kernel, on seeded cases: head dims 64/128 (and
224/256, which ``supports`` accepts only when asked: ``head_dims``),
fp16/bf16, causal top-left / bottom-right / none, lengths in {1, 17, 128, 200, 1000} with
s_q != s_kv both ways, GQA, BSHD and other strided layouts, sliding windows and ALiBi; with and
without the consumer warpgroups' ping-pong. Outputs and LSE live in NaN-guarded
buffers: an unwritten element stays NaN, a stray write outside the tensor is caught.
Every failure message carries a one-line repro. GPU-only: skipped (visibly) elsewhere.
"""
import dataclasses
import random

import pytest
import torch

import fusedattn
from fusedattn.problem import make_problem
from fusedattn.reference import attention_reference
from fusedattn.testing import (FLOOR, MODES, HopperCase, assert_error_within, guarded, max_err,
                               random_hopper_case)

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped"),
              pytest.mark.skipif(torch.cuda.is_available() and not HAS_SM90,
                                 reason="the Gluon forward kernel is Hopper-only (compute capability 9.x)")]

LENGTHS = (1, 17, 128, 200, 1000)
WIDE_D = (224, 256)     # 256-wide tiles (224: TMA zero-fills/clips columns 224..255)


def _random_case(seed):
    return random_hopper_case(seed, LENGTHS)


def run_case(case, nodeid, write_lse=True, pingpong=None):
    from fusedattn.backends.gluon.fwd_sm90 import TILE_D, launch_fwd_sm90, supports
    msg = case.repro(nodeid)
    gen = torch.Generator().manual_seed(case.seed)
    dt = getattr(torch, case.dtype)
    q = guarded((case.b, case.h_q, case.s_q, case.d), dt, "cuda", case.layout, gen)
    k = guarded((case.b, case.h_kv, case.s_kv, case.d), dt, "cuda", case.layout, gen)
    v = guarded((case.b, case.h_kv, case.s_kv, case.d), dt, "cuda", case.layout, gen)
    out = guarded((case.b, case.h_q, case.s_q, case.d), dt, "cuda", case.layout, fill=None)   # NaN-filled
    stats = guarded((case.b, case.h_q, case.s_q, 1), torch.float32, "cuda", "bhsd", fill=None)
    kw = case.kwargs()
    p, extras = make_problem(q.view, k.view, v.view, **kw)
    slopes = extras["slopes"]
    assert supports(p, q.view, k.view, v.view, out.view, head_dims=tuple(TILE_D), slopes=slopes), \
        f"supports() refused a case it should run. {msg}"
    lse = stats.view[..., 0] if write_lse else None
    launch_fwd_sm90(p, q.view, k.view, v.view, out.view, lse, slopes=slopes, pingpong=pingpong)
    torch.cuda.synchronize()

    gold_o, gold_lse = attention_reference(q.view.cpu(), k.view.cpu(), v.view.cpu(), **kw)
    base_o, _ = attention_reference(q.view.cpu(), k.view.cpu(), v.view.cpu(), dtype=dt, **kw)
    got = out.view.cpu()
    assert_error_within(got, gold_o, base_o, msg=msg)
    # against our Triton kernel: both within the rule of the same reference, so they differ
    # by at most the sum of the two errors
    tri_o, tri_stats = fusedattn.attention_forward(q.view, k.view, v.view, backend="triton", return_stats=True, **kw)
    e_tri = max_err(got, tri_o.cpu())
    bound = 2 * (2 * max_err(base_o, gold_o) + FLOOR[dt])
    assert e_tri <= bound, f"differs from the Triton kernel by {e_tri:.3e} > {bound:.3e}. {msg}"
    if write_lse:
        got_lse = stats.view.cpu().double()
        assert torch.isfinite(got_lse).all(), f"non-finite (unwritten?) LSE. {msg}"
        tol = 1e-3 * (1 + gold_lse.abs().max().item())
        e_lse = (got_lse - gold_lse.double()).abs().max().item()
        assert e_lse < tol, f"LSE differs from the reference's log-sum-exp by {e_lse:.3e}. {msg}"
        e_lse_tri = (got_lse - tri_stats.cpu().double()).abs().max().item()
        assert e_lse_tri < tol, f"LSE differs from the Triton kernel's by {e_lse_tri:.3e}. {msg}"
    for g, name in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (stats, "stats")):
        g.check_untouched(f"{name}. {msg}")


@pytest.mark.parametrize("pingpong", [False, True], ids=["plain", "pingpong"])
@pytest.mark.parametrize("s_kv", LENGTHS)
@pytest.mark.parametrize("s_q", LENGTHS)
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_lengths(mode, s_q, s_kv, pingpong, request):
    """Every (s_q, s_kv) pair and mask, d=128 bf16, GQA 4/2, BSHD memory."""
    seed = 100 * MODES.index(mode) + 10 * LENGTHS.index(s_q) + LENGTHS.index(s_kv)
    case = HopperCase(seed=seed, b=2, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=128, dtype="bfloat16", mode=mode,
                 layout="bshd")
    run_case(case, request.node.nodeid, pingpong=pingpong)


@pytest.mark.parametrize("pingpong", [False, True], ids=["plain", "pingpong"])
@pytest.mark.parametrize("seed", range(32), ids=lambda s: f"case{s}")
def test_gluon_fwd_random(seed, pingpong, request):
    """Seeded random geometries: head dim, dtype, mask, lengths, GQA/MQA, layout."""
    run_case(_random_case(seed), request.node.nodeid, pingpong=pingpong)


@pytest.mark.parametrize("pingpong", [False, True], ids=["plain", "pingpong"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gluon_fwd_gqa8(d, dtype, pingpong, request):
    """GQA 8/2 over several tiles, causal bottom-right, no LSE requested."""
    case = HopperCase(seed=7, b=1, h_q=8, h_kv=2, s_q=700, s_kv=1000, d=d, dtype=dtype, mode="bottom_right",
                 layout="bshd")
    run_case(case, request.node.nodeid, write_lse=False, pingpong=pingpong)


@pytest.mark.parametrize("d", WIDE_D)
@pytest.mark.parametrize("s_kv", LENGTHS)
@pytest.mark.parametrize("s_q", LENGTHS)
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_wide_lengths(mode, s_q, s_kv, d, request):
    """d=224/256: every (s_q, s_kv) pair and mask, bf16, GQA 4/2, BSHD memory."""
    seed = 1000 + 100 * MODES.index(mode) + 10 * LENGTHS.index(s_q) + LENGTHS.index(s_kv)
    case = HopperCase(seed=seed, b=2, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=d, dtype="bfloat16", mode=mode,
                 layout="bshd")
    run_case(case, request.node.nodeid)


@pytest.mark.parametrize("seed", range(24), ids=lambda s: f"case{s}")
def test_gluon_fwd_wide_random(seed, request):
    """Seeded random geometries at d=224/256: dtype, mask, lengths, GQA/MQA, strided layouts
    (the gapped ones catch a 256-wide box reading or writing past column 224)."""
    case = _random_case(2000 + seed)
    run_case(dataclasses.replace(case, d=WIDE_D[seed % 2]), request.node.nodeid)


@pytest.mark.parametrize("pingpong", [False, True], ids=["plain", "pingpong"])
@pytest.mark.parametrize("d", WIDE_D)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gluon_fwd_wide_gqa8(d, dtype, pingpong, request):
    """d=224/256, GQA 8/2 over several tiles, causal bottom-right, no LSE requested."""
    case = HopperCase(seed=8, b=1, h_q=8, h_kv=2, s_q=700, s_kv=1000, d=d, dtype=dtype, mode="bottom_right",
                 layout="bshd")
    run_case(case, request.node.nodeid, write_lse=False, pingpong=pingpong)


WINDOWS = ((0, 0), (37, 0), (200, 0), (64, 64), (130, -1), (-1, 90), (5, 300))


@pytest.mark.parametrize("alibi", [False, True], ids=["band", "alibi"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_window_alibi(mode, window, alibi, request):
    """Sliding windows (masked left edges, mask-free middles, masked right edges), each alignment,
    with and without ALiBi; lengths that leave partial tiles and s_q != s_kv."""
    seed = 3000 + 100 * MODES.index(mode) + 10 * WINDOWS.index(window) + alibi
    s_q, s_kv = (700, 1000) if seed % 2 else (1000, 333)
    case = HopperCase(seed=seed, b=1, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=128, dtype="bfloat16", mode=mode,
                 layout="bshd", window=window, alibi=alibi)
    run_case(case, request.node.nodeid)


@pytest.mark.parametrize("seed", range(16), ids=lambda s: f"case{s}")
def test_gluon_fwd_alibi_random(seed, request):
    """ALiBi (the paper's slopes for odd head counts too) with or without a mask, random geometry,
    every routed head dim."""
    case = _random_case(4000 + seed)
    rng = random.Random(seed)
    window = rng.choice([None, None, (rng.randrange(0, 300), rng.choice([0, -1, 50]))])
    case = dataclasses.replace(case, d=(64, 128, 224, 256)[seed % 4], alibi=seed % 4 != 3, window=window)
    run_case(case, request.node.nodeid)


def test_gluon_fwd_supports():
    """What the kernel refuses: windows, other head dims, fp32, misaligned bases, d != d_v."""
    from fusedattn.backends.gluon.fwd_sm90 import SUPPORTED_DIMS, TILE_D, supports

    def check(expect, what, q, k, v, out=None, head_dims=None, **kw):
        p, _ = make_problem(q, k, v, **kw)
        o = out if out is not None else torch.empty_like(q)
        assert supports(p, q, k, v, o, head_dims=head_dims) == expect, what

    mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dt)  # noqa: E731
    check(True, "plain bf16 d128", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128))
    check(True, "BSHD view", *(mk(1, 64, 2, 128).transpose(1, 2) for _ in range(3)))
    check(True, "window", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), window=(8, 0))
    check(False, "ALiBi without slopes", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), alibi=True)
    check(False, "padding mask", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128),
          seq_len_kv=torch.tensor([30], device="cuda", dtype=torch.int32))
    check(False, "bias", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128),
          attn_bias=mk(1, 1, 64, 64))
    check(False, "d=96", mk(1, 2, 64, 96), mk(1, 2, 64, 96), mk(1, 2, 64, 96))
    check(False, "d=96, all tile dims", mk(1, 2, 64, 96), mk(1, 2, 64, 96), mk(1, 2, 64, 96), head_dims=tuple(TILE_D))
    for d in WIDE_D:
        check(d in SUPPORTED_DIMS, f"d={d} by default", *(mk(1, 2, 64, d) for _ in range(3)))
        check(True, f"d={d} when asked", *(mk(1, 64, 2, d).transpose(1, 2) for _ in range(3)),
              head_dims=tuple(TILE_D))
    check(False, "fp32", *(mk(1, 2, 64, 64, dt=torch.float32) for _ in range(3)))
    check(False, "d_v != d", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 64))
    base = torch.randn(2 * 64 * 128 + 3, device="cuda", dtype=torch.bfloat16)
    odd = base[3:].view(1, 2, 64, 128)            # base pointer 6 bytes off 16-byte alignment
    check(False, "misaligned base", odd, mk(1, 2, 64, 128), mk(1, 2, 64, 128))
