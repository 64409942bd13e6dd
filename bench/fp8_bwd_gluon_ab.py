"""Lab probe (issue 27): the FP8 backward's routes in one process: the portable kernel, the Gluon single-pass kernel's
FP8 switch on fp16 MMAs (the default) and on FP8 MMAs (``bwd_fused_sm90.FP8_MMA``, [Note] FP8 MMAs; session 32,
compiled only, predicted 1.3-1.5x the fp16-MMA switch: every product at twice the rate, ~10% fewer instructions
per step, no widening copies).

``fusedattn.fp8.sdpa_fp8_backward`` runs the portable Triton kernel's FP8 backward (164-199 TFLOP/s at d=128 on an
H100, bench/NOTES.md 68, against cuDNN frontend's 633-691) unless ``plan.FP8_BWD_GLUON`` routes it to the Gluon
sm_90 single-pass backward's FP8 switch (``bwd_fused_sm90`` [Note] FP8: the emulation's rounding points, fp16
wgmmas on the FP8 values; d = d_v in 64 / 128, no mask or causal). This times each route in one process on
``bench``'s FP8 configs (e4m3 in, e4m3 gradients, the bench's scales and its own forward's O and stats), and
checks that the Gluon routes' gradients agree with the portable kernel's within a few FP8 steps (they round at
the same points; dQ's reduce-adds sum in another order, the FP8 MMAs' sums with ~14 bits):

    PYTHONPATH=$PWD python3 bench/fp8_bwd_gluon_ab.py [--rep MS] [--only NAME,...]

Prediction (session 31, no GPU): 0.75-0.9x our bf16 backward, 2.5-3x the portable kernel's, 0.7-0.85x cuDNN's.
Measured (session 32, H100, TFLOP/s portable -> Gluon on b4 h32 2k causal / b2 h16 8k / b1 h32 16k causal):
Triton 3.6.0 153 -> 198, 196 -> 483, 199 -> 510; Triton 3.9.0 163 -> 243, 196 -> 487, 198 -> 512 (cuDNN
frontend's FP8 backward, same call as 3.6.0: 234 / 690 / 632; our bf16 backward 405 / 588 / 567). The routes'
gradients agree within 0.02-0.04 of max |g| (a few FP8 steps of single elements).
"""
import argparse

import torch
import triton

from fusedattn import bench, plan
from fusedattn.backends.gluon import bwd_fused_sm90

# route -> (plan.FP8_BWD_GLUON, bwd_fused_sm90.FP8_MMA)
ROUTES = {"portable": (False, False), "gluon": (True, False), "gluon-fp8mma": (True, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--only", default="", help="comma-separated substrings of config names")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    print(f"{'config':36s} " + " ".join(f"{r:>13s}" for r in ROUTES) + f" {'max |diff| / max |g| vs portable':>34s}")
    for cfg in bench.fp8_configs():
        if args.only and not any(s in cfg.name for s in args.only.split(",")):
            continue
        if cfg.s_q == 1:
            continue
        inp = bench.make_fp8_inputs(cfg, "cuda")
        make_bwd = bench.prepare_ours_fp8(cfg, True)(inp).make_bwd
        flops = bench.fwd_flops(cfg) * 2.5
        tf, outs = {}, {}
        for route, (gluon, mma8) in ROUTES.items():
            plan.FP8_BWD_GLUON, bwd_fused_sm90.FP8_MMA = gluon, mma8
            try:
                call = make_bwd()
                outs[route] = [x.float() for x in call()[:3]]
                torch.cuda.synchronize()
                tf[route] = flops / triton.testing.do_bench(call, warmup=10, rep=args.rep) / 1e9
            except Exception as e:      # a route that fails is reported, not fatal: the others still time
                print(f"  {route}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        plan.FP8_BWD_GLUON, bwd_fused_sm90.FP8_MMA = True, False
        base = outs.get("portable")
        diffs = [max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(outs[r], base))
                 if base is not None and r in outs else float("nan") for r in ROUTES if r != "portable"]
        print(f"{cfg.name:36s} " + " ".join(f"{tf.get(r, float('nan')):13.1f}" for r in ROUTES)
              + "   " + " / ".join(f"{x:.3g}" for x in diffs), flush=True)


if __name__ == "__main__":
    main()
