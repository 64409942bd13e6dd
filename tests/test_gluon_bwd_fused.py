"""The experimental single-pass Gluon sm_90 backward (fusedattn/backends/gluon/bwd_fused_sm90.py) on an H100/H200.

dQ, dK and dV, written into NaN-filled guarded buffers, against float64 autograd of the reference by
FlashAttention's rule (error at most 2x PyTorch's same-precision error plus a small floor) and against
the two-pass Gluon backward (``bwd_dq_sm90`` + ``bwd_dkdv_sm90``, d=128 only) on the same inputs, over: d=128 and 64,
fp16/bf16, causal none / top-left / bottom-right, GQA 1 / 2 / 4 / MQA, odd lengths with s_q != s_kv
both ways, BSHD and other strided layouts, dropout (the forward's mask), the tuning switches one at a time and
the ``out=`` path (delta
and the zeroing of the dQ accumulator by one kernel, into NaN-filled buffers);
plus run-to-run agreement (dQ is reduced with atomics: not bitwise) and what ``supports`` refuses.
Every failure message carries a one-line repro. GPU-only: skipped (visibly) elsewhere.
"""

import pytest
import torch

from fusedattn.reference import attention_reference
from fusedattn.testing import FLOOR, MODES, HopperCase, assert_error_within, backward_inputs, guarded, max_err

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped"),
              pytest.mark.skipif(torch.cuda.is_available() and not HAS_SM90,
                                 reason="the Gluon fused backward kernel is Hopper-only (compute capability 9.x)")]

# (s_q, s_kv): single rows, odd lengths, partial key blocks (129 = one 128-key block + 1), s_q != s_kv
# both ways (bottom-right with s_q > s_kv has rows that see no key)
LENGTH_PAIRS = ((1, 1), (1, 300), (17, 129), (129, 17), (300, 1000), (1000, 300), (256, 256))


def reference_grads(q, k, v, do, dtype, **kw):
    """(dq, dk, dv) by autograd through the reference in ``dtype`` on the GPU; returned on the CPU."""
    qs, ks, vs = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, _ = attention_reference(qs, ks, vs, dtype=dtype, **kw)
    o.backward(do.to(dtype))
    return tuple(t.grad.cpu() for t in (qs, ks, vs))


def run_fused(case, p, q, k, v, do, lse, delta, out=None, **kw):
    """dQ, dK, dV from the fused kernel, in NaN-filled guarded buffers of the case's layout. out given: the
    ``out=`` path (delta and the zeroing of dq_acc by one kernel) on NaN-filled delta and dq_acc buffers,
    delta checked against the given one."""
    from fusedattn.backends.gluon.bwd_fused_sm90 import acc_rows, launch_bwd_fused_sm90, supports
    dt = getattr(torch, case.dtype)
    dq = guarded((case.b, case.h_q, case.s_q, case.d), dt, "cuda", case.layout, fill=None)
    dk = guarded((case.b, case.h_kv, case.s_kv, case.d), dt, "cuda", case.layout, fill=None)
    dv = guarded((case.b, case.h_kv, case.s_kv, case.d), dt, "cuda", case.layout, fill=None)
    assert supports(p, q.view, k.view, v.view, do.view, dq.view, dk.view, dv.view), \
        "supports() refused a case it should run"
    if out is None:
        launch_bwd_fused_sm90(p, q.view, k.view, v.view, do.view, lse, delta, dq.view, dk.view, dv.view, **kw)
    else:
        nan = float("nan")
        own = torch.full_like(delta, nan)
        acc = torch.full((p.b * p.h_q * acc_rows(p.s_q) * case.d, ), nan, dtype=torch.float32, device="cuda")
        launch_bwd_fused_sm90(p, q.view, k.view, v.view, do.view, lse, own, dq.view, dk.view, dv.view, out=out,
                              dq_acc=acc, **kw)
        torch.cuda.synchronize()
        # fp32 sums of 128 products in another order: equal to rounding
        assert max_err(own, delta) <= 1e-5 * (1 + delta.abs().max().item()), "delta of the out= path differs"
    torch.cuda.synchronize()
    return dq, dk, dv


