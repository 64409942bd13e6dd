"""FP8 forward on the portable Triton kernel (issue 27; backends/triton/fwd.py [Note] FP8): seeded random cases
(odd sizes, GQA/MQA, causal, band, padding, BSHD strides, d != d_v, every output type) written into NaN-filled
buffers, checked against float64 attention of the dequantized inputs within fusedattn.reference_fp8's derived
bound and against fusedattn.fp8's emulation; amaxes against the emulation's; the routing of the two doors; the
kernel's fp32 -> FP8 rounding against torch's. Targets: interp (Triton's interpreter) and gpu (skips without CUDA)."""
import os

import pytest
import torch
import triton
import triton.language as tl

from conftest import TARGETS
from fusedattn import fp8, plan
from fusedattn.backends.triton import fwd as triton_fwd
from fusedattn.backends.triton.common import to_fp8
from fusedattn.problem import make_band
from fusedattn.reference_fp8 import EPS32, fp8_forward_bound

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KERNEL_TARGETS = TARGETS[1:]        # interp, gpu: the cpu target runs no kernel

# name -> (b, h_q, h_kv, s_q, s_kv, d, d_v), mask, input type, output type, scale_o, BSHD memory
CASES = {
    "odd_gqa_e4m3_o_f32": ((2, 4, 2, 37, 53, 40, 40), {}, E4M3, torch.float32, 1.0, False),
    "causal_bshd_o_bf16": ((1, 6, 2, 45, 45, 64, 64), dict(causal=True), E4M3, torch.bfloat16, 1.0, True),
    "causal_br_mqa_o_e4m3": ((2, 2, 1, 29, 70, 24, 24), dict(causal=True, causal_alignment="bottom_right"), E4M3,
                             E4M3, 4.0, False),
    "window_dv_o_f16": ((1, 4, 4, 33, 61, 48, 32), dict(window=(5, 3)), E4M3, torch.float16, 1.0, True),
    "padding_e5m2_o_bf16": ((2, 4, 2, 37, 53, 32, 32), dict(seq_len_q=[30, 0], seq_len_kv=[11, 53]), E5M2,
                            torch.bfloat16, 1.0, False),
    "padding_causal_e5m2_o_e5m2": ((2, 2, 2, 41, 39, 16, 16), dict(causal=True, seq_len_q=[41, 17],
                                                                  seq_len_kv=[0, 25]), E5M2, E5M2, 8.0, False),
    "decode_row_d128": ((3, 8, 2, 1, 100, 128, 128), dict(causal=True, causal_alignment="bottom_right"), E4M3,
                        torch.bfloat16, 1.0, False),
}


def drawn_shape_and_mask(rng):
    """A random (b, h_q, h_kv, s_q, s_kv, d, d_v) and mask spec (causal either alignment, a window, padding with
    empty sequences) for the FP8 kernels' drawn cases (this file's and test_fp8_bwd_kernel.py's)."""
    h_kv = rng.choice([1, 2])
    d = rng.choice([16, 32, 40, 64])
    shape = (rng.choice([1, 2]), h_kv * rng.choice([1, 2, 4]), h_kv, rng.choice([1, 9, 33]), rng.choice([7, 40, 65]),
             d, d if rng.random() < 0.7 else rng.choice([16, 32]))
    b, s_q, s_kv = shape[0], shape[3], shape[4]
    mask = rng.choice([{}, dict(causal=True), dict(causal=True, causal_alignment="bottom_right"),
                       dict(window=(rng.choice([0, 4]), rng.choice([0, 3])))])
    if rng.random() < 0.35:
        mask = dict(mask, seq_len_q=[rng.randint(0, s_q) for _ in range(b)],
                    seq_len_kv=[rng.randint(0, s_kv) for _ in range(b)])
    return shape, mask


def _drawn_case(seed):
    """A random CASES entry (the same fields): shapes, mask, input and output types, scale_o, memory layout."""
    import random
    rng = random.Random(2800 + seed)
    shape, mask = drawn_shape_and_mask(rng)
    o_dtype = rng.choice([E4M3, E5M2, torch.bfloat16, torch.float16, torch.float32])
    scale_o = rng.choice([4.0, 8.0]) if o_dtype in (E4M3, E5M2) else 1.0
    return shape, mask, rng.choice([E4M3, E5M2]), o_dtype, scale_o, rng.random() < 0.5


