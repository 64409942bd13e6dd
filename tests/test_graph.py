"""The cuDNN-compatible Graph door: API surface, argument translation, caching, errors.

Numerics here check the *translation* (cuDNN's argument names -> the functional call), so the
reference is written from cuDNN's own test reference (``test/python/test_mhas.py: compute_ref``:
masks built with ``triu``/``tril`` from ``diagonal_band_left_bound``/``right_bound``), in float64,
independent of fusedattn's code. Kernel accuracy itself is tested in test_forward/test_backward.

Most tests run on the CPU path; the ones taking ``target`` also run the Triton kernels under the
interpreter (CI) and on the GPU (device machine).
"""
import math

import pytest
import torch

import fusedattn
import fusedattn as cudnn
from fusedattn.backends.cpu import dropout_keep_mask
from fusedattn.graph import graphs as graphs_module
from fusedattn.graph import sdpa as sdpa_module
from fusedattn.graph import support as graph_support
from fusedattn.testing import guarded

F = torch.nn.functional


@pytest.fixture
def handle():
    h = cudnn.create_handle()
    yield h
    cudnn.destroy_handle(h)


@pytest.fixture
def on_target(target, monkeypatch):
    """(device, backend) with graphs built without backend= running on that backend."""
    device, backend = target
    monkeypatch.setattr(graphs_module, "DEFAULT_BACKEND", backend)
    return device, backend


def rand(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


# ------------------------------------------------------------------------------------------------
# a float64 reference in cuDNN's own terms (test_mhas.py compute_ref)
# ------------------------------------------------------------------------------------------------

def cudnn_keep_mask(b, s_q, s_kv, alignment="top_left", left_bound=None, right_bound=None,
                    seq_len_q=None, seq_len_kv=None):
    """bool [b, 1, s_q, s_kv], True = attend, from cuDNN's bound definitions."""
    keep = torch.ones(b, 1, s_q, s_kv, dtype=torch.bool)
    lq = [s_q] * b if seq_len_q is None else [int(x) for x in seq_len_q.flatten()]
    lkv = [s_kv] * b if seq_len_kv is None else [int(x) for x in seq_len_kv.flatten()]
    for i in range(b):
        off = (lkv[i] - lq[i]) if alignment == "bottom_right" else 0
        ones = torch.ones(s_q, s_kv, dtype=torch.bool)
        if right_bound is not None:
            keep[i, 0] &= ~ones.triu(diagonal=off + 1 + right_bound)
        if left_bound is not None:
            keep[i, 0] &= ~ones.tril(diagonal=off - left_bound)
        keep[i, 0, :, lkv[i]:] = False
        keep[i, 0, lq[i]:, :] = False
    return keep


def ref_attention(q, k, v, scale, keep=None, bias=None, alibi_slopes=None, drop_keep=None, p=0.0):
    """float64 softmax(scale q k^T + bias + alibi, masked) [dropout] v; empty rows -> 0 (lse -inf); returns (o, lse)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = scale * q @ k.transpose(-1, -2)
    if bias is not None:
        s = s + bias.double()
    if alibi_slopes is not None:
        i = torch.arange(s.shape[-2]).view(-1, 1)
        j = torch.arange(s.shape[-1]).view(1, -1)
        s = s + alibi_slopes.double().view(1, -1, 1, 1) * (j - i)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    prob = e / torch.where(l > 0, l, torch.ones_like(l))
    # a row with no key: Stats -inf, as cuDNN (9.14 and later) writes
    lse = torch.where(l > 0, m + torch.log(torch.where(l > 0, l, torch.ones_like(l))), torch.full_like(l, float("-inf")))
    if drop_keep is not None:
        prob = prob * drop_keep / (1 - p)
    return prob @ v, lse


def seed_alibi_slopes(num_heads):
    """The seed's get_alibi_slopes (sdpa-tutorial.md)."""
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3)))
    slopes = base ** torch.arange(1, closest_power_of_2 + 1)
    if closest_power_of_2 != num_heads:
        extra = (base ** 0.5) ** torch.arange(1, 2 * (num_heads - closest_power_of_2) + 1, 2)
        slopes = torch.cat([slopes, extra])
    return slopes


def fwd_graph(q_t, k_t, v_t, *, generate_stats=False, io=cudnn.data_type.FLOAT, **sdpa_kw):
    """A built pygraph with one sdpa node over tensor_like inputs; returns (graph, q, k, v, o, stats)."""
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    q, k, v = graph.tensor_like(q_t), graph.tensor_like(k_t), graph.tensor_like(v_t)
    o, stats = graph.sdpa(q=q, k=k, v=v, generate_stats=generate_stats, **sdpa_kw)
    o.set_output(True)
    if stats is not None:
        stats.set_output(True)
    return graph, q, k, v, o, stats


# ------------------------------------------------------------------------------------------------
# module-level API
# ------------------------------------------------------------------------------------------------

def test_module_api():
    assert cudnn.backend_version() == 91900 and isinstance(cudnn.backend_version(), int)
    assert cudnn.backend_version_string() == "9.19.0"
    assert cudnn.backend_version() >= 90500          # the paged sample's gate
    assert isinstance(fusedattn.__version__, str)
    for name in ("HALF", "BFLOAT16", "FLOAT", "DOUBLE", "INT32", "INT64", "BOOLEAN", "UINT8",
                 "FP8_E4M3", "FP8_E5M2", "NOT_SET"):
        assert hasattr(cudnn.data_type, name)
    assert {m.name for m in cudnn.heur_mode} >= {"A", "B", "FALLBACK"}
    assert {m.name for m in cudnn.diagonal_alignment} == {"TOP_LEFT", "BOTTOM_RIGHT"}
    assert issubclass(cudnn.GraphError, ValueError) and issubclass(cudnn.GraphError, fusedattn.FusedAttnError)
    assert issubclass(cudnn.cudnnGraphNotSupportedError, fusedattn.NotSupportedError)
    assert issubclass(cudnn.cudnnGraphNotSupportedError, NotImplementedError)


def test_handle_and_stream():
    h = cudnn.create_handle()
    cudnn.set_stream(h, 0)
    assert cudnn.get_stream(h) == 0
    with pytest.raises(TypeError, match="stream"):
        cudnn.set_stream(h, "stream")
    cudnn.destroy_handle(h)
    q = rand(1, 2, 5, 16)
    graph, qg, kg, vg, o, _ = fwd_graph(q, q, q, attn_scale=0.5)
    graph.build([cudnn.heur_mode.A])
    with pytest.raises(cudnn.GraphError, match="destroyed"):
        graph.execute({qg: q, kg: q, vg: q, o: torch.empty_like(q)}, None, h)


