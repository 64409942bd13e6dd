"""FP8 attention (issue 27): cuDNN's sdpa_fp8 / sdpa_fp8_backward semantics (fusedattn.fp8), checked on
the CPU against float64 references with the derived bound (fusedattn.reference_fp8); exact amaxes; the
Graph door running cuDNN-frontend-style FP8 code unchanged; the functional and FlashAttention doors."""
import math

import pytest
import torch

import fusedattn
import fusedattn as cudnn
from fusedattn import fp8
from fusedattn.problem import make_band
from fusedattn.reference_fp8 import fp8_backward_bound, fp8_forward_bound, fp8_forward_same_points

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "causal_br": dict(causal=True, causal_alignment="bottom_right"),
    "window": dict(window=(5, 3)),
    "padding": dict(seq_len_q=torch.tensor([30, 0], dtype=torch.int32),
                    seq_len_kv=torch.tensor([11, 53], dtype=torch.int32)),
}


def _inputs(dtype=E4M3, b=2, h_q=4, h_kv=2, s_q=37, s_kv=53, d=32, d_v=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in ((b, h_q, s_q, d), (b, h_kv, s_kv, d), (b, h_kv, s_kv, d_v)):
        out.extend(fp8.quantize_per_tensor(torch.randn(shape, generator=g) * 2, dtype))
    q8, dq, k8, dk, v8, dv = out
    return q8, k8, v8, dict(descale_q=dq, descale_k=dk, descale_v=dv)


def _fwd(q8, k8, v8, sc, mask, o_dtype, backend="auto"):
    band = make_band(mask.get("causal", False), mask.get("causal_alignment", "top_left"), mask.get("window"))
    return fp8.sdpa_fp8_forward(q8, k8, v8, band=band, seq_len_q=mask.get("seq_len_q"),
                                seq_len_kv=mask.get("seq_len_kv"), o_dtype=o_dtype, backend=backend, **sc)


@pytest.mark.parametrize("p_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("o_dtype", [torch.bfloat16, E4M3], ids=["o_bf16", "o_e4m3"])
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_forward_within_derived_bound(p_dtype, o_dtype, mask):
    q8, k8, v8, sc = _inputs(p_dtype)
    s_s = fp8.DEFAULT_SCALE_S[p_dtype]
    sc.update(descale_s=1 / s_s, scale_s=s_s, scale_o=4.0 if o_dtype == E4M3 else 1.0)
    o, stats, amax_s, amax_o = _fwd(q8, k8, v8, sc, MASKS[mask], o_dtype)
    ref, lse, bound = fp8_forward_bound(q8, k8, v8, o_dtype=o_dtype, **MASKS[mask], **sc)
    err = (o.double() / sc["scale_o"] - ref).abs()
    ratio = (err / bound).max().item()
    assert ratio <= 1.0, f"error exceeds the derived bound by {ratio:.3f}x"
    assert ratio > 0.05, f"bound is vacuous (error only {ratio:.4f} of it)"    # the bound is meaningful
    finite = torch.isfinite(lse)
    assert torch.equal(torch.isinf(stats), ~finite)                           # empty rows: -inf
    assert (stats.double() - lse)[finite].abs().max() < 1e-5


@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_forward_matches_float64_with_same_rounding_points(mask):
    q8, k8, v8, sc = _inputs(seed=3)
    sc.update(descale_s=1 / 256, scale_s=256.0, scale_o=1.0)
    o, _, amax_s, amax_o = _fwd(q8, k8, v8, sc, MASKS[mask], torch.float32)
    o64, _, amax_s64, amax_o64, slack = fp8_forward_same_points(q8, k8, v8, **MASKS[mask], **sc)
    tol = slack + 1e-5 * (o64.abs() + 1)
    assert ((o.double() - o64).abs() <= tol).all()
    assert abs(amax_s.item() - amax_s64.item()) <= 1e-6
    assert amax_o.item() == o.abs().max().item()          # amax of O before scale_o (= 1): exact


def test_amax_exact():
    # q = 0: every kept key weighs 1 / n exactly; with 4 keys kept (padding) P = 0.25 everywhere
    _, k8, v8, sc = _inputs(s_q=5, s_kv=9)
    q8 = torch.zeros(2, 4, 5, 32).to(E4M3)
    lens = torch.tensor([4, 4], dtype=torch.int32)
    sc.update(descale_s=1 / 256, scale_s=256.0, scale_o=2.0)
    o, _, amax_s, amax_o = fp8.sdpa_fp8_forward(q8, k8, v8, seq_len_kv=lens, o_dtype=torch.float32, **sc)
    assert amax_s.item() == 0.25
    v = (v8.double() * sc["descale_v"].double()).repeat_interleave(2, 1)[:, :, :4].mean(2)
    assert amax_o.item() == pytest.approx(v.abs().max().item(), rel=1e-6)
    assert amax_o.item() == (o.abs().max() / 2.0).item()   # o = O * scale_o, amax before scale_o
    # an FP8 output is exactly the rounded fp32 one
    o8, *_ = fp8.sdpa_fp8_forward(q8, k8, v8, seq_len_kv=lens, o_dtype=E4M3, **sc)
    assert torch.equal(o8.float(), fp8.quantize(o, E4M3).float())


@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_backward_within_derived_bound(mask):
    q8, k8, v8, sc = _inputs(seed=5)
    sc_f = dict(sc, descale_s=1 / 256, scale_s=256.0, scale_o=1.0)
    o, stats, *_ = _fwd(q8, k8, v8, sc_f, MASKS[mask], E4M3)
    do8, ddo = fp8.quantize_per_tensor(torch.randn(o.shape, generator=torch.Generator().manual_seed(9)))
    bs = dict(sc, descale_o=1.0, descale_dO=ddo, descale_s=1 / 256, descale_dP=1 / 64, scale_s=256.0, scale_dQ=1.0,
              scale_dK=1.0, scale_dV=1.0, scale_dP=64.0)
    band = make_band(MASKS[mask].get("causal", False), MASKS[mask].get("causal_alignment", "top_left"),
                     MASKS[mask].get("window"))
    res = fp8.sdpa_fp8_backward(q8, k8, v8, o, do8, stats, band=band, seq_len_q=MASKS[mask].get("seq_len_q"),
                                seq_len_kv=MASKS[mask].get("seq_len_kv"), grad_dtype=torch.bfloat16, **bs)
    refs, bounds = fp8_backward_bound(q8, k8, v8, o, do8, grad_dtype=torch.bfloat16, **MASKS[mask], **bs)
    for name, got, ref, bound, amax in zip(("dQ", "dK", "dV"), res[:3], refs, bounds, res[3:6]):
        ratio = ((got.double() - ref).abs() / bound).max().item()
        assert ratio <= 1.0, f"{name} error exceeds the derived bound by {ratio:.3f}x"
        assert ratio > 0.05, f"{name} bound is vacuous"
        assert amax.item() == pytest.approx(got.float().abs().max().item(), rel=2 ** -7)  # bf16 rounding only
    assert res[6].item() > 0


# ---------------------------------------------------------------------------------------------
# the Graph door: cuDNN frontend FP8 code, unchanged but for the import
# ---------------------------------------------------------------------------------------------

def _graph_forward(q, k, v, dq, dk, dv, ds, ss, so, attn_scale, causal, itype):
    b, h, sq, d = q.shape
    graph = cudnn.pygraph(io_data_type=itype, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)

    def fp8_t(t):
        return graph.tensor(dim=tuple(t.shape), stride=tuple(t.stride()), data_type=itype)

    def scalar_t():
        return graph.tensor(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)

    qt, kt, vt = fp8_t(q), fp8_t(k), fp8_t(v)
    dqt, dkt, dvt, dst, sst, sot = (scalar_t() for _ in range(6))
    o_t, stats_t, amax_s_t, amax_o_t = graph.sdpa_fp8(
        q=qt, k=kt, v=vt, descale_q=dqt, descale_k=dkt, descale_v=dvt, descale_s=dst, scale_s=sst, scale_o=sot,
        generate_stats=True, attn_scale=attn_scale, use_causal_mask=causal)
    o_t.set_output(True).set_dim((b, h, sq, d)).set_stride((h * sq * d, sq * d, d, 1)).set_data_type(itype)
    stats_t.set_output(True).set_dim((b, h, sq, 1)).set_stride((h * sq, sq, 1, 1)).set_data_type(cudnn.data_type.FLOAT)
    amax_s_t.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(cudnn.data_type.FLOAT)
    amax_o_t.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(cudnn.data_type.FLOAT)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()

    def f1(x):
        return torch.tensor([x], device=q.device, dtype=torch.float32)
    o = torch.empty((b, h, sq, d), device=q.device, dtype=q.dtype)
    stats = torch.empty((b, h, sq, 1), device=q.device, dtype=torch.float32)
    amax_s = torch.empty((1, 1, 1, 1), device=q.device, dtype=torch.float32)
    amax_o = torch.empty((1, 1, 1, 1), device=q.device, dtype=torch.float32)
    pack = {qt: q, kt: k, vt: v, dqt: f1(dq), dkt: f1(dk), dvt: f1(dv), dst: f1(ds), sst: f1(ss), sot: f1(so),
            o_t: o, stats_t: stats, amax_s_t: amax_s, amax_o_t: amax_o}
    workspace = torch.empty(graph.get_workspace_size(), device=q.device, dtype=torch.uint8)
    graph.execute(pack, workspace)
    return o, stats, amax_s, amax_o


def _graph_backward(q, k, v, o, dO, stats, s, attn_scale, causal, itype):
    graph = cudnn.pygraph(io_data_type=itype, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)

    def fp8_t(t):
        return graph.tensor(dim=tuple(t.shape), stride=tuple(t.stride()), data_type=itype)

    def scalar_t():
        return graph.tensor(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)
    qt, kt, vt, ot, dot, st = fp8_t(q), fp8_t(k), fp8_t(v), fp8_t(o), fp8_t(dO), graph.tensor_like(stats)
    names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
             "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
    sts = {n: scalar_t() for n in names}
    outs = graph.sdpa_fp8_backward(q=qt, k=kt, v=vt, o=ot, dO=dot, stats=st, **sts, attn_scale=attn_scale,
                                   use_causal_mask=causal)
    for tensor, ref in zip(outs[:3], (q, k, v)):
        tensor.set_output(True).set_dim(tuple(ref.shape)).set_stride(tuple(ref.stride())).set_data_type(itype)
    for tensor in outs[3:]:
        tensor.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(cudnn.data_type.FLOAT)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    res = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)] + [torch.empty(1, 1, 1, 1) for _ in range(4)]
    pack = {qt: q, kt: k, vt: v, ot: o, dot: dO, st: stats}
    pack.update({sts[n]: torch.tensor([float(s[n])], dtype=torch.float32) for n in names})
    pack.update(dict(zip(outs, res)))
    graph.execute(pack, torch.empty(graph.get_workspace_size(), dtype=torch.uint8))
    return res


