"""Command line: ``fusedattn demo`` and ``fusedattn bench [...]`` (also ``python -m fusedattn ...``).

``demo`` runs the seeds' basic, causal, GQA and BSHD examples on the best device
present, checks each against PyTorch and prints a small table of results and
times. ``bench`` times fusedattn beside every attention importable in the same
process (``fusedattn bench --help`` lists its options).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = """usage: fusedattn {demo,bench,warmup} [options]

  demo     run the seeds' examples (basic, causal, GQA, BSHD), check them against
           torch.nn.functional.scaled_dot_product_attention, print a table
  bench    time fusedattn beside PyTorch SDPA backends, FlexAttention, cuDNN frontend
           and FlashAttention-4 (see: fusedattn bench --help)
  warmup   compile the kernels of the common configurations into Triton's cache, side by side,
           so no later process stalls on its first call (warmup [anchors masked decode prefill fp8]);
           --record DIR also writes every compiled kernel to a store under DIR (fusedattn/prebuilt's format)
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch to the demo or the benchmark; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    # Imported lazily: each pulls in torch (and the bench, triton), which --help should not wait for.
    if command == "demo":
        from fusedattn import demo
        return demo.main(rest)
    if command == "bench":
        from fusedattn import bench
        return bench.main(rest)
    if command == "warmup":
        from fusedattn.warmup import GROUPS, warmup
        record = None
        if "--record" in rest:
            at = rest.index("--record")
            if at + 1 >= len(rest):
                print("fusedattn warmup: --record needs a directory", file=sys.stderr)
                return 2
            record, rest = rest[at + 1], rest[:at] + rest[at + 2:]
        groups = rest or list(GROUPS)
        unknown = [g for g in groups if g not in GROUPS]
        if unknown:
            print(f"fusedattn warmup: unknown group(s) {unknown}; expected some of {list(GROUPS)}", file=sys.stderr)
            return 2
        done = warmup(groups, verbose=True, record=record)
        print(f"fusedattn warmup: {done['configs']} configs, {done['kernels']} kernel compiles, "
              f"{done['seconds']:.1f} s" + ("" if done["configs"] else " (no CUDA device: nothing to compile)"))
        if done.get("store"):
            print(f"fusedattn warmup: store written to {done['store']}")
        return 0
    print(f"fusedattn: unknown command {command!r}; expected 'demo', 'bench' or 'warmup'\n\n{USAGE}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
