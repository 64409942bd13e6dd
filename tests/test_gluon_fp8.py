"""The Gluon sm_90 forward's FP8 switch (issue 27 item 3; fusedattn/backends/gluon/fwd_sm90.py [Note] FP8).

GPU (H100 / H200; skipped, visibly, elsewhere): seeded cases (head dims 64 and 128, no mask / causal either
alignment / window, odd lengths, padding, GQA / MQA, BSHD strides, e4m3 and e5m2, outputs fp32 / bf16 / e4m3)
written into NaN-filled buffers through ``fusedattn.fp8._forward_kernel`` with the launches spied on (the
Gluon kernel ran, the portable one did not), checked against float64 attention of the dequantized inputs
within ``reference_fp8.fp8_forward_bound`` with the existing ``fp8.mma_unit(device)``, and with the kernel's
accumulation chain (``fwd_sm90.fp8_mma_chain``), against the emulation within the sum of the bounds, the stats
within 2 delta_i, amax_o exact against the output (fp32, scale_o 1) and both amaxes against the emulation's;
a second call gives the same bits. Head dims 224 / 256 run the same semantics on the 16-bit kernel's MMAs
(``launch_fwd_sm90_fp8_16``, [Note] FP8 on 16-bit MMAs), checked the same way; head dims neither takes (96,
d != d_v) go to the portable kernel; per-head descales (``FP8_HEAD_SCALES``) run on both Gluon routes. CPU: the host's copy of V (``transposed_v``) against
the key order that ``_pack_p8`` and ``_zero_cols_from`` assume; the fp16 copies of ``widened_fp16``; the FP8_EMU
build compiled for sm_90. Every failure message carries a one-line repro."""
import pytest
import torch

from conftest import INTERPRET, run_compile_child
from fusedattn import fp8
from fusedattn.problem import make_band
from fusedattn.reference_fp8 import EPS32, fp8_forward_bound

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
gpu = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped"),
       pytest.mark.skipif(torch.cuda.is_available() and not HAS_SM90,
                          reason="the Gluon forward kernel is Hopper-only (compute capability 9.x)")]

# name -> (b, h_q, h_kv, s_q, s_kv, d), mask, input type, output type, scale_o, BSHD memory
CASES = {
    "d64_plain_o_f32": ((2, 4, 4, 129, 257, 64), {}, E4M3, torch.float32, 1.0, False),
    "d64_causal_odd_gqa_bshd_o_bf16": ((2, 8, 2, 191, 191, 64), dict(causal=True), E4M3, torch.bfloat16, 1.0, True),
    "d128_plain_odd_o_f32": ((1, 4, 2, 77, 1003, 128), {}, E4M3, torch.float32, 1.0, False),
    "d128_causal_o_bf16": ((2, 4, 4, 1000, 1000, 128), dict(causal=True), E4M3, torch.bfloat16, 1.0, False),
    "d128_causal_br_mqa_o_e4m3": ((2, 6, 1, 113, 203, 128), dict(causal=True, causal_alignment="bottom_right"),
                                  E4M3, E4M3, 4.0, False),
    "d128_window_bshd_o_f16": ((1, 4, 4, 300, 511, 128), dict(window=(100, 17)), E4M3, torch.float16, 1.0, True),
    "d128_padding_o_bf16": ((3, 4, 2, 257, 300, 128), dict(seq_len_q=[257, 0, 100], seq_len_kv=[11, 300, 129]),
                            E4M3, torch.bfloat16, 1.0, False),
    "d128_padding_causal_e5m2_o_e5m2": ((2, 2, 2, 200, 190, 128), dict(causal=True, seq_len_q=[200, 17],
                                                                       seq_len_kv=[0, 133]), E5M2, E5M2, 8.0, False),
    "d64_padding_kv_only_o_f32": ((2, 2, 1, 65, 333, 64), dict(seq_len_kv=[333, 47]), E4M3, torch.float32, 1.0,
                                  False),
    "d128_decode_rows_o_bf16": ((3, 8, 2, 1, 1000, 128), dict(causal=True, causal_alignment="bottom_right"), E4M3,
                                torch.bfloat16, 1.0, False),
    # the 16-bit MMAs (fwd_sm90.FP8_16_DIMS)
    "d256_causal_gqa_o_bf16": ((2, 4, 2, 300, 300, 256), dict(causal=True), E4M3, torch.bfloat16, 1.0, False),
    "d224_plain_odd_bshd_o_f32": ((1, 4, 4, 77, 517, 224), {}, E4M3, torch.float32, 1.0, True),
    "d256_padding_e5m2_o_e5m2": ((2, 2, 1, 130, 200, 256), dict(seq_len_q=[130, 5], seq_len_kv=[0, 199]), E5M2,
                                 E5M2, 8.0, False),
    "d256_window_br_o_e4m3": ((1, 4, 4, 129, 257, 256), dict(window=(100, 17), causal_alignment="bottom_right"),
                              E4M3, E4M3, 4.0, False),
}
# calls the switch does not take: the portable kernel runs them
PORTABLE = {
    "d96": ((1, 2, 2, 65, 129, 96), {}),
    "d96_causal_gqa": ((1, 4, 1, 65, 129, 96), dict(causal=True)),
}


