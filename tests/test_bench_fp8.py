"""``fusedattn bench --configs fp8`` (issue 27), on the CPU.

The GPU numbers come from ``python -m fusedattn bench --configs fp8 --quick`` on the device; here: the group's
configs and flag, our FP8 column computing exactly what ``fusedattn.fp8.sdpa_fp8_forward`` / ``sdpa_fp8_backward``
compute, the bf16 column's backward, the cuDNN frontend column's graphs built with cuDNN's sdpa_fp8 /
sdpa_fp8_backward arguments (fusedattn's Graph door, which mirrors cuDNN frontend 1.32's signatures, stands in for
``cudnn``), the backward's scales, the table's ratios, and the CPU run of the group.
"""
import math
import sys

import pytest
import torch

import fusedattn
from fusedattn import bench, fp8
from fusedattn.problem import make_band

E4M3 = torch.float8_e4m3fn
TINY = bench.Config("fp8", 1, 2, 2, 64, 64, 32, "e4m3", causal=True)


def _table_rows(text):
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


def _emulated(inp, cfg, stats=False):
    """What cuDNN's sdpa_fp8 computes for the group's scales, by fusedattn.fp8's exact emulation (o, or (o, stats))."""
    scales = {name: inp.extra[name] for name in bench.FP8_SCALES}
    res = fp8.sdpa_fp8_forward(inp.q, inp.k, inp.v, **scales, band=make_band(cfg.causal, "top_left", None),
                               o_dtype=E4M3, backend="cpu")
    return res[:2] if stats else res[0]


def _emulated_bwd(inp, cfg):
    """What cuDNN's sdpa_fp8_backward computes for the group's scales, dO and the emulated forward's o and stats:
    (dQ, dK, dV, amax_dQ, amax_dK, amax_dV, amax_dP), e4m3 gradients."""
    o, stats = _emulated(inp, cfg, stats=True)
    scales = {name: inp.extra[name] for name in bench.FP8_BWD_SCALE_ARGS}
    return fp8.sdpa_fp8_backward(inp.q, inp.k, inp.v, o, inp.extra["dO"], stats, **scales,
                                 band=make_band(cfg.causal, "top_left", None), grad_dtype=E4M3, backend="cpu")


def _assert_same(got, want):
    assert len(got) == len(want) == 7
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.float(), w.float())


def test_fp8_group_is_asked_for_by_name():
    cfgs = bench.select_configs(bench.parse_args(["--configs", "fp8"]))
    assert [c.name for c in cfgs] == ["b4-h32-s2048-d128-e4m3-causal", "b2-h16-s8192-d128-e4m3",
                                      "b1-h32-s16384-d128-e4m3-causal", "b4-h16-s4096-d256-e4m3-causal",
                                      "b32-h32-s2048-d224-e4m3", "decode-b64-h32kv8-kv4096-d128-bf16-contig-fp8cache",
                                      "decode-b64-h32kv8-kv4096-d128-bf16-paged16-fp8cache",
                                      "decode-b8-h32-kv16384-d128-bf16-contig-fp8cache",
                                      "decode-b8-h32-kv16384-d128-bf16-paged16-fp8cache"]
    assert cfgs[0].label == "4, 32, 2048, 128, e4m3, causal"
    forwards = [c for c in cfgs if c.table == "fp8"]
    assert all(c.torch_dtype == E4M3 and c.d % 16 == 0 and c.d <= 256 for c in forwards)   # cuDNN's Hopper FP8 limits
    assert cfgs[-3].label == "b 64, h 32/8, kv 4096, d 128, bf16, paged 16, e4m3 cache"
    assert bench.fwd_flops(cfgs[0]) == 4 * 32 * 2048 * 2048 * 2 * 256 / 2             # the bf16 configs' count
    everything = bench.select_configs(bench.parse_args(["--configs", "all"]))
    assert not any(c.table == "fp8" or c.mask == "fp8cache" for c in everything)
    # the scale fusedattn.fp8 uses by default for e4m3, dequantized exactly
    assert bench.FP8_SCALES["scale_s"] == fp8.DEFAULT_SCALE_S[E4M3] == 1 / bench.FP8_SCALES["descale_s"]


