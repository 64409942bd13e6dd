"""The command line: ``python -m fusedattn demo`` and ``python -m fusedattn bench --quick``.

Run as subprocesses on the CPU (CUDA hidden, so a GPU machine runs the same fast path),
they must finish and print sane tables. The work counts the bench reports are checked
in-process against the formulas of DESIGN.md.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=120):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "fusedattn", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def table_rows(text):
    """Markdown table rows as lists of cells (header and separator rows dropped)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_demo_runs_every_seed_example_and_passes():
    res = run_cli("demo", "--device", "cpu")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = table_rows(res.stdout)
    header, body = rows[0], rows[1:]
    assert header[0] == "case" and "check" in header
    assert [r[0] for r in body] == ["basic", "causal", "GQA", "BSHD (LLM quick start)"]
    check = header.index("check")
    err = header.index("max abs error")
    for r in body:
        assert r[check] == "pass", r
        assert 0 <= float(r[err]) < 0.05, r
        assert float(r[-1]) > 0 and float(r[-2]) > 0, r          # both timed
    assert "all 4 examples match PyTorch" in res.stdout


def test_bench_quick_without_gpu_times_a_tiny_config(tmp_path):
    csv_path = tmp_path / "bench.csv"
    res = run_cli("bench", "--quick", "--csv", str(csv_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no CUDA GPU found" in res.stderr
    rows = table_rows(res.stdout)
    header, body = rows[0], rows[1:]
    assert header[:3] == ["config", "pass", "ours"] and header[-1] == "ours/best"
    assert [r[1] for r in body] == ["fwd", "bwd", "fwd+bwd"]
    for r in body:
        assert float(r[2]) > 0 and float(r[3]) > 0, r            # ours and torch both measured
        assert float(r[-1]) > 0, r
    lines = csv_path.read_text().splitlines()
    assert lines[0].startswith("table,config,name,pass,backend,status")
    assert sum(",ok," in line for line in lines) == 6            # 2 backends x fwd, bwd, fwd+bwd


def test_unknown_command_is_refused_with_usage():
    res = run_cli("frobnicate")
    assert res.returncode == 2
    assert "unknown command" in res.stderr and "demo" in res.stderr


def test_bench_work_counts_follow_the_usual_formulas():
    from fusedattn import bench

    plain, causal = bench.anchor_configs()[:2]
    assert bench.fwd_flops(plain) == 4 * 8 * 12 * 1024 * 1024 * 64
    assert bench.fwd_flops(causal) == bench.fwd_flops(plain) / 2
    # a window counts only the kept pairs: row i keeps min(i, w) + 1 keys
    win = bench.Config("masked", 1, 1, 1, 10, 10, 8, "fp16", causal=True, mask="window", window=3)
    kept = sum(min(i, 3) + 1 for i in range(10))
    assert bench.fwd_flops(win) == 2 * kept * (8 + 8)
    pad = bench.Config("masked", 2, 1, 1, 8, 8, 8, "fp16", causal=True, mask="padding", lens=(8, 4))
    assert bench.fwd_flops(pad) == 2 * (8 * 8 / 2 + 4 * 4 / 2) * 16
    dec = bench.decode_configs()[0]
    assert bench.kv_bytes(dec) == 64 * 8 * 4096 * (128 + 128) * 2


def test_bench_config_names_are_unique_and_filterable():
    from fusedattn import bench

    args = bench.parse_args(["--configs", "all"])
    names = [c.name for c in bench.select_configs(args)]
    # anchors, masked (4 masks + a d=64 dropout row + 2 sink rows), decode, prefill (4 caches + 3 packed)
    assert len(names) == len(set(names)) == 8 + 7 + 6 + 7
    only = bench.select_configs(bench.parse_args(["--only", "h32kv8,paged16"]))
    assert [c.name for c in only] == ["b4-h32kv8-s4096-d128-bf16-causal",
                                      "decode-b64-h32kv8-kv4096-d128-bf16-contig",
                                      "decode-b64-h32kv8-kv4096-d128-bf16-paged16",
                                      "decode-b64-h32kv8-kv4096-d128-bf16-paged64",
                                      "decode-b8-h32-kv16384-d128-bf16-paged16",
                                      "prefill-b8-h32kv8-q512-kv4096-d128-bf16-contig",
                                      "prefill-b8-h32kv8-q512-kv4096-d128-bf16-paged16",
                                      "prefill-b8-h32kv8-q512-kv4096-d128-bf16-paged64",
                                      "prefill-b8-h32kv8-q512-kv4096-d128-bf16-paged256",
                                      "prefill-b8-h32kv8-q512-kv4096-d128-bf16-contig-varlen",
                                      "prefill-b8-h32kv8-q512-kv4096-d128-bf16-paged16-varlen",
                                      "prefill-b8-h32kv8-q512-kv4096-d128-bf16-paged64-varlen"]


def test_masked_table_gives_each_library_its_own_mask_cost():
    """The masked table's ratios: ours/best never counts an alternative's no-mask run as an
    alternative, and ours/no-mask and cuDNN/no-mask divide each library by its own unmasked run."""
    from fusedattn import bench

    cfg = bench.masked_configs()[0]
    b = bench.Bench(bench.parse_args(["--configs", "masked"]))
    for col, value in (("ours", 300.0), ("ours (no mask)", 500.0), ("cuDNN frontend", 250.0),
                       ("cuDNN frontend (no mask)", 600.0)):
        b._store(cfg, "fwd", col, bench.Cell("ok", 1.0, value))
    table = bench.render_table(b, [cfg], ["ours", "cuDNN frontend"], None)
    head, row = table_rows(table)
    cells = dict(zip(head, row))
    assert cells["cuDNN frontend (no mask)"] == "600" and cells["ours (no mask)"] == "500"
    assert cells["ours/best"] == "1.20"            # 300 / 250, not 300 / 600
    assert cells["ours/no-mask"] == "0.60" and cells["cuDNN/no-mask"] == "0.42"


def test_bench_sink_config_times_ours_with_the_sink_and_declines_the_rest():
    """The masked table's sink rows (issue 26): ours runs with the sink (its gradient among the
    backward's leaves, the sink changing the output), every alternative declines instead of timing
    the problem without a sink."""
    import torch

    from fusedattn import bench

    cfg = bench.Config("masked", 1, 2, 2, 9, 9, 8, "fp32", causal=True, mask="sink")
    assert [c.mask for c in bench.masked_configs()].count("sink") == 2
    inp = bench.make_inputs(cfg, "cpu")
    assert inp.extra["sink"].shape == (2,) and inp.extra["sink"].requires_grad
    runner = bench.prepare_ours(cfg, True)(inp)
    with_sink = runner.fwd()
    plain = bench.prepare_ours(cfg.unmasked(), True)(inp)       # "ours (no mask)" on the same inputs
    assert (with_sink - plain.fwd()).abs().max() > 1e-4          # the sink is really passed
    grads = runner.make_bwd()()
    assert len(grads) == 4 and grads[3].shape == (2,) and torch.isfinite(grads[3]).all()
    assert len(plain.make_bwd()()) == 3                          # no sink leaf where no sink is used
    for prep in (bench.prepare_sdpa("MATH"), bench.prepare_flex, bench.prepare_fa4):
        try:
            prep(cfg, True)
        except bench.Unsupported as exc:
            assert "sink" in str(exc)
        except ImportError:
            pass                                             # FA4 / cuDNN not installed here
        else:
            raise AssertionError(f"{prep} accepted a sink config")


def test_bench_varlen_prefill_is_the_padded_prefill_packed(monkeypatch):
    """The prefill table's varlen rows (issue 25 item 3): the same chunks packed as FlashAttention's
    varlen layout over the same paged or contiguous cache give the padded rows' output, row for row; so do the cuDNN
    frontend column's graphs (packed rows: cuDNN's THD queries, ragged offsets on Q and O, as its
    test_sdpa_chunked_prefill.py builds them), run here through fusedattn's Graph door standing in for
    ``cudnn`` (the real cuDNN frontend runs them in ``bench --configs prefill`` on a GPU)."""
    import torch

    import fusedattn

    from fusedattn import bench

    names = [c.name for c in bench.prefill_configs()]
    assert sum(n.endswith("-varlen") for n in names) == 3 and len(set(names)) == len(names)
    torch.manual_seed(0)
    cfg = bench.Config("prefill", 2, 4, 2, 5, 19, 8, "fp32", causal=True, page_block=4)
    inp = bench.make_inputs(cfg, "cpu")
    padded = bench.prepare_ours(cfg, False)(inp).fwd()                       # [b, h, s_q, d]
    for cache in (cfg, bench.replace(cfg, page_block=0)):                    # the paged cache, the contiguous one
        packed = bench.prepare_ours(bench.replace(cache, mask="varlen"), False)(inp).fwd()   # [b * s_q, h, d]
        assert packed.shape == (cfg.b * cfg.s_q, cfg.h_q, cfg.d)
        torch.testing.assert_close(packed, padded.transpose(1, 2).reshape(packed.shape), rtol=1e-5, atol=1e-5)
    for prepare in (bench.prepare_sdpa("MATH"), bench.prepare_flex, bench.prepare_fa4):
        # no packed-queries layout wired for them: declined, not timed on the padded layout under a packed label
        with pytest.raises(bench.Unsupported):
            prepare(bench.replace(cfg, page_block=0, mask="varlen"), False)

    monkeypatch.setitem(sys.modules, "cudnn", fusedattn)
    monkeypatch.setattr(bench, "_CUDNN", {})
    built = []
    real_sdpa = fusedattn.pygraph.sdpa

    def sdpa(self, *args, **kwargs):
        built.append(kwargs)
        return real_sdpa(self, *args, **kwargs)

    monkeypatch.setattr(fusedattn.pygraph, "sdpa", sdpa)
    runs = []
    real_execute = fusedattn.pygraph.execute

    def execute(self, pack, *args, **kwargs):
        runs.append(pack)
        return real_execute(self, pack, *args, **kwargs)

    monkeypatch.setattr(fusedattn.pygraph, "execute", execute)
    for c in (cfg, bench.replace(cfg, mask="varlen"), bench.replace(cfg, mask="varlen", page_block=0)):
        bench.prepare_cudnn(c, False)(inp).fwd()
    assert len(built) == 3 and len(runs) == 3
    # cuDNN takes ragged Q only with its padding mask (cuDNN 9.19 on the H100: "is_ragged==True is only allowed
    # when padding_mask=True"), so the packed rows over the contiguous cache carry it too
    assert all(kw["use_padding_mask"] and kw["use_causal_mask_bottom_right"] for kw in built)
    assert ["paged_attention_k_table" in kw for kw in built] == [True, True, False]
    assert [kw["q"].get_ragged_offset() is not None for kw in built] == [False, True, True]
    for pack in runs:
        # the output the graph wrote: O [b, h, s_q, d] over BSHD memory (the packed rows' THD layout)
        got, = [t for t in pack.values() if t.shape == padded.shape and t.data_ptr() != inp.q.data_ptr()]
        torch.testing.assert_close(got, padded, rtol=1e-5, atol=1e-5)


def test_prefill_table_divides_each_row_by_the_contiguous_cache_with_the_same_queries():
    """Issue 25 item 3 asks the paged prefill for 0.95x of the contiguous cache, padded and packed queries alike:
    the prefill table's ours/contiguous column divides a padded row by the padded contiguous one and a packed
    (varlen) row by the packed contiguous one, so the pages' cost is not mixed with the packing's."""
    from fusedattn import bench

    cfgs = bench.prefill_configs()
    b = bench.Bench(bench.parse_args(["--configs", "prefill"]))
    speed = {"contig": 600.0, "paged16": 570.0, "paged64": 590.0, "paged256": 606.0,
             "contig-varlen": 580.0, "paged16-varlen": 551.0, "paged64-varlen": 574.2}
    for cfg in cfgs:
        b._store(cfg, "fwd", "ours", bench.Cell("ok", 1.0, speed[cfg.name.split("bf16-")[1]]))
    head, *rows = table_rows(bench.render_table(b, cfgs, ["ours"], None))
    ratio = {row[0]: row[head.index("ours/contiguous")] for row in rows}
    got = [ratio[cfg.label] for cfg in cfgs]
    assert got == ["1.00", "0.95", "0.98", "1.01", "1.00", "0.95", "0.99"], got


def test_bench_table_names_rows_measured_on_a_slowed_gpu():
    """The SM clock read after each of ours' timings (bench.gpu_clock_mhz) goes under the table: its range,
    and the rows read below 90% of the table's highest clock (a transient slowdown of the GPU, not of the
    kernel: bench/NOTES.md 61's packed rows). No readings (CPU), no note."""
    from fusedattn import bench

    cfgs = bench.prefill_configs()[:3]
    b = bench.Bench(bench.parse_args(["--configs", "prefill"]))
    for cfg in cfgs:
        b._store(cfg, "fwd", "ours", bench.Cell("ok", 1.0, 600.0))
    assert "SM clock" not in bench.render_table(b, cfgs, ["ours"], None)
    for cfg, mhz in zip(cfgs, (1980.0, 1800.0, 1410.0)):
        b.clocks[(cfg.name, "fwd")] = mhz
    table = bench.render_table(b, cfgs, ["ours"], None)
    note = [line for line in table.splitlines() if line.startswith("SM clock")]
    assert len(note) == 1 and "1410-1980 MHz" in note[0]
    assert f"{cfgs[2].label} fwd 1410" in note[0]          # 1410 < 0.9 * 1980
    assert cfgs[1].label not in note[0]                    # 1800 >= 0.9 * 1980
    assert not bench.Bench(bench.parse_args(["--configs", "prefill"])).clocks
