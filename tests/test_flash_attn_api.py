"""fusedattn.flash_attn: FlashAttention 2.x's public functions over fusedattn.

Every case is checked against a float64 reference written from FlashAttention's documented
semantics (BSHD tensors, bottom-right causal, window_size with -1 unbounded, softcap,
ALiBi as -slope * |i + seqlen_k - seqlen_q - j|, softmax_lse [batch, nheads, seqlen_q] with +inf
on rows with no key), forward and gradients, by FlashAttention's 2x rule. Also: the packed
variants equal the unpacked ones, cache_seqlens counts the cache BEFORE appending, and every
refusal names its argument.
"""
import contextlib
import math
import os
import sys

import pytest
import torch

import fusedattn
from fusedattn.flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                  flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from fusedattn.problem import NotSupportedError
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within

from conftest import INTERPRET, target_id


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


def check_lse(got, gold, msg=""):
    assert got.dtype == torch.float32, msg
    assert torch.equal(torch.isinf(got), torch.isinf(gold)), f"rows with no key must give softmax_lse = +inf. {msg}"
    fin = ~torch.isinf(gold)
    assert torch.allclose(got[fin].double(), gold[fin], atol=1e-4, rtol=1e-5), \
        f"softmax_lse off by {(got - gold)[fin].abs().max():.3e}. {msg}"


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
        if n == 0:          # an empty cache: FlashAttention writes 0 and softmax_lse +inf
            dt = kw.get("dtype", torch.float64)
            outs.append(torch.zeros(1, q.shape[1], q.shape[2], v_dense.shape[-1], dtype=dt))
            lses.append(torch.full((1, q.shape[2], q.shape[1]), float("inf"), dtype=torch.float64))
            continue
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


def _drawn_kvc(seed):
    """A random KVC entry: contiguous or paged caches, cache_batch_idx, appends of snew tokens (snew may differ from
    sq, or be 0), cache_seqlens up to the capacity left, causal / window, softcap, ALiBi (where the door takes it),
    rotary (interleaved or not, part or all of d) on appends, odd head dims."""
    import random
    rng = random.Random(4100 + seed)
    hk = rng.choice([1, 2])
    c = dict(name=f"drawn{seed}", b=rng.choice([1, 2, 3]), sq=rng.choice([1, 2, 3]), h=hk * rng.choice([1, 2]), hk=hk,
             d=rng.choice([16, 24, 32]))
    c["snew"] = rng.choice([0, c["sq"], 1, 3])
    if rng.random() < 0.35:
        c.update(page=rng.choice([4, 8]), smax=0)
        capacity = 3 * c["page"]             # the test's three pages per sequence
    else:
        c["smax"] = capacity = rng.choice([8, 16, 24])
        if rng.random() < 0.3:
            c["batch_idx"] = rng.sample(range(c["b"] + 1), c["b"])
    c["lens"] = [rng.randint(0, capacity - c["snew"]) for _ in range(c["b"])]
    if c["snew"] == 0 and "page" not in c and rng.random() < 0.2:
        c["lens"] = None
    r = rng.random()
    if r < 0.5:
        c["causal"] = True
    elif r < 0.75:
        c["window"] = (rng.choice([-1, 3]), rng.choice([-1, 0]))
    if rng.random() < 0.25:
        c["softcap"] = 4.0
    if rng.random() < 0.25 and (c.get("causal") or c.get("window", (-1, -1))[1] == 0):
        c["alibi"] = True
    if c["snew"] and rng.random() < 0.35:
        c.update(rotary=rng.choice([16, c["d"] - c["d"] % 4]), interleaved=rng.random() < 0.5)
    return c


# FUSEDATTN_FUZZ_SEEDS=N draws N cases (``_drawn_kvc``) beside the named ones; CI draws 16
KVC_DRAWN = [_drawn_kvc(i) for i in range(int(os.environ.get("FUSEDATTN_FUZZ_SEEDS", "16")))]


@pytest.mark.parametrize("c", KVC + KVC_DRAWN, ids=lambda c: c["name"])
def test_kvcache_matches_reference(c):
    _check_kvcache_case(c, "auto")


@pytest.mark.parametrize("c", KVC_DRAWN[:8], ids=lambda c: c["name"])
def test_kvcache_drawn_on_the_kernels(c, target):
    """The first drawn cases on every target (the Triton kernels under the interpreter, and on the GPU)."""
    device, backend = target
    if device == "cuda":
        pytest.skip("the drawn cache cases build CPU caches (the GPU's are tests/test_kvcache_combinations.py's)")
    _check_kvcache_case(c, backend)


def _check_kvcache_case(c, backend):
    """One KVC case through flash_attn_with_kvcache on CPU tensors: the appended caches (rotated k at
    cache_seqlens before the append) and the output and softmax_lse against float64, FlashAttention's rule."""
    # a seed from the name's bytes (hash() of a str changes with every process: the case would too)
    g = torch.Generator().manual_seed(sum(c["name"].encode()) * 7 % 1000)
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
        per_seq = 3
        n_blocks = max(7, b * per_seq + 1)
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
        backend=backend, **kw)
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
    # a mistyped scale or flag is refused by its FlashAttention name, not converted (float("x"), bool("no"))
    with pytest.raises(TypeError, match=r"softmax_scale must be a float, got 'x'"):
        flash_attn_func(q, k, v, softmax_scale="x")
    with pytest.raises(TypeError, match=r"causal must be a bool, got 'no'"):
        flash_attn_func(q, k, v, causal="no")
    with pytest.raises(TypeError, match=r"causal must be a bool, got 'no'"):
        flash_attn_with_kvcache(q, torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16), cache_seqlens=4, causal="no")
    with pytest.raises(ValueError, match=r"softmax_scale must be finite and > 0, got -1.0"):
        flash_attn_func(q, k, v, softmax_scale=-1)
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


