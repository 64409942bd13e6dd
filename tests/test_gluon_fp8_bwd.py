"""FP8 backward on the Gluon sm_90 single-pass kernel's FP8 switch (issue 27; bwd_fused_sm90 [Note] FP8): the same
checks as tests/test_fp8_bwd_kernel.py's portable kernel (``check_against_bound``: within fusedattn.reference_fp8's
derived bound of float64 gradients of the dequantized inputs, against fusedattn.fp8's emulation, amaxes exact) on
the shapes the switch runs (d = d_v in 64 / 128, no mask or causal of either alignment, GQA / MQA, odd lengths,
BSHD, e4m3 / e5m2 inputs and dO, every gradient type; d = 224 / 256 on the two passes' switch, windows too),
written into NaN-filled buffers; the routing
(``plan.FP8_BWD_GLUON``, ``bwd_fused_sm90.supports_fp8``); the same cases on its FP8 MMAs (``FP8_MMA``, [Note]
FP8 MMAs, the default where dO has q's type). GPU only (Gluon has no interpreter): skips visibly without
CUDA; the builds are compiled for sm_90 on the CPU too."""
import pytest
import torch

from conftest import TARGETS, run_compile_child
from fusedattn import fp8, plan
from fusedattn.backends.gluon import bwd_dkdv_sm90, bwd_fused_sm90
from fusedattn.backends.triton import bwd as triton_bwd
from test_fp8_bwd_kernel import GRADS, _problem, check_against_bound

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
GPU = TARGETS[2]

# name -> (b, h_q, h_kv, s_q, s_kv, d, d_v), mask, q/k/v type, dO type, o type, gradient type, BSHD memory
CASES = {
    "d128_gqa_g_e4m3": ((2, 4, 2, 200, 333, 128, 128), {}, E4M3, E4M3, E4M3, E4M3, False),
    "d128_causal_bshd_do_e5m2_g_bf16": ((1, 4, 4, 190, 190, 128, 128), dict(causal=True), E4M3, E5M2, E4M3, BF16,
                                        True),
    "d128_causal_br_mqa_o_bf16_g_f32": ((2, 2, 1, 77, 300, 128, 128),
                                        dict(causal=True, causal_alignment="bottom_right"), E4M3, E4M3, BF16, F32,
                                        False),
    "d128_one_row_causal_br": ((3, 8, 2, 1, 100, 128, 128), dict(causal=True, causal_alignment="bottom_right"), E4M3,
                               E5M2, E4M3, BF16, False),
    "d64_e5m2_g_f16": ((2, 3, 3, 129, 65, 64, 64), {}, E5M2, E5M2, E5M2, F16, False),
    "d64_causal_gqa_bshd_g_e5m2": ((1, 6, 2, 100, 100, 64, 64), dict(causal=True), E4M3, E4M3, E4M3, E5M2, True),
    # d = 224 / 256: the two passes' switch (bwd_dkdv_sm90 ``launch_bwd_fp8``; windows too)
    "d256_causal_gqa_g_e4m3": ((1, 4, 2, 200, 333, 256, 256), dict(causal=True), E4M3, E4M3, E4M3, E4M3, False),
    "d224_plain_bshd_do_e5m2_g_bf16": ((2, 2, 2, 130, 97, 224, 224), {}, E4M3, E5M2, BF16, BF16, True),
    "d256_window_br_mqa_o_bf16_g_f32": ((2, 2, 1, 77, 190, 256, 256),
                                        dict(window=(40, 9), causal_alignment="bottom_right"), E4M3, E4M3, BF16, F32,
                                        False),
    "d224_e5m2_causal_br_one_row_g_f16": ((3, 2, 2, 1, 70, 224, 224),
                                          dict(causal=True, causal_alignment="bottom_right"), E5M2, E5M2, E5M2, F16,
                                          False),
}
# the two passes' cases: fp16 MMAs only (no FP8-MMA route there)
WIDE = {c for c, spec in CASES.items() if spec[0][5] > 128}


def _repro(case):
    return f"repro: pytest tests/test_gluon_fp8_bwd.py -k '{case}'"


@pytest.fixture
def gluon_on(monkeypatch):
    monkeypatch.setattr(plan, "FP8_BWD_GLUON", True)