# FUSEDATTN_FUZZ_SEEDS=N draws N more cases (``_drawn_case``) beside the chosen ones; CI draws 4
CASES.update({f"drawn{i}": _drawn_case(i) for i in range(int(os.environ.get("FUSEDATTN_FUZZ_SEEDS", "4")))})


def _ratio(err, bound):
    """max err / bound, where a zero bound (an empty row, whose output is exactly 0) demands a zero error."""
    safe = torch.where(bound > 0, bound, torch.ones_like(bound))
    return torch.where(bound > 0, err / safe, torch.where(err > 0, float("inf"), 0.0)).max().item()


def _repro(case, device):
    return f"repro: pytest tests/test_fp8_kernel.py -k '{case} and {'gpu' if device == 'cuda' else 'interp'}'"


def _inputs(shape, dtype, bshd, seed):
    """q8 [b,h_q,s_q,d], k8, v8 (views of [b,s,h,d] memory when bshd) and their per-tensor descales, on the CPU."""
    b, h_q, h_kv, s_q, s_kv, d, d_v = shape
    g = torch.Generator().manual_seed(seed)
    out = []
    for h, s, dd in ((h_q, s_q, d), (h_kv, s_kv, d), (h_kv, s_kv, d_v)):
        x8, scale = fp8.quantize_per_tensor(torch.randn((b, s, h, dd), generator=g) * 2, dtype)
        out += [x8.transpose(1, 2) if bshd else x8.transpose(1, 2).contiguous(), scale]
    q8, dq, k8, dk, v8, dv = out
    return q8, k8, v8, dict(descale_q=dq, descale_k=dk, descale_v=dv)


def _mask(spec, device):
    """The case's mask as sdpa_fp8_forward takes it (band, seq_len_q / seq_len_kv int32 on ``device``)."""
    lens = {n: torch.tensor(spec[n], dtype=torch.int32, device=device)
            for n in ("seq_len_q", "seq_len_kv") if n in spec}
    band = make_band(spec.get("causal", False), spec.get("causal_alignment", "top_left"), spec.get("window"))
    return dict(band=band, **lens)


def _row_scale(q8, k8, dq, dk, d):
    """A_i of the bound (fusedattn.fp8's docstring): max_j attn_scale * descale_q * descale_k * sum |q8 k8|."""
    g = q8.shape[1] // k8.shape[1]
    qa = q8.double().abs() * float(dq)
    ka = (k8.double().abs() * float(dk)).repeat_interleave(g, 1)
    return (qa @ ka.transpose(-1, -2)).amax(-1, keepdim=True) * d ** -0.5


@pytest.fixture(params=KERNEL_TARGETS)
def kernel_target(request):
    return request.param


@pytest.fixture(autouse=True)
def _portable_only(monkeypatch):
    """This file tests the portable kernel: the Gluon sm_90 FP8 switch (which fusedattn.fp8 takes first on an
    H100 for head dims 64 / 128) is tests/test_gluon_fp8.py's."""
    monkeypatch.setattr(fp8, "_run_gluon_fp8", lambda *args, **kwargs: False)


