"""FP8 backward on the portable Triton kernel (issue 27; backends/triton/bwd.py [Note] FP8): seeded random cases
(odd sizes, GQA/MQA, causal, band, padding with empty rows, BSHD strides, d != d_v, e4m3 / e5m2 dO, every gradient
type) written into NaN-filled buffers, checked against float64 gradients of attention of the dequantized inputs
within fusedattn.reference_fp8's derived bound and against fusedattn.fp8's emulation; the amaxes exact (the max of
the kernel's own unscaled gradients; equal to the emulation's bit for bit on an exactly representable problem)
and within the bound of float64's; the routing. Targets: interp (Triton's interpreter) and gpu (skips without
CUDA)."""
import math
import os

import pytest
import torch

from conftest import TARGETS
from fusedattn import fp8, plan
from fusedattn.backends.triton import bwd as triton_bwd
from fusedattn.problem import make_band
from fusedattn.reference_fp8 import fp8_backward_bound

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
KERNEL_TARGETS = TARGETS[1:]        # interp, gpu: the cpu target runs no kernel
GRADS = ("dQ", "dK", "dV")

# name -> (b, h_q, h_kv, s_q, s_kv, d, d_v), mask, q/k/v type, dO type, o type, gradient type, BSHD memory
CASES = {
    "odd_gqa_e4m3_g_f32": ((2, 4, 2, 37, 53, 40, 40), {}, E4M3, E4M3, E4M3, F32, False),
    "causal_bshd_do_e5m2_g_bf16": ((1, 6, 2, 45, 45, 64, 64), dict(causal=True), E4M3, E5M2, E4M3, BF16, True),
    "causal_br_mqa_g_e4m3": ((2, 2, 1, 29, 70, 24, 24), dict(causal=True, causal_alignment="bottom_right"), E4M3,
                             E5M2, E4M3, E4M3, False),
    "window_dv_o_bf16_g_f16": ((1, 4, 4, 33, 61, 48, 32), dict(window=(5, 3)), E4M3, E4M3, BF16, F16, True),
    "padding_e5m2_g_bf16": ((2, 4, 2, 37, 53, 32, 32), dict(seq_len_q=[30, 0], seq_len_kv=[11, 53]), E5M2, E5M2,
                            E5M2, BF16, False),
    "padding_causal_e5m2_g_e5m2": ((2, 2, 2, 41, 39, 16, 16), dict(causal=True, seq_len_q=[41, 17],
                                                                  seq_len_kv=[0, 25]), E5M2, E5M2, E5M2, E5M2, False),
    "decode_row_d128": ((3, 8, 2, 1, 100, 128, 128), dict(causal=True, causal_alignment="bottom_right"), E4M3, E5M2,
                        E4M3, BF16, False),
}


def _drawn_case(seed):
    """A random CASES entry (the same fields): shapes, mask, the five tensor types and the memory layout."""
    import random
    from test_fp8_kernel import drawn_shape_and_mask
    rng = random.Random(2700 + seed)
    shape, mask = drawn_shape_and_mask(rng)
    fp8_types = [E4M3, E5M2]
    return (shape, mask, rng.choice(fp8_types), rng.choice(fp8_types), rng.choice(fp8_types + [BF16, F32]),
            rng.choice([F32, BF16, F16, E4M3, E5M2]), rng.random() < 0.5)


# FUSEDATTN_FUZZ_SEEDS=N draws N more cases (``_drawn_case``) beside the chosen ones; CI draws 4
CASES.update({f"drawn{i}": _drawn_case(i) for i in range(int(os.environ.get("FUSEDATTN_FUZZ_SEEDS", "4")))})
SCALE_NAMES = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP", "scale_s",
               "scale_dQ", "scale_dK", "scale_dV", "scale_dP")


def _repro(case, device):
    return f"repro: pytest tests/test_fp8_bwd_kernel.py -k '{case} and {'gpu' if device == 'cuda' else 'interp'}'"