@pytest.mark.parametrize("block", [0, 8], ids=["contiguous", "paged"])
def test_fp8_cache_decode_rows(block):
    """The FP8-cache decode rows (issue 27 item 4): e4m3 bytes in the cache, TB/s counted on one byte per
    element, ours computing what attention_with_kvcache computes on those bytes, the others refusing."""
    cfg = bench.Config("decode", 2, 4, 2, 1, 64, 32, "bf16", page_block=block, mask="fp8cache")
    inp = bench.make_inputs(cfg, "cpu")
    k, v = (inp.extra["k_cache"], inp.extra["v_cache"]) if block else (inp.k, inp.v)
    assert k.dtype == E4M3 and v.dtype == E4M3
    assert bench.kv_bytes(cfg) == 2 * 2 * 64 * (32 + 32) * 1
    got = bench.prepare_ours(cfg, False)(inp).fwd()
    kw = dict(page_table=inp.extra["page_table"], seq_len_kv=inp.extra["seq_len_kv"]) if block else {}
    want = fusedattn.attention_with_kvcache(inp.q, k, v, causal=True, descale_k=1.0, descale_v=1.0, **kw)
    assert torch.equal(got, want)
    with pytest.raises(bench.Unsupported, match="FP8 K/V cache"):
        bench._refuse_sink(cfg, "SDPA")


def test_ours_fp8_column_computes_sdpa_fp8_forward():
    torch.manual_seed(0)
    inp = bench.make_inputs(TINY, "cpu")
    assert inp.q.dtype == E4M3 and inp.q.transpose(1, 2).is_contiguous()       # BSHD memory, as the bf16 configs
    assert torch.equal(inp.extra["q_bf16"].float(), inp.q.float())
    ours = bench.prepare_ours_fp8(TINY, False)(inp)
    out = ours.fwd()
    assert out.dtype == E4M3 and out.shape == (1, 2, 64, 32)
    assert torch.equal(out.float(), _emulated(inp, TINY).float())
    # our bf16 forward on the same values agrees up to e4m3's rounding (half a step: 2^-4 relative) of O, and of
    # P, which moves O by at most 2^-4 max |v| (O is a convex combination of V's rows), plus bf16's own rounding.
    # (A fixed 0.2 absolute was exceeded by one unseeded draw in CI: 0.203 with max |v| 3.75.)
    ref = bench.prepare_ours_bf16(TINY, False)(inp).fwd()
    assert ref.dtype == torch.bfloat16
    bound = 2 ** -4 * ref.float().abs() + 2 ** -4 * inp.v.float().abs().amax() + 2 ** -7
    assert ((out.float() - ref.float()).abs() <= bound).all(), ((out.float() - ref.float()).abs() - bound).max()


def test_ours_fp8_column_backward_computes_sdpa_fp8_backward():
    """The bwd column: sdpa_fp8_backward on e4m3 q, k, v, dO and our forward's e4m3 o and stats, e4m3 gradients in
    q/k/v's shapes and amaxes; the bf16 column's backward is autograd's on the bf16 copies with the bf16 dO, and the
    two agree up to the FP8 rounding of P, dS and the gradients."""
    inp = bench.make_inputs(TINY, "cpu")
    d_o = inp.extra["dO"]
    assert d_o.dtype == E4M3 and d_o.shape == (1, 2, 64, 32) and d_o.transpose(1, 2).is_contiguous()
    assert torch.equal(inp.extra["dO_bf16"].float(), d_o.float())
    got = bench.prepare_ours_fp8(TINY, True)(inp).make_bwd()()
    want = _emulated_bwd(inp, TINY)
    _assert_same(got, want)
    assert all(g.dtype == bench.FP8_GRAD for g in got[:3])
    assert all(float(a) > 0 for a in got[3:])

    ref = bench.prepare_ours_bf16(TINY, True)(inp).make_bwd()()
    assert len(ref) == 3 and all(r.dtype == torch.bfloat16 for r in ref)
    for g, r, name in zip(got[:3], ref, ("scale_dQ", "scale_dK", "scale_dV")):
        deq = g.float() / inp.extra[name]
        assert deq.shape == r.shape
        # e4m3's 2^-4 relative rounding of P, dS and the gradient itself, against the bf16 gradient's size
        assert (deq - r.float()).abs().max().item() < 0.25 * r.float().abs().max().item() + 0.05


