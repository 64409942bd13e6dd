"""Lab timing (issue 28, bench/BWD_PROFILE.md hypothesis 3 / 6b): the single-pass Gluon backward at d=64.

The d=64 backward runs the portable Triton pair of passes on Hopper (dQ, then dK/dV: 7 matmuls per
(query tile, key tile) pair where the single pass does 5; the dK/dV pass at 214-239 registers). The Gluon
single-pass kernel (``backends/gluon/bwd_fused_sm90.py``) takes its head dim from its descriptors; at d=64
its tiles stay (64 keys per consumer warpgroup, 64-row query tiles), its dQ products become 64x32x16
wgmmas (each warpgroup's 32 columns of dQ) and its shared memory halves (116 KB, 2 stages). No-GPU compile
(tools/gluon_fused_check.py 0 fp16 - d64, Triton 3.6): 168 registers at entry, no spill in its loops.

    PYTHONPATH=$PWD python3 bench/d64_fused.py [--rep MS]

For each config: ``fusedattn.attention_backward`` with ``deterministic=True`` (the Triton pair) and as routed
(plan._GLUON_BWD_DIMS: the single pass at d=64 since session 23) against the single pass
(``launch_bwd_fused_sm90`` with ``out=``: delta and the dQ accumulator's zeroing in one kernel, the fused
kernel, dQ's conversion), CUDA-graph replays and eager calls, TFLOP/s (2.5x the forward's flops, /2
causal), and the single pass's gradients against the pair's (max |difference| / max |reference|).
Prediction (BWD_PROFILE hypothesis 3): 5/7 of the MMA work at the d128 kernel's rate: 340-460 TFLOP/s at
b8 h12 s1024 without a mask against 299 (FA4 372); causal at s1024 is host-bound eagerly (graphs show it).

Measured (H100 80GB HBM3, torch 2.11, Triton 3.6.0, session 23; two runs on two machines), TFLOP/s, CUDA graphs /
eager, single pass with 2 stages (3 under a causal mask read the same within 1%):

    config                  Triton pair        single pass        single / pair (graphs)
    b8 h12 1k               278-283 / 290-293  295 / 282-284      1.04-1.06x
    b8 h12 1k causal        203-207 / 204-205  221-222 / 137-210  1.07-1.10x
    b4 h32 2k causal        266-273 / 276-281  286-293 / 288-291  1.06-1.08x
    b2 h16 8k               335-346 / 336-352  379-386 / 391-393  1.11-1.13x

Below the 340-460 predicted at 1k: at d=64 the softmax-side work per step does not shrink with d, and 128-row
query tiles (FA3's d=64 shape) spill 169 accesses per step in this kernel. Eagerly at 1k the single pass is
host-bound (its ~0.2 ms of GPU work is less than its launches' host time on these machines: 0.23-0.56 ms per
call, run to run), hence plan.GLUON_BWD_FUSED_MIN_WORK (2^28, the 2k causal call's work): from there on it is
the routed backward (the "routed" row of a later run: 1k and 1k causal 1.00x, 2k causal 1.07-1.08x, 8k 1.13x).
The tuning switches at d=64 (``--variants``, graphs): LAG 1.08 / 1.06 / 1.06 / 1.17x the pair against the default's
1.04 / 1.07 / 1.06 / 1.11x (a gain at 8k only, one run: not taken), flat staging 0.97-1.01x, DQ_FIRST, the
grid's order and the forward order within 2%.

Session 43 (H100, 3.6.0, after KV_REGS; bench/NOTES.md 83), ms graph / eager, single pass / pair: 1k 0.2002 /
0.2052 against 0.2286 / 0.2292 (1.14 / 1.12x), 1k causal 0.1354 / 0.1428 against 0.1527 / 0.1588 (1.13 / 1.11x),
2k causal 1.15 / 1.12x, 8k 1.20 / 1.21x: no longer host-bound at 1k, so GLUON_BWD_FUSED_MIN_WORK is 2^25 now.
"""
import argparse

import torch
import triton

