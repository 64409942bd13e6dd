"""Seeded random combinations of features, forward and backward, against the float64 reference.

tests/test_features.py checks each feature alone and in the pairs users meet; this draws whole calls the way
a user might build them: GQA / MQA, odd and unequal lengths, d_v != d, a causal mask (either alignment) or a
window, softcap, ALiBi, a float bias in one of four broadcast shapes or a bool mask, per-batch lengths on
either side, a sink, dropout, each independently. Every case checks the output, the log-sum-exp (-inf on
exactly the rows the reference finds empty) and dQ, dK, dV (and the sink's gradient) by FlashAttention's rule
(2x PyTorch's same-precision error plus a floor), and prints a one-line repro with the drawn call.
(A first run of 150 CPU-path and 60 interpreter cases of this draw found nothing, session 26.)
"""
import os
import random

import pytest
import torch

import fusedattn
from fusedattn.reference import attention_reference
from fusedattn.testing import FLOOR, assert_error_within, delta_convention_floors

from conftest import target_id

# FUSEDATTN_FUZZ_SEEDS=N draws N cases instead (a longer hunt on a GPU; the default is CI's)
SEEDS = range(int(os.environ.get("FUSEDATTN_FUZZ_SEEDS", "48")))


def draw(seed, device):
    """(q, k, v, do, kwargs, description) of case ``seed``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    b, h_kv = rng.choice([1, 2]), rng.choice([1, 2])
    h_q = h_kv * rng.choice([1, 2, 3])
    s_q, s_kv = rng.choice([1, 5, 17, 40]), rng.choice([1, 6, 19, 40])
    d = rng.choice([8, 16, 24, 40])
    d_v = d if rng.random() < 0.7 else rng.choice([8, 16, 32])
    if device == "cuda":
        dtype = rng.choice([torch.float16, torch.bfloat16])
    else:   # the interpreter multiplies bf16 wrongly (backends/interpreter_check.py): fp16 / fp32 here
        dtype = rng.choice([torch.float16, torch.float32])
    kw = {}
    r = rng.random()
    if r < 0.3:
        kw.update(causal=True, causal_alignment=rng.choice(["top_left", "bottom_right"]))
    elif r < 0.45:
        kw.update(window=(rng.choice([-1, 0, 3]), rng.choice([-1, 0, 2])),
                  causal_alignment=rng.choice(["top_left", "bottom_right"]))
    if rng.random() < 0.25:
        kw["softcap"] = rng.choice([1.5, 10.0])
    if rng.random() < 0.2 and (kw.get("causal") or "window" in kw):
        kw["alibi"] = True
    if rng.random() < 0.2:
        shape = rng.choice([(b, h_q, s_q, s_kv), (1, 1, s_q, s_kv), (s_kv,), (1, h_q, 1, s_kv)])
        kw["attn_bias"] = torch.randn(*shape, generator=gen).to(device, dtype)
    elif rng.random() < 0.1:
        kw["attn_bias"] = (torch.rand(b, 1, s_q, s_kv, generator=gen) > 0.2).to(device)
    if rng.random() < 0.25:
        kw["seq_len_q"] = torch.randint(0, s_q + 1, (b,), generator=gen, dtype=torch.int32).to(device)
    if rng.random() < 0.25:
        kw["seq_len_kv"] = torch.randint(0, s_kv + 1, (b,), generator=gen, dtype=torch.int32).to(device)
    if rng.random() < 0.15:
        kw["sink"] = torch.randn(h_q, generator=gen).to(device)
    if rng.random() < 0.15:
        kw.update(dropout_p=0.2, dropout_seed=seed, dropout_offset=3)
    q = torch.randn(b, h_q, s_q, d, generator=gen).to(device, dtype)
    k = torch.randn(b, h_kv, s_kv, d, generator=gen).to(device, dtype)
    v = torch.randn(b, h_kv, s_kv, d_v, generator=gen).to(device, dtype)
    do = torch.randn(b, h_q, s_q, d_v, generator=gen).to(device, dtype)
    described = ", ".join(f"{n}={tuple(x.shape) if isinstance(x, torch.Tensor) else x}" for n, x in kw.items())
    return q, k, v, do, kw, f"b{b} h{h_q}/{h_kv} s{s_q}x{s_kv} d{d}/{d_v} {str(dtype)[6:]} {described}"


def reference(q, k, v, do, kw, dtype):
    """(out, lse, dq, dk, dv, dsink) of the reference in ``dtype``, on the CPU."""
    rq, rk, rv = (t.detach().cpu().to(dtype).requires_grad_() for t in (q, k, v))
    rkw = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    bias = rkw.get("attn_bias")
    if bias is not None and bias.is_floating_point():
        rkw["attn_bias"] = bias.to(dtype)
    if "sink" in rkw:
        rkw["sink"] = rkw["sink"].to(dtype).requires_grad_()
    out, lse = attention_reference(rq, rk, rv, dtype=dtype, **rkw)
    out.backward(do.cpu().to(dtype))
    return out.detach(), lse, rq.grad, rk.grad, rv.grad, (rkw["sink"].grad if "sink" in rkw else None)


def probabilities(q, k, kw):
    """The float64 softmax of the drawn call before dropout, [b, h_q, s_q, s_kv] (the sink's column left
    out): the reference's output for one-hot values."""
    b, h_kv, s_kv = k.shape[:3]
    one_hot = torch.eye(s_kv, dtype=torch.float64).expand(b, h_kv, s_kv, s_kv)
    rkw = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items() if not n.startswith("dropout")}
    return attention_reference(q.detach().cpu().double(), k.detach().cpu().double(), one_hot, **rkw)[0]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_feature_combination(seed, target):
    device, backend = target
    q, k, v, do, kw, described = draw(seed, device)
    rep = (f"repro: pytest tests/test_feature_combinations.py -k 'test_random_feature_combination and "
           f"{target_id(target)}-{seed}]' ; {described}")
    gold = reference(q, k, v, do, kw, torch.float64)
    base = reference(q, k, v, do, kw, q.dtype)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    call_kw = dict(kw)
    if "sink" in kw:
        call_kw["sink"] = kw["sink"].detach().clone().requires_grad_()
        leaves.append(call_kw["sink"])
    out, stats = fusedattn.attention(*leaves[:3], backend=backend, return_stats=True, **call_kw)
    grads = torch.autograd.grad(out, leaves, do)

    assert_error_within(out.detach().cpu(), gold[0], base[0], msg=f"out. {rep}")
    lse, gold_lse = stats.detach().cpu()[..., 0].double(), gold[1][..., 0].double()
    empty = gold_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), f"lse -inf rows differ from the reference's empty rows. {rep}"
    torch.testing.assert_close(lse[~empty], gold_lse[~empty], atol=2e-2, rtol=2e-3, msg=lambda m: f"{m}. {rep}")
    # dQ and dK also carry FlashAttention's delta-from-rounded-O term, which PyTorch's error does not bound
    floors = delta_convention_floors(q, k, out, gold[0], do, probabilities(q, k, kw), q.shape[-1] ** -0.5)
    extra = dict(zip(("dq", "dk"), floors))
    for name, got, g_ref, b_ref in zip(("dq", "dk", "dv", "dsink"), grads, gold[2:], base[2:]):
        if g_ref is not None:
            assert_error_within(got.detach().cpu().to(g_ref.dtype), g_ref, b_ref, floor=FLOOR[b_ref.dtype] +
                                extra.get(name, 0.0), msg=f"{name}. {rep}")


