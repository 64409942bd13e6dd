"""Masks, bias, ALiBi, windows, padding, softcap and dropout: forward and backward against the
float64 reference, alone and in the pairs users meet; fully masked rows; dropout statistics."""
import math

import pytest
import torch

import fusedattn
from fusedattn.backends.cpu import dropout_keep_mask
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within


def make_inputs(device, dtype, b=2, h_q=4, h_kv=2, s_q=37, s_kv=45, d=64, d_v=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h_q, d, generator=gen).to(device, dtype).transpose(1, 2)   # BSHD memory
    k = torch.randn(b, s_kv, h_kv, d, generator=gen).to(device, dtype).transpose(1, 2)
    v = torch.randn(b, s_kv, h_kv, d_v, generator=gen).to(device, dtype).transpose(1, 2)
    do = torch.randn(b, h_q, s_q, d_v, generator=gen).to(device, dtype)
    return q, k, v, do


def lens(device, *vals):
    return torch.tensor(vals, dtype=torch.int32, device=device)


def feature_kwargs(name, device, b=2, h=4, s_q=37, s_kv=45):
    gen = torch.Generator().manual_seed(11)
    table = {
        "padding": dict(seq_len_q=lens(device, 30, 9), seq_len_kv=lens(device, 41, 12)),
        "padding+causal_br": dict(seq_len_q=lens(device, 30, 9), seq_len_kv=lens(device, 41, 12), causal=True,
                                  causal_alignment="bottom_right"),
        "padding+causal_tl": dict(seq_len_q=lens(device, 30, 9).view(b, 1, 1, 1),
                                  seq_len_kv=lens(device, 41, 12).view(b, 1, 1, 1), causal=True),
        "bias": dict(attn_bias=torch.randn(1, h, s_q, s_kv, generator=gen).to(device)),
        "bias_b1ss": dict(attn_bias=torch.randn(b, 1, s_q, s_kv, generator=gen).to(device)),
        "bias+causal": dict(attn_bias=torch.randn(b, h, s_q, s_kv, generator=gen).to(device), causal=True),
        "boolmask": dict(attn_bias=(torch.rand(1, 1, s_q, s_kv, generator=gen) > 0.3).to(device)),
        "alibi": dict(alibi=True),
        "alibi+causal": dict(alibi=True, causal=True, causal_alignment="bottom_right"),
        "alibi_slopes": dict(alibi=torch.rand(h, generator=gen).to(device)),
        "window": dict(window=(7, 3)),
        "window+padding": dict(window=(5, 0), seq_len_kv=lens(device, 20, 45), causal_alignment="bottom_right"),
        "softcap": dict(softcap=3.0),
        "softcap+causal": dict(softcap=1.5, causal=True),
        "dropout": dict(dropout_p=0.2, dropout_seed=1234, dropout_offset=5),
        "dropout+causal": dict(dropout_p=0.35, dropout_seed=99, causal=True),
    }
    return table[name]


FEATURES = ["padding", "padding+causal_br", "padding+causal_tl", "bias", "bias_b1ss", "bias+causal", "boolmask",
            "alibi", "alibi+causal", "alibi_slopes", "window", "window+padding", "softcap", "softcap+causal",
            "dropout", "dropout+causal"]


