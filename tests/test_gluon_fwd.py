"""The Gluon sm_90 forward kernel (fusedattn/backends/gluon/fwd_sm90.py) on an H100/H200.

Against a float64 reference by FlashAttention's rule (error at most 2x PyTorch's same-precision
error plus a small floor) and against our Triton kernel, on seeded cases: head dims 64/128 (and
224/256, which ``supports`` accepts only when asked: ``head_dims``),
fp16/bf16, causal top-left / bottom-right / none, lengths in {1, 17, 128, 200, 1000} with
s_q != s_kv both ways, GQA, BSHD and other strided layouts, sliding windows and ALiBi; with and
without the consumer warpgroups' ping-pong; padding (per-batch seq_len_q / seq_len_kv, with
NaN written into the padding rows of Q, K and V). Outputs and LSE live in NaN-guarded
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
from fusedattn.testing import (FLOOR, MODES, PAD_SHAPES, PAD_SIDES, WINDOWS, HopperCase, assert_error_within,
                               assert_lse_close,
                               guarded, max_err, pad_case, poison_padding, random_hopper_case, window_alibi_case)

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped"),
              pytest.mark.skipif(torch.cuda.is_available() and not HAS_SM90,
                                 reason="the Gluon forward kernel is Hopper-only (compute capability 9.x)")]

LENGTHS = (1, 17, 128, 200, 1000)
WIDE_D = (224, 256)     # 256-wide tiles (224: TMA zero-fills/clips columns 224..255)


def _random_case(seed):
    return random_hopper_case(seed, LENGTHS)


def run_case(case, nodeid, write_lse=True, pingpong=None, lens=(None, None), persistent=None, sink=None):
    """Run one case on the Gluon kernel and check it against the float64 reference and the
    Triton forward. lens: per-batch (len_q, len_kv) lists (either None: unpadded side); the
    reference and the Triton kernel see clean inputs, the Gluon kernel sees the padding rows
    of Q, K and V overwritten with NaN.

    persistent: None (the kernel's default grid) or launch_fwd_sm90's persistent-grid keywords
    (persistent, dynamic, head_group, ctas); the output and LSE must then also be bit-identical
    to the one-tile grid's (each work tile runs the same instructions), written into a second
    pair of NaN-filled buffers.

    sink: None, or the per-head sink logits (a list of h_q floats, -inf for a head without one)."""
    from fusedattn.backends.gluon.fwd_sm90 import TILE_D, launch_fwd_sm90, supports
    msg = (case.repro(nodeid) + (f" lens={lens}" if lens != (None, None) else "")
           + (f" sink={sink}" if sink is not None else ""))
    gen = torch.Generator().manual_seed(case.seed)
    dt = getattr(torch, case.dtype)
    q = guarded((case.b, case.h_q, case.s_q, case.d), dt, "cuda", case.layout, gen)
    k = guarded((case.b, case.h_kv, case.s_kv, case.d), dt, "cuda", case.layout, gen)
    v = guarded((case.b, case.h_kv, case.s_kv, case.d), dt, "cuda", case.layout, gen)
    out = guarded((case.b, case.h_q, case.s_q, case.d), dt, "cuda", case.layout, fill=None)   # NaN-filled
    stats = guarded((case.b, case.h_q, case.s_q, 1), torch.float32, "cuda", "bhsd", fill=None)
    kw = case.kwargs()
    for name, n in zip(("seq_len_q", "seq_len_kv"), lens):
        if n is not None:
            kw[name] = torch.tensor(n, dtype=torch.int32, device="cuda")
    if sink is not None:
        kw["sink"] = torch.tensor(sink, dtype=torch.float32, device="cuda")
    p, extras = make_problem(q.view, k.view, v.view, **kw)
    slopes = extras["slopes"]
    seq = dict(seq_len_q=extras["seq_len_q"], seq_len_kv=extras["seq_len_kv"], sink=extras["sink"])
    assert supports(p, q.view, k.view, v.view, out.view, head_dims=tuple(TILE_D), slopes=slopes, **seq), \
        f"supports() refused a case it should run. {msg}"

    kw_cpu = {key: (val.cpu() if isinstance(val, torch.Tensor) else val) for key, val in kw.items()}
    gold_o, gold_lse = attention_reference(q.view.cpu(), k.view.cpu(), v.view.cpu(), **kw_cpu)
    base_o, _ = attention_reference(q.view.cpu(), k.view.cpu(), v.view.cpu(), dtype=dt, **kw_cpu)
    tri_o, tri_stats = fusedattn.attention_forward(q.view, k.view, v.view, backend="triton", return_stats=True, **kw)
    tri_o, tri_stats = tri_o.cpu(), tri_stats.cpu()

    poison_padding(q.view, lens[0])
    poison_padding(k.view, lens[1])
    poison_padding(v.view, lens[1])
    lse = stats.view[..., 0] if write_lse else None
    grid_kw = {} if persistent is None else dict(persistent)
    launch_fwd_sm90(p, q.view, k.view, v.view, out.view, lse, slopes=slopes, pingpong=pingpong, **grid_kw, **seq)
    torch.cuda.synchronize()
    if persistent is not None:
        msg += f" persistent={persistent}"
        out1 = guarded((case.b, case.h_q, case.s_q, case.d), dt, "cuda", case.layout, fill=None)
        stats1 = guarded((case.b, case.h_q, case.s_q, 1), torch.float32, "cuda", "bhsd", fill=None)
        lse1 = stats1.view[..., 0] if write_lse else None
        launch_fwd_sm90(p, q.view, k.view, v.view, out1.view, lse1, slopes=slopes, pingpong=pingpong,
                        persistent=False, **seq)
        torch.cuda.synchronize()
        same = torch.equal(out.view.cpu().view(torch.int16), out1.view.cpu().view(torch.int16))
        assert same, (f"persistent output differs from the one-tile grid's by "
                      f"{max_err(out.view.cpu(), out1.view.cpu()):.3e}. {msg}")
        if write_lse:
            assert torch.equal(stats.view.cpu(), stats1.view.cpu()), f"persistent LSE differs. {msg}"
        out1.check_untouched(f"out (one-tile grid). {msg}")

    got = out.view.cpu()
    assert_error_within(got, gold_o, base_o, msg=msg)
    # against our Triton kernel: both within the rule of the same reference, so they differ
    # by at most the sum of the two errors
    e_tri = max_err(got, tri_o)
    bound = 2 * (2 * max_err(base_o, gold_o) + FLOOR[dt])
    assert e_tri <= bound, f"differs from the Triton kernel by {e_tri:.3e} > {bound:.3e}. {msg}"
    if lens[0] is not None:
        for bi, n in enumerate(lens[0]):
            assert (got[bi, :, max(n, 0):] == 0).all(), f"padding rows of batch entry {bi} are not 0. {msg}"
    if write_lse:
        got_lse = stats.view.cpu().double()
        # -inf on exactly the rows with no key (padding, band), NaN (unwritten) fails
        assert_lse_close(got_lse, gold_lse, msg=f"against the reference. {msg}")
        assert_lse_close(got_lse, tri_stats, msg=f"against the Triton kernel. {msg}")
        if lens[0] is not None:
            for bi, n in enumerate(lens[0]):
                # a padded row sees no key: -inf (issue 24's convention, cuDNN 9.14+)
                assert (got_lse[bi, :, max(n, 0):] == float("-inf")).all(), \
                    f"padding LSE of batch entry {bi} is not -inf. {msg}"
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




@pytest.mark.parametrize("alibi", [False, True], ids=["band", "alibi"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_window_alibi(mode, window, alibi, request):
    """Sliding windows (masked left edges, mask-free middles, masked right edges), each alignment,
    with and without ALiBi; lengths that leave partial tiles and s_q != s_kv."""
    case = window_alibi_case(3000, mode, window, alibi)
    run_case(case, request.node.nodeid)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gluon_fwd_alibi_user_slopes(dtype, mode, request):
    """A user's slopes from 0.001 to 9.5 (slope * c / scale up to ~14000: bf16 takes the column term
    through the tensor cores in three parts, fwd_sm90 [Note] ALiBi by wgmma; fp16 through the FMA),
    both grids (the persistent one bit-identical to the one-tile grid)."""
    seed = 3900 + 10 * MODES.index(mode) + (dtype == "float16")
    case = HopperCase(seed=seed, b=2, h_q=4, h_kv=2, s_q=700, s_kv=900, d=128, dtype=dtype, mode=mode,
                      layout="bshd", alibi=(0.001, 0.37, 3.0, 9.5))
    run_case(case, request.node.nodeid, persistent=dict(persistent=True))


@pytest.mark.parametrize("seed", range(16), ids=lambda s: f"case{s}")
def test_gluon_fwd_alibi_random(seed, request):
    """ALiBi (the paper's slopes for odd head counts too) with or without a mask, random geometry,
    every routed head dim."""
    case = _random_case(4000 + seed)
    rng = random.Random(seed)
    window = rng.choice([None, None, (rng.randrange(0, 300), rng.choice([0, -1, 50]))])
    case = dataclasses.replace(case, d=(64, 128, 224, 256)[seed % 4], alibi=seed % 4 != 3, window=window)
    run_case(case, request.node.nodeid)


# ------------------------------------------------------------------------------------------------
# padding: per-batch lengths seq_len_q / seq_len_kv (fwd_sm90's [Note] padding)

@pytest.mark.parametrize("d", (128,) + WIDE_D)
@pytest.mark.parametrize("side", PAD_SIDES)
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_padding(mode, side, d, request):
    """Lengths per batch entry (0, 1, full, odd) on q, kv or both, every causal alignment (the
    bottom-right diagonal from each sequence's own lengths), GQA 4/2, NaN in the padding rows."""
    seed = 5000 + 100 * MODES.index(mode) + 10 * PAD_SIDES.index(side) + d % 7
    s_q, s_kv = PAD_SHAPES[seed % len(PAD_SHAPES)]
    case = HopperCase(seed=seed, b=4, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=d, dtype="bfloat16", mode=mode,
                      layout="bshd")
    run_case(case, request.node.nodeid, pingpong=seed % 2 == 1, lens=pad_case(case, side, seed))


PAD_WINDOWS = ((37, 0), (200, 0), (64, 64), (-1, 90))


@pytest.mark.parametrize("alibi", [False, True], ids=["band", "alibi"])
@pytest.mark.parametrize("window", PAD_WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_padding_window_alibi(mode, window, alibi, request):
    """Padding on both sides with sliding windows (a left edge can start a CTA's band past
    len_kv: nothing to compute) and ALiBi, each alignment."""
    seed = 6000 + 100 * MODES.index(mode) + 10 * PAD_WINDOWS.index(window) + alibi
    s_q, s_kv = PAD_SHAPES[seed % len(PAD_SHAPES)]
    case = HopperCase(seed=seed, b=4, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=128, dtype="bfloat16", mode=mode,
                      layout="bshd", window=window, alibi=alibi)
    run_case(case, request.node.nodeid, lens=pad_case(case, "both", seed))


@pytest.mark.parametrize("seed", range(16), ids=lambda s: f"case{s}")
def test_gluon_fwd_padding_random(seed, request):
    """Seeded random geometries (GQA/MQA, strided layouts, fp16/bf16, every head dim, any mask,
    sometimes a window or ALiBi) padded on a random side; every other one without the LSE."""
    rng = random.Random(seed)
    case = _random_case(7000 + seed)
    window = rng.choice([None, None, (rng.randrange(0, 300), rng.choice([0, -1, 50]))])
    case = dataclasses.replace(case, b=4, d=(64, 128, 224, 256)[seed % 4], alibi=rng.random() < 0.3, window=window)
    run_case(case, request.node.nodeid, write_lse=seed % 2 == 0, pingpong=rng.random() < 0.5,
             lens=pad_case(case, PAD_SIDES[seed % 3], 7000 + seed))


# ------------------------------------------------------------------------------------------------
# sinks (fwd_sm90 [Note] sinks): one more softmax term per head, folded in the epilogue

@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"case{s}")
def test_gluon_fwd_sink_random(seed, request):
    """Sink logits from -inf (a head without one) to 12 (a sink that outweighs every key) on random
    geometries: every head dim, any mask, sometimes a window, ALiBi (the sink joins in the loop's
    shifted frame), padding or dropout, both grids (persistent bit-identical to the one-tile grid)."""
    rng = random.Random(seed)
    case = _random_case(9500 + seed)
    window = rng.choice([None, None, (rng.randrange(0, 300), rng.choice([0, -1, 50]))])
    case = dataclasses.replace(case, d=(64, 128, 224, 256)[seed % 4], alibi=rng.random() < 0.3, window=window,
                               dropout=rng.choice([0.0, 0.0, 0.2]))
    lens = (None, None)
    if seed % 3 == 0:
        case = dataclasses.replace(case, b=4)
        lens = pad_case(case, "both", 9500 + seed)
    sink = [rng.choice([float("-inf"), -3.0, 0.5, 2.0, 12.0]) for _ in range(case.h_q)]
    persistent = dict(persistent=True, ctas=1 + seed % 5) if seed % 2 else None
    run_case(case, request.node.nodeid, write_lse=seed % 4 != 1, lens=lens, persistent=persistent, sink=sink)


def test_gluon_fwd_sink_routes_to_gluon(monkeypatch):
    """attention(..., sink=) on an H100 runs the Gluon forward (not the portable kernel), and its
    output, stats and gradients match the float64 reference."""
    from fusedattn.backends.gluon import fwd_sm90
    from fusedattn.backends.triton import fwd as triton_fwd
    calls = []
    real = fwd_sm90.launch_fwd_sm90
    monkeypatch.setattr(fwd_sm90, "launch_fwd_sm90", lambda *a, **kw: calls.append("gluon") or real(*a, **kw))
    real_tri = triton_fwd.launch_fwd
    monkeypatch.setattr(triton_fwd, "launch_fwd", lambda *a, **kw: calls.append("triton") or real_tri(*a, **kw))
    gen = torch.Generator().manual_seed(26)
    q, k, v = (torch.randn(2, 300, 4, 128, generator=gen).transpose(1, 2).to("cuda", torch.bfloat16)
               .requires_grad_() for _ in range(3))
    sink = torch.tensor([0.3, -1.0, 2.5, 7.0], device="cuda", requires_grad=True)
    out, stats = fusedattn.attention(q, k, v, causal=True, sink=sink, return_stats=True)
    assert calls == ["gluon"], f"forward launches: {calls}"
    gold_o, gold_lse = attention_reference(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), causal=True,
                                           sink=sink.detach().cpu())
    base_o, _ = attention_reference(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), causal=True,
                                    sink=sink.detach().cpu(), dtype=torch.bfloat16)
    assert_error_within(out.detach().cpu(), gold_o, base_o, msg="sink through attention()")
    assert_lse_close(stats.detach().cpu().double(), gold_lse, msg="sink through attention()")
    out.float().square().sum().backward()
    qd, kd, vd, sd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v, sink))
    ref, _ = attention_reference(qd, kd, vd, causal=True, sink=sd)
    ref.square().sum().backward()
    for name, got, want in (("dq", q.grad, qd.grad), ("dk", k.grad, kd.grad), ("dv", v.grad, vd.grad)):
        scale = want.abs().max().item()
        assert max_err(got.cpu(), want) <= 0.02 * scale + 1e-3, f"{name} off by {max_err(got.cpu(), want):.3e}"
    assert torch.allclose(sink.grad.cpu().double(), sd.grad, rtol=2e-2, atol=2e-2), (sink.grad, sd.grad)


