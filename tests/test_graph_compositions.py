"""Compositions of Graph features cuDNN runs and fusedattn used to refuse (issue 24, cuDNN frontend's
own test_mhas.py through the Graph door):

(a) packed page tables: ``page_table_k/v.set_ragged_offset(...)`` (test_mhas.py's "paged_packed": the
    tables of ``convert_uniform_to_ragged_page_tables``, sequence ``i``'s page entries from element
    ``offset[i]`` of the flattened table);
(b) dropout with paged K/V (the mask indexed by the logical key position, as for dense K/V);
(c) a bias with packed (ragged, THD) q/k/v, forward and backward;
(d) K and V with different head counts, packed, forward and backward.

Each graph is built the way test_mhas.py builds it (small sizes), run on the CPU path, and compared with
the float64 ``fusedattn.reference.attention_reference`` on the padded problem; outputs live in NaN-filled
buffers so an unwritten element fails. Every assertion message carries a one-line repro.
"""
import math

import pytest
import torch

import fusedattn as cudnn
from fusedattn.backends.cpu import dropout_keep_mask
from fusedattn.reference import attention_reference

F32 = cudnn.data_type.FLOAT
I32 = cudnn.data_type.INT32
TOL = dict(atol=1e-4, rtol=1e-4)        # float32 io against float64: accumulated rounding only


def repro(test, **kw):
    return f"repro: pytest tests/test_graph_compositions.py -k '{test}' ({', '.join(f'{k}={v}' for k, v in kw.items())})"


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) - 0.5


def nan_like(x):
    return torch.full_like(x, float("nan"))


def bshd(shape):
    """test_mhas.py's bshd_bshd_bshd strides for a [b, h, s, d] tensor: token-major."""
    b, h, s, d = shape
    return (s * h * d, d, h * d, 1)


