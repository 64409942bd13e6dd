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


# ----------------------------------------------------------------------------- variable-length queries over a cache
# (issue 25 item 2): padded (seq_len_q) or packed (cu_seqlens_q) new tokens against a contiguous or paged cache,
# appended in the same call, bottom-right causal per sequence

def _cache_case(seed, paged, device, dtype, d=24, d_v=40, lens_before=(5, 0, 30), lens_new=(3, 1, 6)):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)  # noqa: E731
    b, h_q, h_kv, page = len(lens_before), 4, 2, 16
    if paged:
        kc, vc = mk(12, h_kv, page, d), mk(12, h_kv, page, d_v)
        table = torch.randperm(12, generator=gen)[:3 * b].view(b, 3).to(device, torch.int32)
    else:
        kc, vc, table = mk(b, h_kv, 48, d), mk(b, h_kv, 48, d_v), None
    s = max(lens_new)
    q, kn, vn = mk(b, h_q, s, d), mk(b, h_kv, s, d), mk(b, h_kv, s, d_v)
    return dict(kc=kc, vc=vc, table=table, q=q, kn=kn, vn=vn, before=list(lens_before), new=list(lens_new))


def _dense_after(c, i):
    """Sequence i's keys/values after its append, from the case's original caches."""
    if c["table"] is not None:
        k = torch.cat([c["kc"][j] for j in c["table"][i].tolist()], 1)
        v = torch.cat([c["vc"][j] for j in c["table"][i].tolist()], 1)
    else:
        k, v = c["kc"][i].clone(), c["vc"][i].clone()
    n0, n = c["before"][i], c["new"][i]
    k[:, n0:n0 + n], v[:, n0:n0 + n] = c["kn"][i, :, :n], c["vn"][i, :, :n]
    return k[:, :n0 + n], v[:, :n0 + n]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("packed", [False, "packed-kernel", "padded"],
                         ids=["seq_len_q", "cu_seqlens_q", "cu_seqlens_q-padded"])
@pytest.mark.parametrize("long", [False, True], ids=["decode", "prefill"])
def test_varlen_queries_over_cache_with_append(paged, packed, long, target, monkeypatch):
    """Every sequence's new tokens attend to its cache plus themselves (bottom-right causal), against float64;
    the appended keys land in the cache; padded rows give 0; slopes [b, h] on the paged cases. Packed queries
    both ways the Triton path can run them: the packed (VARLEN) kernel, and gathered into a padded batch
    (``kvcache.PAD_PACKED_MAX_WASTE``, forced here either way)."""
    from fusedattn import kvcache
    monkeypatch.setattr(kvcache, "PAD_PACKED_MAX_WASTE", 100.0 if packed == "padded" else -1.0)
    route, packed = packed, bool(packed)
    device, backend = target
    dtype = torch.float16 if device == "cuda" else torch.float32
    new = (3, 40, 17) if long else (3, 1, 6)         # 40 tokens x g = 2: 80 rows, the tiled forward (prefill)
    c = _cache_case(13 + paged + 2 * packed, paged, device, dtype, lens_before=(5, 0, 30) if not long else (5, 2, 30),
                    lens_new=new)
    orig = {n: c[n].clone() for n in ("kc", "vc")}
    b = len(new)
    lens = torch.tensor([x + y for x, y in zip(c["before"], new)], dtype=torch.int32, device=device)
    slopes = torch.rand(b, 4, generator=torch.Generator().manual_seed(1)).to(device) if paged else False
    kw = dict(page_table=c["table"], seq_len_kv=lens, alibi=slopes, return_stats=True, backend=backend)
    repro = f"repro: paged={paged} packed={route} long={long} target={target}"
    if packed:
        cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=device)
        pack = lambda t: torch.cat([t[i, :, :new[i]].transpose(0, 1) for i in range(b)])  # noqa: E731
        out, stats = fusedattn.attention_with_kvcache(pack(c["q"]), c["kc"], c["vc"], k_new=pack(c["kn"]),
                                                      v_new=pack(c["vn"]), cu_seqlens_q=cu, max_seqlen_q=max(new),
                                                      **kw)
        assert out.shape == (sum(new), 4, 40) and stats.shape == (4, sum(new)), repro
    else:
        lq = torch.tensor(new, dtype=torch.int32, device=device)
        out, stats = fusedattn.attention_with_kvcache(c["q"], c["kc"], c["vc"], k_new=c["kn"], v_new=c["vn"],
                                                      seq_len_q=lq, **kw)
    now = dict(c)
    c.update(orig)                                   # the reference starts from the caches before the call
    row = 0
    for i in range(b):
        n = new[i]
        k, v = (t.cpu() for t in _dense_after(c, i))
        kn_cache = (torch.cat([now["kc"][j] for j in c["table"][i].tolist()], 1) if paged else now["kc"][i]).cpu()
        n0 = c["before"][i]
        assert torch.equal(kn_cache[:, n0:n0 + n], c["kn"][i, :, :n].cpu()), f"append of sequence {i}. {repro}"
        al = slopes[i].cpu() if paged else False
        res = [attention_reference(c["q"][i:i + 1, :, :n].cpu(), k[None], v[None], causal=True,
                                   causal_alignment="bottom_right", alibi=al, dtype=dt) for dt in (torch.float64, dtype)]
        got = out[row:row + n].transpose(0, 1)[None] if packed else out[i:i + 1, :, :n]
        got_lse = stats[:, row:row + n][None] if packed else stats[i:i + 1, :, :n, 0]
        row += n
        assert_error_within(got.cpu(), res[0][0], res[1][0], msg=f"sequence {i}. {repro}")
        torch.testing.assert_close(got_lse.cpu(), res[0][1][..., 0].float(), atol=2e-3, rtol=1e-3)
        if not packed:
            assert (out[i, :, n:] == 0).all(), f"padded rows of sequence {i} must be 0. {repro}"