def two_pass(p, q, k, v, do, lse, delta):
    """(dq, dk, dv) from the two-pass Gluon backward (dQ pass, then dK/dV pass) on the same delta."""
    from fusedattn.backends.gluon.bwd_dkdv_sm90 import launch_dkdv_sm90
    from fusedattn.backends.gluon.bwd_dq_sm90 import launch_dq_sm90
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launch_dq_sm90(p, q, k, v, do, lse, delta, dq)
    launch_dkdv_sm90(p, q, k, v, do, lse, delta, dk, dv)
    torch.cuda.synchronize()
    return dq, dk, dv


def run_case(case, nodeid, **kw):
    msg = case.repro(nodeid) + (f" {kw}" if kw else "")
    p, extras, q, k, v, do, out, lse, delta = backward_inputs(case)
    kw = dict(kw)
    got = run_fused(case, p, q, k, v, do, lse, delta, out=out if kw.pop("via_out", False) else None, **kw)
    ck = case.kwargs()
    gold = reference_grads(q.view, k.view, v.view, do.view, torch.float64, **ck)
    dt = getattr(torch, case.dtype)
    base = reference_grads(q.view, k.view, v.view, do.view, dt, **ck)
    # the two Gluon passes take d=128 only: at d=64 the float64 rule alone
    ref2 = two_pass(p, q.view, k.view, v.view, do.view, lse, delta) if case.d == 128 else (None,) * 3
    for name, g, gd, gb, r2 in zip(("dq", "dk", "dv"), got, gold, base, ref2):
        x = g.view.cpu()
        assert_error_within(x, gd, gb, msg=f"{name}. {msg}")
        if r2 is not None:
            # both within the rule of the same reference, so they differ by at most the sum of the two errors
            e2 = max_err(x, r2.cpu())
            bound = 2 * (2 * max_err(gb, gd) + FLOOR[dt])
            assert e2 <= bound, f"{name} differs from the two-pass Gluon backward by {e2:.3e} > {bound:.3e}. {msg}"
        g.check_untouched(f"{name}. {msg}")
    for g, name in ((q, "q"), (k, "k"), (v, "v"), (do, "do")):
        g.check_untouched(f"{name}. {msg}")


@pytest.mark.parametrize("s_q,s_kv", LENGTH_PAIRS, ids=lambda x: str(x))
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fused_lengths(mode, s_q, s_kv, request):
    """Length pairs x masks, bf16, GQA 2 (two query heads per kv head), BSHD memory."""
    seed = 7000 + 100 * MODES.index(mode) + 10 * LENGTH_PAIRS.index((s_q, s_kv))
    case = HopperCase(seed=seed, b=2, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=128, dtype="bfloat16", mode=mode,
                      layout="bshd")
    run_case(case, request.node.nodeid)


GEOMS = [  # (h_q, h_kv, s_q, s_kv, mode, layout)
    (3, 3, 300, 519, "bottom_right", "bshd"),     # GQA 1
    (8, 2, 700, 1000, "top_left", "gap"),         # GQA 4, row gaps in memory
    (4, 1, 1000, 300, "bottom_right", "sbhd"),    # MQA, s_q > s_kv
    (6, 2, 257, 257, "none", "bhsd"),             # GQA 3, contiguous
]


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: f"h{g[0]}-{g[1]}-s{g[2]}x{g[3]}-{g[4]}-{g[5]}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gluon_fused_geometries(geom, dtype, request):
    """dtypes, GQA/MQA group sizes, masks and strided layouts."""
    h_q, h_kv, s_q, s_kv, mode, layout = geom
    case = HopperCase(seed=8000 + 10 * GEOMS.index(geom) + (dtype == "float16"), b=2, h_q=h_q, h_kv=h_kv, s_q=s_q,
                      s_kv=s_kv, d=128, dtype=dtype, mode=mode, layout=layout)
    run_case(case, request.node.nodeid)


