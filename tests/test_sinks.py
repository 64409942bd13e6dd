"""Attention sinks (issue 26 item 3): a learnable per-head logit in every row's softmax denominator.

Checked against the float64 reference (``fusedattn.reference``, the sink as an appended column of value
0) by FlashAttention's rule (``testing.assert_error_within``: at most 2x PyTorch's same-precision
error plus a floor) on the CPU path, the real Triton kernels under the interpreter and the GPU:
forward, stats (which include the sink), backward with dsink; the split-KV decode (the sink counted
once whatever the split count); packed batches; the Graph and FlashAttention doors.
Each seeded case prints a one-line repro on failure.
"""
import pytest
import torch

import fusedattn
import fusedattn as cudnn
from fusedattn.graph import graphs as graphs_module
from fusedattn.kvcache import attention_with_kvcache
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within, assert_lse_close, guarded

# (name, kwargs of attention): every mask path that changes the epilogue's rows (ALiBi shifts the
# forward's frame; padding and an empty band leave rows with only the sink; bottom-right causal
# with s_q > s_kv has rows above the diagonal that see no key)
CASES = [
    ("plain", {}),
    ("causal_br", dict(causal=True, causal_alignment="bottom_right")),
    ("alibi_window", dict(alibi=True, window=(6, 2))),
    ("padding", dict(seq_len_q=[30, 41], seq_len_kv=[0, 45])),
    ("softcap_causal", dict(softcap=5.0, causal=True)),
]


def _inputs(seed, device, dtype, b=2, h_q=4, h_kv=2, s_q=41, s_kv=53, d=32, layout="bhsd"):
    gen = torch.Generator().manual_seed(seed)
    q = guarded((b, h_q, s_q, d), dtype, device, layout=layout, gen=gen).view
    k = guarded((b, h_kv, s_kv, d), dtype, device, layout=layout, gen=gen).view
    v = guarded((b, h_kv, s_kv, d), dtype, device, layout=layout, gen=gen).view
    # spread so some heads' sinks dominate and others hardly count
    sink = (torch.randn(h_q, generator=gen) * 2.0).to(device)
    return q, k, v, sink


def _kw(kw, device):
    out = dict(kw)
    for name in ("seq_len_q", "seq_len_kv"):
        if name in out:
            out[name] = torch.tensor(out[name], dtype=torch.int32, device=device)
    return out


def _leaf(t, dtype=None):
    return t.detach().clone().to(dtype or t.dtype).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_sink_forward_backward(target, name, kw, dtype):
    device, backend = target
    seed = 1000 + [c[0] for c in CASES].index(name)
    repro = f"repro: pytest tests/test_sinks.py -k 'test_sink_forward_backward and {name}' (seed {seed}, {dtype})"
    q, k, v, sink = _inputs(seed, device, dtype)
    kw = _kw(kw, device)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)

    leaves = [_leaf(t) for t in (q, k, v)] + [_leaf(sink)]
    out, lse = fusedattn.attention(*leaves[:3], sink=leaves[3], return_stats=True, backend=backend, **kw)
    grads = torch.autograd.grad(out, leaves, do)

    gold_leaves = [_leaf(t, torch.float64) for t in (q, k, v, sink)]
    gold_out, gold_lse = attention_reference(*gold_leaves[:3], sink=gold_leaves[3], **kw)
    gold_grads = torch.autograd.grad(gold_out, gold_leaves, do.double())
    base_leaves = [_leaf(t, torch.float32 if dtype == torch.float32 else dtype) for t in (q, k, v)]
    base_sink = _leaf(sink)
    base_out, _ = attention_reference(*base_leaves, sink=base_sink, dtype=dtype, **kw)
    base_grads = torch.autograd.grad(base_out, base_leaves + [base_sink], do)

    assert_error_within(out, gold_out, base_out, msg=f"out. {repro}")
    assert_lse_close(lse, gold_lse, msg=repro)
    for nm, g, gg, bg in zip(("dq", "dk", "dv", "dsink"), grads, gold_grads, base_grads):
        assert_error_within(g, gg, bg.to(gg.dtype) if nm == "dsink" else bg, factor=3.0,
                            floor=1e-4 if nm == "dsink" else None, msg=f"{nm}. {repro}")
    assert grads[3].dtype == sink.dtype and grads[3].shape == sink.shape

    # the sink matters: without it the output and stats differ (and equal the sink-free reference)
    plain = fusedattn.attention(q, k, v, backend=backend, **kw)
    assert (plain.double() - out.detach().double()).abs().max() > 1e-2, repro


