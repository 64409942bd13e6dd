"""Where the padded (per-batch lengths) attention spends its time, pass by pass, on the GPU.

    python3 bench/padding_probe.py [--profile] [--split]

The bench's padding config (b4 h32 s2048 d128 bf16 causal, lengths 2048/1536/1024/512) against the
same problem unpadded: each Gluon pass launched directly (forward, delta, dQ, dK/dV) and the
functional calls, as do_bench medians (eager: host launch cost included) and do_bench_cudagraph
(GPU time only), in ms. --profile: also the host time to enqueue one padded functional forward and
backward (no sync; a call is host-bound when this exceeds its GPU time) and the top of a cProfile of each.
--split: the padded call against the same sequences run one by one unpadded (b1, s = each length): the
time a padded call would take if padding cost nothing beyond the shorter sequences themselves. (Under
graph capture the causal and padded forwards take the one-tile grid, fwd_sm90._tile_counter: the
forward columns compare one-tile grids.)
"""
import cProfile
import os
import pstats
import sys
import time

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


def host_profile():
    """Host ms per enqueued call and the cProfile top of the padded functional forward and backward."""
    b, h, s, d = 4, 32, 2048, 128
    lens = torch.tensor([2048, 1536, 1024, 512], dtype=torch.int32, device="cuda")
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    q, k, v, do = mk(), mk(), mk(), mk()
    kw = dict(causal=True, seq_len_q=lens, seq_len_kv=lens)
    out, stats = fusedattn.attention_forward(q, k, v, return_stats=True, **kw)
    calls = {"fwd": lambda: fusedattn.attention_forward(q, k, v, return_stats=True, **kw),
             "bwd": lambda: fusedattn.attention_backward(q, k, v, out, do, stats, deterministic=True, **kw)}
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) * 1e3 / n
        torch.cuda.synchronize()
        print(f"padded {name} host {host:.4f} ms per enqueued call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def split_lengths():
    """CUDA-graph ms of the padded functional forward / backward against the sum over its sequences
    of the unpadded calls at each sequence's own length (b = 1), and the TFLOP/s of each."""
    b, h, s, d = 4, 32, 2048, 128
    lens = [2048, 1536, 1024, 512]
    torch.manual_seed(0)

    def calls(q, k, v, do, **kw):
        out, stats = fusedattn.attention_forward(q, k, v, return_stats=True, **kw)
        return (lambda: fusedattn.attention_forward(q, k, v, return_stats=True, **kw),
                lambda: fusedattn.attention_backward(q, k, v, out, do, stats, **kw))

    def timed(fwd, bwd):
        fwd(), bwd()
        torch.cuda.synchronize()
        return do_bench_cudagraph(fwd, rep=100), do_bench_cudagraph(bwd, rep=100)

    mk = lambda n, L: torch.randn(n, L, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    flops = sum(4 * h * L * L * d / 2 for L in lens)
    t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    pf, pb = timed(*calls(mk(b, s), mk(b, s), mk(b, s), mk(b, s), causal=True, seq_len_q=t, seq_len_kv=t))
    sf = sb = 0.0
    for L in lens:
        f, bw = timed(*calls(mk(1, L), mk(1, L), mk(1, L), mk(1, L), causal=True))
        print(f"split    s={L:5d} fwd {f:.4f} ms ({4 * h * L * L * d / 2 / f * 1e-9:.0f})  "
              f"bwd {bw:.4f} ms ({2.5 * 4 * h * L * L * d / 2 / bw * 1e-9:.0f})")
        sf, sb = sf + f, sb + bw
    full_f, full_b = timed(*calls(mk(b, s), mk(b, s), mk(b, s), mk(b, s), causal=True))
    full = 4 * b * h * s * s * d / 2
    for name, pt, st, ft, k in (("fwd", pf, sf, full_f, 1.0), ("bwd", pb, sb, full_b, 2.5)):
        print(f"{name}: padded {pt:.4f} ms ({k * flops / pt * 1e-9:.0f}), one by one {st:.4f} ms "
              f"({k * flops / st * 1e-9:.0f}), unpadded full s {ft:.4f} ms ({k * full / ft * 1e-9:.0f}); "
              f"padded / full {k * flops / pt / (k * full / ft):.2f}, one by one / full "
              f"{k * flops / st / (k * full / ft):.2f}")


if __name__ == "__main__":
    if "--split" in sys.argv:
        split_lengths()
    else:
        main()
    if "--profile" in sys.argv:
        host_profile()
