"""Where the eager backward's host time goes at d=64 (b8 h12 s1024 fp16): autograd vs the
launchers called directly, and a cProfile of autograd.grad (bench/NOTES.md 16-17).

    python3 bench/overhead_bwd.py [--causal]
"""
import argparse
import cProfile
import pstats

import torch
import triton

import fusedattn
from fusedattn.functional import _run_backward
from fusedattn.backends.triton.bwd import launch_bwd
from fusedattn.plan import plan
from fusedattn.problem import make_problem
from overhead import host_ms     # bench/overhead.py, beside this file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    b, h, s, d = 8, 12, 1024, 64
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.float16).transpose(1, 2).requires_grad_()  # noqa
    q, k, v = mk(), mk(), mk()
    out = fusedattn.attention(q, k, v, causal=args.causal)
    do = torch.randn_like(out)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    p, extras = make_problem(qd, kd, vd, causal=args.causal)
    pl = plan(p)
    o2, lse = fusedattn.attention_forward(qd, kd, vd, causal=args.causal, return_stats=True)
    dq, dk, dv = (torch.empty_like(t) for t in (qd, kd, vd))
    runs = {
        "autograd.grad": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
        "_run_backward": lambda: _run_backward(p, extras, pl, qd, kd, vd, o2, do, lse[..., 0]),
        "launch_bwd": lambda: launch_bwd(p, pl, qd, kd, vd, o2, do, lse[..., 0], extras, dq, dk, dv, False),
        "attention_backward": lambda: fusedattn.attention_backward(qd, kd, vd, o2, do, lse, causal=args.causal),
    }
    for name, fn in runs.items():
        gpu = triton.testing.do_bench(fn, return_mode="median") * 1e3
        print(f"{name:20s} do_bench {gpu:7.1f} us   host enqueue {host_ms(fn) * 1e3:7.1f} us", flush=True)
    for name in ("autograd.grad", "launch_bwd"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            runs[name]()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- cProfile of 200 x {name}")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
