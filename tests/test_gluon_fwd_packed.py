"""Packed queries over a K/V cache on the Gluon sm_90 forward's packed mode (fwd_sm90 [Note] packed
queries; issue 25 items 2-3): ``attention_with_kvcache(q [total, h_q, d], ..., cu_seqlens_q=)`` with the
kernel reading and writing each sequence's rows in place, over paged or contiguous caches.

Seeded random cases: sequences of 0, 1, 63-65, 127-129 and odd numbers of new tokens (a sequence's last
tile goes out by masked stores, whole tiles by TMA), keys shorter or longer than the queries, GQA, head dims
64 / 128 / 256, bottom-right causal or none, ALiBi, both grids; the output buffer NaN-filled with spare rows
past cu_seqlens_q[-1], which must stay NaN. Each sequence against its float64 reference by FlashAttention's
rule, LSE too, and the packed launch checked to have run. Every failure message carries a one-line repro.
GPU-only (Hopper): skipped, visibly, elsewhere.
"""
import random

import pytest
import torch

import fusedattn
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within, assert_lse_close

# pytestmark: the paged tests' marks (GPU only, Hopper only: skipped visibly elsewhere)
from test_gluon_fwd_paged import pytestmark, scatter_pages, shuffled_table  # noqa: F401

EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129]


