"""The Gluon sm_90 forward over a paged K/V cache (fwd_sm90 [Note] paged K/V; issue 25 item 3).

Each case scatters a contiguous K/V into shuffled pages of a larger container whose unused slots hold
NaN, then runs ``attention_forward`` with the page tables (as ``attention_with_kvcache``'s prefill
does): pages smaller than a key tile (several TMA boxes per tile), equal to it and larger (several
tiles per page), head dims 64/128/256, GQA, bottom-right causal or no mask, per-sequence key lengths
(0, 1, odd, full) or none, both grids. Checked against the float64 reference by FlashAttention's rule,
bit for bit against the same kernel on the contiguous K/V (the same tiles in the same order), LSE too,
and that the Gluon kernel, not the portable one, ran. Every failure message carries a one-line repro.
GPU-only (Hopper): skipped, visibly, elsewhere.
"""
import random

import pytest
import torch

import fusedattn
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within, assert_lse_close, max_err

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped"),
              pytest.mark.skipif(torch.cuda.is_available() and not HAS_SM90,
                                 reason="the Gluon forward kernel is Hopper-only (compute capability 9.x)")]


def shuffled_table(b, per_seq, gen):
    """int32 [b, per_seq]: distinct block indices in shuffled order, among b * per_seq + b blocks (one
    spare block per sequence, never referenced, so unused blocks exist)."""
    return torch.randperm(b * per_seq + b, generator=gen)[:b * per_seq].to(torch.int32).view(b, per_seq)


def scatter_pages(t, table, page):
    """t [b, h, s, d] written into the pages ``table`` names: a container [blocks, h, page, d] over
    [blocks, page, h, d] memory (the page-major layout caches use); every slot no key lands in (the
    last page's tail, the spare blocks) holds NaN."""
    b, h, s, d = t.shape
    per_seq = table.shape[1]
    n_blocks = b * per_seq + b
    src = torch.nn.functional.pad(t, (0, 0, 0, per_seq * page - s), value=float("nan"))
    src = src.reshape(b, h, per_seq, page, d).permute(0, 2, 3, 1, 4).reshape(b * per_seq, page, h, d)
    container = torch.full((n_blocks, page, h, d), float("nan"), dtype=t.dtype, device=t.device)
    container[table.reshape(-1).long().to(t.device)] = src
    return container.transpose(1, 2)


def table_view(table, pad, gen):
    """``table`` on the GPU as a row-strided view of a wider int32 tensor whose ``pad`` extra columns per
    row name blocks far past any container (a read past the row's end would fetch zeros, not the keys)."""
    if not pad:
        return table.cuda()
    b, per_seq = table.shape
    wide = torch.randint(1 << 20, 1 << 21, (b, per_seq + pad), generator=gen, dtype=torch.int32)
    wide[:, :per_seq] = table
    return wide.cuda()[:, :per_seq]