@pytest.mark.parametrize("causal", [False, True])
def test_graph_door_cudnn_fp8_sample(causal):
    q8, k8, v8, sc = _inputs(h_kv=4, s_kv=37, seed=11)
    attn = 1.0 / math.sqrt(q8.shape[-1])
    dq, dk, dv = (float(sc[n]) for n in ("descale_q", "descale_k", "descale_v"))
    o, stats, amax_s, amax_o = _graph_forward(q8, k8, v8, dq, dk, dv, 1 / 256, 256.0, 2.0, attn, causal,
                                              cudnn.data_type.FP8_E4M3)
    want = fp8.sdpa_fp8_forward(q8, k8, v8, attn_scale=attn, band=("top_left", None, 0) if causal else None,
                                descale_q=dq, descale_k=dk, descale_v=dv, descale_s=1 / 256, scale_s=256.0,
                                scale_o=2.0)
    assert torch.equal(o.float(), want[0].float()) and torch.equal(stats, want[1])
    assert amax_s.item() == want[2].item() and amax_o.item() == want[3].item()
    do8, ddo = fp8.quantize_per_tensor(torch.randn(o.shape, generator=torch.Generator().manual_seed(2)))
    s = dict(descale_q=dq, descale_k=dk, descale_v=dv, descale_o=0.5, descale_dO=float(ddo), descale_s=1 / 256,
             descale_dP=1 / 64, scale_s=256.0, scale_dQ=4.0, scale_dK=4.0, scale_dV=4.0, scale_dP=64.0)
    got = _graph_backward(q8, k8, v8, o, do8, stats, s, attn, causal, cudnn.data_type.FP8_E4M3)
    want = fp8.sdpa_fp8_backward(q8, k8, v8, o, do8, stats, attn_scale=attn,
                                 band=("top_left", None, 0) if causal else None, **s)
    for g, w in zip(got, want):
        assert torch.equal(g.float(), w.float())
    assert all(a.item() > 0 for a in got[3:])


