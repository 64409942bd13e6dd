"""Lab probe (issue 27): the FP8 forward at d = 224 / 256 on the Gluon 16-bit kernel (fwd_sm90 [Note] FP8 on
16-bit MMAs) with every product fp16 on widened q, k, v (``FP8_16_QK = False``, the default until session 33) against QK^T an FP8
wgmma on q and k as they are, V alone widened (``FP8_16_QK = True``, the default since). Times both in one process on ``bench``'s
FP8 configs at those head dims (e4m3 in and out, the bench's scales) and checks that the two outputs agree
within a few e4m3 steps (they round P at the same points; QK^T's sums differ by the FP8 MMA's 14-bit alignment):

    PYTHONPATH=$PWD python3 bench/fp8_16_qk_ab.py [--rep MS]

Prediction (session 32, static only: 8 QGMMA + 4 HGMMA per step, loops 387-523 SASS instructions against
418-568): QK^T at twice the rate and two of three widening copies gone, so 1.2-1.4x the default's 486-517
TFLOP/s (H100, 3.6.0), 0.65-0.8x cuDNN frontend's FP8 forward (912-927). Measured (session 33, H200, 3.6.0):
d256 causal 543 -> 685, d224 501 -> 636 (1.26-1.27x); outputs within 0.025-0.031 of max |o|.
"""
import argparse

import torch
import triton

from fusedattn import bench
from fusedattn.backends.gluon import fwd_sm90


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    print(f"{'config':40s} {'fp16 QK':>8s} {'fp8 QK':>8s} {'ratio':>6s} {'max |diff| / max |o|':>22s}")
    for cfg in bench.fp8_configs():
        if cfg.d not in fwd_sm90.FP8_16_DIMS or cfg.s_q == 1:
            continue
        inp = bench.make_fp8_inputs(cfg, "cuda")
        fwd = bench.prepare_ours_fp8(cfg, False)(inp).fwd
        flops = bench.fwd_flops(cfg)
        tf, outs = {}, {}
        for qk in (False, True):
            fwd_sm90.FP8_16_QK = qk
            outs[qk] = fwd().float()
            torch.cuda.synchronize()
            tf[qk] = flops / triton.testing.do_bench(fwd, warmup=10, rep=args.rep) / 1e9
        fwd_sm90.FP8_16_QK = False
        diff = ((outs[True] - outs[False]).abs().max() / outs[False].abs().max().clamp_min(1e-30)).item()
        print(f"{cfg.name:40s} {tf[False]:8.1f} {tf[True]:8.1f} {tf[True] / tf[False]:6.2f} {diff:22.3g}", flush=True)


if __name__ == "__main__":
    main()
