"""Where the eager d=64 backward's host time goes under autograd (issue 28's d=64 rows, bench/NOTES.md 87).

    python3 bench/autograd_thread_probe.py [--causal]

bench/overhead.py showed (H100, Triton 3.6.0, b8 h12 s1024 d64 fp16) the autograd backward at 608 us of host
time per call against 203 us for ``attention_backward`` on the main thread and 90 us for the autograd engine
with a no-op Function: ~300 us unexplained. The engine runs a CUDA backward on its own device thread, which a
profiler of the main thread does not see. This times, per call:
  * ``torch.autograd.grad`` as the bench calls it (host enqueue, no sync);
  * ``_Attention.backward``'s body and the ``_run_backward`` inside it, timed from inside (the device thread);
  * ``_run_backward`` on the main thread and on another Python thread (the same arguments);
and prints a cProfile of the backward body made on the device thread.
"""
import argparse
import cProfile
import io
import pstats
import threading
import time

import torch

import fusedattn
from fusedattn import functional
from overhead import host_ms, small_training_call    # bench/overhead.py: host time per call, the d=64 call

N = 200


def host_us(fn, n=N):
    """Host time per call (us) of n calls with no sync between them."""
    return host_ms(fn, n) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    q, k, v, out, do = small_training_call(args.causal)
    grad = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731

    original = functional._Attention.backward
    spent = {"body": 0.0, "run": 0.0, "calls": 0, "thread": None}
    prof = cProfile.Profile()
    profiling = [False]
    run_original = functional._run_backward

    def timed_run(*a, **kw):
        t0 = time.perf_counter()
        try:
            return run_original(*a, **kw)
        finally:
            spent["run"] += time.perf_counter() - t0

    def timed_backward(ctx, *grads):
        t0 = time.perf_counter()
        if profiling[0]:
            prof.enable()
        try:
            return original(ctx, *grads)
        finally:
            if profiling[0]:
                prof.disable()
            spent["body"] += time.perf_counter() - t0
            spent["calls"] += 1
            spent["thread"] = threading.current_thread().name

    functional._Attention.backward = staticmethod(timed_backward)
    functional._run_backward = timed_run
    try:
        for _ in range(3):      # compiles (a process without the shipped kernels) stay out of the body's average
            grad()
        torch.cuda.synchronize()
        spent.update(body=0.0, run=0.0, calls=0)
        whole = host_us(grad)
        calls = spent["calls"]
        print(f"autograd.grad (as the bench)        host {whole:7.1f} us per call, on thread {spent['thread']!r}")
        print(f"  _Attention.backward body          {spent['body'] * 1e6 / calls:7.1f} us per call")
        print(f"  _run_backward inside it           {spent['run'] * 1e6 / calls:7.1f} us per call")
        profiling[0] = True
        for _ in range(N):
            grad()
        torch.cuda.synchronize()
        profiling[0] = False
    finally:
        functional._Attention.backward = staticmethod(original)
        functional._run_backward = run_original

    ctx_problem = []
    o2, lse = fusedattn.attention_forward(q.detach(), k.detach(), v.detach(), causal=args.causal, return_stats=True,
                                          _keep_problem=ctx_problem)
    p, extras, pl = ctx_problem
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    run = lambda: functional._run_backward(p, extras, pl, qd, kd, vd, o2, do, lse[..., 0])  # noqa: E731
    print(f"_run_backward, main thread          host {host_us(run):7.1f} us per call")
    result = {}
    worker = threading.Thread(target=lambda: result.update(us=host_us(run)))
    worker.start()
    worker.join()
    print(f"_run_backward, another thread       host {result['us']:7.1f} us per call")
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(f"cProfile of {N} backward bodies on the autograd device thread:\n{text.getvalue()}")


if __name__ == "__main__":
    main()