DROPOUT_CASES = [  # (h_q, h_kv, s_q, s_kv, mode, layout, d, dtype, p)
    (4, 2, 300, 1000, "none", "bshd", 128, "bfloat16", 0.1),
    (3, 3, 257, 519, "top_left", "bhsd", 128, "float16", 0.3),
    (8, 2, 700, 300, "bottom_right", "gap", 128, "bfloat16", 0.2),     # rows that see no key
    (4, 1, 129, 17, "none", "sbhd", 128, "float16", 0.5),              # MQA, a partial key block
    (12, 12, 1024, 1024, "top_left", "bshd", 64, "float16", 0.1),
    (6, 2, 257, 700, "none", "bhsd", 64, "bfloat16", 0.25),
]


@pytest.mark.parametrize("case_args", DROPOUT_CASES,
                         ids=lambda c: f"h{c[0]}-{c[1]}-s{c[2]}x{c[3]}-{c[4]}-d{c[6]}-p{c[8]}")
@pytest.mark.parametrize("odd_seed", [False, True], ids=["seed", "offset_past_2^32"])
def test_gluon_fused_dropout(case_args, odd_seed, request, monkeypatch):
    """Dropout ([Note] dropout: the forward's Philox mask, made per (keys, rows) tile on the transposed scores)
    against float64 autograd of the reference with the CPU path's mask (``backends.cpu.dropout_keep_mask``), and at
    d=128 against the two Gluon passes on the same mask; an odd case seed puts the counter offset past 2^32
    (``HopperCase.kwargs``). d=128 is not routed here (``DROPOUT_DIMS``: slower than the two passes) but the
    kernel takes it: the test turns it on."""
    from fusedattn.backends.gluon import bwd_fused_sm90
    monkeypatch.setattr(bwd_fused_sm90, "DROPOUT_DIMS", (64, 128))
    bwd_fused_sm90._problem_ok.cache_clear()
    request.addfinalizer(bwd_fused_sm90._problem_ok.cache_clear)
    h_q, h_kv, s_q, s_kv, mode, layout, d, dtype, p = case_args
    seed = 9100 + 10 * DROPOUT_CASES.index(case_args) + (1 if odd_seed else 0)
    case = HopperCase(seed=seed, b=2, h_q=h_q, h_kv=h_kv, s_q=s_q, s_kv=s_kv, d=d, dtype=dtype, mode=mode,
                      layout=layout, dropout=p)
    run_case(case, request.node.nodeid)


def test_gluon_fused_dropout_segments(request, monkeypatch):
    """Dropout with GQA under a causal mask on the segment-major loop (``SEGMENTS``, Triton 3.9's default there):
    each step's mask takes its own query head's counter base (the head changes inside the loop)."""
    from fusedattn.backends.gluon import bwd_fused_sm90
    monkeypatch.setattr(bwd_fused_sm90, "DROPOUT_DIMS", (64, 128))
    bwd_fused_sm90._problem_ok.cache_clear()
    request.addfinalizer(bwd_fused_sm90._problem_ok.cache_clear)
    for d in (64, 128):
        case = HopperCase(seed=9201 + d, b=2, h_q=8, h_kv=2, s_q=300, s_kv=700, d=d, dtype="bfloat16",
                          mode="bottom_right", layout="bshd", dropout=0.2)
        run_case(case, request.node.nodeid, segments=True)


