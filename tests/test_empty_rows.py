"""Rows that see no key (issue 24 item 1): their log-sum-exp is -inf, their output 0, their gradients 0.

Every backend reachable here runs (``target``: the CPU path, the real Triton kernels under the
interpreter; the GPU variants are marked ``gpu`` and skip visibly without CUDA). A row sees no key
when it is past ``seq_len_q``, when the band leaves it nothing (bottom-right causal with s_q > s_kv,
a window), when ``seq_len_kv`` is 0, or when a bool mask drops its whole row::

    s_q = 6, s_kv = 3, bottom-right causal (x kept)        lse          out
        row 0   . . .                                      -inf         0
        row 1   . . .                                      -inf         0
        row 2   . . .                                      -inf         0
        row 3   x . .                                      s30          v0
        row 4   x x .                                      lse(s40, s41)
        row 5   x x x                                      lse(s50, s51, s52)

-inf is the log of the row's empty sum (cuDNN 9.14+ writes it too), so (out, lse) pairs computed
on parts of K/V merge exactly: a part a row does not see weighs exp(-inf - lse) = 0. The backward
reads -inf as "no probability", never exp(-inf - -inf) = NaN. Each failure prints a repro line.
"""
import pytest
import torch

import fusedattn
import fusedattn as cudnn
from fusedattn.distributed.ring import merge_partial
from fusedattn.graph import graphs as graphs_module
from fusedattn.kvcache import attention_with_kvcache
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within, assert_lse_close

from conftest import target_id

NEG_INF = float("-inf")


@pytest.fixture
def on_target(target, monkeypatch):
    """(device, backend) with graphs built without backend= running on that backend."""
    device, backend = target
    monkeypatch.setattr(graphs_module, "DEFAULT_BACKEND", backend)
    return device, backend


def _lens(device, *vals):
    return torch.tensor(vals, dtype=torch.int32, device=device)


def geometry(device, kind):
    """(b, h_q, h_kv, s_q, s_kv, d, dtype). On the GPU: the shape of the NaN report of issue 24 item 4
    (s_q 512 > s_kv 24, d 64; bf16 for the bias + band case, fp16 elsewhere); here small, fp32."""
    if device == "cuda":
        return 2, 4, 2, 512, 24, 64, torch.bfloat16 if kind == "band_bias" else torch.float16
    return 2, 4, 2, 40, 13, 32, torch.float32


def kind_kwargs(kind, device, b, h_q, s_q, s_kv, gen):
    """Keyword arguments of ``kind``: each leaves some rows (never all) without a key."""
    if kind == "padding_q":                 # rows past seq_len_q; batch entry 1 has no query row at all
        return dict(seq_len_q=_lens(device, s_q - 5, 0))
    if kind == "causal_br":                 # rows i < s_q - s_kv see nothing
        return dict(causal=True, causal_alignment="bottom_right")
    if kind == "window":                    # top-left diagonal only: rows >= s_kv see nothing
        return dict(window=(0, 0))
    if kind == "seq_len_kv_0":              # batch entry 1 has no key
        return dict(seq_len_kv=_lens(device, s_kv, 0))
    if kind == "boolmask":                  # a bool keep-mask with whole rows False
        keep = torch.rand(1, h_q, s_q, s_kv, generator=gen) > 0.3
        keep[:, :, ::3] = False
        return dict(attn_bias=keep.to(device))
    if kind == "band_bias":                 # issue 24 item 4: float bias, bottom-right, cuDNN band (1, 0)
        return dict(attn_bias=torch.randn(b, h_q, s_q, s_kv, generator=gen).to(device),
                    causal_alignment="bottom_right", window=(0, 0))
    if kind == "alibi_causal_br":           # ALiBi shifts the lse of the rows that see keys only
        return dict(alibi=True, causal=True, causal_alignment="bottom_right")
    if kind == "softcap_window_br":
        return dict(softcap=2.0, window=(2, 0), causal_alignment="bottom_right")
    raise ValueError(kind)


KINDS = ["padding_q", "causal_br", "window", "seq_len_kv_0", "boolmask", "band_bias", "alibi_causal_br",
         "softcap_window_br"]


def make_case(kind, device):
    """BSHD inputs, dO and the kind's kwargs, seeded by the kind's index."""
    b, h_q, h_kv, s_q, s_kv, d, dt = geometry(device, kind)
    gen = torch.Generator().manual_seed(240 + KINDS.index(kind))
    q = torch.randn(b, s_q, h_q, d, generator=gen).to(device, dt).transpose(1, 2)
    k = torch.randn(b, s_kv, h_kv, d, generator=gen).to(device, dt).transpose(1, 2)
    v = torch.randn(b, s_kv, h_kv, d, generator=gen).to(device, dt).transpose(1, 2)
    do = torch.randn(b, h_q, s_q, d, generator=gen).to(device, dt)
    return q, k, v, do, kind_kwargs(kind, device, b, h_q, s_q, s_kv, gen)