def test_varlen_queries_over_cache_bad_input(target):
    """seq_len_q / cu_seqlens_q: clear errors naming the argument; validate=False trusts them."""
    device, backend = target
    c = _cache_case(3, True, device, torch.float32)
    lens = torch.tensor([8, 1, 36], dtype=torch.int32, device=device)
    kw = dict(page_table=c["table"], seq_len_kv=lens, backend=backend)
    q3 = c["q"][:, :, :4].transpose(1, 2).reshape(-1, 4, 24)         # 12 packed rows
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    cases = [
        (dict(seq_len_q=i32(3, 9, 1)), ValueError, r"seq_len_q\[1\] = 9 is outside \[0, s_q\] = \[0, 6\]"),
        (dict(seq_len_q=i32(3, 2, 1), k_new=c["kn"], v_new=c["vn"]), ValueError,
         r"seq_len_kv\[1\] = 1 < 2 new tokens of sequence 1 \(seq_len_q\)"),
    ]
    for extra, err, pat in cases:
        with pytest.raises(err, match=pat):
            fusedattn.attention_with_kvcache(c["q"], c["kc"], c["vc"], **kw, **extra)
    packed_cases = [
        (dict(cu_seqlens_q=i32(0, 4, 2, 12), max_seqlen_q=10), ValueError, r"cu_seqlens_q must be non-decreasing"),
        (dict(cu_seqlens_q=i32(1, 4, 8, 12), max_seqlen_q=4), ValueError, r"cu_seqlens_q\[0\] = 1"),
        (dict(cu_seqlens_q=i32(0, 4, 8, 13), max_seqlen_q=5), ValueError, r"cu_seqlens_q\[-1\] = 13 exceeds the 12"),
        (dict(cu_seqlens_q=i32(0, 4, 8, 12), max_seqlen_q=3), ValueError, r"more than max_seqlen_q = 3"),
        (dict(cu_seqlens_q=torch.tensor([0, 4, 8, 12], device=device), max_seqlen_q=4), TypeError,
         r"cu_seqlens_q must be an int32 tensor"),
        (dict(cu_seqlens_q=i32(0, 4, 8, 12), max_seqlen_q=4, seq_len_q=i32(1, 1, 1)), ValueError,
         r"seq_len_q and cu_seqlens_q"),
    ]
    for extra, err, pat in packed_cases:
        with pytest.raises(err, match=pat):
            fusedattn.attention_with_kvcache(q3, c["kc"], c["vc"], **kw, **extra)
    # trusted metadata: no check, no error, nothing out of bounds (lengths clamped)
    out = fusedattn.attention_with_kvcache(c["q"], c["kc"], c["vc"], seq_len_q=i32(3, 9, 1), validate=False, **kw)
    assert not torch.isnan(out).any()