def _repro(case):
    return f"repro: pytest tests/test_gluon_fp8.py -k '{case}'"


def _inputs(shape, dtype, bshd, seed, d_v=None):
    """q8, k8, v8 [b, h, s, d] (views of [b, s, h, d] memory when bshd) and per-tensor descales, on the CPU."""
    b, h_q, h_kv, s_q, s_kv, d = shape
    g = torch.Generator().manual_seed(seed)
    out = []
    for h, s, dd in ((h_q, s_q, d), (h_kv, s_kv, d), (h_kv, s_kv, d_v or d)):
        x8, scale = fp8.quantize_per_tensor(torch.randn((b, s, h, dd), generator=g) * 2, dtype)
        out += [x8.transpose(1, 2) if bshd else x8.transpose(1, 2).contiguous(), scale]
    q8, dq, k8, dk, v8, dv = out
    return q8, k8, v8, dict(descale_q=dq, descale_k=dk, descale_v=dv)


def _mask(spec, device):
    lens = {n: torch.tensor(spec[n], dtype=torch.int32, device=device)
            for n in ("seq_len_q", "seq_len_kv") if n in spec}
    band = make_band(spec.get("causal", False), spec.get("causal_alignment", "top_left"), spec.get("window"))
    return dict(band=band, **lens)


@pytest.fixture
def launches(monkeypatch):
    """Which kernels ran: 'gluon' (fwd_sm90.launch_fwd_sm90_fp8), 'gluon16' (its 16-bit MMAs,
    launch_fwd_sm90_fp8_16), 'portable' (triton/fwd.launch_fwd_fp8)."""
    from fusedattn.backends.gluon import fwd_sm90
    from fusedattn.backends.triton import fwd as triton_fwd
    calls = []
    real_g, real_g16, real_t = fwd_sm90.launch_fwd_sm90_fp8, fwd_sm90.launch_fwd_sm90_fp8_16, triton_fwd.launch_fwd_fp8
    monkeypatch.setattr(fwd_sm90, "launch_fwd_sm90_fp8", lambda *a, **kw: (calls.append("gluon"), real_g(*a, **kw))[1])
    monkeypatch.setattr(fwd_sm90, "launch_fwd_sm90_fp8_16",
                        lambda *a, **kw: (calls.append("gluon16"), real_g16(*a, **kw))[1])
    monkeypatch.setattr(triton_fwd, "launch_fwd_fp8", lambda *a, **kw: (calls.append("portable"), real_t(*a, **kw))[1])
    return calls


def _run(q8, k8, v8, sc, mask_spec, o_dtype):
    """fp8._forward_kernel on the GPU into NaN-filled buffers; (o, stats, amax_s, amax_o) on the CPU."""
    b, h_q, s_q, _ = q8.shape
    s_kv, d_v = v8.shape[2], v8.shape[3]
    dev_sc = {n: torch.tensor([float(x)], dtype=torch.float32, device="cuda") for n, x in sc.items()}
    mask = _mask(mask_spec, "cuda")
    lens = {n: (fp8._lengths(mask.get(n), n, b, s, "cuda") if n in mask else None)
            for n, s in (("seq_len_q", s_q), ("seq_len_kv", s_kv))}
    out = torch.full((b, h_q, s_q, d_v), float("nan"), dtype=o_dtype, device="cuda")
    stats_out = torch.full((b, h_q, s_q, 1), float("nan"), dtype=torch.float32, device="cuda")
    res = fp8._forward_kernel(q8.cuda(), k8.cuda(), v8.cuda(), dev_sc, q8.shape[-1] ** -0.5, mask["band"],
                              lens["seq_len_q"], lens["seq_len_kv"], o_dtype, out=out, stats_out=stats_out)
    assert res[0] is out and res[1] is stats_out
    return tuple(x.cpu() for x in res)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("_", [pytest.param(None, id="sm90", marks=gpu)])
