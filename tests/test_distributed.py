"""Context-parallel attention (fusedattn.distributed) on gloo groups of 2 and 4 spawned processes.

One group per world size runs every case of ``CASES`` (spawning is the slow part: each process
imports torch); each rank saves its local out, stats and gradients, and the tests here reassemble
them with ``unshard_sequence`` and compare with the float64 reference on the whole sequence
(FlashAttention's 2x rule from fusedattn.testing). Every process wait is bounded by a timeout.

This file is also the worker: ``python tests/test_distributed.py --worker RANK WORLD INIT_FILE OUT_DIR``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback
import zlib

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GROUP_TIMEOUT_S = 150           # one group, all its cases (about 10 s); a hang fails the tests, not CI

# name: (worlds, dtype, backend, b, h_q, h_kv, c (chunk length), d, d_v, causal, layout, variant, bshd)
CASES = {
    "f64-causal-zigzag-ring": ((2, 4), "float64", "cpu", 2, 2, 2, 7, 16, 16, True, "zigzag", "ring", False),
    "f64-full-zigzag-ring": ((2, 4), "float64", "cpu", 1, 2, 2, 7, 16, 16, False, "zigzag", "ring", False),
    "f32-causal-zigzag-ring-gqa": ((2, 4), "float32", "cpu", 2, 4, 2, 7, 16, 16, True, "zigzag", "ring", False),
    "f32-full-zigzag-ring-gqa": ((2,), "float32", "cpu", 1, 4, 2, 7, 16, 16, False, "zigzag", "ring", False),
    "f32-causal-zigzag-allgather-gqa": ((2, 4), "float32", "cpu", 2, 4, 2, 7, 16, 16, True, "zigzag",
                                        "allgather", False),
    "f64-full-zigzag-allgather": ((2, 4), "float64", "cpu", 1, 2, 2, 7, 16, 16, False, "zigzag", "allgather", False),
    "f64-causal-contiguous-ring": ((2, 4), "float64", "cpu", 1, 2, 2, 7, 16, 16, True, "contiguous", "ring", False),
    "f32-causal-contiguous-allgather-gqa": ((2, 4), "float32", "cpu", 1, 4, 2, 7, 16, 16, True, "contiguous",
                                            "allgather", False),
    "f32-causal-zigzag-ring-dv24-bshd": ((2,), "float32", "cpu", 1, 2, 1, 5, 16, 24, True, "zigzag", "ring", True),
    "f32-causal-zigzag-auto-gqa": ((2, 4), "float32", "cpu", 1, 4, 2, 3, 8, 8, True, "zigzag", "auto", False),
    "interp-f32-causal-zigzag-ring-gqa": ((2,), "float32", "triton", 1, 2, 1, 5, 16, 16, True, "zigzag", "ring",
                                          False),
    # windows (global band; chunks of 7 so the band cuts chunks), softcap, sinks
    "f64-window-causal-zigzag-ring": ((2, 4), "float64", "cpu", 1, 2, 2, 7, 16, 16, True, "zigzag", "ring", False),
    "f32-window-full-contiguous-ring-gqa": ((2, 4), "float32", "cpu", 1, 4, 2, 7, 16, 16, False, "contiguous",
                                            "ring", False),
    "f32-window-causal-zigzag-allgather": ((4,), "float32", "cpu", 1, 2, 2, 5, 16, 16, True, "zigzag", "allgather",
                                           False),
    "f64-softcap-sink-causal-zigzag-ring-gqa": ((2, 4), "float64", "cpu", 1, 4, 2, 5, 16, 16, True, "zigzag", "ring",
                                                False),
    "f32-sink-full-zigzag-allgather": ((2,), "float32", "cpu", 1, 2, 2, 5, 16, 16, False, "zigzag", "allgather",
                                       False),
    "f32-causal-zigzag-ring-mesh": ((2, 4), "float32", "cpu", 1, 2, 2, 3, 8, 8, True, "zigzag", "ring", False),
    "f32-causal-zigzag-ring-qgrad-only": ((2,), "float32", "cpu", 1, 2, 2, 3, 8, 8, True, "zigzag", "ring", False),
    # packed variable-length batches (each sequence a multiple of 2W / W tokens; one empty sequence)
    "varlen-f64-causal-zigzag-gqa": ((2, 4), "float64", "cpu", 1, 4, 2, (3, 1, 0, 5), 16, 16, True, "zigzag",
                                     "ring", False),
    "varlen-f32-full-contiguous-sink": ((2,), "float32", "cpu", 1, 2, 2, (3, 2), 16, 16, False, "contiguous",
                                        "ring", False),
}
# options beyond the table: window / softcap / sink (a [h_q] logit drawn with the inputs) / the group
# given as a 1-D DeviceMesh / gradients asked for q only
EXTRA = {
    "f64-window-causal-zigzag-ring": dict(window=(9, -1)),
    "f32-window-full-contiguous-ring-gqa": dict(window=(4, 10)),
    "f32-window-causal-zigzag-allgather": dict(window=(6, 0)),
    "f64-softcap-sink-causal-zigzag-ring-gqa": dict(softcap=1.5, sink=True),
    "f32-sink-full-zigzag-allgather": dict(sink=True),
    "f32-causal-zigzag-ring-mesh": dict(mesh=True),
    "f32-causal-zigzag-ring-qgrad-only": dict(grads=("q",)),
    "varlen-f32-full-contiguous-sink": dict(sink=True),
}
FIELDS = ("worlds", "dtype", "backend", "b", "h_q", "h_kv", "c", "d", "d_v", "causal", "layout", "variant", "bshd")
# error cases, run on the 2-rank group: (name, substring every rank's message must contain)
ERRORS = {
    "odd-zigzag": "must be even with layout='zigzag'",
    "mismatch-length": "q.shape[2] (local sequence length) must be the same on every rank of the group, "
                       "got rank 0: 6, rank 1: 4",
    "mismatch-causal": "causal must be the same on every rank",
    "kv-length": "k.shape[2] (local sequence length) must equal q.shape[2] = 6",
    "layout": "layout must be one of ('zigzag', 'contiguous'), got 'striped'",
    "variant": "variant must be one of ('auto', 'ring', 'allgather'), got 'tree'",
}
# fusedattn's stats are fp32 even for fp64 inputs: merging partial results through them (and the
# backward's P = exp(S - lse)) carries fp32's relative error (~1e-7 on unit-size data); the rest is fp64
FP64_FLOOR = 3e-6


def case_dict(name):
    return dict(zip(FIELDS, CASES[name]), name=name, varlen=name.startswith("varlen"), **EXTRA.get(name, {}))


def _chunks(cs, world):
    return 2 * world if cs["layout"] == "zigzag" else world


def cu_seqlens_of(cs, world):
    """Varlen cases: c is a tuple of per-sequence chunk lengths; sequence i has c_i * chunks tokens."""
    lens = [c * _chunks(cs, world) for c in cs["c"]]
    return torch.tensor([0] + lens).cumsum(0).to(torch.int32)


def make_inputs(cs, world):
    """Whole-sequence q, k, v, dO and the sink (or None), the same on every rank and in the parent
    (seeded by the case name). Varlen cases: packed [total, h, d]."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{cs['name']}-{world}".encode()))
    dt = getattr(torch, cs["dtype"])
    if cs["varlen"]:
        t = int(cu_seqlens_of(cs, world)[-1])
        shapes = [(t, cs["h_q"], cs["d"]), (t, cs["h_kv"], cs["d"]), (t, cs["h_kv"], cs["d_v"]),
                  (t, cs["h_q"], cs["d_v"])]
    else:
        s = _chunks(cs, world) * cs["c"]
        shapes = [(cs["b"], cs["h_q"], s, cs["d"]), (cs["b"], cs["h_kv"], s, cs["d"]),
                  (cs["b"], cs["h_kv"], s, cs["d_v"]), (cs["b"], cs["h_q"], s, cs["d_v"])]
    ts = [torch.randn(sh, generator=gen).to(dt) for sh in shapes]
    sink = (torch.randn(cs["h_q"], generator=gen) + 1.0).to(dt) if cs.get("sink") else None
    return ts + [sink]