def test_packed_queries_over_cache_route(target, monkeypatch):
    """A packed batch whose padding would add at most PAD_PACKED_MAX_WASTE of rows runs padded (on Hopper the
    Gluon forward reads the paged cache; the packed kernel is the portable one); a skewed one stays packed.
    Rows past cu_seqlens_q[-1] are left as they were, both ways."""
    from fusedattn import kvcache
    device, backend = target
    if backend == "cpu":
        pytest.skip("the CPU path pads every packed batch: the route is the Triton path's")
    dtype = torch.float16 if device == "cuda" else torch.float32
    calls = []
    real = kvcache._Call._run_packed_padded
    monkeypatch.setattr(kvcache._Call, "_run_packed_padded", lambda self, *a: (calls.append(1), real(self, *a)))
    for new, padded in (((40, 38, 40), True), ((40, 2, 3), False)):
        calls.clear()
        c = _cache_case(5, True, device, dtype, lens_before=(5, 2, 8), lens_new=new)
        b, total = len(new), sum(new)
        lens = torch.tensor([x + y for x, y in zip(c["before"], new)], dtype=torch.int32, device=device)
        cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=device)
        pack = lambda t: torch.cat([t[i, :, :new[i]].transpose(0, 1) for i in range(b)])  # noqa: E731
        spare = 2                                       # two packed rows past cu_seqlens_q[-1]
        extend = lambda t: torch.cat([pack(t), torch.zeros(spare, *t.shape[1:2], t.shape[3],  # noqa: E731
                                                          dtype=dtype, device=device)])
        out = torch.full((total + spare, 4, 40), float("nan"), dtype=dtype, device=device)
        got = fusedattn.attention_with_kvcache(extend(c["q"]), c["kc"], c["vc"], k_new=extend(c["kn"]),
                                               v_new=extend(c["vn"]),
                                               cu_seqlens_q=cu, max_seqlen_q=max(new), page_table=c["table"],
                                               seq_len_kv=lens, backend=backend, out=out)
        assert bool(calls) == padded, f"new={new}: padded route {bool(calls)}, expected {padded}"
        assert got.data_ptr() == out.data_ptr()
        assert not out[:total].isnan().any() and out[total:].isnan().all(), f"new={new}"


@pytest.mark.parametrize("mask", ["causal", "window", "alibi", "softcap-sink", "noncausal-window"])
def test_padded_route_rows_right_aligned_match_the_packed_kernel(mask, target, monkeypatch):
    """The padded route puts each sequence's rows at the end of its padded block and runs the kernel with no
    query lengths (bottom-right alignment then needs none): every mask that depends on a row's position
    (causal, a window, ALiBi's stats, which shift by slope * (s_q - n)) must come out as the packed kernel
    computes it, row for row, outputs and stats. Lengths of 1..max, a sequence with no new token, and a
    prefill-sized block (the tiled forward) and a decode-sized one (the split-KV kernel)."""
    from fusedattn import kvcache
    device, backend = target
    if backend == "cpu":
        pytest.skip("the CPU path pads every packed batch: the route is the Triton path's")
    dtype = torch.float16 if device == "cuda" else torch.float32
    kw = {"causal": dict(), "window": dict(window=(5, 0)), "alibi": dict(alibi=True),
          "softcap-sink": dict(softcap=20.0, sink=torch.randn(4, generator=torch.Generator().manual_seed(3))),
          "noncausal-window": dict(causal=False, window=(4, 2))}[mask]
    if "sink" in kw:
        kw["sink"] = kw["sink"].to(device)
    for new in ((40, 17, 0, 13), (3, 1, 2, 3)):       # caches of 48 keys (3 pages of 16)
        c = _cache_case(7, True, device, dtype, lens_before=(5, 2, 8, 30), lens_new=new)
        b = len(new)
        lens = torch.tensor([x + y for x, y in zip(c["before"], new)], dtype=torch.int32, device=device)
        cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=device)
        pack = lambda t: torch.cat([t[i, :, :new[i]].transpose(0, 1) for i in range(b)])  # noqa: E731
        results = {}
        for route, waste in (("padded", 100.0), ("packed", -1.0)):
            monkeypatch.setattr(kvcache, "PAD_PACKED_MAX_WASTE", waste)
            results[route] = fusedattn.attention_with_kvcache(
                pack(c["q"]), c["kc"], c["vc"], cu_seqlens_q=cu, max_seqlen_q=max(new), page_table=c["table"],
                seq_len_kv=lens, backend=backend, return_stats=True, **kw)
        repro = f"repro: mask={mask} new={new} target={target}"
        (o_pad, st_pad), (o_pk, st_pk) = results["padded"], results["packed"]
        assert not o_pad.isnan().any() and not st_pad.isnan().any(), repro
        torch.testing.assert_close(o_pad.float(), o_pk.float(), atol=2e-3, rtol=2e-3, msg=lambda m: f"{m}. {repro}")
        finite = torch.isfinite(st_pk)
        assert torch.equal(finite, torch.isfinite(st_pad)), f"rows with no key differ. {repro}"
        torch.testing.assert_close(st_pad[finite], st_pk[finite], atol=1e-4, rtol=1e-4, msg=lambda m: f"{m}. {repro}")