def test_gluon_fp8_within_bound(case, _, launches):
    _check_case(case, launches)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0][5] in (224, 256)])
@pytest.mark.parametrize("_", [pytest.param(None, id="sm90", marks=gpu)])
def test_gluon_fp8_16_with_fp16_qk_within_bound(case, _, launches, monkeypatch):
    """The 16-bit MMAs' FP8 forward with every product fp16 on widened copies (``fwd_sm90.FP8_16_QK`` off: the
    route where TMA refuses q or k as they are); the default cases run QK^T as an FP8 wgmma (its sums as the
    FP8 switch's: ``fp8_mma_chain``)."""
    from fusedattn.backends.gluon import fwd_sm90
    monkeypatch.setattr(fwd_sm90, "FP8_16_QK", False)
    _check_case(case, launches)


def _check_case(case, launches):
    from fusedattn.backends.gluon import fwd_sm90
    shape, mask_spec, dtype, o_dtype, scale_o, bshd = CASES[case]
    rep = _repro(case)
    b, h_q, h_kv, s_q, s_kv, d = shape
    q8, k8, v8, sc = _inputs(shape, dtype, bshd, seed=len(case))
    s_s = fp8.DEFAULT_SCALE_S[dtype]
    sc.update(descale_s=1 / s_s, scale_s=s_s, scale_o=scale_o)
    o, stats, amax_s, amax_o = _run(q8, k8, v8, sc, mask_spec, o_dtype)
    kernel = "gluon16" if d in fwd_sm90.FP8_16_DIMS else "gluon"
    assert launches == [kernel], f"expected the Gluon FP8 kernel ({kernel}) alone, ran {launches}; {rep}"
    assert not o.float().isnan().any(), f"output elements left unwritten (NaN); {rep}"
    assert not stats.isnan().any(), f"stats left unwritten (NaN); {rep}"
    again = _run(q8, k8, v8, sc, mask_spec, o_dtype)
    assert all(torch.equal(x.float(), y.float()) for x, y in zip((o, stats, amax_s, amax_o), again)), (
        f"a second call gave other bits; {rep}")

    ref_mask = {n: v for n, v in mask_spec.items() if n not in ("seq_len_q", "seq_len_kv")}
    ref_mask.update({n: torch.tensor(mask_spec[n], dtype=torch.int32) for n in ("seq_len_q", "seq_len_kv")
                     if n in mask_spec})
    err = None
    # the existing bound (MMA sums moved to fp32 every K-step of 32), then the one the kernel's accumulation
    # guarantees (its chains of fp8_mma_chain K-steps; fwd_sm90 [Note] FP8, the accumulation)
    chain = fwd_sm90.fp8_mma_chain(d)
    ratios = {}
    for name, u_mma in (("existing", fp8.mma_unit("cuda")), (f"chain {chain}", fp8.mma_unit("cuda", chain))):
        ref, lse, bound = fp8_forward_bound(q8, k8, v8, o_dtype=o_dtype, mma_unit=u_mma, **ref_mask, **sc)
        err = (o.double() / scale_o - ref).abs()
        ratios[name] = (err / bound).max().item()
    assert max(ratios.values()) <= 1.0, f"error / bound {ratios}; {rep}"
    _, _, bound_fp32 = fp8_forward_bound(q8, k8, v8, o_dtype=o_dtype, **ref_mask, **sc)
    tight = (err / bound_fp32).max().item()
    assert tight > 0.05, f"bound is vacuous here (error only {tight:.4f} of it); {rep}"

    # the emulation (cuDNN's graph): both within their bounds of float64
    oe, stats_e, amax_s_e, amax_o_e = fp8.sdpa_fp8_forward(q8, k8, v8, **sc, **_mask(mask_spec, "cpu"),
                                                           o_dtype=o_dtype, backend="cpu")
    u_mma = fp8.mma_unit("cuda", chain)
    _, _, bound = fp8_forward_bound(q8, k8, v8, o_dtype=o_dtype, mma_unit=u_mma, **ref_mask, **sc)
    gap = ((o.double() - oe.double()).abs() / scale_o / (bound + bound_fp32)).max().item()
    assert gap <= 1.0, f"kernel and emulation differ by {gap:.3f}x the sum of their bounds; {rep}"

    # stats: -inf exactly on empty rows; elsewhere within 2 delta_i
    g = h_q // h_kv
    A = ((q8.double().abs() * float(sc["descale_q"])) @ (k8.double().abs() * float(sc["descale_k"]))
         .repeat_interleave(g, 1).transpose(-1, -2)).amax(-1, keepdim=True) * d ** -0.5
    delta = 2 * (d + 3) * EPS32 * A + 2 * u_mma * A + (s_kv + 6) * EPS32
    finite = torch.isfinite(lse)
    assert torch.equal(torch.isinf(stats), ~finite), f"stats' -inf rows differ; {rep}"
    lse_tol = 2 * delta + 4 * EPS32 * lse.abs()
    assert ((stats.double() - lse).abs() <= lse_tol)[finite].all(), f"stats off by more than 2 delta_i; {rep}"
    if not finite.all():
        assert (o.float()[~finite.expand_as(o)] == 0).all(), f"empty rows must write 0; {rep}"

    # amaxes: exact against the output where it is O itself; against the emulation within P's error
    if o_dtype == torch.float32 and scale_o == 1.0:
        assert amax_o.item() == o.abs().max().item(), f"amax_o must be max |O| exactly; {rep}"
    tol_s = 2 * delta.max().item() * max(amax_s_e.item(), 1e-30)
    assert abs(amax_s.item() - amax_s_e.item()) <= tol_s, f"amax_s {amax_s.item()!r} vs {amax_s_e.item()!r}; {rep}"
    _, _, bound32 = fp8_forward_bound(q8, k8, v8, o_dtype=torch.float32, mma_unit=u_mma, **ref_mask, **sc)
    assert abs(amax_o.item() - amax_o_e.item()) <= 2 * bound32.max().item(), (
        f"amax_o {amax_o.item()!r} vs emulation {amax_o_e.item()!r}; {rep}")