# ----------------------------------------------------------------------------- review: supported paths without a test
# varlen dropout; [batch_size, nheads] ALiBi and softmax_scale on the caches; window / softcap / ALiBi on paged
# varlen; learnable_sink on varlen and with_kvcache; deterministic; the packed functions' returns and options;
# the remaining refusals; validate=False reading nothing back to the host.


def _repro(test, target=None, case=None):
    """The one-line command that reruns one case of a test."""
    words = [test] + [w for w in (case, target_id(target) if target else None) if w]
    return f"repro: pytest tests/test_flash_attn_api.py -k '{' and '.join(words)}'"


def _target_dtype(device):
    return torch.float16 if device == "cuda" else torch.float32      # as the file's other target tests


def _offsets(lens):
    return [0] + torch.tensor(lens).cumsum(0).tolist()


def _reference_pair(q, k, v, dtype, do=None, **ref_kw):
    """fa_reference on CPU copies of q [1, sq, h, d], k, v: float64 (gold) and dtype (base, PyTorch's
    same-precision error), each ``(out, lse, (dq, dk, dv) or None)``; gradients when ``do`` is given."""
    res = []
    for dt in (torch.float64, dtype):
        leaves = [t.detach().cpu().to(dt).requires_grad_(do is not None) for t in (q, k, v)]
        out, lse = fa_reference(*leaves, dtype=dt, **ref_kw)
        grads = torch.autograd.grad(out, leaves, do.cpu().to(dt)) if do is not None else None
        res.append((out.detach(), lse, grads))
    return res


def _sink_reference_pair(q, k, v, sink, dtype, do=None, **ref_kw):
    """fusedattn.reference.attention_reference(sink=) with bottom-right causal (FlashAttention's) on CPU copies
    of BSHD q [1, sq, h, d], k, v and sink [h] (as tests/test_sinks.py builds it): float64 (gold) and dtype
    (base; its sink fp32), each ``(out [1, sq, h, dv], lse [1, h, sq] float64, (dq, dk, dv, dsink) or None)``."""
    res = []
    for dt in (torch.float64, dtype):
        leaves = [t.detach().cpu().to(dt).requires_grad_(do is not None) for t in (q, k, v)]
        s = sink.detach().cpu().to(torch.float64 if dt == torch.float64 else torch.float32)
        s.requires_grad_(do is not None)
        out, lse = attention_reference(*(t.transpose(1, 2) for t in leaves), sink=s, causal_alignment="bottom_right",
                                       dtype=dt, **ref_kw)
        out = out.transpose(1, 2)
        grads = torch.autograd.grad(out, leaves + [s], do.cpu().to(dt)) if do is not None else None
        res.append((out.detach(), lse[..., 0].double(), grads))
    return res


# --- flash_attn_func / qkvpacked

def test_func_deterministic_backward_bitwise(target):
    """deterministic=True on flash_attn_func: two backward passes give bitwise-equal dq, dk, dv, and they are
    right. On the GPU the shape is one where deterministic=False may take the single-pass Hopper backward
    (no mask, d = 128, dQ reduced with atomic adds: not bitwise reproducible); GQA 4:1, several tiles."""
    device, backend = target
    dtype = _target_dtype(device)
    repro = _repro("test_func_deterministic_backward_bitwise", target)
    s_q, s_k, d = (384, 512, 128) if device == "cuda" else (40, 72, 32)
    q, k, v, do = (t.to(dtype) for t in _dense_inputs(dict(b=2, sq=s_q, sk=s_k, h=4, hk=1, d=d), 61)[:4])
    runs = []
    for _ in range(2):
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, deterministic=True, backend=backend)
        runs.append(torch.autograd.grad(out, leaves, do.to(device)))
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"{name} differs between two backward runs ({(a - b).abs().max():.3e}). {repro}"
    gold, base = _reference_pair(q, k, v, dtype, do)
    for name, got, gd, bs in zip(("dq", "dk", "dv"), runs[0], gold[2], base[2]):
        close(got.cpu(), gd, bs, f"{name}. {repro}")


def test_qkvpacked_return_attn_probs(target):
    """flash_attn_qkvpacked_func(return_attn_probs=True) returns (out, softmax_lse, None): equal to
    flash_attn_func's on the views, softmax_lse [batch, nheads, seqlen] fp32 against the reference."""
    device, backend = target
    dtype = _target_dtype(device)
    repro = _repro("test_qkvpacked_return_attn_probs", target)
    qkv = torch.randn(2, 13, 3, 4, 16, generator=torch.Generator().manual_seed(62)).to(device, dtype)
    kw = dict(causal=True, window_size=(5, -1), softcap=3.0, softmax_scale=0.3)
    res = flash_attn_qkvpacked_func(qkv, return_attn_probs=True, backend=backend, **kw)
    assert isinstance(res, tuple) and len(res) == 3 and res[2] is None, f"(out, lse, None) expected. {repro}"
    out, lse, _ = res
    assert lse.shape == (2, 4, 13) and lse.dtype == torch.float32, f"lse {lse.shape} {lse.dtype}. {repro}"
    ref_out, ref_lse, _ = flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], return_attn_probs=True,
                                          backend=backend, **kw)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), f"packed != unpacked. {repro}"
    gold, base = _reference_pair(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dtype, causal=True, window=(5, -1),
                                 softcap=3.0, scale=0.3)
    close(out.cpu(), gold[0], base[0], f"out. {repro}")
    check_lse(lse.cpu(), gold[1], repro)


