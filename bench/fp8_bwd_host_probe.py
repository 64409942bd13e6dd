"""Lab probe (issue 27, bench/NOTES.md 72): why the FP8 backward at b4 h32 2k d128 causal read 134 (Triton 3.6.0)
and 261 (3.9.0) TFLOP/s in ``python -m fusedattn bench --configs fp8 --quick`` but 381 in
``bench/fp8_bwd_gluon_ab.py`` one call before (H200, the same route: the Gluon fused backward on FP8 MMAs).

Both time ``bench.prepare_ours_fp8``'s closure with ``triton.testing.do_bench``; ``bench`` rotates over several
input sets (``n_input_sets``) with its quick options, the A/B times one set with warmup 10 / rep 100. This times
the same closures each way in one process, then the host's side alone (enqueue time of 20 calls with no sync,
against their GPU time), which route ran, and a CPU profile of the call's torch ops:

    PYTHONPATH=$PWD python3 bench/fp8_bwd_host_probe.py [--only s2048] [--cprofile] [--profile]

Measured (session 33, H200, Triton 3.6.0, the shipped store on): 2k causal 198-253 TFLOP/s every way (bench's
rotation quick / full, one set), 20 calls enqueued at 1.37-1.51 ms each against 1.41-1.55 ms with the GPU: host-
bound; 8k 640-644 (host 2.27 ms under 4.3 ms of GPU). cProfile: the shipped kernel's packer generated and
compiled on every call (the FP8 switches' tensors passed by keyword made each call's tail new), ten TMA
descriptors encoded per call. Fixed in ``PrebuiltKernel.bound`` (bench/NOTES.md 72); session 34, store on: 383
TFLOP/s, host 0.60 ms a call; the JIT path (a store miss, ``FUSEDATTN_PREBUILT=0``) 272. Session 35, the JIT path
after the fused backward moved to ``launch.launch`` (bench/NOTES.md 75): 383.5-385.9, host 0.92 ms a call.
"""
import argparse
import time

import torch
import triton
from triton.testing import do_bench

from fusedattn import bench
from fusedattn.backends.gluon import bwd_fused_sm90


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="s2048,s8192", help="comma-separated substrings of config names")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler CPU table per config")
    ap.add_argument("--cprofile", action="store_true", help="print cProfile's cumulative table of 50 calls, and "
                    "the host time of ways to gather 12 one-element scale tensors")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_bwd_host_probe: needs a CUDA GPU (it times the GPU path's host side)")
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    routes = []
    launch = bwd_fused_sm90.launch_bwd_fused_fp8

    def spy(*a, **kw):
        routes.append(kw.get("mma8"))
        return launch(*a, **kw)
    bwd_fused_sm90.launch_bwd_fused_fp8 = spy
    for cfg in bench.fp8_configs():
        if cfg.s_q == 1 or cfg.d != 128 or not any(s in cfg.name for s in args.only.split(",")):
            continue
        first = bench.make_fp8_inputs(cfg, "cuda")
        free, _ = torch.cuda.mem_get_info()
        n = bench.n_input_sets(first.nbytes, free, False)
        sets = [first] + [bench.make_fp8_inputs(cfg, "cuda") for _ in range(n - 1)]
        bind = bench.prepare_ours_fp8(cfg, True)
        fns = [bind(inp).make_bwd() for inp in sets]
        flops = bench.fwd_flops(cfg) * 2.5
        tf = lambda ms: flops / ms / 1e9      # noqa: E731
        routes.clear()
        fns[0]()
        torch.cuda.synchronize()
        print(f"{cfg.name}: {n} input sets; Gluon launches in the first call: {len(routes)} "
              f"(FP8 MMAs: {bwd_fused_sm90.FP8_MMA and bwd_fused_sm90.supports_fp8_mma(*(sets[0].q, sets[0].k, sets[0].v, sets[0].extra['dO']))})",
              flush=True)
        rows = [("bench (rotating, quick)", bench.time_gpu_ms(fns, True, False)),
                ("bench (rotating, full)", bench.time_gpu_ms(fns, False, False)),
                ("one set, warmup 10 rep 100", do_bench(fns[0], warmup=10, rep=100)),
                ("bench (rotating, quick) again", bench.time_gpu_ms(fns, True, False))]
        for what, ms in rows:
            print(f"  {what:32s} {ms:8.3f} ms {tf(ms):7.1f} TFLOP/s", flush=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(20):
            fns[i % n]()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"  host enqueue {1e3 * (t1 - t0) / 20:.3f} ms/call; enqueue + GPU {1e3 * (t2 - t0) / 20:.3f} ms/call",
              flush=True)
        if args.cprofile:
            import cProfile
            import pstats
            torch.cuda.synchronize()
            with cProfile.Profile() as prof:
                for i in range(50):
                    fns[i % n]()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(28)
            scalars = [torch.full((1,), 1.5, device="cuda") for _ in range(12)]
            for what, op in (("torch.cat of 12 one-element tensors", lambda: torch.cat(scalars)),
                             ("12 copy_ into a [12] buffer", lambda: [torch.empty(12, device="cuda")[i:i + 1].copy_(x)
                                                                      for i, x in enumerate(scalars)]),
                             ("torch.stack of 12", lambda: torch.stack(scalars))):
                op()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    op()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                print(f"  {what}: {1e6 * (t1 - t0) / 200:.1f} us host per call", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(5):
                    fns[i % n]()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18), flush=True)
        del fns, sets, first
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
