"""Lab script (issue 28): variants of the single-pass backward (``bwd_fused_sm90``'s switches, as keywords of
``launch_bwd_fused_sm90``) against its defaults, in one process, rounds interleaved; or one call each for Nsight
Compute, whose elapsed cycles are the steadier measure on a GPU whose clock moves.

    python3 bench/fused_ab.py [--rounds N] [--configs 8k,16kc,gqa4kc,2kc,d64] [--variants default,dqfirst,...] [--graphs]
    ncu --profile-from-start off --kernel-name regex:_attn_bwd_fused ... -o R python3 bench/fused_ab.py --profile ...
    ncu --import R.ncu-rep --page raw --csv > raw.csv; python3 bench/fused_ab.py --cycles raw.csv --variants ...
    bash bench/run_device.sh fused-ab ncu-fused-ab      # both (FUSED_AB_ARGS: e.g. "--configs 8k --variants ...")

Timing: per config and variant the whole backward as ``launch_bwd_fused_sm90(out=)`` runs it (delta and the
dq_acc zeroing, the fused kernel, the dQ conversion), median ms of ``bench.do_bench_cold`` per round (--graphs:
the mean of 20 replays of a CUDA graph of the backward between one pair of events, L2 warm, no host time),
TFLOP/s (2.5x the forward's flops, halved causal) and each round's ratio to the first variant's time in the same
round. Before timing, each variant's dQ / dK / dV against the first's on the same inputs: dK, dV bitwise (one
writer each), dQ within fp32 rounding of the adds' order. --profile: no timing, one backward per variant between
cudaProfilerStart / Stop, in the --variants order, per config. --cycles: each profiled kernel's elapsed cycles
(``gpc__cycles_elapsed.max``) and tensor-pipe share, named in that order, and the ratio to the first variant's.

Measured (H200, Triton 3.6.0, bench/NOTES.md 78): event timings moved by up to 7% between rounds of the same
build, under CUDA graphs too (the clock), while ncu's cycle counts are repeatable; a dQ writer warp (session
38, 6cdbd9d, reverted) read 0.91-1.06x in timed rounds and +4.5% cycles at 8k in ncu.
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fusedattn.backends.gluon import bwd_fused_sm90 as F  # noqa: E402
from fusedattn.bench import do_bench_cold  # noqa: E402
from gluon_fused_sweep import _inputs  # noqa: E402  (this folder is on sys.path when run as a script)
from ncu_raw import CYCLES, TENSOR, kernel_metrics  # noqa: E402

CONFIGS = {  # name: (b, h_q, h_kv, s, d, causal)
    "8k": (2, 16, 16, 8192, 128, False),
    "16kc": (1, 32, 32, 16384, 128, True),
    "gqa4kc": (4, 32, 8, 4096, 128, True),
    "2kc": (4, 32, 32, 2048, 128, True),
    "d64": (8, 12, 12, 1024, 64, False),
    "d64c": (8, 12, 12, 1024, 64, True),
    "d64_4k": (4, 16, 16, 4096, 64, False),
    "d64_4kc": (4, 16, 16, 4096, 64, True),
}
# the module's switches, one at a time (``launch_bwd_fused_sm90``'s keywords; bwd_fused_sm90 "Switches")
VARIANTS = {"default": {}, "dqfirst": dict(dq_first=True), "dqlast": dict(dq_first=False), "stages2": dict(stages=2),
            "stages3": dict(stages=3), "flat": dict(flat=True), "forward": dict(reverse=False),
            "reverse": dict(reverse=True), "grid_order": dict(heavy_first=False), "rotate": dict(rotate=True),
            "segments": dict(segments=True), "per_head": dict(segments=False),
            "kv_smem": dict(kv_regs=False), "frag": dict(flat="frag"),
            "frag_dqfirst": dict(flat="frag", dq_first=True), "swizzled": dict(flat=False),
            "frag_dqlast": dict(flat="frag", dq_first=False)}


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


def cycles(path, configs, names):
    """Print the profiled kernels' elapsed cycles from ncu's raw page, named config by config in --variants order."""
    labels = [(c, n) for c in configs for n in names]
    first = {}
    for (c, n), (cyc, tensor) in zip(labels, kernel_metrics(path, "_attn_bwd_fused", len(labels), (CYCLES, TENSOR))):
        first.setdefault(c, cyc)
        print(f"{c:7s} {n:15s} {cyc / 1e6:8.3f} M cycles  x{first[c] / cyc:.3f} of {names[0]}  tensor {tensor:g}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="8k,16kc,gqa4kc,2kc")
    ap.add_argument("--variants", default="default,dqfirst")
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cycles", metavar="RAW_CSV")
    a = ap.parse_args()
    names = a.variants.split(",")
    if a.cycles:
        return cycles(a.cycles, a.configs.split(","), names)
    print(torch.cuda.get_device_name(), "triton", __import__("triton").__version__, flush=True)
    for cname in a.configs.split(","):
        b, h_q, h_kv, s, d, causal = CONFIGS[cname]
        p, q, k, v, do, out, lse = _inputs(b, h_q, h_kv, s, torch.bfloat16, causal, d)
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