def as_bshd(x):
    """``x`` [b, h, s, d] copied into token-major (BSHD) memory, same values."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def lengths(lens):
    return torch.tensor(lens, dtype=torch.int32).view(-1, 1, 1, 1)


def padded_keep(x, lens):
    """``x`` [b, h, s, ...] with the rows past each sequence's length zeroed (compared as cuDNN's test does)."""
    x = x.clone()
    for i, n in enumerate(lens):
        x[i, :, n:] = 0
    return x


# ------------------------------------------------------------------------------------------------
# paged K/V as test_mhas.py builds it
# ------------------------------------------------------------------------------------------------

def container_and_table(x, block_size, seed):
    """test_mhas.py's ``create_container_and_page_table`` with the pages shuffled: ``x`` [B, H, S, D] as a
    container [B * pages, H, block_size, D] and a table [B, 1, pages, 1] int32 (strides (pages, pages, 1, 1))."""
    B, H, S, D = x.shape
    pages = math.ceil(S / block_size)
    padded = torch.cat([x, torch.zeros(B, H, pages * block_size - S, D)], dim=2)
    perm = torch.randperm(B * pages, generator=torch.Generator().manual_seed(seed))
    container = torch.empty(B * pages, H, block_size, D)
    table = torch.empty(B, 1, pages, 1, dtype=torch.int32)
    for i in range(B):
        for j in range(pages):
            blk = int(perm[i * pages + j])
            container[blk] = padded[i, :, j * block_size:(j + 1) * block_size]
            table[i, 0, j, 0] = blk
    return container, table.view(-1).as_strided((B, 1, pages, 1), (pages, pages, 1, 1))


def packed_table(table, lens_kv, block_size):
    """test_mhas.py's ``convert_uniform_to_ragged_page_tables``: each sequence's used page entries back to
    back (zeros after the last), as a [B, 1, pages, 1] view, and the int32 [B + 1, 1, 1, 1] offsets."""
    B, _, S, _ = table.shape
    used = [(n + block_size - 1) // block_size for n in lens_kv]
    off = torch.zeros(B + 1, 1, 1, 1, dtype=torch.int32)
    for i, n in enumerate(used):
        off[i + 1] = off[i] + n
    flat = torch.zeros(B * S, dtype=table.dtype)
    for i, n in enumerate(used):
        flat[int(off[i]):int(off[i]) + n] = table[i, 0, :n, 0]
    return flat.view(B, S, 1, 1).permute(0, 2, 1, 3), off


def paged_forward(*, lens_q, lens_kv, h_q=4, h_k=2, d=16, block_size=8, s_q=None, s_kv=None, bias=False,
                  band=None, dropout=0.0, packed=True, infer=False, seed=0):
    """Run test_mhas.py's paged (``packed``: paged_packed) forward graph on float32 tensors; returns
    (o, stats or None, rng_dump or None, reference inputs dict)."""
    b = len(lens_q)
    s_q = s_q or max(lens_q) + 1
    s_kv = s_kv or max(lens_kv) + 3
    q_t = as_bshd(rand(b, h_q, s_q, d, seed=seed))
    k_t, v_t = as_bshd(rand(b, h_k, s_kv, d, seed=seed + 1)), as_bshd(rand(b, h_k, s_kv, d, seed=seed + 2))
    ck, tk = container_and_table(k_t, block_size, seed + 3)
    cv, tv = container_and_table(v_t, block_size, seed + 4)
    off_k = off_v = None
    if packed:
        tk, off_k = packed_table(tk, lens_kv, block_size)
        tv, off_v = packed_table(tv, lens_kv, block_size)
    bias_t = rand(1, h_q, s_q, s_kv, seed=seed + 5) if bias else None
    sq_t, skv_t = lengths(lens_q), lengths(lens_kv)
    seed_t = torch.full((1, 1, 1, 1), 123456, dtype=torch.int64)
    offset_t = torch.full((1, 1, 1, 1), 789, dtype=torch.int64)
    rng_t = torch.zeros(b, h_q, s_q, s_kv) if dropout else None

    graph = cudnn.pygraph(io_data_type=F32, intermediate_data_type=F32, compute_data_type=F32)
    q, kc, vc, ptk, ptv, sq, skv = (graph.tensor_like(t) for t in (q_t, ck, cv, tk, tv, sq_t, skv_t))
    bias_g = graph.tensor_like(bias_t) if bias else None
    rng = graph.tensor_like(rng_t) if dropout else None
    seed_g, offset_g = (graph.tensor_like(seed_t), graph.tensor_like(offset_t)) if dropout else (None, None)
    if packed:
        offk, offv = graph.tensor_like(off_k), graph.tensor_like(off_v)
        ptk.set_ragged_offset(offk)
        ptv.set_ragged_offset(offv)
    left, right, align = band or (None, None, cudnn.diagonal_alignment.TOP_LEFT)
    o, stats = graph.sdpa(name="sdpa", q=q, k=kc, v=vc, generate_stats=not infer, attn_scale=0.125, bias=bias_g,
                          use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv, diagonal_band_left_bound=left,
                          diagonal_band_right_bound=right, diagonal_alignment=align,
                          dropout=(dropout, seed_g, offset_g) if dropout else None, rng_dump=rng,
                          paged_attention_k_table=ptk, paged_attention_v_table=ptv,
                          paged_attention_max_seq_len_kv=s_kv)
    o.set_output(True).set_dim([b, h_q, s_q, d]).set_stride(bshd((b, h_q, s_q, d)))
    if not infer:
        stats.set_output(True).set_data_type(F32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    o_t = nan_like(q_t)
    st_t = torch.full((b, h_q, s_q, 1), float("nan")) if not infer else None
    pack = {q: q_t, kc: ck, vc: cv, ptk: tk, ptv: tv, sq: sq_t, skv: skv_t, o: o_t}
    if not infer:
        pack[stats] = st_t
    if bias:
        pack[bias_g] = bias_t
    if dropout:
        pack.update({rng: rng_t, seed_g: seed_t, offset_g: offset_t})
    if packed:
        pack.update({offk: off_k, offv: off_v})
    graph.execute(pack, torch.empty(graph.get_workspace_size(), dtype=torch.uint8))
    return o_t, st_t, rng_t, dict(q=q_t, k=k_t, v=v_t, bias=bias_t, seq_len_q=sq_t, seq_len_kv=skv_t)


def ref_band(band):
    """attention_reference's band keywords for cuDNN's (left, right, alignment) bounds."""
    if band is None:
        return {}
    left, right, align = band
    # cuDNN's left bound counts the diagonal: key j is kept for i - left < j (+ the alignment's offset)
    return dict(window=(-1 if left is None else left - 1, -1 if right is None else right),
                causal_alignment="top_left" if align == cudnn.diagonal_alignment.TOP_LEFT else "bottom_right")


def check_forward(o_t, st_t, ref, lens_q, msg, **ref_kw):
    want_o, want_lse = attention_reference(ref["q"].double(), ref["k"].double(), ref["v"].double(),
                                           attn_scale=0.125, seq_len_q=ref["seq_len_q"], seq_len_kv=ref["seq_len_kv"],
                                           attn_bias=ref["bias"], **ref_kw)
    assert not torch.isnan(padded_keep(o_t, lens_q)).any(), f"O left unwritten (NaN). {msg}"
    torch.testing.assert_close(padded_keep(o_t, lens_q).double(), padded_keep(want_o, lens_q), **TOL,
                               msg=lambda m: f"O: {m}. {msg}")
    if st_t is not None:
        torch.testing.assert_close(padded_keep(st_t, lens_q).double(), padded_keep(want_lse, lens_q).double(), **TOL,
                                   msg=lambda m: f"Stats: {m}. {msg}")


# ------------------------------------------------------------------------------------------------
# (a) packed page tables
# ------------------------------------------------------------------------------------------------

PAGED_PACKED = [
    # (lens_q, lens_kv, h_q, h_k, bias, band, infer): sequence 0 uses fewer pages than the table holds, so
    # reading sequence 1's entries from the table's start (the offsets ignored) attends sequence 0's pages
    ((5, 3), (9, 30), 4, 4, False, None, True),
    ((5, 3), (9, 30), 4, 2, True, None, False),
    ((1, 6, 4), (17, 3, 25), 4, 1, False, (2, 0, cudnn.diagonal_alignment.BOTTOM_RIGHT), False),
    ((6, 2), (24, 11), 4, 2, True, (3, 5, cudnn.diagonal_alignment.TOP_LEFT), True),
]


@pytest.mark.parametrize("case", range(len(PAGED_PACKED)), ids=["mha", "gqa_bias_stats", "mqa_br_band", "bias_tl_band"])
def test_paged_packed_tables(case):
    """(a) page tables with ragged offsets (test_mhas.py "paged_packed") against the padded reference;
    the same graph with the uniform tables gives the same O."""
    lens_q, lens_kv, h_q, h_k, bias, band, infer = PAGED_PACKED[case]
    msg = repro("test_paged_packed_tables", case=case, lens_q=lens_q, lens_kv=lens_kv, h_q=h_q, h_k=h_k)
    o_t, st_t, _, ref = paged_forward(lens_q=lens_q, lens_kv=lens_kv, h_q=h_q, h_k=h_k, bias=bias, band=band,
                                      infer=infer, seed=case)
    check_forward(o_t, st_t, ref, lens_q, msg, **ref_band(band))
    o_u, _, _, _ = paged_forward(lens_q=lens_q, lens_kv=lens_kv, h_q=h_q, h_k=h_k, bias=bias, band=band,
                                 infer=infer, seed=case, packed=False)
    torch.testing.assert_close(padded_keep(o_t, lens_q), padded_keep(o_u, lens_q), atol=0, rtol=0,
                               msg=lambda m: f"packed vs uniform tables: {m}. {msg}")


def test_paged_packed_tables_refused_on_seed_tables():
    """The seeds' [b, pages] tables (sdpa_with_paged_cache) have no packed form: named, not supported."""
    b, h, d, bs, pages = 2, 2, 16, 8, 2
    graph = cudnn.pygraph(io_data_type=F32)
    q = graph.tensor(dim=[b, h, 3, d], stride=[h * 3 * d, 3 * d, d, 1])
    kc, vc = (graph.tensor(dim=[b * pages, bs, h, d], stride=[bs * h * d, h * d, d, 1]) for _ in "kv")
    table = graph.tensor(dim=[b, pages], stride=[pages, 1], data_type=I32)
    table.set_ragged_offset(graph.tensor(dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32))
    o = graph.sdpa_with_paged_cache(q, kc, vc, table) if hasattr(graph, "sdpa_with_paged_cache") else None
    if o is None:
        pytest.skip("no seed paged spelling on this pygraph")
    (o[0] if isinstance(o, (tuple, list)) else o).set_output(True)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match=r"ragged offset on a \[b, pages\] page table"):
        graph.validate()