def _quantized(g, shape, dtype, bshd):
    """A random tensor [b, h, s, d] quantized per tensor (its memory [b, s, h, d] when bshd), and its descale."""
    b, h, s, d = shape
    x8, descale = fp8.quantize_per_tensor(torch.randn((b, s, h, d), generator=g) * 2, dtype)
    return (x8.transpose(1, 2) if bshd else x8.transpose(1, 2).contiguous()), descale


def _mask(spec, device):
    """The case's mask as sdpa_fp8_forward / _backward take it (band, seq_len_q / seq_len_kv int32 on device)."""
    lens = {n: torch.tensor(spec[n], dtype=torch.int32, device=device)
            for n in ("seq_len_q", "seq_len_kv") if n in spec}
    band = make_band(spec.get("causal", False), spec.get("causal_alignment", "top_left"), spec.get("window"))
    return dict(band=band, **lens)


def _ref_mask(spec):
    """The case's mask as reference_fp8 takes it (causal / alignment / window, CPU lengths)."""
    m = {n: v for n, v in spec.items() if n not in ("seq_len_q", "seq_len_kv")}
    m.update({n: torch.tensor(spec[n], dtype=torch.int32) for n in ("seq_len_q", "seq_len_kv") if n in spec})
    return m


def _pow2_scale(amax, dtype):
    """A recipe's next scale: the largest power of two that keeps amax * scale within dtype's range (1 for
    non-FP8 types, 2 for bf16 / fp16 so that the scale is exercised)."""
    if dtype not in fp8.FP8_DTYPES:
        return 1.0 if dtype == F32 else 2.0
    a = float(amax)
    return 1.0 if a == 0 else 2.0 ** math.floor(math.log2(fp8.FP8_MAX[dtype] / a))


def _problem(case, device, backend, spec=None):
    """q8, k8, v8, o, dO8, stats on ``device`` (the forward run on the target's backend) and the twelve scales:
    scale_dP and the FP8 gradients' scales from an emulated first pass (delayed scaling, powers of two).
    spec: the case's CASES-style entry (default ``CASES[case]``)."""
    shape, mask_spec, dtype, do_dtype, o_dtype, g_dtype, bshd = spec or CASES[case]
    b, h_q, h_kv, s_q, s_kv, d, d_v = shape
    g = torch.Generator().manual_seed(len(case))
    q8, dq = _quantized(g, (b, h_q, s_q, d), dtype, bshd)
    k8, dk = _quantized(g, (b, h_kv, s_kv, d), dtype, bshd)
    v8, dv = _quantized(g, (b, h_kv, s_kv, d_v), dtype, bshd)
    do8, ddo = _quantized(g, (b, h_q, s_q, d_v), do_dtype, bshd)
    s_s = fp8.DEFAULT_SCALE_S[dtype]
    scale_o = 4.0 if o_dtype in fp8.FP8_DTYPES else 1.0
    mask = _mask(mask_spec, device)
    q8, k8, v8, do8 = (x.to(device) for x in (q8, k8, v8, do8))
    o, stats, _, _ = fp8.sdpa_fp8_forward(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, descale_s=1 / s_s,
                                          scale_s=s_s, scale_o=scale_o, o_dtype=o_dtype, backend=backend, **mask)
    sc = dict(descale_q=dq, descale_k=dk, descale_v=dv, descale_o=1 / scale_o, descale_dO=ddo, descale_s=1 / s_s,
              descale_dP=1.0, scale_s=s_s, scale_dQ=1.0, scale_dK=1.0, scale_dV=1.0, scale_dP=1.0)
    cpu = lambda x: x.cpu() if isinstance(x, torch.Tensor) else x     # noqa: E731
    first = fp8.sdpa_fp8_backward(*(cpu(x) for x in (q8, k8, v8, o, do8, stats)), **sc, **_mask(mask_spec, "cpu"),
                                  grad_dtype=F32, backend="cpu")
    s_dp = _pow2_scale(first[6], do_dtype) if float(first[6]) else 1.0
    sc.update(scale_dP=s_dp, descale_dP=1 / s_dp)
    for name, amax in zip(GRADS, first[3:6]):
        sc[f"scale_{name}"] = _pow2_scale(amax, g_dtype)
    sc = {n: float(x) for n, x in sc.items()}
    return q8, k8, v8, o, do8, stats, sc, mask


