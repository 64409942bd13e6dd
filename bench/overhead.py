"""Where eager time goes on small problems: host time per call vs GPU time, and a cProfile.

    python3 bench/overhead.py [--causal]
Prints, for b8 h12 s1024 d64 fp16: do_bench medians of our forward and backward (as the
bench measures them), the host time to enqueue one call (no sync; a host-bound call
shows host >= GPU) through each layer of the backward (autograd, attention_backward,
_run_backward, the launchers), one launch through the JIT vs the compiled kernel's
launcher, and the top of a cProfile of the autograd backward (bench/NOTES.md 13, 16, 17).
"""
import argparse
import cProfile
import pstats
import time

import torch
import triton

import fusedattn
from fusedattn.backends.triton.bwd import launch_bwd
from fusedattn.functional import _run_backward
from fusedattn.plan import plan
from fusedattn.problem import make_problem


def host_ms(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / n
    torch.cuda.synchronize()
    return host


def launch_cost(q, k, v, causal):
    """Host time of one forward launch through JITFunction (binder, cache key, launcher) vs
    calling the cached compiled kernel's launcher directly with the same arguments."""
    from fusedattn.backends.triton import fwd as fwd_mod
    seen = {}
    jit = fwd_mod._attn_fwd
    orig = jit.run

    def spy(*a, grid, warmup, **kw):
        seen.update(args=a, grid=grid, kw=kw)
        seen["kernel"] = orig(*a, grid=grid, warmup=warmup, **kw)
        return seen["kernel"]
    jit.run = spy
    fwd_mod._FWD.cache.clear()        # else the call launches directly and never reaches jit.run
    fusedattn.attention(q, k, v, causal=causal)
    jit.run = orig
    kern, grid, kw = seen["kernel"], seen["grid"], seen["kw"]
    values = list(seen["args"]) + [kw[n] for n in jit.arg_names[len(seen["args"]):]]
    stream = torch.cuda.current_stream().cuda_stream
    g = tuple(grid) + (1,) * (3 - len(grid))
    via_jit = lambda: jit[grid](*seen["args"], **kw)  # noqa: E731
    direct = lambda: kern.run(g[0], g[1], g[2], stream, kern.function, kern.packed_metadata, None, None, None,  # noqa
                              *values)
    full = lambda: fusedattn.attention(q, k, v, causal=causal)  # noqa: E731
    for name, fn in (("fusedattn.attention", full), ("JIT launch only", via_jit), ("compiled launcher only", direct)):
        print(f"{name:28s} host enqueue {host_ms(fn) * 1e3:7.1f} us", flush=True)


class _NoOp(torch.autograd.Function):
    """The autograd engine's own cost for a Python Function: a backward that launches nothing."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.set_materialize_grads(False)
        ctx.grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        return q.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        return ctx.grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    b, h, s, d = 8, 12, 1024, 64
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.float16).transpose(1, 2).requires_grad_()  # noqa
    q, k, v = mk(), mk(), mk()
    out = fusedattn.attention(q, k, v, causal=args.causal)
    do = torch.randn_like(out)
    fwd = lambda: fusedattn.attention(q.detach(), k.detach(), v.detach(), causal=args.causal)  # noqa
    bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa
    p, extras = make_problem(q.detach(), k.detach(), v.detach(), causal=args.causal)
    pl = plan(p)
    o2, lse = fusedattn.attention_forward(q.detach(), k.detach(), v.detach(), causal=args.causal, return_stats=True)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    kern = lambda: launch_bwd(p, pl, qd, kd, vd, o2, do, lse.squeeze(-1), extras, dq, dk, dv, False)  # noqa
    run_bwd = lambda: _run_backward(p, extras, pl, qd, kd, vd, o2, do, lse[..., 0])  # noqa: E731
    api_bwd = lambda: fusedattn.attention_backward(qd, kd, vd, o2, do, lse, causal=args.causal)  # noqa: E731
    noop_out = _NoOp.apply(q, k, v)
    engine = lambda: torch.autograd.grad(noop_out, (q, k, v), do, retain_graph=True)  # noqa: E731
    print(f"{'autograd engine, no-op bwd':28s} host enqueue {host_ms(engine) * 1e3:7.1f} us", flush=True)
    for name, fn in (("fwd", fwd), ("bwd autograd", bwd), ("bwd attention_backward", api_bwd),
                     ("bwd _run_backward", run_bwd), ("bwd kernels (launch_bwd)", kern)):
        gpu = triton.testing.do_bench(fn, return_mode="median")
        print(f"{name:28s} do_bench {gpu * 1e3:7.1f} us   host enqueue {host_ms(fn) * 1e3:7.1f} us", flush=True)
    launch_cost(q.detach(), k.detach(), v.detach(), args.causal)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        bwd()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
