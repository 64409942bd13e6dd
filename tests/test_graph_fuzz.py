"""Seeded random graphs through the cuDNN door (``import fusedattn as cudnn``), forward and backward.

tests/test_graph.py checks each sdpa / sdpa_backward argument on chosen cases; this draws whole graphs the way
cuDNN frontend's own tests build them (``test_mhas.py``): BHSD or BSHD memory, GQA / MQA, d_v != d, FLOAT or
HALF io, an attn_scale, a mask in any of cuDNN's spellings (use_causal_mask, use_causal_mask_bottom_right,
diagonal_alignment with diagonal_band_left_bound / right_bound), padding (use_padding_mask with seq_len_q /
seq_len_kv tensors), a float bias of a broadcast shape, use_alibi_mask, generate_stats, and a backward graph
over the forward's O and Stats. The reference is written in cuDNN's terms (``test_graph.cudnn_keep_mask``,
the bounds of cuDNN's compute_ref; ALiBi from the seed's get_alibi_slopes) and folded into one float bias
(-inf where cuDNN masks) for ``fusedattn.reference.attention_reference``, float64 and the io precision, so each
output, Stats row (-inf where a row keeps no key, as cuDNN 9.14+) and gradient is held to FlashAttention's rule.
"""
import os
import random

import pytest
import torch

import fusedattn as cudnn
from fusedattn.graph import graphs as graphs_module
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within

from conftest import target_id
from test_graph import cudnn_keep_mask, seed_alibi_slopes

# FUSEDATTN_FUZZ_SEEDS=N draws N cases instead (a longer hunt; the default is CI's)
SEEDS = range(int(os.environ.get("FUSEDATTN_FUZZ_SEEDS", "32")))
MASKS = ["none", "causal", "causal_bottom_right", "band"]


