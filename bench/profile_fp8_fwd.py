"""Lab probe (issue 27): one Gluon FP8 forward and one bf16 forward of the same problem, for Nsight Compute.

The FP8 forward (d=128) reads 0.82-0.88x cuDNN frontend's ``sdpa_fp8`` and only ~1.1x our own bf16 forward
(bench/NOTES.md 69); moving exponentials off MUFU cost time and removing a multiply per score gained ~1.5%,
so the step is bound by neither MUFU nor instruction issue. This runs the ``bench --configs fp8`` problem
(default: b2 h16 s8192 d128, e4m3 in, e4m3 out, the group's scales; ``--causal`` for b1 h32 16k causal) through
the bench's own call, FP8 then bf16 on the same values, each once under ``cudaProfilerStart`` / ``Stop``
after two warm-up calls:

    ncu --profile-from-start off --kernel-name regex:_attn_fwd_sm90 --section ... python3 bench/profile_fp8_fwd.py

``run_device.sh ncu-fp8`` runs it ($OUT/ncu-fp8/: report, details, raw, per-SASS-line source counters). What
to read, FP8 beside bf16: the tensor pipe's active share, issue slots busy, the warp stall reasons, and per
SASS line (``bench/ncu_stalls.py source.csv --waits``) the consumer warps' samples at the ping-pong turn
barrier, at the K / V ready waits and at the wgmma waits (``WARPGROUP.DEPBAR``).

Measured (session 30, H100, Triton 3.6.0, b2 h16 8k d128): FP8 1.30 ms under ncu, Compute (SM) throughput 44%
(bf16: 1.47 ms, 79%), issue slots busy 41% (37%), 0.58 eligible warps per scheduler of 3; stalls barrier 32.5%
(a quarter of all samples are the producer warpgroup's idle warps at the join), wait 19.6%, selected 14.1%,
long scoreboard 10.2%; the consumers' mbarrier waits ~4000 of 147k samples, the load warp's free-slot waits
9840. The consumers are slow through their own step's dependent chains (bench/NOTES.md 69).
"""
import argparse
import torch
import triton

from fusedattn import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--causal", action="store_true", help="the 16k causal config instead of the 8k one")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    cfg = [c for c in bench.fp8_configs() if c.d == 128 and c.causal == args.causal and c.s_q >= 8192][0]
    inp = bench.make_fp8_inputs(cfg, "cuda")
    fp8_call = bench.prepare_ours_fp8(cfg, False)(inp).fwd
    bf16_call = bench.prepare_ours_bf16(cfg, False)(inp).fwd
    for name, call in (("fp8", fp8_call), ("bf16", bf16_call)):
        for _ in range(2):      # the first call loads the shipped kernel (or compiles it)
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda.nvtx.range_push(f"{name} {cfg.name}")
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled: {name} {cfg.name}", flush=True)


if __name__ == "__main__":
    main()