# --- varlen: dropout, [batch, nheads] ALiBi, learnable_sink, packed options

def test_varlen_dropout_reproducible_unbiased_and_differentiable(target):
    """flash_attn_varlen_func(dropout_p=0.3), as test_dropout_reproducible_and_differentiable for the dense
    function: the same torch seed gives the same output (fusedattn.attention_varlen's under that seed),
    another seed another mask; kept probabilities are scaled by 1 / (1 - p) (with v = 1 each output is the
    kept mass / (1 - p): mean 1, where no dropout gives exactly 1); q, k and v get finite gradients."""
    device, backend = target
    dtype = _target_dtype(device)
    repro = _repro("test_varlen_dropout_reproducible_unbiased_and_differentiable", target)
    g = torch.Generator().manual_seed(31)
    lens = [5, 11, 8]
    cu = _cu(lens).to(device)
    q, k, v, do = (torch.randn(sum(lens), 2, 16, generator=g).to(device, dtype) for _ in range(4))

    def run(q_, k_, v_, seed, p=0.3):
        torch.manual_seed(seed)
        return flash_attn_varlen_func(q_, k_, v_, cu, cu, 11, 11, dropout_p=p, causal=True, backend=backend)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    a = run(*leaves, 5)
    grads = torch.autograd.grad(a, leaves, do)
    b = run(q, k, v, 5)
    torch.manual_seed(5)      # the same seed draw as fusedattn.attention_varlen's
    c = fusedattn.attention_varlen(q, k, v, cu, cu, 11, 11, causal=True, causal_alignment="bottom_right",
                                   dropout_p=0.3, backend=backend)
    assert torch.equal(a.detach(), b) and torch.equal(b, c), f"same seed, same mask expected. {repro}"
    assert not torch.equal(b, run(q, k, v, 6)), f"another seed gave the same mask. {repro}"
    assert not torch.allclose(b, run(q, k, v, 5, p=0.0)), f"dropout_p=0.3 changed nothing. {repro}"
    for name, gr in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(gr).all() and gr.abs().sum() > 0, f"{name} not finite or all zero. {repro}"

    lens = [64, 64]                                    # non-causal: 64 keys a row, 512 (row, head) samples
    cu = _cu(lens).to(device)
    q, k = (torch.randn(128, 4, 16, generator=g).to(device, dtype) for _ in range(2))
    ones = torch.ones(128, 4, 16, device=device, dtype=dtype)
    torch.manual_seed(7)
    out = flash_attn_varlen_func(q, k, ones, cu, cu, 64, 64, dropout_p=0.3, backend=backend).float()
    mass = out[..., 0]                                 # kept mass / (1 - p), the same in every column
    assert not torch.allclose(mass, torch.ones_like(mass), atol=1e-2), f"no probability was dropped. {repro}"
    assert (mass >= 0).all() and (mass <= 1 / 0.7 + 1e-2).all(), f"kept mass / (1 - p) out of range. {repro}"
    assert abs(mass.mean().item() - 1.0) < 0.03, f"mean {mass.mean().item():.4f}: the scaling is biased. {repro}"