@pytest.fixture(params=[False, True], ids=["mma8", "mma16"])
def mma16(request, monkeypatch):
    """The products as FP8 MMAs (mma8) or as fp16 MMAs on the same FP8 values (mma16, plan.FP8_FWD_MMA16,
    ``common.fp8_dot``): the same rounding points, so every check below holds for both."""
    monkeypatch.setattr(plan, "FP8_FWD_MMA16", request.param)
    return request.param


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_kernel_within_bound_and_matches_emulation(case, kernel_target, mma16):
    shape, mask_spec, dtype, o_dtype, scale_o, bshd = CASES[case]
    device, backend = kernel_target
    rep = _repro(f"{case} and {'mma16' if mma16 else 'mma8'}", device)
    b, h_q, h_kv, s_q, s_kv, d, d_v = shape
    q8, k8, v8, sc = _inputs(shape, dtype, bshd, seed=len(case))
    s_s = fp8.DEFAULT_SCALE_S[dtype]
    sc.update(descale_s=1 / s_s, scale_s=s_s, scale_o=scale_o)
    dev_sc = {n: torch.tensor([float(x)], dtype=torch.float32, device=device) for n, x in sc.items()}
    mask = _mask(mask_spec, device)
    qd, kd, vd = (x.to(device) for x in (q8, k8, v8))
    if bshd:
        assert qd.stride(1) == d and qd.stride(2) == h_q * d, rep          # BSHD memory reaches the kernel
    lens = {n: (fp8._lengths(mask.get(n), n, b, s, device) if n in mask else None)
            for n, s in (("seq_len_q", s_q), ("seq_len_kv", s_kv))}
    out = torch.full((b, h_q, s_q, d_v), float("nan"), dtype=o_dtype, device=device)
    stats_out = torch.full((b, h_q, s_q, 1), float("nan"), dtype=torch.float32, device=device)
    o, stats, amax_s, amax_o = fp8._forward_kernel(qd, kd, vd, dev_sc, d ** -0.5, mask["band"], lens["seq_len_q"],
                                                   lens["seq_len_kv"], o_dtype, out=out, stats_out=stats_out)
    assert o is out and stats is stats_out, rep
    o, stats, amax_s, amax_o = (x.cpu() for x in (o, stats, amax_s, amax_o))
    assert not o.float().isnan().any(), f"output elements left unwritten (NaN); {rep}"
    assert not stats.isnan().any(), f"stats left unwritten (NaN); {rep}"

    # the public door routes here and gives the same bits (the kernel is deterministic)
    o2, stats2, amax_s2, amax_o2 = fp8.sdpa_fp8_forward(qd, kd, vd, **dev_sc, **mask, o_dtype=o_dtype,
                                                        backend=backend)
    assert torch.equal(o2.cpu().float(), o.float()) and torch.equal(stats2.cpu(), stats), rep
    assert amax_s2.item() == amax_s.item() and amax_o2.item() == amax_o.item(), rep

    ref_mask = {n: v for n, v in mask_spec.items() if n not in ("seq_len_q", "seq_len_kv")}
    ref_mask.update({n: torch.tensor(mask_spec[n], dtype=torch.int32) for n in ("seq_len_q", "seq_len_kv")
                     if n in mask_spec})
    # the GPU's FP8 MMAs sum with fewer bits than fp32: their unit u_mma joins the bound (fusedattn.fp8)
    u_mma = fp8.mma_unit(device)
    ref, lse, bound = fp8_forward_bound(q8, k8, v8, o_dtype=o_dtype, mma_unit=u_mma, **ref_mask, **sc)
    err = (o.double() / scale_o - ref).abs()
    ratio = _ratio(err, bound)
    assert ratio <= 1.0, f"error exceeds the derived bound by {ratio:.3f}x; {rep}"
    # not vacuous: the error reaches a share of the fp32-sum bound (u_mma = 0), P8's rounding dominating it
    _, _, bound_fp32_sums = fp8_forward_bound(q8, k8, v8, o_dtype=o_dtype, **ref_mask, **sc)
    tight = _ratio(err, bound_fp32_sums)
    # measured 0.45-0.73 on the chosen cases; a drawn one may have too few terms to come near the bound
    assert case.startswith("drawn") or tight > 0.05, f"bound is vacuous here (error only {tight:.4f} of it); {rep}"

    # the emulation (cuDNN's graph: the normalized P quantized): both within the bound of float64
    cpu_mask = _mask(mask_spec, "cpu")
    oe, stats_e, amax_s_e, amax_o_e = fp8.sdpa_fp8_forward(q8, k8, v8, **sc, **cpu_mask, o_dtype=o_dtype,
                                                           backend="cpu")
    gap = _ratio((o.double() - oe.double()).abs() / scale_o, bound + bound_fp32_sums)
    assert gap <= 1.0, f"kernel and emulation differ by {gap:.3f}x the sum of their bounds; {rep}"

    # stats: -inf exactly on empty rows; elsewhere the log-sum-exp's error (2 delta_i of the bound)
    A = _row_scale(q8, k8, sc["descale_q"], sc["descale_k"], d)
    delta = 2 * (d + 3) * EPS32 * A + 2 * u_mma * A + (s_kv + 6) * EPS32
    finite = torch.isfinite(lse)
    assert torch.equal(torch.isinf(stats), ~finite) and torch.equal(torch.isinf(stats_e), ~finite), rep
    lse_tol = 2 * delta + 4 * EPS32 * lse.abs()
    assert ((stats.double() - lse).abs() <= lse_tol)[finite].all(), f"stats off by more than 2 delta_i; {rep}"
    if not finite.all():
        assert (o.float()[~finite.expand_as(o)] == 0).all(), f"empty rows must write 0; {rep}"

    # amax_s: 1 / l against the emulation's max P: both carry P's fp32 error delta (relative)
    tol_s = 2 * delta.max().item() * max(amax_s_e.item(), 1e-30)
    assert abs(amax_s.item() - amax_s_e.item()) <= tol_s, (
        f"amax_s {amax_s.item()!r} vs emulation {amax_s_e.item()!r}; {rep}")
    # amax_o: max |.| moves by at most the largest elementwise gap: the two pre-output-rounding bounds
    _, _, bound32 = fp8_forward_bound(q8, k8, v8, o_dtype=torch.float32, mma_unit=u_mma, **ref_mask, **sc)
    tol_o = 2 * bound32.max().item()
    assert abs(amax_o.item() - amax_o_e.item()) <= tol_o, (
        f"amax_o {amax_o.item()!r} vs emulation {amax_o_e.item()!r} (tol {tol_o:.3g}); {rep}")
    if o_dtype == torch.float32 and scale_o == 1.0:
        assert amax_o.item() == o.abs().max().item(), f"amax_o must be max |O| exactly; {rep}"