def run_paged(seed, b, h_q, h_kv, s_q, s_kv, d, page, causal, lens, dtype, nodeid, monkeypatch, persistent=None,
              separate_v=False, table_pad=0, ctas=None, v_warp=None):
    """One case: the paged forward against the float64 reference and, bit for bit, against the same
    kernel on the contiguous K/V. lens: per-sequence key lengths, or None (then s_kv must fill whole
    pages: every key the table reaches is a key). separate_v: V through its own table and container
    (another shuffle); table_pad: the tables are views with that many extra columns per row
    (``table_view``); ctas: the persistent grid's size (its CTAs then run several work tiles each); v_warp:
    V's copies from a second load warp (persistent grid, pages smaller than a tile; None: the default)."""
    from fusedattn.backends.gluon import fwd_sm90
    msg = (f"repro: pytest {nodeid} ; seed={seed} b={b} h={h_q}/{h_kv} s_q={s_q} s_kv={s_kv} d={d} page={page} "
           f"causal={causal} lens={lens} {dtype} persistent={persistent} separate_v={separate_v} "
           f"table_pad={table_pad} ctas={ctas} v_warp={v_warp}")
    per_seq = -(-s_kv // page)
    assert lens is not None or per_seq * page == s_kv, "a case without lengths needs whole pages"
    calls = []
    real = fwd_sm90.launch_fwd_sm90

    def counted(p, *a, **kw):
        calls.append(p.paged)
        if persistent is not None:
            kw["persistent"] = persistent
        if ctas is not None:
            kw["ctas"] = ctas
        if v_warp is not None:
            kw["v_warp"] = v_warp
        return real(p, *a, **kw)

    monkeypatch.setattr(fwd_sm90, "launch_fwd_sm90", counted)
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, s, h, d, generator=gen).to("cuda", dt).transpose(1, 2)
               for s, h in ((s_q, h_q), (s_kv, h_kv), (s_kv, h_kv)))
    table_k = table_view(shuffled_table(b, per_seq, gen), table_pad, gen)
    table_v = table_view(shuffled_table(b, per_seq, gen), table_pad, gen) if separate_v else table_k
    k_pages, v_pages = scatter_pages(k, table_k, page), scatter_pages(v, table_v, page)
    lens_t = torch.tensor(lens if lens is not None else [s_kv] * b, dtype=torch.int32, device="cuda")
    kw = dict(causal=causal, causal_alignment="bottom_right", return_stats=True)
    if lens is not None:
        kw["seq_len_kv"] = lens_t
    out, stats = fusedattn.attention_forward(q, k_pages, v_pages, page_table_k=table_k, page_table_v=table_v, **kw)
    torch.cuda.synchronize()
    assert calls == [True], f"the Gluon forward did not take the paged call ({calls}). {msg}"

    # the reference and the contiguous run see the table's reach (pages * page keys), the tail empty
    reach = per_seq * page
    k_log, v_log = (torch.nn.functional.pad(t, (0, 0, 0, reach - s_kv)) for t in (k, v))
    ref_kw = dict(causal=causal, causal_alignment="bottom_right", seq_len_kv=lens_t.cpu())
    gold_o, gold_lse = attention_reference(q.cpu(), k_log.cpu(), v_log.cpu(), **ref_kw)
    base_o, _ = attention_reference(q.cpu(), k_log.cpu(), v_log.cpu(), dtype=dt, **ref_kw)
    assert_error_within(out.cpu(), gold_o, base_o, msg=msg)
    assert_lse_close(stats.cpu().double(), gold_lse, msg=msg)
    calls.clear()
    out_c, stats_c = fusedattn.attention_forward(q, k_log, v_log, **kw)
    assert calls == [False], f"the contiguous run did not take the Gluon forward ({calls}). {msg}"
    assert torch.equal(out.view(torch.int16), out_c.view(torch.int16)), \
        f"paged differs from contiguous by {max_err(out.cpu(), out_c.cpu()):.3e}. {msg}"
    assert torch.equal(stats, stats_c), f"paged LSE differs from contiguous. {msg}"


@pytest.mark.parametrize("page", [8, 16, 64, 128, 256])
@pytest.mark.parametrize("d", [128, 256])
def test_gluon_fwd_paged_pages_and_dims(page, d, request, monkeypatch):
    """Every page size against both key-tile widths the planner gives the Gluon forward here (128 keys
    at d=128, 64 at d=256: pages of 8..256 keys are 16..1/4 boxes per tile; d=64 masked problems take
    the portable kernel, plan.py), GQA 4/2, bottom-right causal chunked prefill, per-sequence lengths."""
    seed = page * 10 + d
    run_paged(seed, 3, 4, 2, 200, 777, d, page, True, [777, 1, 530], "bfloat16", request.node.nodeid, monkeypatch)