def _cpu(kw):
    return {n: (t.detach().cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}


def reference_grads(q, k, v, do, kw, dtype):
    """(out, lse, dq, dk, dv, dbias) of the reference in ``dtype`` (dbias None without a float bias)."""
    rq, rk, rv = (t.detach().cpu().to(dtype).requires_grad_() for t in (q, k, v))
    rkw = _cpu(kw)
    rb = None
    bias = rkw.get("attn_bias")
    if bias is not None and bias.is_floating_point():
        rkw["attn_bias"] = rb = bias.to(dtype).requires_grad_()
    o, lse = attention_reference(rq, rk, rv, dtype=dtype, **rkw)
    o.backward(do.cpu().to(dtype))
    return o.detach(), lse, rq.grad, rk.grad, rv.grad, (rb.grad if rb is not None else None)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_rows_forward_backward(kind, target):
    """-inf stats on exactly the empty rows, output and dQ exactly 0 there, every gradient finite and
    equal to the float64 reference's (FlashAttention's 2x rule), through both doors: autograd, and
    attention_forward / attention_backward writing into NaN-filled buffers."""
    device, backend = target
    rep = f"repro: pytest tests/test_empty_rows.py -k 'test_empty_rows_forward_backward and {kind} and " \
          f"{target_id(target)}'"
    q, k, v, do, kw = make_case(kind, device)
    bias = kw.get("attn_bias")
    float_bias = bias is not None and bias.is_floating_point()
    if float_bias:
        kw["attn_bias"] = bias = bias.clone().requires_grad_()
    gold = reference_grads(q, k, v, do, kw, torch.float64)
    base = reference_grads(q, k, v, do, kw, q.dtype)
    empty = gold[1][..., 0] == NEG_INF                      # [b, h_q, s_q]
    assert empty.any() and not empty.all(), f"the case must have empty and non-empty rows. {rep}"

    # forward door, NaN-filled outputs: every element written
    out = torch.full_like(do, float("nan"))
    stats = torch.full(do.shape[:3] + (1,), float("nan"), device=device)
    fusedattn.attention_forward(q, k, v, backend=backend, out=out, stats_out=stats, **kw)
    assert_lse_close(stats, gold[1], msg=rep)
    assert (out.cpu()[empty] == 0).all(), f"rows with no key must give output 0. {rep}"
    assert_error_within(out.cpu(), gold[0], base[0], msg=f"out. {rep}")

    # backward door from those stats (-inf rows included), NaN-filled gradients
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    _, _, _, dbias = fusedattn.attention_backward(q, k, v, out, do, stats, backend=backend, dq=dq, dk=dk, dv=dv,
                                                  need_dbias=float_bias, **kw)
    got = {"dq": dq, "dk": dk, "dv": dv, "dbias": dbias}
    # autograd: the same gradients
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o2 = fusedattn.attention(qs, ks, vs, backend=backend, **kw)
    o2.backward(do)
    auto = {"dq": qs.grad, "dk": ks.grad, "dv": vs.grad, "dbias": bias.grad if float_bias else None}
    for name, g_ref, b_ref in zip(("dq", "dk", "dv", "dbias"), gold[2:], base[2:]):
        if g_ref is None:
            continue
        for door, t in (("attention_backward", got[name]), ("autograd", auto[name])):
            assert torch.isfinite(t).all(), f"{door}: non-finite {name} ({int((~torch.isfinite(t)).sum())}). {rep}"
            assert_error_within(t.detach().cpu(), g_ref, b_ref, msg=f"{door}: {name}. {rep}")
    assert (dq.cpu()[empty] == 0).all() and (qs.grad.cpu()[empty] == 0).all(), f"dQ of empty rows must be 0. {rep}"
    if float_bias:
        assert (dbias.cpu()[empty] == 0).all(), f"dBias of empty rows must be 0. {rep}"


def keep_mask(kind, b, h_q, s_q, s_kv, gen, split):
    """The whole problem's mask as a bool keep-mask [b, h_q, s_q, s_kv] (sliceable by key halves at
    ``split``)."""
    i = torch.arange(s_q).view(-1, 1)
    j = torch.arange(s_kv).view(1, -1)
    if kind == "causal_br":
        keep = j <= i + (s_kv - s_q)
    elif kind == "window_br":
        keep = (j <= i + (s_kv - s_q)) & (j >= i + (s_kv - s_q) - 3)
    else:
        # random, with whole rows dropped (1::4) and rows that see one half only, by construction on every
        # geometry (a random row rarely loses a whole half when the halves are long, as on the GPU's 24 keys):
        # rows 2::4 keep no key of [split, s_kv) and rows 3::4 none of [0, split), each at least one of its own
        keep = torch.rand(b, h_q, s_q, s_kv, generator=gen) > 0.4
        keep[:, :, 1::4] = False
        keep[:, :, 2::4, split:] = False
        keep[:, :, 2::4, 0] = True
        keep[:, :, 3::4, :split] = False
        keep[:, :, 3::4, s_kv - 1] = True
    return keep.expand(b, h_q, s_q, s_kv).contiguous()


def _merged(parts, shape_o, shape_l):
    """Merge (out, lse [b,h,s,1]) parts with the package's rule (``distributed.ring.merge_partial``)."""
    out = torch.zeros(shape_o, dtype=torch.float64)
    lse = torch.full(shape_l, NEG_INF, dtype=torch.float64)
    for o, l in parts:
        merge_partial(out, lse, o.cpu().double(), l.cpu().double()[..., 0])
    return out, lse


@pytest.mark.parametrize("kind", ["causal_br", "window_br", "random"])
def test_halves_merge_to_whole(kind, target):
    """(out, lse) of keys [0, m) and [m, s_kv), merged by lse, equal the whole call's; a row that sees no
    key of one half has lse -inf there and weight 0, a row that sees no key at all stays 0 / -inf."""
    device, backend = target
    b, h_q, h_kv, s_q, s_kv, d, dt = geometry(device, "causal_br")
    rep = f"repro: pytest tests/test_empty_rows.py -k 'test_halves_merge_to_whole and {kind} and " \
          f"{target_id(target)}'"
    gen = torch.Generator().manual_seed(2400 + len(kind))
    q, k, v = (torch.randn(b, h, s, d, generator=gen).to(device, dt) for h, s in ((h_q, s_q), (h_kv, s_kv), (h_kv, s_kv)))
    m = s_kv // 2 + 1
    keep = keep_mask(kind, b, h_q, s_q, s_kv, gen, m).to(device)
    whole = fusedattn.attention(q, k, v, attn_bias=keep, return_stats=True, backend=backend)
    halves = [fusedattn.attention(q, k[:, :, a:e], v[:, :, a:e], attn_bias=keep[..., a:e], return_stats=True,
                                  backend=backend) for a, e in ((0, m), (m, s_kv))]
    one_sided = (halves[0][1] == NEG_INF) != (halves[1][1] == NEG_INF)
    assert one_sided.any(), f"some rows must see keys in one half only. {rep}"
    out, lse = _merged(halves, whole[0].shape, whole[1].shape[:3])
    assert_lse_close(lse.unsqueeze(-1), whole[1], msg=f"merged lse. {rep}")
    assert_lse_close(whole[1], attention_reference(q.cpu(), k.cpu(), v.cpu(), attn_bias=keep.cpu())[1],
                     msg=f"whole lse. {rep}")
    tol = 1e-5 if dt == torch.float32 else 2e-2
    err = (out - whole[0].cpu().double()).abs().max().item()
    assert err < tol, f"merged halves differ from the whole by {err:.2e}. {rep}"
    assert (out[lse == NEG_INF] == 0).all(), f"rows with no key in either half must merge to 0. {rep}"


def test_halves_merge_with_padding_lengths(target):
    """The same merge with native seq_len_kv: the second half of batch entry 1 has length 0 (no key)."""
    device, backend = target
    b, h_q, h_kv, s_q, s_kv, d, dt = geometry(device, "seq_len_kv_0")
    gen = torch.Generator().manual_seed(2410)
    q, k, v = (torch.randn(b, h, s, d, generator=gen).to(device, dt) for h, s in ((h_q, s_q), (h_kv, s_kv), (h_kv, s_kv)))
    m = s_kv // 2
    lens = [s_kv, m - 2]
    kw = dict(causal=True, causal_alignment="top_left")
    whole = fusedattn.attention(q, k, v, seq_len_kv=_lens(device, *lens), return_stats=True, backend=backend, **kw)
    # keys [m, s_kv) seen from the same rows: a bool mask keeps the top-left causal condition j <= i
    i, j = torch.arange(s_q).view(-1, 1), torch.arange(m, s_kv).view(1, -1)
    keep_b = (j <= i).to(device).expand(b, h_q, s_q, s_kv - m)
    parts = [fusedattn.attention(q, k[:, :, :m], v[:, :, :m], seq_len_kv=_lens(device, *(min(n, m) for n in lens)),
                                 return_stats=True, backend=backend, **kw),
             fusedattn.attention(q, k[:, :, m:], v[:, :, m:], attn_bias=keep_b, return_stats=True, backend=backend,
                                 seq_len_kv=_lens(device, *(max(n - m, 0) for n in lens)))]
    assert (parts[1][1][1] == NEG_INF).all(), "a part with seq_len_kv = 0 must give lse -inf"
    assert (parts[1][0][1] == 0).all(), "a part with seq_len_kv = 0 must give output 0"
    out, lse = _merged(parts, whole[0].shape, whole[1].shape[:3])
    assert_lse_close(lse.unsqueeze(-1), whole[1], msg="merged lse (padding halves)")
    tol = 1e-5 if dt == torch.float32 else 2e-2
    assert (out - whole[0].cpu().double()).abs().max().item() < tol


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_splits_empty(splits, target):
    """The split-KV decode kernel and its combine: a window leaves most splits empty for every row (weight
    0), a short cache leaves rows with no key at all (out 0, lse -inf), an empty cache every row."""
    device, backend = target
    gen = torch.Generator().manual_seed(2420 + splits)
    b, h_q, h_kv, s_q, cap, d = 3, 4, 2, 5, 96, 32
    dt = torch.float16 if device == "cuda" else torch.float32
    q = torch.randn(b, h_q, s_q, d, generator=gen).to(device, dt)
    k = torch.randn(b, h_kv, cap, d, generator=gen).to(device, dt)
    v = torch.randn(b, h_kv, cap, d, generator=gen).to(device, dt)
    lens = _lens(device, 90, 3, 0)          # entry 1: tokens 0, 1 see no key; entry 2: nothing at all
    out, lse = attention_with_kvcache(q, k, v, seq_len_kv=lens, window=(4, 0), num_splits=splits, return_stats=True,
                                      backend=backend)
    gold, gold_lse = attention_reference(q.cpu(), k.cpu(), v.cpu(), causal=True, causal_alignment="bottom_right",
                                         window=(4, 0), seq_len_kv=lens.cpu())
    rep = f"repro: pytest tests/test_empty_rows.py -k 'test_decode_splits_empty and {splits} and " \
          f"{target_id(target)}'"
    assert_lse_close(lse, gold_lse, tol=2e-3, msg=rep)
    assert (gold_lse[1, :, :2] == NEG_INF).all() and (gold_lse[2] == NEG_INF).all()
    assert (out.cpu()[gold_lse[..., 0] == NEG_INF] == 0).all(), f"rows with no key must give output 0. {rep}"
    tol = 1e-5 if dt == torch.float32 else 5e-3
    assert (out.cpu().double() - gold).abs().max().item() < tol, rep


def test_graph_stats_minus_inf(on_target):
    """The Graph door writes -inf into Stats for rows past seq_len_q and rows the band leaves empty, as
    cuDNN (backend 9.14 and later) does; the output of those rows is 0."""
    device, _ = on_target
    b, h, s_q, s_kv, d = 2, 2, 12, 7, 16
    gen = torch.Generator().manual_seed(2430)
    q_t, k_t, v_t = (torch.randn(b, h, s, d, generator=gen).to(device) for s in (s_q, s_kv, s_kv))
    lq = torch.tensor([12, 6], dtype=torch.int32).view(b, 1, 1, 1)
    lkv = torch.tensor([7, 7], dtype=torch.int32).view(b, 1, 1, 1)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    q, k, v = graph.tensor_like(q_t), graph.tensor_like(k_t), graph.tensor_like(v_t)
    sq, skv = graph.tensor_like(lq.to(device)), graph.tensor_like(lkv.to(device))
    o, stats = graph.sdpa(q, k, v, generate_stats=True, attn_scale=0.5, use_padding_mask=True, seq_len_q=sq,
                          seq_len_kv=skv, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
                          diagonal_band_right_bound=0)
    o.set_output(True)
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    graph.build()
    out = torch.full((b, h, s_q, d), float("nan"), device=device)
    st = torch.full((b, h, s_q, 1), float("nan"), device=device)
    graph.execute({q: q_t, k: k_t, v: v_t, sq: lq.to(device), skv: lkv.to(device), o: out, stats: st})
    # entry 0: 12 queries on 7 keys, bottom-right causal: rows 0..4 see nothing; entry 1: rows 6.. are padding
    gold, gold_lse = attention_reference(q_t.cpu(), k_t.cpu(), v_t.cpu(), attn_scale=0.5, causal=True,
                                         causal_alignment="bottom_right", seq_len_q=lq.view(b), seq_len_kv=lkv.view(b))
    assert (st[0, :, :5] == NEG_INF).all() and (st[1, :, 6:] == NEG_INF).all(), "Stats of rows with no key: -inf"
    assert_lse_close(st, gold_lse, tol=1e-4, msg="graph Stats")
    assert (out[0, :, :5] == 0).all() and (out[1, :, 6:] == 0).all()
    torch.testing.assert_close(out.cpu().double(), gold, atol=1e-4, rtol=1e-4)