def test_gluon_fwd_supports():
    """What the kernel refuses: windows, other head dims, fp32, misaligned bases, d != d_v."""
    from fusedattn.backends.gluon.fwd_sm90 import SUPPORTED_DIMS, TILE_D, supports

    def check(expect, what, q, k, v, out=None, head_dims=None, lengths=None, **kw):
        # lengths: None (none passed to supports), True (the normalized ones), or a tensor for both
        p, extras = make_problem(q, k, v, **kw)
        o = out if out is not None else torch.empty_like(q)
        seq = {}
        if lengths is not None:
            seq = {name: extras[name] if lengths is True else lengths for name in ("seq_len_q", "seq_len_kv")}
        assert supports(p, q, k, v, o, head_dims=head_dims, **seq) == expect, what

    mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dt)  # noqa: E731
    check(True, "plain bf16 d128", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128))
    check(True, "BSHD view", *(mk(1, 64, 2, 128).transpose(1, 2) for _ in range(3)))
    check(True, "window", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), window=(8, 0))
    check(False, "ALiBi without slopes", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), alibi=True)
    lens = torch.tensor([30], device="cuda", dtype=torch.int32)
    check(False, "padding mask without its lengths", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128),
          seq_len_kv=lens)
    check(True, "padding mask", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), seq_len_kv=lens,
          lengths=True)
    check(False, "padding mask, lengths not int32", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128),
          seq_len_q=lens, lengths=lens.long())
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