def _ratio(err, bound):
    """max err / bound, where a zero bound (a gradient row nothing reaches: a key no row sees, an empty
    sequence) demands a zero error."""
    safe = torch.where(bound > 0, bound, torch.ones_like(bound))
    return torch.where(bound > 0, err / safe, torch.where(err > 0, float("inf"), 0.0)).max().item()


@pytest.fixture(autouse=True)
def portable_kernel(monkeypatch):
    """This file tests the portable kernel: the door's FP8 backward stays on it where the Gluon switch could run
    the call (``plan.FP8_BWD_GLUON``; tests/test_gluon_fp8_bwd.py tests that one)."""
    monkeypatch.setattr(plan, "FP8_BWD_GLUON", False)


@pytest.fixture(params=KERNEL_TARGETS)
def kernel_target(request):
    return request.param


@pytest.fixture(params=[False, True], ids=["mma8", "mma16"])
def mma16(request, monkeypatch):
    """The products as FP8 MMAs (mma8) or as fp16 MMAs on the same FP8 values (mma16, plan.FP8_BWD_MMA16,
    ``common.fp8_dot``): the same rounding points, so every check below holds for both."""
    monkeypatch.setattr(plan, "FP8_BWD_MMA16", request.param)
    return request.param


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_bwd_kernel_within_bound_and_matches_emulation(case, kernel_target, mma16):
    shape, mask_spec, dtype, do_dtype, o_dtype, g_dtype, bshd = CASES[case]
    device, backend = kernel_target
    rep = _repro(f"{case} and {'mma16' if mma16 else 'mma8'}", device)
    b, h_q, h_kv, s_q, s_kv, d, d_v = shape
    q8, k8, v8, o, do8, stats, sc, mask = _problem(case, device, backend)
    if bshd:
        assert q8.stride(1) == d and q8.stride(2) == h_q * d, rep        # BSHD memory reaches the kernel
    dev_sc = {n: torch.tensor([x], dtype=F32, device=device) for n, x in sc.items()}
    lens = {n: (fp8._lengths(mask.get(n), n, b, s, device) if n in mask else None)
            for n, s in (("seq_len_q", s_q), ("seq_len_kv", s_kv))}
    bufs = [torch.full(s, float("nan"), dtype=g_dtype, device=device)
            for s in ((b, h_q, s_q, d), (b, h_kv, s_kv, d), (b, h_kv, s_kv, d_v))]
    res = fp8._backward_kernel(q8, k8, v8, o, do8, stats, dev_sc, d ** -0.5, mask["band"], lens["seq_len_q"],
                               lens["seq_len_kv"], g_dtype, *bufs)
    assert all(r is buf for r, buf in zip(res, bufs)), rep
    res = [x.cpu() for x in res]
    for name, x in zip(GRADS, res):
        assert not x.float().isnan().any(), f"{name} elements left unwritten (NaN); {rep}"

    # the public door routes here and gives the same bits (the kernel is deterministic)
    res2 = fp8.sdpa_fp8_backward(q8, k8, v8, o, do8, stats, **dev_sc, **mask, grad_dtype=g_dtype, backend=backend)
    for name, x, y in zip(GRADS + ("amax_dQ", "amax_dK", "amax_dV", "amax_dP"), res, res2):
        assert torch.equal(x.float(), y.cpu().float()), f"{name}: the door differs from the kernel; {rep}"
    check_against_bound(CASES[case], res, sc, (q8, k8, v8, o, do8, stats), fp8.mma_unit(device), case, rep)


