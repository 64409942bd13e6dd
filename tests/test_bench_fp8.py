"""``fusedattn bench --configs fp8`` (issue 27), on the CPU.

The GPU numbers come from ``python -m fusedattn bench --configs fp8 --quick`` on the device; here: the group's
configs and flag, our FP8 column computing exactly what ``fusedattn.fp8.sdpa_fp8_forward`` computes, the cuDNN
frontend column's graph built with cuDNN's sdpa_fp8 arguments (fusedattn's Graph door, which mirrors cuDNN
frontend 1.32's signatures, stands in for ``cudnn``), the table's ratios, and the CPU run of the group.
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


def _emulated(inp, cfg):
    """What cuDNN's sdpa_fp8 computes for the group's scales, by fusedattn.fp8's exact emulation."""
    scales = {name: inp.extra[name] for name in bench.FP8_SCALES}
    return fp8.sdpa_fp8_forward(inp.q, inp.k, inp.v, **scales, band=make_band(cfg.causal, "top_left", None),
                                o_dtype=E4M3, backend="cpu")[0]


def test_fp8_group_is_asked_for_by_name():
    cfgs = bench.select_configs(bench.parse_args(["--configs", "fp8"]))
    assert [c.name for c in cfgs] == ["b4-h32-s2048-d128-e4m3-causal", "b2-h16-s8192-d128-e4m3",
                                      "b1-h32-s16384-d128-e4m3-causal", "b4-h16-s4096-d256-e4m3-causal",
                                      "b32-h32-s2048-d224-e4m3", "decode-b64-h32kv8-kv4096-d128-bf16-contig-fp8cache",
                                      "decode-b64-h32kv8-kv4096-d128-bf16-paged16-fp8cache",
                                      "decode-b8-h32-kv16384-d128-bf16-contig-fp8cache"]
    assert cfgs[0].label == "4, 32, 2048, 128, e4m3, causal"
    forwards = [c for c in cfgs if c.table == "fp8"]
    assert all(c.torch_dtype == E4M3 and c.d % 16 == 0 and c.d <= 256 for c in forwards)   # cuDNN's Hopper FP8 limits
    assert cfgs[-2].label == "b 64, h 32/8, kv 4096, d 128, bf16, paged 16, e4m3 cache"
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
    inp = bench.make_inputs(TINY, "cpu")
    assert inp.q.dtype == E4M3 and inp.q.transpose(1, 2).is_contiguous()       # BSHD memory, as the bf16 configs
    assert torch.equal(inp.extra["q_bf16"].float(), inp.q.float())
    ours = bench.prepare_ours_fp8(TINY, False)(inp)
    out = ours.fwd()
    assert out.dtype == E4M3 and out.shape == (1, 2, 64, 32)
    assert torch.equal(out.float(), _emulated(inp, TINY).float())
    with pytest.raises(bench.Unsupported, match="no FP8 backward"):
        ours.make_bwd()
    # our bf16 forward on the same values agrees up to e4m3's rounding of P and O (2^-4 relative)
    ref = bench.prepare_ours_bf16(TINY, False)(inp).fwd()
    assert ref.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max().item() < 0.2


def test_cudnn_fp8_column_builds_cudnns_sdpa_fp8(monkeypatch):
    """The column's graph through fusedattn's Graph door (cuDNN frontend 1.32's signatures: a wrong keyword is
    a TypeError there, as in cuDNN), with the call's arguments recorded; executed, it gives the emulation."""
    calls = {}
    real_init, real_sdpa_fp8 = fusedattn.pygraph.__init__, fusedattn.pygraph.sdpa_fp8

    def init(self, *args, **kwargs):
        calls["graph"] = kwargs
        real_init(self, *args, **kwargs)

    def sdpa_fp8(self, *args, **kwargs):
        calls["sdpa_fp8"] = (args, kwargs)
        return real_sdpa_fp8(self, *args, **kwargs)

    monkeypatch.setattr(fusedattn.pygraph, "__init__", init)
    monkeypatch.setattr(fusedattn.pygraph, "sdpa_fp8", sdpa_fp8)
    monkeypatch.setitem(sys.modules, "cudnn", fusedattn)
    monkeypatch.setattr(bench, "_CUDNN", {})
    cols, missing = bench.fp8_backends()
    assert [c for c, _ in cols] == ["ours", "ours bf16", "cuDNN frontend"] and not missing

    inp = bench.make_inputs(TINY, "cpu")
    runner = bench.prepare_cudnn_fp8(TINY, False)(inp)
    assert calls["graph"]["io_data_type"] == fusedattn.data_type.FP8_E4M3
    args, kw = calls["sdpa_fp8"]
    assert not args
    assert kw["is_inference"] is True and kw["use_causal_mask"] is True
    assert kw["attn_scale"] == pytest.approx(1 / math.sqrt(TINY.d))
    assert {"q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"} <= set(kw)
    out = runner.fwd()
    assert out.dtype == E4M3 and out.shape == (1, 2, 64, 32)
    assert torch.equal(out.float(), _emulated(inp, TINY).float())
    with pytest.raises(bench.Unsupported):
        runner.make_bwd()


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
    fwd = rows[1]
    assert fwd[1] == "fwd" and float(fwd[2]) > 0 and float(fwd[3]) > 0 and float(fwd[-1]) > 0
    assert [r[2] for r in rows[2:]] == ["none", "none"]        # bwd, fwd+bwd: no FP8 backward yet