def test_graph_door_rejects_16bit_inputs_and_unsupported_options():
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    t = graph.tensor(dim=(1, 1, 8, 16), stride=(128, 128, 16, 1))
    sc = [graph.tensor(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT) for _ in range(6)]
    o, *_ = graph.sdpa_fp8(t, t, t, *sc, is_inference=True)
    o.set_output(True)
    with pytest.raises(cudnn.GraphError, match="q .* must be FP8_E4M3 or FP8_E5M2"):
        graph.validate()
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3)
    t = graph.tensor(dim=(1, 1, 8, 16), stride=(128, 128, 16, 1))
    sc = [graph.tensor(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT) for _ in range(6)]
    o, *_ = graph.sdpa_fp8(t, t, t, *sc, is_inference=True, use_alibi_mask=True)
    o.set_output(True)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="use_alibi_mask"):
        graph.validate()


# ---------------------------------------------------------------------------------------------
# the functional and FlashAttention doors
# ---------------------------------------------------------------------------------------------

def test_functional_door_fp8_inputs():
    q8, k8, v8, sc = _inputs(seed=4)
    out, stats = fusedattn.attention(q8, k8, v8, causal=True, return_stats=True, **sc)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, 37, 32)
    want, want_stats, *_ = fp8.sdpa_fp8_forward(q8, k8, v8, band=("top_left", None, 0), descale_s=1 / 256,
                                                scale_s=256.0, scale_o=1.0, o_dtype=torch.bfloat16, **sc)
    assert torch.equal(out, want) and torch.equal(stats, want_stats)
    o8 = fusedattn.attention(q8, k8, v8, out_dtype=E4M3, scale_o=8.0, **sc)
    assert o8.dtype == E4M3