# ------------------------------------------------------------------------------------------------
# (b) dropout with paged K/V
# ------------------------------------------------------------------------------------------------

PAGED_DROPOUT = [
    # (lens_q, lens_kv, s_kv, block_size, packed tables, bias, band): s_kv below the tables' capacity, across a
    # 16-key boundary (the mask's Philox counters group keys by 16): the mask is the graph's [b, h, s_q, s_kv]
    # one, not the capacity's (as with cuDNN's s_kv = 24 on pages of 64 or 128)
    ((5, 3), (9, 12), 12, 32, False, False, (2, 0, cudnn.diagonal_alignment.TOP_LEFT)),
    ((5, 3), (9, 24), 24, 64, False, True, (2, None, cudnn.diagonal_alignment.BOTTOM_RIGHT)),
    ((4, 6), (19, 40), 40, 32, True, True, None),
    ((1, 6, 2), (3, 33, 11), 33, 16, True, False, None),
]


@pytest.mark.parametrize("case", range(len(PAGED_DROPOUT)), ids=["tl_band", "bias_br", "packed_bias", "packed_mqa"])
def test_paged_dropout(case):
    """(b) dropout over paged K/V (test_mhas.py paged1 / paged_packed with dropout1): rng_dump is the mask of
    the graph's [b, h_q, s_q, s_kv] problem (the logical key position), O is the reference's with that mask,
    as test_mhas.py checks it (its compute_ref applies the rng_dump mask)."""
    lens_q, lens_kv, s_kv, block_size, packed, bias, band = PAGED_DROPOUT[case]
    h_k = 1 if case == 3 else 2
    p = 0.25
    msg = repro("test_paged_dropout", case=case, lens_q=lens_q, lens_kv=lens_kv, s_kv=s_kv, block_size=block_size,
                packed=packed)
    o_t, st_t, rng_t, ref = paged_forward(lens_q=lens_q, lens_kv=lens_kv, s_kv=s_kv, h_k=h_k, block_size=block_size,
                                          bias=bias, band=band, dropout=p, packed=packed, seed=10 + case)
    b, h_q, s_q = rng_t.shape[:3]
    want_mask = dropout_keep_mask(b, h_q, s_q, s_kv, p, 123456, 789).float()
    assert torch.equal(rng_t, want_mask), f"rng_dump is not the [b, h, s_q, s_kv] mask of the dense problem. {msg}"
    kept = want_mask.mean().item()
    assert 0.6 < kept < 0.9, f"rng_dump keeps {kept:.2f} of the scores with p = {p}. {msg}"
    check_forward(o_t, st_t, ref, lens_q, msg, dropout_p=p, dropout_seed=123456, dropout_offset=789,
                  **ref_band(band))