def draw(seed, device):
    """(tensors, sdpa keyword arguments for the graph, reference pieces, description) of case ``seed``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    b, h_kv = rng.choice([1, 2, 3]), rng.choice([1, 2])
    h_q = h_kv * rng.choice([1, 2, 4])
    s_q, s_kv = rng.choice([1, 7, 16, 33]), rng.choice([1, 9, 16, 40])
    d = rng.choice([8, 16, 32, 64])
    d_v = d if rng.random() < 0.75 else rng.choice([16, 32])
    half = device == "cuda" or rng.random() < 0.5
    dtype = torch.float16 if half else torch.float32
    bshd = rng.random() < 0.5

    def make(shape):        # [b, h, s, d] logical; BSHD memory when drawn (cuDNN takes any strides)
        if bshd:
            return torch.randn(shape[0], shape[2], shape[1], shape[3], generator=gen).to(device, dtype).transpose(1, 2)
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, k, v = make((b, h_q, s_q, d)), make((b, h_kv, s_kv, d)), make((b, h_kv, s_kv, d_v))
    do = make((b, h_q, s_q, d_v))
    scale = rng.choice([d ** -0.5, 0.1, 1.0])
    sdpa_kw, ref = {"attn_scale": scale}, {"alignment": "top_left", "left": None, "right": None}
    mask = rng.choice(MASKS)
    if mask == "causal":
        sdpa_kw["use_causal_mask"] = True
        ref["right"] = 0
    elif mask == "causal_bottom_right":
        sdpa_kw["use_causal_mask_bottom_right"] = True
        ref.update(alignment="bottom_right", right=0)
    elif mask == "band":
        bottom = rng.random() < 0.5
        left, right = rng.choice([None, 1, 3, 12]), rng.choice([None, 0, 2])   # cuDNN: left >= 1
        if left is None and right is None:
            right = 1
        if bottom:
            sdpa_kw["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
        if left is not None:
            sdpa_kw["diagonal_band_left_bound"] = left
        if right is not None:
            sdpa_kw["diagonal_band_right_bound"] = right
        ref.update(alignment="bottom_right" if bottom else "top_left", left=left, right=right)
    tensors = {"q": q, "k": k, "v": v, "do": do}
    if rng.random() < 0.3:
        tensors["seq_len_q"] = torch.randint(1, s_q + 1, (b, 1, 1, 1), generator=gen, dtype=torch.int32).to(device)
        tensors["seq_len_kv"] = torch.randint(1, s_kv + 1, (b, 1, 1, 1), generator=gen, dtype=torch.int32).to(device)
        sdpa_kw["use_padding_mask"] = True
    if rng.random() < 0.25:
        shape = rng.choice([(1, 1, s_q, s_kv), (b, 1, s_q, s_kv), (1, h_q, s_q, s_kv), (b, h_q, s_q, s_kv)])
        tensors["bias"] = torch.randn(*shape, generator=gen).to(device, dtype)
    if rng.random() < 0.2 and mask != "none":
        sdpa_kw["use_alibi_mask"] = True
    described = (f"b{b} h{h_q}/{h_kv} s{s_q}x{s_kv} d{d}/{d_v} {str(dtype)[6:]} {'bshd' if bshd else 'bhsd'} "
                 f"mask={mask} " + ", ".join(f"{n}={x}" for n, x in sdpa_kw.items() if n != "diagonal_alignment")
                 + (" bottom_right" if "diagonal_alignment" in sdpa_kw else "")
                 + "".join(f" {n}={tuple(t.shape)}" for n, t in tensors.items() if n in ("bias", "seq_len_q")))
    return tensors, sdpa_kw, ref, dtype, described


def reference(tensors, sdpa_kw, ref, dtype):
    """(out, lse, dq, dk, dv) in ``dtype`` on the CPU: the cuDNN keep mask, bias and ALiBi as one float bias."""
    q, k, v, do = (tensors[n].detach().cpu() for n in ("q", "k", "v", "do"))
    b, h_q, s_q, _ = q.shape
    s_kv = k.shape[2]
    lens = {n: tensors[n].cpu() if n in tensors else None for n in ("seq_len_q", "seq_len_kv")}
    keep = cudnn_keep_mask(b, s_q, s_kv, ref["alignment"], ref["left"], ref["right"], lens["seq_len_q"],
                           lens["seq_len_kv"])
    bias = torch.zeros(b, h_q, s_q, s_kv, dtype=dtype)
    if "bias" in tensors:
        bias = bias + tensors["bias"].cpu().to(dtype)
    if sdpa_kw.get("use_alibi_mask"):
        i, j = torch.arange(s_q).view(-1, 1), torch.arange(s_kv).view(1, -1)
        bias = bias + (seed_alibi_slopes(h_q).view(1, -1, 1, 1) * (j - i)).to(dtype)
    bias = bias.masked_fill(~keep, float("-inf"))
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, attn_scale=sdpa_kw["attn_scale"], attn_bias=bias, dtype=dtype)
    grads = torch.autograd.grad(out, leaves, do.to(dtype))
    return (out.detach(), lse, *grads)


def run_graphs(tensors, sdpa_kw, dtype, device):
    """The forward graph (O, Stats) and the backward graph (dQ, dK, dV) built and executed as cuDNN's
    test_mhas does, into NaN-filled buffers; returns (o, stats, dq, dk, dv)."""
    io = cudnn.data_type.HALF if dtype == torch.float16 else cudnn.data_type.FLOAT
    extra = [n for n in ("bias", "seq_len_q", "seq_len_kv") if n in tensors]
    q_t, k_t, v_t, do_t = (tensors[n] for n in ("q", "k", "v", "do"))
    b, h_q, s_q, _ = q_t.shape
    d_v = v_t.shape[-1]

    fwd = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                        compute_data_type=cudnn.data_type.FLOAT)
    q, k, v = (fwd.tensor_like(t) for t in (q_t, k_t, v_t))
    ex = {n: fwd.tensor_like(tensors[n]) for n in extra}
    o, stats = fwd.sdpa(q=q, k=k, v=v, generate_stats=True, **sdpa_kw, **ex)
    o_t = torch.full((b, h_q, s_q, d_v), float("nan"), dtype=dtype, device=device)
    st_t = torch.full((b, h_q, s_q, 1), float("nan"), dtype=torch.float32, device=device)
    o.set_output(True).set_dim(o_t.size()).set_stride(o_t.stride())
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    fwd.build()
    fwd.execute({q: q_t, k: k_t, v: v_t, o: o_t, stats: st_t, **{ex[n]: tensors[n] for n in extra}})

    bwd = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                        compute_data_type=cudnn.data_type.FLOAT)
    q, k, v, o, dO, stats = (bwd.tensor_like(t) for t in (q_t, k_t, v_t, o_t, do_t, st_t))
    ex = {n: bwd.tensor_like(tensors[n]) for n in extra}
    dQ, dK, dV = bwd.sdpa_backward(q=q, k=k, v=v, o=o, dO=dO, stats=stats, **sdpa_kw, **ex)
    grads = [torch.full_like(t, float("nan")) for t in (q_t, k_t, v_t)]
    for g, t in zip((dQ, dK, dV), grads):
        g.set_output(True).set_dim(t.size()).set_stride(t.stride())
    bwd.build()
    bwd.execute({q: q_t, k: k_t, v: v_t, o: o_t, dO: do_t, stats: st_t, dQ: grads[0], dK: grads[1], dV: grads[2],
                 **{ex[n]: tensors[n] for n in extra}})
    return (o_t, st_t, *grads)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_graph(seed, target, monkeypatch):
    device, backend = target
    monkeypatch.setattr(graphs_module, "DEFAULT_BACKEND", backend)
    tensors, sdpa_kw, ref, dtype, described = draw(seed, device)
    rep = f"repro: pytest tests/test_graph_fuzz.py -k '{target_id(target)}-{seed}]' ; {described}"
    got = run_graphs(tensors, sdpa_kw, dtype, device)
    gold = reference(tensors, sdpa_kw, ref, torch.float64)
    base = reference(tensors, sdpa_kw, ref, dtype)
    assert_error_within(got[0].cpu(), gold[0], base[0], msg=f"O. {rep}")
    lse, gold_lse = got[1].cpu().double(), gold[1].double()
    empty = gold_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), f"Stats -inf rows differ from the reference's empty rows. {rep}"
    torch.testing.assert_close(lse[~empty], gold_lse[~empty], atol=2e-2, rtol=2e-3, msg=lambda m: f"{m}. {rep}")
    for name, g, gd, bs in zip(("dQ", "dK", "dV"), got[2:], gold[2:], base[2:]):
        assert_error_within(g.cpu().to(gd.dtype), gd, bs, msg=f"{name}. {rep}")