# launch_bwd_fused_sm90's tuning switches (its docstring has their d=128 outcomes)
VARIANTS = {"dq_first": dict(dq_first=True), "flat": dict(flat=True), "lag": dict(lag=True),
            "forward": dict(reverse=False), "grid_order": dict(heavy_first=False), "atomic": dict(dq_atomic=True)}
CONFIGS = [(8, 12, 1024, False), (8, 12, 1024, True), (4, 32, 2048, True), (2, 16, 8192, False)]   # d=64 fp16


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    ap.add_argument("--stages", default="2,3", help="the single pass's Q/dO ring depths to time")
    ap.add_argument("--variants", default="", help="launch overrides to time beside (comma-separated: "
                    + ", ".join(VARIANTS) + ")")
    args = ap.parse_args()
    from triton.testing import do_bench, do_bench_cudagraph

    import fusedattn
    from fusedattn.backends.gluon import bwd_fused_sm90 as fused
    from fusedattn.problem import make_problem
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    for b, h, s, causal in CONFIGS:
        d = 64
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
        out, stats = fusedattn.attention_forward(q, k, v, causal=causal, return_stats=True)
        do = torch.randn_like(out)
        lse = stats[..., 0]                       # [b, h, s, 1] -> the kernel's [b, h, s] view
        flops = 4 * b * h * s * s * d * 2.5 / (2 if causal else 1)
        print(f"b{b} h{h} s{s} d{d} fp16 {'causal' if causal else 'no mask'} ({flops / 1e12:.3f} TFLOP per backward)")
        p, _ = make_problem(q, k, v, causal=causal)
        # deterministic: the Triton pair (the single pass reduces dQ with adds in any order); default: the routing
        pair = lambda: fusedattn.attention_backward(q, k, v, out, do, stats, causal=causal,  # noqa: E731
                                                    validate=False, deterministic=True)
        routed = lambda: fusedattn.attention_backward(q, k, v, out, do, stats, causal=causal,  # noqa: E731
                                                      validate=False)
        ref = [x.clone() for x in pair()[:3]]
        rows = [("Triton pair (deterministic)", pair, None), ("attention_backward (routed)", routed, None)]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for st in map(int, args.stages.split(",")):
            rows.append((f"Gluon single pass, {st} stages",
                         lambda st=st: fused.launch_bwd_fused_sm90(p, q, k, v, do, lse, None, dq, dk, dv, out=out,
                                                                   stages=st), st))
        for name in filter(None, args.variants.split(",")):
            rows.append((f"Gluon single pass, {name}",
                         lambda kw=VARIANTS[name]: fused.launch_bwd_fused_sm90(p, q, k, v, do, lse, None, dq, dk, dv,
                                                                               out=out, **kw), 0))
        base = None
        for name, fn, st in rows:
            try:
                if st is not None and not fused.supports(p, q, k, v, do, dq, dk, dv):
                    print(f"  {name:30s} refused by supports()")
                    continue
                got = [x.clone() for x in fn()[:3]]
                torch.cuda.synchronize()
                graph_ms = do_bench_cudagraph(fn, rep=args.rep)
                eager_ms = do_bench(fn, warmup=25, rep=args.rep)
                base = base or graph_ms
                diff = max((x.float() - r.float()).abs().max().item() / max(r.float().abs().max().item(), 1e-6)
                           for x, r in zip(got, ref))
                nan = sum(int(torch.isnan(x).sum()) for x in got)
                print(f"  {name:30s} graph {graph_ms:.4f} ms {flops / graph_ms / 1e9:6.1f} TFLOP/s "
                      f"({base / graph_ms:.3f}x)  eager {eager_ms:.4f} ms {flops / eager_ms / 1e9:6.1f}  "
                      f"max rel diff {diff:.1e}{'  CHECK' if diff > 2e-2 or nan else ''}"
                      f"{f'  NaN {nan}' if nan else ''}",
                      flush=True)
            except Exception as exc:     # a failing variant (compile, launch, capture) is a result
                print(f"  {name:30s} FAILED {type(exc).__name__}: {str(exc).strip()[:200]}", flush=True)


if __name__ == "__main__":
    main()