@pytest.mark.parametrize("causal", [True, False])
def test_fp8_backward_scales(causal):
    """The backward's scales: powers of two, each descale the exact inverse of its scale, descale_o the forward's
    1 / scale_o, in the inputs as fp32 [1, 1, 1, 1] tensors beside the forward's."""
    cfg = bench.Config("fp8", 1, 2, 2, 64, 64, 32, "e4m3", causal=causal)
    sc = bench.fp8_bwd_scales(cfg)
    assert sc["descale_o"] == 1 / bench.FP8_SCALES["scale_o"] and sc["descale_dO"] == 1.0
    assert sc["scale_dP"] * sc["descale_dP"] == 1.0 and sc["scale_dP"] == (256.0 if causal else 1024.0)
    for name in ("scale_dP", "scale_dQ", "scale_dK", "scale_dV"):
        assert math.log2(sc[name]).is_integer()
    assert set(bench.FP8_BWD_SCALE_ARGS) == (set(bench.FP8_SCALES) - {"scale_o"}) | set(sc)     # twelve, no other
    inp = bench.make_inputs(cfg, "cpu")
    for name in bench.FP8_BWD_SCALE_ARGS:
        t = inp.extra[name]
        assert t.dtype == torch.float32 and t.shape == (1, 1, 1, 1)
    assert float(inp.extra["scale_dP"]) == sc["scale_dP"]


def test_cudnn_fp8_column_builds_cudnns_sdpa_fp8(monkeypatch):
    """The column's graphs through fusedattn's Graph door (cuDNN frontend 1.32's signatures: a wrong keyword is
    a TypeError there, as in cuDNN), with the calls' arguments recorded; executed, they give the emulation: the
    timed inference forward, then the training forward (stats) and sdpa_fp8_backward of the bwd column."""
    calls = {}
    real_init, real_sdpa_fp8 = fusedattn.pygraph.__init__, fusedattn.pygraph.sdpa_fp8
    real_bwd = fusedattn.pygraph.sdpa_fp8_backward

    def init(self, *args, **kwargs):
        calls["graph"] = kwargs
        real_init(self, *args, **kwargs)

    def sdpa_fp8(self, *args, **kwargs):
        calls.setdefault("sdpa_fp8", []).append((args, kwargs))
        return real_sdpa_fp8(self, *args, **kwargs)

    def sdpa_fp8_backward(self, *args, **kwargs):
        calls["sdpa_fp8_backward"] = (args, kwargs)
        return real_bwd(self, *args, **kwargs)

    monkeypatch.setattr(fusedattn.pygraph, "__init__", init)
    monkeypatch.setattr(fusedattn.pygraph, "sdpa_fp8", sdpa_fp8)
    monkeypatch.setattr(fusedattn.pygraph, "sdpa_fp8_backward", sdpa_fp8_backward)
    monkeypatch.setitem(sys.modules, "cudnn", fusedattn)
    monkeypatch.setattr(bench, "_CUDNN", {})
    cols, missing = bench.fp8_backends()
    assert [c for c, _ in cols] == ["ours", "ours bf16", "cuDNN frontend"] and not missing

    inp = bench.make_inputs(TINY, "cpu")
    runner = bench.prepare_cudnn_fp8(TINY, False)(inp)
    assert calls["graph"]["io_data_type"] == fusedattn.data_type.FP8_E4M3
    (args, kw), = calls["sdpa_fp8"]
    assert not args
    assert kw["is_inference"] is True and kw["use_causal_mask"] is True
    assert kw["attn_scale"] == pytest.approx(1 / math.sqrt(TINY.d))
    assert {"q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"} <= set(kw)
    out = runner.fwd()
    assert out.dtype == E4M3 and out.shape == (1, 2, 64, 32)
    assert torch.equal(out.float(), _emulated(inp, TINY).float())

    bwd = runner.make_bwd()
    (args, kw), = calls["sdpa_fp8"][1:]          # the training forward: stats on
    assert not args and kw["is_inference"] is False and kw["use_causal_mask"] is True
    args, kw = calls["sdpa_fp8_backward"]
    assert not args
    assert set(kw) == {"q", "k", "v", "o", "dO", "stats", "attn_scale", "use_causal_mask", "name"} | set(
        bench.FP8_BWD_SCALE_ARGS)
    assert kw["use_causal_mask"] is True and kw["attn_scale"] == pytest.approx(1 / math.sqrt(TINY.d))
    got = bwd()
    _assert_same(got, _emulated_bwd(inp, TINY))
    assert [g.stride() for g in got[:3]] == [inp.q.stride(), inp.k.stride(), inp.v.stride()]


