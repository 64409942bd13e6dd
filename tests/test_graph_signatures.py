"""The Graph door's signatures against cuDNN frontend 1.32's, and "not supported" vs "invalid".

* ``fusedattn.graph.signatures.CUDNN_SIGNATURES`` is cuDNN frontend 1.32's table (from its binding's
  docstrings and its ``pygraph``): ``pygraph.sdpa`` / ``sdpa_backward`` / ``sdpa_fp8`` /
  ``sdpa_fp8_backward`` must have its names, order and defaults, and take None for every keyword
  marked so, meaning "not given": the graph with ``kw=None`` computes what the graph without it does.
* A valid graph fusedattn cannot run (head dim 1032, a 16-bit sdpa given FP8 tensors) raises ``cudnnGraphNotSupportedError`` where
  cuDNN does, so cuDNN code skipping on it keeps working; malformed graphs keep their ``GraphError``.
"""
import inspect

import pytest
import torch

import fusedattn as cudnn
from fusedattn.graph import sdpa as sdpa_module
from fusedattn.graph import support as graph_support
from fusedattn.graph.signatures import CUDNN_SIGNATURES

P = inspect.Parameter
B, H, S_Q, S_KV, D = 1, 2, 5, 7, 16


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------
# the table against our signatures
# ------------------------------------------------------------------------------------------------

def test_table_is_well_formed():
    for op, sig in CUDNN_SIGNATURES.items():
        names = list(sig.positional) + [kw.name for kw in sig.keywords]
        assert len(names) == len(set(names)), op
        assert all(kw.binding_type in ("tensor", "object", "bool", "enum", "str", "callable") for kw in sig.keywords)


@pytest.mark.parametrize("op", sorted(CUDNN_SIGNATURES))
def test_signature_matches_cudnn(op):
    """cuDNN's required tensors first, then its keywords in its order with its defaults (so calls in
    the binding's positional order work too); fusedattn's extra spellings only after, keyword-only."""
    sig = CUDNN_SIGNATURES[op]
    params = list(inspect.signature(getattr(cudnn.pygraph, op)).parameters.values())[1:]   # less self
    n_pos, n_kw = len(sig.positional), len(sig.keywords)
    assert [p.name for p in params[:n_pos]] == list(sig.positional)
    assert all(p.kind is P.POSITIONAL_OR_KEYWORD and p.default is P.empty for p in params[:n_pos])
    ours = params[n_pos:n_pos + n_kw]
    assert [p.name for p in ours] == [kw.name for kw in sig.keywords]
    for p, kw in zip(ours, sig.keywords):
        assert p.kind is P.POSITIONAL_OR_KEYWORD, p.name
        # type too: False must not pass for 0, nor an enum for its value
        assert type(p.default) is type(kw.default) and p.default == kw.default, (p.name, p.default, kw.default)
    extras = params[n_pos + n_kw:]
    assert all(p.kind is P.KEYWORD_ONLY for p in extras), [p.name for p in extras]


# ------------------------------------------------------------------------------------------------
# None = not given, in real graphs executed on CPU tensors
# ------------------------------------------------------------------------------------------------

_Q, _K, _V = _rand(B, H, S_Q, D, seed=1), _rand(B, H, S_KV, D, seed=2), _rand(B, H, S_KV, D, seed=3)
_DO = _rand(B, H, S_Q, D, seed=4)


def _forward(**kw):
    """O and Stats of one sdpa graph over _Q, _K, _V with ``kw``."""
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v = graph.tensor_like(_Q), graph.tensor_like(_K), graph.tensor_like(_V)
    o, stats = graph.sdpa(q, k, v, **kw)
    o.set_output(True)
    pack = {q: _Q, k: _K, v: _V, o: torch.empty(B, H, S_Q, D)}
    if stats is not None:
        stats.set_output(True)
        pack[stats] = torch.empty(B, H, S_Q, 1)
    graph.build([cudnn.heur_mode.A])
    graph.execute(pack, None)
    return pack[o], pack.get(stats)


