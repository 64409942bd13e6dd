"""Seeded random calls of the FlashAttention door, forward and backward, against FlashAttention's semantics.

tests/test_flash_attn_api.py checks each function and keyword on chosen cases; this draws whole calls the way
a user of FlashAttention 2.x writes them: one of the six differentiable functions (dense, kv-packed,
qkv-packed, and their varlen forms, sequences of length 0 included), GQA / MQA, any head dim (odd ones, d_v !=
d where the function allows it), causal (bottom-right) or a window with -1 bounds, softcap, ALiBi slopes of
shape [h] or [b, h] (where the door takes them: causal or ``window_size[1] == 0``), a softmax_scale,
deterministic, return_attn_probs. Each case checks the output, softmax_lse (+inf on rows with no key) and the
gradients of every input against a float64 reference written from FlashAttention's documented semantics
(``test_flash_attn_api.fa_reference``, sequence by sequence for varlen), by FlashAttention's rule (2x
PyTorch's same-precision error plus a floor), and prints a one-line repro with the drawn call.
"""
import os
import random

import pytest
import torch

import fusedattn
from fusedattn.flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                  flash_attn_varlen_qkvpacked_func)
from fusedattn.testing import assert_error_within

from conftest import target_id

from test_flash_attn_api import check_lse, fa_reference

# FUSEDATTN_FUZZ_SEEDS=N draws N cases instead (a longer hunt; the default is CI's)
SEEDS = range(int(os.environ.get("FUSEDATTN_FUZZ_SEEDS", "40")))
FUNCS = ["func", "kvpacked", "qkvpacked", "varlen", "varlen_kvpacked", "varlen_qkvpacked"]