@pytest.mark.parametrize("d,fused", [(64, True), (128, False)], ids=["d64-single-pass", "d128-two-passes"])
def test_gluon_fused_dropout_route(d, fused, monkeypatch):
    """Autograd with dropout (deterministic=False) takes the single pass at the head dims of ``DROPOUT_DIMS`` (d=64;
    ``GLUON_BWD_FUSED_MIN_WORK`` lowered under this test's size) and the two Gluon passes at d=128 (counted
    launches); the gradients pass the float64 rule with the CPU path's mask either way."""
    import fusedattn
    from fusedattn import functional
    from fusedattn.backends.gluon import bwd_dkdv_sm90, bwd_fused_sm90
    monkeypatch.setattr(functional, "GLUON_BWD_FUSED_MIN_WORK", {64: 0})
    from fusedattn.backends.triton import launch as launch_mod
    calls = []

    def counted(real, name):
        def run(*a, **k):
            if getattr(launch_mod._ahead, "active", None) is None:     # not the first forward's compile-ahead
                calls.append(name)
            return real(*a, **k)
        return run
    for mod, name in ((bwd_fused_sm90, "launch_bwd_fused_sm90"), (bwd_dkdv_sm90, "launch_dkdv_sm90")):
        monkeypatch.setattr(mod, name, counted(getattr(mod, name), name))
    gen = torch.Generator().manual_seed(9300 + d)
    mk = lambda h, s: torch.randn(2, s, h, d, generator=gen).to("cuda", torch.float16).transpose(1, 2)  # noqa: E731
    q, k, v, do = mk(4, 333), mk(2, 517), mk(2, 517), mk(4, 333)
    kw = dict(causal=True, causal_alignment="bottom_right", dropout_p=0.2, dropout_seed=77, dropout_offset=2 ** 32 + 3)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    fusedattn.attention(qs, ks, vs, deterministic=False, **kw).backward(do)
    assert calls == (["launch_bwd_fused_sm90"] if fused else ["launch_dkdv_sm90"]), calls
    msg = f"repro: pytest -k 'test_gluon_fused_dropout_route and d{d}' ; {kw}"
    gold = reference_grads(q, k, v, do, torch.float64, **kw)
    base = reference_grads(q, k, v, do, torch.float16, **kw)
    for name, g, gd, gb in zip(("dq", "dk", "dv"), (qs.grad, ks.grad, vs.grad), gold, base):
        assert_error_within(g.cpu(), gd, gb, msg=f"{name}. {msg}")


D64_GEOMS = [  # (h_q, h_kv, s_q, s_kv, mode, layout, dtype)
    (12, 12, 1024, 1024, "none", "bshd", "float16"),   # the ANCHORS d=64 shape's heads and length (b 2)
    (12, 12, 1024, 1024, "top_left", "bshd", "float16"),
    (8, 2, 700, 1000, "bottom_right", "gap", "bfloat16"),
    (4, 1, 1000, 300, "top_left", "sbhd", "float16"),
    (6, 2, 257, 257, "none", "bhsd", "bfloat16"),
]


@pytest.mark.parametrize("s_q,s_kv", LENGTH_PAIRS, ids=lambda x: str(x))
@pytest.mark.parametrize("mode", MODES)
def test_gluon_fused_d64_lengths(mode, s_q, s_kv, request):
    """d=64 (the dQ products become [64, 32] per warpgroup: a 32-column slice of each K tile): length pairs x
    masks, fp16, GQA 2, BSHD memory."""
    seed = 7500 + 100 * MODES.index(mode) + 10 * LENGTH_PAIRS.index((s_q, s_kv))
    case = HopperCase(seed=seed, b=2, h_q=4, h_kv=2, s_q=s_q, s_kv=s_kv, d=64, dtype="float16", mode=mode,
                      layout="bshd")
    run_case(case, request.node.nodeid)


@pytest.mark.parametrize("geom", D64_GEOMS, ids=lambda g: f"h{g[0]}-{g[1]}-s{g[2]}x{g[3]}-{g[4]}-{g[5]}-{g[6]}")
@pytest.mark.parametrize("variant", ["default", "stages3", "flat", "via_out", "atomic"])
def test_gluon_fused_d64_geometries(geom, variant, request):
    """d=64: GQA / MQA, masks, strided layouts, both dtypes, and the switches whose code depends on the head
    dim (the dQ staging boxes, dQ by atomics, the out= path's delta and zeroing kernel, a 3-deep ring)."""
    h_q, h_kv, s_q, s_kv, mode, layout, dtype = geom
    case = HopperCase(seed=8500 + 10 * D64_GEOMS.index(geom), b=2, h_q=h_q, h_kv=h_kv, s_q=s_q, s_kv=s_kv, d=64,
                      dtype=dtype, mode=mode, layout=layout)
    kw = {} if variant == "default" else VARIANTS[variant]
    run_case(case, request.node.nodeid, **kw)