def test_functional_door_autograd_straight_through():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 19, 16, generator=g, dtype=torch.float32, requires_grad=True) for _ in range(3))
    out, stats = fusedattn.attention_fp8(q, k, v, causal=True, return_stats=True)
    out.square().sum().backward()
    # the backward is the 16-bit one on the dequantized inputs, with the FP8 forward's output and stats
    deq = [fp8.quantize_per_tensor(x)[0].float() * fp8.quantize_per_tensor(x)[1] for x in (q, k, v)]
    want = fusedattn.attention_backward(*deq, out.detach(), 2 * out.detach(), stats, causal=True)[:3]
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert torch.equal(got, w)
    # and it is close to the exact gradient of the unquantized attention (e4m3: a few percent)
    qe, ke, ve = (x.detach().requires_grad_() for x in (q, k, v))
    fusedattn.attention(qe, ke, ve, causal=True).square().sum().backward()
    assert (q.grad - qe.grad).norm() < 0.2 * qe.grad.norm()
    assert q.grad.abs().sum() > 0


def test_functional_door_bad_input_names_the_argument():
    q8, k8, v8, sc = _inputs()
    with pytest.raises(ValueError, match="descale_k"):
        fusedattn.attention(q8, k8, v8, descale_q=sc["descale_q"], descale_v=sc["descale_v"])
    with pytest.raises(TypeError, match="one float8 type"):
        fusedattn.attention(q8, k8.float(), v8, **sc)
    with pytest.raises(ValueError, match="descale_q given but"):
        fusedattn.attention(q8.float(), k8.float(), v8.float(), descale_q=1.0)
    with pytest.raises(TypeError, match="descale_v must be a float32"):
        fusedattn.attention(q8, k8, v8, descale_q=1.0, descale_k=1.0, descale_v=torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="descale_q must have one element or one per head"):
        fusedattn.attention(q8, k8, v8, descale_q=torch.ones(3), descale_k=1.0, descale_v=1.0)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fusedattn.attention(q8, k8, v8, dropout_p=0.1, **sc)
    with pytest.raises(NotImplementedError, match="float8 q / k / v"):
        fusedattn.attention(q8.requires_grad_(), k8, v8, **sc)
    with pytest.raises(ValueError, match="scale_s / scale_o / out_dtype are FP8 options"):
        fusedattn.attention(q8.float(), k8.float(), v8.float(), scale_s=2.0)