def draw(seed, device):
    """(function name, dense inputs, lengths, keyword arguments, description) of case ``seed``.

    Inputs are per sequence lists of (q [sq, h, d], k [sk, hk, d], v [sk, hk, dv]) so that the call and the
    reference see the same values; the call packs them as its function takes them."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    fn = rng.choice(FUNCS)
    packed_qkv = fn.endswith("qkvpacked")
    b = rng.choice([1, 2, 3])
    hk = rng.choice([1, 2])
    h = hk if packed_qkv else hk * rng.choice([1, 2, 3])
    d = rng.choice([1, 3, 8, 16, 24, 40, 64])
    dv = d if packed_qkv or fn.endswith("kvpacked") or rng.random() < 0.7 else rng.choice([8, 16, 32])
    if fn.startswith("varlen"):
        lq = [rng.choice([0, 1, 4, 9, 17]) for _ in range(b)]
        lk = list(lq) if packed_qkv else [rng.choice([0, 1, 6, 13, 20]) for _ in range(b)]
    else:
        sq = rng.choice([1, 5, 17, 33])
        sk = sq if packed_qkv else rng.choice([1, 6, 19, 33])
        lq, lk = [sq] * b, [sk] * b
    if device == "cuda":
        dtype = rng.choice([torch.float16, torch.bfloat16])
    else:   # the interpreter multiplies bf16 wrongly (backends/interpreter_check.py)
        dtype = rng.choice([torch.float16, torch.float32])
    kw = {}
    r = rng.random()
    if r < 0.35:
        kw["causal"] = True
    if r > 0.2 and rng.random() < 0.5:
        kw["window_size"] = (rng.choice([-1, 0, 3, 10]), rng.choice([-1, 0, 2]))
    if rng.random() < 0.25:
        kw["softcap"] = rng.choice([2.0, 30.0])
    if rng.random() < 0.2:
        kw["softmax_scale"] = rng.choice([0.05, 0.3, 1.0])
    right = kw.get("window_size", (-1, -1))[1]
    if rng.random() < 0.3 and (kw.get("causal") or right == 0):
        shape = rng.choice([(h,), (b, h)])
        kw["alibi_slopes"] = fusedattn.alibi_slopes(h).expand(shape) * (1 + torch.rand(*shape, generator=gen))
    if rng.random() < 0.3:
        kw["deterministic"] = True
    if rng.random() < 0.5:
        kw["return_attn_probs"] = True
    seqs = [(torch.randn(a, h, d, generator=gen), torch.randn(c, hk, d, generator=gen),
             torch.randn(c, hk, dv, generator=gen)) for a, c in zip(lq, lk)]
    dos = [torch.randn(a, h, dv, generator=gen) for a in lq]
    seqs = [tuple(t.to(dtype) for t in s) for s in seqs]
    dos = [t.to(dtype) for t in dos]
    described = ", ".join(f"{n}={tuple(x.shape) if isinstance(x, torch.Tensor) else x}" for n, x in kw.items())
    return fn, seqs, dos, lq, lk, kw, (f"{fn} b{b} h{h}/{hk} lq{lq} lk{lk} d{d}/{dv} {str(dtype)[6:]} "
                                       f"{described}")


def _cu(lens, device):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def call(fn, seqs, lq, lk, kw, device, backend):
    """The drawn function on leaves built from ``seqs``: (out as [sum lq, h, dv], lse as [h, sum lq] or None,
    leaves, a function that maps each leaf's gradient to per-input (dq, dk, dv) as [sum len, heads, dim])."""
    q = torch.cat([s[0] for s in seqs]).to(device)
    k = torch.cat([s[1] for s in seqs]).to(device)
    v = torch.cat([s[2] for s in seqs]).to(device)
    b = len(seqs)
    kw = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    kw["backend"] = backend
    varlen = fn.startswith("varlen")
    if varlen:
        cu_q, cu_k = _cu(lq, device), _cu(lk, device)
        mq, mk = max(lq), max(lk)
    else:   # dense: [b, s, h, d]
        q, k, v = (t.view(b, -1, *t.shape[1:]) for t in (q, k, v))
    if fn.endswith("qkvpacked"):
        leaf = torch.stack([q, k, v], dim=-3).requires_grad_()
        leaves = [leaf]
        res = (flash_attn_varlen_qkvpacked_func(leaf, cu_q, mq, **kw) if varlen
               else flash_attn_qkvpacked_func(leaf, **kw))
        split = (lambda g: (g[..., 0, :, :], g[..., 1, :, :], g[..., 2, :, :]))
    elif fn.endswith("kvpacked"):
        ql, kvl = q.clone().requires_grad_(), torch.stack([k, v], dim=-3).requires_grad_()
        leaves = [ql, kvl]
        res = (flash_attn_varlen_kvpacked_func(ql, kvl, cu_q, cu_k, mq, mk, **kw) if varlen
               else flash_attn_kvpacked_func(ql, kvl, **kw))
        split = (lambda gq, gkv: (gq, gkv[..., 0, :, :], gkv[..., 1, :, :]))
    else:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        res = (flash_attn_varlen_func(*leaves, cu_q, cu_k, mq, mk, **kw) if varlen else flash_attn_func(*leaves, **kw))
        split = (lambda gq, gk, gv: (gq, gk, gv))
    out, lse = (res[0], res[1]) if kw.get("return_attn_probs") else (res, None)
    if kw.get("return_attn_probs"):
        assert res[2] is None
    flat = (lambda t: t) if varlen else (lambda t: t.reshape(-1, *t.shape[2:]))
    if lse is not None and not varlen:
        lse = lse.permute(1, 0, 2).reshape(lse.shape[1], -1)        # [b, h, sq] -> [h, b * sq]
    return flat(out), lse, leaves, lambda grads: tuple(flat(g) for g in split(*grads))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_flash_attn_call(seed, target):
    device, backend = target
    fn, seqs, dos, lq, lk, kw, described = draw(seed, device)
    rep = (f"repro: pytest tests/test_flash_attn_fuzz.py -k 'test_random_flash_attn_call and "
           f"{target_id(target)}-{seed}]' ; {described}")
    out, lse, leaves, grads_of = call(fn, seqs, lq, lk, kw, device, backend)
    do = torch.cat(dos).to(device)
    grads = grads_of(torch.autograd.grad(out, leaves, do))
    dtype = seqs[0][0].dtype
    ref_kw = dict(causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)),
                  softcap=kw.get("softcap", 0.0), scale=kw.get("softmax_scale"))
    slopes = kw.get("alibi_slopes")
    oq, ok = _cu(lq, "cpu").tolist(), _cu(lk, "cpu").tolist()
    for i, ((q, k, v), d_o) in enumerate(zip(seqs, dos)):
        if lq[i] == 0:
            continue
        sl_q, sl_k = slice(oq[i], oq[i + 1]), slice(ok[i], ok[i + 1])
        alibi = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[i])
        res = []
        for dt in (torch.float64, dtype):
            ref_leaves = [t.to(dt).unsqueeze(0).requires_grad_() for t in (q, k, v)]
            if lk[i] == 0:      # no key at all: FlashAttention writes 0, softmax_lse +inf, and dQ is 0
                zeros = [torch.zeros_like(t) for t in ref_leaves]
                res.append((torch.zeros(lq[i], q.shape[1], v.shape[2], dtype=dt),
                            torch.full((q.shape[1], lq[i]), float("inf"), dtype=torch.float64), zeros))
                continue
            o, l_ = fa_reference(*ref_leaves, alibi=alibi, dtype=dt, **ref_kw)
            res.append((o[0].detach(), l_[0], torch.autograd.grad(o, ref_leaves, d_o.to(dt).unsqueeze(0))))
        (o_gold, lse_gold, g_gold), (o_base, _, g_base) = res
        msg = f"sequence {i}. {rep}"
        assert_error_within(out[sl_q].detach().cpu(), o_gold, o_base, msg=f"out, {msg}")
        if lse is not None:
            check_lse(lse[:, sl_q].cpu(), lse_gold, msg)
        for name, got, sl, gd, bs in zip(("dq", "dk", "dv"), grads, (sl_q, sl_k, sl_k), g_gold, g_base):
            if sl.stop > sl.start:
                assert_error_within(got[sl].cpu().to(gd.dtype), gd[0], bs[0], msg=f"{name}, {msg}")