def test_sink_empty_rows_and_dsink_closed_form(target):
    """A row that sees no key has output 0 and lse = its head's sink (rows past seq_len_q: 0 / -inf);
    dsink equals -sum_rows exp(sink - lse) * rowsum(dO * O) computed by hand."""
    device, backend = target
    q, k, v, sink = _inputs(7, device, torch.float32, s_q=9, s_kv=5)
    lens_q = torch.tensor([9, 4], dtype=torch.int32, device=device)
    leaves = [_leaf(t) for t in (q, k, v, sink)]
    # bottom-right causal with s_q 9 > s_kv 5: rows 0..3 see no key
    out, lse = fusedattn.attention(*leaves[:3], sink=leaves[3], causal=True, causal_alignment="bottom_right",
                                   seq_len_q=lens_q, return_stats=True, backend=backend)
    do = torch.randn_like(out)
    dsink = torch.autograd.grad(out, leaves[3], do)[0]
    assert torch.equal(out[0, :, :4].detach(), torch.zeros_like(out[0, :, :4]))
    torch.testing.assert_close(lse[0, :, :4, 0], sink.view(-1, 1).expand(-1, 4), rtol=0, atol=1e-6)
    assert (lse[1, :, 4:, 0] == float("-inf")).all()                       # past seq_len_q
    delta = (do.double() * out.detach().double()).sum(-1)
    lse_d = lse[..., 0].double()
    p_sink = torch.where(lse_d == float("-inf"), 0.0, torch.exp(sink.double().view(1, -1, 1) - lse_d))
    torch.testing.assert_close(dsink.double(), -(p_sink * delta).sum(dim=(0, 2)), rtol=1e-4, atol=1e-5)


def test_sink_absent_is_unchanged(target):
    """sink=None is exactly the sink-free call (same kernels, HAS_SINK off); a sink of -inf per head
    equals no sink too (exp(-inf) = 0)."""
    device, backend = target
    q, k, v, _ = _inputs(3, device, torch.float32)
    a = fusedattn.attention(q, k, v, causal=True, backend=backend)
    b = fusedattn.attention(q, k, v, causal=True, backend=backend, sink=None)
    c = fusedattn.attention(q, k, v, causal=True, backend=backend,
                            sink=torch.full((q.shape[1],), float("-inf"), device=device))
    assert torch.equal(a, b)
    torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(3), r"sink must be a float tensor of shape \[4\]"),
    (torch.zeros(4, dtype=torch.int32), "float tensor"),
    ([0.0] * 4, "float tensor"),
])
def test_sink_bad_input(bad, match):
    q, k, v, _ = _inputs(0, "cpu", torch.float32)
    with pytest.raises(ValueError, match=match):
        fusedattn.attention(q, k, v, sink=bad)