def test_flash_attn_door_fa3_descales():
    from fusedattn.flash_attn import flash_attn_func
    q8, k8, v8, sc = _inputs(seed=8)
    bshd = [x.transpose(1, 2) for x in (q8, k8, v8)]
    desc = {f"{n}_descale": sc[f"descale_{n}"].reshape(1, 1).expand(2, 2).contiguous() for n in "qkv"}
    out = flash_attn_func(*bshd, causal=True, **desc)
    want = fusedattn.attention(q8, k8, v8, causal=True, causal_alignment="bottom_right", **sc)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.transpose(1, 2))
    with pytest.raises(ValueError, match="k_descale must have shape"):
        flash_attn_func(*bshd, q_descale=desc["q_descale"], k_descale=torch.ones(3, 2), v_descale=desc["v_descale"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_cuda_matches_cpu_emulation(mask):
    q8, k8, v8, sc = _inputs(seed=12)
    sc.update(descale_s=1 / 256, scale_s=256.0, scale_o=1.0)
    cpu = _fwd(q8, k8, v8, sc, MASKS[mask], torch.bfloat16)
    m = {n: (x.cuda() if isinstance(x, torch.Tensor) else x) for n, x in MASKS[mask].items()}
    # the emulation on CUDA (backend 'cpu': 'auto' would run the Triton kernel, tests/test_fp8_kernel.py)
    gpu = _fwd(q8.cuda(), k8.cuda(), v8.cuda(), {n: (x.cuda() if isinstance(x, torch.Tensor) else x)
                                                for n, x in sc.items()}, m, torch.bfloat16, backend="cpu")
    ref, lse, bound = fp8_forward_bound(q8, k8, v8, o_dtype=torch.bfloat16, **MASKS[mask], **sc)
    assert ((gpu[0].cpu().double() - ref).abs() <= bound).all()
    assert abs(gpu[2].item() - cpu[2].item()) <= 1e-6


def test_a_gpu_without_fp8_kernels_runs_the_emulation_or_refuses(monkeypatch):
    """Triton types float8_e4m3fn as fp8e4nv and compiles it for compute capability 8.9+ only (its
    backends/nvidia/compiler.py adds fp8e4nv at >= 89; below, language/core.py raises "type fp8e4nv not
    supported in this architecture"). On such a GPU (an A100, say) an FP8 call must not reach a kernel:
    backend 'auto' takes the exact emulation with one warning naming the GPU, 'triton' refuses naming the
    capability; warmup's fp8 group is skipped there; the FP8 cache's decode kernel is not chosen. 8.9 / 9.0
    run the kernels, and CPU tensors (the interpreter) are unaffected."""
    import warnings
    from types import SimpleNamespace

    from fusedattn import plan, warmup
    from fusedattn.kvcache import _Call
    from fusedattn.problem import NotSupportedError
    capability = [(8, 0)]
    monkeypatch.setattr(plan, "_capability", lambda index: capability[0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    from fusedattn.backends import compat
    monkeypatch.setattr(compat, "_warned", set())
    gpu = torch.device("cuda", 0)
    with pytest.warns(RuntimeWarning, match="A100.*compute capability 8.0.*emulation"):
        assert fp8._use_kernel("auto", gpu, "sdpa_fp8") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # once per device
        assert fp8._use_kernel("auto", gpu, "sdpa_fp8") is False
    with pytest.raises(NotSupportedError, match=r"sdpa_fp8: backend='triton'.*8\.9.*compute capability 8\.0"):
        fp8._use_kernel("triton", gpu, "sdpa_fp8")
    decode_call = SimpleNamespace(q=SimpleNamespace(dtype=torch.bfloat16, device=gpu), s_q=1, g=4)
    assert not _Call.fp8_decode(decode_call)
    names = [name for name, _ in warmup.calls(["anchors", "fp8"], gpu)]
    assert names and not any(n.startswith("fp8:") for n in names)
    from fusedattn import bench                             # bench's FP8 cells: none, with the reason
    fake_inputs = SimpleNamespace(q=SimpleNamespace(device=gpu), extra={})
    with pytest.raises(bench.Unsupported, match="compute capability 8.9"):
        bench.prepare_ours_fp8(bench.fp8_configs()[0], True)(fake_inputs)
    for capability[0] in ((8, 9), (9, 0)):
        assert fp8._use_kernel("auto", gpu, "sdpa_fp8") is True
        assert _Call.fp8_decode(decode_call)
        assert any(n.startswith("fp8:") for n, _ in warmup.calls(["fp8"], gpu))
    assert plan.fp8_kernels_run(torch.device("cpu"))


def test_fa3_descales_equal_everywhere_become_one_scale():
    """FlashAttention-3 takes descales of shape (batch_size, nheads_k); serving code passes its per-tensor
    scale expanded to that shape. fusedattn's FP8 forward kernels read per-head descales too, but its backward
    kernels one per tensor (per-head ones run the emulation), so the door hands a descale whose entries are all
    equal over as one element, per-head values as [nheads_k * group], and refuses values that differ between
    batch rows."""
    from fusedattn.flash_attn import _fa3_descale
    from fusedattn.problem import NotSupportedError
    x = torch.full((3, 2), 0.5)
    one = _fa3_descale("q_descale", x, 3, 2, 4)
    assert one.numel() == 1 and float(one) == 0.5
    heads = torch.tensor([[0.5, 0.25]]).expand(3, 2)
    per_head = _fa3_descale("k_descale", heads, 3, 2, 2)
    assert per_head.tolist() == [0.5, 0.5, 0.25, 0.25]
    with pytest.raises(NotSupportedError, match="v_descale differing between batch entries"):
        _fa3_descale("v_descale", torch.tensor([[0.5, 0.5], [0.25, 0.25], [0.5, 0.5]]), 3, 2, 1)


def test_a_gpu_call_the_kernels_refuse_warns_once(monkeypatch):
    """On a GPU an FP8 call the kernels do not take (per-head descales in the backward, say) runs the emulation:
    one warning per
    entry point and reason, naming it; none for the test-only refusals (16-bit values through the FP8 door,
    empty tensors) nor on the CPU."""
    import warnings

    from fusedattn.backends import compat
    monkeypatch.setattr(compat, "_warned", set())
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert fp8._refused(None, "sdpa_fp8", gpu) is False
    with pytest.warns(RuntimeWarning, match="sdpa_fp8 on cuda:0.*per-head descales.*emulation"):
        assert fp8._refused("per-head descales", "sdpa_fp8", gpu) is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fp8._refused("per-head descales", "sdpa_fp8", gpu)               # once
        assert fp8._refused("inputs are not of one float8 type", "sdpa_fp8", gpu)
        assert fp8._refused("per-head descales", "sdpa_fp8_backward", cpu)
    q8, k8, v8, sc = _inputs(seed=9)
    heads = q8.shape[1]
    per_head = dict(sc, descale_q=sc["descale_q"].reshape(1).repeat(heads))
    per_head = {n: fp8._scale(x, n, q8.device, heads) for n, x in per_head.items()}
    # the forward kernels read per-head descales (FP8_HEAD_SCALES); the backward kernels one per tensor
    assert fp8._kernel_refuses(q8, k8, v8, per_head, 1.0) is None
    assert fp8._kernel_refuses_bwd(q8, k8, v8, q8, q8, per_head) == "per-head descales"
