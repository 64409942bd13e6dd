"""One launch of the single-pass backward kernel to profile with Nsight Compute (after one warm-up call).

    ncu --clock-control none --kernel-name regex:_attn_bwd_fused --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        --section WarpStateStats python3 bench/profile_fused.py [b h s] [--no-causal]
Default: the 16k causal anchor (b1 h32 s16384 d128 bf16), the d128 fwd+bwd row furthest behind cuDNN
(bench/NOTES.md 47). Run with ``run_device.sh ncu-fused``.
"""
import sys

import torch

import fusedattn
from fusedattn.backends.gluon import bwd_fused_sm90 as fused
from fusedattn.problem import make_problem


def main():
    sizes = [int(a) for a in sys.argv[1:] if a.isdigit()]
    b, h, s = sizes if len(sizes) == 3 else (1, 32, 16384)
    causal = "--no-causal" not in sys.argv
    torch.manual_seed(0)
    mk = lambda: torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v, do = mk(), mk(), mk(), mk()
    out, stats = fusedattn.attention_forward(q, k, v, causal=causal, return_stats=True)
    p, _ = make_problem(q, k, v, causal=causal)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for _ in range(2):        # the first compiles; ncu skips it (--launch-skip 1)
        fused.launch_bwd_fused_sm90(p, q, k, v, do, stats[..., 0], None, dq, dk, dv, out=out)
    torch.cuda.synchronize()
    print(f"profiled: b{b} h{h} s{s} d128 bf16 causal={causal}")


if __name__ == "__main__":
    main()