VARIANTS = {"stages2": dict(stages=2), "stages3": dict(stages=3), "nolag": dict(lag=False), "forward": dict(reverse=False),
            "reverse": dict(reverse=True), "flat": dict(flat=True), "swizzled": dict(flat=False),
            "lag": dict(lag=True), "p16": dict(p16_ds=True), "swizzled_nolag": dict(flat=False, lag=False),
            "flat_nolag": dict(flat=True, lag=False), "swizzled_lag": dict(flat=False, lag=True),
            "flat_lag": dict(flat=True, lag=True), "dqfirst": dict(dq_first=True), "dqlast": dict(dq_first=False),
            "dqlast_lag": dict(dq_first=False, lag=True), "defer": dict(defer_dk=True, dq_first=True, lag=False),
            "defer_stages2": dict(defer_dk=True, dq_first=True, lag=False, stages=2), "via_out": dict(via_out=True),
            "via_out_defer": dict(via_out=True, defer_dk=True, dq_first=True, lag=False), "atomic": dict(dq_atomic=True, lag=False),
            "via_out_atomic": dict(via_out=True, dq_atomic=True, lag=False),
            "atomic_dqfirst_stages2": dict(dq_atomic=True, lag=False, dq_first=True, stages=2),
            "heavy_first": dict(heavy_first=True), "grid_order": dict(heavy_first=False),
            "rotate": dict(rotate=True), "rotate_forward": dict(rotate=True, reverse=False),
            "rotate_lag": dict(rotate=True, lag=True), "segments": dict(segments=True), "per_head": dict(segments=False),
            "segments_rotate": dict(segments=True, rotate=True), "segments_forward": dict(segments=True, reverse=False),
            "segments_lag": dict(segments=True, lag=True),
            "segments_defer": dict(segments=True, defer_dk=True, dq_first=True, lag=False),
            "frag": dict(flat="frag", lag=False), "frag_stages2": dict(flat="frag", lag=False, stages=2),
            "frag_segments": dict(flat="frag", lag=False, segments=True),
            "frag_via_out": dict(flat="frag", lag=False, via_out=True),
            "frag_dqfirst": dict(flat="frag", lag=False, dq_first=True),
            "frag_dqlast": dict(flat="frag", lag=False, dq_first=False)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", ["none", "top_left", "bottom_right"])
def test_gluon_fused_variants(mode, variant, request):
    """The tuning switches (a 3-deep Q/dO ring, LAG or not, query tiles in either order, flat, swizzled or
    fragment-order dQ staging, dS from 16-bit P, dQ before or after dK, dK deferred to the next step, dQ by atomics, heavy CTAs
    first or the grid's order, each run of query tiles over the group's heads in one loop or a loop per head), one
    at a time and the staging x LAG pairs, and the out= path (delta and the dq_acc zeroing in one kernel); GQA 4, many rounds
    of the ring."""
    case = HopperCase(seed=9000 + MODES.index(mode), b=1, h_q=8, h_kv=2, s_q=650, s_kv=700, d=128, dtype="bfloat16",
                      mode=mode, layout="bshd")
    run_case(case, request.node.nodeid, **VARIANTS[variant])


@pytest.mark.parametrize("mode", ["none", "bottom_right"])
def test_gluon_fused_repeatable(mode):
    """Two launches agree to rounding (dQ's adds come in any order: not bitwise; dK, dV have one writer each
    and are bitwise equal)."""
    case = HopperCase(seed=5, b=2, h_q=8, h_kv=2, s_q=900, s_kv=1100, d=128, dtype="bfloat16", mode=mode,
                      layout="bshd")
    p, _, q, k, v, do, out, lse, delta = backward_inputs(case)
    first = run_fused(case, p, q, k, v, do, lse, delta)
    again = run_fused(case, p, q, k, v, do, lse, delta)
    scale = first[0].view.float().abs().max().item()
    assert max_err(first[0].view, again[0].view) <= 1e-2 * scale, "dQ differs between two launches beyond rounding"
    for a, b in zip(first[1:], again[1:]):
        assert torch.equal(a.view, b.view), "dK/dV not bitwise reproducible"


def test_gluon_fused_supports():
    """What the kernel takes (d=128 or 64, fp16/bf16, no mask, causal, GQA, strided) and refuses (windows,
    ALiBi, padding, bias, other head dims, fp32, d != d_v, misaligned bases)."""
    from fusedattn.backends.gluon.bwd_fused_sm90 import supports
    from fusedattn.problem import make_problem

    def check(expect, what, q, k, v, **kw):
        p, _ = make_problem(q, k, v, **kw)
        do = torch.empty(q.shape[:-1] + (v.shape[-1],), device=q.device, dtype=q.dtype)
        got = supports(p, q, k, v, do, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        assert got == expect, what

    mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dt)  # noqa: E731
    check(True, "plain bf16 d128", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128))
    check(True, "BSHD view, causal", *(mk(1, 64, 2, 128).transpose(1, 2) for _ in range(3)), causal=True)
    check(True, "fp16 MQA bottom-right", mk(1, 4, 64, 128, dt=torch.float16), mk(1, 1, 64, 128, dt=torch.float16),
          mk(1, 1, 64, 128, dt=torch.float16), causal=True, causal_alignment="bottom_right")
    check(False, "window", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), window=(8, 0))
    check(False, "ALiBi", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), alibi=True)
    check(False, "dropout at d=128 (DROPOUT_DIMS)", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128),
          dropout_p=0.1)
    check(True, "dropout at d=64", mk(1, 2, 64, 64), mk(1, 2, 64, 64), mk(1, 2, 64, 64), dropout_p=0.1)
    check(False, "padding", mk(2, 2, 64, 128), mk(2, 2, 64, 128), mk(2, 2, 64, 128),
          seq_len_q=torch.tensor([30, 64], device="cuda", dtype=torch.int32))
    check(False, "bias", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 128), attn_bias=mk(1, 2, 64, 64))
    check(True, "d=64", mk(1, 2, 64, 64), mk(1, 2, 64, 64), mk(1, 2, 64, 64))
    check(False, "d=96", mk(1, 2, 64, 96), mk(1, 2, 64, 96), mk(1, 2, 64, 96))
    check(False, "d=256", mk(1, 2, 64, 256), mk(1, 2, 64, 256), mk(1, 2, 64, 256))
    check(False, "fp32", *(mk(1, 2, 64, 128, dt=torch.float32) for _ in range(3)))
    check(False, "d_v != d", mk(1, 2, 64, 128), mk(1, 2, 64, 128), mk(1, 2, 64, 64))
    base = torch.randn(2 * 64 * 128 + 3, device="cuda", dtype=torch.bfloat16)
    odd = base[3:].view(1, 2, 64, 128)            # base pointer 6 bytes off 16-byte alignment
    check(False, "misaligned base", odd, mk(1, 2, 64, 128), mk(1, 2, 64, 128))


