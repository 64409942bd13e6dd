"""Seeded random K/V-cache calls (``attention_with_kvcache``) against the float64 reference, sequence by sequence.

Each case draws what a serving loop does: a contiguous or paged cache (pages of 1 to 32 keys, the page table a
random permutation into a container with spare blocks), per-sequence lengths (0 included), new tokens appended
first or not, padded new tokens (``seq_len_q``), bottom-right causal or not, a window, softcap, ALiBi. Every
slot the call must not read holds NaN (past each length in a contiguous cache, unused pages and page tails in a
paged one), so a stray read shows. The expected result of sequence i is the reference on its first
``seq_len_kv[i]`` keys after the append, its ``seq_len_q[i]`` new rows being the last of them; padded rows give
0; the append lands where ``seq_len_kv`` says. (A first run of 200 CPU-path and 80 interpreter cases of this
draw found nothing, session 26.)
"""
import os
import random

import pytest
import torch

import fusedattn
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within

from conftest import target_id

# FUSEDATTN_FUZZ_SEEDS=N draws N cases instead (a longer hunt on a GPU; the default is CI's)
SEEDS = range(int(os.environ.get("FUSEDATTN_FUZZ_SEEDS", "32")))


def draw(seed, device):
    rng = random.Random(1000 + seed)
    gen = torch.Generator().manual_seed(seed)
    b, h_kv = rng.choice([1, 2, 3]), rng.choice([1, 2])
    h_q = h_kv * rng.choice([1, 2, 4])
    d, s_q, s_max = rng.choice([16, 32, 8, 24, 40]), rng.choice([1, 2, 3, 7, 20]), rng.choice([24, 40, 64])
    # odd head dims and d_v != d: the decode kernel pads both (Triton 3.6 miscompiled the portable forward at
    # d 24 / d_v 8, bench/NOTES.md 66)
    d_v = d if rng.random() < 0.7 else rng.choice([8, 16, 32])
    dtype = rng.choice([torch.float16, torch.bfloat16]) if device == "cuda" else \
        rng.choice([torch.float16, torch.float32])
    paged, append = rng.random() < 0.5, rng.random() < 0.5
    block = rng.choice([1, 4, 16, 32]) if paged else 0
    lens = [rng.randint(s_q if append else 0, s_max) for _ in range(b)]
    lq = [rng.randint(0, s_q) for _ in range(b)] if rng.random() < 0.3 else None
    kw = dict(causal=rng.random() < 0.7)
    if rng.random() < 0.2:
        kw["window"] = (rng.choice([-1, 0, 3]), rng.choice([-1, 0, 2]))
    if rng.random() < 0.2:
        kw["softcap"] = 2.0
    if rng.random() < 0.2 and (kw["causal"] or "window" in kw):
        kw["alibi"] = True
    q = torch.randn(b, h_q, s_q, d, generator=gen).to(dtype)
    dense_k = torch.randn(b, h_kv, s_max, d, generator=gen).to(dtype)
    dense_v = torch.randn(b, h_kv, s_max, d_v, generator=gen).to(dtype)
    new = [torch.randn(b, h_kv, s_q, n, generator=gen).to(dtype) for n in (d, d_v)] if append else [None, None]
    return dict(b=b, h_q=h_q, h_kv=h_kv, d=d, d_v=d_v, s_q=s_q, s_max=s_max, dtype=dtype, block=block, lens=lens, lq=lq,
                kw=kw, q=q, dense_k=dense_k, dense_v=dense_v, new=new, gen=gen)


def caches(c):
    """The caches as the call gets them, NaN wherever it must not read."""
    b, h_kv, d, s_max, block = c["b"], c["h_kv"], c["d"], c["s_max"], c["block"]
    if not block:
        k, v = c["dense_k"].clone(), c["dense_v"].clone()
        for i, n in enumerate(c["lens"]):
            k[i, :, n:] = float("nan")
            v[i, :, n:] = float("nan")
        return k, v, None
    pages = (s_max + block - 1) // block
    table = torch.randperm(b * pages + 3, generator=c["gen"])[:b * pages].reshape(b, pages).to(torch.int32)
    k = torch.full((b * pages + 3, h_kv, block, d), float("nan"), dtype=c["dtype"])
    v = torch.full((b * pages + 3, h_kv, block, c["d_v"]), float("nan"), dtype=c["dtype"])
    for i in range(b):
        for p in range(pages):
            rows = slice(p * block, min((p + 1) * block, s_max))
            k[table[i, p], :, :rows.stop - rows.start] = c["dense_k"][i, :, rows]
            v[table[i, p], :, :rows.stop - rows.start] = c["dense_v"][i, :, rows]
    return k, v, table


@pytest.mark.parametrize("seed", SEEDS)
def test_random_cache_call(seed, target):
    device, backend = target
    c = draw(seed, device)
    rep = (f"repro: pytest tests/test_kvcache_combinations.py -k '{target_id(target)}-{seed}]'"
           f" ; b{c['b']} h{c['h_q']}/{c['h_kv']} s_q{c['s_q']} d{c['d']}/{c['d_v']} {str(c['dtype'])[6:]} pages of "
           f"{c['block'] or '-'} append {c['new'][0] is not None} lens {c['lens']} seq_len_q {c['lq']} {c['kw']}")
    k, v, table = caches(c)
    to = (lambda t: t.to(device) if t is not None else None)
    k_dev, v_dev = to(k), to(v)
    out = fusedattn.attention_with_kvcache(
        to(c["q"]), k_dev, v_dev, page_table=to(table), seq_len_kv=to(torch.tensor(c["lens"], dtype=torch.int32)),
        k_new=to(c["new"][0]), v_new=to(c["new"][1]), backend=backend,
        seq_len_q=to(torch.tensor(c["lq"], dtype=torch.int32)) if c["lq"] is not None else None, **c["kw"]).cpu()
    # the logical cache after the append
    want_k, want_v = c["dense_k"].clone(), c["dense_v"].clone()
    for i, n in enumerate(c["lens"]):
        rows = c["s_q"] if c["lq"] is None else c["lq"][i]
        if c["new"][0] is not None:
            want_k[i, :, n - rows:n] = c["new"][0][i, :, :rows]
            want_v[i, :, n - rows:n] = c["new"][1][i, :, :rows]
            if table is None:           # the append landed in the caller's cache
                assert torch.equal(k_dev.cpu()[i, :, n - rows:n], c["new"][0][i, :, :rows]), f"append. {rep}"
        got = out[i:i + 1]
        assert torch.isfinite(got).all(), f"non-finite output in sequence {i}. {rep}"
        if rows == 0 or n == 0:
            assert (got == 0).all(), f"sequence {i} has no new row or no key: output 0. {rep}"
            continue
        if rows < c["s_q"]:
            assert (got[:, :, rows:] == 0).all(), f"padded rows of sequence {i} must be 0. {rep}"
        args = (c["q"][i:i + 1, :, :rows], want_k[i:i + 1, :, :n], want_v[i:i + 1, :, :n])
        gold, _ = attention_reference(*args, causal_alignment="bottom_right", **c["kw"])
        base, _ = attention_reference(*args, causal_alignment="bottom_right", dtype=c["dtype"], **c["kw"])
        assert_error_within(got[:, :, :rows], gold, base, msg=f"sequence {i}. {rep}")