def _backward(**kw):
    """dQ, dK, dV of one sdpa_backward graph (the forward: causal bottom-right, scale 0.5)."""
    o_t, st_t = _forward(generate_stats=True, attn_scale=0.5, use_causal_mask_bottom_right=True)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v, o, do, st = (graph.tensor_like(t) for t in (_Q, _K, _V, o_t, _DO, st_t))
    dq, dk, dv = graph.sdpa_backward(q, k, v, o, do, st, **kw)
    pack = {q: _Q, k: _K, v: _V, o: o_t, do: _DO, st: st_t}
    for t, like in ((dq, _Q), (dk, _K), (dv, _V)):
        t.set_output(True)
        pack[t] = torch.empty_like(like)
    graph.build([cudnn.heur_mode.A])
    graph.execute(pack, None)
    return pack[dq], pack[dk], pack[dv]


def _none_cases(op):
    return [kw.name for kw in CUDNN_SIGNATURES[op].keywords if kw.accepts_none]


@pytest.mark.parametrize("name", _none_cases("sdpa"))
def test_sdpa_keyword_accepts_none(name):
    base = dict(generate_stats=True, attn_scale=0.5, use_causal_mask_bottom_right=True)
    base.pop(name, None)
    if name == "generate_stats":
        base["is_inference"] = False           # stats either way: cuDNN wants one of the two flags
    want = _forward(**base)
    got = _forward(**base, **{name: None})
    for g, w in zip(got, want):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("name", _none_cases("sdpa_backward"))
def test_sdpa_backward_keyword_accepts_none(name):
    base = dict(attn_scale=0.5, use_causal_mask_bottom_right=True)
    base.pop(name, None)
    want = _backward(**base)
    got = _backward(**base, **{name: None})
    for g, w in zip(got, want):
        assert torch.equal(g, w), name


def _fp8_graph(op):
    """A graph and one graph tensor per required argument of ``op`` (cuDNN's shapes)."""
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3)
    x = graph.tensor(dim=[B, H, S_Q, D], stride=[H * S_Q * D, S_Q * D, D, 1])
    stats = graph.tensor(dim=[B, H, S_Q, 1], stride=[H * S_Q, S_Q, 1, 1], data_type=cudnn.data_type.FLOAT)
    scale = graph.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
    args = [stats if n == "stats" else scale if n.startswith(("descale", "scale")) else x
            for n in CUDNN_SIGNATURES[op].positional]
    return graph, args


@pytest.mark.parametrize("op,n_out", [("sdpa_fp8", 4), ("sdpa_fp8_backward", 7)])
def test_fp8_ops_take_cudnns_arguments_and_build(op, n_out):
    """Every keyword None (and each one alone) is accepted at the call; every build step passes (the FP8
    ops run fusedattn.fp8's emulation; tests/test_fp8.py checks what they compute)."""
    for kws in [{kw.name: None for kw in CUDNN_SIGNATURES[op].keywords}] + \
               [{kw.name: None} for kw in CUDNN_SIGNATURES[op].keywords]:
        graph, args = _fp8_graph(op)
        outs = getattr(graph, op)(*args, **kws)
        assert len(outs) == n_out
    for step in ("validate", "check_support", "build"):
        graph, args = _fp8_graph(op)
        kw = {"generate_stats": True} if op == "sdpa_fp8" else {}
        outs = getattr(graph, op)(*args, **kw)
        assert all(t is not None for t in outs)
        outs[0].set_output(True)
        getattr(graph, step)()


def test_fp8_through_the_graph_wrapper():
    """The seeds' cudnn.Graph spelling on torch tensors: FP8 tensors build and run; 16-bit ones are bad input."""
    x, one = torch.randn(B, H, S_Q, D).to(torch.float8_e4m3fn), torch.ones(1, 1, 1, 1)
    with cudnn.Graph() as graph:
        o, _, amax_s, amax_o = graph.sdpa_fp8(x, x, x, one, one, one, one, one, one, generate_stats=False,
                                              use_causal_mask=None)
        o.set_output(True)
    with pytest.raises(cudnn.GraphError, match="FP8_E4M3 or FP8_E5M2"):
        with cudnn.Graph() as graph:
            y = torch.zeros(B, H, S_Q, D)
            graph.sdpa_fp8(y, y, y, one, one, one, one, one, one, generate_stats=False)[0].set_output(True)