@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_sink_decode_split_counts_once(target, splits, paged):
    """attention_with_kvcache: the sink joins one split's partial, so every split count gives the
    reference's out and lse (GQA group packed, ragged cache lengths, one empty cache)."""
    device, backend = target
    gen = torch.Generator().manual_seed(40 + splits)
    b, h_q, h_kv, s_q, d, cap = 3, 4, 2, 2, 32, 96
    q = torch.randn(b, h_q, s_q, d, generator=gen).to(device)
    kc = torch.randn(b, h_kv, cap, d, generator=gen).to(device)
    vc = torch.randn(b, h_kv, cap, d, generator=gen).to(device)
    sink = (torch.randn(h_q, generator=gen) * 2).to(device)
    lens = torch.tensor([96, 37, 0], dtype=torch.int32, device=device)
    kw = dict(seq_len_kv=lens, causal=True, num_splits=splits, return_stats=True, backend=backend, sink=sink)
    if paged:
        page = 16
        perm = torch.randperm(b * cap // page, generator=gen)
        table = perm.view(b, cap // page).to(torch.int32).to(device)
        kp = torch.empty(b * cap // page, h_kv, page, d, device=device)
        vp = torch.empty_like(kp)
        kp[table.long().flatten()] = kc.unflatten(2, (cap // page, page)).permute(0, 2, 1, 3, 4).flatten(0, 1)
        vp[table.long().flatten()] = vc.unflatten(2, (cap // page, page)).permute(0, 2, 1, 3, 4).flatten(0, 1)
        out, lse = attention_with_kvcache(q, kp, vp, page_table=table, **kw)
    else:
        out, lse = attention_with_kvcache(q, kc, vc, **kw)
    gold_out, gold_lse = attention_reference(q.double(), kc.double(), vc.double(), causal=True,
                                             causal_alignment="bottom_right", seq_len_kv=lens, sink=sink.double())
    base_out, _ = attention_reference(q, kc, vc, causal=True, causal_alignment="bottom_right", seq_len_kv=lens,
                                      sink=sink, dtype=torch.float32)
    repro = f"repro: pytest tests/test_sinks.py -k 'decode and {splits}' (paged={paged})"
    assert_error_within(out, gold_out, base_out, msg=repro)
    assert_lse_close(lse, gold_lse, msg=repro)
    # the empty cache: every row has only the sink
    torch.testing.assert_close(lse[2, :, :, 0], sink.view(-1, 1).expand(-1, s_q), rtol=0, atol=1e-5)


def test_sink_varlen_matches_padded(target):
    """attention_varlen with a sink: out, stats and every gradient (dsink included) equal the padded
    call's (seq_len_q / seq_len_kv masks)."""
    device, backend = target
    gen = torch.Generator().manual_seed(77)
    lq, lkv = [5, 0, 17], [9, 4, 17]
    h_q, h_kv, d = 4, 2, 16
    cu_q = torch.tensor([0, 5, 5, 22], dtype=torch.int32, device=device)
    cu_kv = torch.tensor([0, 9, 13, 30], dtype=torch.int32, device=device)
    q = torch.randn(22, h_q, d, generator=gen).to(device).requires_grad_()
    k = torch.randn(30, h_kv, d, generator=gen).to(device).requires_grad_()
    v = torch.randn(30, h_kv, d, generator=gen).to(device).requires_grad_()
    sink = torch.randn(h_q, generator=gen).to(device).requires_grad_()
    out, st = fusedattn.attention_varlen(q, k, v, cu_q, cu_kv, 17, 17, causal=True, causal_alignment="bottom_right",
                                         sink=sink, return_stats=True, backend=backend)
    do = torch.randn(out.shape, generator=gen).to(device)
    g = torch.autograd.grad(out, (q, k, v, sink), do)

    def pad(x, lens, cu):
        t = x.new_zeros((3, 17) + tuple(x.shape[1:]))
        for i, n in enumerate(lens):
            t[i, :n] = x[int(cu[i]):int(cu[i]) + n]
        return t.transpose(1, 2)
    qr, kr, vr = (pad(t.detach().double(), ln, cu).requires_grad_() for t, ln, cu in
                  ((q, lq, cu_q), (k, lkv, cu_kv), (v, lkv, cu_kv)))
    sr = sink.detach().double().requires_grad_()
    lens = [torch.tensor(x, dtype=torch.int32, device=device) for x in (lq, lkv)]
    ro, rl = attention_reference(qr, kr, vr, causal=True, causal_alignment="bottom_right", seq_len_q=lens[0],
                                 seq_len_kv=lens[1], sink=sr)
    rg = torch.autograd.grad(ro, (qr, kr, vr, sr), pad(do.double(), lq, cu_q))
    unpad = lambda t, ln: torch.cat([t[i].transpose(0, 1)[:n] for i, n in enumerate(ln)])  # noqa: E731
    torch.testing.assert_close(out.double(), unpad(ro, lq), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st.double(), unpad(rl.double(), lq)[..., 0].T, rtol=1e-4, atol=1e-5)
    for nm, a, r, ln in (("dq", g[0], rg[0], lq), ("dk", g[1], rg[1], lkv), ("dv", g[2], rg[2], lkv)):
        torch.testing.assert_close(a.double(), unpad(r, ln), rtol=1e-4, atol=1e-4, msg=nm)
    torch.testing.assert_close(g[3].double(), rg[3], rtol=1e-4, atol=1e-4)


def test_sink_flash_attn_door(target):
    """FlashAttention-4's keyword: flash_attn_func(learnable_sink=) in BSHD, with its gradient;
    softmax_lse includes the sink."""
    from fusedattn.flash_attn import flash_attn_func
    device, backend = target
    q, k, v, sink = _inputs(11, device, torch.float32)
    qb, kb, vb = (_leaf(t.transpose(1, 2)) for t in (q, k, v))
    s = _leaf(sink)
    out, lse, _ = flash_attn_func(qb, kb, vb, causal=True, learnable_sink=s, return_attn_probs=True, backend=backend)
    dsink = torch.autograd.grad(out.sum(), s)[0]
    gs = _leaf(sink, torch.float64)
    ro, rl = attention_reference(q.double(), k.double(), v.double(), causal=True, causal_alignment="bottom_right",
                                 sink=gs)
    torch.testing.assert_close(out.transpose(1, 2).double(), ro, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), rl[..., 0].double(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dsink.double(), torch.autograd.grad(ro.sum(), gs)[0], rtol=1e-4, atol=1e-4)


def test_sink_graph_door(target, monkeypatch):
    """cuDNN frontend 1.32's spelling: sdpa(sink_token=) and sdpa_backward(sink_token=, dSink_token=),
    sink tensors [1, h, 1, 1] fp32; Stats include the sink."""
    device, backend = target
    monkeypatch.setattr(graphs_module, "DEFAULT_BACKEND", backend)
    q_t, k_t, v_t, sink = _inputs(21, device, torch.float32, s_q=13, s_kv=19)
    q_t, k_t, v_t = (t.contiguous() for t in (q_t, k_t, v_t))
    b, h, s_q, d = q_t.shape
    sink_t = sink.view(1, h, 1, 1).contiguous()
    do_t = torch.randn(q_t.shape, generator=torch.Generator().manual_seed(5)).to(device)

    fwd = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v, sk = (fwd.tensor_like(t) for t in (q_t, k_t, v_t, sink_t))
    o, stats = fwd.sdpa(q, k, v, generate_stats=True, attn_scale=0.3, use_causal_mask=True, sink_token=sk)
    o.set_output(True)
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    fwd.build()
    o_t = torch.full((b, h, s_q, d), float("nan"), device=device)
    st_t = torch.full((b, h, s_q, 1), float("nan"), device=device)
    fwd.execute({q: q_t, k: k_t, v: v_t, sk: sink_t, o: o_t, stats: st_t}, None)

    bwd = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v, o, dO, stats, sk = (bwd.tensor_like(t) for t in (q_t, k_t, v_t, o_t, do_t, st_t, sink_t))
    dsink_t = torch.full_like(sink_t, float("nan"))
    dsk = bwd.tensor_like(dsink_t)
    dQ, dK, dV = bwd.sdpa_backward(q=q, k=k, v=v, o=o, dO=dO, stats=stats, attn_scale=0.3, use_causal_mask=True,
                                   sink_token=sk, dSink_token=dsk)
    for g_, t in ((dQ, q_t), (dK, k_t), (dV, v_t)):
        g_.set_output(True).set_dim(t.size()).set_stride(t.stride())
    bwd.build()
    dq_t, dk_t, dv_t = (torch.full_like(t, float("nan")) for t in (q_t, k_t, v_t))
    bwd.execute({q: q_t, k: k_t, v: v_t, o: o_t, dO: do_t, stats: st_t, sk: sink_t, dsk: dsink_t,
                 dQ: dq_t, dK: dk_t, dV: dv_t}, None)

    leaves = [_leaf(t, torch.float64) for t in (q_t, k_t, v_t, sink)]
    ro, rl = attention_reference(*leaves[:3], attn_scale=0.3, causal=True, sink=leaves[3])
    rg = torch.autograd.grad(ro, leaves, do_t.double())
    torch.testing.assert_close(o_t.double(), ro, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(st_t.double(), rl.double(), rtol=1e-4, atol=1e-5)
    for got, want in zip((dq_t, dk_t, dv_t, dsink_t.view(-1)), rg):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_sink_graph_dsink_needs_sink():
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q = graph.tensor_like(torch.empty(1, 2, 4, 16))
    with pytest.raises(cudnn.GraphError, match="dSink_token given without sink_token"):
        graph.sdpa_backward(q, q, q, q, q, graph.tensor_like(torch.empty(1, 2, 4, 1)),
                            dSink_token=graph.tensor_like(torch.empty(1, 2, 1, 1)))
