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
    return dict(zip(FIELDS, CASES[name]), name=name)


def make_inputs(cs, world):
    """Whole-sequence q, k, v, dO (same on every rank and in the parent: seeded by the case name)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{cs['name']}-{world}".encode()))
    dt = getattr(torch, cs["dtype"])
    s = 2 * world * cs["c"] if cs["layout"] == "zigzag" else world * cs["c"]
    shapes = [(cs["b"], cs["h_q"], s, cs["d"]), (cs["b"], cs["h_kv"], s, cs["d"]),
              (cs["b"], cs["h_kv"], s, cs["d_v"]), (cs["b"], cs["h_q"], s, cs["d_v"])]
    return [torch.randn(sh, generator=gen).to(dt) for sh in shapes]


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

    for name in CASES:
        cs = case_dict(name)
        if world not in cs["worlds"] or (cs["backend"] == "triton" and not interp):
            continue
        try:
            q, k, v, do = make_inputs(cs, world)
            local = [shard_sequence(t, world, rank, cs["layout"]) for t in (q, k, v, do)]
            if cs["bshd"]:
                local = [_as_bshd(t) for t in local]
            ql, kl, vl = (t.detach().requires_grad_() for t in local[:3])
            out, stats = context_parallel_attention(ql, kl, vl, causal=cs["causal"], layout=cs["layout"],
                                                    variant=cs["variant"], backend=cs["backend"], return_stats=True)
            out.backward(local[3])
            save(name, dict(out=out.detach(), stats=stats, dq=ql.grad, dk=kl.grad, dv=vl.grad))
        except Exception:  # noqa: BLE001 - reported by the test of this case
            save(name, dict(error=traceback.format_exc()))
            # the group may be out of step now: stop at once (the peers' pending exchanges fail on the
            # closed connection) rather than hang in the next case; later cases report no result
            sys.stdout.flush()
            os._exit(1)

    if world == 2:
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


def _reference(cs, q, k, v, do, dtype):
    from fusedattn.reference import attention_reference
    qs, ks, vs = (t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v))
    o, lse = attention_reference(qs, ks, vs, causal=cs["causal"], dtype=dtype)
    o.backward(do.to(dtype))
    return o.detach(), lse, qs.grad, ks.grad, vs.grad


PARAMS = [pytest.param(w, n, id=f"w{w}-{n}") for n in CASES for w in CASES[n][0]]


@pytest.mark.parametrize("world,name", PARAMS)
def test_context_parallel_matches_whole_sequence(groups, world, name):
    from fusedattn.distributed import unshard_sequence
    from fusedattn.testing import assert_error_within
    cs = case_dict(name)
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if cs["backend"] == "triton" and not interp:
        pytest.skip("Triton interpreter off (TRITON_INTERPRET unset)")
    res = _results(groups(world), name)
    q, k, v, do = make_inputs(cs, world)
    dt = getattr(torch, cs["dtype"])
    gold = _reference(cs, q, k, v, do, torch.float64)
    base = _reference(cs, q, k, v, do, dt)
    floor = FP64_FLOOR if dt == torch.float64 else None
    for i, field in enumerate(("out", "stats", "dq", "dk", "dv")):
        got = unshard_sequence([r[field] for r in res], cs["layout"])
        assert got.dtype == (torch.float32 if field == "stats" else dt), field
        if field == "stats":      # fp32 everywhere: within fp32 rounding of the true log-sum-exp
            assert_error_within(got, gold[i], base[i].float(), floor=1e-5, msg=f"{field} ({name}, world {world})")
        else:
            assert_error_within(got, gold[i], base[i], floor=floor, msg=f"{field} ({name}, world {world})")


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


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_plan_covers_the_mask_once(world, layout, causal):
    from fusedattn.distributed import block_plan, sequence_positions
    c = 3

    def plan(r, s):
        qpos = sequence_positions(s, world, r, layout)
        for step in range(world):
            src = (r - step) % world
            kpos = sequence_positions(s, world, src, layout)
            for q0, q1, k0, k1, cz in block_plan(world, r, src, layout, causal, len(qpos)):
                n, m = q1 - q0, k1 - k0
                mask = torch.ones(n, m, dtype=torch.bool).tril() if cz else torch.ones(n, m, dtype=torch.bool)
                yield qpos[q0:q1], kpos[k0:k1], mask

    count, work = _coverage(world, layout, c, plan)
    s = count.shape[0]
    want = torch.ones(s, s, dtype=torch.int64)
    assert torch.equal(count, want.tril() if causal else want)
    if layout == "zigzag":
        assert len(set(work)) == 1, f"causal work per rank not balanced: {work}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_allgather_plan_covers_the_mask_once(world, layout, causal):
    from fusedattn.distributed import gather_plan, sequence_positions

    def plan(r, s):
        qpos = sequence_positions(s, world, r, layout)
        for q0, q1, k_end, cz in gather_plan(world, r, layout, causal, len(qpos)):
            n = q1 - q0
            mask = torch.ones(n, k_end, dtype=torch.bool)
            if cz:
                mask = mask.tril(k_end - n)          # bottom-right causal
            yield qpos[q0:q1], torch.arange(k_end), mask

    count, _ = _coverage(world, layout, 3, plan)
    want = torch.ones_like(count)
    assert torch.equal(count, want.tril() if causal else want)


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