def test_varlen_batch_alibi_matches_reference(target):
    """alibi_slopes [batch_size, nheads] on flash_attn_varlen_func (causal, bottom-right per sequence;
    sequence 2 has rows with no key): sequence i reads row i; out, softmax_lse, dq, dk, dv against the
    reference with that row, and row 0 for every sequence would give another result."""
    device, backend = target
    dtype = _target_dtype(device)
    repro = _repro("test_varlen_batch_alibi_matches_reference", target)
    g = torch.Generator().manual_seed(41)
    lq, lk, h, hk, d = [4, 9, 6], [7, 9, 3], 4, 2, 16
    q = torch.randn(sum(lq), h, d, generator=g).to(dtype)
    k, v = (torch.randn(sum(lk), hk, d, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(sum(lq), h, d, generator=g).to(dtype)
    slopes = torch.rand(3, h, generator=g) + 0.25
    cq, ck = _cu(lq).to(device), _cu(lk).to(device)
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    out, lse, _ = flash_attn_varlen_func(*leaves, cq, ck, max(lq), max(lk), causal=True, alibi_slopes=slopes.to(device),
                                         return_attn_probs=True, backend=backend)
    grads = [gr.cpu() for gr in torch.autograd.grad(out, leaves, do.to(device))]
    out, lse = out.detach().cpu(), lse.cpu()
    oq, ok = _offsets(lq), _offsets(lk)
    for i in range(3):
        rq, rk = slice(oq[i], oq[i + 1]), slice(ok[i], ok[i + 1])
        gold, base = _reference_pair(q[rq][None], k[rk][None], v[rk][None], dtype, do[rq][None], causal=True,
                                     alibi=slopes[i:i + 1])
        msg = f"sequence {i}. {repro}"
        close(out[rq][None], gold[0], base[0], f"out, {msg}")
        check_lse(lse[:, rq][None], gold[1], msg)
        for name, got, gd, bs in zip(("dq", "dk", "dv"), (grads[0][rq], grads[1][rk], grads[2][rk]), gold[2], base[2]):
            close(got[None], gd, bs, f"{name}, {msg}")
    with torch.no_grad():
        row0 = flash_attn_varlen_func(q.to(device), k.to(device), v.to(device), cq, ck, max(lq), max(lk), causal=True,
                                      alibi_slopes=slopes[0].to(device), backend=backend).cpu()
    assert not torch.allclose(row0[oq[1]:], out[oq[1]:], atol=1e-3), f"alibi_slopes' batch rows ignored. {repro}"


def test_varlen_learnable_sink_matches_reference(target):
    """learnable_sink on flash_attn_varlen_func (unpaged, causal bottom-right per sequence): each sequence
    against attention_reference(sink=); softmax_lse includes the sink (a row with no key: lse = its sink,
    out = 0); dq, dk, dv and dsink (summed over the sequences) by FlashAttention's rule."""
    device, backend = target
    dtype = _target_dtype(device)
    repro = _repro("test_varlen_learnable_sink_matches_reference", target)
    g = torch.Generator().manual_seed(51)
    lq, lk, h, hk, d = [3, 8, 5], [6, 8, 2], 4, 2, 32          # sequence 2: 5 queries, 2 keys: rows with no key
    q = torch.randn(sum(lq), h, d, generator=g).to(dtype)
    k, v = (torch.randn(sum(lk), hk, d, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(sum(lq), h, d, generator=g).to(dtype)
    sink = torch.randn(h, generator=g) * 2.0        # some heads' sinks dominate, others hardly count
    leaves = [t.to(device).requires_grad_() for t in (q, k, v, sink)]
    out, lse, _ = flash_attn_varlen_func(*leaves[:3], _cu(lq).to(device), _cu(lk).to(device), max(lq), max(lk),
                                         causal=True, learnable_sink=leaves[3], return_attn_probs=True,
                                         backend=backend)
    grads = [gr.cpu() for gr in torch.autograd.grad(out, leaves, do.to(device))]
    out, lse = out.detach().cpu(), lse.cpu()
    oq, ok = _offsets(lq), _offsets(lk)
    dsink_gold, dsink_base = torch.zeros(h, dtype=torch.float64), torch.zeros(h, dtype=torch.float64)
    for i in range(3):
        rq, rk = slice(oq[i], oq[i + 1]), slice(ok[i], ok[i + 1])
        gold, base = _sink_reference_pair(q[rq][None], k[rk][None], v[rk][None], sink, dtype, do[rq][None],
                                          causal=True)
        msg = f"sequence {i}. {repro}"
        close(out[rq][None], gold[0], base[0], f"out, {msg}")
        check_lse(lse[:, rq][None], gold[1], msg)
        for name, got, gd, bs in zip(("dq", "dk", "dv"), (grads[0][rq], grads[1][rk], grads[2][rk]), gold[2], base[2]):
            close(got[None], gd, bs, f"{name}, {msg}")
        dsink_gold += gold[2][3]
        dsink_base += base[2][3].double()
    assert (out[oq[2]:oq[2] + 3] == 0).all(), f"rows with no key (only the sink) must give 0. {repro}"
    assert_error_within(grads[3], dsink_gold, dsink_base, factor=3.0, floor=1e-4, msg=f"dsink. {repro}")


PACKED_OPTIONS = [
    dict(name="window", window_size=(3, 1)),
    dict(name="softcap_causal_scale", causal=True, softcap=2.5, softmax_scale=0.4),
    dict(name="alibi_heads", causal=True, alibi="heads"),
    dict(name="alibi_batch_window", window_size=(4, 0), alibi="batch"),
]


@pytest.mark.parametrize("c", PACKED_OPTIONS, ids=lambda c: c["name"])
def test_varlen_packed_options_equal_unpacked(c, target):
    """flash_attn_varlen_qkvpacked_func and flash_attn_varlen_kvpacked_func pass window_size, softcap,
    softmax_scale and alibi_slopes ([nheads] and [batch_size, nheads]) through: out, softmax_lse and the
    gradients (landing in qkv / kv) equal flash_attn_varlen_func's on the same views, and differ from the
    call without the option."""
    device, backend = target
    dtype = _target_dtype(device)
    repro = _repro("test_varlen_packed_options_equal_unpacked", target, c["name"])
    g = torch.Generator().manual_seed(sum(map(ord, c["name"])))
    opts = {key: val for key, val in c.items() if key not in ("name", "alibi")}
    slopes = {"heads": torch.rand(2, generator=g) + 0.25, "batch": torch.rand(3, 2, generator=g) + 0.25}.get(
        c.get("alibi"))
    if slopes is not None:
        opts["alibi_slopes"] = slopes.to(device)
    plain = dict(causal=opts.get("causal", False))

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    cu = _cu([4, 9, 2]).to(device)
    qkv = leaf(15, 3, 2, 16)
    qkv2 = qkv.detach().clone().requires_grad_()
    do = torch.randn(15, 2, 16, generator=g).to(device, dtype)
    packed = flash_attn_varlen_qkvpacked_func(qkv, cu, 9, return_attn_probs=True, backend=backend, **opts)
    views = flash_attn_varlen_func(qkv2[:, 0], qkv2[:, 1], qkv2[:, 2], cu, cu, 9, 9, return_attn_probs=True,
                                   backend=backend, **opts)
    assert torch.equal(packed[0], views[0]) and torch.equal(packed[1], views[1]), f"qkvpacked out / lse. {repro}"
    dqkv, dqkv_views = torch.autograd.grad(packed[0], qkv, do)[0], torch.autograd.grad(views[0], qkv2, do)[0]
    assert torch.equal(dqkv, dqkv_views), f"qkvpacked dqkv. {repro}"
    with torch.no_grad():
        other = flash_attn_varlen_qkvpacked_func(qkv, cu, 9, backend=backend, **plain)
    assert not torch.allclose(other, packed[0].detach(), atol=1e-3), f"qkvpacked ignored {c['name']}. {repro}"

    cq, ck = _cu([2, 5, 3]).to(device), _cu([6, 5, 4]).to(device)
    q, kv = leaf(10, 2, 16), leaf(15, 2, 2, 16)
    q2, kv2 = (t.detach().clone().requires_grad_() for t in (q, kv))
    do = torch.randn(10, 2, 16, generator=g).to(device, dtype)
    packed = flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 5, 6, return_attn_probs=True, backend=backend, **opts)
    views = flash_attn_varlen_func(q2, kv2[:, 0], kv2[:, 1], cq, ck, 5, 6, return_attn_probs=True, backend=backend,
                                   **opts)
    assert torch.equal(packed[0], views[0]) and torch.equal(packed[1], views[1]), f"kvpacked out / lse. {repro}"
    grads, grads_views = torch.autograd.grad(packed[0], (q, kv), do), torch.autograd.grad(views[0], (q2, kv2), do)
    for name, a, b in zip(("dq", "dkv"), grads, grads_views):
        assert torch.equal(a, b), f"kvpacked {name}. {repro}"
    with torch.no_grad():
        other = flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 5, 6, backend=backend, **plain)
    assert not torch.allclose(other, packed[0].detach(), atol=1e-3), f"kvpacked ignored {c['name']}. {repro}"


# --- paged varlen (block_table): softmax_scale, window_size, softcap, alibi_slopes

PAGED_VARLEN = [
    dict(name="softmax_scale", causal=True, scale=0.21),
    dict(name="window", window=(5, 2)),
    dict(name="softcap", causal=True, softcap=2.0),
    dict(name="alibi_heads", causal=True, alibi="heads"),
    dict(name="alibi_batch_window", window=(6, 0), alibi="batch"),
    dict(name="all_at_once", causal=True, window=(9, -1), softcap=4.0, alibi="batch", scale=0.3),
]


@pytest.mark.parametrize("c", PAGED_VARLEN, ids=lambda c: c["name"])
def test_varlen_block_table_options(c, target):
    """flash_attn_varlen_func with block_table (packed queries over paged caches, forward) under
    softmax_scale, window_size, softcap and alibi_slopes ([nheads], [batch_size, nheads]): each sequence
    against the reference on its gathered keys (sequence 1 has more queries than keys: rows with no key),
    and the options change the result."""
    device, backend = target
    dtype = _target_dtype(device)
    repro = _repro("test_varlen_block_table_options", target, c["name"])
    g = torch.Generator().manual_seed(sum(map(ord, c["name"])))
    lq, lk, page, h, hk, d = [3, 6, 7], [20, 5, 31], 8, 4, 2, 40
    kc, vc = (torch.randn(14, page, hk, d, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(14, generator=g)[:12].view(3, 4).to(torch.int32)
    q = torch.randn(sum(lq), h, d, generator=g).to(dtype)
    slopes = {"heads": torch.rand(h, generator=g) + 0.25, "batch": torch.rand(3, h, generator=g) + 0.25}.get(
        c.get("alibi"))
    kw = dict(causal=c.get("causal", False), window_size=c.get("window", (-1, -1)), softcap=c.get("softcap", 0.0),
              softmax_scale=c.get("scale"))

    def run(**kw_):
        return flash_attn_varlen_func(q.to(device), kc.to(device), vc.to(device), _cu(lq).to(device),
                                      _cu(lk).to(device), max(lq), max(lk), block_table=table.to(device),
                                      return_attn_probs=True, backend=backend, **kw_)

    out, lse, _ = run(alibi_slopes=None if slopes is None else slopes.to(device), **kw)
    out, lse = out.cpu(), lse.cpu()
    oq = _offsets(lq)
    for i in range(3):
        keys, values = (torch.cat([cache[j] for j in table[i].tolist()])[:lk[i]][None] for cache in (kc, vc))
        alibi = slopes if slopes is None or slopes.dim() == 1 else slopes[i:i + 1]
        gold, base = _reference_pair(q[oq[i]:oq[i + 1]][None], keys, values, dtype, causal=kw["causal"],
                                     window=kw["window_size"], softcap=kw["softcap"], scale=kw["softmax_scale"],
                                     alibi=alibi)
        msg = f"sequence {i}. {repro}"
        close(out[oq[i]:oq[i + 1]][None], gold[0], base[0], f"out, {msg}")
        check_lse(lse[:, oq[i]:oq[i + 1]][None], gold[1], msg)
    plain = run(causal=kw["causal"])[0].cpu()
    assert not torch.allclose(plain, out, atol=1e-3), f"the options changed nothing. {repro}"


# --- with_kvcache: [batch, nheads] ALiBi, softmax_scale, learnable_sink, int64 cache_seqlens

KVC_OPTIONS = [
    dict(name="batch_alibi", causal=True, alibi=True),
    dict(name="batch_alibi_window_paged", window=(5, 0), alibi=True, page=4),
    dict(name="softmax_scale", causal=True, scale=0.41),
    dict(name="softmax_scale_softcap_paged", scale=0.2, softcap=3.0, page=4),
]


def _kvcache_inputs(g, dtype, b, sq, h, hk, d, page=None):
    """q, the new k / v (seqlen_new = seqlen_q: fusedattn's append), the caches (contiguous [b, 20, hk, d],
    or pages of ``page`` keys with a shuffled block table) and ``dense`` (cache -> [b, keys, hk, d])."""
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    kn, vn = (torch.randn(b, sq, hk, d, generator=g).to(dtype) for _ in range(2))
    if page:
        per_seq, n_blocks = 20 // page, b * 20 // page + 2
        kc, vc = (torch.randn(n_blocks, page, hk, d, generator=g).to(dtype) for _ in range(2))
        table = torch.randperm(n_blocks, generator=g)[: b * per_seq].view(b, per_seq).to(torch.int32)
        return q, kn, vn, kc, vc, table, lambda cache: cache[table.long()].reshape(b, per_seq * page, hk, d)
    kc, vc = (torch.randn(b, 20, hk, d, generator=g).to(dtype) for _ in range(2))
    return q, kn, vn, kc, vc, None, lambda cache: cache


@pytest.mark.parametrize("c", KVC_OPTIONS, ids=lambda c: c["name"])
def test_kvcache_batch_alibi_and_softmax_scale(c, target):
    """flash_attn_with_kvcache (appending k/v, contiguous or paged) with alibi_slopes [batch_size, nheads]
    (sequence i reads row i around its own diagonal) and with a non-default softmax_scale: out and
    softmax_lse against the reference per sequence; row 0 for every sequence, or the default scale,
    would give another result."""
    device, backend = target
    dtype = _target_dtype(device)
    repro = _repro("test_kvcache_batch_alibi_and_softmax_scale", target, c["name"])
    g = torch.Generator().manual_seed(sum(map(ord, c["name"])))
    b, sq, h, hk, d = 3, 2, 4, 2, 16
    lens = [3, 10, 15]
    q, kn, vn, kc, vc, table, dense = _kvcache_inputs(g, dtype, b, sq, h, hk, d, c.get("page"))
    slopes = torch.rand(b, h, generator=g) + 0.25 if c.get("alibi") else None
    kw = dict(causal=c.get("causal", False), window_size=c.get("window", (-1, -1)), softcap=c.get("softcap", 0.0),
              softmax_scale=c.get("scale"))

    def run(**kw_):
        return flash_attn_with_kvcache(q.to(device), kc.to(device), vc.to(device), kn.to(device), vn.to(device),
                                       cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
                                       block_table=None if table is None else table.to(device),
                                       return_softmax_lse=True, backend=backend, **kw_)

    out, lse = (t.cpu() for t in run(alibi_slopes=None if slopes is None else slopes.to(device), **kw))
    k_exp, v_exp = dense(kc).clone(), dense(vc).clone()
    for i, n in enumerate(lens):
        k_exp[i, n:n + sq], v_exp[i, n:n + sq] = kn[i], vn[i]
    for i, n in enumerate(lens):
        gold, base = _reference_pair(q[i:i + 1], k_exp[i:i + 1, :n + sq], v_exp[i:i + 1, :n + sq], dtype,
                                     causal=kw["causal"], window=kw["window_size"], softcap=kw["softcap"],
                                     scale=kw["softmax_scale"], alibi=None if slopes is None else slopes[i:i + 1])
        close(out[i:i + 1], gold[0], base[0], f"out, sequence {i}. {repro}")
        check_lse(lse[i:i + 1], gold[1], f"sequence {i}. {repro}")
    if slopes is not None:
        other = run(alibi_slopes=slopes[0].to(device), **kw)[0].cpu()
        assert not torch.allclose(other[1:], out[1:], atol=1e-3), f"alibi_slopes' batch rows ignored. {repro}"
    else:
        other = run(**{**kw, "softmax_scale": None})[0].cpu()
        assert not torch.allclose(other, out, atol=1e-3), f"softmax_scale ignored. {repro}"


KVC_SINK = [
    dict(name="empty_rows", lens=[0, 2, 12], append=False),          # no key at all; a row above the diagonal
    dict(name="append_paged", lens=[3, 9, 14], append=True, page=4),
]


@pytest.mark.parametrize("c", KVC_SINK, ids=lambda c: c["name"])
def test_kvcache_learnable_sink_matches_reference(c, target):
    """learnable_sink on flash_attn_with_kvcache (forward only, causal): each sequence against
    attention_reference(sink=) on its cache; softmax_lse includes the sink (a row with no key: lse = its
    sink, out = 0)."""
    device, backend = target
    dtype = _target_dtype(device)
    repro = _repro("test_kvcache_learnable_sink_matches_reference", target, c["name"])
    g = torch.Generator().manual_seed(sum(map(ord, c["name"])))
    b, sq, h, hk, d = 3, 3, 4, 2, 32
    q, kn, vn, kc, vc, table, dense = _kvcache_inputs(g, dtype, b, sq, h, hk, d, c.get("page"))
    sink = torch.randn(h, generator=g) * 2.0
    snew = sq if c["append"] else 0
    out, lse = flash_attn_with_kvcache(
        q.to(device), kc.to(device), vc.to(device), kn.to(device) if snew else None, vn.to(device) if snew else None,
        cache_seqlens=torch.tensor(c["lens"], dtype=torch.int32, device=device),
        block_table=None if table is None else table.to(device), causal=True, learnable_sink=sink.to(device),
        return_softmax_lse=True, backend=backend)
    out, lse = out.cpu(), lse.cpu()
    k_exp, v_exp = dense(kc).clone(), dense(vc).clone()
    for i, n in enumerate(c["lens"]):
        k_exp[i, n:n + snew], v_exp[i, n:n + snew] = kn[i, :snew], vn[i, :snew]
    for i, n in enumerate(c["lens"]):
        gold, base = _sink_reference_pair(q[i:i + 1], k_exp[i:i + 1, :n + snew], v_exp[i:i + 1, :n + snew], sink,
                                          dtype, causal=True)
        close(out[i:i + 1], gold[0], base[0], f"out, sequence {i}. {repro}")
        check_lse(lse[i:i + 1], gold[1], f"sequence {i}. {repro}")
    if not c["append"]:
        assert (out[0] == 0).all() and (out[1, 0] == 0).all(), f"rows with only the sink must give 0. {repro}"
        assert torch.allclose(lse[0], sink.view(h, 1).expand(h, sq)), f"no key: lse = the sink. {repro}"


@pytest.mark.parametrize("snew", [1, 3], ids=["fused_append", "pytorch_append"])
def test_kvcache_int64_cache_seqlens_equals_int32(snew, target):
    """cache_seqlens as int64 (torch's default integer type) is accepted: the same appended caches, output
    and softmax_lse as with int32 (fusedattn's append, seqlen_new == seqlen_q, and the PyTorch scatter)."""
    device, backend = target
    repro = _repro("test_kvcache_int64_cache_seqlens_equals_int32", target, f"{snew}")
    g = torch.Generator().manual_seed(71 + snew)
    q = torch.randn(2, 1, 4, 16, generator=g).to(device)
    kc, vc = (torch.randn(2, 12, 2, 16, generator=g).to(device) for _ in range(2))
    kn, vn = (torch.randn(2, snew, 2, 16, generator=g).to(device) for _ in range(2))
    res = []
    for dt in (torch.int32, torch.int64):
        caches = kc.clone(), vc.clone()
        out, lse = flash_attn_with_kvcache(q, *caches, kn, vn, cache_seqlens=torch.tensor([4, 8], dtype=dt,
                                                                                           device=device),
                                           causal=True, return_softmax_lse=True, backend=backend)
        res.append((out, lse) + caches)
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), *res):
        assert torch.equal(a, b), f"{name}: int64 cache_seqlens differs from int32. {repro}"


# --- refusals

def test_varlen_and_kvcache_refusals_name_the_argument():
    """max_seqlen_q / max_seqlen_k not an int, max_seqlen_k past the block table's capacity, block_table with
    tensors that require grad (allowed under no_grad), learnable_sink with block_table, with_kvcache's k
    without v (or v without k): each a clear error naming the argument."""
    repro = _repro("test_varlen_and_kvcache_refusals_name_the_argument")
    g = torch.Generator().manual_seed(81)
    q = torch.randn(8, 2, 16, generator=g)
    pages, pv = (torch.randn(4, 4, 2, 16, generator=g) for _ in range(2))
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)            # capacity 2 blocks x 4 = 8 keys
    cq, ck = _cu([4, 4]), _cu([5, 8])
    for bad in (4.0, True, "4"):
        with pytest.raises(ValueError, match=f"max_seqlen_q must be an int, got {bad!r}"):
            flash_attn_varlen_func(q, q, q, cq, cq, bad, 4)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int, got 4.5"):
        flash_attn_varlen_func(q, pages, pv, cq, ck, 4, 4.5, block_table=bt)
    with pytest.raises(ValueError, match=r"max_seqlen_k = 9 exceeds the block table's capacity of 8 keys "
                                         r"\(2 blocks x page_block_size 4\)"):
        flash_attn_varlen_func(q, pages, pv, cq, ck, 4, 9, block_table=bt)
    k_grad = pages.clone().requires_grad_()
    with pytest.raises(NotSupportedError, match="block_table with tensors that require grad: paged K/V is forward"):
        flash_attn_varlen_func(q, k_grad, pv, cq, ck, 4, 8, block_table=bt)
    with torch.no_grad():
        out = flash_attn_varlen_func(q, k_grad, pv, cq, ck, 4, 8, block_table=bt)
    assert torch.isfinite(out).all(), f"block_table under torch.no_grad(). {repro}"
    with pytest.raises(NotSupportedError, match="learnable_sink with block_table"):
        flash_attn_varlen_func(q, pages, pv, cq, ck, 4, 8, block_table=bt, learnable_sink=torch.zeros(2))
    qc, kc = torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 8, 2, 16, generator=g)
    kn = torch.randn(2, 1, 2, 16, generator=g)
    with pytest.raises(ValueError, match="k and v must be given together"):
        flash_attn_with_kvcache(qc, kc, kc.clone(), k=kn, cache_seqlens=3)
    with pytest.raises(ValueError, match="k and v must be given together"):
        flash_attn_with_kvcache(qc, kc, kc.clone(), v=kn, cache_seqlens=3)


