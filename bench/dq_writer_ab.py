"""Lab script (issue 28): the single-pass backward's dQ writer warp (``bwd_fused_sm90.DQ_WRITER``) against the
consumers' own dQ reduces, with and without ``DQ_FIRST``, in one process, rounds interleaved.

    python3 bench/dq_writer_ab.py [--rounds N] [--configs 8k,16kc,gqa4kc,2kc,d64] [--variants a,b] [--graphs]
    ncu --profile-from-start off ... python3 bench/dq_writer_ab.py --profile --configs 8k

Per config and variant: the whole backward as ``launch_bwd_fused_sm90(out=)`` runs it (delta and the dq_acc
zeroing, the fused kernel, the dQ conversion), median ms of ``bench.do_bench_cold`` per round (--graphs: the mean
of 20 replays of a CUDA graph of the backward, between one pair of events, L2 warm: no host time), TFLOP/s (2.5x the
forward's flops, halved causal) and each round's ratio to the defaults' time in the same round. Before timing,
each variant's dQ / dK / dV against the defaults' on the same inputs: dK, dV bitwise (one writer each), dQ within
fp32 rounding of the adds' order. --profile: no timing; one backward per variant between cudaProfilerStart / Stop
(for ncu's --profile-from-start off), in the --variants order.

Why (bench/BWD_PROFILE.md, NOTES 78): Nsight Compute's per-instruction samples of the 8k no-mask kernel put
22% of a consumer warp's time in the dQ tail (store_wait, 16 STS.64, fence, warpgroup barriers, two TMA reduce
issues), after its wgmmas are all done, both warpgroups at once.
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fusedattn  # noqa: E402
from fusedattn.backends.gluon import bwd_fused_sm90 as F  # noqa: E402
from fusedattn.bench import do_bench_cold  # noqa: E402
from fusedattn.problem import make_problem  # noqa: E402

CONFIGS = {  # name: (b, h_q, h_kv, s, d, causal)
    "8k": (2, 16, 16, 8192, 128, False),
    "16kc": (1, 32, 32, 16384, 128, True),
    "gqa4kc": (4, 32, 8, 4096, 128, True),
    "2kc": (4, 32, 32, 2048, 128, True),
    "d64": (8, 12, 12, 1024, 64, False),
}
VARIANTS = {"default": {}, "dqfirst": dict(dq_first=True), "writer": dict(dq_writer=True),
            "writer+dqfirst": dict(dq_writer=True, dq_first=True)}


def inputs(b, h_q, h_kv, s, d, causal):
    torch.manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(b, s, h_q, d, device="cuda", dtype=dt).transpose(1, 2)
    k = torch.randn(b, s, h_kv, d, device="cuda", dtype=dt).transpose(1, 2)
    v = torch.randn(b, s, h_kv, d, device="cuda", dtype=dt).transpose(1, 2)
    do = torch.randn(b, s, h_q, d, device="cuda", dtype=dt).transpose(1, 2)
    out, stats = fusedattn.attention_forward(q, k, v, causal=causal, return_stats=True)
    p, _ = make_problem(q, k, v, causal=causal)
    return p, q, k, v, do, out, stats[..., 0]


def graph_timer(fn, replays=20):
    """A function timing ``fn`` captured in a CUDA graph: mean ms of ``replays`` replays between two events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def timed():
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / replays
    return timed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="8k,16kc,gqa4kc,2kc")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    names = a.variants.split(",")
    print(torch.cuda.get_device_name(), "triton", __import__("triton").__version__, flush=True)
    for cname in a.configs.split(","):
        b, h_q, h_kv, s, d, causal = CONFIGS[cname]
        p, q, k, v, do, out, lse = inputs(b, h_q, h_kv, s, d, causal)
        delta = torch.empty((b * h_q, s), dtype=torch.float32, device="cuda")
        acc = torch.empty((b, h_q, F.acc_rows(s), d), dtype=torch.float32, device="cuda")
        grads = {n: (torch.full_like(q, float("nan")), torch.full_like(k, float("nan")), torch.full_like(v, float("nan")))
                 for n in names}

        def run(n):
            dq, dk, dv = grads[n]
            F.launch_bwd_fused_sm90(p, q, k, v, do, lse, delta, dq, dk, dv, out=out, dq_acc=acc, **VARIANTS[n])

        for n in names:
            run(n)
        torch.cuda.synchronize()
        ref = grads[names[0]]
        scale = ref[0].float().abs().max().item()
        for n in names[1:]:
            dq_err = (grads[n][0].float() - ref[0].float()).abs().max().item()
            same_kv = torch.equal(grads[n][1], ref[1]) and torch.equal(grads[n][2], ref[2])
            ok = same_kv and dq_err <= 1e-2 * scale
            print(f"  {cname} {n}: dK/dV bitwise {'equal' if same_kv else 'DIFFER'}, max|dQ - default| {dq_err:.2e} "
                  f"(|dQ| max {scale:.2e}) {'ok' if ok else 'WRONG'}", flush=True)
        if a.profile:
            for n in names:
                torch.cuda.cudart().cudaProfilerStart()
                run(n)
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                print(f"  {cname} {n}: one backward profiled", flush=True)
            continue
        flops = 2.5 * 4.0 * b * h_q * s * s * d * (0.5 if causal else 1.0)
        timers = {n: (lambda n=n: do_bench_cold(lambda: run(n), warmup=25, rep=200)) for n in names}
        if a.graphs:
            timers = {n: graph_timer(lambda n=n: run(n)) for n in names}
        times = {n: [] for n in names}
        for r in range(a.rounds):
            for n in names:
                times[n].append(timers[n]())
        base = times[names[0]]
        for n in names:
            ratios = " ".join(f"{base[i] / t:.3f}" for i, t in enumerate(times[n]))
            med = statistics.median(times[n])
            print(f"{cname:7s} {n:15s} {med:7.3f} ms {flops / med / 1e9:6.1f} TFLOP/s  per-round x default: {ratios}",
                  flush=True)


if __name__ == "__main__":
    main()
