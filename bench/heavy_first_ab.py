"""Lab A/B (issue 28, BWD_PROFILE.md 7.4 change 2): the Gluon two-pass backward with and without its
longest-first CTA order (``HEAVY_FIRST``), in one process on the same inputs, interleaved rounds.

    python3 bench/heavy_first_ab.py [--configs 2kc,1kc] [--rounds 5] [--reps 20]

Per config and round: ``reps`` backwards (``fusedattn.attention_backward``, the routed path) timed with CUDA
events with the switch off, then on; prints each round's median ms and the median over rounds, TFLOP/s
(bench convention: 2.5 x forward, halved causal) and on / off. Only causal configs that take the two-pass
Gluon kernels (d = 128, fewer than ``functional._FUSED_CAUSAL_MIN_KEYS`` keys) change.

Measured: see bench/NOTES.md (entry of the session that ran it).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import profile_bwd  # noqa: E402

profile_bwd.CONFIGS.setdefault("1kc", (8, 32, 32, 1024, 128, "bf16", True))
profile_bwd.CONFIGS.setdefault("2kc-gqa", (4, 32, 8, 2048, 128, "bf16", True))


def main():
    import torch
    from fusedattn.backends.gluon import bwd_dkdv_sm90, bwd_dq_sm90

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="2kc,1kc,2kc-gqa")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    def switch(on):
        bwd_dq_sm90.HEAVY_FIRST[True] = on
        bwd_dkdv_sm90.HEAVY_FIRST[True] = on

    for name in args.configs.split(","):
        run = profile_bwd._ours(name)
        for on in (False, True):       # compile both builds outside the timing
            switch(on)
            run(), run()
        torch.cuda.synchronize()
        med = {False: [], True: []}
        for r in range(args.rounds):
            for on in (False, True):
                switch(on)
                ms = profile_bwd.event_times(run, args.reps)
                med[on].append(ms[len(ms) // 2])
            print(f"  {name} round {r}: off {med[False][-1]:.4f} ms, on {med[True][-1]:.4f} ms")
        f = profile_bwd.flops(name)
        off, on = sorted(med[False])[args.rounds // 2], sorted(med[True])[args.rounds // 2]
        print(f"{name}: heavy-first off {off:.4f} ms ({f / off / 1e9:.1f} TFLOP/s), on {on:.4f} ms "
              f"({f / on / 1e9:.1f} TFLOP/s): on / off speed {off / on:.3f}x")
        switch(True)
        del run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