@pytest.mark.parametrize("case", list(PORTABLE))
@pytest.mark.parametrize("_", [pytest.param(None, id="sm90", marks=gpu)])
def test_gluon_fp8_refuses_to_portable(case, _, launches):
    """Head dims outside fwd_sm90.FP8_DIMS and FP8_16_DIMS run the portable kernel."""
    shape, mask_spec = PORTABLE[case]
    q8, k8, v8, sc = _inputs(shape, E4M3, False, seed=5)
    sc.update(descale_s=1 / 256, scale_s=256.0, scale_o=1.0)
    _run(q8, k8, v8, sc, mask_spec, torch.bfloat16)
    assert launches == ["portable"], f"ran {launches}; {_repro(case)}"


@pytest.mark.parametrize("d, gqa, persistent", [(128, False, None), (128, True, None), (128, True, True),
                                                 (64, True, None), (256, True, None)])
@pytest.mark.parametrize("_", [pytest.param(None, id="sm90", marks=gpu)])
def test_gluon_fp8_per_head_descales(d, gqa, persistent, _, launches, monkeypatch):
    """Per-head descales on the Gluon routes (``FP8_HEAD_SCALES``: fusedattn's addition to cuDNN's per-tensor
    scales, as the portable kernel's): every head quantized with its own power-of-two scale, about four times the
    previous head's, so a program that read another head's descale (q's, or its kv head's for k and v) would be
    off by 2x or more. The persistent grid (several heads per CTA) and the one-tile grid; d = 256 on the 16-bit
    MMAs. NaN-filled outputs, within the bound of float64 attention of the dequantized inputs, near the
    emulation."""
    from fusedattn.backends.gluon import fwd_sm90
    if persistent is not None:
        monkeypatch.setitem(fwd_sm90.FP8_PERSISTENT, fwd_sm90.TILE_D[d], persistent)
    b, h_q, h_kv, s_q, s_kv = 2, 4, (2 if gqa else 4), 200, 333
    rep = _repro(f"per_head_descales and {d}-{gqa}-{persistent}")
    gen = torch.Generator().manual_seed(31 + d + gqa)

    def per_head_fp8(h, s):
        x = torch.randn((b, h, s, d), generator=gen) * 0.125 * (4.0 ** torch.arange(h)).view(1, h, 1, 1)
        parts = [fp8.quantize_per_tensor(x[:, i:i + 1], E4M3) for i in range(h)]
        return torch.cat([x8 for x8, _ in parts], 1), torch.cat([sc.reshape(1) for _, sc in parts])

    (q8, dq), (k8, dk), (v8, dv) = per_head_fp8(h_q, s_q), per_head_fp8(h_kv, s_kv), per_head_fp8(h_kv, s_kv)
    assert len(set(dq.tolist())) == h_q and len(set(dv.tolist())) == h_kv, "the test needs a descale per head"
    sc = dict(descale_q=dq, descale_k=dk, descale_v=dv, descale_s=1 / 256, scale_s=256.0, scale_o=1.0)
    heads = dict(descale_q=h_q, descale_k=h_kv, descale_v=h_kv)
    dev_sc = {n: fp8._scale(x.cuda() if isinstance(x, torch.Tensor) else x, n, torch.device("cuda"), heads.get(n))
              for n, x in sc.items()}
    band = make_band(True, "bottom_right", None)
    out = torch.full((b, h_q, s_q, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    stats_out = torch.full((b, h_q, s_q, 1), float("nan"), dtype=torch.float32, device="cuda")
    o, stats, _, _ = fp8._forward_kernel(q8.cuda(), k8.cuda(), v8.cuda(), dev_sc, d ** -0.5, band, None, None,
                                         torch.bfloat16, out=out, stats_out=stats_out)
    kernel = "gluon16" if d in fwd_sm90.FP8_16_DIMS else "gluon"
    assert launches == [kernel], f"expected the Gluon FP8 kernel ({kernel}) alone, ran {launches}; {rep}"
    o, stats = o.cpu(), stats.cpu()
    assert not o.float().isnan().any() and not stats.isnan().any(), f"elements left unwritten (NaN); {rep}"
    mask = dict(causal=True, causal_alignment="bottom_right")
    u_mma = fp8.mma_unit("cuda", fwd_sm90.fp8_mma_chain(d))
    ref, _, bound = fp8_forward_bound(q8, k8, v8, o_dtype=torch.bfloat16, mma_unit=u_mma, **mask, **sc)
    err = (o.double() - ref).abs()
    # a zero bound (an exactly-zero output) demands a zero error
    ratio = torch.where(bound > 0, err / torch.where(bound > 0, bound, torch.ones_like(bound)),
                        torch.where(err > 0, float("inf"), 0.0)).max().item()
    assert ratio <= 1.0, f"error exceeds the derived bound by {ratio:.3f}x; {rep}"
    oe = fp8.sdpa_fp8_forward(q8, k8, v8, **sc, band=band, o_dtype=torch.bfloat16, backend="cpu")[0]
    _, _, bound32 = fp8_forward_bound(q8, k8, v8, o_dtype=torch.bfloat16, **mask, **sc)
    gap = ((o.double() - oe.double()).abs() / (bound + bound32)).max().item()
    assert gap <= 1.0, f"kernel and emulation differ by {gap:.3f}x the sum of their bounds; {rep}"


@pytest.mark.parametrize("_", [pytest.param(None, id="sm90", marks=gpu)])
def test_gluon_fp8_doors_route_here(_, launches):
    """fusedattn.attention and sdpa_fp8_forward with backend 'auto' take the Gluon switch at d=128, with per-head
    descales too (``FP8_HEAD_SCALES``); backend='cpu' never launches."""
    import fusedattn
    q8, k8, v8, sc = _inputs((1, 4, 2, 130, 130, 128), E4M3, False, seed=9)
    q8, k8, v8 = q8.cuda(), k8.cuda(), v8.cuda()
    sc = {n: x.cuda() for n, x in sc.items()}
    o = fusedattn.attention(q8, k8, v8, causal=True, **sc)
    assert launches == ["gluon"] and o.dtype == torch.bfloat16
    per_head = dict(sc, descale_q=torch.full((4,), float(sc["descale_q"]), device="cuda"))
    fusedattn.attention(q8, k8, v8, causal=True, **per_head)
    assert launches == ["gluon", "gluon"]
    fusedattn.attention(q8, k8, v8, causal=True, backend="cpu", **sc)
    assert launches == ["gluon", "gluon"]


def test_transposed_v_key_order():
    """CPU: the host's V copy is V transposed with keys in fwd_sm90.key_order within each 16 and zeros past
    s_kv; the order is the one _pack_p8 builds (operand column 16 g + 4 q + t <- score column 16 g +
    8 (t // 2) + 2 q + t % 2) and _zero_cols_from inverts (the same formula, written in the kernel); so
    P (in that column order) @ the copy is P @ V."""
    from fusedattn.backends.gluon.fwd_sm90 import key_order, transposed_v
    c = torch.arange(64)
    want = torch.tensor([16 * (x // 16) + 8 * ((x % 4) // 2) + 2 * ((x % 16) // 4) + x % 2 for x in range(64)])
    assert torch.equal(key_order(64, "cpu").cpu(), want)
    assert torch.equal(torch.sort(key_order(64, "cpu")).values, c), "key_order must be a permutation"
    # the kernel's register form (_pack_p8): dims [kb, h, u, q, e] of score columns, operand [kb, h, q, u, e]
    score = torch.arange(64).reshape(2, 2, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(64)
    assert torch.equal(score, want), "the kernel's operand order differs from key_order"
    for s_kv, dtype in ((37, E4M3), (64, E5M2), (1, E4M3)):
        g = torch.Generator().manual_seed(s_kv)
        v8 = fp8.quantize(torch.randn(2, 3, s_kv, 8, generator=g), dtype)
        vt = transposed_v(v8)
        pad = -(-s_kv // 16) * 16
        assert vt.shape == (2, 3, 8, pad) and vt.dtype == dtype and vt.stride(-1) == 1
        idx = key_order(pad, "cpu")
        for cc in range(pad):
            key = int(idx[cc])
            col = vt[..., cc].float()
            if key < s_kv:
                assert torch.equal(col, v8[:, :, key].float()), (s_kv, cc)
            else:
                assert (col == 0).all(), (s_kv, cc)
        p = torch.rand(2, 3, 5, pad)
        p[..., s_kv:] = 0
        vv = torch.zeros(2, 3, pad, 8)
        vv[:, :, :s_kv] = v8.float()
        torch.testing.assert_close(p[..., idx] @ vt.float().transpose(-1, -2), p @ vv)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(
        not INTERPRET, reason="Triton interpreter off (TRITON_INTERPRET unset)")),
    pytest.param("cuda", id="gpu", marks=gpu[:2])])
def test_transposed_v_kernel_equals_torch(device):
    """The V copy's kernel (``_transpose_v_keys``) writes the bytes of its PyTorch form (``_transposed_v_torch``,
    checked against the key order above; with permute=False, the FP8 backward's K^T, the plain transpose), bit for
    bit: BSHD and hostile strides, odd lengths, head dims that are
    not powers of two, one key, more keys than one program's columns, e4m3 and e5m2, into a buffer of 0xFF."""
    from fusedattn.backends.gluon.fwd_sm90 import _transposed_v_torch, transposed_v
    for (b, h, s, d), layout, dtype in (((2, 3, 37, 40), "bshd", E4M3), ((1, 2, 1, 64), "bhsd", E5M2),
                                        ((2, 1, 300, 128), "strided", E4M3), ((1, 2, 129, 256), "bshd", E4M3)):
        g = torch.Generator().manual_seed(s + d)
        x = torch.randn(b, s, h, 2 * d, generator=g) if layout == "strided" else torch.randn(b, s, h, d, generator=g)
        x = x[..., ::2] if layout == "strided" else x
        v8 = fp8.quantize(x, dtype).to(device).transpose(1, 2)      # [b, h, s, d] over BSHD memory
        if layout == "bhsd":
            v8 = v8.contiguous()
        rep = f"repro: python -m pytest -q tests/test_gluon_fp8.py -k transposed_v_kernel  # {(b, h, s, d)} {layout}"
        for permute in (True, False):
            got = transposed_v(v8, permute)
            want = _transposed_v_torch(v8, permute)
            assert got.shape == want.shape and got.stride() == want.stride(), f"{rep} permute={permute}"
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{rep} permute={permute}"
        # permute=False (the FP8 backward's K^T): the plain transpose, zeros past s
        pad = want.shape[-1]
        plain = torch.zeros((b, h, d, pad), dtype=torch.uint8)
        plain[..., :s] = v8.cpu().view(torch.uint8).transpose(2, 3)
        assert torch.equal(want.cpu().view(torch.uint8), plain), f"{rep} (the plain transpose)"


@pytest.mark.parametrize("device", [
    pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(
        not INTERPRET, reason="Triton interpreter off (TRITON_INTERPRET unset)")),
    pytest.param("cuda", id="gpu", marks=gpu[:2])])
def test_widened_fp16_kernel_is_exact(device):
    """The FP8 forward's fp16 copies on the 16-bit MMAs (``widened_fp16``, ``_widen_fp8``) hold every FP8 value
    exactly (PyTorch's conversion, bit for bit; NaN where it is NaN: every one of the 256 byte patterns), for BSHD and
    strided views, odd lengths and head dims, one row, e4m3 and e5m2, contiguous [b, h, s, d] out."""
    from fusedattn.backends.gluon.fwd_sm90 import widened_fp16
    for (b, h, s, d), layout, dtype in (((2, 3, 37, 40), "bshd", E4M3), ((1, 2, 1, 64), "bhsd", E5M2),
                                        ((2, 1, 300, 224), "strided", E5M2), ((1, 2, 129, 256), "bshd", E4M3)):
        g = torch.Generator().manual_seed(s + d)
        n = (2 * d if layout == "strided" else d)
        raw = torch.randint(0, 256, (b, s, h, n), generator=g, dtype=torch.uint8)
        m = min(raw.numel(), 256)
        raw.view(-1)[:m] = torch.arange(256, dtype=torch.uint8)[-m:]     # every byte pattern (the NaNs in all)
        x8 = raw.view(dtype).to(device)
        x8 = (x8[..., ::2] if layout == "strided" else x8).transpose(1, 2)
        if layout == "bhsd":
            x8 = x8.contiguous()
        got = widened_fp16(x8)
        want = x8.cpu().to(torch.float16)
        rep = f"repro: python -m pytest -q tests/test_gluon_fp8.py -k widened  # {(b, h, s, d)} {layout} {dtype}"
        assert got.dtype == torch.float16 and got.is_contiguous() and got.shape == want.shape, rep
        got = got.cpu()
        # NaN in the same places (the GPU's cvt and PyTorch give NaNs of other payloads), every other value's bits
        same = (got.view(torch.int16) == want.view(torch.int16)) | (want.isnan() & got.isnan())
        if device == "cpu":
            # Triton's interpreter converts e4m3's NaN (0x7F / 0xFF) to +-480, e5m2's subnormals to other values and
            # its NaN payloads to others; the GPU's cvt is exact. The kernel runs on the GPU only (the Gluon
            # forward): here the interpreter checks its indexing on every other value
            same |= want.isnan() | (want.abs() < 2 ** -14)
        bad = (~same).nonzero()
        assert not len(bad), (f"{len(bad)} values differ, first at {bad[0].tolist()}: "
                              f"{got[tuple(bad[0])].item()!r} for {want[tuple(bad[0])].item()!r}; {rep}")


@pytest.mark.parametrize("spec", [dict(), dict(causal=True), dict(seq_len_q=[100, 3], seq_len_kv=[77, 300])],
                         ids=["plain", "causal", "padded"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("_", [pytest.param(None, id="sm90", marks=gpu)])
def test_gluon_fp8_persistent_grid_bit_identical(spec, d, _):
    """The persistent grid (launch_fwd_sm90_fp8(persistent=True), a few CTAs running many work tiles) writes
    the one-tile grid's bits, amaxes included."""
    from fusedattn.backends.gluon import fwd_sm90
    from fusedattn.problem import AttentionProblem
    rep = _repro(f"persistent and {d}")
    b, h_q, h_kv, s_q, s_kv = 2, 4, 2, 300, 301
    q8, k8, v8, sc = _inputs((b, h_q, h_kv, s_q, s_kv, d), E4M3, False, seed=d)
    q8, k8, v8 = q8.cuda(), k8.cuda(), v8.cuda()
    scales = torch.tensor([float(sc["descale_q"]), float(sc["descale_k"]), float(sc["descale_v"]), 1 / 256, 256.0,
                           1.0], dtype=torch.float32, device="cuda")
    mask = _mask(spec, "cuda")
    p = AttentionProblem(b=b, h_q=h_q, h_kv=h_kv, s_q=s_q, s_kv=s_kv, d=d, d_v=d, dtype=E4M3, device_type="cuda",
                         scale=d ** -0.5, band=mask["band"], has_seq_len_q="seq_len_q" in mask,
                         has_seq_len_kv="seq_len_kv" in mask)
    lens = {n: mask[n] for n in ("seq_len_q", "seq_len_kv") if n in mask}
    outs = []
    for kw in (dict(persistent=False), dict(persistent=True, ctas=3), dict(persistent=True)):
        o = torch.full((b, h_q, s_q, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((b, h_q, s_q), float("nan"), dtype=torch.float32, device="cuda")
        amax = torch.zeros(2, dtype=torch.float32, device="cuda")
        assert fwd_sm90.supports_fp8(p, q8, k8, v8, o, **lens), rep
        fwd_sm90.launch_fwd_sm90_fp8(p, q8, k8, fwd_sm90.transposed_v(v8), o, lse, scales, amax, **lens, **kw)
        outs.append((o.float().cpu(), lse.cpu(), amax.cpu()))
    for got in outs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(outs[0], got)), f"persistent grid differs; {rep}"
    assert not outs[0][0].isnan().any(), rep


def test_fp8_on_16bit_mmas_compiles_for_sm90():
    """No GPU needed: the FP8 forward on the 16-bit MMAs (``FP8_EMU``, d=256, no mask, e5m2 P8, e4m3 output; and
    causal with QK^T in FP8, ``FP8_16_QK``) compiles for sm_90 with this Triton's compiler and ptxas
    (``tools/gluon_check.compile_fwd``; a child process, since Triton's interpreter, which CI turns on, compiles
    nothing), without spills, and each of its step loops holds the 16-bit build's exponentials with twice its
    conversions (P8's rounding, then fp16)."""
    out = run_compile_child(
        "import re\n"
        "from gluon_check import compile_fwd, inner_loops, ptxas_report, sass\n"
        "for emu in (2, 0):\n"
        "    k = compile_fwd(d=256, causal=False, dtype='fp16', out='fp8e4nv' if emu else 'fp16', fp8_emu=emu)\n"
        "    print('SPILL', emu, sum(int(x) for x in re.findall(r'(\\d+) bytes spill', ptxas_report(k))))\n"
        "    for _, n, body in inner_loops(sass(k)):\n"
        "        print('LOOP', emu, sum('MUFU.EX2' in b for b in body), sum('F2FP' in b for b in body))\n"
        "k = compile_fwd(d=256, causal=True, dtype='e4m3', out='bf16', fp8_emu=1)\n"
        "print('SPILL', 1, sum(int(x) for x in re.findall(r'(\\d+) bytes spill', ptxas_report(k))))\n"
        "for _, n, body in inner_loops(sass(k)):\n"
        "    print('QK', sum('QGMMA' in b for b in body), sum('HGMMA' in b for b in body))\n")
    lines = [line.split() for line in out.splitlines()]
    # FP8_16_QK's build (causal, e4m3 q / k, fp16 V): per step loop 8 FP8 wgmmas of QK^T (d 256 / 32) and 4
    # fp16 ones of P V (64 keys / 16), no spills
    qk = [(int(w[1]), int(w[2])) for w in lines if w[0] == "QK" and (int(w[1]) or int(w[2]))]
    assert qk and all(x == (8, 4) for x in qk), f"FP8-QK^T build's step loops (QGMMA, HGMMA): {qk}"
    spills = {int(w[1]): int(w[2]) for w in lines if w[0] == "SPILL"}
    assert spills.get(2) == 0 and spills.get(1) == 0, f"an FP8_EMU build spills: {spills}"
    loops = {emu: sorted((int(w[2]), int(w[3])) for w in lines if w[0] == "LOOP" and int(w[1]) == emu and int(w[2]))
             for emu in (0, 2)}
    assert loops[2] and len(loops[2]) == len(loops[0]), f"step loops differ from the 16-bit build's: {loops}"
    for (ex_emu, cvt_emu), (ex16, cvt16) in zip(loops[2], loops[0]):
        assert ex_emu == ex16 and cvt_emu == 2 * cvt16, f"FP8_EMU loops {loops[2]} vs 16-bit {loops[0]}"