@pytest.mark.parametrize("feature", FEATURES)
def test_feature_forward_backward(feature, target):
    device, backend = target
    dtype = torch.float16 if device == "cuda" else torch.float32
    q, k, v, do = make_inputs(device, dtype)
    kw = feature_kwargs(feature, device)
    bias = kw.get("attn_bias")
    if bias is not None and bias.is_floating_point():
        kw["attn_bias"] = bias = bias.clone().requires_grad_()
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fusedattn.attention(qs, ks, vs, backend=backend, **kw)
    plain = fusedattn.attention(q, k, v, backend=backend)
    assert (out.float() - plain.float()).abs().max() > 1e-3, f"{feature} had no effect"
    out.backward(do)

    def ref(dt):
        rq, rk, rv = (t.detach().cpu().to(dt).requires_grad_() for t in (q, k, v))
        rkw = {n: (t.detach().cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
        rb = None
        if bias is not None and bias.is_floating_point():
            rkw["attn_bias"] = rb = bias.detach().cpu().to(dt).requires_grad_()
        o, _ = attention_reference(rq, rk, rv, dtype=dt, **rkw)
        o.backward(do.cpu().to(dt))
        return o, rq.grad, rk.grad, rv.grad, (rb.grad if rb is not None else None)

    gold, base = ref(torch.float64), ref(dtype)
    got = (out, qs.grad, ks.grad, vs.grad, bias.grad if bias is not None and bias.is_floating_point() else None)
    for name, g, gd, gb in zip(("out", "dq", "dk", "dv", "dbias"), got, gold, base):
        if gd is None:
            continue
        assert_error_within(g.detach().cpu(), gd, gb, msg=f"{feature}: {name}")


@pytest.mark.parametrize("mask", ["padding", "window", "boolmask", "causal_br"])
def test_fully_masked_rows_are_zero_not_nan(mask, target):
    device, backend = target
    q, k, v, do = make_inputs(device, torch.float32, s_q=20, s_kv=16)
    if mask == "padding":
        kw = dict(seq_len_kv=lens(device, 0, 16))                      # batch 0 has no keys at all
    elif mask == "window":
        kw = dict(window=(0, 0), causal_alignment="top_left")          # rows 16..19 see no key (j = i >= 16)
    elif mask == "boolmask":
        m = torch.ones(1, 1, 20, 16, dtype=torch.bool)
        m[..., 3, :] = False
        kw = dict(attn_bias=m.to(device))
    else:
        q, k, v, do = make_inputs(device, torch.float32, s_q=20, s_kv=10)
        kw = dict(causal=True, causal_alignment="bottom_right")         # rows 0..9 see nothing
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, stats = fusedattn.attention(qs, ks, vs, backend=backend, return_stats=True, **kw)
    out.backward(do)
    for name, t in (("out", out), ("dq", qs.grad), ("dk", ks.grad), ("dv", vs.grad)):
        assert torch.isfinite(t).all(), f"{mask}: non-finite {name}"
    assert not (torch.isnan(stats) | (stats == float("inf"))).any(), f"{mask}: NaN or +inf stats"
    gold, gold_lse = attention_reference(q.cpu(), k.cpu(), v.cpu(), **{n: (t.cpu() if isinstance(t, torch.Tensor) else t)
                                                                        for n, t in kw.items()})
    empty = gold_lse[..., 0] == float("-inf")
    assert empty.any(), "the case has no empty row"
    assert (out.detach().cpu()[empty] == 0).all(), f"{mask}: rows with no key must give output 0"
    assert torch.equal(stats.detach().cpu()[..., 0] == float("-inf"), empty), \
        f"{mask}: stats must be -inf on exactly the rows with no key"
    assert (qs.grad.cpu()[empty] == 0).all(), "empty rows must get zero gradient"
    assert (out.detach().cpu().double() - gold).abs().max() < 1e-4


def test_padding_rows_past_length_are_zero(target):
    device, backend = target
    q, k, v, do = make_inputs(device, torch.float32)
    qs = q.detach().clone().requires_grad_()
    out, stats = fusedattn.attention(qs, k, v, seq_len_q=lens(device, 30, 9), seq_len_kv=lens(device, 41, 12),
                                     backend=backend, return_stats=True)
    out.backward(do)
    assert (out[0, :, 30:] == 0).all() and (out[1, :, 9:] == 0).all()
    assert (stats[0, :, 30:] == float("-inf")).all() and (qs.grad[1, :, 9:] == 0).all()
    assert stats[0, :, :30].isfinite().all() and stats[1, :, :9].isfinite().all()


def test_dropout_mask_matches_cpu_mask_and_statistics(target):
    """The kernel drops exactly the elements of the CPU mask (v = identity reveals P*mask)."""
    device, backend = target
    b, h, s, p = 1, 2, 64, 0.3
    q = torch.zeros(b, h, s, 16, device=device)                 # uniform attention: P = 1/s everywhere
    k = torch.randn(b, h, s, 16, device=device)
    v = torch.eye(s, device=device).expand(b, h, s, s).contiguous()[..., :64]   # out = P_dropped
    out = fusedattn.attention(q, k, v, dropout_p=p, dropout_seed=42, dropout_offset=7, backend=backend)
    keep = dropout_keep_mask(b, h, s, s, p, 42, 7)
    expected = keep.float() / s / (1 - p)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-4)
    frac = keep.float().mean().item()
    sigma = math.sqrt(p * (1 - p) / keep.numel())
    assert abs(frac - (1 - p)) < 4 * sigma, f"kept fraction {frac:.4f} vs {1 - p} (4 sigma = {4 * sigma:.4f})"
    other = fusedattn.attention(q, k, v, dropout_p=p, dropout_seed=43, dropout_offset=7, backend=backend)
    assert not torch.equal(other, out), "a different seed must give a different mask"


def test_dropout_is_unbiased():
    """E[dropout(P) @ V] = P @ V: the mean over many seeds approaches the no-dropout output."""
    q, k, v, _ = make_inputs("cpu", torch.float32, b=1, h_q=1, h_kv=1, s_q=8, s_kv=16, d=16, d_v=16)
    plain = fusedattn.attention(q, k, v, backend="cpu")
    mean = sum(fusedattn.attention(q, k, v, dropout_p=0.5, dropout_seed=s, backend="cpu") for s in range(400)) / 400
    assert (mean - plain).abs().max() < 0.15 * plain.abs().max() + 0.05


def test_dropout_fresh_seed_per_training_step():
    q, k, v, _ = make_inputs("cpu", torch.float32)
    q.requires_grad_()
    a = fusedattn.attention(q, k, v, dropout_p=0.3, backend="cpu")
    b = fusedattn.attention(q, k, v, dropout_p=0.3, backend="cpu")
    assert not torch.equal(a, b)


def test_alibi_slopes_match_seed_formula():
    def get_alibi_slopes(num_heads):     # the seed's code (sdpa-tutorial.md)
        closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
        base = 2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3)))
        powers = torch.arange(1, closest_power_of_2 + 1)
        slopes = base ** powers
        if closest_power_of_2 != num_heads:
            extra_powers = torch.arange(1, 2 * (num_heads - closest_power_of_2) + 1, 2)
            extra_slopes = (base ** 0.5) ** extra_powers
            slopes = torch.cat([slopes, extra_slopes])
        return slopes
    for h in (1, 4, 6, 12, 32):
        torch.testing.assert_close(fusedattn.alibi_slopes(h), get_alibi_slopes(h).float())


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_window_wider_than_every_key_is_unbounded(alignment, target):
    """A window bound of at least s_q + s_kv keeps every key it could reach, so the problem carries
    it as unbounded (no int32 arithmetic near 2^31 in the kernels): the outputs match the unbounded
    call's bit for bit, and a bound one key short of that width stays a real bound."""
    from fusedattn.problem import make_problem
    device, backend = target
    q, k, v, _ = make_inputs(device, torch.float32, s_q=20, s_kv=33)
    wide = {"window": (2 ** 31 - 1, 2 ** 40), "causal": True, "causal_alignment": alignment}
    p, _ = make_problem(q, k, v, **wide)
    assert p.band is not None and p.band.left is None and p.band.right == 0
    assert make_problem(q, k, v, window=(53, 53), causal_alignment=alignment)[0].band is None
    short = make_problem(q, k, v, window=(52, 52), causal_alignment=alignment)[0].band
    assert (short.left, short.right) == (52, 52)
    got = fusedattn.attention(q, k, v, backend=backend, **wide)
    want = fusedattn.attention(q, k, v, backend=backend, causal=True, causal_alignment=alignment)
    assert torch.equal(got, want)
    plain = fusedattn.attention(q, k, v, backend=backend)
    assert torch.equal(fusedattn.attention(q, k, v, backend=backend, window=(2 ** 33, 2 ** 33),
                                           causal_alignment=alignment), plain)
