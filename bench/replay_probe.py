"""Issue 28's eager d=64 backward and forward with launch replays (``fusedattn.backends.replay``) off and on,
interleaved in one process (bench/NOTES.md 90, 91).

    python3 bench/replay_probe.py [--rounds 5] [--parts] [--shape B,H,S]

The anchors' eager d=64 backward is host-bound, and its host time moves from run to run on the GPU machine (the
same code read 123 and 191 TFLOP/s in two processes), so replays off and on are compared in rounds,
alternating, in one process. For the d=64 anchor (b8 h12 s1024 fp16; ``--shape`` another), plain and causal, per
round and setting:
  * host: us to enqueue one ``torch.autograd.grad`` (200 calls, no sync; bench/overhead.py's host_ms);
  * body: us of ``_Attention.backward`` on autograd's device thread, timed from inside;
  * bench: the bench's eager backward time (``bench.do_bench_cold``: each call after an L2 flush) and its TFLOP/s;
  * fwd: the bench's eager forward time (under no_grad) of the same problem and its host time per call (session
    51: the forward is replayed too, ``functional._forward_replays``; before, two processes of session 50's call 1
    read it at 148 and 389 TFLOP/s);
then the medians over the rounds. ``--parts``: the replayed backward's host time split into its parts, each timed
alone on the main thread (us per call, 300 calls: fewer launches than the launch queue holds, so a launch times
the host): the key, the replay's checks, its allocations, each launch's argument tuple and driver launch.
"""
import argparse
import statistics
import time

import torch

import fusedattn
from fusedattn import bench, functional
from fusedattn.backends import replay
from overhead import host_ms    # bench/overhead.py


def training_call(shape, causal):
    """q, k, v (BSHD memory, leaves that require grad), out = attention(q, k, v) with its autograd graph, and a
    gradient do, for shape (b, h, s) at d=64 fp16 (bench/overhead.py's small_training_call at any size)."""
    b, h, s = shape
    mk = lambda: torch.randn(b, s, h, 64, device="cuda", dtype=torch.float16).transpose(1, 2).requires_grad_()  # noqa
    q, k, v = mk(), mk(), mk()
    out = fusedattn.attention(q, k, v, causal=causal)
    return q, k, v, out, torch.randn_like(out)


def parts(shape, causal: bool) -> None:
    """The replayed backward's parts, timed alone (see the module docstring)."""
    from fusedattn.backends.triton import launch
    from fusedattn.backends import compat
    functional._backward_replays.clear()
    q, k, v, out, do = training_call(shape, causal)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    made = [r for r in functional._backward_replays.values() if r is not None]
    assert len(made) == 1, "no replay was made"
    rep = made[0]
    q_, k_, v_ = (t.detach() for t in (q, k, v))
    ctx_problem = []
    o2, st = fusedattn.attention_forward(q_, k_, v_, causal=causal, return_stats=True, _keep_problem=ctx_problem)
    p, extras, pl = ctx_problem
    lse = st[..., 0]
    roles_in = (q_, k_, v_, o2, do, st)
    roles = roles_in + rep.make(*roles_in)
    device = rep.device
    rows = [("whole replay (checks, allocations, 3 launches)", lambda: rep(*roles_in)),
            ("key (_replay_key)", lambda: functional._replay_key(p, pl, False, q_, k_, v_, o2, do, st)),
            ("key lookup", lambda: functional._backward_replays.get(
                functional._replay_key(p, pl, False, q_, k_, v_, o2, do, st))),
            ("stats[..., 0] view", lambda: st[..., 0]),
            ("allocations (make)", lambda: rep.make(*roles_in)),
            ("  one empty_like", lambda: torch.empty_like(q_)),
            ("checks: _current_device", launch._current_device),
            ("checks: _no_launch_hooks", launch._no_launch_hooks),
            ("ensure_context", lambda: compat.ensure_context(device)),
            ("raw stream", lambda: launch._current_raw_stream(device))]
    stream = launch._current_raw_stream(device)
    for i, (launcher, go, gx, gy, gz, args_of) in enumerate(rep.steps):
        name = getattr(getattr(launcher.kernel, "fn", None), "__name__", str(launcher.kernel))
        args = args_of(roles)
        rows.append((f"step {i} {name}: arguments", lambda args_of=args_of: args_of(roles)))
        rows.append((f"step {i} {name}: launch", lambda go=go, g=(gx, gy, gz), args=args: go(*g, stream, args)))
    for name, fn in rows:
        print(f"{'causal' if causal else 'plain '} {name:55s} {host_ms(fn, 300) * 1e3:7.2f} us", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--shape", type=lambda text: tuple(int(x) for x in text.split(",")), default=(8, 12, 1024),
                    metavar="B,H,S", help="the problem (d=64 fp16; default the anchor's 8,12,1024)")
    args = ap.parse_args()
    if args.parts:
        for causal in (False, True):
            parts(args.shape, causal)
        return
    original = functional._Attention.backward
    spent = {"body": 0.0, "calls": 0}

    def timed_backward(ctx, *grads):
        t0 = time.perf_counter()
        try:
            return original(ctx, *grads)
        finally:
            spent["body"] += time.perf_counter() - t0
            spent["calls"] += 1

    functional._Attention.backward = staticmethod(timed_backward)
    try:
        for causal in (False, True):
            q, k, v, out, do = training_call(args.shape, causal)
            grad = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            fwd = lambda: fusedattn.attention(qd, kd, vd, causal=causal)  # noqa: E731
            flops = 2.5 * 4 * q.shape[0] * q.shape[1] * q.shape[2] ** 2 * q.shape[3] / (2 if causal else 1)
            rows = {False: [], True: []}
            for r in range(args.rounds):
                for on in (False, True):
                    replay.ENABLED = on
                    replay.clear_all()
                    for _ in range(3):
                        grad()          # the replay is made on a key's second call
                    torch.cuda.synchronize()
                    spent.update(body=0.0, calls=0)
                    host = host_ms(grad) * 1e3
                    body = spent["body"] * 1e6 / max(spent["calls"], 1)
                    ms = bench.do_bench_cold(grad, warmup=25, rep=100)
                    with torch.no_grad():
                        fwd_ms = bench.do_bench_cold(fwd, warmup=25, rep=100)
                        fwd_host = host_ms(fwd) * 1e3
                    rows[on].append((host, body, ms, fwd_ms, fwd_host))
                    print(f"{'causal' if causal else 'plain '} round {r} replay {'on ' if on else 'off'}: host "
                          f"{host:6.1f} us, body {body:6.1f} us, bench {ms * 1e3:6.1f} us = "
                          f"{flops / ms / 1e9:5.0f} TFLOP/s; fwd {flops / 2.5 / fwd_ms / 1e9:5.0f} TFLOP/s, "
                          f"host {fwd_host:5.1f} us", flush=True)
            for on in (False, True):
                host, body, ms, fwd_ms, fwd_host = (statistics.median(x[i] for x in rows[on]) for i in range(5))
                print(f"{'causal' if causal else 'plain '} median replay {'on ' if on else 'off'}: host {host:6.1f} us, "
                      f"body {body:6.1f} us, bench {ms * 1e3:6.1f} us = {flops / ms / 1e9:5.0f} TFLOP/s; fwd "
                      f"{flops / 2.5 / fwd_ms / 1e9:5.0f} TFLOP/s, host {fwd_host:5.1f} us")
    finally:
        functional._Attention.backward = staticmethod(original)
        replay.ENABLED = True


if __name__ == "__main__":
    main()
