"""fusedattn.flash_attn: FlashAttention 2.x's public functions over fusedattn.

Every case is checked against a float64 reference written from FlashAttention's documented
semantics (BSHD tensors, bottom-right causal, window_size with -1 unbounded, softcap,
ALiBi as -slope * |i + seqlen_k - seqlen_q - j|, softmax_lse [batch, nheads, seqlen_q] with +inf
on rows with no key), forward and gradients, by FlashAttention's 2x rule. Also: the packed
variants equal the unpacked ones, cache_seqlens counts the cache BEFORE appending, and every
refusal names its argument.
"""
import math

import pytest
import torch

import fusedattn
from fusedattn.flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                  flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from fusedattn.problem import NotSupportedError
from fusedattn.testing import assert_error_within

from conftest import INTERPRET


# ----------------------------------------------------------------------------- reference (FlashAttention semantics)

def fa_reference(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
                 dtype=torch.float64):
    """q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv] -> out [b, sq, h, dv] in dtype, lse [b, h, sq]."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    kf = kf.repeat_interleave(h // hk, dim=2)
    vf = vf.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    diag = i + sk - sq
    if alibi is not None:
        s = s - alibi.to(dtype).reshape(-1, h, 1, 1) * (diag - j).abs().to(dtype)     # [h] or [b, h]
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= diag - left
    if right >= 0:
        keep &= j <= diag + right
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    prob = e / torch.where(l > 0, l, torch.ones_like(l))
    lse = torch.where(l > 0, m + torch.log(torch.where(l > 0, l, torch.ones_like(l))),
                      torch.full_like(l, float("inf")))
    out = torch.einsum("bhqk,bkhd->bqhd", prob, vf)
    return out, lse[..., 0].double()


def check_lse(got, gold):
    assert got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(gold)), "rows with no key must give softmax_lse = +inf"
    fin = ~torch.isinf(gold)
    assert torch.allclose(got[fin].double(), gold[fin], atol=1e-4, rtol=1e-5), (got - gold)[fin].abs().max()


def close(got, gold, base, msg=""):
    assert_error_within(got, gold, base, msg=msg)    # the floor is that of base's (the input's) dtype


# ----------------------------------------------------------------------------- flash_attn_func

DENSE = [
    dict(b=2, sq=17, sk=17, h=4, hk=4, d=32, causal=True),
    dict(b=1, sq=5, sk=23, h=6, hk=2, d=16, causal=True),                             # GQA, bottom-right
    dict(b=2, sq=23, sk=5, h=4, hk=1, d=32, causal=True),                             # MQA, empty rows
    dict(b=2, sq=19, sk=30, h=2, hk=2, d=24, window=(3, 2)),
    dict(b=1, sq=12, sk=20, h=4, hk=2, d=16, window=(4, 0), alibi=True),              # ALiBi, right bound 0
    dict(b=2, sq=16, sk=16, h=4, hk=4, d=32, causal=True, alibi=True, softcap=5.0, scale=0.3),
    dict(b=1, sq=20, sk=33, h=2, hk=1, d=64, dv=32, window=(-1, 3)),
    dict(b=2, sq=9, sk=14, h=2, hk=2, d=16, causal=True, window=(2, 5)),               # causal caps right
    dict(b=1, sq=13, sk=13, h=2, hk=2, d=16, dtype=torch.bfloat16, causal=True, softcap=2.0),
]


def _dense_inputs(c, seed):
    g = torch.Generator().manual_seed(seed)
    dt = c.get("dtype", torch.float32)
    dv = c.get("dv", c["d"])
    q = torch.randn(c["b"], c["sq"], c["h"], c["d"], generator=g).to(dt)
    k = torch.randn(c["b"], c["sk"], c["hk"], c["d"], generator=g).to(dt)
    v = torch.randn(c["b"], c["sk"], c["hk"], dv, generator=g).to(dt)
    do = torch.randn(c["b"], c["sq"], c["h"], dv, generator=g).to(dt)
    slopes = fusedattn.alibi_slopes(c["h"]) * (1 + torch.rand(c["h"], generator=g)) if c.get("alibi") else None
    return q, k, v, do, slopes


@pytest.mark.parametrize("ci", range(len(DENSE)), ids=lambda i: f"case{i}")
def test_func_matches_reference(ci):
    c = DENSE[ci]
    q, k, v, do, slopes = _dense_inputs(c, 100 + ci)
    kw = dict(causal=c.get("causal", False), window_size=c.get("window", (-1, -1)), softcap=c.get("softcap", 0.0),
              softmax_scale=c.get("scale"))
    ref_kw = dict(causal=kw["causal"], window=kw["window_size"], softcap=kw["softcap"], scale=kw["softmax_scale"],
                  alibi=slopes)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse, probs = flash_attn_func(qg, kg, vg, alibi_slopes=slopes, return_attn_probs=True, **kw)
    assert probs is None
    assert out.shape == (c["b"], c["sq"], c["h"], v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == (c["b"], c["h"], c["sq"])
    out.backward(do)

    gold = [t.double().requires_grad_() for t in (q, k, v)]
    base = [t.clone().requires_grad_() for t in (q, k, v)]
    o_gold, lse_gold = fa_reference(*gold, **ref_kw)
    o_base, _ = fa_reference(*base, dtype=q.dtype, **ref_kw)
    o_gold.backward(do.double())
    o_base.backward(do)
    close(out, o_gold, o_base, "out")
    check_lse(lse, lse_gold)
    for name, got, gd, bs in zip("qkv", (qg, kg, vg), gold, base):
        close(got.grad, gd.grad, bs.grad, f"d{name}")
    # the plain call returns the same output alone
    assert torch.equal(flash_attn_func(q, k, v, alibi_slopes=slopes, **kw), out.detach())


def test_func_default_scale_and_bshd_views():
    q, k, v, _, _ = _dense_inputs(dict(b=2, sq=8, sk=8, h=2, hk=2, d=16), 7)
    out = flash_attn_func(q, k, v)
    gold, _ = fa_reference(q, k, v, scale=1 / math.sqrt(16))
    assert torch.allclose(out.double(), gold, atol=1e-5)
    assert out.is_contiguous()                   # BSHD in, BSHD memory out (fusedattn kept the layout)


def test_packed_equal_unpacked():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 11, 3, 4, 16, generator=g, requires_grad=True)
    do = torch.randn(2, 11, 4, 16, generator=g)
    out = flash_attn_qkvpacked_func(qkv, causal=True, window_size=(4, -1))
    out.backward(do)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    ref = flash_attn_func(q, k, v, causal=True, window_size=(4, -1))
    ref.backward(do)
    assert torch.equal(out, ref)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2))

    qq = torch.randn(2, 5, 4, 16, generator=g, requires_grad=True)
    kv = torch.randn(2, 9, 2, 2, 16, generator=g, requires_grad=True)
    do = torch.randn(2, 5, 4, 16, generator=g)
    out, lse, _ = flash_attn_kvpacked_func(qq, kv, causal=True, return_attn_probs=True)
    out.backward(do)
    k, v = (kv.detach()[:, :, i].clone().requires_grad_() for i in range(2))
    q2 = qq.detach().clone().requires_grad_()
    ref, lse_ref, _ = flash_attn_func(q2, k, v, causal=True, return_attn_probs=True)
    ref.backward(do)
    assert torch.equal(out, ref) and torch.equal(lse, lse_ref)
    assert torch.equal(kv.grad, torch.stack([k.grad, v.grad], dim=2)) and torch.equal(qq.grad, q2.grad)


def test_dropout_reproducible_and_differentiable():
    q, k, v, do, _ = _dense_inputs(dict(b=1, sq=16, sk=16, h=2, hk=2, d=16), 11)
    qg = q.clone().requires_grad_()
    torch.manual_seed(5)
    a = flash_attn_func(qg, k, v, dropout_p=0.3, causal=True)
    a.backward(do)
    torch.manual_seed(5)
    b = flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    torch.manual_seed(5)      # the same seed draw as fusedattn.attention's
    c = fusedattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                            causal_alignment="bottom_right", dropout_p=0.3).transpose(1, 2)
    assert torch.equal(a.detach(), b) and torch.equal(b, c)
    assert not torch.allclose(b, flash_attn_func(q, k, v, causal=True))
    assert torch.isfinite(qg.grad).all() and qg.grad.abs().sum() > 0


@pytest.mark.skipif(not INTERPRET, reason="Triton interpreter off (TRITON_INTERPRET unset)")
def test_func_triton_interpreter():
    c = dict(b=1, sq=16, sk=24, h=2, hk=1, d=16, causal=True)
    q, k, v, _, _ = _dense_inputs(c, 21)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, backend="triton")
    gold, lse_gold = fa_reference(q, k, v, causal=True)
    base, _ = fa_reference(q, k, v, causal=True, dtype=torch.float32)
    close(out, gold, base)
    check_lse(lse, lse_gold)


# ----------------------------------------------------------------------------- varlen

VARLEN = [
    dict(lq=[5, 1, 12], lk=[5, 1, 12], h=4, hk=2, d=16, causal=True),
    dict(lq=[3, 7, 0, 4], lk=[9, 2, 5, 4], h=2, hk=2, d=32, causal=True),             # empty rows, empty sequence
    dict(lq=[6, 10], lk=[8, 10], h=4, hk=4, d=16, window=(2, 1), softcap=3.0),
    dict(lq=[4, 9], lk=[7, 9], h=4, hk=1, d=16, causal=True, alibi=True, scale=0.5),
]


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


@pytest.mark.parametrize("ci", range(len(VARLEN)), ids=lambda i: f"case{i}")
def test_varlen_matches_reference(ci):
    c = VARLEN[ci]
    g = torch.Generator().manual_seed(200 + ci)
    tq, tk = sum(c["lq"]), sum(c["lk"])
    q = torch.randn(tq, c["h"], c["d"], generator=g)
    k = torch.randn(tk, c["hk"], c["d"], generator=g)
    v = torch.randn(tk, c["hk"], c["d"], generator=g)
    do = torch.randn(tq, c["h"], c["d"], generator=g)
    slopes = fusedattn.alibi_slopes(c["h"]) if c.get("alibi") else None
    kw = dict(causal=c.get("causal", False), window_size=c.get("window", (-1, -1)), softcap=c.get("softcap", 0.0),
              softmax_scale=c.get("scale"), alibi_slopes=slopes)
    cq, ck = _cu(c["lq"]), _cu(c["lk"])
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse, probs = flash_attn_varlen_func(qg, kg, vg, cq, ck, max(c["lq"]), max(c["lk"]), return_attn_probs=True,
                                             **kw)
    assert probs is None and out.shape == (tq, c["h"], c["d"]) and lse.shape == (c["h"], tq)
    out.backward(do)
    ref_kw = dict(causal=kw["causal"], window=kw["window_size"], softcap=kw["softcap"], scale=kw["softmax_scale"],
                  alibi=slopes)
    for i in range(len(c["lq"])):
        sq_, sk_ = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        if sq_.stop == sq_.start:
            continue
        parts = [t[sl].unsqueeze(0) for t, sl in ((q, sq_), (k, sk_), (v, sk_))]
        gold = [t.double().requires_grad_() for t in parts]
        base = [t.clone().requires_grad_() for t in parts]
        o_gold, lse_gold = fa_reference(*gold, **ref_kw)
        o_base, _ = fa_reference(*base, dtype=torch.float32, **ref_kw)
        o_gold.backward(do[sq_].unsqueeze(0).double())
        o_base.backward(do[sq_].unsqueeze(0))
        close(out[sq_], o_gold[0], o_base[0], f"out seq {i}")
        check_lse(lse[:, sq_], lse_gold[0])
        close(qg.grad[sq_], gold[0].grad[0], base[0].grad[0], f"dq seq {i}")
        if sk_.stop > sk_.start:
            close(kg.grad[sk_], gold[1].grad[0], base[1].grad[0], f"dk seq {i}")
            close(vg.grad[sk_], gold[2].grad[0], base[2].grad[0], f"dv seq {i}")


def test_varlen_packed_equal_unpacked():
    g = torch.Generator().manual_seed(9)
    cu = _cu([4, 9, 2])
    qkv = torch.randn(15, 3, 2, 16, generator=g, requires_grad=True)
    do = torch.randn(15, 2, 16, generator=g)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 9, causal=True)
    out.backward(do)
    q, k, v = (qkv.detach()[:, i].clone().requires_grad_() for i in range(3))
    ref = flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True)
    ref.backward(do)
    assert torch.equal(out, ref) and torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=1))

    cq, ck = _cu([2, 5]), _cu([6, 5])
    qq = torch.randn(7, 4, 16, generator=g, requires_grad=True)
    kv = torch.randn(11, 2, 2, 16, generator=g, requires_grad=True)
    do = torch.randn(7, 4, 16, generator=g)
    out = flash_attn_varlen_kvpacked_func(qq, kv, cq, ck, 5, 6, causal=True)
    out.backward(do)
    k, v = (kv.detach()[:, i].clone().requires_grad_() for i in range(2))
    q2 = qq.detach().clone().requires_grad_()
    ref = flash_attn_varlen_func(q2, k, v, cq, ck, 5, 6, causal=True)
    ref.backward(do)
    assert torch.equal(out, ref) and torch.equal(kv.grad, torch.stack([k.grad, v.grad], dim=1))
    assert torch.equal(qq.grad, q2.grad)


# ----------------------------------------------------------------------------- with_kvcache

def _cache_reference(q, k_dense, v_dense, lens_after, **kw):
    """Per sequence: q [b, sq, h, d] against the first lens_after[i] keys of dense caches [b, s, hk, d]."""
    outs, lses = [], []
    for i in range(q.shape[0]):
        n = int(lens_after[i])
        o, l = fa_reference(q[i:i + 1], k_dense[i:i + 1, :n], v_dense[i:i + 1, :n], **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def _rotary_reference(x, cos, sin, pos, interleaved):
    """Rotary in float64 from the definition (x [b, s, h, d], pos [b, s])."""
    rd = 2 * cos.shape[1]
    out = x.double().clone()
    for bi in range(x.shape[0]):
        for t in range(x.shape[1]):
            c, s = cos[pos[bi, t]].double(), sin[pos[bi, t]].double()
            for p in range(rd // 2):
                a, b_ = (2 * p, 2 * p + 1) if interleaved else (p, p + rd // 2)
                x1, x2 = out[bi, t, :, a].clone(), out[bi, t, :, b_].clone()
                out[bi, t, :, a] = x1 * c[p] - x2 * s[p]
                out[bi, t, :, b_] = x1 * s[p] + x2 * c[p]
    return out


KVC = [
    dict(name="decode", b=3, sq=1, snew=1, h=4, hk=2, d=16, smax=24, lens=[5, 0, 20], causal=True),
    dict(name="noappend", b=2, sq=3, snew=0, h=4, hk=1, d=32, smax=16, lens=[10, 3], causal=True),
    dict(name="window", b=2, sq=2, snew=2, h=2, hk=2, d=16, smax=20, lens=[7, 12], window=(3, 0)),
    dict(name="paged", b=2, sq=2, snew=2, h=4, hk=2, d=16, smax=0, lens=[9, 17], causal=True, page=8),
    dict(name="batchidx", b=2, sq=1, snew=1, h=2, hk=2, d=16, smax=12, lens=[4, 9], causal=True, batch_idx=[2, 0]),
    dict(name="snew_ne_sq", b=2, sq=1, snew=3, h=2, hk=2, d=16, smax=16, lens=[2, 6], causal=True),
    dict(name="alibi_softcap", b=2, sq=2, snew=2, h=4, hk=2, d=16, smax=20, lens=[3, 10], causal=True, alibi=True,
         softcap=4.0),
    dict(name="rotary_inter", b=2, sq=2, snew=2, h=2, hk=1, d=32, smax=16, lens=[3, 8], causal=True, rotary=16,
         interleaved=True),
    dict(name="rotary_neox_noncausal", b=2, sq=2, snew=2, h=2, hk=1, d=32, smax=16, lens=[3, 8], rotary=32,
         interleaved=False),
    dict(name="nolens", b=2, sq=2, snew=0, h=2, hk=2, d=16, smax=9, lens=None, causal=False),
]


@pytest.mark.parametrize("c", KVC, ids=lambda c: c["name"])
def test_kvcache_matches_reference(c):
    g = torch.Generator().manual_seed(hash(c["name"]) % 1000)
    b, sq, snew, h, hk, d = c["b"], c["sq"], c["snew"], c["h"], c["hk"], c["d"]
    lens = torch.tensor(c["lens"], dtype=torch.int32) if c["lens"] is not None else None
    q = torch.randn(b, sq, h, d, generator=g)
    k_new = torch.randn(b, snew, hk, d, generator=g) if snew else None
    v_new = torch.randn(b, snew, hk, d, generator=g) if snew else None
    slopes = fusedattn.alibi_slopes(h) if c.get("alibi") else None
    cos = sin = None
    if c.get("rotary"):
        ang = torch.rand(64, c["rotary"] // 2, generator=g) * 6.28
        cos, sin = ang.cos(), ang.sin()
    kw = dict(causal=c.get("causal", False), window_size=c.get("window", (-1, -1)), softcap=c.get("softcap", 0.0),
              alibi_slopes=slopes)

    page, bidx, table = c.get("page"), c.get("batch_idx"), None
    if page:
        n_blocks, per_seq = 7, 3
        k_cache = torch.randn(n_blocks, page, hk, d, generator=g)
        v_cache = torch.randn(n_blocks, page, hk, d, generator=g)
        table = torch.randperm(n_blocks, generator=g)[: b * per_seq].view(b, per_seq).to(torch.int32)
        dense = lambda cache: cache[table.long()].reshape(b, per_seq * page, hk, d)  # noqa: E731
    else:
        rows = b + 1 if bidx else b
        k_cache = torch.randn(rows, c["smax"], hk, d, generator=g)
        v_cache = torch.randn(rows, c["smax"], hk, d, generator=g)
        sel = torch.tensor(bidx) if bidx else torch.arange(b)
        dense = lambda cache: cache[sel]  # noqa: E731
    k_before, v_before = dense(k_cache).clone(), dense(v_cache).clone()

    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=lens, cache_batch_idx=torch.tensor(bidx, dtype=torch.int32) if bidx else None,
        block_table=table, rotary_interleaved=c.get("interleaved", True), return_softmax_lse=True, num_splits=3,
        **kw)
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq)

    # the expected cache after the append: k/v (rotated) at cache_seqlens .. cache_seqlens + snew - 1
    q_ref = q.double()
    k_exp, v_exp = k_before.double(), v_before.double()
    if snew:
        pos_k = lens.long()[:, None] + torch.arange(snew)[None, :]
        kn = k_new.double()
        if cos is not None:
            kn = _rotary_reference(k_new, cos, sin, pos_k, c["interleaved"])
            pos_q = lens.long()[:, None] + (torch.arange(sq)[None, :] if (kw["causal"] or kw["window_size"] != (-1, -1))
                                            else torch.zeros(1, sq, dtype=torch.long))
            q_ref = _rotary_reference(q, cos, sin, pos_q, c["interleaved"])
        for i in range(b):
            n = int(lens[i])
            k_exp[i, n:n + snew] = kn[i]
            v_exp[i, n:n + snew] = v_new[i].double()
        assert torch.allclose(dense(k_cache).double(), k_exp, atol=1e-6), "k appended at cache_seqlens (before)"
        assert torch.equal(dense(v_cache).double(), v_exp), "v appended at cache_seqlens (before)"
    lens_after = (lens + snew) if lens is not None else torch.full((b,), k_exp.shape[1])
    ref_kw = dict(causal=kw["causal"], window=kw["window_size"], softcap=kw["softcap"], alibi=slopes)
    gold, lse_gold = _cache_reference(q_ref, k_exp, v_exp, lens_after, **ref_kw)
    base, _ = _cache_reference(q_ref.float(), k_exp.float(), v_exp.float(), lens_after, dtype=torch.float32, **ref_kw)
    close(out, gold, base)
    check_lse(lse, lse_gold)


def test_kvcache_int_seqlens_and_plain_return():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 1, 2, 16, generator=g)
    kc, vc = torch.randn(2, 10, 2, 16, generator=g), torch.randn(2, 10, 2, 16, generator=g)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=6, causal=True)
    gold, _ = _cache_reference(q.double(), kc.double(), vc.double(), [6, 6], causal=True)
    assert torch.allclose(out.double(), gold, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="Triton interpreter off (TRITON_INTERPRET unset)")
def test_kvcache_triton_interpreter():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 4, 16, generator=g)
    kc, vc = torch.randn(2, 12, 2, 16, generator=g), torch.randn(2, 12, 2, 16, generator=g)
    kn, vn = torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True, backend="triton")
    assert torch.equal(kc[0, 3], kn[0, 0]) and torch.equal(vc[1, 9], vn[1, 0])
    gold, _ = _cache_reference(q.double(), kc.double(), vc.double(), lens + 1, causal=True)
    base, _ = _cache_reference(q, kc, vc, lens + 1, causal=True, dtype=torch.float32)
    close(out, gold, base)


# ----------------------------------------------------------------------------- with_kvcache: cache_leftpad

LEFTPAD = [
    dict(name="append", b=3, sq=2, snew=2, smax=20, lens=[9, 4, 13], lp=[3, 0, 12], causal=True),
    dict(name="snew_ne_sq_window", b=2, sq=1, snew=3, smax=16, lens=[6, 10], lp=[2, 5], window=(8, 0)),
    dict(name="noappend_alibi", b=2, sq=3, snew=0, smax=24, lens=[16, 20], lp=[8, 4], causal=True, alibi=True),
    dict(name="batchidx", b=2, sq=1, snew=1, smax=12, lens=[7, 3], lp=[6, 1], causal=True, batch_idx=[2, 0]),
    dict(name="paged", b=2, sq=2, snew=2, smax=0, lens=[13, 6], lp=[5, 4], causal=True, page=4),
    dict(name="rotary", b=2, sq=2, snew=2, smax=16, lens=[5, 9], lp=[1, 3], causal=True, rotary=16),
    dict(name="aligned_pages", b=2, sq=2, snew=0, smax=16, lens=[12, 16], lp=[4, 8], causal=False),
    dict(name="no_validate", b=2, sq=2, snew=2, smax=16, lens=[7, 11], lp=[5, 2], causal=True, validate=False),
]


@pytest.mark.parametrize("c", LEFTPAD, ids=lambda c: c["name"])
def test_kvcache_leftpad(c, target):
    """cache_leftpad (FlashAttention's semantics, its test's reference): sequence i attends to cache slots
    cache_leftpad[i] .. cache_seqlens[i] + seqlen_new - 1 re-indexed from 0 (causal / window / ALiBi around
    that sequence's own diagonal); k/v are appended at cache_seqlens and rotated at absolute positions."""
    device, backend = target
    seed = sum(map(ord, c["name"]))
    g = torch.Generator().manual_seed(seed)
    b, sq, snew, h, hk, d = c["b"], c["sq"], c["snew"], 4, 2, 32
    lens = torch.tensor(c["lens"], dtype=torch.int32)
    lp = torch.tensor(c["lp"], dtype=torch.int32)
    q = torch.randn(b, sq, h, d, generator=g)
    kn = torch.randn(b, snew, hk, d, generator=g) if snew else None
    vn = torch.randn(b, snew, hk, d, generator=g) if snew else None
    slopes = fusedattn.alibi_slopes(h) if c.get("alibi") else None
    cos = sin = None
    if c.get("rotary"):
        ang = torch.rand(64, c["rotary"] // 2, generator=g) * 6.28
        cos, sin = ang.cos(), ang.sin()
    page, bidx, table = c.get("page"), c.get("batch_idx"), None
    if page:
        n_blocks, per_seq = 11, 4
        kc, vc = (torch.randn(n_blocks, page, hk, d, generator=g) for _ in range(2))
        table = torch.randperm(n_blocks, generator=g)[: b * per_seq].view(b, per_seq).to(torch.int32)
        dense = lambda cache: cache[table.long()].reshape(b, per_seq * page, hk, d)  # noqa: E731
    else:
        kc, vc = (torch.randn(b + 1 if bidx else b, c["smax"], hk, d, generator=g) for _ in range(2))
        sel = torch.tensor(bidx) if bidx else torch.arange(b)
        dense = lambda cache: cache[sel]  # noqa: E731
    k_exp, v_exp = dense(kc).double(), dense(vc).double()
    q_ref = q.double()
    if snew:
        pos_k = lens.long()[:, None] + torch.arange(snew)[None, :]          # absolute positions
        kr = _rotary_reference(kn, cos, sin, pos_k, True) if cos is not None else kn.double()
        if cos is not None:
            q_ref = _rotary_reference(q, cos, sin, lens.long()[:, None] + torch.arange(sq)[None, :], True)
        for i in range(b):
            k_exp[i, lens[i]:lens[i] + snew] = kr[i]
            v_exp[i, lens[i]:lens[i] + snew] = vn[i].double()
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    kc, vc = kc.to(device), vc.to(device)
    out, lse = flash_attn_with_kvcache(
        to(q), kc, vc, k=to(kn), v=to(vn), rotary_cos=to(cos), rotary_sin=to(sin), cache_seqlens=to(lens),
        cache_batch_idx=to(torch.tensor(bidx, dtype=torch.int32)) if bidx else None, cache_leftpad=to(lp),
        block_table=to(table), causal=c.get("causal", False), window_size=c.get("window", (-1, -1)),
        alibi_slopes=to(slopes), return_softmax_lse=True, backend=backend, validate=c.get("validate", True))
    if snew:
        assert torch.allclose(dense(kc.cpu()).double(), k_exp, atol=1e-6), "k appended at cache_seqlens (absolute)"
        assert torch.equal(dense(vc.cpu()).double(), v_exp), "v appended at cache_seqlens (absolute)"
    ref_kw = dict(causal=c.get("causal", False), window=c.get("window", (-1, -1)), alibi=slopes)
    for i in range(b):
        keys = slice(int(lp[i]), int(lens[i]) + snew)                     # FlashAttention's key_padding_mask
        gold, lse_gold = fa_reference(q_ref[i:i + 1], k_exp[i:i + 1, keys], v_exp[i:i + 1, keys], **ref_kw)
        base, _ = fa_reference(q_ref[i:i + 1].float(), k_exp[i:i + 1, keys].float(), v_exp[i:i + 1, keys].float(),
                               dtype=torch.float32, **ref_kw)
        close(out[i:i + 1].cpu(), gold, base, msg=f"sequence {i}; repro: pytest -k 'leftpad and {c['name']}'")
        check_lse(lse[i:i + 1].cpu(), lse_gold)
    # the option matters: without the pad the padded keys would count too (each case's pads reach its band)
    ref_nopad, _ = fa_reference(q_ref[:1], k_exp[:1, : int(lens[0]) + snew], v_exp[:1, : int(lens[0]) + snew],
                                **ref_kw)
    assert not torch.allclose(out[:1].cpu().double(), ref_nopad, atol=1e-3), "cache_leftpad changed nothing"


def test_kvcache_leftpad_bad_block_table():
    q = torch.randn(1, 1, 2, 16)
    pages = torch.randn(4, 4, 2, 16)
    bt = torch.tensor([[0, 9, 1]], dtype=torch.int32)             # block 9 holds keys 4..7, read from slot 5 on
    with pytest.raises(ValueError, match=r"block_table\[0\] names block 9, out of range of the 4 blocks"):
        flash_attn_with_kvcache(q, pages, pages, cache_seqlens=7, cache_leftpad=torch.tensor([5], dtype=torch.int32),
                                block_table=bt)
    out = flash_attn_with_kvcache(q, pages, pages, cache_seqlens=3, block_table=bt,
                                  cache_leftpad=torch.tensor([1], dtype=torch.int32))   # keys 1..2: block 0 only
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- item 4 leftovers

def test_cu_seqlens_dtype_per_door():
    """FlashAttention's door requires int32 offsets (as FlashAttention asserts); the functional door
    attention_varlen also takes int64 (torch.cumsum's dtype), converts it, and checks its values first."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(9, 2, 16, generator=g) for _ in range(3))
    cu = _cu([4, 5])
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 tensor"):
        flash_attn_varlen_func(q, k, v, cu.long(), cu, 5, 5)
    out32 = fusedattn.attention_varlen(q, k, v, cu, cu, 5, 5, causal=True)
    out64 = fusedattn.attention_varlen(q, k, v, cu.long(), cu.long(), 5, 5, causal=True)
    assert torch.equal(out32, out64)
    wraps = torch.tensor([0, 4, 2 ** 32 + 9], dtype=torch.int64)      # would wrap to 9 in int32
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 4294967305 exceeds the 9 rows"):
        fusedattn.attention_varlen(q, k, v, wraps, cu, 5, 5)


def test_fa_lse_marks_kernel_empty_rows():
    """A row the kernels leave empty (lse = -inf, issue 24) that the geometry does not predict still gets
    FlashAttention's +inf, ALiBi's shift included; finite rows keep their value."""
    from fusedattn.flash_attn import _fa_lse
    lse = torch.tensor([[[0.5, float("-inf"), 1.0]]])                     # [b=1, h=1, rows=3]
    geometry = torch.tensor([[[False, False, True]]])
    got = _fa_lse(lse, geometry, None, torch.zeros(1, 1, 3))
    assert got.tolist() == [[[0.5, float("inf"), float("inf")]]]
    got = _fa_lse(lse, geometry, torch.tensor([0.25]), torch.tensor([[[4, 4, 4]]]))
    assert got.tolist() == [[[-0.5, float("inf"), float("inf")]]]


def test_fa_lse_never_minus_inf_end_to_end():
    """Every door returns +inf, never -inf, for rows without keys: cache rows with no key at all
    (cache_seqlens = 0), varlen sequences with no key, bottom-right rows above the diagonal."""
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 3, 2, 16, generator=g)
    kc = torch.randn(2, 8, 2, 16, generator=g)
    _, lse = flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([0, 2], dtype=torch.int32), causal=True,
                                     return_softmax_lse=True)
    assert (lse[0] == float("inf")).all() and (lse[1, :, 0] == float("inf")).all() and torch.isfinite(lse[1, :, 2]).all()
    qv, kv = torch.randn(5, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
    _, lse, _ = flash_attn_varlen_func(qv, kv, kv, _cu([2, 3]), _cu([0, 4]), 3, 4, causal=True,
                                       return_attn_probs=True)
    assert not (lse == float("-inf")).any() and (lse[:, :2] == float("inf")).all()


# ----------------------------------------------------------------------------- refusals

def _qkv(d=16, sq=4, sk=4):
    return torch.randn(1, sq, 2, d), torch.randn(1, sk, 2, d), torch.randn(1, sk, 2, d)


def test_refusals_name_the_argument():
    q, k, v = _qkv(d=260)
    with pytest.raises(NotSupportedError, match="headdim 260: fusedattn supports any head dim from 1 to 256"):
        flash_attn_func(q, k, v)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \[nheads\] = \[2\] or \[batch_size"):
        flash_attn_func(q, k, v, causal=True, alibi_slopes=torch.ones(3, 2))
    with pytest.raises(NotSupportedError, match="alibi_slopes without causal"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(2))
    with pytest.raises(NotSupportedError, match="alibi_slopes without causal"):
        flash_attn_func(q, k, v, window_size=(2, 1), alibi_slopes=torch.ones(2))
    cu = _cu([4])
    with pytest.raises(TypeError, match="cu_seqlens_k must be an int32 tensor"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, cu.long(), 4, 4)
    kc, vc = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match=r"cache_leftpad must be an int32 tensor \(batch_size,\) = \(1,\)"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2, cache_leftpad=torch.ones(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"cache_leftpad\[0\] = 3 must be in \[0, cache_seqlens\[0\]\] = \[0, 2\]"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2, cache_leftpad=torch.full((1,), 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="rotary_cos/rotary_sin need the new k"):
        flash_attn_with_kvcache(q, kc, vc, rotary_cos=torch.ones(8, 4), rotary_sin=torch.zeros(8, 4),
                                cache_seqlens=2)
    with pytest.raises(ValueError, match="need cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, k=k, v=v)
    with pytest.raises(NotSupportedError, match="cache_batch_idx together with block_table"):
        flash_attn_with_kvcache(q, kc, vc, cache_batch_idx=torch.zeros(1, dtype=torch.int32),
                                block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, k, v, window_size=3)
    assert issubclass(NotSupportedError, NotImplementedError)


# ----------------------------------------------------------------------------- issue 25 item 2: head dims, [b, h] ALiBi,
# paged varlen; item 4: bad metadata

@pytest.mark.parametrize("d,d_v", [(59, 59), (111, 40), (3, 3)], ids=lambda x: str(x))
def test_any_headdim_and_batch_alibi(d, d_v, target):
    """Head dims FlashAttention pads inside (59, 111, 3; headdim_v != headdim), with alibi_slopes
    [batch_size, nheads], causal: out, softmax_lse and gradients against FlashAttention's semantics."""
    device, backend = target
    dtype = torch.float16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(d)
    q = torch.randn(2, 9, 4, d, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(2, 13, 2, d, generator=gen).to(device, dtype).requires_grad_()
    v = torch.randn(2, 13, 2, d_v, generator=gen).to(device, dtype).requires_grad_()
    slopes = torch.rand(2, 4, generator=gen).to(device)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True, backend=backend)
    do = torch.randn(out.shape, generator=gen).to(device, dtype)
    out.backward(do)
    res = []
    for dt in (torch.float64, dtype):
        rq, rk, rv = (t.detach().cpu().to(dt).requires_grad_() for t in (q, k, v))
        ro, rl = fa_reference(rq, rk, rv, causal=True, alibi=slopes.cpu(), dtype=dt)
        ro.backward(do.cpu().to(dt))
        res.append((ro, rq.grad, rk.grad, rv.grad, rl))
    for name, g, gold, base in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), res[0], res[1]):
        close(g.cpu(), gold, base, msg=f"{name}, repro: d={d} d_v={d_v} target={target}")
    check_lse(lse.cpu(), res[0][4])