@pytest.mark.parametrize("s", (600, 1000))
def test_gluon_fused_with_sink(s, monkeypatch):
    """A learnable sink keeps the single-pass backward (bench/NOTES.md 54: taking the two passes for it cost
    0.86x at b2 h16 8k): attention(..., sink=) with no mask and deterministic=False launches the fused kernel
    once and no two-pass kernel; dsink comes from the separate delta pass with the sink folded in
    (``launch_delta(..., dsink=)``, atomics; issue 26), never from torch's ``cpu.sink_grad``; dQ, dK, dV and
    dsink match float64."""
    import fusedattn
    from fusedattn.backends import cpu as cpu_backend
    from fusedattn.backends.gluon import bwd_dq_sm90, bwd_fused_sm90
    from fusedattn.backends.triton import bwd as triton_bwd
    from fusedattn.backends.triton import launch as launch_mod
    calls = []
    for mod, name in ((bwd_fused_sm90, "launch_bwd_fused_sm90"), (bwd_dq_sm90, "launch_dq_sm90")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    real_delta, real_sink_grad = triton_bwd.launch_delta, cpu_backend.sink_grad

    def delta_counted(*a, **kw):
        if getattr(launch_mod._ahead, "active", None) is None:      # run, not compiled ahead
            calls.append("launch_delta+dsink" if kw.get("dsink") is not None else "launch_delta")
        return real_delta(*a, **kw)
    monkeypatch.setattr(triton_bwd, "launch_delta", delta_counted)
    monkeypatch.setattr(cpu_backend, "sink_grad",
                        lambda *a, **kw: calls.append("sink_grad") or real_sink_grad(*a, **kw))
    gen = torch.Generator().manual_seed(54 + s)
    q, k, v = (torch.randn(2, s, 4, 128, generator=gen).transpose(1, 2).to("cuda", torch.bfloat16).requires_grad_()
               for _ in range(3))
    sink = torch.tensor([0.3, -1.0, 2.5, 7.0], device="cuda", requires_grad=True)
    do = torch.randn(2, 4, s, 128, generator=gen).to("cuda", torch.bfloat16)
    out = fusedattn.attention(q, k, v, sink=sink, deterministic=False)
    out.backward(do)
    torch.cuda.synchronize()
    # (the first forward under autograd also runs the backward's plan once, launching nothing, to compile it
    # ahead: functional._compile_backward_ahead; so the fused entry may be counted twice)
    assert "launch_bwd_fused_sm90" in calls and "launch_dq_sm90" not in calls, \
        f"backward launches: {calls} (repro: s={s})"
    assert "launch_delta+dsink" in calls and "launch_delta" not in calls and "sink_grad" not in calls, \
        f"dsink not folded into the delta pass: {calls} (repro: s={s})"
    qd, kd, vd, sd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v, sink))
    gold, gold_lse = attention_reference(qd, kd, vd, sink=sd)
    gold.backward(do.cpu().double())
    base = reference_grads(q, k, v, do, torch.bfloat16, sink=sink.detach())
    for name, got, want, same_prec in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), (qd.grad, kd.grad, vd.grad),
                                          base):
        assert_error_within(got.cpu(), want, same_prec, msg=f"{name} with a sink (repro: s={s})")
    # dsink = -sum over rows of p_sink * delta (2 x s rows, fp32 sums): bounded relative to sum |p_sink * delta|
    p_sink = torch.exp(sd.detach().view(1, 4, 1) - gold_lse.detach()[..., 0])
    delta = (gold.detach() * do.cpu().double()).sum(-1)
    scale = (p_sink * delta.abs()).sum(dim=(0, 2))
    err = (sink.grad.cpu().double() - sd.grad).abs()
    assert (err <= 2e-2 * scale + 1e-3).all(), f"dsink {sink.grad.tolist()} vs {sd.grad.tolist()} (repro: s={s})"