def test_fp8_call_errors_stay_graph_errors():
    graph, args = _fp8_graph("sdpa_fp8")
    with pytest.raises(cudnn.GraphError, match="torch.Tensor"):
        graph.sdpa_fp8(torch.empty(1), *args[1:], is_inference=True)
    with pytest.raises(cudnn.GraphError, match="scale_o is required"):
        graph.sdpa_fp8(*args[:-1], None, is_inference=True)
    with pytest.raises(TypeError):
        graph.sdpa_fp8(*args[:-1], is_inference=True)     # a required argument missing, as in cuDNN


# ------------------------------------------------------------------------------------------------
# not supported is not invalid
# ------------------------------------------------------------------------------------------------

def _graph(q_shape, k_shape=None, v_shape=None, dt=cudnn.data_type.HALF):
    graph = cudnn.pygraph(io_data_type=dt)
    tensors = [graph.tensor(name=n, dim=list(s), stride=list(torch.empty(s).stride()))
               for n, s in (("Q", q_shape), ("K", k_shape or q_shape), ("V", v_shape or k_shape or q_shape))]
    return graph, tensors


def _fwd(q_shape, k_shape=None, v_shape=None, dt=cudnn.data_type.HALF):
    graph, (q, k, v) = _graph(q_shape, k_shape, v_shape, dt)
    o, _ = graph.sdpa(q, k, v, generate_stats=False)
    o.set_output(True)
    return graph


def _bwd(q_shape, k_shape=None, v_shape=None):
    graph, (q, k, v) = _graph(q_shape, k_shape, v_shape)
    d_v = (v_shape or k_shape or q_shape)[-1]
    od = list(q_shape[:3]) + [d_v]
    o, do = (graph.tensor(dim=od, stride=list(torch.empty(od).stride())) for _ in range(2))
    sd = list(q_shape[:3]) + [1]
    st = graph.tensor(dim=sd, stride=list(torch.empty(sd).stride()), data_type=cudnn.data_type.FLOAT)
    for t in graph.sdpa_backward(q, k, v, o, do, st, attn_scale=0.5):
        t.set_output(True)
    return graph


@pytest.mark.parametrize("shapes", [
    ((1, 2, 8, 1032),),                                 # d past 1024
    ((1, 2, 8, 64), (1, 2, 8, 64), (1, 2, 8, 1032)),    # d_v past 1024
], ids=["d1032", "dv1032"])
def test_head_dim_past_1024_is_not_supported_at_validate(shapes):
    """A head dim fusedattn cannot run is refused at validate(): cuDNN frontend's test_mhas.py guards only
    validate() with its skip on cudnnGraphNotSupportedError (check_support runs unguarded there)."""
    for graph in (_fwd(*shapes), _bwd(*shapes)):
        with pytest.raises(cudnn.cudnnGraphNotSupportedError,
                           match=r"= 1032 is not supported .*multiples of 8 up to 1024"):
            graph.validate()