@pytest.mark.parametrize("target", [GPU])
@pytest.mark.parametrize("case", list(CASES))
def test_gluon_fp8_bwd_within_bound_and_matches_emulation(case, target, gluon_on, monkeypatch):
    """The switch on fp16 MMAs (widened copies; the route where dO's type differs from q's, ``FP8_MMA`` off; at
    d = 224 / 256 the two passes, ``bwd_dkdv_sm90.launch_bwd_fp8``, checked to have run)."""
    monkeypatch.setattr(bwd_fused_sm90, "FP8_MMA", False)
    ran = []
    real = bwd_dkdv_sm90.launch_bwd_fp8
    monkeypatch.setattr(bwd_dkdv_sm90, "launch_bwd_fp8", lambda *a: (ran.append(1), real(*a))[1])
    _check_case(case, target, fp8.mma_unit(target[0]))
    assert bool(ran) == (case in WIDE), f"the two passes ran: {bool(ran)}; {_repro(case)}"


@pytest.mark.parametrize("target", [GPU])
@pytest.mark.parametrize("case", [c for c, spec in CASES.items() if spec[3] == spec[2] and c not in WIDE])
def test_gluon_fp8_bwd_fp8_mmas_within_bound(case, target, gluon_on, monkeypatch):
    """The FP8 MMAs (bwd_fused_sm90 ``FP8_MMA``, the default; [Note] FP8 MMAs; dO of q's type), checked as the
    switch on fp16
    MMAs. dV and dK add up every query tile of the group's heads in one FP8 accumulation (Hopper's ~14-bit sums,
    fwd_sm90 [Note] FP8): their chain is group * s_q / 32 K-steps, which ``mma_unit`` scales the bound's unit by."""
    monkeypatch.setattr(bwd_fused_sm90, "FP8_MMA", True)
    ran = []
    real = bwd_fused_sm90.fp8_transposes
    monkeypatch.setattr(bwd_fused_sm90, "fp8_transposes", lambda *a: (ran.append(1), real(*a))[1])
    b, h_q, h_kv, s_q, s_kv, d, d_v = CASES[case][0]
    chain = max(d // 32, h_q // h_kv * -(-s_q // 32))
    _check_case(case, target, fp8.mma_unit(target[0], chain))
    assert ran, f"the FP8 MMAs did not run; {_repro(case)}"


def _check_case(case, target, u_mma):
    spec = CASES[case]
    shape, mask_spec, dtype, do_dtype, o_dtype, g_dtype, bshd = spec
    device, backend = target
    rep = _repro(case)
    b, h_q, h_kv, s_q, s_kv, d, d_v = shape
    q8, k8, v8, o, do8, stats, sc, mask = _problem(case, device, backend, spec)
    if bshd:
        assert q8.stride(1) == d and q8.stride(2) == h_q * d, rep        # BSHD memory reaches the kernel
    dev_sc = {n: torch.tensor([x], dtype=F32, device=device) for n, x in sc.items()}
    bufs = [torch.full(s, float("nan"), dtype=g_dtype, device=device)
            for s in ((b, h_q, s_q, d), (b, h_kv, s_kv, d), (b, h_kv, s_kv, d_v))]
    res = fp8._backward_gluon(q8, k8, v8, o, do8, stats, dev_sc, d ** -0.5, mask["band"], g_dtype, *bufs)
    assert res is not None, f"the Gluon FP8 backward refused a case it runs; {rep}"
    assert all(r is buf for r, buf in zip(res, bufs)), rep
    res = [x.cpu() for x in res]
    for name, x in zip(GRADS, res):
        assert not x.float().isnan().any(), f"{name} elements left unwritten (NaN); {rep}"
    # the public door routes here: dK, dV and the amaxes of dK / dV bit for bit (each CTA sums its keys in a
    # fixed order); dQ's reduce-adds arrive in any order, so dQ and amax_dQ / amax_dP only within the bound below
    res2 = fp8.sdpa_fp8_backward(q8, k8, v8, o, do8, stats, **dev_sc, **mask, grad_dtype=g_dtype, backend=backend)
    for i in (1, 2, 4, 5):
        assert torch.equal(res[i].float(), res2[i].cpu().float()), f"output {i}: the door differs; {rep}"
    check_against_bound(spec, res, sc, (q8, k8, v8, o, do8, stats), u_mma, case, rep)


@pytest.fixture
def calls(monkeypatch):
    """Counts the Gluon FP8 backward's and the portable kernel's launches."""
    seen = {"gluon": 0, "portable": 0}
    real_g, real_p = bwd_fused_sm90.launch_bwd_fused_fp8, triton_bwd.launch_bwd_fp8

    def gluon(*a, **kw):
        seen["gluon"] += 1
        return real_g(*a, **kw)

    def portable(*a, **kw):
        seen["portable"] += 1
        return real_p(*a, **kw)
    monkeypatch.setattr(bwd_fused_sm90, "launch_bwd_fused_fp8", gluon)
    monkeypatch.setattr(triton_bwd, "launch_bwd_fp8", portable)
    return seen


@pytest.mark.parametrize("target", [GPU])
def test_gluon_fp8_bwd_routing(target, calls, monkeypatch):
    """With ``plan.FP8_BWD_GLUON`` on, the Graph door's FP8 backward runs the Gluon switch where it can (d = d_v =
    128, causal) and the portable kernel where it cannot (query lengths, d = 32); off, the portable kernel
    always."""
    device, backend = target
    spec = CASES["d128_causal_bshd_do_e5m2_g_bf16"]
    q8, k8, v8, o, do8, stats, sc, mask = _problem("routing", device, backend, spec)
    monkeypatch.setattr(plan, "FP8_BWD_GLUON", True)
    fp8.sdpa_fp8_backward(q8, k8, v8, o, do8, stats, **sc, **mask)
    assert calls == {"gluon": 1, "portable": 0}
    lens = torch.full((q8.shape[0],), q8.shape[2] - 3, dtype=torch.int32, device=device)
    fp8.sdpa_fp8_backward(q8, k8, v8, o, do8, stats, **sc, **mask, seq_len_q=lens)
    assert calls == {"gluon": 1, "portable": 1}, "query lengths: the portable kernel"
    narrow = [x[..., :32].contiguous() for x in (q8, k8, v8, o, do8)]
    fp8.sdpa_fp8_backward(*narrow, stats, **sc, **mask)
    assert calls == {"gluon": 1, "portable": 2}, "d = 32: the portable kernel"
    monkeypatch.setattr(plan, "FP8_BWD_GLUON", False)
    fp8.sdpa_fp8_backward(q8, k8, v8, o, do8, stats, **sc, **mask)
    assert calls == {"gluon": 1, "portable": 3}, "FP8_BWD_GLUON off: the portable kernel"


def test_gluon_fp8_bwd_gate(monkeypatch):
    """No GPU needed: ``plan.gluon_fp8_bwd`` sends d = d_v in 64 / 128 / 224 / 256 to the Gluon FP8 backward while
    ``FP8_BWD_GLUON`` is on and FUSEDATTN_GLUON is not 0 (the forward's switch), nothing else."""
    monkeypatch.delenv("FUSEDATTN_GLUON", raising=False)
    monkeypatch.setattr(plan, "FP8_BWD_GLUON", True)
    assert all(plan.gluon_fp8_bwd(d, d) for d in (64, 128, 224, 256))
    assert not any(plan.gluon_fp8_bwd(d, d_v) for d, d_v in ((128, 64), (256, 224), (96, 96), (32, 32), (192, 192)))
    monkeypatch.setenv("FUSEDATTN_GLUON", "0")
    assert not plan.gluon_fp8_bwd(128, 128), "FUSEDATTN_GLUON=0 must turn the Gluon FP8 backward off"
    monkeypatch.delenv("FUSEDATTN_GLUON")
    monkeypatch.setattr(plan, "FP8_BWD_GLUON", False)
    assert not plan.gluon_fp8_bwd(128, 128)


def test_gluon_fp8_bwd_compiles_for_sm90():
    """No GPU needed: the FP8 switch's build (d=64, no mask, e4m3 P, e5m2 dS, FP8 gradients) compiles for sm_90 with
    this Triton's compiler and ptxas (``tools/gluon_fused_check.compile_fused``; a child process, since Triton's
    interpreter, which CI turns on, compiles nothing), and its step loops keep the 16-bit kernel's 32
    exponentials, with the two FP8 roundings (F2FP) in them."""
    out = run_compile_child(
        "import gluon_fused_check as c\n"
        "from gluon_check import sass\n"
        "from gluon_bwd_check import inner_loops\n"
        "k = c.compile_fused(False, d=64, fp8_grad='fp8e4nv', DS_E5M2=True)\n"
        "for _, n, body in inner_loops(sass(k)):\n"
        "    print('LOOP', n, sum('MUFU.EX2' in b for b in body), sum('F2FP' in b for b in body))\n"
        "k = c.compile_fused(False, d=64, fp8_grad='fp8e4nv', fp8_mma=True, DS_E5M2=True)\n"
        "for _, n, body in inner_loops(sass(k)):\n"
        "    print('MMA8', sum('MUFU.EX2' in b for b in body), sum('QGMMA' in b for b in body),\n"
        "          sum('HGMMA' in b for b in body))\n")
    loops = [tuple(int(x) for x in line.split()[1:]) for line in out.splitlines() if line.startswith("LOOP")]
    steps = [loop for loop in loops if loop[1] == 32]
    assert steps, f"no step loop with the 32 exponentials: {loops}"
    assert all(f2fp >= 32 for _, _, f2fp in steps), f"the FP8 roundings are missing from a step loop: {steps}"
    # the FP8 MMAs' build ([Note] FP8 MMAs): each step loop's five products are FP8 wgmmas, d=64: S^T, dP^T 2
    # each (K 64 / 32), dV, dK 2 each (64 rows / 32), dQ 2 x 2 (two 64-key halves)
    mma8 = [tuple(int(x) for x in line.split()[1:]) for line in out.splitlines() if line.startswith("MMA8")]
    mma8 = [m for m in mma8 if m[0] == 32]
    assert mma8 and all(m[1:] == (12, 0) for m in mma8), f"FP8 MMA step loops (EX2, QGMMA, HGMMA): {mma8}"


def test_gluon_fp8_bwd_two_pass_compiles_for_sm90():
    """No GPU needed: the two passes' FP8 switch (bwd_dkdv_sm90 ``launch_bwd_fp8``: d = 224 on the 256-wide SPLIT
    dK/dV kernel, e5m2 dS, FP8 gradients; the dQ pass with an e4m3 O) compiles for sm_90 with this Triton, and its
    step loops hold the FP8 roundings: in the dK/dV pass 16 more conversions (F2FP) per loop than the 16-bit build
    in both warpgroups' loops (warpgroup 0 rounds P8, warpgroup 1 dS8), in the dQ pass 8 more (dS8) beside its 16
    exponentials."""
    out = run_compile_child(
        "from gluon_bwd_check import compile_dkdv, inner_loops\n"
        "from gluon_dq_check import compile_dq\n"
        "from gluon_check import sass\n"
        "for tag, k in (('DKDV8', compile_dkdv(224, False, fp8_grad='fp8e4nv', DS_E5M2=True)),\n"
        "               ('DKDV16', compile_dkdv(224, False, 'fp16')),\n"
        "               ('DQ8', compile_dq(224, False, fp8_grad='fp8e4nv', o_type='fp8e4nv')),\n"
        "               ('DQ16', compile_dq(224, False, 'fp16'))):\n"
        "    for _, n, body in inner_loops(sass(k)):\n"
        "        print(tag, sum('MUFU.EX2' in b for b in body), sum('F2FP' in b for b in body),\n"
        "              sum('HGMMA' in b for b in body))\n")
    rows = {}
    for line in out.splitlines():
        tag, *nums = line.split()
        if tag in ("DKDV8", "DKDV16", "DQ8", "DQ16"):
            rows.setdefault(tag, []).append(tuple(int(x) for x in nums))
    # step loops: the ones with wgmmas; dK/dV: warpgroup 0's (32 EX2) and warpgroup 1's (none)
    def f2fp(tag, ex2):
        return sorted(f for e, f, h in rows.get(tag, []) if h and e == ex2)
    assert f2fp("DKDV8", 32) and f2fp("DKDV8", 0), f"dK/dV step loops missing: {rows}"
    assert min(f2fp("DKDV8", 32)) >= max(f2fp("DKDV16", 32)) + 16, f"P8's rounding missing: {rows}"
    assert min(f2fp("DKDV8", 0)) >= max(f2fp("DKDV16", 0)) + 16, f"dS8's rounding missing: {rows}"
    assert f2fp("DQ8", 16) and min(f2fp("DQ8", 16)) >= max(f2fp("DQ16", 16)) + 8, f"dQ pass's dS8: {rows}"