@triton.jit
def _to_fp8_kernel(X, Y, N, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0)
    tl.store(Y + offs, to_fp8(x, Y.dtype.element_ty, INTERP), mask=offs < N)


def _rounding_probe(dtype):
    """fp32 values around every finite FP8 value: the values, the midpoints (ties), just off them, beyond
    the largest (saturation), subnormals, zeros, random."""
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids * (1 + 2 ** -20), mids * (1 - 2 ** -20)])
    big = torch.tensor([1.0, 1.5, 1e4, 1e9]) * fp8.FP8_MAX[dtype]
    g = torch.Generator().manual_seed(7)
    rnd = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, 18, (4096,), generator=g).float())
    return torch.cat([grid, mids, near, big, -big, torch.tensor([0.0, -0.0]), rnd])


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_kernel_rounding_matches_torch(dtype, kernel_target):
    """common.to_fp8 (the kernel's P8 and FP8 output rounding) is fusedattn.fp8.quantize: nearest even,
    saturating; on the interpreter through round_to_fp8_grid, on the GPU through the hardware cast."""
    device, _ = kernel_target
    rep = _repro(f"rounding and {'e4m3' if dtype == E4M3 else 'e5m2'}", device)
    x = _rounding_probe(dtype).to(device)
    y = torch.full(x.shape, float("nan"), dtype=dtype, device=device)
    _to_fp8_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024, INTERP=device == "cpu")
    want = fp8.quantize(x.cpu(), dtype).float()
    got = y.cpu().float()
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} values round differently, e.g. {x.cpu()[bad[:4]].tolist()} -> "
                              f"{got[bad[:4]].tolist()} (want {want[bad[:4]].tolist()}); {rep}")


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_fp8_kernel_per_head_descales(gqa, kernel_target, mma16):
    """Per-head descales (fusedattn's addition to cuDNN's per-tensor scales; the kernel's FP8_HEAD_SCALES): every
    head quantized with its own power-of-two scale, about four times the previous head's, so a program that read
    another head's descale would be off by 2x or more. Written into NaN-filled buffers, within the derived bound of
    float64 attention of the dequantized inputs, and near the emulation."""
    device, backend = kernel_target
    b, h_q, h_kv, s_q, s_kv, d = 2, 4, (2 if gqa else 4), 33, 47, 32
    rep = _repro(f"per_head and {'gqa' if gqa else 'mha'} and {'mma16' if mma16 else 'mma8'}", device)
    gen = torch.Generator().manual_seed(17 + gqa)

    def per_head_fp8(h, s):
        x = torch.randn((b, h, s, d), generator=gen) * 0.125 * (4.0 ** torch.arange(h)).view(1, h, 1, 1)
        parts = [fp8.quantize_per_tensor(x[:, i:i + 1], E4M3) for i in range(h)]
        return torch.cat([x8 for x8, _ in parts], 1), torch.cat([sc.reshape(1) for _, sc in parts])

    (q8, dq), (k8, dk), (v8, dv) = per_head_fp8(h_q, s_q), per_head_fp8(h_kv, s_kv), per_head_fp8(h_kv, s_kv)
    assert len(set(dq.tolist())) == h_q, "the test needs a different descale per head"
    sc = dict(descale_q=dq, descale_k=dk, descale_v=dv, descale_s=1 / 256, scale_s=256.0, scale_o=1.0)
    heads = dict(descale_q=h_q, descale_k=h_kv, descale_v=h_kv)
    dev_sc = {n: fp8._scale(x if not isinstance(x, torch.Tensor) else x.to(device), n, torch.device(device),
                            heads.get(n)) for n, x in sc.items()}
    band = make_band(True, "bottom_right", None)
    out = torch.full((b, h_q, s_q, d), float("nan"), dtype=torch.bfloat16, device=device)
    stats_out = torch.full((b, h_q, s_q, 1), float("nan"), dtype=torch.float32, device=device)
    qd, kd, vd = (x.to(device) for x in (q8, k8, v8))
    o, stats, _, _ = fp8._forward_kernel(qd, kd, vd, dev_sc, d ** -0.5, band, None, None, torch.bfloat16,
                                         out=out, stats_out=stats_out)
    o, stats = o.cpu(), stats.cpu()
    assert not o.float().isnan().any() and not stats.isnan().any(), f"elements left unwritten (NaN); {rep}"
    mask = dict(causal=True, causal_alignment="bottom_right")
    ref, _, bound = fp8_forward_bound(q8, k8, v8, o_dtype=torch.bfloat16, mma_unit=fp8.mma_unit(device), **mask,
                                      **sc)
    ratio = _ratio((o.double() - ref).abs(), bound)
    assert ratio <= 1.0, f"error exceeds the derived bound by {ratio:.3f}x; {rep}"
    oe = fp8.sdpa_fp8_forward(q8, k8, v8, **sc, band=band, o_dtype=torch.bfloat16, backend="cpu")[0]
    _, _, bound_fp32 = fp8_forward_bound(q8, k8, v8, o_dtype=torch.bfloat16, **mask, **sc)
    gap = _ratio((o.double() - oe.double()).abs(), bound + bound_fp32)
    assert gap <= 1.0, f"kernel and emulation differ by {gap:.3f}x the sum of their bounds; {rep}"


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts launch_fwd_fp8 calls (fusedattn.fp8 imports it at call time)."""
    calls = []
    real = triton_fwd.launch_fwd_fp8

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(triton_fwd, "launch_fwd_fp8", spy)
    return calls


def test_fp8_routing(kernel_target, kernel_calls):
    """backend='triton' (and 'auto' on CUDA) runs the kernel; 'cpu' the emulation; per-head descales run the
    kernel too (FP8_HEAD_SCALES), per-head copies of one value giving the per-tensor call's bits; the functional
    door passes backend through."""
    import fusedattn
    device, backend = kernel_target
    q8, k8, v8, sc = _inputs((1, 2, 1, 20, 20, 32, 32), E4M3, False, seed=3)
    q8, k8, v8 = q8.to(device), k8.to(device), v8.to(device)
    sc = {n: x.to(device) for n, x in sc.items()}
    fusedattn.attention(q8, k8, v8, causal=True, backend=backend, **sc)
    assert len(kernel_calls) == 1
    if device == "cuda":
        fusedattn.attention(q8, k8, v8, causal=True, **sc)                     # auto
        assert len(kernel_calls) == 2
    n = len(kernel_calls)
    per_tensor = fusedattn.attention(q8, k8, v8, causal=True, backend=backend, **sc)
    per_head = dict(sc, descale_q=torch.full((2,), float(sc["descale_q"]), device=device))
    a = fusedattn.attention(q8, k8, v8, causal=True, backend=backend, **per_head)
    assert len(kernel_calls) == n + 2, "per-head descales must run the kernel"
    assert torch.equal(a, per_tensor), "per-head copies of one descale must give the per-tensor call's bits"
    b = fp8.sdpa_fp8_forward(q8, k8, v8, **sc, descale_s=1 / 256, scale_s=256.0, scale_o=1.0,
                             band=make_band(True, "top_left", None), o_dtype=torch.bfloat16, backend="cpu")[0]
    assert len(kernel_calls) == n + 2, "backend='cpu' runs the emulation"
    assert (a.float() - b.float()).abs().max() <= 0.05 * b.float().abs().max(), "kernel far from the emulation"
