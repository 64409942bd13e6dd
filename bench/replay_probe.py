"""Issue 28's eager d=64 backward with launch replays (``fusedattn.backends.replay``) off and on, interleaved in one
process (bench/NOTES.md 90).

    python3 bench/replay_probe.py [--rounds 5]

The anchors' eager d=64 backward is host-bound, and its host time moves from run to run on the GPU machine (the
same build read 123 and 191 TFLOP/s in two processes of one call), so replays off and on are compared in rounds,
alternating, in one process. For each d=64 anchor (b8 h12 s1024 fp16, plain and causal), per round and setting:
  * host: us to enqueue one ``torch.autograd.grad`` (200 calls, no sync; bench/overhead.py's host_ms);
  * body: us of ``_Attention.backward`` on autograd's device thread, timed from inside;
  * bench: the bench's eager backward time (``bench.do_bench_cold``: each call after an L2 flush) and its TFLOP/s;
then the medians over the rounds.
"""
import argparse
import statistics
import time

import torch

from fusedattn import bench, functional
from fusedattn.backends import replay
from overhead import host_ms, small_training_call    # bench/overhead.py


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
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
            q, k, v, out, do = small_training_call(causal)
            grad = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
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
                    rows[on].append((host, body, ms))
                    print(f"{'causal' if causal else 'plain '} round {r} replay {'on ' if on else 'off'}: host "
                          f"{host:6.1f} us, body {body:6.1f} us, bench {ms * 1e3:6.1f} us = "
                          f"{flops / ms / 1e9:5.0f} TFLOP/s", flush=True)
            for on in (False, True):
                host, body, ms = (statistics.median(x[i] for x in rows[on]) for i in range(3))
                print(f"{'causal' if causal else 'plain '} median replay {'on ' if on else 'off'}: host {host:6.1f} us, "
                      f"body {body:6.1f} us, bench {ms * 1e3:6.1f} us = {flops / ms / 1e9:5.0f} TFLOP/s")
    finally:
        functional._Attention.backward = staticmethod(original)
        replay.ENABLED = True


if __name__ == "__main__":
    main()