@pytest.mark.parametrize("d,d_v", [(264, 264), (520, 192), (64, 264)], ids=lambda x: str(x))
def test_head_dims_past_256_run(d, d_v):
    """cuDNN 9.9+ runs head dims 264 and 520 on Hopper (test_mhas.py draws them; cuDNN 9.19 passed them on
    the H100, bench/NOTES.md 56); fusedattn runs them on its PyTorch path (plan.large_head_dim_plan):
    forward with stats, then the backward graph, against the float64 reference by the 2x rule."""
    from fusedattn.reference import attention_reference
    from fusedattn.testing import assert_error_within
    b, h, s_q, s_kv = 1, 2, 9, 13
    q_t, k_t = _rand(b, h, s_q, d, seed=d), _rand(b, h, s_kv, d, seed=d + 1)
    v_t, do_t = _rand(b, h, s_kv, d_v, seed=d_v + 2), _rand(b, h, s_q, d_v, seed=d_v + 3)
    dt = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=dt, intermediate_data_type=dt, compute_data_type=dt)
    q, k, v = graph.tensor_like(q_t), graph.tensor_like(k_t), graph.tensor_like(v_t)
    o, st = graph.sdpa(q=q, k=k, v=v, generate_stats=True, attn_scale=0.3, diagonal_band_right_bound=0,
                       diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT)
    o.set_output(True)
    st.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    graph.build([cudnn.heur_mode.A])
    o_t = torch.full((b, h, s_q, d_v), float("nan"))
    st_t = torch.full((b, h, s_q, 1), float("nan"))
    graph.execute({q: q_t, k: k_t, v: v_t, o: o_t, st: st_t})

    bwd = cudnn.pygraph(io_data_type=dt, intermediate_data_type=dt, compute_data_type=dt)
    tq, tk, tv, to, tdo, tst = (bwd.tensor_like(x) for x in (q_t, k_t, v_t, o_t, do_t, st_t))
    dq, dk, dv = bwd.sdpa_backward(q=tq, k=tk, v=tv, o=to, dO=tdo, stats=tst, attn_scale=0.3,
                                   diagonal_band_right_bound=0,
                                   diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT)
    for t in (dq, dk, dv):
        t.set_output(True)
    bwd.build([cudnn.heur_mode.A])
    grads = [torch.full(x.shape, float("nan")) for x in (q_t, k_t, v_t)]
    bwd.execute({tq: q_t, tk: k_t, tv: v_t, to: o_t, tdo: do_t, tst: st_t, dq: grads[0], dk: grads[1], dv: grads[2]})

    ref = {}
    for rdt in (torch.float64, torch.float32):
        rq, rk, rv = (x.to(rdt).requires_grad_() for x in (q_t, k_t, v_t))
        ro, rl = attention_reference(rq, rk, rv, dtype=rdt, attn_scale=0.3, causal=True,
                                     causal_alignment="bottom_right")
        ro.backward(do_t.to(rdt))
        ref[rdt] = (ro, rq.grad, rk.grad, rv.grad, rl)
    repro = f"repro: d={d} d_v={d_v}"
    for name, got, gold, base in zip(("O", "dQ", "dK", "dV"), (o_t, *grads), ref[torch.float64], ref[torch.float32]):
        assert_error_within(got, gold, base, msg=f"{name}. {repro}")
    torch.testing.assert_close(st_t.view(b, h, s_q), ref[torch.float64][4].float().view(b, h, s_q), atol=1e-4,
                               rtol=1e-4)


def test_head_dim_not_multiple_of_8_is_not_supported_at_validate():
    for graph in (_fwd((1, 2, 8, 20)), _bwd((1, 2, 8, 20))):
        with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="d .* = 20 is not supported"):
            graph.validate()


def test_double_off_the_cpu_is_not_supported(monkeypatch):
    """fusedattn runs DOUBLE on the CPU path only; on a GPU that is a limit, not bad input (the probe
    is asked about a CUDA device directly, so this runs without one)."""
    monkeypatch.setattr(graph_support, "_PROBE_CACHE", {})
    graph = _fwd((1, 2, 8, 16), dt=cudnn.data_type.DOUBLE)
    graph.build_operation_graph()
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="DOUBLE .* CPU only"):
        sdpa_module.probe(graph._calls[0], torch.device("cuda"), "auto")
    sdpa_module.probe(graph._calls[0], torch.device("cpu"), "auto")      # runs on the CPU


@pytest.mark.parametrize("make", [_fwd, _bwd], ids=["sdpa", "sdpa_backward"])
@pytest.mark.parametrize("shapes,pattern", [
    (((2, 2, 8, 264), (1, 2, 8, 264)), "batch sizes differ"),
    (((1, 2, 8, 264), (1, 2, 8, 256)), "head dim"),
    (((1, 2, 8, 64), (1, 2, 8, 64), (1, 2, 9, 264)), "same sequence length"),
    (((1, 2, 8, 264), (1, 2, 8, 264), (1, 2, 8)), "'V'.*4-D"),
], ids=["batch", "qk_head_dim", "kv_seq", "rank"])
def test_malformed_keeps_its_error(make, shapes, pattern):
    """Malformed graphs raise their GraphError even with an unsupported head dim in them: bad input
    is reported as bad input, never as "not supported" (which cuDNN code would skip on)."""
    graph = make(*shapes)
    with pytest.raises(cudnn.GraphError, match=pattern) as e:
        graph.build()
    assert not isinstance(e.value, cudnn.cudnnGraphNotSupportedError)
