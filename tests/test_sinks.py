"""Attention sinks (issue 26 item 3): a learnable per-head logit in every row's softmax denominator.

Checked against the float64 reference (``fusedattn.reference``, the sink as an appended column of value
0) by FlashAttention's rule (``testing.assert_error_within``: at most 2x PyTorch's same-precision
error plus a floor) on the CPU path, the real Triton kernels under the interpreter and the GPU:
forward, stats (which include the sink), backward with dsink; the split-KV decode (the sink counted
once whatever the split count); packed batches; the Graph and FlashAttention doors. dsink folded into
the kernel that computes delta (deterministic=False: the Triton delta pass under the interpreter, the
Gluon dQ pass and the delta pass on Hopper) against float64 and against torch's ``cpu.sink_grad``.
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


# ---------------------------------------------------------------------------------------------------
# issue 26: the sink's gradient folded into the kernel that computes delta (deterministic=False)

def _delta_pass_inputs(seed, device, layout, group, padded):
    """q, k, v (fp32, ``layout``), sink, the forward's out and stats (a sink-aware forward), dO with NaN
    in the rows past seq_len_q, and the problem's keyword arguments."""
    from conftest import HAS_CUDA
    gen = torch.Generator().manual_seed(seed)
    b, h_kv, s_q, s_kv, d = 2, 2, 77, 50, 40          # 77 rows: two 64-row programs per head, one partial
    h_q = h_kv * group
    q = guarded((b, h_q, s_q, d), torch.float32, device, layout=layout, gen=gen).view
    k = guarded((b, h_kv, s_kv, d), torch.float32, device, layout=layout, gen=gen).view
    v = guarded((b, h_kv, s_kv, d), torch.float32, device, layout=layout, gen=gen).view
    sink = (torch.randn(h_q, generator=gen) * 2.0).to(device)
    sink[0] = 6.0                                     # a sink that dominates its rows
    kw = dict(causal=True, causal_alignment="bottom_right")
    if padded:
        # batch 0 sees no key (lse = sink, out = 0, delta = 0); batch 1's rows past 30 have lse -inf
        kw.update(seq_len_q=torch.tensor([77, 30], dtype=torch.int32, device=device),
                  seq_len_kv=torch.tensor([0, 50], dtype=torch.int32, device=device))
    out, stats = fusedattn.attention_forward(q, k, v, sink=sink, return_stats=True,
                                             backend="triton" if HAS_CUDA else "cpu", **kw)
    do = guarded((b, h_q, s_q, d), torch.float32, device, layout=layout, gen=gen).view
    if padded:
        do[1, :, 30:] = float("nan")                  # padding rows of dO may hold anything
    return q, k, v, sink, out, stats, do, kw


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("group", [1, 3], ids=["mha", "gqa3"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_delta_pass_adds_dsink(layout, group, padded):
    """bwd.launch_delta(..., lse=, sink=, dsink=) (the Gluon backward's delta pass, deterministic=False)
    writes delta and adds -sum_rows exp(sink - lse) * delta into a zeroed dsink with one atomic per
    program: against float64 autograd by the reference rule (PyTorch's fp32 ``cpu.sink_grad`` as the
    same-precision error), rows with lse -inf and NaN in dO's padding rows giving 0; the stats in the
    caller's layout (BSHD memory seen as [b, h, s]); and the sink-free launch unchanged."""
    from conftest import HAS_CUDA, INTERPRET
    if not (HAS_CUDA or INTERPRET):
        pytest.skip("needs the GPU or Triton's interpreter")
    from fusedattn.backends import cpu as cpu_backend
    from fusedattn.backends.triton import bwd
    from fusedattn.problem import make_problem
    device = "cuda" if HAS_CUDA else "cpu"
    repro = f"repro: pytest tests/test_sinks.py -k 'test_delta_pass_adds_dsink and {layout}' (group={group}, " \
            f"padded={padded})"
    q, k, v, sink, out, stats, do, kw = _delta_pass_inputs(60 + group + 10 * padded, device, layout, group, padded)
    b, h_q, s_q, _ = q.shape
    lse = stats[..., 0]
    if layout == "bshd":
        mem = torch.full((b, s_q, h_q), float("nan"), device=device)
        mem.copy_(lse.transpose(1, 2))
        lse = mem.transpose(1, 2)
    p, extras = make_problem(q, k, v, sink=sink, **kw)
    delta = torch.full((b * h_q, s_q), float("nan"), device=device)
    dsink = torch.zeros(h_q, device=device)
    bwd.launch_delta(p, out, do, delta, lse=lse, sink=extras["sink"], dsink=dsink)

    rows_ok = torch.ones(b, h_q, s_q, dtype=torch.bool, device=device)
    if padded:
        rows_ok[1, :, 30:] = False
    want_delta = (out.double() * do.double()).sum(-1)
    torch.testing.assert_close(delta.view(b, h_q, s_q)[rows_ok].double(), want_delta[rows_ok], rtol=1e-5,
                               atol=1e-4, msg=repro)
    # float64 autograd of the reference; dO's NaN padding rows are no gradient of anything (zeroed)
    leaves = [_leaf(t, torch.float64) for t in (q, k, v, sink)]
    gold_out, _ = attention_reference(*leaves[:3], sink=leaves[3], **kw)
    gold = torch.autograd.grad(gold_out, leaves[3], torch.where(rows_ok[..., None], do, 0.0).double())[0]
    base = cpu_backend.sink_grad(extras["sink"], stats[..., 0], torch.where(rows_ok, want_delta.float(), 0.0))
    assert not torch.isnan(dsink).any(), f"NaN in dsink {dsink.tolist()}. {repro}"
    assert_error_within(dsink, gold, base.double(), factor=3.0, floor=1e-4, msg=f"dsink. {repro}")

    # without dsink: the same delta, nothing else touched
    again = torch.full_like(delta, float("nan"))
    bwd.launch_delta(p, out, do, again)
    assert torch.equal(again[rows_ok.view(b * h_q, s_q)], delta[rows_ok.view(b * h_q, s_q)]), repro



def test_delta_pass_launch_key_includes_the_sink(monkeypatch):
    """launch_delta's Launcher key (backends/triton/launch.py's contract: everything the JIT specializes on)
    tells the HAS_SINK launch from the plain one, and the stats' strides apart (a repeat call with another
    layout must not reuse a kernel specialized on the first one's)."""
    from fusedattn.backends.triton import bwd
    from fusedattn.problem import make_problem
    seen = []
    monkeypatch.setattr(bwd, "_PREPROCESS", lambda key, grid, *a, **kw: seen.append((key, kw["HAS_SINK"])))
    q = torch.randn(1, 4, 33, 16)
    p, extras = make_problem(q, q, q, sink=torch.zeros(4))
    delta, dsink = torch.empty(4, 33), torch.zeros(4)
    lse = torch.empty(1, 4, 33)
    lse_t = torch.empty(1, 33, 4).transpose(1, 2)
    bwd.launch_delta(p, q, q, delta)
    bwd.launch_delta(p, q, q, delta, lse=lse, sink=extras["sink"], dsink=dsink)
    bwd.launch_delta(p, q, q, delta, lse=lse_t, sink=extras["sink"], dsink=dsink)
    bwd.launch_delta(p, q, q, delta, lse=lse, sink=extras["sink"], dsink=dsink)
    assert [flag for _, flag in seen] == [False, True, True, True]
    keys = [key for key, _ in seen]
    assert len(set(keys[:3])) == 3 and keys[1] == keys[3]


def test_delta_pass_launch_key_is_the_same_for_every_dropout_seed(monkeypatch):
    """launch_delta's key holds nothing that changes from one training step to the next: with dropout the problem
    carries a new seed and offset on every call, and a key holding them made a cache entry and a JIT dispatch per
    step (the GPU test test_launch.py::test_repeat_training_steps_add_no_launch_entries[fused_dropout], bench/NOTES.md
    89); what the kernel does depend on (here the query length) still tells keys apart."""
    from fusedattn.backends.triton import bwd
    from fusedattn.problem import make_problem
    seen = []
    monkeypatch.setattr(bwd, "_PREPROCESS", lambda key, grid, *a, **kw: seen.append(key))
    for seed, offset, s_q in ((1, 0, 33), (2**40 + 3, 16, 33), (48, 2**33, 33), (1, 0, 34)):
        q = torch.randn(1, 4, s_q, 16)
        p, _ = make_problem(q, q, q, dropout_p=0.1, dropout_seed=seed, dropout_offset=offset)
        bwd.launch_delta(p, q, q, torch.empty(4, s_q))
    assert seen[0] == seen[1] == seen[2] and seen[3] != seen[0], seen

# the Gluon two-pass backward with a sink (H100/H200): (d, kwargs of attention, lengths) -> the kernel that
# computes delta and takes the sink there: "causal_2k" (issue 26's bench row, below
# functional._FUSED_CAUSAL_MIN_KEYS keys: two passes) and "causal_padded" (rows that see no key, rows past
# seq_len_q, CTAs with no key tile) the dQ pass (WRITE_DELTA); "plain_padded" and "d256_plain" (the fused
# kernel refuses them) the separate delta pass
GLUON_SINK_ROUTES = {
    "causal_2k": (128, 2048, 2048, dict(causal=True)),
    "causal_padded": (128, 1000, 1100, dict(causal=True, causal_alignment="bottom_right",
                                            seq_len_q=[1000, 333], seq_len_kv=[900, 0])),
    "plain_padded": (128, 1000, 1100, dict(seq_len_q=[1000, 333], seq_len_kv=[900, 0])),
    "d256_plain": (256, 777, 777, {}),
}
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _HOPPER, reason="the Gluon backward is Hopper-only (compute capability 9.x): GPU test skipped")
@pytest.mark.parametrize("route", GLUON_SINK_ROUTES)
def test_gluon_two_pass_backward_folds_dsink(route, monkeypatch):
    """deterministic=False: the kernel that computes delta (the Gluon dQ pass under a band, else the
    separate delta pass) adds dsink with atomics and torch's ``cpu.sink_grad`` never runs; deterministic=True
    keeps sink_grad (bitwise reproducible run to run). Both give dsink within fp32 summation order of each
    other and of float64, the same dQ, dK, dV bit for bit (the fold changes nothing else), and those pass
    the reference rule. bf16, GQA 8/2, BSHD memory; the fused kernel is never taken."""
    from fusedattn.backends import cpu as cpu_backend
    from fusedattn.backends.gluon import bwd_dq_sm90, bwd_fused_sm90
    from fusedattn.backends.triton import bwd as triton_bwd
    from fusedattn.backends.triton import launch as launch_mod
    d, s_q, s_kv, kw = GLUON_SINK_ROUTES[route]
    kw = {key: torch.tensor(val, dtype=torch.int32, device="cuda") if isinstance(val, list) else val
          for key, val in kw.items()}
    repro = f"repro: pytest tests/test_sinks.py -k 'test_gluon_two_pass_backward_folds_dsink and {route}'"
    calls = []

    def counted(real, name):
        def run(*a, **kwargs):
            if getattr(launch_mod._ahead, "active", None) is None:      # run, not compiled ahead
                calls.append(name + ("+dsink" if kwargs.get("dsink") is not None else ""))
            return real(*a, **kwargs)
        return run
    for mod, name in ((bwd_dq_sm90, "launch_dq_sm90"), (bwd_fused_sm90, "launch_bwd_fused_sm90"),
                      (triton_bwd, "launch_delta"), (cpu_backend, "sink_grad")):
        monkeypatch.setattr(mod, name, counted(getattr(mod, name), name))
    gen = torch.Generator().manual_seed(26)
    mk = lambda h, s: torch.randn(2, s, h, d, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v = mk(8, s_q), mk(2, s_kv), mk(2, s_kv)
    sink = (torch.randn(8, generator=gen) * 2).to("cuda")
    sink[3] = 7.0                                     # a sink that takes most of its rows' mass
    do = mk(8, s_q)
    if "seq_len_q" in kw:
        rows = torch.arange(s_q, device="cuda").view(1, 1, -1, 1) < kw["seq_len_q"].view(-1, 1, 1, 1)
        do = torch.where(rows, do, 0.0)               # no gradient reaches padding rows of the output

    got = {}
    for deterministic in (False, True, True):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
        out = fusedattn.attention(*leaves[:3], sink=leaves[3], deterministic=deterministic, **kw)
        calls.clear()
        out.backward(do)
        torch.cuda.synchronize()
        assert not any(c.startswith("launch_bwd_fused_sm90") for c in calls), f"fused kernel taken: {calls}. {repro}"
        folded = [c for c in calls if c.endswith("+dsink")]
        if deterministic:
            assert calls.count("sink_grad") == 1 and not folded, f"deterministic: {calls}. {repro}"
        else:
            want = "launch_dq_sm90+dsink" if "causal" in kw else "launch_delta+dsink"
            assert folded == [want] and "sink_grad" not in calls, f"deterministic=False: {calls}. {repro}"
        grads = [t.grad for t in leaves]
        if deterministic and deterministic in got:
            assert torch.equal(grads[3], got[True][3]), f"deterministic dsink differs run to run. {repro}"
        got[deterministic] = grads
    for name, a, b in zip(("dq", "dk", "dv"), got[False][:3], got[True][:3]):
        assert torch.equal(a, b), f"{name} differs with the sink folded into the delta kernel. {repro}"

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    gold, gold_lse = attention_reference(*leaves[:3], sink=leaves[3], **kw)
    gold_grads = torch.autograd.grad(gold, leaves, do.double())
    base_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    base, _ = attention_reference(*base_leaves, sink=sink, dtype=torch.bfloat16, **kw)
    base_grads = torch.autograd.grad(base, base_leaves, do)
    for name, g, gg, bg in zip(("dq", "dk", "dv"), got[False][:3], gold_grads[:3], base_grads):
        assert_error_within(g, gg, bg, msg=f"{name} with a sink. {repro}")
    # dsink: fp32 sums over 2 x s_q rows, bounded relative to sum |p_sink * delta|
    lse_d = gold_lse.detach()[..., 0]
    p_sink = torch.where(lse_d == float("-inf"), 0.0, torch.exp(leaves[3].detach().view(1, -1, 1) - lse_d))
    scale = (p_sink * (gold.detach() * do.double()).sum(-1).abs()).sum(dim=(0, 2))
    for deterministic in (False, True):
        dsink = got[deterministic][3]
        assert ((dsink.double() - gold_grads[3]).abs() <= 2e-2 * scale + 1e-3).all(), \
            f"dsink (deterministic={deterministic}) {dsink.tolist()} vs {gold_grads[3].tolist()}. {repro}"
    assert ((got[False][3].double() - got[True][3].double()).abs() <= 1e-4 * scale + 1e-6).all(), \
        f"dsink folded {got[False][3].tolist()} vs sink_grad {got[True][3].tolist()}. {repro}"