@pytest.mark.parametrize("v_warp", [True, False], ids=["v_warp", "one_load_warp"])
@pytest.mark.parametrize("page", [8, 16, 32])
@pytest.mark.parametrize("d", [128, 256])
def test_gluon_fwd_paged_small_pages_tables(page, d, v_warp, request, monkeypatch):
    """Pages smaller than a key tile, whose table entries the load warp reads a step ahead, K's of one
    tile and V's of the one before in separate lanes (fwd_sm90._page_entries): K and V through different
    tables (a K/V lane mix-up
    shows), the tables row views of wider tensors (a read past a row shows), GQA 4/2, lengths with a
    partial last tile, and the persistent grid on 3 CTAs (each runs several work tiles: the entries are
    read ahead within a work tile only). Both load splits: V's copies from a second warp that follows the
    producer's work tiles (fwd_sm90.PAGED_V_WARP, the default), or all copies from one warp."""
    run_paged(page * 7 + d, 3, 4, 2, 200, 777, d, page, True, [777, 1, 530], "bfloat16", request.node.nodeid,
              monkeypatch, persistent=True, separate_v=True, table_pad=5, ctas=3, v_warp=v_warp)


@pytest.mark.parametrize("page", [128, 256, 512])
@pytest.mark.parametrize("d", [128, 256])
def test_gluon_fwd_paged_large_pages_tables(page, d, request, monkeypatch):
    """Pages of a key tile or more (128-key tiles at d=128, 64 at d=256: 1 to 8 tiles per page), one table
    entry per tile (fwd_sm90._paged_tile_loads: K's of tile j, then V's of tile j - 1): K and V through
    different tables (a K/V or tile mix-up shows), the tables row views of wider tensors (a read past a
    row shows), GQA 4/2, a partial last tile, the persistent grid on 3 CTAs (several work tiles each)."""
    run_paged(page * 3 + d, 3, 4, 2, 200, 777, d, page, True, [777, 1, 530], "bfloat16", request.node.nodeid,
              monkeypatch, persistent=True, separate_v=True, table_pad=5, ctas=3)


@pytest.mark.parametrize("page", [8, 16])
@pytest.mark.parametrize("d", [128, 256])
def test_gluon_fwd_paged_cache_narrower_than_a_tile(page, d, request, monkeypatch):
    """A cache of fewer pages than a key tile has (40 keys: 3 or 5 pages against 8 or 16 per 128-key
    tile, 4 or 8 per 64-key tile): every entry past the table is clamped to its last one, as for the last
    tile of a longer cache; separate K/V tables, no mask and causal, one-tile grid."""
    for causal in (False, True):
        run_paged(page + d + causal, 2, 8, 2, 300, 40, d, page, causal, [40, 23], "float16", request.node.nodeid,
                  monkeypatch, persistent=False, separate_v=True)


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"case{s}")
def test_gluon_fwd_paged_random(seed, request, monkeypatch):
    """Random geometry: lengths 0 / 1 / odd / full, queries longer or shorter than the keys, no mask or
    causal, fp16/bf16, MQA/GQA, the one-tile or the persistent grid."""
    rng = random.Random(seed)
    b = rng.choice([1, 2, 4])
    h_kv = rng.choice([1, 2])
    h_q = h_kv * rng.choice([1, 2, 4])
    s_kv = rng.choice([64, 300, 1000, 2048])
    s_q = rng.choice([100, 128, 513])         # g * s_q > 64: not the decode kernel's (decode.decode_rows_fit)
    lens = [rng.choice([0, 1, s_kv, rng.randrange(1, s_kv + 1)]) for _ in range(b)]
    run_paged(5000 + seed, b, h_q, h_kv, s_q, s_kv, rng.choice([128, 256]), rng.choice([16, 32, 64, 256]),
              rng.random() < 0.7, lens, rng.choice(["float16", "bfloat16"]), request.node.nodeid, monkeypatch,
              persistent=rng.choice([None, True, False]))


def test_gluon_fwd_paged_no_lengths(request, monkeypatch):
    """No per-sequence lengths: the table's whole reach (pages * page) is keys."""
    run_paged(77, 2, 8, 2, 300, 1024, 128, 64, True, None, "bfloat16", request.node.nodeid, monkeypatch)


