"""``fusedattn bench --models`` (fusedattn/bench_models.py) and examples/hf_llama.py, on the CPU.

The GPU numbers come from bench/run_device.sh's ``models`` part; here: the group skips at once without
transformers, measures four positive rates with it, and the example trains, generates and agrees with sdpa.
"""
import importlib.util
import pathlib
import sys
import time

import pytest

from fusedattn import bench, bench_models

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_models_flag_parses():
    assert bench.parse_args(["--models"]).models
    assert not bench.parse_args([]).models


def test_models_skip_quickly_without_transformers(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)      # import transformers -> ImportError
    t0 = time.time()
    assert bench.main(["--models"]) == 0
    assert time.time() - t0 < 1.0
    assert "skipped, transformers is not installed" in capsys.readouterr().err


def test_models_measure_and_render_on_cpu():
    pytest.importorskip("transformers")
    import torch
    shape = bench_models.ModelShape(layers=1, hidden=32, heads=4, kv_heads=2, mlp=64, vocab=64, train_batch=2,
                                    train_seq=16, gen_batch=2, prompt=4, new=3, steps=1)
    res = bench_models.measure(shape, torch.device("cpu"), torch.float32, warmup=0)
    assert set(res) == {(ph, impl) for ph in ("train", "generate") for impl in ("sdpa", "fusedattn")}
    assert all(v > 0 for v in res.values())
    table = bench_models.render(shape, res, "CPU")
    assert "| train |" in table and "| generate |" in table and "fusedattn / sdpa" in table


def test_hf_llama_example_runs(capsys):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("hf_llama", ROOT / "examples" / "hf_llama.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--steps", "2", "--layers", "1", "--width", "64", "--batch", "2", "--seq", "32",
                         "--new", "5"]) == 0
    out = capsys.readouterr().out
    assert "attn_implementation='fusedattn'" in out
    assert "step    2  loss" in out
    assert out.count("generated:") == 2
    assert "identical to attn_implementation='sdpa': True" in out