def _as_bshd(t):
    """The same values in BSHD memory, seen as BHSD (a strided view, as models pass them)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


# ------------------------------------------------------------------------------------------------
# the worker (one process per rank)

def _worker(rank, world, init_file, out_dir):
    import datetime

    import torch.distributed as dist
    from fusedattn.distributed import context_parallel_attention, gather_sequence, shard_sequence
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

    def save(name, result):
        torch.save(result, os.path.join(out_dir, f"{name}-r{rank}.pt"))

    mesh = None
    for name in CASES:
        cs = case_dict(name)
        if world not in cs["worlds"] or (cs["backend"] == "triton" and not interp):
            continue
        try:
            if cs.get("mesh") and mesh is None:
                from torch.distributed.device_mesh import init_device_mesh
                mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
            save(name, _run_case(cs, world, rank, mesh))
        except Exception:  # noqa: BLE001 - reported by the test of this case
            save(name, dict(error=traceback.format_exc()))
            # the group may be out of step now: stop at once (the peers' pending exchanges fail on the
            # closed connection) rather than hang in the next case; later cases report no result
            sys.stdout.flush()
            os._exit(1)

    _failure_cases(world, rank, save)
    if world == 2:
        _compile_case(rank, save)
        for name in ERRORS:
            try:
                kw = dict(causal=True, backend="cpu")
                s = 6
                if name == "odd-zigzag":
                    s = 7
                elif name == "mismatch-length":
                    s = 6 if rank == 0 else 4
                elif name == "mismatch-causal":
                    kw["causal"] = rank == 0
                elif name == "layout":
                    kw["layout"] = "striped"
                elif name == "variant":
                    kw["variant"] = "tree"
                q = torch.randn(1, 2, s, 8)
                k = torch.randn(1, 2, s + (2 if name == "kv-length" else 0), 8)
                context_parallel_attention(q, k, k, **kw)
                save("err-" + name, dict(message="no error raised"))
            except Exception as exc:  # noqa: BLE001
                save("err-" + name, dict(message=f"{type(exc).__name__}: {exc}"))
        # the group still works after the errors (nobody was left waiting in a ring)
        try:
            q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(rank))
            out = context_parallel_attention(q, q, q, causal=True, backend="cpu")
            save("after-errors", dict(out=out, gathered=gather_sequence(q)))
        except Exception:  # noqa: BLE001
            save("after-errors", dict(error=traceback.format_exc()))
    dist.barrier()
    dist.destroy_process_group()


def _run_case(cs, world, rank, mesh):
    """One case on this rank: local shards in, local out / stats / gradients out (and the sizes of the
    K/V messages the ring sent, for the GQA check)."""
    from fusedattn.distributed import (_comm, context_parallel_attention, context_parallel_attention_varlen,
                                       shard_sequence, shard_varlen)
    q, k, v, do, sink = make_inputs(cs, world)
    if cs["varlen"]:
        cu = cu_seqlens_of(cs, world)
        local = [shard_varlen(t, cu, world, rank, cs["layout"]) for t in (q, k, v, do)]
    else:
        local = [shard_sequence(t, world, rank, cs["layout"]) for t in (q, k, v, do)]
        if cs["bshd"]:
            local = [_as_bshd(t) for t in local]
    wanted = cs.get("grads", ("q", "k", "v"))
    ql, kl, vl = (t.detach().requires_grad_(n in wanted) for n, t in zip("qkv", local[:3]))
    sl = sink.detach().requires_grad_() if sink is not None else None
    sent = []
    exchange = _comm.ring_exchange

    def spy(info, send, recv, tag):
        if tag == _comm.TAG_KV:
            sent.append(send.numel())
        return exchange(info, send, recv, tag)

    _comm.ring_exchange = spy
    try:
        opts = dict(causal=cs["causal"], layout=cs["layout"], backend=cs["backend"], return_stats=True,
                    softcap=cs.get("softcap", 0.0), sink=sl)
        if cs["varlen"]:
            out, stats = context_parallel_attention_varlen(ql, kl, vl, cu, **opts)
        else:
            out, stats = context_parallel_attention(ql, kl, vl, mesh if cs.get("mesh") else None,
                                                    variant=cs["variant"], window=cs.get("window"), **opts)
        out.backward(local[3])
    finally:
        _comm.ring_exchange = exchange
    return dict(out=out.detach(), stats=stats, dq=ql.grad, dk=kl.grad, dv=vl.grad,
                dsink=None if sl is None else sl.grad, sent=sent)


# failure cases: (name, pass that fails, the rank that fails (-1: the last), ring step it fails at)
FAILURES = {"fail-forward": ("forward_step", 1, 1), "fail-backward": ("backward_step", -1, 1)}
FAIL_MESSAGE = "injected kernel failure"


def _failure_cases(world, rank, save):
    """One rank's kernel raises mid-ring (forward, then backward); every rank must end with an error,
    quickly, and the group must still work afterwards."""
    from fusedattn.distributed import ring
    from fusedattn.distributed import context_parallel_attention
    for name, (method, bad, at_step) in FAILURES.items():
        bad = bad % world
        original = getattr(ring.DenseBlocks, method)
        steps = []

        def failing(self, src, *args, _original=original, _steps=steps):
            _steps.append(src)
            if len(_steps) - 1 == at_step:
                raise RuntimeError(FAIL_MESSAGE)
            return _original(self, src, *args)

        if rank == bad:
            setattr(ring.DenseBlocks, method, failing)
        t0 = time.monotonic()
        try:
            q = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
            out = context_parallel_attention(q, q, q, causal=True, variant="ring", backend="cpu")
            out.sum().backward()
            save(name, dict(message="no error raised", seconds=time.monotonic() - t0))
        except Exception as exc:  # noqa: BLE001
            save(name, dict(message=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - t0))
        finally:
            setattr(ring.DenseBlocks, method, original)
    try:
        q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(rank))
        save("after-failures", dict(out=context_parallel_attention(q, q, q, causal=True, backend="cpu")))
    except Exception:  # noqa: BLE001
        save("after-failures", dict(error=traceback.format_exc()))


def _compile_case(rank, save):
    """A function compiled with torch.compile around context_parallel_attention: it breaks the graph
    there (the call is eager) and gives the eager result, gradients included."""
    try:
        import torch._dynamo
        from fusedattn.distributed import context_parallel_attention

        def step(x, w):
            q = (x @ w).view(1, 2, 6, 8)
            out = context_parallel_attention(q, q, q, causal=True, backend="cpu")
            return (out.tanh() * 2).sum()

        gen = torch.Generator().manual_seed(rank)
        x, w = torch.randn(12, 8, generator=gen), torch.randn(8, 8, generator=gen)
        results = []
        for fn in (step, torch.compile(step, backend="aot_eager")):
            wi = w.clone().requires_grad_()
            loss = fn(x, wi)
            loss.backward()
            results.append((loss.detach(), wi.grad))
        explain = torch._dynamo.explain(step)(x, w)
        save("compile", dict(eager=results[0], compiled=results[1], graph_breaks=explain.graph_break_count,
                             reasons=[str(b.reason) for b in explain.break_reasons]))
    except Exception:  # noqa: BLE001
        save("compile", dict(error=traceback.format_exc()))


# ------------------------------------------------------------------------------------------------
# the parent: one gloo group per world size, all cases

def _launch_group(world, tmp):
    init_file = os.path.join(tmp, "init")
    logs, procs = [], []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for rank in range(world):
        log = open(os.path.join(tmp, f"log-r{rank}.txt"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(rank), str(world),
                                       init_file, tmp], stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read()[-3000:])
        log.close()
    return dict(dir=tmp, timed_out=timed_out, codes=[p.returncode for p in procs], logs=texts, world=world)


@pytest.fixture(scope="module")
def groups():
    made = {}
    tmps = []

    def get(world):
        if world not in made:
            tmp = tempfile.mkdtemp(prefix=f"fusedattn-cp{world}-")
            tmps.append(tmp)
            made[world] = _launch_group(world, tmp)
        return made[world]

    yield get
    import shutil
    for tmp in tmps:
        shutil.rmtree(tmp, ignore_errors=True)


def _results(group, name):
    """Each rank's saved dict for ``name``; fails with the ranks' logs when the group did not finish."""
    info = f"world {group['world']}, exit codes {group['codes']}; logs:\n" + "\n---\n".join(group["logs"])
    assert not group["timed_out"], f"the gloo group did not finish within {GROUP_TIMEOUT_S} s ({info})"
    res = []
    for r in range(group["world"]):
        path = os.path.join(group["dir"], f"{name}-r{r}.pt")
        assert os.path.exists(path), f"rank {r} saved no result for {name} ({info})"
        d = torch.load(path)
        assert "error" not in d, f"rank {r} failed on {name}:\n{d['error']}"
        res.append(d)
    return res


def _reference(cs, world, q, k, v, do, sink, dtype):
    """(out, lse, dq, dk, dv, dsink) of the whole sequence in ``dtype`` (varlen: per sequence, packed;
    lse [h_q, total] as attention_varlen gives)."""
    from fusedattn.reference import attention_reference
    qs, ks, vs = (t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v))
    ss = sink.detach().to(dtype).clone().requires_grad_() if sink is not None else None
    opts = dict(causal=cs["causal"], window=cs.get("window"), softcap=cs.get("softcap", 0.0), sink=ss, dtype=dtype)
    if cs["varlen"]:
        cu = cu_seqlens_of(cs, world).tolist()
        outs, lses = [], []
        for a, b in zip(cu[:-1], cu[1:]):
            if a == b:
                continue
            o, lse = attention_reference(*(t[a:b].transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs)), **opts)
            outs.append(o[0].transpose(0, 1))
            lses.append(lse[0, :, :, 0])
        o, lse = torch.cat(outs), torch.cat(lses, dim=1)
    else:
        o, lse = attention_reference(qs, ks, vs, **opts)
    o.backward(do.to(dtype))
    return o.detach(), lse, qs.grad, ks.grad, vs.grad, None if ss is None else ss.grad


PARAMS = [pytest.param(w, n, id=f"w{w}-{n}") for n in CASES for w in CASES[n][0]]


@pytest.mark.parametrize("world,name", PARAMS)
def test_context_parallel_matches_whole_sequence(groups, world, name):
    from fusedattn.distributed import unshard_sequence
    from fusedattn.testing import assert_error_within
    cs = case_dict(name)
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if cs["backend"] == "triton" and not interp:
        pytest.skip("Triton interpreter off (TRITON_INTERPRET unset)")
    from fusedattn.distributed import unshard_varlen
    res = _results(groups(world), name)
    q, k, v, do, sink = make_inputs(cs, world)
    dt = getattr(torch, cs["dtype"])
    gold = _reference(cs, world, q, k, v, do, sink, torch.float64)
    base = _reference(cs, world, q, k, v, do, sink, dt)
    floor = FP64_FLOOR if dt == torch.float64 else None
    wanted = cs.get("grads", ("q", "k", "v"))
    for i, field in enumerate(("out", "stats", "dq", "dk", "dv")):
        if field[0] == "d" and field[1] not in wanted:
            assert all(r[field] is None for r in res), f"{field} computed though not asked for"
            continue
        if cs["varlen"]:
            got = unshard_varlen([r[field] for r in res], cu_seqlens_of(cs, world), cs["layout"],
                                 dim=1 if field == "stats" else 0)
        else:
            got = unshard_sequence([r[field] for r in res], cs["layout"])
        assert got.dtype == (torch.float32 if field == "stats" else dt), field
        if field == "stats":      # fp32 everywhere: within fp32 rounding of the true log-sum-exp
            assert_error_within(got.reshape(gold[i].shape), gold[i], base[i].float(), floor=1e-5,
                                msg=f"{field} ({name}, world {world})")
        else:
            assert_error_within(got, gold[i], base[i], floor=floor, msg=f"{field} ({name}, world {world})")
    if sink is not None:   # each rank holds its rows' share; the shares sum to the whole gradient
        got = sum(r["dsink"].to(torch.float64) for r in res)
        assert all(r["dsink"].dtype == dt for r in res)
        assert_error_within(got, gold[5], base[5], floor=floor, msg=f"dsink ({name}, world {world})")
        assert not torch.allclose(res[0]["dsink"].double(), got), "a rank's dsink is not its share"
    if cs["variant"] == "ring" and world > 1:   # GQA: the K/V messages hold the h_kv heads only
        per_rank_tokens = (q.shape[0] if cs["varlen"] else q.shape[2]) // world
        elems = cs["b"] * k.shape[1] * per_rank_tokens * (cs["d"] + cs["d_v"])
        for r in res:      # W - 1 exchanges in the forward, W - 1 in the backward
            assert r["sent"] == [elems] * (2 * (world - 1)), (r["sent"], elems)


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_name_the_argument_on_every_rank(groups, name):
    res = _results(groups(2), "err-" + name)
    for r, d in enumerate(res):
        assert "InvalidArgumentError" in d["message"] and ERRORS[name] in d["message"], f"rank {r}: {d['message']}"


def test_group_still_works_after_errors(groups):
    import fusedattn
    from fusedattn.distributed import unshard_sequence
    res = _results(groups(2), "after-errors")
    q = unshard_sequence([torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)])
    want = fusedattn.attention(q, q, q, causal=True, backend="cpu")
    torch.testing.assert_close(unshard_sequence([d["out"] for d in res]), want, rtol=1e-5, atol=1e-5)
    for d in res:          # gather_sequence: the whole sequence on every rank
        assert torch.equal(d["gathered"], q)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(FAILURES))
def test_one_rank_failing_mid_ring_fails_every_rank(groups, world, name):
    """Rank ``bad`` raises in its kernel at ring step 1: it re-raises its own error, every other rank a
    ContextParallelError naming it, all within seconds (no rank waits for the group timeout), and the
    group is usable afterwards."""
    _, bad, at_step = FAILURES[name]
    bad %= world
    res = _results(groups(world), name)
    for r, d in enumerate(res):
        assert d["seconds"] < 20, f"rank {r} took {d['seconds']:.1f} s to fail"
        if r == bad:
            assert d["message"] == f"RuntimeError: {FAIL_MESSAGE}", d["message"]
        else:
            want = f"rank {bad} at ring step {at_step} (RuntimeError: {FAIL_MESSAGE})"
            assert d["message"].startswith("ContextParallelError") and want in d["message"], d["message"]
    import fusedattn
    from fusedattn.distributed import unshard_sequence
    after = _results(groups(world), "after-failures")
    q = unshard_sequence([torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)])
    torch.testing.assert_close(unshard_sequence([d["out"] for d in after]),
                               fusedattn.attention(q, q, q, causal=True, backend="cpu"), rtol=1e-5, atol=1e-5)


def test_torch_compile_breaks_the_graph_cleanly(groups):
    res = _results(groups(2), "compile")
    for r, d in enumerate(res):
        (loss_e, grad_e), (loss_c, grad_c) = d["eager"], d["compiled"]
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad_c, grad_e, rtol=1e-6, atol=1e-6)
        assert d["graph_breaks"] >= 1, f"rank {r}: expected a graph break at the call, got none"
        assert any("disable" in reason for reason in d["reasons"]), d["reasons"]


def test_dropout_is_refused_naming_the_kernel_change():
    """Refused before any communication (single process): the kernels' Philox counters depend on each
    call's own lengths, so no block could reproduce one device's mask."""
    from fusedattn import NotSupportedError
    from fusedattn.distributed import context_parallel_attention
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(NotSupportedError, match="Philox counter.*global row/key origin"):
        context_parallel_attention(q, q, q, dropout_p=0.1)


def test_not_initialized_is_a_clear_error():
    import torch.distributed as dist
    from fusedattn.distributed import context_parallel_attention
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process already has a default process group")
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        context_parallel_attention(q, q, q)


# ------------------------------------------------------------------------------------------------
# single-process pieces: layouts, plans, the merge, exact block gradients

@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(world, layout):
    from fusedattn.distributed import sequence_positions, shard_sequence, unshard_sequence
    c = 3
    n = 2 * world if layout == "zigzag" else world
    s = n * c
    x = torch.randn(2, 3, s, 8)
    shards = [shard_sequence(x, world, r, layout) for r in range(world)]
    for r, sh in enumerate(shards):
        chunks = (r, 2 * world - 1 - r) if layout == "zigzag" else (r,)
        pos = torch.cat([torch.arange(ch * c, (ch + 1) * c) for ch in chunks])
        assert torch.equal(sequence_positions(s, world, r, layout), pos)
        assert torch.equal(sh, x[:, :, pos])
    assert torch.equal(unshard_sequence(shards, layout), x)
    assert torch.equal(unshard_sequence([shard_sequence(x, world, r, layout, dim=2).transpose(1, 2)
                                         for r in range(world)], layout, dim=1), x.transpose(1, 2))
    if n > 1:
        with pytest.raises(ValueError, match=f"cannot be cut into {n} equal chunks"):
            shard_sequence(x[:, :, :s - 1], world, 0, layout)


def _coverage(world, layout, c, plan):
    """Times each (global query, global key) pair is computed by ``plan(rank, s)``, which yields
    (global rows, global keys, kept mask) per kernel call; also the work (kept pairs) of each rank."""
    s = world * c * (2 if layout == "zigzag" else 1)
    count = torch.zeros(s, s, dtype=torch.int64)
    work = []
    for r in range(world):
        w = 0
        for rows, keys, mask in plan(r, s):
            sub = mask.long()
            assert (sub.sum(1) > 0).all(), f"rank {r}: a call has a row with no key"
            count[rows[:, None], keys[None, :]] += sub
            w += int(sub.sum())
        work.append(w)
    return count, work


def _call_mask(n, m, mask):
    """A call's kept pairs: ``mask`` None (all) or a top-left band (left, right), None = unbounded."""
    a = torch.arange(n).view(-1, 1)
    b = torch.arange(m).view(1, -1)
    keep = torch.ones(n, m, dtype=torch.bool)
    if mask is not None:
        left, right = mask
        assert (left is None or left >= 0) and (right is None or right >= 0), f"bounds < 0: {mask}"
        if left is not None:
            keep &= b >= a - left
        if right is not None:
            keep &= b <= a + right
    return keep