def test_gluon_fwd_paged_refuses_odd_pages():
    """Pages the TMA boxes cannot tile (not a power of two, or under 8 keys) go to the portable kernel,
    which computes the same attention."""
    from fusedattn.backends.gluon import fwd_sm90
    from fusedattn.problem import make_problem
    gen = torch.Generator().manual_seed(3)
    for page in (4, 24, 48):
        q = torch.randn(1, 4, 64, 128, generator=gen).to("cuda", torch.bfloat16)
        kv = torch.randn(8, 4, page, 128, generator=gen).to("cuda", torch.bfloat16)
        table = torch.arange(8, dtype=torch.int32, device="cuda").view(1, 8)
        p, _ = make_problem(q, kv, kv, page_table_k=table, page_table_v=table)
        assert not fwd_sm90.supports(p, q, kv, kv, torch.empty_like(q), page_table_k=table, page_table_v=table), page
        out = fusedattn.attention_forward(q, kv, kv, page_table_k=table, page_table_v=table)[0]
        flat = kv.transpose(0, 1).reshape(1, 4, 8 * page, 128).cpu()      # pages in table order
        ref = attention_reference(q.cpu(), flat, flat)[0]
        base = attention_reference(q.cpu(), flat, flat, dtype=torch.bfloat16)[0]
        assert_error_within(out.cpu(), ref, base, msg=f"page {page}")


@pytest.mark.parametrize("page", [16, 64])
def test_gluon_fwd_paged_packed_queries(page, request, monkeypatch):
    """Packed queries (cu_seqlens_q) over a paged cache run on the Gluon forward's packed mode (fwd_sm90
    [Note] packed queries; before it, as a padded batch gathered on the device): each sequence against its
    float64 reference, bottom-right causal over its own keys, and the Gluon kernel launched once, paged,
    with the packed offsets (tests/test_gluon_fwd_packed.py has the edge lengths and random cases)."""
    from fusedattn.backends.gluon import fwd_sm90
    calls = []
    real = fwd_sm90.launch_fwd_sm90
    monkeypatch.setattr(fwd_sm90, "launch_fwd_sm90", lambda p, *a, **kw: (
        calls.append((p.paged, kw.get("cu_seqlens_q") is not None)), real(p, *a, **kw))[1])
    gen = torch.Generator().manual_seed(page)
    b, h_q, h_kv, d, s_kv = 3, 8, 2, 128, 700
    lens_q, lens_kv = [300, 277, 300], [700, 411, 300]
    msg = f"repro: pytest {request.node.nodeid} ; page={page} lens_q={lens_q} lens_kv={lens_kv}"
    k, v = (torch.randn(b, s_kv, h_kv, d, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2) for _ in range(2))
    table = shuffled_table(b, -(-s_kv // page), gen).cuda()
    k_pages, v_pages = scatter_pages(k, table, page), scatter_pages(v, table, page)
    q = torch.randn(sum(lens_q), h_q, d, generator=gen).to("cuda", torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out, stats = fusedattn.attention_with_kvcache(
        q, k_pages, v_pages, page_table=table, seq_len_kv=torch.tensor(lens_kv, dtype=torch.int32, device="cuda"),
        cu_seqlens_q=cu, max_seqlen_q=max(lens_q), causal=True, return_stats=True)
    torch.cuda.synchronize()
    assert calls == [(True, True)], f"the Gluon paged forward's packed mode did not take the call ({calls}). {msg}"
    for i in range(b):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        qi = q[rows].transpose(0, 1)[None].cpu()
        ki, vi = k[i:i + 1, :, :lens_kv[i]].cpu(), v[i:i + 1, :, :lens_kv[i]].cpu()
        ref = dict(causal=True, causal_alignment="bottom_right")
        gold_o, gold_lse = attention_reference(qi, ki, vi, **ref)
        base_o, _ = attention_reference(qi, ki, vi, dtype=torch.bfloat16, **ref)
        assert_error_within(out[rows].transpose(0, 1)[None].cpu(), gold_o, base_o, msg=f"sequence {i}. {msg}")
        assert_lse_close(stats[:, rows][None, ..., None].cpu().double(), gold_lse, msg=f"sequence {i}. {msg}")