def run_packed(seed, nodeid, monkeypatch, *, b, h_q, h_kv, d, page, lens_q, lens_kv, causal, alibi, persistent,
               dtype=torch.bfloat16, spare=3):
    from fusedattn.backends.gluon import fwd_sm90
    msg = (f"repro: pytest '{nodeid}' ; seed={seed} b={b} h={h_q}/{h_kv} d={d} page={page} lens_q={lens_q} "
           f"lens_kv={lens_kv} causal={causal} alibi={alibi} persistent={persistent}")
    launches = []
    real = fwd_sm90.launch_fwd_sm90

    def spy(p, *a, **kw):
        launches.append(kw.get("cu_seqlens_q") is not None)
        return real(p, *a, **{**kw, "persistent": persistent})
    monkeypatch.setattr(fwd_sm90, "launch_fwd_sm90", spy)
    gen = torch.Generator().manual_seed(seed)
    s_kv = max(max(lens_kv), 1)
    k, v = (torch.randn(b, s_kv, h_kv, d, generator=gen).to("cuda", dtype).transpose(1, 2) for _ in range(2))
    if page:
        table = shuffled_table(b, -(-s_kv // page), gen).cuda()
        k_cache, v_cache = scatter_pages(k, table, page), scatter_pages(v, table, page)
    else:
        table = None
        # a contiguous cache with NaN in every slot past the sequence's keys
        k_cache, v_cache = (torch.nn.functional.pad(t, (0, 0, 0, 37), value=float("nan")) for t in (k, v))
        for i, n in enumerate(lens_kv):
            k_cache[i, :, n:] = float("nan")
            v_cache[i, :, n:] = float("nan")
    total = sum(lens_q)
    q = torch.randn(total + spare, h_q, d, generator=gen).to("cuda", dtype)
    cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out = torch.full((total + spare, h_q, d), float("nan"), dtype=dtype, device="cuda")
    seq_kv = torch.tensor(lens_kv, dtype=torch.int32, device="cuda")
    _, stats = fusedattn.attention_with_kvcache(
        q, k_cache, v_cache, page_table=table, seq_len_kv=seq_kv, cu_seqlens_q=cu, max_seqlen_q=max(max(lens_q), 1),
        causal=causal, alibi=alibi, return_stats=True, out=out)
    torch.cuda.synchronize()
    assert launches == [True], f"the Gluon forward's packed mode did not take the call ({launches}). {msg}"
    assert torch.isnan(out[total:].float()).all(), f"rows past cu_seqlens_q[-1] were written. {msg}"
    for i in range(b):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if lens_q[i] == 0:
            continue
        if lens_kv[i] == 0:
            # no key at all: output 0 and LSE -inf (the log of an empty sum), the package's convention
            assert (out[rows] == 0).all(), f"sequence {i} (no key): output not 0. {msg}"
            assert (stats[:, rows] == float("-inf")).all(), f"sequence {i} (no key): LSE not -inf. {msg}"
            continue
        qi = q[rows].transpose(0, 1)[None].cpu()
        ki, vi = k[i:i + 1, :, :lens_kv[i]].cpu(), v[i:i + 1, :, :lens_kv[i]].cpu()
        ref = dict(causal=causal, causal_alignment="bottom_right", alibi=alibi)
        gold_o, gold_lse = attention_reference(qi, ki, vi, **ref)
        base_o, _ = attention_reference(qi, ki, vi, dtype=dtype, **ref)
        got = out[rows].transpose(0, 1)[None].cpu()
        assert torch.isfinite(got.float()).all(), f"sequence {i}: non-finite output. {msg}"
        assert_error_within(got, gold_o.nan_to_num(0.0), base_o.nan_to_num(0.0), msg=f"sequence {i}. {msg}")
        assert_lse_close(stats[:, rows][None, ..., None].cpu().double(), gold_lse, msg=f"sequence {i}. {msg}")


@pytest.mark.parametrize("page", [None, 16, 64, 256])
@pytest.mark.parametrize("persistent", [False, True])
def test_gluon_packed_edge_lengths(page, persistent, request, monkeypatch):
    """Every edge length of a sequence's new tokens (0, 1, around one and two 64-row halves of a 128-row
    tile) in one call, keys 0 to a few hundred more than the queries, GQA 8/2, d=128, bottom-right causal."""
    lens_q = EDGE_LENGTHS
    lens_kv = [n + extra for n, extra in zip(lens_q, [5, 0, 300, 64, 1, 200, 0, 77])]
    run_packed(11, request.node.nodeid, monkeypatch, b=len(lens_q), h_q=8, h_kv=2, d=128, page=page, lens_q=lens_q,
               lens_kv=lens_kv, causal=True, alibi=False, persistent=persistent)


@pytest.mark.parametrize("seed", range(12))
def test_gluon_packed_random(seed, request, monkeypatch):
    """Random batches: 1-5 sequences of edge or random lengths (up to 400), keys shorter than the queries
    too (rows with no key: output 0, LSE -inf), GQA, d 128/256 (the plan gives d=64 with lengths to the
    portable kernel), pages 16-256 or none, causal or not, ALiBi, either grid, fp16 or bf16."""
    rng = random.Random(seed)
    b = rng.randint(1, 5)
    h_kv = rng.choice([1, 2, 4])
    h_q = h_kv * rng.choice([1, 2, 4])
    d = rng.choice([128, 256])
    page = rng.choice([None, 16, 64, 256])
    lens_q = [rng.choice(EDGE_LENGTHS + [rng.randint(1, 400)]) for _ in range(b)]
    lens_kv = [max(0, n + rng.choice([0, rng.randint(1, 500), -rng.randint(0, 40)])) for n in lens_q]
    run_packed(seed, request.node.nodeid, monkeypatch, b=b, h_q=h_q, h_kv=h_kv, d=d, page=page, lens_q=lens_q,
               lens_kv=lens_kv, causal=rng.random() < 0.7, alibi=rng.random() < 0.3,
               persistent=rng.choice([False, True]), dtype=rng.choice([torch.float16, torch.bfloat16]))


@pytest.mark.parametrize("seed", range(8))
def test_gluon_packed_keys_varlen(seed, request, monkeypatch):
    """``attention_varlen`` (FlashAttention's ``flash_attn_varlen_func`` layout: packed queries AND keys) on the
    packed mode with packed keys: edge and random lengths (0 and keys shorter than queries too), GQA, d 128 /
    256, causal top-left or bottom-right, a window, ALiBi, either grid; each sequence against float64, LSE too,
    a NaN key row past the last sequence never reaching a result, and the gradients (the
    portable VARLEN backward on this forward's LSE) against float64 by the same rule."""
    from fusedattn.backends.gluon import fwd_sm90
    rng = random.Random(100 + seed)
    b = rng.randint(1, 5)
    h_kv = rng.choice([1, 2, 4])
    h_q = h_kv * rng.choice([1, 2, 4])
    d = rng.choice([128, 256])
    dtype = rng.choice([torch.float16, torch.bfloat16])
    lens_q = [rng.choice(EDGE_LENGTHS + [rng.randint(1, 300)]) for _ in range(b)]
    lens_kv = [max(0, n + rng.choice([0, rng.randint(1, 300), -rng.randint(0, 40)])) for n in lens_q]
    mask = rng.choice(["none", "causal-tl", "causal-br", "window"])
    opts = {"none": {}, "causal-tl": dict(causal=True), "causal-br": dict(causal=True, causal_alignment="bottom_right"),
            "window": dict(window=(rng.randint(0, 90), rng.randint(0, 40)), causal_alignment="bottom_right")}[mask]
    alibi = rng.random() < 0.3
    persistent = rng.choice([False, True])
    msg = (f"repro: pytest '{request.node.nodeid}' ; seed={seed} b={b} h={h_q}/{h_kv} d={d} {dtype} lens_q={lens_q} "
           f"lens_kv={lens_kv} {opts} alibi={alibi} persistent={persistent}")
    launches = []
    real = fwd_sm90.launch_fwd_sm90

    def spy(p, *a, **kw):
        launches.append((kw.get("cu_seqlens_q") is not None, kw.get("cu_seqlens_kv") is not None))
        return real(p, *a, **{**kw, "persistent": persistent})
    monkeypatch.setattr(fwd_sm90, "launch_fwd_sm90", spy)
    gen = torch.Generator().manual_seed(seed)
    # FlashAttention's offsets are back to back; one NaN row past the last sequence's keys, inside the tensor,
    # is what a key tile reaching past that sequence meets (masked in K, zeroed in V: never in a result)
    total_k, total_q = sum(lens_kv), sum(lens_q)
    k_cat, v_cat = (torch.cat([torch.randn(total_k, h_kv, d, generator=gen),
                               torch.full((1, h_kv, d), float("nan"))]).to(dtype) for _ in range(2))
    q = torch.randn(total_q, h_q, d, generator=gen).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_kv = torch.tensor([0, *torch.tensor(lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k_cat, v_cat))
    out, stats = fusedattn.attention_varlen(qc, kc, vc, cu_q.cuda(), cu_kv.cuda(), max(max(lens_q), 1),
                                            max(max(lens_kv), 1), alibi=alibi, return_stats=True, **opts)
    torch.cuda.synchronize()
    # no query row at all: nothing to launch (a TMA descriptor needs rows)
    expected = [(True, True)] if total_q else []
    assert launches == expected, f"the Gluon forward's packed mode: launches {launches}, expected {expected}. {msg}"
    do = torch.randn(out.shape, generator=gen).to(dtype).cuda()
    dq, dk, dv = torch.autograd.grad(out, (qc, kc, vc), do)
    ref = dict(alibi=alibi, **opts)
    for i in range(b):
        rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_kv[i]), int(cu_kv[i + 1]))
        if lens_q[i] == 0:
            continue
        if lens_kv[i] == 0:
            assert (out[rq] == 0).all() and (stats[:, rq] == float("-inf")).all(), f"sequence {i} (no key). {msg}"
            continue
        qi, ki, vi = (t[r].transpose(0, 1)[None].detach().cpu().double().requires_grad_()
                      for t, r in ((q, rq), (k_cat, rk), (v_cat, rk)))
        gold_o, gold_lse = attention_reference(qi, ki, vi, **ref)
        base_o, _ = attention_reference(qi.to(dtype), ki.to(dtype), vi.to(dtype), dtype=dtype, **ref)
        got = out[rq].transpose(0, 1)[None].detach().cpu()
        assert torch.isfinite(got.float()).all(), f"sequence {i}: non-finite output. {msg}"
        assert_error_within(got, gold_o.detach().nan_to_num(0.0), base_o.nan_to_num(0.0), msg=f"sequence {i}. {msg}")
        assert_lse_close(stats[:, rq][None, ..., None].cpu().double(), gold_lse.detach(), msg=f"sequence {i}. {msg}")
        dO = do[rq].transpose(0, 1)[None].cpu().double()
        gq, gk, gv = torch.autograd.grad(gold_o.nan_to_num(0.0), (qi, ki, vi), dO)
        for name, got_g, gold_g in (("dq", dq[rq], gq), ("dk", dk[rk], gk), ("dv", dv[rk], gv)):
            got_g = got_g.transpose(0, 1)[None].cpu()
            assert torch.isfinite(got_g.float()).all(), f"sequence {i}: non-finite {name}. {msg}"
            err = (got_g.double() - gold_g).abs().max().item()
            scale = gold_g.abs().max().item()
            assert err <= 2e-2 * scale + 1e-2, f"sequence {i}: {name} error {err:.3g} (max |{name}| {scale:.3g}). {msg}"
