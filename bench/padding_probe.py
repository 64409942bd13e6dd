"""Where the padded (per-batch lengths) attention spends its time, pass by pass, on the GPU.

    python3 bench/padding_probe.py

The bench's padding config (b4 h32 s2048 d128 bf16 causal, lengths 2048/1536/1024/512) against the
same problem unpadded: each Gluon pass launched directly (forward, delta, dQ, dK/dV) and the
functional calls, as do_bench medians (eager: host launch cost included) and do_bench_cudagraph
(GPU time only), in ms.
"""
import os
import sys

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fusedattn  # noqa: E402
from fusedattn.backends.gluon import bwd_dkdv_sm90, bwd_dq_sm90, fwd_sm90  # noqa: E402
from fusedattn.backends.triton.bwd import launch_bwd, launch_delta  # noqa: E402
from fusedattn.plan import Plan, plan  # noqa: E402
from fusedattn.problem import make_problem  # noqa: E402


def main():
    b, h, s, d = 4, 32, 2048, 128
    lens = torch.tensor([2048, 1536, 1024, 512], dtype=torch.int32, device="cuda")
    torch.manual_seed(0)
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v, do = mk(), mk(), mk(), mk()
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    for padded in (False, True):
        kw = dict(causal=True)
        if padded:
            kw.update(seq_len_q=lens, seq_len_kv=lens)
        p, extras = make_problem(q, k, v, **kw)
        seq = dict(seq_len_q=extras["seq_len_q"], seq_len_kv=extras["seq_len_kv"])
        out, stats = fusedattn.attention_forward(q, k, v, return_stats=True, **kw)
        lse = stats[..., 0]
        delta = torch.empty(b * h, s, device="cuda")
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        launch_delta(p, out, do, delta)
        pl = plan(p, "triton")
        tri = Plan("triton", pl.fwd, pl.bwd, pl.bwd_dq)
        runs = {
            "fwd gluon": lambda: fwd_sm90.launch_fwd_sm90(p, q, k, v, out, lse, slopes=None, **seq),
            "fwd functional": lambda: fusedattn.attention_forward(q, k, v, return_stats=True, **kw),
            "delta": lambda: launch_delta(p, out, do, delta),
            "dq gluon": lambda: bwd_dq_sm90.launch_dq_sm90(p, q, k, v, do, lse, delta, dq, **seq),
            "dkdv gluon": lambda: bwd_dkdv_sm90.launch_dkdv_sm90(p, q, k, v, do, lse, delta, dk, dv, **seq),
            "bwd functional": lambda: fusedattn.attention_backward(q, k, v, out, do, stats, **kw),
            "bwd triton": lambda: launch_bwd(p, tri, q, k, v, out, do, lse, extras, dq, dk, dv, False),
        }
        for name, fn in runs.items():
            try:
                fn()
                torch.cuda.synchronize()
                eager = do_bench(fn, warmup=25, rep=100)
                graph = do_bench_cudagraph(fn, rep=100)
                print(f"{'padded' if padded else 'unpadded':8s} {name:16s} eager {eager:.4f} ms  graph {graph:.4f} ms")
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{'padded' if padded else 'unpadded':8s} {name:16s} failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