# ------------------------------------------------------------------------------------------------
# the persistent grid (fwd_sm90 [Note] persistent grid): a few CTAs (``ctas``) so that each runs many
# work tiles of different lengths (ring and Q-slot phases across tiles, the dynamic tile counter and
# its reset between launches); every case also checks bit-identity with the one-tile grid (run_case)

P_SHAPES = ((1000, 1000), (1000, 200), (200, 1000), (17, 1000), (1000, 17), (1, 1))


def _grid(seed, ctas=None, dynamic=True, head_group=None):
    """Persistent-grid keywords for run_case; ctas default: 1..9 from the seed."""
    return dict(persistent=True, dynamic=dynamic, head_group=head_group, ctas=ctas or 1 + seed % 9)


@pytest.mark.parametrize("d", (128, 256))
@pytest.mark.parametrize("shape", P_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_persistent_lengths(mode, shape, d, request):
    """Each mask alignment and (s_q, s_kv) pair (partial tiles, s_q != s_kv both ways, a single
    row), d=128 (2 Q slots) and 256 (1 Q slot), GQA 4/2, BSHD, bf16."""
    seed = 8000 + 100 * MODES.index(mode) + 10 * P_SHAPES.index(shape) + d % 7
    case = HopperCase(seed=seed, b=2, h_q=4, h_kv=2, s_q=shape[0], s_kv=shape[1], d=d, dtype="bfloat16", mode=mode,
                      layout="bshd")
    run_case(case, request.node.nodeid, persistent=_grid(seed))


@pytest.mark.parametrize("variant", ["static", "hg1", "hg3", "all_sms", "pingpong"])
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_persistent_variants(mode, variant, request):
    """The static schedule (tile + nprog), head groups of 1 and 3 (a partial last group), the grid
    of every SM (one wave here, one tile per CTA) and the ping-pong turns counted across tiles; d=64
    and fp16 on some."""
    seed = 8500 + 10 * MODES.index(mode) + ["static", "hg1", "hg3", "all_sms", "pingpong"].index(variant)
    grid = {"static": _grid(seed, dynamic=False), "hg1": _grid(seed, head_group=1), "hg3": _grid(seed, head_group=3),
            "all_sms": dict(persistent=True), "pingpong": _grid(seed)}[variant]
    case = HopperCase(seed=seed, b=3, h_q=6, h_kv=2, s_q=900, s_kv=1000 if seed % 2 else 500, d=(64, 128)[seed % 2],
                      dtype=("float16", "bfloat16")[seed % 3 == 0], mode=mode, layout="bshd")
    run_case(case, request.node.nodeid, pingpong=variant == "pingpong", persistent=grid)


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"case{s}")
def test_gluon_fwd_persistent_random(seed, request):
    """Seeded random geometries (GQA/MQA, strided layouts, fp16/bf16, head dims 64/128/224/256, any
    mask, sometimes a window) on a few CTAs, static or dynamic."""
    rng = random.Random(seed)
    case = _random_case(9000 + seed)
    window = rng.choice([None, None, (rng.randrange(0, 300), rng.choice([0, -1, 50]))])
    case = dataclasses.replace(case, b=3, d=(64, 128, 224, 256)[seed % 4], window=window)
    run_case(case, request.node.nodeid, write_lse=seed % 3 != 0,
             persistent=_grid(seed, dynamic=rng.random() < 0.7, head_group=rng.choice([None, 1, 2, 5])))


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_persistent_window(mode, window, request):
    """Sliding windows (work tiles of very different lengths, masked edges), ALiBi on every other
    one, each alignment, on a few CTAs."""
    alibi = (MODES.index(mode) + WINDOWS.index(window)) % 2 == 1
    case = window_alibi_case(9300, mode, window, alibi)
    run_case(case, request.node.nodeid, persistent=_grid(case.seed))


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("side", PAD_SIDES)
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_persistent_padding(mode, side, d, request):
    """Padding on q, kv or both (empty sequences: work tiles with nothing to load, which still write
    zeros and pass their Q slot on), every alignment, NaN in the padding rows, on a few CTAs."""
    seed = 9600 + 100 * MODES.index(mode) + 10 * PAD_SIDES.index(side) + d % 7
    s_q, s_kv = PAD_SHAPES[seed % len(PAD_SHAPES)]
    case = HopperCase(seed=seed, b=4, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=d, dtype="bfloat16", mode=mode,
                      layout="bshd")
    run_case(case, request.node.nodeid, lens=pad_case(case, side, seed), persistent=_grid(seed))