def test_cudnn_fp8_backward_refusal_is_a_none_cell(monkeypatch):
    """cuDNN refusing the FP8 backward (Hopper: d = 128 only) is an Unsupported with cuDNN's text, given again
    for the next input set without a rebuild, and the forward still runs."""
    monkeypatch.setitem(sys.modules, "cudnn", fusedattn)
    monkeypatch.setattr(bench, "_CUDNN", {})
    built = []

    def refuse(self, *args, **kwargs):
        built.append(1)
        raise RuntimeError("hidden_dim shoud be equal to 128")

    monkeypatch.setattr(fusedattn.pygraph, "sdpa_fp8_backward", refuse)
    bind = bench.prepare_cudnn_fp8(TINY, True)
    runners = [bind(bench.make_inputs(TINY, "cpu")) for _ in range(2)]
    for r in runners:
        with pytest.raises(bench.Unsupported, match="sdpa_fp8_backward: RuntimeError: hidden_dim"):
            r.make_bwd()
    assert len(built) == 1
    assert runners[0].fwd().dtype == E4M3
    cell = bench._failure(bench.Unsupported("cuDNN frontend sdpa_fp8_backward: x"))
    assert cell.status == "none" and "sdpa_fp8_backward" in cell.why


def test_fp8_table_divides_by_cudnn_and_by_our_bf16():
    cfg = bench.fp8_configs()[0]
    b = bench.Bench(bench.parse_args(["--configs", "fp8", "--pass", "fwd"]))
    for col, value in (("ours", 900.0), ("ours bf16", 600.0), ("cuDNN frontend", 1000.0)):
        b._store(cfg, "fwd", col, bench.Cell("ok", 1.0, value))
    head, row = _table_rows(bench.render_table(b, [cfg], ["ours", "ours bf16", "cuDNN frontend"], None))
    cells = dict(zip(head, row))
    assert cells["ours/best"] == "0.90"            # ours bf16 is no alternative: the best one is cuDNN's
    assert cells["ours/ours bf16"] == "1.50"


def test_fp8_group_runs_on_the_cpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--configs", "fp8", "--quick"]) == 0
    res = capsys.readouterr()
    assert "FP8 config on the CPU" in res.err
    rows = _table_rows(res.out)
    assert rows[0] == ["config", "pass", "ours", "ours bf16", "ours/best", "ours/ours bf16"]
    assert [r[1] for r in rows[1:]] == ["fwd", "bwd", "fwd+bwd"]
    for row in rows[1:]:            # ours, ours bf16 and their ratio in every pass (the FP8 backward is timed)
        assert float(row[2]) > 0 and float(row[3]) > 0 and row[4] == "-" and float(row[-1]) > 0