# --- validate=False reads nothing back to the host (the door's promise for CUDA-graph capture)

_HOST_READS = ("item", "__bool__", "tolist", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def _host_reads_fail(monkeypatch, door_only):
    """While inside, torch.Tensor's host reads (item, bool, tolist, int, float, index) raise: from anywhere,
    or (door_only) when called from fusedattn/flash_attn.py. Yields the list of reads seen, so that a read
    whose error some ``except`` swallowed still fails the test."""
    door = os.path.join("fusedattn", "flash_attn.py")
    seen = []

    def guard(name, orig):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if not door_only or caller.f_code.co_filename.endswith(door):
                seen.append(f"Tensor.{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
                raise AssertionError(f"host read: {seen[-1]}")
            return orig(self, *args, **kwargs)
        return read

    with monkeypatch.context() as m:
        for name in _HOST_READS:
            m.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
        yield seen


NO_HOST_READ = [
    dict(name="append_snew_ne_sq", sq=1, snew=3),
    dict(name="rotary", sq=2, snew=2, rotary=True),
    dict(name="rotary_append_snew_ne_sq_paged", sq=1, snew=3, rotary=True, page=4),
]


@pytest.mark.parametrize("c", NO_HOST_READ, ids=lambda c: c["name"])
def test_kvcache_validate_false_reads_nothing_back(c, target, monkeypatch):
    """flash_attn_with_kvcache(validate=False) reads no device value back to the host on the paths that did
    (the PyTorch append when seqlen_new != seqlen_q; rotary's position check). GPU: under
    torch.cuda.set_sync_debug_mode("error"). CPU tensors: torch.Tensor's host reads made to raise, from
    anywhere under the Triton interpreter (the whole call), from fusedattn/flash_attn.py on the CPU backend
    (which computes on the host by design). The results (out, lse, caches) equal validate=True's."""
    device, backend = target
    dtype = _target_dtype(device)
    repro = _repro("test_kvcache_validate_false_reads_nothing_back", target, c["name"])
    g = torch.Generator().manual_seed(sum(map(ord, c["name"])))
    b, h, hk, d, page = 2, 4, 2, 32, c.get("page")
    q = torch.randn(b, c["sq"], h, d, generator=g).to(dtype)
    kn, vn = (torch.randn(b, c["snew"], hk, d, generator=g).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(12 if page else b, page or 20, hk, d, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(12, generator=g)[:10].view(b, 5).to(torch.int32) if page else None
    ang = torch.rand(32, 8, generator=g) * 6.28
    rotary = dict(rotary_cos=ang.cos().to(device, dtype), rotary_sin=ang.sin().to(device, dtype)) \
        if c.get("rotary") else {}

    def inputs():                      # fresh device copies (the call appends in place), made before any check
        return [t.to(device) for t in (q, kc, vc, kn, vn)], dict(
            cache_seqlens=torch.tensor([5, 11], dtype=torch.int32, device=device),
            block_table=None if table is None else table.to(device), **rotary)

    def call(args, kw, validate):
        out, lse = flash_attn_with_kvcache(*args, **kw, causal=True, return_softmax_lse=True, backend=backend,
                                           validate=validate)
        return out, lse, args[1], args[2]

    want = call(*inputs(), validate=True)      # also loads / compiles the kernels outside the check
    args, kw = inputs()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = call(args, kw, validate=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        with _host_reads_fail(monkeypatch, door_only=backend == "cpu") as seen:
            try:
                got = call(args, kw, validate=False)
            except AssertionError as e:
                raise AssertionError(f"{e}. {repro}") from None
        assert not seen, f"host reads with validate=False: {seen}. {repro}"
    for name, a, b_ in zip(("out", "lse", "k_cache", "v_cache"), want, got):
        assert torch.equal(a, b_), f"{name}: validate=False differs from validate=True. {repro}"


def test_kvcache_validate_false_clamps_untrusted_positions(target):
    """validate=False trusts cache_seqlens: an append past the cache's end or a rotary position past
    rotary_cos's rows is clamped into range (nothing read or written out of bounds, earlier slots kept)
    where validate=True names the problem."""
    device, backend = target
    repro = _repro("test_kvcache_validate_false_clamps_untrusted_positions", target)
    g = torch.Generator().manual_seed(91)
    q = torch.randn(1, 1, 2, 16, generator=g).to(device)
    kc, vc = (torch.randn(1, 8, 2, 16, generator=g).to(device) for _ in range(2))
    kn, vn = (torch.randn(1, 3, 2, 16, generator=g).to(device) for _ in range(2))
    with pytest.raises(ValueError, match="cache_seqlens \\+ seqlen_new \\(seqlen_new = 3\\) exceeds the cache's 8"):
        flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=7, backend=backend)
    caches = kc.clone(), vc.clone()
    out = flash_attn_with_kvcache(q, *caches, kn, vn, cache_seqlens=7, backend=backend, validate=False)
    assert torch.isfinite(out).all(), f"append past the end, validate=False. {repro}"
    assert torch.equal(caches[0][:, :7], kc[:, :7]) and torch.equal(caches[1][:, :7], vc[:, :7]), \
        f"slots before cache_seqlens were overwritten. {repro}"

    ang = torch.rand(6, 4, generator=g).to(device)
    rot = dict(rotary_cos=ang.cos(), rotary_sin=ang.sin())
    q2, kn2 = torch.randn(1, 2, 2, 16, generator=g).to(device), torch.randn(1, 2, 2, 16, generator=g).to(device)
    with pytest.raises(ValueError, match="seqlen_ro = 6 rows but position 6 is needed"):
        flash_attn_with_kvcache(q2, kc.clone(), vc.clone(), kn2, kn2, cache_seqlens=5, causal=True, backend=backend,
                                **rot)
    out = flash_attn_with_kvcache(q2, kc.clone(), vc.clone(), kn2, kn2, cache_seqlens=5, causal=True,
                                  backend=backend, validate=False, **rot)
    assert torch.isfinite(out).all(), f"rotary past seqlen_ro, validate=False. {repro}"