def test_varlen_with_block_table(target):
    """flash_attn_varlen_func over paged caches (key counts from cu_seqlens_k), forward, causal, each sequence
    against FlashAttention's semantics on its gathered keys."""
    device, backend = target
    dtype = torch.float16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(4)
    lq, lk, page = [3, 1, 7], [20, 5, 31], 8
    kc = torch.randn(14, page, 2, 40, generator=gen).to(device, dtype)
    vc = torch.randn(14, page, 2, 40, generator=gen).to(device, dtype)
    table = torch.randperm(14, generator=gen)[:12].view(3, 4).to(device, torch.int32)
    q = torch.randn(sum(lq), 4, 40, generator=gen).to(device, dtype)
    cq, ck = _cu(lq).to(device), _cu(lk).to(device)
    with torch.no_grad():
        out, lse, _ = flash_attn_varlen_func(q, kc, vc, cq, ck, max(lq), max(lk), causal=True, block_table=table,
                                             return_attn_probs=True, backend=backend)
    assert out.shape == (sum(lq), 4, 40) and lse.shape == (4, sum(lq))
    row = 0
    for i in range(3):
        k = torch.cat([kc[j] for j in table[i].tolist()])[:lk[i]].cpu()[None]
        v = torch.cat([vc[j] for j in table[i].tolist()])[:lk[i]].cpu()[None]
        qi = q[row:row + lq[i]].cpu()[None]
        gold, gl = fa_reference(qi, k, v, causal=True)
        base, _ = fa_reference(qi, k, v, causal=True, dtype=dtype)
        close(out[row:row + lq[i]].cpu()[None], gold, base, msg=f"sequence {i}, target={target}")
        check_lse(lse[:, row:row + lq[i]].cpu()[None], gl)
        row += lq[i]
    with pytest.raises(NotSupportedError, match="dropout_p > 0 with block_table"):
        flash_attn_varlen_func(q, kc, vc, cq, ck, max(lq), max(lk), dropout_p=0.1, block_table=table, backend=backend)