@pytest.mark.parametrize("causal", [False, True])
def test_d64_routing_by_work(causal, monkeypatch):
    """At d=64 autograd takes the single pass from plan.GLUON_BWD_FUSED_MIN_WORK on and not below it (nor when
    deterministic), and its gradients match the deterministic Triton pair's to rounding."""
    import fusedattn
    from fusedattn import plan
    from fusedattn.backends.gluon import bwd_fused_sm90 as fused
    calls = []
    real = fused.launch_bwd_fused_sm90
    monkeypatch.setattr(fused, "launch_bwd_fused_sm90", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    min_work = plan.GLUON_BWD_FUSED_MIN_WORK[64]

    def grads(b, h, s, deterministic=None):
        gen = torch.Generator().manual_seed(b * 1000 + s)
        q, k, v = (torch.randn(b, s, h, 64, generator=gen).to("cuda", torch.float16).transpose(1, 2)
                   .requires_grad_() for _ in range(3))
        out = fusedattn.attention(q, k, v, causal=causal, deterministic=deterministic)
        out.backward(torch.randn(out.shape, generator=gen).to("cuda", out.dtype))
        return [t.grad for t in (q, k, v)]

    b, h, s = (4, 16, 4096) if causal else (4, 16, 2048)
    work = b * h * s * s // (2 if causal else 1)
    assert work >= min_work
    small = grads(2, 4, 256)
    assert calls == [], "a call below GLUON_BWD_FUSED_MIN_WORK took the single pass"
    pair = grads(b, h, s, deterministic=True)
    assert calls == [], "a deterministic call took the single pass (its dQ adds come in any order)"
    single = grads(b, h, s)
    # (twice: the forward's compile-ahead of its backward goes the same way, launching nothing)
    assert calls, "a call of GLUON_BWD_FUSED_MIN_WORK took the Triton pair"
    for name, x, y in zip(("dq", "dk", "dv"), single, pair):
        scale = y.float().abs().max().item()
        assert max_err(x, y) <= 2e-2 * scale, f"{name}: single pass vs Triton pair differ beyond rounding"
    assert all(torch.isfinite(g).all() for g in small)
