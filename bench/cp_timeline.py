"""SIMULATED timeline of fusedattn.distributed's ring (issue 29), from single-GPU kernel times and published
NVLink bandwidth figures. Nothing here runs on several GPUs: no machine with several GPUs was lent when it
was written, so this is what the overlap should look like, to be checked against a real run.

    python bench/cp_timeline.py                  # the table of bench/NOTES.md's entry (H100, 370 GB/s)
    python bench/cp_timeline.py --bw 180 --latency-us 30

Model (per rank, per ring step; the calls are fusedattn.distributed.block_plan's own, so the causal work
per step is what the code runs):
* kernel time of a call = its FLOPs / TFLOP/s measured on one H100 for a problem of that length
  (``KERNEL_TFLOPS``, bench/NOTES.md; log-interpolated between measured lengths, clamped outside them);
* merge / accumulate time = the bytes the torch ops of ring.py move / 3.0 TB/s (the copy ceiling in the
  NOTES header): merge_partial ~26 bytes per fp32 output element, dq/dk/dv accumulation ~10 bytes;
* transfer time = bytes / bandwidth + latency: forward K/V in bf16 each step; backward K/V (bf16) and the
  travelling dK/dV accumulator (fp32, as ring.py keeps it) each step, plus the accumulator's last hop home;
* the ring is simulated event by event: a step starts when the rank's previous compute is done and both its
  receive (from rank - 1) and its send (to rank + 1) of that step have completed (ring.py waits on both).
"Comm not hidden" = (T - T with free communication) / T, so load imbalance is not counted as communication.
Per-GPU TFLOP/s counts the useful FLOPs of the whole problem (causal: half) / W / T, forward 4*s^2*h*d,
backward 2.5x forward, as bench/NOTES.md counts.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fusedattn.distributed import block_plan, num_chunks  # noqa: E402

# Measured on one H100 (bench/NOTES.md, d128 bf16, Gluon kernels): (sequence length, TFLOP/s)
KERNEL_TFLOPS = {
    # causal forward: b4 h32 2k 543 (entry 51's table, H100, Triton 3.6.0); b1 h32 16k 673 (entry 38)
    ("fwd", True): [(2048, 543.0), (16384, 673.0)],
    # causal backward: 2k 396 (entry 51, H100, 3.6.0); 16k 505 (entry 40, anchors run)
    ("bwd", True): [(2048, 396.0), (16384, 505.0)],
    # no mask: b2 h16 8k forward 713, backward 588 (entry 51, H100, 3.6.0); one length measured
    ("fwd", False): [(8192, 713.0)],
    ("bwd", False): [(8192, 588.0)],
}
COPY_TBS = 3.0                  # device copy ceiling, bench/NOTES.md header (TB/s, read + write)
MERGE_BYTES_PER_ELEM = 26       # merge_partial as torch ops: mul_, exp, cast, mul, add_ over fp32 [.., n, d_v]
ACC_BYTES_PER_ELEM = 10         # dq_acc += dq_b (fp32 read + write, bf16 read); the same for dk / dv

# Published, not measured here: HGX H100 SXM, NVLink 4 through NVSwitch, one GPU pair at a time.
# p2pBandwidthLatencyTest: ~376-380 GB/s unidirectional, ~742-749 GB/s bidirectional per pair out of
# 450 / 900 GB/s theoretical (github.com/NVIDIA/nccl/issues/1264). nccl-tests sendrecv_perf on two NVLinked
# H100s plateaued at ~180 GB/s in one report (github.com/NVIDIA/nccl-tests/issues/268): the pessimistic case.
BW_GBS = {"p2p (nccl#1264)": 370.0, "sendrecv (nccl-tests#268)": 180.0}


def kernel_tflops(pass_, causal, length):
    pts = KERNEL_TFLOPS[(pass_, causal)]
    if length <= pts[0][0]:
        return pts[0][1]
    if length >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= length <= x1:
            t = (math.log(length) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    raise AssertionError(length)


def call_flops(n, m, mask, h, d):
    """Useful forward FLOPs of one call: 4*n*m*h*d, causal-diagonal (square) halved."""
    f = 4.0 * n * m * h * d
    return f / 2 if mask is not None else f


def step_compute(world, rank, src, layout, causal, L, h, d, pass_):
    """Seconds of kernels + merge / accumulation of one ring step on ``rank`` (pass_ 'fwd' or 'bwd')."""
    t = 0.0
    for q0, q1, k0, k1, mask in block_plan(world, rank, src, layout, causal, L):
        n, m = q1 - q0, k1 - k0
        diag = mask is not None
        fl = call_flops(n, m, mask, h, d) * (2.5 if pass_ == "bwd" else 1.0)
        t += fl / (kernel_tflops(pass_, diag, n if diag else m) * 1e12)
        if pass_ == "fwd":
            t += MERGE_BYTES_PER_ELEM * n * h * d / (COPY_TBS * 1e12)
        else:
            t += ACC_BYTES_PER_ELEM * (n * h * d + 2 * m * h * d) / (COPY_TBS * 1e12)
    return t


def simulate(world, S, layout, causal, h, h_kv, d, bw, lat, pass_, free_comm=False):
    """Wall time (s) of one pass over the ring, every rank in lock-step by its exchanges."""
    L = S // world
    comp = [[step_compute(world, r, (r - s) % world, layout, causal, L, h, d, pass_) for s in range(world)]
            for r in range(world)]
    kv_bytes = 2 * L * h_kv * d * 2                        # K and V, bf16
    dkv_bytes = 2 * L * h_kv * d * 4                       # the travelling fp32 accumulator
    xfer = 0.0 if free_comm else kv_bytes / (bw * 1e9) + lat
    xfer_dkv = 0.0 if free_comm else dkv_bytes / (bw * 1e9) + lat
    start = [0.0] * world
    dkv_post = [None] * world          # when each rank posted its accumulator for the next hop
    dkv_done = [0.0] * world           # when the hop into each rank completed
    for s in range(world):
        done = [start[r] + comp[r][s] for r in range(world)]
        if pass_ == "bwd":
            if s > 0:   # the accumulator of this block must have arrived before adding this step's grads
                done = [max(done[r], dkv_done[r], dkv_done[(r + 1) % world]) for r in range(world)]
            dkv_post = done[:]
            dkv_done = [max(dkv_post[r], dkv_post[(r - 1) % world]) + xfer_dkv for r in range(world)]
        if s + 1 < world:
            kv_in = [max(start[r], start[(r - 1) % world]) + xfer for r in range(world)]
            start = [max(done[r], kv_in[r], kv_in[(r + 1) % world]) for r in range(world)]
        else:
            start = done
    end = max(start)
    if pass_ == "bwd" and world > 1:                       # the last hop home cannot overlap anything
        end = max(end, max(dkv_done))
    return end


def one_gpu_time(S, causal, h, d, pass_):
    fl = 4.0 * S * S * h * d * (0.5 if causal else 1.0) * (2.5 if pass_ == "bwd" else 1.0)
    return fl / (kernel_tflops(pass_, causal, S) * 1e12), fl


def row(S, W, layout, causal, h, h_kv, d, bw, lat):
    out = {}
    for name, passes in (("fwd", ("fwd",)), ("fwd+bwd", ("fwd", "bwd"))):
        t = sum(simulate(W, S, layout, causal, h, h_kv, d, bw, lat, p) for p in passes)
        t0 = sum(simulate(W, S, layout, causal, h, h_kv, d, bw, lat, p, free_comm=True) for p in passes)
        one = [one_gpu_time(S, causal, h, d, p) for p in passes]
        flops = sum(f for _, f in one)
        out[name] = (flops / W / t / 1e12, (t - t0) / t, flops / sum(x for x, _ in one) / 1e12)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bw", type=float, default=None, help="GB/s per direction (default: both BW_GBS figures)")
    ap.add_argument("--latency-us", type=float, default=20.0, help="per exchange (assumed, not measured)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 256, 512, 1024], help="sequence lengths, in k")
    ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    bws = {f"{args.bw:g} GB/s": args.bw} if args.bw else BW_GBS
    h, h_kv, d, lat = args.heads, args.kv_heads, args.head_dim, args.latency_us * 1e-6
    print(f"SIMULATED (not measured): h {h}/{h_kv} d {d} bf16, batch 1, latency {args.latency_us:g} us/exchange")
    for label, bw in bws.items():
        print(f"\n### K/V bandwidth {bw:g} GB/s per direction ({label})\n")
        print("| tokens | GPUs | layout | mask | fwd TFLOP/s/GPU | fwd comm not hidden | fwd+bwd TFLOP/s/GPU | "
              "fwd+bwd comm not hidden | fwd+bwd vs 1 GPU |")
        print("|---|---|---|---|---|---|---|---|---|")
        for S in (t * 1024 for t in args.tokens):
            for W in args.gpus:
                for layout, causal in (("zigzag", True), ("contiguous", True), ("zigzag", False)):
                    if S % num_chunks(W, layout):
                        continue
                    r = row(S, W, layout, causal, h, h_kv, d, bw, lat)
                    f, fb = r["fwd"], r["fwd+bwd"]
                    print(f"| {S // 1024}k | {W} | {layout} | {'causal' if causal else 'none'} | {f[0]:.0f} | "
                          f"{f[1]:.1%} | {fb[0]:.0f} | {fb[1]:.1%} | {fb[0] / fb[2]:.2f} |")
        one = row(128 * 1024, 8, "zigzag", True, h, h_kv, d, bw, lat)["fwd+bwd"]
        print(f"\ntarget (issue 29): 128k, 8 GPUs, causal, zigzag, fwd+bwd >= 0.9 x one GPU's {one[2]:.0f} = "
              f"{0.9 * one[2]:.0f} TFLOP/s per GPU: simulated {one[0]:.0f} ({one[0] / one[2]:.2f}x)")


if __name__ == "__main__":
    main()