@pytest.mark.parametrize("window", PAD_WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_persistent_padding_window(mode, window, request):
    """Padding on both sides with sliding windows (tiles whose band starts past len_kv) and ALiBi on
    every other one, on a few CTAs."""
    seed = 9800 + 100 * MODES.index(mode) + 10 * PAD_WINDOWS.index(window)
    s_q, s_kv = PAD_SHAPES[seed % len(PAD_SHAPES)]
    case = HopperCase(seed=seed, b=4, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=128, dtype="bfloat16", mode=mode,
                      layout="bshd", window=window, alibi=seed % 2 == 1)
    run_case(case, request.node.nodeid, lens=pad_case(case, "both", seed), persistent=_grid(seed))


def test_gluon_fwd_persistent_repeat():
    """The dynamic tile counter across launches of different sizes on one stream and on a second
    stream (each launch must leave it 0): outputs bit-identical to the one-tile grid's every time."""
    from fusedattn.backends.gluon.fwd_sm90 import launch_fwd_sm90
    gen = torch.Generator(device="cuda").manual_seed(11)
    side = torch.cuda.Stream()
    for it, (b, s, ctas) in enumerate([(2, 900, 5), (1, 300, 7), (3, 1000, None), (2, 900, 5), (1, 130, 2)]):
        mk = lambda h: torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
        q, k, v = mk(4), mk(2), mk(2)
        p, _ = make_problem(q, k, v, causal=True)
        ref = torch.full_like(q, float("nan"))
        launch_fwd_sm90(p, q, k, v, ref, None, persistent=False)
        stream = side if it % 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                got = torch.full_like(q, float("nan"))
                launch_fwd_sm90(p, q, k, v, got, None, persistent=True, ctas=ctas)
                torch.cuda.current_stream().synchronize()
                assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), f"launch {it} (b={b}, s={s})"