def test_tensor_api():
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    t = graph.tensor(name="Q", dim=[2, 4, 8, 16], stride=[512, 128, 16, 1], data_type=cudnn.data_type.HALF, uid=7)
    assert t.get_name() == "Q" and t.get_dim() == [2, 4, 8, 16] and t.get_stride() == [512, 128, 16, 1]
    assert t.get_data_type() == cudnn.data_type.HALF and t.get_uid() == 7 and not t.get_is_virtual()
    assert t.set_uid(9).set_name("Q2").set_data_type(torch.float32) is t      # chainable, torch dtypes ok
    assert t.get_uid() == 9 and t.get_data_type() == cudnn.data_type.FLOAT
    like = graph.tensor_like(torch.empty(3, 5, 7, 8).transpose(1, 2))
    assert like.get_dim() == [3, 7, 5, 8] and like.get_stride() == [280, 8, 56, 1]
    off = graph.tensor(dim=[3, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
    assert like.set_ragged_offset(off).get_ragged_offset() is off
    with pytest.raises(cudnn.GraphError, match="uid"):
        t.set_uid(-3)
    with pytest.raises(cudnn.GraphError, match="dim"):
        t.set_dim([2, "x"])


# ------------------------------------------------------------------------------------------------
# the released API end to end: pygraph, tensor_like, uids, variant packs, handle spellings
# ------------------------------------------------------------------------------------------------

def test_pygraph_lifecycle_and_variant_packs(on_target, handle):
    device, _ = on_target
    b, h, s_q, s_kv, d = 2, 3, 11, 19, 32
    q_t, k_t, v_t = (rand(b, h, n, d, device=device, seed=i) for i, n in enumerate((s_q, s_kv, s_kv)))
    graph, q, k, v, o, stats = fwd_graph(q_t, k_t, v_t, generate_stats=True, attn_scale=0.3,
                                         use_causal_mask_bottom_right=True, name="attn")
    o.set_dim([b, h, s_q, d]).set_stride([h * s_q * d, s_q * d, d, 1])
    stats.set_data_type(cudnn.data_type.FLOAT)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    assert graph.get_execution_plan_count() == 1
    assert o.get_name() == "attn::O" and stats.get_dim() == [b, h, s_q, 1]   # stats inferred
    workspace = torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8)
    keep = cudnn_keep_mask(b, s_q, s_kv, "bottom_right", right_bound=0)
    want_o, want_lse = ref_attention(q_t.cpu(), k_t.cpu(), v_t.cpu(), 0.3, keep)

    # keyed by graph tensors, handle positional; outputs in NaN-guarded buffers
    out = guarded((b, h, s_q, d), torch.float32, device, fill=None)
    st = guarded((b, h, s_q, 1), torch.float32, device, fill=None)
    graph.execute({q: q_t, k: k_t, v: v_t, o: out.view, stats: st.view, None: None}, workspace, handle)
    torch.testing.assert_close(out.view.cpu().double(), want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(st.view.cpu().double(), want_lse, atol=2e-5, rtol=2e-5)
    out.check_untouched("O")
    st.check_untouched("Stats")

    # keyed by uids, handle keyword; a second execute reuses the cached translation
    o2, st2 = torch.full_like(out.view, float("nan")), torch.full_like(st.view, float("nan"))
    graph.execute({q.get_uid(): q_t, k.get_uid(): k_t, v.get_uid(): v_t, o.get_uid(): o2, stats.get_uid(): st2},
                  workspace, handle=handle)
    assert torch.equal(o2, out.view) and torch.equal(st2, st.view)


def test_explicit_uids_and_query():
    q_t = rand(1, 2, 6, 16)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q = graph.tensor(name="Q", dim=q_t.shape, stride=q_t.stride(), uid=1)
    k = graph.tensor(name="K", dim=q_t.shape, stride=q_t.stride(), uid=2)
    v = graph.tensor(name="V", dim=q_t.shape, stride=q_t.stride(), uid=3)
    o, _ = graph.sdpa(q, k, v, attn_scale=0.25, is_inference=True)
    o.set_output(True).set_uid(4)
    graph.build([cudnn.heur_mode.FALLBACK])
    assert graph.query_tensor_attributes_of_uid(4) is o
    out = torch.empty_like(q_t)
    graph.execute({1: q_t, 2: q_t, 3: q_t, 4: out}, None)
    want, _ = ref_attention(q_t, q_t, q_t, 0.25)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


def test_default_scale_is_one():
    """cuDNN applies no scale when attn_scale is None (not 1/sqrt(d))."""
    q_t, k_t, v_t = rand(1, 2, 7, 16, seed=1), rand(1, 2, 9, 16, seed=2), rand(1, 2, 9, 16, seed=3)
    graph, q, k, v, o, _ = fwd_graph(q_t, k_t, v_t)
    graph.build()
    out = torch.empty(1, 2, 7, 16)
    graph.execute({q: q_t, k: k_t, v: v_t, o: out})
    torch.testing.assert_close(out.double(), ref_attention(q_t, k_t, v_t, 1.0)[0], atol=2e-5, rtol=2e-5)


def test_attn_scale_tensor_pass_by_value():
    q_t, k_t, v_t = rand(2, 2, 5, 16, seed=1), rand(2, 2, 8, 16, seed=2), rand(2, 2, 8, 16, seed=3)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v = graph.tensor_like(q_t), graph.tensor_like(k_t), graph.tensor_like(v_t)
    scale = graph.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT,
                         is_pass_by_value=True)
    o, _ = graph.sdpa(q, k, v, attn_scale=scale, generate_stats=False)
    o.set_output(True)
    graph.build([cudnn.heur_mode.A])
    out = torch.empty(2, 2, 5, 16)
    for value in (0.5, 0.125):   # the scalar is read per execute
        graph.execute({q: q_t, k: k_t, v: v_t, o: out, scale: torch.full((1, 1, 1, 1), value)}, None)
        torch.testing.assert_close(out.double(), ref_attention(q_t, k_t, v_t, value)[0], atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------------------
# mask translation: every cuDNN spelling against cuDNN's own reference
# ------------------------------------------------------------------------------------------------

BANDS = [
    # (sdpa kwargs, (alignment, left_bound, right_bound) in cuDNN's terms)
    (dict(use_causal_mask=True), ("top_left", None, 0)),
    (dict(use_causal_mask_bottom_right=True), ("bottom_right", None, 0)),
    (dict(diagonal_band_right_bound=2), ("top_left", None, 2)),
    (dict(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0,
          diagonal_band_left_bound=4), ("bottom_right", 4, 0)),
    (dict(diagonal_band_left_bound=1, diagonal_band_right_bound=0), ("top_left", 1, 0)),   # diagonal only
    (dict(use_causal_mask=True, sliding_window_length=3), ("top_left", 3, 0)),
    (dict(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, left_bound=5, right_bound=1),
     ("bottom_right", 5, 1)),
    (dict(diagonal_band_left_bound=2), ("top_left", 2, None)),
]


@pytest.mark.parametrize("s_q,s_kv", [(13, 21), (21, 13)], ids=["sq<skv", "sq>skv"])
@pytest.mark.parametrize("kw,band", BANDS, ids=[f"band{i}" for i in range(len(BANDS))])
def test_band_translation(kw, band, s_q, s_kv):
    b, h, d = 2, 2, 16
    q_t, k_t, v_t = rand(b, h, s_q, d, seed=1), rand(b, h, s_kv, d, seed=2), rand(b, h, s_kv, d, seed=3)
    graph, q, k, v, o, stats = fwd_graph(q_t, k_t, v_t, generate_stats=True, attn_scale=0.4, **kw)
    graph.build()
    out, st = torch.empty(b, h, s_q, d), torch.empty(b, h, s_q, 1)
    graph.execute({q: q_t, k: k_t, v: v_t, o: out, stats: st})
    keep = cudnn_keep_mask(b, s_q, s_kv, band[0], band[1], band[2])
    want_o, want_lse = ref_attention(q_t, k_t, v_t, 0.4, keep)
    torch.testing.assert_close(out.double(), want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(st.double(), want_lse, atol=2e-5, rtol=2e-5)


def test_band_on_kernel(on_target):
    """One band + padding case through the Triton kernel (interpreter in CI, GPU on the device)."""
    device, _ = on_target
    b, h, s_q, s_kv, d = 2, 2, 9, 14, 16
    q_t, k_t, v_t = (rand(b, h, n, d, device=device, seed=i) for i, n in enumerate((s_q, s_kv, s_kv)))
    lq = torch.tensor([9, 5], dtype=torch.int32).view(b, 1, 1, 1)
    lkv = torch.tensor([11, 14], dtype=torch.int32).view(b, 1, 1, 1)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v = graph.tensor_like(q_t), graph.tensor_like(k_t), graph.tensor_like(v_t)
    sq, skv = graph.tensor_like(lq.to(device)), graph.tensor_like(lkv.to(device))
    o, _ = graph.sdpa(q, k, v, generate_stats=False, attn_scale=0.5, use_padding_mask=True, seq_len_q=sq,
                      seq_len_kv=skv, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
                      diagonal_band_left_bound=3, diagonal_band_right_bound=1)
    o.set_output(True)
    graph.build()
    out = torch.full((b, h, s_q, d), float("nan"), device=device)
    graph.execute({q: q_t, k: k_t, v: v_t, sq: lq.to(device), skv: lkv.to(device), o: out})
    keep = cudnn_keep_mask(b, s_q, s_kv, "bottom_right", 3, 1, lq, lkv)
    want, _ = ref_attention(q_t.cpu(), k_t.cpu(), v_t.cpu(), 0.5, keep)
    torch.testing.assert_close(out.cpu().double(), want, atol=1e-4, rtol=1e-4)
    assert (out[1, :, 5:] == 0).all()          # padded query rows give 0


# ------------------------------------------------------------------------------------------------
# bias, ALiBi, dropout, backward with dBias
# ------------------------------------------------------------------------------------------------

def test_bias_bool_and_alibi():
    b, h, s_q, s_kv, d = 2, 3, 8, 12, 16
    q_t, k_t, v_t = rand(b, h, s_q, d, seed=1), rand(b, h, s_kv, d, seed=2), rand(b, h, s_kv, d, seed=3)
    bias_t = rand(1, h, s_q, s_kv, seed=4)
    graph, q, k, v, o, _ = fwd_graph(q_t, k_t, v_t, attn_scale=0.3, use_alibi_mask=True, use_causal_mask=True,
                                     bias=None)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v, bias = (graph.tensor_like(t) for t in (q_t, k_t, v_t, bias_t))
    o, _ = graph.sdpa(q, k, v, is_inference=True, attn_scale=0.3, bias=bias, use_alibi_mask=True,
                      use_causal_mask=True)
    o.set_output(True)
    graph.build()
    out = torch.empty(b, h, s_q, d)
    graph.execute({q: q_t, k: k_t, v: v_t, bias: bias_t, o: out})
    keep = cudnn_keep_mask(b, s_q, s_kv, "top_left", None, 0)
    want, _ = ref_attention(q_t, k_t, v_t, 0.3, keep, bias=bias_t, alibi_slopes=seed_alibi_slopes(h))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)

    # a BOOLEAN bias is a keep-mask (as PyTorch's SDPA takes it)
    mask_t = rand(b, 1, s_q, s_kv, seed=5) > -0.5
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v, m = (graph.tensor_like(t) for t in (q_t, k_t, v_t, mask_t))
    o, _ = graph.sdpa(q, k, v, is_inference=True, attn_scale=0.3, attn_bias=m)
    o.set_output(True)
    graph.build()
    graph.execute({q: q_t, k: k_t, v: v_t, m: mask_t, o: out})
    torch.testing.assert_close(out.double(), ref_attention(q_t, k_t, v_t, 0.3, mask_t)[0], atol=2e-5, rtol=2e-5)


def _dropout_graph(q_t, k_t, v_t, seed_t, offset_t, p, rng_dump_t=None):
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v = graph.tensor_like(q_t), graph.tensor_like(k_t), graph.tensor_like(v_t)
    seed, offset = graph.tensor_like(seed_t), graph.tensor_like(offset_t)
    rng = graph.tensor_like(rng_dump_t) if rng_dump_t is not None else None
    o, stats = graph.sdpa(q, k, v, generate_stats=True, attn_scale=0.5, dropout=(p, seed, offset), rng_dump=rng)
    o.set_output(True)
    stats.set_output(True)
    graph.build([cudnn.heur_mode.A])
    return graph, (q, k, v, seed, offset, rng, o, stats)


def test_dropout_both_spellings_and_rng_dump(on_target):
    device, _ = on_target
    b, h, s_q, s_kv, d, p = 2, 2, 7, 10, 16, 0.25
    q_t, k_t, v_t = (rand(b, h, n, d, device=device, seed=i) for i, n in enumerate((s_q, s_kv, s_kv)))
    seed_t = torch.full((1, 1, 1, 1), 123456, dtype=torch.int64, device=device)
    offset_t = torch.full((1, 1, 1, 1), 789, dtype=torch.int64, device=device)
    rng_t = torch.zeros(b, h, s_q, s_kv, device=device)
    graph, (q, k, v, seed, offset, rng, o, stats) = _dropout_graph(q_t, k_t, v_t, seed_t, offset_t, p, rng_t)
    out, st = torch.empty(b, h, s_q, d, device=device), torch.empty(b, h, s_q, 1, device=device)
    graph.execute({q: q_t, k: k_t, v: v_t, seed: seed_t, offset: offset_t, rng: rng_t, o: out, stats: st})
    mask = dropout_keep_mask(b, h, s_q, s_kv, p, 123456, 789, "cpu")
    assert torch.equal(rng_t.cpu(), mask.float()), "rng_dump must be the kept mask (1 kept, 0 dropped)"
    assert 0 < mask.float().mean() < 1
    want, want_lse = ref_attention(q_t.cpu(), k_t.cpu(), v_t.cpu(), 0.5, drop_keep=mask, p=p)
    torch.testing.assert_close(out.cpu().double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st.cpu().double(), want_lse, atol=1e-4, rtol=1e-4)

    # the seeds' spelling: dropout=p, dropout_seed=int, dropout_offset=int -> the same mask
    graph2, q2, k2, v2, o2, _ = fwd_graph(q_t, k_t, v_t, attn_scale=0.5, dropout=p, dropout_seed=123456,
                                          dropout_offset=789)
    graph2.build()
    out2 = torch.empty_like(out)
    graph2.execute({q2: q_t, k2: k_t, v2: v_t, o2: out2})
    assert torch.equal(out2, out)


def test_backward_with_dbias_and_dropout(on_target):
    """sdpa_backward as cuDNN's test_mhas builds it: dBias from tensor_like, dropout tuple,
    deterministic flag; gradients against float64 autograd with the same dropout mask."""
    device, _ = on_target
    b, h, h_kv, s_q, s_kv, d, p = 1, 4, 2, 6, 9, 16, 0.2
    q_t = rand(b, h, s_q, d, device=device, seed=1)
    k_t, v_t = rand(b, h_kv, s_kv, d, device=device, seed=2), rand(b, h_kv, s_kv, d, device=device, seed=3)
    bias_t = rand(1, h, s_q, s_kv, device=device, seed=4)
    do_t = rand(b, h, s_q, d, device=device, seed=5)
    seed_t = torch.full((1, 1, 1, 1), 7, dtype=torch.int64, device=device)
    off_t = torch.full((1, 1, 1, 1), 3, dtype=torch.int64, device=device)
    kw = dict(attn_scale=0.5, use_causal_mask=True)

    fwd = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v, bias, seed, off = (fwd.tensor_like(t) for t in (q_t, k_t, v_t, bias_t, seed_t, off_t))
    o, stats = fwd.sdpa(q, k, v, generate_stats=True, bias=bias, dropout=(p, seed, off), **kw)
    o.set_output(True)
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    fwd.build()
    o_t, st_t = torch.empty(b, h, s_q, d, device=device), torch.empty(b, h, s_q, 1, device=device)
    fwd.execute({q: q_t, k: k_t, v: v_t, bias: bias_t, seed: seed_t, off: off_t, o: o_t, stats: st_t}, None)

    bwd = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v, o, dO, stats, bias, seed, off = (bwd.tensor_like(t) for t in
                                              (q_t, k_t, v_t, o_t, do_t, st_t, bias_t, seed_t, off_t))
    dbias_t = torch.full_like(bias_t, float("nan"))
    dBias = bwd.tensor_like(dbias_t).set_stride((h * s_q * s_kv, s_q * s_kv, s_kv, 1))
    dQ, dK, dV = bwd.sdpa_backward(q=q, k=k, v=v, o=o, dO=dO, stats=stats, bias=bias, dBias=dBias,
                                   dropout=(p, seed, off), use_deterministic_algorithm=True,
                                   max_total_seq_len_q=None, **kw)
    for g, t in ((dQ, q_t), (dK, k_t), (dV, v_t)):
        g.set_output(True).set_dim(t.size()).set_stride(t.stride())
    bwd.build()
    dq_t, dk_t, dv_t = (torch.full_like(t, float("nan")) for t in (q_t, k_t, v_t))
    bwd.execute({q: q_t, k: k_t, v: v_t, o: o_t, dO: do_t, stats: st_t, bias: bias_t, seed: seed_t, off: off_t,
                 dBias: dbias_t, dQ: dq_t, dK: dk_t, dV: dv_t}, None)

    mask = dropout_keep_mask(b, h, s_q, s_kv, p, 7, 3, "cpu")
    keep = cudnn_keep_mask(b, s_q, s_kv, "top_left", None, 0)
    qr, kr, vr, br = (t.detach().cpu().double().requires_grad_() for t in (q_t, k_t, v_t, bias_t))
    want_o, _ = ref_attention(qr, kr, vr, 0.5, keep, bias=br, drop_keep=mask, p=p)
    want_o.backward(do_t.cpu().double())
    torch.testing.assert_close(o_t.cpu().double(), want_o.detach(), atol=1e-4, rtol=1e-4)
    for got, ref, name in ((dq_t, qr, "dQ"), (dk_t, kr, "dK"), (dv_t, vr, "dV"), (dbias_t, br, "dBias")):
        torch.testing.assert_close(got.cpu().double(), ref.grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------
# the Graph wrapper: positional inputs in first-seen order, outputs, dict calls
# ------------------------------------------------------------------------------------------------

def test_graph_wrapper_io_order_and_layout(handle):
    b, h, s, d = 2, 2, 9, 16
    Q = rand(b, s, h, d, seed=1).transpose(1, 2)      # BSHD memory, BHSD logical
    KV = rand(b, h, s, d, seed=2)
    with cudnn.Graph(io_data_type=torch.float32) as graph:     # torch dtypes accepted, as cuDNN's wrapper
        out, stats = graph.sdpa(q=Q, k=KV, v=KV, attn_scale=0.25, generate_stats=True, use_causal_mask=True)
        out.set_output(True).set_dim(Q.shape).set_stride(Q.stride())
        stats.set_output(True)
    O, S = graph(Q, KV, handle=handle)                 # KV used twice: one input
    assert O.stride() == Q.stride()                    # allocated with the strides set on it
    keep = cudnn_keep_mask(b, s, s, "top_left", None, 0)
    want_o, want_lse = ref_attention(Q, KV, KV, 0.25, keep)
    torch.testing.assert_close(O.double(), want_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(S.double(), want_lse, atol=2e-5, rtol=2e-5)
    with pytest.raises(cudnn.GraphError, match=r"takes 2 input\(s\)"):
        graph(Q, KV, KV, handle=handle)
    # a dict call (keys: the torch tensors the graph was built from, graph tensors, uids or names)
    # fills in the outputs and returns the dict
    res = graph({Q: Q, KV: KV})
    assert torch.equal(res[out], O) and torch.equal(res[stats], S)
    # set_io_tuples: another order
    graph.set_io_tuples([KV, Q], [stats, out])
    S2, O2 = graph(KV, Q)
    assert torch.equal(O2, O) and torch.equal(S2, S)


def test_graph_rebuild_reuses_probe(monkeypatch):
    """Building the same static problem twice probes (and so compiles) once; execute never re-lowers."""
    q = rand(1, 2, 5, 16)
    calls = []
    real = fusedattn.functional.attention_forward

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(fusedattn.functional, "attention_forward", counting)
    for _ in range(2):
        with cudnn.Graph(io_data_type=cudnn.data_type.FLOAT) as graph:
            o, _ = graph.sdpa(q=q, k=q, v=q, attn_scale=0.7, is_inference=True, diagonal_band_right_bound=3)
            o.set_output(True)
    n_build = len(calls)
    assert n_build <= 1
    monkeypatch.setattr(sdpa_module.SdpaNode, "lower", lambda *a: pytest.fail("execute re-lowered the graph"))
    monkeypatch.setattr(sdpa_module.SdpaNode, "validate", lambda *a: pytest.fail("execute re-validated"))
    r1, r2 = graph(q), graph(q)
    assert torch.equal(r1, r2) and len(calls) == n_build + 2


# ------------------------------------------------------------------------------------------------
# errors: GraphError naming the tensor and the problem
# ------------------------------------------------------------------------------------------------

def _qkv_graph(q_shape=(1, 4, 8, 16), k_shape=(1, 4, 8, 16), v_shape=None):
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    v_shape = v_shape or k_shape
    q = graph.tensor(name="Q", dim=q_shape, stride=torch.empty(q_shape).stride())
    k = graph.tensor(name="K", dim=k_shape, stride=torch.empty(k_shape).stride())
    v = graph.tensor(name="V", dim=v_shape, stride=torch.empty(v_shape).stride())
    return graph, q, k, v


@pytest.mark.parametrize("q_shape,k_shape,v_shape,pattern", [
    ((1, 4, 8, 16), (1, 4, 8, 32), None, r"'K'.*head dim 32.*16"),
    ((1, 4, 8, 16), (1, 3, 8, 16), None, r"multiple of key/value heads"),
    ((2, 4, 8, 16), (1, 4, 8, 16), None, r"batch sizes differ"),
    ((1, 4, 8, 16), (1, 4, 8, 16), (1, 4, 9, 16), r"same sequence length"),
    ((1, 4, 8), (1, 4, 8, 16), None, r"'Q'.*4-D"),
], ids=["head_dim", "gqa_ratio", "batch", "kv_len", "rank"])
def test_inconsistent_dims(q_shape, k_shape, v_shape, pattern):
    graph, q, k, v = _qkv_graph(q_shape, k_shape, v_shape)
    o, _ = graph.sdpa(q, k, v, is_inference=True)
    o.set_output(True)
    with pytest.raises(cudnn.GraphError, match=pattern):
        graph.validate()


def test_output_and_tensor_without_dims():
    graph, q, k, v = _qkv_graph()
    o, _ = graph.sdpa(q, k, v, is_inference=True)
    o.set_output(True).set_dim([1, 4, 8, 16])          # dims without strides
    with pytest.raises(cudnn.GraphError, match=r"O.*set_dim and set_stride must be declared together"):
        graph.validate()
    graph, q, k, v = _qkv_graph()
    bad = graph.tensor(name="Qx", data_type=cudnn.data_type.FLOAT)
    o, _ = graph.sdpa(bad, k, v, is_inference=True)
    o.set_output(True)
    with pytest.raises(cudnn.GraphError, match=r"'Qx' \(uid \d+\) has no dims"):
        graph.build()
    graph, q, k, v = _qkv_graph()
    o, _ = graph.sdpa(q, k, v, is_inference=True)
    o.set_output(True).set_dim([1, 4, 8, 32]).set_stride([1024, 256, 32, 1])
    with pytest.raises(cudnn.GraphError, match=r"O.*dims \[1, 4, 8, 32\].*produces \[1, 4, 8, 16\]"):
        graph.validate()
    graph, q, k, v = _qkv_graph()
    graph.sdpa(q, k, v, is_inference=True)               # O never marked as output
    with pytest.raises(cudnn.GraphError, match="set_output"):
        graph.validate()


def _built(shape=(1, 2, 8, 16)):
    q_t = rand(*shape)
    graph, q, k, v, o, _ = fwd_graph(q_t, q_t, q_t, attn_scale=0.5)
    graph.build()
    return graph, q_t, (q, k, v, o)


def test_variant_pack_errors():
    graph, q_t, (q, k, v, o) = _built()
    out = torch.empty_like(q_t)
    with pytest.raises(cudnn.GraphError, match=r"missing k .*sdpa_0\.k"):
        graph.execute({q: q_t, v: q_t, o: out}, None)
    with pytest.raises(cudnn.GraphError, match=r"v .*torch.float16.*declared torch.float32"):
        graph.execute({q: q_t, k: q_t, v: q_t.half(), o: out}, None)
    with pytest.raises(cudnn.GraphError, match=r"k .*shape \[1, 2, 9, 16\].*declared \[1, 2, 8, 16\]"):
        graph.execute({q: q_t, k: rand(1, 2, 9, 16), v: q_t, o: out}, None)
    with pytest.raises(cudnn.GraphError, match=r"o .* is on meta"):
        graph.execute({q: q_t, k: q_t, v: q_t, o: torch.empty_like(out, device="meta")}, None)
    with pytest.raises(cudnn.GraphError, match=r"uid 99 is not a tensor of this graph"):
        graph.execute({99: q_t}, None)
    other, *_ = _built()
    with pytest.raises(cudnn.GraphError, match="another graph"):
        other.execute({q: q_t}, None)
    with pytest.raises(cudnn.GraphError, match="must be a torch tensor"):
        graph.execute({q: [1, 2]}, None)
    with pytest.raises(cudnn.GraphError, match="variant_pack must be a dict"):
        graph.execute([q_t], None)


def test_workspace_and_state_errors(monkeypatch):
    graph, q_t, (q, k, v, o) = _built()
    pack = {q: q_t, k: q_t, v: q_t, o: torch.empty_like(q_t)}
    assert graph.get_workspace_size() == 0
    graph.execute(pack, torch.empty(0, dtype=torch.uint8))
    with pytest.raises(cudnn.GraphError, match="workspace must be a torch tensor"):
        graph.execute(pack, "workspace")
    monkeypatch.setattr(graph, "_workspace_size", 64)           # as if a plan needed scratch
    with pytest.raises(cudnn.GraphError, match=r"workspace too small: 16 bytes, need 64"):
        graph.execute(pack, torch.empty(16, dtype=torch.uint8))
    with pytest.raises(cudnn.GraphError, match="needs a workspace of 64 bytes"):
        graph.execute(pack, None)
    with pytest.raises(cudnn.GraphError, match="after the graph was built"):
        o.set_dim([1, 1, 1, 1])
    unbuilt, q2, k2, v2, o2, _ = fwd_graph(q_t, q_t, q_t)
    with pytest.raises(cudnn.GraphError, match="before the graph is built"):
        unbuilt.execute({q2: q_t, k2: q_t, v2: q_t, o2: torch.empty_like(q_t)}, None)
    with pytest.raises(cudnn.GraphError, match="heur_mode"):
        unbuilt.create_execution_plans(["A"])


@pytest.mark.parametrize("kw,pattern", [
    (dict(use_causal_mask=True, use_causal_mask_bottom_right=True), "cannot both be true"),
    (dict(use_causal_mask=True, diagonal_band_right_bound=2), "cannot be set at the same time"),
    (dict(sliding_window_length=3, diagonal_band_left_bound=3), "same argument"),
    (dict(diagonal_band_left_bound=0), r"left_bound.*>= 1"),
    (dict(diagonal_band_right_bound=-1), r"right_bound must be an int >= 0"),
    (dict(use_causal_mask=True, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT), "top-left"),
    (dict(is_inference=True, generate_stats=True), "contradict"),
    (dict(is_inference=True, dropout=1.0, dropout_seed=1), r"dropout probability.*\[0, 1\)"),
    (dict(is_inference=True, dropout_seed=3), "without dropout"),
    (dict(is_inference=True, attn_scale=-1.0), "attn_scale"),
], ids=["two_causal", "causal_right", "window_twice", "left0", "right_neg", "causal_br_align", "stats_flags",
        "dropout_p1", "seed_without_dropout", "scale"])
def test_argument_contradictions(kw, pattern):
    graph, q, k, v = _qkv_graph()
    with pytest.raises(cudnn.GraphError, match=pattern):
        graph.sdpa(q, k, v, **kw)


def test_option_errors_at_validate():
    graph, q, k, v = _qkv_graph()
    o, _ = graph.sdpa(q, k, v, is_inference=True, use_padding_mask=True)
    o.set_output(True)
    with pytest.raises(cudnn.GraphError, match="requires seq_len_q and seq_len_kv"):
        graph.validate()
    graph, q, k, v = _qkv_graph()
    lens = graph.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
    o, _ = graph.sdpa(q, k, v, is_inference=True, seq_len_q=lens, seq_len_kv=lens)
    o.set_output(True)
    with pytest.raises(cudnn.GraphError, match="use_padding_mask is False"):
        graph.validate()
    graph, q, k, v = _qkv_graph()
    with pytest.raises(cudnn.GraphError, match="rng_dump .* no dropout"):
        graph.sdpa(q, k, v, is_inference=True, rng_dump=lens)
    graph, q, k, v = _qkv_graph()
    q.set_uid(5)
    k.set_uid(5)
    o, _ = graph.sdpa(q, k, v, is_inference=True)
    o.set_output(True)
    with pytest.raises(cudnn.GraphError, match="uid 5 is used by both 'Q' .* and 'K'"):
        graph.validate()
    graph, q, k, v = _qkv_graph()
    o, st = graph.sdpa(q, k, v, generate_stats=True)
    o.set_output(True)
    st.set_output(True).set_data_type(cudnn.data_type.HALF)
    with pytest.raises(cudnn.GraphError, match="Stats .* must be FLOAT"):
        graph.validate()
    graph = cudnn.pygraph()
    qi = graph.tensor_like(torch.zeros(1, 2, 4, 16, dtype=torch.int32))
    o, _ = graph.sdpa(qi, qi, qi, is_inference=True)
    o.set_output(True)
    with pytest.raises(cudnn.GraphError, match="q is INT32; attention inputs must be"):
        graph.validate()
    graph, q, k, v = _qkv_graph()
    with pytest.raises(cudnn.GraphError, match="torch.Tensor"):
        graph.sdpa(torch.empty(1, 4, 8, 16), k, v, is_inference=True)
    graph, q, k, v = _qkv_graph()
    with pytest.raises(cudnn.GraphError, match="dBias given without bias"):
        graph.sdpa_backward(q, k, v, q, q, q, dBias=k)
    with pytest.raises(AttributeError, match="SDPA part"):
        graph.matmul(q, k)


# ------------------------------------------------------------------------------------------------
# valid but not supported: cudnnGraphNotSupportedError naming the argument
# ------------------------------------------------------------------------------------------------

def test_not_supported_arguments():
    def build(**kw):
        graph, q, k, v = _qkv_graph()
        o, _ = graph.sdpa(q, k, v, is_inference=True, **kw)
        o.set_output(True)
        graph.build()

    graph, q, k, v = _qkv_graph()
    mask, scale = graph.tensor_like(torch.empty(1, 4, 8, 8)), graph.tensor_like(torch.empty(1, 1, 1, 1))
    o, _ = graph.sdpa(q, k, v, is_inference=True, dropout=(mask, scale))
    o.set_output(True)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match=r"dropout=\(mask, scale"):
        graph.validate()
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="score_mod"):
        build(score_mod=lambda graph, score: score)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="stats_use_log2"):
        build(stats_use_log2=True)
    graph, q, k, v = _qkv_graph()
    q.set_ragged_offset(graph.tensor(dim=[2, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32))
    o, _ = graph.sdpa(q, k, v, is_inference=True)
    o.set_output(True)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match=r"'Q'.*ragged offset"):
        graph.validate()
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3)
    q = graph.tensor(name="Q8", dim=[1, 2, 8, 16], stride=[256, 128, 16, 1])
    o, _ = graph.sdpa(q, q, q, is_inference=True)
    o.set_output(True)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="FP8"):
        graph.validate()
    graph, q, k, v = _qkv_graph()
    o, _ = graph.sdpa(q, k, v, is_inference=True)
    o.set_output(True).set_data_type(cudnn.data_type.HALF)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match=r"O .* HALF .* FLOAT"):
        graph.validate()