def test_bad_cache_metadata_names_the_argument(target):
    """Item 4: out-of-range block-table entries, cache_seqlens past the capacity, repeated cache_batch_idx when
    appending, non-int32 or decreasing cu_seqlens: clear errors (validate=True by default)."""
    device, backend = target
    q = torch.randn(2, 1, 2, 16, device=device)
    kn = torch.randn(2, 1, 2, 16, device=device)
    kc, vc = torch.randn(2, 8, 2, 16, device=device), torch.randn(2, 8, 2, 16, device=device)
    pages, pv = torch.randn(4, 4, 2, 16, device=device), torch.randn(4, 4, 2, 16, device=device)
    bt = torch.tensor([[0, 9], [1, 2]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 9 is out of range"):
        flash_attn_with_kvcache(q, pages, pv, cache_seqlens=6, block_table=bt, backend=backend)
    with pytest.raises(ValueError, match=r"seq_len_kv\[0\] = 9 is beyond the cache"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([9, 1], dtype=torch.int32, device=device),
                                backend=backend)
    same = torch.tensor([1, 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[0\] = cache_batch_idx\[1\] = 1"):
        flash_attn_with_kvcache(q, kc, vc, k=kn, v=kn, cache_seqlens=2, cache_batch_idx=same, backend=backend)
    q1 = q[:1].expand(2, -1, -1, -1)          # one query, read twice through the same cache row: allowed
    out = flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=2, cache_batch_idx=same, backend=backend)
    assert torch.equal(out[0], out[1])
    qv = torch.randn(6, 2, 16, device=device)
    bad = torch.tensor([0, 4, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_attn_varlen_func(qv, qv, qv, bad, bad, 4, 4, backend=backend)
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_attn_varlen_func(qv, pages, pv, bad, _cu([3, 3]).to(device), 4, 6, block_table=bt,
                               backend=backend)
    good = _cu([3, 3]).to(device)
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 9 is out of range"):
        flash_attn_varlen_func(qv, pages, pv, good, _cu([6, 3]).to(device), 3, 6, block_table=bt,
                               backend=backend)
