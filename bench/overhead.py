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
    """Host time (ms) to enqueue one call of ``fn``, n calls with no sync between them: host >= the call's GPU
    time means the call is host-bound (also used by bench/prefill_route_probe.py and bench/varlen_probe.py)."""
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
    """Host time of the forward's kernel launch, whichever kernel takes it (Triton or Gluon):
    through our ``Launcher`` (key built, cache hit, direct launch), through the JIT, and the
    compiled kernel's launcher alone with the same arguments; beside the whole call and the
    layers above the launch (make_problem, plan, the Gluon forward's supports)."""
    from fusedattn.backends.triton import launch as launch_mod
    seen = {}
    orig = launch_mod.Launcher.__call__

    def spy(self, key, grid, *args, **kwargs):
        seen.update(launcher=self, key=key, grid=grid, args=args, kwargs=kwargs)
        return orig(self, key, grid, *args, **kwargs)
    launch_mod.Launcher.__call__ = spy
    try:
        fusedattn.attention(q, k, v, causal=causal)
    finally:
        launch_mod.Launcher.__call__ = orig
    launcher, key, grid, args, kwargs = (seen[n] for n in ("launcher", "key", "grid", "args", "kwargs"))
    compiled, tail, device, fast = launcher.cache[key][:4]
    jit_args = [launcher.jit_arg(a) for a in args] if launcher.jit_arg else list(args)
    stream = torch.cuda.current_stream().cuda_stream
    g = tuple(grid) + (1,) * (3 - len(grid))
    p, extras = make_problem(q, k, v, causal=causal)
    steps = [
        ("fusedattn.attention", lambda: fusedattn.attention(q, k, v, causal=causal)),
        ("make_problem", lambda: make_problem(q, k, v, causal=causal)),
        ("plan", lambda: plan(p)),
        ("Launcher (key + direct)", lambda: launcher(key, grid, *args, **kwargs)),
        ("JIT launch", lambda: launcher.kernel[grid](*jit_args, **kwargs)),
        ("torch.empty_like(q)", lambda: torch.empty_like(q)),
    ]
    if hasattr(compiled, "run"):           # Triton's compiled kernel: its own launcher
        steps.insert(-1, ("compiled launcher only", lambda: compiled.run(
            g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)))
    else:                                  # a shipped kernel (backends.prebuilt): its driver launch
        go = compiled.bound(tail)
        steps.insert(-1, ("prebuilt launch only", lambda: go(g[0], g[1], g[2], stream, args)))
    if launcher.jit_arg is not None:       # a Gluon launch: its key is built on every call
        steps.insert(4, ("signature key only", lambda: launch_mod_key(args, kwargs)))
    print(f"forward kernel: {launcher.kernel.fn.__name__}, {len(args)} positional arguments", flush=True)
    if fast is not None and fast is not launch_mod._UNASKED:
        steps.insert(5, ("direct C launch (cached TMA)", lambda: fast(g[0], g[1], g[2], stream, args)))
    try:
        from fusedattn.backends.gluon import fwd_sm90
        from fusedattn.functional import _run_forward
        o = torch.empty_like(q)
        pl = plan(p)
        steps += [("attention_forward", lambda: fusedattn.attention_forward(q, k, v, causal=causal)),
                  ("_run_forward", lambda: _run_forward(p, extras, pl, q, k, v, o, None)),
                  ("gluon supports()", lambda: fwd_sm90.supports(p, q, k, v, o)),
                  ("launch_fwd_sm90", lambda: fwd_sm90.launch_fwd_sm90(p, q, k, v, o, None))]
    except Exception as exc:  # noqa: BLE001 - no Gluon on this Triton
        print(f"(no Gluon forward: {exc})")
    for name, fn in steps:
        print(f"{name:28s} host enqueue {host_ms(fn) * 1e3:7.1f} us", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        fusedattn.attention(q, k, v, causal=causal)
    prof.disable()
    torch.cuda.synchronize()
    print("cProfile of 500 eager forwards (no grad):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def launch_mod_key(args, kwargs):
    from fusedattn.backends.gluon.launch import signature_key
    return signature_key(args, kwargs)


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


def small_training_call(causal):
    """The d=64 anchor as a training step makes it (b8 h12 s1024 d64 fp16, physically BSHD): q, k, v (leaves that
    require grad), out = attention(q, k, v) with its autograd graph, and a gradient do (also used by
    bench/autograd_thread_probe.py)."""
    b, h, s, d = 8, 12, 1024, 64
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.float16).transpose(1, 2).requires_grad_()  # noqa
    q, k, v = mk(), mk(), mk()
    out = fusedattn.attention(q, k, v, causal=causal)
    return q, k, v, out, torch.randn_like(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    q, k, v, out, do = small_training_call(args.causal)
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
    # the host's own speed, to compare runs: pure Python, and one small PyTorch call
    t0 = time.perf_counter()
    total = 0
    for i in range(1_000_000):
        total += i
    print(f"{'host: 1M Python adds':28s} {(time.perf_counter() - t0) * 1e3:7.1f} ms", flush=True)
    noop_out = _NoOp.apply(q, k, v)
    engine = lambda: torch.autograd.grad(noop_out, (q, k, v), do, retain_graph=True)  # noqa: E731
    print(f"{'autograd engine, no-op bwd':28s} host enqueue {host_ms(engine) * 1e3:7.1f} us", flush=True)
    for name, fn in (("fwd", fwd), ("bwd autograd", bwd), ("bwd attention_backward", api_bwd),
                     ("bwd _run_backward", run_bwd), ("bwd kernels (launch_bwd)", kern)):
        gpu = triton.testing.do_bench(fn, return_mode="median")
        print(f"{name:28s} do_bench {gpu * 1e3:7.1f} us   host enqueue {host_ms(fn) * 1e3:7.1f} us", flush=True)
    launch_cost(q.detach(), k.detach(), v.detach(), args.causal)
    # the autograd engine runs a CUDA backward on its device thread, which a profiler of this thread does not
    # see: attention_backward (the same Python below the autograd Function) is profiled here instead
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        api_bwd()
    prof.disable()
    torch.cuda.synchronize()
    print("cProfile of 200 attention_backward calls:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