def check_against_bound(spec, res, sc, inputs, u_mma, case, rep):
    """An FP8 backward's result ``res`` (dQ, dK, dV, and the four amaxes, on the CPU) of the CASES-style entry
    ``spec`` with scales ``sc``, against float64 gradients of the dequantized inputs within
    reference_fp8.fp8_backward_bound (u_mma: the MMAs' accumulation unit) and against the emulation; the
    amaxes exact (the max of the kernel's own unscaled gradients) and within the bound of float64's. ``case``:
    its name (a drawn case may have too few terms for the bound to be tight)."""
    shape, mask_spec, dtype, do_dtype, o_dtype, g_dtype, bshd = spec
    q8, k8, v8, o, do8, stats = (x.cpu() for x in inputs)
    rmask = _ref_mask(mask_spec)
    refs, bounds, (ds_ref, ds_bound) = fp8_backward_bound(q8, k8, v8, o, do8, grad_dtype=g_dtype, mma_unit=u_mma,
                                                          with_ds=True, **rmask, **sc)
    _, bounds_fp32_sums = fp8_backward_bound(q8, k8, v8, o, do8, grad_dtype=g_dtype, **rmask, **sc)
    _, bounds32 = fp8_backward_bound(q8, k8, v8, o, do8, grad_dtype=F32, mma_unit=u_mma, **rmask, **sc)
    emu = fp8.sdpa_fp8_backward(q8, k8, v8, o, do8, stats, **sc, **_mask(mask_spec, "cpu"), grad_dtype=g_dtype,
                                backend="cpu")
    amaxes = [x.item() for x in res[3:]]
    for i, name in enumerate(GRADS):
        got = res[i].double() / sc[f"scale_{name}"]
        err = (got - refs[i]).abs()
        ratio = _ratio(err, bounds[i])
        assert ratio <= 1.0, f"{name} error exceeds the derived bound by {ratio:.3f}x; {rep}"
        # not vacuous: the error reaches a share of the fp32-sum bound (u_mma = 0); on the chosen cases (a drawn
        # one may have too few terms, or none, for its error to come near the bound)
        tight = _ratio(err, bounds_fp32_sums[i])
        assert case.startswith("drawn") or tight > 0.05, (
            f"{name} bound is vacuous here (error only {tight:.4f} of it); {rep}")
        # the emulation (the same rounding points): both within the bound of float64
        gap = _ratio((got - emu[i].double() / sc[f"scale_{name}"]).abs(), bounds[i] + bounds_fp32_sums[i])
        assert gap <= 1.0, f"{name}: kernel and emulation differ by {gap:.3f}x the sum of their bounds; {rep}"
        # amax: of the kernel's own unscaled gradient; exact when nothing rounds it on the way out
        out_max = res[i].float().abs().max().item()
        if g_dtype == F32 and sc[f"scale_{name}"] == 1.0:
            assert amaxes[i] == out_max, f"amax_{name} {amaxes[i]!r} != max |{name}| {out_max!r}; {rep}"
        else:
            u_g, a_g = fp8.ROUNDING[g_dtype]
            want = amaxes[i] * sc[f"scale_{name}"]
            assert abs(out_max - want) <= u_g * want + a_g, (
                f"amax_{name} * scale {want!r} vs max |{name}| {out_max!r}; {rep}")
        # and within the bound of float64's and the emulation's
        tol = bounds32[i].max().item()
        assert abs(amaxes[i] - refs[i].abs().max().item()) <= tol, f"amax_{name} off float64's by > {tol:.3g}; {rep}"
        assert abs(amaxes[i] - emu[3 + i].item()) <= 2 * tol, f"amax_{name} off the emulation's; {rep}"
    # amax_dP: max |dS| before scale_dP, within the bound on dS of float64's
    tol = ds_bound.max().item()
    assert abs(amaxes[3] - ds_ref.abs().max().item()) <= tol, f"amax_dP {amaxes[3]!r} vs float64; {rep}"
    assert abs(amaxes[3] - emu[6].item()) <= 2 * tol, f"amax_dP {amaxes[3]!r} vs emulation {emu[6].item()!r}; {rep}"


def _small_ints(g, shape, lo, hi, dtype):
    return torch.randint(lo, hi + 1, shape, generator=g).float().to(dtype)


