"""Packed variable-length batches (forward and backward) and paged K/V in the main kernel,
against the same data padded / gathered dense."""
import pytest
import torch

import fusedattn
from fusedattn.backends.cpu import gather_pages
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within


def packed(lens_q, lens_kv, h_q=4, h_kv=2, d=64, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    cq = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=device)
    ck = torch.tensor([0] + torch.tensor(lens_kv).cumsum(0).tolist(), dtype=torch.int32, device=device)
    # rows inside a NaN buffer with room after the last row: a stray write past a sequence shows up
    def buf(n, h):
        t = torch.full((n + 9, h, d), float("nan"), dtype=dtype, device=device)
        t[:n] = torch.randn(n, h, d, generator=gen).to(device, dtype)
        return t[:n]
    return buf(int(cq[-1]), h_q), buf(int(ck[-1]), h_kv), buf(int(ck[-1]), h_kv), cq, ck


VARLEN_CASES = [
    ([5, 17, 1, 30], [9, 17, 4, 33], dict()),
    ([5, 17, 1, 30], [9, 17, 4, 33], dict(causal=True, causal_alignment="bottom_right")),
    ([33, 0, 12], [20, 3, 12], dict(causal=True)),                       # an empty sequence
    ([16, 40], [16, 40], dict(window=(7, 0), alibi=True)),
]


@pytest.mark.parametrize("case", range(len(VARLEN_CASES)), ids=lambda i: f"varlen{i}")
def test_varlen_matches_per_sequence_reference(case, target):
    device, backend = target
    lens_q, lens_kv, kw = VARLEN_CASES[case]
    dtype = torch.float16 if device == "cuda" else torch.float32
    q, k, v, cq, ck = packed(lens_q, lens_kv, dtype=dtype, device=device, seed=case)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fusedattn.attention_varlen(qs, ks, vs, cq, ck, max(lens_q), max(lens_kv), backend=backend, **kw)
    do = torch.randn_like(out)
    out.backward(do)
    for i in range(len(lens_q)):
        a, b = cq[i].item(), cq[i + 1].item()
        c, e = ck[i].item(), ck[i + 1].item()
        if b == a:
            continue
        seq = lambda t, lo, hi: t[lo:hi].transpose(0, 1)[None].detach().cpu()  # noqa: E731
        grads = []
        for dt in (torch.float64, dtype):
            rq, rk, rv = (x.to(dt).requires_grad_() for x in (seq(q, a, b), seq(k, c, e), seq(v, c, e)))
            ro, _ = attention_reference(rq, rk, rv, dtype=dt, **kw)
            ro.backward(seq(do, a, b).to(dt))
            grads.append((ro, rq.grad, rk.grad, rv.grad))
        got = (seq(out, a, b), seq(qs.grad, a, b), seq(ks.grad, c, e), seq(vs.grad, c, e))
        for name, g, gd, gb in zip(("out", "dq", "dk", "dv"), got, *grads):
            assert_error_within(g, gd, gb, msg=f"varlen case {case}, sequence {i}: {name}")


def test_varlen_dropout_equals_padded(target):
    """Packed and padded layouts draw the same dropout mask (counters use max_seqlen)."""
    device, backend = target
    lens = [7, 20, 13]
    q, k, v, cq, ck = packed(lens, lens, device=device)
    out = fusedattn.attention_varlen(q, k, v, cq, ck, 20, 20, dropout_p=0.3, dropout_seed=5, backend=backend)
    pad = lambda t: torch.stack([torch.nn.functional.pad(t[cq[i]:cq[i + 1]], (0, 0, 0, 0, 0, 20 - lens[i]))  # noqa
                                 for i in range(3)]).transpose(1, 2)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    dense = fusedattn.attention(pad(q), pad(k), pad(v), seq_len_q=lens_t, seq_len_kv=lens_t, dropout_p=0.3,
                                dropout_seed=5, backend=backend)
    for i in range(3):
        torch.testing.assert_close(out[cq[i]:cq[i + 1]], dense[i, :, :lens[i]].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", ["decreasing", "past_end", "too_long", "dtype"])
def test_varlen_bad_offsets(bad):
    q, k, v, cq, ck = packed([5, 6], [5, 6])
    if bad == "decreasing":
        cq = torch.tensor([0, 6, 5], dtype=torch.int32)
    elif bad == "past_end":
        cq = torch.tensor([0, 5, 40], dtype=torch.int32)
    elif bad == "too_long":
        pass
    else:
        cq = cq.float()
    with pytest.raises((ValueError, TypeError), match="cu_seqlens_q|max_seqlen"):
        fusedattn.attention_varlen(q, k, v, cq, ck, 3 if bad == "too_long" else 6, 6)


@pytest.mark.parametrize("page_size", [8, 16, 32, 64])  # 8: below a tile (a table read per key); others: one per tile
def test_paged_forward_equals_dense(page_size, target):
    device, backend = target
    gen = torch.Generator().manual_seed(page_size)
    b, h, h_kv, d, n_pages = 3, 4, 2, 64, 24
    max_blocks = 128 // page_size
    kc = torch.randn(n_pages, h_kv, page_size, d, generator=gen).to(device)
    vc = torch.randn(n_pages, h_kv, page_size, d, generator=gen).to(device)
    table = torch.stack([torch.randperm(n_pages, generator=gen)[:max_blocks] for _ in range(b)]).int().to(device)
    lens = torch.tensor([128, 1, 77], dtype=torch.int32, device=device)
    q = torch.randn(b, h, 9, d, generator=gen).to(device)
    kw = dict(seq_len_kv=lens, causal=True, causal_alignment="bottom_right")
    table_k = table.t().contiguous().t()            # column-major, as the seed's transposed table
    out, _ = fusedattn.attention_forward(q, kc, vc, page_table_k=table_k, page_table_v=table.view(b, 1, -1, 1),
                                         backend=backend, **kw)
    kd, vd = gather_pages(kc, table), gather_pages(vc, table)
    gold, _ = attention_reference(q.cpu(), kd.cpu(), vd.cpu(), **{n: (t.cpu() if isinstance(t, torch.Tensor) else t)
                                                                   for n, t in kw.items()})
    assert (out.cpu().double() - gold).abs().max() < 1e-4


def test_paged_bad_tables():
    kc = torch.randn(4, 2, 16, 64)
    q = torch.randn(2, 2, 3, 64)
    with pytest.raises(TypeError, match="page_table_k must be int32"):
        fusedattn.attention_forward(q, kc, kc, page_table_k=torch.zeros(2, 2), page_table_v=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="page_table_k must have shape"):
        t = torch.zeros(3, 2, dtype=torch.int32)
        fusedattn.attention_forward(q, kc, kc, page_table_k=t, page_table_v=t)
