"""The Graph door's ragged offsets: cuDNN's packed variable-length (THD) layout.

Graphs are built exactly as cuDNN's samples build them: the graph tensors keep the padded
BHSD dims ``[b, h, s_max, d]`` with BSHD strides, a ``[b + 1, 1, 1, 1]`` INT32 ragged offset
(element offset of each sequence's first token, then the end) is set on q/k/v/o (and
dO/dQ/dK/dV), with ``use_padding_mask`` and seq_len tensors. Results are compared sequence by
sequence with the float64 reference (``fusedattn.reference``) under the repo's 2x rule, the
packed outputs living in NaN-filled buffers so an unwritten element fails.
"""
import os

import pytest
import torch

import fusedattn as cudnn
from fusedattn.graph import graphs as graphs_module
from fusedattn.reference import attention_reference
from fusedattn.testing import assert_error_within

from conftest import target_id

F32 = cudnn.data_type.FLOAT
I32 = cudnn.data_type.INT32


@pytest.fixture
def on_target(target, monkeypatch):
    """(device, backend) with graphs built without backend= running on that backend."""
    device, backend = target
    monkeypatch.setattr(graphs_module, "DEFAULT_BACKEND", backend)
    return device, backend


def cumulative(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def bshd(b, h, s, d):
    """cuDNN's strides for a packed tensor described as [b, h, s, d]: token-major (BSHD)."""
    return [s * h * d, d, h * d, 1]


def offsets(cu, token_stride, device, start=0):
    """A ragged offset tensor [b + 1, 1, 1, 1] int32: element offsets, ``start`` tokens in."""
    return (torch.tensor(cu, dtype=torch.int32, device=device) + start).mul(token_stride).view(-1, 1, 1, 1)


def lengths(lens, device):
    return torch.tensor(lens, dtype=torch.int32, device=device).view(-1, 1, 1, 1)


def rand(*shape, dtype, device, gen):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def nan_buffer(n, dtype, device):
    return torch.full((n,), float("nan"), dtype=dtype, device=device)


def seq(x, cu, i):
    """Sequence ``i`` of a packed [total, h, d] tensor as [1, h, n, d] (CPU)."""
    return x[cu[i]:cu[i + 1]].transpose(0, 1)[None].detach().cpu()


def ragged_fwd_graph(b, h_q, h_kv, s_q, s_kv, d, dtype, *, generate_stats=True, override=False, **sdpa_kw):
    """cuDNN's ragged sample: returns (graph, tensors by name)."""
    graph = cudnn.pygraph(io_data_type=dtype, intermediate_data_type=F32, compute_data_type=F32,
                          is_override_shape_enabled=override)
    q = graph.tensor(name="Q", dim=[b, h_q, s_q, d], stride=bshd(b, h_q, s_q, d), data_type=dtype)
    k = graph.tensor(name="K", dim=[b, h_kv, s_kv, d], stride=bshd(b, h_kv, s_kv, d), data_type=dtype)
    v = graph.tensor(name="V", dim=[b, h_kv, s_kv, d], stride=bshd(b, h_kv, s_kv, d), data_type=dtype)
    ragged_q = graph.tensor(name="ragged_q", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    ragged_kv = graph.tensor(name="ragged_kv", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    seq_len_q = graph.tensor(name="seq_len_q", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    seq_len_kv = graph.tensor(name="seq_len_kv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    q.set_ragged_offset(ragged_q)
    k.set_ragged_offset(ragged_kv)
    v.set_ragged_offset(ragged_kv)
    o, stats = graph.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=generate_stats, use_padding_mask=True,
                          seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, **sdpa_kw)
    o.set_output(True).set_dim([b, h_q, s_q, d]).set_stride(bshd(b, h_q, s_q, d)).set_ragged_offset(ragged_q)
    if stats is not None:
        stats.set_output(True).set_data_type(F32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, dict(q=q, k=k, v=v, o=o, stats=stats, ragged_q=ragged_q, ragged_kv=ragged_kv,
                       seq_len_q=seq_len_q, seq_len_kv=seq_len_kv)


def run_ragged_fwd(graph, g, lens_q, lens_kv, h_q, h_kv, s_q, d, dtype, device, gen, kv_start):
    """Execute a ``ragged_fwd_graph`` on random packed inputs, bound three ways: q as [total, h, d]; k and v
    flat with ``kv_start`` tokens before the first sequence (offsets that do not start at 0, NaN there and
    past the end); O as the declared padded [b, h, s, d] (BSHD) view of a NaN-filled buffer. Returns
    (q [total_q, h_q, d], k, v [total_kv, h_kv, d], out [total_q, h_q, d], the flat O and K buffers, Stats)."""
    b = len(lens_q)
    cu_q, cu_kv = cumulative(lens_q), cumulative(lens_kv)
    tq, tkv = cu_q[-1], cu_kv[-1]
    q_t = rand(max(tq, 1), h_q, d, dtype=dtype, device=device, gen=gen)
    kv_flat = [nan_buffer((kv_start + tkv + 2) * h_kv * d, dtype, device) for _ in range(2)]
    k_t, v_t = (f[kv_start * h_kv * d:(kv_start + tkv) * h_kv * d].view(tkv, h_kv, d) for f in kv_flat)
    k_t.copy_(rand(tkv, h_kv, d, dtype=dtype, device=device, gen=gen))
    v_t.copy_(rand(tkv, h_kv, d, dtype=dtype, device=device, gen=gen))
    o_flat = nan_buffer(b * s_q * h_q * d, dtype, device)
    o_t = o_flat.as_strided((b, h_q, s_q, d), bshd(b, h_q, s_q, d))
    stats_t = torch.full((b, h_q, s_q, 1), float("nan"), device=device)
    graph.execute({g["q"]: q_t, g["k"]: kv_flat[0], g["v"]: kv_flat[1], g["o"]: o_t, g["stats"]: stats_t,
                   g["ragged_q"]: offsets(cu_q, h_q * d, device),
                   g["ragged_kv"]: offsets(cu_kv, h_kv * d, device, start=kv_start),
                   g["seq_len_q"]: lengths(lens_q, device), g["seq_len_kv"]: lengths(lens_kv, device)},
                  torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8))
    return q_t, k_t, v_t, o_flat[:tq * h_q * d].view(tq, h_q, d), o_flat, kv_flat[0], stats_t


# (lens_q, lens_kv, sdpa options, reference options, kv start): lengths 1 and 0, GQA 4/2
CASES = [
    ((5, 1, 9), (7, 3, 12), dict(attn_scale=0.3), dict(attn_scale=0.3), 0),
    ((5, 1, 9), (7, 1, 12), dict(attn_scale=0.25, use_causal_mask=True),
     dict(attn_scale=0.25, causal=True), 0),
    ((5, 1, 0, 9), (7, 2, 3, 12), dict(use_causal_mask_bottom_right=True),
     dict(attn_scale=1.0, causal=True, causal_alignment="bottom_right"), 3),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=["plain", "causal", "bottom_right_empty"])
def test_ragged_forward(case, on_target):
    device, _ = on_target
    lens_q, lens_kv, sdpa_kw, ref_kw, kv_start = CASES[case]
    dtype = torch.float16 if device == "cuda" else torch.float32
    b, h_q, h_kv, d = len(lens_q), 4, 2, 16
    s_q, s_kv = max(lens_q) + 2, max(lens_kv) + 1          # padded maxima above every length
    cu_q, cu_kv = cumulative(lens_q), cumulative(lens_kv)
    tq = cu_q[-1]
    gen = torch.Generator().manual_seed(case)
    graph, g = ragged_fwd_graph(b, h_q, h_kv, s_q, s_kv, d, cudnn.data_type.HALF if dtype == torch.float16
                                else F32, **sdpa_kw)
    q_t, k_t, v_t, out, o_flat, k_flat, stats_t = run_ragged_fwd(graph, g, lens_q, lens_kv, h_q, h_kv, s_q, d,
                                                                 dtype, device, gen, kv_start)
    assert torch.isnan(o_flat[tq * h_q * d:]).all(), "O written past the packed tokens"
    assert torch.isnan(k_flat[:kv_start * h_kv * d]).all()
    for i in range(b):
        if lens_q[i] == 0:
            continue
        gold, gold_lse = attention_reference(seq(q_t, cu_q, i), seq(k_t, cu_kv, i), seq(v_t, cu_kv, i), **ref_kw)
        base, _ = attention_reference(seq(q_t, cu_q, i), seq(k_t, cu_kv, i), seq(v_t, cu_kv, i), dtype=dtype,
                                      **ref_kw)
        assert_error_within(seq(out, cu_q, i), gold, base, msg=f"O of sequence {i}")
        got_lse = stats_t[i:i + 1, :, :lens_q[i]].cpu().double()
        torch.testing.assert_close(got_lse, gold_lse.double(), atol=2e-3, rtol=2e-3, msg=lambda m: f"Stats {i}: {m}")
    # padded Stats rows past a sequence's length see no key: -inf, as cuDNN (9.14 and later) writes
    for i in range(b):
        assert (stats_t[i, :, lens_q[i]:] == float("-inf")).all(), f"Stats rows past sequence {i}'s length"


def _drawn_ragged(seed):
    """(lens_q, lens_kv, h_q, h_kv, d, sdpa options, (alignment, left, right), kv start) of a random ragged graph:
    empty sequences, GQA, odd head dims, every mask spelling of cuDNN's, a scale, offsets that do not start at 0."""
    import random
    rng = random.Random(5300 + seed)
    b = rng.choice([1, 2, 3, 5])
    lens_q = [rng.choice([0, 1, 4, 9, 17]) for _ in range(b)]
    lens_kv = [rng.choice([1, 3, 8, 20]) if rng.random() < 0.9 else 0 for _ in range(b)]
    h_kv = rng.choice([1, 2])
    h_q, d = h_kv * rng.choice([1, 2, 4]), rng.choice([8, 16, 24, 40, 64])
    sdpa_kw = {"attn_scale": rng.choice([0.1, 0.3, 1.0])}
    band = ("top_left", None, None)
    r = rng.random()
    if r < 0.25:
        sdpa_kw["use_causal_mask"] = True
        band = ("top_left", None, 0)
    elif r < 0.5:
        sdpa_kw["use_causal_mask_bottom_right"] = True
        band = ("bottom_right", None, 0)
    elif r < 0.75:
        left, right = rng.choice([None, 1, 4]), rng.choice([0, 2])
        bottom = rng.random() < 0.5
        if bottom:
            sdpa_kw["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
        sdpa_kw["diagonal_band_right_bound"] = right
        if left is not None:
            sdpa_kw["diagonal_band_left_bound"] = left
        band = ("bottom_right" if bottom else "top_left", left, right)
    return lens_q, lens_kv, h_q, h_kv, d, sdpa_kw, band, rng.choice([0, 3])


@pytest.mark.parametrize("seed", range(int(os.environ.get("FUSEDATTN_FUZZ_SEEDS", "12"))))
def test_ragged_forward_drawn(seed, on_target):
    """Random ragged forward graphs (``_drawn_ragged``) as cuDNN's samples build them, sequence by sequence
    against float64 with cuDNN's own mask definitions (test_graph.cudnn_keep_mask on each sequence's lengths);
    O in a NaN-filled buffer past the packed tokens, Stats -inf on padded rows."""
    from test_graph import cudnn_keep_mask
    device, _ = on_target
    lens_q, lens_kv, h_q, h_kv, d, sdpa_kw, band, kv_start = _drawn_ragged(seed)
    rep = (f"repro: pytest tests/test_graph_ragged.py -k 'drawn and {target_id(on_target)}-{seed}]' ; lens_q "
           f"{lens_q} lens_kv {lens_kv} h{h_q}/{h_kv} d{d} {sdpa_kw} band {band} kv start {kv_start}")
    dtype = torch.float16 if device == "cuda" else torch.float32
    b = len(lens_q)
    s_q, s_kv = max(lens_q) + 1, max(lens_kv) + 2
    cu_q, cu_kv = cumulative(lens_q), cumulative(lens_kv)
    tq = cu_q[-1]
    gen = torch.Generator().manual_seed(seed)
    graph, g = ragged_fwd_graph(b, h_q, h_kv, s_q, s_kv, d, cudnn.data_type.HALF if dtype == torch.float16
                                else F32, **sdpa_kw)
    q_t, k_t, v_t, out, o_flat, _, stats_t = run_ragged_fwd(graph, g, lens_q, lens_kv, h_q, h_kv, s_q, d, dtype,
                                                            device, gen, kv_start)
    assert torch.isnan(o_flat[tq * h_q * d:]).all(), f"O written past the packed tokens. {rep}"
    for i in range(b):
        assert (stats_t[i, :, lens_q[i]:] == float("-inf")).all(), f"Stats rows past sequence {i}'s length. {rep}"
        if lens_q[i] == 0:
            continue
        keep = cudnn_keep_mask(1, lens_q[i], lens_kv[i], *band)
        if lens_kv[i] == 0 or not keep.any(-1).all():
            # rows that keep no key: O 0 and Stats -inf (cuDNN 9.14+); the kept rows below
            rows = ~keep.any(-1)[0, 0] if lens_kv[i] else torch.ones(lens_q[i], dtype=torch.bool)
            got = seq(out, cu_q, i)[0][:, rows]
            assert (got == 0).all(), f"sequence {i}: rows with no key must be 0. {rep}"
            assert (stats_t[i, :, :lens_q[i]][:, rows] == float("-inf")).all(), f"sequence {i}: Stats. {rep}"
            if lens_kv[i] == 0:
                continue
        args = (seq(q_t, cu_q, i), seq(k_t, cu_kv, i), seq(v_t, cu_kv, i))
        scale = sdpa_kw["attn_scale"]
        gold, gold_lse = attention_reference(*args, attn_scale=scale, attn_bias=keep)
        base, _ = attention_reference(*args, attn_scale=scale, attn_bias=keep, dtype=dtype)
        assert_error_within(seq(out, cu_q, i), gold, base, msg=f"O of sequence {i}. {rep}")
        got_lse = stats_t[i:i + 1, :, :lens_q[i]].cpu().double()
        fin = torch.isfinite(gold_lse)
        assert torch.equal(torch.isfinite(got_lse), fin), f"Stats -inf rows of sequence {i}. {rep}"
        torch.testing.assert_close(got_lse[fin], gold_lse.double()[fin], atol=2e-3, rtol=2e-3,
                                   msg=lambda m: f"Stats {i}: {m}. {rep}")


def test_override_shapes_reuse_one_graph(on_target):
    """cuDNN frontend's THD and chunked-prefill tests (test/python/test_sdpa_thd.py,
    test_sdpa_chunked_prefill.py) build one graph with ``is_override_shape_enabled=True``, cache it without
    the batch's maximum query length, and run it with ``execute(..., override_uids=, override_shapes=,
    override_strides=)`` at the batch's own ``[b, h, s_max, d]`` dims, passing a packed ``[T, h, d]``
    tensor's own (3-entry) strides for Q and O. Here a graph built for s_q 6 / s_kv 12 runs a batch whose
    longest query is 11 (Stats not overridden: inferred anew), then again at its own dims, unchanged."""
    device, _ = on_target
    dtype = torch.float16 if device == "cuda" else torch.float32
    cdt = cudnn.data_type.HALF if dtype == torch.float16 else F32
    b, h_q, h_kv, d = 3, 4, 2, 16
    graph, g = ragged_fwd_graph(b, h_q, h_kv, 6, 12, d, cdt, override=True, attn_scale=0.3)
    gen = torch.Generator().manual_seed(16)
    ws = torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8)

    def run(lens_q, lens_kv, s_q, override):
        cu_q, cu_kv = cumulative(lens_q), cumulative(lens_kv)
        q_t = rand(cu_q[-1], h_q, d, dtype=dtype, device=device, gen=gen)
        k_t, v_t = (rand(cu_kv[-1], h_kv, d, dtype=dtype, device=device, gen=gen) for _ in range(2))
        o_t = torch.full((cu_q[-1], h_q, d), float("nan"), dtype=dtype, device=device)
        stats_t = torch.full((b, h_q, s_q, 1), float("nan"), device=device)
        pack = {g["q"]: q_t, g["k"]: k_t, g["v"]: v_t, g["o"]: o_t, g["stats"]: stats_t,
                g["ragged_q"]: offsets(cu_q, h_q * d, device), g["ragged_kv"]: offsets(cu_kv, h_kv * d, device),
                g["seq_len_q"]: lengths(lens_q, device), g["seq_len_kv"]: lengths(lens_kv, device)}
        if override:
            # cuDNN's own order and values: the packed tensors' strides, the declared 4-D shapes
            names = ["q", "ragged_q", "k", "v", "seq_len_q", "seq_len_kv", "o"]
            shapes = [[b, h_q, s_q, d], pack[g["ragged_q"]].shape, [b, h_kv, 12, d], [b, h_kv, 12, d],
                      pack[g["seq_len_q"]].shape, pack[g["seq_len_kv"]].shape, [b, h_q, s_q, d]]
            graph.execute(pack, ws, override_uids=[g[n].get_uid() for n in names], override_shapes=shapes,
                          override_strides=[pack[g[n]].stride() for n in names])
        else:
            graph.execute(pack, ws)
        for i in range(b):
            gold, gold_lse = attention_reference(seq(q_t, cu_q, i), seq(k_t, cu_kv, i), seq(v_t, cu_kv, i),
                                                 attn_scale=0.3)
            base, _ = attention_reference(seq(q_t, cu_q, i), seq(k_t, cu_kv, i), seq(v_t, cu_kv, i),
                                          attn_scale=0.3, dtype=dtype)
            assert_error_within(seq(o_t, cu_q, i), gold, base, msg=f"O of sequence {i} (override={override})")
            torch.testing.assert_close(stats_t[i:i + 1, :, :lens_q[i]].cpu().double(), gold_lse.double(),
                                       atol=2e-3, rtol=2e-3)
            assert (stats_t[i, :, lens_q[i]:] == float("-inf")).all(), f"Stats past sequence {i} (override={override})"

    run((9, 2, 11), (10, 3, 12), 11, override=True)      # longer than the graph's s_q 6
    run((9, 2, 11), (10, 3, 12), 11, override=True)      # the cached lowering
    run((5, 1, 6), (7, 3, 12), 6, override=False)        # the graph itself is unchanged


def test_override_shapes_refusals():
    """Overrides on a graph built without is_override_shape_enabled, lists of unequal lengths, an unknown
    uid and a shape of another rank are GraphErrors naming the argument."""
    b, h, d = 2, 2, 16
    plain, g = ragged_fwd_graph(b, h, h, 4, 4, d, F32)
    over, g2 = ragged_fwd_graph(b, h, h, 4, 4, d, F32, override=True)
    uid = g2["q"].get_uid()
    cases = [
        (plain, dict(override_uids=[g["q"].get_uid()], override_shapes=[[b, h, 8, d]]), "is_override_shape_enabled"),
        (over, dict(override_uids=[uid], override_shapes=[]), "one entry per uid"),
        (over, dict(override_uids=[987654], override_shapes=[[b, h, 8, d]]), "uid 987654 is not a tensor"),
        (over, dict(override_uids=[uid], override_shapes=[[b, h, 8]]), "has 3 dims"),
        (over, dict(override_uids=["q"], override_shapes=[[b, h, 8, d]]), "override_uids are ints"),
    ]
    for graph, kw, needle in cases:
        with pytest.raises(cudnn.GraphError, match=needle):
            graph.execute({}, None, **kw)


def test_ragged_forward_lengths_from_offsets_and_packed_stats(on_target):
    """Without use_padding_mask the lengths come from the offsets; Stats with a ragged offset of
    its own is written packed [total_q, h_q] (token stride h_q)."""
    device, _ = on_target
    lens_q, lens_kv = (3, 1, 6), (4, 2, 6)
    b, h_q, h_kv, d = 3, 2, 1, 32
    s_q, s_kv = 6, 6
    cu_q, cu_kv = cumulative(lens_q), cumulative(lens_kv)
    tq, tkv = cu_q[-1], cu_kv[-1]
    gen = torch.Generator().manual_seed(7)
    graph = cudnn.pygraph(io_data_type=F32)
    q = graph.tensor(dim=[b, h_q, s_q, d], stride=bshd(b, h_q, s_q, d))
    k = graph.tensor(dim=[b, h_kv, s_kv, d], stride=bshd(b, h_kv, s_kv, d))
    v = graph.tensor(dim=[b, h_kv, s_kv, d], stride=bshd(b, h_kv, s_kv, d))
    rq, rkv, rst = (graph.tensor(dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32) for _ in range(3))
    q.set_ragged_offset(rq)
    k.set_ragged_offset(rkv)
    v.set_ragged_offset(rkv)
    o, stats = graph.sdpa(q, k, v, generate_stats=True, attn_scale=0.2, use_causal_mask=True)
    o.set_output(True).set_ragged_offset(rq)                 # strides inferred token-major like q
    stats.set_output(True).set_ragged_offset(rst)
    graph.build([cudnn.heur_mode.A])
    assert o.get_stride() == bshd(b, h_q, s_q, d)
    assert stats.get_stride() == [s_q * h_q, 1, h_q, 1]
    q_t = rand(tq, h_q, d, dtype=torch.float32, device=device, gen=gen)
    k_t = rand(tkv, h_kv, d, dtype=torch.float32, device=device, gen=gen)
    v_t = rand(tkv, h_kv, d, dtype=torch.float32, device=device, gen=gen)
    o_t = torch.full((tq, h_q, d), float("nan"), device=device)
    st_t = torch.full((tq + 2, h_q, 1), float("nan"), device=device)
    graph.execute({q: q_t, k: k_t, v: v_t, o: o_t, stats: st_t, rq: offsets(cu_q, h_q * d, device),
                   rkv: offsets(cu_kv, h_kv * d, device), rst: offsets(cu_q, h_q, device)})
    assert torch.isnan(st_t[tq:]).all()
    for i in range(b):
        kw = dict(attn_scale=0.2, causal=True)
        gold, gold_lse = attention_reference(seq(q_t, cu_q, i), seq(k_t, cu_kv, i), seq(v_t, cu_kv, i), **kw)
        base, _ = attention_reference(seq(q_t, cu_q, i), seq(k_t, cu_kv, i), seq(v_t, cu_kv, i),
                                      dtype=torch.float32, **kw)
        assert_error_within(seq(o_t, cu_q, i), gold, base, msg=f"O of sequence {i}")
        torch.testing.assert_close(seq(st_t, cu_q, i).double(), gold_lse.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_ragged_backward(causal, on_target):
    """sdpa then sdpa_backward on packed tensors (dO/dQ/dK/dV with the forward's offsets), against
    autograd of the per-sequence reference."""
    device, _ = on_target
    lens_q, lens_kv = (5, 1, 9), (7, 2, 12)
    dtype = torch.float16 if device == "cuda" else torch.float32
    io = cudnn.data_type.HALF if dtype == torch.float16 else F32
    b, h_q, h_kv, d, scale = 3, 4, 2, 16, 0.3
    s_q, s_kv = 9, 12
    cu_q, cu_kv = cumulative(lens_q), cumulative(lens_kv)
    tq, tkv = cu_q[-1], cu_kv[-1]
    mask_kw = dict(use_causal_mask_bottom_right=True) if causal else {}
    ref_kw = dict(attn_scale=scale, causal=causal, causal_alignment="bottom_right")
    gen = torch.Generator().manual_seed(11)
    q_t = rand(tq, h_q, d, dtype=dtype, device=device, gen=gen)
    k_t = rand(tkv, h_kv, d, dtype=dtype, device=device, gen=gen)
    v_t = rand(tkv, h_kv, d, dtype=dtype, device=device, gen=gen)
    do_t = rand(tq, h_q, d, dtype=dtype, device=device, gen=gen)
    off_q, off_kv = offsets(cu_q, h_q * d, device), offsets(cu_kv, h_kv * d, device)
    len_q, len_kv = lengths(lens_q, device), lengths(lens_kv, device)

    fwd, g = ragged_fwd_graph(b, h_q, h_kv, s_q, s_kv, d, io, attn_scale=scale, **mask_kw)
    o_t = torch.empty(tq, h_q, d, dtype=dtype, device=device)
    st_t = torch.empty(b, h_q, s_q, 1, device=device)
    fwd.execute({g["q"]: q_t, g["k"]: k_t, g["v"]: v_t, g["o"]: o_t, g["stats"]: st_t, g["ragged_q"]: off_q,
                 g["ragged_kv"]: off_kv, g["seq_len_q"]: len_q, g["seq_len_kv"]: len_kv})

    bwd = cudnn.pygraph(io_data_type=io, intermediate_data_type=F32, compute_data_type=F32)
    q = bwd.tensor(name="Q", dim=[b, h_q, s_q, d], stride=bshd(b, h_q, s_q, d))
    k = bwd.tensor(name="K", dim=[b, h_kv, s_kv, d], stride=bshd(b, h_kv, s_kv, d))
    v = bwd.tensor(name="V", dim=[b, h_kv, s_kv, d], stride=bshd(b, h_kv, s_kv, d))
    o = bwd.tensor(name="O", dim=[b, h_q, s_q, d], stride=bshd(b, h_q, s_q, d))
    dO = bwd.tensor(name="dO", dim=[b, h_q, s_q, d], stride=bshd(b, h_q, s_q, d))
    stats = bwd.tensor(name="Stats", dim=[b, h_q, s_q, 1], stride=[h_q * s_q, s_q, 1, 1], data_type=F32)
    ragged_q = bwd.tensor(name="ragged_q", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    ragged_kv = bwd.tensor(name="ragged_kv", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    seq_len_q = bwd.tensor(name="seq_len_q", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    seq_len_kv = bwd.tensor(name="seq_len_kv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    for t, r in ((q, ragged_q), (k, ragged_kv), (v, ragged_kv), (o, ragged_q), (dO, ragged_q)):
        t.set_ragged_offset(r)
    dQ, dK, dV = bwd.sdpa_backward(q=q, k=k, v=v, o=o, dO=dO, stats=stats, attn_scale=scale,
                                   use_padding_mask=True, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv,
                                   max_total_seq_len_q=tq, max_total_seq_len_kv=tkv, **mask_kw)
    for t, h, s, r in ((dQ, h_q, s_q, ragged_q), (dK, h_kv, s_kv, ragged_kv), (dV, h_kv, s_kv, ragged_kv)):
        t.set_output(True).set_dim([b, h, s, d]).set_stride(bshd(b, h, s, d)).set_ragged_offset(r)
    bwd.build([cudnn.heur_mode.A])
    grads = {name: torch.full((n + 3, h, d), float("nan"), dtype=dtype, device=device)
             for name, n, h in (("dq", tq, h_q), ("dk", tkv, h_kv), ("dv", tkv, h_kv))}
    bwd.execute({q: q_t, k: k_t, v: v_t, o: o_t, dO: do_t, stats: st_t, ragged_q: off_q, ragged_kv: off_kv,
                 seq_len_q: len_q, seq_len_kv: len_kv, dQ: grads["dq"], dK: grads["dk"], dV: grads["dv"]})
    for name, n in (("dq", tq), ("dk", tkv), ("dv", tkv)):
        assert torch.isnan(grads[name][n:]).all(), f"{name} written past the packed tokens"

    for i in range(b):
        refs = []
        for dt in (torch.float64, dtype):
            rq, rk, rv = (seq(x, cu, i).to(dt).requires_grad_()
                          for x, cu in ((q_t, cu_q), (k_t, cu_kv), (v_t, cu_kv)))
            ro, _ = attention_reference(rq, rk, rv, dtype=dt, **ref_kw)
            ro.backward(seq(do_t, cu_q, i).to(dt))
            refs.append((ro, rq.grad, rk.grad, rv.grad))
        got = (seq(o_t, cu_q, i), seq(grads["dq"], cu_q, i), seq(grads["dk"], cu_kv, i), seq(grads["dv"], cu_kv, i))
        for name, x, gold, base in zip(("O", "dQ", "dK", "dV"), got, *refs):
            assert_error_within(x, gold.detach(), base.detach(), msg=f"{name} of sequence {i}")


def test_ragged_dropout_matches_padded_graph():
    """Dropout on packed tensors draws the mask of the padded problem the graph dims describe:
    the ragged graph equals the same graph on padded tensors with seq_len masks (and rng_dump)."""
    lens = (4, 1, 6)
    b, h, d, s, p = 3, 2, 16, 6, 0.25
    cu = cumulative(lens)
    gen = torch.Generator().manual_seed(3)
    q_t, k_t, v_t = (rand(cu[-1], h, d, dtype=torch.float32, device="cpu", gen=gen) for _ in range(3))
    graph, g = ragged_fwd_graph(b, h, h, s, s, d, F32, generate_stats=False, attn_scale=0.5,
                                dropout=p, dropout_seed=9, dropout_offset=2)
    o_t = torch.full((cu[-1], h, d), float("nan"))
    off, lens_t = offsets(cu, h * d, "cpu"), lengths(lens, "cpu")
    graph.execute({g["q"]: q_t, g["k"]: k_t, g["v"]: v_t, g["o"]: o_t, g["ragged_q"]: off, g["ragged_kv"]: off,
                   g["seq_len_q"]: lens_t, g["seq_len_kv"]: lens_t})

    def pad(x):
        out = torch.zeros(b, s, h, d)
        for i in range(b):
            out[i, :lens[i]] = x[cu[i]:cu[i + 1]]
        return out.transpose(1, 2)

    dense = cudnn.pygraph(io_data_type=F32)
    qd, kd, vd = (dense.tensor_like(pad(x)) for x in (q_t, k_t, v_t))
    sl_q, sl_kv = dense.tensor_like(lens_t), dense.tensor_like(lens_t)
    od, _ = dense.sdpa(qd, kd, vd, attn_scale=0.5, dropout=p, dropout_seed=9, dropout_offset=2,
                       use_padding_mask=True, seq_len_q=sl_q, seq_len_kv=sl_kv)
    od.set_output(True)
    dense.build()
    out_d = torch.empty(b, h, s, d)
    dense.execute({qd: pad(q_t), kd: pad(k_t), vd: pad(v_t), od: out_d, sl_q: lens_t, sl_kv: lens_t})
    for i in range(b):
        torch.testing.assert_close(seq(o_t, cu, i), out_d[i:i + 1, :, :lens[i]], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------

def _small_ragged(**sdpa_kw):
    lens = (3, 1, 4)
    b, h, d, s = 3, 2, 16, 4
    cu = cumulative(lens)
    graph, g = ragged_fwd_graph(b, h, h, s, s, d, F32, generate_stats=False, **sdpa_kw)
    gen = torch.Generator().manual_seed(0)
    x = rand(cu[-1], h, d, dtype=torch.float32, device="cpu", gen=gen)
    off, lens_t = offsets(cu, h * d, "cpu"), lengths(lens, "cpu")
    pack = {g["q"]: x, g["k"]: x, g["v"]: x, g["o"]: torch.empty_like(x), g["ragged_q"]: off,
            g["ragged_kv"]: off, g["seq_len_q"]: lens_t, g["seq_len_kv"]: lens_t}
    return graph, g, pack, cu, lens


def test_ragged_offset_errors():
    graph, g, pack, cu, lens = _small_ragged()
    graph.execute(pack)                                           # the good pack runs

    bad = dict(pack)
    bad[g["ragged_q"]] = offsets(cu, 32, "cpu") + torch.tensor([0, 0, 8, 8], dtype=torch.int32).view(-1, 1, 1, 1)
    with pytest.raises(cudnn.GraphError, match=r"ragged offset of q .*multiples of q's token stride 32"):
        graph.execute(bad)

    bad = dict(pack)
    bad[g["ragged_kv"]] = torch.tensor([0, 96, 32, 256], dtype=torch.int32).view(-1, 1, 1, 1)
    with pytest.raises(cudnn.GraphError, match="non-decreasing"):
        graph.execute(bad)

    bad = dict(pack)
    bad[g["seq_len_q"]] = lengths((3, 2, 4), "cpu")               # sequence 1 overlaps sequence 2
    with pytest.raises(cudnn.GraphError, match=r"seq_len_q\[1\] = 2 but the ragged offsets of q leave 1 tokens"):
        graph.execute(bad)

    bad = dict(pack)
    bad[g["seq_len_kv"]] = lengths((3, 1, 2), "cpu")              # a gap after sequence 2
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match=r"seq_len_kv\[2\] = 2 .*gaps between packed"):
        graph.execute(bad)

    bad = dict(pack)
    bad[g["ragged_q"]] = offsets((0, 3, 8, 9), 32, "cpu")          # 5 tokens > s_q = 4
    bad[g["seq_len_q"]] = lengths((3, 5, 1), "cpu")
    with pytest.raises(cudnn.GraphError, match=r"sequence 1 has 5 tokens .*s_q = 4"):
        graph.execute(bad)

    bad = dict(pack)
    bad[g["o"]] = torch.empty(cu[-1] - 1, 2, 16)                   # one token short
    with pytest.raises(cudnn.GraphError, match="o 'sdpa::O'.* too small for its ragged offsets"):
        graph.execute(bad)


def _ragged_qkv_graph(b, h, s, d):
    """A pygraph with packed (ragged) q, k, v sharing one offsets tensor: (graph, q, k, v, offsets)."""
    graph = cudnn.pygraph(io_data_type=F32)
    q, k, v = (graph.tensor(dim=[b, h, s, d], stride=bshd(b, h, s, d)) for _ in range(3))
    r = graph.tensor(dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    for t in (q, k, v):
        t.set_ragged_offset(r)
    return graph, q, k, v, r


def test_ragged_graph_errors():
    # a bias runs with packed tensors (as the padded call: tests/test_graph_compositions.py)
    b, h, s, d = 2, 2, 4, 16
    graph, q, k, v, r = _ragged_qkv_graph(b, h, s, d)
    bias = graph.tensor(dim=[1, h, s, s], stride=[h * s * s, s * s, s, 1])
    o, _ = graph.sdpa(q, k, v, is_inference=True, bias=bias)
    o.set_output(True).set_ragged_offset(r)
    graph.validate()

    # O without a ragged offset while q/k/v have one: named
    graph, q, k, v, r = _ragged_qkv_graph(b, h, s, d)
    o, _ = graph.sdpa(q, k, v, is_inference=True)
    o.set_output(True)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match=r"but o 'sdpa_0::O'.* does not"):
        graph.validate()

    # a packed O whose strides would overlap tokens; offsets of the wrong length / dtype
    for setup, err, pattern in (
            (lambda o, r: o.set_dim([b, h, s, d]).set_stride([h * s * d, s * d, d, 1]).set_ragged_offset(r),
             cudnn.GraphError, "packed tokens would overlap"),
            (lambda o, r: (o.set_ragged_offset(r), r.set_dim([b, 1, 1, 1])),
             cudnn.GraphError, r"dims \[b \+ 1, 1, 1, 1\]"),
            (lambda o, r: (o.set_ragged_offset(r), r.set_data_type(cudnn.data_type.FLOAT)),
             cudnn.GraphError, "INT32")):
        graph, q, k, v, r = _ragged_qkv_graph(b, h, s, d)
        o, _ = graph.sdpa(q, k, v, is_inference=True)
        o.set_output(True)
        setup(o, r)
        with pytest.raises(err, match=pattern):
            graph.validate()

    # ragged_offset_multiplier stays refused
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="ragged_offset_multiplier"):
        cudnn.pygraph().tensor(dim=[3, 1, 1, 1], stride=[1, 1, 1, 1], ragged_offset_multiplier=2)


# packed q over padded or paged K/V (chunked prefill, cuDNN's test_sdpa_chunked_prefill.py)
# ------------------------------------------------------------------------------------------------

def chunked_graph(b, h_q, h_kv, chunk, s_kv, d, dtype, *, paged=None, generate_stats=False, **sdpa_kw):
    """cuDNN's chunked-prefill graph: Q and O packed (ragged offsets), K/V padded BSHD-strided
    [b, h_kv, s_kv, d] or, with ``paged=(num_blocks, block)``, paged containers; padding mask."""
    graph = cudnn.pygraph(io_data_type=dtype, intermediate_data_type=F32, compute_data_type=F32)
    q = graph.tensor(name="Q", dim=[b, h_q, chunk, d], stride=[h_q * d, d, h_q * d, 1], data_type=dtype)
    rq = graph.tensor(name="Q_ragged", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64)
    q.set_ragged_offset(rq)
    kw = {}
    if paged is None:
        k = graph.tensor(name="K", dim=[b, h_kv, s_kv, d], stride=bshd(b, h_kv, s_kv, d), data_type=dtype)
        v = graph.tensor(name="V", dim=[b, h_kv, s_kv, d], stride=bshd(b, h_kv, s_kv, d), data_type=dtype)
    else:
        n, bs = paged
        k = graph.tensor(name="K", dim=[n, h_kv, bs, d], stride=[h_kv * bs * d, bs * d, d, 1], data_type=dtype)
        v = graph.tensor(name="V", dim=[n, h_kv, bs, d], stride=[h_kv * bs * d, bs * d, d, 1], data_type=dtype)
        per = -(-s_kv // bs)
        kw["paged_attention_k_table"] = graph.tensor(name="pt", dim=[b, 1, per, 1], stride=[per, per, 1, 1],
                                                     data_type=I32)
        kw["paged_attention_v_table"] = kw["paged_attention_k_table"]
        kw["paged_attention_max_seq_len_kv"] = s_kv
    lq = graph.tensor(name="seq_len_q", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    lkv = graph.tensor(name="seq_len_kv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    o, stats = graph.sdpa(name="chunk", q=q, k=k, v=v, use_padding_mask=True, seq_len_q=lq, seq_len_kv=lkv,
                          generate_stats=generate_stats, **kw, **sdpa_kw)
    o.set_output(True).set_dim([b, h_q, chunk, d]).set_stride([h_q * d, d, h_q * d, 1])
    ro = graph.tensor(name="O_ragged", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64)
    o.set_ragged_offset(ro)
    if stats is not None:
        stats.set_output(True).set_data_type(F32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, dict(q=q, rq=rq, k=k, v=v, o=o, ro=ro, lq=lq, lkv=lkv, stats=stats, pt=kw.get("paged_attention_k_table"))


@pytest.mark.parametrize("mode", ["chunked_causal_topleft", "plain_varlen", "paged_bottom_right"])
def test_chunked_prefill(mode, on_target):
    """Packed q over padded (or paged) K/V, per sequence against float64. cuDNN's own chunked prefill:
    chunk c of every sequence (chunk tokens) over its first (c + 1) * chunk keys, causal through a top-left
    band whose right bound is the chunk's offset c * chunk; also sequences of different lengths without a
    band, and a paged cache with bottom-right causal; Stats padded, -inf past each sequence."""
    device, _ = on_target
    dtype = torch.float16 if device == "cuda" else torch.float32
    cdt = cudnn.data_type.HALF if dtype == torch.float16 else F32
    b, h_q, h_kv, d, chunk = 2, 4, 2, 16, 5
    gen = torch.Generator().manual_seed(len(mode))
    if mode == "chunked_causal_topleft":
        c = 2                                                    # the third chunk
        lens_q, lens_kv, s_kv = [chunk, chunk], [(c + 1) * chunk] * 2, (c + 1) * chunk
        sdpa_kw, ref_kw = dict(diagonal_band_right_bound=c * chunk), dict(window=(-1, c * chunk), attn_scale=1.0)
    elif mode == "plain_varlen":
        lens_q, lens_kv, s_kv = [3, 5], [9, 4], 11
        sdpa_kw, ref_kw = dict(attn_scale=0.3), dict(attn_scale=0.3)
    else:
        lens_q, lens_kv, s_kv = [4, 2], [13, 6], 16
        sdpa_kw = dict(use_causal_mask_bottom_right=True, attn_scale=0.25)
        ref_kw = dict(causal=True, causal_alignment="bottom_right", attn_scale=0.25)
    paged = (9, 4) if mode.startswith("paged") else None
    graph, g = chunked_graph(b, h_q, h_kv, chunk, s_kv, d, cdt, paged=paged, generate_stats=True, **sdpa_kw)
    cu = cumulative(lens_q)
    q_t = rand(cu[-1], h_q, d, dtype=dtype, device=device, gen=gen)
    k_pad = rand(b, s_kv, h_kv, d, dtype=dtype, device=device, gen=gen)          # BSHD memory
    v_pad = rand(b, s_kv, h_kv, d, dtype=dtype, device=device, gen=gen)
    o_t = torch.full((cu[-1] + 2, h_q, d), float("nan"), dtype=dtype, device=device)
    stats_t = torch.full((b, h_q, chunk, 1), float("nan"), device=device)
    pack = {g["q"]: q_t, g["rq"]: offsets(cu, h_q * d, device).long(), g["o"]: o_t,
            g["ro"]: offsets(cu, h_q * d, device).long(), g["lq"]: lengths(lens_q, device),
            g["lkv"]: lengths(lens_kv, device), g["stats"]: stats_t}
    if paged is None:
        pack[g["k"]], pack[g["v"]] = k_pad.transpose(1, 2), v_pad.transpose(1, 2)
    else:
        n, bs = paged
        table = torch.randperm(n, generator=gen)[: b * (s_kv // bs)].view(b, 1, -1, 1).to(device, torch.int32)
        kc, vc = (torch.zeros(n, h_kv, bs, d, dtype=dtype, device=device) for _ in range(2))
        for i in range(b):
            for j, blk in enumerate(table[i, 0, :, 0].tolist()):
                kc[blk] = k_pad[i, j * bs:(j + 1) * bs].transpose(0, 1)
                vc[blk] = v_pad[i, j * bs:(j + 1) * bs].transpose(0, 1)
        pack.update({g["k"]: kc, g["v"]: vc, g["pt"]: table})
    graph.execute(pack, torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8))
    assert torch.isnan(o_t[cu[-1]:]).all(), "O written past the packed tokens"
    for i in range(b):
        k_i = k_pad[i:i + 1, :lens_kv[i]].transpose(1, 2).cpu()
        v_i = v_pad[i:i + 1, :lens_kv[i]].transpose(1, 2).cpu()
        gold, gold_lse = attention_reference(seq(q_t, cu, i), k_i, v_i, **ref_kw)
        base, _ = attention_reference(seq(q_t, cu, i), k_i, v_i, dtype=dtype, **ref_kw)
        assert_error_within(seq(o_t, cu, i), gold, base, msg=f"O of sequence {i} ({mode}, {on_target})")
        got_lse = stats_t[i:i + 1, :, :lens_q[i]].cpu().double()
        torch.testing.assert_close(got_lse, gold_lse.double(), atol=2e-3, rtol=2e-3)
        assert (stats_t[i, :, lens_q[i]:] == float("-inf")).all(), f"Stats rows past sequence {i}'s length"


def test_chunked_prefill_refusals():
    """What the packed-q path cannot run is named, not run wrong: a top-left causal mask whose bottom-right
    form would need a negative bound, dropout."""
    b, h, d, chunk = 2, 2, 16, 4
    graph, g = chunked_graph(b, h, h, chunk, 8, d, F32, use_causal_mask=True)       # top-left, right bound 0
    x = torch.randn(2 * chunk, h, d)
    off = offsets(cumulative([chunk, chunk]), h * d, "cpu").long()
    pack = {g["q"]: x, g["rq"]: off, g["o"]: torch.empty_like(x), g["ro"]: off,
            g["lq"]: lengths([chunk, chunk], "cpu"), g["lkv"]: lengths([8, 8], "cpu"),
            g["k"]: torch.randn(b, h, 8, d), g["v"]: torch.randn(b, h, 8, d)}
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match=r"top-left diagonal band with packed q"):
        graph.execute(pack)
    pack[g["lkv"]] = lengths([chunk, chunk], "cpu")              # offset 0: top-left = bottom-right, runs
    graph.execute(pack)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match=r"dropout with packed q over padded"):
        chunked_graph(b, h, h, chunk, 8, d, F32, dropout=(0.1, 1, 2))