@pytest.mark.parametrize("do_dtype", [E4M3, E5M2], ids=["do_e4m3", "do_e5m2"])
def test_fp8_bwd_kernel_exact_problem_equals_emulation(do_dtype, kernel_target, mma16):
    """One key per row (seq_len_kv = 1), small integers, power-of-two scales and stats = S: every product, sum
    and scale is exact in fp32 and P = 1 exactly (exp2(S * log2e - S * log2e) in the kernel, exp(S - S) in the
    emulation), so the kernel and the emulation agree bit for bit: gradients and all four amaxes."""
    device, backend = kernel_target
    rep = _repro(f"exact_problem and {'do_e4m3' if do_dtype == E4M3 else 'do_e5m2'} and "
                 f"{'mma16' if mma16 else 'mma8'}", device)
    b, h_q, h_kv, s_q, s_kv, d = 2, 4, 2, 19, 45, 64
    g = torch.Generator().manual_seed(11)
    q8 = _small_ints(g, (b, h_q, s_q, d), -2, 2, E4M3)
    k8 = _small_ints(g, (b, h_kv, s_kv, d), -2, 2, E4M3)
    v8 = _small_ints(g, (b, h_kv, s_kv, d), -3, 3, E4M3)
    do8 = _small_ints(g, (b, h_q, s_q, d), -3, 3, do_dtype)
    o8 = _small_ints(g, (b, h_q, s_q, d), -4, 4, E4M3)
    sc = dict(descale_q=0.5, descale_k=0.25, descale_v=1.0, descale_o=0.5, descale_dO=0.5, descale_s=1 / 256,
              descale_dP=1 / 8, scale_s=256.0, scale_dQ=1.0, scale_dK=1.0, scale_dV=1.0, scale_dP=8.0)
    lens = torch.ones(b, dtype=torch.int32)
    scale = d ** -0.5
    s0 = (q8.float() @ k8.float().repeat_interleave(h_q // h_kv, 1)[:, :, :1].transpose(-1, -2))
    stats = (s0 * scale * sc["descale_q"] * sc["descale_k"]).contiguous()           # exact: the lse of one key
    want = fp8.sdpa_fp8_backward(q8, k8, v8, o8, do8, stats, **sc, seq_len_kv=lens, grad_dtype=F32, backend="cpu")
    to = lambda x: x.to(device)        # noqa: E731
    got = fp8.sdpa_fp8_backward(*map(to, (q8, k8, v8, o8, do8, stats)), **sc, seq_len_kv=to(lens), grad_dtype=F32,
                                backend=backend)
    names = GRADS + ("amax_dQ", "amax_dK", "amax_dV", "amax_dP")
    for name, x, y in zip(names, got, want):
        assert torch.equal(x.cpu(), y), f"{name}: kernel {x.cpu().abs().max().item()!r} vs emulation " \
                                        f"{y.abs().max().item()!r} (max |diff| {(x.cpu() - y).abs().max().item()!r}); {rep}"
    assert all(float(x) > 0 for x in want[3:]), "the exact problem must give nonzero amaxes"


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts launch_bwd_fp8 calls (fusedattn.fp8 imports it at call time)."""
    calls = []
    real = triton_bwd.launch_bwd_fp8

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(triton_bwd, "launch_bwd_fp8", spy)
    return calls


def test_fp8_bwd_routing(kernel_target, kernel_calls):
    """backend='triton' (and 'auto' on CUDA, the Graph door's) runs the kernel; 'cpu' the emulation; per-head
    descales and a dO that is not float8 fall back to the emulation."""
    device, backend = kernel_target
    g = torch.Generator().manual_seed(5)
    q8, dq = _quantized(g, (1, 2, 20, 32), E4M3, False)
    k8, dk = _quantized(g, (1, 1, 20, 32), E4M3, False)
    v8, dv = _quantized(g, (1, 1, 20, 32), E4M3, False)
    do8, ddo = _quantized(g, (1, 2, 20, 32), E5M2, False)
    o = torch.randn(1, 2, 20, 32, generator=g).to(BF16)
    stats = torch.randn(1, 2, 20, 1, generator=g) + 3
    t = [x.to(device) for x in (q8, k8, v8, o, do8, stats)]
    sc = dict(descale_q=dq, descale_k=dk, descale_v=dv, descale_o=1.0, descale_dO=ddo, descale_s=1 / 256,
              descale_dP=1 / 64, scale_s=256.0, scale_dQ=1.0, scale_dK=1.0, scale_dV=1.0, scale_dP=64.0)
    band = make_band(True, "top_left", None)
    a = fp8.sdpa_fp8_backward(*t, **sc, band=band, backend=backend)
    assert len(kernel_calls) == 1
    if device == "cuda":
        fp8.sdpa_fp8_backward(*t, **sc, band=band)                 # auto
        assert len(kernel_calls) == 2
    n = len(kernel_calls)
    e = fp8.sdpa_fp8_backward(*t, **sc, band=band, backend="cpu")
    per_head = dict(sc, descale_q=torch.full((2,), float(dq), device=device))
    ph = fp8.sdpa_fp8_backward(*t, **per_head, band=band, backend=backend)
    assert len(kernel_calls) == n, "per-head descales must run the emulation"
    assert all(torch.equal(x, y) for x, y in zip(e, ph)), "per-head descales of one value: the emulation's bits"
    t16 = t[:4] + [(t[4].float() * float(ddo)).to(BF16), t[5]]
    fp8.sdpa_fp8_backward(*t16, **dict(sc, descale_dO=1.0), band=band, backend=backend)
    assert len(kernel_calls) == n, "a bf16 dO must run the emulation"
    for x, y in zip(a[:3], e[:3]):
        assert (x.float() - y.float()).abs().max().item() <= 0.1 * y.float().abs().max().item() + 1e-6


@pytest.mark.parametrize("version", [(3, 6, 0), (3, 9, 0)], ids=["3.6", "3.9"])
def test_fp16_mma_switch_routes_around_triton_36_fault(version, monkeypatch):
    """plan.fp8_mma16_compiles_right: before Triton 3.9 the fp16-MMA switch (forward and backward) runs only
    where d and d_v take one FP8 tile width (3.6 faulted at 48 / 32 and 40 / 32 on an H100, session 28); forcing
    the switch does not override that; the default buckets (every backward bucket since session 29, the forward's
    d256) take it where allowed."""
    from fusedattn.backends import compat
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(compat, "TRITON_VERSION", version)
    old = version < (3, 9)
    for d, d_v in ((48, 32), (40, 32), (64, 16)):
        assert plan.fp8_mma16_compiles_right(d, d_v) is not old
        for forced in ("FP8_BWD_MMA16", "FP8_FWD_MMA16"):
            monkeypatch.setattr(plan, forced, True)
        assert plan.fp8_bwd_mma16(d, d_v) is not old and plan.fp8_fwd_mma16(d, d_v) is not old
        for forced in ("FP8_BWD_MMA16", "FP8_FWD_MMA16"):
            monkeypatch.setattr(plan, forced, None)
    for d in (24, 40, 128, 224, 256):
        assert plan.fp8_mma16_compiles_right(d, d)
    assert plan.fp8_bwd_mma16(128, 128) and plan.fp8_bwd_mma16(224, 224) and plan.fp8_bwd_mma16(64, 64)
    assert plan.fp8_bwd_mma16(64, 16) is not old            # d64's bucket, unforced: 3.6 keeps the FP8 MMAs
    assert plan.fp8_bwd_tiles(64, 64) == plan._BWD_FP8_MMA16_SM90[64]
    assert plan.fp8_fwd_mma16(256, 256) and not plan.fp8_fwd_mma16(128, 128)
    assert plan.fp8_bwd_tiles(128, 128) == plan._BWD_FP8_MMA16_SM90[128]
    assert plan.fp8_fwd_tiles(224, 224) == plan._FWD_FP8_MMA16_SM90[256]
