"""bench/cudnn_fe_suite.py's own logic (no GPU, no fetched cuDNN tests needed): the seeded sample, the
static-skip rules, and a run of a small stand-in test file through the plugin (pass, fail, both kinds of
skip, a crash, the per-case seed), with fusedattn as ``cudnn``."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("cudnn_fe_suite_under_test", BENCH / "cudnn_fe_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows():
    rows = [{"id": f"test_mhas.py::test_sdpa[{i}]", "file": "test_mhas.py", "func": "test_sdpa", "params": {}}
            for i in range(500)]
    rows += [{"id": f"test_mhas.py::test_sdpa_backward[{i}]", "file": "test_mhas.py", "func": "test_sdpa_backward",
              "params": {}} for i in range(100)]
    rows += [{"id": f"test_sdpa_thd.py::test_{k}", "file": "test_sdpa_thd.py", "func": f"test_{k}", "params": {}}
             for k in "abc"]
    return rows


def test_sample_is_seeded_and_stratified(suite):
    rows = _rows()
    a = suite.sample(rows, 21, seed=7)
    assert a == suite.sample(rows, 21, seed=7)
    assert a != suite.sample(rows, 21, seed=8)
    assert len(a) == len(set(a)) == 21
    # the three one-case functions whole, the other 18 split evenly
    assert sum("thd" in i for i in a) == 3
    assert sum("test_sdpa[" in i for i in a) == 9 and sum("backward" in i for i in a) == 9
    # in collection order
    order = [r["id"] for r in rows]
    assert a == sorted(a, key=order.index)
    assert len(suite.sample(rows, 30, seed=1, how="uniform")) == 30
    assert len(suite.sample(rows, 10_000, seed=1)) == len(rows)


def test_static_skip_rules(suite):
    def row(func, **p):
        base = {"is_ragged": "False", "is_padding": "True", "layout": "bshd_bshd_bshd", "paged_attention": "0",
                "is_alibi": "False", "diagonal_alignment": "diagonal_alignment.TOP_LEFT", "is_right_bound": "True"}
        base.update({k: str(v) for k, v in p.items()})
        return {"id": "x", "file": "test_mhas.py", "func": func, "params": base}

    assert not suite.is_static_skip(row("test_sdpa"))
    assert suite.is_static_skip(row("test_sdpa", is_ragged=True, is_padding=False))
    assert suite.is_static_skip(row("test_sdpa", is_ragged=True, layout="sbh3d"))
    assert suite.is_static_skip(row("test_sdpa", paged_attention="_packed", layout="bs3hd"))
    assert not suite.is_static_skip(row("test_sdpa", paged_attention="1"))
    assert suite.is_static_skip(row("test_sdpa_backward", is_alibi=True, is_right_bound=False))
    assert suite.is_static_skip(row("test_sdpa_backward", is_alibi=True,
                                    diagonal_alignment="diagonal_alignment.BOTTOM_RIGHT"))
    assert not suite.is_static_skip(row("test_sdpa_backward", is_alibi=True))


STAND_IN = '''
import os, random, pytest, cudnn

@pytest.mark.parametrize("x", [0, 1, 2, 3, 4, 5])
def test_case(x):
    print(f"pytest case{x} --draw={random.randint(0, 10**9)}")
    if x == 1:
        assert x == 2, "numbers differ"
    if x == 2:
        pytest.skip("TEST WAIVED: unsupported graph.")
    if x == 3:
        pytest.skip("Ragged tensor is only tested with packed variable length tensors")
    if x == 4:
        os._exit(3)

def test_which_cudnn():
    assert cudnn.__name__ == "fusedattn"
'''


def test_run_side_outcomes_and_report(suite, tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_standin.py").write_text(STAND_IN)
    (tests / "pytest.ini").write_text(suite.PYTEST_INI)
    ids = [f"test_standin.py::test_case[{i}]" for i in range(6)] + ["test_standin.py::test_which_cudnn"]
    runs = [suite.run_side("fusedattn", ids, tests, 5, 240, 0, tmp_path / f"work{k}", lambda m: None)
            for k in range(2)]
    r = runs[0]
    got = {i.split("::")[1]: r[i]["outcome"] for i in ids}
    assert got == {"test_case[0]": "pass", "test_case[1]": "FAIL", "test_case[2]": "unsupported",
                   "test_case[3]": "skip", "test_case[4]": "crash", "test_case[5]": "pass",
                   "test_which_cudnn": "pass"}, got
    assert r["_session"]["cudnn_file"].endswith(os.path.join("fusedattn", "__init__.py"))
    # the same case draws the same "shapes" in every run (Python's random seeded per case)
    assert runs[0][ids[0]]["repro"] == runs[1][ids[0]]["repro"]
    assert runs[0][ids[0]]["repro"] != runs[0][ids[5]]["repro"]
    # a pretend cuDNN side that passes case 1: one disagreement, with the failure's first lines
    other = {i: dict(v) for i, v in r.items() if i != "_session"}
    other[ids[1]] = {"outcome": "pass", "detail": "", "repro": None}
    text = suite.report(ids, {"cudnn": other, "fusedattn": r, "_why": {}}, ["cudnn", "fusedattn"], "t",
                        tmp_path / "out")
    assert "disagree: 1" in text and "numbers differ" in text
    saved = json.loads((tmp_path / "out" / "cudnn_fe_results.json").read_text())
    assert saved["ids"] == ids


def test_check_files_names_what_is_missing(suite, tmp_path):
    problems = suite.check_files(tmp_path)
    assert len(problems) == len(suite.MANIFEST) and all("missing" in p for p in problems)
    assert suite.short_id("test_mhas.py::test_sdpa[torch.bfloat16-bshd_bshd_bshd]") == "test_sdpa[bf16-bshd]"


def test_api_check_reads_cudnn_names(suite, tmp_path):
    (tmp_path / "t.py").write_text("x = cudnn.diagonal_alignment.TOP_LEFT\ny = cudnn.no_such_thing\n"
                                   "z = torch.backends.cudnn.version()\nw = cudnn.data_type.NO_SUCH\n")
    missing = suite.api_check(tmp_path, ["t.py"])
    assert missing == ["cudnn.no_such_thing (t.py:2)", "cudnn.data_type.NO_SUCH (t.py:4)"], missing


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