def test_probe_names_the_unsupported_argument(monkeypatch):
    """When the functional layer refuses a feature, check_support names cuDNN's argument for it."""
    monkeypatch.setattr(graph_support, "_PROBE_CACHE", {})
    real = fusedattn.functional.attention_forward

    def no_alibi(*a, alibi=False, **kw):
        if alibi:
            raise fusedattn.NotSupportedError("alibi: not in this build")
        return real(*a, **kw)

    monkeypatch.setattr(fusedattn.functional, "attention_forward", no_alibi)
    q_t = rand(1, 2, 8, 16)
    graph, *_ = fwd_graph(q_t, q_t, q_t, use_alibi_mask=True, use_causal_mask=True, attn_scale=0.5)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match=r"use_alibi_mask: not supported .*alibi: not in this build") as e:
        graph.build()
    assert "use_causal_mask" not in str(e.value).split(":")[1]     # the band works, it is not blamed
    assert isinstance(e.value, NotImplementedError)


def test_paged_attention_pygraph(on_target):
    """cuDNN's paged spelling (containers [num_blocks, h, block, d], tables [b, 1, blocks, 1]): either
    right, or refused at build with the argument named (paged caches are issue 6)."""
    device, _ = on_target
    b, h, s, d, bs = 2, 2, 32, 16, 16
    q_t, k_t, v_t = (rand(b, h, s, d, device=device, seed=i) for i in range(3))
    nb = s // bs
    perm = torch.randperm(b * nb, generator=torch.Generator().manual_seed(0))
    table = perm.view(b, 1, nb, 1).to(torch.int32).to(device)
    k_c = torch.empty(b * nb, h, bs, d, device=device)
    v_c = torch.empty(b * nb, h, bs, d, device=device)
    for i in range(b):
        for j in range(nb):
            k_c[table[i, 0, j, 0]] = k_t[i, :, j * bs:(j + 1) * bs]
            v_c[table[i, 0, j, 0]] = v_t[i, :, j * bs:(j + 1) * bs]
    lens = torch.tensor([s, 20], dtype=torch.int32, device=device).view(b, 1, 1, 1)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, kc, vc, tk, tv, sq, skv = (graph.tensor_like(t) for t in (q_t, k_c, v_c, table, table, lens, lens))
    o, _ = graph.sdpa(name="sdpa", q=q, k=kc, v=vc, is_inference=True, attn_scale=0.25, use_causal_mask=True,
                      use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv, paged_attention_k_table=tk,
                      paged_attention_v_table=tv, paged_attention_max_seq_len_kv=s)
    o.set_output(True)
    try:
        graph.build()
    except cudnn.cudnnGraphNotSupportedError as e:
        assert "paged_attention_k_table" in str(e)
        pytest.xfail(f"paged K/V not supported by the functional layer yet: {e}")
    out = torch.zeros(b, h, s, d, device=device)
    graph.execute({q: q_t, kc: k_c, vc: v_c, tk: table, tv: table, sq: lens, skv: lens, o: out})
    keep = cudnn_keep_mask(b, s, s, "top_left", None, 0, lens.cpu(), lens.cpu())
    want, _ = ref_attention(q_t.cpu(), k_t.cpu(), v_t.cpu(), 0.25, keep)
    torch.testing.assert_close(out.cpu().double(), want, atol=1e-4, rtol=1e-4)