# ------------------------------------------------------------------------------------------------
# dropout (fwd_sm90 ``_drop``, backends/gluon/dropout.py): the reference drops exactly the CPU
# path's mask, so a wrong keep bit anywhere shows up as an error far past the rule's bound

@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"case{s}")
def test_gluon_fwd_dropout_random(seed, request):
    """Dropout p in (0.1, 0.5) on random geometries (every head dim, any mask, sometimes a window,
    ALiBi or padding), on both grids; seeds and counter offsets past 2^32 on odd cases."""
    rng = random.Random(seed)
    case = _random_case(9000 + seed)
    window = rng.choice([None, None, (rng.randrange(0, 300), rng.choice([0, -1, 50]))])
    case = dataclasses.replace(case, d=(64, 128, 224, 256)[seed % 4], dropout=rng.choice([0.1, 0.25, 0.5]),
                               alibi=rng.random() < 0.3, window=window)
    lens = (None, None)
    if seed % 3 == 0:
        case = dataclasses.replace(case, b=4)
        lens = pad_case(case, "both", 9000 + seed)
    persistent = dict(persistent=True, ctas=3) if seed % 2 else None
    run_case(case, request.node.nodeid, write_lse=seed % 4 != 1, lens=lens, persistent=persistent)


@pytest.mark.parametrize("mode", MODES)
def test_gluon_fwd_dropout_lengths(mode, request):
    """Dropout at d=128 on lengths that leave partial tiles both ways, GQA 2, BSHD."""
    case = HopperCase(seed=9100 + MODES.index(mode), b=2, h_q=4, h_kv=2, s_q=1000, s_kv=333, d=128,
                      dtype="bfloat16", mode=mode, layout="bshd", dropout=0.2)
    run_case(case, request.node.nodeid)
    run_case(dataclasses.replace(case, s_q=200, s_kv=1000, seed=case.seed + 50), request.node.nodeid)