@pytest.mark.parametrize("kind", ["float", "bool", "dropout", "seq_len_q"])
@pytest.mark.parametrize("d, d_v", [(24, 8), (40, 8), (72, 24), (8, 40)])
def test_unequal_head_dims_neither_a_power_of_two(d, d_v, kind, target):
    """d and d_v that both pad their tiles, to different widths: seeds 34, 153, 262, 281 and 291 above (d 24
    or 40, d_v 8, with a bias, dropout or per-batch query lengths) were wrong on Triton 3.6's GPU kernels
    (NaN, errors of 0.3-1.4, an illegal address; session 27) while the interpreter and 3.9 were right;
    ``backends/triton/args.head_blocks`` now gives both dims one tile width there. Forward and the three
    gradients against float64, FlashAttention's rule (dropout: the same mask in the reference)."""
    device, backend = target
    gen = torch.Generator().manual_seed(d * 100 + d_v)
    b, h, s_q, s_kv = 2, 2, 37, 45
    q, k, v, do = (torch.randn(*shape, generator=gen).to(device, torch.float16)
                   for shape in ((b, h, s_q, d), (b, h, s_kv, d), (b, h, s_kv, d_v), (b, h, s_q, d_v)))
    if kind == "float":
        kw = {"attn_bias": torch.randn(b, 1, 1, s_kv, generator=gen).to(device, torch.float16)}
    elif kind == "bool":
        kw = {"attn_bias": (torch.rand(b, h, s_q, s_kv, generator=gen) > 0.2).to(device)}
    elif kind == "dropout":
        kw = {"dropout_p": 0.2, "dropout_seed": d, "dropout_offset": d_v}
    else:
        kw = {"seq_len_q": torch.tensor([s_q - 5, 3], dtype=torch.int32).to(device)}
    rep = f"repro: pytest tests/test_feature_combinations.py -k 'unequal and {d}-{d_v} and {kind}'"
    gold = reference(q, k, v, do, kw, torch.float64)
    base = reference(q, k, v, do, kw, q.dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fusedattn.attention(*leaves, backend=backend, **kw)
    grads = torch.autograd.grad(out, leaves, do)
    for name, got, g_ref, b_ref in zip(("out", "dq", "dk", "dv"), (out, *grads), gold[:1] + gold[2:5],
                                       base[:1] + base[2:5]):
        assert_error_within(got.detach().cpu().to(g_ref.dtype), g_ref, b_ref, msg=f"{name}. {rep}")