def test_paged_translation_with_gathering_stand_in(monkeypatch):
    """The Graph door's paged translation, checked now (before paged kernels, issue 6) against a
    stand-in functional layer that gathers the pages into contiguous K/V and runs the dense path:
    cuDNN's spelling with paged_attention_max_seq_len_kv below the tables' capacity, and the seeds'
    sdpa_with_paged_cache with [num_pages, page_size, h, d] caches and a [b, n] table."""
    import fusedattn.functional as fm
    real = fm.attention_forward

    def gathering(q, k, v, *, page_table_k=None, page_table_v=None, **kw):
        if page_table_k is None:
            return real(q, k, v, **kw)
        assert k.dim() == 4 and page_table_k.dim() == 4 and page_table_k.shape[1::2] == (1, 1)

        def gather(container, table):        # [nb, h, bs, d], [b, 1, n, 1] -> [b, h, n * bs, d]
            return container[table[:, 0, :, 0].long()].permute(0, 2, 1, 3, 4).flatten(2, 3)
        return real(q, gather(k, page_table_k), gather(v, page_table_v), **kw)

    monkeypatch.setattr(fm, "attention_forward", gathering)
    monkeypatch.setattr(graph_support, "_PROBE_CACHE", {})
    b, h, s_q, d, bs, n = 2, 2, 5, 16, 8, 4
    k_t, v_t = rand(b, h, n * bs, d, seed=1), rand(b, h, n * bs, d, seed=2)
    q_t = rand(b, h, s_q, d, seed=3)
    perm = torch.randperm(b * n, generator=torch.Generator().manual_seed(1))
    table = perm.view(b, n).to(torch.int32)
    k_c, v_c = torch.empty(b * n, h, bs, d), torch.empty(b * n, h, bs, d)
    for i in range(b):
        for j in range(n):
            k_c[table[i, j]] = k_t[i, :, j * bs:(j + 1) * bs]
            v_c[table[i, j]] = v_t[i, :, j * bs:(j + 1) * bs]

    # cuDNN's spelling: s_kv = paged_attention_max_seq_len_kv = 27 < 32 = 4 blocks x 8
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    t4 = table.view(b, 1, n, 1)
    q, kc, vc, tk, tv = (graph.tensor_like(t) for t in (q_t, k_c, v_c, t4, t4))
    o, _ = graph.sdpa(q=q, k=kc, v=vc, is_inference=True, attn_scale=0.5, use_causal_mask_bottom_right=True,
                      paged_attention_k_table=tk, paged_attention_v_table=tv, paged_attention_max_seq_len_kv=27)
    o.set_output(True)
    graph.build()
    out = torch.empty(b, h, s_q, d)
    graph.execute({q: q_t, kc: k_c, vc: v_c, tk: t4, tv: t4, o: out})
    keep = cudnn_keep_mask(b, s_q, 27, "bottom_right", None, 0)
    want, _ = ref_attention(q_t, k_t[:, :, :27], v_t[:, :, :27], 0.5, keep)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)

    # the seeds' spelling: caches [num_pages, page_size, h, d], one table [b, n], seq_len_kv alone
    K_cache, V_cache = k_c.permute(0, 2, 1, 3).contiguous(), v_c.permute(0, 2, 1, 3).contiguous()
    lens = torch.tensor([30, 11], dtype=torch.int32)
    with cudnn.Graph() as g2:
        out2, _ = g2.sdpa_with_paged_cache(q=q_t, k=K_cache, v=V_cache, page_table=table, seq_len_kv=lens,
                                           attn_scale=0.5, is_inference=True, use_causal_mask_bottom_right=True)
    res = g2(q_t, K_cache, V_cache, table, lens)
    keep = cudnn_keep_mask(b, s_q, n * bs, "bottom_right", None, 0, torch.full((b,), s_q), lens)
    want, _ = ref_attention(q_t, k_t, v_t, 0.5, keep)
    torch.testing.assert_close(res.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("padding", [False, True], ids=["max_seq_len_kv", "seq_len_kv"])
def test_paged_bias_sized_by_the_graphs_kv_length(padding):
    """cuDNN sizes a paged graph's bias by its kv length (paged_attention_max_seq_len_kv = 21 here), below
    the tables' capacity (2 pages of 16 = 32): test_mhas.py does it (s_kv 24 on pages of 128, found by
    bench/cudnn_fe_suite.py). The bias is not refused, and the keys past 21 stay unread."""
    b, h, s_q, d, bs, n, s_kv = 2, 2, 5, 16, 16, 2, 21
    k_t, v_t = rand(b, h, n * bs, d, seed=1), rand(b, h, n * bs, d, seed=2)
    q_t, bias_t = rand(b, h, s_q, d, seed=3), rand(1, h, s_q, s_kv, seed=4)
    table = torch.randperm(b * n, generator=torch.Generator().manual_seed(2)).view(b, n).to(torch.int32)
    k_c, v_c = torch.full((b * n, h, bs, d), float("nan")), torch.full((b * n, h, bs, d), float("nan"))
    for i in range(b):
        for j in range(n):
            # pages hold the keys up to s_kv; NaN past them: a key past the graph's length read would show
            k_c[table[i, j]] = k_t[i, :, j * bs:(j + 1) * bs].masked_fill(
                (torch.arange(j * bs, (j + 1) * bs) >= s_kv).view(1, -1, 1), float("nan"))
            v_c[table[i, j]] = v_t[i, :, j * bs:(j + 1) * bs].masked_fill(
                (torch.arange(j * bs, (j + 1) * bs) >= s_kv).view(1, -1, 1), float("nan"))
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    t4 = table.view(b, 1, n, 1)
    q, kc, vc, tk, tv, bias = (graph.tensor_like(t) for t in (q_t, k_c, v_c, t4, t4, bias_t))
    lens_kv = torch.tensor([s_kv, 9], dtype=torch.int32).view(b, 1, 1, 1)
    lens_q = torch.full((b, 1, 1, 1), s_q, dtype=torch.int32)
    kw = dict(paged_attention_k_table=tk, paged_attention_v_table=tv, paged_attention_max_seq_len_kv=s_kv,
              bias=bias, attn_scale=0.5)
    variant = {}
    if padding:
        sq, skv = graph.tensor_like(lens_q), graph.tensor_like(lens_kv)
        kw.update(use_padding_mask=True, seq_len_q=sq, seq_len_kv=skv)
        variant = {sq: lens_q, skv: lens_kv}
    o, _ = graph.sdpa(q=q, k=kc, v=vc, is_inference=True, **kw)
    o.set_output(True)
    graph.build()
    out = torch.full((b, h, s_q, d), float("nan"))
    graph.execute({q: q_t, kc: k_c, vc: v_c, tk: t4, tv: t4, bias: bias_t, o: out, **variant})
    keep = cudnn_keep_mask(b, s_q, s_kv, seq_len_kv=lens_kv if padding else None)
    want, _ = ref_attention(q_t, k_t[:, :, :s_kv], v_t[:, :, :s_kv], 0.5, keep, bias=bias_t)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------------------
# K and V with different head counts (issue 24 item 3): cuDNN maps query head i to K head
# i // (h_q // h_k) and V head i // (h_q // h_v) (test_mhas.py compute_ref expands each on its own)
# ------------------------------------------------------------------------------------------------

def ref_kv_heads(q, k, v, scale, keep):
    """float64 (o, lse) with K and V expanded to h_q heads each on its own, as cuDNN's reference does."""
    h_q = q.shape[1]
    k = k.double().repeat_interleave(h_q // k.shape[1], 1)
    v = v.double().repeat_interleave(h_q // v.shape[1], 1)
    return ref_attention(q, k, v, scale, keep)


# (h_q, h_k, h_v): a single-head K under GQA V, the reverse, and MQA K with MHA V (stride-0 views); then
# neither single (gather copies to lcm(h_k, h_v) heads): coprime counts both ways, lcm 12 = h_q with
# neither count 1 nor h_q, and MHA K with GQA V (only V copied)
KV_HEADS = [(4, 1, 2), (4, 2, 1), (6, 1, 6), (6, 2, 3), (6, 3, 2), (12, 6, 4), (6, 6, 3)]


@pytest.mark.parametrize("h_q,h_k,h_v", KV_HEADS, ids=[f"q{q}_k{k}_v{v}" for q, k, v in KV_HEADS])
def test_kv_head_counts_differ(on_target, h_q, h_k, h_v):
    """sdpa and sdpa_backward with h_k != h_v (both dividing h_q): O, Stats, dQ, dK, dV against float64
    (causal, padding, d_v != d, K in BSHD memory), every output in a NaN-filled buffer."""
    device, _ = on_target
    b, s_q, s_kv, d, d_v, scale = 2, 7, 11, 16, 8, 0.3
    q_t = rand(b, h_q, s_q, d, device=device, seed=1)
    k_t = rand(b, s_kv, h_k, d, device=device, seed=2).transpose(1, 2)      # BSHD memory
    v_t = rand(b, h_v, s_kv, d_v, device=device, seed=3)
    do_t = rand(b, h_q, s_q, d_v, device=device, seed=4)
    lens_q = torch.tensor([7, 4], dtype=torch.int32, device=device).view(b, 1, 1, 1)
    lens_kv = torch.tensor([11, 6], dtype=torch.int32, device=device).view(b, 1, 1, 1)
    kw = dict(attn_scale=scale, use_causal_mask=True, use_padding_mask=True)
    nan = lambda *shape: torch.full(shape, float("nan"), device=device)  # noqa: E731

    fwd = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v, sq, skv = (fwd.tensor_like(t) for t in (q_t, k_t, v_t, lens_q, lens_kv))
    o, stats = fwd.sdpa(q, k, v, generate_stats=True, seq_len_q=sq, seq_len_kv=skv, **kw)
    o.set_output(True)
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    fwd.build()
    o_t, st_t = nan(b, h_q, s_q, d_v), nan(b, h_q, s_q, 1)
    fwd.execute({q: q_t, k: k_t, v: v_t, sq: lens_q, skv: lens_kv, o: o_t, stats: st_t}, None)

    bwd = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v, o, dO, stats, sq, skv = (bwd.tensor_like(t) for t in (q_t, k_t, v_t, o_t, do_t, st_t, lens_q, lens_kv))
    dQ, dK, dV = bwd.sdpa_backward(q=q, k=k, v=v, o=o, dO=dO, stats=stats, seq_len_q=sq, seq_len_kv=skv, **kw)
    for g, t in ((dQ, q_t), (dK, k_t), (dV, v_t)):
        g.set_output(True).set_dim(t.size()).set_stride(t.stride())
    bwd.build()
    dq_t, dk_t, dv_t = (torch.full_like(t, float("nan")) for t in (q_t, k_t, v_t))
    bwd.execute({q: q_t, k: k_t, v: v_t, o: o_t, dO: do_t, stats: st_t, sq: lens_q, skv: lens_kv,
                 dQ: dq_t, dK: dk_t, dV: dv_t}, None)

    keep = cudnn_keep_mask(b, s_q, s_kv, "top_left", None, 0, lens_q.cpu(), lens_kv.cpu())
    qr, kr, vr = (t.detach().cpu().double().requires_grad_() for t in (q_t, k_t, v_t))
    want_o, want_lse = ref_kv_heads(qr, kr, vr, scale, keep)
    want_o.backward(do_t.cpu().double())
    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(o_t.cpu().double(), want_o.detach(), **tol)
    torch.testing.assert_close(st_t.cpu().double(), want_lse, **tol)
    for got, ref, name in ((dq_t, qr, "dQ"), (dk_t, kr, "dK"), (dv_t, vr, "dV")):
        torch.testing.assert_close(got.cpu().double(), ref.grad, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("h_q,h_k,h_v", [(4, 2, 1), (6, 2, 3)], ids=["q4_k2_v1", "q6_k2_v3"])
def test_kv_head_counts_differ_paged(on_target, h_q, h_k, h_v):
    """A paged forward with K's and V's containers holding different head counts (each with its own
    table): a single-head V (a stride-0 view), and K 2 / V 3 (both containers copied to 6 heads)."""
    device, _ = on_target
    b, s_q, s, d, bs = 2, 5, 32, 16, 16
    q_t = rand(b, h_q, s_q, d, device=device, seed=1)
    k_t, v_t = rand(b, h_k, s, d, device=device, seed=2), rand(b, h_v, s, d, device=device, seed=3)
    nb = s // bs
    tables = [torch.randperm(b * nb, generator=torch.Generator().manual_seed(i)).view(b, 1, nb, 1).to(torch.int32)
              for i in (5, 6)]
    containers = []
    for x, table in ((k_t, tables[0]), (v_t, tables[1])):
        c = torch.empty(b * nb, x.shape[1], bs, d, device=device)
        for i in range(b):
            for j in range(nb):
                c[table[i, 0, j, 0]] = x[i, :, j * bs:(j + 1) * bs]
        containers.append(c)
    tk_t, tv_t = (t.to(device) for t in tables)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, kc, vc, tk, tv = (graph.tensor_like(t) for t in (q_t, *containers, tk_t, tv_t))
    o, _ = graph.sdpa(q=q, k=kc, v=vc, is_inference=True, attn_scale=0.25, use_causal_mask_bottom_right=True,
                      paged_attention_k_table=tk, paged_attention_v_table=tv, paged_attention_max_seq_len_kv=27)
    o.set_output(True)
    graph.build()
    out = torch.full((b, h_q, s_q, d), float("nan"), device=device)
    graph.execute({q: q_t, kc: containers[0], vc: containers[1], tk: tk_t, tv: tv_t, o: out})
    keep = cudnn_keep_mask(b, s_q, 27, "bottom_right", None, 0)
    want, _ = ref_kv_heads(q_t.cpu(), k_t[:, :, :27].cpu(), v_t[:, :, :27].cpu(), 0.25, keep)
    torch.testing.assert_close(out.cpu().double(), want, atol=1e-4, rtol=1e-4)


def _kv_heads_graphs(h_q, h_k, h_v):
    """An sdpa graph and an sdpa_backward graph (declared tensors, not built) with these head counts."""
    b, s, d = 1, 8, 16
    fwd, q, k, v = _qkv_graph((b, h_q, s, d), (b, h_k, s, d), (b, h_v, s, d))
    o, _ = fwd.sdpa(q, k, v, is_inference=True)
    o.set_output(True)
    bwd, q, k, v = _qkv_graph((b, h_q, s, d), (b, h_k, s, d), (b, h_v, s, d))
    o, do = (bwd.tensor(name=n, dim=[b, h_q, s, d], stride=[h_q * s * d, s * d, d, 1]) for n in ("O", "dO"))
    st = bwd.tensor(name="Stats", dim=[b, h_q, s, 1], stride=[h_q * s, s, 1, 1], data_type=cudnn.data_type.FLOAT)
    for g in bwd.sdpa_backward(q=q, k=k, v=v, o=o, dO=do, stats=st):
        g.set_output(True)
    return fwd, bwd


@pytest.mark.parametrize("h_k,h_v", [(1, 2), (2, 4)], ids=["k1_v2", "k2_v4"])
def test_kv_head_counts_refused(h_k, h_v):
    """A head count that does not divide h_q is malformed (GraphError, forward and backward, one count
    single or neither); different counts with packed q over padded K/V (chunked prefill) are not supported
    (cudnnGraphNotSupportedError naming both counts), a view or a copy alike; with packed q, k and v they
    run (as the padded call: tests/test_graph_compositions.py)."""
    for h_q, bad_k, bad_v in ((4, 1, 3), (6, 4, 3)):
        for graph in _kv_heads_graphs(h_q, bad_k, bad_v):
            with pytest.raises(cudnn.GraphError, match=rf"query heads \({h_q}\).*k has {bad_k}, v has {bad_v}"):
                graph.validate()
    for graph in _kv_heads_graphs(4, h_k, h_v):
        graph.validate()            # the same pair, dense: supported
    b, h_q, s, d = 2, 4, 8, 16
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    off = graph.tensor(dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
    lens = [graph.tensor(dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32) for _ in "qk"]
    q, k, v = (graph.tensor(name=n, dim=[b, h, s, d], stride=[s * h * d, d, h * d, 1])
               for n, h in (("Q", h_q), ("K", h_k), ("V", h_v)))
    for t in (q, k, v):
        t.set_ragged_offset(off)
    o, _ = graph.sdpa(q, k, v, is_inference=True, use_padding_mask=True, seq_len_q=lens[0], seq_len_kv=lens[1])
    o.set_output(True).set_dim([b, h_q, s, d]).set_stride([s * h_q * d, d, h_q * d, 1]).set_ragged_offset(off)
    graph.validate()                # packed q, k and v: supported
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    off = graph.tensor(dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
    q, k, v = (graph.tensor(name=n, dim=[b, h, s, d], stride=[s * h * d, d, h * d, 1])
               for n, h in (("Q", h_q), ("K", h_k), ("V", h_v)))
    q.set_ragged_offset(off)        # packed q and O over padded K/V
    o, _ = graph.sdpa(q, k, v, is_inference=True)
    o.set_output(True).set_dim([b, h_q, s, d]).set_stride([s * h_q * d, d, h_q * d, 1]).set_ragged_offset(off)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match=rf"k has {h_k} heads and v has {h_v}.*packed q"):
        graph.validate()