def _global_mask(s, causal, window):
    i = torch.arange(s).view(-1, 1)
    j = torch.arange(s).view(1, -1)
    keep = torch.ones(s, s, dtype=torch.bool)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right == -1 else min(right, 0)
    if left != -1:
        keep &= j >= i - left
    if right != -1:
        keep &= j <= i + right
    return keep.long()


# (causal, window): the plain masks and bands that cut chunks of 3 at every offset
MASKS = [(True, None), (False, None), (True, (2, -1)), (True, (4, 0)), (False, (1, 1)), (False, (0, 5)),
         (False, (7, 2)), (True, (0, 0)), (False, (-1, 3))]
MASK_IDS = [f"{'causal' if c else 'full'}-w{w[0]},{w[1]}" if w else ("causal" if c else "full") for c, w in MASKS]


@pytest.mark.parametrize("causal,window", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_plan_covers_the_mask_once(world, layout, causal, window):
    from fusedattn.distributed import block_plan, sequence_positions
    c = 3

    def plan(r, s):
        qpos = sequence_positions(s, world, r, layout)
        for step in range(world):
            src = (r - step) % world
            kpos = sequence_positions(s, world, src, layout)
            for q0, q1, k0, k1, mask in block_plan(world, r, src, layout, causal, len(qpos), window):
                yield qpos[q0:q1], kpos[k0:k1], _call_mask(q1 - q0, k1 - k0, mask)

    count, work = _coverage(world, layout, c, plan)
    assert torch.equal(count, _global_mask(count.shape[0], causal, window))
    if layout == "zigzag" and window is None:
        assert len(set(work)) == 1, f"causal work per rank not balanced: {work}"


@pytest.mark.parametrize("causal,window", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_allgather_plan_covers_the_mask_once(world, layout, causal, window):
    from fusedattn.distributed import gather_plan, sequence_positions

    def plan(r, s):
        qpos = sequence_positions(s, world, r, layout)
        for q0, q1, k0, k1, mask in gather_plan(world, r, layout, causal, len(qpos), window):
            yield qpos[q0:q1], torch.arange(k0, k1), _call_mask(q1 - q0, k1 - k0, mask)

    count, _ = _coverage(world, layout, 3, plan)
    assert torch.equal(count, _global_mask(count.shape[0], causal, window))


def test_sink_enters_the_merge_once():
    """Merging key blocks whose calls carry no sink, then apply_sink once, equals one call with the sink
    (out and lse); a sink given to every block instead would count W times and differ."""
    import fusedattn
    from fusedattn.distributed import merge_partial
    from fusedattn.distributed.ring import apply_sink
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 10, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    sink = torch.tensor([0.5, 2.0], dtype=torch.float64)
    want, want_lse = fusedattn.attention_forward(q, k, v, sink=sink, causal=True, causal_alignment="bottom_right",
                                                 return_stats=True, backend="cpu")
    outs = []
    for per_block_sink in (None, sink):
        out = torch.zeros(1, 2, 6, 8, dtype=torch.float64)
        lse = torch.full((1, 2, 6), float("-inf"), dtype=torch.float64)
        for k0, k1, causal in ((0, 4, False), (4, 10, True)):    # keys 4..9: bottom-right diagonal block
            o, st = fusedattn.attention_forward(q, k[:, :, k0:k1], v[:, :, k0:k1], causal=causal,
                                                causal_alignment="bottom_right", sink=per_block_sink,
                                                return_stats=True, backend="cpu")
            merge_partial(out, lse, o, st[..., 0])
        if per_block_sink is None:
            apply_sink(out, lse, sink.view(1, -1, 1))
        outs.append((out, lse))
    torch.testing.assert_close(outs[0][0], want, rtol=0, atol=1e-6)
    torch.testing.assert_close(outs[0][1].float(), want_lse[..., 0], rtol=0, atol=1e-5)
    assert (outs[1][0] - want).abs().max() > 1e-3, "a sink in every block should count twice"


def test_apply_sink_to_a_row_with_no_key():
    """A row that saw no key (lse -inf after the merge) gets out 0 and lse = sink, as one device gives."""
    from fusedattn.distributed.ring import apply_sink
    out = torch.zeros(1, 1, 2, 4)
    out[0, 0, 1] = 1.0
    lse = torch.tensor([[[float("-inf"), 0.0]]])
    apply_sink(out, lse, torch.tensor([0.0]).view(1, -1, 1))
    assert torch.equal(out[0, 0, 0], torch.zeros(4)) and lse[0, 0, 0] == 0.0
    torch.testing.assert_close(out[0, 0, 1], torch.full((4,), 0.5))
    torch.testing.assert_close(lse[0, 0, 1], torch.tensor(2.0).log())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_of_key_blocks_equals_whole(dtype):
    import fusedattn
    from fusedattn.distributed import merge_partial
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 9, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, 13, 16, generator=gen).to(dtype) for _ in range(2))
    want, want_lse = fusedattn.attention_forward(q, k, v, return_stats=True, backend="cpu")
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.zeros(2, 4, 9, 16, dtype=acc)
    lse = torch.full((2, 4, 9), float("-inf"), dtype=acc)
    for k0, k1 in ((5, 13), (0, 5)):
        o, st = fusedattn.attention_forward(q, k[:, :, k0:k1], v[:, :, k0:k1], attn_scale=16 ** -0.5,
                                            return_stats=True, backend="cpu")
        merge_partial(out, lse, o, st[..., 0])
    tol = 2e-6 if dtype == torch.float32 else FP64_FLOOR
    torch.testing.assert_close(out.to(dtype), want, rtol=0, atol=tol)
    torch.testing.assert_close(lse.float(), want_lse[..., 0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_block_gradients_with_global_stats_are_exact(causal):
    """The ring backward's premise: attention_backward on a key block, given the *whole* row's out and
    stats, gives exactly that block's share of dq and its dk/dv (checked in fp64 against one call)."""
    import fusedattn
    gen = torch.Generator().manual_seed(11)
    s, a = 12, 5
    q = torch.randn(1, 4, s, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, s, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    do = torch.randn(1, 4, s, 16, generator=gen, dtype=torch.float64)
    out, stats = fusedattn.attention_forward(q, k, v, causal=causal, return_stats=True, backend="cpu")
    dq, dk, dv, _ = fusedattn.attention_backward(q, k, v, out, do, stats, causal=causal, backend="cpu")
    # blocks: keys [0, a) for every row (diagonal part for rows < a), keys [a, s) for rows >= a
    calls = [((0, a), (0, a), causal), ((a, s), (0, a), False), ((a, s), (a, s), causal)] if causal else \
        [((0, s), (0, a), False), ((0, s), (a, s), False)]
    gq, gk, gv = torch.zeros_like(dq), torch.zeros_like(dk), torch.zeros_like(dv)
    for (q0, q1), (k0, k1), cz in calls:
        bq, bk, bv, _ = fusedattn.attention_backward(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], out[:, :, q0:q1], do[:, :, q0:q1],
            stats[:, :, q0:q1], attn_scale=16 ** -0.5, causal=cz, backend="cpu")
        gq[:, :, q0:q1] += bq
        gk[:, :, k0:k1] += bk
        gv[:, :, k0:k1] += bv
    for got, want in ((gq, dq), (gk, dk), (gv, dv)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_choose_variant_rule():
    from fusedattn.distributed import AUTO_ALLGATHER_MAX_ROWS, choose_variant
    assert choose_variant(2, 16, 4, 2) == "ring"                       # 2 ranks: always the ring
    assert choose_variant(4, 16, 4, 2) == "allgather"                  # short shards, many ranks
    assert choose_variant(8, AUTO_ALLGATHER_MAX_ROWS, 8, 8) == "ring"  # long shards hide the transfer
    assert choose_variant(8, AUTO_ALLGATHER_MAX_ROWS // 4, 8, 2) == "ring"   # GQA groups count as rows
    assert choose_variant(8, 16, 1, 1, kv_bytes_per_rank=1 << 28) == "ring"  # gathered K/V too big


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        sys.exit("usage: python tests/test_distributed.py --worker RANK WORLD INIT_FILE OUT_DIR")