# ------------------------------------------------------------------------------------------------
# (c) bias and (d) K/V head counts that differ, with packed (ragged) q/k/v: the padded call
# ------------------------------------------------------------------------------------------------

def prefix(lens, per_token):
    """test_mhas.py's generate_ragged_offset: element offsets [b + 1, 1, 1, 1] (INT64, cuDNN 9.6 and later)."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int64).mul(per_token).view(-1, 1, 1, 1)


def pad(x, lens, s):
    """Packed [total, h, d] -> zero-padded [b, h, s, d]."""
    out, t0 = torch.zeros(len(lens), x.shape[1], s, x.shape[2], dtype=x.dtype), 0
    for i, n in enumerate(lens):
        out[i, :, :n] = x[t0:t0 + n].transpose(0, 1)
        t0 += n
    return out


def unpad(x, lens):
    """Padded [b, h, s, d] -> packed [total, h, d]."""
    return torch.cat([x[i, :, :n].transpose(0, 1) for i, n in enumerate(lens)])


def packed_fwd_bwd(*, lens_q, lens_kv, h_q, h_k, h_v, d=16, d_v=16, bias=False, band=None, dropout=0.0, alibi=False,
                   seed=0):
    """test_mhas.py's ragged sdpa then sdpa_backward (bshd_bshd_bshd, thd_thd_thd offsets; Stats padded, as
    there) on float32 tensors in NaN-filled outputs. Returns (got, inputs): got holds packed O, dQ, dK, dV,
    padded Stats (and dBias, rng_dump)."""
    b = len(lens_q)
    s_q, s_kv = max(lens_q) + 2, max(lens_kv) + 1
    tq, tkv = sum(lens_q), sum(lens_kv)
    q_t, k_t, v_t = rand(tq, h_q, d, seed=seed), rand(tkv, h_k, d, seed=seed + 1), rand(tkv, h_v, d_v, seed=seed + 2)
    do_t = 0.5 * rand(tq, h_q, d_v, seed=seed + 3)
    bias_t = rand(1, h_q, s_q, s_kv, seed=seed + 4) if bias else None
    off = {"q": prefix(lens_q, h_q * d), "k": prefix(lens_kv, h_k * d), "v": prefix(lens_kv, h_v * d_v),
           "o": prefix(lens_q, h_q * d_v)}
    sq_t, skv_t = lengths(lens_q), lengths(lens_kv)
    seed_t = torch.full((1, 1, 1, 1), 123456, dtype=torch.int64)
    offset_t = torch.full((1, 1, 1, 1), 789, dtype=torch.int64)
    shapes = {"q": (b, h_q, s_q, d), "k": (b, h_k, s_kv, d), "v": (b, h_v, s_kv, d_v), "o": (b, h_q, s_q, d_v)}
    left, right, align = band or (None, None, cudnn.diagonal_alignment.TOP_LEFT)
    mask_kw = dict(attn_scale=0.125, use_alibi_mask=alibi, use_padding_mask=True, diagonal_band_left_bound=left,
                   diagonal_band_right_bound=right, diagonal_alignment=align)

    def common(graph):
        g = {r: graph.tensor(name=r.upper(), dim=list(shapes[r]), stride=list(bshd(shapes[r])), data_type=F32)
             for r in ("q", "k", "v")}
        g.update({f"off_{r}": graph.tensor_like(x) for r, x in off.items()})
        for r in ("q", "k", "v"):
            g[r].set_ragged_offset(g[f"off_{r}"])
        g["sq"], g["skv"] = graph.tensor_like(sq_t), graph.tensor_like(skv_t)
        g["bias"] = graph.tensor_like(bias_t) if bias else None
        if dropout:
            g["seed"], g["offset"] = graph.tensor_like(seed_t), graph.tensor_like(offset_t)
        pack = {g["q"]: q_t, g["k"]: k_t, g["v"]: v_t, g["sq"]: sq_t, g["skv"]: skv_t,
                **{g[f"off_{r}"]: x for r, x in off.items()}}
        if bias:
            pack[g["bias"]] = bias_t
        if dropout:
            pack.update({g["seed"]: seed_t, g["offset"]: offset_t})
        return g, pack

    def build(graph):
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()

    got = {}
    fwd = cudnn.pygraph(io_data_type=F32, intermediate_data_type=F32, compute_data_type=F32)
    g, pack = common(fwd)
    rng = fwd.tensor_like(torch.zeros(b, h_q, s_q, s_kv)) if dropout else None
    o, stats = fwd.sdpa(name="sdpa", q=g["q"], k=g["k"], v=g["v"], generate_stats=True, bias=g["bias"],
                        seq_len_q=g["sq"], seq_len_kv=g["skv"], rng_dump=rng,
                        dropout=(dropout, g["seed"], g["offset"]) if dropout else None, **mask_kw)
    o.set_output(True).set_dim(list(shapes["o"])).set_stride(list(bshd(shapes["o"]))).set_ragged_offset(g["off_o"])
    stats.set_output(True).set_data_type(F32)
    build(fwd)
    o_buf = torch.full((tq + 2, h_q, d_v), float("nan"))
    got["stats"] = torch.full((b, h_q, s_q, 1), float("nan"))
    pack.update({o: o_buf, stats: got["stats"]})
    if dropout:
        got["rng_dump"] = torch.zeros(b, h_q, s_q, s_kv)
        pack[rng] = got["rng_dump"]
    fwd.execute(pack, torch.empty(fwd.get_workspace_size(), dtype=torch.uint8))
    assert torch.isnan(o_buf[tq:]).all(), "O written past the packed tokens"
    got["o"] = o_buf[:tq]

    bwd = cudnn.pygraph(io_data_type=F32, intermediate_data_type=F32, compute_data_type=F32)
    g, pack = common(bwd)
    o_g = bwd.tensor(name="O", dim=list(shapes["o"]), stride=list(bshd(shapes["o"])), data_type=F32)
    do_g = bwd.tensor(name="dO", dim=list(shapes["o"]), stride=list(bshd(shapes["o"])), data_type=F32)
    o_g.set_ragged_offset(g["off_o"])
    do_g.set_ragged_offset(g["off_o"])
    st_g = bwd.tensor_like(got["stats"])
    dbias_g = bwd.tensor_like(torch.empty(1, h_q, s_q, s_kv)) if bias else None
    dQ, dK, dV = bwd.sdpa_backward(name="sdpa_backward", q=g["q"], k=g["k"], v=g["v"], o=o_g, dO=do_g, stats=st_g,
                                   bias=g["bias"], dBias=dbias_g, seq_len_q=g["sq"], seq_len_kv=g["skv"],
                                   max_total_seq_len_q=tq, max_total_seq_len_kv=tkv,
                                   dropout=(dropout, g["seed"], g["offset"]) if dropout else None, **mask_kw)
    for t, r in ((dQ, "q"), (dK, "k"), (dV, "v")):
        t.set_output(True).set_dim(list(shapes[r])).set_stride(list(bshd(shapes[r]))).set_ragged_offset(g[f"off_{r}"])
    build(bwd)
    grads = {r: torch.full((n + 2, h, dd), float("nan"))
             for r, n, h, dd in (("dq", tq, h_q, d), ("dk", tkv, h_k, d), ("dv", tkv, h_v, d_v))}
    pack.update({o_g: got["o"], do_g: do_t, st_g: got["stats"], dQ: grads["dq"], dK: grads["dk"], dV: grads["dv"]})
    if bias:
        got["dbias"] = torch.full((1, h_q, s_q, s_kv), float("nan"))
        pack[dbias_g] = got["dbias"]
    bwd.execute(pack, torch.empty(bwd.get_workspace_size(), dtype=torch.uint8))
    for r, n in (("dq", tq), ("dk", tkv), ("dv", tkv)):
        assert torch.isnan(grads[r][n:]).all(), f"{r} written past the packed tokens"
        got[r] = grads[r][:n]
    return got, dict(q=q_t, k=k_t, v=v_t, do=do_t, bias=bias_t, s_q=s_q, s_kv=s_kv)


def check_packed(got, x, *, lens_q, lens_kv, band, dropout, alibi, msg):
    """The packed results against the float64 reference on the padded problem, K and V each expanded to
    h_q heads (test_mhas.py's compute_ref), autograd for the gradients."""
    s_q, s_kv = x["s_q"], x["s_kv"]
    h_q = x["q"].shape[1]
    q, k, v = (pad(x[r].double(), lens, s).requires_grad_()
               for r, lens, s in (("q", lens_q, s_q), ("k", lens_kv, s_kv), ("v", lens_kv, s_kv)))
    bias = x["bias"].double().requires_grad_() if x["bias"] is not None else None
    kw = dict(attn_scale=0.125, seq_len_q=lengths(lens_q), seq_len_kv=lengths(lens_kv), attn_bias=bias, alibi=alibi,
              **ref_band(band))
    if dropout:
        kw.update(dropout_p=dropout, dropout_seed=123456, dropout_offset=789)
    o, lse = attention_reference(q, k.repeat_interleave(h_q // k.shape[1], 1),
                                 v.repeat_interleave(h_q // v.shape[1], 1), **kw)
    o.backward(pad(x["do"].double(), lens_q, s_q))
    checks = [("O", got["o"], unpad(o.detach(), lens_q)),
              ("Stats", padded_keep(got["stats"], lens_q), padded_keep(lse.detach(), lens_q)),
              ("dQ", got["dq"], unpad(q.grad, lens_q)), ("dK", got["dk"], unpad(k.grad, lens_kv)),
              ("dV", got["dv"], unpad(v.grad, lens_kv))]
    if bias is not None:
        checks.append(("dBias", got["dbias"], bias.grad))
    if dropout:
        b = len(lens_q)
        checks.append(("rng_dump", got["rng_dump"], dropout_keep_mask(b, h_q, s_q, s_kv, dropout, 123456, 789).double()))
    for name, g, want in checks:
        assert not torch.isnan(g).any(), f"{name} left unwritten (NaN). {msg}"
        torch.testing.assert_close(g.double(), want.double(), **TOL, msg=lambda m: f"{name}: {m}. {msg}")


PACKED = {
    # name: (lens_q, lens_kv, h_q, h_k, h_v, bias, band, dropout, alibi); a length 1 and a length 0 query row set
    "bias": ((5, 1, 7), (6, 3, 9), 4, 4, 4, True, None, 0.0, False),
    "bias_gqa_tl_band": ((5, 2, 7), (6, 4, 9), 4, 2, 2, True, (2, 1, cudnn.diagonal_alignment.TOP_LEFT), 0.0, False),
    "bias_dropout_br": ((5, 0, 7), (6, 3, 9), 4, 1, 1, True, (3, 0, cudnn.diagonal_alignment.BOTTOM_RIGHT), 0.2,
                        False),
    "bias_alibi_causal_dropout": ((6, 3), (6, 8), 4, 4, 4, True, (None, 0, cudnn.diagonal_alignment.TOP_LEFT), 0.2,
                                  True),
    "kv_heads_k2_v1": ((5, 1, 7), (6, 3, 9), 4, 2, 1, False, (2, 1, cudnn.diagonal_alignment.TOP_LEFT), 0.0, False),
    "kv_heads_k3_v2_br": ((4, 6), (9, 6), 6, 3, 2, False, (2, 0, cudnn.diagonal_alignment.BOTTOM_RIGHT), 0.0, False),
    "kv_heads_bias_dropout": ((4, 6), (9, 6), 6, 1, 3, True, None, 0.2, False),
}


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_padded_route(name):
    """(c) a bias and (d) K / V of different head counts with packed q/k/v (test_mhas.py ragged1): sdpa and
    sdpa_backward run as the padded call; O, Stats, dQ, dK, dV (dBias, rng_dump) against the reference."""
    lens_q, lens_kv, h_q, h_k, h_v, bias, band, dropout, alibi = PACKED[name]
    msg = repro("test_packed_padded_route", name=name, lens_q=lens_q, lens_kv=lens_kv, h=(h_q, h_k, h_v))
    got, x = packed_fwd_bwd(lens_q=lens_q, lens_kv=lens_kv, h_q=h_q, h_k=h_k, h_v=h_v, d_v=8 if h_k != h_v else 16,
                            bias=bias, band=band, dropout=dropout, alibi=alibi, seed=len(name))
    check_packed(got, x, lens_q=lens_q, lens_kv=lens_kv, band=band, dropout=dropout, alibi=alibi, msg=msg)
